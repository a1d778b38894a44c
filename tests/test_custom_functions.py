"""A custom torch.autograd.Function in a model's forward is captured whole and trains with its
own backward, bit for bit (capture/functions.py); what it cannot carry is refused before the
first step. HF's BLOOM, which trains its GELU so, is a case of test_models_today.py."""

import pytest
import torch
from torch import nn

import superneurons as sn
from equality import assert_same_training

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
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            total, difference = Gated.apply(self.b(h), Returned.apply(h), gate)
            total = Projected.apply(total, self.weight)
        out = Listed.apply(total.float() * difference.float().tanh(), [h])
        return self.c(out).tanh()


def _loss(out, _):
    return out.square().mean()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_custom_function_trains_with_its_own_backward(policy):
    wrapped = assert_same_training(AppliesFunctions(), X, None, policy=policy, loss_fn=_loss)
    assert all(p.grad is not None for name, p in wrapped.model.named_parameters()
               if name != "weight")                  # Projected's backward gives it none


def test_a_custom_function_reads_its_parameters_from_the_host():
    assert_same_training(AppliesFunctions(), X, None, policy="superneurons", loss_fn=_loss,
                         state="host", device=torch.device("cpu"))


def test_a_custom_function_under_autocast_replays_its_forward_under_it():
    """The backward's forward runs under the autocast state its forward ran under: without
    it, Gated's saved tensors would be float32 and its gradients other bits."""
    assert_same_training(AppliesFunctions(autocast=True), X, None, policy="recompute",
                         loss_fn=_loss)


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


class RandomScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * torch.rand_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


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


@pytest.mark.parametrize("function, said", [
    (RandomScale, "RandomScale, whose forward draws random numbers"),
    (DoubledInPlace, "DoubledInPlace, which writes its inputs in place"),
    (WithCount, "WithCount, which returns something other than tensors")])
def test_a_function_its_operation_cannot_carry_is_refused(function, said):
    with pytest.raises(ValueError, match=said):
        sn.wrap(Applies(function), policy="recompute")(X)


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
