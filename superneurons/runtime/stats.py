"""What the last training step did, as ``wrapped.stats``."""

from dataclasses import asdict, dataclass


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
    # forward layers at which the host waited for the compute stream (executor Rule 10)
    paced_layers: int = 0
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
