"""Speed at every memory ratio (issue 16): each model's training throughput when capped at a
fraction of plain PyTorch's own measured peak, for plain PyTorch (uncapped, the reference),
torch.utils.checkpoint per block, save_on_cpu, torch.compile with its activation memory budget
and superneurons, in fp32 and under bf16 autocast; one process per measurement, so that no
system inherits another's allocator state.

    python benchmarks/ratio.py OUT_DIR [--models resnet50 efficientnet_b0 densenet121 gpt2]
        [--dtypes fp32 bf16] [--ratios 0.75 0.5 0.35 0.25] [--systems ...] [--steps 6]
        [--workers 1] [--no-slice-loss] [--plot]

Writes OUT_DIR/ratio_<model>_<dtype>.json, rewritten after each measurement (a run stopped by a
time limit keeps what it measured), and OUT_DIR/ratio_<model>.png with --plot. A capped system
runs under torch.cuda.set_per_process_memory_fraction(cap); superneurons gets the cap less
CAP_HEADROOM as its budget (cuDNN's workspaces take what the cap leaves: BENCHMARKS.md), or less
the share RATIO_HEADROOM names in the environment.

Plain PyTorch runs first for every model and dtype, one process at a time: its peak sets the
caps. Then every capped row, and plain once more as a control, run ``--workers`` processes at a
time. Each process's set-up and first step (where torch.compile compiles and superneurons
captures, plans and pins) share the GPU with the other processes' first steps; its second step
and its timed steps have the GPU alone (GpuLock). A plain control row after each ratio says
whether the timed steps were undisturbed.
"""

import argparse
import contextlib
import fcntl
import glob
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed

MODELS = ("resnet50", "efficientnet_b0", "densenet121", "gpt2")
SYSTEMS = ("checkpoint", "save_on_cpu", "compile", "superneurons", "superneurons_host")
# superneurons_host: the model's state (parameters, gradients, AdamW's state) in host memory,
# AdamW stepping there with PyTorch's fused kernel for CPU tensors; asked for by name, where the
# state on the device leaves a quarter of plain's peak too little room
DEFAULT_SYSTEMS = SYSTEMS[:-1]
RATIOS = (0.75, 0.5, 0.35, 0.25)
# the share of a cap superneurons leaves to what its plans do not count: the 0.5 GiB of the 12
# GiB cap the README's claims leave (11.5 GiB budgets)
CAP_HEADROOM = 0.5 / 12
# batch sizes: plain PyTorch's peak well above a few GiB on the H200, so that a quarter of it is
# still a working set, not allocator noise; the decoder is issue 16's GPT-2 small anchor
BATCH = {"resnet50": 192, "efficientnet_b0": 192, "densenet121": 128, "gpt2": 16}
IMAGE, SEQUENCE, VOCAB = 224, 1024, 50257
GPU_LOCK = "RATIO_GPU_LOCK"          # environment: the file a process locks for its timed steps
SLICE_LOSS = "RATIO_SLICE_LOSS"      # environment: "0" wraps with slice_loss=False
STRICT_BUDGET = "RATIO_STRICT_BUDGET"  # environment: "1" wraps with strict_budget=True
# environment: the allocator's cap times this number while superneurons' budget stays the cap's
# (a diagnosis: what the allocator's retries at the cap cost a plan that is not changed)
CAP_SLACK = "RATIO_CAP_SLACK"
# environment: the share of the cap left beside superneurons' budget, instead of CAP_HEADROOM
# (what a budget that leaves the allocator room for its free blocks costs the plan, where they
# made it retry at the cap)
HEADROOM = "RATIO_HEADROOM"
CHILD_SECONDS = 300                  # a cold torch.compile of DenseNet-121 fits in it
# untimed first steps: every system's first two (compilation, capture, pinning), the first
# steps in which superneurons calibrates (executor Rule 4 reads the allocator at every layer,
# which a steady step does not: with them a median of 4 steps is a first step's), and its trial
# of plans it may not keep (module Rule 10). A calibration made again later (after an
# out-of-memory retry) is a steady cost, and timed. At most spare_steps() more are run.
WARM_STEPS = 2


def spare_steps() -> int:
    """The steps a superneurons row may run before its timed ones: its calibration (two steps
    and one trusting it, executor Rule 4), a trial of the most plans (trial.py, Rule 7's
    included), and 3 more for a calibration made again."""
    from superneurons.runtime.trial import LONGEST_TRIAL_STEPS
    return 3 + LONGEST_TRIAL_STEPS + 3


