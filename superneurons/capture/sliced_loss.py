"""A language model's loss layer sliced over rows: the same bits, in the memory of the logits
and their gradient alone.

A cross-entropy over a vocabulary is often a model's largest layer: GPT-2 small at 16 x 1,024
tokens has 3.07 GiB of fp32 logits. Plain PyTorch's forward makes their log-softmax beside them,
its backward holds three such tensors at once (the saved log-softmax, its gradient and the
logits' gradient), and a model whose logits are half precision upcasts them for the loss first
(HF's losses: logits.float()), keeping a float32 copy through the step. That sets the floor no
plan can go below. Here the layer keeps its logits, as the model made them, and walks the rows
in slices both ways: in forward each slice's log-softmax gives up the log-probabilities of its
targets, which one reduction over the rows sums as the whole loss would; in backward each
slice's log-softmax is made again, then its gradient and the logits' gradient, written into
one full buffer.

Rule 1: exact. The kernels are those plain PyTorch runs: _log_softmax, nll_loss_forward,
        nll_loss_backward, _log_softmax_backward_data, and the casts. Each computes a row from
        that row alone (its reductions run over the classes), and a slice is a view at the
        row's own address, so a row's arithmetic, down to its vector alignment, is the one a
        whole-tensor call gives it. Slices start at multiples of ROW_ALIGNMENT rows so that
        the buffers made for a slice have the row alignments the whole tensor's rows have.
        The loss itself is nll_loss_forward over the targets' log-probabilities gathered into
        one column (a copy): the kernel reads a row's target entry alone, and its sum over the
        rows runs in an order set by the row count, not the class count (the CPU's cascade,
        CUDA's threads striding over rows). The backward uses the whole loss's total_weight.
        A cast to float32 is exact, and its backward's cast back rounds each element alone:
        made per slice, both give the whole tensor's bits.
Rule 2: only the plain case is sliced: contiguous 2-D logits in float32, or in half precision
        where autocast runs the whole loss in float32 (the CPU's autocast; then cast as it
        casts, its backward casting back; capture's AutocastOnMeta counts as autocast, so plan
        and step agree; CUDA's autocast runs the log-softmax in half precision, a computation
        this form does not make), or half-precision logits the graph casts to float32 for the
        loss alone (Rule 5), integer targets, no class weights, no label smoothing, reduction
        "mean" or "sum", at least two slices' rows. Any other call runs the original
        operations as they are (int64 targets, one per row: plain PyTorch's own messages for
        any other).
Rule 3: a backward that builds a graph through the layer (create_graph=True: a gradient
        penalty), or one after the logits were written in place, is a RuntimeError saying to
        wrap with slice_loss=False. Plain PyTorch sums the loss's gradient and the penalty's at
        its one log-softmax node, then runs its backward once; a log-softmax made again for the
        graph would run it twice and sum after (a last-bit difference in the logits'
        gradient). Keeping the logits, not their log-softmax, has two more effects plain
        PyTorch does not have: logits written in place after the loss cannot be read back
        (autograd's version check), and torch.func's transforms (grad, vmap, jvp) refuse the
        Function. Under Rule 5 and under the CPU's autocast the logits kept are the model's
        half-precision ones, so a write into the logits a model returns (out.logits.div_(t)
        before backward) is refused there too, where plain PyTorch reads its float32 copy.
Rule 4: only the graph's top level is rewritten: a loss inside a grad-mode or autocast region
        of an exported graph (its own submodule) runs as it is, and is planned so.
Rule 5: a cross-entropy whose logits are a view of a cast to float32 that nothing else reads
        (HF's logits.float().view(-1, vocab)) takes the cast's source: a half-precision source
        is cast slice by slice, and its gradient comes back in its own dtype, so neither the
        float32 copy nor its float32 gradient is ever whole.
"""

import torch
import torch.nn.functional as F
from torch import fx
from torch.overrides import _get_current_function_mode_stack

from .autocast import REDUCTIONS, AutocastOnMeta, casts_cross_entropy

__all__ = ["slice_losses", "SLICED_LOSSES", "SLICES", "SLICE_BYTES", "ROW_ALIGNMENT",
           "sliced_cast_cross_entropy_loss"]

# a slice is at most 1/SLICES of the rows and about SLICE_BYTES of float32 log-probabilities
# (rounded up to ROW_ALIGNMENT rows):
# its backward holds up to four such temporaries (the float32 cast of a half-precision slice,
# its log-softmax, that one's gradient, the logits' gradient before its cast back), so a
# vocabulary's layer stays near the bytes of its logits and their gradient; smaller slices
# ran slower on an H100, these as fast as 16 (BENCHMARKS.md, "Slices of the loss layer")
SLICES = 16
SLICE_BYTES = 32 << 20
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
    """The loss of 2-D ``logits`` whose float32 form the layer reads slice by slice (Rule 1):
    float32 logits, or half-precision ones cast per slice (Rule 5), their gradient returned
    in their own dtype."""

    @staticmethod
    def forward(ctx, logits, target, reduction: int, ignore_index: int):
        ignored = target == ignore_index
        chosen = torch.where(ignored, 0, target).unsqueeze(1)
        # Rule 1: the targets' log-probabilities in the column of a class no ignored row names
        column = 0 if ignore_index != 0 else 1
        picked = logits.new_zeros((logits.shape[0], column + 1), dtype=torch.float32)
        for start, stop in _slices(logits):
            log_probs = _log_softmax(logits[start:stop])
            picked[start:stop, column:] = log_probs.gather(1, chosen[start:stop])
            del log_probs
        loss, total_weight = torch.ops.aten.nll_loss_forward.default(
            picked, torch.where(ignored, target, column), None, reduction, ignore_index)
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
        for start, stop in _slices(logits):
            log_probs = _log_softmax(logits[start:stop])
            grad_log_probs = torch.ops.aten.nll_loss_backward.default(
                grad_loss, log_probs, target[start:stop], None, ctx.reduction,
                ctx.ignore_index, total_weight)
            if grad.dtype == torch.float32:
                torch.ops.aten._log_softmax_backward_data.out(
                    grad_log_probs, log_probs, 1, torch.float32, out=grad[start:stop])
            else:                                         # Rule 5: the cast's backward, per slice
                grad[start:stop] = torch.ops.aten._log_softmax_backward_data.default(
                    grad_log_probs, log_probs, 1, torch.float32)
            del log_probs, grad_log_probs
        return grad, None, None, None


