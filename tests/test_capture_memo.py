"""Capture Rule 4: reusing an earlier layer's pattern gives the graph a full run would give."""

import dataclasses
import importlib

import pytest
import torch
from torch import nn

from superneurons.capture import capture
from superneurons.models import input_shape
from conftest import meta_model
from test_runtime_cases import Traps

trace = importlib.import_module("superneurons.capture.trace")   # the module, not the function


def _graph_facts(graph) -> tuple:
    layers = [(l.name, l.kind, l.inputs, l.outputs, l.saved, l.mutates, l.random)
              for l in graph.layers]
    return (layers, [dataclasses.astuple(v) for v in graph.values],
            [dataclasses.astuple(s) for s in graph.storages], graph.input_values,
            graph.output_values, graph.param_bytes, graph.buffer_bytes, graph.order_deps)


class _Views(nn.Module):
    """Views, chunks, in-place writes into views and a user module: what the memo must not
    confuse."""

    def __init__(self):
        super().__init__()
        self.scale = _Scale(2.0)
        self.other = _Scale(3.0)     # same class, different behaviour the repr does not show

    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        c, d = x.chunk(2, dim=1)
        a = torch.relu(a)
        c = torch.relu(c)
        e = self.scale(a) + self.other(c)
        f = e.view(e.shape[0], -1)
        g = f.view(e.shape[0], -1)
        g.add_(1)
        return torch.log_softmax(g + b.flatten(1) + d.flatten(1), dim=1)


class _Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor if self.factor > 2.5 else x.repeat(1, 1, 1, 1) * self.factor


@pytest.mark.parametrize("name", ["resnet50", "densenet121", "inception_v4", "alexnet"])
def test_memoized_capture_equals_a_full_run(name, monkeypatch):
    model, shape = meta_model(name), input_shape(name, 2)
    memoized = capture(model, shape)
    monkeypatch.setattr(trace, "memo_key", lambda *args: None)
    full = capture(model, shape)
    assert _graph_facts(memoized) == _graph_facts(full)


@pytest.mark.parametrize("make", [Traps, _Views])
def test_memoized_capture_equals_a_full_run_on_traps(make, monkeypatch):
    model, x = make(), torch.randn(2, 8, 6, 6)
    if make is Traps:
        x = torch.randn(2, 3, 8, 8)
    memoized = capture(model, x)
    monkeypatch.setattr(trace, "memo_key", lambda *args: None)
    full = capture(model, x)
    assert _graph_facts(memoized) == _graph_facts(full)


def test_repeated_layers_are_run_once(monkeypatch):
    calls = []
    original = trace.Analyzer._run

    def counting(self, *args):
        calls.append(args[2])
        return original(self, *args)
    monkeypatch.setattr(trace.Analyzer, "_run", counting)
    graph = capture(meta_model("resnet", depth=152), (2, 3, 64, 64))
    assert len(calls) < len(graph.layers) // 3
