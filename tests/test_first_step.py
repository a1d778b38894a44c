"""The first step's own work (capture, planning, the host memory check) in its StepStats, and
what the command line shows of it while it runs; the library itself prints nothing."""

import logging
import sys
import time

import torch
import torch.nn.functional as F

import superneurons as sn
from superneurons.cli.main import main

MADE = ("capture_seconds", "planning_seconds", "host_check_seconds")


def _net():
    torch.manual_seed(0)
    return sn.models.resnet(blocks=(1, 1, 1, 1), num_classes=10)


def _step(wrapped, x, y) -> float:
    began = time.perf_counter()
    F.nll_loss(wrapped(x), y).backward()
    return time.perf_counter() - began


def test_the_first_step_records_making_its_plan_and_later_steps_do_not():
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    wrapped = sn.wrap(_net(), policy="superneurons")
    wall = _step(wrapped, x, y)
    first = wrapped.stats
    assert all(first[name] > 0 for name in MADE), first
    assert first.setup_seconds == sum(first[name] for name in (
        *MADE, "machine_seconds", "host_memory_seconds", "calibration_seconds"))
    assert first.setup_seconds <= wall
    assert set(MADE) <= set(first.as_dict())
    _step(wrapped, x, y)
    assert all(wrapped.stats[name] == 0 for name in MADE)


def test_a_plan_made_before_any_step_is_reported_by_the_step_that_runs_it():
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    # a budget that holds the step: the model runs untouched, with no host memory to check
    wrapped = sn.wrap(_net(), policy="superneurons", budget="4GiB")
    began = time.perf_counter()
    plan, executor = wrapped.plan_for(x)
    wall = time.perf_counter() - began + _step(wrapped, x, y)
    stats = wrapped.stats
    assert executor is None and stats.capture_seconds > 0 and stats.planning_seconds > 0
    assert stats.host_check_seconds == 0 and stats.setup_seconds <= wall
    _step(wrapped, x, y)
    assert wrapped.stats.capture_seconds == wrapped.stats.planning_seconds == 0


def test_the_library_prints_nothing_and_logs_its_phases_at_info(capsys, caplog):
    """Python shows INFO records only where the application asks (no handler shows them by
    default, and the package's logger has a NullHandler): a wrapped model's steps print nothing,
    and what they log is there for a status display."""
    caplog.set_level(logging.INFO, logger="superneurons")
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    wrapped = sn.wrap(_net(), policy="superneurons")
    for _ in range(2):
        _step(wrapped, x, y)
    assert wrapped.stats.offloaded_bytes > 0
    assert capsys.readouterr() == ("", "")
    records = [r for r in caplog.records if r.name.startswith("superneurons")]
    assert {r.levelno for r in records} == {logging.INFO}
    said = " ".join(r.getMessage() for r in records)
    for phase in ("capturing ResNet", "planning", "first step: running", "host memory"):
        assert phase in said, said
    package = logging.getLogger("superneurons")
    assert any(isinstance(h, logging.NullHandler) for h in package.handlers)


def _train_cli(capsys) -> str:
    assert main(["train", "densenet_cifar", "--depth", "16", "--batch", "4", "--steps", "2",
                 "--device", "cpu", "--budget", "5MB"]) == 0
    captured = capsys.readouterr()
    assert "first step: capture / planning" in captured.out
    assert "first step: device's rates / host check" in captured.out
    return captured.err


def test_cli_train_shows_the_first_steps_phases_and_a_bar(capsys):
    logger = logging.getLogger("superneurons")
    handlers, level = list(logger.handlers), logger.level
    err = _train_cli(capsys)
    for phase in ("capturing DenseNet with torch.fx", "planning 59 layers: superneurons",
                  "first step: running", "host memory for offloads"):
        assert phase in err, err
    assert "2/2" in err                            # tqdm's bar
    assert logger.handlers == handlers and logger.level == level      # left as it was


def test_cli_train_without_tqdm_says_the_same_in_plain_lines(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)       # import tqdm: ImportError
    err = _train_cli(capsys)
    assert "capturing DenseNet" in err and "step 2/2: loss" in err
