"""The faster of the plans that fit, measured on the machine (module Rule 10).

The planner picks, among the plans that fit the budget with nothing moved, the one with the
least replay work at the machine's rates (planner/trim.py). A step's time holds more than that:
the host's time per replayed layer, the copies the pool makes where real use passes the plan by
the calibrated excess (and the waits for them before convolutions, executor Rule 10), kernels
slower than their bytes say (batch norm in bf16). So once a managed plan's first steps are done
(on CUDA, its calibration), the other plans that fit what the budget leaves beside that excess
with nothing moved each run a few steps, and the one whose fastest step took least, timed from
one forward's start to the next, is kept; the others are dropped (module Rule 5).

Rule 1: every plan is exact, so the trial changes a step's speed, never its values.
Rule 2: a tried plan inherits the calibration of the plan it is tried against (executor Rule 4):
        it runs in the same room beside the same excess, without the slow reading steps; a step
        past the budget still raises its own excess (calibration.passed).
Rule 3: a step of the wrapper in flight (gradient accumulation) at a forward of the trial ends
        it there with the plan then running: another plan's pool would count that step's
        tensors as another's.
Rule 4: one trial per plan made: a plan made again (module Rule 3) is tried again.
Rule 5: the running plan was made before its calibration, with the first-step margin: where it
        moves data within the room the calibration leaves and the others fit it with nothing
        moved, it is not timed, nor kept. Timed beside them, it won a trial of efficientnet_b0
        by a step's noise and then moved 0.73 GB a step where they moved none
        (ratio_efficientnet_b0_bf16_4910947.json, at 0.75).
Rule 6: the plans tried are those that fit beside what the model does not own at the step the
        trial begins; a plan whose turn comes when that has grown past it (module Rule 3) is
        not run: the trial ends there with the plan then running.
Rule 7: where the step before the trial made the caching allocator retry at its limit
        (near_limit.py), plans for a budget lower by each of ROOM_SHARES are tried too, moving
        data or not, their executors (and so their Tensor Caches) keeping to that budget: the
        memory the allocator holds free beside the tensors then fits below its limit. The
        running plan is timed beside them (Rule 5 holds only against plans that move
        nothing). A retry waits for the device, so fewer of them can pay for the data a lower
        budget moves, or not: the machine decides.
Rule 8: when a plan's turn is over, every plan whose turn is over and whose fastest step was
        slower than another's is dropped at once (module Rule 5), the running one among them:
        Rule 7's plans move data, each through host memory of its own, which would otherwise
        stay pinned until the trial ends.
"""

import time
import weakref
from typing import NamedTuple

import torch

from ..planner import plan_graph
from .calibration import CALIBRATION_STEPS
from .executor import Executor
from .room import managed_holds

# timed steps per plan; a tried plan's first step runs untimed (it fills its host store), and a
# step is timed only up to the next forward of the same plan (a switch makes the next plan's
# executor on the host in between). A plan counts its fastest step: what else runs on the
# machine only adds to a step (one of two steps of efficientnet_b0 took 0.35 s, the other
# 0.15, and the median kept a plan whose steps took 0.16: ratio_efficientnet_b0_bf16_611bcfe.json)
TIMED_STEPS = 2
# plans tried beside the one chosen: each costs TIMED_STEPS + 2 steps
MAX_TRIED = 2
# Rule 7: shares of the budget left to the allocator. At a quarter of plain PyTorch's peak in
# bf16, with a budget 4% below the allocator's limit, DenseNet-121 retried 3-7 times a step;
# with 11% and 22% less budget it retried 0-3 times and its steps took 14% and 20% less time,
# while ResNet-50's, moving more, took 6% and 13% more with 6% and 11% less (BENCHMARKS.md,
# "What a lower budget gives the allocator")
ROOM_SHARES = (0.1, 0.2)
# the longest trial, in steps: the running plan's, then each other plan's with its first one
# (_Trial.schedule), for MAX_TRIED plans and Rule 7's
LONGEST_TRIAL_STEPS = (TIMED_STEPS + 1) + (MAX_TRIED + len(ROOM_SHARES)) * (TIMED_STEPS + 2)


class Candidate(NamedTuple):
    """A plan to try, and the bytes of the budget its executor leaves to the allocator."""
    plan: object
    gives_bytes: int = 0


