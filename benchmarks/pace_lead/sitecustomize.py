"""An A/B switch for benchmarks: with this folder first on PYTHONPATH, every Python process
(ratio.py's and claims.py's children included) paces the executor's forward (Rule 10) as
SN_PACE_LEAD says: a number of layers the host may queue ahead of the compute stream
(executor.PACE_LEAD); seconds of the plan's layer times ("0.001s": before each layer the host
waits for what it queued before the layers that many planned seconds back); or "unpaced" (the
host runs ahead as far as PyTorch lets it).

    SN_PACE_LEAD=2 PYTHONPATH=$PWD/benchmarks/pace_lead:$PWD python benchmarks/ratio.py OUT ...
"""

import os

import torch

from superneurons.runtime import executor as _executor

_LEAD = os.environ.get("SN_PACE_LEAD", "")

if _LEAD == "unpaced":
    _executor.Pace.before_layer = lambda pace, position: None
elif _LEAD.endswith("s"):
    _SECONDS = float(_LEAD[:-1])
    _init = _executor.Executor.__init__

    def _init_knowing_layer_times(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        if self.pace is not None:
            self.pace.work_before = self.work_before     # the plan's seconds of the first k layers

    def _before_layer_in_seconds(pace, position):
        pace.marks.append((position, torch.cuda.current_stream(pace.device).record_event()))
        while pace.marks and \
                pace.work_before[position] - pace.work_before[pace.marks[0][0]] >= _SECONDS:
            pace.marks.popleft()[1].synchronize()
    _executor.Executor.__init__ = _init_knowing_layer_times
    _executor.Pace.before_layer = _before_layer_in_seconds
elif _LEAD:
    _executor.PACE_LEAD = int(_LEAD)
