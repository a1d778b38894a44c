"""Models nobody here wrote, trained at budgets where convolutions replay alone, the outputs of
the cheap layers after them kept (planner/trim.py): torchvision resnext50_32x4d and
mobilenet_v3_small, timm resnet26d and seresnext26d_32x4d, HF's ResNetForImageClassification
from a small config. 3 AdamW steps under "superneurons" and "recompute" at 75% and 90% of the
way from the policy's floor to the liveness peak, compared with plain PyTorch bit for bit
(tests/matrix.py), on the CPU; the record keeps how many of the chosen plan's segments replay a
convolution alone and how many replay a batch norm.

    python benchmarks/newcomers_conv_alone.py OUT_DIR  (writes newcomers_conv_alone.json)
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


def main():
    sys.path.insert(0, HERE)
    import timm
    import torchvision
    from common import write
    from newcomers_blocks_policies import under_recomputing_policies
    from newcomers_split import _image_model as _image
    from superneurons.capture import Kind
    from superneurons.planner.policy import CHECKPOINT_KINDS

    def described(plan) -> dict:
        kinds = [[plan.graph.layers[l].kind for l in s.layers] for s in plan.segments]
        return {"segments": len(kinds),
                "replayed_alone": sum(len(k) == 1 and k[0] in CHECKPOINT_KINDS for k in kinds),
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
