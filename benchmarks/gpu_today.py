"""Models people train today, on CUDA: exactness against plain PyTorch, and a decoder's speed at
fractions of plain PyTorch's own peak memory.

    python benchmarks/gpu_today.py exact OUT.json [NAME ...] [--toward F] [--steps N] [--bf16]
                                                      # resnet50, efficientnet_b0, convnext_tiny,
                                                      # vit_b_16, HF GPT-2, BLOOM, SEW-D
                                                      # and PhiMoE:
                                                      # plain-vs-plain
                                                      # control, then
                                                      # every policy at a budget that forces it:
                                                      # F of the way from the policy's floor to
                                                      # the liveness peak (0.5; near 0, data
                                                      # must move), N AdamW steps (3; past the
                                                      # calibrating ones, steps trust their
                                                      # calibration and drain: executor Rule 10;
                                                      # --bf16: the steps under bf16 autocast)
    python benchmarks/gpu_today.py ratio OUT.json     # GPT-2 small (12 layers, d 768, seq 1024,
                                                      # batch 16, AdamW) at 0.5 and 0.25 of
                                                      # plain's peak: plain, checkpoint per
                                                      # block, superneurons, a process each

Exactness uses deterministic kernels (torch.use_deterministic_algorithms) so that plain against
plain is bit-identical and any difference is the runtime's.
"""

import copy
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import superneurons as sn  # noqa: E402
from benchmarks.common import (environment, gpt2 as _gpt2, replayed_alone,  # noqa: E402
                               token_batch, write)

POLICIES = ("recompute", "superneurons", "offload")


def _vision(name):
    import torchvision
    return lambda: torchvision.models.get_model(name, weights=None, num_classes=100)


def _exact_cases(device):
    def image_batch(size):
        x = torch.randn(8, 3, size, size, device=device)
        y = torch.randint(0, 100, (8,), device=device)
        return (x,), {}, lambda out: torch.nn.functional.cross_entropy(out, y)

    def tokens():
        ids = torch.randint(0, 1000, (4, 256), device=device)
        mask = torch.ones_like(ids)
        mask[1, 200:] = 0
        return (), dict(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False), \
            lambda out: out.loss
    return {
        "resnet50": (_vision("resnet50"), lambda: image_batch(128)),
        "efficientnet_b0": (_vision("efficientnet_b0"), lambda: image_batch(128)),
        "convnext_tiny": (_vision("convnext_tiny"), lambda: image_batch(128)),
        "vit_b_16": (_vision("vit_b_16"), lambda: image_batch(224)),
        "hf_gpt2": (lambda: _gpt2(layers=4, width=256, heads=4, positions=256, vocab=1000),
                    tokens),
        # its GELU a custom autograd Function, captured whole (capture/functions.py)
        "hf_bloom": (_bloom, tokens),
        # custom Functions that draw random numbers (SEW-D's XDropout) or route experts
        # (PhiMoE), as the CPU's matrix builds them
        "hf_sew_d": _from_matrix("build_hf_sew_d", device),
        "hf_phimoe": _from_matrix("build_hf_phimoe", device),
    }


def _from_matrix(builder: str, device):
    """A case of tests/today_models.py, its model and tensors on ``device``."""
    def build():
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "tests"))
        import today_models
        model, args, kwargs, loss_fn = getattr(today_models, builder)()
        on = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        built[:] = [tuple(map(on, args)), {k: on(v) for k, v in kwargs.items()}, loss_fn]
        return model
    built = []
    return build, lambda: (built[0], built[1], lambda out: built[2](out))


def _bloom():
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM(BloomConfig(vocab_size=1000, hidden_size=256, n_layer=4, n_head=4,
                                        hidden_dropout=0.1, attention_dropout=0.1))


