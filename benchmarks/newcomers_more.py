"""More models nobody here wrote, as newcomers_exact.py runs them (3 AdamW steps from the same
start and seed, losses and every parameter and buffer compared bit for bit with plain PyTorch),
with offload at its own plan's peak so that it moves data:

- timm: swin (shifted windows, drop path), DeiT distilled in its training mode (a tuple of two
  heads), LeViT (attention biases), PoolFormer v2, CoAtNet and MaxViT (grid and block
  attention), NFNet (scaled weight standardization), RepVGG in training (parallel branches),
  SKNet (selective kernels), MLP-Mixer and CaiT (class attention, layer scale), with dropout
  and drop path where they take them;
- torchvision: deeplabv3_mobilenet_v3_large with its auxiliary head (a dict output, two
  per-pixel losses); a network with weight_norm and spectral_norm parametrizations (spectral
  norm's vectors are buffers written every forward);
- HF transformers from small configs with dropout: Mistral (sliding window, left padding,
  eager attention), Qwen2 (sliding window), Phi (partial rotary), Phi3, GPT-NeoX, Gemma,
  Mixtral (experts routed by the tokens' values, its router loss), T5 and Bart
  (encoder-decoders, a padded mask), Whisper (audio features), CLIP (two towers, its
  contrastive loss) and BertForSequenceClassification; decoders with use_cache off, as training sets it (with it on
  superneurons refuses before the first step: the cache is not a training output).

    python benchmarks/newcomers_more.py OUT_DIR [--only NAME ...]
        (CPU; writes newcomers_more.json)
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from common import write
from newcomers_exact import STEPS, compare

VOCAB = 128
CAUSAL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              attention_dropout=0.1)


def timm_classifier(name: str, size: int, **options):
    def make():
        import timm
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10, **options).train()
        x, y = torch.randn(2, 3, size, size), torch.randint(0, 10, (2,))

        def loss_of(out):              # DeiT distilled in training: (class head, distillation)
            if isinstance(out, tuple):
                return (F.cross_entropy(out[0], y) + F.cross_entropy(out[1], y)) / 2
            return F.cross_entropy(out, y)
        return model, (x,), {}, loss_of
    return make


def deit_distilled():
    model, args, kwargs, loss_of = timm_classifier(
        "deit_tiny_distilled_patch16_224", 32, img_size=32, drop_rate=0.1,
        drop_path_rate=0.1)()
    model.set_distilled_training(True)
    return model, args, kwargs, loss_of


def deeplab():
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=10, aux_loss=True).train()
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2, 64, 64))
    return model, (x,), {}, lambda out: F.cross_entropy(out["out"], y) + \
        0.4 * F.cross_entropy(out["aux"], y)


class Parametrized(nn.Module):
    def __init__(self):
        super().__init__()
        normed = torch.nn.utils.parametrizations
        self.c1 = normed.weight_norm(nn.Conv2d(3, 16, 3, padding=1))
        self.c2 = normed.spectral_norm(nn.Conv2d(16, 16, 3, padding=1))
        self.bn = nn.BatchNorm2d(16)
        self.fc = normed.spectral_norm(nn.Linear(16, 10))

    def forward(self, x):
        x = F.relu(self.c1(x))
        x = F.relu(self.bn(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def parametrized():
    torch.manual_seed(0)
    model = Parametrized().train()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    return model, (x,), {}, lambda out: F.cross_entropy(out, y)


def causal(model_class: str, config_class: str, attention=None, **config):
    """A decoder from a small config, 2 sequences of 16 tokens, the second left-padded by 5."""
    def make():
        import transformers
        torch.manual_seed(0)
        settings = getattr(transformers, config_class)(**config)
        settings.use_cache = False
        if attention:
            settings._attn_implementation = attention
        model = getattr(transformers, model_class)(settings).train()
        ids = torch.randint(1, VOCAB, (2, 16))
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, :5] = 0
        labels = ids.clone()
        labels[1, :5] = -100
        return model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels}, \
            lambda out: out.loss
    return make


def seq2seq(model_class: str, config) -> callable:
    """An encoder-decoder: 2 sequences of 16 tokens (the second padded by 4), 8 label tokens;
    use_cache=False in the call (T5's parts keep copies of its config)."""
    def make():
        import transformers
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(config()).train()
        ids = torch.randint(4, VOCAB, (2, 16))
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, -4:] = 0
        labels = torch.randint(4, VOCAB, (2, 8))
        return model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels,
                           "use_cache": False}, lambda out: out.loss
    return make


def t5_config():
    import transformers
    return transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                 num_decoder_layers=2, num_heads=4, dropout_rate=0.1,
                                 decoder_start_token_id=0, pad_token_id=0)


def bart_config():
    import transformers
    return transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1)


