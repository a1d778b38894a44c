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
Rule 4: autograd Python the forward sets up as it runs is not in the captured graph, which runs
        instead of the forward: a gradient hook it registers on a tensor (Tensor.register_hook)
        and saved-tensor hooks it enters (torch.autograd.graph.saved_tensors_hooks itself;
        torch.utils.checkpoint's own are captured as the operations they run) would be
        dropped, silently changing the gradients; functorch's transforms (torch.vmap,
        torch.func.grad) cannot run as layers one at a time. Refused. A custom
        torch.autograd.Function applied where it would be differentiated (grad enabled, an
        input requiring grad) would have its forward's operations recorded and its backward
        dropped (HF's BLOOM trains its GELU by one, whose hand-written backward differs from
        autograd's in the last bits): it is called as one operation instead, which keeps its
        backward (functions.py), unless its call or its forward is one that operation cannot
        carry (keyword arguments, a module among its arguments, inputs written in place,
        outputs other than tensors): refused. torch's own Functions are refused, but those
        whose output carries no gradient (_DROPPED_EXACTLY). A torch.library.custom_op with
        register_autograd is captured whole, as export records it.
"""

import contextlib
import threading

import torch
import torch.utils.checkpoint
from torch import nn

from .functions import as_operation, calling

# torch's Functions whose backward dropping leaves the gradients as they are: non-reentrant
# checkpointing's holder of the inputs, whose output no gradient flows through (its backward
# raises if called); torch 2.11 applies it in every non-reentrant torch.utils.checkpoint call
_DROPPED_EXACTLY = {getattr(torch.utils.checkpoint, "_NoopSaveInputs", None)} - {None}

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


@contextlib.contextmanager
def autograd_python_watched(seen: list):
    """Rule 4: while the model is captured, ``seen`` collects the hooks its forward sets up.
    The patches are the process's: only the capturing thread's calls count (export.py holds
    one capture at a time)."""
    from torch.autograd.graph import saved_tensors_hooks
    register_hook, enter = torch.Tensor.register_hook, saved_tensors_hooks.__enter__
    function = torch.autograd.Function
    apply = function.__dict__["apply"]      # a C classmethod; subclasses' super().apply too
    capturing = threading.get_ident()

    def hooked(self, hook):
        if threading.get_ident() == capturing:
            seen.append("registers a gradient hook on a tensor (Tensor.register_hook)")
        return register_hook(self, hook)

    def entered(self):
        if type(self) is saved_tensors_hooks and threading.get_ident() == capturing:
            seen.append("enters torch.autograd.graph.saved_tensors_hooks")
        return enter(self)

    def applied(cls, *args, **kwargs):
        # torch.library's custom ops run their register_autograd as a Function of torch's own
        # (torch._library.autograd), inside the op export records whole
        if not cls.__module__.startswith("torch._library.") and cls not in _DROPPED_EXACTLY \
                and not calling() and torch.is_grad_enabled() and \
                threading.get_ident() == capturing and \
                any(isinstance(t, torch.Tensor) and t.requires_grad
                    for t in torch.utils._pytree.tree_leaves((args, kwargs))):
            if cls.__module__.startswith("torch.") or kwargs:
                seen.append(_function_said(cls))
            else:
                out, refusal = as_operation(cls, args)
                if refusal is None:
                    return out
                seen.append(refusal)
        return apply.__get__(None, cls)(*args, **kwargs)
    torch.Tensor.register_hook, saved_tensors_hooks.__enter__ = hooked, entered
    function.apply = classmethod(applied)
    try:
        yield
    finally:
        torch.Tensor.register_hook, saved_tensors_hooks.__enter__ = register_hook, enter
        function.apply = apply


def _function_said(cls) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__.startswith("torch."):     # torch.cond's, scan's, nn.CrossMapLRN2d's
        return (f"reaches torch's own autograd Function {name} (torch.cond or torch.scan on "
                "values, or a torch layer built on a Function), which capture cannot keep")
    return f"applies the custom autograd Function {name}, whose own backward capture drops"


def functorch_transforms(graph_module) -> bool:
    """Rule 4: whether a captured graph (its regions included) runs a functorch transform."""
    return any(node.op == "call_function" and
               "functorch" in (getattr(node.target, "__module__", None) or "")
               for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes)


def autograd_python_refusal(model: nn.Module, seen: list) -> ValueError:
    return ValueError(
        f"{type(model).__name__}'s forward {' and '.join(dict.fromkeys(seen))}: superneurons "
        "runs the graph it captured instead of the forward, which drops the hooks a forward "
        "sets up and the own backward of a custom autograd Function it cannot call as one "
        "operation (the step would differentiate its forward's operations instead) and cannot "
        "run functorch's transforms one layer at a time, so its steps would not compute plain "
        "PyTorch's gradients. Register gradient hooks on the wrapped model's output or "
        "parameters outside the forward; make a custom Function a torch.library.custom_op "
        "with register_autograd (captured whole), or replace it by its forward's operations in "
        "the model itself; or wrap the parts of the model that do not use them.")