class Clock:
    """Marks at a forward's start: CUDA events on the current stream (a step's time on the
    device, its idle waits for the host included), elsewhere the host's clock."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end) -> float:
        if self.device.type != "cuda":
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


def replays(plan) -> tuple:
    """What tells two plans apart: the policy and the layers each segment replays."""
    return plan.policy, tuple(tuple(s.layers) for s in plan.segments)


class _Trial:
    def __init__(self, tried: list, clock, running_fits: bool = True):
        self.tried = tried                    # [Candidate, executor or None until its turn]
        self.clock = clock
        # the plan of each step: the running one's steps (Rule 5: where it is a candidate),
        # then each other's with a first one
        self.schedule = [0] * (TIMED_STEPS + 1) * running_fits
        for index in range(1, len(tried)):
            self.schedule += [index] * (TIMED_STEPS + 2)
        self.marks: list = []                 # (plan index, mark) per step run
        self.gone: set = set()                # indices of the plans dropped already (Rule 8)

    def running(self):
        return self.tried[self.schedule[len(self.marks) - 1]][1] if self.marks else \
            self.tried[0][1]

    def drop_slower(self, drop) -> None:
        """Rule 8, as a turn ends: drop the plans whose turn is over and that are slower."""
        seconds = [min(s, default=float("inf")) for s in self.seconds()]
        over = {index for index, _ in self.marks} - self.gone
        fastest = min(seconds[i] for i in over)
        for index in over:
            if seconds[index] > fastest:
                self.gone.add(index)
                drop(self.tried[index][1])

    def holds(self, executor) -> bool:
        return any(executor is e for _, e in self.tried)

    def seconds(self) -> list:
        """Per plan, its timed steps' seconds."""
        timed = [[] for _ in self.tried]
        for k in range(len(self.marks) - 1):
            index, start = self.marks[k]
            following, end = self.marks[k + 1]
            first = k == 0 or self.marks[k - 1][0] != index
            if following == index and (not first or index == 0):
                timed[index].append(self.clock.seconds(start, end))
        return timed


class PlanTrials:
    """Per call key, its trial in progress, or the executor a finished one kept (weakly)."""

    def __init__(self, clock=Clock):
        self.clock = clock
        self.trials: dict = {}
        self.settled: dict = {}
        self.records: list = []               # every finished trial, for benchmarks and logs
        self.trying = False                   # whether the last step was one of a trial

    def step(self, key, planned, device, ready, others, make, drop, in_flight,
             fits=lambda candidate: True):
        """The (plan, executor) to run now for ``key``, whose own is ``planned``. ``ready(e)``:
        whether executor e's first steps are done; ``others(plan, e)``: (the Candidates to try
        beside it, whether it is itself one: Rule 5); ``make(candidate, e)``: an executor for a
        tried one; ``drop(e)``: module Rule 5; ``in_flight()``: whether a step of the wrapper
        is (asked only while a trial may run, not at every step of a settled plan);
        ``fits(candidate)``: whether its plan still fits beside what the model does not own
        now (Rule 6)."""
        self.trying = False
        plan, executor = planned
        trial = self.trials.get(key)
        if trial is not None and not trial.holds(executor):      # Rule 4: made again
            self._end(key, trial, None, drop, dropped=trial.running())
            trial = None
        if trial is None:
            settled = self.settled.get(key)
            if (settled is not None and settled() is executor) or not ready(executor) or \
                    in_flight():
                return planned
            candidates, running_fits = others(plan, executor)
            tried = [c for c in candidates if not c.gives_bytes and
                     replays(c.plan) != replays(plan)][:MAX_TRIED] + \
                [c for c in candidates if c.gives_bytes]                       # Rule 7
            if not tried:
                self.settled[key] = weakref.ref(executor)
                return planned
            trial = self.trials[key] = _Trial(
                [[Candidate(plan), executor]] + [[c, None] for c in tried],
                self.clock(device), running_fits)                                 # Rule 5
        elif in_flight():                                                 # Rule 3
            return self._end(key, trial, trial.running(), drop)
        if len(trial.marks) == len(trial.schedule):
            trial.marks.append((None, trial.clock.mark()))
            seconds = trial.seconds()
            fastest = min(range(len(trial.tried)),
                          key=lambda i: min(seconds[i], default=float("inf")))
            self.records.append({
                "plans": [{"replayed_layers": c.plan.num_extra_computations,
                           "gives_bytes": c.gives_bytes, "step_seconds": s}
                          for (c, _), s in zip(trial.tried, seconds)],
                "kept": fastest})
            return self._end(key, trial, trial.tried[fastest][1], drop)
        index = trial.schedule[len(trial.marks)]
        entry = trial.tried[index]
        if entry[1] is None and not fits(entry[0]):                      # Rule 6
            return self._end(key, trial, trial.running(), drop)
        if trial.marks and trial.marks[-1][0] != index:
            trial.drop_slower(drop)                                        # Rule 8
        if entry[1] is None:
            entry[1] = make(entry[0], trial.tried[0][1])
        self.trying = True
        trial.marks.append((index, trial.clock.mark()))
        return entry[0].plan, entry[1]

    def step_within(self, key, planned, device, budget_bytes: int, strategy, model, foreign,
                    retried: bool, drop, in_flight):
        """step() for a wrapper's managed plan with its state on the device, within the
        caller's ``budget_bytes`` beside the ``foreign`` bytes the model does not own (None:
        not read this step); ``retried``: whether the step before made the allocator retry
        (Rule 7)."""
        return self.step(
            key, planned, device, ready,
            lambda p, e: others_within(p, e, budget_bytes, strategy, "device", foreign, retried),
            lambda c, e: tried_executor(c, e, budget_bytes, model), drop, in_flight,
            lambda c: foreign is None or
            managed_holds(c.plan, budget_bytes - c.gives_bytes, foreign))        # Rule 6

    def _end(self, key, trial, kept, drop, dropped=None):
        """Keep executor ``kept`` (None: the trial's plans were made again), drop the trial's
        others (``dropped`` already is)."""
        del self.trials[key]
        for index, (_, executor) in enumerate(trial.tried):
            if executor is not None and executor is not kept and executor is not dropped \
                    and index not in trial.gone:
                drop(executor)
        if kept is None:
            return None
        self.settled[key] = weakref.ref(kept)
        candidate = next(c for c, e in trial.tried if e is kept)
        return candidate.plan, kept

    def forget(self, key, drop, dropped) -> None:
        """``key``'s plans are dropped (module Rule 5): so are its trial's others."""
        self.settled.pop(key, None)
        trial = self.trials.get(key)
        if trial is not None:
            self._end(key, trial, None, drop, dropped)

    def executors(self) -> list:
        return [e for trial in self.trials.values()
                for index, (_, e) in enumerate(trial.tried)
                if e is not None and index not in trial.gone]


