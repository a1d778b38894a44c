"""Plans for steps under torch.autocast count the dtypes autocast gives (capture/autocast.py)."""

import pytest
import torch
from torch import nn

import superneurons as sn
from superneurons.capture import sliced_loss
from superneurons import models
from superneurons.capture import capture
from test_runtime_cases import Traps


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (device machine)")


def _real_output_dtypes(model, x) -> dict:
    """Each leaf module's output dtypes, in call order, in a real forward under autocast."""
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o: seen.setdefault(m, []).append(o.dtype))
             for m in model.modules() if not m._modules]
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x)
    for hook in hooks:
        hook.remove()
    return seen, out.dtype


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("build", [Traps, lambda: models.resnet(blocks=(1, 1, 1, 1), num_classes=5),
                                   lambda: models.densenet(16, 4, cifar=True, num_classes=5)])
def test_capture_has_the_dtypes_of_a_real_autocast_step(build, device):
    torch.manual_seed(0)
    model = build().to(device)
    x = torch.randn(2, 3, 8, 8) if isinstance(model, Traps) else torch.randn(2, 3, 32, 32)
    x = x.to(device)
    expected, expected_out = _real_output_dtypes(model, x)
    graph = capture(model, x, (device, torch.bfloat16))
    named = {name: m for name, m in model.named_modules()}
    got = {}
    for layer, after in zip(graph.layers, [*graph.layers[1:], None]):
        module = layer.module or named.get(layer.path)
        if module is not None and (after is None or after.path != layer.path):
            # a module's output is its last layer's (an exported module runs as operations)
            got.setdefault(module, []).extend(graph.values[v].dtype for v in layer.outputs)
    assert {n: got.get(m) for n, m in named.items() if m in expected} == \
        {n: expected[m] for n, m in named.items() if m in expected}
    assert graph.values[graph.output_values[0]].dtype == expected_out
    assert torch.bfloat16 in {v.dtype for v in graph.values}


def test_a_bf16_plan_holds_about_half_the_activations():
    with torch.device("meta"):
        model = models.build("resnet50")
    fp32 = sn.plan(model, (32, 3, 224, 224), policy="liveness")
    bf16 = sn.plan(model, (32, 3, 224, 224), policy="liveness", autocast=torch.bfloat16)
    activations = [p.peak_bytes - p.resident_bytes for p in (fp32, bf16)]
    assert 0.4 < activations[1] / activations[0] < 0.65


def test_cuda_autocast_keeps_log_softmax_in_float32():
    """CUDA's lists differ from the CPU's: log_softmax runs in float32 there."""
    model = nn.Sequential(nn.Linear(8, 4), nn.LogSoftmax(1))
    cuda = capture(model, (2, 8), ("cuda", torch.bfloat16))
    cpu = capture(model, (2, 8), ("cpu", torch.bfloat16))
    assert [cuda.values[v].dtype for v in cuda.output_values] == [torch.float32]
    assert [cpu.values[v].dtype for v in cpu.output_values] == [torch.bfloat16]


