"""Bounded state (module.py Rules 2 and 5, host.py Rule 5): at most MAX_PLANS plans per wrapped
model, a dropped plan's memory given back without losing a step in flight, and the untouched
decision checked again at every step against memory the model does not own."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import superneurons as sn
from superneurons import models
from superneurons.planner.costs import OFF_CUDA
from superneurons.runtime import host, module, room, untouched
from superneurons.runtime.executor import Executor


def small_resnet():
    torch.manual_seed(0)
    return models.resnet(blocks=(1, 1, 1, 1), num_classes=10)


def batch(size: int):
    generator = torch.Generator().manual_seed(size)
    return (torch.randn(size, 3, 32, 32, generator=generator),
            torch.randint(0, 10, (size,), generator=generator))


def step(model, size: int) -> torch.Tensor:
    x, y = batch(size)
    loss = F.nll_loss(model(x), y)
    loss.backward()
    return loss.detach()


def assert_same_state(plain, managed):
    for (name, a), b in zip(plain.state_dict().items(), managed.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs"
    for a, b in zip(plain.parameters(), managed.parameters()):
        assert (a.grad is None) == (b.grad is None)
        assert a.grad is None or torch.equal(a.grad, b.grad)


def batch_sizes(wrapped) -> list:
    """The batch sizes of the plans kept, least recently used first (a key's first tensor)."""
    return [call[1][0][0][0] for call, *_ in wrapped._executors]


def chunk_buffers(executor) -> list:
    return [weakref.ref(chunk.buffer) for chunk in executor.pool.host_memory.chunks.values()]


# -- Rule 5: at most MAX_PLANS plans ------------------------------------------------------------
def test_only_the_plans_used_last_remain():
    wrapped = sn.wrap(small_resnet(), policy="superneurons")
    sizes = range(2, module.MAX_PLANS + 4)
    executors = {}
    for count, size in enumerate(sizes, 1):
        step(wrapped, size)
        executors[size] = wrapped.plan_for(batch(size)[0])[1]
        assert len(wrapped._executors) == min(count, module.MAX_PLANS)
    kept = batch_sizes(wrapped)
    assert kept == list(sizes)[-module.MAX_PLANS:]
    for size, executor in executors.items():
        assert executor.pool.host_memory.closed == (size not in kept), size
    step(wrapped, kept[0])                                    # used again: now the most recent
    step(wrapped, 100)
    assert batch_sizes(wrapped) == [*kept[2:], kept[0], 100]


def test_calls_cycling_past_the_plans_kept_warn_once(recwarn):
    wrapped = sn.wrap(small_resnet(), policy="superneurons")
    wrapped.max_plans = 2
    for size in (2, 3, 2, 3):                                  # fits: no warning
        step(wrapped, size)
    assert not [w for w in recwarn if "max_plans" in str(w.message)]
    for size in (4, 2, 3, 4):                                  # 2 was dropped, then asked for
        step(wrapped, size)
    warned = [w for w in recwarn if "max_plans" in str(w.message)]
    assert len(warned) == 1 and "more than 2 different input structures" in str(warned[0].message)
    wrapped.replan()                                           # asked for: no warning
    step(wrapped, 4)
    assert len([w for w in recwarn if "max_plans" in str(w.message)]) == 1


def test_a_dropped_executors_host_memory_is_given_back():
    wrapped = sn.wrap(small_resnet(), policy="superneurons")
    wrapped.max_plans = 1
    step(wrapped, 4)
    dropped = wrapped.plan_for(batch(4)[0])[1]
    memory = dropped.pool.host_memory
    assert wrapped.stats.offloaded_bytes > 0 and memory.capacity > 0
    buffers = chunk_buffers(dropped)
    step(wrapped, 3)                                          # batch 4's plan is dropped
    assert len(wrapped._executors) == 1 and not wrapped._retiring
    assert memory.closed and memory.capacity == memory.pinned_bytes == 0
    assert all(buffer() is None for buffer in buffers)       # nothing else holds the chunks
    assert not dropped.pool.entries and dropped.pool.device_bytes == 0
    kept = wrapped.plan_for(batch(3)[0])[1]
    assert kept.pool.host_memory.capacity > 0 and not kept.pool.host_memory.closed
    wrapped.replan()                                          # replan() gives back too
    assert kept.pool.host_memory.capacity == 0 and not wrapped._executors


@pytest.mark.filterwarnings("ignore:superneurons. the model is called")   # 1 plan: it cycles
@pytest.mark.parametrize("max_plans", [1, module.MAX_PLANS])
@pytest.mark.parametrize("policy", ["superneurons", "recompute"])
def test_training_alternating_batch_sizes_is_exact(policy, max_plans):
    """Three SGD steps, batch sizes 4, 3, 4: with one plan kept, every step drops the other's
    plan and captures again; the results are plain PyTorch's, bit for bit."""
    model = small_resnet()
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = sn.wrap(managed, policy=policy)
    wrapped.max_plans = max_plans
    losses = {}
    for name, net in (("plain", plain), ("wrapped", wrapped)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        losses[name] = []
        for size in (4, 3, 4):
            optimizer.zero_grad()
            losses[name].append(step(net, size))
            optimizer.step()
    assert torch.equal(torch.stack(losses["plain"]), torch.stack(losses["wrapped"]))
    assert_same_state(plain, managed)
    assert len(wrapped._executors) == min(2, max_plans)


@pytest.mark.parametrize("policy", ["superneurons", "recompute"])
def test_a_plan_dropped_mid_step_keeps_its_data(policy):
    """Two batch sizes in one step with one plan kept: the first's plan is dropped while its
    loss still waits for backward; its executor is closed only after, at the next call."""
    model = small_resnet()
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = sn.wrap(managed, policy=policy)
    wrapped.max_plans = 1
    for net in (plain, wrapped):
        (x4, y4), (x3, y3) = batch(4), batch(3)
        first = F.nll_loss(net(x4), y4)
        if net is wrapped:
            dropped = wrapped.plan_for(x4)[1]
        second = F.nll_loss(net(x3), y3)
        if net is wrapped:
            assert list(wrapped._retiring) == [dropped] and dropped.in_flight
            assert not dropped.pool.host_memory.closed
        (first + second).backward()
    assert_same_state(plain, managed)
    assert not dropped.in_flight
    wrapped.plan_for(batch(3)[0])                             # the next call closes it
    assert not wrapped._retiring and dropped.pool.host_memory.closed


@pytest.mark.parametrize("policy", ["superneurons", "recompute"])
def test_a_collected_wrapper_leaves_its_step_whole(policy):
    """A loss kept past its wrapper (sn.wrap(model)(x) in one expression) still backpropagates:
    autograd's saved-tensor hooks keep the executor alive, and it goes with the graph."""
    model = small_resnet()
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    step(plain, 4)
    wrapped = sn.wrap(managed, policy=policy)
    x, y = batch(4)
    loss = F.nll_loss(wrapped(x), y)
    executor = weakref.ref(wrapped.plan_for(x)[1])
    del wrapped
    gc.collect()
    assert executor() is not None                             # the step holds it
    loss.backward()
    assert_same_state(plain, managed)
    del loss
    gc.collect()
    assert executor() is None


def test_a_collected_wrapper_gives_back_its_host_memory():
    wrapped = sn.wrap(small_resnet(), policy="superneurons")
    step(wrapped, 4)
    executor = wrapped.plan_for(batch(4)[0])[1]
    memory = executor.pool.host_memory
    assert memory.capacity > 0
    del wrapped
    gc.collect()
    assert memory.closed and memory.capacity == 0


def test_a_closed_host_store_gives_back_chunks_once_their_regions_return(monkeypatch):
    """host.py Rule 5: at close, a chunk no region is carved from goes at once, and its pinned
    pages go back to the system; a chunk a live region still uses goes when it returns."""
    monkeypatch.setattr(host.pages, "MAPPABLE", False)    # PyTorch's pinned allocator
    real_empty = torch.empty
    monkeypatch.setattr(host.torch, "empty", lambda *args, pin_memory=False, **kwargs:
                        real_empty(*args, **kwargs))             # "pinned" on the CPU
    import weakref
    returned, chunks = [], []
    # the pages are free only once no chunk holds them: PyTorch's cache keeps blocks in use
    monkeypatch.setattr(host, "_return_pinned_pages",
                        lambda: returned.append([chunk() is None for chunk in chunks]))
    memory = host.HostMemory(pin=True, first_chunk_bytes=4096)
    regions = [memory.alloc(1000) for _ in range(5)]         # two chunks: 4096 and 4096
    assert memory.capacity == memory.pinned_bytes == 8192
    chunks.append(weakref.ref(next(iter(memory.chunks.values())).buffer))
    for region in regions[:4]:
        memory.release(region)                                # the first chunk is unused now
    del regions[:4], region                                   # as the pool lets go of them
    memory.close()
    assert memory.capacity == memory.pinned_bytes == 4096 and returned == [[True]]
    with pytest.raises(RuntimeError, match="closed"):
        memory.alloc(10)
    memory.release(regions[0])                                # the last region returns
    assert memory.capacity == 0 and not memory.chunks


# -- Rule 2: the untouched decision holds at every step -----------------------------------------
def test_untouched_holds_with_fake_byte_counts():
    gib = 1 << 30
    assert room.untouched_holds(plan_peak_bytes=8 * gib, budget_bytes=12 * gib, foreign=0)
    assert room.untouched_holds(8 * gib, 12 * gib, 4 * gib)               # exactly full
    assert not room.untouched_holds(8 * gib, 12 * gib, 4 * gib + 1)       # Adam's moments


class FakeDevice:
    """Fake counts of device memory the model does not own, as if the step ran on CUDA; no
    managed warm-up and no margin for what untouched steps use between layers (those are
    test_untouched_watch.py's)."""

    def __init__(self, monkeypatch, foreign: int = 0):
        self.foreign, self.calls = foreign, 0
        monkeypatch.setattr(module, "reads_device_memory", lambda device: True)
        monkeypatch.setattr(untouched, "UNTOUCHED_MARGIN", 0)
        monkeypatch.setattr(untouched, "WARMUP_STEPS", 0)
        monkeypatch.setattr(module, "foreign_bytes", self.read)

    def read(self, graph, tensors, device, parameters, state_on_device=True) -> int:
        self.calls += 1
        return self.foreign


def train_beside(device, plain, wrapped, x, y, foreign_per_step, seen) -> dict:
    """SGD steps with momentum on ``plain`` and ``wrapped`` alike, each beside the step's bytes
    the model does not own (``device.foreign``, as momentum's buffers would be counted);
    ``seen(foreign, readings before)`` after each wrapped step; the losses by model."""
    losses = {"plain": [], "wrapped": []}
    for name, net in (("plain", plain), ("wrapped", wrapped)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        for foreign in foreign_per_step:
            device.foreign, calls = foreign, device.calls
            optimizer.zero_grad()
            loss = F.nll_loss(net(x), y)
            loss.backward()
            optimizer.step()
            losses[name].append(loss.detach())
            if net is wrapped:
                seen(foreign, calls)
    return losses


@pytest.mark.parametrize("policy", ["superneurons", "auto"])
def test_optimizer_state_past_the_budget_plans_the_step_again(monkeypatch, policy):
    """Rule 2: the first step fits untouched; the optimizer's state then grows the memory the
    model does not own; the step that would exceed the budget runs a managed plan within what
    is left, planned before it runs, and training stays exact; when that memory is gone, the
    step runs untouched again. One reading per step."""
    x, y = batch(2)
    liveness = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="liveness").peak_bytes
    floor = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="superneurons").peak_bytes
    assert liveness - floor > 4000
    budget = liveness + 1000
    device = FakeDevice(monkeypatch)
    model = small_resnet()
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = sn.wrap(managed, policy=policy, budget=budget)
    untouched, readings = [], []

    def seen(foreign, calls):
        readings.append(device.calls - calls)
        untouched.append(wrapped._last[1] is None)                   # the step's executor
    losses = train_beside(device, plain, wrapped, x, y,
                          (0, 1000, (liveness - floor) // 2, (liveness - floor) // 2, 1000), seen)
    # the 3rd and 4th steps no longer fit; once the memory others hold is gone, untouched again
    assert untouched == [True, True, False, False, True]
    assert readings == [1, 1, 1, 1, 1]              # the untouched plan is checked every step
    assert torch.equal(torch.stack(losses["plain"]), torch.stack(losses["wrapped"]))
    assert_same_state(plain, managed)
    device.foreign = (liveness - floor) // 2
    plan, executor = wrapped.plan_for(x)
    assert executor is not None and plan.peak_bytes <= budget - device.foreign


def test_a_budget_the_optimizer_state_fills_is_an_error_before_the_step(monkeypatch):
    x, y = batch(2)
    floor = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="superneurons").peak_bytes
    liveness = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="liveness").peak_bytes
    device = FakeDevice(monkeypatch)
    model = small_resnet()
    wrapped = sn.wrap(model, policy="superneurons", budget=liveness)
    F.nll_loss(wrapped(x), y).backward()
    assert wrapped._last[1] is None                           # untouched: liveness fits
    device.foreign = liveness - floor + 1                     # not even the floor fits now
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="at least"):
        wrapped(x)
    device.foreign = liveness                                 # all of the budget
    with pytest.raises(ValueError, match="does not own already hold"):
        wrapped(x)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_managed_plan_the_optimizer_state_outgrows_is_made_again(monkeypatch):
    """Rule 3 at every step: a managed plan made before the optimizer had state (momentum) no
    longer fits beside it; the next step is planned again within what is left, before it runs,
    and training stays exact. Memory that goes away again does not make a third plan."""
    x, y = batch(8)
    liveness = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="liveness").peak_bytes
    floor = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="superneurons").peak_bytes
    # where the first plan peaks above the floor (at 0.9 of the way, convolutions replayed
    # alone peak at it: planner/trim.py)
    budget = floor + 8 * (liveness - floor) // 10
    first = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="superneurons",
                    budget=budget).peak_bytes
    assert floor < first <= budget                   # fewer replays than the floor plan
    device = FakeDevice(monkeypatch)
    closed = []
    close = Executor.close
    monkeypatch.setattr(Executor, "close", lambda self: (closed.append(self), close(self)))
    model = small_resnet()
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = sn.wrap(managed, policy="superneurons", budget=budget)
    grown = budget - first + 1                       # the first plan no longer fits
    executors = []

    def seen(foreign, calls):
        plan, executor = wrapped._last[:2]
        executors.append(executor)
        assert plan.peak_bytes + foreign <= budget
    losses = train_beside(device, plain, wrapped, x, y, (0, grown, grown, 0), seen)
    assert executors[0] is not executors[1]
    assert executors[1] is executors[2] is executors[3]
    assert closed == [executors[0]]                             # the first plan was given back
    assert torch.equal(torch.stack(losses["plain"]), torch.stack(losses["wrapped"]))
    assert_same_state(plain, managed)
    device.foreign = budget - floor + 1                         # not even the floor fits
    before = [p.detach().clone() for p in managed.parameters()]
    with pytest.raises(ValueError, match="does not own") as error:
        wrapped(x)
    assert sn.units.format_bytes(floor + device.foreign) in str(error.value)
    assert all(torch.equal(a, b) for a, b in zip(before, managed.parameters()))


