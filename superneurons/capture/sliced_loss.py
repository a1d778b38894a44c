"""A language model's loss layer with its backward sliced over rows: the same bits, in the
memory of two logits instead of three.

A cross-entropy over a vocabulary is often a model's largest layer: GPT-2 small at 16 x 1,024
tokens has 3.07 GiB of fp32 logits, and plain PyTorch's backward holds three such tensors at once
(the saved log-softmax, its gradient and the logits' gradient), which sets the floor no plan can
go below. Here the layer keeps its logits instead of their log-softmax, and its backward walks
the rows in slices: the log-softmax of a slice again, its gradient, and the logits' gradient
written into one full buffer.

Rule 1: exact. The forward runs the kernels aten.cross_entropy_loss runs (_log_softmax, then
        nll_loss_forward), whole. The backward runs the kernels autograd runs
        (nll_loss_backward, _log_softmax_backward_data) on slices of rows: each computes a row
        from that row alone (its reductions run over the classes), with the whole loss's
        total_weight, and a slice is a view at the row's own address, so a row's arithmetic,
        down to its vector alignment, is the one a whole-tensor call gives it. Slices start at
        multiples of ROW_ALIGNMENT rows so that the buffers made for a slice have the row
        alignments the whole tensor's rows have.
Rule 2: only the plain case is sliced: contiguous 2-D logits in float32, or in half precision
        where autocast runs the whole loss in float32 (the CPU's autocast; then cast as it
        casts, its backward casting back; capture's AutocastOnMeta counts as autocast, so plan
        and step agree; CUDA's autocast runs the log-softmax in half precision, a computation
        this form does not make),
        integer targets, no class weights, no label smoothing, reduction "mean" or "sum", at
        least two slices' rows. Any other call runs the original operation as it is.
Rule 3: a backward that builds a graph through the layer (create_graph=True: a gradient
        penalty), or one after the logits were written in place, is a RuntimeError saying to
        wrap with slice_loss=False. Plain PyTorch sums the loss's gradient and the penalty's at
        its one log-softmax node, then runs its backward once; a log-softmax made again for the
        graph would run it twice and sum after (a last-bit difference in the logits'
        gradient). Keeping the logits, not their log-softmax, has two more effects plain
        PyTorch does not have: logits written in place after the loss cannot be read back
        (autograd's version check), and torch.func's transforms (grad, vmap, jvp) refuse the
        Function.
Rule 4: only the graph's top level is rewritten: a loss inside a grad-mode or autocast region
        of an exported graph (its own submodule) runs as it is, and is planned so.
"""

import torch
import torch.nn.functional as F
from torch import fx
from torch.overrides import _get_current_function_mode_stack

from .autocast import REDUCTIONS, AutocastOnMeta, casts_cross_entropy

__all__ = ["slice_losses", "SLICED_LOSSES", "SLICES", "ROW_ALIGNMENT"]

SLICES = 16                  # a slice's two temporaries: at most 1/8 of the logits' bytes
# slices start at multiples of this many rows: an fp32 row's offset is then a multiple of 256
# bytes, which keeps every row's 16-byte vector alignment in a slice's own buffers as in the
# whole tensor's (CUDA's allocations start at multiples of 512 bytes)
ROW_ALIGNMENT = 64
_REDUCTIONS = {k: v for k, v in REDUCTIONS.items() if k != "none"}    # Rule 2
# autograd's words for a saved tensor written in place since, which the executor uses too
# (runtime/handles.py, Written)
MODIFIED_INPLACE = ("one of the variables needed for gradient computation has been modified by "
                    "an inplace operation")


