"""Plain attributes a forward assigns, which torch.export puts back after tracing.

export snapshots every module attribute that is not nn.Module's own (parameters, buffers,
children, hooks, training), containers copied, runs the forward once and restores the snapshot
(attributes the forward created stay: they are removed here); the captured graph then never
runs the forward's Python. A counter the forward bumps
(``self.step += 1``), a flag it sets or a list it appends to thus keeps its value from before
capture at every step, where plain PyTorch writes it at every call: superneurons refuses the
model. So is a value set once, lazily (``if self.pad is None: ...``, an attribute the forward
creates): one call cannot tell it from a counter started there (``getattr(self, "n", 0) + 1``),
so the refusal says to call the model once before wrapping it, after which it is found equal.

What is compared is what export restores, just before it restores it: each attribute of each
module there before the call, before and after, the same object or an equal value being no
write (``self.scale = 2.0`` where it was 2.0 already). A submodule the forward builds and
assigns is in the graph like any other; tensors are left to export_said.py Rule 2, where export
names them. A write inside an object export does not copy (a config's field, a set) is not
seen: export does not put it back either.
"""

import contextlib
import importlib
import weakref

import torch
from torch import nn
from torch.utils import _pytree as pytree

# nn.Module's own attributes, as export leaves them out (hooks, training, children...); and
# transformers' mark on a model whose recording hooks it installed at its first call that asks
# for recorded outputs (export.py's _RECORDING_HOOKS): set once, then found set, as by the steps
_OWN = frozenset(nn.Module().__dict__) | {"_initialize_hook", "_load_hook",
                                          "_output_capturing_hooks_installed"}


@contextlib.contextmanager
def watched_attributes(model: nn.Module, written: list):
    """While export runs on ``model``: into ``written``, (qualified name, before, after) of each
    plain attribute the forward changed, seen just before export puts it back."""
    try:
        trace = importlib.import_module("torch.export._trace")
    except ImportError:
        trace = None
    detect = getattr(trace, "_detect_attribute_assignment", None)
    if detect is None:       # another torch: what export leaves changed, seen after it
        modules = dict(model.named_modules())
        before = _snapshot(modules)
        yield
        written.extend(_changed(before, _snapshot(modules, copy=False)))
        return

    @contextlib.contextmanager
    def watching(root: nn.Module):
        modules = dict(root.named_modules())
        before = _snapshot(modules)
        try:
            with detect(root):
                try:
                    yield
                finally:
                    written.extend(_changed(before, _snapshot(modules, copy=False)))
        finally:
            # export put back what was there (``__dict__.update``), not what the forward
            # created, which holds capture's values (fake tensors among them)
            _put_back(modules, written)
    trace._detect_attribute_assignment = watching
    try:
        yield
    finally:
        trace._detect_attribute_assignment = detect


@contextlib.contextmanager
def leaves_watched(model: nn.Module, written: list):
    """torch.fx runs a leaf module's forward as one layer (trace.py Rule 1): at capture's
    analysis, here, and again at every replay of it. A user's leaf whose forward changes its
    plain attributes would change them more often than plain PyTorch: into ``written`` as
    watched_attributes says, each put back as it was. torch.nn's and the zoo's leaves are
    not watched: their forwards write no plain attribute, and a zoo network has thousands."""
    modules = {name: module for name, module in model.named_modules()
               if not module._modules and not type(module).__module__.startswith(
                   ("torch.nn.", "superneurons.models"))}
    before = _snapshot(modules)
    try:
        yield
    finally:
        changed = _changed(before, _snapshot(modules, copy=False))
        _put_back(modules, changed)
        written.extend(changed)


_MISSING, _REGISTERED = object(), object()


