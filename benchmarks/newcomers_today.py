"""A third pass of models nobody here wrote, as newcomers_exact.py runs them (3 AdamW steps from
the same start and seed, losses and every parameter and buffer compared bit for bit with plain
PyTorch; offload at its own plan's peak), with dropout and drop path where they take them:

- timm: EVA-02 (rotary), ConvNeXt-V2 (global response norm), FastViT and MobileOne in
  training (reparameterizable branches), Hiera, EfficientFormer-V2, HRNet, VOLO (outlooker),
  DLA, ResNeSt (split attention), Twins (SVT), TinyNet;
- torchvision: R3D-18 (video), Swin-V2-T, ViT-B/16 at 32 px, ShuffleNet-V2, SqueezeNet;
- HF transformers from small configs: Gemma2 (soft-capping, sliding window), Gemma3 text,
  Qwen3, OLMo2, Falcon, DeBERTa-v2 (relative attention), RoBERTa for tokens, DistilBERT and
  BERT for question answering (their start and end logits are contiguous halves of one
  tensor: capture/trace.py Rule 3), ModernBERT, Mamba, ViTMAE (masking drawn with torch.rand)
  and SegFormer.

    python benchmarks/newcomers_today.py OUT_DIR [--only NAME ...]
        (CPU; writes newcomers_today.json)
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from newcomers_more import CAUSAL, VOCAB, causal, run, timm_classifier

SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1,
             attention_probs_dropout_prob=0.1)


def encoder(model_class: str, config_class: str, task: str, **config):
    """An encoder from a small config: 2 sequences of 16 tokens, the second right-padded by 5;
    a masked-LM, token-classification or question-answering loss of its own head."""
    def make():
        import transformers
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(
            getattr(transformers, config_class)(**config)).train()
        ids = torch.randint(4, VOCAB, (2, 16))
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, -5:] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
        if task == "qa":
            inputs.update(start_positions=torch.tensor([1, 3]), end_positions=torch.tensor([4, 6]))
        else:
            labels = ids.clone() if task == "mlm" else torch.randint(0, 3, (2, 16))
            labels[:, ::3] = -100
            labels[1, -5:] = -100
            inputs["labels"] = labels
        return model, (), inputs, lambda out: out.loss
    return make


def torchvision_classifier(name: str, size: int, **options):
    def make():
        import torchvision
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None, num_classes=10,
                                                  **options).train()
        x, y = torch.randn(2, 3, size, size), torch.randint(0, 10, (2,))
        return model, (x,), {}, lambda out: F.cross_entropy(out, y)
    return make


def r3d():
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.video.r3d_18(weights=None, num_classes=10).train()
    x, y = torch.randn(2, 3, 4, 32, 32), torch.randint(0, 10, (2,))
    return model, (x,), {}, lambda out: F.cross_entropy(out, y)


def vitmae():
    import transformers
    torch.manual_seed(0)
    config = transformers.ViTMAEConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
        decoder_num_attention_heads=4, decoder_intermediate_size=64, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, mask_ratio=0.75, norm_pix_loss=True)
    model = transformers.ViTMAEForPreTraining(config).train()
    return model, (), {"pixel_values": torch.randn(2, 3, 32, 32)}, lambda out: out.loss


def segformer():
    import transformers
    torch.manual_seed(0)
    config = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[4, 2], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
        classifier_dropout_prob=0.1, drop_path_rate=0.1, decoder_hidden_size=32, num_labels=5)
    model = transformers.SegformerForSemanticSegmentation(config).train()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 5, (2, 32, 32))
    y[1, :4] = 255                                            # ignored pixels
    return model, (), {"pixel_values": x, "labels": y}, lambda out: out.loss


DROP = dict(drop_rate=0.1, drop_path_rate=0.1)
FALCON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              hidden_dropout=0.1, attention_dropout=0.1, max_position_embeddings=64)
MODELS = {
    "timm eva02_tiny_patch14_224": timm_classifier("eva02_tiny_patch14_224", 56, img_size=56,
                                                   **DROP),
    "timm convnextv2_atto": timm_classifier("convnextv2_atto", 64, **DROP),
    "timm fastvit_t8 (training branches)": timm_classifier("fastvit_t8", 64, **DROP),
    "timm hiera_tiny_224": timm_classifier("hiera_tiny_224", 64, img_size=64, **DROP),
    "timm efficientformerv2_s0": timm_classifier("efficientformerv2_s0", 64, img_size=64,
                                                 **DROP),
    "timm mobileone_s0 (training branches)": timm_classifier("mobileone_s0", 64, **DROP),
    "timm hrnet_w18_small": timm_classifier("hrnet_w18_small", 64, drop_rate=0.1),
    "timm volo_d1_224": timm_classifier("volo_d1_224", 64, img_size=64, **DROP),
    "timm dla34": timm_classifier("dla34", 64, drop_rate=0.1),
    "timm resnest14d": timm_classifier("resnest14d", 64, **DROP),
    "timm twins_svt_small": timm_classifier("twins_svt_small", 64, img_size=64, **DROP),
    "timm tinynet_e": timm_classifier("tinynet_e", 64, **DROP),
    "torchvision r3d_18 (video)": r3d,
    "torchvision swin_v2_t": torchvision_classifier("swin_v2_t", 64),
    "torchvision vit_b_16 (32 px)": torchvision_classifier(
        "vit_b_16", 32, image_size=32, dropout=0.1, attention_dropout=0.1),
    "torchvision shufflenet_v2_x1_0": torchvision_classifier("shufflenet_v2_x1_0", 64),
    "torchvision squeezenet1_0": torchvision_classifier("squeezenet1_0", 64),
    "HF Gemma2 (soft-capping, sliding window, eager)": causal(
        "Gemma2ForCausalLM", "Gemma2Config", "eager", head_dim=8, sliding_window=8,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=8,
        **CAUSAL),
    "HF Gemma3 text (sliding and full layers)": causal(
        "Gemma3ForCausalLM", "Gemma3TextConfig", "eager", head_dim=8, sliding_window=8,
        final_logit_softcapping=30.0, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"], **CAUSAL),
    "HF Qwen3": causal("Qwen3ForCausalLM", "Qwen3Config", head_dim=8, **CAUSAL),
    "HF OLMo2": causal("Olmo2ForCausalLM", "Olmo2Config", eos_token_id=2, pad_token_id=0,
                       **CAUSAL),
    "HF Falcon (new decoder architecture)": causal(
        "FalconForCausalLM", "FalconConfig", num_kv_heads=2, new_decoder_architecture=True,
        **FALCON),
    "HF Falcon (alibi)": causal("FalconForCausalLM", "FalconConfig", alibi=True, **FALCON),
    "HF DebertaV2ForMaskedLM (relative attention)": encoder(
        "DebertaV2ForMaskedLM", "DebertaV2Config", "mlm", relative_attention=True,
        pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16,
        norm_rel_ebd="layer_norm", share_att_key=True, **SMALL),
    "HF RobertaForTokenClassification": encoder(
        "RobertaForTokenClassification", "RobertaConfig", "tokens", num_labels=3,
        **{**SMALL, "max_position_embeddings": 40}),
    "HF DistilBertForQuestionAnswering": encoder(
        "DistilBertForQuestionAnswering", "DistilBertConfig", "qa", vocab_size=VOCAB, dim=32,
        n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64, dropout=0.1,
        attention_dropout=0.1, qa_dropout=0.1),
    "HF BertForQuestionAnswering": encoder("BertForQuestionAnswering", "BertConfig", "qa",
                                           **SMALL),
    "HF ModernBertForMaskedLM (local and global layers)": encoder(
        "ModernBertForMaskedLM", "ModernBertConfig", "mlm", vocab_size=VOCAB, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=8,
        attention_dropout=0.1, embedding_dropout=0.1, mlp_dropout=0.1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        reference_compile=False),
    "HF Mamba (PyTorch path)": causal("MambaForCausalLM", "MambaConfig", vocab_size=VOCAB,
                                      hidden_size=32, state_size=8, num_hidden_layers=2,
                                      expand=2, conv_kernel=4),
    "HF ViTMAEForPreTraining (torch.rand masking)": vitmae,
    "HF SegformerForSemanticSegmentation": segformer,
}


def main():
    run(MODELS, "newcomers_today.json")

if __name__ == "__main__":
    main()
