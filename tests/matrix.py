"""The models-today comparison harness: a model trained plainly and wrapped, from the same start
and the same seeds, must end bit-identical -- or be refused with a ValueError before its first
step changed anything.

    outcome = compare(case_or_build, "recompute", steps=3, optimizer="adamw", budget="forcing")
    outcome.status   # 'exact' or 'refused' (reason: the ValueError's message); a mismatch raises
                     # MatrixFailure, anything else the runtime raised propagates
    run(case, policy)  # the same, never raising: status 'FAILED' with the reason instead

``build()`` returns ``(model, args, kwargs, loss_fn)`` (see today_models.py); each side builds its
own model after the same ``torch.manual_seed``, is called ``model(*args, **kwargs)`` and trains
``steps`` optimizer steps, ``torch.manual_seed(seed + step)`` before each step, so dropout and
other randomness must match draw for draw. Compared: every step's loss (torch.equal), every
parameter and buffer by the model's own state_dict keys, which parameters have a gradient and the
gradients themselves, and any ``side_effects`` dict on the model's root.

budget="forcing": one below the liveness policy's own peak, so the runtime must act:
``(floor + liveness) // 2`` where ``floor`` is the policy's own peak (sn.plan with that policy),
``liveness`` the liveness policy's; None when the policy saves nothing, and for 'liveness'.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import superneurons as sn
from superneurons.planner.plan import captured_step, plan_graph

POLICIES = ("liveness", "offload", "recompute", "superneurons", "auto")

# case name, or "case/policy", -> why superneurons refuses it (a ValueError before its first
# step). A refusal not listed here fails the matrix test; so does a listed case that trains.
EXPECTED_REFUSALS: dict[str, str] = {
    # a hook's Python would run once, at capture; plain PyTorch runs it every step
    "c_hook_changes_output": "hook",
    "c_hook_side_effect": "hook",
    # plain PyTorch fails in backward; superneurons says so before the first step
    "c_inplace_on_saved": "writes in place into a tensor",
}


def expected_refusal(case: str, policy: str) -> str | None:
    return EXPECTED_REFUSALS.get(f"{case}/{policy}", EXPECTED_REFUSALS.get(case))


class MatrixFailure(AssertionError):
    """The wrapped model's training differs from plain PyTorch's (or it refused too late)."""


@dataclass
class Outcome:
    case: str
    policy: str
    status: str                          # 'exact' | 'refused' | 'FAILED'
    reason: str = ""
    budget: int | None = None
    plain_s: float = 0.0                 # the plain run (shared by the policies of one case)
    plan_s: float = 0.0                  # the two sn.plan calls of the forcing budget
    wrapped_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    stats: dict | None = None            # the wrapped model's last step (sn's StepStats)

    def __str__(self):
        return self.status if not self.reason else f"{self.status}: {self.reason}"

    def record(self) -> dict:
        return {"case": self.case, "policy": self.policy, "status": self.status,
                "reason": self.reason, "budget": self.budget, "plain_s": round(self.plain_s, 3),
                "plan_s": round(self.plan_s, 3), "wrapped_s": round(self.wrapped_s, 3),
                "notes": self.notes, "stats": self.stats}


# ----------------------------------------------------------------------------- training

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
}


@dataclass
class Trained:
    """What one side's training left: losses, final state, gradients, or where it raised."""

    losses: list = field(default_factory=list)
    error: BaseException | None = None
    error_step: int | None = None
    error_phase: str | None = None       # forward | loss | backward | step
    seconds: float = 0.0

    def where(self) -> str:
        return f"{type(self.error).__name__} at step {self.error_step} ({self.error_phase})"


