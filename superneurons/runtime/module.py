"""wrap(): a drop-in nn.Module whose training steps run within a memory budget.

Rule 1: the plan is made at the first forward for each input shape and dtype, and autocast
        state, and reused (a step under bf16 autocast holds about half the bytes).
Rule 2: when the budget holds the whole step with liveness alone, the model runs untouched:
        no hook, no copy, no replay (plain PyTorch already frees tensors after last use).
Rule 3: a budget too small for the policy is a ValueError before the step runs, naming the
        smallest budget that would work.
Rule 4: no grad (evaluation) runs the model untouched.
"""

import torch
from torch import nn

from ..capture import capture
from ..capture.autocast import autocast_state
from ..planner import Policy, parse_policy, parse_strategy, plan_graph
from ..units import format_bytes, parse_bytes
from .executor import Executor, foreign_bytes
from .stats import StepStats

_MANAGED = (Policy.OFFLOAD, Policy.RECOMPUTE, Policy.SUPERNEURONS)


class SuperNeuronsModule(nn.Module):
    def __init__(self, model: nn.Module, policy, budget, strategy):
        super().__init__()
        self.model = model
        self.policy = parse_policy(policy)
        self.strategy = parse_strategy(strategy)
        self.budget_bytes = parse_bytes(budget)
        self._executors: dict = {}
        self._last = None

    def plan_for(self, x: torch.Tensor):
        """The (cached) plan for inputs like ``x``: (plan, executor or None for plain runs)."""
        autocast = autocast_state(x.device.type)
        key = (tuple(x.shape), x.dtype, x.device, x.requires_grad, self.model.training, autocast)
        if key not in self._executors:
            self._executors[key] = self._make(x, autocast)
        return self._executors[key]

    def _make(self, x: torch.Tensor, autocast):
        graph = capture(self.model, x, autocast)
        budget = self.budget_bytes
        if budget is not None and x.device.type == "cuda":
            budget -= foreign_bytes(graph, x)
        if budget is not None and self.policy in _MANAGED:
            try:
                return plan_graph(graph, Policy.LIVENESS, budget, self.strategy), None  # Rule 2
            except ValueError:
                pass
        plan = plan_graph(graph, self.policy, budget, self.strategy)     # Rule 3 raises here
        if plan.policy not in _MANAGED:
            return plan, None
        if self.budget_bytes is None:
            return plan, Executor(plan, x.device, plan.peak_bytes, count_foreign=False)
        return plan, Executor(plan, x.device, self.budget_bytes)

    def forward(self, x, *args, **kwargs):
        if args or kwargs or not isinstance(x, torch.Tensor):
            raise ValueError("a superneurons-wrapped model takes one tensor input; pass the "
                             "others to the module's constructor")
        if not torch.is_grad_enabled():
            return self.model(x)                                         # Rule 4
        plan, executor = self.plan_for(x)
        if x.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(x.device)
        self._last = (plan, executor, x.device)
        if executor is None:
            return self.model(x)
        executor.pool.offloaded_bytes = executor.pool.prefetched_bytes = 0
        executor.pool.cache_hits = executor.pool.cache_misses = 0
        executor.recomputed_layers = executor.accounted_peak = 0
        try:
            return executor.run((x,))
        except torch.OutOfMemoryError as error:
            executor.release()
            raise RuntimeError(
                f"out of device memory inside a superneurons step (policy {plan.policy}, budget "
                f"{format_bytes(executor.budget_bytes)}): something outside the plan holds memory "
                "(other tensors, another process, fragmentation). The model and optimizer are "
                "unchanged; lower the budget or the batch, or set PYTORCH_CUDA_ALLOC_CONF="
                "expandable_segments:True") from error

    @property
    def stats(self) -> StepStats | None:
        if self._last is None:
            return None
        plan, executor, device = self._last
        measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        cuda = measured > 0              # zero without the caching allocator: not a measurement
        if executor is None:
            return StepStats(str(plan.policy), self.budget_bytes, plan.peak_bytes,
                             measured if cuda else plan.peak_bytes, 0, 0, 0, 0, 0, cuda)
        pool = executor.pool
        return StepStats(str(plan.policy), self.budget_bytes, plan.peak_bytes,
                         measured if cuda else executor.accounted_peak, pool.offloaded_bytes,
                         pool.prefetched_bytes, pool.cache_hits, pool.cache_misses,
                         executor.recomputed_layers, cuda)


def wrap(model: nn.Module, policy="superneurons", budget=None, *, strategy="cost-aware"):
    """Wrap ``model`` so its training steps run within ``budget`` (bytes or e.g. "12GiB")."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"wrap() takes an nn.Module, not {type(model).__name__}")
    return SuperNeuronsModule(model, policy, budget, strategy)
