import pytest
import torch

from superneurons import models


def meta_model(name: str, **kwargs):
    with torch.device("meta"):
        return models.build(name, **kwargs)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
