"""capture/sliced_loss.py: a cross-entropy's backward over slices of rows gives plain PyTorch's
bits, lowers the layer's working set from three logits' bytes to two, and runs the original
operation wherever its Rule 2 does not hold."""

import copy

import pytest
import torch
import torch.nn.functional as F

import superneurons as sn
from superneurons.capture import sliced_loss
from superneurons.capture.sliced_loss import (sliced_cast_cross_entropy_loss,
                                              sliced_cross_entropy, sliced_cross_entropy_loss)

transformers = pytest.importorskip("transformers")


def _logits(rows: int, classes: int, device, dtype=torch.float32, ignore_index=-100):
    generator = torch.Generator().manual_seed(rows + classes)
    logits = (4 * torch.randn(rows, classes, generator=generator)).to(device, dtype)
    target = torch.randint(0, classes, (rows,), generator=generator).to(device)
    target[::7] = ignore_index                                   # ignored rows
    return logits.requires_grad_(), target


@pytest.mark.parametrize("rows, classes", [(300, 1001), (256, 64), (131, 50)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_sliced_loss_gives_plain_bits(rows, classes, reduction, ignore_index, device):
    """Odd class counts put rows at every alignment; 300 rows leave a short last slice. An
    ignore_index of 0 moves the forward's gathered column (Rule 1)."""
    logits, target = _logits(rows, classes, device, ignore_index=ignore_index)
    plain = F.cross_entropy(logits, target, reduction=reduction, ignore_index=ignore_index)
    (plain_grad,) = torch.autograd.grad(plain, logits)
    ours = sliced_cross_entropy(logits, target, reduction=reduction, ignore_index=ignore_index)
    assert type(ours.grad_fn).__name__ == "_SlicedCrossEntropyBackward"
    (our_grad,) = torch.autograd.grad(ours, logits)
    assert torch.equal(plain, ours) and torch.equal(plain_grad, our_grad)
    aten = sliced_cross_entropy_loss(logits, target, None, {"mean": 1, "sum": 2}[reduction],
                                     ignore_index)
    assert torch.equal(plain, aten)


@pytest.mark.parametrize("slice_bytes, slices", [(None, 16), (100 * 1001 * 4, 16),
                                                 (30 * 1001 * 4, 32), (1, 32)])
def test_slices_are_bounded_by_bytes_and_keep_plain_bits(slice_bytes, slices, device,
                                                         monkeypatch):
    """A slice is at most SLICE_BYTES of float32 rows, rounded up to ROW_ALIGNMENT rows; 2,048
    rows make 16 slices of 128 rows by count alone."""
    if slice_bytes is not None:
        monkeypatch.setattr(sliced_loss, "SLICE_BYTES", slice_bytes)
    logits, target = _logits(2048, 1001, device, torch.bfloat16)
    assert len(sliced_loss._slices(logits)) == slices
    plain = F.cross_entropy(logits.float(), target)
    ours = sliced_cast_cross_entropy_loss(logits, [-1, 1001], target)
    (plain_grad,), (our_grad,) = (torch.autograd.grad(loss, logits) for loss in (plain, ours))
    assert torch.equal(plain, ours) and torch.equal(plain_grad, our_grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_a_cast_for_the_loss_alone_is_made_per_slice(dtype, ignore_index, device):
    """Rule 5: a cross-entropy of logits.float().view(-1, classes) takes the logits as they
    are; their gradient comes back in their dtype, to the bit, under autocast or not."""
    logits, target = _logits(300, 1001, device, dtype, ignore_index)
    logits = logits.detach().view(3, 100, 1001).requires_grad_()
    for autocast in (False, True):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            plain = F.cross_entropy(logits.float().view(-1, 1001), target,
                                    ignore_index=ignore_index)
            ours = sliced_cast_cross_entropy_loss(logits, [-1, 1001], target, None, 1,
                                                  ignore_index)
        assert type(ours.grad_fn).__name__ == "_SlicedCrossEntropyBackward"
        (plain_grad,), (our_grad,) = (torch.autograd.grad(loss, logits) for loss in (plain, ours))
        assert our_grad.dtype == dtype
        assert torch.equal(plain, ours) and torch.equal(plain_grad, our_grad)


@pytest.mark.parametrize("case", ["label smoothing", "class weights", "bf16", "3-d", "few rows",
                                  "no reduction", "float targets", "transposed", "empty",
                                  "byte targets", "targets not one per row"])
def test_other_calls_run_the_original_operation(case):
    logits, target = _logits(256, 10, "cpu")
    kwargs = {}
    if case == "label smoothing":
        kwargs["label_smoothing"] = 0.1
    elif case == "class weights":
        kwargs["weight"] = torch.rand(10)
    elif case == "bf16":
        logits = logits.detach().bfloat16().requires_grad_()
    elif case == "3-d":
        logits = logits.detach().reshape(2, 10, 128).requires_grad_()
        target = target.reshape(2, 128).clamp(min=0)
    elif case == "few rows":
        logits, target = logits[:64], target[:64]                 # one slice
    elif case == "no reduction":
        kwargs["reduction"] = "none"
    elif case == "transposed":
        logits = logits.detach().t().contiguous().t().requires_grad_()
    elif case == "empty":
        logits, target = logits[:0], target[:0]
    elif case == "byte targets":
        target = target.clamp(min=0).to(torch.uint8)
    elif case == "targets not one per row":
        target = target[:-1]
    else:
        target = F.softmax(torch.randn(256, 10), dim=1)
    if case == "targets not one per row":            # plain PyTorch's own error
        with pytest.raises(ValueError, match="batch_size") as plain:
            F.cross_entropy(logits, target)
        with pytest.raises(ValueError, match="batch_size") as ours:
            sliced_cross_entropy(logits, target)
        assert str(ours.value) == str(plain.value)
        return
    ours = sliced_cross_entropy(logits, target, **kwargs)
    assert type(ours.grad_fn).__name__ != "_SlicedCrossEntropyBackward"
    torch.testing.assert_close(ours, F.cross_entropy(logits, target, **kwargs), rtol=0, atol=0,
                               equal_nan=True)                    # the empty batch's NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_under_autocast_are_cast_as_autocast_casts(dtype, device):
    """The CPU's autocast runs a cross-entropy in float32: the sliced form casts half-precision
    logits as it does, and their gradient comes back in their dtype, to the bit. CUDA's runs
    the log-softmax in half precision (autocast.py Rule 4): the original operation runs."""
    results = []
    for loss_of in (F.cross_entropy, sliced_cross_entropy):
        logits, target = _logits(300, 1001, device, dtype)
        with torch.autocast(device, dtype=dtype):
            loss = loss_of(logits, target)
        (grad,) = torch.autograd.grad(loss, logits)
        results.append((loss, grad, type(loss.grad_fn).__name__))
    (plain, plain_grad, _), (ours, our_grad, ours_fn) = results
    sliced = ours_fn == "_SlicedCrossEntropyBackward"
    assert sliced == (device == "cpu") and our_grad.dtype == dtype
    assert torch.equal(plain, ours) and torch.equal(plain_grad, our_grad)
    logits, target = _logits(300, 1001, device, dtype)                  # no autocast: as it is
    assert type(sliced_cross_entropy(logits, target).grad_fn).__name__ != \
        "_SlicedCrossEntropyBackward"


def _opt():
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                                    ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32,
                                    max_position_embeddings=128)             # dropout 0.1
    config.use_cache = False
    return transformers.OPTForCausalLM(config).train()


# transformers 5.17's OPT makes its own mask of ones and branches on its values
# (masking_utils._ignore_causal_mask_sdpa), which export cannot capture: superneurons refuses
# it with a ValueError there (seen on the device machine); 5.24's does not
OLD_OPT = tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 24)


@pytest.mark.skipif(OLD_OPT, reason="transformers < 5.24: OPT's forward branches on its mask")
@pytest.mark.parametrize("bf16", [False, True])
def test_a_decoder_no_other_test_trains_matches_plain_within_a_budget(bf16, monkeypatch):
    """HF OPT, sliced, under a budget between the floor and liveness (the planner's trim,
    weighed by the machine's rates), 3 AdamW steps bit for bit."""
    ran = []
    run_sliced = sliced_loss._run
    monkeypatch.setattr(sliced_loss, "_run", lambda *args: ran.append(1) or run_sliced(*args))
    call = dict(input_ids=_tokens()["input_ids"], labels=_tokens()["labels"])
    def planned(policy):           # as the wrapper plans the step, under the step's autocast
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            wrapped = sn.wrap(_opt(), policy=policy, slice_loss=True)
            return wrapped.plan_for(**call)[0].peak_bytes
    floor, liveness = planned("superneurons"), planned("liveness")
    budget = (floor + liveness) // 2
    plain = _train(_opt, call, lambda m: m, "cpu", bf16)
    ours = _train(_opt, call, lambda m: sn.wrap(m, policy="superneurons", budget=budget,
                                                 slice_loss=True), "cpu", bf16)
    assert ran and all(torch.equal(a, b) for a, b in zip(plain, ours))


def test_a_backward_that_builds_a_graph_says_to_turn_slicing_off():
    """Rule 3, by default; with slice_loss=False a gradient penalty through the wrapped model's
    loss is plain PyTorch's."""
    logits, target = _logits(256, 33, "cpu")
    (grad,) = torch.autograd.grad(sliced_cross_entropy(logits, target), logits)     # one: fine
    with pytest.raises(RuntimeError, match="slice_loss=False"):
        torch.autograd.grad(sliced_cross_entropy(logits, target), logits, create_graph=True)
    def penalized(run, model):
        embeddings = model.transformer.wte.weight
        loss = run(**_tokens()).loss
        (grad,) = torch.autograd.grad(loss, embeddings, create_graph=True)
        (loss + grad.pow(2).sum()).backward()
        return [p.grad for p in model.parameters()]
    model = _gpt2()
    with pytest.raises(RuntimeError, match="slice_loss=False"):
        penalized(sn.wrap(model, policy="superneurons"), model)
    results = []
    for wrap in (lambda m: m, lambda m: sn.wrap(m, policy="superneurons", slice_loss=False)):
        model = _gpt2()
        results.append(penalized(wrap(model), model))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_logits_written_in_place_after_the_loss_say_to_turn_slicing_off():
    """Rule 3: plain PyTorch keeps the log-softmax, so its backward runs; ours says why not."""
    logits, target = _logits(256, 33, "cpu")
    loss = sliced_cross_entropy(logits * 1, target)
    with torch.no_grad():
        logits.mul_(2)                   # the leaf is not what the loss saved: no error
    loss.backward()
    scaled = logits.detach().requires_grad_() * 1
    loss = sliced_cross_entropy(scaled, target)
    scaled.add_(1)
    with pytest.raises(RuntimeError, match="written in place after the loss.*slice_loss=False"):
        loss.backward()


def _gpt2(vocab=1000):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=128, n_embd=32, n_layer=2,
                                     n_head=4)                        # dropout 0.1: random
    return transformers.GPT2LMHeadModel(config).train()


