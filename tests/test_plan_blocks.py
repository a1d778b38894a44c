"""Blocks of decoders (policy Rule 8's cuts beside the storages every block reads) and blocks
merged into longer replays (trim.merge_blocks), planned on the CPU."""

import pytest
import torch

from superneurons.planner import plan_graph
from superneurons.planner.costs import OFF_CUDA
from superneurons.planner.plan import captured_step
from superneurons.planner.policy import CHECKPOINT_KINDS, route_cuts
from superneurons.planner.trim import merge_blocks
import today_models


def _cut_names(build) -> list:
    model, args, kwargs, _ = build()
    graph = captured_step(model, args, kwargs=kwargs, device_type="cpu")
    order = list(plan_graph(graph, "liveness").order)
    return [graph.layers[layer].name for layer in route_cuts(graph, order)]


@pytest.mark.parametrize("build, blocks", [
    ("build_hf_llama", "model.layers.{}."), ("build_nanogpt", "transformer.h.{}:")])
def test_a_decoders_blocks_are_cut_beside_its_mask_rotary_tables_and_labels(build, blocks):
    """Every block reads the attention mask (and Llama's rotary tables) and the loss reads the
    labels at the end: with those counted, no point of the route had one storage alone live."""
    if build.startswith("build_hf"):
        pytest.importorskip("transformers")
    names = _cut_names(getattr(today_models, build))
    for block in range(2):
        assert any(name.startswith(blocks.format(block)) for name in names), names


def test_blocks_are_merged_into_pieces_making_at_most_the_size():
    order, cuts = list(range(10)), {1, 3, 5, 7, 9}        # five blocks of two layers
    made = {layer: 1 + layer % 2 for layer in order}     # each block makes 3 bytes
    assert merge_blocks(order, cuts, made, 3) == cuts                 # none merged
    assert merge_blocks(order, cuts, made, 6) == {3, 7, 9}            # two and two and one
    assert merge_blocks(order, cuts, made, 9) == {5, 9}
    assert merge_blocks(order, cuts, made, 2) == cuts      # a block above the size stays whole
    assert merge_blocks(order, cuts, made, 100) == {9}     # the route's last cut is kept
    # a block of 30 bytes in the middle is a piece of its own; layers after the last cut (a
    # head) are not merged: their own replays are the policy's
    order, cuts = list(range(8)), {1, 3, 5}
    made = {0: 1, 1: 2, 2: 10, 3: 20, 4: 1, 5: 2, 6: 50, 7: 50}
    assert merge_blocks(order, cuts, made, 6) == {1, 3, 5}
    assert merge_blocks(order, cuts, made, 35) == {3, 5}
    assert merge_blocks(order, cuts, made, 40) == {5}
    assert merge_blocks(order, set(), made, 6) == set()


