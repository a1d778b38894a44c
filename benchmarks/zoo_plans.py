"""The zoo's plans at the largest batches the records claim, within 11.5 GiB: peak, replays,
bytes the Tensor Cache moves. Planner only (CPU, meta tensors): run it on two checkouts to show
that a change left the zoo's plans, and so its records, as they were.

    python benchmarks/zoo_plans.py OUT.json
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import superneurons as sn  # noqa: E402
from benchmarks.common import environment, write  # noqa: E402
from superneurons.models import zoo  # noqa: E402

# the README's claims (claims.py; zoo_plans.json was made at the one-step largest batches
# before them, some of which no longer fit beside the plans' slack), and ResNet-50 at twice
# plain's largest
CASES = [("resnet50", 896), ("resnet101", 896), ("resnet152", 869), ("densenet201", 783),
         ("inception_v4", 450), ("vgg16", 265), ("alexnet", 2124), ("resnet50", 280)]


def main(out: str) -> None:
    record = {**environment(), "part": "zoo_plans", "budget": "11.5GiB", "rows": {}}
    for name, batch in CASES:
        with torch.device("meta"):
            model = zoo.build(name)
        plan = sn.plan(model, zoo.input_shape(name, batch), policy="superneurons",
                       budget="11.5GiB")
        record["rows"][f"{name}@{batch}"] = {
            "peak_bytes": plan.peak_bytes, "extra_computations": plan.num_extra_computations,
            "layers": len(plan.order), "bytes_to_move": plan.bytes_to_move("11.5GiB")}
        print(name, batch, record["rows"][f"{name}@{batch}"], flush=True)
    write(out, record)


if __name__ == "__main__":
    main(sys.argv[1])