def test_a_plan_chosen_to_move_nothing_is_made_again_where_the_state_would_make_it_move(
        monkeypatch):
    """Rule 3 for a plan whose replays were chosen so that nothing moves within its budget
    (planner/trim.py): its peak still fits beside the optimizer's state, but its replays no
    longer keep every checkpoint on the device there; it is made again within what is left,
    once, and training stays exact."""
    x, y = batch(8)
    liveness = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="liveness").peak_bytes
    floor = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="superneurons").peak_bytes
    budget = floor + 9 * (liveness - floor) // 10
    first = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="superneurons", budget=budget)
    assert first.moves_nothing_within(budget)
    slack = budget // module.REPLAN_SLACK            # what a plan made again leaves to grow
    grown = next(g for g in range(0, budget, 4096)
                 if not first.moves_nothing_within(budget - g + slack))
    assert first.peak_bytes + grown <= budget        # the peak alone would not plan again
    assert first.moves_nothing_within(budget - grown + slack + 4096)   # within the slack: not
    device = FakeDevice(monkeypatch)
    model = small_resnet()
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = sn.wrap(managed, policy="superneurons", budget=budget)
    executors = []

    def seen(foreign, calls):
        executors.append(wrapped._last[1])
    losses = train_beside(device, plain, wrapped, x, y, (0, grown, grown, grown), seen)
    assert executors[0] is not executors[1]
    assert executors[1] is executors[2] is executors[3]
    assert torch.equal(torch.stack(losses["plain"]), torch.stack(losses["wrapped"]))
    assert_same_state(plain, managed)