def train(model, call, args, kwargs, loss_fn, steps: int, optimizer: str, seed: int) -> Trained:
    """``steps`` steps of ``call(*args, **kwargs)`` (the model, or its wrapper) on ``model``'s
    parameters; an exception is recorded with its step and phase, not raised."""
    opt = OPTIMIZERS[optimizer](list(call.parameters()))
    result = Trained()
    start = time.perf_counter()
    phase = "forward"
    for step in range(steps):
        try:
            torch.manual_seed(seed + step)
            opt.zero_grad(set_to_none=True)
            phase = "forward"
            out = call(*args, **kwargs)
            phase = "loss"
            loss = loss_fn(out)
            phase = "backward"
            loss.backward()
            phase = "step"
            opt.step()
            result.losses.append(loss.detach().clone())
        except Exception as error:          # noqa: BLE001 -- recorded and judged by the caller
            result.error, result.error_step, result.error_phase = error, step, phase
            break
        finally:
            out = loss = None
    result.seconds = time.perf_counter() - start
    return result


def snapshot(model: torch.nn.Module) -> dict:
    """Copies of state_dict (the model's keys), every buffer and every parameter's gradient."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "grads": {k: None if p.grad is None else p.grad.detach().clone()
                  for k, p in model.named_parameters()},
        "side_effects": copy.deepcopy(getattr(model, "side_effects", None)),
    }


@dataclass
class PlainRun:
    initial: dict
    final: dict
    trained: Trained


_PLAIN_CACHE: OrderedDict = OrderedDict()     # the last case's plain run, for its next policy


def _resolve(build) -> tuple[str, Callable, str | None]:
    if hasattr(build, "build"):                 # a today_models.Case
        return build.name, build.build, build.optimizer
    return getattr(build, "__qualname__", repr(build)), build, None


def _build(build, seed: int):
    torch.manual_seed(seed)
    model, args, kwargs, loss_fn = build()
    return model.train(), tuple(args), dict(kwargs or {}), loss_fn


def plain_run(build, *, steps=3, optimizer="adamw", seed=0, fresh=False) -> PlainRun:
    """Plain PyTorch's training of the case (cached for the case last asked; ``fresh``: run it
    again, cached or not, and keep the cached one)."""
    name, builder, _ = _resolve(build)
    key = (name, id(builder), steps, optimizer, seed)
    if key in _PLAIN_CACHE and not fresh:
        return _PLAIN_CACHE[key]
    if not fresh:
        _PLAIN_CACHE.clear()
    gc.collect()
    model, args, kwargs, loss_fn = _build(builder, seed)
    initial = snapshot(model)
    trained = train(model, model, args, kwargs, loss_fn, steps, optimizer, seed + 1)
    run = PlainRun(initial, snapshot(model), trained)
    del model, args, kwargs, loss_fn
    if not fresh:
        _PLAIN_CACHE[key] = run
    return run


def _same_training(a: PlainRun, b: PlainRun) -> list[str]:
    problems = []
    for step, (x, y) in enumerate(zip(a.trained.losses, b.trained.losses)):
        if not torch.equal(x, y):
            problems.append(f"loss of step {step}: {x.item()!r} then {y.item()!r}")
            break
    return problems + _differences(a.final["state"], b.final["state"], "state", limit=2)


# ---------------------------------------------------------------------------- comparison

def example_input(args: tuple):
    """sn.plan's example_input: the tensor when the model takes one, else the args tuple."""
    if len(args) == 1 and isinstance(args[0], torch.Tensor):
        return args[0]
    return args


_CAPTURED: OrderedDict = OrderedDict()   # the last case's layer graph, for all its policies


def forcing_budget(model, args, kwargs, policy: str, key=None, state="device") -> int | None:
    """Halfway between the policy's own peak and liveness's: the runtime must act. ``key``
    names the case (same model, same inputs) whose captured graph may be planned again."""
    if policy == "liveness":
        return None
    if key is None or key not in _CAPTURED:
        graph = captured_step(model, example_input(args), kwargs=kwargs)
        if key is not None:
            _CAPTURED.clear()
            _CAPTURED[key] = graph
    graph = _CAPTURED[key] if key is not None else graph
    liveness = plan_graph(graph, "liveness", state=state).peak_bytes
    floor = plan_graph(graph, policy, state=state).peak_bytes
    return (floor + liveness) // 2 if floor < liveness else None


