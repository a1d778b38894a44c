"""How much more device memory a CUDA step really uses than its plan says (executor Rule 4).

The plan counts tensors; the device also holds the allocator's rounding and cuDNN's workspaces.
The first steps of a plan read the allocator at layer boundaries and learn the largest excess;
later steps leave that much room beside the pool at every step, and more once a step passed
the budget between readings (passed()).

Only boundaries are read. The allocator's high-water mark between readings also sees autograd's
kernels, but mostly it sees cuDNN's workspaces, which take what the memory cap leaves and
shrink when the pool needs the room: learned as excess, they made VGG16 (batch 282) reserve
6.2 GiB and DenseNet-201 (826) 5.3 GiB beside the pool, against 2.9 and 2.4 from boundaries
(benchmarks/results/claims_high_water_calibration.json).
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


def allocated_bytes(device: torch.device) -> int:
    """torch.cuda.memory_allocated without flattening all the allocator's statistics in Python
    at every call (read at every layer, memory_allocated was part of a host time that filled
    most of a step: 185 of 193 ms, ResNet-50 at batch 140, profile_before.json)."""
    return torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["current"]


class Calibration:
    def __init__(self, device: torch.device, budget_bytes: int):
        self.device = device
        self.slack = int(budget_bytes * SLACK_SHARE)
        self.excess_bytes = None    # what every step adds to the plan, once calibrated
        self.seen_excess = None     # the largest excess the readings found, plus a pass's
                                    # overshoot (passed())
        self.seen_at = None         # the timeline step of that reading, where it is above 0
        self.left = CALIBRATION_STEPS
        self.active = False
        self.seconds = 0.0          # host time spent reading (StepStats)
        self.raised = False         # a step past the budget raised the excess (passed())

    def begin_step(self) -> bool:
        """Whether this step reads the allocator; the excess seen so far applies from now."""
        if self.seen_excess is not None:
            self.excess_bytes = self.seen_excess + self.slack
        self.active = self.left > 0
        self.left = max(0, self.left - 1)
        return self.active

    def adopt(self, other: "Calibration") -> None:
        """What ``other`` learned, as this plan's own, without reading steps (trial.py Rule 2):
        a plan tried beside another runs in the same room beside the same excess."""
        self.seen_excess, self.seen_at = other.seen_excess, other.seen_at
        self.excess_bytes, self.raised = other.excess_bytes, other.raised
        self.left = 0

    def again(self) -> None:
        """An out-of-memory retry: the next steps read the allocator again."""
        self.left = CALIBRATION_STEPS

    def passed(self, overshoot: int) -> None:
        """A step peaked ``overshoot`` bytes past the budget, between readings (untouched.py
        Rule 5): later steps add that much to the excess, the next ones read the allocator
        again, and every later one fits its convolutions' workspaces (executor Rule 9). Once:
        where the plan is at its floor a larger excess makes no room, it only moves more."""
        if self.raised or self.active or self.excess_bytes is None:
            return     # a first or calibrating step made its room by other rules than later ones
        self.raised = True
        self.seen_excess = (self.seen_excess or 0) + overshoot
        self.excess_bytes = self.seen_excess + self.slack
        self.again()

    def outside(self, planned: int) -> int:
        """Real use outside the pool where the plan says ``planned``."""
        if self.excess_bytes is None:
            return int(FIRST_STEP_MARGIN * planned)
        return planned + self.excess_bytes

    def read(self) -> int:
        """What the allocator holds now."""
        began = time.perf_counter()
        try:
            return allocated_bytes(self.device)
        finally:
            self.seconds += time.perf_counter() - began

    def observe(self, step: int, others: int, planned: int, pool: int) -> None:
        """One reading at timeline ``step``'s boundary: ``others``, the user's bytes (optimizer
        state, their tensors); ``planned``, the plan's bytes outside the pool there; ``pool``,
        what the pool holds."""
        excess = max(0, self.read() - others - pool - planned)
        if self.seen_excess is None or excess > self.seen_excess:
            self.seen_excess = excess
            self.seen_at = step if excess else None