def _log_softmax(rows: torch.Tensor) -> torch.Tensor:
    """The float32 log-softmax of ``rows``, cast to float32 first where they are half
    precision (Rule 5: as the whole cast would)."""
    return torch.ops.aten._log_softmax.default(rows.to(torch.float32), 1, False)


def _slices(logits: torch.Tensor) -> list:
    """(start, stop) of each slice of ``logits``' rows."""
    rows, classes = logits.shape
    step = min(-(-rows // SLICES), max(1, SLICE_BYTES // max(1, 4 * classes)))
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


def _sliceable(logits, target, weight, label_smoothing, reduction, cast=False) -> bool:
    """Rule 2; ``cast``: the graph casts half-precision logits to float32 for this loss alone
    (Rule 5)."""
    return (isinstance(logits, torch.Tensor) and logits.dim() == 2
            and (logits.dtype == torch.float32
                 or logits.dtype in (torch.bfloat16, torch.float16)
                 and (cast or _autocast_runs_it_in_float32(logits.device.type)))
            and logits.is_contiguous()
            and isinstance(target, torch.Tensor) and target.dtype == torch.int64
            and target.dim() == 1 and target.shape[0] == logits.shape[0] and weight is None
            and label_smoothing == 0.0 and reduction in _REDUCTIONS.values()
            and logits.shape[0] > ROW_ALIGNMENT)                   # two slices at least


def _run(logits, target, reduction: int, ignore_index: int):
    """Half-precision logits go in as they are: the layer casts them per slice, as autocast or
    the graph's cast would cast them whole (Rules 1 and 5)."""
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


def sliced_cast_cross_entropy_loss(source, shape, target, weight=None, reduction=1,
                                   ignore_index=-100, label_smoothing=0.0):
    """aten.cross_entropy_loss.default of source.to(torch.float32).view(shape), where nothing
    else reads the cast or the view (Rule 5)."""
    if source.is_contiguous():
        logits = source.view(shape)
        if _sliceable(logits, target, weight, label_smoothing, reduction, cast=True):
            return _run(logits, target, reduction, ignore_index)
    return torch.ops.aten.cross_entropy_loss.default(
        source.to(torch.float32).view(shape), target, weight, reduction, ignore_index,
        label_smoothing)


_SLICED = {torch.ops.aten.cross_entropy_loss.default: sliced_cross_entropy_loss,
           F.cross_entropy: sliced_cross_entropy}
SLICED_LOSSES = frozenset((*_SLICED.values(), sliced_cast_cross_entropy_loss))


def slice_losses(gm: fx.GraphModule) -> int:
    """Point every cross-entropy call of ``gm`` at its sliced form (which runs the original
    where Rule 2 does not hold), taking the source of a cast only it reads (Rule 5); the
    number of calls changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _SLICED:
            node.target = _SLICED[node.target]
            changed += 1
            cast = _cast_for_the_loss_alone(node)
            if cast is not None:
                view = node.args[0]
                node.target = sliced_cast_cross_entropy_loss
                node.args = (cast.args[0], view.args[1], *node.args[1:])
                gm.graph.erase_node(view)
                gm.graph.erase_node(cast)
    if changed:
        gm.recompile()
    return changed


def _cast_for_the_loss_alone(loss: fx.Node):
    """Rule 5: the node casting to float32 whose one reader is a view whose one reader is
    ``loss`` (an exported aten.cross_entropy_loss), else None."""
    view = loss.args[0]
    if loss.target is not sliced_cross_entropy_loss or not _only_read_by(view, loss) or \
            view.target is not torch.ops.aten.view.default:
        return None
    cast = view.args[0]
    if not _only_read_by(cast, view) or cast.target is not torch.ops.aten.to.dtype or \
            len(cast.args) != 2 or cast.args[1] is not torch.float32 or \
            any(cast.kwargs.values()):          # non_blocking, copy, memory_format: defaults
        return None
    # as traced: a half-precision source and rows enough to slice, else the graph stays as
    # it is (a float32 model's cast returns its input: nothing to save)
    source, rows = cast.args[0].meta.get("val"), view.meta.get("val")
    if not isinstance(source, torch.Tensor) or not isinstance(rows, torch.Tensor) or \
            source.dtype not in (torch.bfloat16, torch.float16) or rows.dim() != 2 or \
            not isinstance(rows.shape[0], int) or rows.shape[0] <= ROW_ALIGNMENT:
        return None
    return cast


def _only_read_by(node, reader: fx.Node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and \
        list(node.users) == [reader] and list(reader.args).count(node) == 1
