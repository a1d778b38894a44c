import dataclasses
import json
import re

import pytest
import torch
from torch import nn

import superneurons as sn
from superneurons.cli.main import main
from superneurons.units import format_bytes, parse_bytes


def test_budget_strings():
    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096 and parse_bytes(None) is None
    for bad in ("12 parsecs", "-3GiB", 0, True, [1]):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    assert format_bytes(1536) == "1.50 KiB"


def test_bad_policy_and_input_say_what_to_do():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="choose one of"):
        sn.plan(model, (2, 4), policy="fastest")
    with pytest.raises(ValueError, match="shape"):
        sn.plan(model, (2, -4))
    with pytest.raises(ValueError, match="example_input"):
        sn.plan(model, "a picture")
    with pytest.raises(ValueError, match=r"fails on its inputs \(\(2, 5\) torch.float32\)"):
        sn.plan(model, (2, 5))


def test_a_budget_too_small_names_the_smallest_that_works():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    floor = sn.plan(model, (32, 64), policy="superneurons").peak_bytes
    with pytest.raises(ValueError, match=f"needs at least .*{floor} bytes"):
        sn.plan(model, (32, 64), policy="superneurons", budget=floor - 1)
    with pytest.raises(ValueError, match="superneurons' needs"):
        sn.plan(model, (32, 64), policy="liveness", budget=floor)
    assert sn.plan(model, (32, 64), policy="auto", budget=floor).policy is sn.Policy.SUPERNEURONS
    assert sn.plan(model, (32, 64), policy="auto").policy is sn.Policy.LIVENESS


def test_untraceable_model_gets_a_value_error():
    class Branchy(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x
    with pytest.raises(ValueError, match="reads tensor values .* or branches on them"):
        sn.plan(Branchy(), (2, 2))


def test_cli_plan_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "densenet_cifar", "--batch", "4", "--depth", "40", "--json",
                 str(out_json), "--plot", str(out_png)]) == 0
    record = json.loads(out_json.read_text())
    assert set(record["policies"]) == {"baseline", "liveness", "offload", "recompute",
                                       "superneurons"}
    steps = record["policies"]["liveness"]["steps"]
    assert len(steps) == 2 * record["num_layers"]
    assert record["policies"]["liveness"]["offloaded_bytes"] == 0       # what goes to the host
    assert record["policies"]["superneurons"]["offloaded_bytes"] > 0
    assert out_png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "superneurons" in out and "to the host" in out       # rich may wrap the header
    assert main(["plan", "resnet", "--depth", "51", "--batch", "2"]) == 2


def test_cli_plan_within_a_budget_says_what_replays_and_moves(capsys):
    said = r"(\d+) layers replayed \((\d+) replays of whole, cut or merged blocks\), nothing moved"
    assert main(["plan", "resnet50", "--batch", "280", "--budget", "11.5GiB"]) == 0
    fp32 = re.search(said, capsys.readouterr().out)
    assert fp32 and int(fp32.group(2)) > 0
    # under bf16 autocast the same batch needs fewer replays
    assert main(["plan", "resnet50", "--batch", "280", "--budget", "11.5GiB", "--bf16"]) == 0
    out = capsys.readouterr().out
    bf16 = re.search(said, out)
    assert "bf16 autocast" in out and bf16 and int(bf16.group(1)) < int(fp32.group(1))
    assert main(["plan", "resnet50", "--batch", "500", "--budget", "11.5GiB"]) == 0
    assert "the cache moves about" in capsys.readouterr().out
    assert main(["plan", "resnet50", "--batch", "2000", "--budget", "11.5GiB"]) == 2
    assert "Raise the budget to at least" in capsys.readouterr().err


def test_auto_within_a_budget_replays_only_what_it_needs():
    with torch.device("meta"):
        model = sn.models.build("resnet50")
    auto = sn.plan(model, (280, 3, 224, 224), policy="auto", budget="11.5GiB")
    chosen = sn.plan(model, (280, 3, 224, 224), policy=str(auto.policy), budget="11.5GiB")
    assert auto.num_extra_computations == chosen.num_extra_computations
    assert auto.bytes_to_move() == 0 and auto.bytes_to_move("4GiB") > 0
    with pytest.raises(ValueError, match="needs a budget"):
        sn.plan(model, (2, 3, 64, 64)).bytes_to_move()


def test_cli_train_summarizes_the_step(capsys):
    assert main(["train", "densenet_cifar", "--depth", "16", "--batch", "4", "--steps", "2",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "layers recomputed" in out and "superneurons" in out
    assert main(["train", "densenet_cifar", "--depth", "16", "--batch", "4", "--steps", "1",
                 "--device", "cpu", "--budget", "1KB"]) == 2


def test_cli_train_shows_the_allocators_retries_where_memory_is_measured(capsys,
                                                                          monkeypatch):
    """On CUDA (faked: measured stats) the summary counts the last step's allocator retries;
    on the CPU, where nothing is measured, it has no such row."""
    from superneurons.runtime import module, stats

    def measured(*args, **kwargs):
        return dataclasses.replace(step_stats(*args, **kwargs), measured=True,
                                   allocator_retries=3)
    step_stats = stats.step_stats
    assert main(["train", "densenet_cifar", "--depth", "16", "--batch", "4", "--steps", "1",
                 "--device", "cpu"]) == 0
    assert "allocator retries" not in capsys.readouterr().out
    monkeypatch.setattr(module, "step_stats", measured)
    assert main(["train", "densenet_cifar", "--depth", "16", "--batch", "4", "--steps", "1",
                 "--device", "cpu"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if "allocator retries" in line]
    assert len(row) == 1 and "3" in row[0]


def test_cli_train_explains_running_out_of_memory_where_it_cannot_retry(capsys, monkeypatch):
    """An out-of-memory in autograd's kernels (faked on the CPU) ends the command with the
    allocator's peaks and the budget that leaves it their overhead, not PyTorch's trace."""
    from superneurons.cli import train_cmd
    from superneurons.runtime import near_limit

    class Failing:
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def nll_loss(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.10 GiB.")
    gib = 2**30
    monkeypatch.setattr(train_cmd, "F", Failing())
    monkeypatch.setattr(near_limit, "reads_allocator", lambda device: True)     # as on CUDA
    monkeypatch.setattr(near_limit, "peaks", lambda device: (11 * gib, 9 * gib, 12 * gib))
    assert main(["train", "densenet_cifar", "--depth", "16", "--batch", "4", "--steps", "2",
                 "--device", "cpu", "--budget", "11.5GiB"]) == 2
    said = capsys.readouterr().err
    assert "training step 1" in said and "Tried to allocate 1.10 GiB" in said
    assert "lower the budget to 10.00 GiB or less" in said, said


def test_cli_train_runs_under_bf16_autocast(capsys):
    assert main(["train", "densenet_cifar", "--depth", "16", "--batch", "4", "--steps", "2",
                 "--device", "cpu", "--bf16"]) == 0
    out = capsys.readouterr().out
    assert "bf16 autocast" in out and "final loss" in out


@pytest.mark.slow
def test_cli_train_launches_data_parallel_processes(capfd):
    assert main(["train", "densenet_cifar", "--depth", "16", "--batch", "2", "--steps", "1",
                 "--device", "cpu", "--nproc", "2"]) == 0
    assert "x 2 processes" in capfd.readouterr().out
