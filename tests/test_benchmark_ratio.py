"""benchmarks/ratio.py without a GPU: the checkpoint peer's wrapping trains as plain PyTorch
does, and a run measures plain first and caps every other system at a share of its peak."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import ratio  # noqa: E402

torchvision = pytest.importorskip("torchvision")


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_b0"])
def test_checkpoint_per_block_gives_plain_gradients(name):
    def grads(wrap):
        torch.manual_seed(0)
        model = torchvision.models.get_model(name, weights=None, num_classes=10).train()
        if wrap:
            ratio.checkpoint_blocks(model)
        torch.manual_seed(1)
        x = torch.randn(2, 3, 64, 64)
        torch.nn.functional.cross_entropy(model(x), torch.tensor([1, 2])).backward()
        return [p.grad for p in model.parameters()], model
    plain, _ = grads(False)
    wrapped, model = grads(True)
    assert any(type(m).__name__ == "_Checkpointed" for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped))


def test_plain_runs_first_and_sets_every_cap(tmp_path):
    calls = []

    def child(name, dtype, system, fraction, plain_peak, steps):
        calls.append((system, fraction, plain_peak))
        if system == "plain":
            return {"ok": True, "per_s": 100.0, "peak_allocated_bytes": 8000}
        if system == "checkpoint" and fraction == 0.25:
            return {"ok": False, "error": "out of memory"}
        return {"ok": True, "per_s": 100.0 * fraction, "peak_allocated_bytes": 1}
    record = ratio.run_model(str(tmp_path), "resnet50", "fp32", ["checkpoint", "superneurons"],
                             [0.5, 0.25], steps=1, child=child)
    assert calls[0] == ("plain", None, None)
    assert all(peak == 8000 for system, _, peak in calls[1:])
    assert len(record["rows"]) == 5 and record["complete"]
    failed = [r for r in record["rows"] if not r["ok"]]
    assert [(r["system"], r["ratio"]) for r in failed] == [("checkpoint", 0.25)]
    assert {r["of_plain"] for r in record["rows"][1:] if r["ok"]} == {0.5, 0.25}
    with open(tmp_path / "ratio_resnet50_fp32.json") as file:
        assert json.load(file)["rows"] == record["rows"]
    ratio.plot(str(tmp_path), "resnet50")
    assert (tmp_path / "ratio_resnet50.png").exists()
