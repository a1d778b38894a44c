"""With a budget, replay only what the budget needs, and choose what to replay by its cost.

A recomputing policy without a budget replays every cheap segment: that is its floor. With a
budget above the floor, some segments can keep their tensors instead. On a modern GPU a replay
costs compute and a move to the host costs far more (DESIGN.md), so the goal is the cheapest
replays whose plan fits the budget *with nothing moved*. Four families of plans are tried:

- the policy's own segments, and the cheap segments that keep the most on the device (policy
  Rule 7 off), with the least useful segments dropped (fewest bytes saved per unit of replay
  time, costs.work) while the plan that keeps every checkpoint on the device still fits;
- whole blocks (policy Rule 8): every block replayed, then the least useful blocks back to
  replaying only their cheap layers, then the least useful segments dropped, as above; every
  block replayed, then the least useful blocks not replayed at all while the plan fits (a
  few blocks replayed whole can cost less than many cheap layers and free as much: GPT-2
  small in bf16, whose blocks' cheap layers, the GELU's eight float32 elementwise layers
  among them, cost more to replay than its whole blocks and keep more); and
  every block replayed as it is, the fewest and largest replays: a replay costs the host time
  per segment and per layer that the byte model does not see, and checkpointing per block ran
  efficientnet_b0 in bf16 faster than the cheapest plan's many small replays
  (ratio_efficientnet_b0_bf16_h100_00d224a.json);
- convolutions alone: every block replayed, then the least useful blocks back to replaying only
  their CONV, FC and ATTN layers (each run of them from its kept input), the outputs of their
  cheap layers kept, while the plan fits; then trimmed as above; tried only where every block
  replayed fits. Of a convolution's output and the batch norm's after it, of one size, one stays
  either way: keeping the batch norm's costs a replay of the convolution (its arithmetic),
  keeping the convolution's a replay of the batch norm (a pass over its bytes, slow in bf16: on
  an H200 a bf16 ResNet-50's batch norms took 0.045 s of plain's 0.080 s of kernels, its
  convolutions 0.017 and its GEMM kernels 0.007, profile_ratio.json). And a bottleneck's
  widening convolution, whose output is four times a narrow one's, then keeps nothing: the
  block's output is kept either way;
- blocks split (split_blocks): every block replayed, except that a block whose replay would
  make more than a given number of bytes is cut at convolutions into pieces that make at most
  that many, for a ladder of sizes. A whole block's replay holds everything it makes at once,
  so at a small budget the largest blocks' replays set the floor; cut into pieces, they keep
  only a few convolution outputs more, where the policy's own plan keeps every one. Above the
  largest block's size, consecutive blocks are merged instead: where something else sets the
  floor (a decoder's logits and its loss), longer replays cost no peak and keep fewer block
  outputs; a merge that raises the floor is made only within the share below. Among the
  fitting plans only where every block replayed whole does not fit: where it does, the
  trial's two tries (runtime/trial.py) stay with it and the planner's first choice.

Each fitting plan first drops the segments whose replay frees none of what they make (a
convolution replayed alone whose output a kept in-place ReLU writes, a matrix product a kept
layer reshapes: the storage stays on the device either way, policy Rule 4), where it still fits
without them (their replay may still free what a layer saves of its own). The fitting plan
with the least replay work wins; the others that fit are kept beside it (Plan.alternatives),
for the runtime to time on the machine (runtime/trial.py). Where none fits
without moving data, the Tensor Cache will move what the budget forces out; then the policy's
own plan, the plan replaying every block and the split blocks are weighed by replay time plus
the time to move what each would move (every rise of its live bytes above the budget, out and
back over the machine's link). Replaying whole blocks keeps far more on the device, so it moves
far less (ResNet-50 at batch 450 in 11.5 GiB: 0.3 GiB against 43); at a quarter of plain
PyTorch's peak, where every block replayed whole does not fit, the split blocks halve what
ResNet-50 moves (trim_split_blocks.json). Each but the policy's own plan is weighed only where
its peak is within the budget and its floor is no higher than the own plan's (within a pool
page) or within the share below, and a split one only where it moves less than the own plan.
"""

