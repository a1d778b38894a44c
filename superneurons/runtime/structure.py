"""The wrapped model's modules and parameters, listed again only when the module tree changed.

A step's plan is keyed by every module's training mode and every parameter's requires_grad
(module Rule 1). Walking the module tree for them at every call costs milliseconds of host time
on a network of hundreds of modules, enough to show in a host-bound step. So the lists are
kept, and each call checks that every module still holds the same children and parameters
(a fifth of the walk's time): that sees what registering sees, and what bypasses it too
(`del model.head`, `module.bias = None`, a direct write to `_parameters` or `_modules` as
accelerate and torch.ao's convert make). PyTorch's registration hooks alone missed those.
"""

from itertools import chain

from torch import nn


class Structure:
    """``modules`` and ``parameters`` of a model, as they are at the time they are read."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._modules: list = []
        self._parameters: list = []
        self._dicts: list = []       # every module's _modules and _parameters
        self._held: list = []        # the ids of what each held when listed

    def _seen(self) -> tuple:
        # ids, not objects: the lists above keep every object seen alive, so an id is not
        # reused while it is held here; built by C iterators alone (a Python loop over 1,200
        # dictionaries cost most of the time saved)
        dicts = self._dicts
        return (tuple(map(len, dicts)),
                tuple(map(id, chain.from_iterable(map(dict.values, dicts)))))

    def _refresh(self) -> None:
        if not self._modules or self._seen() != self._held:
            self._modules = list(self.model.modules())
            self._parameters = list(self.model.parameters())
            self._dicts = [d for m in self._modules for d in (m._modules, m._parameters)]
            self._held = self._seen()

    def read(self) -> tuple:
        """(key, parameters): what a captured graph specializes on beyond its arguments, every
        module's training mode (BatchNorm frozen by eval()) and every parameter's requires_grad
        (unfreezing), and the model's parameters."""
        self._refresh()
        key = (tuple(m.training for m in self._modules),
               tuple(p.requires_grad for p in self._parameters))
        return key, self._parameters
