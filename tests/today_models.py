"""Models people train today, written by nobody on this project, each tiny enough for a CPU.

Every case's ``build()`` returns ``(model, args, kwargs, loss_fn)``: the model in train mode, the
positional and keyword arguments it is called with (``model(*args, **kwargs)``, exactly as its
authors call it) and a function from the model's output to a scalar loss. Inputs and labels are
drawn from their own generator, so a builder called twice after the same ``torch.manual_seed``
returns the same model (same initial weights) and the same data.

- every classification builder of ``torchvision.models`` (``list_models(module=...)``), with
  ``weights=None, num_classes=10`` at the smallest input it runs on;
- Hugging Face transformers built from small configs, no download: GPT-2, Llama, BERT (masked
  LM), ViT, called the Hugging Face way (``input_ids=, attention_mask=, labels=``, a padded
  batch), loss ``out.loss``; dropout left on;
- a nanoGPT decoder, written as karpathy/nanoGPT's model.py writes it;
- nn.MultiheadAttention and nn.TransformerEncoderLayer (post-norm and norm_first) models;
- a few timm models.

Constructs (one per tiny module) are in today_constructs.py; the harness is matrix.py.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanogpt import GPT, GPTConfig

BATCH = 2
NUM_CLASSES = 10


@dataclass(frozen=True)
class Case:
    """One model of the matrix. ``build()`` -> (model, args, kwargs, loss_fn)."""

    name: str
    build: Callable[[], tuple]
    group: str
    requires: tuple[str, ...] = ()      # importable modules the builder needs (else: skipped)
    default: bool = False               # in the subset every test run covers
    slow: bool = False                  # seconds or more per run on a CPU: the full matrix only
    optimizer: str = "adamw"            # 'sgd' for the models of hundreds of millions of weights
    plain_raises: type | None = None    # plain PyTorch raises this in training (the runtime too)
    note: str = ""

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def _generator(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def classification_loss(labels: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """Cross entropy on the logits; for outputs with auxiliary logits (GoogLeNet, Inception v3 in
    train mode: namedtuples whose first field is the main logits) 0.3 of each auxiliary's too."""

    def loss_fn(out):
        if isinstance(out, torch.Tensor):
            return F.cross_entropy(out, labels)
        main, *aux = out
        loss = F.cross_entropy(main, labels)
        for logits in aux:
            if logits is not None:
                loss = loss + 0.3 * F.cross_entropy(logits, labels)
        return loss

    return loss_fn


def image_batch(size: int, batch: int = BATCH):
    g = _generator()
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=g)
    return x, y


# ------------------------------------------------------------------------------- torchvision

# name -> input side; every other builder runs at 32 (measured: the smallest that works)
_TV_SIZE = {"alexnet": 64, "inception_v3": 299, "maxvit_t": 224, "vit_h_14": 28}
# builder keyword arguments beyond weights=None, num_classes=10
_TV_KWARGS = {
    "googlenet": {"init_weights": True},       # the default; saying so silences a FutureWarning
    "inception_v3": {"init_weights": True},
}
# the always-run subset (maxvit_t runs only at 224: its small sibling below is in the subset)
TV_DEFAULT = ("resnet18", "efficientnet_b0", "mobilenet_v3_small", "swin_t")
# hundreds of millions of weights: SGD, so that two copies and AdamW's state fit a CI machine
_TV_HUGE = {"regnet_y_128gf", "vit_h_14", "vit_l_16", "vit_l_32"}
# above this many weights a plain run of 3 AdamW steps takes 2 s or more on 2 CPU cores
# (measured: vgg* 4-5 s, convnext_large 5 s, regnet_y_128gf 14 s with SGD); with 224+ inputs
# (maxvit_t, inception_v3) 3-4 s
_TV_SLOW_PARAMS = 60_000_000


def _tv_size(name: str) -> int:
    return _TV_SIZE.get(name, 32)


def _tv_kwargs(name: str) -> dict:
    kwargs = dict(weights=None, num_classes=NUM_CLASSES, **_TV_KWARGS.get(name, {}))
    if name.startswith("vit_"):
        # VisionTransformer takes image_size through the builder's **kwargs; the patch size is
        # fixed by the builder (16, 32 or 14): the smallest multiple of it from 28 up
        kwargs["image_size"] = _tv_size(name)
    return kwargs


def torchvision_builder(name: str):
    def build():
        import torchvision

        builder = torchvision.models.get_model_builder(name)
        model = builder(**_tv_kwargs(name))
        x, y = image_batch(_tv_size(name))
        return model.train(), (x,), {}, classification_loss(y)

    build.__name__ = f"build_{name}"
    build.__qualname__ = build.__name__
    return build


