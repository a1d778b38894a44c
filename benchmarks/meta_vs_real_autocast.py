"""Predictions before running, under bf16 autocast: the plans sn.plan makes on the meta device
(traced without autocast, its casts kept: capture/kept_casts.py) against the plans of the graph
traced from the model's real call under the CPU's autocast, as sn.wrap traces it, for HF
models nobody here wrote. Per model and policy: the two peaks, and whether every step's live
bytes agree.

    python benchmarks/meta_vs_real_autocast.py OUT_DIR      (CPU: OUT_DIR/meta_vs_real_autocast.json)

The models of newcomers_decoder_blocks.py (4 layers of width 48, batch 4 of 96 tokens with one
row padded) and HF OPT and Mistral alike.
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = ("liveness", "recompute", "superneurons")


def main():
    sys.path[:0] = [HERE]
    import superneurons as sn
    from common import write
    from newcomers_decoder_blocks import CASES, _hf
    from superneurons.capture import capture
    cases = dict(CASES)
    cases["HF OPTForCausalLM"] = _hf("OPTConfig", "OPTForCausalLM", hidden_size=48,
                                     ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
                                     word_embed_proj_dim=48, max_position_embeddings=128)
    cases["HF MistralForCausalLM"] = _hf("MistralConfig", "MistralForCausalLM", hidden_size=48,
                                         intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128)
    state = ("cpu", torch.bfloat16)
    rows = []
    for name, build in cases.items():
        model, args, kwargs, _ = build()
        on_meta = {}              # labels that are input_ids stay one tensor, as in the call
        meta_kwargs = {k: on_meta.setdefault(id(v), v.to("meta")) if torch.is_tensor(v) else v
                       for k, v in kwargs.items()}
        meta = capture(model, (), state, meta_kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            real = capture(model, (), state, dict(kwargs))
        for policy in POLICIES:
            planned, ran = (sn.planner.plan_graph(graph, policy) for graph in (meta, real))
            rows.append({"model": name, "policy": policy, "meta_peak_bytes": planned.peak_bytes,
                         "real_peak_bytes": ran.peak_bytes,
                         "every_step_alike": [s.live_bytes for s in planned.steps]
                         == [s.live_bytes for s in ran.steps],
                         "layers": [len(meta.layers), len(real.layers)],
                         "rule7_casts": len(meta.cast_from)})
            print(rows[-1], flush=True)
    write(os.path.join(sys.argv[1], "meta_vs_real_autocast.json"), {"rows": rows})


if __name__ == "__main__":
    main()
