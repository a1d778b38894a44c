"""Budgets: errors before the step, the untouched fast path, auto, and the runtime keeping them
(the Tensor Pool's own rules on fakes: test_tensor_pool.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import superneurons as sn
from superneurons.capture import Kind
from superneurons.planner.plan import BudgetError, plan_graph
from superneurons import models
from equality import assert_same_training


def small_resnet():
    torch.manual_seed(0)
    return models.resnet(blocks=(1, 1, 1, 1), num_classes=10)


X, Y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))


def floor(policy: str) -> int:
    return sn.plan(small_resnet(), X, policy=policy).peak_bytes


def test_budget_below_the_floor_raises_before_the_step():
    model = small_resnet()
    before = [p.detach().clone() for p in model.parameters()]
    wrapped = sn.wrap(model, policy="superneurons", budget=floor("superneurons") - 1)
    with pytest.raises(ValueError, match=f"at least .*\\({floor('superneurons')} bytes\\)"):
        wrapped(X)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        sn.wrap(small_resnet(), policy="magic")
    with pytest.raises(ValueError, match="12GiB"):
        sn.wrap(small_resnet(), budget="twelve gigs")
    with pytest.raises(ValueError, match="nn.Module"):
        sn.wrap(lambda x: x)
    with pytest.raises(ValueError, match=r"fails on its inputs \(\(2, 5, 32, 32\).*channel"):
        sn.wrap(small_resnet())(torch.randn(2, 5, 32, 32))      # what plain PyTorch says
    with pytest.raises(ValueError, match="could not capture .* called with these arguments.*positional"):
        sn.wrap(small_resnet())(X, X)


def test_a_budget_that_fits_liveness_runs_plain_pytorch():
    wrapped = sn.wrap(small_resnet(), policy="superneurons", budget=floor("liveness"))
    F.nll_loss(wrapped(X), Y).backward()
    plan, executor = wrapped.plan_for(X)
    assert executor is None and plan.policy is sn.Policy.LIVENESS
    assert wrapped.stats.offloaded_bytes == 0 and wrapped.stats.recomputed_layers == 0


def test_auto_picks_the_fastest_policy_that_fits():
    budget = (floor("superneurons") + floor("recompute")) // 2
    wrapped = assert_same_training(small_resnet(), X, Y, steps=2, policy="auto", budget=budget)
    assert wrapped.stats.policy == "superneurons"
    assert wrapped.stats.peak_bytes <= budget
    roomy = sn.wrap(small_resnet(), policy="auto", budget=floor("recompute"))
    assert roomy.plan_for(X)[0].policy is sn.Policy.RECOMPUTE


def test_the_cache_moves_less_when_the_budget_grows():
    moved = []
    for budget in (floor("superneurons"), (floor("superneurons") + floor("offload")) // 2):
        wrapped = assert_same_training(small_resnet(), X, Y, steps=1, policy="superneurons",
                                       budget=budget)
        moved.append(wrapped.stats.offloaded_bytes)
        assert wrapped.stats.peak_bytes <= budget
    assert moved[0] > moved[1]


def test_one_pool_entry_per_storage_for_densenet_features():
    torch.manual_seed(0)
    model = models.densenet(16, cifar=True)
    wrapped = sn.wrap(model, policy="offload")
    out = wrapped(torch.randn(2, 3, 32, 32))
    pool = wrapped.plan_for(torch.randn(2, 3, 32, 32))[1].pool
    storages = [key[1] for key in pool.entries if len(key) == 2]
    assert len(storages) == len(set(storages)) > 0
    out.sum().backward()
    assert not pool.entries and pool.device_bytes == 0      # all released after backward


def test_a_layer_retried_after_running_out_of_memory_midway_completes_the_step(monkeypatch):
    """Rule 5 of the executor: handles made by the failed attempt must not release anything.
    (Its BatchNorm statistics moved twice: the attempt ran to the end before "failing".)"""
    from superneurons.runtime.executor import Executor
    calls = {"n": 0}
    real_call = Executor._call

    def flaky(self, layer, args, kwargs, trains=False):
        calls["n"] += 1
        if calls["n"] == 2:                       # stem.1, a BatchNorm in a segment
            real_call(self, layer, args, kwargs, trains)  # runs (and saves), then "runs out"
            raise torch.OutOfMemoryError("simulated")
        return real_call(self, layer, args, kwargs, trains)
    monkeypatch.setattr(Executor, "_call", flaky)
    model = small_resnet()
    wrapped = sn.wrap(model, policy="superneurons")
    F.nll_loss(wrapped(X), Y).backward()
    assert calls["n"] > 2 and wrapped.stats.recomputed_layers > 0


def test_a_layer_retried_after_its_allocation_failed_trains_exactly(monkeypatch):
    """Rule 5 as it happens: PyTorch's layers allocate their results before they write
    anything, so the failure comes before any BatchNorm statistic moves."""
    from superneurons.runtime.executor import Executor
    calls = {"n": 0}
    real_call = Executor._call

    def flaky(self, layer, args, kwargs, trains=False):
        calls["n"] += 1
        if calls["n"] in (2, 9):                  # stem.1 (BatchNorm) and a later layer
            raise torch.OutOfMemoryError("simulated")
        return real_call(self, layer, args, kwargs, trains)
    monkeypatch.setattr(Executor, "_call", flaky)
    wrapped = assert_same_training(small_resnet(), X, Y, steps=2, policy="superneurons")
    assert calls["n"] > 9 and wrapped.stats.recomputed_layers > 0


def test_range_max_agrees_with_max():
    from superneurons.runtime.room import RangeMax
    values = [(i * 7919) % 101 for i in range(300)]
    table = RangeMax(values)
    for first in range(0, 300, 7):
        for last in range(first, 300, 13):
            assert table(first, last) == max(values[first:last + 1])


def test_a_roomier_budget_moves_nothing_and_replays_less():
    x, y = torch.randn(4, 3, 96, 96), torch.randint(0, 10, (4,))   # activations dominate
    low = sn.plan(small_resnet(), x, policy="recompute").peak_bytes
    high = sn.plan(small_resnet(), x, policy="liveness").peak_bytes
    replayed = []
    for budget in (None, (low + high) // 2, low + 9 * (high - low) // 10):
        wrapped = assert_same_training(small_resnet(), x, y, steps=2, policy="superneurons",
                                       budget=budget)
        replayed.append(wrapped.stats.recomputed_layers)
        if budget is not None:
            assert wrapped.stats.offloaded_bytes == 0   # it fits with nothing moved
    assert 0 < replayed[2] <= replayed[1] < replayed[0]


class _DropoutBlock(torch.nn.Module):
    """A residual block with dropout between its convolutions: replayed whole, it must draw the
    same mask again."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.drop = torch.nn.Dropout(0.3)
        self.bn = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv2(torch.relu(self.bn(self.drop(self.conv1(x))))))