def test_where_the_lm_head_sets_the_floor_blocks_merged_fit_with_nothing_moved():
    """A decoder whose logits outweigh its blocks: just above the floor, neither the policy's
    own plan nor every block replayed fits with nothing moved (each keeps too many outputs),
    but replaying two or more blocks at once costs no peak and keeps fewer, so nothing
    moves."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=2048, n_positions=64, n_embd=32, n_layer=6,
                                     n_head=2)
    ids = torch.randint(0, config.vocab_size, (4, 64))
    graph = captured_step(transformers.GPT2LMHeadModel(config).train(), (),
                          kwargs=dict(input_ids=ids, labels=ids, use_cache=False),
                          device_type="cpu")
    floor = plan_graph(graph, "superneurons", machine=OFF_CUDA).peak_bytes
    liveness = plan_graph(graph, "liveness", machine=OFF_CUDA).peak_bytes
    budget = floor + (liveness - floor) * 2 // 40
    plan = plan_graph(graph, "superneurons", budget, machine=OFF_CUDA)
    cuts = route_cuts(graph, list(plan.order))
    assert plan.bytes_to_move(budget) == 0
    assert len(plan.segments) < len(cuts)
    assert any(graph.layers[layer].kind in CHECKPOINT_KINDS for layer in plan.segment_of())


def test_blocks_are_not_merged_where_the_merge_raises_the_floor():
    """A ResNet-50's stem merged with its first block fitted the first step's room of a bf16
    ResNet-50 at batch 192 with nothing moved, its replay holding all but a few percent of the
    room with nothing the pool could move, and an H100 ran out of memory there before the
    first calibration. In that room no block is replayed merged with another."""
    torchvision = pytest.importorskip("torchvision")
    import superneurons as sn
    from superneurons.planner import Machine
    model = torchvision.models.resnet50().to("meta").train()
    x = torch.randn(192, 3, 224, 224, device="meta")
    graph = sn.plan(model, (x,), policy="liveness", autocast=torch.bfloat16).graph
    # the H100's rates its runtime measured (runtime/machine.py) when that plan was made
    h100 = Machine(memory_bytes_per_s=1.90e12, link_bytes_per_s=5.42e10,
                   conv_flops_per_s={"float32": 2.98e13, "bfloat16": 3.40e14},
                   matmul_flops_per_s={"float32": 4.80e13, "bfloat16": 4.21e14})
    plan = plan_graph(graph, "superneurons", 3_026_685_062, machine=h100)
    cuts = route_cuts(graph, list(plan.order))
    assert not [s for s in plan.segments if any(layer in cuts for layer in s.layers[:-1])]


def _replayed_kinds(plan) -> list:
    return [[plan.graph.layers[layer].kind for layer in s.layers] for s in plan.segments]


def test_convolutions_replayed_alone_where_they_cost_less_than_their_batch_norms():
    """Kept, a batch norm's output frees its convolution's: a 1x1 convolution in bf16 replays
    in less time than the batch norm after it reads and writes its bytes. Planned at the
    H200's default rates in the room an H100 run of torchvision's bf16 ResNet-50 at batch 192
    had at 0.75 of plain's peak, every replay is a convolution alone, for less replay work than
    any plan replaying a batch norm."""
    torchvision = pytest.importorskip("torchvision")
    import superneurons as sn
    from superneurons.capture import Kind
    from superneurons.planner import H200
    from superneurons.planner.trim import replay_work
    model = torchvision.models.resnet50().to("meta").train()
    x = torch.randn(192, 3, 224, 224, device="meta")
    graph = sn.plan(model, (x,), policy="liveness", autocast=torch.bfloat16).graph
    room = 6_043_204_153          # ratio_resnet50_bf16_h100_trimmed_blocks.json, at 0.75
    plan = plan_graph(graph, "superneurons", room, machine=H200)
    assert plan.moves_nothing_within(room)
    assert _replayed_kinds(plan) and all(k == [Kind.CONV] for k in _replayed_kinds(plan))
    with_batch_norms = [p for p in plan.alternatives
                        if any(Kind.BN in kinds for kinds in _replayed_kinds(p))]
    assert with_batch_norms
    assert replay_work(plan) < min(replay_work(p) for p in with_batch_norms)


def test_no_plan_tried_replays_what_it_cannot_free():
    """Where a kept layer views or writes in place what a segment makes, replaying the segment
    frees nothing (policy Rule 4). A GPT-2-shaped decoder in bf16 halfway from its floor had a
    plan among those the trial times that replayed such matrix products alone beside the
    chosen plan's replays; here no plan the trial may time replays any."""
    transformers = pytest.importorskip("transformers")
    import superneurons as sn
    from superneurons.planner import Action
    from superneurons.planner.trim import _made
    config = transformers.GPT2Config(vocab_size=1000, n_positions=256, n_embd=256, n_layer=4,
                                     n_head=4)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.zeros(4, 256, dtype=torch.long, device="meta")
    kwargs = dict(input_ids=ids, labels=ids, use_cache=False)
    graph = sn.plan(model, (), policy="liveness", autocast=torch.bfloat16, kwargs=kwargs).graph
    peak = plan_graph(graph, "liveness").peak_bytes
    floor = plan_graph(graph, "superneurons").peak_bytes
    plan = plan_graph(graph, "superneurons", floor + (peak - floor) // 2)
    for option in (plan, *plan.alternatives):
        assert all(any(option.actions[storage] is Action.RECOMPUTE
                       for storage in _made(graph, segment)) for segment in option.segments)
    assert len(plan.alternatives) >= 2
