"""A step that held its budget and still came close to running out of memory, on CUDA.

The budget counts allocated bytes. The caching allocator also holds memory free between
allocations, and with expandable segments it maps the device in pages of 20 MiB (2 MiB for
requests of 1 MiB or less): a page that holds one live tensor stays mapped, and the rest of it
serves only requests that fit there; a large one needs pages newly mapped, under the limit.
The Tensor Cache keeps tensors on the device while the budget has room (pool Rule 1), so the
memory held free beside them must fit between the budget and the limit. DenseNet-BC from depth
2,242 within 11.5 GiB of a 12 GiB limit runs out of memory so in the step after the first, its
plan within the budget, 1.3-2.3 GiB held free in hundreds of pieces between the activations and
the cache's tensors (gradients and momentum kept in a buffer of their own change nothing:
BENCHMARKS.md).

When a request finds the device's limit reached, the allocator returns all it holds free and
tries again (a retry: it synchronizes the device, so the host stops running ahead of it, and
a step with several is slower: bf16 ResNet-50 at a quarter of plain's peak, its limit 4% above
the budget, retried 6-15 times a step and took 13% longer than with a limit 15% higher); when
that fails too, the step runs out of memory, inside autograd's kernels beyond the runtime's
reach (executor Rule 5). A retry is the
warning the runtime can read: the count since the step's forward, less the retries under the
runtime's own workspace limits (executor Rule 9), is in its stats, and the first step of a call
that had one says so (untouched.py Rule 6). Not seen: where the caller set max_split_size_mb,
the allocator first returns cached blocks without counting a retry. After a step that did run
out of memory there, `superneurons train` gives the same advice (out_of_memory()).
"""

import torch

from ..units import format_bytes


# per CUDA device index: retries made while the runtime's own limit for a convolution's
# workspace was in force (workspaces.py), and the count when the one in force now began. Under
# that limit a workspace the allocator cannot give is refused and counted as a retry, and
# PyTorch runs an engine that needs less: the runtime's doing, not the device's limit reached.
_own: dict = {}
_began: dict = {}


def counted(index: int) -> int:
    """The caching allocator's count of retries on device ``index``."""
    return torch.cuda.memory_stats_as_nested_dict(index).get("num_alloc_retries", 0)


def own_limit_began(index: int, count: int) -> None:
    """The runtime's workspace limit is in force on ``index`` from now; ``count``: counted()."""
    _began[index] = count


def own_limit_ended(index: int) -> None:
    began = _began.pop(index, None)
    if began is not None:
        _own[index] = _own.get(index, 0) + counted(index) - began


def allocator_retries(device: torch.device) -> int:
    """The caching allocator's count of requests that found its limit reached, returned the
    memory it held free and tried again, less those under the runtime's own workspace limits
    (0 off CUDA or without the caching allocator)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    now = counted(index)
    under_own = _own.get(index, 0) + (now - _began[index] if index in _began else 0)
    return now - under_own


def limit_bytes(device: torch.device) -> int:
    """What the allocator may reserve on ``device``: the caller's per-process fraction of it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = torch.cuda.get_per_process_memory_fraction(index) \
        if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    return int(total * fraction)


def reads_allocator(device: torch.device) -> bool:
    """Whether ``device``'s memory comes from the CUDA caching allocator, which peaks() reads."""
    return device.type == "cuda"


def peaks(device: torch.device) -> tuple:
    """The step's peaks reserved and allocated on ``device`` and the allocator's limit."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return (stats["reserved_bytes"]["all"]["peak"], stats["allocated_bytes"]["all"]["peak"],
            limit_bytes(device))


def advice(budget_bytes: int | None, reserved: int, allocated: int, limit: int) -> str:
    """What to change after a step whose allocator reserved ``reserved`` bytes at its peak for
    ``allocated`` allocated under ``limit``."""
    # the allocator held reserved - allocated beyond the tensors at their peaks; the budget
    # that leaves it that much below the limit (a lower bound: reserved stopped at the limit)
    fitting = limit - (reserved - allocated)
    if budget_bytes is None:
        return f"give a budget of {format_bytes(fitting)} or less, or raise the limit"
    if fitting < budget_bytes:
        return f"lower the budget to {format_bytes(fitting)} or less, or raise the limit"
    return ("memory beside the plan (the loss, other tensors, another wrapper) took the room: "
            "free it, or lower the budget")


def message(device: torch.device, retries: int, budget_bytes: int) -> str:
    """What to tell the user of a step on ``device`` with ``retries`` retries, from the step's
    peaks."""
    return said(device, retries, budget_bytes, *peaks(device))


def said(device, retries: int, budget_bytes: int, reserved: int, allocated: int,
         limit: int) -> str:
    """message() from the step's peaks reserved and allocated and the allocator's limit."""
    return (f"superneurons: in a training step on {device} the caching allocator reached its "
            f"limit of {format_bytes(limit)} {retries} time(s) and returned the memory it held "
            f"free to go on, waiting for the device each time, which slows the step (at their "
            f"peaks it reserved {format_bytes(reserved)} for "
            f"{format_bytes(allocated)} allocated; the budget is "
            f"{format_bytes(budget_bytes)}). Memory it holds but cannot reuse (fragmentation) "
            f"brought the step close to running out of memory, and a later step may: "
            f"{advice(budget_bytes, reserved, allocated, limit)}")


def said_by_torch(error: Exception) -> str:
    """The first line of PyTorch's own message (what was asked, what was free), cut short."""
    said = str(error).strip()
    return said.splitlines()[0][:200] if said else ""


