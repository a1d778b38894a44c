"""The planner counts the Tensor Pool's tensors as the pool does (pool Rule 5): on CUDA each
rounded up to the allocator's 2 MiB page. A plan said to move nothing then moves nothing; counted
byte for byte, a network of many small saved tensors (squeeze-excitation blocks) moved data
every step within a budget its plan said it fitted. Here on the CPU with a smaller page."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import torchvision

import superneurons as sn
from superneurons.planner import plan_graph
from superneurons.planner.costs import OFF_CUDA
from superneurons.runtime import module
from superneurons.runtime.pool import TensorPool

PAGE = 256 << 10
PAGED = dataclasses.replace(OFF_CUDA, pool_page_bytes=PAGE)


def mobilenet_and_batch():
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    return model, torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))


def budget_between(graph, share: float) -> int:
    floor = plan_graph(graph, "superneurons", machine=OFF_CUDA).peak_bytes
    liveness = plan_graph(graph, "liveness", machine=OFF_CUDA).peak_bytes
    return floor + int(share * (liveness - floor))


def test_pages_make_a_plan_replay_more_to_move_nothing():
    model, x, _ = mobilenet_and_batch()
    graph = sn.plan(model, x, policy="liveness").graph
    budget = budget_between(graph, 0.7)
    by_bytes = plan_graph(graph, "superneurons", budget, machine=OFF_CUDA)
    by_pages = plan_graph(graph, "superneurons", budget, machine=PAGED)
    assert by_bytes.moves_nothing_within(budget) and by_pages.moves_nothing_within(budget)
    assert by_pages.num_extra_computations > by_bytes.num_extra_computations
    # the plan counted byte for byte, counted in pages, moves data within that budget
    assert dataclasses.replace(by_bytes, costs=by_pages.costs).bytes_to_move(budget) > 0
    assert by_pages.bytes_to_move(budget) == 0


@pytest.mark.parametrize("planned_page", [PAGE, 1], ids=["pages", "bytes"])
def test_a_plan_said_to_move_nothing_moves_nothing_in_a_paged_pool(planned_page, monkeypatch):
    """The pool counts pages either way; the planner counts them, or (the control) bytes."""
    machine = dataclasses.replace(PAGED, pool_page_bytes=planned_page)
    monkeypatch.setattr(module, "machine_of", lambda device: machine)
    made = TensorPool.__init__

    def paged_pool(self, device, allowance, footprint=None):
        made(self, device, allowance, PAGED.pool_bytes)
    monkeypatch.setattr(TensorPool, "__init__", paged_pool)
    model, x, y = mobilenet_and_batch()
    budget = budget_between(sn.plan(model, x, policy="liveness").graph, 0.7)
    plain = copy.deepcopy(model)
    wrapped = sn.wrap(model, policy="superneurons", budget=budget)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, model)]
    moved = []
    for step in range(3):
        losses = []
        for run, optimizer in zip((plain, wrapped), optimizers):
            torch.manual_seed(step)                    # the same dropout masks
            optimizer.zero_grad()
            loss = F.cross_entropy(run(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        assert torch.equal(*losses)
        assert wrapped.stats.peak_bytes <= budget
        moved.append(wrapped.stats.offloaded_bytes)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                   model.state_dict().values()))
    if planned_page == PAGE:
        assert moved == [0, 0, 0]
    else:
        assert all(m > 0 for m in moved)
