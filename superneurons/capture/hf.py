"""HF transformers models take another path when exported than when called: capture takes theirs.

transformers builds attention masks one way when it runs and another when torch.export traces it
(masking_utils): called without a mask, or with one that masks nothing, a decoder runs SDPA with
is_causal=True and, for grouped-query attention, enable_gqa=True; exported, it materializes the
causal mask and repeats the key and value heads (an exported graph must serve any later mask and
sequence length, and it may not read a traced tensor's values to learn that the positions are
one sequence each). The two agree in value but not in rounding: other SDPA kernels run on CUDA,
and under bf16 the repeated heads' gradients are rounded before they are summed. A superneurons
graph serves only calls like the one it was captured from (same shapes, and a new capture for
any other), so it can keep the path the model runs.

Rule 1: while superneurons exports a model holding an HF model, for a call that passes no
        attention mask (no tensor argument named *attention_mask) and whose positions are one
        sequence per row, transformers' masking code is told it is not traced (by whichever
        flags its version asks) and that the positions pack nothing. Whether the call's
        position_ids pack several sequences is decided as the model decides it, from their values
        (packed_positions, part of the plan's key); positions the model makes itself are one
        sequence per row. A call with a mask or packed positions needs nothing: both paths
        materialize its mask. The switches are installed once and act only in the thread
        exporting, only while it exports; elsewhere they are transformers' own functions.
Rule 2: a 2-D attention_mask (bool or integer) that masks nothing is dropped from an HF model's
        call before capture and before each step: transformers treats it as no mask (it skips
        such masks when it runs, but cannot when exported). A 4-D mask is the user's own
        pattern and stays, as does a mask that masks something. Reading it costs one small
        reduction and a host sync per step, as reading packed positions does.
Rule 3: a model that builds its own mask of ones (Perceiver, from its inputs) meets, under Rule
        1, transformers' own read of that mask's values to skip it, which export cannot
        capture; the traced path would materialize it instead and round otherwise. Refused
        before the first step, naming the parts below the mask's making (the mask they are
        passed has been skipped already): wrapped in its place, Perceiver's encoder trains bit
        for bit.
Rule 4: beyond the masks, transformers' modeling code asks the same flags to pick export-friendly
        computations (Qwen3-Next's gated delta rule inverts its triangular system by forward
        substitution when exported, by torch.linalg.solve_triangular when called: other last
        bits). While superneurons exports anything, the modeling modules loaded
        (transformers.models.*) are told they are neither exported nor compiled, as when
        called. Where the called path cannot be exported (it reads a value), capture fails
        and the model is refused, loudly.
"""

import contextlib
import functools
import inspect
import sys
import threading

import torch
from torch import nn