def torchvision_names() -> list[str]:
    """Every classification builder torchvision has (empty without torchvision)."""
    if importlib.util.find_spec("torchvision") is None:
        return list(TV_DEFAULT)
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def _tv_slow(name: str) -> bool:
    if name in TV_DEFAULT:
        return False
    if _tv_size(name) >= 224 or name in _TV_HUGE:
        return True
    return _TV_PARAMS.get(name, 0) > _TV_SLOW_PARAMS


# weights per builder at num_classes=10 (torchvision 0.29), to mark the slow ones without
# building them at import
_TV_PARAMS = {
    "alexnet": 57_044_810, "convnext_base": 87_576_714, "convnext_large": 196_245_706,
    "convnext_small": 49_462_378, "efficientnet_b7": 63_812_570,
    "efficientnet_v2_l": 117_247_082, "efficientnet_v2_m": 52_871_166,
    "regnet_x_32gf": 105_315_770, "regnet_y_16gf": 80_595_390, "regnet_y_32gf": 141_370_900,
    "regnet_y_128gf": 637_493_824, "resnext101_32x8d": 86_762_826,
    "resnext101_64x4d": 81_426_762, "swin_b": 86_753_474, "swin_v2_b": 86_916_098,
    "vgg11": 128_807_306, "vgg11_bn": 128_812_810, "vgg13": 128_991_818,
    "vgg13_bn": 128_997_706, "vgg16": 134_301_514, "vgg16_bn": 134_309_962,
    "vgg19": 139_611_210, "vgg19_bn": 139_622_218, "vit_b_16": 85_658_890,
    "vit_b_32": 87_426_058, "vit_h_14": 630_455_050, "vit_l_16": 303_115_274,
    "vit_l_32": 305_471_498, "wide_resnet101_2": 124_858_186, "wide_resnet50_2": 66_854_730,
}


def build_tv_maxvit_small():
    """torchvision's MaxVit class at 32x32: partition 4, two stages of one block (the builder's
    maxvit_t takes only multiples of 224: its partition size 7 must divide every stage)."""
    from torchvision.models import MaxVit

    model = MaxVit(input_size=(32, 32), stem_channels=16, partition_size=4,
                   block_channels=[16, 32], block_layers=[1, 1], head_dim=8,
                   stochastic_depth_prob=0.2, num_classes=NUM_CLASSES)
    x, y = image_batch(32)
    return model.train(), (x,), {}, classification_loss(y)


def build_tv_vit_small():
    """torchvision's VisionTransformer class, two layers of width 32 on 16 patches of 8x8, with
    dropout (the builders' smallest, vit_b_16, has 86M weights)."""
    from torchvision.models import VisionTransformer

    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                              hidden_dim=32, mlp_dim=64, dropout=0.1, attention_dropout=0.1,
                              num_classes=NUM_CLASSES)
    x, y = image_batch(32)
    return model.train(), (x,), {}, classification_loss(y)


def torchvision_cases() -> dict[str, Case]:
    cases = {}
    for name in torchvision_names():
        note = f"input (2, 3, {_tv_size(name)}, {_tv_size(name)})"
        if name.startswith("vit_"):
            note += f", image_size={_tv_size(name)}"
        if name == "inception_v3":
            note += " (299: the smallest its auxiliary head takes)"
        cases[f"tv_{name}"] = Case(
            f"tv_{name}", torchvision_builder(name), "torchvision", ("torchvision",),
            default=name in TV_DEFAULT, slow=_tv_slow(name),
            optimizer="sgd" if name in _TV_HUGE else "adamw", note=note)
    tv = ("torchvision",)
    cases["tv_maxvit_small"] = Case(
        "tv_maxvit_small", build_tv_maxvit_small, "torchvision", tv, default=True,
        note="MaxVit class, input 32, partition 4, blocks [1, 1]")
    cases["tv_vit_small"] = Case(
        "tv_vit_small", build_tv_vit_small, "torchvision", tv, default=True,
        note="VisionTransformer class, input 32, patch 8, 2 layers of 32")
    return cases


# ------------------------------------------------------------------------- HF transformers

SEQ = 12


def _text_batch(vocab: int):
    """input_ids (2, 12), an attention_mask whose second row ends in 4 padding zeros, and causal
    LM labels (-100 on padding)."""
    g = _generator()
    input_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, -4:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


def _hf_loss(out):
    return out.loss


def _causal_lm(model, vocab: int):
    """A causal LM's case: its padded batch as keyword arguments, labels included."""
    input_ids, attention_mask, labels = _text_batch(vocab)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                  use_cache=False)
    return model.train(), (), kwargs, _hf_loss


