"""What torch.export says while it captures a model, as superneurons' user needs it said.

Rule 1: the graph export prints when it fails (its partial graph, 19 KB for torchvision's Faster
        R-CNN) is not printed: the ValueError that follows says what to do, and the graph stays
        on the error superneurons raises from (``error.__cause__.partial_fx_graph``).
Rule 2: export's warning that the forward assigned tensor attributes is taken, not passed on:
        export puts every attribute back after tracing, and the captured graph does not assign
        them, so the caller refuses the model (a stale attribute read after a step, an
        auxiliary loss kept on the module, would silently change what the user trains). Every
        other warning passes on as it was raised.
"""

import contextlib
import importlib
import re
import warnings

# export's words (torch/_functorch/_aot_autograd/frontend_utils.py)
_ASSIGNED = r"The tensor attributes? (.+?) (?:was|were) assigned during export"


@contextlib.contextmanager
def said_by_export(assigned: list):
    """While export runs: Rule 1, and Rule 2 into ``assigned`` (the attributes' paths)."""
    with _without_partial_graph(), warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message=_ASSIGNED)   # said again on every capture
        try:
            yield
        finally:
            for warning in caught:
                found = re.match(_ASSIGNED, str(warning.message))
                if found:
                    assigned.extend(found.group(1).split(", "))
    for warning in caught:          # after catch_warnings: the user's filters and handlers
        if not re.match(_ASSIGNED, str(warning.message)):
            warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                   warning.lineno, source=warning.source)


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
