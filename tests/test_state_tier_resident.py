"""Resident state with state="host" (planner/state.py, runtime/state.py Rule 7): where the budget
leaves room the plan keeps state on the device, fetched once; training stays plain PyTorch's,
bit for bit, and what changes on the host reaches the next step. On the CPU the "device copies"
are copies in host memory, so every path of the tier runs; copies are counted at the tier."""

import importlib
from collections import Counter

import pytest
import torch
from torch import nn

import superneurons as sn
from superneurons.planner.costs import OFF_CUDA
from superneurons.planner.plan import captured_step, plan_graph

plan_module = importlib.import_module("superneurons.planner.plan")   # the package names a function so

SHAPES = {"resnet": (4, 3, 32, 32), "exported": (4, 3, 8, 8)}


class _Exported(nn.Module):
    """Captured by torch.export (get_attr state): BatchNorm, a buffer nobody writes."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16),
                                      nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 8 * 8, 10))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.head(self.backbone(x) * self.scale)


def _model(kind="resnet", seed=0):
    """With a frozen first convolution and its BatchNorm's affine parameters (a frozen stem)."""
    torch.manual_seed(seed)
    model = sn.models.resnet(blocks=(1, 1, 2, 1), num_classes=10) if kind == "resnet" \
        else _Exported()
    for parameter in list(model.parameters())[:3]:
        parameter.requires_grad_(False)
    return model


def _budget(kind, factor):
    """``factor`` times the policy's floor with the state on the host."""
    return int(factor * sn.plan(_model(kind), SHAPES[kind], state="host",
                                machine=OFF_CUDA).peak_bytes)


def _batch(kind, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(*SHAPES[kind], generator=g), torch.randint(0, 10, (4,), generator=g)


OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
    # fused kernels write the parameters without counting a version (state Rule 7)
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
}


