"""GPT-2 small's floor as planned: the smallest budget superneurons plans ratio.py's GPT-2 step
in (batch 16 of 1,024 tokens, labels given, its loss sliced), in fp32 and under bf16 autocast,
counting the backward of the model's loss alone (planner/gradients.py Rule 5) and with a gradient
from outside into every output as well (outside_gradients=True, as every plan counted it before
Rule 5).

    python benchmarks/gpt2_floor.py OUT_DIR                (CPU: OUT_DIR/gpt2_floor.json)
    python benchmarks/gpt2_floor.py OUT_DIR --device cuda  (OUT_DIR/gpt2_floor_cuda.json)

On the CPU the model and its batch are on the meta device (sn.plan). With --device cuda they are
on the GPU and captured as sn.wrap captures them, beside the meta capture, and the layers whose
outputs, saved bytes or scratch differ between the two are listed: the CUDA runs planned bf16's
floor 1.15 GiB above the CPU's, and fp32's to the byte.
"""

import argparse
import os
import sys

import torch

import superneurons as sn
from common import gpt2, token_batch, write
from ratio import BATCH, SEQUENCE, VOCAB
from superneurons.capture import capture
from superneurons.planner import H200, Policy, Strategy, plan_graph
from superneurons.planner.plan import BudgetError

DTYPES = (("fp32", None), ("bf16", torch.bfloat16))


def model_and_call(device: str):
    with torch.device("meta" if device == "cpu" else device):
        model = gpt2(positions=SEQUENCE, vocab=VOCAB)
    call = token_batch(device, BATCH["gpt2"], SEQUENCE, VOCAB)
    if device == "cpu":
        on_meta = {}     # labels=input_ids stays one tensor, as the real call passes it
        call = {k: on_meta.setdefault(id(v), v.to("meta")) if torch.is_tensor(v) else v
                for k, v in call.items()}
    return model, call


def floor(model, call, autocast, outside: bool) -> int:
    try:
        return sn.plan(model, (), "superneurons", budget=1, kwargs=call, autocast=autocast,
                       outside_gradients=outside).peak_bytes
    except BudgetError as error:             # its peak is the floor
        return error.peak_bytes


def layer_rows(graph) -> dict:
    return {layer.name: {"outputs": [(list(graph.values[v].shape), str(graph.values[v].dtype),
                                      graph.values[v].requires_grad,
                                      graph.storages[graph.values[v].storage].nbytes)
                                     for v in layer.outputs],
                         "kind": str(layer.kind), "target": str(layer.node.target),
                         "mutates": len(layer.mutates), "is_output": any(
                             v in graph.output_values for v in layer.outputs),
                         "saved_bytes": sum(s.nbytes if s.value is None
                                            else graph.values[s.value].nbytes
                                            for s in layer.saved),
                         "scratch": [layer.forward_scratch, layer.backward_scratch]}
            for layer in graph.layers}


def as_wrapped(model, call, autocast) -> dict:
    """The floor of the graph captured from the model's real call on its device, as sn.wrap's
    first call captures it (under the caller's autocast), and the layers that differ from the
    meta capture's."""
    state = None if autocast is None else ("cuda", autocast)
    with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
        real = capture(model, (), state, dict(call), slice_loss=True)
    meta_model, meta_call = model_and_call("cpu")
    meta = capture(meta_model, (), state, meta_call, slice_loss=True)
    real_plan, meta_plan = floor_plan(real), floor_plan(meta)
    real_rows, meta_rows = layer_rows(real), layer_rows(meta)
    differ = [{"layer": name, "real": real_rows.get(name), "meta": meta_rows.get(name)}
              for name in dict.fromkeys([*real_rows, *meta_rows])
              if real_rows.get(name) != meta_rows.get(name)]
    real_steps, meta_steps = step_bytes(real_plan), step_bytes(meta_plan)
    steps = sorted(((real_steps[k] - meta_steps.get(k, 0), k) for k in real_steps),
                   reverse=True)
    return {"real_capture_floor_bytes": real_plan.peak_bytes,
            "meta_capture_floor_bytes": meta_plan.peak_bytes, "layers": len(real.layers),
            "meta_layers": len(meta.layers), "differing_layers": differ[:60],
            "outputs": [len(real.output_values), len(meta.output_values)],
            "real_peak_steps": top_steps(real_plan), "meta_peak_steps": top_steps(meta_plan),
            "steps_most_above_meta": [(list(k), d) for d, k in steps[:20]]}


def floor_plan(graph):
    """The plan at the floor: the plan a budget of the floor's bytes gets."""
    try:
        plan_graph(graph, Policy.SUPERNEURONS, 1, Strategy.COST_AWARE, "device", H200)
    except BudgetError as error:
        return plan_graph(graph, Policy.SUPERNEURONS, error.peak_bytes, Strategy.COST_AWARE,
                          "device", H200)
    raise AssertionError("a budget of one byte fits")


def step_bytes(plan) -> dict:
    return {(step.phase, step.layer): step.live_bytes for step in plan.steps}


def top_steps(plan) -> list:
    return [(step.phase, step.layer, step.live_bytes)
            for step in sorted(plan.steps, key=lambda s: -s.live_bytes)[:8]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    model, call = model_and_call(args.device)
    rows = []
    for name, dtype in DTYPES:
        for outside in (False, True):
            rows.append({"dtype": name, "outside_gradients": outside,
                         "floor_bytes": floor(model, call, dtype, outside)})
            print(rows[-1], flush=True)
        if args.device == "cuda":
            rows.append({"dtype": name, **as_wrapped(model, call, dtype)})
            print({k: v for k, v in rows[-1].items() if k != "differing_layers"}, flush=True)
    suffix = "" if args.device == "cpu" else "_cuda"
    write(os.path.join(args.out, f"gpt2_floor{suffix}.json"), {"rows": rows})


if __name__ == "__main__":
    sys.exit(main())