@pytest.mark.parametrize("model", ["resnet", "dropout"])
def test_whole_blocks_replayed_within_a_budget_train_exactly(model):
    torch.manual_seed(0)
    if model == "resnet":
        net, x = small_resnet(), torch.randn(4, 3, 96, 96)
    else:
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), _DropoutBlock(8),
                                  _DropoutBlock(8), _DropoutBlock(8), torch.nn.Flatten(),
                                  torch.nn.Linear(8 * 32 * 32, 10), torch.nn.LogSoftmax(1))
        x = torch.randn(4, 3, 32, 32)
    y = torch.randint(0, 10, (4,))
    # just under what replaying cheap layers needs with nothing moved (the planner keeps 3% spare)
    budget = int(0.99 * sn.plan(net, x, policy="recompute").peak_bytes)
    wrapped = assert_same_training(net, x, y, steps=3, policy="superneurons", budget=budget)
    plan, _ = wrapped.plan_for(x)
    assert any(plan.graph.layers[l].kind is Kind.CONV for l in plan.segment_of())
    assert wrapped.stats.offloaded_bytes == 0 and wrapped.stats.recomputed_layers > 0


def test_forward_starts_offloads_ahead_and_trains_exactly(monkeypatch):
    """Executor Rule 8: the same bytes leave as when the room is made only at the step that
    needs it, some of them layers earlier, and training is plain PyTorch's."""
    from superneurons.runtime import room
    budget = floor("superneurons")
    started = {}
    for lookahead in (0, room.OFFLOAD_LOOKAHEAD_LAYERS):
        monkeypatch.setattr(room, "OFFLOAD_LOOKAHEAD_LAYERS", lookahead)
        wrapped = sn.wrap(small_resnet(), policy="superneurons", budget=budget)
        plan, executor = wrapped.plan_for(X)
        steps, offload = [], executor.pool._offload

        def counted(entry, offload=offload, executor=executor, steps=steps):
            if executor.backward_step is None:                        # in forward
                steps.append((entry.key[1], executor.layer.index))
            return offload(entry)
        executor.pool._offload = counted
        assert_same_training(small_resnet(), X, Y, steps=1, policy="superneurons",
                             budget=budget)          # exact with the same budget and rule
        F.nll_loss(wrapped(X), Y).backward()
        started[lookahead] = (steps, wrapped.stats.offloaded_bytes)
    (late, late_bytes), (early, early_bytes) = \
        started[0], started[room.OFFLOAD_LOOKAHEAD_LAYERS]
    assert late and early_bytes == late_bytes                     # the same copies
    position = {layer: p for p, layer in enumerate(plan.order)}
    when_late, when_early = {}, {}                                # each storage's first
    for steps, when in ((late, when_late), (early, when_early)):
        for storage, layer in steps:
            when.setdefault(storage, position[layer])
    assert when_early.keys() == when_late.keys()
    assert all(when_early[k] <= when_late[k] for k in when_late)
    assert any(when_early[k] < when_late[k] for k in when_late)


