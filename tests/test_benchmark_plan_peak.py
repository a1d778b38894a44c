"""benchmarks/plan_peak.py: what a plan holds at its peak, and the plan replaying every block's
convolutions alone."""

import os
import sys

import torch
import torchvision

import superneurons as sn
from superneurons.capture import Kind

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from plan_peak import convolutions_alone, live_at_peak  # noqa: E402


def test_the_peak_and_its_largest_storages_and_convolutions_alone():
    with torch.device("meta"):
        model = torchvision.models.resnet18(num_classes=10)
    graph = sn.plan(model, (torch.empty(8, 3, 64, 64, device="meta"),),
                    policy="liveness").graph
    liveness = sn.plan(model, (torch.empty(8, 3, 64, 64, device="meta"),), policy="liveness")
    alone = convolutions_alone(graph, liveness.peak_bytes)
    replayed = {graph.layers[l].kind for s in alone.segments for l in s.layers}
    assert replayed == {Kind.CONV}                      # every cheap layer's output kept
    found = live_at_peak(alone, top=5)
    assert found["kept_peak_bytes"] == max(alone._kept_live)
    sizes = [entry["bytes"] for entry in found["largest"]]
    assert len(sizes) == 5 and sizes == sorted(sizes, reverse=True)
    assert found["kept_peak_bytes"] < liveness.peak_bytes     # the replays free something
