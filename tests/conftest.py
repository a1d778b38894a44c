import pytest
import torch

from superneurons import models


def meta_model(name: str, **kwargs):
    with torch.device("meta"):
        return models.build(name, **kwargs)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (device machine)"))])
def device(request, monkeypatch):
    """"cpu", and "cuda" with deterministic kernels where there is one: a test taking it
    compares with plain PyTorch bit for bit on both."""
    if request.param == "cuda":
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        yield "cuda"
        torch.use_deterministic_algorithms(before)
    else:
        yield "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _machine_rates_cache(tmp_path_factory):
    """The device's measured rates go to a folder of the test session, not the user's cache
    (runtime/machine.py)."""
    import os
    from superneurons.runtime.machine import CACHE_DIR
    before = os.environ.get(CACHE_DIR)
    os.environ[CACHE_DIR] = str(tmp_path_factory.mktemp("machine_rates"))
    yield
    if before is None:
        os.environ.pop(CACHE_DIR, None)
    else:
        os.environ[CACHE_DIR] = before


def pytest_configure(config):
    # one intra-op thread per xdist worker: the README runs 2 workers on 2 cores, and each
    # worker's default of one thread per core made 4 threads fight over 2
    import os
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """tests/test_benchmark_*.py run the benchmark scripts' plumbing on the CPU (child
    processes, gloo ranks, records written): marked ``scripts`` and left to their own command
    (``-m scripts``, which .ci/run runs after the README's), so that the README's command stays
    within ten minutes on two cores. No exactness case is among them."""
    selected = "scripts" in (config.option.markexpr or "")
    kept, deselected = [], []
    for item in items:
        if item.path.name.startswith("test_benchmark_"):
            item.add_marker(pytest.mark.scripts)
            if not selected:
                deselected.append(item)
                continue
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
