"""Host memory is finite (runtime/host_memory.py, host.py Rule 5, module.py Rule 5): what a step
will take of it is checked before anything moves, the Tensor Cache's host memory is reused
across steps and given back when its plan is dropped, and the state tier keeps nothing of a
step. On the CPU nothing is pinned: the accounting and the release paths are checked through
the objects' own counters."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.runtime import host_memory
from superneurons.runtime.host_memory import (HostNeed, cache_need, first_step_need,
                                              pinned_size, state_need)
from superneurons.units import format_bytes
from test_state_tier import _same, _train


def _small():
    """A network whose superneurons plan offloads on the CPU, small enough to step in ~0.1 s."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _offloading(model, **kwargs):
    """A wrapper whose plan offloads on the CPU: superneurons at its own floor (no budget)."""
    return sn.wrap(model, policy="superneurons", **kwargs)


def _step(wrapped, batch=4):
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    F.nll_loss(wrapped(x), y).backward()


def _available(monkeypatch, nbytes):
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: nbytes)


def test_a_step_that_does_not_fit_is_refused_before_anything_moves(monkeypatch):
    model = _small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = sn.wrap(model, policy="superneurons", state="host", device="cpu")
    _available(monkeypatch, 1 << 10)         # below the gradients alone: certain to not fit
    with pytest.raises(ValueError) as error:
        _train(model, wrapped, steps=1)
    message = str(error.value)
    executor = wrapped._last[1]
    need = first_step_need(executor, model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert need.gradients == params and need.gradients > 1 << 10
    for text in (format_bytes(need.total), format_bytes(1 << 10), "MemAvailable",
                 "gradients", "Lower the batch", "state='device'", "more host memory",
                 "not counted: the optimizer's state", format_bytes(2 * params)):
        assert text in message, text
    # nothing ran: no gradient, no state moved, no host memory taken, parameters unchanged
    assert executor.step_id == 0 and executor.tier.moved_bytes == 0
    assert executor.pool.host_memory.capacity == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the step fits the bytes it needs exactly, and then trains as plain PyTorch
    _available(monkeypatch, need.total)
    plain = _small()
    expected, _ = _train(plain, plain)
    got, _ = _train(model, wrapped)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    _same(plain, model)


def test_the_cache_estimate_one_byte_short_warns_and_no_reading_means_no_check(monkeypatch):
    """The Tensor Cache's part is an upper estimate (the pool falls back to smaller chunks and
    pageable memory): short by it alone, the step is warned about and runs."""
    wrapped = _offloading(_small())
    x = torch.randn(4, 3, 32, 32)
    executor = wrapped.plan_for(x)[1]
    need = first_step_need(executor, wrapped.model)
    assert need.cache > 0 and need.gradients == 0      # state on the device: no host gradients
    _available(monkeypatch, need.total - 1)
    with pytest.warns(UserWarning, match="Tensor Cache"):
        wrapped(x)
    assert executor.step_id == 1
    _available(monkeypatch, None)                       # not Linux: no check, no error
    _step(wrapped)
    assert wrapped.stats.offloaded_bytes > 0


def test_the_cache_estimate_follows_what_the_pool_takes():
    wrapped = _offloading(_small())
    executor = wrapped.plan_for(torch.randn(4, 3, 32, 32))[1]
    estimate, at_most = cache_need(executor)
    _step(wrapped)
    taken = wrapped.stats.offloaded_bytes               # each entry goes to the host once
    assert 0.8 * taken <= estimate <= min(1.25 * taken, at_most)
    assert cache_need(executor)[0] == 0                 # its chunks are held now


def test_state_not_yet_in_host_memory_counts_its_copy_and_the_pinned_rounding():
    assert pinned_size(3 << 20, True) == 4 << 20 and pinned_size(4 << 20, True) == 4 << 20
    assert pinned_size(3 << 20, False) == 3 << 20 and pinned_size(0, True) == 0
    model = torch.nn.Sequential(torch.nn.Linear(300, 1000), torch.nn.BatchNorm1d(1000))
    sizes = [t.numel() * 4 for t in (*model.parameters(), *model.buffers()) if t.numel() > 1]
    # pageable host tensors to pin: the rounding beyond their own pages, and the largest source
    # beside its pinned copy
    taken, transient = state_need(model, pin=True)
    assert taken == sum(pinned_size(n, True) - n for n in sizes) and transient == max(sizes)
    assert state_need(model, pin=False) == (0, 0)       # nothing to move without pinning
    with torch.device("meta"):                          # state elsewhere: all of it is copied
        elsewhere = torch.nn.Linear(300, 1000)
    assert state_need(elsewhere, pin=False) == (1000 * 301 * 4, 300 * 1000 * 4)


def test_wrap_refuses_state_that_does_not_fit_before_moving_it(monkeypatch):
    with torch.device("meta"):
        model = torch.nn.Linear(300, 1000)
    _available(monkeypatch, 1000)
    with pytest.raises(ValueError, match="wrapping the model with state='host' needs about"):
        sn.wrap(model, state="host", device="cpu")
    assert model.weight.device.type == "meta"           # not moved


def test_the_optimizer_is_named_not_counted():
    need = HostNeed(gradients=10, optimizer_hint=20)
    assert need.total == 10
    assert "not counted: the optimizer's state" in "\n".join(need.lines())
    assert HostNeed(cache=5, reusable=8).total == 0


def test_available_host_bytes_reads_meminfo_or_says_nothing(monkeypatch):
    import builtins
    import os
    if os.path.exists("/proc/meminfo"):
        assert host_memory.available_host_bytes() > 0

    def missing(*args, **kwargs):
        raise OSError("no /proc here")
    monkeypatch.setattr(builtins, "open", missing)
    assert host_memory.available_host_bytes() is None


def test_the_cache_reuses_its_chunks_across_steps():
    wrapped = _offloading(_small())
    _step(wrapped)
    memory = wrapped._last[1].pool.host_memory
    chunks, capacity = set(memory.chunks), memory.capacity
    assert capacity > 0
    for _ in range(2):
        _step(wrapped)
        assert wrapped.stats.offloaded_bytes > 0 and wrapped.stats.host_memory_seconds == 0.0
        assert set(memory.chunks) == chunks and memory.capacity == capacity
        assert all(chunk.unused for chunk in memory.chunks.values())   # every region returned


def test_a_dropped_plan_gives_its_host_memory_back():
    wrapped = _offloading(_small())
    wrapped.max_plans = 1
    _step(wrapped, batch=4)
    first = wrapped._last[1]
    assert first.pool.host_memory.capacity > 0
    _step(wrapped, batch=5)                             # a second plan: the first is dropped
    assert first.pool.host_memory.closed and first.pool.host_memory.capacity == 0
    second = wrapped._last[1]
    assert second is not first and second.pool.host_memory.capacity > 0
    wrapped.replan()
    assert second.pool.host_memory.capacity == 0


def test_a_plan_dropped_in_flight_gives_it_back_once_its_step_is_done():
    wrapped = _offloading(_small())
    _step(wrapped)
    executor = wrapped._last[1]
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    loss = F.nll_loss(wrapped(x), y)
    wrapped.replan()                                    # its step still reads the pool
    assert executor.in_flight and executor.pool.host_memory.capacity > 0
    loss.backward()
    del loss
    _step(wrapped)                                      # the next call closes it
    assert executor.pool.host_memory.capacity == 0 and wrapped._retiring == []


def test_a_collected_wrapper_gives_its_host_memory_back():
    wrapped = _offloading(_small())
    _step(wrapped)
    memory = wrapped._last[1].pool.host_memory
    del wrapped
    gc.collect()
    assert memory.closed and memory.capacity == 0


def test_the_state_tier_keeps_nothing_of_a_step():
    model = _small()
    wrapped = sn.wrap(model, policy="superneurons", state="host", device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        _step(wrapped)
        tier = wrapped._last[1].tier
        assert not (tier.copies or tier.arrived or tier.ahead or tier.reading)
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        optimizer.step()
    optimizer.zero_grad()                               # the last step's targets go with .grad
    assert all(grad() is None for grad in grads)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_containers_memory_limit_bounds_what_is_available(tmp_path, monkeypatch, version):
    """host_memory Rule 3: MemAvailable sees the whole host; past a container's limit the
    out-of-memory killer ends the process. File pages count as room, as MemAvailable counts
    reclaimable cache."""
    limit, usage, stat = (tmp_path / name for name in ("limit", "usage", "stat"))
    key = "file" if version == "v2" else "total_cache"
    files = (str(limit), str(usage), str(stat), key)
    monkeypatch.setattr(host_memory, "CGROUP_FILES",
                        (files,) if version == "v2" else (("/nonexistent",) * 3 + ("file",),
                                                         files))
    monkeypatch.setattr(host_memory, "_mem_available", lambda: 100 << 30)
    limit.write_text(f"{8 << 30}\n")
    usage.write_text(f"{5 << 30}\n")
    stat.write_text(f"anon {4 << 30}\n{key} {1 << 30}\nother 7\n")
    assert host_memory.available_host_bytes() == 4 << 30        # 8 - 5 + 1 GiB
    limit.write_text("max\n" if version == "v2" else "9223372036854771712\n")
    assert host_memory.available_host_bytes() == 100 << 30      # no limit: MemAvailable