def clip():
    import transformers
    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, projection_dim=16, attention_dropout=0.1)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, max_position_embeddings=32, **tower),
        vision_config=dict(image_size=32, patch_size=8, **tower), projection_dim=16)
    model = transformers.CLIPModel(config).train()
    ids, pixels = torch.randint(1, VOCAB, (3, 16)), torch.randn(3, 3, 32, 32)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[2, -6:] = 0
    return model, (), {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels,
                       "return_loss": True}, lambda out: out.loss


def whisper():
    import transformers
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, d_model=32, max_source_positions=32, max_target_positions=32,
        dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, use_cache=False)
    model = transformers.WhisperForConditionalGeneration(config).train()
    features = torch.randn(2, 16, 64)             # (batch, mel bins, 2 x source positions)
    labels = torch.randint(3, VOCAB, (2, 10))
    labels[1, -3:] = -100
    return model, (), {"input_features": features, "labels": labels}, lambda out: out.loss


def bert_classifier():
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, num_labels=3)
    model = transformers.BertForSequenceClassification(config).train()
    ids = torch.randint(1, VOCAB, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, -5:] = 0
    return model, (), {"input_ids": ids, "attention_mask": mask,
                       "labels": torch.tensor([0, 2])}, lambda out: out.loss


DROP = dict(drop_rate=0.1, drop_path_rate=0.2)
MODELS = {
    "timm swin_tiny_patch4_window7_224": timm_classifier(
        "swin_tiny_patch4_window7_224", 32, img_size=32, window_size=4, **DROP),
    "timm deit_tiny_distilled_patch16_224 (training: two heads)": deit_distilled,
    "timm levit_128s": timm_classifier("levit_128s", 64, img_size=64),
    "timm poolformerv2_s12": timm_classifier("poolformerv2_s12", 64),
    "timm coatnet_0_rw_224": timm_classifier("coatnet_0_rw_224", 64, img_size=64),
    "timm maxvit_tiny_rw_224": timm_classifier("maxvit_tiny_rw_224", 64, img_size=64),
    "timm dm_nfnet_f0": timm_classifier("dm_nfnet_f0", 64),
    "timm repvgg_a0": timm_classifier("repvgg_a0", 64),
    "timm skresnet18": timm_classifier("skresnet18", 64),
    "timm mixer_s16_224": timm_classifier("mixer_s16_224", 64, img_size=64, **DROP),
    "timm cait_xxs24_224 (depth 2)": timm_classifier(
        "cait_xxs24_224", 32, img_size=32, depth=2, **DROP),
    "torchvision deeplabv3_mobilenet_v3_large (aux)": deeplab,
    "weight_norm and spectral_norm parametrizations": parametrized,
    "HF Mistral (sliding window, eager)": causal(
        "MistralForCausalLM", "MistralConfig", "eager", sliding_window=8, **CAUSAL),
    "HF Qwen2 (sliding window)": causal("Qwen2ForCausalLM", "Qwen2Config",
                                        use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1, **CAUSAL),
    "HF Phi (partial rotary)": causal("PhiForCausalLM", "PhiConfig", resid_pdrop=0.1,
                                      embd_pdrop=0.1, partial_rotary_factor=0.5, **CAUSAL),
    "HF Phi3": causal("Phi3ForCausalLM", "Phi3Config", pad_token_id=0, resid_pdrop=0.1,
                      embd_pdrop=0.1, **CAUSAL),
    "HF GPT-NeoX (eager)": causal(
        "GPTNeoXForCausalLM", "GPTNeoXConfig", "eager", vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, attention_dropout=0.1, hidden_dropout=0.1,
        use_parallel_residual=False),
    "HF Gemma (eager)": causal("GemmaForCausalLM", "GemmaConfig", "eager", head_dim=8,
                               **CAUSAL),
    "HF Mixtral (4 experts, top 2, router loss)": causal(
        "MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02, **CAUSAL),
    "HF T5ForConditionalGeneration": seq2seq("T5ForConditionalGeneration", t5_config),
    "HF BartForConditionalGeneration": seq2seq("BartForConditionalGeneration", bart_config),
    "HF CLIPModel": clip,
    "HF WhisperForConditionalGeneration": whisper,
    "HF BertForSequenceClassification": bert_classifier,
}


def run(models: dict, record: str) -> None:
    """The command line of a newcomers pass: OUT_DIR [--only NAME ...], into OUT_DIR/record."""
    only = sys.argv[sys.argv.index("--only") + 1:] if "--only" in sys.argv else None
    chosen = {name: make for name, make in models.items()
              if only is None or any(part in name for part in only)}
    rows = compare(chosen, offload_moving=True)
    write(os.path.join(sys.argv[1], record), {"steps": STEPS, "rows": rows})


def main():
    run(MODELS, "newcomers_more.json")


if __name__ == "__main__":
    main()