def ready(executor) -> bool:
    """Whether an executor's first steps are done: where it reads the allocator, its
    calibration (executor Rule 4) and a step that trusted it; elsewhere its first step."""
    if not executor.reads_allocator:
        return executor.step_id >= 1
    calibration = executor.calibration
    return executor.step_id > CALIBRATION_STEPS and not calibration.active and \
        calibration.left == 0


def others_within(plan, executor, budget_bytes: int, strategy, state: str,
                  foreign=None, retried: bool = False) -> tuple:
    """(the Candidates to try beside ``plan``, whether it is itself one: Rule 5). Those that fit
    what ``budget_bytes`` leaves beside the ``foreign`` bytes the model does not own (read for
    this step; None: the executor's last reading) and the calibrated excess (executor Rule 4)
    with nothing moved: the planner's choice there first, then the others it found fitting
    (Plan.alternatives); where the last step ``retried`` at the allocator's limit, the
    planner's choice in each lower budget of Rule 7."""
    held = executor.foreign_bytes if foreign is None else foreign
    room = budget_bytes - held - (executor.calibration.excess_bytes or 0)
    fitting = [Candidate(p) for p in _plans_within(plan, room, strategy, state)
               if p.moves_nothing_within(room)]
    lower = []
    for share in ROOM_SHARES if retried else ():
        gives = int(budget_bytes * share)
        lower += [Candidate(p, gives)
                  for p in _plans_within(plan, room - gives, strategy, state)[:1]]
    return fitting + lower, plan.moves_nothing_within(room) or not fitting


def _plans_within(plan, room: int, strategy, state: str) -> list:
    """The planner's choice for ``plan``'s graph and policy in ``room``, then its alternatives;
    none where the policy's floor does not fit there."""
    if room <= 0:
        return []
    try:
        best = plan_graph(plan.graph, plan.policy, room, strategy, state, plan.costs.machine)
    except ValueError:
        return []
    return [best, *best.alternatives]


def tried_executor(candidate: Candidate, like, budget_bytes: int, model):
    """An executor for a tried ``candidate`` within the wrapper's ``budget_bytes``, calibrated
    as ``like`` (Rule 2)."""
    executor = Executor(candidate.plan, like.device, budget_bytes - candidate.gives_bytes,
                        model=model, callers_budget_bytes=budget_bytes)
    executor.calibration.adopt(like.calibration)
    return executor
