"""A readable account of a plan: per layer, what is kept, offloaded or recomputed, and why."""

from ..units import format_bytes
from .policy import CHECKPOINT_KINDS, Action


def _reason(plan, layer, segment) -> str:
    if segment is not None:
        block = any(plan.graph.layers[l].kind in CHECKPOINT_KINDS for l in segment.layers)
        what = f"{layer.kind} in a replayed block (whole, cut or merged)" if block else \
            f"cheap {layer.kind}"
        return (f"{what}: dropped after forward, replayed from segment {segment.index}'s "
                f"inputs ({segment.strategy})")
    if not plan.policy.recomputes:
        return "kept: this policy recomputes nothing"
    if layer.kind in CHECKPOINT_KINDS:
        return f"checkpoint: {layer.kind} is expensive to recompute"
    return ("checkpoint: its output ends a block, feeds another segment, is a model output, or "
            "is written in place")


def _output_action(plan, layer_index: int) -> str:
    graph = plan.graph
    storages = {graph.values[v].storage for v in graph.layers[layer_index].outputs
                if graph.storages[graph.values[v].storage].creator == layer_index}
    actions = {plan.actions[s] for s in storages}
    return str(actions.pop()) if len(actions) == 1 else "alias" if not actions else "mixed"


def block_of(path: str) -> str:
    """The block a module belongs to: its path up to the first index into a container
    ('transformer.h.3', 'layer2.1', 'features.7'), else its first two names."""
    parts = path.split(".")
    for at, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:at + 1])
    return ".".join(parts[:2])


def _per_layer(plan) -> list:
    graph, segment_of = plan.graph, plan.segment_of()
    rows = [f"{'step':>5}  {'layer':<32} {'kind':<8} {'l_f':>10} {'l_b':>10}  {'output':<9} why"]
    for step, layer_index in enumerate(plan.order):
        layer = graph.layers[layer_index]
        rows.append(f"{step:>5}  {layer.name[:32]:<32} {str(layer.kind):<8} "
                    f"{format_bytes(plan.costs.forward[layer_index]):>10} "
                    f"{format_bytes(plan.costs.backward[layer_index]):>10}  "
                    f"{_output_action(plan, layer_index):<9} "
                    f"{_reason(plan, layer, segment_of.get(layer_index))}")
    return rows


def _per_block(plan) -> list:
    """Consecutive layers of one block in a row: how many, how many replayed, what their
    outputs do, the largest l_i."""
    graph, segment_of = plan.graph, plan.segment_of()
    groups = []                     # [block, first step, layer indices]
    for step, layer_index in enumerate(plan.order):
        path = graph.layers[layer_index].path
        block = block_of(path) if path else (groups[-1][0] if groups else "(model)")
        if not groups or groups[-1][0] != block:
            groups.append([block, step, []])
        groups[-1][2].append(layer_index)
    rows = [f"{'steps':>11}  {'block':<28} {'layers':>6} {'replayed':>8} {'largest l_i':>11}  "
            "outputs"]
    for block, first, members in groups:
        actions: dict = {}
        for index in members:
            action = _output_action(plan, index)
            actions[action] = actions.get(action, 0) + 1
        largest = max(max(plan.costs.forward[i], plan.costs.backward[i]) for i in members)
        replayed = sum(1 for i in members if i in segment_of)
        rows.append(f"{first:>5}-{first + len(members) - 1:<5}  {block[:28]:<28} "
                    f"{len(members):>6} {replayed:>8} {format_bytes(largest):>11}  "
                    + ", ".join(f"{count} {action}" for action, count in sorted(actions.items())))
    return rows


def explain(plan, per_layer=None) -> str:
    """Per layer, or per block (the default past 200 layers: a transformer runs thousands of
    operations)."""
    header = (f"{plan.policy} plan: {len(plan.order)} layers, predicted peak "
              f"{format_bytes(plan.peak_bytes)} (resident {format_bytes(plan.resident_bytes)}, "
              f"l_peak {format_bytes(plan.max_layer_bytes)})")
    if plan.policy.recomputes:
        header += f", {plan.num_extra_computations} extra layer computations ({plan.strategy})"
    if per_layer is None:
        per_layer = len(plan.order) <= 200
    rows = [header, *(_per_layer(plan) if per_layer else _per_block(plan))]
    offloaded = sum(1 for a in plan.actions if a is Action.OFFLOAD)
    rows.append(f"{offloaded} storages may move to host memory "
                f"({format_bytes(plan.offloaded_bytes)}), moved only when the budget needs room")
    if plan.state == "host":
        rows.append(f"model state on the host: {format_bytes(plan.resident_state_bytes)} kept "
                    f"resident on the device ({len(plan.resident_state)} tensors, in the room "
                    f"the budget leaves), {format_bytes(plan.streamed_state_bytes)} streamed; "
                    f"{format_bytes(plan.state_bytes_moved)} moved a step (streamed state to "
                    "the device for forward, replays and backward, resident state once, "
                    "gradients back)")
    return "\n".join(rows)
