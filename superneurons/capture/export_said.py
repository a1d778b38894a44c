"""What torch.export says while it captures a model, as superneurons' user needs it said.

Rule 1: the graph export prints when it fails (its partial graph, 19 KB for torchvision's Faster
        R-CNN) is not printed: the ValueError that follows says what to do, and the graph stays
        on the error superneurons raises from (``error.__cause__.partial_fx_graph``).
Rule 2: export's warning that the forward assigned tensor attributes is taken, not shown: export
        puts every attribute back after tracing and the captured graph never assigns them, so
        the caller refuses the model (an auxiliary loss kept on the module, read after a step,
        would silently be stale), unless each attribute held the model's own parameters or
        buffers before the call (nn.LSTM's _flat_weights: export's stand-ins for the
        parameters made it assign them again). Every other warning is shown as the user's
        filters say, once: the hook sits where warnings are shown, after the filters ran.
        Export's warning is always shown to the hook, so that a second capture of the same
        model sees it too; that filter resets Python's record of warnings shown once.
"""

import contextlib
import importlib
import re
import warnings

from torch import nn

# export's words (torch/_functorch/_aot_autograd/frontend_utils.py)
_ASSIGNED = r"The tensor attributes? (.+?) (?:was|were) assigned during export"


@contextlib.contextmanager
def said_by_export(assigned: list):
    """While export runs: Rule 1, and Rule 2 into ``assigned`` (the attributes' paths)."""
    with _without_partial_graph(), warnings.catch_warnings():
        warnings.filterwarnings("always", message=_ASSIGNED)
        show = warnings.showwarning

        def shown(message, category, filename, lineno, file=None, line=None):
            found = re.match(_ASSIGNED, str(message))
            if found:
                assigned.extend(found.group(1).split(", "))
            else:
                show(message, category, filename, lineno, file, line)
        warnings.showwarning = shown
        yield


def stale_attributes(model: nn.Module, paths: list) -> list:
    """Rule 2: of the attributes export says the forward assigned (as "self.a.b[0]"), those
    that did not hold one of the model's own parameters or buffers before the call."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    return [path for path in paths if id(_held_at(model, path)) not in own]


def _held_at(model: nn.Module, path: str):
    """What ``path`` names in ``model`` now (export put it back), or None."""
    held = model
    for name, index in re.findall(r"\.(\w+)|\[([^\]]+)\]", path.removeprefix("self")):
        try:
            if name:
                held = getattr(held, name)
            else:
                held = held[int(index) if index.lstrip("-").isdigit() else index.strip("'\"")]
        except (AttributeError, LookupError, TypeError):
            return None
    return held


@contextlib.contextmanager
def _without_partial_graph():
    """Rule 1: export's _trace module prints nothing else (its one print is the partial graph);
    a name in the module shadows the builtin for that module alone."""
    try:
        module = importlib.import_module("torch.export._trace")   # imported at first export
    except ImportError:
        module = None
    if module is None or "print" in vars(module):
        yield
        return
    module.print = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.print
