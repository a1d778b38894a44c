"""Model state in host memory (sn.wrap(..., state="host")): exactness on CUDA, the deepest
ResNet and a decoder, each case in a fresh process under the 12 GiB cap.

    python benchmarks/state_tier.py OUT_DIR exact            # plain vs host state, and a control
    python benchmarks/state_tier.py OUT_DIR deep [--n3 3323] [--batch 16]
    python benchmarks/state_tier.py OUT_DIR decoder [--decoder HIDDEN LAYERS ...] [--fused]
    python benchmarks/state_tier.py OUT_DIR anchor [--decoder HIDDEN LAYERS ...] [--bf16-weights]

exact: small models nobody here needed to write (the zoo's ResNet, HF Llama and GPT-2 from small
configs) trained 3 steps plainly on the GPU and wrapped with their state on the host, with
deterministic kernels; a second plain run is the control. Compared: losses, parameters,
gradients, optimizer state. deep: a bottleneck ResNet [3, 4, n3, 3] at batch 16 (n3 3323:
10,001 layers), SGD with momentum over host tensors, 3 steps; per step seconds, peak allocated,
bytes moved, and the link-bound minimum (bytes each way over LINK_BYTES_PER_S). decoder: an HF
Llama built on the host, bf16 autocast, AdamW on the host, tokens per second. anchor: the peers'
way for the same decoder (the issue's anchor): HF gradient checkpointing per layer, weights on the
device (fp32, or bf16 with --bf16-weights), torchao's CPUOffloadOptimizer (AdamW on the host,
gradients offloaded in backward), bf16 autocast; torchao travels as a wheel.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

CAP_GIB, BUDGET = 12.0, "11.5GiB"
STEPS = 3
# the H200's host link, each way, measured for pinned copies (benchmarks/results/pinning.json)
LINK_BYTES_PER_S = 55e9


def _setup(deterministic: bool = False):
    from common import torch_settings
    torch_settings(deterministic)
    import torch
    return torch


# -- exact ------------------------------------------------------------------------------------
def _exact_models():
    import torch
    import superneurons as sn

    def resnet():
        model = sn.models.resnet(blocks=(1, 2, 2, 1), num_classes=10)
        x = torch.randn(8, 3, 64, 64)
        y = torch.randint(0, 10, (8,))
        return model, (x,), {}, lambda out: torch.nn.functional.cross_entropy(out, y.cuda())

    def hf(kind):
        import transformers as tf

        def build():
            if kind == "llama":
                config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, attention_dropout=0.1)
            else:
                config = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4)
            config.use_cache = False       # a training step keeps no key-value cache
            model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            ids = torch.randint(0, 256, (2, 64))
            return model, (), {"input_ids": ids, "labels": ids}, lambda out: out.loss
        return build
    return {"resnet": (resnet, "sgd"), "hf_llama": (hf("llama"), "adamw"),
            "hf_gpt2": (hf("gpt2"), "adamw")}


def _train(build, optimizer_name: str, state: str, autocast: bool):
    import torch
    import superneurons as sn
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = build()
    model.train()
    host_step = state == "device, optimizer on the host"
    if state.startswith("device"):
        # the reference for the optimizer on the host: plain PyTorch on the GPU, its optimizer
        # over host copies (as torchao's CPUOffloadOptimizer runs it)
        masters = [p.detach().clone().requires_grad_() for p in model.parameters()] \
            if host_step else None
        model = model.cuda()
        run = model
    else:
        run = sn.wrap(model, policy="superneurons", budget=None, state="host", device="cuda")
    stepped = masters if host_step else list(model.parameters())
    optimizer = (torch.optim.SGD(stepped, lr=0.1, momentum=0.9)
                 if optimizer_name == "sgd" else torch.optim.AdamW(stepped, lr=1e-3))
    losses = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        optimizer.zero_grad(set_to_none=True)
        a = [t.cuda() for t in args]
        k = {n: t.cuda() for n, t in kwargs.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(run(*a, **k))
        loss.backward()
        if host_step:
            for master, p in zip(masters, model.parameters()):
                master.grad = None if p.grad is None else p.grad.cpu()
                p.grad = None
        optimizer.step()
        if host_step:
            with torch.no_grad():
                for master, p in zip(masters, model.parameters()):
                    p.copy_(master)
                    p.grad = master.grad.cuda() if master.grad is not None else None
        losses.append(loss.detach().float().cpu())
    state_of = {"params": {n: p.detach().cpu() for n, p in model.named_parameters()},
                "grads": {n: p.grad.cpu() for n, p in model.named_parameters()
                          if p.grad is not None},
                "buffers": {n: b.cpu() for n, b in model.named_buffers()},
                "optimizer": {f"{i}.{k}": v.cpu() for i, s in
                              enumerate(optimizer.state.values()) for k, v in s.items()
                              if hasattr(v, "cpu")}}
    return losses, state_of, (run.stats.as_dict() if state == "host" else None)


def _max_diff(a: dict, b: dict) -> float:
    import torch
    worst = 0.0
    for part in a:
        if set(a[part]) != set(b[part]):
            return float("inf")
        for key, x in a[part].items():
            y = b[part][key]
            if not torch.equal(x, y):
                worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def exact_case(name: str) -> dict:
    _setup(deterministic=True)
    build, optimizer = _exact_models()[name]
    row = {"model": name, "optimizer": optimizer}
    for autocast in (False, True):
        plain = _train(build, optimizer, "device", autocast)
        control = _train(build, optimizer, "device", autocast)
        host = _train(build, optimizer, "host", autocast)
        host_step = _train(build, optimizer, "device, optimizer on the host", autocast)
        tag = "bf16" if autocast else "fp32"
        row[tag] = {
            "losses_equal": all(bool((a == b).all()) for a, b in zip(plain[0], host[0])),
            "max_diff": _max_diff(plain[1], host[1]),
            "control_max_diff": _max_diff(plain[1], control[1]),
            # against plain PyTorch on the GPU whose optimizer steps host copies
            "losses_equal_optimizer_on_host": all(bool((a == b).all())
                                                  for a, b in zip(host_step[0], host[0])),
            "max_diff_optimizer_on_host": _max_diff(host_step[1], host[1]),
            "losses": [float(x) for x in host[0]], "stats": host[2]}
    return row


# -- deep ResNet ------------------------------------------------------------------------------
def _steps(torch, wrapped, step_fn, budget_bytes: int) -> list:
    from common import calibration_of, rss_bytes
    rows = []
    # a diagnosis: the allocator's history of the steps after the first, for the peak's tensors
    snapshot = os.environ.get("STATE_TIER_SNAPSHOT")
    for index in range(STEPS):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if snapshot and index == 1:
            torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        began = time.perf_counter()
        try:
            step_fn()
            torch.cuda.synchronize()
        finally:        # the steps after the first, or up to the out-of-memory error
            if snapshot and (index == STEPS - 1 or sys.exc_info()[0] is not None):
                torch.cuda.memory._dump_snapshot(snapshot)
                torch.cuda.memory._record_memory_history(enabled=None)
        seconds = time.perf_counter() - began
        stats = wrapped.stats
        peak = torch.cuda.max_memory_allocated()
        moved_cache = stats.offloaded_bytes + stats.prefetched_bytes
        rows.append({"seconds": seconds, "peak_allocated_bytes": peak,
                     "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                     "budget_held": peak <= budget_bytes,
                     "cache_moved_bytes": moved_cache,
                     "state_moved_bytes": stats.state_moved_bytes,
                     "host_memory_seconds": stats.host_memory_seconds,
                     "recomputed_layers": stats.recomputed_layers,
                     # each way at the link's speed: the least time the bytes moved can take
                     "link_bound_seconds": (moved_cache + stats.state_moved_bytes) / 2
                     / LINK_BYTES_PER_S,
                     "host_rss_bytes": rss_bytes(), **calibration_of(wrapped)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def deep_case(n3: int, batch: int) -> dict:
    torch = _setup()
    import superneurons as sn
    from common import cap_memory
    cap_memory(CAP_GIB)
    began = time.perf_counter()
    model = sn.models.resnet(blocks=(3, 4, n3, 3))           # built in host memory
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    row = {"n3": n3, "depth": 3 * (n3 + 10) + 2, "batch": batch,
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "build_s": time.perf_counter() - began}
    print(json.dumps(row), flush=True)              # progress: a timed-out case keeps it
    began = time.perf_counter()
    wrapped = sn.wrap(model, policy="superneurons", budget=BUDGET, state="host", device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    row["wrap_s"] = time.perf_counter() - began
    began = time.perf_counter()
    plan, _ = wrapped.plan_for(x)
    row.update(plan_s=time.perf_counter() - began, predicted_peak_bytes=plan.peak_bytes,
               planned_state_bytes_moved=plan.state_bytes_moved,
               planned_bytes_to_move=plan.bytes_to_move())
    print(json.dumps(row), flush=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        optimizer.step()
    try:
        row["steps"] = _steps(torch, wrapped, step, wrapped.budget_bytes)
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
        row["error"] = str(error).splitlines()[0][:400]
    row["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


# -- decoder ----------------------------------------------------------------------------------
def decoder_case(hidden, layers, intermediate, heads, kv_heads, vocab, seq, batch,
                 fused=0) -> dict:
    torch = _setup()
    import superneurons as sn
    from common import cap_memory
    if os.environ.get("STATE_TIER_NO_RESIDENT"):    # a diagnosis: every tensor streamed
        # the module (superneurons.planner.plan, as an attribute, is the function plan())
        sys.modules["superneurons.planner.plan"].with_resident_state = lambda plan, budget: plan
    cap_memory(CAP_GIB)
    began = time.perf_counter()
    model = _llama(hidden, layers, intermediate, heads, kv_heads, vocab, seq)  # fp32, on the host
    row = {"config": dict(hidden=hidden, layers=layers, intermediate=intermediate, heads=heads,
                          kv_heads=kv_heads, vocab=vocab, seq=seq, batch=batch),
           "params": sum(p.numel() for p in model.parameters()),
           "build_s": time.perf_counter() - began}
    wrapped = sn.wrap(model, policy="superneurons", budget=BUDGET, state="host", device="cuda")
    # the user's choice of kernel: foreach, or the fused one PyTorch has for CPU tensors too
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5,
                                  **({"fused": True} if fused else {"foreach": True}))
    row["optimizer"] = "AdamW fused" if fused else "AdamW foreach"
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    began = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plan, _ = wrapped.plan_for(input_ids=ids, labels=ids)
    row.update(plan_s=time.perf_counter() - began, predicted_peak_bytes=plan.peak_bytes,
               planned_state_bytes_moved=plan.state_bytes_moved)
    print(json.dumps(row), flush=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        began = time.perf_counter()
        optimizer.step()
        row.setdefault("optimizer_s", []).append(time.perf_counter() - began)
    try:
        row["steps"] = _steps(torch, wrapped, step, wrapped.budget_bytes)
        steady = row["steps"][1:] or row["steps"]
        row["tokens_per_s"] = batch * seq * len(steady) / sum(s["seconds"] for s in steady)
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
        row["error"] = str(error).splitlines()[0][:400]
    row["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


def _llama(hidden, layers, intermediate, heads, kv_heads, vocab, seq):
    import transformers as tf
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, max_position_embeddings=seq,
                            use_cache=False)
    return tf.LlamaForCausalLM(config)


def anchor_case(hidden, layers, intermediate, heads, kv_heads, vocab, seq, batch,
                bf16_weights=0) -> dict:
    torch = _setup()
    from torchao.optim import CPUOffloadOptimizer
    from common import cap_memory
    cap_memory(CAP_GIB)
    row = {"config": dict(hidden=hidden, layers=layers, intermediate=intermediate, heads=heads,
                          kv_heads=kv_heads, vocab=vocab, seq=seq, batch=batch),
           "weights": "bf16" if bf16_weights else "fp32",
           "system": "HF checkpointing per layer + torchao CPUOffloadOptimizer(AdamW, fused, "
                     "offload_gradients)"}
    with torch.device("meta"):
        row["params"] = sum(p.numel() for p in _llama(hidden, layers, intermediate, heads,
                                                      kv_heads, vocab, seq).parameters())
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    try:
        began = time.perf_counter()
        # built where it trains, in its own dtype: its weights on the device are the peer's way
        # (and a bf16 build on the host is slower than the step itself)
        torch.set_default_dtype(torch.bfloat16 if bf16_weights else torch.float32)
        with torch.device("cuda"):
            model = _llama(hidden, layers, intermediate, heads, kv_heads, vocab, seq)
        torch.set_default_dtype(torch.float32)
        row["build_s"] = time.perf_counter() - began
        print(json.dumps(row), flush=True)
        model.gradient_checkpointing_enable()
        model.train()
        optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW,
                                        offload_gradients=True, fused=True, lr=1e-5)
        rows = []
        for _ in range(STEPS):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            began = time.perf_counter()
            step()
            torch.cuda.synchronize()
            rows.append({"seconds": time.perf_counter() - began,
                         "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                         "peak_reserved_bytes": torch.cuda.max_memory_reserved()})
            print(json.dumps(rows[-1]), flush=True)
        row["steps"] = rows
        steady = rows[1:]
        row["tokens_per_s"] = batch * seq * len(steady) / sum(s["seconds"] for s in steady)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        row["error"] = str(error).splitlines()[0][:400]
    row["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


# -- driver -----------------------------------------------------------------------------------
def _child(argv: list) -> None:
    kind = argv[0]
    if kind == "exact":
        row = exact_case(argv[1])
    elif kind == "deep":
        row = deep_case(int(argv[1]), int(argv[2]))
    elif kind == "anchor":
        row = anchor_case(*map(int, argv[1:]))
    else:
        row = decoder_case(*map(int, argv[1:]))
    print("RESULT " + json.dumps(row), flush=True)


def _in_child(argv: list, timeout: float) -> dict:
    began = time.time()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", *map(str, argv)],
                              capture_output=True, text=True, timeout=timeout,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout
        return {"case": argv, "error": f"timed out after {timeout} s",
                "partial": [json.loads(l) for l in (out or "").splitlines() if l.startswith("{")]}
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    row = json.loads(lines[-1][7:]) if lines else {
        "error": f"process ended with {done.returncode}: "
                 f"{done.stderr.strip().splitlines()[-3:]}",
        "partial": [json.loads(l) for l in done.stdout.splitlines() if l.startswith("{")]}
    row.update(case=argv, process_s=time.time() - began)
    print(json.dumps({k: v for k, v in row.items() if k not in ("steps",)})[:2000], flush=True)
    return row


def main():
    if sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("kind", choices=("exact", "deep", "decoder", "anchor"))
    parser.add_argument("--n3", type=int, default=3323)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--fused", action="store_true", help="decoder: fused AdamW on the host")
    parser.add_argument("--bf16-weights", action="store_true", help="anchor: bf16 weights")
    parser.add_argument("--decoder", type=int, nargs=7, default=[2048, 22, 5632, 32, 4, 32000, 2048],
                        metavar=("HIDDEN", "LAYERS", "INTERMEDIATE", "HEADS", "KV_HEADS", "VOCAB",
                                 "SEQ"))
    parser.add_argument("--timeout", type=float, default=540)
    parser.add_argument("--models", nargs="*", default=["resnet", "hf_llama", "hf_gpt2"])
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import environment, write
    if args.kind == "exact":
        rows = [_in_child(["exact", name], args.timeout) for name in args.models]
    elif args.kind == "deep":
        rows = [_in_child(["deep", args.n3, args.batch], args.timeout)]
    elif args.kind == "anchor":
        rows = [_in_child(["anchor", *args.decoder, args.batch, int(args.bf16_weights)],
                          args.timeout)]
    else:
        rows = [_in_child(["decoder", *args.decoder, args.batch, int(args.fused)], args.timeout)]
    write(os.path.join(args.out, f"state_tier_{args.kind}.json"),
          {"command": " ".join(sys.argv), "environment": environment(), "cap_gib": CAP_GIB,
           "budget": BUDGET, "steps": STEPS, "results": rows})


if __name__ == "__main__":
    main()
