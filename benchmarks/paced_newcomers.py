"""Executor Rule 10's pace on models nobody here wrote, on the CPU: every executor paced as
after a CUDA step that moved data, with a compute stream that only counts its marks and waits,
through newcomers_exact.compare (3 AdamW steps from one seed, dropout on; offload at its plan's
peak, recompute, superneurons at its floor and halfway). Says whether the steps stay bit for bit
and how each forward waited: before every layer, or only where the pool moved data.

    OMP_NUM_THREADS=1 python benchmarks/paced_newcomers.py OUT_DIR
        (CPU; writes OUT_DIR/paced_newcomers.json)
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import newcomers_exact  # noqa: E402
from newcomers_more import timm_classifier  # noqa: E402


class CountingStream:
    """A compute stream whose marks count the host's waits for them."""

    def __init__(self):
        self.marks = self.waits = 0

    def record_event(self):
        self.marks += 1
        return type("Mark", (), {"synchronize": lambda _: setattr(self, "waits", self.waits + 1)})()


def hf_resnet():
    import transformers
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                       num_labels=10)
    model, args, kwargs, loss_of = newcomers_exact._classifier(
        lambda: transformers.ResNetForImageClassification(config))
    return model, args, kwargs, lambda out: loss_of(out.logits)


MODELS = {"timm cs3darknet_focus_s": timm_classifier("cs3darknet_focus_s", 64, drop_rate=0.1),
          "timm repghostnet_050": timm_classifier("repghostnet_050", 64, drop_rate=0.1),
          "HF ResNetForImageClassification": hf_resnet}


def main():
    from common import write
    from superneurons.runtime import executor
    stream, forwards = CountingStream(), []
    torch.cuda.current_stream = lambda device=None: stream
    run = executor.Executor.run

    def paced_run(self, args, foreign=None):
        if self.pace is None:
            self.pace, self.paced = executor.Pace(torch.device("cuda", 0)), True
        out = run(self, args, foreign)
        forwards.append({"layers": self.num_layers, "every_layer": self.pace.everywhere,
                         "waits": self.pace.waits, "moves": len(self.pace.moves)})
        return out
    executor.Executor.run = paced_run
    rows = newcomers_exact.compare(MODELS, offload_moving=True)
    write(os.path.join(sys.argv[1], "paced_newcomers.json"), {
        "steps": newcomers_exact.STEPS, "rows": rows, "forwards": forwards,
        "pairs_bit_identical": sum(bool(r.get("bit_identical")) for r in rows),
        "pairs": len(rows), "marks": stream.marks, "waits": stream.waits})


if __name__ == "__main__":
    main()
