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


@pytest.mark.parametrize("workers", [1, 3])
def test_plain_runs_first_and_sets_every_cap(tmp_path, workers):
    calls, lock = [], __import__("threading").Lock()

    def child(name, dtype, system, fraction, plain_peak, steps):
        with lock:
            calls.append((name, system, fraction, plain_peak))
        peak = 8000 if name == "resnet50" else 6000
        if system == "plain":
            return {"ok": True, "per_s": 100.0, "peak_allocated_bytes": peak}
        if system == "checkpoint" and fraction == 0.25:
            return {"ok": False, "error": "out of memory"}
        return {"ok": True, "per_s": 100.0 * fraction, "peak_allocated_bytes": 1}
    cases = [("resnet50", "fp32"), ("gpt2", "bf16")]
    records = ratio.run_all(str(tmp_path), cases, ["checkpoint", "superneurons"], [0.5, 0.25],
                            steps=1, child=child, workers=workers)
    assert [c[:3] for c in calls[:2]] == [("resnet50", "plain", None), ("gpt2", "plain", None)]
    for name, system, fraction, peak in calls[2:]:
        assert peak == ((8000 if name == "resnet50" else 6000) if fraction else None)
    for case, record in records.items():
        rows = record["rows"]
        assert len(rows) == 7 and record["complete"] and rows[0]["system"] == "plain"
        failed = [(r["system"], r["ratio"]) for r in rows if not r["ok"]]
        assert failed == [("checkpoint", 0.25)]
        capped = {r["of_plain"] for r in rows[1:] if r["ok"] and not r["control"]}
        assert capped == {0.5, 0.25}
        assert [r["of_plain"] for r in rows if r["control"]] == [1.0, 1.0]  # after each ratio
        with open(tmp_path / f"ratio_{case[0]}_{case[1]}.json") as file:
            assert json.load(file)["rows"] == rows
    ratio.plot(str(tmp_path), "resnet50")
    assert (tmp_path / "ratio_resnet50.png").exists()


def _waiting(path, take: str, hold_for: float = 0.0):
    """A process that takes the GPU lock at ``path`` (``take``: "share" or "own"), prints
    "held", keeps it ``hold_for`` seconds and exits."""
    import subprocess
    code = (f"import sys, time; sys.path.insert(0, {os.path.dirname(ratio.__file__)!r}); "
            f"import ratio; lock = ratio.GpuLock({str(path)!r}); lock.{take}(); "
            f"print('held', flush=True); time.sleep({hold_for})")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _blocked(process, seconds: float = 1.0) -> bool:
    import subprocess
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


def test_timed_steps_have_the_gpu_alone_and_go_before_new_first_steps(tmp_path):
    """First steps share the GPU; a process timing its steps waits for the first steps running,
    and first steps asking after it wait for it (else a stream of first steps would keep the
    timed steps waiting, or run beside them)."""
    path = tmp_path / "gpu.lock"
    first_step = ratio.GpuLock(str(path))
    first_step.share()
    assert not _blocked(_waiting(path, "share"))       # first steps run side by side
    timed = _waiting(path, "own", hold_for=2.0)
    assert _blocked(timed)                              # waits for the first step running
    later = _waiting(path, "share")
    assert _blocked(later)                              # and goes before a later first step
    first_step.held.close()                             # the first step is done
    assert timed.stdout.readline().strip() == "held"
    assert _blocked(later, 0.5)                         # the GPU is the timed steps' alone
    assert timed.wait(timeout=30) == 0
    assert later.communicate(timeout=30)[0].strip() == "held"


def test_without_a_lock_file_nothing_waits(monkeypatch):
    monkeypatch.delenv(ratio.GPU_LOCK, raising=False)
    lock = ratio.GpuLock.from_environment()
    lock.share()
    lock.own()
    assert lock.held is None


def test_a_run_stops_when_the_device_rates_were_not_kept_alone(tmp_path, monkeypatch):
    """Every worker would otherwise measure the rates beside the others' first steps."""
    import common
    monkeypatch.setenv("SUPERNEURONS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(common, "run_child", lambda command, timeout, cwd=None: {"ok": False})
    with pytest.raises(SystemExit, match="not kept"):
        ratio.rates_measured_alone()

    def measured_alone(command, timeout, cwd=None):
        (tmp_path / "machine_rates.json").write_text("{}")
        return {"link_bytes_per_s": 5e10}
    monkeypatch.setattr(common, "run_child", measured_alone)
    assert ratio.rates_measured_alone() == {"link_bytes_per_s": 5e10}
    assert os.environ["SUPERNEURONS_CACHE_DIR"] == str(tmp_path)


def test_steps_are_timed_after_the_warm_up_the_calibration_and_the_trial():
    seconds = [4.0, 0.4, 0.2, 0.19, 0.13, 0.13]
    assert ratio.after_warm_up(seconds, []) == seconds[2:]                     # the peers
    assert ratio.after_warm_up(seconds, [True] * 3 + [False] * 3) == seconds[3:]
    # a calibration made again later is a steady cost: timed
    assert ratio.after_warm_up(seconds, [True, True, True, False, True, False]) == seconds[3:]
    assert ratio.after_warm_up(seconds, [True] * 6) == []
    # plans tried on the machine (module Rule 10) are not the one kept: untimed to the last
    trying = [False, False, False, True, False, False]
    assert ratio.after_warm_up(seconds, [True] * 3 + [False] * 3, trying) == seconds[4:]


def test_the_budget_leaves_the_headroom_the_environment_names(monkeypatch):
    cap = 12 * 2**30
    monkeypatch.delenv(ratio.HEADROOM, raising=False)
    assert ratio.superneurons_budget(cap) == int(cap * (1 - ratio.CAP_HEADROOM))   # 11.5 GiB
    monkeypatch.setenv(ratio.HEADROOM, "0.15")
    assert ratio.superneurons_budget(cap) == int(cap * 0.85)


def test_the_host_state_row_keeps_the_model_and_its_adamw_on_the_host(monkeypatch):
    """superneurons_host trains the model as superneurons does, its parameters and AdamW's
    state in host memory (on a machine without a GPU the "device" is the CPU itself)."""
    def build(name, system, device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4)).to(device)
        x, y = torch.randn(6, 8, device=device), torch.tensor([0, 1, 2, 3, 0, 1], device=device)
        return model, (x,), {}, lambda out: torch.nn.functional.cross_entropy(out, y)
    monkeypatch.setattr(ratio, "build", build)
    trained = {}
    for system in ("superneurons", "superneurons_host"):
        run, step, cap, _ = ratio.prepare("tiny", "fp32", system, None, None, torch.device("cpu"))
        for _ in range(3):
            step()
        trained[system] = [p.detach().clone() for p in run.model.parameters()]
        assert cap is None and run.state == ("host" if system.endswith("host") else "device")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in
               zip(trained["superneurons"], trained["superneurons_host"]))
    assert "superneurons_host" not in ratio.DEFAULT_SYSTEMS
