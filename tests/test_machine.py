"""The planner weighs replays and moves with the rates of the machine it plans for
(planner/costs.Machine), measured on the device a wrapped model runs on (runtime/machine.py)."""

from dataclasses import replace

import pytest
import torch

from superneurons.capture import Kind, capture
from superneurons.models import input_shape
from superneurons.planner import H200, layer_costs
from superneurons.runtime.machine import machine_of
from conftest import meta_model


def _resnet_graph(autocast=None):
    return capture(meta_model("resnet50"), input_shape("resnet50", 8), autocast)


def test_a_faster_convolution_makes_its_replay_cheaper_and_a_relu_costs_its_bytes():
    graph = _resnet_graph()
    fast = replace(H200, conv_flops_per_s={k: 10 * v for k, v in H200.conv_flops_per_s.items()})
    slow, quick = layer_costs(graph, H200).work, layer_costs(graph, fast).work
    convs = [l.index for l in graph.layers if l.kind is Kind.CONV and l.name.endswith("conv2")]
    relus = [l.index for l in graph.layers if l.kind is not Kind.CONV and "relu" in l.name]
    assert convs and relus
    assert all(quick[i] < slow[i] for i in convs)
    assert all(quick[i] == slow[i] for i in relus)


def test_a_layer_is_weighed_at_the_rate_of_the_dtype_it_computes_in():
    """Under bf16 autocast a convolution computes in bf16: the machine's bf16 rate weighs it."""
    machine = replace(H200, conv_flops_per_s={"float32": 1e12, "bfloat16": 1e15})
    fp32 = layer_costs(_resnet_graph(), machine).work
    graph = _resnet_graph(("cuda", torch.bfloat16))
    bf16 = layer_costs(graph, machine).work
    conv = next(l.index for l in graph.layers if l.kind is Kind.CONV and l.name.endswith("conv2"))
    assert bf16[conv] < fp32[conv] / 10


def test_moving_a_byte_costs_its_way_out_and_back():
    assert H200.move_seconds(H200.link_bytes_per_s) == pytest.approx(2.0)


def test_off_cuda_the_planner_assumes_the_h200_with_the_pool_counting_bytes_as_they_are():
    machine = machine_of(torch.device("cpu"))
    assert machine.pool_page_bytes == 1 and machine.pool_bytes(3) == 3
    assert replace(machine, pool_page_bytes=H200.pool_page_bytes,
                   pool_small_bytes=H200.pool_small_bytes, source="") == replace(H200, source="")
    # on CUDA a tensor of at most 1 MiB counts in the small segments' 512-byte blocks, a larger
    # one in 2 MiB pages
    assert H200.pool_bytes(1) == 512 and H200.pool_bytes(1 << 20) == 1 << 20
    assert H200.pool_bytes((1 << 20) + 1) == H200.pool_bytes(2 << 20) == 2 << 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: measures the device's rates")
def test_measuring_the_device_leaves_its_random_stream_and_autocast_alone():
    """Dropout masks drawn after the measurement are those plain PyTorch draws."""
    from superneurons.runtime import machine
    machine._MEASURED.clear()
    device = torch.device("cuda", 0)
    state = torch.cuda.get_rng_state(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        measured = machine_of(device)
        assert torch.is_autocast_enabled("cuda")
    assert torch.equal(torch.cuda.get_rng_state(device), state)
    assert machine_of(device) is measured                  # once per device and TF32 setting
    assert 1e11 < measured.memory_bytes_per_s < 1e14
    assert 1e9 < measured.link_bytes_per_s < 1e12
    assert "measured on" in measured.source
    if machine._alone(0):       # beside other processes' kernels a rate reads what they leave
        assert measured.matmul_flops_per_s["bfloat16"] > measured.matmul_flops_per_s["float32"]


def test_measured_rates_are_kept_on_disk_by_device_and_versions(tmp_path, monkeypatch):
    """A later process reads the rates an earlier one measured on the same device; another key
    (another device, library or TF32 setting) is measured; an unreadable cache is measured
    around."""
    from superneurons.runtime import machine
    monkeypatch.setenv(machine.CACHE_DIR, str(tmp_path / "cache"))
    measured = replace(H200, memory_bytes_per_s=1.0, source="measured on a test device")
    machine._store("device A", measured)
    assert machine._load("device A") == measured
    assert machine._load("device B") is None
    machine._store("device B", H200)
    assert machine._load("device A") == measured and machine._load("device B") == H200
    (tmp_path / "cache" / "machine_rates.json").write_text("{not json")
    assert machine._load("device A") is None
    monkeypatch.setenv(machine.CACHE_DIR, "")                  # empty: nothing kept
    machine._store("device A", measured)
    assert machine._load("device A") is None
    monkeypatch.setenv(machine.CACHE_DIR, str(tmp_path / "file"))
    (tmp_path / "file").write_text("")                         # not a folder: measured around
    machine._store("device A", measured)
    assert machine._load("device A") is None


# beyond the allocator: this process's own context and, at 1.3 GiB, another's bare one
@pytest.mark.parametrize("others_gib, kept", [(1.3, True), (6.0, False)])
def test_rates_measured_beside_other_processes_are_not_kept_for_later_ones(
        tmp_path, monkeypatch, others_gib, kept):
    """Another process's kernels may share the device with the measurement; its bare context
    does not."""
    import contextlib
    from superneurons.runtime import machine
    monkeypatch.setenv(machine.CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(machine, "_MEASURED", {})
    monkeypatch.setattr(machine, "_disk_key", lambda index, tf32: "device A")
    monkeypatch.setattr(machine, "_measure", lambda device: replace(H200, source="measured"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "GPU")
    total, ours = 140 << 30, 3 << 30
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: ours)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (
        total - ours - int(others_gib * (1 << 30)), total))
    assert machine_of(torch.device("cuda", 0)).source == "measured"
    assert (machine._load("device A") is not None) == kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: measures the device's rates")
def test_a_new_process_reads_the_rates_instead_of_measuring(tmp_path, monkeypatch):
    from superneurons.runtime import machine
    monkeypatch.setenv(machine.CACHE_DIR, str(tmp_path))
    machine._MEASURED.clear()
    # the suite's other workers share the GPU, and rates measured beside them are not kept
    # (the test above): here the device is taken to be this process's alone
    monkeypatch.setattr(machine, "_alone", lambda index: True)
    device = torch.device("cuda", 0)
    first = machine_of(device)
    machine._MEASURED.clear()                                # as a new process starts
    monkeypatch.setattr(machine, "_measure", lambda device: pytest.fail("measured again"))
    assert machine_of(device) == first


def test_the_disk_key_names_the_device_the_libraries_and_tf32(monkeypatch):
    """Rates measured on another device, with other libraries or another TF32 setting are not
    read back."""
    from superneurons.runtime import machine
    properties = type("Properties", (), {"name": "GPU", "uuid": "u-1", "total_memory": 80})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    key = machine._disk_key(0, (False, False))
    assert key == machine._disk_key(0, (False, False))
    assert key != machine._disk_key(0, (True, False))
    properties.uuid = "u-2"
    assert key != machine._disk_key(0, (False, False))
    properties.uuid = "u-1"
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert key != machine._disk_key(0, (False, False))