_local = threading.local()       # .as_called: this thread is exporting a call as called


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is, or holds, a transformers model."""
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


def mask_read_refusal(model: nn.Module, where: str | None) -> str | None:
    """Rule 3: what to say where export failed on transformers' masking code reading a mask's
    values (``where``: the read's place), else None."""
    if not where or "transformers/masking_utils.py" not in where or not is_hf_model(model):
        return None
    where = where[where.index("transformers/masking_utils.py"):]
    parts = []
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("encoder", "decoder", "layers") and \
                not any(name.startswith(part + ".") for part in parts):
            parts.append(name)
    parts = parts[:3]
    example = f"model.{parts[0]} = sn.wrap(model.{parts[0]}, ...)" if parts else \
        "sn.wrap(part, ...) in its place"
    return (f"{type(model).__name__} builds an attention mask of its own, and transformers' "
            f"masking code reads its values ({where}) to skip it where it masks nothing, as "
            "the model does when called: superneurons cannot capture that read, and the path "
            "that materializes the mask instead rounds otherwise than plain PyTorch. Wrap the "
            "part of the model below the mask's making, which is given the mask already "
            f"skipped{': ' + ', '.join(parts) if parts else ''} ({example}).")


def _masking(model: nn.Module):
    """transformers' masking module where ``model`` holds an HF model and it is loaded."""
    masking = sys.modules.get("transformers.masking_utils")
    return masking if masking is not None and is_hf_model(model) else None


# how transformers' masking code asks whether it is traced, across its versions (is_tracing
# takes an optional tensor; without a mask it is asked of none the call passed)
_TRACED_FLAGS = ("is_torchdynamo_exporting", "is_torchdynamo_compiling", "is_tracing")


def _named(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by the names of the model's forward (positional ones included)."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return dict(kwargs)
    named = {}
    for name, value in bound.arguments.items():
        if bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)                   # forward(self, **batch): the batch's names
        else:
            named[name] = value
    return named


def _passes_mask(named: dict) -> bool:
    """Whether the call passes an attention mask, which transformers' masking code builds on:
    not any tensor named like a mask. BEiT's bool_masked_pos (the patches its masked image
    modeling hides) is no attention mask, and taken for one, capture exported the mask
    transformers materializes where it runs SDPA on the bias alone: other rounding, silently.
    Taking a mask of another name for none errs loudly (its values are read in capture)."""
    return any(isinstance(value, torch.Tensor) and name.endswith("attention_mask")
               for name, value in named.items())


def packed_positions(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Rule 1: whether a call's own position_ids pack several sequences in a row, as the model
    would find when it runs (only without a mask, as it looks only then)."""
    if "transformers.masking_utils" not in sys.modules or \
            not any(isinstance(a, torch.Tensor) for a in (*args, kwargs.get("position_ids"))):
        return False          # every step: no binding of the call where nothing could apply
    named = _named(model, args, kwargs)
    positions = named.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.device.type == "meta" or \
            _passes_mask(named):
        return False
    masking = _masking(model)
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        return False
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    with _acting(False):
        return masking.find_packed_sequence_indices(positions) is not None


@contextlib.contextmanager
def exported_as_called(model: nn.Module, args: tuple, kwargs: dict, packed: bool = False):
    """Rule 1, for the duration of an export of ``model`` called with ``args`` and ``kwargs``;
    ``packed``: packed_positions of the call."""
    _install_modeling()
    with _acting(True, "modeling_as_called"):                                  # Rule 4
        masking = _masking(model)
        if masking is None or packed or _passes_mask(_named(model, args, kwargs)):
            yield
            return
        _install(masking)
        with _acting(True):
            yield


@contextlib.contextmanager
def _acting(value: bool, flag: str = "as_called"):
    before = getattr(_local, flag, False)
    setattr(_local, flag, value)
    try:
        yield
    finally:
        setattr(_local, flag, before)


def _install(masking) -> None:
    """Rule 1's switches, once per process: each is transformers' own function unless this
    thread is exporting a call as called."""
    if getattr(masking, "_superneurons_switches", False):
        return
    for name in _TRACED_FLAGS:
        if hasattr(masking, name):
            setattr(masking, name, _switch(getattr(masking, name), False))
    if hasattr(masking, "find_packed_sequence_indices"):
        masking.find_packed_sequence_indices = _switch(masking.find_packed_sequence_indices, None)
    masking._superneurons_switches = True


def _install_modeling() -> None:
    """Rule 4's switches in every modeling module loaded, once per module."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None or \
                getattr(module, "_superneurons_switches", False):
            continue
        for flag in ("is_torchdynamo_exporting", "is_torchdynamo_compiling"):
            if callable(getattr(module, flag, None)):
                setattr(module, flag, _switch(getattr(module, flag), False,
                                              when="modeling_as_called"))
        module._superneurons_switches = True


def _switch(original, answer, when: str = "as_called"):
    @functools.wraps(original)
    def switch(*args, **kwargs):
        if getattr(_local, when, False):
            return answer
        return original(*args, **kwargs)
    return switch


def without_full_mask(model: nn.Module, kwargs: dict) -> dict:
    """Rule 2: ``kwargs`` without a 2-D attention_mask that masks nothing."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.device.type == "meta" or \
            mask.is_floating_point() or mask.is_complex() or not is_hf_model(model) or \
            not bool(mask.all()):
        return kwargs
    return {name: value for name, value in kwargs.items() if name != "attention_mask"}