def per_second(name: str, seconds: list) -> float:
    """Samples a second (images, or tokens for the decoder) over the median of ``seconds``."""
    return BATCH[name] * (SEQUENCE if name == "gpt2" else 1) / sorted(seconds)[len(seconds) // 2]


def after_warm_up(seconds: list, calibrating: list, trying: list = ()) -> list:
    """The seconds of the steps to time: those after the first WARM_STEPS, after the first
    run of steps that calibrated and after the last step of a trial (``calibrating``,
    ``trying``: a flag per step, as long as ``seconds`` or empty)."""
    first_run = next((i for i, flag in enumerate(calibrating) if not flag), len(calibrating))
    tried = max((i + 1 for i, flag in enumerate(trying) if flag), default=0)
    return seconds[max(WARM_STEPS, first_run, tried):]


def build(name: str, system: str, device):
    """(model wrapped for ``system`` except superneurons and compile, inputs, loss function)."""
    import torch
    from common import gpt2, token_batch
    if name == "gpt2":
        model = gpt2(positions=SEQUENCE, vocab=VOCAB).to(device).train()
        if system == "checkpoint":
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, (), token_batch(device, BATCH[name], SEQUENCE, VOCAB), lambda out: out.loss
    import torchvision
    options = {"memory_efficient": True} if system == "checkpoint" and name == "densenet121" \
        else {}
    model = torchvision.models.get_model(name, weights=None, **options).to(device).train()
    if system == "checkpoint" and name != "densenet121":
        checkpoint_blocks(model)
    x = torch.randn(BATCH[name], 3, IMAGE, IMAGE, device=device)
    y = torch.randint(0, 1000, (BATCH[name],), device=device)
    return model, (x,), {}, lambda out: torch.nn.functional.cross_entropy(out.float(), y)


def checkpoint_blocks(model) -> None:
    """torch.utils.checkpoint around every residual block of a torchvision ResNet or
    EfficientNet (DenseNet has its own: memory_efficient=True). common.CheckpointBlocks finds
    the zoo's blocks, and in an EfficientNet would nest checkpoints three deep."""
    from torch import nn
    from common import _Checkpointed
    stages = [getattr(model, f"layer{i}") for i in range(1, 5) if hasattr(model, f"layer{i}")]
    if not stages:                                   # EfficientNet: features' stages of MBConvs
        stages = [stage for stage in model.features if isinstance(stage, nn.Sequential)
                  and all(type(block).__name__ == "MBConv" for block in stage)]
    if not stages:
        raise ValueError(f"no blocks to checkpoint in {type(model).__name__}")
    for stage in stages:
        for index, block in enumerate(stage):
            stage[index] = _Checkpointed(block)


def prepare(name: str, dtype: str, system: str, ratio, plain_peak, device):
    """One system set up in this process as measure() times it: the cap at ``ratio`` of
    ``plain_peak`` (none for plain), the model built and wrapped. Returns (what the step calls,
    a function running one AdamW step, the cap in bytes or None, the call's (args, kwargs))."""
    import torch
    import superneurons as sn
    cap = int(plain_peak * ratio) if ratio else None
    if cap:
        total = torch.cuda.get_device_properties(device).total_memory
        slack = float(os.environ.get(CAP_SLACK, "1"))
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * slack / total), device)
    torch.manual_seed(0)
    model, args, kwargs, loss_of = build(name, system, device)
    run, host = model, system == "superneurons_host"
    if host:
        model.cpu()                                  # built on the device as the others are
        torch.cuda.empty_cache()
    if system.startswith("superneurons"):
        run = sn.wrap(model, policy="superneurons", budget=superneurons_budget(cap),
                      slice_loss=os.environ.get(SLICE_LOSS) != "0",
                      strict_budget=os.environ.get(STRICT_BUDGET) == "1",
                      **({"state": "host", "device": device} if host else {}))
    elif system == "compile":
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = ratio or 1.0
        run = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if host else {}))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16")
    offload = torch.autograd.graph.save_on_cpu(pin_memory=True) if system == "save_on_cpu" \
        else contextlib.nullcontext()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast, offload:
            loss = loss_of(run(*args, **kwargs))
        loss.backward()
        optimizer.step()
    return run, step, cap, (args, kwargs)


