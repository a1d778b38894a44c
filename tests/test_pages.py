"""The host store's own pinned pages (runtime/pages.py): mapped, registered with CUDA, given
back once the device has finished, pageable where registering is refused, not inherited by
forks. CUDA's calls are faked on the CPU; the last test runs them on a GPU."""

import gc

import pytest
import torch

from superneurons.runtime import host, pages

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
mappable = pytest.mark.skipif(not pages.MAPPABLE, reason="no anonymous mappings here")


class FakeCudart:
    def __init__(self, refuse: bool = False):
        self.refuse, self.registered, self.unregistered, self.calls = refuse, [], [], []

    def cudaHostRegister(self, pointer, size, flags):
        if self.refuse:
            return 1
        self.registered.append((pointer, size))
        return 0

    def cudaHostUnregister(self, pointer):
        assert not pages._registered[pointer].closed     # Rule 2: never unmapped registered
        self.unregistered.append(pointer)
        self.calls.append("unregister")
        return 0


@pytest.fixture(autouse=True)
def module_state(monkeypatch):
    """pages.py's tables as they were, whatever a test leaves in them."""
    for table in ("_registered", "_pending", "_in_child"):
        monkeypatch.setattr(pages, table, type(getattr(pages, table))())


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.fixture
def device_waits(cudart, monkeypatch):
    """A CUDA device on the CPU: synchronize() records which device it waited for."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: cudart.calls.append(("synchronize", device)))
    return torch.device("cuda", 1)


@mappable
def test_mapped_chunks_are_registered_and_unregistered_once_no_region_uses_them(cudart):
    memory = host.HostMemory(pin=True, first_chunk_bytes=4096)
    regions = [memory.alloc(1000) for _ in range(5)]            # two chunks of 4096
    assert [size for _, size in cudart.registered] == [4096, 4096]
    assert memory.pinned_bytes == 8192
    regions[0].fill_(7)
    assert regions[0].sum().item() == 7 * 1000                   # host memory as any other
    for region in regions[:4]:
        memory.release(region)                                   # the first chunk is unused
    memory.close()
    first, second = (pointer for pointer, _ in cudart.registered)
    assert cudart.unregistered == [first]                        # given back at once
    memory.release(regions[4])
    assert cudart.unregistered == [first, second]                # once its last region returns
    assert memory.capacity == 0


@mappable
def test_chunks_are_unregistered_only_after_the_stores_device_finished(cudart, device_waits):
    """host Rule 5: a plan is dropped as soon as backward returns on the host, while the device
    may still copy out of its regions; only the store's device is waited for."""
    memory = host.HostMemory(pin=True, first_chunk_bytes=4096, device=device_waits)
    regions = [memory.alloc(1000) for _ in range(5)]
    for region in regions[:4]:
        memory.release(region)
    memory.close()
    assert cudart.calls == [("synchronize", device_waits), "unregister"]
    memory.release(regions[4])
    assert cudart.calls[2:] == [("synchronize", device_waits), "unregister"]


@mappable
def test_a_store_collected_unclosed_gives_its_chunks_back_at_the_next_safe_point(
        cudart, device_waits):
    """pages.py Rule 2: a finalizer calls no CUDA (it may run during another thread's graph
    capture); the mapping stays until the next give-back has waited for the device and
    unregistered it."""
    memory = host.HostMemory(pin=True, first_chunk_bytes=4096, device=device_waits)
    memory.alloc(1000)
    [(pointer, _)] = cudart.registered
    del memory
    gc.collect()                                  # the chunk's last tensor went with the store
    assert cudart.calls == [] and not pages._registered[pointer].closed
    host.HostMemory(pin=True, first_chunk_bytes=4096).close()
    assert cudart.calls == [("synchronize", device_waits), "unregister"]
    assert pointer not in pages._registered


