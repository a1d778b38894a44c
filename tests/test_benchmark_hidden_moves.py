"""benchmarks/hidden_moves.py's plans for a larger room, run within the budget: they must replay
less than the budget's own plan, move data within it, and be said to be made for it, or the
wrapper makes them again at every step (module Rule 3) and times that instead of the moves."""

import os
import sys

import pytest
import torch
import torchvision

import superneurons as sn
import superneurons.runtime.module as module
import superneurons.runtime.trial as trial
from superneurons.runtime.room import managed_holds

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from hidden_moves import plans_for_a_larger_room  # noqa: E402


def test_a_plan_for_a_larger_room_moves_within_the_budget_and_is_kept(monkeypatch):
    monkeypatch.setattr(module, "plan_graph", module.plan_graph)       # restored after
    monkeypatch.setattr(trial, "others_within", trial.others_within)
    with torch.device("meta"):      # planned only: activations large beside the state
        model = torchvision.models.resnet18(num_classes=10)
    x = torch.empty(16, 3, 128, 128, device="meta")
    liveness = sn.plan(model, (x,), policy="liveness")
    graph, peak = liveness.graph, liveness.peak_bytes
    floor = module.plan_graph(graph, "superneurons").peak_bytes
    budget = floor + (peak - floor) // 2
    own = module.plan_graph(graph, "superneurons", budget)

    plans_for_a_larger_room(1.3)
    larger = module.plan_graph(graph, "superneurons", budget)
    assert larger.budget_bytes == budget
    assert larger.num_extra_computations < own.num_extra_computations
    assert own.moves_nothing_within(budget) and not larger.moves_nothing_within(budget)
    assert managed_holds(larger, budget, 0)          # not made again at the next step
    with pytest.raises(ValueError):      # liveness is planned for the budget: not untouched
        module.plan_graph(graph, "liveness", budget)
    assert trial.others_within() == ([], True)       # no plan tried beside it
