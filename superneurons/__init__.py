"""superneurons: train deep networks beyond GPU memory (SuperNeurons, PPoPP'18, on PyTorch).

    import superneurons as sn
    model = sn.models.resnet(50)                                       # or any nn.Module
    plan = sn.plan(model, (32, 3, 224, 224), policy="superneurons")   # no device touched
    print(plan.explain())
    model = sn.wrap(model, policy="superneurons", budget="12GiB")     # drop-in nn.Module
"""

import importlib
import logging

from .planner import Action, Plan, Policy, Strategy, plan
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

# The library says what long work is doing (capture, planning, host memory) as INFO records of
# this logger; silent unless the application shows them (the command line does).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["plan", "wrap", "Plan", "Policy", "Strategy", "Action", "parse_bytes", "format_bytes",
           "models"]


def wrap(model, policy="superneurons", budget=None, **options):
    """Wrap ``model`` so its training steps run within ``budget``; see runtime.wrap."""
    from .runtime import wrap as _wrap
    return _wrap(model, policy=policy, budget=budget, **options)


def __getattr__(name):
    # sn.models works as torchvision.models does, but the zoo loads only when first asked for
    if name == "models":
        return importlib.import_module(".models", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), "models"})
