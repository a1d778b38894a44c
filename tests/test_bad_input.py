"""Bad input gets a clear answer: budgets that are not a count of bytes, on the library's side
and on the command line's, and sn.models reached as torchvision.models is."""

import math
import subprocess
import sys

import pytest
import torch

from superneurons import models
from superneurons.cli import plan_cmd
from superneurons.cli.main import main
from superneurons.units import parse_bytes


def test_a_fractional_budget_is_refused_not_truncated_to_one_byte():
    for fraction in (1.5, 0.5, "1.5", "0.5 B"):
        with pytest.raises(ValueError, match=r"whole number of bytes.*'1\.5GiB'"):
            parse_bytes(fraction)
    assert parse_bytes(12e9) == 12_000_000_000 and type(parse_bytes(12e9)) is int
    assert parse_bytes("1.5KB") == 1500


def test_nan_and_infinite_budgets_are_refused():
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="finite number of bytes"):
            parse_bytes(bad)


def test_sn_models_needs_no_import_of_its_own():
    code = ("import sys, superneurons as sn; "
            "assert 'superneurons.models' not in sys.modules, 'the zoo loaded eagerly'; "
            "print(type(sn.models.resnet(50)).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ResNet"


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("size, says", [("1.5x", "cannot read the size '1.5x'"),
                                        ("1.5", "'1.5GiB'"), ("nan", "cannot read the size")])
def test_cli_refuses_a_bad_budget_before_building_a_model(command, size, says, monkeypatch,
                                                          capsys):
    def never(*args, **kwargs):
        raise AssertionError("a model was built for a bad --budget")
    monkeypatch.setattr(models, "build", never)
    monkeypatch.setattr(plan_cmd, "build_meta", never)
    with pytest.raises(SystemExit) as stopped:
        main([command, "resnet50", "--batch", "8", "--budget", size])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--budget" in err and says in err


def test_cli_bad_budget_exits_without_a_traceback():
    done = subprocess.run([sys.executable, "-m", "superneurons.cli.main", "plan", "resnet50",
                           "--batch", "8", "--budget", "1.5x"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "--budget" in done.stderr


def test_memory_held_by_others_beyond_the_budget_is_named():
    from superneurons.runtime.module import budget_left
    assert budget_left(10 * 2**30, 2**30, "cuda:0") == 9 * 2**30
    with pytest.raises(ValueError, match=r"already hold 11.00 GiB on cuda:0, all of the budget "
                                         r"of 10.00 GiB"):
        budget_left(10 * 2**30, 11 * 2**30, "cuda:0")


@pytest.mark.parametrize("steps", ["0", "-2", "two"])
def test_cli_train_refuses_steps_that_are_not_a_positive_count(steps, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("a model was built for a bad --steps")
    monkeypatch.setattr(models, "build", never)
    with pytest.raises(SystemExit) as stopped:
        main(["train", "resnet50", "--batch", "8", "--steps", steps])
    assert stopped.value.code == 2
    assert "--steps" in capsys.readouterr().err


class _CumulativeNorm(torch.nn.Module):
    """Not a Sequential: captured by torch.export rather than torch.fx."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.norm = torch.nn.BatchNorm2d(4, momentum=None)

    def forward(self, x):
        return self.norm(self.conv(x)).mean((2, 3))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_batch_norm_with_a_cumulative_average_is_refused_naming_its_momentum(tracer):
    """BatchNorm with momentum=None reads its step counter as a Python number, which planning
    on the meta device cannot: refused before a step, saying so (plain PyTorch trains it, so
    the message must not send the user to check their inputs)."""
    import superneurons as sn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=None),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)) \
        if tracer == "fx" else _CumulativeNorm()
    x = torch.randn(2, 3, 8, 8)
    model(x).sum().backward()                                 # plain PyTorch trains it
    with pytest.raises(ValueError, match="momentum") as error:
        sn.wrap(model, policy="recompute")(x)
    assert "fails the same way" not in str(error.value)


class _Branching(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        if h.sum() > 0:                       # a branch on a value: export cannot capture it
            return h * 2
        return h


def test_a_value_read_in_the_forward_is_refused_naming_where_and_no_batch_norm():
    import superneurons as sn
    with pytest.raises(ValueError, match="test_bad_input.py") as error:
        sn.wrap(_Branching(), policy="recompute")(torch.randn(2, 4))
    assert "BatchNorm" not in str(error.value)           # it has none


def test_offload_on_a_model_without_convolutions_says_it_moves_nothing():
    """Policy 'offload' moves convolution outputs (the paper's); on a model with none it would
    run as liveness without a word: it warns, once, at the caller's line, naming the policy that
    moves what it keeps."""
    import warnings

    import superneurons as sn
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.warns(UserWarning, match="captured as a convolution.*'superneurons'") as said:
        sn.plan(mlp, torch.randn(4, 8), policy="offload")
    assert [w.filename for w in said] == [__file__]         # once, at the caller's line
    with pytest.warns(UserWarning, match="captured as a convolution") as said:
        sn.wrap(mlp, policy="offload")(torch.randn(4, 8)).sum().backward()
    assert said[0].filename == __file__
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sn.plan(conv, torch.randn(2, 3, 8, 8), policy="offload")
