"""Prediction: every buffer of the step with the steps it lives, per policy.

A buffer is an activation storage, a gradient, a layer's internal saved tensors, or the scratch
a step's computations need while they run. Summing the buffers live at each step gives the
per-step memory (the paper's Figure 10) and the peak.
"""

import bisect
from dataclasses import dataclass

from ..capture import LayerGraph
from .policy import CHECKPOINT_KINDS, Action, Policy, Strategy
from .timeline import Timeline

__all__ = ["Buffer", "predict_buffers", "live_per_step", "recompute_counts"]


@dataclass(frozen=True)
class Buffer:
    label: str
    nbytes: int
    intervals: tuple          # ((first_step, last_step), ...), inclusive
    storage: int | None = None
    managed: bool = False     # in the Tensor Pool: may move to host memory

    def live_at(self, step: int) -> bool:
        return any(first <= step <= last for first, last in self.intervals)


def _label(graph: LayerGraph, storage: int) -> str:
    creator = graph.storages[storage].creator
    return "input" if creator is None else graph.layers[creator].name


class SegmentNeeds:
    """When each segment is replayed in backward, how far, and what each replay reads."""

    def __init__(self, graph: LayerGraph, timeline: Timeline, segments: list, actions: list):
        self.graph = graph
        self.by_layer = {l: s for s in segments for l in s.layers}
        self.replays: dict = {}           # segment -> [(backward step, last position replayed)]
        self.needed_layers: dict = {}     # segment -> layers whose products backward reads
        for segment in segments:
            wanted = []                   # (step, position) a layer's products are read at
            for position, layer_index in enumerate(segment.layers):
                layer = graph.layers[layer_index]
                if layer.internal_saved_bytes or any(s.value is not None for s in layer.saved):
                    wanted.append((timeline.bwd(layer_index), position))
                for value in layer.outputs:
                    storage = graph.values[value].storage
                    if actions[storage] is Action.RECOMPUTE:
                        wanted.extend((b, position) for b in timeline.backward_uses[storage])
            self.needed_layers[segment.index] = {segment.layers[p] for _, p in wanted}
            if wanted and segment.strategy is Strategy.SPEED:
                wanted = [(min(wanted)[0], max(p for _, p in wanted))]
            self.replays[segment.index] = sorted(set(wanted))

    def first_replay(self, segment) -> int:
        return self.replays[segment.index][0][0]

    def inputs_read(self, segment, last: int) -> tuple:
        """The segment's outside values that a replay up to position ``last`` reads."""
        inside = set(segment.layers)
        return tuple(dict.fromkeys(
            v for l in segment.layers[:last + 1] for v in self.graph.layers[l].inputs
            if self.graph.values[v].producer not in inside))

    def replay_inputs(self, segment) -> tuple:
        """What the segment's deepest replay reads: its other inputs may go after forward."""
        last = max((position for _, position in self.replays[segment.index]), default=-1)
        return self.inputs_read(segment, last)


