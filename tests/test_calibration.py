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


def test_the_excess_seen_at_a_step_is_left_there_in_later_steps(allocator):
    planned = [100 * MIB, 300 * MIB, 200 * MIB, 250 * MIB, 50 * MIB]
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB, planned=planned)
    assert steps.begin_step()
    assert steps.outside(0, 0) == int(FIRST_STEP_MARGIN * 100 * MIB)   # nothing seen yet
    assert steps.outside(0, 4) == int(FIRST_STEP_MARGIN * 300 * MIB)
    real = {0: 130, 1: 310, 2: 180, 4: 50}                   # step 3 is not read
    for step, mib in real.items():
        allocator["bytes"] = (50 + 40 + mib) * MIB           # user's 50, pool's 40
        steps.observe(step, others=50 * MIB, planned=planned[step], pool=40 * MIB)
    assert steps.seen_excess == 30 * MIB and steps.seen_at == 0
    assert steps.begin_step()                                # the second calibrating step
    slack = steps.slack
    assert steps.outside(0, 0) == 130 * MIB + slack          # its own excess
    assert steps.outside(1, 1) == 310 * MIB + slack
    assert steps.outside(2, 2) == 200 * MIB + slack          # none there: not step 0's 30
    assert steps.outside(3, 3) == 250 * MIB + slack          # not read: its neighbours' 0
    assert steps.outside(0, 4) == 310 * MIB + slack          # planned plus excess, at its most
    assert steps.excess_bytes == 30 * MIB + slack
    allocator["bytes"] = (50 + 40 + 270) * MIB               # the second step reads 20 at 3
    steps.observe(3, others=50 * MIB, planned=planned[3], pool=40 * MIB)
    assert not steps.begin_step()                            # later steps trust both
    assert steps.outside(3, 3) == 270 * MIB + slack
    assert steps.outside(2, 2) == 200 * MIB + slack
    assert steps.outside(0, 0) == 130 * MIB + slack


def test_a_step_not_read_takes_the_larger_excess_around_it(allocator):
    planned = [0] * 6
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB, planned=planned)
    steps.begin_step()
    for step, mib in ((1, 10), (4, 40)):
        allocator["bytes"] = mib * MIB
        steps.observe(step, others=0, planned=0, pool=0)
    steps.begin_step()
    assert [steps.outside(s, s) - steps.slack for s in range(6)] == \
        [10 * MIB, 10 * MIB, 40 * MIB, 40 * MIB, 40 * MIB, 40 * MIB]


def test_an_out_of_memory_retry_calibrates_again(allocator):
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB, planned=[0])
    for _ in range(2):
        steps.begin_step()
    assert not steps.begin_step()
    steps.again()
    assert steps.begin_step()
