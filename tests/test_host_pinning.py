"""The host store's pinning setting (host Rule 6): set once, the user's settings kept, none of
ours where the user chose pinned options."""

import pytest
import torch

from superneurons.runtime import host


@pytest.fixture
def settings(monkeypatch):
    given = []
    monkeypatch.setattr(host, "_pinning_set", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", given.append)
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setattr(host.os, "cpu_count", lambda: 12)
    return given


def _in_force(monkeypatch, text: str) -> None:
    """The allocator settings PyTorch says are in force."""
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: text,
                        raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", text)


def test_pinning_threads_are_set_once_keeping_the_users_settings(settings, monkeypatch):
    _in_force(monkeypatch, "expandable_segments:True")
    host._pin_with_threads()
    host._pin_with_threads()
    assert settings == ["expandable_segments:True,pinned_use_cuda_host_register:True,"
                        "pinned_num_register_threads:8"]      # a power of two, within 12 cores


def test_a_warning_from_the_setting_never_ends_a_step(monkeypatch):
    import warnings
    monkeypatch.setattr(host, "_pinning_set", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings",
                        lambda text: warnings.warn("deprecated", FutureWarning))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host._pin_with_threads()


def test_the_users_pinned_options_win(settings, monkeypatch):
    _in_force(monkeypatch, "pinned_use_cuda_host_register:False")
    host._pin_with_threads()
    assert settings == []


def test_a_step_counts_the_host_time_it_spent_taking_memory():
    """The first step takes host memory for its offloads; the next reuses it (StepStats)."""
    import torch.nn.functional as F
    import superneurons as sn
    from superneurons import models
    model = models.resnet(blocks=(1, 1, 1, 1), num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    wrapped = sn.wrap(model, policy="superneurons")
    seconds = []
    for _ in range(2):
        F.nll_loss(wrapped(x), y).backward()
        assert wrapped.stats.offloaded_bytes > 0
        seconds.append(wrapped.stats.host_memory_seconds)
    assert seconds[0] > 0 and seconds[1] == 0.0
    assert wrapped.stats.calibration_seconds == 0.0           # no allocator on the CPU
