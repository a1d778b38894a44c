"""How much more device memory a CUDA step really uses than its plan says (executor Rule 4).

The plan counts tensors; the device also holds the allocator's rounding and cuDNN's workspaces.
The first steps of a plan read the allocator at layer boundaries and learn the excess at each;
later steps leave, at each step, the excess seen there beside the pool (at a step not read, the
larger of the readings around it), and SLACK_SHARE of the budget everywhere. Per step, not the
largest at every step: the excess sits where the plan's count misses a tensor, and where the pool
is fullest it was often none. ResNet-50 (batch 192, fp32, budget 11.7 GiB) showed 0.29 GiB in the
backward of its first stage and 0 where the pool held most; left at every step, that 0.29 made
the pool move 0.57 GiB each way a step (benchmarks/results/diagnose_excess_resnet50_fp32_0.75.json).

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


class RangeMax:
    """max(values[first..last]) in O(1) after O(n log n) set-up (a sparse table): the pool asks
    for it for every tensor it considers prefetching, on networks of thousands of steps."""

    def __init__(self, values: list):
        self.levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            previous = self.levels[-1]
            self.levels.append([max(previous[i], previous[i + width])
                                for i in range(len(previous) - width)])
            width *= 2

    def __call__(self, first: int, last: int) -> int:
        level = (last - first + 1).bit_length() - 1
        table = self.levels[level]
        return max(table[first], table[last - (1 << level) + 1])


class Calibration:
    """``planned``: the plan's bytes outside the pool at each timeline step."""

    def __init__(self, device: torch.device, budget_bytes: int, planned: list):
        self.device = device
        self.slack = int(budget_bytes * SLACK_SHARE)
        self.planned = list(planned)
        self.planned_max = RangeMax(self.planned)
        self.real_max = None        # once calibrated: RangeMax of planned + excess, per step
        self.seen = {}              # timeline step -> the largest excess read there
        self.left = CALIBRATION_STEPS
        self.active = False
        self.seconds = 0.0          # host time spent reading (StepStats)

    @property
    def seen_excess(self):
        """The largest excess the readings found (None before any reading)."""
        return max(self.seen.values()) if self.seen else None

    @property
    def seen_at(self):
        """The timeline step of the largest excess, where it is above 0."""
        largest = self.seen_excess
        return next(s for s, e in self.seen.items() if e == largest) if largest else None

    @property
    def excess_bytes(self):
        """The most any calibrated step leaves beside the pool (None before calibration)."""
        return None if self.real_max is None else max(self._excess_per_step()) + self.slack

    def begin_step(self) -> bool:
        """Whether this step reads the allocator; the excess seen so far applies from now."""
        if self.seen:
            self.real_max = RangeMax([p + e for p, e in
                                      zip(self.planned, self._excess_per_step())])
        self.active = self.left > 0
        self.left = max(0, self.left - 1)
        return self.active

    def _excess_per_step(self) -> list:
        """The excess seen at each step; at a step not read, the larger of the nearest
        readings before and after it."""
        read = sorted(self.seen)
        result, index = [], 0
        for step in range(len(self.planned)):
            while index < len(read) and read[index] < step:
                index += 1
            if index < len(read) and read[index] == step:
                result.append(self.seen[step])
                continue
            around = [self.seen[read[i]] for i in (index - 1, index) if 0 <= i < len(read)]
            result.append(max(around, default=0))
        return result

    def again(self) -> None:
        """An out-of-memory retry: the next steps read the allocator again."""
        self.left = CALIBRATION_STEPS

    def outside(self, step: int, until: int) -> int:
        """Real use outside the pool from timeline ``step`` to ``until``, at its most."""
        if self.real_max is None:
            return int(FIRST_STEP_MARGIN * self.planned_max(step, until))
        return self.real_max(step, until) + self.slack

    def read(self) -> int:
        """What the allocator holds now."""
        began = time.perf_counter()
        try:
            return allocated_bytes(self.device)
        finally:
            self.seconds += time.perf_counter() - began

    def observe(self, step: int, others: int, planned: int, pool: int) -> None:
        """One reading at timeline ``step``'s boundary: ``others``, the user's bytes (optimizer
        state, their tensors); ``planned``, the plan's bytes outside the pool there (awaiting
        pool storages included); ``pool``, what the pool holds."""
        excess = max(0, self.read() - others - pool - planned)
        self.seen[step] = max(excess, self.seen.get(step, 0))
