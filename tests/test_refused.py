"""Ways of training that a captured graph cannot reproduce bit for bit are refused before the
first step, saying what to change (capture/refused.py); the ways next to them still train bit
for bit."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointFunction, checkpoint

import superneurons as sn
from equality import assert_same_training, train


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(checkpoint(self.block, self.a(x), use_reentrant=self.reentrant))


X, Y = torch.randn(4, 8), torch.randint(0, 2, (4,))


def test_a_reentrant_checkpoint_in_the_forward_is_refused_and_the_patch_undone():
    """Rule 2: its part would run under no_grad in the captured graph; before, the wrapped
    step's output had no gradient and backward raised deep in autograd."""
    apply = CheckpointFunction.apply
    with pytest.raises(ValueError, match="use_reentrant=True"):
        sn.wrap(Checkpointed(reentrant=True), policy="recompute")(X)
    assert CheckpointFunction.apply == apply
    losses = train(Checkpointed(reentrant=True), X, Y, 3, loss_fn=F.cross_entropy)
    assert torch.isfinite(torch.stack(losses)).all()    # plain PyTorch's reentrant one works


@pytest.mark.parametrize("policy", ["recompute", "superneurons"])
def test_a_non_reentrant_checkpoint_in_the_forward_trains_bit_for_bit(policy):
    assert_same_training(Checkpointed(reentrant=False), X, Y, loss_fn=F.cross_entropy,
                         policy=policy)


def test_a_compiled_submodule_is_refused():
    """Rule 1: inductor's kernels and random numbers are not the module's Python's (refused
    before anything compiles: torch.compile is lazy)."""
    model = Checkpointed(reentrant=False)
    model.block = torch.compile(model.block)
    with pytest.raises(ValueError, match="block of Checkpointed is compiled"):
        sn.wrap(model, policy="recompute")(X)
    with pytest.raises(ValueError, match="the model is compiled.*_orig_mod"):
        sn.wrap(torch.compile(Checkpointed(reentrant=False)), policy="recompute")(X)


def test_hf_gradient_checkpointing_is_refused_naming_how_to_turn_it_off():
    """Rule 2, before HF's hook on the input embeddings would be named instead."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        sn.wrap(model, policy="recompute")(input_ids=ids, labels=ids)


@dataclasses.dataclass
class TwoHeads:
    left: torch.Tensor
    right: torch.Tensor


class Forked(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x):
        return TwoHeads(self.left(x), self.right(x))


def test_an_unregistered_output_class_is_named_with_the_fix():
    with pytest.raises(ValueError, match=r"register_dataclass\(TwoHeads\)") as error:
        sn.wrap(Forked(), policy="recompute")(X)
    assert "these arguments" not in str(error.value)      # the call was not the problem


class Keyed(nn.Module):
    """The model's own bug: a list as a dictionary key, a TypeError inside its forward."""

    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(8, 2), {(8,): 1.0}

    def forward(self, x):
        return self.fc(x) * self.scale[list(x.shape[1:])]


def test_the_models_own_unhashable_key_is_not_taken_for_its_output_class():
    with pytest.raises(ValueError) as error:
        sn.plan(Keyed(), X)
    assert "register_dataclass" not in str(error.value)


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)
        return self.head(out)


def test_a_packed_sequence_is_refused_as_a_value_read_not_as_the_callers_arguments():
    with pytest.raises(ValueError, match="PackedSequence") as error:
        sn.wrap(PackedLSTM(), policy="recompute")(torch.randn(3, 5, 4), torch.tensor([5, 3, 2]))
    assert "these arguments" not in str(error.value) and "model.lstm" in str(error.value)


class HeldGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.noise = nn.Linear(8, 2), torch.Generator().manual_seed(0)

    def forward(self, x):
        return self.fc(x + torch.rand(x.shape, generator=self.noise))


def test_a_held_generator_is_named_with_what_to_draw_from_instead():
    with pytest.raises(ValueError, match=r"torch.Generator it holds \(noise\).*manual_seed"):
        sn.plan(HeldGenerator(), X)


def _t5():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).train()
    ids, labels = torch.randint(1, 64, (2, 16)), torch.randint(1, 64, (2, 8))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, -4:] = 0                          # padding: the mask is passed as it is
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels,
                   "use_cache": False}


def test_t5_under_autocast_is_refused_and_trains_bit_for_bit_without_it():
    """Rule 3: under CPU bf16 autocast its relative attention bias's gradient differed."""
    model, kwargs = _t5()
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(ValueError, match="T5 family"):
        sn.wrap(model, policy="recompute")(**kwargs)
    plain, _ = _t5()
    torch.manual_seed(1)
    plain(**kwargs).loss.backward()
    wrapped_model, _ = _t5()
    torch.manual_seed(1)
    sn.wrap(wrapped_model, policy="recompute")(**kwargs).loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(),
                                                           wrapped_model.parameters()))


def test_the_t5_refusal_is_still_needed(monkeypatch):
    """What Rule 3 refuses: captured anyway, T5 under CPU bf16 autocast gets another gradient
    than plain PyTorch's. Should this fail, capture takes T5's eager path: lift the refusal."""
    from superneurons.capture import entry
    monkeypatch.setattr(entry, "refuse_under_autocast", lambda model, autocast: None)
    grads = []
    for wrapped in (False, True):
        model, kwargs = _t5()
        run = sn.wrap(model, policy="recompute") if wrapped else model
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(**kwargs).loss
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert not all(torch.equal(a, b) for a, b in zip(*grads))


def test_hf_output_recording_hooks_left_by_a_first_call_are_not_refused():
    """transformers installs hooks that record router logits at a model's first call and keeps
    them; they only hand outputs to the model's return value, so a model called before (or
    captured before: a second input shape) still trains, bit for bit."""
    import copy
    pytest.importorskip("transformers")
    from today_models import tiny_hf_mixtral
    base, kwargs = tiny_hf_mixtral()
    base(**kwargs)                                       # its hooks are installed now
    losses, models = [], []
    for wrapped in (False, True):
        model = copy.deepcopy(base)
        models.append(model)
        run = sn.wrap(model, policy="recompute") if wrapped else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            loss = run(**kwargs).loss                       # its router loss included
            loss.backward()
            optimizer.step()
        losses.append(loss.detach())
    assert torch.equal(*losses)
    assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(),
                                                 models[1].state_dict().values()))
