"""Trial Rule 7 on two models nobody here wrote: HF GPTBigCodeForCausalLM (multi-query attention)
and timm mobilevitv2_050 (convolutions and attention over unfolded patches), under the CPU's bf16
autocast, "superneurons" and "recompute" at half of the way from each floor to the liveness peak.
Each runs STEPS AdamW steps, enough for the trial of plans (module Rule 10) to end, beside plain
PyTorch, compared bit for bit (losses and state); per run, what the trial timed (whether each
plan moves data, the plan kept) and the bytes the last step moved.

    PYTHONPATH=TREE:benchmarks python benchmarks/newcomers_moving_trial.py OUT_DIR
        (writes OUT_DIR/newcomers_moving_trial.json)
"""

import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# a CPU plan's first step, then the chosen plan's 3 and 4 for each of at most 3 tried, and more
STEPS = 20


def rows() -> list:
    import torch
    import superneurons as sn
    from common import cpu_bf16_steps
    from newcomers_idle_replays import _bigcode, _mobilevit
    out = []
    for name, build in (("HF GPTBigCodeForCausalLM", _bigcode),
                        ("timm mobilevitv2_050", _mobilevit)):
        torch.manual_seed(0)
        base, args, kwargs, loss_of = build()
        liveness = sn.plan(base, args, policy="liveness", autocast=torch.bfloat16,
                           device_type="cpu", kwargs=kwargs).peak_bytes
        reference = copy.deepcopy(base)
        plain = cpu_bf16_steps(reference, lambda: loss_of(reference(*args, **kwargs)), STEPS)
        for policy in ("superneurons", "recompute"):
            floor = sn.plan(base, args, policy=policy, autocast=torch.bfloat16,
                            device_type="cpu", kwargs=kwargs).peak_bytes
            model = copy.deepcopy(base)
            wrapped = sn.wrap(model, policy=policy, budget=floor + (liveness - floor) // 2)
            losses = cpu_bf16_steps(model, lambda: loss_of(wrapped(*args, **kwargs)), STEPS)
            out.append({
                "model": name, "policy": policy, "toward": 0.5,
                "losses_equal": losses == plain,
                "state_equal": all(torch.equal(a, b) for a, b in zip(
                    model.state_dict().values(), reference.state_dict().values())),
                "trials": [{"moves": [p["moves"] for p in t["plans"]], "kept": t["kept"]}
                           for t in wrapped.plan_trials],
                "last_step_moved_bytes": wrapped.stats.offloaded_bytes
                + wrapped.stats.prefetched_bytes,
                "replayed_layers": wrapped.stats.recomputed_layers})
            print(out[-1], flush=True)
    return out


def main():
    sys.path.insert(0, HERE)
    from common import write
    write(os.path.join(sys.argv[1], "newcomers_moving_trial.json"),
          {"command": "python benchmarks/newcomers_moving_trial.py OUT", "rows": rows()})


if __name__ == "__main__":
    main()