import dataclasses
import functools

from .policy import CHECKPOINT_KINDS, Action, Policy, Strategy

# what the byte model misses (allocator rounding, saved tensors sized differently off the meta
# device) should not turn "nothing moves" into a few evictions: keep 3% of the budget spare
PLANNED_SHARE = 0.97
# when data must move, a plan replaying every block (whole or split) is taken only if its floor
# is no higher than the policy's own or fills at most this share of the budget: its replays hold
# whole blocks the pool cannot move, and real use has exceeded a floor's prediction by up to
# 1.42x on the GPU (BENCHMARKS.md), so 1 / 1.42; near its largest batch a network keeps the
# policy's own, smaller floor. The model's input is left out of the floor here: it is exact
# (its caller holds it), not what real use exceeds plans by, and the share was set before plans
# held it (ResNet-50 b500 within 11.5 GiB would otherwise flip from replaying every block, 9 GiB
# to move a step, to cheap replays and 51; planner_costs.json)
_BLOCKS_FLOOR_SHARE = 0.7


def replay_work(plan) -> float:
    """Seconds of the layers a step replays (costs.work), per the plan's
    strategies: speed-centric replays up to the last layer needed once, memory-centric the
    prefix each needed layer needs."""
    work, total = plan.costs.work, 0
    for segment in plan.segments:
        positions = [segment.layers.index(l) for l in plan.needs.needed_layers[segment.index]]
        if not positions:
            continue
        prefix = [0]                      # prefix[p]: work of the segment's first p layers
        for layer in segment.layers:
            prefix.append(prefix[-1] + work[layer])
        if segment.strategy is Strategy.SPEED:
            total += prefix[max(positions) + 1]
        else:
            total += sum(prefix[p + 1] for p in positions)
    return total


def _replays(plan) -> tuple:
    return tuple(tuple(s.layers) for s in plan.segments)


def _made(graph, segment) -> set:
    """The storages a segment's layers create."""
    inside = set(segment.layers)
    return {graph.values[v].storage for l in segment.layers for v in graph.layers[l].outputs
            if graph.storages[graph.values[v].storage].creator in inside}


def _usefulness(plan, segment) -> float:
    saved = sum(plan.graph.storages[s].nbytes for s in _made(plan.graph, segment))
    work = sum(plan.costs.work[l] for l in segment.layers)
    return saved / max(work, 1e-12)


def _without_idle_replays(plan, budget: int, build):
    """``plan`` less the segments whose replay frees none of what they make: where a kept layer
    writes in place into what a segment makes, or views it, that storage stays on the device
    (policy Rule 4) and the replay costs its work for it (a convolution replayed alone before an
    in-place ReLU, a matrix product whose output a kept layer reshapes). Such a replay may still
    free what its layers save of their own (under autocast, a layer's cast of its input: timm
    mobilevitv2_050's attention projections, resmlp_12_224's token mixers), which the plan
    without it keeps; so that plan is taken only where it still fits with nothing moved and
    peaks no higher."""
    idle = {s.index for s in plan.segments
            if all(plan.actions[storage] is not Action.RECOMPUTE
                   for storage in _made(plan.graph, s))}
    if not idle:
        return plan
    leaner = build(plan.policy, [s for s in plan.segments if s.index not in idle])
    return leaner if leaner.moves_nothing_within(budget) and \
        leaner.peak_bytes <= plan.peak_bytes else plan


