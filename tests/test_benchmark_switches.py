"""The benchmarks' A/B switches (benchmarks/*/sitecustomize.py) apply in a fresh process put on
PYTHONPATH, as the device commands use them: a switch that silently does nothing measures the
runtime as it is and calls it the variant."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

PROBE = """
from superneurons.runtime import executor, pool
from superneurons.runtime.calibration import Calibration
from superneurons.planner import trim
print(executor.Executor._call.__name__, Calibration.begin_step.__name__,
      pool.HostMemory.__name__, trim.PLANNED_SHARE)
"""

AS_IS = ["_call", "begin_step", "HostMemory", "0.97"]


def _probe(switch: str, **environment) -> list:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SN_")}
    env.update(environment, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "benchmarks", switch), ROOT]))
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()[0].split()


# (switch, its environment, what the probe then prints otherwise than AS_IS, by position)
CASES = [
    ("planned_share", {"SN_PLANNED_SHARE": "0.9"}, {3: "0.9"}),
    ("planned_share", {}, {}),
    ("ab_calibration", {"SN_AB": "always_fitted"}, {0: "_fitted_call"}),
    ("ab_calibration", {"SN_AB": "always_calibrating"}, {1: "_always"}),
    ("ab_calibration", {}, {}),
    ("without_fence", {}, {2: "_WithoutFence"}),
]


@pytest.mark.parametrize("switch, environment, changed", CASES)
def test_a_switch_applies_in_a_fresh_process(switch, environment, changed):
    expected = [changed.get(index, value) for index, value in enumerate(AS_IS)]
    assert _probe(switch, **environment) == expected


def test_every_switch_is_probed():
    """A switch in benchmarks/ unprobed here could do nothing unseen."""
    switches = {name for name in os.listdir(os.path.join(ROOT, "benchmarks"))
                if os.path.isfile(os.path.join(ROOT, "benchmarks", name, "sitecustomize.py"))}
    assert switches == {switch for switch, *_ in CASES}
