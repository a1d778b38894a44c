"""A readable account of a plan: per layer, what is kept, offloaded or recomputed, and why."""

from ..units import format_bytes
from .policy import CHECKPOINT_KINDS, Action


def _reason(plan, layer, segment) -> str:
    if segment is not None:
        whole = any(plan.graph.layers[l].kind in CHECKPOINT_KINDS for l in segment.layers)
        what = f"{layer.kind} in a block replayed whole" if whole else f"cheap {layer.kind}"
        return (f"{what}: dropped after forward, replayed from segment {segment.index}'s "
                f"inputs ({segment.strategy})")
    if not plan.policy.recomputes:
        return "kept: this policy recomputes nothing"
    if layer.kind in CHECKPOINT_KINDS:
        return f"checkpoint: {layer.kind} is expensive to recompute"
    return ("checkpoint: its output ends a block, feeds another segment, is a model output, or "
            "is written in place")


def explain(plan) -> str:
    graph, segment_of = plan.graph, plan.segment_of()
    header = (f"{plan.policy} plan: {len(plan.order)} layers, predicted peak "
              f"{format_bytes(plan.peak_bytes)} (resident {format_bytes(plan.resident_bytes)}, "
              f"l_peak {format_bytes(plan.max_layer_bytes)})")
    if plan.policy.recomputes:
        header += f", {plan.num_extra_computations} extra layer computations ({plan.strategy})"
    rows = [header, f"{'step':>5}  {'layer':<32} {'kind':<8} {'l_f':>10} {'l_b':>10}  "
                    f"{'output':<9} why"]
    for step, layer_index in enumerate(plan.order):
        layer = graph.layers[layer_index]
        storages = {graph.values[v].storage for v in layer.outputs
                    if graph.storages[graph.values[v].storage].creator == layer_index}
        actions = {plan.actions[s] for s in storages}
        action = (actions.pop() if len(actions) == 1 else
                  "alias" if not actions else "mixed")
        rows.append(f"{step:>5}  {layer.name[:32]:<32} {str(layer.kind):<8} "
                    f"{format_bytes(plan.costs.forward[layer_index]):>10} "
                    f"{format_bytes(plan.costs.backward[layer_index]):>10}  {str(action):<9} "
                    f"{_reason(plan, layer, segment_of.get(layer_index))}")
    offloaded = sum(1 for a in plan.actions if a is Action.OFFLOAD)
    rows.append(f"{offloaded} storages may move to host memory "
                f"({format_bytes(plan.offloaded_bytes)}), moved only when the budget needs room")
    return "\n".join(rows)
