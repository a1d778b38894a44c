"""A custom torch.autograd.Function in a model's forward is captured whole and trains with its
own backward, bit for bit (capture/functions.py); what it cannot carry is refused before the
first step. HF's BLOOM, which trains its GELU so, is a case of test_models_today.py."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import superneurons as sn
from equality import assert_same_training, train

X = torch.randn(2, 16, 32)
POLICIES = ["liveness", "offload", "recompute", "superneurons"]


class Scaled(torch.autograd.Function):
    """A constant among its arguments, and a backward that is not the forward's derivative."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (3.0 * ctx.scale) + x * 1e-3, None


class Gated(torch.autograd.Function):
    """Two outputs, and an input (the gate) that needs no gradient."""

    @staticmethod
    def forward(ctx, a, b, gate):
        ctx.save_for_backward(a, b, gate)
        return a * gate + b, a - b

    @staticmethod
    def backward(ctx, grad_sum, grad_difference):
        a, b, gate = ctx.saved_tensors
        return grad_sum * gate + grad_difference, grad_sum - grad_difference * b.sign(), None


class Listed(torch.autograd.Function):
    """A tensor inside a list argument: autograd sends no gradient to it through the
    Function, though it requires one."""

    @staticmethod
    def forward(ctx, x, others):
        ctx.save_for_backward(others[0])
        return x * others[0]

    @staticmethod
    def backward(ctx, grad):
        (other,) = ctx.saved_tensors
        return grad * other, None


class Projected(torch.autograd.Function):
    """Saves its output, whose dtype autocast sets: the backward's forward must run under the
    forward's autocast state to save the same tensor."""

    @staticmethod
    def forward(ctx, x, weight):
        y = x @ weight
        ctx.save_for_backward(y, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, weight = ctx.saved_tensors
        return (grad.float() * y.float().tanh()) @ weight.float().t(), None


class Returned(torch.autograd.Function):
    """Returns its input itself: the captured operation returns a copy."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class AppliesFunctions(nn.Module):
    def __init__(self, autocast: bool = False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.weight = nn.Parameter(torch.randn(32, 32) / 32)
        self.autocast = autocast

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = Scaled.apply(h, 2.0)
        gate = (x[..., :1] > 0).to(h.dtype)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            total, difference = Gated.apply(self.b(h), Returned.apply(h), gate)
            total = Projected.apply(total, self.weight)
        out = Listed.apply(total.float() * difference.float().tanh(), [h])
        return self.c(out).tanh()


def _loss(out, _):
    return out.square().mean()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_custom_function_trains_with_its_own_backward(policy, device):
    wrapped = assert_same_training(AppliesFunctions(), X, None, policy=policy, loss_fn=_loss,
                                   on=device)
    assert all(p.grad is not None for name, p in wrapped.model.named_parameters()
               if name != "weight")                  # Projected's backward gives it none


class AppliesAtTheTop(nn.Module):
    """A model without children: its own forward applies the Function."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 32)

    def forward(self, x):
        return Scaled.apply(x @ self.weight, 2.0)


@pytest.mark.parametrize("policy", ["liveness", "superneurons"])
def test_a_model_without_children_keeps_its_functions_backward(policy):
    """fx, which traces the zoo, would trace through it and drop Scaled's backward."""
    assert_same_training(AppliesAtTheTop(), X, None, policy=policy, loss_fn=_loss)


def test_a_custom_function_reads_its_parameters_from_the_host(device):
    """The Function is given the parameters' device copies (functions.py Rule 4)."""
    model = AppliesFunctions()
    plain = copy.deepcopy(model).to(device)
    expected = train(plain, X.to(device), None, 3, loss_fn=_loss)
    got = train(sn.wrap(model, policy="superneurons", state="host", device=device), X, None, 3,
                loss_fn=_loss)
    assert torch.equal(torch.stack(expected).cpu(), torch.stack(got).cpu())
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a.cpu(), b) and (a.grad is None) == (b.grad is None)
        assert a.grad is None or torch.equal(a.grad.cpu(), b.grad)


