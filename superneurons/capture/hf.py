"""HF transformers models take another path when exported than when called: capture takes theirs.

transformers builds attention masks one way when it runs and another when torch.export traces it
(masking_utils): called without a mask, or with one that masks nothing, a decoder runs SDPA with
is_causal=True and, for grouped-query attention, enable_gqa=True; exported, it materializes the
causal mask and repeats the key and value heads (an exported graph must serve any later mask and
sequence length, and it may not read a traced tensor's values to learn that the positions are
one sequence each). The two agree in value but not in rounding: under bf16 autocast the repeated
heads' gradients are rounded to bf16 before they are summed, so the gradients of k_proj and v_proj
differ from plain PyTorch's. A superneurons graph serves only calls like the one it was captured
from (same shapes, and a new capture for any other), so it can keep the path the model runs.

Rule 1: while superneurons exports an HF model for a call without a mask, transformers' masking
        code is told it is not traced (by whichever flags its version asks), and whether the
        call's positions pack several sequences is decided as the call itself decides it
        (packed_positions, part of the plan's key): positions the model makes itself (none
        passed) are one sequence per row. A call with a mask, or packed positions, needs
        nothing: both paths materialize its mask.
Rule 2: an attention_mask that masks nothing is dropped from an HF model's call before capture
        and before each step: transformers treats it as no mask (it skips such masks when it
        runs, but cannot when exported, since it may not read a traced tensor's values). A mask
        that masks something stays, and both paths materialize it. Reading it costs one small
        reduction and a host sync per step.
"""

import contextlib
import sys

import torch
from torch import nn


def is_hf_model(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _masking(model: nn.Module):
    """transformers' masking module where ``model`` is an HF model and it is loaded, else None."""
    masking = sys.modules.get("transformers.masking_utils")
    return masking if masking is not None and is_hf_model(model) else None


# how transformers' masking code asks whether it is traced, across its versions (is_tracing
# takes an optional tensor; without a mask it is asked of none the call passed)
_TRACED_FLAGS = ("is_torchdynamo_exporting", "is_torchdynamo_compiling", "is_tracing")


def packed_positions(model: nn.Module, kwargs: dict) -> bool:
    """Rule 1: whether a call's own position_ids pack several sequences in a row, as the model
    would find when it runs (only without an attention mask, as it looks only then)."""
    masking = _masking(model)
    positions = kwargs.get("position_ids")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices") or \
            not isinstance(positions, torch.Tensor) or positions.device.type == "meta" or \
            kwargs.get("attention_mask") is not None:
        return False
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    return masking.find_packed_sequence_indices(positions) is not None


@contextlib.contextmanager
def exported_as_called(model: nn.Module, kwargs: dict, packed: bool = False):
    """Rule 1, for the duration of an export of ``model`` called with ``kwargs``; ``packed``:
    packed_positions of the call. A call with a mask, or with packed positions, materializes
    its mask both ways: nothing to tell (and the flags must stay, or transformers would read
    the traced mask's values)."""
    masking = _masking(model)
    if masking is None or packed or kwargs.get("attention_mask") is not None:
        yield
        return
    names = [name for name in (*_TRACED_FLAGS, "find_packed_sequence_indices")
             if hasattr(masking, name)]
    originals = {name: getattr(masking, name) for name in names}
    for name in names:
        setattr(masking, name, (lambda position_ids: None) if name.startswith("find_")
                else (lambda *tensor: False))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)


def without_full_mask(model: nn.Module, kwargs: dict) -> dict:
    """Rule 2: ``kwargs`` without an attention_mask that masks nothing."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.device.type == "meta" or \
            not is_hf_model(model) or not bool(mask.all()):
        return kwargs
    return {name: value for name, value in kwargs.items() if name != "attention_mask"}
