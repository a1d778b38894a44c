"""The pool's room at each step of a plan (executor Rules 4 and 8, pool Rule 3): the budget
less the plan's bytes outside the pool, the calibrated excess of real use over the plan and the
device memory the model does not own; and, in forward, the copies the room of the layers ahead
will need, started early. A part of the Executor (it reads the executor's plan, pool and
calibration); the executor runs the layers. The memory the model does not own is read here for
the wrapper too (module Rules 2 and 3)."""

import torch

from ..units import format_bytes
from .calibration import allocated_bytes

# executor Rule 8 looks at most this many layers ahead: a bound on the host time it adds to
# every layer of a network of thousands, not a tuned value (copies needing more lead than that
# start late)
OFFLOAD_LOOKAHEAD_LAYERS = 64


def allocator_counts(inputs: list) -> bool:
    """Whether the allocator's statistics count the step's ``inputs``: without the caching
    allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1) they read zero, and the runtime then keeps its
    own accounting, as on the CPU, with the first-step margin at every step (Rule 4)."""
    nbytes = sum(x.numel() * x.element_size() for x in inputs)
    return nbytes == 0 or allocated_bytes(inputs[0].device) >= nbytes


def foreign_bytes(graph, inputs: list, device: torch.device, parameters=None,
                  state_on_device: bool = True) -> int:
    """Device memory the plan does not know of: optimizer state, the user's other tensors.
    ``inputs``: the step's input tensors (the plan counts them); model state counts where it
    lives on the device."""
    parameters = graph.graph_module.parameters() if parameters is None else parameters
    known = sum(x.numel() * x.element_size() for x in inputs)
    if state_on_device:
        known += graph.param_bytes + graph.buffer_bytes + sum(
            p.grad.numel() * p.grad.element_size() for p in parameters if p.grad is not None)
    return max(0, allocated_bytes(device) - known)


def reads_device_memory(device: torch.device) -> bool:
    """Whether the device's allocator says what is allocated, so that memory the model does not
    own can be counted against the budget: CUDA's."""
    return device.type == "cuda"


def untouched_holds(plan_peak_bytes: int, budget_bytes: int, foreign: int) -> bool:
    """module Rule 2 at every step: the untouched (liveness) plan still fits the budget beside
    the ``foreign`` bytes the model does not own now (optimizer state made since the decision)."""
    return plan_peak_bytes + foreign <= budget_bytes


# a plan made again beside memory the model does not own leaves 1/REPLAN_SLACK of the budget
# for that memory to grow into, so that a step does not plan again at every few megabytes
REPLAN_SLACK = 50


