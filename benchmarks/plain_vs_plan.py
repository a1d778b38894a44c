"""The memory model against plain PyTorch: one plain training step's peak above what existed
before it (parameters, buffers, the input), measured by the caching allocator, beside what the
liveness plan predicts for the same step (plain PyTorch frees a tensor after its last use the
way liveness does). A plan under the measured peak is a budget the runtime cannot keep.

    python benchmarks/plain_vs_plan.py OUT.json [--only NAME ...]     (CUDA)
"""

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gpt2, make, token_batch, torch_settings, write  # noqa: E402
import superneurons as sn  # noqa: E402


def _torchvision(name, batch, image=224):
    import torchvision
    model = getattr(torchvision.models, name)(num_classes=1000).cuda()
    return model, (torch.randn(batch, 3, image, image, device="cuda"),), {}


def _ours(name, batch):
    model, x, _ = make(name, batch, "cuda")
    return model, (x,), {}


def _gpt2(batch):
    batch_kwargs = token_batch("cuda", batch=batch, seq=512)
    return gpt2(layers=4).cuda(), (), batch_kwargs


CASES = {
    "densenet121_64": lambda: _ours("densenet121", 64),
    "densenet201_32": lambda: _ours("densenet201", 32),
    "tv_densenet121_64": lambda: _torchvision("densenet121", 64),
    "resnet50_64": lambda: _ours("resnet50", 64),
    "tv_resnet101_32": lambda: _torchvision("resnet101", 32),
    "inception_v4_32": lambda: _ours("inception_v4", 32),
    "vgg16_32": lambda: _ours("vgg16", 32),
    "alexnet_256": lambda: _ours("alexnet", 256),
    "tv_efficientnet_b0_64": lambda: _torchvision("efficientnet_b0", 64),
    "gpt2_4_layers_8x512": lambda: _gpt2(8),
}


def _loss(out):
    logits = out.logits if hasattr(out, "logits") else out
    return out.loss if getattr(out, "loss", None) is not None else logits.float().sum()


def one(build) -> dict:
    """Plain steps' peaks from an empty device (the first step chooses cuDNN's algorithms) and
    the plan's peak, which counts the same: model state, gradients, the input, the step."""
    gc.collect()
    torch.cuda.empty_cache()
    empty = torch.cuda.memory_allocated()
    model, args, kwargs = build()
    plan = sn.plan(model, args, policy="liveness", kwargs=kwargs)
    measured = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _loss(model(*args, **kwargs)).backward()
        torch.cuda.synchronize()
        measured.append(torch.cuda.max_memory_allocated() - empty)
    del model, args, kwargs
    return {"predicted_peak_bytes": plan.peak_bytes, "measured_peak_bytes": measured,
            "predicted_over_measured": round(plan.peak_bytes / measured[-1], 4),
            "peak_step": next({"phase": step.phase, "layer": step.layer} for step in plan.steps
                              if step.live_bytes == plan.peak_bytes)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    torch_settings()
    rows = {}
    for name, build in CASES.items():
        if args.only and name not in args.only:
            continue
        try:
            rows[name] = one(build)
        except Exception as error:          # a record of what failed, not a lost run
            rows[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        print(name, rows[name], flush=True)
    under = [n for n, r in rows.items() if "error" not in r and r["predicted_over_measured"] < 1]
    write(args.out, {"cases": rows, "plan_under_measured": under})


if __name__ == "__main__":
    main()
