"""The rates the planner weighs replays against moves with (superneurons/runtime/machine.py),
measured three times under PyTorch's default TF32 settings and three times with TF32 off, as
the benchmarks here run (common.torch_settings). Their spread says how far one measurement,
the one a wrapped model's first plan takes, can be from another.

    python benchmarks/machine_rates.py OUT.json
"""

import sys
from dataclasses import asdict

import torch

from common import write
from superneurons.runtime import machine

SETTINGS = {"pytorch_defaults": (torch.backends.cuda.matmul.allow_tf32,
                                 torch.backends.cudnn.allow_tf32),
            "no_tf32": (False, False)}


def main(path: str) -> None:
    device = torch.device("cuda", 0)
    record = {"settings": {}}
    for name, (matmul, cudnn) in SETTINGS.items():
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        runs = []
        for _ in range(3):
            machine._MEASURED.clear()
            runs.append(asdict(machine.machine_of(device)))
        record["settings"][name] = {"matmul_allow_tf32": matmul, "cudnn_allow_tf32": cudnn,
                                    "runs": runs}
    write(path, record)


if __name__ == "__main__":
    main(sys.argv[1])