def test_a_custom_function_under_autocast_replays_its_forward_under_it(device):
    """The backward's forward runs under the autocast state its forward ran under: without
    it, Gated's saved tensors would be float32 and its gradients other bits."""
    assert_same_training(AppliesFunctions(autocast=True), X, None, policy="recompute",
                         loss_fn=_loss, on=device)


def test_the_functions_own_backward_is_what_runs():
    """Against autograd's derivative of Scaled's forward, its backward triples the gradient:
    the wrapped model's first layer gets Scaled's."""
    torch.manual_seed(0)
    model = AppliesFunctions()
    wrapped = sn.wrap(model, policy="recompute")
    _loss(wrapped(X), None).backward()
    own = model.a.weight.grad.clone()
    model.zero_grad()
    original = Scaled.backward
    Scaled.backward = staticmethod(lambda ctx, grad: (grad * ctx.scale, None))
    try:
        _loss(sn.wrap(model, policy="recompute")(X), None).backward()
    finally:
        Scaled.backward = original
    assert not torch.equal(own, model.a.weight.grad)


class DoubledInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2.0)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


class WithCount(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0, 3

    @staticmethod
    def backward(ctx, grad, _):
        return grad * 2.0


class Applies(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.a, self.function = nn.Linear(32, 32), function

    def forward(self, x):
        out = self.function.apply(self.a(x) * 1.0)
        return out[0] if isinstance(out, tuple) else out


class ScaledBy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        return x * module.weight.sum()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AppliesToModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)

    def forward(self, x):
        return ScaledBy.apply(self.a(x), self.a)


@pytest.mark.parametrize("model, said", [
    (Applies(DoubledInPlace), "DoubledInPlace, which writes its inputs in place"),
    (Applies(WithCount), "WithCount, which returns something other than tensors"),
    (AppliesToModule(), "ScaledBy to a module, whose tensors the captured graph would not see")])
def test_a_function_its_operation_cannot_carry_is_refused(model, said):
    with pytest.raises(ValueError, match=said):
        sn.wrap(model, policy="recompute")(X)


class SavesItsOutput(torch.autograd.Function):
    """Saves only its output: plain PyTorch lets a later layer write its input in place."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


class WritesTheFunctionsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)

    def forward(self, x):
        h = self.a(x)
        y = SavesItsOutput.apply(h)
        return y + h.mul_(2)


def test_a_later_write_into_a_functions_input_is_refused_naming_the_function():
    """The operation keeps the inputs to run the forward again (Rule 1), so a write into one
    is refused: by a message that says why, not one saying plain PyTorch fails."""
    model = WritesTheFunctionsInput()
    model(X).sum().backward()                                        # plain PyTorch trains
    with pytest.raises(ValueError, match=r"input of the custom autograd Function "
                                         r".*SavesItsOutput.*only where the Function saves"):
        sn.wrap(model, policy="recompute")(X)


class SetsTheGradient(torch.autograd.Function):
    """Megatron-style: its backward writes the weight's gradient itself, returning None."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        weight.grad = x.flatten(0, -2).t() @ grad.flatten(0, -2)
        return grad @ weight.t(), None


class AppliesSetsTheGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.weight = nn.Linear(32, 32), nn.Parameter(torch.randn(32, 32) / 32)

    def forward(self, x):
        return SetsTheGradient.apply(self.a(x), self.weight)


@pytest.mark.parametrize("state", ["device", "host"])
def test_the_function_is_given_a_parameter_where_the_model_has_one(state):
    """ReadsParameter's backward tells a Parameter by its type: with the state on the host it
    is given the device copy as a Parameter too (Rule 4)."""
    model = AsTheFunctionSays()
    plain = copy.deepcopy(model)
    expected = train(plain, X, None, 3, loss_fn=_loss)
    where = {"state": "host", "device": "cpu"} if state == "host" else {}
    got = train(sn.wrap(model, policy="superneurons", **where), X, None, 3, loss_fn=_loss)
    assert torch.equal(torch.stack(expected), torch.stack(got))
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))


