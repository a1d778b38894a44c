"""benchmarks/steady.py: a run's record on the CPU, and the summary that says whether memory grew,
a step went over the budget or one ran out of memory."""

import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
from steady import FIELDS, summarize  # noqa: E402

MIB = 2**20


def steps(n, allocated=100 * MIB, allocated_per_step=0, rss=1000 * MIB,
          rss_per_step=0, peaks=None):
    """Synthetic per-step lists: memory flat unless a per-step growth is given."""
    lists = {field: [0] * n for field in FIELDS}
    lists["seconds"] = [5.0] + [1.0] * (n - 1)
    lists["allocated_bytes"] = [allocated + i * allocated_per_step for i in range(n)]
    lists["rss_bytes"] = [rss + i * rss_per_step for i in range(n)]
    lists["peak_allocated_bytes"] = peaks or [200 * MIB] * n
    lists["peak_reserved_bytes"] = [256 * MIB] * n
    return lists


def test_flat_memory_within_the_budget_holds():
    summary = summarize(steps(100), budget_bytes=300 * MIB)
    assert summary["steps_run"] == 100 and summary["growth_from_step"] == 10
    assert summary["first_step_seconds"] == 5.0 and summary["median_steady_seconds"] == 1.0
    assert summary["allocated_growth_bytes"] == 0 and summary["rss_growth_bytes"] == 0
    assert summary["budget_held"] is True and summary["steps_over_budget"] == 0
    assert summary["grows"] is False and summary["out_of_memory"] is None


def test_growth_after_step_10_is_flagged_and_growth_before_it_is_not():
    leaking = summarize(steps(100, allocated_per_step=MIB // 4), budget_bytes=None)
    assert leaking["allocated_growth_bytes"] == 90 * MIB // 4 and leaking["grows"] is True
    host = summarize(steps(100, rss_per_step=MIB), budget_bytes=None)
    assert host["rss_growth_bytes"] == 90 * MIB and host["grows"] is True
    settling = steps(100)        # steps 1-10 take memory (momentum, pinned pages), then flat
    settling["rss_bytes"] = [MIB * min(i, 9) * 100 for i in range(100)]
    assert summarize(settling, budget_bytes=None)["grows"] is False


def test_steps_over_the_budget_are_counted_from_the_first():
    peaks = [310 * MIB] + [200 * MIB] * 5 + [301 * MIB] + [200 * MIB] * 3
    summary = summarize(steps(10, peaks=peaks), budget_bytes=300 * MIB)
    assert summary["budget_held"] is False and summary["steps_over_budget"] == 2
    assert summary["first_step_over_budget"] == 1
    assert summary["max_peak_allocated_after_first_bytes"] == 301 * MIB
    assert summary["growth_from_step"] is None      # no step after step 10


def test_an_out_of_memory_is_kept_with_its_step_and_a_cpu_run_has_no_device_numbers():
    cpu = steps(3, peaks=[None] * 3)
    summary = summarize(cpu, 300 * MIB, out_of_memory={"step": 4, "message": "OutOfMemory"})
    assert summary["out_of_memory"]["step"] == 4
    assert summary["budget_held"] is None and summary["max_peak_allocated_after_first_bytes"] \
        is None


def test_a_tiny_run_on_the_cpu_writes_its_record(tmp_path):
    # one thread: on a busy machine a child's threads fighting other processes' for the cores
    # made its small steps 30 times slower
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.join(BENCHMARKS, ".."), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "steady.py"), str(tmp_path),
                           "--network", "resnet50:2", "--device", "cpu", "--steps", "3",
                           "--image-size", "32", "--seconds", "120"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "steady_resnet50_2.json").read_text())
    assert record["stopped"] == "steps" and record["device"] == "cpu"
    assert {"command", "date", "torch", "network", "batch", "budget"} <= set(record)
    assert set(record["steps"]) == set(FIELDS)
    assert all(len(values) == 3 for values in record["steps"].values())
    assert record["steps"]["rss_bytes"][0] > 0
    assert record["first_step_split_seconds"]["capture_seconds"] > 0     # the plan was made
    assert record["summary"]["steps_run"] == 3 and record["summary"]["out_of_memory"] is None
    assert "resnet50:2" in done.stdout and "net:batch" in done.stdout   # the table
