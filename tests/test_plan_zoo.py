"""The paper's result in the model, on every zoo network; nothing freed is needed later."""

import pytest
import torch

from superneurons.capture import Kind, capture
from superneurons.models import input_shape
from superneurons.planner import Action, Policy, Strategy, plan_graph
from superneurons.planner.costs import OFF_CUDA
from superneurons.planner.trim import replay_work
from conftest import meta_model

ZOO = {"alexnet": {}, "vgg16": {}, "vgg19": {}, "resnet50": {}, "resnet101": {},
       "resnet152": {}, "inception_v4": {}, "densenet121": {}, "densenet_cifar": {},
       "resnet": {"depth": 35}, "densenet": {"depth": 125}}
BOUNDED = ["alexnet", "vgg16", "resnet50", "resnet101", "resnet152"]
POLICIES = [p for p in Policy if p is not Policy.AUTO]
_cache = {}


def plans(name: str, batch: int = 16) -> dict:
    if (name, batch) not in _cache:
        graph = capture(meta_model(name, **ZOO[name]), input_shape(name, batch))
        _cache[name, batch] = {p: plan_graph(graph, p) for p in POLICIES}
    return _cache[name, batch]


@pytest.mark.parametrize("name", ZOO)
def test_peak_ordering(name):
    peak = {p: plan.peak_bytes for p, plan in plans(name).items()}
    assert peak[Policy.BASELINE] > peak[Policy.LIVENESS] >= peak[Policy.OFFLOAD] \
        >= peak[Policy.SUPERNEURONS]
    assert peak[Policy.LIVENESS] > peak[Policy.SUPERNEURONS]
    assert peak[Policy.RECOMPUTE] >= peak[Policy.SUPERNEURONS]


@pytest.mark.parametrize("name", BOUNDED)
def test_superneurons_approaches_the_largest_layer(name):
    plan = plans(name)[Policy.SUPERNEURONS]
    assert plan.peak_bytes <= 1.10 * (plan.resident_bytes + plan.max_layer_bytes)


@pytest.mark.parametrize("name", ["alexnet", "resnet50", "inception_v4", "densenet121"])
@pytest.mark.parametrize("policy", POLICIES)
def test_nothing_freed_is_needed_later(name, policy):
    plan = plans(name)[policy]
    graph, timeline = plan.graph, plan.timeline
    by_storage = {b.storage: b for b in plan.buffers if b.storage is not None}

    def alive(storage, step):
        return graph.storages[storage].nbytes == 0 or by_storage[storage].live_at(step)

    for layer in graph.layers:
        for value in (*layer.inputs, *layer.outputs):
            assert alive(graph.values[value].storage, timeline.fwd(layer.index))
        for saved in layer.saved:
            if saved.value is not None:
                assert alive(graph.values[saved.value].storage, timeline.bwd(layer.index))
    for segment in plan.segments:   # a replay reads the segment's inputs: they must be there
        inside = set(segment.layers)
        needs = [timeline.bwd(l) for l in segment.layers if graph.layers[l].saved]
        needs += [step for l in segment.layers for v in graph.layers[l].outputs
                  if plan.actions[graph.values[v].storage] is Action.RECOMPUTE
                  for step in timeline.backward_uses[graph.values[v].storage]]
        if needs and segment.strategy is Strategy.SPEED:
            for value in graph.layers[segment.layers[0]].inputs:
                if graph.values[value].producer not in inside:
                    assert alive(graph.values[value].storage, min(needs))


def test_recomputation_counts_follow_table1():
    plan = plans("resnet50")[Policy.SUPERNEURONS]
    extra = plan.extra_computations
    assert extra[Strategy.SPEED] <= extra[Strategy.COST_AWARE] <= extra[Strategy.MEMORY]
    assert extra[Strategy.SPEED] < extra[Strategy.MEMORY]
    memory = plan_graph(plan.graph, "superneurons", strategy="memory-centric")
    speed = plan_graph(plan.graph, "superneurons", strategy="speed-centric")
    assert memory.peak_bytes <= plan.peak_bytes <= speed.peak_bytes


def test_alexnet_is_the_papers_23_layers():
    plan = plans("alexnet")[Policy.LIVENESS]
    kinds = [layer.kind for layer in plan.layers]
    assert kinds == ["CONV", "ACT", "LRN", "POOL", "CONV", "ACT", "LRN", "POOL", "CONV", "ACT",
                     "CONV", "ACT", "CONV", "ACT", "POOL", "FC", "ACT", "DROPOUT", "FC", "ACT",
                     "DROPOUT", "FC", "SOFTMAX"]
    assert len(plan.steps) == 46


