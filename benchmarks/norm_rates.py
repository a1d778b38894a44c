"""How fast normalization runs for its bytes, against a copy and a ReLU of the same tensor: the
rate the planner's cost model assumes for a batch norm's replay is the copy's
(planner/costs.py: a cheap layer costs its bytes at the memory rate). Each timing is the
fastest of 5 runs after one untimed run, as the machine's own rates are timed
(runtime/machine.py); rates count the input's and output's bytes once each. Batch norms in
training mode (batch statistics, running statistics updated), NCHW, at ResNet-50 shapes; a
layer norm at a GPT-2-small shape (16 sequences of 1024 tokens, d 768).

    python benchmarks/norm_rates.py > OUT.json
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from superneurons.runtime.machine import fastest_seconds as seconds  # noqa: E402

SHAPES = [(32, 256, 56, 56), (192, 256, 56, 56), (192, 64, 56, 56), (192, 1024, 14, 14)]


def rate(x: torch.Tensor, run) -> dict:
    s = seconds(run)
    return {"s": s, "bytes_per_s": 2 * x.numel() * x.element_size() / s}


def main():
    device = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    source = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    out["copy_bytes_per_s"] = 2 * source.numel() / seconds(lambda: target.copy_(source))
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.full(shape, 0.5, dtype=dtype, device=device)
            c = shape[1]
            weight, bias = torch.ones(c, device=device), torch.zeros(c, device=device)
            mean, var = torch.zeros(c, device=device), torch.ones(c, device=device)
            out[f"bn {shape} {dtype}"] = rate(x, lambda: F.batch_norm(
                x, mean, var, weight, bias, training=True))
            out[f"relu {shape} {dtype}"] = rate(x, lambda: F.relu(x))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.full((16384, 768), 0.5, dtype=dtype, device=device)
        weight = torch.ones(768, dtype=dtype, device=device)
        out[f"ln {dtype}"] = rate(x, lambda: F.layer_norm(x, (768,), weight, weight))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
