"""When an untouched step holds the budget (module Rule 2), on CUDA.

An untouched step is plain PyTorch. Its liveness plan counts tensors, not what runs between
them: cuDNN's workspaces, which take what the device leaves, kernels' temporaries, and a loss
computed outside the model. ResNet-50 fp32 peaked 3.3% above its liveness plan on the H200 and
GPT-2 small fp32 5.7% (benchmarks/results/untouched_margin.json). A managed step calibrates
such excess and fits its convolutions' workspaces to the budget (executor Rules 4 and 9), and
cuDNN keeps, per shape and thread, the engine a convolution ran with (workspaces.py). So:

Rule 1: a call's first WARMUP_STEPS steps run its managed plan though liveness fits: the
        engines they choose fit the budget, and the untouched steps after run the same ones.
Rule 2: a call then runs untouched only where its plan, the memory the model does not own and a
        margin fit the budget. Until an untouched step of the call has been read, the margin
        is UNTOUCHED_MARGIN of the plan; then it is the latest reading plus the executor's
        slack: the latest, not the largest, and nothing here raises (a call the margin does
        not fit runs its managed plan, whose executor calibrates its own excess). Managed steps
        are not read for the margin (only for Rule 4), so such a call runs untouched again only
        where what the model does not own shrinks, and one whose plan was managed from the
        start (liveness fit, the margin did not) stays managed.
Rule 3: a reading is the device's peak from the step's forward (every wrapper resets the
        statistic there) to the end of its backward, less the plan and what the model did
        not own at the forward. It is dropped where any wrapper reset the statistic meanwhile
        (another model's step on the device, a second micro-batch), or where the call's plan
        was dropped meanwhile.
Rule 4: every step with a budget on CUDA is read, managed or untouched, whatever the policy,
        to say so once per call key where one passed the budget: at its floor a plan can make
        no more room, and what it does not count (kernels' temporaries, allocator rounding, a
        loss computed outside the model) may take the device past the budget. The step runs
        on. Under strict_budget nothing is said: the allocator refuses past the budget inside
        the wrapped step, and what passes it is outside (the caller's loss).
Rule 5: a managed step past its executor's budget (the caller's, or a lower one a trial kept:
        trial.py Rule 7) also tells the executor by how much, once per plan, from a step
        that trusted its calibration (executor Rule 4): the readings at layer
        boundaries missed that much real use between them, which a step later than the
        calibrating ones can meet (ResNet-101 at batch 896 passed by 120 MiB in its third
        step, claims_0495cd2.json, not in its second).
Rule 6: every step with a budget on CUDA (not strict) is also read for the allocator's
        retries from its forward to the end of its backward, less those under the runtime's
        own workspace limits (near_limit.py): a step that had one is said once per call key,
        held budget or not, whatever reset the peak statistic meanwhile.
"""

import warnings

import torch
from torch.utils import _pytree as pytree

from ..units import format_bytes
from .calibration import SLACK_SHARE
from .near_limit import allocator_retries, message
from .room import untouched_holds

# twice the largest share measured (GPT-2 small fp32, 5.7%), rounded up to a power of two
UNTOUCHED_MARGIN = 1 / 8
# one managed step runs every convolution of the call, forward and backward, under its fit
WARMUP_STEPS = 1

# per device, every reset of the peak statistic by any wrapper: a reading spanning one is dropped
_resets: dict = {}
# per device, the allocator's retries at the latest reset (Rule 6)
_retries_at_reset: dict = {}


def _device_key(device: torch.device) -> tuple:
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return device.type, index


def reset_peak(device: torch.device) -> int:
    """Start a step's peak reading (every wrapper's forward, managed or not); returns the
    allocator's retries since the reset before (the step before's: trial.py Rule 7)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    key = _device_key(device)
    _resets[key] = _resets.get(key, 0) + 1
    count, before = allocator_retries(device), _retries_at_reset.get(key, 0)
    _retries_at_reset[key] = count
    return max(0, count - before)


def retries_since_reset(device: torch.device) -> int:
    """The allocator's retries since the latest reset on ``device`` (StepStats; none below 0
    where the caller reset the allocator's own counts since)."""
    return max(0, allocator_retries(device) - _retries_at_reset.get(_device_key(device), 0))


