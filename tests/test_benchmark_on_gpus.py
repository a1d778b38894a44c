"""benchmarks/on_gpus.py: commands side by side, one per GPU slot, each within its limit."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from on_gpus import run_all  # noqa: E402

SCRIPT = """import os, sys, time
print("gpu", os.environ["CUDA_VISIBLE_DEVICES"], "nvls", os.environ["NCCL_NVLS_ENABLE"],
      "started", time.time(), flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
"""


def test_commands_share_the_slots_and_each_keeps_its_limit(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    status = run_all([f"{script} 1.5 0", f"{script} 1.5 3", f"{script} 30 0"], gpus=2,
                     limit=4, out=str(tmp_path), poll=0.1)
    assert status == [0, 3, None]           # the third ran past its limit and was stopped
    logs = {name: (tmp_path / name).read_text() for name in ("gpu0.log", "gpu1.log")}
    assert "gpu 0 nvls 0" in logs["gpu0.log"] and "gpu 1 nvls 0" in logs["gpu1.log"]
    assert "=== exit 3" in logs["gpu1.log"]
    assert "=== stopped after 4 s" in "".join(logs.values())
    starts = sorted(float(line.split()[-1]) for log in logs.values()
                    for line in log.splitlines() if " started " in line)
    assert starts[1] - starts[0] < 1.0       # the first two ran side by side
    assert starts[2] - starts[0] > 1.0       # the third waited for a free slot