class AsksForMainGrad(torch.autograd.Function):
    """Megatron's fused weight-gradient accumulation asks the weight for its main_grad."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.fused = hasattr(weight, "main_grad")
        scale = 2.0 if getattr(weight, "sequence_parallel", False) else 1.0
        return x @ weight * scale

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        fused = ctx.fused or hasattr(weight, "main_grad")
        return grad @ weight.t(), None if fused else x.flatten(0, -2).t() @ grad.flatten(0, -2)


class AppliesAsksForMainGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 32)

    def forward(self, x):
        return AsksForMainGrad.apply(x, self.weight)


def test_a_parameters_own_attribute_asked_for_with_the_state_on_the_host():
    """On the device the Function asks the Parameter itself (captured on a twin that has no
    such attribute, which must not refuse it). On the host it asks the copy: an attribute the
    parameter lacks is missing there too, a flag of the parameter's is read from it, and its
    main_grad, a host tensor, is refused."""
    assert_same_training(AppliesAsksForMainGrad(), X, None, policy="superneurons",
                         loss_fn=_loss)
    on_host = dict(policy="superneurons", state="host", device="cpu")
    assert_same_training(AppliesAsksForMainGrad(), X, None, loss_fn=_loss, **on_host)
    flagged = AppliesAsksForMainGrad()
    plain = copy.deepcopy(flagged)             # a deep copy drops a parameter's attributes
    flagged.weight.sequence_parallel = plain.weight.sequence_parallel = True
    expected = train(plain, X, None, 3, loss_fn=_loss)
    got = train(sn.wrap(flagged, **on_host), X, None, 3, loss_fn=_loss)
    assert torch.equal(torch.stack(expected), torch.stack(got))
    model = AppliesAsksForMainGrad()
    model.weight.main_grad = torch.zeros_like(model.weight)
    wrapped = sn.wrap(model, policy="superneurons", state="host", device="cpu")
    with pytest.raises(ValueError, match="attribute 'main_grad' of a parameter"):
        _loss(wrapped(X), None).backward()


def test_a_backward_that_sets_a_parameters_grad_trains_or_is_refused():
    """On the device the Function is given the Parameter itself and its write lands (Rule 4);
    with the state on the host it is given a copy, and the write would be lost: refused."""
    assert_same_training(AppliesSetsTheGradient(), X, None, policy="superneurons",
                         loss_fn=_loss)
    wrapped = sn.wrap(AppliesSetsTheGradient(), policy="superneurons", state="host",
                      device="cpu")
    with pytest.raises(ValueError, match=r"SetsTheGradient sets \.grad of its input 1 itself"):
        _loss(wrapped(X), None).backward()


class Noisy(torch.autograd.Function):
    """Draws in its forward and reads the draw in its backward: the backward's forward must
    draw the same numbers, and leave the generator where the step left it."""

    @staticmethod
    def forward(ctx, x):
        noise = torch.rand_like(x)
        ctx.save_for_backward(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad):
        (noise,) = ctx.saved_tensors
        return grad * noise * 3.0


class Unused(torch.autograd.Function):
    """Its second output gets no gradient: its backward, which does not materialize gradients,
    sees None there, not zeros (0 * inf would be nan)."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x * 2.0, torch.exp(x * 100.0)

    @staticmethod
    def backward(ctx, grad, grad_exp):
        (x,) = ctx.saved_tensors
        own = grad * 2.0
        return own if grad_exp is None else own + grad_exp * torch.exp(x * 100.0)


class Twice(torch.autograd.Function):
    """Returns one tensor twice, and a position it marks non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        y = x * 3.0
        position = x.argmax(dim=-1, keepdim=True).to(x.dtype)
        ctx.mark_non_differentiable(position)
        return y, y, position

    @staticmethod
    def backward(ctx, grad_a, grad_b, _):
        return grad_a * 3.0 + grad_b


class ReadsParameter(torch.autograd.Function):
    """Its backward tells the parameter it was given (in plain PyTorch, the Parameter itself:
    a backward may write its .grad or read its attributes) from a tensor."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return x @ weight

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        scale = 0.5 if isinstance(weight, nn.Parameter) else 1.0
        return grad @ weight.t() * scale, grad.sum() * torch.ones_like(weight)


