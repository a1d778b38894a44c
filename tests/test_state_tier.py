"""Model state in host memory (sn.wrap(..., state="host")): the same training as plain PyTorch,
the model's own tensors, and what cannot be made exact refused. On the CPU the "device copies"
are copies in host memory, so every path of the tier runs (fetch, saved-state references,
gradients summed per use and set or accumulated, buffers written back); the cases taking
``device`` run on CUDA too, against plain PyTorch there under deterministic kernels."""

import copy
import gc

import pytest
import torch
from torch import nn

import superneurons as sn
from matrix import compare
from today_constructs import cases as construct_cases
from today_models import cases as model_cases


def _resnet():
    torch.manual_seed(0)
    return sn.models.resnet(blocks=(1, 1, 2, 1), num_classes=10)


def _batch(step=0, device="cpu"):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    return x.to(device), y.to(device)


def _train(model, run, steps=3, micro=1, device="cpu"):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        for k in range(micro):               # micro > 1: gradients accumulate over calls
            x, y = _batch(10 * step + k, device)
            loss = nn.functional.cross_entropy(run(x), y)
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
    return losses, optimizer


def _same(plain, other) -> None:
    """``other``'s state is in host memory; ``plain`` ran on the compute device."""
    for (key, a), (_, b) in zip(plain.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a.cpu(), b), key
    for (key, a), (_, b) in zip(plain.named_parameters(), other.named_parameters()):
        assert (a.grad is None) == (b.grad is None) and (
            a.grad is None or torch.equal(a.grad.cpu(), b.grad)), key


@pytest.mark.parametrize("policy", ["liveness", "offload", "recompute", "superneurons"])
def test_the_zoo_trains_as_plain_pytorch_with_its_state_on_the_host(policy, device):
    plain = _resnet().to(device)
    expected, plain_optimizer = _train(plain, plain, device=device)
    model = _resnet()
    wrapped = sn.wrap(model, policy=policy, state="host", device=device)
    got, optimizer = _train(model, wrapped, device=device)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    _same(plain, model)
    for a, b in zip(plain_optimizer.state.values(), optimizer.state.values()):
        assert torch.equal(a["momentum_buffer"].cpu(), b["momentum_buffer"])
    assert wrapped.stats.state_moved_bytes > 0


def test_gradients_accumulate_over_micro_batches_as_autograd_adds_them(device):
    plain = _resnet().to(device)
    expected, _ = _train(plain, plain, steps=2, micro=2, device=device)
    model = _resnet()
    got, _ = _train(model, sn.wrap(model, policy="superneurons", state="host", device=device),
                    steps=2, micro=2, device=device)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    _same(plain, model)


def test_the_model_keeps_its_own_tensors_and_keys():
    model = _resnet()
    weight = model.stem[0].weight
    wrapped = sn.wrap(model, state="host", device="cpu")
    _train(model, wrapped, steps=1)
    assert model.stem[0].weight is weight and weight.grad is not None
    state = wrapped.state_dict()
    assert list(state) == list(model.state_dict())
    fresh = _resnet()
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                   model.state_dict().values()))


def test_evaluation_without_grad_runs_on_the_device_copies():
    plain = _resnet().eval()
    model = _resnet().eval()
    wrapped = sn.wrap(model, state="host", device="cpu")
    x, _ = _batch()
    with torch.no_grad():
        assert torch.equal(plain(x), wrapped(x))


def test_a_parameter_changed_between_forward_and_backward_fails_as_in_plain_pytorch():
    model = _resnet()
    wrapped = sn.wrap(model, policy="liveness", state="host", device="cpu")
    x, y = _batch()
    loss = nn.functional.cross_entropy(wrapped(x), y)
    with torch.no_grad():
        model.head[1].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_training_goes_on_as_plain_pytorch_after_a_backward_that_raised(device):
    plain, model = _resnet().to(device), _resnet()
    wrapped = sn.wrap(model, policy="liveness", state="host", device=device)
    for module, run in ((plain, plain), (model, wrapped)):
        x, y = _batch(device=device)
        loss = nn.functional.cross_entropy(run(x), y)
        with torch.no_grad():       # the stem's backward runs last: the head's gradients
            module.stem[0].weight.add_(1.0)                     # arrive before it raises
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        module.zero_grad(set_to_none=True)
    _train(plain, plain, device=device)
    _train(model, wrapped, device=device)
    _same(plain, model)


def test_an_hf_decoder_trains_on_as_plain_pytorch_after_a_backward_that_raised(device):
    pytest.importorskip("transformers")
    from today_models import build_hf_gpt2
    torch.manual_seed(0)
    model, _, kwargs, loss_of = build_hf_gpt2()
    plain = copy.deepcopy(model).to(device)
    kwargs = {name: value.to(device) if torch.is_tensor(value) else value
              for name, value in kwargs.items()}
    wrapped = sn.wrap(model, policy="superneurons", state="host", device=device)
    for module, run in ((plain, plain), (model, wrapped)):
        torch.manual_seed(1)                                    # the same dropout masks
        loss = loss_of(run(**kwargs))
        with torch.no_grad():       # the first block's backward runs after the head's
            module.transformer.h[0].attn.c_attn.weight.add_(0.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        # the tier's optimizer steps in host memory, and AdamW's CPU kernels round otherwise
        # than its CUDA ones (the gradients agree): on CUDA both step SGD, whose kernels agree
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3) if device == "cpu" else \
            torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(2 + step)
            loss_of(run(**kwargs)).backward()
            optimizer.step()
    _same(plain, model)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "c_shared_twice", "c_shared_batchnorm",
                                  "c_spectral_norm", "c_no_grad_branch", "c_autocast_bf16_region",
                                  "c_kwargs_dict", "c_rand_like"])