def _trained_toward_recompute(blocks, share: float):
    """A network of a stem convolution, ``blocks()`` and a classifier head, trained 2 steps
    under superneurons, exactly as plain PyTorch, with a budget ``share`` of the way from the
    policy's floor to what recompute needs (every checkpoint kept): (wrapper, its plan)."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), *blocks(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(8, 10), torch.nn.LogSoftmax(1))
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    low = sn.plan(net(), x, policy="superneurons").peak_bytes
    high = sn.plan(net(), x, policy="recompute").peak_bytes
    wrapped = assert_same_training(net(), x, y, steps=2, policy="superneurons",
                                   budget=low + int(share * (high - low)))
    return wrapped, wrapped.plan_for(x)[0]


def test_whole_blocks_replayed_while_the_cache_moves_data_train_exactly():
    """Below what any plan needs with nothing moved, replaying every block still keeps the most
    on the device (planner trim.py): its block outputs go to the host and back, exactly."""
    wrapped, plan = _trained_toward_recompute(
        lambda: [_DropoutBlock(8) for _ in range(10)], 0.3)
    assert any(plan.graph.layers[l].kind is Kind.CONV for l in plan.segment_of())
    assert wrapped.stats.offloaded_bytes > 0 and wrapped.stats.peak_bytes <= plan.budget_bytes


class _WideBlock(torch.nn.Module):
    """A bottleneck four times wider inside than out: its replay makes far more than its
    output, so a small budget cuts it at a convolution rather than replaying it whole."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.a, self.bn1 = torch.nn.Conv2d(channels, width, 1), torch.nn.BatchNorm2d(width)
        self.b, self.bn2 = torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.BatchNorm2d(width)
        self.c, self.bn3 = torch.nn.Conv2d(width, channels, 1), torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        y = torch.relu(self.bn1(self.a(x)))
        y = torch.relu(self.bn2(self.b(y)))
        return torch.relu(x + self.bn3(self.c(y)))


