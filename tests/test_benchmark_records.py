"""The benchmark runner's records: written after every measurement, complete only at the end,
and on a machine without CUDA the planner-only parts still run (benchmarks/run.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
from common import largest, run_child, write  # noqa: E402


def test_a_record_is_replaced_whole(tmp_path):
    path = tmp_path / "part.json"
    write(str(path), {"results": {"a": 1}}, quiet=True)
    write(str(path), {"results": {"a": 2}}, quiet=True)
    assert json.loads(path.read_text())["results"] == {"a": 2}
    assert os.listdir(tmp_path) == ["part.json"]            # no temporary file left behind


def test_a_child_gives_its_last_record_or_why_it_has_none():
    python = sys.executable
    assert run_child([python, "-c", "print('{\"a\": 1}'); print('{\"a\": 2}')"], 30) == {"a": 2}
    failed = run_child([python, "-c", "import sys; sys.exit('broken')"], 30)
    assert not failed["ok"] and "ended with 1: broken" in failed["error"]
    hung = run_child([python, "-c", "import time; time.sleep(30)"], 0.5)
    assert not hung["ok"] and "no result within 0.5 s" in hung["error"]


def test_every_probe_is_logged_with_its_outcome(capsys):
    largest(lambda n: n <= 10, 8, tolerance=0.1)
    out = capsys.readouterr().out
    assert "  8: fits (" in out and "  16: does not fit (" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (on CUDA it measures)")
def test_the_densenet_part_plans_on_a_cpu_and_says_it_is_complete(tmp_path):
    subprocess.run([sys.executable, os.path.join(BENCHMARKS, "run.py"), "densenet", "--depths",
                    "40", "--out", str(tmp_path), "--tag", "_cpu"], check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                       [os.path.join(BENCHMARKS, ".."), os.environ.get("PYTHONPATH", "")])})
    record = json.loads((tmp_path / "densenet_cpu.json").read_text())
    assert record["complete"] is True
    (row,) = record["results"]["memory_by_depth"]
    assert row["depth"] == 40
    assert row["predicted_peak_bytes"]["superneurons"] < row["predicted_peak_bytes"]["liveness"]
    assert record["results"]["deepest"] == {}


def test_isolated_speed_runs_each_network_and_system_in_a_child_and_merges_the_rows(monkeypatch):
    import argparse
    import run
    commands, saved = [], []

    def child(command, env, check):
        commands.append(command)
        folder = command[command.index("--out") + 1]
        system = command[command.index("--systems") + 1]
        (network,) = command[command.index("--networks") + 1:command.index("--systems")]
        with open(os.path.join(folder, "speed_child.json"), "w") as record:
            json.dump({"results": {network: [{"batch": 144, "system": system}]}}, record)
    monkeypatch.setattr(run.subprocess, "run", child)
    args = argparse.Namespace(isolate=True, systems=["plain", "superneurons"],
                              networks=["vgg16", "alexnet"], dtypes=["fp32", "bf16"],
                              batches=None, cap_gib=12.0, budget=11.5, save=saved.append)
    result = run.speed_part(args)
    assert [row["system"] for row in result["vgg16"]] == ["plain", "superneurons"]
    assert [row["system"] for row in result["alexnet"]] == ["plain", "superneurons"]
    assert len(commands) == 4 and all("--batches" not in c for c in commands)  # the part's own
    assert commands[0][commands[0].index("--dtypes") + 1:][:2] == ["fp32", "bf16"]
    assert len(saved) == 4                       # a record after each network and system


def test_the_memory_part_measures_each_network_and_plots_beside_the_record(monkeypatch, tmp_path):
    import argparse
    import gpu_check
    import run
    measured = []

    def memory_per_step(name, batch):
        measured.append((name, batch))
        return {"liveness": {"steps": [{"measured_peak_bytes": 2**20, "predicted_bytes": 2**20}]}}
    monkeypatch.setattr(gpu_check, "memory_per_step", memory_per_step)
    args = argparse.Namespace(out=str(tmp_path), tag="_stub")
    result = run.PARTS["memory"](args)
    assert measured == [("alexnet", 128), ("resnet50", 32), ("densenet121", 32)]
    assert set(result["networks"]) == {"alexnet", "resnet50", "densenet121"}
    assert "input" in result["what"]
    assert (tmp_path / "memory_stub.png").stat().st_size > 0
