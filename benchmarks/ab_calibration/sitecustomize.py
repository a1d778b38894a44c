"""An A/B switch for benchmarks: with this folder first on PYTHONPATH, every Python process
(claims.py's children included) runs the executor with one difference between a calibrating
step and a later one (executor Rules 4 and 9) removed, named by SN_AB:

- always_fitted: every step's convolutions run under the workspace limit, as a calibrating
  step's do (workspaces.py); the calibration itself is trusted as usual;
- always_calibrating: every step reads the allocator at every layer and makes its room from
  the readings (calibration.py), workspaces fitted too.

    SN_AB=always_fitted PYTHONPATH=$PWD/benchmarks/ab_calibration:$PWD python benchmarks/claims.py OUT ...
"""

import os

from superneurons.runtime.calibration import Calibration as _Calibration
from superneurons.runtime.executor import Executor as _Executor

_SWITCH = os.environ.get("SN_AB", "")

if _SWITCH == "always_fitted":
    _call = _Executor._call

    def _fitted_call(self, layer, args, kwargs, trains=False):
        was, self.calibrating = self.calibrating, True
        try:
            return _call(self, layer, args, kwargs, trains)
        finally:
            self.calibrating = was
    _Executor._call = _fitted_call
elif _SWITCH == "always_calibrating":
    _begin_step = _Calibration.begin_step

    def _always(self):
        self.left = max(self.left, 1)
        return _begin_step(self)
    _Calibration.begin_step = _always
elif _SWITCH:
    raise ValueError(f"SN_AB={_SWITCH!r}: say always_fitted or always_calibrating")
