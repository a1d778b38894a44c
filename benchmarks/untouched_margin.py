"""How far the untouched path's real peak lies above its plan, and whether the wrapper holds
the budget there (module Rule 2, runtime/untouched.py).

    python benchmarks/untouched_margin.py OUT.json MODEL:DTYPE[:plan|:margin] [...]

Models, batches and inputs as ratio.py builds them; plain SGD without momentum, so that what the
model does not own stays the same from step to step. Per config, fresh processes: plain PyTorch
at the liveness plan's peak plus what the model does not own, and the wrapper at that budget
("plan": within the margin, so managed) and at the plan with the untouched margin ("margin"),
each with the allocator limited to the budget (strict) or not. Each runs STEPS steps and records,
per step, the peak allocated bytes from the forward to the end of the backward and whether the
wrapped step ran untouched.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3
# (system, strict_budget, budget at): plain at the plan; the wrapper at the plan (within the
# untouched margin: managed) and at the plan and the margin, with the allocator limited or not
SYSTEMS = (("plain", "0", "plan"), ("wrapped", "1", "plan"), ("wrapped", "0", "plan"),
           ("wrapped", "1", "margin"), ("wrapped", "0", "margin"))


def child(name: str, dtype: str, system: str, strict: str, budget_at: str) -> dict:
    import torch
    import superneurons as sn
    from superneurons.runtime.room import foreign_bytes
    from superneurons.runtime.calibration import SLACK_SHARE
    from superneurons.runtime.untouched import UNTOUCHED_MARGIN
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
    if budget_at == "margin":   # and the executor's slack: what the first step leaves (cuBLAS's
        budget += int((UNTOUCHED_MARGIN + SLACK_SHARE) * plan.peak_bytes)   # workspaces) grows
    run = model if system == "plain" else sn.wrap(model, policy="superneurons", budget=budget,
                                                  strict_budget=strict == "1")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    peaks, untouched = [], []
    try:
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = loss_of(run(*args, **kwargs))
            loss.backward()
            peaks.append(torch.cuda.max_memory_allocated(device))
            if system != "plain":
                untouched.append(run.stats.policy == "liveness")
            optimizer.step()
    except (torch.OutOfMemoryError, RuntimeError) as error:     # the wrapper's own, too
        return {"ok": False, "error": str(error).splitlines()[0][:300], "peaks": peaks,
                "untouched": untouched, "plan_peak_bytes": plan.peak_bytes,
                "budget_bytes": budget}
    return {"ok": True, "plan_peak_bytes": plan.peak_bytes, "foreign_bytes": foreign,
            "budget_bytes": budget, "peaks": peaks, "untouched": untouched or None,
            "over_budget_bytes": max(peaks) - budget}


def main():
    if sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:7])), flush=True)
        return
    sys.path.insert(0, HERE)
    from common import run_child, write
    out = sys.argv[1]
    record = {"steps": STEPS, "rows": []}
    for config in sys.argv[2:]:
        name, dtype, *only = config.split(":")          # MODEL:DTYPE[:plan|margin]
        for system, strict, budget_at in SYSTEMS:
            if only and budget_at not in only:
                continue
            row = run_child([sys.executable, __file__, "--child", name, dtype, system, strict,
                             budget_at], 240, cwd=HERE)
            row = {"model": name, "dtype": dtype, "system": system, "budget_at": budget_at,
                   "strict_budget": strict == "1", **row}
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
            write(out, record, quiet=True)


if __name__ == "__main__":
    main()
