"""The known traps, each on a small network: every policy must train exactly like PyTorch."""

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from equality import assert_same_training

POLICIES = ["offload", "recompute", "superneurons"]


class Traps(nn.Module):
    """Dropout, in-place ReLU, residual +=, a module called twice, a concatenation."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.shared = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                                    nn.ReLU(inplace=True))
        self.proj = nn.Conv2d(8, 8, 1)
        self.bn = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16 * 8 * 8, 5)

    def forward(self, x):
        x = F.relu(self.stem(x), inplace=True)
        y = self.shared(x)
        y = self.proj(self.shared(y))  # the same weights and BatchNorm, twice
        y += x                         # residual, in place
        z = torch.cat([x, torch.sigmoid(y)], 1)
        z = self.drop(F.relu(self.bn(z)))
        return F.log_softmax(self.head(z.flatten(1)), dim=1)


@pytest.mark.parametrize("policy", POLICIES)
def test_traps_train_exactly(policy):
    torch.manual_seed(0)
    wrapped = assert_same_training(Traps(), torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)),
                                   steps=3, policy=policy)
    if policy != "offload":
        assert wrapped.stats.recomputed_layers > 0


@pytest.mark.parametrize("strategy", ["speed-centric", "memory-centric", "cost-aware"])
def test_every_recomputation_strategy_is_exact(strategy):
    torch.manual_seed(0)
    wrapped = assert_same_training(Traps(), torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)),
                                   steps=2, policy="superneurons", strategy=strategy)
    assert wrapped.stats.recomputed_layers > 0


def test_mlp_with_functional_dropout_and_mse():
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.norm = nn.Linear(16, 32), nn.Linear(32, 4), nn.LayerNorm(32)

        def forward(self, x):
            h = F.dropout(F.gelu(self.norm(self.fc1(x))), 0.2, self.training)
            return self.fc2(h)
    torch.manual_seed(0)
    assert_same_training(MLP(), torch.randn(8, 16), torch.randn(8, 4), steps=3,
                         loss_fn=F.mse_loss, policy="superneurons")


@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_autocast_is_replayed_under_autocast(policy):
    """Planned with autocast's dtypes (capture/autocast.py), run and replayed under autocast."""
    torch.manual_seed(0)
    model, x, y = Traps(), torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))

    def loss_fn(out, target):
        return F.nll_loss(out.float(), target)

    import copy
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = sn.wrap(managed, policy=policy)
    for m in (plain, wrapped):
        torch.manual_seed(1)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss_fn(m(x), y).backward()
    for a, b in zip(plain.parameters(), managed.parameters()):
        assert torch.equal(a.grad, b.grad)
    for (name, a), b in zip(plain.state_dict().items(), managed.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs"
    if policy != "offload":
        assert wrapped.stats.recomputed_layers > 0
    else:
        assert wrapped.stats.offloaded_bytes > 0


def test_eval_and_no_grad_run_untouched():
    model = Traps().eval()
    wrapped = sn.wrap(model, policy="superneurons")
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(wrapped(x), model(x))
    assert wrapped.stats is None


def test_grad_scaler_works_unchanged():
    torch.manual_seed(0)
    model, x, y = Traps(), torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    import copy
    results = []
    for managed in (False, True):
        replica = copy.deepcopy(model)
        net = sn.wrap(replica, policy="superneurons") if managed else replica
        optimizer = torch.optim.SGD(replica.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        torch.manual_seed(1)
        for _ in range(2):
            optimizer.zero_grad()
            scaler.scale(F.nll_loss(net(x), y)).backward()
            scaler.step(optimizer)
            scaler.update()
        results.append([p.detach().clone() for p in replica.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_models_returning_several_outputs_and_input_gradients():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            self.a, self.b = nn.Linear(8 * 8 * 8, 5), nn.Linear(8 * 8 * 8, 3)

        def forward(self, x):
            h = self.body(x).flatten(1)
            return {"main": F.log_softmax(self.a(h), 1), "aux": self.b(h)}

    torch.manual_seed(0)
    model, x = TwoHeads(), torch.randn(4, 3, 8, 8)
    import copy
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    grads = []
    for net in (plain, sn.wrap(managed, policy="superneurons")):
        inp = x.clone().requires_grad_()
        out = net(inp)
        (F.nll_loss(out["main"], torch.arange(4)) + out["aux"].square().mean()).backward()
        grads.append(inp.grad)
    assert torch.equal(grads[0], grads[1])
    for a, b in zip(plain.parameters(), managed.parameters()):
        assert torch.equal(a.grad, b.grad)


class _Headed(nn.Module):
    """Not a zoo network: exported, its parameters read by get_attr at every step."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return F.log_softmax(self.fc(self.body(x).mean((2, 3))), 1)


@pytest.mark.parametrize("swap", ["head", "layer"])
def test_a_submodule_replaced_between_steps_is_the_one_trained(swap):
    """Fine-tuning swaps a head (or a layer) for a fresh one of the same shape: the step after
    it reads and trains the new module's parameters, as plain PyTorch does."""
    import copy

    def replace(model):
        torch.manual_seed(5)
        if swap == "head":
            model.fc = nn.Linear(8, 10)
        else:
            model.body[3] = nn.Conv2d(8, 8, 3, padding=1)

    def grads(model, run):
        torch.manual_seed(1)
        x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
        F.nll_loss(run(x), y).backward()
        model.zero_grad()
        replace(model)
        F.nll_loss(run(x), y).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    torch.manual_seed(0)
    plain = _Headed()
    managed = copy.deepcopy(plain)
    expected = grads(plain, plain)
    got = grads(managed, sn.wrap(managed, policy="superneurons"))
    assert expected.keys() == got.keys()
    for name in expected:
        assert got[name] is not None and torch.equal(expected[name], got[name]), name


def test_a_layer_boundary_finds_the_inputs_read_last_gone(monkeypatch):
    """The room made after a layer counts what only it read as gone (executor Rule 1): nothing
    of the executor's own may still hold it there, or the next layer runs beside it."""
    from superneurons.runtime.executor import Executor

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))  # fc1's output: read by tanh alone

    made, seen = [], {}
    call, account = Executor._call, Executor._account

    def calling(self, layer, *args, **kwargs):
        out = call(self, layer, *args, **kwargs)
        if layer.name == "fc1":
            made.append(weakref.ref(out))
        return out
    monkeypatch.setattr(Executor, "_call", calling)

    def reading(self, step, awaiting=None):
        if made and step == 1:                         # after tanh, its last reader
            seen["alive"] = made[-1]() is not None
        return account(self, step, awaiting)
    monkeypatch.setattr(Executor, "_account", reading)
    wrapped = sn.wrap(Chain(), policy="offload")
    wrapped(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert seen == {"alive": False}


@pytest.mark.parametrize("policy", POLICIES + ["liveness"])
def test_a_frozen_model_trains_its_input_exactly(policy):
    """Prompt tuning, adversarial inputs, a pipeline stage: the parameters frozen, the input
    needs a gradient. The plan counts the gradients, and the input's gradient is plain's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))
    model.requires_grad_(False)
    plan = sn.plan(model, (torch.randn(8, 16, requires_grad=True),), policy="liveness")
    assert any(b.label == "grad(input)" for b in plan.buffers)
    wrapped = sn.wrap(copy.deepcopy(model), policy=policy)
    grads = {}
    for name, run in (("plain", model), (policy, wrapped)):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        torch.manual_seed(2)
        for _ in range(2):
            x.grad = None
            run(x).pow(2).sum().backward()
        grads[name] = x.grad
    assert torch.equal(grads["plain"], grads[policy])
