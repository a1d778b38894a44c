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
    write(f"{out}/plan_bounds.json", {"what": "superneurons predicted peak / (resident + l_peak)",
                                      "results": rows})