def test_blocks_cut_at_convolutions_while_the_cache_moves_data_train_exactly():
    """Where every block replayed whole would set a higher floor than the budget allows, the
    wide blocks are cut at a convolution (trim.split_blocks): it moves less than the policy's
    own plan, and trains exactly."""
    wrapped, plan = _trained_toward_recompute(lambda: [
        _WideBlock(8, 32), _WideBlock(8, 32), torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),
        *[_DropoutBlock(8) for _ in range(4)]], 0.6)
    wide = {f"{block}.{conv}" for block in (1, 2) for conv in "abc"}
    replayed = {plan.graph.layers[l].name for l in plan.segment_of()} & wide
    assert replayed and replayed != wide          # cut inside, not replayed whole
    room = plan.budget_bytes                      # what the plan was made within
    own = plan_graph(plan.graph, "superneurons", machine=plan.costs.machine)
    assert plan.bytes_to_move(room) < 0.5 * own.bytes_to_move(room)
    assert wrapped.stats.offloaded_bytes > 0 and wrapped.stats.peak_bytes <= plan.budget_bytes


def test_a_replay_retried_after_running_out_of_memory_trains_exactly(monkeypatch):
    """Rule 5 in backward: a replay that runs out of memory is retried once, exactly."""
    from superneurons.runtime.executor import Executor
    failures = {"left": 1}
    real_replay = Executor.replay

    def flaky(self, record, last, wanted):
        if failures["left"]:
            failures["left"] -= 1
            raise torch.OutOfMemoryError("simulated")
        return real_replay(self, record, last, wanted)
    monkeypatch.setattr(Executor, "replay", flaky)
    wrapped = assert_same_training(small_resnet(), X, Y, steps=2, policy="superneurons")
    assert failures["left"] == 0 and wrapped.stats.recomputed_layers > 0


def test_running_out_of_memory_twice_in_backward_is_a_clear_error(monkeypatch):
    from superneurons.runtime.executor import Executor

    def always(self, record, last, wanted):
        raise torch.OutOfMemoryError("simulated")
    monkeypatch.setattr(Executor, "replay", always)
    model = small_resnet()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="backward of a superneurons step.*simulated.*the "
                       "plan counts .* at this step.*zero them"):
        F.nll_loss(sn.wrap(model, policy="superneurons")(X), Y).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_backward_error_says_whether_real_use_passed_the_plan():
    """Where the allocator was read, the error sets what it held beside what the plan counts:
    past it, real use passed the plan; within it, the request met memory held elsewhere."""
    from superneurons.runtime.near_limit import bring_back_out_of_memory
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 294.00 MiB.")
    said = [bring_back_out_of_memory("superneurons", 3 << 30, 2 << 30, 1 << 28,
                                     (allocated, 3 << 30), error)
            for allocated in (5 << 29, 1 << 31)]
    assert "2.50 GiB were allocated" in said[0] and "real use passed the plan" in said[0]
    assert "cannot reuse" in said[1] and "Tried to allocate 294.00 MiB" in said[1]


def test_host_memory_is_pinned_as_offloads_need_it_and_falls_back(monkeypatch):
    """host.py Rules 1-3: chunks are pinned as regions need them, each a power of two that
    doubles what is pinned; a system that will not pin a chunk gets a smaller one, then pageable
    memory: slower copies, not a failed step."""
    from superneurons.runtime import host
    monkeypatch.setattr(host.pages, "MAPPABLE", False)    # PyTorch's pinned allocator
    real_empty = torch.empty
    pinned = []

    def pin_at_most(limit):
        def empty(*args, pin_memory=False, **kwargs):
            if pin_memory:
                if args[0] > limit:
                    raise RuntimeError("CUDA error: out of memory")
                pinned.append(args[0])
            return real_empty(*args, **kwargs)      # pinned or not: the same on the CPU
        return empty
    monkeypatch.setattr(host.torch, "empty", pin_at_most(1 << 20))
    memory = host.HostMemory(pin=True, first_chunk_bytes=4096)
    regions = [memory.alloc(1000) for _ in range(4)]       # 1024 bytes each with alignment
    assert pinned == [4096] and memory.capacity == 4096     # one chunk held all four
    regions.append(memory.alloc(1000))
    assert pinned == [4096, 4096]                           # doubled what is pinned
    memory.release(regions.pop(0))
    regions.append(memory.alloc(1000))                      # the released region, reused
    assert memory.capacity == 8192
    memory.alloc(5000)
    assert pinned[-1] == 8192                               # at least the region, a power of two
    monkeypatch.setattr(host.torch, "empty", pin_at_most(3000))
    memory = host.HostMemory(pin=True, first_chunk_bytes=10_000)
    assert memory.alloc(1000).numel() == 1000 and memory.capacity == 2048   # halved until pinned
    monkeypatch.setattr(host.torch, "empty", pin_at_most(0))
    memory = host.HostMemory(pin=True, first_chunk_bytes=10_000)
    assert memory.alloc(1000).numel() == 1000 and not memory.pin   # pageable from now on

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
    monkeypatch.setattr(host.torch, "empty", no_memory)
    with pytest.raises(RuntimeError, match="out of host memory .* raise the budget"):
        memory.alloc(100_000)


