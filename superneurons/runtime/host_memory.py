"""Host memory is finite: what a step will take of it, checked before anything is moved.

Rule 1: wrap(state="host") checks that the model's state fits in host memory before pinning it
        (to_host_memory); the first step of every plan that runs on an executor checks that
        what that step takes of host memory and does not hold yet fits: model state not yet
        there, its gradients (state="host"), the Tensor Cache's offloaded activations, and on
        the CPU the step's own tensors (its device is the host). Not fitting is a ValueError
        before the step, not an allocation failing inside an autograd hook (or the kernel's
        out-of-memory killer, which pinned pages bring on: they cannot be swapped).
Rule 2: the estimate counts what must be there, not what might be: where it is short (the pool
        pins whole chunks, host Rule 1-2), the pool takes smaller chunks and then pageable
        memory (host Rule 3). A check that refused steps which run would be worse than none:
        where only the Tensor Cache's part (an upper estimate) does not fit, it warns.
        - state: every tensor not in (pinned) host memory gets a copy, rounded up to a power
          of two where pinned (PyTorch's pinned allocator rounds every request: host Rule 2);
          one tensor's source lives beside its copy until it is replaced (the transient).
        - gradients: one target per trainable parameter (state.py `_send`), as many bytes as
          the parameter, pinned and so rounded; set as .grad, or beside an existing .grad
          until backward ends.
        - Tensor Cache: at its fullest step, the bytes the plan's managed tensors would hold
          beyond the pool's room (the executor's own allowance, its first-step margin
          included) with all of them on the device; at most everything it may offload
          (Plan.offloaded_bytes). An upper estimate: the tests hold it within 0.8-1.25x of
          what the pool takes with state on the device; with state on the host it runs higher.
        - less what PyTorch's pinned allocator holds free for reuse (a dropped plan's
          gradient targets; a store's chunks where that allocator pinned them, host Rule 5):
          MemAvailable does not count those pages.
        The optimizer's state is the user's, made at its first step() after this check: it is
        not counted, only named in the error with what AdamW's two moments would add.
Rule 3: what is available is /proc/meminfo's MemAvailable (Linux), and no more than the room
        the process's cgroup leaves under its memory limit where one is set (a container's:
        MemAvailable sees the whole host, and past the limit the kernel's out-of-memory killer
        ends the process). The cgroup's file pages are counted as room, as MemAvailable counts
        reclaimable cache: an estimate that errs towards running (Rule 2). Elsewhere there is
        no check.
"""

import warnings
from dataclasses import dataclass

import torch

from ..planner.predict import Buffer, live_per_step
from ..units import format_bytes


# (limit, usage, statistics, the statistic counting file pages): cgroup v2, then v1, as the
# process sees its own cgroup in a container (mounted at its root)
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
                 "/sys/fs/cgroup/memory.stat", "file"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                 "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                 "/sys/fs/cgroup/memory/memory.stat", "total_cache"))
_NO_LIMIT = 1 << 60        # cgroup v1 writes "no limit" as 2**63 rounded down to a page


