"""The host store's pinning setting (host Rule 6): set once, the user's settings kept, none of
ours where the user chose pinned options."""

import pytest
import torch

from superneurons.runtime import host


@pytest.fixture
def settings(monkeypatch):
    given = []
    monkeypatch.setattr(host, "_pinning_set", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", given.append)
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setattr(host.os, "cpu_count", lambda: 12)
    return given


def _in_force(monkeypatch, text: str) -> None:
    """The allocator settings PyTorch says are in force."""
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: text,
                        raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", text)


def test_pinning_threads_are_set_once_keeping_the_users_settings(settings, monkeypatch):
    _in_force(monkeypatch, "expandable_segments:True")
    host._pin_with_threads()
    host._pin_with_threads()
    assert settings == ["expandable_segments:True,pinned_use_cuda_host_register:True,"
                        "pinned_num_register_threads:8"]      # a power of two, within 12 cores


def test_a_warning_from_the_setting_never_ends_a_step(monkeypatch):
    import warnings
    monkeypatch.setattr(host, "_pinning_set", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings",
                        lambda text: warnings.warn("deprecated", FutureWarning))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host._pin_with_threads()


def test_the_users_pinned_options_win(settings, monkeypatch):
    _in_force(monkeypatch, "pinned_use_cuda_host_register:False")
    host._pin_with_threads()
    assert settings == []


def test_a_step_counts_the_host_time_it_spent_taking_memory():
    """The first step takes host memory for its offloads; the next reuses it (StepStats)."""
    import torch.nn.functional as F
    import superneurons as sn
    from superneurons import models
    model = models.resnet(blocks=(1, 1, 1, 1), num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    wrapped = sn.wrap(model, policy="superneurons")
    seconds = []
    for _ in range(2):
        F.nll_loss(wrapped(x), y).backward()
        assert wrapped.stats.offloaded_bytes > 0
        seconds.append(wrapped.stats.host_memory_seconds)
    assert seconds[0] > 0 and seconds[1] == 0.0
    assert wrapped.stats.calibration_seconds == 0.0           # no allocator on the CPU


class _FakeCudart:
    """CUDA's runtime as pinned.py calls it, on a machine without CUDA: it pins at most
    ``limit`` bytes at once."""

    def __init__(self, limit=1 << 40):
        self.limit, self.registered, self.calls = limit, {}, []

    def cudaHostRegister(self, pointer, num_bytes, flags):
        self.calls.append(("register", num_bytes))
        if num_bytes > self.limit:
            return 2                                           # cudaErrorMemoryAllocation
        self.registered[pointer] = num_bytes
        return 0

    def cudaHostUnregister(self, pointer):
        self.calls.append(("unregister", self.registered.pop(pointer)))
        return 0


@pytest.fixture
def cudart(monkeypatch):
    from superneurons.runtime import pinned
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pinned.maps_itself()
    return fake


def test_a_mapped_chunk_is_unregistered_when_the_last_tensor_on_it_goes(cudart):
    """pinned.py Rule 1: before it is unmapped, never while a region of it is held."""
    import gc
    from superneurons.runtime.pinned import mapped_pinned
    chunk = mapped_pinned(4 << 20)
    assert cudart.calls == [("register", 4 << 20)] and bool((chunk == 0).all())
    region = chunk[4096:8192]
    del chunk
    gc.collect()
    assert cudart.calls == [("register", 4 << 20)]        # the region still reads it
    region.fill_(7)
    del region
    gc.collect()
    assert cudart.calls[-1] == ("unregister", 4 << 20) and not cudart.registered


def test_the_host_store_maps_its_chunks_and_halves_one_the_system_will_not_pin(
        cudart, monkeypatch):
    """host.py Rules 3, 5 and 6: mapped chunks, a smaller one where pinning fails, and at
    close no emptying of PyTorch's pinned cache, which holds none of their pages."""
    import gc
    emptied = []
    monkeypatch.setattr(host, "_return_pinned_pages", lambda: emptied.append(True))
    monkeypatch.setattr(host, "_pin_with_threads", lambda: pytest.fail("torch's path"))
    cudart.limit = 2 << 20
    memory = host.HostMemory(pin=True, first_chunk_bytes=4 << 20)
    region = memory.alloc(1000)
    assert [size for what, size in cudart.calls] == [4 << 20, 2 << 20]
    assert memory.pinned_bytes == 2 << 20 and memory.pin
    memory.release(region)
    memory.close()
    del region
    gc.collect()
    assert emptied == [] and not memory.chunks and not cudart.registered
