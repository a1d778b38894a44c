"""benchmarks/today_plans.py: the record of what the command line plans for models of today."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import today_plans  # noqa: E402

TINY_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 64}


def test_a_row_has_every_policys_peak_and_the_state_on_the_host_needs_less():
    device, host = (today_plans.planned("hf:gpt2", 2, {"seq": 16}, TINY_GPT2, state)
                    for state in ("device", "host"))
    peaks = device["peak_bytes"]
    assert set(peaks) == {"baseline", "liveness", "recompute", "superneurons"}
    assert peaks["superneurons"] <= peaks["liveness"] <= peaks["baseline"]
    assert host["peak_bytes"]["superneurons"] < peaks["superneurons"]
    assert device["inputs"] == "2 x 16 tokens" and device["parameters"] > 0


def test_the_script_writes_its_record(tmp_path, monkeypatch):
    monkeypatch.setattr(today_plans, "MODELS", [("hf:gpt2", 2, {"seq": 16}, TINY_GPT2)])
    monkeypatch.setattr(sys, "argv", ["today_plans.py", str(tmp_path)])
    today_plans.main()
    record = json.loads((tmp_path / "today_plans.json").read_text())
    assert [row["state"] for row in record["rows"]] == ["device", "host"]
    assert "environment" in record and record["command"].startswith("python benchmarks/")
