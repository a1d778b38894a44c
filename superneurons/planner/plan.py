"""The frozen Plan: route, per-layer costs, per-storage actions, per-step memory, peak."""

import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..capture import LayerGraph, capture
from ..capture.hf import packed_positions, without_full_mask
from ..units import format_bytes, parse_bytes
from .costs import H200, LayerCosts, Machine, layer_costs
from .policy import OFFLOAD_KINDS, Policy, Strategy, find_segments, parse_policy, \
    parse_strategy, route_cuts, storage_actions
from .predict import SegmentNeeds, live_per_step, predict_buffers, recompute_counts
from .route import route as build_route
from .state import STATES, choose_resident, layer_state, state_buffers, state_bytes_moved, \
    state_tensors
from .trim import PLANNED_SHARE, bytes_to_move, replay_only_what_the_budget_needs
from .timeline import Timeline, build_timeline

__all__ = ["Plan", "LayerInfo", "Step", "plan", "plan_graph", "captured_step", "AUTO_ORDER"]

# "auto" takes the first that fits: fastest first. On an H200 recomputing cheap layers costs less
# than moving their tensors over the host link, so offloading comes last.
AUTO_ORDER = (Policy.LIVENESS, Policy.RECOMPUTE, Policy.SUPERNEURONS)


@dataclass(frozen=True)
class LayerInfo:
    name: str
    kind: str
    forward_bytes: int     # l_f
    backward_bytes: int    # l_b


@dataclass(frozen=True)
class Step:
    index: int
    phase: str             # "forward" or "backward"
    layer: str
    live_bytes: int        # activations, gradients and saved tensors live, plus resident state
    live_tensors: int