def predict_buffers(graph: LayerGraph, timeline: Timeline, policy: Policy, actions: list,
                    segments: list, needs: SegmentNeeds) -> list:
    last_step = timeline.num_steps - 1
    extra_uses = [[] for _ in graph.storages]   # segment inputs are read again at each replay
    for segment in segments:
        for step, last in needs.replays[segment.index]:
            for value in needs.inputs_read(segment, last):
                extra_uses[graph.values[value].storage].append(step)
    checkpoint_steps = sorted(timeline.bwd(l.index) for l in graph.layers
                              if l.kind in CHECKPOINT_KINDS)

    def prefetch_step(first_need: int) -> int:
        if policy is Policy.SUPERNEURONS:
            # the floor of the policy: back on the device at the step that reads it. Within a
            # budget above the floor, the Tensor Cache prefetches earlier and evicts less.
            return first_need
        # the paper's offload: fetched when backward reaches the checkpoint before the need
        at = bisect.bisect_left(checkpoint_steps, first_need) - 1
        return checkpoint_steps[at] if at >= 0 else min(first_need, timeline.num_layers)

    buffers = []
    for storage in graph.storages:
        s = storage.index
        if storage.nbytes == 0:
            continue
        create, last_fwd = timeline.create[s], timeline.last_forward_use(s)
        backward = sorted(set(timeline.backward_uses[s]) | set(extra_uses[s]))
        action = actions[s]
        if policy is Policy.BASELINE or storage.creator is None:
            intervals = ((create, last_step),)     # the model's input: its caller holds it
        elif not backward or action is Action.KEEP:
            intervals = ((create, max([last_fwd, *backward])),)
        elif action is Action.OFFLOAD:
            fetch = prefetch_step(backward[0])
            intervals = (((create, backward[-1]),) if fetch <= last_fwd + 1
                         else ((create, last_fwd), (fetch, backward[-1])))
        else:  # RECOMPUTE: made again at the segment's replays
            segment = needs.by_layer[storage.creator]
            if segment.strategy is Strategy.SPEED:
                intervals = ((create, last_fwd), (needs.first_replay(segment), backward[-1]))
            else:
                intervals = ((create, last_fwd), *((b, b) for b in backward))
        buffers.append(Buffer(_label(graph, s), storage.nbytes, _merge(intervals), s,
                              managed=action is Action.OFFLOAD and policy is not Policy.BASELINE))
    for value, first, last, nbytes in timeline.grad_buffers:
        end = last_step if policy is Policy.BASELINE else last
        producer = graph.values[value].producer
        label = "input" if producer is None else graph.layers[producer].name
        buffers.append(Buffer(f"grad({label})",
                              graph.values[value].nbytes if nbytes is None else nbytes,
                              ((first, end),)))
    for layer in graph.layers:
        nbytes = layer.internal_saved_bytes
        if not nbytes:
            continue
        first, last = timeline.fwd(layer.index), timeline.bwd(layer.index)
        segment = needs.by_layer.get(layer.index)
        if policy is Policy.BASELINE:
            intervals = ((first, last_step),)
        elif segment is None:
            intervals = ((first, last),)
        elif segment.strategy is Strategy.SPEED:
            intervals = ((first, first), (needs.first_replay(segment), last))
        else:
            intervals = ((first, first), (last, last))
        # a checkpoint's internal tensors (pooling indices) may move to the host like its output
        managed = policy is Policy.SUPERNEURONS and segment is None
        if managed and last > first + 1:
            fetch = prefetch_step(last)
            intervals = ((first, last),) if fetch <= first + 1 else ((first, first), (fetch, last))
        buffers.append(Buffer(f"{layer.name}:saved", nbytes, _merge(intervals), managed=managed))
    return buffers + _scratch_buffers(graph, timeline, segments, needs)


def _scratch_buffers(graph: LayerGraph, timeline: Timeline, segments: list,
                     needs: SegmentNeeds) -> list:
    """One buffer per step whose computations need scratch (capture/scratch.py): the largest
    among them, since one computation frees its scratch before the next begins. A step computes
    its layer's forward or backward, and in backward the replays of segments it reads."""
    largest: dict = {}

    def need(step: int, nbytes: int) -> None:
        if nbytes > largest.get(step, 0):
            largest[step] = nbytes
    for layer in graph.layers:
        need(timeline.fwd(layer.index), layer.forward_scratch)
        need(timeline.bwd(layer.index), layer.backward_scratch)
    for segment in segments:
        for step, last in needs.replays[segment.index]:
            need(step, max(graph.layers[l].forward_scratch for l in segment.layers[:last + 1]))
    return [Buffer("scratch", nbytes, ((step, step),)) for step, nbytes in sorted(largest.items())]


def _merge(intervals) -> tuple:
    merged = []
    for first, last in sorted(intervals):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return tuple(merged)


def live_per_step(buffers: list, num_steps: int) -> tuple:
    """(bytes, tensor count) live at each step, by difference arrays: O(steps + buffers)."""
    delta_bytes = [0] * (num_steps + 1)
    delta_count = [0] * (num_steps + 1)
    for buffer in buffers:
        for first, last in buffer.intervals:
            delta_bytes[first] += buffer.nbytes
            delta_bytes[last + 1] -= buffer.nbytes
            delta_count[first] += 1
            delta_count[last + 1] -= 1
    live_bytes, live_count, b, c = [], [], 0, 0
    for step in range(num_steps):
        b += delta_bytes[step]
        c += delta_count[step]
        live_bytes.append(b)
        live_count.append(c)
    return live_bytes, live_count


def recompute_counts(segments: list, needs: SegmentNeeds) -> dict:
    """Extra layer computations per step for each strategy (the paper's Table 1)."""
    counts = {Strategy.SPEED: 0, Strategy.MEMORY: 0, Strategy.COST_AWARE: 0}
    for segment in segments:
        positions = [segment.layers.index(l) for l in needs.needed_layers[segment.index]]
        if not positions:
            continue
        speed = max(positions) + 1                     # one replay, up to the last layer needed
        memory = sum(p + 1 for p in positions)         # one replay per layer needed
        counts[Strategy.SPEED] += speed
        counts[Strategy.MEMORY] += memory
        counts[Strategy.COST_AWARE] += speed if segment.strategy is Strategy.SPEED else memory
    return counts
