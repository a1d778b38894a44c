"""With a budget, replay only what the budget needs.

A recomputing policy without a budget replays every cheap segment: that is its floor. With a
budget above the floor, some segments can keep their tensors instead. On a modern GPU a replay
costs compute and a move to the host costs far more (DESIGN.md), so the goal is the fewest
replays whose plan fits the budget *with nothing moved*: segments stop replaying, least useful
first (fewest bytes saved per byte a replay reads and writes), while the plan that keeps every
checkpoint on the device still fits. Where even replaying everything does not fit without moving
data, the plan stays as it is and the Tensor Cache moves only what the budget forces out.
"""

from .policy import Policy

# what the byte model misses (allocator rounding, saved tensors sized differently off the meta
# device) should not turn "nothing moves" into a few evictions: keep 3% of the budget spare
_SLACK = 0.97


def _usefulness(plan, segment) -> float:
    graph = plan.graph
    inside = set(segment.layers)
    saved = sum(graph.storages[s].nbytes for s in
                {graph.values[v].storage for l in segment.layers for v in graph.layers[l].outputs
                 if graph.storages[graph.values[v].storage].creator in inside})
    work = sum(plan.costs.forward[l] for l in segment.layers)
    return saved / max(1, work)


def replay_only_what_the_budget_needs(plan, budget: int, build, candidates: list):
    """``build(policy, segments)`` makes a plan. Tries ``plan``'s own segments and
    ``candidates`` (the segments that keep the most on the device: policy Rule 7 off); returns the
    plan with the fewest replays among those that fit with nothing moved, else ``plan``."""
    fitting = [t for t in (_trim(plan, list(plan.segments), budget, build),
                           _trim(plan, candidates, budget, build)) if t is not None]
    if not fitting:
        return plan             # something must move: the Tensor Cache decides what, when
    return min(fitting, key=lambda t: t.num_extra_computations)


def _trim(plan, segments: list, budget: int, build):
    if not segments:
        return None
    by_use = sorted(segments, key=lambda s: _usefulness(plan, s))

    def fits_on_device(num_dropped: int) -> bool:
        return build(Policy.RECOMPUTE, by_use[num_dropped:]).peak_bytes <= _SLACK * budget

    if not fits_on_device(0):
        return None
    low, high = 0, len(by_use)                  # fits_on_device(low) holds
    while low < high:
        middle = (low + high + 1) // 2
        if fits_on_device(middle):
            low = middle
        else:
            high = middle - 1
    kept = {s.index for s in by_use[low:]}
    return build(plan.policy, [s for s in segments if s.index in kept])
