"""What the last training step did, as ``wrapped.stats``."""

from dataclasses import asdict, dataclass

import torch

from .untouched import retries_since_reset


@dataclass(frozen=True)
class StepStats:
    policy: str
    budget_bytes: int | None
    predicted_peak_bytes: int
    peak_bytes: int            # CUDA: measured max_memory_allocated; CPU: pool-accounted
    offloaded_bytes: int
    prefetched_bytes: int
    cache_hits: int
    cache_misses: int
    recomputed_layers: int
    measured: bool             # True where peak_bytes is a device measurement
    # host seconds of the step's first-step work: taking host memory for offloads (pinning on
    # CUDA) and reading the allocator while calibrating (executor Rule 4)
    host_memory_seconds: float = 0.0
    calibration_seconds: float = 0.0
    # with state on the host: bytes of parameters sent to the device and gradients sent back
    state_moved_bytes: int = 0
    # convolutions before which the compute stream waited for offloads in flight, to run
    # beside the pool they were fitted beside (executor Rule 10)
    drained_convolutions: int = 0
    # CUDA: requests that found the caching allocator's limit reached and were tried again
    # after it returned the memory it held free, from the step's forward until these stats
    # are read, less those under the runtime's own workspace limits (near_limit.py)
    allocator_retries: int = 0
    # host seconds of making the plan, on the first step that runs it (0 on later steps; a
    # plan made by plan_for() before any step is reported by the step that first runs it):
    # capturing the model, measuring the device's rates (once per device and TF32 setting,
    # unless kept on disk by an earlier process: runtime/machine.py), planning (the
    # executor's set-up included), and checking that the step's host memory fits
    # (host_memory Rule 1)
    capture_seconds: float = 0.0
    planning_seconds: float = 0.0
    host_check_seconds: float = 0.0
    machine_seconds: float = 0.0
    # the step ran a plan tried on the machine, or the chosen one while timed (module Rule 10)
    trying: bool = False
    # CUDA: the device bytes the model does not own (the optimizer's state, the caller's other
    # tensors), read before the step: the budget holds them beside the plan's predicted peak,
    # and the measured peak counts them
    foreign_bytes: int = 0

    @property
    def setup_seconds(self) -> float:
        """Host seconds of the step's work beyond running the model: making the plan, taking
        host memory, reading the allocator (mostly the first step's)."""
        return (self.capture_seconds + self.machine_seconds + self.planning_seconds
                + self.host_check_seconds + self.host_memory_seconds + self.calibration_seconds)

    def as_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key):
        return getattr(self, key)


def step_stats(plan, executor, device: torch.device, budget_bytes: int | None,
               made: dict) -> StepStats:
    """The stats of the step just run by ``executor`` (None: the model ran untouched) of
    ``plan`` on ``device``; ``made``: the seconds its plan's making took, on its first step."""
    measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    cuda = measured > 0              # zero without the caching allocator: not a measurement
    retries = retries_since_reset(device)
    if executor is None:
        return StepStats(str(plan.policy), budget_bytes, plan.peak_bytes,
                         measured if cuda else plan.peak_bytes, 0, 0, 0, 0, 0, cuda,
                         allocator_retries=retries, **made)
    pool = executor.pool
    return StepStats(str(plan.policy), budget_bytes, plan.peak_bytes,
                     measured if cuda else executor.accounted_peak, pool.offloaded_bytes,
                     pool.prefetched_bytes, pool.cache_hits, pool.cache_misses,
                     executor.recomputed_layers, cuda, pool.host_memory.taking_seconds,
                     executor.calibration_seconds,
                     executor.tier.moved_bytes if executor.tier is not None else 0,
                     executor.drained_convolutions, retries,
                     **{**made, "foreign_bytes": executor.foreign_bytes})