def test_without_allocator_statistics_the_runtime_keeps_its_own_accounting(monkeypatch):
    """With PYTORCH_NO_CUDA_MEMORY_CACHING=1 the allocator's statistics read zero: the runtime
    must notice (the input itself is not counted) rather than trust readings of nothing."""
    from superneurons.runtime import room
    x = torch.randn(4, 4)
    monkeypatch.setattr(room, "allocated_bytes", lambda device: 0)
    assert not room.allocator_counts(x)
    monkeypatch.setattr(room, "allocated_bytes", lambda device: 64 + 1000)
    assert room.allocator_counts(x)
    assert room.allocator_counts(torch.empty(0))          # nothing to tell by: trust it


def test_the_backward_step_of_a_layer_with_scratch_is_entered(monkeypatch):
    """Executor Rule 6: a replayed layer's backward reads only its segment's slots; where the
    layer has scratch its step must still be entered so the pool makes that step's room
    (AlexNet b1620 ran LRN1's backward at POOL1's accounting and went out of memory)."""
    from superneurons.runtime.executor import Executor
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(inplace=True),
        models.layers.LocalResponseNorm(5), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(inplace=True),
        torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 10), torch.nn.LogSoftmax(dim=1))
    entered = []
    original = Executor._enter_backward_step
    monkeypatch.setattr(Executor, "_enter_backward_step",
                        lambda self, step: (entered.append(step), original(self, step)))
    wrapped = assert_same_training(model, X, Y, steps=1, policy="superneurons")
    plan, executor = wrapped.plan_for(X)
    lrn = plan.graph.layer("2")
    assert plan.actions[plan.graph.values[lrn.outputs[0]].storage] is sn.planner.Action.RECOMPUTE
    assert executor.bwd(lrn.index) in entered


def test_forward_leaves_room_for_the_next_layer():
    """After each forward layer the pool makes room for the next one, which allocates before the
    pool can act again: its outputs outside the pool and those that enter it."""
    budget = (floor("superneurons") + floor("recompute")) // 2
    wrapped = sn.wrap(small_resnet(), policy="superneurons", budget=budget)
    plan, executor = wrapped.plan_for(X)
    unmanaged, created = plan.unmanaged_per_step(), plan.managed_created_per_step()
    over = []
    make_room = executor.pool.make_room

    awaiting = []

    def checked(step, forward, limit=None):
        make_room(step, forward, limit)
        if forward and limit != 0 and step < executor.num_layers:
            waiting = executor._awaiting_bytes()
            awaiting.append(waiting)
            held = executor.pool.device_bytes + unmanaged[step] + created[step] + waiting
            over.append(held - budget)
    executor.pool.make_room = checked
    F.nll_loss(wrapped(X), Y).backward()
    assert over and max(over) <= 0
    assert max(awaiting) > 0


