"""Capture sees what the step will do, or the model is refused before its first step: copies
that only happen for some strides (capture/trace.py Rule 3), draws from generators outside
torch, tensor attributes the forward assigns, and export's own output (capture/export_said.py)."""

import copy
import functools
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from equality import assert_same_training, train

X = torch.randn(2, 16, 32)


class QuestionAnswering(nn.Module):
    """HF's question-answering heads: the logits split into start and end, each made
    contiguous, both returned and both in the loss."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.qa = nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 2)
        self.register_buffer("positions", torch.tensor([[1, 4], [3, 6]]))

    def forward(self, x):
        start, end = self.qa(self.norm(self.lin(x))).split(1, dim=-1)
        start, end = start.squeeze(-1).contiguous(), end.squeeze(-1).contiguous()
        loss = (F.cross_entropy(start, self.positions[:, 0]) +
                F.cross_entropy(end, self.positions[:, 1])) / 2
        return loss, start, end


def test_a_contiguous_copy_of_a_split_half_is_not_taken_for_a_view():
    """Captured on contiguous fresh inputs, contiguous() looked like a view of the logits, and
    the end loss's replay read the start half: every gradient differed."""
    torch.manual_seed(0)
    model = QuestionAnswering()
    floor = sn.plan(copy.deepcopy(model), (X,), "superneurons").peak_bytes
    liveness = sn.plan(copy.deepcopy(model), (X,), "liveness").peak_bytes
    assert floor < liveness
    wrapped = assert_same_training(model, X, None, loss_fn=lambda out, _: out[0],
                                   policy="superneurons", budget=(floor + liveness) // 2)
    assert wrapped.stats.recomputed_layers > 0


class Drawing(nn.Module):
    def __init__(self, draw):
        super().__init__()
        self.lin, self.draw = nn.Linear(32, 32), draw

    def forward(self, x):
        return self.lin(x) * self.draw(x)


@pytest.mark.parametrize("draw", [lambda x: float(np.random.rand()),
                                  lambda x: random.random()], ids=["numpy", "python"])
def test_a_forward_drawing_from_numpy_or_python_random_is_refused(draw):
    """Every step would reuse the numbers drawn at capture (HF Wav2Vec2's SpecAugment)."""
    with pytest.raises(ValueError, match="draws random numbers .* torch.rand"):
        sn.wrap(Drawing(draw))(X)


def test_a_forward_drawing_from_torch_trains_bit_for_bit():
    assert_same_training(Drawing(lambda x: torch.rand_like(x)), X, None,
                         loss_fn=lambda out, _: out.square().mean(), policy="recompute")


class Assigning(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.aux_loss = None

    def forward(self, x):
        out = self.lin(x)
        self.aux_loss = out.square().mean()        # read by the training loop after the call
        warnings.warn("the model's own warning")
        return out


def test_a_tensor_attribute_assigned_in_the_forward_is_refused_other_warnings_said():
    """Export puts the attribute back and the graph never sets it: after a step the loop
    would read the value from before the first call."""
    with pytest.warns(UserWarning, match="the model's own warning"):
        with pytest.raises(ValueError, match=r"assigns tensor attributes \(self.aux_loss\)"
                                             r".*children: lin"):
            sn.wrap(Assigning())(X)


class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone, self.head = nn.Linear(32, 32), nn.Linear(32, 2)

    def forward(self, x):
        features = self.backbone(x)
        if features.sum() > 0:                  # a branch on a value: not capturable
            features = features * 2
        return self.head(features)


def test_a_data_dependent_refusal_names_the_children_and_prints_no_graph(capfd):
    with pytest.raises(ValueError, match="its children: backbone, head; model.backbone = "
                                         r"sn.wrap\(model.backbone, ...\)") as refused:
        sn.wrap(ReadsValues())(X)
    assert "def forward" not in capfd.readouterr().err          # export's partial graph
    assert refused.value.__cause__ is not None and "labels=" not in str(refused.value)


class ReadsLabels(nn.Module):
    """HF's heads given labels= compute their loss in the forward, some reading the labels'
    values (DeBERTa-v2's classifier, Wav2Vec2's CTC)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 2)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        if labels is not None and labels.max() >= 2:
            raise ValueError("labels out of range")
        return logits


def test_a_refusal_for_values_read_with_labels_says_to_compute_the_loss_outside():
    with pytest.raises(ValueError, match="call it without labels and compute the loss"):
        sn.wrap(ReadsLabels())(X, labels=torch.zeros(2, 16, dtype=torch.long))


class Recurrent(nn.Module):
    """nn.LSTM assigns its _flat_weights in every forward where its parameters were swapped
    (export's stand-ins): the model's own parameters again, not a stale attribute."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(32, 16, batch_first=True), nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_a_recurrent_layer_reassigning_its_own_weights_trains_bit_for_bit():
    assert_same_training(Recurrent(), X, None, loss_fn=lambda out, _: out.square().mean(),
                         policy="recompute")


class WarnsThenReads(ReadsValues):
    def forward(self, x):
        warnings.warn("the model's own warning", FutureWarning)
        return super().forward(x)


def test_warnings_said_during_a_failed_capture_are_shown():
    with pytest.warns(FutureWarning, match="the model's own warning"):
        with pytest.raises(ValueError, match="reads tensor values"):
            sn.wrap(WarnsThenReads())(X)


class Warns(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        warnings.warn("the model's own warning")
        return self.lin(x)


def test_a_warning_is_filtered_once_as_the_user_said():
    """Shown where the user's filters let it through, not filtered again under another module
    name (which, under "error" for all but this module, refused the model)."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("error")
        warnings.filterwarnings("always", category=UserWarning, module=__name__)
        sn.wrap(Warns())(X)
    assert [str(w.message) for w in shown] == ["the model's own warning"]


def test_the_module_that_reads_is_named_and_only_children_without_it_are_offered():
    """Numbered children named as Python indexes them; the child holding the read is not
    offered, and where every child holds it, the refusal says so."""
    model = nn.Sequential(ReadsValues(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"in ReadsValues \(0\)\).*children that hold no "
                                         r"ReadsValues: 1; model\[1\] = sn.wrap\(model\[1\]"):
        sn.wrap(model)(X)
    with pytest.raises(ValueError, match=r"each of its children holds ReadsValues\)"):
        sn.wrap(nn.Sequential(ReadsValues(), ReadsValues()))(X)


class Doubled(torch.autograd.Function):
    """Identity forward, a backward of its own (not the forward's derivative)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


@torch.library.custom_op("superneurons_tests::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 1.0


doubled.register_fake(torch.empty_like)
doubled.register_autograd(lambda ctx, grad: grad * 2.0)


class SetsUpAutograd(nn.Module):
    """What a forward sets up for autograd as it runs (capture/refused.py Rule 4)."""

    def __init__(self, how: str):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(32, 32), nn.Linear(32, 32), how

    def forward(self, x):
        h = self.a(x)
        if self.how == "tensor hook":
            h.register_hook(lambda grad: grad.clamp(-1e-3, 1e-3))
            return self.b(h)
        if self.how == "saved tensors hooks":
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: t.to(torch.bfloat16), lambda t: t.to(torch.float32)):
                return self.b(h).tanh()
        return self.b(torch.vmap(torch.tanh)(h))


@pytest.mark.parametrize("how, said", [("tensor hook", "Tensor.register_hook"),
                                       ("saved tensors hooks", "saved_tensors_hooks"),
                                       ("vmap", "functorch transform")])
def test_autograd_python_a_forward_sets_up_is_refused(how, said):
    """Dropped from the captured graph, a hook or a compressing pack changed the gradients
    silently; vmap's levels failed capture and stayed open for the rest of the process. (A
    custom autograd Function is captured whole: tests/test_custom_functions.py.)"""
    with pytest.raises(ValueError, match=said):
        sn.wrap(SetsUpAutograd(how), policy="recompute")(X)
    torch.nn.functional.dropout(torch.ones(4), 0.5)       # functorch's levels closed again


class AppliesWithoutGradient(nn.Module):
    """A custom Function nothing differentiates (on the input), and a custom op whose
    register_autograd export keeps whole: neither is refused."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.b(doubled(self.a(Doubled.apply(x)))).tanh()


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_functions_whose_backward_capture_keeps_train_as_plain(policy):
    assert_same_training(AppliesWithoutGradient(), X, None, policy=policy,
                         loss_fn=lambda out, _: out.square().mean())


def _traced(forward):
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):         # as HF decorates its forwards
        return forward(self, *args, **kwargs)
    return wrapper


def _positive(features):
    return features.sum() > 0                   # the read, in a helper function


class ReadsInHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    @_traced
    def forward(self, x):
        features = self.lin(x)
        return features * 2 if _positive(features) else features


def test_a_reader_behind_a_decorator_and_a_helper_is_still_named():
    model = nn.Sequential(nn.Linear(32, 32), ReadsInHelper(), nn.Linear(32, 2))
    with pytest.raises(ValueError, match=r"in ReadsInHelper \(1\)\).*children that hold no "
                                         r"ReadsInHelper: 0, 2; model\[0\]"):
        sn.wrap(model)(X)


class ComplexRotary(nn.Module):
    """Rotary embeddings as complex numbers (HF DeepSeek-V2's): a complex product saves its
    other factor for backward, which a replay must be planned to make again."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(32, 32), nn.Linear(32, 32)
        self.register_buffer("angles", torch.arange(16.0).outer(torch.linspace(0.1, 1.0, 16)))

    def forward(self, x):
        rotation = torch.polar(torch.ones_like(self.angles), self.angles)   # made each call
        q = torch.view_as_complex(self.q(x).reshape(*x.shape[:-1], 16, 2))
        return self.out(torch.view_as_real(q * rotation).flatten(-2)).tanh()


def test_complex_values_are_traced_as_differentiable():
    graph = sn.plan(ComplexRotary(), X, policy="liveness").graph
    product = next(l for l in graph.layers if l.name.rsplit(":", 1)[-1] == "mul")
    assert product.saved, "the complex product's saved factor is not planned"


@pytest.mark.parametrize("policy", ["recompute", "superneurons"])
def test_a_complex_rotary_trains_as_plain(policy):
    assert_same_training(ComplexRotary(), X, None, policy=policy,
                         loss_fn=lambda out, _: out.square().mean())


class NormalizedWithoutGrad(nn.Module):
    """A model without children, its own forward holding a no-grad region: fx, which traces the
    zoo's networks, would trace through it and drop the region (capture/trace.py Rule 1)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 32)

    def forward(self, x):
        h = x @ self.weight
        with torch.no_grad():
            scale = h.abs().mean()
        return F.log_softmax(h / scale, -1)


def test_a_model_without_children_is_captured_with_its_regions():
    assert_same_training(NormalizedWithoutGrad(), torch.randn(4, 32), torch.randint(0, 32, (4,)),
                         policy="superneurons")


def test_a_forward_set_on_a_containers_instance_is_the_one_captured():
    """accelerate's prepare() sets an autocast forward on the model instance; fx, which traces
    torch.nn's containers, would trace the class's forward and drop it (trace.py Rule 1)."""
    def prepared():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        own = model.forward
        model.forward = lambda x: F.log_softmax(own(x) * 0.5, -1)
        return model
    x, y = torch.randn(4, 32), torch.randint(0, 32, (4,))
    plain, managed = prepared(), prepared()
    expected = train(plain, x, y, 3)
    got = train(sn.wrap(managed, policy="superneurons"), x, y, 3)
    assert torch.equal(torch.stack(expected), torch.stack(got))
