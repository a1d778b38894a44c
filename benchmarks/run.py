"""The paper's evaluation on one GPU, side by side with PyTorch's own memory tools.

    python benchmarks/run.py PART [PART...] --out DIR [--cap-gib 12]

PART: depth, batch, speed, densenet, memory, recompute, cache, pool, workspace (exact training
on CUDA and speed when the step fits: gpu_check.py).
Every part writes DIR/PART.json with the command, device and versions. The card is capped at
--cap-gib with torch.cuda.set_per_process_memory_fraction; superneurons gets the same budget.
"""

import argparse
import contextlib
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import superneurons as sn  # noqa: E402
from superneurons import models  # noqa: E402
from common import cap_memory, fits, largest, make, make_deep_resnet, make_densenet_bc, sgd, \
    sgd_step, system, throughput, write  # noqa: E402
from no_workspace import DenyWorkspace  # noqa: E402

SYSTEMS = ["plain", "checkpoint", "save_on_cpu", "superneurons"]
NO_WORKSPACE = "SUPERNEURONS_BENCH_NO_WORKSPACE"   # set in the workspace part's child process
# where each bisection starts: the anchors in DESIGN.md (batch, or ResNet stage-3 blocks n)
BATCH_START = {"alexnet": (2560, 2880), "vgg16": (148, 156), "inception_v4": (70, 200),
               "resnet50": (140, 344), "resnet101": (96, 256), "resnet152": (66, 188),
               "densenet201": (61, 116)}
DEFAULT_BATCHES = (64, 140, 280)        # ResNet-50's batches for the cache, pool, workspace parts
# the speed part's batches when --batches is not given: about plain's largest under the cap
# (batch*.json) and about twice that, within superneurons' largest
SPEED_BATCHES = {"alexnet": (768, 1024), "vgg16": (144, 256), "inception_v4": (64, 128),
                 "resnet50": (140, 280), "resnet101": (96, 192), "resnet152": (64, 128),
                 "densenet201": (56, 112)}


def options_for(name: str, budget_gib: float) -> dict:
    return ({"policy": "superneurons", "budget": f"{budget_gib}GiB"} if name == "superneurons"
            else {})


def start_for(system_name: str, anchors: tuple) -> int:
    plain, checkpointed = anchors
    return {"plain": plain, "checkpoint": checkpointed, "save_on_cpu": plain,
            "superneurons": checkpointed}[system_name]


def depth_part(args) -> dict:
    """Deepest bottleneck ResNet [3, 4, n, 3] at batch 16 per system."""
    result = {}
    high = _model_state_bound(args.cap_gib)
    for name in args.systems:
        start = args.start or {"plain": 240, "checkpoint": 624, "save_on_cpu": 864,
                               "superneurons": 864}[name]
        began = time.time()
        n3, exact = largest(lambda n: fits(lambda: make_deep_resnet(n, 16), name,
                                           **options_for(name, args.budget)),
                            min(start, high - 1), bound=high, tolerance=0.03,
                            seconds=args.seconds)
        result[name] = {"n3": n3, "depth": 3 * (n3 + 10) + 2, "exact": exact,
                        "seconds": time.time() - began, "model_state_bound_n3": high}
        print(name, result[name], flush=True)
        args.save(result)
    return result


