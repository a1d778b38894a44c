"""GPT-2 small in bf16 planned on the CPU as the wrapped CUDA step plans it, in the rooms a ratio
record's superneurons row had: its first step's budget, and its last step's (the budget less the
memory the model did not own and the calibrated excess). No GPU needed.

    python benchmarks/gpt2_bf16_plans.py OUT_DIR RECORD.json [--ratio 0.5]

The wrapper captures the model from the real call under CUDA's autocast, so the graph's logits
are bf16 and the loss's float32 copy of them is sliced (capture/sliced_loss.py Rule 5). Here the
model is exported from CPU tensors under the CPU's bf16 autocast, which gives the graph the
dtypes of the step's, and analyzed under CUDA's autocast as the wrapper analyzes it. Beside it,
sn.plan's capture of the model on the meta device (traced without autocast before 5ac2ce9, where
that copy could not be told from the logits the model returns, trace.py Rule 7, and was planned
whole). For each room: the chosen plan and its alternatives,
each with its peak with every checkpoint kept on the device (what "moves nothing" is held to),
its replays' seconds at the H200's rates and the layers it replays; the meta capture's chosen
plan beside them; and the policy's own plan (every cheap layer replayed). Also one block's
layers as the step's graph has them: kind, dtype and bytes made, and a replay's seconds.
Writes OUT_DIR/gpt2_bf16_plans.json.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def described(plan) -> dict:
    from superneurons.planner.trim import replay_work
    return {"kept_peak_bytes": max(plan._kept_live, default=0),
            "replay_seconds": replay_work(plan), "replayed_layers": plan.num_extra_computations,
            "segments": len(plan.segments)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("record")
    parser.add_argument("--ratio", type=float, default=0.5)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    import torch
    from common import write
    from common import gpt2
    from ratio import SEQUENCE, VOCAB, build
    from superneurons.capture import capture
    from superneurons.capture.hf import without_full_mask
    from superneurons.planner import H200, plan_graph
    from superneurons.planner.plan import captured_step
    with open(args.record) as f:
        record = json.load(f)
    row = next(r for r in record["rows"] if r["system"] == "superneurons"
               and r["ratio"] == args.ratio)
    last = row["steps"][-1]
    budget = row["first_step"]["budget_bytes"]
    rooms = {"first_step": budget,
             "last_step": budget - last["foreign_bytes"] - (last["excess_bytes"] or 0)}
    model, _, kwargs, _ = build("gpt2", "superneurons", torch.device("cpu"))
    kwargs = without_full_mask(model, dict(kwargs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stepped = capture(model, (), ("cuda", torch.bfloat16), kwargs)
    with torch.device("meta"):              # built there, its LM head stays tied to wte
        meta_model = gpt2(positions=SEQUENCE, vocab=VOCAB).train()
    meta_kwargs = dict(kwargs, input_ids=kwargs["input_ids"].to("meta"))
    meta_kwargs["labels"] = meta_kwargs["input_ids"]          # one tensor, as the call's
    traced = captured_step(meta_model, (), autocast=torch.bfloat16, kwargs=meta_kwargs)
    plans = {}
    for name, room in rooms.items():
        chosen = plan_graph(stepped, "superneurons", room, machine=H200)
        plans[name] = {"room_bytes": room, "chosen": described(chosen),
                       "alternatives": [described(p) for p in chosen.alternatives],
                       "meta_capture_chosen": described(
                           plan_graph(traced, "superneurons", room, machine=H200))}
        print(name, json.dumps(plans[name]), flush=True)
    own = plan_graph(stepped, "superneurons", machine=H200)
    write(os.path.join(args.out, "gpt2_bf16_plans.json"),
          {"record": os.path.basename(args.record), "ratio": args.ratio, "plans": plans,
           "own_plan": described(own), "block_5": block_layers(own, "transformer.h.5."),
           "floor_bytes": own.peak_bytes,
           "meta_capture_floor_bytes": plan_graph(traced, "superneurons", machine=H200).peak_bytes,
           "liveness_peak_bytes": plan_graph(stepped, "liveness", machine=H200).peak_bytes})


def block_layers(plan, prefix: str) -> list:
    """The layers named under ``prefix``, in the route's order: kind, the dtype and bytes of
    the storages each makes, and its replay's seconds (costs.work)."""
    graph, rows = plan.graph, []
    for index in plan.order:
        layer = graph.layers[index]
        if not layer.name.startswith(prefix):
            continue
        made = [graph.values[v] for v in layer.outputs
                if graph.storages[graph.values[v].storage].creator == index]
        rows.append({"layer": layer.name, "kind": layer.kind.value,
                     "dtypes": sorted({str(v.dtype) for v in made}),
                     "made_bytes": sum(graph.storages[v.storage].nbytes for v in made),
                     "replay_seconds": plan.costs.work[index]})
    return rows


if __name__ == "__main__":
    main()
