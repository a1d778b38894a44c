"""benchmarks/state_tier_ddp.py on the CPU (gloo, two ranks): the streamed throughput case
writes a record with both ranks' steps; the GPU run is the same code with NCCL."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import state_tier_ddp  # noqa: E402


@pytest.mark.slow
def test_the_streamed_case_runs_two_gloo_ranks_and_writes_its_record(tmp_path):
    path = state_tier_ddp.main([str(tmp_path), "throughput", "--device", "cpu", "--n3", "1",
                                "--batch", "2", "--image", "32", "--timeout", "120"])
    record = json.load(open(path))
    (row,) = record["results"]
    assert row["world"] == 2 and len(row["ranks"]) == 2
    for rank in row["ranks"]:
        assert "error" not in rank, rank
        assert len(rank["steps"]) == state_tier_ddp.STEPS
        assert all(step["state_moved_bytes"] > 0 for step in rank["steps"])
