"""The wrapped model's modules and parameters, listed again only when the module tree changed,
and the modules' Python scalars that a captured graph takes as constants.

A step's plan is keyed by every module's training mode and every parameter's requires_grad
(module Rule 1). Walking the module tree for them at every call costs milliseconds of host time
on a network of hundreds of modules, enough to show in a host-bound step. So the lists are
kept, and each call checks that every module still holds the same children and parameters
(a fifth of the walk's time): that sees what registering sees, and what bypasses it too
(`del model.head`, `module.bias = None`, a direct write to `_parameters` or `_modules` as
accelerate and torch.ao's convert make). PyTorch's registration hooks alone missed those.

The key also holds every module's public scalar attributes (a dropout's p, a norm's eps, an
attention's scaling) and those of a ``config`` a module holds: capture bakes the values the
forward reads into the graph, so a value changed between steps (a dropout schedule) would
otherwise train on the old one, silently. Read per call from lists made with the others, by C
iterators alone.
"""

import numbers
import warnings
from itertools import chain

import torch
from torch import nn


def is_scalar(value) -> bool:
    """What capture takes as a constant and a key can compare: numbers (numpy's too: a schedule
    of np.linspace's values), strings and None; a module's tensors, tuples (kernel sizes,
    strides) and objects are not (of an HF config, its own scalars are read)."""
    return isinstance(value, (numbers.Number, str, type(None)))


class Structure:
    """``modules`` and ``parameters`` of a model, as they are at the time they are read."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._modules: list = []
        self._parameters: list = []
        self._dicts: list = []       # every module's _modules and _parameters
        self._held: list = []        # the ids of what each held when listed
        self._scalar_dicts: list = []    # per scalar attribute: its module's __dict__, name
        self._scalar_names: list = []
        self._scalar_paths: list = []    # and its qualified name, for the warning
        self._scalar_types: frozenset = frozenset()     # the types of their values as listed
        self._last_scalars: tuple | None = None     # (paths, values) of the last read
        self._owners: list = []          # every __dict__ read (modules', configs')
        self._owner_sizes: tuple = ()
        self._warned = False

    def _seen(self) -> tuple:
        # ids, not objects: the lists above keep every object seen alive, so an id is not
        # reused while it is held here; built by C iterators alone (a Python loop over 1,200
        # dictionaries cost most of the time saved)
        dicts = self._dicts
        return (tuple(map(len, dicts)),
                tuple(map(id, chain.from_iterable(map(dict.values, dicts)))))

    def _refresh(self) -> None:
        if not self._modules or self._seen() != self._held:
            named = list(self.model.named_modules())
            self._modules = [module for _, module in named]
            self._parameters = list(self.model.parameters())
            self._dicts = [d for m in self._modules for d in (m._modules, m._parameters)]
            self._held = self._seen()
            self._list_scalars(named)

    def _list_scalars(self, named: list) -> None:
        """The public scalar attributes of every module (``training`` is keyed on its own) and
        of the objects modules hold as ``config`` (HF's, nanoGPT's: the forward reads flags
        there, Gemma2's logit softcapping), each object once; a class held as a config, whose
        attributes are its type's, is not read."""
        self._scalar_dicts, self._scalar_names, self._scalar_paths = [], [], []
        self._owners, types, configs = [], set(), set()
        for path, module in named:
            owners = [(path, module.__dict__)]
            config = module.__dict__.get("config")
            if type(getattr(config, "__dict__", None)) is dict and id(config) not in configs \
                    and not isinstance(config, (nn.Module, torch.Tensor)):
                configs.add(id(config))
                owners.append((f"{path}.config" if path else "config", vars(config)))
            for where, attributes in owners:
                self._owners.append(attributes)
                for name, value in attributes.items():
                    if is_scalar(value) and name != "training" and not name.startswith("_"):
                        self._scalar_dicts.append(attributes)
                        self._scalar_names.append(name)
                        self._scalar_paths.append(f"{where}.{name}" if where else name)
                        types.add(type(value))
        self._scalar_types = frozenset(types)
        self._owner_sizes = tuple(map(len, self._owners))

    def _scalars(self) -> tuple:
        values = tuple(map(dict.get, self._scalar_dicts, self._scalar_names))
        # listed again where a value is of another type now (a tensor, np.float64) or an owner
        # holds other names (a class's default set on the instance by a schedule)
        if not set(map(type, values)) <= self._scalar_types or \
                tuple(map(len, self._owners)) != self._owner_sizes:
            self._list_scalars(list(self.model.named_modules()))
            values = tuple(map(dict.get, self._scalar_dicts, self._scalar_names))
        # the paths' list is made anew at each listing, never changed: held, not copied
        last, self._last_scalars = self._last_scalars, (self._scalar_paths, values)
        if not self._warned and last is not None and last[1] != values:
            self._warn(dict(zip(*last)), dict(zip(self._scalar_paths, values)))
        return values

    def _warn(self, last: dict, now: dict) -> None:
        """Once per model: a scalar changed, so the step is captured again for its value."""
        changed = next((path for path, value in now.items()
                        if path not in last or last[path] != value), None)
        if changed is None:
            return                             # one went away: nothing to name
        self._warned = True
        before = repr(last[changed]) if changed in last else "its class's value"
        warnings.warn(
            f"superneurons: {changed} changed from {before} to "
            f"{now[changed]!r}, and a captured step takes it as a constant: the step is "
            "captured again for the new value (seconds on a large model; each value's plan is "
            "kept among wrapped.max_plans), as for every module attribute changed from now on",
            stacklevel=5)

    def settle(self) -> tuple:
        """The key read again, without a warning: after capture ran the forward, what the
        forward set itself is the model's state, not a change."""
        self._last_scalars = None
        return self.read()[0]

    def read(self) -> tuple:
        """(key, parameters): what a captured graph specializes on beyond its arguments, every
        module's training mode (BatchNorm frozen by eval()), every parameter's requires_grad
        (unfreezing) and every module's scalar attributes, and the model's parameters."""
        self._refresh()
        key = (tuple(m.training for m in self._modules),
               tuple(p.requires_grad for p in self._parameters), self._scalars())
        return key, self._parameters
