"""Planner-side figures quoted in DESIGN.md and BENCHMARKS.md (no GPU needed):

- capture time of a deep ResNet with and without the capture memo (trace.py Rule 4);
- within an 11.5 GiB budget, the plan each batch gets: its replays, whole blocks, and the bytes
  the Tensor Cache would move a step, beside the policy's floor's (trim.py);
- the bytes a plan holds that the pool cannot move (what Inception-v4's largest batch hits);
- with --densenet alone: the time to capture and plan deep DenseNet-BCs, whose layers all differ
  so that capture's memo never hits (planner_costs_densenet.json);
- with --densenet-host alone: what the superneurons floor of DenseNet-BC sends to the host per
  step, by the kind of layer that made it (planner_costs_densenet_host.json);
- with --autocast alone: the liveness peak in fp32 and under bf16 autocast for the bf16 rows of
  the speed part, against the budget: where it fits, the wrapped model runs untouched
  (planner_costs_autocast.json);
- with --lrn alone: AlexNet's LRN1 (l_f, l_b, scratch) and the superneurons floor with PyTorch's
  LRN, the one-step LRN over the whole batch and the sliced one (planner_costs_lrn.json);
- with --alexnet-anchor alone: the liveness peak of the zoo's AlexNet (the paper's) and of
  torchvision's layout at the batches of DESIGN.md's anchors (planner_costs_alexnet_anchor.json).

    python benchmarks/planner_costs.py [--densenet | --densenet-host | --autocast | --lrn |
                                        --alexnet-anchor] [OUT]
"""

import importlib
import os
import sys
import time

import torch

import superneurons as sn
from superneurons import models
from superneurons.capture import capture
from superneurons.planner import Policy
from common import write

trace = importlib.import_module("superneurons.capture.trace")
BUDGET = int(11.5 * 2**30)


def capture_seconds() -> dict:
    with torch.device("meta"):
        capture(models.resnet(blocks=(3, 4, 6, 3)), (16, 3, 224, 224))   # warm PyTorch up
        model = models.resnet(blocks=(3, 4, 300, 3))
    began = time.perf_counter()
    graph = capture(model, (16, 3, 224, 224))
    memoized = time.perf_counter() - began
    real_key = trace.memo_key
    trace.memo_key = lambda *args: None
    try:
        began = time.perf_counter()
        capture(model, (16, 3, 224, 224))
        full = time.perf_counter() - began
    finally:
        trace.memo_key = real_key
    return {"layers": len(graph.layers), "seconds_with_memo": memoized,
            "seconds_without_memo": full}


def plans_within_budget(name: str, batches: list) -> list:
    rows = []
    for batch in batches:
        with torch.device("meta"):
            model = models.build(name)
        shape = models.input_shape(name, batch)
        graph = capture(model, shape)
        chosen = sn.planner.plan_graph(graph, Policy.SUPERNEURONS, BUDGET)
        floor = sn.planner.plan_graph(graph, Policy.SUPERNEURONS)
        whole = sum(1 for s in chosen.segments if any(
            graph.layers[l].kind.value in ("CONV", "FC") for l in s.layers))
        rows.append({"batch": batch, "layers_replayed": chosen.num_extra_computations,
                     "whole_blocks": whole, "bytes_to_move": chosen.bytes_to_move(),
                     "floor_bytes_to_move": floor.bytes_to_move(BUDGET),
                     "unmovable_peak_bytes": max(chosen.unmanaged_per_step()),
                     "predicted_floor_peak_bytes": chosen.peak_bytes})
        print(name, rows[-1], flush=True)
    return rows


def densenet_seconds(depths=(1000, 1372, 2002)) -> list:
    """Capture and plan (superneurons within the budget) of DenseNet-BC, k=12, 32 px, batch 64."""
    rows = []
    for depth in depths:
        with torch.device("meta"):
            model = models.densenet(depth, 12, cifar=True)
        began = time.perf_counter()
        graph = capture(model, (64, 3, 32, 32))
        captured = time.perf_counter()
        sn.planner.plan_graph(graph, Policy.SUPERNEURONS, BUDGET)
        rows.append({"depth": depth, "layers": len(graph.layers),
                     "capture_seconds": captured - began,
                     "plan_seconds": time.perf_counter() - captured})
        print(rows[-1], flush=True)
    return rows


def densenet_host_bytes(depths=(100, 250, 400, 1000, 2200, 2902)) -> list:
    """The superneurons floor of DenseNet-BC (k=12, 32 px, batch 64): its device peak and the
    bytes it offloads, by the kind of the layer that made them."""
    rows = []
    for depth in depths:
        with torch.device("meta"):
            model = models.densenet(depth, 12, cifar=True)
        floor = sn.plan(model, (64, 3, 32, 32), policy="superneurons")
        graph, by_kind = floor.graph, {}
        for buffer in floor.buffers:
            if buffer.managed:
                kind = str(graph.layers[graph.storages[buffer.storage].creator].kind)
                by_kind[kind] = by_kind.get(kind, 0) + buffer.nbytes
        rows.append({"depth": depth, "floor_peak_bytes": floor.peak_bytes,
                     "offloaded_bytes": floor.offloaded_bytes,
                     "offloaded_bytes_by_producer_kind": by_kind})
        print(rows[-1], flush=True)
    return rows


