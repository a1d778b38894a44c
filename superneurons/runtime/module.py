"""wrap(): a drop-in nn.Module whose training steps run within a memory budget.

Rule 1: a plan is made at the first forward for each input structure, tensor shape and dtype,
        value of every non-tensor argument (a graph specializes on them), module's training
        mode and scalars (a dropout's p, its config's: structure.py), parameter's requires_grad
        and the autocast state, as read after capture (HF classifiers set config.problem_type
        at their first call), and reused while among the MAX_PLANS used last (Rule 5). Other
        Python state the forward reads is fixed at capture: replan() after changing it.
Rule 2: when the budget holds the whole step with liveness alone, the model runs untouched:
        no copy, no replay (plain PyTorch already frees tensors after last use). On CUDA a
        call's first step runs managed, fitting cuDNN's engines to the budget (untouched.py
        Rule 1), and the decision counts the device memory the model does not own (optimizer
        state), which grows after the first step (momentum, Adam's moments), and a margin for
        what plain PyTorch uses between layers, from the call's own steps once read: every
        later step reads both again, once (UntouchedWatch.holds), and where the step would not
        fit, that call runs a managed plan of the same graph within what is left, kept beside
        the untouched one: the next step that fits runs untouched again (the same holds for
        "auto" choosing liveness).
Rule 3: a budget too small for the policy is a ValueError before the step runs, naming the
        smallest budget that would work. On CUDA the budget also holds what the model does not
        own, read before every step: where that grew past what a managed plan leaves (the
        optimizer's state, made by the first step), the plan is made again within what is
        left before the step runs, or the ValueError names the budget that would hold both. A
        plan whose replays were chosen to move nothing within its budget is made again too
        where what is left would make it move data.
Rule 4: no grad (evaluation) runs the model untouched, except with state on the host (Rule 6).
Rule 5: a dropped plan (the least recently used past MAX_PLANS, replan(), the wrapper collected)
        gives back its executor's pool and host memory (pinned chunks) at once where no step of
        it is in flight; else once that step's handles are gone (a loss not yet backpropagated
        reads them, and gradient accumulation keeps several steps'). A step's graph keeps its
        executor alive by itself (autograd holds the saved-tensor hooks, the executor's own
        methods): a wrapper collected before backward leaves its step whole. Calls that
        cycle through more structures than that, so that a dropped plan is asked for again,
        get one warning (each such call captures again).
Rule 6: state="host" keeps parameters, gradients, buffers and so the optimizer's state in host
        memory and streams them through the device layer by layer (state.py); the model is run
        on ``device`` (CUDA where there is one), always by an executor, and the call's tensors
        are moved there. Capture sees the model as on ``device`` (export.py Rule 3). Only the
        plan about to run (or be made) keeps resident state on the device (state.py Rule 7):
        another plan's copies would hold memory this one's budget does not count.
Rule 7: data parallelism with state="host" is the wrapper's own (process_group=, runtime/
        data_parallel.py): DistributedDataParallel's reducer hooks AccumulateGrad, which the
        state tier never runs, so DDP around such a wrapper is a ValueError before any
        collective (DDP reads _ddp_params_and_buffers_to_ignore first thing).
Rule 8: with strict_budget on CUDA, a step's forward and backward run with the caching
        allocator limited to the budget (allocator_cap.py), the untouched ones included:
        cuDNN's workspaces, which plans do not count, then fit in what the plan leaves rather
        than in what the device has. The caller's own limit is back for the loss and the
        optimizer's step. Off by default: plans are exact at layer boundaries, and between
        them real use can pass the plan (a loss's temporaries, allocator fragmentation); with
        the limit such a step runs out of memory, without it it passes the budget.
Rule 9: a plan counts the caller's backward as starting from the model's loss where one is
        among the outputs (planner/gradients.py Rule 5). Once a step saw a gradient reach such
        an output from outside as well (outside.py), the next forward or plan_for warns and
        makes every plan again, counting outside gradients for every output from then on
        (wrap(..., outside_gradients=True): from the first step).
Rule 10: once a managed plan's first steps are done (on CUDA, calibrated), the other plans that
        fit what the budget leaves beside the calibrated excess with nothing moved run a few
        steps each, and the fastest on the machine is kept, the running plan among them where
        it too fits so (trial.py); where the step before made the caching allocator retry at
        its limit, so do plans for lower budgets (trial.py Rule 7).
"""