def test_pool_storages_no_layer_has_saved_yet_are_counted():
    """A planned pool storage is on the device from the layer that makes it, but becomes a pool
    entry only when a layer saves it (a branch's output, saved at the join): until then the
    pool's room and the calibration count it apart. Checked against the forward's environment
    itself: the planned pool storages its layers' outputs hold that are not entries."""
    budget = (floor("superneurons") + floor("recompute")) // 2
    wrapped = sn.wrap(small_resnet(), policy="superneurons", budget=budget)
    plan, executor = wrapped.plan_for(X)
    graph = plan.graph
    managed = {b.storage for b in plan.buffers if b.managed}
    made_by = {layer.node: {graph.values[v].storage for v in layer.outputs} & managed
               for layer in graph.layers}
    environment = {}
    load = executor._load

    def seen(node, env, trains=False):
        environment["env"] = env
        return load(node, env, trains)
    executor._load = seen
    checks = []
    make_room = executor.pool.make_room

    def checked(step, forward, limit=None):
        if forward and limit != 0:
            expected = {s for node in environment["env"] for s in made_by.get(node, ())
                        if (executor.step_id, s) not in executor.pool.entries}
            executor._awaiting_bytes()
            checks.append(expected)
            assert set(executor.awaiting) == expected
        make_room(step, forward, limit)
    executor.pool.make_room = checked
    F.nll_loss(wrapped(X), Y).backward()
    assert any(checks)


def test_a_budget_error_names_liveness_where_it_needs_less_than_the_policys_floor():
    """A floor whose replays and copies hold more at once than keeping everything (HF Mixtral's
    with its state on the host): the error names liveness's smaller need, and where liveness
    fits the budget it says to use it rather than to raise the budget."""
    pytest.importorskip("transformers")
    from today_models import tiny_hf_mixtral
    model, kwargs = tiny_hf_mixtral()
    floor = sn.plan(model, (), "superneurons", kwargs=kwargs, state="host").peak_bytes
    kept = sn.plan(model, (), "liveness", kwargs=kwargs, state="host").peak_bytes
    if kept >= floor:
        pytest.skip("liveness needs no less than the floor here: nothing to name")
    with pytest.raises(BudgetError, match="Use policy 'liveness', which fits") as error:
        sn.plan(model, (), "superneurons", (kept + floor) // 2, kwargs=kwargs, state="host")
    assert error.value.needed_bytes == kept


def test_a_backward_out_of_the_routes_order_holds_the_budget():
    """HF Gemma2's MLP branches: autograd runs a step the route has later before one with
    less room; planned at its own floor, the step's peak stays within the budget, exactly."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
        sliding_window=8, max_position_embeddings=64, use_cache=False, pad_token_id=0)
    config._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(config).train()
    ids = torch.randint(3, 128, (2, 16))
    call = dict(input_ids=ids, labels=ids, use_cache=False)
    floor = sn.plan(model, (), policy="superneurons", kwargs=call).peak_bytes
    plain = copy.deepcopy(model)
    wrapped = sn.wrap(model, policy="superneurons", budget=floor)
    for net in (plain, wrapped):
        torch.manual_seed(1)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            loss = net(**call).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
            if net is wrapped:
                assert wrapped.stats.peak_bytes <= floor, (wrapped.stats.peak_bytes, floor)
        if net is plain:
            expected = losses
    assert torch.equal(torch.stack(expected), torch.stack(losses))
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                 model.state_dict().values()))


def test_convolutions_replayed_alone_train_exactly():
    """torchvision's ResNet-50 in a roomy budget replays convolutions alone and keeps the batch
    norms' outputs (planner/trim.py): each replay reads a kept input and frees its output,
    exactly."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = torchvision.models.resnet50(num_classes=10)
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    low = sn.plan(net, x, policy="superneurons").peak_bytes
    high = sn.plan(net, x, policy="liveness").peak_bytes
    wrapped = assert_same_training(net, x, y, steps=3, loss_fn=F.cross_entropy,
                                   policy="superneurons", budget=low + int(0.85 * (high - low)))
    plan, _ = wrapped.plan_for(x)
    alone = [s for s in plan.segments if [plan.graph.layers[l].kind for l in s.layers]
             == [Kind.CONV]]
    assert alone and wrapped.stats.recomputed_layers > 0
    made = [plan.graph.values[plan.graph.layers[s.layers[0]].outputs[0]].storage for s in alone]
    assert all(plan.actions[storage] is sn.planner.Action.RECOMPUTE for storage in made)
