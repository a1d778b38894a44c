"""A sixth newcomers pass: models not in the other newcomers_*.py passes or the tests, run as
those run them (3 AdamW steps from one seed, dropout on where a model takes it, losses and every
parameter and buffer compared bit for bit with plain PyTorch, under offload at its plan's peak,
recompute and superneurons at its floor and halfway):

- HF decoders from tiny configs (2 sequences of 16 tokens, the second left-padded by 5):
  Qwen2-MoE (4 experts, top 2, a gated shared expert, its router loss), DeepSeek-V3 (latent
  attention with low-rank q and kv, interleaved rotary, grouped top-k routing with a
  correction bias, a shared expert, a dense first layer), Mamba2 (its chunked scan, the
  PyTorch path), Jamba (a Mamba layer, then an attention layer with experts), PhiMoE
  (sparsemixer routing with jitter), GPT-OSS (attention sinks, sliding and full layers,
  clamped SwiGLU experts, YaRN rotary), GLM-4 (partial rotary, extra norms around each
  block) and SmolLM3 (a layer without rotary embeddings); PhiMoE is refused before a step, by
  design (its router's custom autograd Function has a backward of its own);
- HF encoders (2 sequences of 16 tokens, the second right-padded by 5): MPNet (relative
  position buckets), ESM (rotary, token dropout over masked tokens) and RoFormer (rotary
  values);
- HF vision: Swinv2 (cosine attention, log-spaced continuous position bias), PVTv2 (spatial
  reduction, overlapping patches), FocalNet (focal modulation, layer scale) and MobileViTV2
  (separable self-attention);
- timm at 64 px: efficientvit_m0 (cascaded group attention), tiny_vit_5m_224, hgnetv2_b0,
  mobilenetv4_hybrid_medium (mobile multi-query attention) and vit_little_patch16_reg4_gap_256
  (register tokens, 32 px in patches of 8), with dropout and drop path where they take them.

    python benchmarks/newcomers_sixth.py OUT_DIR [--only NAME ...]
        (CPU; writes newcomers_sixth.json)
"""

import torch

from newcomers_more import CAUSAL, VOCAB, causal, run, timm_classifier
from newcomers_fourth import DROP, hf_image
from newcomers_today import SMALL, encoder


def esm():
    """ESM for masked LM: rotary, token dropout (embeddings of mask tokens zeroed, the rest
    rescaled by each row's masked fraction), mask tokens in the input, a padded row."""
    import transformers
    torch.manual_seed(0)
    config = transformers.EsmConfig(mask_token_id=3, pad_token_id=1,
                                    position_embedding_type="rotary", token_dropout=True,
                                    emb_layer_norm_before=False, **SMALL)
    model = transformers.EsmForMaskedLM(config).train()
    ids = torch.randint(4, VOCAB, (2, 16))
    labels = torch.full_like(ids, -100)
    masked = torch.zeros(2, 16, dtype=torch.bool)
    masked[0, 2::4] = True
    masked[1, 1:11:3] = True
    labels[masked] = ids[masked]
    ids[masked] = 3
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, -5:] = 0
    ids[1, -5:] = 1
    return model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels}, \
        lambda out: out.loss


MOE = dict(output_router_logits=True, router_aux_loss_coef=0.02)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)    # their defaults: past VOCAB

MODELS = {
    # HF decoders
    "HF Qwen2-MoE (4 experts, top 2, shared expert, router loss)": causal(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, **MOE, **CAUSAL),
    "HF DeepSeek-V3 (latent attention, grouped routing)": causal(
        "DeepseekV3ForCausalLM", "DeepseekV3Config", moe_intermediate_size=16,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        **{**CAUSAL, "num_key_value_heads": 4}),
    "HF Mamba2 (PyTorch path)": causal(
        "Mamba2ForCausalLM", "Mamba2Config", vocab_size=VOCAB, hidden_size=32, state_size=8,
        num_heads=8, head_dim=8, n_groups=1, expand=2, conv_kernel=4, chunk_size=8,
        num_hidden_layers=2),
    "HF Jamba (Mamba and attention layers, experts)": causal(
        "JambaForCausalLM", "JambaConfig", num_experts=4, num_experts_per_tok=2,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
        attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        use_mamba_kernels=False, **MOE, **CAUSAL),
    "HF PhiMoE (sparsemixer, router jitter)": causal(
        "PhimoeForCausalLM", "PhimoeConfig", num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.01, **MOE, **CAUSAL),
    "HF GPT-OSS (sinks, sliding and full layers, experts)": causal(
        "GptOssForCausalLM", "GptOssConfig", "eager", num_local_experts=4,
        num_experts_per_tok=2, head_dim=8, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=16,
                             rope_theta=150000.0), **MOE, **CAUSAL),
    "HF GLM-4 (partial rotary, sandwich norms)": causal(
        "Glm4ForCausalLM", "Glm4Config", head_dim=8, **TOKENS, **CAUSAL),
    "HF SmolLM3 (a layer without rotary)": causal(
        "SmolLM3ForCausalLM", "SmolLM3Config", no_rope_layers=[1, 0], use_sliding_window=False,
        **TOKENS, **CAUSAL),
    # HF encoders
    "HF MPNetForMaskedLM (relative position buckets)": encoder(
        "MPNetForMaskedLM", "MPNetConfig", "mlm", **SMALL),
    "HF EsmForMaskedLM (rotary, token dropout)": esm,
    "HF RoFormerForMaskedLM (rotary values)": encoder(
        "RoFormerForMaskedLM", "RoFormerConfig", "mlm", embedding_size=32, rotary_value=True,
        **SMALL),
    # HF vision
    "HF Swinv2": hf_image("Swinv2ForImageClassification", "Swinv2Config", image_size=32,
                          patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                          window_size=4, hidden_dropout_prob=0.1,
                          attention_probs_dropout_prob=0.1, drop_path_rate=0.1),
    "HF PVTv2": hf_image("PvtV2ForImageClassification", "PvtV2Config", image_size=32,
                         num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                         hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                         num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                         hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                         drop_path_rate=0.1),
    "HF FocalNet (layer scale)": hf_image(
        "FocalNetForImageClassification", "FocalNetConfig", image_size=32, patch_size=4,
        embed_dim=16, depths=[1, 1], focal_levels=[2, 2], focal_windows=[3, 3],
        hidden_dropout_prob=0.1, drop_path_rate=0.1, use_layerscale=True,
        layerscale_value=0.1),
    "HF MobileViTV2 (separable attention)": hf_image(
        "MobileViTV2ForImageClassification", "MobileViTV2Config", size=64, image_size=64,
        width_multiplier=0.5, classifier_dropout_prob=0.1, attn_dropout=0.1,
        ffn_dropout=0.1),
    # timm
    "timm efficientvit_m0": timm_classifier("efficientvit_m0", 64, img_size=64,
                                            drop_rate=0.1),
    "timm tiny_vit_5m_224": timm_classifier("tiny_vit_5m_224", 64, **DROP),
    "timm hgnetv2_b0": timm_classifier("hgnetv2_b0", 64, **DROP),
    "timm mobilenetv4_hybrid_medium": timm_classifier("mobilenetv4_hybrid_medium", 64,
                                                      **DROP),
    "timm vit_little_patch16_reg4_gap_256 (registers)": timm_classifier(
        "vit_little_patch16_reg4_gap_256", 32, img_size=32, patch_size=8, **DROP),
}


def main():
    run(MODELS, "newcomers_sixth.json")


if __name__ == "__main__":
    main()
