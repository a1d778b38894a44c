"""Whether moving a little over the host link beats replaying more, at a fixed memory ratio: a
model capped at RATIO of plain PyTorch's peak (results/ratio_MODEL_DTYPE.json, as ratio.py caps
it), superneurons running the plan made for its budget (nothing moved) against plans made for a
room F times the budget and run within the same budget, the Tensor Cache moving what does not
fit to the host and back beside the step's compute. The trial of plans (module Rule 10) is off
in every run, so each runs the plan it made first. Plain uncapped runs first, for the share. A
fresh process per run; the budget's hold is read per step (max_memory_allocated).

    python benchmarks/hidden_moves.py OUT_DIR [--model resnet50] [--dtype bf16] [--ratio 0.5]
        [--rooms 1 1.1 1.2 1.35] [--steps 8] [--profile [--stacks]]

With --profile, two more steps of each run under torch.profiler (profile_ratio.profiled): its
kernels by kind, the copies among them, and the host's waits (with --stacks, by the Python
frames they were called from). Writes OUT_DIR/hidden_moves.json.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WARM = 5          # the first step, two calibrating ones (executor Rule 4) and two more


def plans_for_a_larger_room(room: float):
    """Make the wrapper's plans for ``room`` times its budget (each said to be made for the
    budget itself) and time no other plans: returns the planning function it now calls."""
    import superneurons.runtime.module as module
    import superneurons.runtime.trial as trial
    from superneurons.planner import Policy, parse_policy
    plan_graph = module.plan_graph

    def for_a_larger_room(graph, policy, budget=None, *args, **kwargs):
        if budget is None or parse_policy(policy) is Policy.LIVENESS:
            return plan_graph(graph, policy, budget, *args, **kwargs)
        # said to be made for the budget itself: a plan whose own budget it fits with nothing
        # moved is made again where it would move (module Rule 3), at every step
        return dataclasses.replace(plan_graph(graph, policy, int(budget * room), *args,
                                              **kwargs), budget_bytes=budget)
    module.plan_graph = for_a_larger_room
    trial.others_within = lambda *args, **kwargs: ([], True)               # no trial
    return for_a_larger_room


def child(name: str, dtype: str, ratio: float, room: float | None, steps: int,
          profile: bool, stacks: bool = False) -> dict:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    from common import torch_settings
    from ratio import prepare, recorded_plain_peak
    torch_settings()
    device = torch.device("cuda", 0)
    if room is not None:
        plans_for_a_larger_room(room)
    system = "plain" if room is None else "superneurons"
    run, step, cap, _ = prepare(name, dtype, system, ratio if room else None,
                                   recorded_plain_peak(name, dtype) if room else None, device)
    seconds, peaks, moved = [], [], []
    try:
        for _ in range(WARM + steps):
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize()
            began = time.perf_counter()
            step()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - began)
            peaks.append(torch.cuda.max_memory_allocated(device))
            if room is not None:
                moved.append(run.stats.offloaded_bytes + run.stats.prefetched_bytes)
    except torch.OutOfMemoryError as error:
        return {"room": room, "ok": False, "error": str(error)[:600], "steps_run": len(seconds)}
    steady = sorted(seconds[WARM:])
    row = {"room": room, "ok": True, "step_s": steady[len(steady) // 2], "seconds": seconds,
           "peak_allocated_bytes": peaks, "cap_bytes": cap}
    if room is not None:
        row.update(moved_bytes=moved, replayed_layers=run.stats.recomputed_layers,
                   budget_bytes=run.budget_bytes, held=all(p <= cap for p in peaks[1:]),
                   last_step=run.stats.as_dict())
    if profile:
        from profile_ratio import profiled
        row["profile"] = profiled(step, 2, stacks=stacks)
        if room is not None:
            row["profiled_step"] = run.stats.as_dict()
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rooms", nargs="*", type=float, default=[1.0, 1.1, 1.2, 1.35])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--stacks", action="store_true")
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    if args.child is not None:
        room = None if args.child == "plain" else float(args.child)
        print(json.dumps(child(args.model, args.dtype, args.ratio, room, args.steps,
                               args.profile, args.stacks)))
        return
    from common import environment, run_child, write
    record = {**environment(), "command": "python benchmarks/hidden_moves.py " +
              " ".join(sys.argv[2:]), "model": args.model, "dtype": args.dtype,
              "ratio": args.ratio, "rows": []}
    for room in ["plain", *map(str, args.rooms)]:
        result = run_child([sys.executable, __file__, args.out, "--model", args.model,
                            "--dtype", args.dtype, "--ratio", str(args.ratio),
                            "--steps", str(args.steps), "--child", room,
                            *(["--profile"] if args.profile else []),
                            *(["--stacks"] if args.stacks else [])], timeout=240)
        record["rows"].append(result)
        plain = record["rows"][0].get("step_s")
        if result.get("ok") and plain:
            result["of_plain"] = plain / result["step_s"]
        print(room, {k: v for k, v in result.items()
                     if k not in ("seconds", "peak_allocated_bytes", "last_step")}, flush=True)
        write(os.path.join(args.out, "hidden_moves.json"), record, quiet=True)
    write(os.path.join(args.out, "hidden_moves.json"), record)


if __name__ == "__main__":
    main()
