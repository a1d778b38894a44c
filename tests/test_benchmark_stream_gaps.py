"""benchmarks/stream_gaps.py: the compute stream's gaps, by what copies ran during each."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from stream_gaps import stream_gaps  # noqa: E402


def _event(cat, name, stream, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream}}


def test_gaps_are_split_by_the_copies_running_during_them():
    compute, out, back = 7, 20, 21
    trace = {"traceEvents": [
        _event("kernel", "conv", compute, 0, 100),
        _event("kernel", "bn", compute, 150, 100),        # 50 us gap: an offload ran
        _event("kernel", "relu", compute, 260, 10),       # 10 us: launch spacing, not a gap
        _event("kernel", "conv_backward", compute, 400, 200),   # 130 us: a prefetch ran
        _event("kernel", "bn_backward", compute, 700, 50),      # 100 us: nothing ran
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", out, 90, 70),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", back, 300, 80),
        _event("kernel", "fill", back, 0, 5),             # not a copy: not counted as one
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 999},
    ]}
    gaps = stream_gaps(trace, steps=1)
    assert gaps["compute_kernels_s"] == pytest.approx(460e-6)
    assert gaps["copies_s"] == {"out": pytest.approx(70e-6), "in": pytest.approx(80e-6)}
    assert gaps["gaps"] == 3
    assert gaps["gaps_s"]["with_copies_out"] == pytest.approx(50e-6)
    assert gaps["gaps_s"]["with_copies_in"] == pytest.approx(130e-6)
    assert gaps["gaps_s"]["with_no_copy"] == pytest.approx(100e-6)
    assert gaps["gaps_s"]["all"] == pytest.approx(280e-6)
    largest = gaps["largest_ms"][0]
    assert (largest["then"], largest["gap"], largest["copies_in"]) == \
        ("conv_backward", pytest.approx(0.13), pytest.approx(0.08))
    assert stream_gaps(trace, steps=2)["gaps_s"]["all"] == pytest.approx(140e-6)


def test_a_trace_without_device_events_says_nothing():
    assert stream_gaps({"traceEvents": []}, steps=1) == {}
