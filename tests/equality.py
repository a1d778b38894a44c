"""Train a model plainly and wrapped, from the same start and seeds; compare everything."""

import copy

import torch
import torch.nn.functional as F

import superneurons as sn


def train(model, x, y, steps: int, seed: int = 1, loss_fn=F.nll_loss):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def assert_same_training(model, x, y, *, steps=3, loss_fn=F.nll_loss, on="cpu", **wrap_options):
    """Losses, parameters and buffers (BatchNorm statistics) identical to plain PyTorch; ``on``:
    the device both train on (conftest's ``device`` fixture: "cuda" with deterministic
    kernels)."""
    plain, managed = copy.deepcopy(model).to(on), copy.deepcopy(model).to(on)
    x, y = (t if t is None else t.to(on) for t in (x, y))
    expected = train(plain, x, y, steps, loss_fn=loss_fn)
    assert torch.isfinite(torch.stack(expected)).all(), \
        f"plain PyTorch's own losses are not finite, so nothing is compared: {expected}"
    wrapped = sn.wrap(managed, **wrap_options)
    got = train(wrapped, x, y, steps, loss_fn=loss_fn)
    assert torch.equal(torch.stack(expected), torch.stack(got)), (expected, got)
    for (name, a), b in zip(plain.state_dict().items(), managed.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs"
    for a, b in zip(plain.parameters(), managed.parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
    return wrapped
