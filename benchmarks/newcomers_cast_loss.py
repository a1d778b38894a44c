"""HF decoders nobody here wrote, kept in bf16 (model.to(torch.bfloat16)), whose loss casts
their logits to float32 (transformers' ForCausalLMLoss: logits.float()): trained under
superneurons near its floor, where that copy is made per slice of rows and never whole
(capture/sliced_loss.py Rule 5): 3 AdamW steps each, compared with plain PyTorch bit for bit
(tests/matrix.py), on the CPU.

    python benchmarks/newcomers_cast_loss.py OUT_DIR

writes OUT_DIR/newcomers_cast_loss.json: per model and budget, whether the run was exact, the
loss layer's form, its planned forward and backward bytes, and the floors with the copy whole
(slice_loss=False) and made per slice.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOWARD = (0.05, 0.3)


def main():
    sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
    import torch
    import matrix
    import superneurons as sn
    from common import write
    from newcomers_decoder_blocks import CASES, _hf
    cases = {name: build for name, build in CASES.items() if "Bert" not in name}
    cases["HF MistralForCausalLM"] = _hf("MistralConfig", "MistralForCausalLM", hidden_size=48,
                                         intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128)
    made = []
    wrap = matrix.sn.wrap
    matrix.sn.wrap = lambda *a, **k: made.append(wrap(*a, **k)) or made[-1]
    rows = []
    for name, build in cases.items():
        def in_bf16(build=build):
            model, args, kwargs, loss_of = build()
            return model.to(torch.bfloat16), args, kwargs, loss_of
        in_bf16.__qualname__ = f"{build.__qualname__} in bf16"
        model, args, kwargs, _ = in_bf16()
        floors = {sliced: sn.plan(model, args, kwargs=kwargs, device_type="cpu",
                                  slice_loss=sliced).peak_bytes for sliced in (False, True)}
        liveness = sn.plan(model, args, policy="liveness", kwargs=kwargs,
                           device_type="cpu").peak_bytes
        for toward in TOWARD:
            budget = floors[True] + int(toward * (liveness - floors[True]))
            outcome = matrix.compare(in_bf16, "superneurons", steps=3, optimizer="adamw",
                                     budget=budget)
            plan, _ = made[-1].plan_for(*args, **kwargs)
            loss = next(layer for layer in plan.graph.layers if "cross_entropy" in layer.name)
            rows.append({
                "model": name, "toward": toward, "budget_bytes": budget,
                "status": outcome.status,
                "loss_layer": getattr(loss.node.target, "__name__", str(loss.node.target)),
                "loss_forward_bytes": plan.costs.forward[loss.index],
                "loss_backward_bytes": plan.costs.backward[loss.index],
                "floor_bytes_copy_whole": floors[False], "floor_bytes": floors[True],
                "replayed_layers": outcome.stats["recomputed_layers"],
                "offloaded_bytes": outcome.stats["offloaded_bytes"]})
            print(rows[-1], flush=True)
    write(os.path.join(sys.argv[1], "newcomers_cast_loss.json"),
          {"batch": "4 x 96 tokens, one row padded", "rows": rows})


if __name__ == "__main__":
    main()
