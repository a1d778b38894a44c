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

    def as_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key):
        return getattr(self, key)
