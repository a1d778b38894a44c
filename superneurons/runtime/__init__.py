"""The runtime: executes training steps as the Plan says (Tensor Pool, LRU cache, replays)."""

from .module import SuperNeuronsModule, wrap
from .stats import StepStats

__all__ = ["wrap", "SuperNeuronsModule", "StepStats"]
