"""GPT-2 small's floor under bf16 autocast as sn.wrap plans it (ratio.py's step: batch 16 of
1,024 tokens, labels given), with its loss layer three ways: PyTorch's cross-entropy whole
(slice_loss=False); sliced over rows, forward and backward, on the float32 copy HF's loss makes
of the logits (logits.float()); and sliced on the bf16 logits themselves, that copy made per
slice (capture/sliced_loss.py Rule 5, the default).

    python benchmarks/cast_loss_floor.py OUT_DIR [--device cpu|cuda]

The graph is traced from the model's real call under the device's autocast, as the wrapper
traces it on its first step (on the CPU, under the CPU's autocast). Writes
OUT_DIR/cast_loss_floor[_cuda].json: per form, the floor in bytes and its highest steps.
"""

import argparse
import os
import sys
from unittest import mock

import torch

from common import gpt2, token_batch, write
from gpt2_floor import floor_plan, top_steps
from ratio import BATCH, SEQUENCE, VOCAB
from superneurons.capture import capture, sliced_loss

FORMS = ("whole", "sliced", "sliced, cast per slice")


def traced(model, call, device: str, form: str):
    state = (device, torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16), \
            mock.patch.object(sliced_loss, "_cast_for_the_loss_alone",
                              sliced_loss._cast_for_the_loss_alone if form == FORMS[2]
                              else lambda loss: None):
        return capture(model, (), state, dict(call), slice_loss=form != "whole")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    with torch.device(args.device):
        model = gpt2(positions=SEQUENCE, vocab=VOCAB)
    call = token_batch(args.device, BATCH["gpt2"], SEQUENCE, VOCAB)
    rows = []
    for form in FORMS:
        graph = traced(model, call, args.device, form)
        plan = floor_plan(graph)
        loss = next(layer for layer in graph.layers if "cross_entropy" in layer.name)
        rows.append({"loss_layer": form, "target": getattr(loss.node.target, "__name__",
                                                           str(loss.node.target)),
                     "floor_bytes": plan.peak_bytes, "floor_gib": plan.peak_bytes / 2**30,
                     "highest_steps": top_steps(plan)})
        print({k: v for k, v in rows[-1].items() if k != "highest_steps"}, flush=True)
    suffix = "" if args.device == "cpu" else "_cuda"
    write(os.path.join(args.out, f"cast_loss_floor{suffix}.json"),
          {"model": "GPT-2 small (HF), bf16 autocast", "batch": BATCH["gpt2"],
           "sequence": SEQUENCE, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