def replay_only_what_the_budget_needs(plan, budget: int, build, candidates: list,
                                      segments_for=None, cut_sets: tuple = ()):
    """``build(policy, segments)`` makes a plan; ``candidates`` are the cheap segments that keep
    the most on the device; ``segments_for(keep, offloads=False)`` finds segments checkpointing
    ``keep`` (with policy Rule 7 where ``offloads``) and ``cut_sets`` are the route's cuts
    (policy Rule 8), strict and beside ambient storages, for whole-block plans from each.
    Returns the plan with the least replay work among those that fit with nothing moved, else
    the one costing least in replay and moving time."""
    tries = [_trim(plan, list(plan.segments), budget, build),
             _trim(plan, candidates, budget, build)]
    blocks, split = [], []                   # every block replayed, and blocks cut or merged
    for cuts in ([] if segments_for is None else _distinct(cut_sets)):
        every = segments_for(cuts)
        blocks.append(build(plan.policy, every))
        by_use = sorted(every, key=lambda s: _usefulness(plan, s))
        trimmed = _whole_blocks(plan, budget, build, segments_for, cuts, by_use)
        if trimmed is not None:              # then every block replayed fits too
            tries += [trimmed, blocks[-1], _trim(blocks[-1], list(blocks[-1].segments),
                                                 budget, build),
                      _whole_blocks(plan, budget, build, segments_for, cuts, by_use, True)]
        else:                                # where it does not, blocks cut may
            cut = split_blocks(plan, build, segments_for, cuts, _BLOCKS_FLOOR_SHARE * budget)
            split += cut
            tries.append(min((p for p in cut if p.moves_nothing_within(budget)),
                             key=replay_work, default=None))
    fitting, seen = [], set()
    tries = [_without_idle_replays(t, budget, build) for t in tries if t is not None]
    for option in sorted(tries, key=replay_work):
        if _replays(option) not in seen:
            seen.add(_replays(option))
            fitting.append(option)
    if fitting:      # the others are tried on the machine (runtime/trial.py)
        return dataclasses.replace(fitting[0], alternatives=tuple(fitting[1:]))
    # something must move: the Tensor Cache decides what, when. Replays the pool cannot move
    # are weighed where their floor is within the share, or no higher than the policy's own
    # (by less than a page of the pool's, the unit the pool counts in), and their peak within
    # the budget; a cut plan where it moves less than the policy's own: one moving more would
    # win only on replay time, at a higher peak
    limit = max(_BLOCKS_FLOOR_SHARE * budget,
                _floor(plan) + plan.costs.machine.pool_page_bytes - 1)
    own_moves = plan.bytes_to_move(budget)
    split = [option for option in split if option.bytes_to_move(budget) < own_moves]
    options = [plan] + [option for option in blocks + split
                        if _floor(option) <= limit and option.peak_bytes <= budget]
    machine = plan.costs.machine
    return min(options, key=lambda option: replay_work(option)
               + machine.move_seconds(option.bytes_to_move(budget)))


def _distinct(cut_sets) -> list:
    """The non-empty cut sets, each once, in order."""
    distinct = []
    for cuts in cut_sets:
        if cuts and cuts not in distinct:
            distinct.append(cuts)
    return distinct


def _floor(plan) -> int:
    """The plan's peak less the model's input (exact: its caller holds it)."""
    return plan.peak_bytes - sum(s.nbytes for s in plan.graph.storages if s.creator is None)


