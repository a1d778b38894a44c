"""The wrapped model's own attributes, read through the wrapper.

Refusals advise wrapping a part in its place (``model.part = sn.wrap(model.part)``), and the
parent's forward then reads the part's attributes: HF's multimodal models call their language
model's get_input_embeddings() and read its config. A name the wrapper does not have itself
(its parameters, buffers, submodules, attributes and properties come first) is read from the
wrapped model, but for private names (``_ddp_params_and_buffers_to_ignore`` and the like name
the wrapped model's own tensors) and methods other than accessors (``get_*``): a method such as
``generate`` or ``training_step`` would run the wrapped model's forward outside the wrapper's
plan and budget, so it is called on ``wrapped.model``, where that is plain to see. Attributes
set on the wrapper stay the wrapper's.
"""

import inspect

from torch import nn


class ReadsThrough:
    """Mixed into an nn.Module that holds the wrapped model as its submodule ``model``."""

    def __getattr__(self, name: str):
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            # a property of the wrapper that failed inside says so itself
            if model is None or name.startswith("_") or hasattr(type(self), name):
                raise
        value = getattr(model, name)
        if inspect.ismethod(value) and value.__self__ is model and not name.startswith("get_"):
            raise AttributeError(
                f"{type(model).__name__}.{name} would run outside superneurons' plan and budget "
                f"when called through the wrapper: call it on the wrapped model itself "
                f"(wrapped.model.{name}), or call the wrapper to train")
        return value