def _tokens(vocab=1000, batch=2, seq=128):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(3))
    return dict(input_ids=ids, labels=ids, use_cache=False)


def test_the_loss_layer_holds_two_logits_not_three():
    kwargs = _tokens()
    plan = sn.plan(_gpt2(), (), "superneurons", kwargs=kwargs, device_type="cpu",
                   slice_loss=True)
    logits_bytes, slice_bytes = 2 * 128 * 1000 * 4, sliced_loss.ROW_ALIGNMENT * 1000 * 4
    loss = next(layer for layer in plan.graph.layers if "cross_entropy" in layer.name)
    assert loss.node.target is sliced_cross_entropy_loss
    # the logits, their gradient and a slice's two temporaries (256 rows: slices of 64)
    assert plan.costs.backward[loss.index] < 2 * logits_bytes + 2 * slice_bytes + 4096
    original = sn.plan(_gpt2(), (), "superneurons", kwargs=kwargs, device_type="cpu",
                       slice_loss=False)
    layer = next(layer for layer in original.graph.layers if "cross_entropy" in layer.name)
    assert original.costs.backward[layer.index] > 2.9 * logits_bytes
    assert plan.peak_bytes < original.peak_bytes


def test_half_logits_cast_for_the_loss_are_never_whole_in_float32():
    """Rule 5 in a model kept in bf16 (no autocast): the layer holds the bf16 logits and their
    bf16 gradient, and slices' float32 temporaries, not a float32 copy of the logits."""
    kwargs = _tokens()
    logits_bytes, slice_bytes = 2 * 128 * 1000 * 2, sliced_loss.ROW_ALIGNMENT * 1000 * 4
    plans = {sliced: sn.plan(_gpt2().to(torch.bfloat16), (), "superneurons", kwargs=kwargs,
                             device_type="cpu", slice_loss=sliced) for sliced in (True, False)}
    loss = next(layer for layer in plans[True].graph.layers if "cross_entropy" in layer.name)
    assert loss.node.target is sliced_cast_cross_entropy_loss
    assert plans[True].costs.forward[loss.index] < logits_bytes + 2 * slice_bytes + 8192
    assert plans[True].costs.backward[loss.index] < 2 * logits_bytes + 3 * slice_bytes + 8192
    assert plans[True].peak_bytes < plans[False].peak_bytes - 2 * logits_bytes


