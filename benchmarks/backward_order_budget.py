"""Budgets held where autograd runs a branch's backward before the route's order has it: models
whose backward reaches a step with less room after a step that prefetched for more (pool Rule
2), each trained 3 AdamW steps on the CPU at a budget the runtime must act in, the pool-accounted
peak of every step against the budget.

- HF Gemma2 (eager attention, soft-capping; its MLP's gate and up branches), superneurons at
  its own floor;
- HF Mistral (sliding window, left padding) with its state on the host, superneurons halfway
  between its floor and the liveness plan's peak;
- timm nfnet_l0 at 64 px (a downsampling shortcut beside the main branch), superneurons at its
  own floor.

    python benchmarks/backward_order_budget.py OUT_DIR
        (CPU; writes OUT_DIR/backward_order_budget.json)
"""

import os
import sys

import torch
import torch.nn.functional as F

import superneurons as sn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def gemma2():
    import transformers
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
        sliding_window=8, max_position_embeddings=64, use_cache=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(config).train()
    return model, (), _padded_batch(), lambda out: out.loss, "device", "floor"


def mistral():
    import transformers
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        max_position_embeddings=64, attention_dropout=0.1, use_cache=False)
    model = transformers.MistralForCausalLM(config).train()
    return model, (), _padded_batch(), lambda out: out.loss, "host", "halfway"


def nfnet():
    import timm
    model = timm.create_model("nfnet_l0", pretrained=False, num_classes=10).train()
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    return model, (x,), {}, lambda out: F.cross_entropy(out, y), "device", "floor"


def _padded_batch() -> dict:
    ids = torch.randint(3, 128, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                use_cache=False)


def measure(name, build) -> dict:
    torch.manual_seed(0)
    model, args, kwargs, loss_of, state, within = build()
    floor = sn.plan(model, args, policy="superneurons", kwargs=kwargs, state=state).peak_bytes
    budget = floor
    if within == "halfway":
        liveness = sn.plan(model, args, policy="liveness", kwargs=kwargs, state=state)
        budget = (floor + liveness.peak_bytes) // 2
    where = {"state": state, "device": "cpu"} if state == "host" else {}
    wrapped = sn.wrap(model, policy="superneurons", budget=budget, **where)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = []
    for step in range(STEPS):
        torch.manual_seed(1 + step)
        optimizer.zero_grad()
        loss_of(wrapped(*args, **kwargs)).backward()
        optimizer.step()
        peaks.append(wrapped.stats.peak_bytes)
    row = {"model": name, "state": state, "budget_bytes": budget, "peak_bytes": peaks,
           "predicted_peak_bytes": wrapped.stats.predicted_peak_bytes,
           "held": all(peak <= budget for peak in peaks)}
    print(row, flush=True)
    return row


def main():
    from common import write
    torch.set_num_threads(2)
    rows = [measure(name, build) for name, build in
            (("HF Gemma2", gemma2), ("HF Mistral, state on the host", mistral),
             ("timm nfnet_l0", nfnet))]
    write(os.path.join(sys.argv[1], "backward_order_budget.json"), {"steps": STEPS, "rows": rows})


if __name__ == "__main__":
    main()
