"""Models nobody here wrote, trained under superneurons with budgets near its floor, where data
must move and blocks are replayed with their convolutions, whole or cut (planner/trim.py):
3 AdamW steps each, compared with plain PyTorch bit for bit (tests/matrix.py), on the CPU.

    python benchmarks/newcomers_split.py OUT_DIR     (writes OUT_DIR/newcomers_split.json)

The budget is TOWARD of the way from the policy's floor to the liveness plan's peak.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOWARD = (0.05, 0.2)


def _image_model(make):
    def build():
        import torch
        model = make().train()
        x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
        return model, (x,), {}, lambda out: torch.nn.functional.cross_entropy(out, y)
    return build


def main():
    sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
    import timm
    import torchvision
    import superneurons as sn
    import matrix
    from common import write
    from superneurons.capture import Kind
    cases = {
        "timm rexnet_100": lambda: timm.create_model("rexnet_100", num_classes=10),
        "torchvision regnet_y_400mf": lambda: torchvision.models.regnet_y_400mf(num_classes=10),
        "timm resnet26d": lambda: timm.create_model("resnet26d", num_classes=10),
    }
    made = []
    wrap = matrix.sn.wrap
    matrix.sn.wrap = lambda *a, **k: made.append(wrap(*a, **k)) or made[-1]
    rows = []
    for name, make in cases.items():
        build = _image_model(make)
        build.__qualname__ = name
        model, args, _, _ = build()
        floor = sn.plan(model, args[0], policy="superneurons").peak_bytes
        liveness = sn.plan(model, args[0], policy="liveness").peak_bytes
        for toward in TOWARD:
            budget = floor + int(toward * (liveness - floor))
            outcome = matrix.compare(build, "superneurons", steps=3, optimizer="adamw",
                                     budget=budget)
            plan, _ = made[-1].plan_for(*args)
            rows.append({
                "model": name, "toward": toward, "budget_bytes": budget,
                "status": outcome.status,
                "replayed_layers": outcome.stats["recomputed_layers"],
                "offloaded_bytes": outcome.stats["offloaded_bytes"],
                "replayed_convolutions": sum(plan.graph.layers[l].kind is Kind.CONV
                                             for l in plan.segment_of())})
            print(rows[-1], flush=True)
    write(os.path.join(sys.argv[1], "newcomers_split.json"), {"rows": rows})


if __name__ == "__main__":
    main()
