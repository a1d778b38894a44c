"""Models no other test trains, under the policies that move or replay tensors and with the
state on the host: HF decoders whose layers fan and join otherwise than Llama's, timm networks
that mix convolutions and attention or ghost modules, and torchvision's ShuffleNetV2."""

import pytest
import torch

import matrix
from today_models import NUM_CLASSES, classification_loss, image_batch, timm_builder

transformers = pytest.importorskip("transformers")
pytest.importorskip("timm")


def _name(build) -> str:
    return getattr(build, "__name__", "model").replace("build_", "")


def _gpt_neox():
    """Parallel residual (attention and MLP both read each layer's input: a fan and a join in
    every layer), dropout, a padded row."""
    config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64,
                                        max_position_embeddings=64, hidden_dropout=0.1,
                                        attention_dropout=0.1, use_parallel_residual=True)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    return transformers.GPTNeoXForCausalLM(config), (), \
        dict(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False), lambda out: out.loss


def _phi3():
    """Grouped-query attention with fused qkv and gate-up projections, residual dropout."""
    config = transformers.Phi3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=64, max_position_embeddings=64,
                                     resid_pdrop=0.1, pad_token_id=0)
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    return transformers.Phi3ForCausalLM(config), (), \
        dict(input_ids=ids, labels=ids, use_cache=False), lambda out: out.loss


def _shufflenet():
    """Channel shuffles (a view, a transpose and a copy between every pair of branches) and
    depthwise convolutions: replays the planner weighs at the machine's convolution rate."""
    import torchvision
    model = torchvision.models.shufflenet_v2_x0_5(num_classes=NUM_CLASSES)
    x, y = image_batch(64)
    return model.train(), (x,), {}, classification_loss(y)


_BUILDS = [_gpt_neox, _phi3, timm_builder("edgenext_xx_small"),
           timm_builder("ghostnetv2_100", size=64), _shufflenet]
_POLICIES = [("recompute", "device"), ("offload", "device"), ("superneurons", "device"),
             ("superneurons", "host")]


# model-major, each model's cases on one worker (--dist loadgroup): they share its plain run
# and its captured graph (matrix.py)
@pytest.mark.parametrize("build,policy,state", [
    pytest.param(build, policy, state, id=f"{policy}-{state}-{_name(build)}",
                 marks=pytest.mark.xdist_group(_name(build)))
    for build in _BUILDS for policy, state in _POLICIES])
def test_models_no_other_test_trains_match_plain(build, policy, state):
    """3 AdamW steps at a budget that forces the policy to act, bit for bit (matrix.py)."""
    assert matrix.compare(build, policy, state=state).status == "exact"