class _ReadsItsCastTwice(torch.nn.Module):
    """bf16 logits cast to float32 for the loss, the cast (or its view) also returned."""

    def __init__(self, returns: str):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
        self.returns = returns

    def forward(self, ids, labels):
        cast = self.head(self.embed(ids)).float()
        flat = cast.view(-1, 50)
        loss = F.cross_entropy(flat, labels.view(-1))
        return loss, cast if self.returns == "cast" else flat


@pytest.mark.parametrize("returns", ["cast", "view"])
def test_a_cast_read_besides_the_loss_stays_whole(returns):
    """Rule 5 takes a cast only the loss reads: one the model also returns is left as it is."""
    ids = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(0))
    plan = sn.plan(_ReadsItsCastTwice(returns).to(torch.bfloat16), (ids, ids), "superneurons",
                   device_type="cpu")
    targets = [layer.node.target for layer in plan.graph.layers]
    assert sliced_cross_entropy_loss in targets
    assert sliced_cast_cross_entropy_loss not in targets


class _CastsForItsLossAlone(torch.nn.Module):
    """fp32 weights, logits cast to float32 for the loss alone, which is all it returns."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)

    def forward(self, ids, labels):
        return F.cross_entropy(self.head(self.embed(ids)).float().view(-1, 50), labels.view(-1))


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_plan_on_the_meta_device_slices_the_cast_as_the_step_under_autocast_does(device_type):
    """Rule 5 in sn.plan on the meta device, where no autocast acts (capture/entry.py traces it
    under the CPU's): the float32 cast of a matrix product's logits is sliced in the plan as
    in the step captured under a real autocast (the CPU's here), and each step is planned as
    that one."""
    from superneurons.capture import capture
    ids = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(0))
    planned = sn.plan(_CastsForItsLossAlone(), (ids.to("meta"), ids.to("meta")), "liveness",
                      autocast=torch.bfloat16, device_type=device_type)
    targets = [layer.node.target for layer in planned.graph.layers]
    assert sliced_cast_cross_entropy_loss in targets
    if device_type == "cpu":
        state = ("cpu", torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            real = capture(_CastsForItsLossAlone(), (ids, ids), state)
        ran = sn.planner.plan_graph(real, "liveness")
        assert [s.live_bytes for s in planned.steps] == [s.live_bytes for s in ran.steps]
    unsliced = sn.plan(_CastsForItsLossAlone(), (ids.to("meta"), ids.to("meta")), "liveness",
                       autocast=torch.bfloat16, device_type=device_type, slice_loss=False)
    assert planned.peak_bytes < unsliced.peak_bytes


def test_a_decoder_kept_in_bf16_trains_as_plain_pytorch_within_a_budget():
    """Rule 5 in training: HF GPT-2 with bf16 weights, its loss on logits.float(), 3 AdamW
    steps at a budget between superneurons' floor and the liveness peak, bit for bit."""
    call = _tokens()
    build = lambda: _gpt2().to(torch.bfloat16)                       # noqa: E731
    floor, liveness = (sn.plan(build(), (), policy, kwargs=call, device_type="cpu").peak_bytes
                       for policy in ("superneurons", "liveness"))
    plain = _train(build, call, lambda m: m, "cpu", False)
    wrapped = {}

    def wrap(model):
        wrapped["module"] = sn.wrap(model, policy="superneurons", budget=(floor + liveness) // 2)
        return wrapped["module"]
    ours = _train(build, call, wrap, "cpu", False)
    plan = wrapped["module"]._last[0]
    assert any(layer.node.target is sliced_cast_cross_entropy_loss for layer in plan.graph.layers)
    assert plan.num_extra_computations > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, ours))


def _nanogpt(dropout=0.1):
    """dropout 0 is nanoGPT's default: its attention then runs the fused kernel whose output's
    layout on the device differs from the meta one's (capture/aten.py, with_traced_layout)."""
    from nanogpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=128, vocab_size=1000, n_layer=2, n_head=2, n_embd=32,
                         dropout=dropout)).train()