def _differences(expected: dict, got: dict, what: str, limit=5) -> list[str]:
    problems = []
    if list(expected) != list(got):
        missing = [k for k in expected if k not in got]
        extra = [k for k in got if k not in expected]
        problems.append(f"{what} keys differ: missing {missing[:limit]}, extra {extra[:limit]}")
    for key, a in expected.items():
        if key not in got:
            continue
        b = got[key]
        if a is None or b is None:
            if (a is None) != (b is None):
                problems.append(f"{what} {key}: plain {'None' if a is None else 'a tensor'}, "
                                f"wrapped {'None' if b is None else 'a tensor'}")
        elif a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{what} {key}: plain {a.dtype}{list(a.shape)}, "
                            f"wrapped {b.dtype}{list(b.shape)}")
        elif not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "-"
            problems.append(f"{what} {key} differs (max |diff| {diff})")
    if len(problems) > limit:
        problems = problems[:limit] + [f"... {len(problems) - limit} more {what} differences"]
    return problems


def _changed(initial: dict, model: torch.nn.Module) -> list[str]:
    """What a refused step left changed: state (parameters, buffers) or gradients."""
    now = snapshot(model)
    problems = _differences(initial["state"], now["state"], "state")
    grads = [k for k, g in now["grads"].items() if g is not None]
    if grads:
        problems.append(f"gradients left on {grads[:3]}{' ...' if len(grads) > 3 else ''}")
    return problems


def _stats(wrapped) -> dict | None:
    try:
        stats = wrapped.stats
        return None if stats is None else dict(dataclasses.asdict(stats))
    except Exception:                       # noqa: BLE001 -- informative only
        return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def compare(build, policy: str, *, steps: int = 3, optimizer: str | None = None,
            budget: Any = "forcing", seed: int = 0, state: str = "device") -> Outcome:
    """Train ``build``'s model plainly and under ``sn.wrap(policy=, budget=, state=)``; see
    the module docstring. Returns the outcome ('exact' or 'refused'); raises MatrixFailure on
    any difference and lets any other exception of the wrapped side through. ``state="host"``:
    the wrapped model's state in host memory, computed where the plain one was."""
    outcome = Outcome(_resolve(build)[0], policy, "exact")
    return _compare(build, policy, outcome, steps, optimizer, budget, seed, state)


