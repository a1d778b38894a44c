"""The Unified Tensor Pool and its LRU Tensor Cache (the paper's Algorithm 2).

One entry per storage: every saved view of it, by any number of layers, shares the entry, so a
tensor read by many layers (DenseNet's features) moves once. An entry is ON_DEVICE, TO_HOST
(on the host behind a copy that may still run: its offload, or a prefetch that gave way),
ON_HOST, or TO_DEVICE (prefetch in flight); dropped tensors are not entries (recomputation owns
them).

Rule 1: a tensor leaves the device only when the budget needs the room (now, or soon: Rule 6),
        least recently used first; tensors still to be read in forward, or read by the layer
        now running, are locked.
Rule 2: in backward, tensors come back ahead of need, in the order the route will read them, as
        far as the budget has room; a tensor needed now and not there is a cache miss. Autograd
        may reach a step with less room after a step the route has later prefetched for the
        room it had (branches): the prefetches not needed yet then give way.
Rule 3: the room the pool may use at a step is the budget less what the plan says the rest of
        that step needs; on CUDA, plus the calibrated excess (executor Rule 4), and while
        calibrating less what is really allocated outside the pool, if more. In
        forward the room is made after each layer for the next one, which allocates before the
        pool can act again, and leaves out the planned pool tensors no layer has saved yet
        (they become entries when one does: the executor counts them).
Rule 4: an entry whose offload is in flight still holds its device bytes (mover Rule 1): the pool
        counts them until the copy has finished; when the budget needs their room now, the
        oldest are freed behind a wait of the compute stream for their copies (mover Rule 3),
        not a wait of the host.
Rule 5: on CUDA an entry counts its bytes rounded up to the allocator's 2 MiB page: a tensor the
        pool frees between live ones leaves partly used pages that stay mapped: with hundreds of
        entries live, 0.7-1.0 GiB of such slivers at Inception-v4's stem left autograd's own
        kernels, which nothing can retry, out of memory within the budget (benchmarks/results/
        diagnose_inception_v4_1_before.json; the executor's first-step margin did the rest).
        A tensor of at most 1 MiB (batch statistics, a squeeze-excitation's pooled channels)
        lives in the allocator's small segments, shared with other small ones, in 512-byte
        blocks: it counts in those. The pool counts as the plan's machine does
        (Machine.pool_bytes; byte for byte off CUDA), so that a plan the planner says moves
        nothing fits what the pool counts.
Rule 6: in forward the executor starts, after each layer, the copies that the room of the
        layers ahead will need (executor Rule 8): they run while those layers compute, and the
        room is then made by freeing copies already done.
"""

import enum
from collections import OrderedDict, deque

import torch

from .handles import storage_bytes
from .host import HostMemory
from .mover import Mover


class State(enum.Enum):
    ON_DEVICE = "on device"
    TO_HOST = "on host behind a copy in flight"
    ON_HOST = "on host"
    TO_DEVICE = "prefetch in flight"


class Entry:
    __slots__ = ("key", "nbytes", "footprint", "device", "saved_view", "writtens", "host",
                 "event", "state", "last_forward_step", "need_steps", "refs", "pool")

    def __init__(self, pool, key, tensor: torch.Tensor, last_forward_step: int,
                 view=None):
        self.pool, self.key = pool, key
        # any tensor over the whole storage: as saved (its view in saved_view, so that a
        # reader of that view gets it back as is), or the bytes a prefetch brought back
        self.device, self.saved_view = tensor, view
        self.writtens: list = []     # savers' write checks holding these bytes (executor Rule 7)
        self.nbytes = tensor.untyped_storage().nbytes()
        self.footprint = pool.footprint(self.nbytes)           # Rule 5
        self.host = self.event = None
        self.state = State.ON_DEVICE
        self.last_forward_step = last_forward_step
        self.need_steps: list = []               # backward steps that will read it
        self.refs = 0

    def adopt(self, written) -> None:
        """Executor Rule 7: a saver's Written keeps these bytes while the entry holds them as
        saved, and lets go of them when the entry does (a check costs no copy of a tensor
        kept)."""
        if self.saved_view is None:
            written.forget_bytes()
        else:
            self.writtens.append(written)

    def let_go(self) -> None:
        """The entry holds no device bytes from now on."""
        for written in self.writtens:
            written.forget_bytes()
        self.writtens = []
        self.device = self.saved_view = None

    def next_need(self, step: int) -> int:
        upcoming = [s for s in self.need_steps if s >= step]
        return min(upcoming) if upcoming else 1 << 60


