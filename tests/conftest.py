import pytest
import torch

from superneurons import models


def meta_model(name: str, **kwargs):
    with torch.device("meta"):
        return models.build(name, **kwargs)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    # one intra-op thread per xdist worker: the README runs 2 workers on 2 cores, and each
    # worker's default of one thread per core made 4 threads fight over 2
    import os
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
