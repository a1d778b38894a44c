"""An A/B switch for benchmarks: with this folder first on PYTHONPATH, every Python process
(ratio.py's and claims.py's children included) plans with the share of the budget that
SN_PLANNED_SHARE says (planner/trim.PLANNED_SHARE, 0.97 by default), the rest left to what
the byte model misses.

    SN_PLANNED_SHARE=0.93 PYTHONPATH=$PWD/benchmarks/planned_share:$PWD python benchmarks/ratio.py OUT ...
"""

import importlib
import os

_plan = importlib.import_module("superneurons.planner.plan")   # the package exports plan()
_trim = importlib.import_module("superneurons.planner.trim")

if os.environ.get("SN_PLANNED_SHARE"):
    _trim.PLANNED_SHARE = _plan.PLANNED_SHARE = float(os.environ["SN_PLANNED_SHARE"])
