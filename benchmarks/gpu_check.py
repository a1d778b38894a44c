"""The runtime on CUDA: exact training, measured memory per step against the plan, speed.

    python benchmarks/gpu_check.py OUT_DIR [--quick | --fits-only]

Writes cuda_equality.json, memory_per_step.json (+ .png) and throughput_fits.json; with
--fits-only, throughput_fits.json alone, in more and longer rounds (7 of 24 steps).
"""

import copy
import gc
import sys

import torch
import torch.nn.functional as F

import superneurons as sn
from common import make, sgd, sgd_step, system, throughput, write

POLICIES = ["offload", "recompute", "superneurons"]
WHOLE_BLOCKS = "superneurons, budget for whole-block replays"


def equality(name: str, batch: int, steps: int = 3) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.manual_seed(0)
    model, x, y = make(name, batch, "cuda")
    runs = {}
    # just under what cheap replays need with nothing moved: whole blocks are replayed
    blocks_budget = int(0.99 * sn.plan(model, x, policy="recompute").peak_bytes)
    for policy in ["plain", *POLICIES, WHOLE_BLOCKS]:
        replica = copy.deepcopy(model)
        options = {"policy": policy}
        if policy == WHOLE_BLOCKS:   # the budget covers all device memory: the others' replicas
            outside = torch.cuda.memory_allocated() - x.numel() * x.element_size() - sum(
                t.numel() * t.element_size() for t in (*replica.parameters(), *replica.buffers()))
            options = {"policy": "superneurons", "budget": blocks_budget + outside}
        wrapped = system("plain" if policy == "plain" else "superneurons", replica, **options)
        optimizer = torch.optim.SGD(replica.parameters(), lr=0.01, momentum=0.9)
        torch.manual_seed(1)
        losses = [sgd_step(wrapped, optimizer, x, y).item() for _ in range(steps)]
        stats = wrapped.stats.as_dict() if policy != "plain" else None
        runs[policy] = (losses, replica.state_dict(), stats)
        del wrapped, optimizer
    reference_losses, reference_state, _ = runs["plain"]
    result = {}
    for policy in [*POLICIES, WHOLE_BLOCKS]:
        losses, state, stats = runs[policy]
        diffs = [((a.double() - b.double()).abs().max() / (a.double().abs().max() + 1e-12)).item()
                 for a, b in zip(reference_state.values(), state.values()) if a.is_floating_point()]
        result[policy] = {"losses": losses, "plain_losses": reference_losses,
                          "max_relative_state_difference": max(diffs),
                          "equal_within_1e-3": max(diffs) < 1e-3 and all(
                              abs(a - b) <= 1e-4 * abs(a) for a, b in zip(losses, reference_losses)),
                          "stats": stats}
    torch.backends.cudnn.deterministic = False
    return result


class StepRecorder:
    """Device memory at every module layer's forward and backward step.

    A forward hook reads the allocator's counters; a pre-hook on the output's grad_fn reads them
    again when backward reaches that layer (no extra autograd nodes, so in-place ReLU still works).
    """

    def __init__(self, model):
        self.records, self.calls = [], {}
        self.in_forward = False           # layers replayed in backward are not steps
        self.handles = [m.register_forward_hook(self._forward(name))
                        for name, m in model.named_modules() if not m._modules]

    def _read(self, phase, name):
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.records.append((phase, name, torch.cuda.memory_allocated(), peak))

    def _forward(self, name):
        def hook(module, args, output):
            if not self.in_forward:
                return
            count = self.calls[name] = self.calls.get(name, 0) + 1
            label = name if count == 1 else f"{name}#{count}"
            self._read("forward", label)
            if isinstance(output, torch.Tensor) and output.grad_fn is not None:
                output.grad_fn.register_prehook(lambda grads: self._read("backward", label))
        return hook