def build_hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return _causal_lm(GPT2LMHeadModel(config), config.vocab_size)


def build_hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, attention_dropout=0.1)
    return _causal_lm(LlamaForCausalLM(config), config.vocab_size)


def build_hf_bloom():
    """BLOOM trains its GELU by a custom autograd Function (GeLUFunction) with a backward of its
    own, captured whole (capture/functions.py)."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4,
                         hidden_dropout=0.1, attention_dropout=0.1)
    return _causal_lm(BloomForCausalLM(config), config.vocab_size)


def build_hf_phimoe():
    """PhiMoE routes by sparsemixer, a custom autograd Function with a backward of its own."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    config = PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2)
    return _causal_lm(PhimoeForCausalLM(config), config.vocab_size)


def build_hf_sew_d():
    """SEW-D's attention masks and drops out by custom autograd Functions (XSoftmax, XDropout),
    the dropout drawing in its forward."""
    from transformers import SEWDConfig, SEWDForSequenceClassification

    config = SEWDConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                        conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                        num_conv_pos_embedding_groups=2, squeeze_factor=2,
                        apply_spec_augment=False, hidden_dropout=0.1, attention_dropout=0.1,
                        activation_dropout=0.1, num_labels=3, position_buckets=16,
                        max_position_embeddings=64)
    audio = torch.randn(BATCH, 800, generator=_generator())
    return (SEWDForSequenceClassification(config).train(), (),
            dict(input_values=audio, labels=torch.tensor([0, 2])), _hf_loss)


def tiny_hf_mixtral():
    """HF Mixtral from a small config (4 experts, top 2, its router loss) and a call of it, for
    the tests of its own paths (it is not in the matrix); deterministic from seed 0."""
    import pytest
    import transformers
    from transformers import MixtralConfig, MixtralForCausalLM

    # transformers 5.17's experts count their tokens with bincount, which has no meta kernel:
    # superneurons refuses it with a ValueError there (seen on the device machine); 5.24's do not
    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 24):
        pytest.skip("transformers < 5.24: Mixtral's experts count tokens with bincount")
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, num_local_experts=4,
                           num_experts_per_tok=2, output_router_logits=True, use_cache=False)
    ids = torch.randint(1, config.vocab_size, (2, 16))
    return MixtralForCausalLM(config).train(), {"input_ids": ids, "labels": ids}


def build_hf_bert_mlm():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = BertForMaskedLM(config)
    input_ids, attention_mask, _ = _text_batch(config.vocab_size)
    labels = torch.full_like(input_ids, -100)
    masked = torch.tensor([[1, 4, 7], [0, 3, 5]])               # positions predicted
    labels.scatter_(1, masked, input_ids.gather(1, masked))
    input_ids = input_ids.scatter(1, masked, 3)                 # the [MASK] token
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return model.train(), (), kwargs, _hf_loss


def build_hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                       num_labels=NUM_CLASSES)
    model = ViTForImageClassification(config)
    x, y = image_batch(32)
    return model.train(), (), dict(pixel_values=x, labels=y), _hf_loss


# ----------------------------------------------------------------------------------- nanoGPT
# the decoder itself is in nanogpt.py, as karpathy/nanoGPT writes it

def _nanogpt(bias: bool):
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32,
                       dropout=0.1, bias=bias)
    model = GPT(config)
    g = _generator()
    data = torch.randint(0, config.vocab_size, (BATCH, config.block_size + 1), generator=g)
    # as nanoGPT's get_batch (torch.stack of slices): contiguous, targets shifted by one
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    return model.train(), (x, y), {}, lambda out: out[1]


def build_nanogpt():
    return _nanogpt(bias=True)


def build_nanogpt_nobias():
    """nanoGPT with bias=False (its LayerNorm without a bias, Linears without biases)."""
    return _nanogpt(bias=False)


# ------------------------------------------------------------------------- torch.nn attention

class MHAClassifier(nn.Module):
    """Tokens -> nn.MultiheadAttention (batch_first, dropout) -> residual + LayerNorm -> mean
    over the unpadded tokens -> logits; called with a key_padding_mask keyword."""

    def __init__(self, features=8, dim=32, heads=4):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, x, key_padding_mask=None):
        h = self.embed(x)
        a, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask)
        h = self.norm(h + a)
        if key_padding_mask is not None:
            keep = (~key_padding_mask).unsqueeze(-1).to(h.dtype)
            pooled = (h * keep).sum(1) / keep.sum(1)
        else:
            pooled = h.mean(1)
        return self.head(pooled)


