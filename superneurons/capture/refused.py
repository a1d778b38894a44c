"""Ways of training a model that a captured graph cannot reproduce bit for bit, refused with a
ValueError before the first step, each saying what to change.

Rule 1: a module compiled with torch.compile runs kernels of its own (inductor's fused ones, and
        its own random numbers under dropout); capture reads the module's Python, so the wrapped
        step would compute other bits than the compiled model does, silently.
Rule 2: checkpointing the model does itself is superneurons' job here, planned within the
        budget. A reentrant torch.utils.checkpoint runs its part under no_grad, which a graph
        captured once keeps, and the step's output would lose its gradient: refused. HF's
        gradient checkpointing (either kind) also adds a hook on the input embeddings:
        refused, naming how to turn it off. A non-reentrant checkpoint in the model's own
        forward is captured as the operations it runs, and trains bit for bit.
Rule 3: HF's T5 family under torch.autocast: its captured graph masks the decoder's attention
        bias on another path than its eager forward takes, and the relative attention bias's
        gradient differs in its last bits (CPU bf16; tests/test_refused.py). In float32 it
        trains bit for bit. Refused under autocast until capture takes the eager path there.
"""

import contextlib

from torch import nn

# HF model types sharing T5's attention with a relative position bias (Rule 3)
_T5_FAMILY = {"t5", "mt5", "umt5", "longt5", "switch_transformers"}


def refuse_unsupported(model: nn.Module) -> None:
    """Rules 1 and 2, as far as the model's modules tell before capture."""
    from torch._dynamo.eval_frame import OptimizedModule
    compiled = [name for name, module in model.named_modules()
                if isinstance(module, OptimizedModule)]
    if compiled:
        what = "the model" if compiled[0] == "" else \
            f"{', '.join(compiled[:3])} of {type(model).__name__}"
        raise ValueError(
            f"{what} is compiled with "
            "torch.compile, whose kernels (and random numbers) differ from the module's Python, "
            "which superneurons runs: its gradients would not be the compiled model's. Wrap "
            "the model uncompiled (a compiled module's original is its _orig_mod).")
    if any(getattr(module, "gradient_checkpointing", False) is True
           for module in model.modules()):
        raise ValueError(
            f"{type(model).__name__} has gradient checkpointing enabled "
            "(gradient_checkpointing_enable()): superneurons recomputes what the budget needs "
            "itself. Turn it off before wrapping: model.gradient_checkpointing_disable() "
            "(activation_checkpointing_disable() in newer transformers).")


def refuse_under_autocast(model: nn.Module, autocast) -> None:
    """Rule 3; ``autocast``: the (device type, dtype) the step runs under, or None."""
    kinds = {getattr(getattr(module, "config", None), "model_type", None)
             for module in model.modules()}
    if autocast is not None and kinds & _T5_FAMILY:
        raise ValueError(
            f"{type(model).__name__} (HF's T5 family) under torch.autocast: superneurons' "
            "captured graph masks the decoder's attention bias on another path than the "
            "model's own forward, and its gradients would differ from plain PyTorch's in their "
            "last bits. Train it without autocast (bit for bit then), or keep autocast and "
            "train it without superneurons.")


class ReentrantCheckpoint(Exception):
    """A reentrant torch.utils.checkpoint ran while the model was captured (Rule 2)."""


@contextlib.contextmanager
def reentrant_checkpoints_refused(seen: list):
    """While the model is captured, a reentrant checkpoint raises, and ``seen`` says so (the
    exporter may wrap the exception in its own)."""
    from torch.utils.checkpoint import CheckpointFunction
    own = CheckpointFunction.__dict__.get("apply")

    def refuse(cls, *args, **kwargs):
        seen.append(True)
        raise ReentrantCheckpoint("torch.utils.checkpoint with use_reentrant=True")
    CheckpointFunction.apply = classmethod(refuse)
    try:
        yield
    finally:
        if own is None:
            del CheckpointFunction.apply
        else:
            CheckpointFunction.apply = own


def reentrant_refusal(model: nn.Module) -> ValueError:
    return ValueError(
        f"{type(model).__name__} calls torch.utils.checkpoint with use_reentrant=True in its "
        "forward: its part runs under no_grad, which a captured graph keeps, so the step's "
        "output would have no gradient. superneurons recomputes what the budget needs itself: "
        "remove the checkpoint (or pass use_reentrant=False, which it captures as it is).")