def available_host_bytes() -> int | None:
    """Rule 3: in bytes, or None where the system says nothing. Tests replace it."""
    known = [n for n in (_mem_available(), _cgroup_room()) if n is not None]
    return min(known) if known else None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024            # given in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """What the cgroup's memory limit leaves, its file pages counted as room; None without a
    limit."""
    for limit_file, usage_file, stat_file, file_key in CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read())
            with open(stat_file) as f:
                stats = dict(line.split() for line in f if len(line.split()) == 2)
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= _NO_LIMIT:
            return None
        return max(0, int(limit) - usage + int(stats.get(file_key, 0)))
    return None


@dataclass
class HostNeed:
    """Host bytes a step will take beyond what it holds (Rule 2), by what takes them."""
    state: int = 0
    gradients: int = 0
    cache: int = 0
    cache_at_most: int = 0
    working: int = 0           # the step's own tensors where its device is the host
    reusable: int = 0          # pinned blocks PyTorch's allocator holds free
    optimizer_hint: int = 0    # not counted (Rule 2): AdamW's moments, for the message

    @property
    def total(self) -> int:
        return max(0, self.state + self.gradients + self.cache + self.working - self.reusable)

    def lines(self) -> list:
        cache = ("Tensor Cache: activations offloaded at the fullest step (at most "
                 f"{format_bytes(self.cache_at_most)})")
        state = "model state moved into host memory, with one tensor's transient copy"
        rows = [(self.state, state),
                (self.gradients, "gradients (one host target per trainable parameter)"),
                (self.cache, cache),
                (self.working, "the step's own tensors (its device is the host)"),
                (-self.reusable, "pinned memory PyTorch holds free for reuse")]
        out = [f"  {format_bytes(abs(n)):>10} {'less ' if n < 0 else ''}{what}"
               for n, what in rows if n]
        adamw = format_bytes(self.optimizer_hint)
        out.append("  not counted: the optimizer's state, which is yours and is made at its "
                   f"first step() (AdamW's two moments would add {adamw})")
        return out


def pinned_size(nbytes: int, pin: bool) -> int:
    """What a host allocation of ``nbytes`` takes: pinned ones are rounded to a power of two."""
    return 1 << (nbytes - 1).bit_length() if pin and nbytes > 1 else nbytes


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def state_need(model, pin: bool) -> tuple:
    """(bytes, transient) that to_host_memory (state.py) takes for ``model``'s tensors not yet
    in host memory (pinned, where ``pin``): a device tensor gets a host copy; a pageable host
    tensor a pinned copy, its own pages given back once replaced."""
    taken, transient = 0, 0
    for tensor in (*model.parameters(), *model.buffers()):
        data, n = tensor.data, _nbytes(tensor)
        if data.device.type != "cpu":
            taken += pinned_size(n, pin)
        elif pin and not data.is_pinned():
            taken += pinned_size(n, pin) - n
        else:
            continue
        transient = max(transient, n)
    return taken, transient


def trainable_bytes(model, pin: bool = False) -> int:
    return sum(pinned_size(_nbytes(p), pin) for p in model.parameters() if p.requires_grad)


def cache_need(executor) -> tuple:
    """(bytes, at most) the executor's Tensor Cache holds on the host at its fullest step."""
    plan = executor.plan
    managed = [b for b in plan.buffers if b.managed]
    if not managed or not plan.steps:
        return 0, 0
    # every managed tensor on the device from its creation to its last read
    kept = [Buffer(b.label, b.nbytes, ((b.intervals[0][0], b.intervals[-1][1]),))
            for b in managed]
    live, _ = live_per_step(kept, len(plan.steps))
    beyond = max(nbytes - max(0, executor.allowance(step)) for step, nbytes in enumerate(live))
    at_most = plan.offloaded_bytes
    held = executor.pool.host_memory.capacity          # chunks it took at an earlier step
    return max(0, min(beyond, at_most) - held), at_most


def reusable_pinned_bytes() -> int:
    """Pinned bytes PyTorch's allocator caches unused (0 where it does not say)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return 0
    try:
        stats = stats()
        return max(0, stats["allocated_bytes.current"] - stats["active_bytes.current"])
    except Exception:  # noqa: BLE001 -- an older torch names them otherwise: nothing credited
        return 0


def check_state_fits(model, device: torch.device) -> None:
    """Rule 1 at wrap(state="host"), before the state is moved."""
    pin = device.type == "cuda"
    taken, transient = state_need(model, pin)
    if taken:
        need = HostNeed(state=taken + transient, optimizer_hint=2 * trainable_bytes(model))
        _check(need, "wrapping the model with state='host'")


def check_first_step(executor, model) -> None:
    """Rule 1 before an executor's first step."""
    _check(first_step_need(executor, model), "the first step of this plan")


def first_step_need(executor, model) -> HostNeed:
    """Rule 2 for the executor's first step with ``model``."""
    device = executor.device
    pin = device.type == "cuda"
    need = HostNeed(optimizer_hint=2 * trainable_bytes(model))
    if executor.tier is not None:
        taken, transient = state_need(model, pin)
        need.state = taken + transient if taken else 0
        need.gradients = trainable_bytes(model, pin)
    need.cache, need.cache_at_most = cache_need(executor)
    if device.type == "cpu":
        # state on the device is the model's own, already here; resident copies of state on
        # the host (state.py Rule 7) are new memory
        held = executor.plan.resident_bytes if executor.tier is None else 0
        need.working = max(0, executor.plan.peak_bytes - held)
    if pin:
        need.reusable = reusable_pinned_bytes()
    return need


def _check(need: HostNeed, what: str) -> None:
    available = available_host_bytes()
    if available is None or need.total <= available:
        return
    certain = max(0, need.state + need.gradients + need.working - need.reusable)
    if certain <= available:
        # only the Tensor Cache's estimate is over: it may be (Rule 2: higher with state on
        # the host), and the pool falls back to smaller chunks and pageable memory
        warnings.warn(
            f"superneurons: {what} may need about {format_bytes(need.total)} more host memory "
            f"and {format_bytes(available)} is available; the Tensor Cache's part of that is "
            "an upper estimate, so the step runs:\n" + "\n".join(need.lines()), stacklevel=3)
        return
    raise ValueError(
        f"superneurons: {what} needs about {format_bytes(need.total)} more host memory, and "
        f"{format_bytes(available)} is available (MemAvailable in /proc/meminfo):\n"
        + "\n".join(need.lines()) + "\n"
        "Nothing has been moved. Lower the batch (fewer activations to offload), keep the "
        "state on the device (state='device'), raise the budget (less to offload), or free "
        "host memory or use a host with more.")
