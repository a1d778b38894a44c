"""The floor of GPT-2 small's training step (HF, batch 16 of 1,024 tokens, issue 16's decoder)
with its loss layer's backward sliced over rows (capture/sliced_loss.py) and with the original
operation, in fp32 and under bf16 autocast: the planner alone, on the CPU.

    python benchmarks/loss_floor.py OUT.json
"""

import sys

import torch

import superneurons as sn
from common import gpt2, token_batch, write
from superneurons.capture import sliced_loss


def floors(autocast, slice_loss: bool) -> dict:
    model = gpt2(positions=1024)
    call = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
            for k, v in token_batch(torch.device("cpu")).items()}
    plan = sn.plan(model, (), "superneurons", kwargs=call, autocast=autocast,
                   slice_loss=slice_loss)
    loss = next(layer for layer in plan.graph.layers if "cross_entropy" in layer.name)
    return {"floor_bytes": plan.peak_bytes, "largest_layer_bytes": plan.max_layer_bytes,
            "loss_layer_forward_bytes": plan.costs.forward[loss.index],
            "loss_layer_backward_bytes": plan.costs.backward[loss.index],
            "sliced": loss.node.target is sliced_loss.sliced_cross_entropy_loss}


def main(path: str) -> None:
    record = {"model": "HF GPT2LMHeadModel 12x768, seq 1024, batch 16, policy superneurons"}
    for name, autocast in (("fp32", None), ("bf16", torch.bfloat16)):
        record[f"{name}_sliced"] = floors(autocast, True)
        record[f"{name}_original"] = floors(autocast, False)
    write(path, record)


if __name__ == "__main__":
    main(sys.argv[1])
