"""planner/gradients.py Rule 5 and runtime/outside.py: where the model's loss is among its
outputs, the plan counts backward from the loss alone (no second logits-sized gradient), and a
gradient that does reach such an output from outside is seen, warned about and planned for."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.planner.gradients import gradient_buffers, outputs_behind_a_loss
from superneurons.planner.plan import plan_graph

VOCAB, WIDTH, BATCH, TOKENS = 512, 16, 2, 64


class TinyLM(nn.Module):
    """A language model's shape: logits far larger than anything else, the loss inside when
    labels are given, both returned (as HF's causal LMs and nanoGPT return them)."""

    def __init__(self, upcast: bool = False):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)
        self.upcast = upcast

    def forward(self, ids, labels=None):
        logits = self.head(torch.tanh(self.embed(ids)))
        if labels is None:
            return logits
        scored = logits.float() if self.upcast else logits    # HF's loss upcasts, fp32 or not
        loss = F.cross_entropy(scored.view(-1, VOCAB), labels.view(-1))
        return logits, loss


def _batch():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator)
    return ids, torch.roll(ids, -1, 1)


def _plan(model, outside: bool = False, **call):
    """The liveness plan of a step given labels; ``outside``: its graph then marked as having
    seen an outside gradient (for plans made from it again)."""
    ids, labels = _batch()
    plan = sn.plan(model, (ids,), "liveness", kwargs=dict(labels=labels, **call),
                   device_type="cpu", slice_loss=False)
    if outside:
        plan.graph.outside_gradients = True
    return plan


def _logits_gradients_at_backward_start(plan) -> list:
    graph, timeline = plan.graph, plan.timeline
    logits = {v for v in graph.output_values if graph.values[v].shape == (BATCH, TOKENS, VOCAB)}
    return [b for b in gradient_buffers(graph, timeline)
            if b[0] in logits and b[1] == timeline.num_layers]


def test_the_logits_beside_a_loss_get_no_outside_gradient_unless_one_was_seen():
    plan = _plan(TinyLM())
    (logits,) = outputs_behind_a_loss(plan.graph)
    assert plan.graph.values[logits].shape == (BATCH, TOKENS, VOCAB)
    assert _logits_gradients_at_backward_start(plan) == []
    assert len(_logits_gradients_at_backward_start(_plan(TinyLM(), outside=True))) == 1
    # without labels the logits are the only output: the caller's loss sends their gradient
    ids, _ = _batch()
    alone = sn.plan(TinyLM(), (ids,), "liveness", device_type="cpu")
    assert outputs_behind_a_loss(alone.graph) == frozenset()


def test_the_plan_of_a_loss_and_its_logits_holds_one_logits_gradient_not_two():
    logits_bytes = BATCH * TOKENS * VOCAB * 4
    loss_only, outside = _plan(TinyLM()), _plan(TinyLM(), outside=True)
    assert plan_graph(outside.graph, "liveness").peak_bytes - loss_only.peak_bytes == \
        logits_bytes


def test_a_cast_to_its_own_dtype_hands_the_gradient_on():
    """HF's loss calls logits.float() on float32 logits: its backward returns the gradient
    itself, so the plan makes the gradient buffers it makes without the cast."""
    def logits_sized(plan):
        graph = plan.graph
        return sorted((first, last) for value, first, last, nbytes in
                      gradient_buffers(graph, plan.timeline)
                      if (nbytes or graph.values[value].nbytes) == BATCH * TOKENS * VOCAB * 4)
    upcast, plain = logits_sized(_plan(TinyLM(upcast=True))), logits_sized(_plan(TinyLM()))
    assert len(upcast) == len(plain) == 1
    # one layer more in the route: the cast's, through which the one buffer lives on
    assert upcast[0][1] - upcast[0][0] == plain[0][1] - plain[0][0] + 1