def test_models_nobody_here_wrote_train_exactly_with_their_state_on_the_host(name):
    """Tied embeddings (GPT-2: one parameter read by two layers), shared modules, state written
    in place (spectral norm, BatchNorm called twice), regions, keyword calls, randomness."""
    case = (model_cases() | construct_cases())[name]
    for policy in ("recompute", "superneurons"):
        assert compare(case, policy, state="host").status == "exact"


def test_what_the_tier_cannot_make_exact_is_refused():
    model = _resnet()
    model.head[1].weight.register_hook(lambda grad: grad)
    with pytest.raises(ValueError, match="has a hook"):
        sn.wrap(model, state="host", device="cpu")
    with pytest.raises(ValueError, match="sparse"):
        sn.wrap(nn.Embedding(10, 4, sparse=True), state="host", device="cpu")
    with pytest.raises(ValueError, match="state must be"):
        sn.wrap(_resnet(), state="disk")
    with pytest.raises(ValueError, match="state='host'"):
        sn.wrap(_resnet(), device="cpu")
    model = _resnet()
    wrapped = sn.wrap(model, state="host", device="cpu")
    x, y = _batch()
    loss = nn.functional.cross_entropy(wrapped(x), y)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


def test_the_plan_streams_state_and_says_what_it_moves():
    model = sn.models.resnet(blocks=(1, 1, 6, 1))
    on_device = sn.plan(model, (2, 3, 64, 64))
    on_host = sn.plan(model, (2, 3, 64, 64), state="host")
    assert on_host.resident_bytes == 0 and on_device.resident_bytes > 0
    assert on_host.peak_bytes < on_device.peak_bytes
    # forward copies of everything, the trained parameters again in backward, their gradients
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert on_host.state_bytes_moved >= 3 * params
    budget = on_host.peak_bytes
    assert on_host.bytes_to_move(budget) >= on_host.state_bytes_moved
    assert "model state on the host" in on_host.explain()
    with pytest.raises(ValueError, match="state on the host .*needs"):
        sn.plan(model, (2, 3, 64, 64), budget=on_host.peak_bytes)


class _AbandonCounter:
    """A mover that records which prefetches were freed unread (mover Rule 2)."""

    def __init__(self):
        self.abandoned = []

    def abandon(self, event):
        self.abandoned.append(event)


def test_copies_fetched_ahead_and_never_read_wait_for_their_copy_when_dropped():
    from superneurons.runtime.state import StateTier
    mover = _AbandonCounter()
    tier = StateTier(nn.Linear(2, 2), torch.device("cpu"), mover)
    tier.ahead[1] = (torch.empty(4), "copy 1")
    tier.release()                          # between steps
    assert mover.abandoned == ["copy 1"] and not tier.ahead
    tier.ahead[2] = (torch.empty(4), "copy 2")
    del tier                                # a backward raised after fetching ahead
    gc.collect()
    assert mover.abandoned == ["copy 1", "copy 2"]


class _Tied(nn.Module):
    """An embedding tied to the output head: its parameter has two uses a forward."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid = nn.Embedding(64, 32), nn.Linear(32, 32)

    def forward(self, ids):
        return torch.tanh(self.mid(self.emb(ids))) @ self.emb.weight.t()


def _tied_loss(run, seed):
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))
    logits = run(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten().to(logits.device))


def _two_forwards_one_loss(run):
    (_tied_loss(run, 1) + _tied_loss(run, 2)).backward()


def _no_grad_forward_between(run):
    loss = _tied_loss(run, 1)
    with torch.no_grad():
        run(torch.zeros(2, 16, dtype=torch.long))
    loss.backward()


def _two_forwards_two_backwards(run):
    first, second = _tied_loss(run, 1), _tied_loss(run, 2)
    first.backward()
    second.backward()


def _one_graph_twice(run):
    loss = _tied_loss(run, 1)
    loss.backward(retain_graph=True)
    loss.backward()


@pytest.mark.parametrize("pattern", [_two_forwards_one_loss, _no_grad_forward_between,
                                     _two_forwards_two_backwards, _one_graph_twice])
def test_each_backward_sums_the_uses_it_reaches_as_autograd_does(pattern, device):
    """A gradient is sent once every use the running backward reaches has delivered, so that
    its additions into .grad follow autograd's order where one backward runs two forwards'
    graphs, or one graph runs twice (tied weights, .grad accumulated into)."""
    torch.manual_seed(0)
    model = _Tied()
    plain = copy.deepcopy(model).to(device)
    wrapped = sn.wrap(model, policy="liveness", state="host", device=device)
    for module in (plain, wrapped):
        def run(ids, module=module):                    # the ids on the compute device
            return module(ids.to(device))
        _tied_loss(run, 0).backward()       # .grad already there: accumulated into
        pattern(run)
    _same(plain, model)
