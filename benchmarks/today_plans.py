"""What `superneurons plan` predicts for models of today at the sizes people train them, on the
CPU with no weights allocated (the meta device): every policy's peak, the parameters and the
seconds the plan took, with the model's state on the device and in host memory.

    python benchmarks/today_plans.py OUT_DIR [--only NAME ...]
        (CPU; writes OUT_DIR/today_plans.json)
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (name as the command line takes it, batch, --seq or --image, --set fields): GPT-2 small at the
# issue's decoder anchor, a 7B Llama (LlamaConfig's defaults) at a short context, and two vision
# models at an ImageNet batch
MODELS = [
    ("hf:gpt2", 16, {"seq": 1024}, {}),
    ("hf:llama", 1, {"seq": 2048}, {}),
    ("torchvision:vit_b_16", 64, {}, {}),
    ("timm:convnext_tiny", 128, {}, {}),
]


def planned(name: str, batch: int, sizes: dict, options: dict, state: str) -> dict:
    from superneurons.capture import capture
    from superneurons.cli.today import build
    from superneurons.planner import Policy, plan_graph
    began = time.perf_counter()
    named = build(name, batch, "meta", options=options, **sizes)
    graph = capture(named.model, named.args, None, named.kwargs)
    captured = time.perf_counter()
    peaks = {str(p): plan_graph(graph, p, state=state).peak_bytes
             for p in (Policy.BASELINE, Policy.LIVENESS, Policy.RECOMPUTE, Policy.SUPERNEURONS)}
    return {"model": name, "inputs": named.inputs, "state": state,
            "parameters": sum(p.numel() for p in named.model.parameters()),
            "layers": len(graph.layers), "peak_bytes": peaks,
            "capture_seconds": captured - began,
            "planning_seconds": time.perf_counter() - captured}


def main():
    from common import environment, write
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--only", nargs="*", help="models of MODELS to plan, by name")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    rows = [planned(name, batch, sizes, options, state)
            for name, batch, sizes, options in MODELS if not args.only or name in args.only
            for state in ("device", "host")]
    write(os.path.join(args.out, "today_plans.json"), {
        "command": " ".join(["python", "benchmarks/today_plans.py"] + sys.argv[1:]),
        "environment": environment(), "cpu_count": os.cpu_count(), "rows": rows})


if __name__ == "__main__":
    main()
