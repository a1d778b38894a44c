"""A tensor the step saved for backward, written in place after the forward: plain PyTorch's
autograd refuses it when backward reads it; with saved_tensors_hooks it does not check, so the
executor does (executor Rule 7), whether the tensor was kept, moved or is replayed. Without it
the step would read other values than plain PyTorch, silently."""

import pytest
import torch
from torch import nn

import superneurons as sn
from superneurons.capture.sliced_loss import MODIFIED_INPLACE, sliced_cross_entropy

transformers = pytest.importorskip("transformers")


def _sigmoid_head():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Sigmoid())


@pytest.mark.parametrize("policy", ["offload", "recompute", "superneurons"])
def test_an_output_its_layer_saved_written_after_the_forward_is_refused(policy, device):
    """Sigmoid saves its output, which the model returns: written before backward."""
    x = torch.randn(4, 8).to(device)
    outputs = {}
    for name, run in (("plain", _sigmoid_head().to(device)),
                      (policy, sn.wrap(_sigmoid_head().to(device), policy))):
        out = run(x)
        with torch.no_grad():
            out.mul_(2)
        with pytest.raises(RuntimeError, match=MODIFIED_INPLACE):
            out.sum().backward()
        outputs[name] = out
    assert torch.equal(outputs["plain"], outputs[policy])


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=1000, n_positions=128, n_embd=32, n_layer=2,
                                     n_head=4)
    return transformers.GPT2LMHeadModel(config).train()


@pytest.mark.parametrize("policy", ["offload", "recompute", "superneurons"])
def test_logits_written_after_a_sliced_loss_are_refused_and_unsliced_match_plain(policy):
    """Plain PyTorch keeps the log-softmax, so it trains through this; the sliced loss keeps
    the logits (sliced_loss.py Rule 3) and says to wrap with slice_loss=False, which then
    matches plain PyTorch."""
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(3))
    grads = []
    for wrap in (lambda m: m, lambda m: sn.wrap(m, policy=policy),
                 lambda m: sn.wrap(m, policy=policy, slice_loss=False)):
        model = _gpt2()
        torch.manual_seed(1)
        out = wrap(model)(input_ids=ids, labels=ids, use_cache=False)
        with torch.no_grad():
            out.logits.mul_(0)
        try:
            out.loss.backward()
        except RuntimeError as error:
            assert "slice_loss=False" in str(error)
            grads.append(None)
            continue
        grads.append([p.grad for p in model.parameters()])
    plain, sliced, unsliced = grads
    assert sliced is None
    assert all(torch.equal(a, b) for a, b in zip(plain, unsliced))


def test_a_second_backward_is_not_blamed_on_a_write():
    logits = torch.randn(256, 33, requires_grad=True)
    target = torch.randint(0, 33, (256,))
    loss = sliced_cross_entropy(logits * 1, target)
    loss.backward()
    with pytest.raises(RuntimeError) as error:
        loss.backward()
    assert "slice_loss" not in str(error.value)


class _ScaledAfterTheLoss(nn.Module):
    """Logits written in place after the loss, inside the forward (a temperature for what it
    returns): plain PyTorch trains through this, as it keeps the log-softmax."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 100)

    def forward(self, x, target):
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits, target)
        logits.mul_(0.5)
        return loss, logits


def test_logits_written_after_a_sliced_loss_inside_the_forward_are_refused_before_a_step():
    x, target = torch.randn(256, 16), torch.randint(0, 100, (256,))
    with pytest.raises(ValueError, match="keeps for its backward over slices.*slice_loss=False"):
        sn.wrap(_ScaledAfterTheLoss(), "recompute")(x, target)
    grads = []
    for wrap in (lambda m: m, lambda m: sn.wrap(m, "recompute", slice_loss=False)):
        torch.manual_seed(0)
        model = _ScaledAfterTheLoss()
        wrap(model)(x, target)[0].backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _ReturnsADetachedFeature(nn.Module):
    """A detach() alias shares the saved tensor's version but is no view of it."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)

    def forward(self, x):
        h = self.c1(x)
        return self.c2(torch.sin(h)), h.detach()


class _WritesWhatItSaved(nn.Module):
    """a.mul_(a) saves a, then writes it: plain PyTorch refuses the backward."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        a = self.l1(x)
        a.mul_(a)
        return self.l2(a)


def _optimizer_step_before_backward(wrap):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = wrap(model)(torch.randn(4, 8))
    out.pow(2).sum().backward(retain_graph=True)
    optimizer.step()                                  # the saved weights are written
    out.sum().backward()


def _detached_feature_written(wrap):
    torch.manual_seed(0)
    out, feature = wrap(_ReturnsADetachedFeature())(torch.randn(2, 3, 16, 16))
    feature.mul_(0)
    out.sum().backward()


def _written_by_the_layer_that_saved_it(wrap):
    torch.manual_seed(0)
    wrap(_WritesWhatItSaved())(torch.randn(4, 8)).sum().backward()


@pytest.mark.parametrize("policy", ["offload", "recompute", "superneurons"])
@pytest.mark.parametrize("case", [_optimizer_step_before_backward, _detached_feature_written,
                                  _written_by_the_layer_that_saved_it])
def test_every_write_plain_pytorch_refuses_is_refused(case, policy):
    """Saved weights (an optimizer step between forward and backward), a saved tensor written
    through a detach() alias, and one written by the layer that saved it."""
    with pytest.raises(RuntimeError, match=MODIFIED_INPLACE):
        case(lambda m: m)
    with pytest.raises(RuntimeError, match=MODIFIED_INPLACE):
        case(lambda m: sn.wrap(m, policy))