@dataclass(frozen=True)
class Plan:
    policy: Policy
    strategy: Strategy
    budget_bytes: int | None
    graph: LayerGraph = field(repr=False)
    order: tuple = field(repr=False)           # layer indices in route order
    timeline: Timeline = field(repr=False)
    costs: LayerCosts = field(repr=False)
    segments: tuple = field(repr=False)
    actions: tuple = field(repr=False)          # Action per storage
    buffers: tuple = field(repr=False)
    steps: tuple = field(repr=False)
    extra_computations: dict = field(repr=False)
    needs: SegmentNeeds = field(repr=False)     # when and how far each segment replays
    state: str = "device"     # where parameters, gradients and buffers live (planner/state.py)
    state_bytes_moved: int = 0  # with state on the host: bytes of state over the link a step
    # with state on the host: the state kept on the device (planner/state.py), by name, its
    # bytes (live at every step), and the bytes of the state streamed instead
    resident_state: tuple = field(default=(), repr=False)
    resident_state_bytes: int = 0
    streamed_state_bytes: int = 0
    # other plans that fit the same budget with nothing moved, by more replay work (trim.py)
    alternatives: tuple = field(default=(), repr=False, compare=False)

    @property
    def route(self) -> list:
        return [self.graph.layers[i].name for i in self.order]

    @property
    def layers(self) -> list:
        return [LayerInfo(self.graph.layers[i].name, str(self.graph.layers[i].kind),
                          self.costs.forward[i], self.costs.backward[i]) for i in self.order]

    @property
    def resident_bytes(self) -> int:
        return self.graph.resident_bytes if self.state == "device" else self.resident_state_bytes

    @property
    def peak_bytes(self) -> int:
        return max(step.live_bytes for step in self.steps) if self.steps else self.resident_bytes

    @property
    def max_layer_bytes(self) -> int:
        return self.costs.peak

    @property
    def num_extra_computations(self) -> int:
        """Layer forwards replayed per step under this plan's strategy (0 without recompute)."""
        return self.extra_computations.get(self.strategy, 0) if self.policy.recomputes else 0

    @property
    def offloaded_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b.managed)

    def bytes_to_move(self, budget=None) -> int:
        """What moves over the host link each step to run this plan within ``budget`` (the
        plan's own by default): what the Tensor Cache must send to the host (and back), 0 when
        it fits with every checkpoint on the device, else every rise of its live bytes above
        the budget; plus, with state on the host, the state streamed (state_bytes_moved)."""
        budget = self.budget_bytes if budget is None else parse_bytes(budget)
        if budget is None:
            raise ValueError("bytes_to_move needs a budget: this plan was made without one")
        return bytes_to_move(self._kept_live, budget) + self.state_bytes_moved

    @cached_property
    def _kept_live(self) -> list:
        """Per step, this plan's live bytes were every checkpoint kept on the device (its budget
        plays no part), each Tensor Pool tensor counted as the pool counts it on the machine
        planned for (Machine.pool_bytes): the pool's entries are what it keeps."""
        pool_bytes = self.costs.machine.pool_bytes
        kept = [dataclasses.replace(b, nbytes=pool_bytes(b.nbytes),
                                    intervals=((b.intervals[0][0], b.intervals[-1][1]),))
                if b.managed else b for b in self.buffers]
        live, _ = live_per_step(kept, len(self.steps))
        return [nbytes + self.resident_bytes for nbytes in live]

    @cached_property
    def _kept_peak_bytes(self) -> int:
        return max(self._kept_live, default=0)

    def moves_nothing_within(self, budget: int) -> bool:
        """Whether the Tensor Cache moves nothing a step to run this plan within ``budget``
        (bytes_to_move is 0: its replays hold every checkpoint on the device; with state on the
        host, the state still streams)."""
        return self._kept_peak_bytes <= PLANNED_SHARE * budget

    def unmanaged_per_step(self) -> list:
        """Per step, the live bytes the Tensor Pool cannot move (all but its managed buffers)."""
        managed, _ = live_per_step([b for b in self.buffers if b.managed], len(self.steps))
        return [step.live_bytes - moved for step, moved in zip(self.steps, managed)]

    def managed_live_per_step(self) -> list:
        """Per step, the live bytes of Tensor Pool buffers, were none of them moved."""
        return live_per_step([b for b in self.buffers if b.managed], len(self.steps))[0]

    def managed_created_per_step(self) -> list:
        """Per step, the bytes of Tensor Pool buffers that step creates: the room the pool must
        have left before it runs."""
        created = [0] * len(self.steps)
        for buffer in self.buffers:
            if buffer.managed:
                for first, _ in buffer.intervals:
                    created[first] += buffer.nbytes
        return created

    def replay_inputs(self) -> dict:
        """Per segment, the inputs some replay reads; those no replay reaches can go early."""
        return {s.index: self.needs.replay_inputs(s) for s in self.segments}

    def segment_of(self) -> dict:
        return {layer: segment for segment in self.segments for layer in segment.layers}

    def live_at(self, step: int) -> list:
        """Labels of the buffers live during ``step``."""
        return [b.label for b in self.buffers if b.live_at(step)]

    def in_out(self, step: int) -> tuple:
        """The paper's in and out sets of ``step``: live before it, and still live after it."""
        before = {b.label for b in self.buffers if b.live_at(step) and b.live_at(step - 1)}
        after = {b.label for b in self.buffers if b.live_at(step) and b.live_at(step + 1)}
        return before, after

    def explain(self, per_layer: bool | None = None) -> str:
        """What is kept, offloaded or replayed, and why: per layer, or per block (the default
        past 200 layers)."""
        from .explain import explain
        return explain(self, per_layer)

    def to_dict(self) -> dict:
        return {
            "policy": str(self.policy), "strategy": str(self.strategy),
            "budget_bytes": self.budget_bytes, "peak_bytes": self.peak_bytes,
            "resident_bytes": self.resident_bytes, "max_layer_bytes": self.max_layer_bytes,
            "state": self.state, "state_bytes_moved": self.state_bytes_moved,
            "resident_state_bytes": self.resident_state_bytes,
            "resident_state_count": len(self.resident_state),
            "streamed_state_bytes": self.streamed_state_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "num_layers": len(self.order), "num_extra_computations": self.num_extra_computations,
            "steps": [{"step": s.index, "phase": s.phase, "layer": s.layer,
                       "live_bytes": s.live_bytes, "live_tensors": s.live_tensors}
                      for s in self.steps],
        }

    def __str__(self) -> str:
        state = "" if self.state == "device" else (
            f"; state on the host: {len(self.resident_state)} tensors resident, "
            f"{format_bytes(self.streamed_state_bytes)} streamed, "
            f"{format_bytes(self.state_bytes_moved)} moved a step")
        return (f"Plan({self.policy}, {len(self.order)} layers, "
                f"peak {format_bytes(self.peak_bytes)}, "
                f"l_peak {format_bytes(self.max_layer_bytes)}, "
                f"resident {format_bytes(self.resident_bytes)}{state})")


