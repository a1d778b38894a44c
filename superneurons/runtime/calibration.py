"""How much more device memory a CUDA step really uses than its plan says (executor Rule 4).

The plan counts tensors; the device also holds the allocator's rounding, cuDNN's workspaces and
the transients of autograd's own kernels (a matmul's backward allocates both gradients before
either input is freed). The first steps of a plan read the allocator and learn the largest
excess; later steps leave that much room beside the pool at every step.

Two readings make one observation:
- now: what is allocated at a layer boundary, less the pool and the user's tensors, against
  what the plan says for that step;
- between: the allocator's high-water mark. When it moved since the last reading, the highest
  point lay between the two readings, so it is compared with the most the plan allows there
  (its largest step in the window, and the most the pool held in it). This is what sees
  autograd's kernels and the user's loss, which run where no layer boundary is: a 1.1B decoder
  filled the pool's room and then went 128 MiB over its budget inside such a kernel
  (benchmarks/results/snapshot_decoder_1b_streamed_oom.json).

The high-water mark is read, never reset: resetting it would change what
torch.cuda.max_memory_allocated tells the user about their own step. A window whose highest
point stays below an earlier one goes unseen; where the pool fills its room that is the window
with the smaller excess, so the largest is still learned.
"""

import time

import torch

# steps that read the allocator at every layer
CALIBRATION_STEPS = 2
# before any calibration, real use is taken as this multiple of the plan: with 1.25 Inception-v4's
# first step (batch 400, budget 10.5 GiB) peaked at 11.5 GiB in autograd's kernels, between the
# readings, and at 11.5 GiB it ran out of memory there (benchmarks/results/
# diagnose_inception_v4_3_budgets.json); with 1.5, batches 381 and 400 fit
# (diagnose_inception_v4.json)
FIRST_STEP_MARGIN = 1.5
# cuDNN's workspaces come and go between readings: the calibrated excess keeps this share of the
# budget above the largest seen
SLACK_SHARE = 1 / 50


def allocator_reading(device: torch.device) -> tuple[int, int]:
    """(bytes allocated now, the allocator's high-water mark) from one read of its statistics,
    without flattening them all in Python (read at every layer, memory_allocated was part of a
    host time that filled most of a step: 185 of 193 ms, ResNet-50 at batch 140,
    profile_before.json)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]
    return stats["current"], stats["peak"]


def allocated_bytes(device: torch.device) -> int:
    return allocator_reading(device)[0]


class Calibration:
    def __init__(self, device: torch.device, budget_bytes: int):
        self.device = device
        self.slack = int(budget_bytes * SLACK_SHARE)
        self.excess_bytes = None    # what every step adds to the plan, once calibrated
        self.seen_excess = None     # the largest excess the readings found
        self.left = CALIBRATION_STEPS
        self.active = False
        self.seconds = 0.0          # host time spent reading (StepStats)
        self.high_water = self.since = 0

    def begin_step(self) -> bool:
        """Whether this step reads the allocator; the excess seen so far applies from now."""
        if self.seen_excess is not None:
            self.excess_bytes = self.seen_excess + self.slack
        self.active = self.left > 0
        self.left = max(0, self.left - 1)
        if self.active:
            self.since = 0
            self.high_water = self.read()[1]
        return self.active

    def again(self) -> None:
        """An out-of-memory retry: the next steps read the allocator again."""
        self.left = CALIBRATION_STEPS

    def outside(self, planned: int) -> int:
        """Real use outside the pool where the plan says ``planned``."""
        if self.excess_bytes is None:
            return int(FIRST_STEP_MARGIN * planned)
        return planned + self.excess_bytes

    def read(self) -> tuple[int, int]:
        began = time.perf_counter()
        try:
            return allocator_reading(self.device)
        finally:
            self.seconds += time.perf_counter() - began

    def observe(self, step: int, others: int, planned_now: int, planned_since, pool_now: int,
                pool_most: int) -> None:
        """One reading at timeline ``step``. ``others``: the user's bytes (optimizer state,
        their tensors); ``planned_now``: the plan's bytes outside the pool at ``step``;
        ``planned_since(first, last)``: the most it has over those steps; ``pool_now`` and
        ``pool_most``: what the pool holds, and the most it held since the last reading."""
        current, high_water = self.read()
        excess = current - others - pool_now - planned_now
        if high_water != self.high_water:   # rose since the last reading, or the user reset it
            first = min(self.since, step)
            excess = max(excess, high_water - others - pool_most - planned_since(first, step))
        self.high_water, self.since = high_water, step
        self.seen_excess = max(self.seen_excess or 0, excess)
