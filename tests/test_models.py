import pytest
import torch

from superneurons import models
from conftest import meta_model


@pytest.mark.parametrize("name, millions", [("alexnet", 62.4), ("vgg16", 138.4), ("resnet50", 25.6),
                                            ("resnet152", 60.2), ("inception_v4", 42.7),
                                            ("densenet121", 8.0), ("densenet201", 20.0)])
def test_parameter_counts_match_the_published_networks(name, millions):
    model = meta_model(name)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, abs=0.1)


@pytest.mark.parametrize("name", ["alexnet", "vgg19", "resnet101", "inception_v4", "densenet169",
                                  "densenet_cifar"])
def test_each_network_classifies_at_its_usual_size(name):
    model = meta_model(name)
    out = model(torch.empty(models.input_shape(name, 2), device="meta"))
    assert out.shape == (2, 10 if name == "densenet_cifar" else 1000)


def test_resnet_depths():
    assert models.resnet(depth=50, num_classes=10).layer3.__len__() == 6
    with torch.device("meta"):
        deep = models.resnet(depth=3 * (3 + 4 + 100 + 3) + 2)
        custom = models.resnet(blocks=(1, 1, 1, 1))
    assert len(deep.layer3) == 100 and len(custom.layer4) == 1
    with pytest.raises(ValueError, match="try"):
        models.resnet(depth=51)


def test_densenet_depths():
    with torch.device("meta"):
        assert len(models.densenet(100, cifar=True).blocks[0].layers) == 16
        assert len(models.densenet(2 * (6 + 12 + 40 + 16) + 5).blocks[4].layers) == 40
    with pytest.raises(ValueError, match="6n \\+ 4"):
        models.densenet(101, cifar=True)


def test_unknown_network_names_the_choices():
    with pytest.raises(ValueError, match="resnet50"):
        models.build("lenet")