def _build(graph: LayerGraph, order: list, timeline: Timeline, costs: LayerCosts, policy: Policy,
           strategy: Strategy, budget: int | None, segments: list | None = None,
           state: str = "device", resident: tuple = ()) -> Plan:
    """``resident``: with state on the host, the names of the state kept on the device."""
    if segments is None and policy.recomputes and policy.offloads:
        # policy Rule 7 only where its stored values lower the peak (ResNets: yes; DenseNets: no,
        # and DenseNet-BC 2902 would send 270 GiB a step to the host for them)
        def build(segments: list) -> Plan:
            return _build(graph, order, timeline, costs, policy, strategy, budget, segments, state,
                          resident)
        with_rule_7 = find_segments(graph, order, strategy, costs, offloads=True)
        without = find_segments(graph, order, strategy, costs)
        if with_rule_7 == without:                  # Rule 7 stored nothing: one plan to build
            return build(without)
        stored, replayed = build(with_rule_7), build(without)
        return stored if stored.peak_bytes < replayed.peak_bytes else replayed
    if segments is None:
        segments = find_segments(graph, order, strategy, costs) if policy.recomputes else []
    segment_of = {layer: s.index for s in segments for layer in s.layers}
    actions = storage_actions(graph, policy, segment_of)
    needs = SegmentNeeds(graph, timeline, segments, actions)
    buffers = predict_buffers(graph, timeline, policy, actions, segments, needs)
    held, moved, streamed = graph.resident_bytes, 0, 0      # on the device: all of it resident
    if state == "host":
        tensors, chosen = state_tensors(graph), frozenset(resident)
        states = layer_state(graph, tensors, chosen)
        buffers += state_buffers(graph, timeline, segments, needs, states)
        moved = state_bytes_moved(segments, needs, states, tensors, chosen)
        held = sum(t.nbytes for t in tensors if t.name in chosen)
        streamed = sum(t.nbytes for t in tensors if t.name not in chosen)
    else:
        resident = ()
    live_bytes, live_count = live_per_step(buffers, timeline.num_steps)
    n = len(order)
    steps = tuple(
        Step(k, "forward" if k < n else "backward",
             graph.layers[order[k] if k < n else order[2 * n - 1 - k]].name,
             live_bytes[k] + held, live_count[k])
        for k in range(2 * n))
    extra = recompute_counts(segments, needs) if segments else {}
    return Plan(policy, strategy, budget, graph, tuple(order), timeline, costs, tuple(segments),
                tuple(actions), tuple(buffers), steps, extra, needs, state, moved,
                tuple(resident), held if resident else 0, streamed)


def plan_graph(graph: LayerGraph, policy="superneurons", budget=None,
               strategy="cost-aware", state="device", machine: Machine = H200) -> Plan:
    """Plan a captured graph; ``state``: where parameters, gradients and buffers live,
    "device" or "host" (streamed to the device for each layer); ``machine``: the rates that
    weigh replays against moves (costs.Machine). With a budget, a plan that cannot fit raises
    ValueError.

    Where capture Rule 7 could not tell which of a cast and what it cast the model returns
    (graph.cast_from), the step may hold either: both readings are planned (policy Rule 5),
    and the one that needs more is the plan, so that no step is planned below the step."""
    if parse_policy(policy) is Policy.OFFLOAD and \
            all(layer.kind not in OFFLOAD_KINDS for layer in graph.layers):
        warnings.warn("policy 'offload' moves convolution outputs to host memory, as the paper's "
                      "does, and no layer of this model was captured as a convolution: it runs "
                      "as 'liveness'. Policy 'superneurons' offloads what it keeps and "
                      "recomputes the rest.", stacklevel=_callers_level())
    if not graph.cast_from:
        return _plan_graph(graph, policy, budget, strategy, state, machine)
    plans, refused = [], []      # a plan's own graph is one reading: planned again, both are
    for replays in (False, True):
        reading = dataclasses.replace(graph, replays_casts=replays)
        try:
            plans.append(_plan_graph(reading, policy, budget, strategy, state, machine))
        except BudgetError as error:
            refused.append(error)
    if refused:
        raise max(refused, key=lambda error: error.peak_bytes)
    return max(plans, key=lambda p: (p.peak_bytes, sum(s.live_bytes for s in p.steps)))


