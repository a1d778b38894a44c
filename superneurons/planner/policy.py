"""Policies: which tensors stay, which go to host memory, which are recomputed.

Rule 1: CONV, FC and ATTN layers are checkpoints (expensive to compute); every other layer is
        cheap and, under a recomputing policy, recomputable.
Rule 2: a recomputation segment is a maximal run of consecutive recomputable layers in the route;
        it is replayed from its external inputs, which must therefore be kept (or offloaded).
Rule 3: a value a segment hands to another segment makes its producer a checkpoint, so a
        segment never has to recompute another segment to start.
Rule 4: a layer writing in place into a storage that its own segment did not create is not
        recomputable (the replay would write twice); nor is a layer reading a storage that a later
        layer overwrites in place (the replay would read the new contents), nor a leaf module
        of the model's own that writes its buffers (its replay would read them as its forward
        left them, where its output may depend on them).
Rule 5: the layers that produce the model's outputs are checkpoints (the loss reads them). A
        cast capture Rule 7 made an output may be the step's intermediate instead (HF's float32
        copy of the logits, which its loss reads), replayed from what it cast, which then lives
        longer; with graph.replays_casts it is planned so (planner/plan.py plans both readings).
Rule 7: a value that a layer outside its segment saves is replayed at that layer's backward, on top
        of that layer's own working set. Where that replay would exceed l_peak and the value is
        smaller than what the replay holds (the segment's inputs and what it makes), its producer
        becomes a checkpoint instead (a ResNet block's output, read by the next block's convs).
        Only where checkpoints can go to the host ("superneurons"): kept on the device, the
        stored value would cost more than the replay. And only where the plan's peak is lower
        for it (plan.py): DenseNet's largest concatenations pass the local test, yet their
        replays fit under a peak set elsewhere, and stored they sent the host bytes growing
        with the square of the depth (benchmarks/results/planner_costs_densenet_host.json).
Rule 6: "offload" sends CONV outputs to the host, as the paper does; "superneurons" sends every
        kept checkpoint output, since the cheap layers after them are recomputed from them. The
        model's input and outputs stay: its caller holds them through the forward at least.
Rule 8: beyond the paper, whole blocks may be replayed, convolutions included: the checkpoints are
        then the route's cuts, the layers after which a single storage is live (a ResNet block's
        output) besides the model's inputs and what lives across most of the route (a
        decoder's attention mask), the last of each run of consecutive cuts; a replay reads
        those, kept. On a GPU whose arithmetic outruns its host link many times over,
        replaying a block costs less than moving its tensors. Or a block's cheap layers are
        its checkpoints and its CONV, FC and ATTN layers replay alone, each from its kept
        input (planner/trim.py). A segment that replays a CONV, FC or ATTN is speed-centric
        under the cost-aware strategy (a memory-centric replay would run its convolutions
        once per backward layer).
"""

import enum
from dataclasses import dataclass

from ..capture import Kind, LayerGraph

__all__ = ["Policy", "Strategy", "Action", "Segment", "CHECKPOINT_KINDS", "OFFLOAD_KINDS",
           "parse_policy", "parse_strategy", "find_segments", "storage_actions", "route_cuts"]

CHECKPOINT_KINDS = frozenset({Kind.CONV, Kind.FC, Kind.ATTN})
OFFLOAD_KINDS = frozenset({Kind.CONV})


class Policy(str, enum.Enum):
    BASELINE = "baseline"          # nothing freed within the step (the paper's naive allocation)
    LIVENESS = "liveness"          # every tensor freed right after its last use
    OFFLOAD = "offload"            # liveness + CONV outputs to host memory and back
    RECOMPUTE = "recompute"        # liveness + cheap layers recomputed in backward
    SUPERNEURONS = "superneurons"  # all three
    AUTO = "auto"                  # the fastest of the above whose plan fits the budget

    @property
    def offloads(self) -> bool:
        return self in (Policy.OFFLOAD, Policy.SUPERNEURONS)

    @property
    def recomputes(self) -> bool:
        return self in (Policy.RECOMPUTE, Policy.SUPERNEURONS)

    def __str__(self) -> str:
        return self.value


class Strategy(str, enum.Enum):
    SPEED = "speed-centric"    # replay a segment once, keep everything it makes until used
    MEMORY = "memory-centric"  # replay the prefix a backward layer needs, every time
    COST_AWARE = "cost-aware"  # speed-centric where the segment fits under l_peak, else memory

    def __str__(self) -> str:
        return self.value


