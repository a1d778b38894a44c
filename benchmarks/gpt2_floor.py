"""GPT-2 small's floor as planned (CPU, no device): the smallest budget superneurons plans
ratio.py's GPT-2 step in (batch 16 of 1,024 tokens, labels given, its loss sliced), in fp32 and
under bf16 autocast, counting the backward of the model's loss alone (planner/gradients.py
Rule 5) and with a gradient from outside into every output as well (outside_gradients=True,
as every plan counted it before Rule 5).

    python benchmarks/gpt2_floor.py OUT_DIR      (writes OUT_DIR/gpt2_floor.json)
"""

import os
import sys

import torch

import superneurons as sn
from common import gpt2, token_batch, write
from ratio import BATCH, SEQUENCE, VOCAB


def floor(autocast, outside: bool) -> int:
    with torch.device("meta"):
        model = gpt2(positions=SEQUENCE, vocab=VOCAB)
    call = {k: v.to("meta") if torch.is_tensor(v) else v
            for k, v in token_batch("cpu", BATCH["gpt2"], SEQUENCE, VOCAB).items()}
    try:
        return sn.plan(model, (), "superneurons", budget=1, kwargs=call, autocast=autocast,
                       outside_gradients=outside).peak_bytes
    except ValueError as error:              # BudgetError: its peak is the floor
        return error.peak_bytes


def main():
    rows = [{"dtype": name, "outside_gradients": outside, "floor_bytes": floor(dtype, outside)}
            for name, dtype in (("fp32", None), ("bf16", torch.bfloat16))
            for outside in (False, True)]
    for row in rows:
        print(row, flush=True)
    write(os.path.join(sys.argv[1], "gpt2_floor.json"), {"rows": rows})


if __name__ == "__main__":
    main()