def superneurons_budget(cap: int | None) -> int | None:
    """superneurons' budget under a cap of ``cap`` bytes: the cap less its headroom (no cap: no
    budget)."""
    return int(cap * (1 - float(os.environ.get(HEADROOM, CAP_HEADROOM)))) if cap else None


def recorded_plain_peak(name: str, dtype: str) -> int:
    """Plain PyTorch's peak allocated bytes in the stored record results/ratio_NAME_DTYPE.json,
    for scripts that cap a row as this sweep did without measuring plain again."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        f"ratio_{name}_{dtype}.json")
    with open(path) as f:
        rows = json.load(f)["rows"]
    return next(r["peak_allocated_bytes"] for r in rows if r["system"] == "plain" and r["ok"])


def graph_in_record_room(record_path: str, ratio: float) -> tuple:
    """(record, the model's graph as superneurons captured it there, on the meta device, and
    the room its wrapper had at its last step: its budget less the memory the model did not own
    and the calibrated excess), for a superneurons row of a stored ratio record: to plan that
    row again on a machine without a GPU."""
    import torch
    import superneurons as sn
    with open(record_path) as f:
        record = json.load(f)
    measured = next(r for r in record["rows"] if r["system"] == "superneurons"
                    and r["ratio"] == ratio)
    last = measured["steps"][-1]
    room = measured["first_step"]["budget_bytes"] - last["foreign_bytes"] - \
        (last["excess_bytes"] or 0)
    model, args, kwargs, _ = build(record["model"], "superneurons", torch.device("meta"))
    autocast = torch.bfloat16 if record["dtype"] == "bf16" else None
    graph = sn.plan(model, args, policy="liveness", autocast=autocast, kwargs=kwargs).graph
    return record, graph, room


def rows_of_records(specs: list, row, shown=None) -> list:
    """``row(path, ratio)`` for each RECORD:RATIO of ``specs``, each printed as it comes (its
    ``shown`` keys, or all)."""
    rows = []
    for spec in specs:
        path, ratio = spec.rsplit(":", 1)
        rows.append(row(path, float(ratio)))
        print(json.dumps({k: v for k, v in rows[-1].items() if shown is None or k in shown}),
              flush=True)
    return rows


def measure(name: str, dtype: str, system: str, ratio, plain_peak, steps: int) -> dict:
    """One system in this process; ``plain_peak`` and ``ratio`` set the cap (none for plain)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    from common import calibration_of, torch_settings
    torch_settings()                                 # as every benchmark here: no TF32
    device = torch.device("cuda", 0)
    gpu = GpuLock.from_environment()
    gpu.share()                                      # set-up and first step beside others'
    run, step_once, cap, _ = prepare(name, dtype, system, ratio, plain_peak, device)
    seconds, first, states, retries = [], None, [], []

    def timed() -> list:
        return after_warm_up(seconds, [s.get("calibrating", False) for s in states],
                             [s.get("trying", False) for s in states])
    try:
        for step in range(WARM_STEPS + spare_steps() + steps):
            if len(timed()) >= steps:
                break
            if step == 1:
                gpu.own()                            # until this process exits
            torch.cuda.synchronize()
            began = time.perf_counter()
            step_once()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - began)
            # the allocator's retries so far (a step that met the cap freed its cache and retried:
            # a slow step's cause), read after each step
            retries.append(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
            if system.startswith("superneurons") and run.stats is not None:
                if step == 0:
                    first = run.stats.as_dict()
                # per step: whether it calibrated, or ran fitted after a step past the budget
                # (executor Rules 4 and 9: both slower), and what it moved and waited for
                states.append({**calibration_of(run), "trying": run.stats.trying,
                               "drained_convolutions": run.stats.drained_convolutions,
                               "moved_bytes": run.stats.offloaded_bytes
                               + run.stats.prefetched_bytes,
                               "state_moved_bytes": run.stats.state_moved_bytes})
    except (RuntimeError, ValueError) as error:      # torch.OutOfMemoryError among them
        # which step failed, what the steps before it did, and where: enough to tell a plan
        # that cannot fit from a step that met something the plan does not count
        return {"ok": False, "error": f"{type(error).__name__}: {str(error)[:1500]}",
                "failed_step": len(seconds), "steps": states,
                "where": traceback.format_exc(limit=-6)[-3000:]}
    steady = timed() or seconds[-steps:]                    # or calibrating to the end
    row = {"ok": True, "per_s": per_second(name, steady), "first_step_s": seconds[0],
           "step_s": seconds, "alloc_retries": retries, "timed_steps": len(timed()),
           "cap_bytes": cap,
           "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
           "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    if system.startswith("superneurons") and run.stats is not None:
        from superneurons.runtime.machine import machine_of
        machine = machine_of(device)
        row.update(moved_bytes=run.stats.offloaded_bytes + run.stats.prefetched_bytes,
                   recomputed_layers=run.stats.recomputed_layers,
                   predicted_peak_bytes=run.stats.predicted_peak_bytes,
                   policy=run.stats.policy, first_step=first, steps=states,
                   plan_trials=run.plan_trials,
                   machine={"memory_bytes_per_s": machine.memory_bytes_per_s,
                            "conv_flops_per_s": machine.conv_flops_per_s,
                            "matmul_flops_per_s": machine.matmul_flops_per_s,
                            "link_bytes_per_s": machine.link_bytes_per_s,
                            "source": machine.source})
    return row


class GpuLock:
    """A readers-writer lock between processes over two files: set-up and first steps share
    the GPU (shared lock on ``path``), timed steps own it (exclusive lock). A process waiting
    to own it holds the turnstile (``path``.turnstile), so that no new first step starts until
    it has had its turn: the first steps running finish and it goes, however many wait to
    start. Without a path (GPU_LOCK unset) it does nothing."""

    def __init__(self, path: str | None):
        self.path, self.held = path, None

    @classmethod
    def from_environment(cls) -> "GpuLock":
        return cls(os.environ.get(GPU_LOCK))

    def share(self) -> None:
        self._take(fcntl.LOCK_SH)

    def own(self) -> None:
        self._take(fcntl.LOCK_EX)

    def _take(self, mode: int) -> None:
        if self.path is None:
            return
        if self.held is not None:        # a shared lock is let go before owning: no upgrade
            self.held.close()
        with open(self.path + ".turnstile", "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            self.held = open(self.path, "a")
            fcntl.flock(self.held, mode)


def in_child(name, dtype, system, ratio, plain_peak, steps, timeout=CHILD_SECONDS) -> dict:
    from common import run_child
    command = [sys.executable, os.path.abspath(__file__), "--child", name, dtype, system,
               str(ratio or 0), str(plain_peak or 0), str(steps)]
    return run_child(command, timeout, cwd=os.path.dirname(os.path.abspath(__file__)))


def rates_measured_alone() -> dict:
    """The device's rates, measured by a process of their own before any worker shares the GPU,
    into the cache folder every child reads (runtime/machine.py; a folder of this run unless
    SUPERNEURONS_CACHE_DIR names one): a child measuring them beside other workers' first steps
    planned with bf16 rates 29 to 60 times too slow (ratio_*_998e2f5_contended_rates.json)."""
    from common import run_child
    folder = os.environ.get("SUPERNEURONS_CACHE_DIR") or tempfile.mkdtemp(prefix="ratio_rates_")
    os.environ["SUPERNEURONS_CACHE_DIR"] = folder
    script = ("import json, torch; from dataclasses import asdict; from common import "
              "torch_settings; torch_settings(); from superneurons.runtime.machine import "
              "machine_of; print(json.dumps(asdict(machine_of(torch.device('cuda', 0)))))")
    rates = run_child([sys.executable, "-c", script], CHILD_SECONDS,
                      cwd=os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(folder, "machine_rates.json")):
        raise SystemExit(f"the device's rates were not kept in {folder} ({rates}): other "
                         "processes hold memory on the GPU, or it could not be measured; every "
                         "worker would measure them beside the others")
    return rates


def run_all(out: str, cases, systems, ratios, steps, child=in_child, workers: int = 1) -> dict:
    """Every case's (model, dtype) plain row first, one at a time (its peak sets the caps);
    then each case's capped rows and a plain control, ``workers`` at a time, ratio by ratio
    (so that one model's compilations rarely run together), each ratio's rows followed by a
    plain control of each case. Each case's record is rewritten after each of its rows.
    Returns the records by case."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write
    os.environ.setdefault(GPU_LOCK, os.path.join(tempfile.gettempdir(), "ratio_gpu.lock"))
    os.makedirs(out, exist_ok=True)
    records, paths, lock = {}, {}, threading.Lock()

    def add(case, row) -> None:
        with lock:
            record = records[case]
            if row["ok"]:
                row["of_plain"] = row["per_s"] / record["rows"][0]["per_s"]
            record["rows"].append(row)
            print(json.dumps({"model": case[0], "dtype": case[1],
                              **{k: v for k, v in row.items() if k not in ("step_s", "first_step",
                                                                          "machine")}}),
                  flush=True)
            write(paths[case], record, quiet=True)

    for name, dtype in cases:
        case = (name, dtype)
        paths[case] = os.path.join(out, f"ratio_{name}_{dtype}.json")
        records[case] = {"command": " ".join(sys.argv), "model": name, "dtype": dtype,
                         "batch": BATCH[name], "workers": workers,
                         "slice_loss": os.environ.get(SLICE_LOSS) != "0", "complete": False,
                         "rows": []}
        plain = {"system": "plain", "ratio": None, "control": False,
                 **child(name, dtype, "plain", None, None, steps)}
        records[case]["rows"].append(plain)
        write(paths[case], records[case], quiet=True)
    measured = [case for case in records if records[case]["rows"][0]["ok"]]
    jobs = [job for ratio in ratios
            for job in [(case, system, ratio) for case in measured for system in systems]
            + [(case, "plain", None) for case in measured]]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        running = {pool.submit(child, *case, system, ratio,
                               records[case]["rows"][0]["peak_allocated_bytes"] if ratio else None,
                               steps): (case, system, ratio) for case, system, ratio in jobs}
        for future in as_completed(running):
            case, system, ratio = running[future]
            add(case, {"system": system, "ratio": ratio, "control": system == "plain",
                       **future.result()})
    for case, record in records.items():
        record["complete"] = True
        write(paths[case], record)
    return records


def plot(out: str, name: str) -> None:
    """Throughput against the ratio, a line per system and dtype, from the records alone; a
    system and ratio measured twice is plotted as the later record has it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(6, 4))
    for dtype in ("fp32", "bf16"):
        rows = {}          # a later run's record (ratio_<model>_<dtype>_<more>.json) adds rows
        for path in sorted(glob.glob(os.path.join(out, f"ratio_{name}_{dtype}*.json"))):
            with open(path) as file:
                rows.update(((r["system"], r["ratio"]), r) for r in json.load(file)["rows"]
                            if r["ratio"])
        for color, system in enumerate(SYSTEMS):
            points = sorted((ratio, r["of_plain"]) for (s, ratio), r in rows.items()
                            if s == system and r["ok"])
            if points:
                axes.plot(*zip(*points), marker="o", color=f"C{color}",
                          linestyle="-" if dtype == "fp32" else "--", label=f"{system} {dtype}")
    axes.axhline(1.0, color="grey", linewidth=0.5)              # plain PyTorch, uncapped
    axes.set_xlabel("cap / plain PyTorch's peak")
    axes.set_ylabel("throughput / plain PyTorch's")
    axes.set_title(name)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(os.path.join(out, f"ratio_{name}.png"), dpi=120)


def main():
    if sys.argv[1] == "--child":
        name, dtype, system, ratio, peak, steps = sys.argv[2:8]
        print(json.dumps(measure(name, dtype, system, float(ratio) or None, int(peak) or None,
                                 int(steps))), flush=True)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--ratios", nargs="*", type=float, default=list(RATIOS))
    parser.add_argument("--systems", nargs="*", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=1,
                        help="processes at a time after the plain rows (timed steps never share "
                             "the GPU)")
    parser.add_argument("--no-slice-loss", action="store_true",
                        help="superneurons with slice_loss=False (its cross-entropy's backward "
                             "whole, as plain PyTorch runs it)")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    if args.no_slice_loss:
        os.environ[SLICE_LOSS] = "0"                 # the children read it
    # what a compilation may use beside the other processes
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS",
                          str(max(1, (os.cpu_count() or 2) // max(1, args.workers))))
    print(json.dumps({"rates": rates_measured_alone()}), flush=True)
    run_all(args.out, [(m, d) for m in args.models for d in args.dtypes], args.systems,
            args.ratios, args.steps, workers=args.workers)
    if args.plot:
        for name in args.models:
            plot(args.out, name)


if __name__ == "__main__":
    main()
