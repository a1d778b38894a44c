"""The route on the paper's Figure 6, and topological order on every zoo network."""

import pytest
import torch
from torch import nn

from superneurons.capture import capture
from superneurons.planner import plan_graph
from conftest import meta_model


class Join3(nn.Module):
    def forward(self, x, y, z):
        return torch.cat((x, y, z), 1)      # one operation: one layer


class NestedFans(nn.Module):
    """Figure 6: fan (b, c, d) with fan (f, g, h) nested in it; i joins e, g and h."""

    def __init__(self):
        super().__init__()
        for name in "abcdefghj":
            setattr(self, name, nn.Tanh())
        self.i = Join3()

    def forward(self, x):
        b = self.b(self.a(x))
        c, d = self.c(b), self.d(b)
        e, f = self.e(c), self.f(d)
        g, h = self.g(f), self.h(f)
        return self.j(self.i(e, g, h))


def test_figure6_route_runs_the_model_s_own_order_and_waits_for_every_branch():
    """Program order (the paper's depth-first Algorithm 1 would run e before d: planner/route.py
    says why the model's own order is kept); the join i runs after all its branches."""
    graph = capture(NestedFans(), (2, 3))
    plan = plan_graph(graph, "liveness")
    assert plan.route == list("abcdefghij")
    assert {graph.layers[d].name for d in graph.deps(graph.layer("i").index)} == {"e", "g", "h"}
    assert len(plan.steps) == 2 * len(plan.route)
    assert [s.layer for s in plan.steps[10:]] == list("jihgfedcba")


ZOO = ["alexnet", "vgg16", "vgg19", "resnet50", "inception_v4", "densenet121", "densenet_cifar"]


@pytest.mark.parametrize("name", ZOO)
def test_route_is_topological_on_the_zoo(name):
    from superneurons.models import input_shape
    graph = capture(meta_model(name), input_shape(name, 2))
    plan = plan_graph(graph, "liveness")
    position = {layer: p for p, layer in enumerate(plan.order)}
    assert sorted(plan.order) == list(range(len(graph.layers)))
    for layer in graph.layers:
        assert all(position[d] < position[layer.index] for d in graph.deps(layer.index))
