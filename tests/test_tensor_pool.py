"""The Tensor Pool's rules (runtime/pool.py) on its own, with movers whose copies finish when a
test says: eviction order, copies in flight, pages counted, prefetches and what gives way."""

import torch

from superneurons.planner.costs import H200
from superneurons.runtime.pool import State, TensorPool


def test_lru_evicts_least_recent_unlocked_and_respects_forward_use():
    room = {"bytes": 10_000}
    pool = TensorPool(torch.device("cpu"), lambda step, until=None: room["bytes"])
    a = pool.add("a", torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
    b = pool.add("b", torch.zeros(4000, dtype=torch.uint8), last_forward_step=5)
    c = pool.add("c", torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
    pool.make_room(step=1, forward=True)           # b is still read in forward: a goes
    assert a.state is State.ON_HOST and b.state is c.state is State.ON_DEVICE
    pool.locked.add("c")
    room["bytes"] = 4000
    pool.make_room(step=6, forward=True)           # c is locked: b goes
    assert b.state is State.ON_HOST and c.state is State.ON_DEVICE
    assert pool.offloaded_bytes == 8000
    assert torch.equal(pool.fetch(a, step=7), torch.zeros(4000, dtype=torch.uint8))
    assert pool.cache_misses == 1 and a.state is State.ON_DEVICE and "a" in pool.lru
    assert torch.equal(pool.fetch(a, step=8), torch.zeros(4000, dtype=torch.uint8))
    assert pool.cache_hits == 1
    pool.release(a)
    assert "a" not in pool.lru and pool.device_bytes == 4000


class _SlowCopies:
    """A mover whose offloads finish only when the test says (CUDA events stand-in)."""

    cuda = False

    def __init__(self):
        self.events = []

    def to_host(self, device_bytes, host_bytes, after=None):
        host_bytes.copy_(device_bytes)
        self.after = after
        event = _Event()
        self.events.append(event)
        return event

    def reuse_after(self, event):
        event.ordered = True            # the compute stream waits: the host does not


class _Event:
    def __init__(self):
        self.done = self.ordered = False

    def query(self):
        return self.done

    def synchronize(self):
        raise AssertionError("the host waited for a copy")


def test_offloads_in_flight_hold_their_bytes_until_copied():
    """Pool Rule 4: device bytes count until the copy is done; over budget, the oldest are
    freed behind a wait of the compute stream for their copies, and the host goes on."""
    room = {"bytes": 10_000}
    pool = TensorPool(torch.device("cpu"), lambda step, until=None: room["bytes"])
    pool.mover = _SlowCopies()
    a = pool.add("a", torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
    pool.add("b", torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
    room["bytes"] = 6000
    pool.make_room(step=1, forward=True)           # a leaves; its copy is in flight
    first = pool.mover.events[0]
    assert a.state is State.TO_HOST and first.ordered and pool.device_bytes == 4000
    pool.add("c", torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
    room["bytes"] = 10_000
    pool.make_room(step=2, forward=True)           # fits: b stays, nothing waited for
    assert pool.device_bytes == 8000 and len(pool.mover.events) == 1
    room["bytes"] = 5000
    pool.make_room(step=3, forward=True)           # b leaves, freed behind its copy
    assert pool.mover.events[1].ordered and pool.device_bytes == 4000
    room["bytes"] = 0
    pool.make_room(step=4, forward=True)           # c leaves; its copy not done and room 0
    assert pool.mover.events[2].ordered and pool.device_bytes == 0


def test_an_offload_copies_behind_the_host_memorys_fence():
    """host.py Rule 4: the copy into a region waits for what the host store says writes into
    its regions wait for, read after the region is handed out."""
    pool = TensorPool(torch.device("cpu"), lambda step, until=None: 0)
    pool.mover = _SlowCopies()
    fence = _Event()
    pool.host_memory.writes_after = lambda: fence
    pool.add("a", torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
    pool.make_room(step=1, forward=True)
    assert pool.mover.after is fence


def test_copies_start_ahead_of_the_room_that_needs_them():
    """Pool Rule 6: offload_early starts copies of the least recently used entries free to
    leave, without waiting; the room made later frees those done, without waiting either."""
    pool = TensorPool(torch.device("cpu"), lambda step, until=None: 100_000)
    pool.mover = _SlowCopies()
    a = pool.add("a", torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
    b = pool.add("b", torch.zeros(4000, dtype=torch.uint8), last_forward_step=3)
    c = pool.add("c", torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
    pool.offload_early(step=1, nbytes=5000, by_step=2)   # a, then c (b still read in forward)
    assert a.state is c.state is State.TO_HOST and b.state is State.ON_DEVICE
    assert pool.device_bytes == 12_000 and not any(e.ordered for e in pool.mover.events)
    pool.offload_early(step=1, nbytes=8000, by_step=2)   # already in flight: nothing more
    assert len(pool.mover.events) == 2
    for event in pool.mover.events:
        event.done = True
    pool.make_room(step=2, forward=True)
    assert pool.device_bytes == 4000 and not any(e.ordered for e in pool.mover.events)


def test_device_entries_count_whole_allocator_pages():
    """Pool Rule 5: on CUDA an entry above 1 MiB counts its bytes rounded up to the allocator's
    2 MiB page, so that entries leave room for the slivers of pages they keep mapped; one of at
    most 1 MiB counts in the small segments' 512-byte blocks. The exact bytes stay known for
    the executor's calibration."""
    pool = TensorPool(torch.device("cpu"), lambda step, until=None: 5 << 20,
                      H200.pool_bytes)             # as on CUDA
    large = (1 << 20) + 1000
    entries = [pool.add(k, torch.zeros(large, dtype=torch.uint8), last_forward_step=0)
               for k in "abc"]
    small = pool.add("d", torch.zeros(1000, dtype=torch.uint8), last_forward_step=0)
    assert pool.device_bytes == (6 << 20) + 1024 and pool.exact_device_bytes == 3 * large + 1000
    pool.make_room(step=1, forward=True)           # 6 MiB counted > 5 MiB room: one leaves
    assert [e.state for e in (*entries, small)].count(State.ON_HOST) == 1
    assert pool.device_bytes == (4 << 20) + 1024


class _SlowCopiesBothWays(_SlowCopies):
    abandoned: list

    def to_device(self, host_bytes, after=None):
        self.back_after = after
        event = _Event()
        self.events.append(event)
        return host_bytes.clone(), event

    def ready(self, device_bytes, event):
        pass

    def abandon(self, event):
        self.abandoned = [*getattr(self, "abandoned", []), event]


def test_prefetches_give_way_to_a_step_with_less_room():
    """Pool Rule 2: autograd may reach a step with less room after a later step prefetched
    for the room it had; the prefetches needed last leave first, the one needed now stays, and
    each keeps its copy's event (the next prefetch of it, and its host region, wait for it)."""
    room = {"bytes": 20_000}
    pool = TensorPool(torch.device("cpu"), lambda step, until=None: room["bytes"])
    pool.mover = _SlowCopiesBothWays()
    entries = [pool.add(key, torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
               for key in "abc"]
    for entry, need in zip(entries, (12, 13, 14)):
        entry.need_steps = [need]
    pool.make_room(step=1, limit=0, forward=True)
    for event in pool.mover.events:
        event.done = True
    pool.prefetch_ahead(step=11)             # with room for all three
    assert all(e.state is State.TO_DEVICE for e in entries) and pool.device_bytes == 12_000
    a, b, c = entries
    room["bytes"] = 8000
    pool.make_room(step=12, forward=False)   # a step with less room: c, needed last, leaves
    assert c.state is State.TO_HOST and c.event is not None and c.device is None
    assert a.state is b.state is State.TO_DEVICE and pool.device_bytes == 8000
    assert pool.mover.abandoned == [c.event]     # freed unread: behind its copy (mover Rule 2)
    room["bytes"] = 0
    pool.make_room(step=12, forward=False)   # a, needed now, stays
    assert a.state is State.TO_DEVICE and b.state is State.TO_HOST
    copied = c.event
    pool.fetch(c, step=14)                   # brought back behind the copy it had
    assert pool.mover.back_after is copied and c.state is State.ON_DEVICE
    pending = a.event
    pool.release(a)                          # its reader never came: freed behind its copy
    assert pool.mover.abandoned[-1] is pending and pool.device_bytes == 4000


def test_an_entry_released_unread_is_not_brought_back():
    """Pool Rule 2's queue of host entries outlives a release (a saved tensor whose reader never
    unpacked it): the released entry is skipped, not copied back from host memory it gave up."""
    room = {"bytes": 0}
    pool = TensorPool(torch.device("cpu"), lambda step, until=None: room["bytes"])
    a, b = (pool.add(key, torch.zeros(4000, dtype=torch.uint8), last_forward_step=0)
            for key in "ab")
    a.need_steps, b.need_steps = [5], [6]
    pool.make_room(step=1, limit=0, forward=True)
    pool.prefetch_ahead(step=4)                  # no room: the queue is made, nothing moves
    pool.release(a)
    room["bytes"] = 100_000
    pool.prefetch_ahead(step=4)
    assert a.device is None and b.state is State.TO_DEVICE and pool.device_bytes == 4000