def _callers_level() -> int:
    """warnings.warn's stacklevel, for a call from the function calling this one, of the first
    frame outside superneurons and torch: the user's line, however deep the call."""
    outside = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               os.path.dirname(os.path.abspath(torch.__file__)))
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(outside):
        frame, level = frame.f_back, level + 1
    return level


def _plan_graph(graph: LayerGraph, policy, budget, strategy, state, machine) -> Plan:
    policy, strategy, budget = parse_policy(policy), parse_strategy(strategy), parse_bytes(budget)
    state = parse_state(state)
    order = build_route(graph)
    timeline = build_timeline(graph, order)
    costs = layer_costs(graph, machine)

    def build(p, segments=None):
        return _build(graph, order, timeline, costs, p, strategy, budget, segments, state)
    if policy is Policy.AUTO:
        candidates = [build(p) for p in AUTO_ORDER]
        fitting = [c for c in candidates if budget is None or c.peak_bytes <= budget]
        if not fitting:
            _raise_over_budget(candidates[-1], budget)
        result = fitting[0]
        if budget is None:
            return result
        policy = result.policy           # and within the budget, what that policy replays
    else:
        result = build(policy)
    if budget is not None and result.peak_bytes <= budget and policy.recomputes:
        def segments_for(keep, offloads=False):
            return find_segments(graph, order, strategy, costs, offloads=offloads, keep=keep)
        candidates = find_segments(graph, order, strategy, costs, offloads=False)
        cut_sets = (route_cuts(graph, order, ambient=False), route_cuts(graph, order))
        result = replay_only_what_the_budget_needs(result, budget, build, candidates,
                                                   segments_for, cut_sets)
    if budget is not None and result.peak_bytes > budget:
        smallest = result
        if policy is not Policy.SUPERNEURONS:
            smallest = build(Policy.SUPERNEURONS)
        _raise_over_budget(result, budget, smallest)
    if budget is not None and state == "host":
        result = with_resident_state(result, budget)
    return result


def with_resident_state(plan: Plan, budget: int) -> Plan:
    """``plan`` with the state that fits in the room its budget leaves kept on the device
    (planner/state.py). The room is what the plan the budget chose leaves unused, so its
    activations, replays and offloads stay as they are: resident state adds its bytes to every
    step and only takes transient buffers away. 3% of the budget stays spare, as trim.py keeps
    it (PLANNED_SHARE): it is for what the byte model misses (allocator rounding, workspaces),
    and copies parked in it would turn a plan that moves nothing into one whose pool evicts
    every step, costing more over the link than they save."""
    room = int(PLANNED_SHARE * budget) - plan.peak_bytes
    if room <= 0:
        return plan
    chosen = choose_resident(state_tensors(plan.graph), list(plan.segments), plan.needs,
                             plan.timeline, room)
    if not chosen:
        return plan
    return _build(plan.graph, list(plan.order), plan.timeline, plan.costs, plan.policy,
                  plan.strategy, budget, list(plan.segments), plan.state, chosen)


def parse_state(state) -> str:
    if state not in STATES:
        raise ValueError(f"state must be one of {', '.join(map(repr, STATES))}, not {state!r}")
    return state


class BudgetError(ValueError):
    """A budget below what a plan needs. ``peak_bytes``: what ``policy`` needs; ``needed_bytes``:
    the smallest budget that would work with any policy; ``hint``: the other policies' and the
    host tier's needs, as the message gives them."""

    def __init__(self, message: str, policy: str, peak_bytes: int, needed_bytes: int,
                 hint: str = ""):
        super().__init__(message)
        self.policy, self.peak_bytes, self.needed_bytes, self.hint = \
            policy, peak_bytes, needed_bytes, hint