import itertools
import logging
import time
import warnings
import weakref
from collections import OrderedDict

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..capture import capture
from ..capture.entry import Arguments, flat_inputs
from ..capture.autocast import autocast_state
from ..capture.hf import packed_positions, without_full_mask
from ..planner import Policy, parse_policy, parse_strategy, plan_graph
from ..planner.plan import BudgetError, parse_state
from ..units import format_bytes, parse_bytes
from .data_parallel import DataParallel, RefusesDDPOverHostState, agreed, check_group
from .executor import Executor
from .room import REPLAN_SLACK, budget_left, foreign_bytes, managed_holds, \
    reads_device_memory
from .calls import call_key, compute_device, moved_to, on_meta
from .checkpoint_keys import own_keys, wrapper_keys
from .allocator_cap import available as cap_available, capped
from .host_memory import check_first_step, check_state_fits
from .machine import machine_of
from .near_limit import managed_out_of_memory, untouched_out_of_memory
from .outside import seen_bytes
from .reads_through import ReadsThrough
from .state import check_state_tier, to_host_memory
from .stats import StepStats, step_stats
from .structure import Structure
from .trial import PlanTrials
from .untouched import UntouchedWatch, reset_peak
from .workspaces import end_stale

_MANAGED = (Policy.OFFLOAD, Policy.RECOMPUTE, Policy.SUPERNEURONS)
# policies whose untouched run is a decision that the step fits (Rule 2), not the policy itself
_DECIDES_UNTOUCHED = (*_MANAGED, Policy.AUTO)

# Plans kept per wrapped model (Rule 5). A training loop meets a few calls again and again: its
# batch, the epoch's last partial batch, and both in eval() mode where validation runs with
# grad (frozen BatchNorm). Four keep it from capturing again every epoch (seconds on a large
# model); a model fed ever new shapes holds at most four executors, each with pinned memory.
MAX_PLANS = 4

# the first step's doings for a command line's status (INFO: silent unless a caller asks)
log = logging.getLogger(__name__)


