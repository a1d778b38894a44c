"""Where a wrapped HF GPT-2 step fails on CUDA: one step per policy, faulthandler on.

    python -X faulthandler benchmarks/diagnose_gpt2.py
"""
import faulthandler
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import superneurons as sn  # noqa: E402
from benchmarks.common import gpt2 as _gpt2  # noqa: E402

faulthandler.enable()
device = torch.device("cuda", 0)
for policy in sys.argv[1:] or ("recompute", "offload", "superneurons"):
    torch.manual_seed(0)
    model = _gpt2(layers=2, width=128, heads=2, positions=128, vocab=1000).to(device)
    ids = torch.randint(0, 1000, (2, 128), device=device)
    kwargs = dict(input_ids=ids, labels=ids, use_cache=False)
    wrapped = sn.wrap(model, policy=policy)
    print(policy, "planned", flush=True)
    for step in range(2):
        wrapped(**kwargs).loss.backward()
        torch.cuda.synchronize()
        print(policy, "step", step, wrapped.stats, flush=True)