def _raise_over_budget(result: Plan, budget: int, smallest: Plan | None = None):
    smallest = smallest or result
    hint = (f"; policy 'superneurons' needs {format_bytes(smallest.peak_bytes)} "
            f"({smallest.peak_bytes} bytes)" if smallest is not result else "")
    if result.state == "device":
        streamed = _build(smallest.graph, list(smallest.order), smallest.timeline, smallest.costs,
                          Policy.SUPERNEURONS, smallest.strategy, budget, state="host")
        if streamed.peak_bytes < smallest.peak_bytes:
            hint += (f"; with the model's state on the host (sn.wrap(..., state='host'): "
                     f"parameters, gradients and optimizer state in host memory) it needs "
                     f"{format_bytes(streamed.peak_bytes)} ({streamed.peak_bytes} bytes)")
    needed, fitting = min(result.peak_bytes, smallest.peak_bytes), None
    if smallest is not result and smallest.peak_bytes <= budget:
        fitting = "superneurons"
    if result.policy is not Policy.LIVENESS:
        # keeping everything can need less than a floor whose replays and copies hold more at
        # once (a small model's state on the host): then it is the smaller need
        kept = _build(result.graph, list(result.order), result.timeline, result.costs,
                      Policy.LIVENESS, result.strategy, budget, state=result.state)
        if kept.peak_bytes < needed:
            hint += (f"; policy 'liveness', which recomputes and moves nothing, needs "
                     f"{format_bytes(kept.peak_bytes)} ({kept.peak_bytes} bytes)")
            needed = kept.peak_bytes
            fitting = "liveness" if kept.peak_bytes <= budget else fitting
    if fitting:
        advice = f"Use policy {fitting!r}, which fits" + (
            " (sn.wrap runs the model untouched where it fits)" if fitting == "liveness"
            else "") + "."
    else:
        advice = f"Raise the budget to at least {format_bytes(needed)} or use a smaller batch."
    raise BudgetError(
        f"policy {str(result.policy)!r} needs at least {format_bytes(result.peak_bytes)} "
        f"({result.peak_bytes} bytes) for this model and input, more than the budget of "
        f"{format_bytes(budget)}{hint}. {advice}", str(result.policy), result.peak_bytes,
        needed, hint)


def plan(model, example_input, policy="superneurons", budget=None, *,
         strategy="cost-aware", autocast=None, device_type="cuda", kwargs=None,
         state="device", machine: Machine = H200, slice_loss: bool = True,
         outside_gradients: bool = False) -> Plan:
    """Plan the training step of ``model`` on inputs like ``example_input``; nothing is allocated.

    ``example_input`` is a tensor on any device (meta included), a shape tuple, or a tuple of
    the model's positional arguments; ``kwargs`` its keyword arguments. ``autocast``:
    the dtype of the torch.autocast the step will run under on ``device_type`` (torch.bfloat16 or
    torch.float16), or None for none. ``state``: "device" (parameters, gradients and buffers
    resident on the device) or "host" (kept in host memory and streamed, as sn.wrap(...,
    state="host") runs the model). ``machine``: the device's rates (costs.Machine; sn.wrap
    measures them on the device it runs on). ``slice_loss``, ``outside_gradients``: as
    sn.wrap's.
    """
    parse_policy(policy), parse_strategy(strategy), parse_bytes(budget)  # fail fast on bad input
    parse_state(state)
    graph = captured_step(model, example_input, autocast=autocast, device_type=device_type,
                          kwargs=kwargs, slice_loss=slice_loss,
                          outside_gradients=outside_gradients)
    return plan_graph(graph, policy, budget, strategy, state, machine)


def captured_step(model, example_input, *, autocast=None, device_type="cuda", kwargs=None,
                  slice_loss: bool = True, outside_gradients: bool = False) -> LayerGraph:
    """The layer graph plan() plans, captured as sn.wrap would call the model; plan_graph()
    plans it under any policy, budget and state without capturing again."""
    if autocast not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"autocast must be torch.bfloat16, torch.float16 or None, not "
                         f"{autocast!r}")
    autocast_state = None if autocast is None else (device_type, autocast)
    kwargs = without_full_mask(model, dict(kwargs or {}))        # as sn.wrap calls the model
    graph = capture(model, example_input, autocast_state, kwargs,
                    packed_positions=packed_positions(model, (), kwargs), slice_loss=slice_loss)
    graph.outside_gradients = bool(outside_gradients)          # gradients.py Rule 5
    return graph
