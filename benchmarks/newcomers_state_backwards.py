"""Models nobody here wrote, with their state in host memory (state="host"), under the ways users
call backward that are not one forward and one backward: two forwards summed into one loss, a
no_grad forward between a forward and its backward, and a backward that raises (a parameter
changed between forward and backward) followed by more training. Each beside plain PyTorch, then
3 AdamW steps, compared bit for bit (parameters, buffers, gradients). HF Qwen2ForCausalLM with
its embedding tied to its head (a parameter with two uses a forward) and timm regnetx_002 (batch
norms); with --models, also HF GPTNeoForCausalLM (tied, global and local attention, dropout)
and timm ese_vovnet19b_dw (concatenations, depthwise convolutions, batch norms); "liveness" and
"superneurons" halfway from the state="host" floor to the liveness peak. Planner and runtime of
whichever tree is on PYTHONPATH.

    PYTHONPATH=TREE:benchmarks python benchmarks/newcomers_state_backwards.py OUT_DIR
        [--models qwen2 regnetx_002 gpt_neo ese_vovnet19b_dw] [--tag NAME]
        (writes OUT_DIR/newcomers_state_backwards[_NAME].json)
"""

import argparse
import copy
import os
import sys

import torch
from torch import nn


def _hf_decoder(model_class: str, config_class: str, first_weight, **config):
    """An HF causal LM of vocabulary 128 on 2 sequences of 24 tokens, its loss from labels;
    ``first_weight`` (the model) is read by the first block's backward, after the head's."""
    def build():
        import transformers
        model = getattr(transformers, model_class)(
            getattr(transformers, config_class)(vocab_size=128, max_position_embeddings=64,
                                                **config))

        def inputs(seed):
            ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))
            return (), dict(input_ids=ids, labels=ids, use_cache=False)

        def call(run, seed):
            args, kwargs = inputs(seed)
            return run(*args, **kwargs).loss

        def corrupt(model):
            first_weight(model).add_(0.5)
        return model.train(), call, corrupt, inputs(0)
    return build


def _timm_classifier(name: str, first_weight):
    """A timm classifier at batch 4 of 32 px; ``first_weight`` (the model) is read by the
    last backward layer, so that the layers after it have sent their gradients when it raises."""
    def build():
        import timm

        def batch(seed):
            g = torch.Generator().manual_seed(seed)
            return torch.randn(4, 3, 32, 32, generator=g), \
                torch.randint(0, 10, (4,), generator=g)

        def call(run, seed):
            x, y = batch(seed)
            return nn.functional.cross_entropy(run(x), y)

        def corrupt(model):
            first_weight(model).add_(0.5)
        return timm.create_model(name, num_classes=10).train(), call, corrupt, \
            ((batch(0)[0],), {})
    return build


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


MODELS = {"qwen2": _hf_decoder("Qwen2ForCausalLM", "Qwen2Config",
                             lambda m: m.model.layers[0].self_attn.q_proj.weight,
                             hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True),
          "regnetx_002": _timm_classifier("regnetx_002", lambda m: m.stem.conv.weight),
          "gpt_neo": _hf_decoder("GPTNeoForCausalLM", "GPTNeoConfig",
                                 lambda m: m.transformer.h[0].attn.attention.q_proj.weight,
                                 hidden_size=32, num_layers=2, num_heads=4, window_size=8,
                                 attention_types=[[["global", "local"], 1]]),
          "ese_vovnet19b_dw": _timm_classifier("ese_vovnet19b_dw",
                                               lambda m: m.stem[0].conv.weight)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS),
                        default=["qwen2", "regnetx_002"])
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write
    rows = []
    for name in args.models:
        for policy in ("liveness", "superneurons"):
            for pattern in PATTERNS:
                rows.append(row(name, MODELS[name], policy, pattern))
                print(rows[-1], flush=True)
    name = "newcomers_state_backwards" + (f"_{args.tag}" if args.tag else "") + ".json"
    write(os.path.join(args.out, name),
          {"command": "python benchmarks/newcomers_state_backwards.py " + " ".join(sys.argv[1:]),
           "rows": rows})


if __name__ == "__main__":
    main()
