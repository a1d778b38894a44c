"""How long capture takes: torch.fx (the zoo) against torch.export (any other model), on deep
networks and on today's models. CPU only; capture allocates nothing.

    python benchmarks/capture_time.py OUT.json
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import environment, write  # noqa: E402
from superneurons import models  # noqa: E402
from superneurons.capture import capture  # noqa: E402


def _timed(build, example, kwargs=None, tracer="auto") -> dict:
    with torch.device("meta"):
        model = build()
    started = time.perf_counter()
    graph = capture(model, example, kwargs=kwargs, tracer=tracer)
    return {"seconds": round(time.perf_counter() - started, 2), "layers": len(graph.layers),
            "exported": graph.in_spec is not None}


def _gpt2(layers):
    from transformers import GPT2Config, GPT2LMHeadModel
    return lambda: GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=768, n_head=12))


def main(out: str) -> None:
    import torchvision
    ids = torch.empty(1, 1024, dtype=torch.long, device="meta")
    cases = {
        "zoo resnet depth 1001, fx": (lambda: models.resnet(1001), (16, 3, 32, 32), None, "auto"),
        "zoo resnet depth 1001, export": (lambda: models.resnet(1001), (16, 3, 32, 32), None,
                                          "export"),
        "zoo resnet50, fx": (lambda: models.resnet(50), (16, 3, 224, 224), None, "auto"),
        "zoo resnet50, export": (lambda: models.resnet(50), (16, 3, 224, 224), None, "export"),
        "torchvision resnet50": (torchvision.models.resnet50, (16, 3, 224, 224), None, "auto"),
        "torchvision vit_b_16": (torchvision.models.vit_b_16, (16, 3, 224, 224), None, "auto"),
        "HF GPT-2 12 layers": (_gpt2(12), (), dict(input_ids=ids, labels=ids, use_cache=False),
                               "auto"),
    }
    record = {**environment(), "part": "capture_time", "complete": False, "rows": {}}
    for name, (build, example, kwargs, tracer) in cases.items():
        record["rows"][name] = _timed(build, example, kwargs, tracer)
        print(name, record["rows"][name], flush=True)
        write(out, record, quiet=True)
    record["complete"] = True
    write(out, record)


if __name__ == "__main__":
    main(sys.argv[1])
