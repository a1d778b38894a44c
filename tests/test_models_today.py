"""Any model people train today: exact, or refused before its first step.

Every case of today_models.py and today_constructs.py is trained plainly and wrapped under each
policy at the forcing budget (one below liveness's own peak, so the runtime must act) and must
train bit-identically -- or be refused with a ValueError before its first step changed anything,
and then be listed, with the reason, in matrix.EXPECTED_REFUSALS.

- test_today[...]: the always-run subset (a few torchvision and timm networks, the Hugging Face
  models, nanoGPT, torch.nn attention, every construct);
- test_today_matrix[...]: every case, marked ``matrix`` and collected only when ``-m`` selects
  it: ``python -m pytest -m matrix tests/test_models_today.py`` (about an hour on 2 cores;
  benchmarks/models_today.py runs the same matrix and writes the table's record).

Cases whose libraries (torchvision, transformers, timm) are not installed are skipped.
"""

import pytest
import torch
from torch import nn

import matrix
from matrix import POLICIES, MatrixFailure, compare, expected_refusal
from today_constructs import CONSTRUCTS
from today_models import MODELS

CASES = {**MODELS, **CONSTRUCTS}
DEFAULT = [name for name, case in CASES.items() if case.default]


def _check(name: str, policy: str):
    case = CASES[name]
    missing = case.missing()
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    outcome = compare(case, policy)
    reason = expected_refusal(name, policy)
    if outcome.status == "refused":
        assert outcome.reason, f"{name}/{policy}: refused with an empty message"
        assert reason, (f"{name}/{policy} is refused ({outcome.reason}) but not listed in "
                        "matrix.EXPECTED_REFUSALS")
        assert reason in outcome.reason, (name, policy, outcome.reason)
    else:
        assert reason is None, (f"{name}/{policy} trains exactly, yet matrix.EXPECTED_REFUSALS "
                                f"lists it as refused ({reason}): remove it there")


def _pairs(names):
    # model-major, each case's policies on one worker (--dist loadgroup): they run one after
    # another and share its plain run and its captured graph (matrix.py)
    return [pytest.param(name, policy, id=f"{name}-{policy}",
                         marks=pytest.mark.xdist_group(name))
            for name in names for policy in POLICIES]


@pytest.mark.parametrize(("name", "policy"), _pairs(DEFAULT))
def test_today(name, policy):
    _check(name, policy)


def pytest_generate_tests(metafunc):
    """The full matrix exists only when ``-m`` names it, so a plain run does not list ~450
    deselected or skipped tests."""
    if metafunc.definition.name != "test_today_matrix":
        return
    selected = "matrix" in (metafunc.config.option.markexpr or "")
    metafunc.parametrize(("name", "policy"), _pairs(CASES) if selected else [])


@pytest.mark.matrix
def test_today_matrix(name, policy):
    _check(name, policy)


# ------------------------------------------------------------------ the harness itself
# A fake runtime (monkeypatched sn.wrap) that is exact, inexact, refuses early or refuses late:
# the harness must tell each apart, whatever state superneurons itself is in.

def _tiny():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 3))
    return model, (x,), {}, lambda out: nn.functional.cross_entropy(out, y)


class _Fake(nn.Module):
    def __init__(self, model, mode):
        super().__init__()
        self.model, self.mode, self.calls = model, mode, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.mode == "refuse" or (self.mode == "refuse-late" and self.calls == 2):
            raise ValueError("this model is refused")
        out = self.model(*args, **kwargs)
        return out * (1 + 1e-6) if self.mode == "inexact" else out


@pytest.fixture
def fake_wrap(monkeypatch):
    def use(mode):
        monkeypatch.setattr(matrix.sn, "wrap", lambda model, policy, budget: _Fake(model, mode))
    return use


def test_harness_exact(fake_wrap):
    fake_wrap("exact")
    outcome = compare(_tiny, "recompute", budget=None)
    assert outcome.status == "exact" and not outcome.reason


def test_harness_inexact(fake_wrap):
    fake_wrap("inexact")
    with pytest.raises(MatrixFailure, match="loss of step 0"):
        compare(_tiny, "recompute", budget=None, optimizer="sgd")


def test_harness_refusal(fake_wrap):
    fake_wrap("refuse")
    outcome = compare(_tiny, "recompute", budget=None)
    assert outcome.status == "refused" and outcome.reason == "this model is refused"
    assert str(outcome) == "refused: this model is refused"


def test_harness_late_refusal(fake_wrap):
    fake_wrap("refuse-late")
    with pytest.raises(MatrixFailure, match="refused too late"):
        compare(_tiny, "recompute", budget=None)
    assert matrix.run(_tiny, "recompute", budget=None).status == "FAILED"


def test_harness_plain_raises(fake_wrap):
    fake_wrap("exact")               # the fake runs the model: raises where plain PyTorch does
    outcome = compare(CONSTRUCTS["c_inplace_on_saved"], "recompute", budget=None)
    assert outcome.status == "exact" and "raises as plain PyTorch does" in outcome.notes[0]