@mappable
@pytest.mark.parametrize("waiting", ["captured", "refused"])
def test_chunks_whose_device_cannot_be_waited_for_now_are_given_back_later(
        cudart, device_waits, monkeypatch, waiting):
    """While a CUDA graph is captured nothing may wait; after a failed wait the copies' state
    is unknown: either way the chunks stay registered and mapped until a later give-back."""
    def refused(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if waiting == "captured":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    else:
        monkeypatch.setattr(torch.cuda, "synchronize", refused)
    memory = host.HostMemory(pin=True, first_chunk_bytes=4096, device=device_waits)
    memory.release(memory.alloc(1000))
    [(pointer, _)] = cudart.registered
    memory.close()
    assert cudart.unregistered == [] and pointer in pages._registered and pages._pending
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    pages.give_back([], None)
    assert cudart.unregistered == [pointer]


@pytest.mark.skipif(not pages.MAPPABLE or not hasattr(pages.os, "fork"),
                    reason="no anonymous mappings or fork here")
def test_a_forked_child_inherits_no_mapping_and_calls_no_cuda(cudart, device_waits):
    """pages.py Rule 4: the kernel would copy registered pages into every child at once."""
    memory = host.HostMemory(pin=True, first_chunk_bytes=1 << 21, device=device_waits)
    region = memory.alloc(1000)
    address = region.data_ptr()
    child = pages.os.fork()
    if child == 0:                                # the child: is the chunk mapped here?
        with open("/proc/self/maps") as maps:
            mapped = any(int(start, 16) <= address < int(end, 16)
                         for start, end in (line.split()[0].split("-") for line in maps))
        memory.release(region)
        memory.close()
        pages.os._exit(10 * mapped + (len(cudart.calls) > 0))
    _, status = pages.os.waitpid(child, 0)
    assert pages.os.waitstatus_to_exitcode(status) == 0, "mapped in the child, or CUDA called"
    memory.release(region)
    memory.close()
    assert cudart.unregistered == [address]


@mappable
def test_a_refused_registration_leaves_pageable_memory_and_its_error_read_off(monkeypatch):
    """pages.py Rule 3, host Rule 3: the chunk is used unpinned, and no more is pinned."""
    fake = FakeCudart(refuse=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    read_off = []
    monkeypatch.setattr(pages, "_read_off_last_error", lambda: read_off.append(True))
    memory = host.HostMemory(pin=True, first_chunk_bytes=4096)
    assert memory.alloc(1000).numel() == 1000
    assert read_off == [True] and memory.pinned_bytes == 0 and not memory.pin
    memory.close()
    assert fake.unregistered == []                               # nothing was registered


@mappable
def test_a_chunk_past_the_memory_available_is_halved_not_touched(cudart, monkeypatch):
    """Touching pages the host lacks would bring the out-of-memory killer (pages.py)."""
    monkeypatch.setattr(host.pages.host_memory, "available_host_bytes", lambda: 3000)
    memory = host.HostMemory(pin=True, first_chunk_bytes=10_000)
    assert memory.alloc(1000).numel() == 1000
    assert memory.capacity == 2048 and [size for _, size in cudart.registered] == [2048]
    memory.close()


@mappable
def test_a_chunk_cuda_will_not_unregister_stays_mapped(cudart, monkeypatch):
    monkeypatch.setattr(cudart, "cudaHostUnregister", lambda pointer: 1)
    monkeypatch.setattr(pages, "_read_off_last_error", lambda: None)
    memory = host.HostMemory(pin=True, first_chunk_bytes=4096)
    memory.release(memory.alloc(1000))
    [(pointer, _)] = cudart.registered
    memory.close()
    assert pointer in pages._registered          # CUDA has them: never unmapped


@needs_cuda
def test_on_cuda_mapped_pages_are_pinned_copy_both_ways_and_are_unpinned_when_given_back():
    memory = host.HostMemory(pin=True, first_chunk_bytes=1 << 21, device=torch.device("cuda"))
    region = memory.alloc(1 << 20)
    assert region.is_pinned() and memory.pinned_bytes == 1 << 21
    source = torch.arange(1 << 20, device="cuda", dtype=torch.int32).view(torch.uint8)[:1 << 20]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        region.copy_(source, non_blocking=True)
        back = torch.empty_like(source).copy_(region, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, source)
    chunk = next(iter(memory.chunks.values())).buffer
    memory.release(region)
    memory.close()
    assert not chunk.is_pinned() and memory.capacity == 0
