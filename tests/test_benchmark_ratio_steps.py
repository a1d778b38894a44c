"""benchmarks/ratio_steps.py: the collector's passes it records per step, and its summary."""

import gc
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
from ratio_steps import Collections, steady_summary  # noqa: E402


def test_a_full_collection_is_recorded_with_its_generation_and_time():
    collections = Collections()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        collections.close()
    generations = [generation for generation, _ in collections.seen]
    assert generations == [2, 0]
    assert all(seconds >= 0 for _, seconds in collections.seen)
    gc.collect()
    assert len(collections.seen) == 2        # closed: no longer recording


def test_the_summary_counts_the_steady_steps_alone():
    rows = [{"frozen": False, "step_s": 9.0, "calibrating": False},      # the first: capture
            {"frozen": False, "step_s": 5.0, "calibrating": True},
            {"frozen": False, "step_s": 4.0, "trying": True},
            *({"frozen": False, "step_s": s} for s in (1.0, 1.0, 2.0, 3.0)),
            *({"frozen": True, "step_s": s} for s in (4.0, 2.0))]
    summary = steady_summary(rows)
    assert summary["as is"] == {"median_step_s": 1.5, "mean_step_s": 1.75, "max_step_s": 3.0,
                                "steps": 4}
    assert summary["frozen"] == {"median_step_s": 3.0, "mean_step_s": 3.0, "max_step_s": 4.0,
                                 "steps": 2}
