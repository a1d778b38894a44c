"""An A/B switch for benchmarks: with this folder first on PYTHONPATH, every Python process
(ratio.py's and claims.py's children included) paces the executor's forward (Rule 10) as
SN_PACE_LEAD and SN_PACE_AT say.

SN_PACE_LEAD: a number of layers the host may queue ahead of the compute stream
(executor.PACE_LEAD); seconds of the plan's layer times ("0.001s": the host waits for what it
queued before the layers that many planned seconds back); or "unpaced" (the host never waits).
SN_PACE_AT: "moves" (the host waits only where the pool is about to move data) or "every"
(before every forward layer, whether the pool moves data there or not); unset, as the runtime
chooses (executor.PACE_EVERY_LAYER_SHARE).

    SN_PACE_LEAD=2 SN_PACE_AT=every PYTHONPATH=$PWD/benchmarks/pace_lead:$PWD \\
        python benchmarks/ratio.py OUT ...
"""

import os

import torch

from superneurons.runtime import executor as _executor

_LEAD = os.environ.get("SN_PACE_LEAD", "")
_AT = os.environ.get("SN_PACE_AT", "")

if _LEAD == "unpaced":
    _executor.Pace.settle = lambda pace, position: None
elif _LEAD.endswith("s"):
    _SECONDS = float(_LEAD[:-1])
    _init = _executor.Executor.__init__

    def _init_knowing_layer_times(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        if self.pace is not None:
            self.pace.work_before = self.work_before     # the plan's seconds of the first k layers

    def _settle_in_seconds(pace, position):      # the marks' positions, in planned seconds
        last = None
        while pace.marks and \
                pace.work_before[position] - pace.work_before[pace.marks[0][0]] >= _SECONDS:
            last = pace.marks.popleft()[1]
        if last is not None:
            last.synchronize()
            pace.waits += 1
    _executor.Executor.__init__ = _init_knowing_layer_times
    _executor.Pace.settle = _settle_in_seconds
elif _LEAD:
    _executor.PACE_LEAD = int(_LEAD)

if _AT in ("moves", "every"):
    _begin = _executor.Pace.begin_forward

    def _begin_forward_pacing_as_said(pace, num_layers):
        _begin(pace, num_layers)
        pace.everywhere = _AT == "every"
    _executor.Pace.begin_forward = _begin_forward_pacing_as_said
elif _AT:
    raise ValueError(f"SN_PACE_AT is 'moves' or 'every', not {_AT!r}")
