"""Shared by the benchmark scripts: the systems compared, one SGD step, records, bisection.

Systems, all on the same GPU and in the same process:
- plain: PyTorch as it is;
- checkpoint: torch.utils.checkpoint (non-reentrant) around every block;
- save_on_cpu: torch.autograd.graph.save_on_cpu(pin_memory=True) around the step;
- superneurons: superneurons.wrap(model, policy, budget).
"""

import contextlib
import datetime
import gc
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import superneurons as sn
from superneurons import models


def torch_settings(deterministic: bool = False) -> None:
    """What every run here shares: expandable segments, no TF32, and with ``deterministic`` the
    deterministic kernels (cuBLAS reads its workspace setting at its first handle, so before any
    CUDA work)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def environment() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "superneurons": sn.__version__,
        # HF models' capture depends on it (superneurons/capture/hf.py)
        "transformers": _version_of("transformers"),
    }


def _version_of(package: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def rss_bytes() -> int | None:
    """The process's resident host memory (pinned host memory counts in it)."""
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        pass
    try:
        with open("/proc/self/status") as status:
            line = next(ln for ln in status if ln.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def gpt2(layers=12, width=768, heads=12, positions=1024, vocab=50257):
    """An HF GPT2LMHeadModel (GPT-2 small by default), on SDPA attention."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=positions,
                        vocab_size=vocab)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def token_batch(device, batch=16, seq=1024, vocab=50257) -> dict:
    """A causal LM's training call: random tokens as inputs and labels, no cache."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    return dict(input_ids=ids, labels=ids, use_cache=False)


def cpu_bf16_steps(model: nn.Module, loss_of, steps: int = 3) -> list:
    """Losses of ``steps`` AdamW steps of ``model``'s parameters, each ``loss_of()`` (a call
    of the model, plain or wrapped) under the CPU's bf16 autocast, seeded per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def replayed_alone(plan) -> int:
    """The plan's segments that replay one CONV, FC or ATTN layer alone, the outputs of the
    cheap layers after it kept (planner/trim.py)."""
    from superneurons.planner.policy import CHECKPOINT_KINDS
    return sum(len(s.layers) == 1 and plan.graph.layers[s.layers[0]].kind in CHECKPOINT_KINDS
               for s in plan.segments)


def calibration_of(wrapped) -> dict:
    """The executor's calibrated excess (executor Rule 4) after the step just run, in bytes."""
    last = getattr(wrapped, "_last", None)
    executor = last[1] if last else None
    if executor is None:
        return {}
    row = {"excess_bytes": executor.excess_bytes, "seen_excess_bytes": executor.seen_excess,
           "foreign_bytes": executor.foreign_bytes,
           # whether the step read the allocator, or trusted its calibration; and whether a
           # step past the budget raised the excess (calibration.py)
           "calibrating": executor.calibration.active, "raised": executor.calibration.raised}
    step = executor.calibration.seen_at
    if step is not None:            # where the largest excess was read: a forward or backward step
        order, n = executor.plan.order, executor.num_layers
        layer = executor.graph.layers[order[step] if step < n else order[2 * n - 1 - step]]
        row["seen_excess_at"] = f"{'forward' if step < n else 'backward'} {layer.name}"
    return row


def run_child(command: list, timeout: float, cwd: str | None = None, env=None) -> dict:
    """A measuring child process's result: the last JSON object line it printed, else
    {"ok": False, "error": why} (its exit and the end of its stderr, or the time limit), so that
    one config that fails or hangs does not end a sweep."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no result within {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"ok": False, "error": f"process ended with {done.returncode}: "
                                      f"{done.stderr.strip()[-600:]}"}
    return json.loads(lines[-1])


def write(path: str, record: dict, quiet: bool = False) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:       # never a half-written record
        json.dump({**environment(), **record}, f, indent=1)
    os.replace(path + ".tmp", path)
    if not quiet:
        print(f"wrote {path}", flush=True)


class CheckpointBlocks(nn.Module):
    """torch.utils.checkpoint around every block (children of Sequentials, ResNet stages); in a
    network without blocks (AlexNet, VGG: one Sequential of layers) around every convolution or
    fully connected layer with the layers after it up to the next one."""

    def __init__(self, model: nn.Module):
        super().__init__()
        stages = _block_containers(model)
        self.model = model if stages else _layer_groups(model)
        for stage in stages:
            for index, block in enumerate(stage):
                stage[index] = _Checkpointed(block)

    def forward(self, x):
        return self.model(x)


class _Checkpointed(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        # a DenseNet layer gets the growing list of features: checkpoint a copy of it
        args = [list(a) if isinstance(a, list) else a for a in args]
        return checkpoint(self.block, *args, use_reentrant=False)


def _layer_groups(model: nn.Module) -> nn.Module:
    """A Sequential of layers as a Sequential of checkpointed groups, each a CONV or FC layer and
    what follows it (a group never starts with an in-place ReLU, which would write into the
    input the checkpoint keeps); any other model as it is."""
    if not isinstance(model, nn.Sequential) or any(len(layer._modules) for layer in model):
        return model
    groups = []
    for layer in model:
        if not groups or (isinstance(layer, (nn.Conv2d, nn.Linear)) and any(
                isinstance(earlier, (nn.Conv2d, nn.Linear)) for earlier in groups[-1])):
            groups.append([])
        groups[-1].append(layer)
    return nn.Sequential(*(_Checkpointed(nn.Sequential(*group)) for group in groups))


def _block_containers(model):
    """ResNet stages, DenseNet dense blocks' layers, Inception's Sequential: the repeated units."""
    found = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            found.append(module)
        elif isinstance(module, nn.Sequential) and len(module) > 2 and all(
                len(child._modules) > 0 for child in module):
            found.append(module)
    return found


class SaveOnCpu(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return self.model(x)


def system(name: str, model: nn.Module, **options) -> nn.Module:
    if name == "plain":
        return model
    if name == "checkpoint":
        return CheckpointBlocks(model)
    if name == "save_on_cpu":
        return SaveOnCpu(model)
    if name == "superneurons":
        return sn.wrap(model, **options)
    raise ValueError(name)


def make(name: str, batch: int, device, *, depth=None, growth=None, image=None, classes=1000):
    model = models.build(name, depth=depth, growth=growth, num_classes=classes).to(device)
    shape = models.input_shape(name, batch, image)
    x = torch.randn(shape, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    return model, x, y


def make_deep_resnet(n3: int, batch: int, device="cuda"):
    """The depth benchmarks' bottleneck ResNet [3, 4, n3, 3] (depth 3 * (n3 + 10) + 2) and a
    batch of 224 px images."""
    model = models.resnet(blocks=(3, 4, n3, 3)).to(device)
    x = torch.randn(batch, 3, 224, 224, device=device)
    return model, x, torch.randint(0, 1000, (batch,), device=device)


def make_densenet_bc(depth: int, batch: int, device="cuda"):
    """The depth benchmarks' DenseNet-BC (k=12, depth 6n + 4) and a batch of 32 px images."""
    model = models.densenet(depth, 12, cifar=True).to(device)
    x = torch.randn(batch, 3, 32, 32, device=device)
    return model, x, torch.randint(0, 10, (batch,), device=device)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer every benchmark steps: SGD with momentum (its state counts on the device)."""
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def sgd_step(model, optimizer, x, y, autocast_dtype=None) -> float:
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(x)
    loss = F.nll_loss(out.float(), y)
    loss.backward()
    optimizer.step()
    return loss


def throughput(model, x, y, *, steps=8, warmup=3, autocast_dtype=None,
               warmup_context=contextlib.nullcontext) -> float:
    """Images per second over ``steps`` full SGD steps after ``warmup`` (run inside
    ``warmup_context()``: where cuDNN's benchmark mode chooses its algorithms)."""
    optimizer = sgd(model)
    with warmup_context():
        for _ in range(warmup):
            sgd_step(model, optimizer, x, y, autocast_dtype)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        sgd_step(model, optimizer, x, y, autocast_dtype)
    torch.cuda.synchronize()
    return x.shape[0] * steps / (time.perf_counter() - start)


def cap_memory(gib: float | None) -> None:
    """Emulate a smaller card: the caching allocator refuses past ``gib`` (None: no cap)."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if gib is None else gib * 2**30 / total)


def fits(build, system_name: str, **options) -> bool:
    """One full SGD step without running out of memory."""
    ok = _try_step(build, system_name, options)
    gc.collect()                          # the failed step's graph and frames hold memory
    torch.cuda.empty_cache()
    _empty_host_cache()
    return ok


def _empty_host_cache() -> None:
    """Give back the pinned blocks save_on_cpu's probes leave cached: PyTorch keeps them, each
    rounded up to a power of two, so the next, larger probe would pin beside them."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def _try_step(build, system_name, options) -> bool:
    try:
        model, x, y = build()
        wrapped = system(system_name, model, **options)
        optimizer = sgd(model)
        if system_name == "superneurons":      # the log splits a slow probe: planning, the step
            began = time.time()
            wrapped.plan_for(x)
            print(f"  planned in {time.time() - began:.0f} s", flush=True)
        sgd_step(wrapped, optimizer, x, y)
        torch.cuda.synchronize()
        return True
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
        if "memory" not in str(error) and "needs at least" not in str(error):
            raise
        # the log says why a probe failed: our out-of-memory retries, a budget below the
        # plan's floor, or PyTorch's allocator
        print(f"  {system_name} does not fit: {str(error).splitlines()[0][:160]}", flush=True)
        error.__traceback__ = None
        return False


def largest(probe, low: int, bound: int | None = None, tolerance: float = 0.03,
            seconds: float | None = None, look_above=(1.25, 1.5)) -> tuple:
    """(n, exact): the largest n with probe(n) true; bisection stops within ``tolerance``, or
    when ``seconds`` have passed (exact False: n fits, the largest may be more).

    Fitting need not be monotone in n under superneurons (a larger batch may get a different
    plan that fits where a smaller one's did not: BENCHMARKS.md, Inception-v4), so once the
    bisection ends, ``look_above`` multiples of the result are probed, and bisection goes on
    above any that fits. ``bound``: no n from it up fits (it is known, so never probed)."""
    deadline = None if seconds is None else time.time() + seconds
    probe = _logged(probe)

    def out_of_time() -> bool:
        return deadline is not None and time.time() > deadline
    high = bound
    while not probe(low):
        if low <= 1:
            return 0, True
        high, low = low, max(1, low // 2)
    high = high or low * 2
    while True:
        while (bound is None or high < bound) and probe(high):
            low, high = high, _capped(high * 2, bound)
            if out_of_time():
                return low, False
        while high - low > max(1, int(low * tolerance)):
            if out_of_time():
                return low, False
            middle = (low + high) // 2
            if probe(middle):
                low = middle
            else:
                high = middle
        above = next((n for n in (int(low * f) for f in look_above)
                      if n > high and (bound is None or n < bound) and not out_of_time()
                      and probe(n)), None)
        if above is None:
            return low, not out_of_time()
        low, high = above, _capped(above * 2, bound)


def _logged(probe):
    def logged(n: int) -> bool:
        began = time.time()
        ok = probe(n)
        print(f"  {n}: {'fits' if ok else 'does not fit'} ({time.time() - began:.0f} s)",
              flush=True)
        return ok
    return logged


def _capped(n: int, bound: int | None) -> int:
    return n if bound is None else min(n, bound)
