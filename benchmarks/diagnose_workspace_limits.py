"""Did each convolution of a wrapped step run under its workspace limit (executor Rule 9), and
what did it peak at? A network as claims.py runs it (the 12 GiB cap, the 11.5 GiB budget,
expandable segments, SGD with momentum, a fresh process), with the fit's own calls recorded:
per step and convolution (forward, or backward between its node's hooks), the allocator's
allocated and reserved bytes, the room and limit the fit set, and the peak allocated while it
ran. The rows above the budget say which convolutions passed it and whether a limit was on.

    python benchmarks/diagnose_workspace_limits.py OUT.json --network vgg16:271 [--steps 3]
"""

import argparse
import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402 -- after the allocator's configuration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cap_memory, environment, make, sgd, sgd_step, write  # noqa: E402
import superneurons as sn  # noqa: E402
from superneurons.runtime import executor as executor_module, workspaces  # noqa: E402

CAP_GIB, BUDGET_GIB = 12.0, 11.5


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--network", default="vgg16:271")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    network, batch = args.network.split(":")
    cap_memory(CAP_GIB)
    budget = int(BUDGET_GIB * 2**30)
    rows, state = [], {"step": 0, "layer": None}

    original_limit = workspaces.WorkspaceFit._limit

    def limit(self, output_bytes):
        allocated, reserved = workspaces._stats(self.index)
        caller = original_limit(self, output_bytes)
        rows.append({"step": state["step"], "layer": state["layer"], "event": "limit",
                     "allocated": allocated, "reserved": reserved,
                     "outputs": sum(output_bytes), "limit": int(
                         torch.cuda.get_per_process_memory_fraction(self.index) * self.total),
                     "after_empty": workspaces._stats(self.index)})
        return caller

    original_call = executor_module.Executor._call

    def call(self, layer, args, kwargs, trains=False):
        state["layer"] = layer.name
        if layer.kind is executor_module.Kind.CONV:
            torch.cuda.reset_peak_memory_stats()
            out = original_call(self, layer, args, kwargs, trains)
            rows.append({"step": state["step"], "layer": layer.name, "event": "forward peak",
                         "peak": torch.cuda.max_memory_allocated(),
                         "calibrating": self.calibrating, "unfitted": self.unfitted})
            node = getattr(out, "grad_fn", None)
            if trains and node is not None:
                name = layer.name

                def before(grad_outputs, name=name):
                    state["layer"] = name
                    torch.cuda.reset_peak_memory_stats()

                def after(grad_inputs, grad_outputs, name=name):
                    rows.append({"step": state["step"], "layer": name, "event": "backward peak",
                                 "peak": torch.cuda.max_memory_allocated()})
                node.register_prehook(before)
                node.register_hook(after)
            return out
        return original_call(self, layer, args, kwargs, trains)

    workspaces.WorkspaceFit._limit = limit
    executor_module.Executor._call = call

    model, x, y = make(network, int(batch), "cuda")
    wrapped = sn.wrap(model, policy="superneurons", budget=budget)
    optimizer = sgd(model)
    steps = []
    for step in range(args.steps):
        state["step"] = step + 1
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        sgd_step(wrapped, optimizer, x, y)
        torch.cuda.synchronize()
        steps.append({"peak_allocated_bytes": max(
            [r["peak"] for r in rows if r["step"] == step + 1 and "peak" in r]
            + [torch.cuda.max_memory_allocated()])})
    over = [r for r in rows if r.get("peak", 0) > budget]
    write(args.out, {**environment(), "network": args.network, "budget_bytes": budget,
                     "cudnn_benchmark": torch.backends.cudnn.benchmark, "steps": steps,
                     "over_budget": over[:40], "rows": rows})


if __name__ == "__main__":
    main()
