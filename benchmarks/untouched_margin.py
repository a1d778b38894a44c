"""How far the untouched path's real peak lies above its plan, and whether it trains at a
budget of exactly its plan's peak (plus what the model does not own) with strict_budget (the
allocator limited to the budget, runtime/allocator_cap.py) and without.

    python benchmarks/untouched_margin.py OUT.json MODEL:DTYPE [...]

Models, batches and inputs as ratio.py builds them; plain SGD without momentum, so that what the
model does not own stays the same from step to step and the wrapped model stays untouched. Per
config, three fresh processes: plain PyTorch, wrapped with the cap, wrapped without. Each runs
STEPS steps and records, per step, the peak allocated bytes from the forward to the end of the
backward.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


def child(name: str, dtype: str, system: str, strict: str) -> dict:
    import torch
    import superneurons as sn
    from superneurons.runtime.room import foreign_bytes
    from common import torch_settings
    from ratio import build
    torch_settings()                 # expandable segments, no TF32: before any CUDA work
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model, args, kwargs, loss_of = build(name, "plain", device)
    autocast = torch.bfloat16 if dtype == "bf16" else None
    plan = sn.plan(model, args, policy="liveness", kwargs=kwargs, autocast=autocast)
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    foreign = foreign_bytes(plan.graph, tensors, device, model.parameters(),
                            state_on_device=True)
    budget = plan.peak_bytes + foreign
    run = model if system == "plain" else sn.wrap(model, policy="superneurons", budget=budget,
                                                  strict_budget=strict == "1")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    peaks = []
    try:
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = loss_of(run(*args, **kwargs))
            loss.backward()
            peaks.append(torch.cuda.max_memory_allocated(device))
            optimizer.step()
    except (torch.OutOfMemoryError, RuntimeError) as error:     # the wrapper's own, too
        return {"ok": False, "error": str(error).splitlines()[0][:300], "peaks": peaks,
                "plan_peak_bytes": plan.peak_bytes, "budget_bytes": budget}
    untouched = None if system == "plain" else run.plan_for(*args, **kwargs)[1] is None
    return {"ok": True, "plan_peak_bytes": plan.peak_bytes, "foreign_bytes": foreign,
            "budget_bytes": budget, "peaks": peaks, "untouched": untouched,
            "over_budget_bytes": max(peaks) - budget}


def main():
    if sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:6])), flush=True)
        return
    sys.path.insert(0, HERE)
    from common import run_child, write
    out = sys.argv[1]
    record = {"steps": STEPS, "rows": []}
    for config in sys.argv[2:]:
        name, dtype = config.split(":")
        for system, switch in (("plain", "1"), ("wrapped", "1"), ("wrapped", "0")):
            row = run_child([sys.executable, __file__, "--child", name, dtype, system, switch],
                            240, cwd=HERE)
            row = {"model": name, "dtype": dtype, "system": system,
                   "strict_budget": system != "plain" and switch == "1", **row}
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
            write(out, record, quiet=True)


if __name__ == "__main__":
    main()