def test_the_error_beside_others_memory_names_the_policy_s_own_need_and_the_smallest(
        monkeypatch):
    x, y = batch(2)
    recompute = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="recompute").peak_bytes
    floor = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="superneurons").peak_bytes
    liveness = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="liveness").peak_bytes
    assert floor < recompute
    device = FakeDevice(monkeypatch)
    wrapped = sn.wrap(small_resnet(), policy="recompute", budget=liveness)
    F.nll_loss(wrapped(x), y).backward()
    device.foreign = liveness - floor + 1
    with pytest.raises(ValueError) as error:
        wrapped(x)
    message = str(error.value)
    assert f"policy 'recompute' needs at least {sn.units.format_bytes(recompute)}" in message
    assert f"policy 'superneurons' needs {sn.units.format_bytes(floor)}" in message
    assert f"at least {sn.units.format_bytes(floor + device.foreign)}" in message


def test_a_step_in_flight_is_not_read_as_memory_others_hold(monkeypatch):
    """Gradient accumulation: two forwards, then one backward. While the first call's step is in
    flight its tensors are on the device; the second call must not plan again as though they
    were another's, and training stays exact."""
    x, y = batch(8)
    liveness = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="liveness").peak_bytes
    floor = sn.plan(small_resnet(), x, machine=OFF_CUDA, policy="superneurons").peak_bytes
    budget = (floor + liveness) // 2
    device = FakeDevice(monkeypatch)
    model = small_resnet()
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = sn.wrap(managed, policy="superneurons", budget=budget)
    for net in (plain, wrapped):
        device.foreign = 0
        first = F.nll_loss(net(x), y)
        device.foreign = budget          # as a reading would count the first call's tensors
        second = F.nll_loss(net(x), y)
        (first + second).backward()
    assert len(wrapped._executors) == 1 and not wrapped._fallbacks
    assert_same_state(plain, managed)


