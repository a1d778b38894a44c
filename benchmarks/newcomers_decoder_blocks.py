"""HF decoders and an encoder nobody here wrote, trained under superneurons near its floor, where
their blocks are now cut beside the attention mask, rotary tables and labels every block or the
loss reads (policy Rule 8) and may be replayed whole, merged or cut (planner/trim.py): 3 AdamW
steps each, compared with plain PyTorch bit for bit (tests/matrix.py), on the CPU.

    python benchmarks/newcomers_decoder_blocks.py OUT_DIR

writes OUT_DIR/newcomers_decoder_blocks.json.

The budget is TOWARD of the way from the policy's floor to the liveness plan's peak. Batch 4 of
96 tokens, the second row padded: activations outweigh the small models' weights.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOWARD = (0.0, 0.05, 0.2, 0.4)


def _text(vocab: int):
    import torch
    ids = torch.randint(0, vocab, (4, 96), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def _hf(config_of, model_of, **extra):
    def build():
        import torch
        import transformers
        torch.manual_seed(0)
        config = getattr(transformers, config_of)(vocab_size=128, **extra)
        model = getattr(transformers, model_of)(config).train()
        return model, (), {**_text(128), **({"use_cache": False} if "Causal" in model_of
                                           or "LMHead" in model_of else {})}, \
            lambda out: out.loss
    build.__qualname__ = model_of
    return build


CASES = {
    "HF GPT2LMHeadModel": _hf("GPT2Config", "GPT2LMHeadModel", n_positions=128, n_embd=48,
                              n_layer=4, n_head=4, resid_pdrop=0.1, embd_pdrop=0.1,
                              attn_pdrop=0.1),
    "HF LlamaForCausalLM": _hf("LlamaConfig", "LlamaForCausalLM", hidden_size=48,
                               intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, attention_dropout=0.1),
    "HF Qwen2ForCausalLM": _hf("Qwen2Config", "Qwen2ForCausalLM", hidden_size=48,
                               intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128),
    "HF BertForMaskedLM": _hf("BertConfig", "BertForMaskedLM", hidden_size=48,
                              num_hidden_layers=4, num_attention_heads=4,
                              intermediate_size=128, max_position_embeddings=128,
                              hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
}


def main():
    sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
    import superneurons as sn
    import matrix
    from common import write
    from superneurons.planner.policy import CHECKPOINT_KINDS, route_cuts
    made = []
    wrap = matrix.sn.wrap
    matrix.sn.wrap = lambda *a, **k: made.append(wrap(*a, **k)) or made[-1]
    rows = []
    for name, build in CASES.items():
        model, args, kwargs, _ = build()
        floor = sn.plan(model, args, kwargs=kwargs, device_type="cpu").peak_bytes
        liveness = sn.plan(model, args, policy="liveness", kwargs=kwargs,
                           device_type="cpu").peak_bytes
        for toward in TOWARD:
            budget = floor + int(toward * (liveness - floor))
            outcome = matrix.compare(build, "superneurons", steps=3, optimizer="adamw",
                                     budget=budget)
            plan, _ = made[-1].plan_for(*args, **kwargs)
            rows.append({
                "model": name, "toward": toward, "budget_bytes": budget,
                "status": outcome.status, "cuts": len(route_cuts(plan.graph, list(plan.order))),
                "segments": len(plan.segments),
                "replayed_layers": outcome.stats["recomputed_layers"],
                "offloaded_bytes": outcome.stats["offloaded_bytes"],
                "replayed_checkpoint_kinds": sum(plan.graph.layers[l].kind in CHECKPOINT_KINDS
                                                 for l in plan.segment_of())})
            print(rows[-1], flush=True)
    write(os.path.join(sys.argv[1], "newcomers_decoder_blocks.json"), {"rows": rows})


if __name__ == "__main__":
    main()