def _train(model, run, kind, optimizer, steps=3):
    optimizer = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        x, y = _batch(kind, step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(run(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, optimizer


def _same(plain, other, plain_optimizer=None, optimizer=None) -> None:
    for (key, a), (_, b) in zip(plain.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), key
    for (key, a), (_, b) in zip(plain.named_parameters(), other.named_parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or
                                                          torch.equal(a.grad, b.grad)), key
    if optimizer is not None:
        for a, b in zip(plain_optimizer.state.values(), optimizer.state.values()):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind,factor,replays", [("resnet", 1.05, True), ("resnet", 1.5, False),
                                                 ("exported", 1.5, False)])
def test_resident_state_trains_as_plain_pytorch(kind, factor, replays, optimizer):
    """Frozen stem and trained parameters resident, BatchNorm's statistics streamed, replays
    (resnet at 1.05) reading the kept copies: losses, state, gradients and optimizer state
    equal plain PyTorch's after 3 steps."""
    plain = _model(kind)
    expected, plain_optimizer = _train(plain, plain, kind, optimizer)
    model = _model(kind)
    wrapped = sn.wrap(model, budget=_budget(kind, factor), state="host", device="cpu")
    plan = wrapped.plan_for(_batch(kind, 0)[0])[0]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert frozen & set(plan.resident_state) and trained & set(plan.resident_state)
    assert plan.streamed_state_bytes > 0 and (plan.num_extra_computations > 0) == replays
    got, got_optimizer = _train(model, wrapped, kind, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    _same(plain, model, plain_optimizer, got_optimizer)


def _fetches(executor) -> Counter:
    """Bytes the tier copies to the device, per host tensor id, from now on."""
    counted, start = Counter(), executor.tier._start

    def counting(host):
        counted[id(host)] += host.untyped_storage().nbytes()
        return start(host)
    executor.tier._start = counting
    return counted


def test_room_in_the_budget_keeps_state_resident_and_moves_less():
    tight = sn.plan(_model(), SHAPES["resnet"], budget=_budget("resnet", 1.0), state="host",
                    machine=OFF_CUDA)
    roomy_budget = _budget("resnet", 1.5)
    roomy = sn.plan(_model(), SHAPES["resnet"], budget=roomy_budget, state="host", machine=OFF_CUDA)
    assert tight.resident_state == () and roomy.resident_state
    assert roomy.state_bytes_moved < tight.state_bytes_moved

    moved = {}
    for name, budget in (("tight", _budget("resnet", 1.0)), ("roomy", roomy_budget)):
        model = _model()
        wrapped = sn.wrap(model, budget=budget, state="host", device="cpu")
        x, _ = _batch("resnet", 0)
        plan, executor = wrapped.plan_for(x)
        _train(model, wrapped, "resnet", "sgd-momentum", steps=1)
        fetched = _fetches(executor)
        _train(model, wrapped, "resnet", "sgd-momentum", steps=1)
        moved[name] = wrapped.stats.state_moved_bytes
    # the roomy run's second step: resident state moved once (forward), frozen or trained, a
    # trained streamed parameter at least twice
    tensors = dict(model.named_parameters())
    resident = set(plan.resident_state)
    assert any(not tensors[name].requires_grad for name in resident if name in tensors)
    for name, tensor in tensors.items():
        nbytes = tensor.untyped_storage().nbytes()
        if name in resident:
            assert fetched[id(tensor)] == nbytes, name
        elif tensor.requires_grad and name.endswith("weight"):
            assert fetched[id(tensor)] >= 2 * nbytes, name
    assert moved["roomy"] < moved["tight"]
    assert moved["roomy"] == sum(fetched.values()) + sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_the_planned_peak_with_resident_state_stays_within_the_budget(monkeypatch):
    """Resident state takes only the room the plan the budget chose leaves: that plan's
    activations are unchanged, and its peak plus the resident bytes fits the budget."""
    for kind in SHAPES:
        graph = captured_step(_model(kind), SHAPES[kind])      # planned alike under each budget
        floor = plan_graph(graph, state="host", machine=OFF_CUDA).peak_bytes
        for factor in (1.02, 1.05, 1.1, 1.3, 2.0, 4.0):
            budget = int(factor * floor)
            for policy in ("superneurons", "recompute", "liveness", "auto"):
                try:
                    plan = plan_graph(graph, policy, budget, state="host", machine=OFF_CUDA)
                except ValueError:
                    continue                        # liveness below its own peak
                assert plan.peak_bytes <= budget
                assert plan.resident_bytes == plan.resident_state_bytes
                with monkeypatch.context() as patched:
                    patched.setattr(plan_module, "with_resident_state", lambda p, b: p)
                    alone = plan_graph(graph, policy, budget, state="host", machine=OFF_CUDA)
                assert alone.resident_state == ()
                assert [s.layers for s in alone.segments] == [s.layers for s in plan.segments]
                assert alone.actions == plan.actions
                assert plan.peak_bytes <= alone.peak_bytes + plan.resident_state_bytes
                assert plan.resident_state_bytes <= budget - alone.peak_bytes
                assert plan.state_bytes_moved <= alone.state_bytes_moved
    # with no budget (the policy's floor) nothing is resident
    assert sn.plan(_model(), SHAPES["resnet"], state="host", machine=OFF_CUDA).resident_state == ()
    plan = sn.plan(_model(), SHAPES["resnet"], budget=_budget("resnet", 1.5), state="host",
                   machine=OFF_CUDA)
    record = plan.to_dict()
    assert record["resident_state_bytes"] == plan.resident_state_bytes > 0
    assert record["resident_state_count"] == len(plan.resident_state)
    assert record["streamed_state_bytes"] == plan.streamed_state_bytes > 0
    assert "kept resident on the device" in plan.explain()
    assert f"{len(plan.resident_state)} tensors resident" in str(plan)
    assert "resident_state_bytes=" in repr(plan)


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("assign", [False, True])
def test_state_loaded_between_steps_reaches_the_next_step(kind, assign):
    """load_state_dict in place (a new version) or with assign=True (new tensors): the next
    step reads the loaded state, resident copies fetched again."""
    model = _model(kind)
    wrapped = sn.wrap(model, budget=_budget(kind, 1.5), state="host", device="cpu")
    x, y = _batch(kind, 0)
    plan, executor = wrapped.plan_for(x)
    _train(model, wrapped, kind, "sgd-momentum", steps=1)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    # nothing outlives the step's backward (Rule 7): the next step fetches again; nor a
    # forward that no backward follows
    assert set(frozen) <= set(plan.resident_state) and not executor.tier.kept
    with torch.no_grad():
        wrapped(x)
    assert not executor.tier.kept
    loaded = {k: v.clone() for k, v in _model(kind, seed=1).state_dict().items()}
    wrapped.load_state_dict(loaded, assign=assign)
    model.zero_grad()
    plain = _model(kind)
    plain.load_state_dict(loaded)
    for step in (1, 2):                     # a kept copy of the loaded state serves step 2
        x, y = _batch(kind, step)
        nn.functional.cross_entropy(plain(x), y).backward()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        _same(plain, model)


def test_a_frozen_parameter_an_optimizer_still_steps_is_fetched_again():
    """A gradient left from before it was frozen (zero_grad(set_to_none=False)): a fused
    optimizer steps the parameter without counting a version: a copy kept past the step would
    miss it (Rule 7)."""
    def run(model, call):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        for step in range(3):
            if step == 1:
                for parameter in list(model.parameters())[:3]:
                    parameter.requires_grad_(False)
            x, y = _batch("resnet", step)
            optimizer.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(call(x), y).backward()
            optimizer.step()

    plain, model = _model(), _model()
    for m in (plain, model):
        for parameter in m.parameters():
            parameter.requires_grad_(True)
    run(plain, plain)
    wrapped = sn.wrap(model, budget=_budget("resnet", 1.5), state="host", device="cpu")
    run(model, wrapped)
    assert "stem.0.weight" in wrapped.plan_for(_batch("resnet", 0)[0])[0].resident_state
    _same(plain, model)


def test_only_the_plan_running_keeps_resident_copies():
    """Copies kept by another plan of the wrapper (another input shape) would hold memory the
    running plan's budget does not count (module Rule 6): they go when it runs."""
    model = _model()
    wrapped = sn.wrap(model, budget=_budget("resnet", 1.5), state="host", device="cpu")
    small = torch.randn(2, 3, 32, 32)
    large, y = _batch("resnet", 0)
    _, first = wrapped.plan_for(large)
    _, second = wrapped.plan_for(small)
    large_loss = nn.functional.cross_entropy(wrapped(large), y)
    assert first.tier.kept and not second.tier.kept
    small_loss = nn.functional.cross_entropy(wrapped(small), y[:2])
    assert second.tier.kept and not first.tier.kept
    (large_loss + small_loss).backward()      # the first plan's backward fetches again,
    assert not first.tier.kept and not second.tier.kept    # keeping nothing


def test_frozen_state_written_without_a_version_reaches_the_next_step():
    """An EMA teacher (DINO, BYOL) updates its frozen weights through .data, which counts no
    version: a resident copy kept across steps would serve the old weights (Rule 7)."""
    def run(model, call):
        frozen = [p for p in model.parameters() if not p.requires_grad]
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for step in range(3):
            x, y = _batch("resnet", step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(call(x), y).backward()
            optimizer.step()
            for parameter in frozen:
                parameter.data.mul_(0.5).add_(0.25)

    plain, model = _model(), _model()
    run(plain, plain)
    wrapped = sn.wrap(model, budget=_budget("resnet", 1.5), state="host", device="cpu")
    run(model, wrapped)
    assert "stem.0.weight" in wrapped.plan_for(_batch("resnet", 0)[0])[0].resident_state
    _same(plain, model)