class SuperNeuronsModule(ReadsThrough, RefusesDDPOverHostState, nn.Module):
    def __init__(self, model: nn.Module, policy, budget, strategy, state="device", device=None,
                 process_group=None, slice_loss=True, strict_budget=False,
                 outside_gradients=False):
        super().__init__()
        self.model = model
        self.slice_loss = bool(slice_loss)                        # capture/sliced_loss.py
        self.structure = Structure(model)                               # Rule 1's key
        self.policy = parse_policy(policy)
        self.strategy = parse_strategy(strategy)
        self.budget_bytes = parse_bytes(budget)
        self.strict_budget = bool(strict_budget)                        # Rule 8
        if self.strict_budget and (self.budget_bytes is None or not cap_available()):
            raise ValueError("strict_budget limits CUDA's caching allocator to the budget: "
                             + ("give a budget too" if self.budget_bytes is None else
                                f"torch {torch.__version__} cannot read the allocator's limit "
                                "to give it back (torch.cuda.get_per_process_memory_"
                                "fraction): leave strict_budget off"))
        self.state = parse_state(state)
        self.compute_device = None                                      # Rule 6
        if self.state == "host":
            self.compute_device = compute_device(device)
            if self.strict_budget and self.compute_device.type != "cuda":
                raise ValueError(f"strict_budget limits CUDA's caching allocator; this model "
                                 f"runs on {self.compute_device}: leave strict_budget off")
            check_state_tier(model)
            check = lambda: check_state_fits(model, self.compute_device)  # host_memory Rule 1
            if process_group is None:
                check()
            else:                                           # data_parallel Rule 6
                check_group(process_group)
                agreed(check, process_group, self.compute_device, "the host memory check")
            log.info("moving the model's state into host memory")
            to_host_memory(model, self.compute_device)
        elif device is not None:
            raise ValueError("device= is for state='host' (compute there, state in host "
                             "memory); with the state on the device, move the model itself "
                             "(model.to(device)) before wrapping it")
        self._data_parallel = None                                      # Rule 7
        if process_group is not None:
            if self.state != "host":
                raise ValueError("process_group= is for state='host'; with the state on the "
                                 "device, wrap the wrapped model in DistributedDataParallel")
            self._data_parallel = DataParallel(model, process_group, self.compute_device)
        self.max_plans = MAX_PLANS
        self.outside_gradients = bool(outside_gradients)                # Rule 9
        self._outside_seen_bytes = 0       # seen by a step of a plan dropped since
        self._init_plans()
        # checkpoints use the model's own keys, so they move freely between wrapped and plain
        self.register_state_dict_post_hook(own_keys)
        self.register_load_state_dict_pre_hook(wrapper_keys)

    def _init_plans(self) -> None:
        self._executors: OrderedDict = OrderedDict()   # call key -> (plan, executor or None)
        # call key -> the managed (plan, executor) for steps its untouched plan no longer fits
        self._fallbacks: dict = {}
        self._retiring: list = []      # dropped executors with a step in flight (Rule 5)
        self._dropped: OrderedDict = OrderedDict()     # keys dropped lately (Rule 5's warning)
        # call key -> seconds spent making its plan, until a step runs it (StepStats)
        self._unreported: dict = {}
        self._last = None
        self._caps = {}                # device -> AllocatorCap (Rule 8)
        self._untouched = UntouchedWatch()   # call key -> its untouched steps' margin (Rule 2)
        self._trials = PlanTrials()                                     # Rule 10
        # Rule 5 when the wrapper is collected; the callback holds the containers, not self
        weakref.finalize(self, _drop_all, self._executors, self._fallbacks,
                         self._retiring, self._trials).atexit = False

    def plan_for(self, *args, **kwargs):
        """The (cached) plan for calls like ``model(*args, **kwargs)``: (plan, executor or None
        where the model runs untouched)."""
        self._count_outside_gradients(stacklevel=3)                      # Rule 9
        return self._planned(args, without_full_mask(self.model, kwargs))[1]  # as forward calls

    def _planned(self, args, kwargs):
        """(the call's key, plan_for's answer, the bytes on the device the model does not own
        where this call read them, else None: the step's executor takes that reading)."""
        tensors, key = call_key(args, kwargs)
        device = self._device(tensors)
        autocast = autocast_state(device.type)
        structure, parameters = self.structure.read()
        packed = packed_positions(self.model, args, kwargs)              # capture/hf.py Rule 1
        key = (key, structure, autocast, packed)
        if self._retiring:
            self._close_idle()
        planned, foreign = self._executors.get(key), None
        if planned is None:
            if key in self._dropped:
                self._warn_recapture()
            try:
                planned, foreign, key = self._make(key, args, kwargs, tensors, device,
                                                   autocast, packed)
            except BaseException:
                self._unreported.pop(key, None)       # no plan: no step will report its making
                raise
            self._executors[key] = planned
            while len(self._executors) > self.max_plans:                          # Rule 5
                self._drop_key(next(iter(self._executors)))
            if planned[1] is not None or self.policy not in _DECIDES_UNTOUCHED:
                return key, planned, None          # an executor reads the device itself
        else:
            self._executors.move_to_end(key)
        plan, executor = planned
        if foreign is None:
            if self.budget_bytes is None or not reads_device_memory(device) or \
                    (executor is None and self.policy not in _DECIDES_UNTOUCHED):
                return key, planned, None
            if executor is not None:
                # a step of this wrapper still in flight (gradient accumulation: two forwards,
                # then one backward) holds bytes the reading would take for another's; the
                # executor's own reading at the step's start counts them against its pool
                if self._in_flight():
                    return key, planned, None
                self._keep_state_of(None)  # other plans' resident copies are not another's
            foreign = foreign_bytes(plan.graph, tensors, device, parameters,
                                    state_on_device=self.state == "device")
        plans = self._executors
        if executor is None:                                                     # Rule 2
            if self._untouched.warm(key) and \
                    self._untouched.holds(key, plan.peak_bytes, self.budget_bytes, foreign):
                return key, planned, foreign
            # kept beside the untouched plan: memory others hold may be passing (a previous
            # micro-batch's activations, another model's step)
            plans = self._fallbacks
            if key not in plans:
                log.info("planning the step managed within what is left (its first, or the "
                         "optimizer's state or the untouched step's excess fills the budget)")
                plans[key] = self._plan(key, plan.graph, device, foreign, untouched=False)
            plan, executor = plans[key]
        # Rule 3, within the executor's budget: a trial may keep one below the caller's
        if not managed_holds(plan, executor.budget_bytes, foreign):
            log.info("%s on the device are not the model's: planning the step again within "
                     "what is left", format_bytes(foreign))
            try:   # with room for what is not the model's to creep (losses kept on the device)
                replanned = self._plan(key, plan.graph, device,
                                       foreign + self.budget_bytes // REPLAN_SLACK,
                                       untouched=plans is self._executors)
            except BudgetError:
                replanned = self._plan(key, plan.graph, device, foreign,
                                       untouched=plans is self._executors)
            self._drop(executor)
            plans[key] = replanned
        return key, plans[key], foreign

    def _count_outside_gradients(self, stacklevel: int) -> None:
        """Rule 9: once a step saw a gradient from outside reach an output the model's loss is
        computed from, every plan counts outside gradients (``stacklevel``: the caller's)."""
        if self.outside_gradients:
            return
        seen = max(self._outside_seen_bytes, seen_bytes(
            *(e for _, e in self._executors.values()),
            *(e for _, e in self._fallbacks.values()), *self._retiring))
        if not seen:
            return
        self.outside_gradients = True      # before the warning, which may be raised
        self.replan()
        warnings.warn(
            f"superneurons: a gradient of {format_bytes(seen)} reached an output the model's "
            "loss is computed from (its logits, say) from outside the model, beside the loss's "
            "own: that step's plan counted the backward of the model's loss alone, so it may "
            "have passed the budget by up to those bytes. From this step on, plans count a "
            "gradient from outside for every output (sn.wrap(..., outside_gradients=True) "
            "does so from the first step).", stacklevel=stacklevel + 1)

    def _in_flight(self) -> bool:
        """Whether any step of this wrapper has handles alive (module Rule 5)."""
        return bool(self._retiring) or any(
            executor is not None and executor.in_flight
            for _, executor in (*self._executors.values(), *self._fallbacks.values()))

    def replan(self) -> None:
        """Forget every plan: the next step captures the model again. A captured graph fixes
        the Python state the forward reads beyond the scalars of the modules and their
        configs (an object of another name, a global); call this after changing it."""
        while self._executors:
            self._drop_key(next(iter(self._executors)))
        self._dropped.clear()         # capturing again is asked for, not a cycle of shapes
        self._last = None

    def _drop_key(self, key) -> None:
        self._dropped[key] = None
        while len(self._dropped) > 4 * self.max_plans:
            self._dropped.popitem(last=False)
        dropped = self._executors.pop(key)[1]
        self._drop(dropped)
        self._trials.forget(key, self._drop, dropped)                   # Rule 10
        self._drop(self._fallbacks.pop(key, (None, None))[1])
        self._unreported.pop(key, None)
        self._untouched.forget(key)

    def _drop(self, executor) -> None:
        """Rule 5: give back a dropped plan's memory now, or once no step of it is in flight."""
        if executor is None:
            return
        self._outside_seen_bytes = max(self._outside_seen_bytes,            # Rule 9
                                       executor.outside.seen_bytes)
        if executor.in_flight:
            self._retiring.append(executor)
        else:
            executor.close()

    def _warn_recapture(self) -> None:
        """Once: calls cycle through more structures than the plans kept, so each capture is
        thrown away before its next use (seconds a step on a large model)."""
        if getattr(self, "_warned_recapture", False):
            return
        self._warned_recapture = True
        warnings.warn(
            f"superneurons: the model is called with more than {self.max_plans} different "
            "input structures (shapes, dtypes, modes) in turn, so a plan is captured again for "
            f"a call seen before; raise wrapped.max_plans above {self.max_plans} (each plan "
            "keeps its host memory) or pad inputs to fewer shapes",
            stacklevel=6)             # the user's call: through forward and nn.Module's call

    def _keep_state_of(self, executor) -> None:
        """Rule 6: drop the resident state copies of every plan but ``executor``'s."""
        if self.state != "host":
            return
        for other in (*(e for _, e in self._executors.values()),
                      *(e for _, e in self._fallbacks.values()), *self._retiring):
            if other is not None and other is not executor:
                other.tier.release()

    def _close_idle(self) -> None:
        still = [executor for executor in self._retiring if executor.in_flight]
        for executor in self._retiring:
            if not executor.in_flight:
                executor.close()
        self._retiring[:] = still          # the same list: the finalizer holds it

    def _device(self, tensors: list) -> torch.device:
        """Where the step runs: where the model lives (an input may be a host-side scalar), or
        with state on the host the device chosen (Rule 6)."""
        if self.compute_device is not None:
            return self.compute_device
        for state in itertools.chain(self.model.parameters(), self.model.buffers()):
            return state.device
        return tensors[0].device if tensors else torch.device("cpu")

    def _made(self, key, **seconds) -> None:
        """Time spent making the plan for ``key``, reported by the next step that runs it."""
        times = self._unreported.setdefault(key, {})
        for name, value in seconds.items():
            times[name] = times.get(name, 0.0) + value

    def _make(self, key, args, kwargs, tensors: list, device, autocast, packed: bool = False):
        if self.state == "host":                                        # Rule 6
            args, kwargs = on_meta((args, kwargs))
            self._keep_state_of(None)          # before foreign bytes are read below
        began = time.perf_counter()
        graph = capture(self.model, Arguments(args), autocast, kwargs,
                        device=device if self.state == "host" else None, packed_positions=packed,
                        slice_loss=self.slice_loss)
        graph.outside_gradients = self.outside_gradients                # Rule 9
        key = (key[0], self.structure.settle(), *key[2:])          # Rule 1, as captured
        self._made(key, capture_seconds=time.perf_counter() - began)
        foreign = None
        if self.budget_bytes is not None and reads_device_memory(device):
            foreign = foreign_bytes(graph, tensors, device, self.model.parameters(),
                                    state_on_device=self.state == "device")
        try:
            return self._plan(key, graph, device, foreign), foreign, key
        except BaseException as error:
            self._unreported.pop(key, None)       # no plan: no step will report its making
            if not isinstance(error, BudgetError) or not graph.outside_gradients:
                raise
            raise BudgetError(
                f"{error} (This plan counts a gradient from outside the model for every "
                "output, as an earlier step's backward needed: the warning before.)",
                error.policy, error.peak_bytes, error.needed_bytes, error.hint) from None

    def _plan(self, key, graph, device, foreign: int | None, untouched: bool = True):
        """(plan, executor or None) for a captured graph, within the budget less ``foreign``
        bytes on the device that the model does not own (None: not counted); ``untouched``:
        whether it may be the model run untouched (Rule 2)."""
        log.info("planning %d layers: %s within %s", len(graph.layers), self.policy,
                 "its own floor" if self.budget_bytes is None else format_bytes(self.budget_bytes))
        began = time.perf_counter()
        machine = machine_of(device)
        self._made(key, machine_seconds=time.perf_counter() - began)
        began = time.perf_counter()
        try:
            planned = self._choose_plan(key, graph, device, foreign, machine, untouched)
        except BudgetError as error:
            if not foreign:
                raise
            whose = ("the optimizer's state, made by its first step (momentum, Adam's moments), "
                     "and the caller's other tensors" if self.state == "device" else
                     "the caller's other tensors")
            raise BudgetError(
                f"policy {error.policy!r} needs at least {format_bytes(error.peak_bytes)} for "
                f"this model and input{error.hint}, and {format_bytes(foreign)} on {device} "
                f"are tensors the model does not own ({whose}): together more than the budget "
                f"of {format_bytes(self.budget_bytes)}. Raise the budget to at least "
                f"{format_bytes(error.needed_bytes + foreign)} or use a smaller batch.",
                error.policy, error.peak_bytes + foreign, error.needed_bytes + foreign,
                error.hint) from None
        self._made(key, planning_seconds=time.perf_counter() - began)
        plan, executor = planned
        log.info("planned: %s, predicted peak %s%s", plan.policy, format_bytes(plan.peak_bytes),
                 "" if executor is not None else "; the model runs untouched")
        return planned

    def _choose_plan(self, key, graph, device, foreign: int | None, machine, untouched: bool):
        """_plan's choice of policy and executor; ``machine``: the device's rates."""
        budget = self.budget_bytes
        if budget is not None and foreign is not None:
            budget = budget_left(budget, foreign, device)
        host = self.state == "host"

        def untouched_fits(plan) -> bool:         # Rule 2: with a margin where CUDA is read
            return untouched and (foreign is None or self._untouched.holds(
                key, plan.peak_bytes, self.budget_bytes, foreign))
        if budget is not None and self.policy in _MANAGED:
            try:
                liveness = plan_graph(graph, Policy.LIVENESS, budget, self.strategy, self.state,
                                      machine)
            except ValueError:
                liveness = None
            if liveness is not None and host:
                return liveness, Executor(liveness, device, self.budget_bytes,
                                          model=self.model)                         # Rule 6
            if liveness is not None and untouched_fits(liveness):
                return liveness, None                                             # Rule 2
        plan = plan_graph(graph, self.policy, budget, self.strategy, self.state,  # Rule 3
                          machine)
        if plan.policy not in _MANAGED and not host:
            if self.policy is not Policy.AUTO or untouched_fits(plan):
                return plan, None
            # "auto" chose liveness, which fits without the margin: the managed plan that
            # replays only what the budget needs, its executor calibrating the excess
            plan = plan_graph(graph, Policy.SUPERNEURONS, budget, self.strategy, self.state,
                              machine)
        if self.budget_bytes is None:
            return plan, Executor(plan, device, plan.peak_bytes, count_foreign=False,
                                  model=self.model)
        return plan, Executor(plan, device, self.budget_bytes, model=self.model)

    def forward(self, *args, **kwargs):
        end_stale()           # a workspace limit a raising backward left (executor Rule 9)
        if self.compute_device is not None:                             # Rule 6
            args, kwargs = moved_to((args, kwargs), self.compute_device)
        elif not torch.is_grad_enabled():
            return self.model(*args, **kwargs)                           # Rule 4
        kwargs = without_full_mask(self.model, kwargs)                   # capture/hf.py Rule 2
        self._count_outside_gradients(stacklevel=4)                      # Rule 9
        key, (plan, executor), foreign = self._planned(args, kwargs)
        made = {**self._unreported.pop(key, {}), "foreign_bytes": foreign or 0}   # StepStats
        device = executor.device if executor is not None else \
            self._device([t for t in pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)])
        self._untouched.cancel()     # an earlier untouched step without a backward (Rule 2)
        # StepStats and Rule 2; what it returns is the step before's retries (trial Rule 7)
        retried = reset_peak(device) > 0
        self._last = (plan, executor, device, made)
        if executor is None:
            try:
                out = self._capped(device, lambda: self.model(*args, **kwargs))   # Rule 8
            except torch.OutOfMemoryError as error:
                if not self.strict_budget:
                    raise
                raise RuntimeError(untouched_out_of_memory(self.budget_bytes)) from error
            decides = foreign is not None and self.policy in _DECIDES_UNTOUCHED   # Rule 2
            self._untouched.watch(key, out, device,
                                  plan.peak_bytes + foreign if decides else None,
                                  self.budget_bytes if self._says_passed(device) else None)
            return out
        if self._fallbacks.get(key, (None, None))[1] is executor:               # Rule 2
            self._untouched.warming(key)       # a managed step runs, not plan_for's look
        elif self.budget_bytes is not None and self.state == "device" and \
                plan.policy.recomputes:                                         # Rule 10
            plan, executor = self._executors[key] = self._trials.step_within(
                key, (plan, executor), device, self.budget_bytes, self.strategy, self.model,
                foreign, retried, self._drop, self._in_flight)
            made["trying"] = self._trials.trying                        # StepStats
            self._last = (plan, executor, device, made)
        self._keep_state_of(executor)                                   # Rule 6
        if self._data_parallel is not None:                             # Rule 7
            self._data_parallel.before_forward(executor.tier)
        graph = plan.graph
        flat = list(args) if graph.in_spec is None else flat_inputs(graph.in_spec, args, kwargs)
        if executor.step_id == 0:
            began = time.perf_counter()
            check_first_step(executor, self.model)                      # host_memory Rule 1
            made["host_check_seconds"] = time.perf_counter() - began
            log.info("first step: running %d layers (%s)", executor.num_layers, plan.policy)
        try:
            out = self._capped(device, lambda: executor.run(flat, foreign))      # Rule 8
        except torch.OutOfMemoryError as error:
            executor.release()
            raise RuntimeError(managed_out_of_memory(
                plan.policy, executor.callers_budget_bytes, self.strict_budget)) from error
        if self._says_passed(device):                           # untouched.py Rules 4, 5
            calibration = executor.calibration     # raised once: nothing more to tell it
            self._untouched.watch(key, out, device, None, self.budget_bytes,
                                  passed=None if calibration.raised else calibration.passed,
                                  own_budget_bytes=executor.budget_bytes)
        return out

    def _says_passed(self, device: torch.device) -> bool:
        """Whether a step past the budget is said (untouched.py Rule 4)."""
        return self.budget_bytes is not None and not self.strict_budget and \
            reads_device_memory(device)

    def _capped(self, device: torch.device, forward):
        """``forward()`` and the backward of what it returns under the budget (Rule 8)."""
        return capped(self._caps, device, self.budget_bytes, forward) if self.strict_budget \
            else forward()

    def no_sync(self):
        """As DistributedDataParallel.no_sync(): forwards inside it (and their backwards)
        accumulate gradients locally; the first forward after it syncs (Rule 7)."""
        if self._data_parallel is None:
            raise ValueError("no_sync() is for a model wrapped with state='host' and "
                             "process_group=")
        return self._data_parallel.no_sync()

    def __getstate__(self):
        # plans and executors hold streams, pinned memory and graphs: made again after loading
        state = self.__dict__.copy()
        for name in ("_executors", "_fallbacks", "_retiring", "_dropped", "_unreported", "_last",
                     "_caps", "_untouched", "_trials"):
            del state[name]           # __setstate__ makes them anew (_init_plans)
        # a process group does not travel: a copy trains alone until wrapped with one again
        state["_data_parallel"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._init_plans()            # a copy's own plans, and its own finalizer (Rule 5)

    @property
    def stats(self) -> StepStats | None:
        if self._last is None:
            return None
        plan, executor, device, made = self._last
        return step_stats(plan, executor, device, self.budget_bytes, made)

    @property
    def plan_trials(self) -> list:
        """Every finished trial of plans on the machine (Rule 10): each plan's replayed layers,
        the bytes of the budget it left to the allocator (trial Rule 7) and its timed step
        seconds, and the index of the one kept."""
        return list(self._trials.records)


def _drop_all(plans: OrderedDict, fallbacks: dict, retiring: list, trials) -> None:
    """Rule 5 for a wrapper Python collects. An executor with a step in flight is left to that
    step: autograd keeps its saved-tensor hooks, the executor's own methods, so the executor
    lives as long as the step's graph, and Python frees it with the graph (its host store,
    collected then, gives its chunks back once the device has finished: host Rule 5)."""
    for executor in {id(e): e for e in [e for _, e in (*plans.values(), *fallbacks.values())]
                     + retiring + trials.executors()}.values():
        if executor is not None and not executor.in_flight:
            executor.close()
    plans.clear()
    fallbacks.clear()
    retiring.clear()


def wrap(model: nn.Module, policy="superneurons", budget=None, *, strategy="cost-aware",
         state="device", device=None, process_group=None, slice_loss=True,
         strict_budget=False, outside_gradients=False):
    """Wrap ``model`` so its training steps run within ``budget`` (bytes or e.g. "12GiB").
    ``state="host"`` keeps parameters, gradients, buffers and optimizer state in host memory and
    runs the model on ``device`` (default: CUDA where there is one), streaming the state layer
    by layer: models whose state alone exceeds the device. Build the optimizer over the model's
    parameters as usual; it steps them in host memory. ``process_group`` (state="host"):
    train data-parallel over that torch.distributed group as DistributedDataParallel would,
    which cannot wrap such a model; ``wrapped.no_sync()`` as DDP's. ``slice_loss`` (on by
    default): run a cross-entropy's backward over slices of rows, with plain PyTorch's bits,
    holding two logits' bytes instead of three (capture/sliced_loss.py). A backward that builds
    a graph through the loss (create_graph=True: a gradient penalty), or one after the logits
    were written in place, is refused with a RuntimeError: pass slice_loss=False for those.
    ``strict_budget`` (CUDA): limit the caching allocator to the budget while a step's forward
    and backward run, so that cuDNN's workspaces fit what the plan leaves and no step passes
    the budget; where a step really uses more than its plan says between layers, it runs out
    of memory instead (Rule 8). Where the model returns its loss beside the logits it is
    computed from (labels given), plans count the backward of that loss alone; a step that
    also sends a gradient into those logits (a distillation term) is said once, and plans count
    it from the next step on (``wrapped.outside_gradients``, Rule 9). ``outside_gradients=True``
    plans for such a term from the first step."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"wrap() takes an nn.Module, not {type(model).__name__}")
    return SuperNeuronsModule(model, policy, budget, strategy, state, device, process_group,
                              slice_loss, strict_budget, outside_gradients)
