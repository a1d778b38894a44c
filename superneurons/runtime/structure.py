"""The wrapped model's modules and parameters, listed again only when some module registers a
submodule, parameter or buffer.

A step's plan is keyed by every module's training mode and every parameter's requires_grad
(module Rule 1). Walking the module tree for them at every call took 1.8 ms of host time a call
on DenseNet-121 (600 modules), where the rest of the wrapper's own work took 0.1 ms: enough to
show in a host-bound step. PyTorch's global registration hooks say when a list may be stale:
any module anywhere registering anything bumps one counter, and a wrapper lists its model again
at its next call.
"""

from torch import nn

_generation = 0
_installed = False


def _changed(*_) -> None:          # a registration hook: returns None, so nothing is replaced
    global _generation
    _generation += 1


def _install() -> None:
    global _installed
    if not _installed:
        hooks = nn.modules.module
        hooks.register_module_module_registration_hook(_changed)
        hooks.register_module_parameter_registration_hook(_changed)
        hooks.register_module_buffer_registration_hook(_changed)
        _installed = True


class Structure:
    """``modules`` and ``parameters`` of a model, as they are at the time they are read."""

    def __init__(self, model: nn.Module):
        _install()
        self.model = model
        self._seen = None
        self._modules: list = []
        self._parameters: list = []

    def _refresh(self) -> None:
        if self._seen != _generation:
            self._modules = list(self.model.modules())
            self._parameters = list(self.model.parameters())
            self._seen = _generation

    @property
    def parameters(self) -> list:
        self._refresh()
        return self._parameters

    def key(self) -> tuple:
        """What a captured graph specializes on beyond its arguments: every module's training
        mode (BatchNorm frozen by eval()) and every parameter's requires_grad (unfreezing)."""
        self._refresh()
        return (tuple(m.training for m in self._modules),
                tuple(p.requires_grad for p in self._parameters))