def _put_back(modules: dict, changed: list) -> None:
    """Each of ``changed`` (qualified name, before, after) as it was before: an attribute the
    forward created removed, so that a refused model is left as it was."""
    for qualified, before, _ in changed:
        owner, _, key = qualified.rpartition(".")
        module = modules[owner]
        if before is _REGISTERED:
            continue                           # a submodule's name: not a plain attribute
        if before is not _MISSING:
            setattr(module, key, before)
        elif key in vars(module):
            delattr(module, key)


def _snapshot(modules: dict, copy: bool = True) -> dict:
    """The modules' plain attributes by qualified name; ``copy``: containers copied as export
    copies them (pytree's), so that an in-place append shows as the write export undoes. A name
    the forward made a submodule, parameter or buffer is _REGISTERED."""
    found = {}
    for name, module in modules.items():
        for key, value in vars(module).items():
            if key not in _OWN:
                found[f"{name}.{key}" if name else key] = \
                    pytree.tree_map(lambda x: x, value, is_leaf=_size) if copy else value
        for key in (*module._modules, *module._parameters, *module._buffers):
            found.setdefault(f"{name}.{key}" if name else key, _REGISTERED)
    return found


def _size(value) -> bool:
    """A shape is one value: pytree would take it apart into a tuple (export keeps it whole)."""
    return type(value) is torch.Size


def _changed(before: dict, after: dict) -> list:
    return [(name, before.get(name, _MISSING), after.get(name, _MISSING))
            for name in {**before, **after}
            if after.get(name) is not _REGISTERED and
            _differs(before.get(name, _MISSING), after.get(name, _MISSING))]


def _differs(old, new) -> bool:
    old_leaves, old_spec = pytree.tree_flatten(old, is_leaf=_size)
    new_leaves, new_spec = pytree.tree_flatten(new, is_leaf=_size)
    if old_spec != new_spec:
        return True
    return any(_leaf_differs(a, b) for a, b in zip(old_leaves, new_leaves))


def _leaf_differs(old, new) -> bool:
    if isinstance(old, weakref.ref) and isinstance(new, weakref.ref):
        # nn.RNN's _flat_weight_refs, remade whenever its weights are set (export's stand-ins
        # set them): a reference to a tensor is the tensor's, dead once its stand-in is
        old, new = old(), new()
        if isinstance(old, torch.Tensor) or new is None:
            return False
    if old is new or isinstance(new, torch.Tensor):     # tensors: export_said.py Rule 2
        return False
    if type(old) is not type(new):
        return True
    try:
        return not bool(old == new)
    except Exception:  # noqa: BLE001 -- an equality that is not one (arrays): a new value
        return True


def assigned_refusal(model: nn.Module, written: list, children: str,
                     leaf: bool = False) -> ValueError:
    """The refusal of ``model`` whose forward changed ``written``; ``children``: how to wrap
    the model's parts instead; ``leaf``: a leaf's forward changed them (leaves_watched)."""
    name, before, after = written[0]
    more = [w[0] for w in written[1:]]
    why = ("superneurons runs that module's forward as one layer, at capture and again at "
           "every replay of it, so such an attribute would change more often than under plain "
           "PyTorch" if leaf else
           "superneurons runs the graph it captured, not the forward's Python, so over its "
           "steps such an attribute would keep what it held before the first call (capture "
           "puts it back), where plain PyTorch assigns it at every call")
    return ValueError(
        f"{type(model).__name__}'s forward assigns {name} ({_shown(before)} before the call, "
        f"{_shown(after)} after it)"
        + (f" and {len(more)} more ({', '.join(more[:3])}{', ...' if len(more) > 3 else ''})"
           if more else "")
        + ": " + why + ". Keep such state outside the model (count steps in the training "
        "loop and pass the count in as an argument, compute the value outside the wrapped "
        "module), or wrap the parts of the model that do not assign it" + children + "."
        + " Where the forward only sets it once (a lazy initialization), call the model once "
        "before wrapping it.")


def _shown(value) -> str:
    """A value for the refusal: short, "unset" for an attribute that did not exist."""
    if value is _MISSING:
        return "unset"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
