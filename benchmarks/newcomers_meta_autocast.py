"""Decoders nobody here wrote, planned by sn.plan on the meta device for a bf16 autocast step
(capture/entry.py traces them again under the CPU's autocast where a cast the loss reads cannot
be told from the logits), against the graph captured from real tensors under the CPU's autocast,
as the wrapper captures its step: floors under "superneurons" and the liveness peak, and whether
the loss's float32 copy is sliced in each (sliced_loss.py Rule 5). Then the real model is wrapped
at the meta plan's floor, under the CPU's bf16 autocast, and trained 3 AdamW steps beside plain
PyTorch: the budget sn.plan said fits is the wrapper's too, and the losses are plain's.

    python benchmarks/newcomers_meta_autocast.py OUT_DIR  (writes newcomers_meta_autocast.json)
"""

import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH, SEQ, VOCAB = 2, 48, 256          # 94 rows for the loss: more than a slice's alignment
CASES = {
    "HF Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM",
                            dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "HF Olmo2ForCausalLM": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2)),
    "HF GemmaForCausalLM": ("GemmaConfig", "GemmaForCausalLM",
                            dict(num_key_value_heads=2, head_dim=12)),
}


def _model(config_of: str, model_of: str, extra: dict, device: str):
    import torch
    import transformers
    config = getattr(transformers, config_of)(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    with torch.device(device):           # built there, tied weights stay tied
        return getattr(transformers, model_of)(config).train()


def row(config_of: str, model_of: str, extra: dict) -> dict:
    import torch
    import superneurons as sn
    from common import cpu_bf16_steps
    from superneurons.capture import capture
    from superneurons.capture.sliced_loss import sliced_cast_cross_entropy_loss
    from superneurons.planner import plan_graph
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    call = dict(input_ids=ids, labels=ids, use_cache=False)
    meta_ids = ids.to("meta")
    meta_call = dict(input_ids=meta_ids, labels=meta_ids, use_cache=False)
    meta_model = _model(config_of, model_of, extra, "meta")
    model = _model(config_of, model_of, extra, "cpu")
    state = ("cpu", torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stepped = capture(model, (), state, dict(call))

    def sliced(graph) -> bool:
        return any(layer.node.target is sliced_cast_cross_entropy_loss for layer in graph.layers)
    out = {}
    for policy in ("superneurons", "liveness"):
        planned = sn.plan(meta_model, (), policy, kwargs=meta_call, autocast=torch.bfloat16,
                          device_type="cpu")
        out[policy] = {"meta_bytes": planned.peak_bytes,
                       "stepped_bytes": plan_graph(stepped, policy).peak_bytes,
                       "meta_sliced": sliced(planned.graph), "stepped_sliced": sliced(stepped)}
    reference = copy.deepcopy(model)
    plain = cpu_bf16_steps(reference, lambda: reference(**call).loss)
    budget = out["superneurons"]["meta_bytes"]
    wrapped = sn.wrap(model, policy="superneurons", budget=budget)
    try:
        losses = cpu_bf16_steps(model, lambda: wrapped(**call).loss)
        out["wrapped_at_meta_floor"] = {
            "budget_bytes": budget, "losses_equal": losses == plain,
            "max_state_difference": max((a.double() - b.double()).abs().max().item()
                                        for a, b in zip(model.state_dict().values(),
                                                        reference.state_dict().values())
                                        if a.is_floating_point()),
            "recomputed_layers": wrapped.stats.recomputed_layers,
            "offloaded_bytes": wrapped.stats.offloaded_bytes}
    except ValueError as error:                  # refused: the meta floor was below the step's
        out["wrapped_at_meta_floor"] = {"budget_bytes": budget, "refused": str(error)[:300]}
    return out


def main():
    sys.path.insert(0, HERE)
    from common import write
    rows = {}
    for name, (config_of, model_of, extra) in CASES.items():
        rows[name] = row(config_of, model_of, extra)
        print(name, rows[name], flush=True)
    write(os.path.join(sys.argv[1], "newcomers_meta_autocast.json"), {"rows": rows})


if __name__ == "__main__":
    main()