def _saved_by_cross_entropy(kind: str, call: str, device, **kwargs) -> list:
    """The dtypes of the logits-sized tensors a cross-entropy of bf16 logits saves for its backward,
    under autocast on ``kind``: real autocast where ``device`` is that kind, capture's
    AutocastOnMeta where it is "meta"."""
    from superneurons.capture.autocast import AutocastOnMeta
    logits = torch.randn(6, 5, device=device).bfloat16().requires_grad_()
    target = torch.tensor([0, 1, 2, 3, 4, -100], device=device)
    saved = []
    def pack(tensor):
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor
    loss_of = {"F": torch.nn.functional.cross_entropy,
               "aten": torch.ops.aten.cross_entropy_loss.default}[call]
    autocast = (AutocastOnMeta(kind, torch.bfloat16) if device == "meta"
                else torch.autocast(kind, dtype=torch.bfloat16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = loss_of(logits, target, **kwargs)
    return sorted(str(d) for d, shape in saved if shape == (6, 5)), loss.dtype


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("call", ["F", "aten"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_cross_entropy_is_planned_with_what_autocast_saves(kind, call, smoothing, weighted):
    """autocast.py Rule 4: the logits-sized tensors a bf16 cross-entropy saves, and its
    loss's dtype, are the real step's, on the CPU and on CUDA."""
    def kwargs(device):
        weight = {"weight": torch.linspace(0.5, 1.5, 5, device=device)} if weighted else {}
        return {**weight, **({"label_smoothing": smoothing} if smoothing else {})}
    assert _saved_by_cross_entropy(kind, call, "meta", **kwargs("meta")) == \
        _saved_by_cross_entropy(kind, call, kind, **kwargs(kind))


def test_cuda_autocast_plans_a_half_log_softmax_and_a_float32_copy():
    """What torch's CUDA lists give (no cross_entropy_loss in them; log_softmax called with a
    dtype; nll_loss in float32), checked on any machine."""
    saved, dtype = _saved_by_cross_entropy("cuda", "F", "meta")
    assert saved == ["torch.bfloat16", "torch.float32"] and dtype == torch.float32
    saved, _ = _saved_by_cross_entropy("cpu", "F", "meta")
    assert saved and set(saved) == {"torch.float32"}


@pytest.fixture
def traced_without_autocast(monkeypatch):
    """A meta capture traced under no autocast, as a model on a device whose autocast the
    plan does not name is (entry.py): where trace.py Rule 7 plans both readings of a cast."""
    from superneurons.capture import entry
    monkeypatch.setattr(entry, "_under_the_step_autocast",
                        lambda model, args, kwargs, autocast, device: None)


class _CastsItsLogits(nn.Module):
    """Returns its bf16 logits beside a loss computed from a float32 copy of them, as HF's
    causal LMs do (logits.float() in the loss): traced in float32, the copy is the logits."""

    def __init__(self, viewed: bool = False):
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)
        self.viewed = viewed

    def forward(self, ids, labels):
        logits = self.head(self.embed(ids))
        loss = nn.functional.cross_entropy(logits.float().view(-1, 50), labels.view(-1))
        return loss, logits.view(-1, 50) if self.viewed else logits


def test_a_meta_plan_slices_the_cast_the_loss_alone_reads_as_the_step_does():
    """entry.py: traced on the meta device under the CPU's autocast, the float32 copy
    HF-style logits are cast into for the loss alone is made per slice as in the step traced
    under a real autocast (sliced_loss.py Rule 5), and every policy plans each step as there."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 50, (4, 32)), torch.randint(0, 50, (4, 32))   # 128 rows
    for device_type in ("cpu", "cuda"):
        meta = capture(_CastsItsLogits(), (ids.to("meta"), labels.to("meta")),
                       (device_type, torch.bfloat16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            real = capture(_CastsItsLogits(), (ids, labels), (device_type, torch.bfloat16))
        assert not meta.cast_from
        for graph in (meta, real):
            assert any(layer.node.target is sliced_loss.sliced_cast_cross_entropy_loss
                       for layer in graph.layers)
        for policy in ("recompute", "superneurons", "liveness"):
            planned, ran = (sn.planner.plan_graph(graph, policy) for graph in (meta, real))
            assert [s.live_bytes for s in planned.steps] == [s.live_bytes for s in ran.steps]


def test_a_cast_the_loss_alone_reads_is_planned_above_the_step_where_the_trace_cannot_tell(
        traced_without_autocast):
    """sliced_loss.py Rule 5 with trace.py Rule 7: traced under a real autocast, the float32
    copy HF-style logits are cast into for the loss alone is made per slice (the layer takes
    the bf16 logits); traced under none, the cast may be what the model returns, so both
    stay, and every policy's plan there is at or above the real one."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 50, (4, 32)), torch.randint(0, 50, (4, 32))   # 128 rows
    meta = capture(_CastsItsLogits(), (ids.to("meta"), labels.to("meta")),
                   ("cpu", torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = capture(_CastsItsLogits(), (ids, labels), ("cpu", torch.bfloat16))
    def loss_of(graph):
        return next(layer.node.target for layer in graph.layers
                    if layer.node.target in sliced_loss.SLICED_LOSSES)
    assert loss_of(real) is sliced_loss.sliced_cast_cross_entropy_loss
    assert loss_of(meta) is sliced_loss.sliced_cross_entropy_loss
    for policy in ("recompute", "superneurons", "liveness"):
        planned, ran = (sn.planner.plan_graph(graph, policy) for graph in (meta, real))
        assert planned.peak_bytes >= ran.peak_bytes, policy
    bf16_logits = 4 * 32 * 50 * 2         # at least that much below: the copy is never whole
    assert sn.planner.plan_graph(meta, "liveness").peak_bytes >= \
        sn.planner.plan_graph(real, "liveness").peak_bytes + bf16_logits


class _ReturnsItsCast(nn.Module):
    """Returns a float32 cast of its bf16 logits, which nothing else reads (no loss), and then
    computes another output: the bf16 logits need not live past their cast."""

    def __init__(self, viewed: bool = False):
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)
        self.other = nn.Linear(16, 200)
        self.viewed = viewed

    def forward(self, ids, labels):
        hidden = self.embed(ids)
        logits = self.head(hidden).float()
        return logits.view(-1, 50) if self.viewed else logits, self.other(hidden)


def _meta_and_real(model, outside: bool = False, policy=sn.planner.Policy.LIVENESS) -> list:
    """The plans of ``model``'s graph traced on the meta device (as sn.plan traces it) and of the
    one traced from real CPU tensors under CPU autocast, where a cast is a tensor of its own."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))
    meta = capture(model, (ids.to("meta"), labels.to("meta")), ("cpu", torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = capture(model, (ids, labels), ("cpu", torch.bfloat16))
    plans = []
    for graph in (meta, real):
        graph.outside_gradients = outside
        plans.append(sn.planner.plan_graph(graph, policy, None,
                                           sn.planner.Strategy.COST_AWARE, "device",
                                           sn.planner.H200))
    return plans


@pytest.mark.parametrize("viewed", [False, True])
def test_a_cast_that_was_a_no_op_when_traced_keeps_what_it_cast(viewed, traced_without_autocast):
    """trace.py Rule 7: planned on the meta device (traced without autocast), the logits the
    model returns (or a view of them) stay outputs beside their float32 copy, and every step is
    planned as in the graph traced under a real autocast, where the two are different tensors."""
    meta, real = _meta_and_real(_CastsItsLogits(viewed))
    assert torch.bfloat16 in {meta.graph.values[v].dtype for v in meta.graph.output_values}
    planned = [(m.phase, m.live_bytes, r.live_bytes) for m, r in zip(meta.steps, real.steps)]
    if not viewed:
        assert all(m == r for _, m, r in planned)
    else:   # the returned view is traced as the float32 copy's: counted so, and above the step
        assert all(m >= r for phase, m, r in planned if phase == "forward")
        assert meta.peak_bytes >= real.peak_bytes
    ids = torch.randint(0, 50, (4, 8), device="meta")
    assert sn.plan(_CastsItsLogits(viewed), (ids, ids), "liveness", autocast=torch.bfloat16,
                   device_type="cpu").peak_bytes == meta.peak_bytes


class _ReturnsTheCastItsLossReads(nn.Module):
    """Returns the float32 cast of its logits, which cheap layers read on the way to the loss:
    the cast is the output here, where HF's is the loss's intermediate."""

    def __init__(self, viewed: bool = False):
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)
        self.viewed = viewed

    def forward(self, ids, labels):
        cast = self.head(self.embed(ids)).float()
        loss = nn.functional.cross_entropy((torch.tanh(cast) * 2).view(-1, 50), labels.view(-1))
        return loss, cast.view(-1, 50) if self.viewed else cast


def _hf_gpt2_meta_and_real():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16,
                                     vocab_size=128)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    call = {"input_ids": ids, "labels": ids, "use_cache": False}
    state = ("cpu", torch.bfloat16)
    meta = capture(model, (), state, {k: v.to("meta") if torch.is_tensor(v) else v
                                      for k, v in call.items()}, slice_loss=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = capture(model, (), state, dict(call), slice_loss=True)
    return meta, real


def _toy_meta_and_real(model):
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))
    meta = capture(model, (ids.to("meta"), labels.to("meta")), ("cpu", torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = capture(model, (ids, labels), ("cpu", torch.bfloat16))
    return meta, real


@pytest.mark.parametrize("shape", ["hf_gpt2", "returns_cast", "returns_cast_viewed"])
def test_no_policy_plans_a_step_below_either_reading_of_a_cast(shape, traced_without_autocast):
    """plan.py with trace.py Rule 7: a cast the trace could not tell from what it cast may be
    the step's intermediate (HF's float32 logits, which its loss reads: replayed from the bf16
    logits, which live into backward) or its output (kept). Either reading alone planned some
    step below the real one under "recompute" or "superneurons" (HF's first backward step by a
    bf16 logits; here a float32 one); both are planned and the one needing more is taken."""
    if shape == "hf_gpt2":
        meta, real = _hf_gpt2_meta_and_real()
    else:
        meta, real = _toy_meta_and_real(_ReturnsTheCastItsLossReads(shape.endswith("viewed")))
    assert meta.cast_from and not real.cast_from
    for policy in ("recompute", "superneurons", "offload", "liveness", "baseline"):
        planned, ran = (sn.planner.plan_graph(graph, policy).steps for graph in (meta, real))
        assert all(m.live_bytes >= r.live_bytes for m, r in zip(planned, ran)), policy


def test_a_meta_plan_of_hf_gpt2_under_autocast_is_the_steps():
    """entry.py: HF's GPT-2 returns its bf16 logits and casts a float32 copy for its loss;
    traced on the meta device under the CPU's autocast, every policy plans every step as in
    the graph traced from real tensors under a real autocast."""
    meta, real = _hf_gpt2_meta_and_real()
    assert not meta.cast_from
    for policy in ("recompute", "superneurons", "offload", "liveness", "baseline"):
        planned, ran = (sn.planner.plan_graph(graph, policy).steps for graph in (meta, real))
        assert [m.live_bytes for m in planned] == [r.live_bytes for r in ran], policy


def test_a_plan_made_again_from_its_own_graph_plans_both_readings_again(traced_without_autocast):
    """A plan's graph holds the reading it took; made again from it (module Rules 2 and 3
    plan the step again from plan.graph), both readings are planned again."""
    meta, _ = _hf_gpt2_meta_and_real()
    floor = sn.planner.plan_graph(meta, "superneurons").peak_bytes
    budgets = [floor + 4000 * k for k in range(16)]
    first = next(plan for plan in (sn.planner.plan_graph(meta, "superneurons", budget)
                                   for budget in budgets) if plan.graph.replays_casts)
    for budget in budgets:
        again = sn.planner.plan_graph(first.graph, "superneurons", budget)
        assert again.peak_bytes == sn.planner.plan_graph(meta, "superneurons", budget).peak_bytes


@pytest.mark.parametrize("viewed", [False, True])
def test_a_cast_the_model_returns_alone_is_its_only_output(viewed, traced_without_autocast):
    """Rule 7 leaves a cast that nothing but the output (or a view it returns) reads: it is
    what the model returns."""
    meta, real = _meta_and_real(_ReturnsItsCast(viewed))
    assert [s.live_bytes for s in meta.steps] == [s.live_bytes for s in real.steps]


def test_a_cast_and_what_it_cast_get_one_gradient_from_outside(traced_without_autocast):
    """gradients.py Rule 5 with trace.py Rule 7: of the float32 copy and the bf16 logits the
    model may return, the larger alone gets a gradient from outside. The real step gives one to
    the bf16 logits, so the meta plan is above it by the difference of the two alone."""
    meta, real = _meta_and_real(_CastsItsLogits(), outside=True)
    logits = 4 * 8 * 50
    assert meta.peak_bytes - real.peak_bytes in range(0, logits * (4 - 2) + 1)


class _Pair(nn.Module):
    def forward(self, x):
        return x + 1, x * 2


def test_a_leaf_that_returns_a_tuple_returns_both():
    """A torch.fx graph whose last leaf returns a tuple: both tensors are outputs."""
    graph = capture(nn.Sequential(nn.Linear(4, 4), _Pair()), torch.randn(2, 4))
    assert len(graph.output_values) == 2


def test_wrap_plans_again_when_the_autocast_state_changes():
    torch.manual_seed(0)
    wrapped = sn.wrap(Traps(), policy="superneurons")
    x = torch.randn(4, 3, 8, 8)
    wrapped(x).sum().backward()
    fp32 = wrapped.stats.predicted_peak_bytes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped(x).float().sum().backward()
    assert wrapped.stats.predicted_peak_bytes < fp32


def test_plan_refuses_an_autocast_that_is_not_a_low_precision_dtype():
    with pytest.raises(ValueError, match="bfloat16"):
        sn.plan(nn.Linear(2, 2), (1, 2), autocast="bf16")


def test_plan_refuses_a_device_type_whose_autocast_lists_it_does_not_know():
    with pytest.raises(ValueError, match="cuda and cpu"):
        sn.plan(nn.Linear(2, 2), (1, 2), autocast=torch.bfloat16, device_type="xla")