class _SlicedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, reduction: int, ignore_index: int):
        log_probs = torch.ops.aten._log_softmax.default(logits, 1, False)
        loss, total_weight = torch.ops.aten.nll_loss_forward.default(
            log_probs, target, None, reduction, ignore_index)
        ctx.save_for_backward(logits, target, total_weight)
        ctx.reduction, ctx.ignore_index = reduction, ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        try:
            logits, target, total_weight = ctx.saved_tensors
        except RuntimeError as error:                         # Rule 3: written in place since
            if MODIFIED_INPLACE not in str(error):        # autograd's words, and the executor's
                raise
            raise RuntimeError(
                "superneurons keeps this cross-entropy's logits for its backward over slices of "
                "rows (capture/sliced_loss.py), and they were written in place after the loss: "
                "plain PyTorch, which keeps their log-softmax instead, would run this backward. "
                "Wrap the model with slice_loss=False for it.") from error
        if torch.is_grad_enabled():                                          # Rule 3
            raise RuntimeError(
                "superneurons runs this cross-entropy's backward over slices of rows "
                "(capture/sliced_loss.py), which gives plain PyTorch's bits for one backward "
                "only: a backward that builds a graph through it (create_graph=True) would not. "
                "Wrap the model with slice_loss=False for that.")
        grad = torch.empty_like(logits)
        for start, stop in _slices(logits.shape[0]):
            log_probs = torch.ops.aten._log_softmax.default(logits[start:stop], 1, False)
            grad_log_probs = torch.ops.aten.nll_loss_backward.default(
                grad_loss, log_probs, target[start:stop], None, ctx.reduction,
                ctx.ignore_index, total_weight)
            torch.ops.aten._log_softmax_backward_data.out(
                grad_log_probs, log_probs, 1, logits.dtype, out=grad[start:stop])
            del log_probs, grad_log_probs
        return grad, None, None, None


def _slices(rows: int) -> list:
    step = -(-rows // SLICES)
    step = -(-step // ROW_ALIGNMENT) * ROW_ALIGNMENT
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _autocast_runs_it_in_float32(kind: str) -> bool:
    """Whether autocast would cast a half-precision cross-entropy's input to float32 now: real
    autocast on ``kind``, or capture's (AutocastOnMeta) planning for a kind whose autocast
    does (the CPU's; CUDA's runs the log-softmax in half precision: autocast.py Rule 4)."""
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return casts_cross_entropy(kind)
    return any(isinstance(mode, AutocastOnMeta) and "cross_entropy_loss" in mode.float32
               for mode in _get_current_function_mode_stack())


def _sliceable(logits, target, weight, label_smoothing, reduction) -> bool:
    """Rule 2."""
    return (isinstance(logits, torch.Tensor) and logits.dim() == 2
            and (logits.dtype == torch.float32
                 or logits.dtype in (torch.bfloat16, torch.float16)
                 and _autocast_runs_it_in_float32(logits.device.type))
            and logits.is_contiguous()
            and isinstance(target, torch.Tensor)
            and target.dim() == 1 and not target.is_floating_point() and weight is None
            and label_smoothing == 0.0 and reduction in _REDUCTIONS.values()
            and logits.shape[0] > ROW_ALIGNMENT)                   # two slices at least


def _run(logits, target, reduction: int, ignore_index: int):
    logits = logits.to(torch.float32)               # autocast's cast, where Rule 2 let it in
    kind = logits.device.type
    if not torch.amp.is_autocast_available(kind):     # the meta device, while capturing
        return _SlicedCrossEntropy.apply(logits, target, reduction, ignore_index)
    with torch.autocast(kind, enabled=False):        # float32 in, float32 throughout
        return _SlicedCrossEntropy.apply(logits, target, reduction, ignore_index)


def sliced_cross_entropy_loss(input, target, weight=None, reduction=1, ignore_index=-100,
                              label_smoothing=0.0):
    """aten.cross_entropy_loss.default, as an exported graph calls it."""
    if _sliceable(input, target, weight, label_smoothing, reduction):
        return _run(input, target, reduction, ignore_index)
    return torch.ops.aten.cross_entropy_loss.default(input, target, weight, reduction,
                                                     ignore_index, label_smoothing)


def sliced_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                         reduce=None, reduction="mean", label_smoothing=0.0):
    """F.cross_entropy, as a graph torch.fx traced calls it."""
    if size_average is None and reduce is None and _sliceable(
            input, target, weight, label_smoothing, _REDUCTIONS.get(reduction)):
        return _run(input, target, _REDUCTIONS[reduction], ignore_index)
    return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                           reduction, label_smoothing)


_SLICED = {torch.ops.aten.cross_entropy_loss.default: sliced_cross_entropy_loss,
           F.cross_entropy: sliced_cross_entropy}
SLICED_LOSSES = frozenset(_SLICED.values())


def slice_losses(gm: fx.GraphModule) -> int:
    """Point every cross-entropy call of ``gm`` at its sliced form (which runs the original
    where Rule 2 does not hold); the number of calls changed."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SLICED:
            node.target = _SLICED[node.target]
            changed += 1
    if changed:
        gm.recompile()
    return changed