class Action(str, enum.Enum):
    """What happens to a storage between its last forward use and its first backward use."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"

    def __str__(self) -> str:
        return self.value


def _parse(enum_type, value, what: str):
    try:
        return enum_type(value.lower() if isinstance(value, str) else value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"unknown {what} {value!r}; choose one of {choices}") from None


def parse_policy(value) -> Policy:
    return _parse(Policy, value, "policy")


def parse_strategy(value) -> Strategy:
    if isinstance(value, str) and value.lower() in ("speed", "memory", "cost"):
        value = {"speed": "speed-centric", "memory": "memory-centric",
                 "cost": "cost-aware"}[value.lower()]
    return _parse(Strategy, value, "recomputation strategy")


@dataclass(frozen=True)
class Segment:
    index: int
    layers: tuple          # layer indices in route order
    inputs: tuple          # values read from outside the segment (kept or offloaded)
    strategy: Strategy     # speed- or memory-centric, as chosen for this segment


def route_cuts(graph: LayerGraph, order: list, ambient: bool = True) -> set:
    """Rule 8: the last layer of each run of layers after which one storage alone is live,
    with ``ambient`` besides the model's inputs (its caller holds them: a decoder's labels,
    read by its loss at the end) and what stays live across more than half of the route (a
    decoder's attention mask and rotary tables, read by every block). A segment between two
    cuts is replayed from the one storage and the ambient ones, which it reads, kept. Where
    a long skip or an early output is ambient so, the strict cuts may be the better blocks:
    the planner weighs both (planner/trim.py)."""
    n = len(order)
    pos = {layer: p for p, layer in enumerate(order)}
    first, last = {}, {}
    for value in graph.values:
        at = -1 if value.producer is None else pos[value.producer]
        first[value.storage] = min(first.get(value.storage, n), at)
    for layer in graph.layers:
        for value in layer.inputs:
            storage = graph.values[value].storage
            last[storage] = max(last.get(storage, -1), pos[layer.index])
    for value in graph.output_values:
        last[graph.values[value].storage] = n
    delta = [0] * (n + 1)
    for storage, end in last.items():
        begin = max(first.get(storage, 0), 0)
        aside = ambient and (graph.storages[storage].creator is None or end - begin > n / 2)
        if end > begin and not aside:             # live across positions begin .. end - 1
            delta[begin] += 1
            delta[end] -= 1
    live, is_cut = 0, []
    for p in range(n):
        live += delta[p]
        is_cut.append(live == 1)
    return {order[p] for p in range(n) if is_cut[p] and (p + 1 == n or not is_cut[p + 1])}


def _recomputable(graph: LayerGraph, order: list, keep: set | None) -> set:
    pos = {layer: p for p, layer in enumerate(order)}
    outputs = set(graph.output_values)
    if graph.replays_casts:               # Rule 5's exception: the casts as intermediates
        outputs -= set(graph.cast_from)
    candidates = set()
    last_writer = {}
    for layer in graph.layers:
        for storage in layer.mutates:
            last_writer[storage] = max(last_writer.get(storage, -1), pos[layer.index])
    for layer in graph.layers:
        checkpoint = layer.kind in CHECKPOINT_KINDS if keep is None else layer.index in keep
        if checkpoint or outputs.intersection(layer.outputs):
            continue                                      # Rules 1, 5 and 8
        if not layer.outputs or layer.writes_buffers:
            continue                                      # Rule 4, third part
        reads_overwritten = any(
            last_writer.get(graph.values[v].storage, -1) > pos[layer.index] for v in layer.inputs)
        if reads_overwritten:
            continue                                      # Rule 4, second half
        candidates.add(layer.index)
    return candidates


def _runs(order: list, recomputable: set) -> dict:
    segment_of, current = {}, -1
    previous_in = False
    for layer in order:
        if layer in recomputable:
            if not previous_in:
                current += 1
            segment_of[layer] = current
        previous_in = layer in recomputable
    return segment_of


def find_segments(graph: LayerGraph, order: list, strategy: Strategy, costs,
                  offloads: bool = False, keep: set | None = None) -> list:
    """Recomputation segments under Rules 1-5 and 7, each speed- or memory-centric. ``keep``:
    the layers to checkpoint instead of Rule 1's CONV, FC and ATTN (Rule 8)."""
    recomputable = _recomputable(graph, order, keep)
    while True:
        segment_of = _runs(order, recomputable)
        demoted = set()
        for layer_index in segment_of:
            layer = graph.layers[layer_index]
            for value in layer.inputs:
                producer = graph.values[value].producer
                if producer in segment_of and segment_of[producer] != segment_of[layer_index]:
                    demoted.add(producer)                # Rule 3
            for storage in layer.mutates:
                creator = graph.storages[storage].creator
                if segment_of.get(creator) != segment_of[layer_index]:
                    demoted.add(layer_index)             # Rule 4, first half
        if not demoted and offloads:
            demoted = _costly_replays(graph, segment_of, costs)
        if not demoted:
            break
        recomputable -= demoted
    members: dict = {}
    for layer_index in order:
        if layer_index in segment_of:
            members.setdefault(segment_of[layer_index], []).append(layer_index)
    segments = []
    for index, layers in sorted(members.items()):
        inside = set(layers)
        inputs = tuple(dict.fromkeys(
            v for l in layers for v in graph.layers[l].inputs
            if graph.values[v].producer not in inside))
        segments.append(Segment(index, tuple(layers), inputs,
                                _choose(strategy, graph, layers, costs)))
    return segments


def _costly_replays(graph: LayerGraph, segment_of: dict, costs) -> set:
    """Rule 7: producers whose value is cheaper to store than to replay for an outside reader."""
    size = [s.nbytes for s in graph.storages]
    savers: dict = {}                     # value -> layers whose backward reads it
    for consumer in graph.layers:
        for saved in consumer.saved:
            if saved.value is not None:
                savers.setdefault(saved.value, set()).add(consumer.index)
    members: dict = {}
    for layer_index in sorted(segment_of):
        members.setdefault(segment_of[layer_index], []).append(layer_index)
    demoted = set()
    for segment, layers in members.items():
        inside = set(layers)
        input_bytes = sum(size[s] for s in {graph.values[v].storage for l in layers
                                            for v in graph.layers[l].inputs
                                            if graph.values[v].producer not in inside})
        replay_bytes = input_bytes
        for layer_index in layers:
            layer = graph.layers[layer_index]
            replay_bytes += sum(size[graph.values[v].storage] for v in layer.outputs
                                if graph.storages[graph.values[v].storage].creator == layer_index)
            readers = {r for v in layer.outputs for r in savers.get(v, ())} - inside
            for reader in readers:
                value_bytes = sum(size[graph.values[v].storage] for v in layer.outputs)
                if replay_bytes + costs.backward[reader] > costs.peak and \
                        value_bytes < replay_bytes:
                    demoted.add(layer_index)
    return demoted


def _choose(strategy: Strategy, graph: LayerGraph, layers: list, costs) -> Strategy:
    """Cost-aware: speed-centric when sum(l_f over the segment) + l_b(last) stays under l_peak,
    or when the segment replays a CONV, FC or ATTN (Rule 8)."""
    if strategy is not Strategy.COST_AWARE:
        return strategy
    if any(graph.layers[l].kind in CHECKPOINT_KINDS for l in layers):
        return Strategy.SPEED
    memcost = sum(costs.forward[l] for l in layers) + costs.backward[layers[-1]]
    return Strategy.SPEED if memcost <= costs.peak else Strategy.MEMORY


def storage_actions(graph: LayerGraph, policy: Policy, segment_of: dict) -> list:
    """One Action per storage (Rule 6 for what is offloaded)."""
    actions = []
    producers: dict = {}      # storage -> every layer making a value on it (views, in place)
    for value in graph.values:
        producers.setdefault(value.storage, set()).add(value.producer)
    returned = {graph.values[value].storage for value in graph.output_values}
    for storage in graph.storages:
        creator = storage.creator
        touched = producers.get(storage.index, {creator})
        if policy.recomputes and creator is not None and all(l in segment_of for l in touched) \
                and len({segment_of[l] for l in touched}) == 1:
            actions.append(Action.RECOMPUTE)
        elif creator is None or storage.index in returned:
            # the model's input and outputs: its caller holds them through the forward (a
            # language model's logits, which its loss's backward reads first, through the
            # step), so a copy on the host would free nothing (AlexNet b1575 peaked 0.95 GiB
            # over its plan when its input "moved")
            actions.append(Action.KEEP)
        elif policy is Policy.OFFLOAD and graph.layers[creator].kind in OFFLOAD_KINDS:
            actions.append(Action.OFFLOAD)
        elif policy is Policy.SUPERNEURONS:
            actions.append(Action.OFFLOAD)
        else:
            actions.append(Action.KEEP)
    return actions
