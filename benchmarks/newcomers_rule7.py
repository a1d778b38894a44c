"""Capture Rule 7 on HF causal LMs the project had not run (XGLM, BioGpt, Helium, Arcee), under
CPU bf16 autocast: the meta plan (sn.plan) against the plan of the graph captured from the real
call under autocast, step by step; then 3 AdamW steps under sn.wrap (superneurons at 0.8 of the
liveness peak with the state on the device, and with the state on the host) against plain
PyTorch, bit for bit: losses, logits (and their dtype), and the state after the steps.

    python benchmarks/newcomers_rule7.py OUT.json
"""

import copy
import json
import sys

import torch
import transformers as tf

import superneurons as sn
from superneurons.capture import capture
from superneurons.planner import H200, Policy, Strategy, plan_graph

VOCAB, STEPS = 512, 3
SMALL = dict(vocab_size=VOCAB, max_position_embeddings=64)
LLAMA_LIKE = dict(SMALL, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128)
MODELS = {
    "XGLM": (tf.XGLMForCausalLM, tf.XGLMConfig(**SMALL, d_model=64, num_layers=2,
                                               attention_heads=4, ffn_dim=128)),
    "BioGpt": (tf.BioGptForCausalLM, tf.BioGptConfig(**SMALL, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4,
                                                     intermediate_size=128)),
    "Helium": (tf.HeliumForCausalLM, tf.HeliumConfig(**LLAMA_LIKE, head_dim=16)),
    "Arcee": (tf.ArceeForCausalLM, tf.ArceeConfig(**LLAMA_LIKE)),
}


def plans(model, call: dict) -> tuple:
    """(sn.plan's liveness plan on the meta device, the plan of the real call's graph)."""
    meta_call = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in call.items()}
    meta = sn.plan(model, (), "liveness", autocast=torch.bfloat16, device_type="cpu",
                   kwargs=meta_call)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = capture(model, (), ("cpu", torch.bfloat16), dict(call))
    return meta, plan_graph(graph, Policy.LIVENESS, None, Strategy.COST_AWARE, "device", H200)


def trains_alike(model, call: dict, **wrap) -> dict:
    """3 AdamW steps of plain PyTorch and of sn.wrap(**wrap), each seeded alike."""
    plain, mine = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = sn.wrap(mine, policy="superneurons", **wrap)
    pairs = [(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3)),
             (wrapped, torch.optim.AdamW(mine.parameters(), lr=1e-3))]
    same = True
    for step in range(STEPS):
        outs = []
        for module, optimizer in pairs:
            torch.manual_seed(100 + step)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(module(**call))
            outs[-1].loss.backward()
            optimizer.step()
        same &= torch.equal(outs[0].loss, outs[1].loss) and \
            outs[0].logits.dtype == outs[1].logits.dtype and \
            torch.equal(outs[0].logits, outs[1].logits)
    same &= all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                  mine.state_dict().values()))
    stats = wrapped.stats
    return {"same": same, "recomputed_layers": stats.recomputed_layers,
            "offloaded_bytes": stats.offloaded_bytes}


def main():
    rows = []
    for name, (cls, config) in MODELS.items():
        torch.manual_seed(0)
        model = cls(config)
        ids = torch.randint(0, VOCAB, (2, 32))
        call = {"input_ids": ids, "labels": ids, "use_cache": False}
        try:
            meta, real = plans(model, call)
        except ValueError as error:                 # refused before the first step
            rows.append({"model": name, "refused": str(error)[:300]})
            print(rows[-1], flush=True)
            continue
        differences = [m.live_bytes - r.live_bytes for m, r in zip(meta.steps, real.steps)]
        rows.append({"model": name, "meta_peak_bytes": meta.peak_bytes,
                     "real_peak_bytes": real.peak_bytes,
                     "steps": [len(meta.steps), len(real.steps)],
                     "step_differences": [min(differences), max(differences)],
                     "rule7_pairs": len(meta.graph.cast_from),
                     "state_device": trains_alike(model, call,
                                                  budget=int(0.8 * real.peak_bytes)),
                     "state_host": trains_alike(model, call, state="host")})
        print(rows[-1], flush=True)
    with open(sys.argv[1], "w") as out:
        json.dump({"command": "python benchmarks/newcomers_rule7.py OUT.json",
                   "torch": torch.__version__, "transformers": tf.__version__,
                   "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