class TensorPool:
    def __init__(self, device: torch.device, allowance, footprint=lambda nbytes: nbytes):
        self.mover = Mover(device)
        self.host_memory = HostMemory(pin=self.mover.cuda,
                                      fence=self.mover.copies_in if self.mover.cuda else None,
                                      device=device if self.mover.cuda else None)
        self.allowance = allowance               # step -> bytes the pool may hold on the device
        self.entries: dict = {}                  # key -> Entry
        self.lru: OrderedDict = OrderedDict()    # on-device entries, least recently used first
        self.device_bytes = 0                    # counted by footprint (Rule 5)
        self.exact_device_bytes = 0              # as allocated, for the executor's calibration
        self.locked: set = set()                 # keys the running layer reads
        self.offloaded_bytes = self.prefetched_bytes = 0
        self.cache_hits = self.cache_misses = 0
        self._waiting = None                     # host entries by next need, rebuilt lazily
        self._waiting_since = 0                  # the step _waiting was ordered from
        self.draining: deque = deque()           # (event, device bytes, footprint) in flight
        self.footprint = footprint       # nbytes -> the device bytes the pool counts (Rule 5)

    def _hold(self, footprint: int, nbytes: int) -> None:
        self.device_bytes += footprint
        self.exact_device_bytes += nbytes

    # -- forward -------------------------------------------------------------------------------
    def add(self, key, tensor: torch.Tensor, last_forward_step: int, view=None,
            written=None) -> Entry:
        """The entry for ``key``, made from ``tensor`` (any tensor over the storage; ``view``:
        its view) if there is none; ``written``: the saver's check (Entry.adopt)."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = Entry(self, key, tensor, last_forward_step, view)
            self.lru[key] = entry
            self._hold(entry.footprint, entry.nbytes)
        else:
            entry.last_forward_step = max(entry.last_forward_step, last_forward_step)
            if key in self.lru:
                self.lru.move_to_end(key)
        if written is not None:
            entry.adopt(written)
        return entry

    def make_room(self, step: int, forward: bool, limit: int | None = None) -> None:
        """Rule 1: offload least recently used, unlocked entries until the pool fits."""
        self._drain(limit=None)
        if not self.device_bytes:
            return                               # nothing on the device to move
        limit = self.allowance(step) if limit is None else limit
        if self.device_bytes <= limit:
            return
        in_flight = sum(footprint for *_, footprint in self.draining)
        for key in list(self.lru):
            if self.device_bytes - in_flight <= limit:
                break
            entry = self.lru[key]
            if key in self.locked or (forward and entry.last_forward_step >= step):
                continue
            in_flight += self._offload(entry)
        if self.device_bytes - in_flight > limit:
            self._give_way(step, limit + in_flight)
        self._drain(limit)

    def _give_way(self, step: int, limit: int) -> None:
        """Rule 2's prefetches give way to a step whose room is smaller than the room they were
        started in (autograd ran a branch's backward before the route's order has it): those
        whose copies are done first (the compute stream waits for one still running: mover Rule 2),
        then those needed last; one needed now stays. Their host copies are still valid: the
        copy back waited for the copy out, so its event stands for both (a prefetch made again,
        or the host region's reuse, waits for it): such an entry is TO_HOST again."""
        def running(entry) -> bool:    # its bytes are reused only once its copy is done
            return entry.event is not None and not entry.event.query()
        ahead = sorted((e for e in self.entries.values()
                        if e.state is State.TO_DEVICE and e.key not in self.locked
                        and e.next_need(step) > step),
                       key=lambda e: (running(e), -e.next_need(step)))
        for entry in ahead:
            if self.device_bytes <= limit:
                break
            self._hold(-entry.footprint, -entry.nbytes)
            self.mover.abandon(entry.event)      # mover Rule 2: freed unread
            entry.let_go()
            entry.state = State.TO_HOST if entry.event is not None else State.ON_HOST
            self._waiting = None                 # Rule 2's queue holds it no more

    def offload_early(self, step: int, nbytes: int, by_step: int) -> None:
        """Rule 6: of the least recently used entries that make_room at ``by_step`` would send
        away to have ``nbytes`` leave (copies in flight count), start copying those free to
        leave at ``step``; make_room frees them when done, without waiting. Those still read
        in forward before ``by_step`` go then, as make_room picks them."""
        in_flight = sum(footprint for *_, footprint in self.draining)
        for key in list(self.lru):
            if in_flight >= nbytes:
                break
            entry = self.lru[key]
            if entry.last_forward_step >= by_step:
                continue                         # not make_room's at by_step either
            if key in self.locked or entry.last_forward_step >= step:
                in_flight += entry.footprint     # it leaves then; it counts as leaving
                continue
            before = self.device_bytes
            in_flight += self._offload(entry) + before - self.device_bytes

    def free_finished(self) -> None:
        """Free the device bytes of offloads whose copies are done (Rule 4)."""
        self._drain(limit=None)

    def drain_to(self, limit: int) -> bool:
        """Free the device bytes of offloads in flight, oldest first, behind waits of the compute
        stream for their copies (Rule 4), until the pool holds at most ``limit`` bytes or has
        nothing in flight; returns whether any wait was needed."""
        self._drain(limit=None)
        if self.device_bytes <= limit or not self.draining:
            return False
        self._drain(limit)
        return True

    def _drain(self, limit: int | None) -> None:
        """Rule 4: free the device bytes of finished offloads; with a ``limit``, free the oldest
        ones in flight, behind their copies, until the pool fits under it."""
        while self.draining:
            event, tensor, footprint = self.draining[0]
            if not event.query():
                if limit is None or self.device_bytes <= limit:
                    return
                self.mover.reuse_after(event)
            self.draining.popleft()
            self._hold(-footprint, -tensor.numel())

    def _offload(self, entry: Entry) -> int:
        """Start moving ``entry`` to the host; returns the bytes whose copy is now in flight."""
        source = None
        if entry.host is None:
            source = storage_bytes(entry.device)    # holds the bytes while the copy reads them
            entry.host = self.host_memory.alloc(entry.nbytes)
            entry.event = self.mover.to_host(source, entry.host,
                                             self.host_memory.writes_after())
            self.offloaded_bytes += entry.nbytes
        else:   # the host copy is still valid: saved tensors are not written after saving
            entry.event = None
        del self.lru[entry.key]
        self._waiting = None
        in_flight = 0
        if entry.event is not None:                                      # Rule 4
            self.draining.append((entry.event, source, entry.footprint))
            in_flight = entry.footprint
        else:
            self._hold(-entry.footprint, -entry.nbytes)
        entry.let_go()
        entry.state = State.TO_HOST if entry.event is not None else State.ON_HOST
        return in_flight

    # -- backward ------------------------------------------------------------------------------
    def fetch(self, entry: Entry, step: int) -> torch.Tensor:
        """The entry's bytes on the device, for a layer at ``step`` (Algorithm 2's Check)."""
        if entry.state is State.ON_DEVICE:
            self.cache_hits += 1
            self.lru.move_to_end(entry.key)
        else:
            if entry.state is State.TO_DEVICE:
                self.cache_hits += 1             # prefetched in time, or nearly
            else:
                self.cache_misses += 1
                self.make_room(step, forward=False)
                self._prefetch(entry)
            self.mover.ready(entry.device, entry.event)
            entry.state, entry.event = State.ON_DEVICE, None
            self.lru[entry.key] = entry
        self.locked.add(entry.key)
        return entry.device

    def prefetch_ahead(self, step: int) -> None:
        """Rule 2: bring back the entries backward reads next, while the budget has room."""
        if self._waiting is None or step < self._waiting_since:   # ordered from a later step
            self._waiting_since = step
            self._waiting = deque(sorted(
                (e for e in self.entries.values() if e.state in (State.ON_HOST, State.TO_HOST)),
                key=lambda e: e.next_need(step)))
        while self._waiting and not self._on_host(self._waiting[0]):
            self._waiting.popleft()              # fetched or released since
        for entry in self._waiting:              # nothing here changes the queue: no copy
            if not self._on_host(entry):
                continue
            need = entry.next_need(step)
            if need >= 1 << 60 or self.device_bytes + entry.footprint > self.allowance(step, need):
                break
            try:
                self._prefetch(entry)
            except torch.OutOfMemoryError:   # ahead of need: it comes back when it is needed
                break

    def _on_host(self, entry: Entry) -> bool:
        """Whether ``entry`` is still the pool's and on the host (or on its way there)."""
        return entry.state in (State.ON_HOST, State.TO_HOST) and \
            self.entries.get(entry.key) is entry

    def _prefetch(self, entry: Entry) -> None:
        """Start bringing ``entry`` back. Out of memory, it raises: ahead of need the pool stops
        prefetching; a fetch needed now is retried by the executor (its Rule 5)."""
        after = entry.event if entry.state is State.TO_HOST else None
        entry.device, entry.event = self.mover.to_device(entry.host, after)
        entry.state = State.TO_DEVICE
        self._hold(entry.footprint, entry.nbytes)
        self.prefetched_bytes += entry.nbytes

    def unlock_all(self) -> None:
        self.locked.clear()

    # -- lifetime ------------------------------------------------------------------------------
    def release(self, entry: Entry) -> None:
        """The last reader is done: free the device copy and return the host region."""
        if self.entries.pop(entry.key, None) is None:
            return
        if entry.device is not None:
            self._hold(-entry.footprint, -entry.nbytes)
            if entry.state is State.TO_DEVICE:
                self.mover.abandon(entry.event)  # mover Rule 2: freed unread
        self.lru.pop(entry.key, None)
        if entry.host is not None:
            self.host_memory.release(entry.host, entry.event)
        entry.writtens = []          # their handles are gone with the last reader's
        entry.device = entry.saved_view = entry.host = None

    def clear(self) -> None:
        """Drop every entry, with handles that may still read them (a step that raised): their
        checks let go of the bytes too."""
        for entry in list(self.entries.values()):
            for written in entry.writtens:
                written.forget_bytes()
            self.release(entry)

    def close(self) -> None:
        """Give back all the pool holds between steps: its entries, the device bytes of offloads
        in flight (once their copies finish), its host memory (host Rule 5). For a pool whose
        entries no handle reads any more (the executor checks). The copy streams are not
        destroyed: PyTorch takes them from its fixed per-device pool and never frees them."""
        self.clear()
        while self.draining:
            event, tensor, footprint = self.draining.popleft()
            event.synchronize()
            self._hold(-footprint, -tensor.numel())
        self._waiting = None
        self.host_memory.close()