def test_layer_names_are_qualified_module_names():
    route = plans("resnet50")[Policy.LIVENESS].route
    assert "layer1.0.conv1" in route and "layer4.2.bn3" in route
    assert route.index("layer1.0.conv1") < route.index("layer1.0.bn1")


def test_explain_says_what_and_why():
    text = plans("resnet50")[Policy.SUPERNEURONS].explain()
    assert "layer1.0.bn1" in text and "replayed from segment" in text
    assert "checkpoint: CONV is expensive" in text


def test_in_place_relu_after_a_conv_is_a_checkpoint():
    plan = plans("alexnet")[Policy.SUPERNEURONS]
    in_segment = {plan.graph.layers[l].name for l in plan.segment_of()}
    assert "1" not in in_segment           # RELU1 writes into CONV1's output in place (Rule 4)
    assert {"2", "3"} <= in_segment        # LRN1 and POOL1 are replayed


def test_a_budget_above_the_floor_replays_less_or_whole_blocks():
    """Counted byte for byte (off CUDA): the pool's pages are the next test's."""
    graph = plans("resnet50")[Policy.LIVENESS].graph
    floor = plan_graph(graph, "superneurons", machine=OFF_CUDA)
    kept = plan_graph(graph, "recompute", machine=OFF_CUDA).peak_bytes   # every checkpoint kept
    liveness = plan_graph(graph, "liveness", machine=OFF_CUDA).peak_bytes

    def replays_convolutions(plan) -> bool:
        return any(plan.graph.layers[l].kind is Kind.CONV for l in plan.segment_of())
    roomy = plan_graph(graph, "superneurons", budget=(kept + liveness) // 2, machine=OFF_CUDA)
    assert 0 < roomy.num_extra_computations < floor.num_extra_computations
    # the least replay work of the plans that fit: there, a block replayed whole, the others
    # not at all, costs less than the cheap layers of many (trim.py)
    assert all(replay_work(roomy) <= replay_work(other) for other in roomy.alternatives)
    assert replays_convolutions(roomy)
    assert replay_work(roomy) < min(replay_work(other) for other in roomy.alternatives
                                    if not replays_convolutions(other))
    # below what cheap replays need with nothing moved, whole blocks are replayed (Rule 8)
    tight = plan_graph(graph, "superneurons", budget=(floor.peak_bytes + kept) // 2,
                       machine=OFF_CUDA)
    assert replays_convolutions(tight)
    assert "CONV in a replayed block" in tight.explain()
    # just above the floor even whole blocks do not fit and data moves: blocks cut at
    # convolutions where their replays would set a higher floor, moving less than the floor's
    # plan does at no higher a floor (trim.split_blocks)
    budget = int(floor.peak_bytes * 1.01)
    split = plan_graph(graph, "superneurons", budget=budget, machine=OFF_CUDA)
    assert replays_convolutions(split) and len(split.segments) < len(floor.segments)
    assert split.peak_bytes <= floor.peak_bytes
    assert 0 < split.bytes_to_move(budget) < 0.6 * floor.bytes_to_move(budget)


def test_blocks_are_cut_at_convolutions_only_where_their_replays_make_more_than_the_size():
    from superneurons.planner.policy import CHECKPOINT_KINDS, route_cuts
    from superneurons.planner.trim import made_bytes, split_at_convolutions
    plan = plans("resnet50")[Policy.LIVENESS]
    graph, order = plan.graph, list(plan.order)
    cuts, made = route_cuts(graph, order), made_bytes(graph)
    blocks, block = [], []                     # the layers between consecutive cuts
    for layer in order:
        if layer in cuts:
            blocks.append(block)
            block = []
        else:
            block.append(layer)
    sizes = sorted(sum(made[l] for l in b) for b in blocks)
    size = sizes[len(sizes) // 2]
    cut = {}
    for smallest in (False, True):
        added = split_at_convolutions(graph, order, cuts, made, size, smallest) - cuts
        assert added and all(graph.layers[l].kind in CHECKPOINT_KINDS for l in added)
        for block in blocks:
            cut_inside = added & set(block)
            assert bool(cut_inside) == (sum(made[l] for l in block) > size)
        assert split_at_convolutions(graph, order, cuts, made, sizes[-1], smallest) == cuts
        cut[smallest] = sum(made[l] for l in added)
    assert cut[True] < cut[False]     # at a bottleneck's narrow convolutions, not its widening one


def test_a_cut_plan_is_chosen_only_where_it_moves_less_than_the_policys_own():
    graph = plans("densenet_cifar")[Policy.LIVENESS].graph
    own = plan_graph(graph, "superneurons", machine=OFF_CUDA)
    # budgets where a cut plan moving more at a higher peak would win on replay time alone
    for share in (1.48, 1.68):
        budget = int(own.peak_bytes * share)
        chosen = plan_graph(graph, "superneurons", budget=budget, machine=OFF_CUDA)
        assert chosen.bytes_to_move(budget) <= own.bytes_to_move(budget)


def test_the_ladder_of_sizes_ends_where_layers_make_a_byte_each(monkeypatch):
    from superneurons.planner import trim
    plan = plans("resnet")[Policy.SUPERNEURONS]
    monkeypatch.setattr(trim, "made_bytes", lambda graph: {l.index: 1 for l in graph.layers})
    sizes, split_at_convolutions = [], trim.split_at_convolutions

    def counted(graph, order, cuts, made, size, smallest=False):
        assert len(sizes) < 1000, "the ladder of sizes does not end"
        sizes.append(size)
        return split_at_convolutions(graph, order, cuts, made, size, smallest)
    monkeypatch.setattr(trim, "split_at_convolutions", counted)
    # one cut: nothing to merge, so no floor is asked of what build returns (segments here)
    trim.split_blocks(plan, lambda policy, segments: segments,
                      lambda keep, offloads=False: keep, {plan.order[-1]})
    assert sizes and sizes[-1] > 1


def test_route_cuts_are_block_outputs():
    from superneurons.planner.policy import route_cuts
    graph = plans("resnet50")[Policy.LIVENESS].graph
    order = list(plans("resnet50")[Policy.LIVENESS].order)
    names = {graph.layers[l].name for l in route_cuts(graph, order)}
    blocks = {f"layer{s}.{b}.relu#3" for s, n in enumerate((3, 4, 6, 3), 1) for b in range(n)}
    last_block = "layer4.2.relu#3"      # the head's pooling and flatten follow: cuts too
    assert blocks - {last_block} <= names and "stem.3" in names   # and the stem's maxpool
    assert len(names) == len(blocks) + 1 and last_block not in names
    chain = plans("vgg16")[Policy.LIVENESS]
    assert route_cuts(chain.graph, list(chain.order)) == {chain.order[-1]}


def test_replay_work_weighs_convolutions_by_their_arithmetic():
    from superneurons.planner.trim import replay_work
    plan = plans("resnet50")[Policy.SUPERNEURONS]
    work, machine = plan.costs.work, plan.costs.machine
    for layer in plan.graph.layers:
        moving = plan.costs.forward[layer.index] / machine.memory_bytes_per_s
        assert work[layer.index] >= moving
        if layer.kind is Kind.CONV and layer.name.endswith("conv2"):    # 3x3: arithmetic sets it
            assert work[layer.index] > moving
    assert replay_work(plans("resnet50")[Policy.LIVENESS]) == 0
    assert replay_work(plan) > 0


def test_bytes_to_move_counts_rises_above_the_mark_of_each_stretch_over_the_budget():
    """What went to the host waits there: a fall and a rise below the stretch's highest excess
    move nothing new; a stretch that begins after the plan fitted again moves again."""
    from superneurons.planner.trim import bytes_to_move
    budget = 1000
    limit = int(0.97 * budget)
    live = [limit + 100, limit + 50, limit + 100, limit + 150, limit - 10, limit + 40]
    assert bytes_to_move(live, budget) == 150 + 40


def test_bytes_to_move_is_within_what_the_plan_holds():
    from superneurons.planner.trim import bytes_to_move
    keep = plans("resnet50")[Policy.RECOMPUTE]
    live = [s.live_bytes for s in keep.steps]
    assert bytes_to_move(live, 2 * keep.peak_bytes) == 0
    tight = keep.peak_bytes // 2
    moved = bytes_to_move(live, tight)
    assert moved >= keep.peak_bytes - 0.97 * tight          # at least the worst step's excess
    assert moved <= sum(live)


def _floor(graph, rule_7: bool):
    """The superneurons floor with every value policy Rule 7 would store stored, or none."""
    from superneurons.planner.costs import layer_costs
    from superneurons.planner.plan import _build
    from superneurons.planner.policy import find_segments
    from superneurons.planner.route import route
    from superneurons.planner.timeline import build_timeline
    order = route(graph)
    costs = layer_costs(graph)
    return _build(graph, order, build_timeline(graph, order), costs, Policy.SUPERNEURONS,
                  Strategy.COST_AWARE, None,
                  find_segments(graph, order, Strategy.COST_AWARE, costs, offloads=rule_7))


def test_rule_7_stores_values_only_where_that_lowers_the_peak():
    """ResNet-50's stored block outputs lower its floor; DenseNet's stored concatenations do not,
    and would only send more to the host."""
    resnet = capture(meta_model("resnet50"), input_shape("resnet50", 8))
    chosen, stored = plan_graph(resnet, "superneurons"), _floor(resnet, rule_7=True)
    assert chosen.segments == stored.segments
    assert chosen.peak_bytes < _floor(resnet, rule_7=False).peak_bytes
    densenet = capture(meta_model("densenet_cifar", depth=100), (2, 3, 32, 32))
    chosen, stored = plan_graph(densenet, "superneurons"), _floor(densenet, rule_7=True)
    assert chosen.peak_bytes == stored.peak_bytes
    assert chosen.offloaded_bytes < stored.offloaded_bytes / 2


@pytest.mark.parametrize("policy", ["offload", "superneurons"])
def test_the_models_input_stays_on_the_device_through_the_step(policy):
    """Its caller holds it, so a copy on the host would free nothing (AlexNet b1575 peaked
    0.95 GiB over a plan that had offloaded it)."""
    graph = capture(meta_model("resnet50"), input_shape("resnet50", 2, 64))
    plan = plan_graph(graph, policy)
    storage = graph.values[graph.input_values[0]].storage
    assert plan.actions[storage] is Action.KEEP
    buffer = next(b for b in plan.buffers if b.storage == storage)
    assert buffer.intervals == ((0, plan.timeline.num_steps - 1),) and not buffer.managed


class _ReturnsWhatItsLossReads(torch.nn.Module):
    """A convolution's output returned beside a loss that saves it for backward (a language
    model's logits and loss)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)

    def forward(self, x):
        out = self.conv(x)
        return out, out.square().mean()


@pytest.mark.parametrize("policy", ["offload", "superneurons"])
def test_an_output_its_loss_reads_stays_on_the_device(policy):
    """The caller holds the output at least until the forward returns: moved to the host, it
    would free nothing there (GPT-2's logits stayed beside a plan that had freed them:
    BENCHMARKS.md, "Slices of the loss layer, and GPT-2 at a quarter")."""
    with torch.device("meta"):
        model = _ReturnsWhatItsLossReads()
    graph = capture(model, (2, 3, 16, 16))
    plan = plan_graph(graph, policy)
    storage = graph.values[graph.output_values[0]].storage
    assert graph.layers[graph.storages[storage].creator].kind is Kind.CONV
    assert plan.actions[storage] is Action.KEEP
    buffer = next(b for b in plan.buffers if b.storage == storage)
    assert not buffer.managed


def test_the_input_held_by_the_caller_does_not_tip_the_whole_block_choice():
    """trim's whole-block share bounds what real use adds to a plan's floor; the input is exact.
    ResNet-50 b500 within 11.5 GiB replays every block (9 GiB to move a step), as before plans
    held the input, rather than cheap replays moving 51 GiB."""
    graph = capture(meta_model("resnet50"), input_shape("resnet50", 500))
    plan = plan_graph(graph, "superneurons", budget=int(11.5 * 2**30))
    assert plan.bytes_to_move() < 10 * 2**30


def test_blocks_are_merged_only_where_the_floor_stays_within_whole_blocks_or_the_limit():
    """split_blocks keeps a merged plan where its floor is within a pool page of every block
    replayed whole's, or at most the limit it is given: with none, the merges that raise the
    floor are dropped; with the limit above every floor, all are kept."""
    from superneurons.planner.plan import _build
    from superneurons.planner.policy import Strategy, find_segments, route_cuts
    from superneurons.planner.trim import _floor, split_blocks
    own = plans("resnet50")[Policy.SUPERNEURONS]
    graph, order = own.graph, list(own.order)

    def segments_for(keep, offloads=False):
        return find_segments(graph, order, Strategy.COST_AWARE, own.costs, offloads=offloads,
                             keep=keep)

    def build(policy, segments):
        return _build(graph, order, own.timeline, own.costs, policy, Strategy.COST_AWARE,
                      None, segments, "device")
    cuts = route_cuts(graph, order)
    whole = _floor(build(own.policy, segments_for(cuts, own.policy.offloads)))
    page = own.costs.machine.pool_page_bytes

    def merged(plans) -> list:
        return [p for p in plans if any(l in cuts for s in p.segments for l in s.layers[:-1])]
    every = merged(split_blocks(own, build, segments_for, cuts, float("inf")))
    held = merged(split_blocks(own, build, segments_for, cuts))
    assert any(_floor(p) >= whole + page for p in every)
    assert len(held) < len(every) and all(_floor(p) < whole + page for p in held)
