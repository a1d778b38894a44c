"""Executor Rule 4 on made-up allocator readings: the excess of real use over the plan is learned
at layer boundaries and from the allocator's high-water mark between them."""

import pytest
import torch

from superneurons.runtime import calibration
from superneurons.runtime.calibration import Calibration, FIRST_STEP_MARGIN

MIB = 1 << 20


class Allocator:
    """Readings as the CUDA allocator gives them: (allocated now, high-water mark)."""

    def __init__(self, monkeypatch):
        self.current = self.peak = 0
        monkeypatch.setattr(calibration, "allocator_reading", lambda device: (self.current,
                                                                              self.peak))

    def hold(self, nbytes: int) -> None:
        self.current = nbytes
        self.peak = max(self.peak, nbytes)


def planned(values):
    return lambda first, last: max(values[first:last + 1])


@pytest.fixture
def allocator(monkeypatch):
    return Allocator(monkeypatch)


def test_before_calibrating_the_plan_gets_the_first_step_margin(allocator):
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB)
    assert steps.begin_step()
    assert steps.outside(100 * MIB) == int(FIRST_STEP_MARGIN * 100 * MIB)


def test_a_transient_between_readings_is_learned(allocator):
    """A kernel allocates 128 MiB above the plan and frees it before the next layer boundary:
    the reading at the boundary sees nothing, the high-water mark does."""
    plan = [100 * MIB, 300 * MIB, 200 * MIB]
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB)
    allocator.hold(50 * MIB)                          # the user's tensors
    steps.begin_step()
    allocator.hold(50 * MIB + plan[0])
    steps.observe(0, 50 * MIB, plan[0], planned(plan), pool_now=0, pool_most=0)
    assert steps.seen_excess == 0
    allocator.hold(50 * MIB + plan[1] + 128 * MIB)    # inside the kernel: nobody reads here
    allocator.hold(50 * MIB + plan[2])
    steps.observe(2, 50 * MIB, plan[2], planned(plan), pool_now=0, pool_most=0)
    assert steps.seen_excess == 128 * MIB
    assert steps.begin_step() is True                # the second calibrating step
    assert steps.outside(plan[1]) == plan[1] + 128 * MIB + steps.slack
    assert steps.begin_step() is False               # later steps trust it


def test_the_pool_at_its_fullest_in_the_window_is_not_excess(allocator):
    """The pool held 64 MiB more in the window than at the reading (an entry read and freed):
    that is planned room, not excess."""
    plan = [100 * MIB, 100 * MIB]
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB)
    steps.begin_step()
    allocator.hold(plan[0] + 64 * MIB)
    allocator.hold(plan[1])
    steps.observe(1, 0, plan[1], planned(plan), pool_now=0, pool_most=64 * MIB)
    assert steps.seen_excess == 0


def test_a_high_water_mark_that_did_not_move_says_nothing(allocator):
    """The user's own earlier peak stays above the step: only the boundary readings count, and
    the mark is never reset (torch.cuda.max_memory_allocated stays the user's)."""
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB)
    allocator.hold(900 * MIB)
    allocator.hold(10 * MIB)
    steps.begin_step()
    allocator.hold(10 * MIB + 120 * MIB)
    steps.observe(0, 10 * MIB, 100 * MIB, planned([100 * MIB]), pool_now=0, pool_most=0)
    assert steps.seen_excess == 20 * MIB
    assert allocator.peak == 900 * MIB


def test_a_reset_by_the_user_between_readings_is_read_as_a_new_mark(allocator):
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB)
    allocator.hold(900 * MIB)
    allocator.hold(0)
    steps.begin_step()
    allocator.peak = 0                                # torch.cuda.reset_peak_memory_stats()
    allocator.hold(300 * MIB)
    allocator.hold(100 * MIB)
    steps.observe(0, 0, 100 * MIB, planned([100 * MIB]), pool_now=0, pool_most=0)
    assert steps.seen_excess == 200 * MIB


def test_an_out_of_memory_retry_calibrates_again(allocator):
    steps = Calibration(torch.device("cuda"), budget_bytes=1000 * MIB)
    steps.begin_step(), steps.begin_step()
    assert not steps.begin_step()
    steps.again()
    assert steps.begin_step()
