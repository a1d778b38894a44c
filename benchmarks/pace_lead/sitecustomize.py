"""An A/B switch for benchmarks: with this folder first on PYTHONPATH, every Python process
(ratio.py's children included) paces the executor's forward (Rule 10) as SN_PACE_LEAD says:
a number of layers the host may queue ahead of the compute stream (executor.PACE_LEAD), or
"unpaced" (the host runs ahead as far as PyTorch lets it, as before Rule 10).

    SN_PACE_LEAD=2 PYTHONPATH=$PWD/benchmarks/pace_lead:$PWD python benchmarks/ratio.py OUT ...
"""

import os

from superneurons.runtime import executor as _executor

_LEAD = os.environ.get("SN_PACE_LEAD", "")

if _LEAD == "unpaced":
    _executor.Pace.before_layer = lambda pace: None
elif _LEAD:
    _executor.PACE_LEAD = int(_LEAD)
