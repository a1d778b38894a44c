"""The memory-efficient DenseNet (shared storage): plain PyTorch's training bit for bit, alone
and under sn.wrap, with memory linear in depth."""

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune

import superneurons as sn
from superneurons import models
from superneurons.models.efficient_densenet import SharedStorage


def _pair(depth=40, **options):
    plain = models.densenet(depth, 12, cifar=True, **options)
    efficient = models.densenet(depth, 12, cifar=True, efficient=True, **options)
    efficient.load_state_dict(plain.state_dict())
    return plain, efficient


def _train(model, parameters, x, y, steps=3):
    optimizer = torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _assert_same(plain, efficient, plain_losses, efficient_losses):
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, efficient_losses))
    theirs = efficient.state_dict()
    for key, value in plain.state_dict().items():      # running statistics and counts too
        assert torch.equal(value, theirs[key]), key
    for (name, p), q in zip(plain.named_parameters(), efficient.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


def _batch(n=4, size=16):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=generator), \
        torch.randint(0, 10, (n,), generator=generator)


def test_efficient_densenet_trains_as_plain():
    plain, efficient = _pair()
    x, y = _batch()
    _assert_same(plain, efficient, _train(plain, plain.parameters(), x, y),
                 _train(efficient, efficient.parameters(), x, y))


def test_efficient_densenet_in_eval_mode_and_with_frozen_norms():
    """Running statistics read instead of batch statistics, and parameters without grad."""
    plain, efficient = _pair()
    for model in (plain, efficient):
        model.eval()
        for name, p in model.named_parameters():
            p.requires_grad_(not name.endswith("norm1.weight"))
    x, y = _batch()
    _assert_same(plain, efficient,
                 _train(plain, [p for p in plain.parameters() if p.requires_grad], x, y),
                 _train(efficient, [p for p in efficient.parameters() if p.requires_grad], x, y))


def test_efficient_densenet_under_autocast_runs_the_plain_layer():
    plain, efficient = _pair(22)
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same(plain, efficient, _train(plain, plain.parameters(), x, y, 2),
                     _train(efficient, efficient.parameters(), x, y, 2))


def test_efficient_densenet_on_channels_last_runs_the_plain_layer():
    plain, efficient = _pair(22)
    x, y = _batch()
    x = x.to(memory_format=torch.channels_last)
    for model in (plain, efficient):
        model.to(memory_format=torch.channels_last)
    _assert_same(plain, efficient, _train(plain, plain.parameters(), x, y, 2),
                 _train(efficient, efficient.parameters(), x, y, 2))


def test_a_gradient_of_the_gradient_is_refused_not_wrong():
    _, efficient = _pair(22)
    x, _ = _batch()
    x.requires_grad_()
    with pytest.raises(ValueError, match="no gradient of a gradient"):
        torch.autograd.grad(efficient(x).sum(), x, create_graph=True)
    (grad,) = torch.autograd.grad(efficient(x).sum(), x)      # first order still works


def test_hooks_and_subclasses_run_the_plain_layer():
    """A forward hook fires as in plain PyTorch; pruning's pre-hook recomputes the weight."""
    plain, efficient = _pair(22)
    calls = {"plain": 0, "efficient": 0}
    for name, model in (("plain", plain), ("efficient", efficient)):
        def count(*_, name=name):
            calls[name] += 1
        model.blocks[0].layers[1].norm1.register_forward_hook(count)
        torch.nn.utils.prune.l1_unstructured(model.blocks[0].layers[0].conv1, "weight", 0.5)
    x, y = _batch()
    _assert_same(plain, efficient, _train(plain, plain.parameters(), x, y, 2),
                 _train(efficient, efficient.parameters(), x, y, 2))
    assert calls["efficient"] == calls["plain"] == 2


def test_a_backward_reaching_only_a_blocks_last_layer_matches_plain():
    """torch.autograd.grad for one late weight: the block's first layers never run backward
    (a storage released by them would stay held), and the gradient is plain PyTorch's."""
    plain, efficient = _pair(22)
    x, _ = _batch()
    grads = [torch.autograd.grad(model(x).sum(), model.blocks[0].layers[-1].conv1.weight)[0]
             for model in (plain, efficient)]
    assert torch.equal(*grads)


@pytest.mark.parametrize("policy", ["liveness", "offload", "recompute", "superneurons", "auto"])
def test_efficient_densenet_under_wrap_is_exact(policy):
    plain, efficient = _pair()
    x, y = _batch()
    liveness = sn.plan(efficient, tuple(x.shape), policy="liveness").peak_bytes
    floor = sn.plan(efficient, tuple(x.shape),
                    policy="offload" if policy == "offload" else "superneurons").peak_bytes
    budget = liveness if policy == "liveness" else (liveness + floor) // 2
    wrapped = sn.wrap(efficient, policy=policy, budget=budget)
    _assert_same(plain, efficient, _train(plain, plain.parameters(), x, y),
                 _train(wrapped, efficient.parameters(), x, y))
    stats = wrapped.stats
    if policy != "liveness":                          # the budget made the runtime act
        assert stats.recomputed_layers > 0 or stats.offloaded_bytes > 0


def _saved_activation_bytes(model, x) -> int:
    """Bytes of the storages autograd saves in one forward, model state left out."""
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    return sum(n for ptr, n in saved.items() if ptr not in state)


def test_saved_memory_is_linear_in_depth():
    """Doubling the layers per block doubles what the efficient DenseNet saves; the plain one
    saves every layer's concatenation, which grows with the square of the depth."""
    x, _ = _batch(2)
    plain = {d: _saved_activation_bytes(models.densenet(d, 12, cifar=True), x) for d in (40, 76)}
    efficient = {d: _saved_activation_bytes(models.densenet(d, 12, cifar=True, efficient=True), x)
                 for d in (40, 76, 148)}
    assert efficient[76] / efficient[40] < 2.0 and efficient[148] / efficient[76] < 2.0
    assert plain[76] / plain[40] > 2.5
    assert efficient[76] < plain[76] / 2


def test_shared_storage_is_sized_once_for_the_widest_layer():
    storage = SharedStorage(max_channels=40)
    like = torch.empty(2, 16, 4, 4)
    first = storage.view(like, 16)
    flat = storage.flat
    wider = storage.view(like, 40)
    assert storage.flat is flat and flat.numel() == 2 * 40 * 4 * 4
    assert first.shape == (2, 16, 4, 4) and wider.shape == (2, 40, 4, 4)
    storage.release()
    assert storage.flat is None


def test_efficient_applies_to_densenets_only():
    assert models.build("densenet_cifar", depth=40, efficient=True).blocks[0].efficient
    with pytest.raises(ValueError, match="DenseNets"):
        models.build("resnet50", efficient=True)