def split_blocks(plan, build, segments_for, cuts: set, merged_floor: float = 0) -> list:
    """Plans replaying every block, where a block whose replay makes more than a size is cut at
    convolutions (CONV, FC and ATTN layers kept as checkpoints, under the policy's Rule 7),
    cut at the last convolution passed or at the smallest (split_at_convolutions); for sizes
    from the largest layer's own bytes to the largest block's, each half again the last. A
    stretch with no convolution is not cut, so a piece may make more than its size. Above the
    largest block's size, consecutive blocks are merged into pieces of at most the size
    (merge_blocks): where something else sets the floor (a decoder's LM head and its loss),
    replaying two blocks at once costs no peak and keeps half the checkpoints. A merged plan
    is kept only where its floor is no more than a pool page above the floor of every block
    replayed whole, or at most ``merged_floor`` (replay_only_what_the_budget_needs passes the
    share of the budget that data-moving plans' floors are held to): a merge that raises the
    floor past both fits only by holding replays the pool cannot move, and leaves the first
    step, before any calibration of real use, nothing to move when real use passes the plan
    (BENCHMARKS.md, "Blocks merged only where they cost no floor"). A few dozen plans at
    most, but each a full plan: where whole blocks do not fit, they take several times the
    rest of a deep graph's planning (BENCHMARKS.md, "A decoder's blocks")."""
    graph, order = plan.graph, plan.order
    made = made_bytes(graph)
    largest_block, block = 0, 0
    for layer in order:
        block = 0 if layer in cuts else block + made[layer]
        largest_block = max(largest_block, block)
    plans, size, seen = [], max(made.values(), default=0), set()

    @functools.cache
    def whole_floor() -> int:
        return _floor(build(plan.policy, segments_for(cuts, plan.policy.offloads)))

    def add(keep: frozenset, merged: bool = False) -> None:
        if keep in seen:
            return
        seen.add(keep)
        option = build(plan.policy, segments_for(keep, plan.policy.offloads))
        if merged:
            floor, page = _floor(option), plan.costs.machine.pool_page_bytes
            if floor > merged_floor and floor >= whole_floor() + page:
                return                           # a merge that raises the floor past both
        plans.append(option)
    while 0 < size < largest_block:
        for smallest in (False, True):
            add(frozenset(split_at_convolutions(graph, order, cuts, made, size, smallest)))
        size = max(size + 1, size * 3 // 2)
    last_cut = max((p for p, layer in enumerate(order) if layer in cuts), default=-1)
    up_to_last_cut = sum(made[layer] for layer in order[:last_cut + 1])   # what merging spans
    while 0 < size < up_to_last_cut and len(cuts) > 1:
        add(frozenset(merge_blocks(order, cuts, made, size)), merged=True)
        size = max(size + 1, size * 3 // 2)
    return plans


def merge_blocks(order, cuts: set, made: dict, size: int) -> set:
    """The cuts that end pieces of consecutive blocks (the route between cuts) making at most
    ``size`` bytes each, a block larger than that a piece of its own: each piece ends at the
    last cut before it would pass the size. The stretch before the first cut is a block; the
    layers after the last cut (a head) are left to the policy's own replays, and that cut is
    always kept."""
    keep, since, last_cut = set(), 0, None
    for layer in order:
        since += made[layer]
        if layer in cuts:
            if since > size and last_cut is not None:
                keep.add(last_cut)
                since -= since_last_cut
            last_cut, since_last_cut = layer, since
    if last_cut is not None:
        keep.add(last_cut)
    return keep


def made_bytes(graph) -> dict:
    """Layer index -> bytes of the storages it creates (what its replay makes)."""
    return {layer.index: sum(graph.storages[s].nbytes for s in
                             {graph.values[v].storage for v in layer.outputs}
                             if graph.storages[s].creator == layer.index)
            for layer in graph.layers}


def split_at_convolutions(graph, order, cuts: set, made: dict, size: int,
                          smallest: bool = False) -> set:
    """The cuts, and the convolutions (CONV, FC, ATTN) that end a piece of a block wherever the
    bytes made since the last checkpoint pass ``size``: each cut at the last one passed since
    (the longest pieces), or with ``smallest`` at the one of them whose output is smallest (the
    fewest bytes kept). Where none was passed since, the piece grows until one is."""
    keep = set(cuts)
    since, passed = 0, []      # bytes made since the last checkpoint; [conv, bytes since it]
    for layer in order:
        if layer in cuts:
            since, passed = 0, []
            continue
        since += made[layer]
        for entry in passed:
            entry[1] += made[layer]
        if since > size and passed:
            at = min(passed, key=lambda entry: made[entry[0]]) if smallest else passed[-1]
            keep.add(at[0])
            since = at[1]
            passed = passed[passed.index(at) + 1:]
        if graph.layers[layer].kind in CHECKPOINT_KINDS:
            passed.append([layer, 0])
    return keep


def bytes_to_move(kept_live: list, budget: int) -> int:
    """What the Tensor Cache must send to the host when a plan whose live bytes per step are
    ``kept_live`` with every checkpoint kept runs within ``budget``: every rise of its live
    bytes above the highest they reached since they last fitted. Within such a stretch what
    went to the host waits there until backward reads it, so a fall and a rise below that mark
    (a replay's tensors made and freed while checkpoints wait on the host) move nothing new.
    Against what runs measured each way a step (half of offloaded plus prefetched), this counts
    closer: ResNet-152 at 869 sent 122 GiB (counted 110 so, 227 counting every rise),
    DenseNet-201 at 826 sent 25 (21 against 276), a 10,001-layer ResNet replaying whole blocks
    30 (29) (claims_zoo.json, state_tier_deep.json, zoo_plans.json against
    zoo_plans_high_water.json, where the zoo's plans are otherwise unchanged). Counting every
    rise, that ResNet kept its floor plan, which was to send 198 GiB a step to the host, and ran
    no step in 500 s (state_tier_deep_every_rise.json).
    """
    limit, moved, high = PLANNED_SHARE * budget, 0, 0
    for live in kept_live:
        now = max(0, live - limit)
        if now == 0:
            high = 0
        elif now > high:
            moved += now - high
            high = now
    return int(moved)


def _fits_on_device(build, policy, segments: list, budget: int) -> bool:
    """Whether replaying ``segments`` under ``policy`` and keeping every checkpoint on the
    device fits, the Tensor Pool's tensors counted as the pool counts them."""
    return build(policy, segments).moves_nothing_within(budget)


def _largest(fits, count: int) -> int | None:
    """The largest k in 0..count with fits(k), assuming fits is monotone; None if not fits(0)."""
    if not fits(0):
        return None
    low, high = 0, count
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _trim(plan, segments: list, budget: int, build, policy=None):
    """``segments`` less the least useful ones, while what is left fits on the device; the plan
    under ``policy`` (``plan``'s by default), or None if even all of them do not fit."""
    if not segments:
        return None
    policy = policy or plan.policy
    by_use = sorted(segments, key=lambda s: _usefulness(plan, s))
    dropped = _largest(lambda k: _fits_on_device(build, policy, by_use[k:], budget), len(by_use))
    if dropped is None:
        return None
    kept = {s.index for s in by_use[dropped:]}
    return build(policy, [s for s in segments if s.index in kept])


def _whole_blocks(plan, budget: int, build, segments_for, cuts: set, blocks: list,
                  convolutions: bool = False):
    """Every block replayed (Rule 8; ``blocks``, the least useful first); then the least useful
    blocks back to replaying only their cheap layers, or with ``convolutions`` only their CONV,
    FC and ATTN layers, while the plan still fits; then trimmed as above. None if even
    replaying every block does not fit with nothing moved."""
    graph = plan.graph
    if not blocks:
        return None

    def keep_in_part(count: int) -> set:
        """Cuts, plus the layers the ``count`` least useful blocks keep: their CONV, FC and
        ATTN layers, or with ``convolutions`` every other layer."""
        return cuts | {l for block in blocks[:count] for l in block.layers
                       if (graph.layers[l].kind in CHECKPOINT_KINDS) != convolutions}

    def fits(count: int) -> bool:
        return _fits_on_device(build, plan.policy, segments_for(keep_in_part(count)), budget)

    part = _largest(fits, len(blocks))
    if part is None:
        return None
    mixed = build(Policy.RECOMPUTE, segments_for(keep_in_part(part)))
    return _trim(mixed, list(mixed.segments), budget, build, plan.policy)