def _train(model, steps: int, outside_loss: bool, in_place: bool = False):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids, labels = _batch()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        logits, loss = model(ids, labels=labels)
        if in_place:
            logits /= 2.0                # a temperature, in place on the returned logits
        if outside_loss:                 # a distillation term on the logits beside the loss
            loss = loss + 0.1 * logits.float().square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _pair(policy, **options):
    torch.manual_seed(0)
    model = TinyLM()
    plain, managed = copy.deepcopy(model), copy.deepcopy(model)
    return plain, managed, sn.wrap(managed, policy=policy, **options)


def _assert_same(plain, managed):
    for a, b in zip(plain.parameters(), managed.parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("policy", ["superneurons", "recompute", "offload"])
def test_a_loss_alone_trains_exactly_and_says_nothing(policy):
    plain, managed, wrapped = _pair(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # a decoder has no convolution for 'offload' to move, which it says (planner/plan.py)
        warnings.filterwarnings("ignore", "policy 'offload' moves convolution outputs")
        got = _train(wrapped, 3, outside_loss=False)
    assert torch.equal(_train(plain, 3, outside_loss=False), got)
    _assert_same(plain, managed)
    assert not wrapped.outside_gradients


@pytest.mark.parametrize("policy", ["superneurons", "recompute", "offload"])
@pytest.mark.parametrize("in_place", [False, True])
def test_an_outside_gradient_is_exact_said_once_and_planned_for(policy, in_place):
    """Seen in the first step's backward, said at the second step's forward (at the caller's
    line), and planned for from there; a temperature applied in place to the returned logits
    (autograd then routes the outside gradient through its copy) is seen too."""
    plain, managed, wrapped = _pair(policy, slice_loss=not in_place)
    with pytest.warns(UserWarning, match="from outside the model") as said:
        got = _train(wrapped, 3, outside_loss=True, in_place=in_place)
    ours = [w for w in said if "from outside the model" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__
    assert torch.equal(_train(plain, 3, outside_loss=True, in_place=in_place), got)
    _assert_same(plain, managed)
    assert wrapped.outside_gradients
    ids, labels = _batch()
    assert wrapped.plan_for(ids, labels=labels)[0].graph.outside_gradients


def test_the_returned_logits_are_plain_pytorchs():
    """The caller gets the output itself: its gradient can be asked for, retained and hooked,
    as in plain PyTorch."""
    seen = []
    plain, _, wrapped = _pair("superneurons")
    for model in (plain, wrapped):
        ids, labels = _batch()
        logits, loss = model(ids, labels=labels)
        logits.retain_grad()
        hooked = []
        logits.register_hook(hooked.append)
        (asked,) = torch.autograd.grad(loss, logits, retain_graph=True)
        loss.backward()
        seen.append((asked, logits.grad, len(hooked)))
    (asked, kept, hooks), (our_asked, our_kept, our_hooks) = seen
    assert torch.equal(asked, our_asked) and torch.equal(kept, our_kept)
    assert hooks == our_hooks == 2


def test_warnings_raised_as_errors_still_plan_for_it():
    plain, managed, wrapped = _pair("superneurons")
    ids, labels = _batch()
    logits, loss = wrapped(ids, labels=labels)
    (loss + logits.square().mean()).backward()          # hooks record, never raise
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="from outside the model"):
            wrapped(ids, labels=labels)
    assert wrapped.outside_gradients
    wrapped(ids, labels=labels)                          # planned for: said once


def test_plan_for_sees_it_and_a_dropped_plan_keeps_it():
    plain, managed, wrapped = _pair("superneurons")
    ids, labels = _batch()
    logits, loss = wrapped(ids, labels=labels)
    (loss + logits.square().mean()).backward()
    wrapped.replan()                                     # the plan that saw it is dropped
    with pytest.warns(UserWarning, match="from outside the model"):
        assert wrapped.plan_for(ids, labels=labels)[0].graph.outside_gradients


class ZLoss(TinyLM):
    """A z-loss of the logits among the outputs; the caller adds a cross-entropy of its own."""

    def forward(self, ids):
        logits = super().forward(ids)
        return logits, 1e-4 * torch.logsumexp(logits, -1).square().mean()


def test_a_scalar_made_without_a_loss_function_marks_nothing():
    ids, _ = _batch()
    plan = sn.plan(ZLoss(), (ids,), "liveness", device_type="cpu")
    assert outputs_behind_a_loss(plan.graph) == frozenset()


def test_under_ddp_finding_unused_parameters_the_loss_alone_trains(tmp_path):
    """DDP's find_unused_parameters hands None gradients to the outputs a loss did not use."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        plain, managed, wrapped = _pair("superneurons")
        ddp = DistributedDataParallel(wrapped, find_unused_parameters=True)
        expected = DistributedDataParallel(plain, find_unused_parameters=True)
        ids, labels = _batch()
        for model in (expected, ddp):
            model(ids, labels=labels)[1].backward()
        _assert_same(plain, managed)
        assert not wrapped.outside_gradients
    finally:
        dist.destroy_process_group()


class TwiceAndUpcast(TinyLM):
    """Returns the logits twice; its loss upcasts them (a cast to their own dtype: it returns
    its input) and adds a term read from the logits before that cast."""

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.embed(ids)))
        penalty = 1e-3 * logits.square().mean()           # reads the logits before the cast
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1))
        return logits, loss + penalty, logits


def test_layers_reading_an_output_before_its_cast_are_inside_and_twice_is_one_object():
    ids, labels = _batch()
    wrapped = sn.wrap(TwiceAndUpcast(), policy="superneurons")
    for _ in range(2):
        first, loss, second = wrapped(ids, labels=labels)
        assert first is second
        loss.backward()
    assert wrapped._last[1].outside.seen_bytes == 0 and not wrapped.outside_gradients


@pytest.mark.parametrize("write", ["no_grad", "detach"])
def test_a_write_autograd_does_not_record_is_no_outside_gradient(write):
    ids, labels = _batch()
    wrapped = sn.wrap(TinyLM(), policy="superneurons", slice_loss=False)
    logits, loss = wrapped(ids, labels=labels)
    if write == "no_grad":
        with torch.no_grad():
            logits[..., 0] = -1e4
    else:
        logits.detach().div_(2)
    loss.backward()
    assert wrapped._last[1].outside.seen_bytes == 0


def test_a_forward_that_raises_leaves_no_output_alive(monkeypatch):
    import gc
    import weakref
    from superneurons.runtime import executor
    ids, labels = _batch()
    wrapped = sn.wrap(TinyLM(), policy="superneurons")
    wrapped(ids, labels=labels)[1].backward()
    call, made = executor.Executor._call, []

    def raising_after_the_logits(self, layer, args, kwargs, trains=False):
        if made and made[-1][1]:
            made[-1] = (made[-1][0], False)
            raise ValueError("a layer after the logits failed")
        out = call(self, layer, args, kwargs, trains=trains)
        if isinstance(out, torch.Tensor) and out.shape == (BATCH, TOKENS, VOCAB):
            made.append((weakref.ref(out), True))
        return out
    monkeypatch.setattr(executor.Executor, "_call", raising_after_the_logits)
    with pytest.raises(ValueError, match="after the logits"):
        wrapped(ids, labels=labels)
    monkeypatch.setattr(executor.Executor, "_call", call)
    wrapped(ids, labels=labels)[1].backward()
    gc.collect()
    assert made and made[0][0]() is None


def test_outside_gradients_asked_for_plans_them_from_the_first_step():
    ids, labels = _batch()
    asked = sn.plan(TinyLM(), (ids,), "liveness", kwargs=dict(labels=labels),
                    device_type="cpu", slice_loss=False, outside_gradients=True)
    assert asked.peak_bytes - _plan(TinyLM()).peak_bytes == BATCH * TOKENS * VOCAB * 4
    plain, managed, wrapped = _pair("superneurons", outside_gradients=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # nothing to say: it was planned
        got = _train(wrapped, 3, outside_loss=True)
    assert torch.equal(_train(plain, 3, outside_loss=True), got)
    _assert_same(plain, managed)
    assert wrapped.plan_for(ids, labels=labels)[0].graph.outside_gradients
