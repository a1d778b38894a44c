"""The sliced loss layer's time and memory against its slice size (capture/sliced_loss.py's
SLICE_BYTES), on GPT-2 small's logits (16 x 1,024 rows of 50,257 classes): bf16 logits cast per
slice (Rule 5) and float32 logits, forward and backward, against PyTorch's own cross-entropy
(of logits.float() for bf16, as HF's loss calls it).

    python benchmarks/loss_slices.py OUT_DIR [--sizes-mib 0 256 128 64 32 16] [--repeats 10]

A size of 0 is SLICES alone (16 slices, whatever their bytes). Writes OUT_DIR/loss_slices.json:
per form and size, the slices, the median seconds of a forward and backward, and the peak
allocated above the logits and their targets.
"""

import argparse
import os
import statistics
import sys
from unittest import mock

import torch
import torch.nn.functional as F

from common import write
from ratio import BATCH, SEQUENCE, VOCAB
from superneurons.capture import sliced_loss


def timed(run, repeats: int) -> tuple:
    """(median seconds, peak bytes allocated above what was allocated before) of ``run``."""
    run()                                                           # warm: kernels, allocator
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeats):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        run()
        ended.record()
        torch.cuda.synchronize()
        seconds.append(began.elapsed_time(ended) / 1000)
    return statistics.median(seconds), torch.cuda.max_memory_allocated() - before


def forms(dtype: torch.dtype):
    """(name, plain loss, sliced loss) for logits of ``dtype``, each taking (logits, target)."""
    if dtype == torch.float32:
        return (lambda x, t: F.cross_entropy(x, t),
                lambda x, t: sliced_loss.sliced_cross_entropy_loss(x, t))
    return (lambda x, t: F.cross_entropy(x.float(), t),
            lambda x, t: sliced_loss.sliced_cast_cross_entropy_loss(x, x.shape, t))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sizes-mib", nargs="*", type=int, default=[0, 256, 128, 64, 32, 16])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows_count = BATCH["gpt2"] * SEQUENCE
    generator = torch.Generator("cuda").manual_seed(0)
    target = torch.randint(0, VOCAB, (rows_count,), device="cuda", generator=generator)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(rows_count, VOCAB, device="cuda", generator=generator).to(dtype)
        logits.requires_grad_()
        plain, sliced = forms(dtype)

        def step(loss_of):
            loss_of(logits, target).backward()
            logits.grad = None

        seconds, peak = timed(lambda: step(plain), args.repeats)
        rows.append({"dtype": str(dtype), "form": "plain", "seconds": seconds,
                     "peak_above_bytes": peak})
        print(rows[-1], flush=True)
        for size in args.sizes_mib:
            limit = size << 20 if size else 1 << 62
            with mock.patch.object(sliced_loss, "SLICE_BYTES", limit):
                slices = len(sliced_loss._slices(logits))
                seconds, peak = timed(lambda: step(sliced), args.repeats)
            rows.append({"dtype": str(dtype), "form": "sliced", "slice_mib": size,
                         "slices": slices, "seconds": seconds, "peak_above_bytes": peak})
            print(rows[-1], flush=True)
        del logits
    write(os.path.join(args.out, "loss_slices.json"),
          {"rows_count": rows_count, "classes": VOCAB, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