def memory_per_step(name: str, batch: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model, x, y = make(name, batch, "cuda")
    optimizer_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # momentum
    input_bytes = x.numel() * x.element_size()
    result = {}
    for policy in ["liveness", *POLICIES]:
        wrapped = sn.wrap(model, policy=policy)
        recorder = StepRecorder(model)
        optimizer = sgd(model)
        sgd_step(wrapped, optimizer, x, y)                    # grads and momentum now exist
        torch.cuda.reset_peak_memory_stats()
        optimizer.zero_grad(set_to_none=False)
        # plans count the model's input (its caller holds it through the step), so the steps
        # measured here count it too; the optimizer's momentum is outside every plan
        leftover = torch.cuda.memory_allocated() - 3 * optimizer_bytes - input_bytes
        recorder.in_forward = True
        out = wrapped(x)
        recorder.in_forward = False
        F.nll_loss(out, y).backward()
        torch.cuda.synchronize()
        plan = sn.plan(model, x, policy=policy)
        predicted = {(s.phase, s.layer): s.live_bytes for s in plan.steps}
        steps = [{"phase": phase, "layer": label,
                  "measured_bytes": after - optimizer_bytes,
                  "measured_peak_bytes": peak - optimizer_bytes,
                  "predicted_bytes": predicted.get((phase, label))}
                 for phase, label, after, peak in recorder.records]
        result[policy] = {
            "leftover_bytes_before_step": leftover,
            "predicted_peak_bytes": plan.peak_bytes,
            "step_peak_bytes": max(s["measured_peak_bytes"] for s in steps),
            "steps": steps}
        for handle in recorder.handles:
            handle.remove()
        del wrapped, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    return result


def plot_memory(records: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, len(records), figsize=(6 * len(records), 4))
    for axis, (name, policies) in zip(axes, records.items()):
        for policy, record in policies.items():
            steps = record["steps"]
            line, = axis.plot([s["measured_peak_bytes"] / 2**20 for s in steps], lw=1,
                              label=f"{policy} measured")
            axis.plot([(s["predicted_bytes"] or float("nan")) / 2**20 for s in steps], lw=1,
                      ls="--", color=line.get_color(), label=f"{policy} predicted")
        axis.set_title(name)
        axis.set_xlabel("module step (forward, then backward)")
        axis.set_ylabel("MiB")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def speed(name: str, batch: int, rounds: int = 3, steps: int = 8) -> dict:
    """Images/s per system. Plain and the wrapped model with a budget that fits are measured in
    ``rounds`` alternating rounds and reported by their medians: a host-bound step (DenseNet-121
    at batch 32) moves between runs by more than the comparison (throughput_fits.json once said
    0.876, alternated 1.02-1.21: profile_densenet_fast_path.json)."""
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    systems = [("plain", "plain", {}),
               ("superneurons, budget fits", "superneurons", {"policy": "superneurons",
                                                              "budget": "120GiB"})]
    others = [("superneurons, floor budget", "superneurons", {"policy": "superneurons"}),
              ("recompute, floor budget", "superneurons", {"policy": "recompute"}),
              ("checkpoint", "checkpoint", {}), ("save_on_cpu", "save_on_cpu", {})]
    result = {}
    for label, system_name, options in systems * rounds + others:
        model, x, y = make(name, batch, "cuda")
        wrapped = system(system_name, model, **options)
        torch.cuda.reset_peak_memory_stats()
        row = result.setdefault(label, {"rounds": []})
        row["rounds"].append(throughput(wrapped, x, y, steps=steps))
        row["images_per_s"] = sorted(row["rounds"])[len(row["rounds"]) // 2]
        row["peak_bytes"] = torch.cuda.max_memory_allocated()
        if system_name == "superneurons":
            row["stats"] = wrapped.stats.as_dict()
        del model, x, y, wrapped
        torch.cuda.empty_cache()
    base = result["plain"]["images_per_s"]
    for value in result.values():
        value["of_plain"] = value["images_per_s"] / base
    return result


MEMORY_CASES = (("alexnet", 4), ("resnet50", 1), ("densenet121", 1))   # batch: size times this
MEMORY_WHAT = ("device bytes per module step (activations, grads, params and the input; "
               "optimizer state excluded)")


def memory_records(size: int = 32) -> dict:
    """memory_per_step for each of MEMORY_CASES (also run.py's memory part)."""
    return {name: memory_per_step(name, times * size) for name, times in MEMORY_CASES}


def main(argv: list) -> None:
    out = argv[0] if argv else "out"
    quick = "--quick" in argv
    if "--fits-only" in argv:
        rounds, steps = 7, 24
    else:
        check_runtime(out, quick)
        rounds, steps = 3, 8
    write(f"{out}/throughput_fits.json", {
        "what": f"images/s, fp32, full SGD steps, no memory cap; {rounds} alternating rounds "
                f"of {steps} steps for plain and the budget that fits",
        "resnet50_batch64": speed("resnet50", 64, rounds, steps),
        "densenet121_batch32": speed("densenet121", 32, rounds, steps)})


def check_runtime(out: str, quick: bool) -> None:
    size = 4 if quick else 8
    write(f"{out}/cuda_equality.json", {
        "what": "3 SGD steps, deterministic cuDNN, each policy at its floor budget (and "
                "superneurons at a budget where it replays whole blocks) vs plain",
        "resnet50": equality("resnet50", size),
        "densenet121": equality("densenet121", size)})
    records = memory_records(8 if quick else 32)
    write(f"{out}/memory_per_step.json", {"what": MEMORY_WHAT, "networks": records})
    plot_memory(records, f"{out}/memory_per_step.png")


if __name__ == "__main__":
    main(sys.argv[1:])