def _nanogpt_call():
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(3))
    targets = ids.clone()
    targets[:, :5] = -1                                # nanoGPT's ignore_index
    return dict(idx=ids, targets=targets)


def _train(build, call, wrap, device, bf16: bool, steps: int = 3):
    model = build().to(device)
    call = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    run = wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        torch.manual_seed(10 + step)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            out = run(**call)
        loss = out.loss if hasattr(out, "loss") else out[1]
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().cpu())
    return losses + [p.detach().cpu() for p in model.parameters()] + \
        [p.grad.cpu() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["superneurons", "recompute", "offload"])
@pytest.mark.parametrize("model", ["hf gpt2", "nanogpt", "nanogpt without dropout"])
@pytest.mark.parametrize("bf16", [False, True])
def test_decoders_train_as_plain_pytorch(model, policy, bf16, device, monkeypatch):
    """3 AdamW steps (with dropout, and nanoGPT without too), the loss layer sliced, against
    plain PyTorch bit for bit.
    HF upcasts its logits for the loss; nanoGPT's are bf16 under autocast, which the CPU's
    autocast casts for the loss as the sliced form does, and CUDA's does not (Rule 2: the
    original operation runs there)."""
    sliced_runs = []
    run_sliced = sliced_loss._run
    monkeypatch.setattr(sliced_loss, "_run",
                        lambda *args: sliced_runs.append(1) or run_sliced(*args))
    build, call = {"hf gpt2": (_gpt2, _tokens()), "nanogpt": (_nanogpt, _nanogpt_call()),
                   "nanogpt without dropout": (lambda: _nanogpt(0.0), _nanogpt_call())}[model]
    plain = _train(build, call, lambda m: m, device, bf16)
    wrapped = {}

    def wrap(m):
        wrapped["module"] = sn.wrap(m, policy=policy)                   # sliced by default
        return wrapped["module"]
    ours = _train(build, copy.deepcopy(call), wrap, device, bf16)
    plan = wrapped["module"]._last[0]                        # the plan the steps ran
    losses = [layer.node.target for layer in plan.graph.layers
              if layer.node.target in sliced_loss.SLICED_LOSSES]
    # Rule 5: HF's float32 copy of its bf16 logits is made per slice, never whole
    cast = model == "hf gpt2" and bf16
    assert losses == [sliced_cast_cross_entropy_loss if cast else losses[0]]
    assert bool(sliced_runs) == (model == "hf gpt2" or not bf16 or device == "cpu")
    assert all(torch.equal(a, b) for a, b in zip(plain, ours))
