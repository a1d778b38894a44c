"""How close the superneurons plan comes to resident + l_peak, per network and batch (planner only).

    python benchmarks/plan_bounds.py [OUT_DIR]
"""

import sys

import torch

from superneurons import models
from superneurons.capture import capture
from superneurons.planner import plan_graph
from common import write

NETWORKS = ["alexnet", "vgg16", "resnet50", "resnet101", "resnet152", "inception_v4",
            "densenet121"]

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "results"
    rows = {}
    for name in NETWORKS:
        with torch.device("meta"):
            model = models.build(name)
        rows[name] = {}
        for batch in (16, 32, 64):
            plan = plan_graph(capture(model, models.input_shape(name, batch)), "superneurons")
            bound = plan.resident_bytes + plan.max_layer_bytes
            rows[name][batch] = {"peak_bytes": plan.peak_bytes, "bound_bytes": bound,
                                 "ratio": round(plan.peak_bytes / bound, 4)}
        print(name, {b: r["ratio"] for b, r in rows[name].items()}, flush=True)
    with torch.device("meta"):     # the depth target: model state alone at ResNet-2624
        deep = models.resnet(blocks=(3, 4, 864, 3))
    param_bytes = sum(p.numel() * p.element_size() for p in deep.parameters())
    write(f"{out}/plan_bounds.json", {"what": "superneurons predicted peak / (resident + l_peak)",
                                      "results": rows,
                                      "resnet2624_param_bytes": param_bytes,
                                      "resnet2624_params_grads_momentum_bytes": 3 * param_bytes})
