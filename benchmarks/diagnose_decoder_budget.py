"""Where a decoder's step goes over its budget: per layer call of the last step, device memory
before the call and at its high point, against what the executor allowed for (the plan's bytes
outside the pool at that step, the pool's own, and the calibrated excess).

    python benchmarks/diagnose_decoder_budget.py OUT.json [--decoder 7 ints] [--batch 4]

Runs state_tier.py's decoder case (state on the host, bf16 autocast) with Executor._call
wrapped; the record keeps the 25 calls furthest over the budget and over their allowance. The
allocator's peak is reset around every call, so the case's own per-step peaks in the record
are the last call's, not the step's.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--decoder", type=int, nargs=7, default=[2048, 22, 5632, 32, 4, 32000, 2048])
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    import state_tier
    torch = state_tier._setup()
    from superneurons.runtime import executor as executor_module
    calls = []
    call = executor_module.Executor._call

    def measured(self, layer, call_args, kwargs, trains=False):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        try:
            return call(self, layer, call_args, kwargs, trains)
        finally:
            step = self.backward_step if self.backward_step is not None else \
                self.plan.timeline.fwd(layer.index)
            step = min(max(step, 0), len(self.unmanaged) - 1)
            calls.append({"layer": layer.name, "kind": str(layer.kind), "step": step,
                          "backward": self.backward_step is not None, "replay": not trains,
                          "before": before, "high": torch.cuda.max_memory_allocated(),
                          "pool": self.pool.device_bytes, "unmanaged": self.unmanaged[step],
                          "excess": self.excess_bytes, "budget": self.budget_bytes})
    executor_module.Executor._call = measured
    steps_taken = []
    original_steps = state_tier._steps

    def steps(torch_, wrapped, step_fn, budget_bytes):
        def step():
            calls.clear()
            step_fn()
        rows = original_steps(torch_, wrapped, step, budget_bytes)
        steps_taken.extend(rows)
        return rows
    state_tier._steps = steps
    row = state_tier.decoder_case(*args.decoder, args.batch)
    for c in calls:
        c["over_budget"] = c["high"] - c["budget"]
        c["over_allowance"] = c["high"] - (c["pool"] + c["unmanaged"] + (c["excess"] or 0))
    record = {"case": row, "calls": len(calls),
              "most_over_budget": sorted(calls, key=lambda c: -c["over_budget"])[:25],
              "most_over_allowance": sorted(calls, key=lambda c: -c["over_allowance"])[:25]}
    from common import write
    write(args.out, record)


if __name__ == "__main__":
    main()
