"""Executor Rule 4 on made-up allocator readings: the excess of real use over the plan, learned at
layer boundaries in a plan's first steps."""

import pytest
import torch

from superneurons.runtime import calibration
from superneurons.runtime.calibration import Calibration, FIRST_STEP_MARGIN

MIB = 1 << 20


@pytest.fixture
def allocator(monkeypatch):
    held = {"bytes": 0}
    monkeypatch.setattr(calibration, "allocated_bytes", lambda device: held["bytes"])
    return held


def test_the_largest_excess_seen_is_left_at_every_later_step(allocator):
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB)
    assert steps.begin_step()
    assert steps.outside(100 * MIB) == int(FIRST_STEP_MARGIN * 100 * MIB)   # nothing seen yet
    for step, (planned, real) in enumerate(((100, 130), (300, 310), (200, 180))):
        allocator["bytes"] = (50 + 40 + real) * MIB          # user's 50, pool's 40
        steps.observe(step, others=50 * MIB, planned=planned * MIB, pool=40 * MIB)
    assert steps.seen_excess == 30 * MIB and steps.seen_at == 0
    assert steps.begin_step()                                # the second calibrating step
    assert steps.outside(100 * MIB) == 130 * MIB + steps.slack
    assert not steps.begin_step()                            # later steps trust it
    assert steps.outside(100 * MIB) == 130 * MIB + steps.slack


def test_an_out_of_memory_retry_calibrates_again(allocator):
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB)
    for _ in range(2):
        steps.begin_step()
    assert not steps.begin_step()
    steps.again()
    assert steps.begin_step()
