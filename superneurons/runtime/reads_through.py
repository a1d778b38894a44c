"""The wrapped model's own attributes, read through the wrapper.

Refusals advise wrapping a part in its place (``model.part = sn.wrap(model.part)``), and the
parent's forward then reads the part's attributes: HF's multimodal models call their language
model's get_input_embeddings() and read its config. A name the wrapper does not have itself
(its parameters, buffers, submodules and attributes come first) is the wrapped model's.
"""

from torch import nn


class ReadsThrough:
    """Mixed into an nn.Module that holds the wrapped model as its submodule ``model``."""

    def __getattr__(self, name: str):
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("__"):
                raise
            return getattr(model, name)
