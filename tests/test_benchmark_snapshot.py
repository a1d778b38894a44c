"""benchmarks/snapshot_peak.py: what an allocator history held at its peak, by where it was made
(its input comes from CUDA runs; here a made-up history in the same format)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from snapshot_peak import peak  # noqa: E402
from diagnose_peak import layer_at  # noqa: E402


def _event(action, addr, size, where):
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": f"/x/superneurons/runtime/{where}.py", "line": 1,
                        "name": where}]}


def test_the_peak_and_what_was_live_then():
    trace = [_event("alloc", 1, 100, "executor"), _event("alloc", 2, 50, "mover"),
             _event("free_requested", 1, 100, "executor"), _event("alloc", 3, 30, "executor"),
             {"action": "oom", "size": 999}]      # events without an address are skipped
    found = peak({"device_traces": [trace]})
    assert found["peak_above_start_bytes"] == 150 and found["peak_event"] == 1
    assert sorted(row["bytes"] for row in found["live_at_peak"]) == [50, 100]


def test_an_empty_history_has_no_peak():
    found = peak({"device_traces": [[]]})
    assert found["peak_above_start_bytes"] == 0 and found["live_at_peak"] == []


def test_the_layer_running_at_a_time():
    times = [(10, "conv1"), (20, "bn1"), (35, "relu")]
    assert layer_at(times, 25) == "bn1" and layer_at(times, 35) == "relu"
    assert layer_at(times, 5) is None and layer_at(times, None) is None
