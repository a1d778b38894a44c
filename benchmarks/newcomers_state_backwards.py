"""Models nobody here wrote, with their state in host memory (state="host"), under the ways users
call backward that are not one forward and one backward: two forwards summed into one loss, a
no_grad forward between a forward and its backward, and a backward that raises (a parameter
changed between forward and backward) followed by more training. Each beside plain PyTorch, then
3 AdamW steps, compared bit for bit (parameters, buffers, gradients). HF Qwen2ForCausalLM with
its embedding tied to its head (a parameter with two uses a forward) and timm regnetx_002 (batch
norms); "liveness" and "superneurons" halfway from the state="host" floor to the liveness peak.
Planner and runtime of whichever tree is on PYTHONPATH.

    PYTHONPATH=TREE:benchmarks python benchmarks/newcomers_state_backwards.py OUT_DIR
        (writes OUT_DIR/newcomers_state_backwards.json)
"""

import copy
import os
import sys

import torch
from torch import nn


def _qwen2():
    import transformers
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)

    def inputs(seed):
        ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))
        return (), dict(input_ids=ids, labels=ids, use_cache=False)

    def call(run, seed):
        args, kwargs = inputs(seed)
        return run(*args, **kwargs).loss

    def corrupt(model):             # read by the first block's backward, after the head's
        model.model.layers[0].self_attn.q_proj.weight.add_(0.5)
    return transformers.Qwen2ForCausalLM(config).train(), call, corrupt, inputs(0)


def _regnet():
    import timm

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)

    def call(run, seed):
        x, y = batch(seed)
        return nn.functional.cross_entropy(run(x), y)

    def corrupt(model):
        model.stem.conv.weight.add_(0.5)
    return timm.create_model("regnetx_002", num_classes=10).train(), call, corrupt, \
        ((batch(0)[0],), {})


def _two_forwards_one_loss(run, module, call, corrupt):
    (call(run, 1) + call(run, 2)).backward()


def _no_grad_forward_between(run, module, call, corrupt):
    loss = call(run, 1)
    with torch.no_grad():
        call(run, 3)
    loss.backward()


def _backward_that_raises(run, module, call, corrupt):
    loss = call(run, 1)
    with torch.no_grad():
        corrupt(module)
    try:
        loss.backward()
    except RuntimeError as error:
        if "modified by an inplace operation" not in str(error):
            raise
    else:
        raise AssertionError("the backward did not raise")
    module.zero_grad(set_to_none=True)


PATTERNS = (_two_forwards_one_loss, _no_grad_forward_between, _backward_that_raises)


def _train(run, module, call, corrupt, pattern):
    call(run, 0).backward()                  # .grad already there: accumulated into
    pattern(run, module, call, corrupt)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for step in range(3):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        call(run, 10 + step).backward()


def _same(plain, model) -> bool:
    states = zip(plain.state_dict().values(), model.state_dict().values())
    grads = zip(plain.parameters(), model.parameters())
    return all(torch.equal(a, b) for a, b in states) and all(
        (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
        for a, b in grads)


def row(name, build, policy, pattern) -> dict:
    import superneurons as sn
    torch.manual_seed(0)
    plain, call, corrupt, (args, kwargs) = build()
    model = copy.deepcopy(plain)
    options = dict(policy=policy, state="host", device="cpu")
    if policy != "liveness":
        floor = sn.plan(plain, args, policy=policy, state="host", kwargs=kwargs).peak_bytes
        peak = sn.plan(plain, args, policy="liveness", kwargs=kwargs).peak_bytes
        options["budget"] = floor + (peak - floor) // 2
    wrapped = sn.wrap(model, **options)
    _train(plain, plain, call, corrupt, pattern)
    _train(wrapped, model, call, corrupt, pattern)
    stats = wrapped.stats
    return {"model": name, "policy": policy, "pattern": pattern.__name__.strip("_"),
            "budget_bytes": options.get("budget"), "bit_for_bit": _same(plain, model),
            "recomputed_layers": stats.recomputed_layers, "state_moved_bytes":
            stats.state_moved_bytes}


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write
    rows = []
    for name, build in (("qwen2", _qwen2), ("regnetx_002", _regnet)):
        for policy in ("liveness", "superneurons"):
            for pattern in PATTERNS:
                rows.append(row(name, build, policy, pattern))
                print(rows[-1], flush=True)
    write(os.path.join(sys.argv[1], "newcomers_state_backwards.json"),
          {"command": "python benchmarks/newcomers_state_backwards.py OUT", "rows": rows})


if __name__ == "__main__":
    main()