def _model_state_bound(cap_gib: float) -> int:
    """The smallest stage-3 size n whose weights, gradients and momentum alone exceed the cap:
    no system keeping model state on the device gets there, so the bisection never probes it
    or above (probes there cost a full step each before they fail)."""
    def parameter_bytes(n3):
        with torch.device("meta"):
            return 4 * sum(p.numel() for p in models.resnet(blocks=(3, 4, n3, 3)).parameters())
    per_block = parameter_bytes(2) - parameter_bytes(1)
    return int((cap_gib * 2**30 / 3 - parameter_bytes(1)) // per_block) + 2


def batch_part(args) -> dict:
    result = {}
    for network in args.networks:
        result[network] = {}
        for name in args.systems:
            began = time.time()
            bound = _host_bound(network, args.host_gib) if name == "save_on_cpu" else None
            if args.below:                     # measured not to fit by an earlier run
                bound = min(bound or args.below, args.below)
            batch, exact = largest(lambda b: fits(lambda: make(network, b, "cuda"), name,
                                                  **options_for(name, args.budget)),
                                   args.start or start_for(name, BATCH_START[network]),
                                   bound=bound,
                                   tolerance=0.03, seconds=args.seconds)
            result[network][name] = {"batch": batch, "exact": exact,
                                     "seconds": time.time() - began, "bound": bound}
            print(network, name, result[network][name], flush=True)
            args.save(result)
    return result


def _host_bound(network: str, host_gib: float) -> int:
    """A batch from which save_on_cpu is not probed: where what autograd saves in one step (the
    liveness plan's activations), doubled for the pinned allocator's power-of-two blocks, would
    take half the host's memory. Past it the system, not the GPU, would run out, and the kernel
    may end the whole benchmark rather than raise."""
    with torch.device("meta"):
        model = models.build(network)
    planned = sn.plan(model, models.input_shape(network, 8), policy="liveness")
    per_image = 2 * (planned.peak_bytes - planned.resident_bytes) / 8
    return max(2, int(host_gib * 2**30 / 2 / per_image))


def _host_memory_gib() -> float:
    with open("/proc/meminfo") as meminfo:
        kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal"))
    return kib / 2**20


def speed_part(args) -> dict:
    """Images/s against batch, fp32 and bf16 autocast with channels_last, under the cap. With
    --isolate each network and system runs in a child process of its own: cuDNN's benchmark
    mode keeps its algorithm choices per process and the allocator its cache, so otherwise what
    one system chose and cached may serve the next (VGG16 at 144 in fp32: plain 378 img/s after
    other systems in one process, 1015 in its own; BENCHMARKS.md)."""
    if args.isolate:      # one child per network and system: a stopped run keeps the others
        result = {}
        for network in args.networks:
            for name in args.systems:
                rows = _speed_in_child(args, {}, [name], args.dtypes, batches=None,
                                       networks=[network])
                result.setdefault(network, []).extend(rows.get(network, []))
                args.save(result)
        return result
    result = {}
    for network in args.networks:
        rows = result[network] = []
        for batch in args.batches or SPEED_BATCHES[network]:
            for dtype in args.dtypes:
                for name in args.systems:
                    row = {"batch": batch, "dtype": dtype, "system": name}
                    row.update(_speed(network, batch, name, dtype, args.budget,
                                      args.cap_gib))
                    rows.append(row)
                    print(network, row, flush=True)
                    args.save(result)
    return result


def _speed(network, batch, name, dtype, budget_gib, cap_gib) -> dict:
    torch.backends.cudnn.benchmark = True
    deny = None
    if os.environ.get(NO_WORKSPACE) == "1":        # the workspace part's second condition
        deny = DenyWorkspace(int(cap_gib * 2**30))
    model = x = y = wrapped = None
    try:
        model, x, y = make(network, batch, "cuda")
        if dtype == "bf16":
            model, x = model.to(memory_format=torch.channels_last), \
                x.to(memory_format=torch.channels_last)
        wrapped = system(name, model, **options_for(name, budget_gib))
        torch.cuda.reset_peak_memory_stats()
        speed = throughput(wrapped, x, y, steps=5, warmup=2,
                           warmup_context=(lambda: deny) if deny else contextlib.nullcontext,
                           autocast_dtype=torch.bfloat16 if dtype == "bf16" else None)
        out = {"images_per_s": speed, "peak_bytes": torch.cuda.max_memory_allocated()}
        if deny is not None:   # convolutions seen (forward and backward?) and memory taken
            out["warmup_convolutions_denied"] = len(deny.filled_bytes)
            out["warmup_filled_bytes_median"] = sorted(deny.filled_bytes or [0])[
                len(deny.filled_bytes) // 2]
        if name == "superneurons":
            out["stats"] = wrapped.stats.as_dict()
        return out
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
        return {"images_per_s": None, "error": str(error).splitlines()[0][:200]}
    finally:
        del model, x, y, wrapped
        gc.collect()
        torch.cuda.empty_cache()


DENSENET_DEPTHS = (40, 100, 190, 250, 400, 700, 1000)     # DenseNet-BC: depth = 6n + 4
DENSENET_SYSTEMS = ("plain", "checkpoint", "superneurons")  # checkpoint: per dense layer


def densenet_part(args) -> dict:
    """DenseNet-BC (k=12, 32 px, batch 64): memory against depth, each system's measured peak for
    one SGD step with no cap beside the plan's prediction (liveness for plain, the superneurons
    floor); then the deepest that fits the cap per system. Without CUDA: predictions only.

    The systems are plain, torch.utils.checkpoint around every dense layer (what the
    memory-efficient DenseNet recomputes, and a little more: the layer's 3x3 convolution) and
    superneurons; save_on_cpu is left out: its host memory grows with the square of the depth."""
    def build(depth):
        return make_densenet_bc(depth, 64)
    cuda = torch.cuda.is_available()
    systems = [name for name in args.systems if name in DENSENET_SYSTEMS]
    rows = []
    for depth in DENSENET_DEPTHS if args.depths is None else args.depths:
        row = {"depth": depth, "predicted_peak_bytes": _densenet_floors(depth)}
        if cuda:
            cap_memory(None)
            device_bytes = torch.cuda.get_device_properties(0).total_memory
            row["measured_peak_bytes"] = {
                # plain past the card's memory would only spend time running out of it
                name: None if name == "plain" and row["predicted_peak_bytes"]["liveness"]
                > 0.9 * device_bytes else _peak_of_one_step(lambda: build(depth), name)
                for name in systems}
            cap_memory(args.cap_gib)
        rows.append(row)
        print("densenet", row, flush=True)
        args.save({"memory_by_depth": rows})
    result = {"memory_by_depth": rows, "deepest": {}}
    for name in systems if cuda and args.deepest else ():
        start = args.start or {"plain": 262, "checkpoint": 1372, "superneurons": 1372}[name]
        bound = _densenet_floor_bound(args.budget) if name == "superneurons" else None
        began = time.time()
        n, exact = largest(lambda n: fits(lambda: build(6 * n + 4), name,
                                          **options_for(name, args.budget)),
                           (start - 4) // 6, bound=bound, tolerance=0.03, seconds=args.seconds)
        result["deepest"][name] = {"depth": 6 * n + 4, "exact": exact,
                                   "seconds": time.time() - began,
                                   "bound_depth": bound and 6 * bound + 4}
        print(name, result["deepest"][name], flush=True)
        args.save(result)
    return result


@functools.lru_cache(maxsize=None)
def _densenet_floors(depth: int) -> dict:
    """The plan's peak for DenseNet-BC at ``depth``, batch 64: liveness and superneurons' floor."""
    with torch.device("meta"):
        model = models.densenet(depth, 12, cifar=True)
    return {policy: sn.plan(model, (64, 3, 32, 32), policy=policy).peak_bytes
            for policy in ("liveness", "superneurons")}


def _densenet_floor_bound(budget_gib: float, depths=(700, 1000)) -> int:
    """A block count n from which no DenseNet-BC fits superneurons' budget: where the line through
    the floor at ``depths`` reaches the budget. The floor grows a little faster than linearly
    (densenet_plan.json), so the line stays under it beyond ``depths`` and the bound is safe;
    probes there would each spend a minute planning thousands of layers, only to be refused."""
    (d0, f0), (d1, f1) = [(d, _densenet_floors(d)["superneurons"]) for d in depths]
    depth = d1 + (budget_gib * 2**30 - f1) * (d1 - d0) / (f1 - f0)
    return int((depth - 4) // 6) + 1


def _peak_of_one_step(build, name: str):
    """Device peak of one SGD step (superneurons at its floor: no budget), or None if it fails."""
    model = x = y = wrapped = None
    try:
        model, x, y = build()
        wrapped = system(name, model, **({"policy": "superneurons"} if name == "superneurons"
                                         else {}))
        torch.cuda.reset_peak_memory_stats()
        sgd_step(wrapped, sgd(model), x, y)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
        print(name, "failed:", str(error).splitlines()[0][:120], flush=True)
        return None
    finally:
        del model, x, y, wrapped
        gc.collect()
        torch.cuda.empty_cache()


def recompute_part(args) -> dict:
    """Extra layer computations per strategy (Table 1), from the planner: no GPU needed."""
    result = {}
    for network in ("alexnet", "vgg16", "resnet50", "resnet101", "resnet152", "inception_v4",
                    "densenet121"):
        with torch.device("meta"):
            model = models.build(network)
        shape = models.input_shape(network, 32)
        graph = sn.planner.plan(model, shape, "superneurons").graph
        row = {}
        for strategy in sn.Strategy:
            plan = sn.planner.plan_graph(graph, "superneurons", strategy=strategy)
            row[str(strategy)] = {"extra_layer_computations": plan.num_extra_computations,
                                  "peak_bytes": plan.peak_bytes}
        row["l_peak_bytes"] = plan.max_layer_bytes
        row["resident_bytes"] = plan.resident_bytes
        result[network] = row
        print(network, row, flush=True)
    return result


CACHE_STEPS = 3        # past the executor's two calibration steps


def cache_part(args) -> dict:
    """Bytes moved per step with the Tensor Cache (superneurons under the budget) and without it
    (offload at the policy's floor: everything offloaded), as the batch grows (Table 3). Each
    for CACHE_STEPS steps, the first and the last recorded: the first step assumes
    FIRST_STEP_MARGIN of the plan, the later ones the excess calibrated in the first two, and
    they move different amounts (cache.json: 0 and 0.92 GiB at batch 140)."""
    result = {}
    for network in args.networks:
        rows = result[network] = []
        for batch in args.batches or DEFAULT_BATCHES:
            row = {"batch": batch}
            for label, options in (("with_cache", {"policy": "superneurons",
                                                   "budget": f"{args.budget}GiB"}),
                                   ("without_cache", {"policy": "superneurons"})):
                model, x, y = make(network, batch, "cuda")
                wrapped = sn.wrap(model, **options)
                optimizer = sgd(model)
                try:
                    steps = []
                    for _ in range(CACHE_STEPS):
                        sgd_step(wrapped, optimizer, x, y)
                        steps.append(wrapped.stats.as_dict())
                    row[label] = {"first_step": steps[0], "last_step": steps[-1]}
                except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
                    row[label] = {"error": str(error).splitlines()[0][:200]}
                del model, x, y, wrapped, optimizer
                gc.collect()         # else the last case's pool is still held at the next plan,
                torch.cuda.empty_cache()  # which then plans for less (foreign bytes)
            rows.append(row)
            print(network, row, flush=True)
            args.save(result)
    return result


def _speed_in_child(args, extra_env: dict, systems: list, dtypes=("fp32",),
                    batches=DEFAULT_BATCHES, networks=None) -> dict:
    """The speed part in a child process with ``extra_env`` set from its start (``batches``
    None: the speed part's own per network; ``networks`` None: all of --networks)."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, os.path.abspath(__file__), "speed", "--out", folder,
                   "--tag", "_child", "--dtypes", *dtypes, "--cap-gib", str(args.cap_gib),
                   "--budget", str(args.budget), "--networks", *(networks or args.networks),
                   "--systems", *systems]
        batches = args.batches or batches
        if batches:
            command += ["--batches", *map(str, batches)]
        subprocess.run(command, env={**os.environ, **extra_env}, check=True)
        with open(os.path.join(folder, "speed_child.json")) as record:
            return json.load(record)["results"]


def pool_part(args) -> dict:
    """Pooled allocation (the caching allocator) against an allocation per tensor
    (PYTORCH_NO_CUDA_MEMORY_CACHING=1), each in a child process of its own (Table 2)."""
    return {"caching allocator": _speed_in_child(args, {}, args.systems),
            "no caching": _speed_in_child(args, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
                                          args.systems)}


def workspace_part(args) -> dict:
    """Speed with cuDNN free to take workspace from the memory the plan leaves free (benchmark
    mode tries each algorithm and skips those whose workspace does not fit) against cuDNN
    choosing its algorithms with no memory free (no_workspace.py), each in a child process."""
    systems = [s for s in args.systems if s in ("plain", "superneurons")]
    return {"workspace from free memory": _speed_in_child(args, {}, systems),
            "algorithms chosen with no memory free": _speed_in_child(args, {NO_WORKSPACE: "1"},
                                                                     systems)}


def memory_part(args) -> dict:
    """Device bytes at every module step of one training step against the plan's prediction,
    each policy at its floor (the paper's Figure 10; gpu_check.py measures it); plotted beside
    the record."""
    import gpu_check
    records = gpu_check.memory_records()
    gpu_check.plot_memory(records, os.path.join(args.out, f"memory{args.tag}.png"))
    return {"what": gpu_check.MEMORY_WHAT, "networks": records}


PARTS = {"depth": depth_part, "batch": batch_part, "speed": speed_part,
         "densenet": densenet_part, "memory": memory_part, "recompute": recompute_part,
         "cache": cache_part, "pool": pool_part, "workspace": workspace_part}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("parts", nargs="+", choices=sorted(PARTS))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--cap-gib", type=float, default=12.0)
    parser.add_argument("--budget", type=float, default=None,
                        help="superneurons' budget in GiB (default: the cap less 0.5 GiB)")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--networks", nargs="+", default=list(BATCH_START))
    parser.add_argument("--batches", nargs="+", type=int, default=None,
                        help="speed: per network, about plain's largest and twice it; "
                             "cache, pool, workspace: 64 140 280")
    parser.add_argument("--seconds", type=float, default=None,
                        help="stop each bisection after this long (the record says exact: false)")
    parser.add_argument("--start", type=int, default=None,
                        help="where bisections start (batch, ResNet n, DenseNet depth; default: "
                             "DESIGN.md's anchors)")
    parser.add_argument("--below", type=int, default=None,
                        help="batch: a batch an earlier run found not to fit; the bisection "
                             "probes only below it (the record's bound)")
    parser.add_argument("--tag", default="", help="suffix of the record's file name")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="host memory save_on_cpu may fill (default: MemTotal; machines "
                             "that grow their memory on use report less than they have)")
    parser.add_argument("--depths", nargs="*", type=int, default=None,
                        help="densenet: depths whose memory is measured (none: skip)")
    parser.add_argument("--no-deepest", dest="deepest", action="store_false",
                        help="densenet: measure memory against depth only")
    parser.add_argument("--isolate", action="store_true",
                        help="speed: each network and system in a process of its own")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = parser.parse_args()
    args.budget = args.budget or args.cap_gib - 0.5
    args.host_gib = args.host_gib or _host_memory_gib()
    if torch.cuda.is_available():
        cap_memory(args.cap_gib)
    for part in args.parts:
        began = time.time()

        def save(results, complete=False):
            """Written after every measurement too: a run stopped by its time limit keeps what
            it measured (complete: false)."""
            write(os.path.join(args.out, f"{part}{args.tag}.json"),
                  {"part": part, "cap_gib": args.cap_gib, "superneurons_budget_gib": args.budget,
                   "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                   "seconds": time.time() - began, "complete": complete, "results": results},
                  quiet=not complete)
        args.save = save
        save(PARTS[part](args), complete=True)


if __name__ == "__main__":
    main()
