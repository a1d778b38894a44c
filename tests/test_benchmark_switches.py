"""The benchmarks' A/B switches (benchmarks/*/sitecustomize.py) apply in a fresh process put on
PYTHONPATH, as the device commands use them: a switch that silently does nothing measures the
runtime as it is and calls it the variant (the drain switch's first run did)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

PROBE = """
from superneurons.runtime import executor
from superneurons.planner import trim
print(executor.Pace.settle.__name__ == "<lambda>" and executor.Pace.settle(None, 0) is None,
      executor.Executor._call.__name__, trim.PLANNED_SHARE)
"""


def _probe(switch: str, **environment) -> list:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SN_")}
    env.update(environment, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "benchmarks", switch), ROOT]))
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()[0].split()     # the drain switch prints at exit too


@pytest.mark.parametrize("switch, environment, expected", [
    ("pace_lead", {"SN_PACE_LEAD": "unpaced"}, ["True", "_call", "0.97"]),
    ("planned_share", {"SN_PLANNED_SHARE": "0.9"}, ["False", "_call", "0.9"]),
    # the drain switch runs pace_lead's settings itself: a process imports one sitecustomize
    ("drain_before_conv", {"SN_PACE_LEAD": "unpaced"},
     ["True", "_call_after_freeing_copies_in_flight", "0.97"]),
    ("drain_before_conv", {}, ["False", "_call_after_freeing_copies_in_flight", "0.97"]),
])
def test_a_switch_applies_in_a_fresh_process(switch, environment, expected):
    assert _probe(switch, **environment) == expected