def peak_allocated_bytes(device: torch.device) -> int | None:
    """The allocator's peak since the last reset; None off CUDA or without its statistics
    (PYTORCH_NO_CUDA_MEMORY_CACHING=1 reads zero)."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    peak = stats["allocated_bytes"]["all"]["peak"] if "allocated_bytes" in stats else 0
    return peak or None


class UntouchedWatch:
    """Per call key, its managed warm-up, what its untouched steps really used beyond the
    plan, and whether a step passed the budget (Rules 1-5)."""

    def __init__(self):
        self.warmups: dict = {}      # key -> managed steps run while liveness fit (Rule 1)
        self.excess: dict = {}       # key -> the latest reading (may be below zero)
        self._pending: list = []     # hook handles of the step being watched
        self._forgotten = 0          # forget() calls: a reading queued before one is dropped
        self.passed: set = set()     # keys whose step passed the budget and was said (Rule 4)
        self.retried: set = set()    # keys whose step's allocator retried, said (Rule 6)

    def warm(self, key) -> bool:
        """Rule 1: whether ``key``'s warm-up is done."""
        return self.warmups.get(key, 0) >= WARMUP_STEPS

    def warming(self, key) -> None:
        """A managed step of ``key`` is about to run."""
        self.warmups[key] = self.warmups.get(key, 0) + 1

    def holds(self, key, plan_peak_bytes: int, budget_bytes: int, foreign: int) -> bool:
        """Rule 2: whether an untouched step of ``key`` fits the budget with its margin beside
        ``foreign`` bytes the model does not own."""
        excess = self.excess.get(key)
        margin = int(UNTOUCHED_MARGIN * plan_peak_bytes) if excess is None else \
            max(0, excess) + int(SLACK_SHARE * budget_bytes)
        return untouched_holds(plan_peak_bytes + margin, budget_bytes, foreign)

    def watch(self, key, out, device: torch.device, predicted: int | None,
              budget_bytes: int | None, passed=None, own_budget_bytes: int | None = None
              ) -> None:
        """After a forward that returned ``out``: read the step's peak once its backward ends,
        against ``budget_bytes`` (Rule 4; None: not) and, for an untouched step whose policy
        decides it, against ``predicted`` (its plan and the bytes the model did not own; None:
        not). ``passed``, where given, is called with the bytes by which the step passed the
        executor's ``own_budget_bytes`` (None: ``budget_bytes``; Rule 5).
        A hook on each output that has a backward only sees the first gradient pass and
        queues the reading for the backward's end. The wrapper's forward has cancelled the
        watch of any earlier step (one never backpropagated is not read)."""
        retry_budget = None if key in self.retried else budget_bytes      # said once (Rule 6)
        if key in self.passed and passed is None:
            budget_bytes = None                  # said once (Rule 4): not read for it again
        if predicted is None and budget_bytes is None and retry_budget is None:
            return
        began = (_resets.get(_device_key(device)), self._forgotten)
        retries_began = _retries_at_reset.get(_device_key(device), 0)     # this step's (Rule 6)
        queued = []

        def on_gradient(grad):
            if not queued:
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._ended(key, device, predicted, budget_bytes, began, passed,
                                        retry_budget, retries_began, own_budget_bytes))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                self._pending.append(tensor.register_hook(on_gradient))

    def cancel(self) -> None:
        """Remove the hooks of the step being watched (an output returned again by a later
        step would otherwise gather them)."""
        for handle in self._pending:
            handle.remove()
        self._pending.clear()

    def forget(self, key) -> None:
        """``key``'s plan was dropped: a step of it in flight is not read either."""
        self.cancel()
        self._forgotten += 1
        self.warmups.pop(key, None)
        self.excess.pop(key, None)
        self.passed.discard(key)
        self.retried.discard(key)

    def _ended(self, key, device: torch.device, predicted: int | None,
               budget_bytes: int | None, began: tuple, passed, retry_budget: int | None,
               retries_began: int, own_budget_bytes: int | None = None) -> None:
        self.cancel()
        # Rule 6 from this step's own count: another wrapper's reset meanwhile moves no count
        retries = max(0, allocator_retries(device) - retries_began)
        if retries and retry_budget is not None and key not in self.retried:
            self.retried.add(key)
            warnings.warn(message(device, retries, retry_budget), stacklevel=1)
        if began != (_resets.get(_device_key(device)), self._forgotten):    # Rule 3
            return
        peak = peak_allocated_bytes(device)
        if peak is None:
            return
        if predicted is not None:
            self.excess[key] = peak - predicted
        own = budget_bytes if own_budget_bytes is None else own_budget_bytes
        if passed is not None and own is not None and peak > own:              # Rule 5
            passed(peak - own)
        if budget_bytes is None or peak <= budget_bytes:
            return
        if key not in self.passed:                                              # Rule 4
            self.passed.add(key)
            warnings.warn(
                f"superneurons: a training step peaked at {format_bytes(peak)} on {device}, "
                f"{format_bytes(peak - budget_bytes)} over the budget of "
                f"{format_bytes(budget_bytes)}: memory its plan does not count (kernels' "
                "temporaries, cuDNN's workspaces, allocator rounding, a loss computed outside "
                "the model). The step ran; to stay within the budget lower the batch, or pass "
                "strict_budget=True (the allocator then refuses past the budget)",
                stacklevel=1)