def _compare(build, policy, outcome, steps, optimizer, budget, seed, state="device") -> Outcome:
    name, builder, preferred = _resolve(build)
    optimizer = optimizer or preferred or "adamw"
    plain = plain_run(build, steps=steps, optimizer=optimizer, seed=seed)
    outcome.plain_s = plain.trained.seconds

    model, args, kwargs, loss_fn = _build(builder, seed)
    if _differences(plain.initial["state"], snapshot(model)["state"], "state"):
        raise MatrixFailure(f"{name}: the builder is not deterministic (two builds after the "
                            "same seed differ); the harness cannot compare it")

    def refused(error: ValueError, when: str) -> Outcome:
        left = _changed(plain.initial, model)
        if left:
            raise MatrixFailure(f"{name}/{policy}: refused {when} ({_first_line(error)}) but "
                                f"after changing the model: {'; '.join(left)}") from error
        outcome.status, outcome.reason = "refused", _first_line(error)
        return outcome

    # the budget that forces the runtime to act, planned on this very model (planning must
    # change nothing in it)
    start = time.perf_counter()
    try:
        key = (name, id(builder), seed)
        outcome.budget = (forcing_budget(model, args, kwargs, policy, key, state)
                          if budget == "forcing" else budget)
    except ValueError as error:
        return refused(error, "by sn.plan")
    finally:
        outcome.plan_s = time.perf_counter() - start
    left = _changed(plain.initial, model)
    if left:
        raise MatrixFailure(f"{name}/{policy}: sn.plan changed the model: {'; '.join(left)}")

    start = time.perf_counter()
    try:
        where = {} if state == "device" else \
            {"state": state, "device": next(model.parameters()).device}
        wrapped = sn.wrap(model, policy=policy, budget=outcome.budget, **where)
    except ValueError as error:
        return refused(error, "by sn.wrap")
    got = train(model, wrapped, args, kwargs, loss_fn, steps, optimizer, seed + 1)
    outcome.wrapped_s = time.perf_counter() - start
    outcome.stats = _stats(wrapped)
    expected = plain.trained

    if got.error is not None:
        error = got.error
        refusal = isinstance(error, ValueError) and got.error_step == 0 and (
            expected.error is None or not isinstance(expected.error, ValueError))
        if refusal and got.error_phase != "step":
            return refused(error, f"in step 0's {got.error_phase}")
        if isinstance(error, ValueError) and expected.error is None:
            raise MatrixFailure(f"{name}/{policy}: refused too late, {got.where()}: "
                                f"{_first_line(error)}") from error
        if expected.error is not None and type(error) is type(expected.error) and (
                got.error_step, got.error_phase) == (expected.error_step,
                                                     expected.error_phase):
            outcome.notes.append(f"raises as plain PyTorch does: {got.where()}: "
                                 f"{_first_line(error)}")
        else:
            if expected.error is not None:
                outcome.notes.append(f"plain PyTorch raises {expected.where()}")
            raise error
    elif expected.error is not None:
        raise MatrixFailure(f"{name}/{policy}: plain PyTorch raises {expected.where()} "
                            f"({_first_line(expected.error)}); the wrapped model did not")

    problems = []
    for step, (a, b) in enumerate(zip(expected.losses, got.losses)):
        if not torch.equal(a, b):
            problems.append(f"loss of step {step}: plain {a.item()!r}, wrapped {b.item()!r}")
            break
    if len(expected.losses) != len(got.losses):
        problems.append(f"{len(expected.losses)} plain losses, {len(got.losses)} wrapped")
    peak = (outcome.stats or {}).get("peak_bytes")
    if outcome.budget is not None and peak is not None and peak > outcome.budget:
        problems.append(f"the last step's peak, {peak} bytes, passed the budget")

    managed = snapshot(model)
    outer = wrapped.state_dict()
    if list(outer) == list(plain.final["state"]):
        state = {k: v.detach() for k, v in outer.items()}
    else:
        state = managed["state"]
        outcome.notes.append("wrapped.state_dict() does not use the model's keys "
                             f"(first: {next(iter(outer), None)!r}); compared the model's own")
    problems += _differences(plain.final["state"], state, "state")
    problems += _differences(plain.final["buffers"], managed["buffers"], "buffer")
    problems += _differences(plain.final["grads"], managed["grads"], "grad")
    if plain.final["side_effects"] != managed["side_effects"]:
        problems.append(f"side effects: plain {plain.final['side_effects']}, wrapped "
                        f"{managed['side_effects']}")
    if problems:
        # before blaming the runtime: does plain PyTorch reproduce itself on this machine?
        del wrapped, model
        again = plain_run(build, steps=steps, optimizer=optimizer, seed=seed, fresh=True)
        unstable = _same_training(plain, again)
        if unstable:
            problems.insert(0, "plain PyTorch does not reproduce itself for this model here "
                            f"(two plain runs: {'; '.join(unstable)}), so neither can the "
                            "wrapped one; the wrapped run against the first plain run:")
        raise MatrixFailure(f"{name}/{policy} (budget {outcome.budget}): " + "; ".join(problems))
    return outcome


def run(build, policy: str, *, steps: int = 3, optimizer: str | None = None,
        budget: Any = "forcing", seed: int = 0, state: str = "device") -> Outcome:
    """compare(), never raising: a failure is an Outcome with status 'FAILED' and the reason."""
    outcome = Outcome(_resolve(build)[0], policy, "exact")
    start = time.perf_counter()
    try:
        return _compare(build, policy, outcome, steps, optimizer, budget, seed, state)
    except MatrixFailure as error:
        reason = str(error)
    except Exception as error:              # noqa: BLE001 -- the matrix records every failure
        frame = traceback.extract_tb(error.__traceback__)[-1]
        reason = (f"{type(error).__name__}: {_first_line(error)} "
                  f"[{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}]")
    finally:
        gc.collect()
    outcome.status, outcome.reason = "FAILED", reason
    if not outcome.wrapped_s:
        elapsed = time.perf_counter() - start
        outcome.wrapped_s = max(0.0, elapsed - outcome.plain_s - outcome.plan_s)
    return outcome