def test_the_untouched_path_reads_nothing_off_cuda_or_without_a_budget(monkeypatch):
    calls = []
    monkeypatch.setattr(module, "foreign_bytes", lambda *args: calls.append(1) or 0)
    for budget in (None, 1 << 40):
        wrapped = sn.wrap(small_resnet(), policy="superneurons", budget=budget)
        for _ in range(2):
            step(wrapped, 2)
    assert not calls


def test_a_region_whose_copy_may_still_run_is_reused_behind_a_fence_not_a_host_wait(monkeypatch):
    """host.py Rule 4: with a fence, a region released while its host-to-device copy may run
    is reused at once, and copies into regions handed out after wait for the fence's event
    until it completes; without one, the host waits for the copy."""
    monkeypatch.setattr(host.pages, "MAPPABLE", False)    # PyTorch's pinned allocator
    real_empty = torch.empty
    monkeypatch.setattr(host.torch, "empty", lambda *args, pin_memory=False, **kwargs:
                        real_empty(*args, **kwargs))             # "pinned" on the CPU

    class Copy:
        def __init__(self):
            self.done = self.waited = False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True
    fences = []

    def fence():
        fences.append(Copy())
        return fences[-1]
    memory = host.HostMemory(pin=True, first_chunk_bytes=4096, fence=fence)
    regions = [memory.alloc(1000) for _ in range(4)]            # the chunk is full
    assert memory.writes_after() is None
    reading = Copy()
    memory.release(regions[0], reading)                          # its copy still runs
    again = memory.alloc(1000)
    assert again.data_ptr() == regions[0].data_ptr() and memory.capacity == 4096
    assert not reading.waited and len(fences) == 1
    assert memory.writes_after() is fences[0]
    fences[0].done = True
    assert memory.writes_after() is None
    waiting = host.HostMemory(pin=True, first_chunk_bytes=4096)
    regions = [waiting.alloc(1000) for _ in range(4)]
    reading = Copy()
    waiting.release(regions[0], reading)
    waiting.alloc(1000)
    assert reading.waited and waiting.writes_after() is None
