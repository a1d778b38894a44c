"""HF models take another attention path when exported than when called (capture/hf.py): the
wrapped model must take the one plain PyTorch takes, so that bf16 gradients of grouped-query
attention match bit for bit, for every kind of mask and positions a training loop passes."""

import pytest
import torch

import superneurons as sn

transformers = pytest.importorskip("transformers")

SEQ = 16


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    config.use_cache = False
    return transformers.LlamaForCausalLM(config).train()


def _calls():
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(2, SEQ, dtype=torch.long)
    padded[1, -5:] = 0
    packed = torch.cat([torch.arange(6), torch.arange(SEQ - 6)]).expand(2, -1)
    return {
        "no mask": dict(input_ids=ids, labels=ids),
        "mask of ones": dict(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)),
        "padded mask": dict(input_ids=ids, labels=ids, attention_mask=padded),
        "positions": dict(input_ids=ids, labels=ids, position_ids=torch.arange(SEQ)[None]),
        "packed positions": dict(input_ids=ids, labels=ids, position_ids=packed),
    }


def _train(wrap, kwargs: dict, steps: int = 2):
    model = _llama()
    run = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        torch.manual_seed(10 + step)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(**kwargs).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.detach())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(plain, wrapped):
    assert all(torch.equal(a, b) for a, b in zip(plain[0], wrapped[0])), "losses differ"
    for part, what in ((1, "gradient"), (2, "parameter")):
        differing = [n for n in plain[part] if not torch.equal(plain[part][n], wrapped[part][n])]
        assert not differing, f"{what}s differ from plain PyTorch: {differing[:4]}"


@pytest.mark.parametrize("call", list(_calls()))
def test_bf16_gqa_matches_plain(call):
    kwargs = _calls()[call]
    plain = _train(lambda m: m, kwargs)
    _assert_same(plain, _train(lambda m: sn.wrap(m, policy="recompute", budget=None), kwargs))
    _assert_same(plain, _train(lambda m: sn.wrap(m, policy="liveness", budget=None,
                                                 state="host", device="cpu"), kwargs))


def test_masks_of_ones_and_padding_get_their_own_plans():
    """A mask of ones is no mask (one plan with the mask-free call); a padded mask is another."""
    model = sn.wrap(_llama(), policy="recompute", budget=None)
    calls = _calls()
    for name, plans in (("no mask", 1), ("mask of ones", 1), ("padded mask", 2)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**calls[name]).loss.backward()
        assert len(model._executors) == plans, name
