"""Where a wrapped run first departs from plain PyTorch: one forward and backward, then steps.

    python benchmarks/exact_grads.py OUT_DIR [--device cuda] [--models llama gpt2 ...]
                                     [--attention sdpa|eager|math]

For each model (HF Llama and GPT-2 from small configs, with and without dropout) and each way of
running it (plain, wrapped with the state on the device, wrapped with the state on the host under
the liveness and the superneurons policy), fp32 and bf16 autocast, with deterministic kernels:
the first backward's loss and gradients compared bit for bit with plain PyTorch (the worst
parameters named), then 3 SGD steps (no optimizer arithmetic that differs between host and
device: SGD without momentum is one multiply-add) and 3 AdamW steps against plain PyTorch whose
AdamW steps host copies of its parameters, as the state tier's does. --attention: HF's SDPA
attention (default), its eager attention, or SDPA held to the math kernel. Writes
exact_grads[_ATTENTION].json.
"""

import argparse
import os
import sys

STEPS = 3
WAYS = ("plain", "device_superneurons", "host_liveness", "host_superneurons")


def _setup():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import torch_settings
    torch_settings(deterministic=True)
    import torch
    return torch


ATTENTION = "sdpa"


def _build(name: str):
    import torch
    import transformers as tf
    torch.manual_seed(0)
    dropout = 0.0 if name.endswith("_nodrop") else 0.1
    if name.startswith("llama"):
        config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                attention_dropout=dropout)
    else:
        config = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, resid_pdrop=dropout,
                               embd_pdrop=dropout, attn_pdrop=dropout)
    config.use_cache = False
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager" if ATTENTION == "eager" else "sdpa").train()
    ids = torch.randint(0, 256, (2, 64))
    return model, ids


def _run(torch, name: str, way: str, device: str, autocast: bool, optimizer: str):
    """Losses, first gradients and final state of ``way``; optimizer "" stops after one
    backward."""
    import superneurons as sn
    model, ids = _build(name)
    if way == "plain":
        run = model.to(device)
    elif way.startswith("device_"):
        run = sn.wrap(model.to(device), policy=way[7:], budget=None)
    else:
        run = sn.wrap(model, policy=way[5:], budget=None, state="host", device=device)
    # the optimizer steps host tensors for every way: host copies of a plain model's parameters
    on_host = way == "plain" or way.startswith("device_")
    params = list(model.parameters())
    masters = [p.detach().cpu().clone().requires_grad_() for p in params] if on_host else params
    opt = None
    if optimizer == "sgd":
        opt = torch.optim.SGD(masters, lr=0.1)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(masters, lr=1e-3)
    ids = ids.to(device)
    losses, first_grads = [], None
    for step in range(STEPS if opt else 1):
        torch.manual_seed(100 + step)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float().cpu())
        if first_grads is None:
            first_grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()
                           if p.grad is not None}
        if opt is None:
            break
        if on_host:
            for master, p in zip(masters, params):
                master.grad = None if p.grad is None else p.grad.cpu()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_host:
            with torch.no_grad():
                for master, p in zip(masters, params):
                    p.copy_(master)
                    p.grad = None
    final = {n: p.detach().cpu() for n, p in model.named_parameters()}
    final.update({f"optimizer.{i}.{k}": v.cpu() for i, s in
                  enumerate(opt.state.values() if opt else []) for k, v in s.items()})
    return losses, first_grads, final


def _compare(torch, a: dict, b: dict) -> dict:
    diffs = {}
    for key in a:
        if key not in b:
            diffs[key] = "missing"
        elif not torch.equal(a[key], b[key]):
            diffs[key] = (a[key].double() - b[key].double()).abs().max().item()
    numeric = sorted(((v, k) for k, v in diffs.items() if v != "missing"), reverse=True)
    return {"equal": not diffs, "differing": len(diffs), "of": len(a),
            "missing": [k for k, v in diffs.items() if v == "missing"],
            "worst": [[k, v] for v, k in numeric[:4]]}


def case(torch, name: str, device: str) -> dict:
    if ATTENTION == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return _case(torch, name, device)
    return _case(torch, name, device)


def _case(torch, name: str, device: str) -> dict:
    row = {}
    for autocast in (False, True):
        tag = "bf16" if autocast else "fp32"
        for optimizer in ("", "sgd", "adamw"):
            base = _run(torch, name, "plain", device, autocast, optimizer)
            for way in WAYS:
                try:
                    other = _run(torch, name, way, device, autocast, optimizer)
                except Exception as error:          # noqa: BLE001 -- recorded, not hidden
                    row[f"{tag}.{optimizer or 'backward'}.{way}"] = {"error": repr(error)[:400]}
                    continue
                result = {"losses_equal": all(bool((x == y).all())
                                              for x, y in zip(base[0], other[0])),
                          "losses": [float(x) for x in other[0]]}
                if optimizer:
                    result["final"] = _compare(torch, base[2], other[2])
                else:
                    result["grads"] = _compare(torch, base[1], other[1])
                row[f"{tag}.{optimizer or 'backward'}.{way}"] = result
                print(name, tag, optimizer or "backward", way, result, flush=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", choices=("sdpa", "eager", "math"), default="sdpa")
    parser.add_argument("--models", nargs="*",
                        default=["llama", "llama_nodrop", "gpt2", "gpt2_nodrop"])
    args = parser.parse_args()
    global ATTENTION
    ATTENTION = args.attention
    torch = _setup()
    from common import environment, write
    rows = {name: case(torch, name, args.device) for name in args.models}
    suffix = "" if args.attention == "sdpa" else f"_{args.attention}"
    write(os.path.join(args.out, f"exact_grads{suffix}.json"),
          {"command": " ".join(sys.argv), "environment": environment(), "steps": STEPS,
           "results": rows})


if __name__ == "__main__":
    main()