class Masked(torch.autograd.Function):
    """None among its arguments (HF Reformer's reversible layers pass attention_mask=None)."""

    @staticmethod
    def forward(ctx, x, mask):
        return x * 2.0 if mask is None else x * mask

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0, None


class AsTheFunctionSays(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
        self.weight = nn.Parameter(torch.randn(32, 32) / 32)

    def forward(self, x):
        h = Noisy.apply(Masked.apply(torch.relu(self.a(x)), None))
        h, _ = Unused.apply(h)
        first, second, position = Twice.apply(h)
        h = ReadsParameter.apply(first + second, self.weight)
        return torch.tanh(self.b(h)) + position.detach() * 0


@pytest.mark.parametrize("policy", POLICIES)
def test_the_function_sees_what_it_would_see_in_plain_pytorch(policy, device):
    """Rules 1, 3 and 4 of capture/functions.py, with dropout-like draws between steps."""
    assert_same_training(AsTheFunctionSays(), X, None, policy=policy, loss_fn=_loss, on=device)


def test_outputs_it_marks_non_differentiable_are_so():
    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(32, 32)

        def forward(self, x):
            return Twice.apply(self.a(x))
    model = Returns()
    plain = model(X)
    wrapped = sn.wrap(model, policy="recompute")(X)
    assert [t.requires_grad for t in wrapped] == [t.requires_grad for t in plain] == \
        [True, True, False]


class Multiplied(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


@pytest.mark.parametrize("nan", [float, np.float32], ids=["float", "numpy"])
def test_a_nan_constant_is_one_call_at_every_capture(nan):
    from superneurons.capture import functions

    class NotANumber(nn.Module):
        def forward(self, x):
            return Multiplied.apply(x, nan("nan"))
    x = torch.ones(2, 3, requires_grad=True)
    sn.wrap(NotANumber(), policy="recompute")(x)
    calls = len(functions._CALLS)
    sn.wrap(NotANumber(), policy="recompute")(x)
    assert len(functions._CALLS) == calls


def test_constants_that_compare_equal_but_differ_are_two_calls():
    class Signed(nn.Module):
        def forward(self, x):
            return Multiplied.apply(x, 0.0), Multiplied.apply(x, -0.0)
    x = torch.ones(2, 3, requires_grad=True)
    plain = Signed()(x)
    wrapped = sn.wrap(Signed(), policy="recompute")(x)
    assert [torch.signbit(t).tolist() for t in wrapped] == \
        [torch.signbit(t).tolist() for t in plain]


class Temporaries(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return ((x * 2) + 1).sum(dim=-1, keepdim=True)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


def test_a_functions_forward_temporaries_are_its_scratch():
    """Planned as a module's are (scratch.py Rule 6), not as one operation's outputs alone."""
    plan = sn.plan(Applies(Temporaries), X.shape, "liveness")
    layer = next(l for l in plan.graph.layers if l.name.startswith("autograd_function"))
    unit, output = X.numel() * 4, X.numel() // 32 * 4
    assert layer.forward_scratch == 2 * unit - output     # x * 2 and + 1, less the output


class FilledWithMinimum(torch.autograd.Function):
    """Makes a tensor of its own in its forward (HF SEW-D's XSoftmax: torch.tensor(finfo.min)),
    which the meta device's trace must make on the meta device too."""

    @staticmethod
    def forward(ctx, x):
        return x.masked_fill(x < 0, torch.tensor(torch.finfo(x.dtype).min)).softmax(-1)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


@pytest.mark.parametrize("policy", ["recompute", "superneurons"])
def test_a_function_that_makes_a_tensor_is_planned_and_trains(policy, device):
    assert_same_training(Applies(FilledWithMinimum), X, None, policy=policy, loss_fn=_loss,
                         on=device)