def managed_holds(plan, budget_bytes: int, foreign: int) -> bool:
    """module Rule 3 at every step: whether a managed ``plan`` still fits the budget beside the
    ``foreign`` bytes the model does not own now. Its peak must fit; and a plan whose replays
    were chosen so that nothing moves within its budget (planner/trim.py) must still move
    nothing in what is left, give or take the slack a plan made again leaves (so that one
    made again without it, at its policy's floor, is not made again every few kilobytes).
    Made before the optimizer's first step, such a plan fills the room the state then takes,
    and a few more cheap replays cost less than moving what they would keep over the host
    link at every step."""
    if plan.peak_bytes + foreign > budget_bytes:
        return False
    if not plan.policy.recomputes or plan.budget_bytes is None or plan.state != "device":
        return True
    return not plan.moves_nothing_within(plan.budget_bytes) or \
        plan.moves_nothing_within(budget_bytes - foreign + budget_bytes // REPLAN_SLACK)


def budget_left(budget: int, others: int, device) -> int:
    """What a budget leaves the model once ``others`` bytes on the device are not its own."""
    if others >= budget:
        raise ValueError(
            f"tensors the model does not own already hold {format_bytes(others)} on {device}, "
            f"all of the budget of {format_bytes(budget)}: free them (optimizer state of "
            "another model, cached batches) or raise the budget above "
            f"{format_bytes(others)} plus what the model needs")
    return budget - others


class RangeMax:
    """max(values[first..last]) in O(1) after O(n log n) set-up (a sparse table): the pool asks
    it for every tensor it considers prefetching, on networks of thousands of steps."""

    def __init__(self, values: list):
        self.levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            previous = self.levels[-1]
            self.levels.append([max(previous[i], previous[i + width])
                                for i in range(len(previous) - width)])
            width *= 2

    def __call__(self, first: int, last: int) -> int:
        level = (last - first + 1).bit_length() - 1
        table = self.levels[level]
        return max(table[first], table[last - (1 << level) + 1])


class RoomKeeping:
    """The Executor's accounting of the pool's room (see the module's docstring)."""

    def allowance(self, step: int, until: int | None = None) -> int:
        """The pool's room from ``step`` to ``until``: the budget less the rest of the step
        (pool Rule 3)."""
        last_step = len(self.unmanaged) - 1
        step = min(max(step, 0), last_step)
        until = step if until is None else min(max(until, step), last_step)
        outside = self.unmanaged_max(step, until)
        if self.cuda:
            outside = self.calibration.outside(outside)
            if self.calibrating:
                ours = self.calibration.read() - self.pool.exact_device_bytes - \
                    self._awaiting_bytes()
                outside = max(outside, ours - self.foreign_bytes)
        return self.budget_bytes - outside - (self.foreign_bytes if self.count_foreign else 0)

    def _room_for_next(self, position: int, awaiting: int) -> int:
        """The pool's room after forward step ``position``: the next layer allocates before the
        pool can act again, so what it adds outside the pool and into it is left free now;
        ``awaiting``: _awaiting_bytes() now."""
        if self.calibrating:                    # allowance() reads the allocator
            following = min(position + 1, len(self.pool_created) - 1)
            return self.allowance(position, following) - self.pool_created[following] - \
                awaiting
        foreign = self.foreign_bytes if self.count_foreign else 0
        return self._forward_rooms()[0][position] - foreign - awaiting

    def _offload_ahead(self, position: int, awaiting: int) -> None:
        """Rule 8: after forward step ``position``, start the copies that a step from
        ``position + 2`` on needs to have left, where they would take longer to cross the link
        than the layers before that step: started later, they would be late. Until then the
        pool is taken to grow as the plan's pool buffers live, an offloaded one only until its
        last forward read: so the forecast is at most what the room will need, and Rule 8
        starts at most the copies the step would make itself."""
        pool = self.pool
        pool.free_finished()            # copies done since are not bytes still to leave
        if not pool.device_bytes:
            return
        last = min(self.num_layers, position + 2 + OFFLOAD_LOOKAHEAD_LAYERS) - 1
        if last < position + 2:
            return
        _, rooms, tightest = self._forward_rooms()
        if self._held(awaiting, position) + tightest(position + 2, last) <= 0:
            return                                       # nothing ahead needs room
        need, by_step = self._leaving(position, last, awaiting, rooms)
        if need > 0:
            pool.offload_early(position + 1, need, by_step)

    def _held(self, awaiting: int, position: int) -> int:
        """The pool's bytes on the device beyond its planned ones at forward step ``position``;
        the memory the model does not own takes the same room at every step: added here, not to
        the table of rooms, which would be made again whenever the caller's tensors change."""
        return self.pool.device_bytes + awaiting - self.pool_live[position] + \
            (self.foreign_bytes if self.count_foreign else 0)

    def _leaving(self, position: int, last: int, awaiting: int, rooms: list) -> tuple:
        """(bytes that must have left by a step up to ``last``, that step) where the copies
        started later would be late; (0, None) where none."""
        held = self._held(awaiting, position)
        link = self.plan.costs.machine.link_bytes_per_s
        started = self.work_before[position + 1]
        need, by_step = 0, None
        for ahead in range(position + 2, last + 1):
            leaving = held - rooms[ahead]
            if leaving > need and leaving > (self.work_before[ahead] - started) * link:
                need, by_step = leaving, ahead           # later, the copies would be late
        return need, by_step

    def _forward_rooms(self) -> tuple:
        """The tables of forward's rooms, the memory the model does not own left out (it takes
        the same room at every step: subtracted where read, so that the tables are made again
        only when the calibration changes, not whenever the caller's tensors do; a table costs
        a pass over the route, a lookup a layer's host time less than allowance()):
        per step p, the room _room_for_next(p) gives; per step a, that room for a - 1 less the
        pool's planned bytes by then (its growth is added back from where the pool is:
        Rule 8), and their range minimum."""
        key = self.calibration.excess_bytes
        if self.forward_rooms is None or self.forward_rooms[0] != key:
            cuda = self.cuda
            next_rooms = []
            for position in range(self.num_layers):
                outside = self.unmanaged_max(position, position + 1)
                if cuda:
                    outside = self.calibration.outside(outside)
                next_rooms.append(self.budget_bytes - outside - self.pool_created[position + 1])
            ahead = [0] + [next_rooms[a - 1] - self.pool_live[a - 1]
                           for a in range(1, self.num_layers)]
            self.forward_rooms = (key, next_rooms, ahead, RangeMax([-room for room in ahead]))
        return self.forward_rooms[1:]

    def _env_holds(self, node) -> None:
        for storage, nbytes in self.pool_storages_of.get(node, ()):
            self.holders[storage] = self.holders.get(storage, 0) + 1
            self.awaiting[storage] = nbytes

    def _env_drops(self, node) -> None:
        for storage, _ in self.pool_storages_of.get(node, ()):
            self.holders[storage] -= 1
            if not self.holders[storage]:
                self.awaiting.pop(storage, None)

    def _awaiting_bytes(self) -> int:
        """Bytes of planned pool storages made in this forward that no layer has saved yet."""
        if not self.awaiting:
            return 0
        for storage in [s for s in self.awaiting if (self.step_id, s) in self.pool.entries]:
            del self.awaiting[storage]
        return sum(self.awaiting.values())

    def _account(self, step: int, awaiting: int | None = None) -> None:
        step = min(max(step, 0), len(self.unmanaged) - 1)
        if awaiting is None:
            awaiting = self._awaiting_bytes()
        self.accounted_peak = max(self.accounted_peak,
                                  self.unmanaged[step] + self.pool.device_bytes + awaiting)
        if self.calibrating:
            self.calibration.observe(step, self.foreign_bytes, self.unmanaged[step] + awaiting,
                                     self.pool.exact_device_bytes)

    @property
    def excess_bytes(self):
        return self.calibration.excess_bytes

    @property
    def seen_excess(self):
        return self.calibration.seen_excess

    @property
    def calibration_seconds(self) -> float:
        return self.calibration.seconds
