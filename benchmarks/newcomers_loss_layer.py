"""The sliced loss layer (capture/sliced_loss.py: its forward over slices of rows, and Rule 5's
float32 copy made per slice) on HF decoders no test trains, under every policy: plain PyTorch
against the wrapped model, 3 AdamW steps, losses, parameters and gradients compared bit for
bit, on the CPU. Each model runs with bf16 weights and in float32 under the CPU's bf16 autocast,
at a budget halfway between the policy's floor and the liveness plan's peak, both planned as the
wrapper plans the call (under its autocast).

    python benchmarks/newcomers_loss_layer.py OUT_DIR     (OUT_DIR/newcomers_loss_layer.json)
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = ("superneurons", "recompute", "offload")
MODES = ("bf16 weights", "bf16 autocast")


def main():
    sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
    import superneurons as sn
    from common import write
    from newcomers_decoder_blocks import _hf, _text
    from superneurons.capture import sliced_loss
    from test_sliced_loss import _train          # 3 AdamW steps: losses, state, gradients
    models = {
        "HF GraniteForCausalLM": _hf("GraniteConfig", "GraniteForCausalLM", hidden_size=48,
                                     intermediate_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=128, logits_scaling=2.0,
                                     attention_dropout=0.1),
        "HF HeliumForCausalLM": _hf("HeliumConfig", "HeliumForCausalLM", hidden_size=48,
                                    intermediate_size=128, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=12, max_position_embeddings=128)}
    call = {**_text(128), "use_cache": False}
    rows = []
    for name, hf in models.items():
        for mode in MODES:
            autocast = mode == "bf16 autocast"
            def build(hf=hf, autocast=autocast):
                model = hf()[0]
                return model if autocast else model.to(torch.bfloat16)
            plain = _train(build, call, lambda m: m, "cpu", autocast)
            for policy in POLICIES:
                def peak(planned, policy=policy, build=build, autocast=autocast):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        wrapped = sn.wrap(build(), policy=planned)
                        return wrapped.plan_for(**call)[0].peak_bytes
                budget = (peak(policy) + peak("liveness")) // 2
                made = {}

                def wrap(model, policy=policy, budget=budget):
                    made["wrapped"] = sn.wrap(model, policy=policy, budget=budget)
                    return made["wrapped"]
                ours = _train(build, call, wrap, "cpu", autocast)
                plan = made["wrapped"]._last[0]
                loss = next(layer.node.target for layer in plan.graph.layers
                            if layer.node.target in sliced_loss.SLICED_LOSSES)
                stats = made["wrapped"].stats
                rows.append({"model": name, "mode": mode, "policy": policy, "budget_bytes": budget,
                             "exact": all(torch.equal(a, b) for a, b in zip(plain, ours)),
                             "loss_layer": loss.__name__,
                             "replayed_layers": stats.recomputed_layers if stats else 0,
                             "offloaded_bytes": stats.offloaded_bytes if stats else 0})
                print(rows[-1], flush=True)
    write(os.path.join(sys.argv[1], "newcomers_loss_layer.json"),
          {"batch": "4 x 96 tokens, one row padded", "rows": rows})


if __name__ == "__main__":
    main()
