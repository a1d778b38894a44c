"""Models nobody here wrote, trained at budgets where convolutions replay alone, the outputs of
the cheap layers after them kept (planner/trim.py): torchvision resnext50_32x4d and
mobilenet_v3_small, timm resnet26d and seresnext26d_32x4d, HF's ResNetForImageClassification
from a small config. 3 AdamW steps under "superneurons" and "recompute" at 75% and 90% of the
way from the policy's floor to the liveness peak, compared with plain PyTorch bit for bit
(tests/matrix.py), on the CPU; the record keeps how many of the chosen plan's segments replay a
convolution alone and how many replay a batch norm.

    python benchmarks/newcomers_conv_alone.py OUT_DIR  (writes newcomers_conv_alone.json)

With --bf16: timm resnet50d and ecaresnet26t instead, each step under the CPU's bf16 autocast,
"superneurons" and "recompute" at 85% of the way from each floor (sn.plan of that step) to
the liveness peak, 3 AdamW steps beside plain PyTorch, compared bit for bit (losses and state)
(writes newcomers_conv_alone_bf16.json).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOWARD = (0.75, 0.9)


def _hf_resnet():
    def build():
        import torch
        import transformers
        torch.manual_seed(0)
        config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[32, 64, 96, 128],
                                           depths=[1, 2, 1, 1], layer_type="bottleneck",
                                           num_labels=10)
        model = transformers.ResNetForImageClassification(config).train()
        x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
        return model, (), {"pixel_values": x, "labels": y}, lambda out: out.loss
    return build


def _bf16_rows() -> list:
    import copy
    import timm
    import torch
    import superneurons as sn
    from common import cpu_bf16_steps, replayed_alone
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))

    def steps(run, model) -> list:
        return cpu_bf16_steps(model, lambda: torch.nn.functional.cross_entropy(run(x), y))
    rows = []
    for name in ("resnet50d", "ecaresnet26t"):
        torch.manual_seed(0)
        base = timm.create_model(name, num_classes=10).train()
        liveness = sn.plan(base, x, policy="liveness", autocast=torch.bfloat16,
                           device_type="cpu").peak_bytes
        reference = copy.deepcopy(base)
        plain = steps(reference, reference)
        for policy in ("superneurons", "recompute"):
            floor = sn.plan(base, x, policy=policy, autocast=torch.bfloat16,
                            device_type="cpu").peak_bytes
            model = copy.deepcopy(base)
            wrapped = sn.wrap(model, policy=policy, budget=floor + int(0.85 * (liveness - floor)))
            losses = steps(wrapped, model)
            with torch.autocast("cpu", dtype=torch.bfloat16):      # the step's plan
                plan, _ = wrapped.plan_for(x)
            rows.append({"model": f"timm {name}", "policy": policy, "losses_equal": losses == plain,
                         "state_equal": all(torch.equal(a, b) for a, b in zip(
                             model.state_dict().values(), reference.state_dict().values())),
                         "replayed_layers": wrapped.stats.recomputed_layers,
                         "replayed_alone": replayed_alone(plan), "segments": len(plan.segments),
                         "offloaded_bytes": wrapped.stats.offloaded_bytes})
            print(rows[-1], flush=True)
    return rows


def main():
    sys.path.insert(0, HERE)
    if "--bf16" in sys.argv:
        from common import write
        out = [a for a in sys.argv[1:] if a != "--bf16"][0]
        write(os.path.join(out, "newcomers_conv_alone_bf16.json"), {"rows": _bf16_rows()})
        return
    import timm
    import torchvision
    from common import replayed_alone, write
    from newcomers_blocks_policies import under_recomputing_policies
    from newcomers_split import _image_model as _image
    from superneurons.capture import Kind

    def described(plan) -> dict:
        kinds = [[plan.graph.layers[l].kind for l in s.layers] for s in plan.segments]
        return {"segments": len(kinds), "replayed_alone": replayed_alone(plan),
                "replaying_batch_norms": sum(Kind.BN in k for k in kinds)}
    cases = {
        "torchvision resnext50_32x4d": _image(
            lambda: torchvision.models.resnext50_32x4d(num_classes=10)),
        "torchvision mobilenet_v3_small": _image(
            lambda: torchvision.models.mobilenet_v3_small(num_classes=10)),
        "timm resnet26d": _image(lambda: timm.create_model("resnet26d", num_classes=10)),
        "timm seresnext26d_32x4d": _image(
            lambda: timm.create_model("seresnext26d_32x4d", num_classes=10)),
        "HF ResNetForImageClassification": _hf_resnet(),
    }
    rows = under_recomputing_policies(cases, TOWARD, described)
    write(os.path.join(sys.argv[1], "newcomers_conv_alone.json"), {"rows": rows})


if __name__ == "__main__":
    main()