def out_of_memory(device, step: int, budget_bytes: int | None, error: Exception, reserved: int,
                  allocated: int, limit: int) -> str:
    """What to tell the user of training step ``step`` that ran out of memory where the runtime
    cannot retry (autograd's kernels: executor Rule 5), from its peaks (peaks())."""
    budget = f"the budget is {format_bytes(budget_bytes)}" if budget_bytes else "no budget"
    return (f"training step {step} on {device} ran out of memory in PyTorch's own kernels, "
            f"where the runtime cannot retry ({said_by_torch(error)}). At the step's peaks "
            f"the caching allocator reserved {format_bytes(reserved)} for "
            f"{format_bytes(allocated)} allocated, under its limit of {format_bytes(limit)}; "
            f"{budget}: "
            f"{advice(budget_bytes, reserved, allocated, limit)}.")


def bring_back_out_of_memory(policy, budget_bytes: int, planned: int, foreign: int,
                             held: tuple | None, error: Exception) -> str:
    """What to tell the user of a backward step that ran out of memory twice bringing a saved
    tensor back (executor Rule 5): what the plan counts at that step beside what the device
    held, ``held`` (allocated, reserved) where the allocator was read, so that the cause shows:
    real use past the plan, or memory the allocator holds but cannot reuse."""
    counted = (f"the plan counts {format_bytes(planned)} at this step and the tensors the "
               f"model does not own {format_bytes(foreign)}")
    if held is None:
        where = counted
    else:
        allocated, reserved = held
        where = (f"{format_bytes(allocated)} were allocated ({format_bytes(reserved)} "
                 f"reserved) where {counted}: " +
                 ("real use passed the plan (allocator rounding, workspaces, temporaries "
                  "it does not count), with nothing left that the pool could move"
                  if allocated > planned + foreign else
                  "the request did not fit beside memory the allocator holds but cannot reuse, "
                  "or another process's"))
    return (f"out of device memory in the backward of a superneurons step (policy {policy}, "
            f"budget {format_bytes(budget_bytes)}) while bringing a saved tensor back, after "
            f"moving out all the pool could ({said_by_torch(error)}); {where}. The parameters "
            "are unchanged (the optimizer has not stepped) but this step's gradients are partial: "
            "zero them, then lower the budget or the batch")


def managed_out_of_memory(policy, budget_bytes: int, strict_budget: bool) -> str:
    """What to tell the user of a managed step whose layer ran out of memory twice (executor
    Rule 5)."""
    return (f"out of device memory inside a superneurons step (policy {policy}, budget "
            f"{format_bytes(budget_bytes)}): something outside the plan holds memory (other "
            "tensors, another process, fragmentation). The optimizer has not stepped (running "
            "statistics this forward updated have moved); " +
            ("raise the budget or leave strict_budget off (it limits the allocator to the "
             "budget, memory it holds free included)" if strict_budget else
             "lower the budget or the batch, or set "
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))


def untouched_out_of_memory(budget_bytes: int) -> str:
    """What to tell the user of an untouched step that ran out of memory under strict_budget
    (module Rule 8)."""
    return (f"out of device memory in an untouched step under strict_budget (budget "
            f"{format_bytes(budget_bytes)}): the model's real use passed its plan between "
            "layers, and the allocator is limited to the budget. Raise the budget, or leave "
            "strict_budget off (the step may then pass the budget there)")