def _token_batch(features=8):
    g = _generator()
    x = torch.randn(BATCH, SEQ, features, generator=g)
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[1, -4:] = True                       # True: padding (ignored), as PyTorch's masks
    y = torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)
    return x, padding, y


def build_mha():
    model = MHAClassifier()
    x, padding, y = _token_batch()
    return model.train(), (x,), dict(key_padding_mask=padding), classification_loss(y)


class EncoderClassifier(nn.Module):
    """Tokens -> nn.TransformerEncoder of two nn.TransformerEncoderLayer (dropout 0.1) -> first
    token -> logits; called with src_key_padding_mask."""

    def __init__(self, norm_first: bool, features=8, dim=32, heads=4):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=64, dropout=0.1,
                                           batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, x, src_key_padding_mask=None):
        h = self.encoder(self.embed(x), src_key_padding_mask=src_key_padding_mask)
        return self.head(h[:, 0])


def build_encoder_layer():
    x, padding, y = _token_batch()
    return (EncoderClassifier(norm_first=False).train(), (x,),
            dict(src_key_padding_mask=padding), classification_loss(y))


def build_encoder_layer_norm_first():
    x, padding, y = _token_batch()
    return (EncoderClassifier(norm_first=True).train(), (x,),
            dict(src_key_padding_mask=padding), classification_loss(y))


# ------------------------------------------------------------------------------------- timm

def timm_builder(name: str, size: int = 32, **options):
    def build():
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, **options)
        x, y = image_batch(size)
        return model.train(), (x,), {}, classification_loss(y)

    build.__name__ = f"build_timm_{name}"
    return build


TIMM = {
    "timm_resnet18": (timm_builder("resnet18"), False),
    "timm_convnext_atto": (timm_builder("convnext_atto", drop_path_rate=0.1), True),
    # img_size and patch_size are timm VisionTransformer arguments: 16 tokens of 8x8
    "timm_vit_tiny": (timm_builder("vit_tiny_patch16_224", img_size=32, patch_size=8,
                                   drop_rate=0.1, drop_path_rate=0.1), True),
    "timm_efficientnet_b0": (timm_builder("efficientnet_b0", drop_path_rate=0.1), False),
}


# ------------------------------------------------------------------------------------ cases

def cases() -> dict[str, Case]:
    """Every model case, by name (torchvision first, as torchvision lists them)."""
    out = torchvision_cases()
    hf = ("transformers",)
    out.update({
        "hf_gpt2": Case("hf_gpt2", build_hf_gpt2, "transformers", hf, default=True,
                        note="GPT2LMHeadModel, padded batch, use_cache=False"),
        "hf_llama": Case("hf_llama", build_hf_llama, "transformers", hf, default=True,
                         note="LlamaForCausalLM (GQA 4/2 heads), padded batch, use_cache=False"),
        "hf_bloom": Case("hf_bloom", build_hf_bloom, "transformers", hf, default=True,
                         note="BloomForCausalLM, its GELU a custom autograd Function"),
        "hf_phimoe": Case("hf_phimoe", build_hf_phimoe, "transformers", hf,
                          note="PhimoeForCausalLM, its router a custom autograd Function"),
        "hf_sew_d": Case("hf_sew_d", build_hf_sew_d, "transformers", hf,
                         note="SEWDForSequenceClassification, custom Functions that draw"),
        "hf_bert_mlm": Case("hf_bert_mlm", build_hf_bert_mlm, "transformers", hf, default=True,
                            note="BertForMaskedLM, padded batch"),
        "hf_vit": Case("hf_vit", build_hf_vit, "transformers", hf, default=True,
                       note="ViTForImageClassification, pixel_values=, labels="),
        "nanogpt": Case("nanogpt", build_nanogpt, "nanogpt", default=True,
                        note="karpathy/nanoGPT model.py, tied embeddings, model(idx, targets)"),
        "nanogpt_nobias": Case("nanogpt_nobias", build_nanogpt_nobias, "nanogpt",
                               note="nanoGPT with bias=False"),
        "nn_mha": Case("nn_mha", build_mha, "torch.nn", default=True,
                       note="nn.MultiheadAttention(batch_first), key_padding_mask="),
        "nn_encoder_layer": Case("nn_encoder_layer", build_encoder_layer, "torch.nn",
                                 default=True, note="nn.TransformerEncoderLayer, post-norm"),
        "nn_encoder_layer_norm_first": Case(
            "nn_encoder_layer_norm_first", build_encoder_layer_norm_first, "torch.nn",
            default=True, note="nn.TransformerEncoderLayer(norm_first=True)"),
    })
    for name, (build, default) in TIMM.items():
        out[name] = Case(name, build, "timm", ("timm",), default=default)
    return out


MODELS = cases()