def _train(model, args, kwargs, loss_of, steps=3, drained=None, bf16=False, peaks=None):
    """Losses of ``steps`` AdamW steps, each forward under bf16 autocast if ``bf16``; with
    ``drained`` and ``peaks``, a wrapped model's convolutions drained and its peak bytes
    (StepStats, from its forward to its backward's end) per step appended to them."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model(*args, **kwargs))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if drained is not None:
            drained.append(model.stats.drained_convolutions)
        if peaks is not None:
            peaks.append(model.stats.peak_bytes)
    return losses


def _replayed(wrapped, args, kwargs, bf16=False) -> dict:
    """Layers of each checkpoint kind (CONV, FC, ATTN) the plan replays: whole blocks, pieces
    of them, or alone (their cheap successors' outputs kept); "alone" counts the last."""
    from superneurons.planner.policy import CHECKPOINT_KINDS
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        plan, _ = wrapped.plan_for(*args, **kwargs)
    kinds = [plan.graph.layers[l].kind for l in plan.segment_of()]
    return {**{kind.value: kinds.count(kind) for kind in CHECKPOINT_KINDS},
            "alone": replayed_alone(plan)}


def _difference(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa
               if sa[k].is_floating_point()) if sa else 0.0


def exact(out: str, names=(), toward: float = 0.5, steps: int = 3, bf16: bool = False) -> None:
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda")
    record = {**environment(), "part": "exact", "toward": toward, "steps": steps,
              "dtype": "bf16" if bf16 else "fp32",
              "complete": False,
              "models": {}}
    for name, (build, batch) in _exact_cases(device).items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        base = build().to(device).train()
        args, kwargs, loss_of = batch()
        reference = copy.deepcopy(base)
        expected = _train(reference, args, kwargs, loss_of, steps, bf16=bf16)
        control = copy.deepcopy(base)
        same = _train(control, args, kwargs, loss_of, steps, bf16=bf16) == expected
        rows = {"plain_vs_plain": {"losses_equal": same,
                                   "max_state_difference": _difference(reference, control)}}
        del control
        for policy in POLICIES:
            model = copy.deepcopy(base)
            example = args if args else ()
            started = time.perf_counter()
            try:
                cast = torch.bfloat16 if bf16 else None
                graph_peak = sn.plan(model, example, policy="liveness", kwargs=kwargs,
                                     autocast=cast).peak_bytes
                floor = sn.plan(model, example, policy=policy, kwargs=kwargs,
                                autocast=cast).peak_bytes
                # a budget covers all device memory: add what the other copies here hold, and
                # AdamW's two moments, made by the first step
                others = torch.cuda.memory_allocated() - sum(
                    t.numel() * t.element_size() for t in (*model.parameters(),
                                                           *model.buffers())) + 2 * sum(
                    p.numel() * p.element_size() for p in model.parameters())
                budget = others + floor + int(toward * (graph_peak - floor)) \
                    if floor < graph_peak else None
                wrapped = sn.wrap(model, policy=policy, budget=budget)
                drained, peaks = [], []
                losses = _train(wrapped, args, kwargs, loss_of, steps, drained, bf16, peaks)
                stats = wrapped.stats
                rows[policy] = {
                    "budget_bytes": budget, "liveness_peak_bytes": graph_peak,
                    "floor_bytes": floor, "losses_equal": losses == expected,
                    "max_state_difference": _difference(reference, model),
                    "recomputed_layers": stats.recomputed_layers,
                    "replayed_checkpoint_kinds": _replayed(wrapped, args, kwargs, bf16),
                    "offloaded_bytes": stats.offloaded_bytes,
                    "drained_convolutions": drained, "peak_bytes": peaks,
                    "held": budget is None or max(peaks) <= budget, "seconds": round(
                        time.perf_counter() - started, 2)}
            except Exception as error:  # noqa: BLE001 -- recorded, the run goes on
                rows[policy] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
            del model
            torch.cuda.empty_cache()
        record["models"][name] = rows
        print(name, json.dumps(rows), flush=True)
        write(out, record, quiet=True)
    record["complete"] = True
    write(out, record)


def ratio_one(system: str, cap_bytes: int | None, steps: int = 6, warmup: int = 2) -> dict:
    """One system in this process: tokens/s and peak memory, under ``cap_bytes`` if given."""
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_bytes:
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)
    torch.manual_seed(0)
    model = _gpt2().to(device).train()
    kwargs = token_batch(device)
    started = time.perf_counter()
    if system == "checkpoint":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif system == "superneurons":
        model = sn.wrap(model, policy="superneurons", budget=int(cap_bytes * 0.96))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seconds, first = [], None
    try:
        for step in range(warmup + steps):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            model(**kwargs).loss.backward()
            optimizer.step()
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - begin
            if step == 0:
                first = elapsed
            if step >= warmup:
                seconds.append(elapsed)
    except torch.OutOfMemoryError as error:
        return {"system": system, "ok": False, "error": f"out of memory: {str(error)[:200]}"}
    except (RuntimeError, ValueError) as error:
        return {"system": system, "ok": False, "error": f"{type(error).__name__}: "
                                                         f"{str(error)[:400]}"}
    tokens = kwargs["input_ids"].numel()
    seconds.sort()
    row = {"system": system, "ok": True, "tokens_per_s": tokens / seconds[len(seconds) // 2],
           "first_step_s": first, "setup_s": time.perf_counter() - started - sum(seconds),
           "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
           "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    if system == "superneurons":
        stats = model.stats
        row.update(recomputed_layers=stats.recomputed_layers,
                   offloaded_bytes=stats.offloaded_bytes,
                   predicted_peak_bytes=stats.predicted_peak_bytes)
    return row


def _in_process(system: str, cap_bytes) -> dict:
    command = [sys.executable, __file__, "one", system, str(cap_bytes or 0)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=540)
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if not lines:
        return {"system": system, "ok": False, "error": done.stderr[-800:]}
    return json.loads(lines[-1])


def ratio(out: str) -> None:
    record = {**environment(), "part": "ratio", "model": "HF GPT2LMHeadModel 12x768, seq 1024, "
              "batch 16, AdamW, fp32", "complete": False, "rows": []}
    plain = _in_process("plain", None)
    record["rows"].append({"ratio": None, **plain})
    write(out, record, quiet=True)
    print(plain, flush=True)
    if plain.get("ok"):
        for fraction in (0.5, 0.25):
            cap = int(plain["peak_allocated_bytes"] * fraction)
            for system in ("checkpoint", "superneurons"):
                row = {"ratio": fraction, "cap_bytes": cap, **_in_process(system, cap)}
                if row.get("ok"):
                    row["speed_of_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
                record["rows"].append(row)
                print(row, flush=True)
                write(out, record, quiet=True)
    record["complete"] = True
    write(out, record)


if __name__ == "__main__":
    part = sys.argv[1]
    if part == "exact":
        rest = sys.argv[3:]
        toward = 0.5
        if "--toward" in rest:
            at = rest.index("--toward")
            toward, rest = float(rest[at + 1]), rest[:at] + rest[at + 2:]
        steps = 3
        if "--steps" in rest:
            at = rest.index("--steps")
            steps, rest = int(rest[at + 1]), rest[:at] + rest[at + 2:]
        bf16 = "--bf16" in rest
        exact(sys.argv[2], [name for name in rest if name != "--bf16"], toward, steps, bf16)
    elif part == "ratio":
        ratio(sys.argv[2])
    elif part == "one":
        print(json.dumps(ratio_one(sys.argv[2], int(sys.argv[3]) or None)))
    else:
        raise SystemExit(__doc__)