def densenet_budget_host_bytes(depth=1204, budgets_gib=(11.5, 5.0)) -> list:
    """What DenseNet-BC's plans within a budget may offload, all of it: the host slab the runtime
    pinned at the first offload before host.py Rule 1 (profile_first_step.py's configurations;
    before the first step the device holds no optimizer state, so the plan gets the budget)."""
    with torch.device("meta"):
        graph = capture(models.densenet(depth, 12, cifar=True), (64, 3, 32, 32))
    rows = []
    for budget in budgets_gib:
        planned = sn.planner.plan_graph(graph, Policy.SUPERNEURONS, int(budget * 2**30))
        rows.append({"depth": depth, "budget_gib": budget,
                     "offloaded_bytes": planned.offloaded_bytes})
        print(rows[-1], flush=True)
    return rows


def autocast_peaks(cases=(("resnet50", 140), ("resnet101", 96), ("resnet152", 128),
                           ("inception_v4", 128), ("densenet201", 56))) -> list:
    rows = []
    for name, batch in cases:
        with torch.device("meta"):
            model = models.build(name)
        shape = models.input_shape(name, batch)
        peaks = {str(dtype): sn.plan(model, shape, policy="liveness", autocast=dtype).peak_bytes
                 for dtype in (None, torch.bfloat16)}
        rows.append({"network": name, "batch": batch, "liveness_peak_bytes": peaks,
                     "bf16_fits_budget": peaks[str(torch.bfloat16)] <= BUDGET})
        print(rows[-1], flush=True)
    return rows


def lrn_costs(batches=(1080, 1100, 1575, 2205, 2280)) -> list:
    from torch import nn
    from superneurons.models import layers
    sliced = layers.CHUNK_BYTES
    variants = {"pytorch": (nn.LocalResponseNorm, sliced),          # (class, slice bytes)
                "one_step_whole_batch": (layers.LocalResponseNorm, 2**62),
                "one_step_sliced": (layers.LocalResponseNorm, sliced)}
    rows = []
    for batch in batches:
        for variant, (lrn, slice_bytes) in variants.items():
            with torch.device("meta"):
                model = models.build("alexnet")
            for index, module in enumerate(model):
                if isinstance(module, nn.LocalResponseNorm):
                    model[index] = lrn(5)
            layers.CHUNK_BYTES = slice_bytes
            try:
                plan = sn.plan(model, models.input_shape("alexnet", batch), "superneurons")
            finally:
                layers.CHUNK_BYTES = sliced
            lrn1 = plan.graph.layers[2]
            rows.append({"batch": batch, "lrn": variant, "lrn1_l_f": plan.costs.forward[2],
                         "lrn1_l_b": plan.costs.backward[2],
                         "lrn1_scratch": [lrn1.forward_scratch, lrn1.backward_scratch],
                         "l_peak_bytes": plan.max_layer_bytes,
                         "superneurons_floor_bytes": plan.peak_bytes})
            print(rows[-1], flush=True)
    return rows


def torchvision_alexnet():
    """torchvision's AlexNet layout (64 filters in conv1, no LRN), written out here so that no
    torchvision is needed."""
    from torch import nn
    return nn.Sequential(
        nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.AdaptiveAvgPool2d((6, 6)), nn.Flatten(), nn.Dropout(),
        nn.Linear(9216, 4096), nn.ReLU(inplace=True), nn.Dropout(),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Linear(4096, 1000), nn.LogSoftmax(1))


def alexnet_anchor_peaks(batches=(1400, 2205, 2560, 2880)) -> list:
    """Liveness peak (what plain PyTorch holds) and superneurons floor of both AlexNets at 224 px,
    bytes."""
    variants = {"zoo (the paper's: 96 filters in conv1, LRN)": models.build("alexnet"),
                "torchvision layout (64 filters in conv1, no LRN)": torchvision_alexnet()}
    rows = []
    for name, model in variants.items():
        for batch in batches:
            shape = (batch, 3, 224, 224)           # as every benchmark runs both
            rows.append({"model": name, "batch": batch,
                         "liveness_peak_bytes": sn.plan(model, shape, "liveness").peak_bytes,
                         "superneurons_floor_bytes": sn.plan(model, shape).peak_bytes})
    return rows


def main():
    arguments = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = arguments[0] if arguments else os.path.join(os.path.dirname(__file__), "results")
    if "--densenet" in sys.argv:
        write(os.path.join(out, "planner_costs_densenet.json"),
              {"budget_bytes": BUDGET, "host_cores": os.cpu_count(),
               "densenet": densenet_seconds()})
        return
    if "--densenet-host" in sys.argv:
        write(os.path.join(out, "planner_costs_densenet_host.json"),
              {"densenet": densenet_host_bytes(), "within_budgets": densenet_budget_host_bytes()})
        return
    if "--autocast" in sys.argv:
        write(os.path.join(out, "planner_costs_autocast.json"),
              {"budget_bytes": BUDGET, "autocast": autocast_peaks()})
        return
    if "--alexnet-anchor" in sys.argv:
        write(os.path.join(out, "planner_costs_alexnet_anchor.json"),
              {"alexnet": alexnet_anchor_peaks()})
        return
    if "--lrn" in sys.argv:
        write(os.path.join(out, "planner_costs_lrn.json"), {"alexnet": lrn_costs()})
        return
    record = {"budget_bytes": BUDGET, "capture": capture_seconds()}
    print(record["capture"], flush=True)
    record["resnet50"] = plans_within_budget("resnet50", [140, 280, 450, 500, 600])
    record["inception_v4"] = plans_within_budget("inception_v4", [293, 320])
    write(os.path.join(out, "planner_costs.json"), record)


if __name__ == "__main__":
    main()
