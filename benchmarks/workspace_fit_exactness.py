"""Whether fitting convolution workspaces to the budget (executor Rule 9) changes a CUDA step's
values: torchvision resnet18 trained plainly (twice: a plain-vs-plain control) and wrapped, with
deterministic cuDNN kernels, the wrapped model with the fit and without it.

    python benchmarks/workspace_fit_exactness.py OUT_DIR [--steps 14] [--state-budgets 3]

The budget is the one tests/test_plan_trial.py uses on CUDA: halfway between the superneurons
floor and the liveness plan, plus a multiple of the parameters' bytes for what the model does
not own (momentum, the losses kept). Writes OUT_DIR/workspace_fit_exactness.json. The
runtime turns the fit off under deterministic kernels (executor Rule 9); this forces it on.
"""

import argparse
import copy
import gc
import os
import sys

import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import superneurons as sn                                                      # noqa: E402
from superneurons.planner import plan_graph                                    # noqa: E402
from superneurons.runtime import executor                                      # noqa: E402


def train(run, model, x, y, steps: int, each=lambda: None) -> list:
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(run(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        each()
    return losses


def case(fitted: bool, steps: int, state_budgets: float) -> dict:
    gc.collect()           # an earlier case's wrapper (its executors hold cycles) is not foreign
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).cuda()
    x, y = torch.randn(32, 3, 64, 64).cuda(), torch.randint(0, 10, (32,)).cuda()
    graph = sn.plan(model, x, policy="liveness").graph
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = (plan_graph(graph, "superneurons").peak_bytes
              + plan_graph(graph, "liveness").peak_bytes) // 2 + int(state_budgets * state)
    plain = [train(m, m, x, y, steps) for m in (copy.deepcopy(model), copy.deepcopy(model))]
    fits_on = executor.fits_on
    # forced either way: the runtime itself never fits under deterministic kernels
    executor.fits_on = lambda device: fitted and device.type == "cuda"
    try:
        wrapped, rows = sn.wrap(model, "superneurons", budget), []

        def each():
            stats = wrapped.stats
            rows.append({"recomputed_layers": stats.recomputed_layers,
                         "offloaded_bytes": stats.offloaded_bytes, "peak_bytes": stats.peak_bytes,
                         "trying": stats.trying})
        losses = train(wrapped, model, x, y, steps, each)
    finally:
        executor.fits_on = fits_on
    return {"budget_bytes": budget, "plain": plain[0], "plain_again": plain[1],
            "wrapped": losses, "bit_for_bit": [a == b for a, b in zip(plain[0], losses)],
            "steps": rows}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--state-budgets", type=float, default=3)
    args = parser.parse_args()
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    from common import write
    record = {"workspace_fitted": case(True, args.steps, args.state_budgets),
              "workspace_not_fitted": case(False, args.steps, args.state_budgets)}
    write(os.path.join(args.out, "workspace_fit_exactness.json"), record)


if __name__ == "__main__":
    main()
