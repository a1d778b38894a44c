"""The zoo's plans at the largest batches and depths the records claim, within 11.5 GiB (the
room of a claim's first step, before momentum): peak, replays, segments, bytes the Tensor
Cache moves. Planner only (CPU, meta tensors): run it on two checkouts to show that a change
left the zoo's plans, and so its records, as they were.

    python benchmarks/zoo_plans.py OUT.json
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import superneurons as sn  # noqa: E402
from benchmarks.common import environment, write  # noqa: E402
from superneurons import models  # noqa: E402
from superneurons.models import zoo  # noqa: E402

# the README's claims (claims.py; zoo_plans.json was made at the one-step largest batches
# before them, some of which no longer fit beside the plans' slack), and ResNet-50 at twice
# plain's largest
CASES = [("resnet50", 896), ("resnet101", 896), ("resnet152", 869), ("densenet201", 783),
         ("inception_v4", 450), ("vgg16", 265), ("alexnet", 2124), ("resnet50", 280)]
# the depth claims (claims.py): the ResNet [3, 4, 865, 3] at batch 16, DenseNet-BC 2206 at 64
DEPTHS = [("resnet_depth_2627", 865, 16), ("densenet_bc_depth_2206", 2206, 64)]


def zoo_case(name: str, batch: int) -> tuple:
    """(key, model, input shape) of a zoo network at a batch."""
    return f"{name}@{batch}", zoo.build(name), zoo.input_shape(name, batch)


def depth_case(name: str, size: int, batch: int) -> tuple:
    """(key, model, input shape) of a depth claim, as benchmarks/common.py builds it."""
    if name.startswith("resnet"):
        return name, models.resnet(blocks=(3, 4, size, 3)), (batch, 3, 224, 224)
    return name, models.densenet(size, 12, cifar=True), (batch, 3, 32, 32)


def main(out: str) -> None:
    record = {**environment(), "part": "zoo_plans", "budget": "11.5GiB", "rows": {}}
    for make, case in [(zoo_case, c) for c in CASES] + [(depth_case, c) for c in DEPTHS]:
        with torch.device("meta"):
            key, model, shape = make(*case)
        plan = sn.plan(model, shape, policy="superneurons", budget="11.5GiB")
        record["rows"][key] = {
            "peak_bytes": plan.peak_bytes, "extra_computations": plan.num_extra_computations,
            "layers": len(plan.order), "segments": len(plan.segments),
            "bytes_to_move": plan.bytes_to_move("11.5GiB")}
        print(key, record["rows"][key], flush=True)
    write(out, record)


if __name__ == "__main__":
    main(sys.argv[1])
