"""An experiment switch for benchmarks: with this folder first on PYTHONPATH, every Python
process frees, before each convolution of a step that trusts its calibration (executor Rules 4
and 9: no workspace fit), the device bytes of every offload still in flight, behind a wait of the
compute stream for its copy (pool Rule 4), not of the host.

It tests one explanation of executor Rule 10's measurements: a calibrating step's fitted
convolutions kept engines whose workspaces fit beside a pool whose earlier copies had finished;
a trusting step whose host runs ahead finds those copies unfinished, the pool holds their bytes
within its room, and the kept engine's workspace takes the same room again. If so, ResNet-101 at
batch 896 holds its calibrating steps' peak unpaced with this switch, and passes its budget
without it:

    PYTHONPATH=$PWD/benchmarks/drain_before_conv:$PWD SN_PACE_LEAD=unpaced \
        python benchmarks/diagnose_trusting_peak.py OUT --bare --steps 4

A process imports the first sitecustomize on its path alone, so this one runs benchmarks/
pace_lead's where SN_PACE_LEAD is set: with both folders on the path, pace_lead's was never
run, and the steps waited before every layer. At exit it prints, per process, the bytes so freed early and before how many convolutions.
"""

import atexit
import json
import os
import runpy

from superneurons.capture.kinds import Kind
from superneurons.runtime import executor as _executor

_call = _executor.Executor._call
_freed = {"bytes": 0, "convolutions": 0}


def _call_after_freeing_copies_in_flight(self, layer, args, kwargs, trains=False):
    if layer.kind is Kind.CONV and self.device.type == "cuda" and not self.calibrating and \
            not self.calibration.raised and self.pool.draining:
        _freed["bytes"] += sum(footprint for *_, footprint in self.pool.draining)
        _freed["convolutions"] += 1
        self.pool._drain(limit=-1)        # below any room: every copy in flight is waited for
    return _call(self, layer, args, kwargs, trains)


_executor.Executor._call = _call_after_freeing_copies_in_flight
if os.environ.get("SN_PACE_LEAD"):
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "pace_lead", "sitecustomize.py"))
atexit.register(lambda: print(json.dumps({"freed_before_convolutions": _freed}), flush=True))
