"""A fourth newcomers pass: models not in newcomers_exact.py, newcomers_more.py or
newcomers_today.py, run as those run them (3 AdamW steps from one seed, dropout on, losses and
every parameter and buffer compared bit for bit with plain PyTorch, under offload at its plan's
peak, recompute and superneurons at its floor and halfway):

- HF decoders: GPT-J, OPT (and post-norm with projected embeddings), MPT (alibi), StableLM,
  Persimmon, CodeGen, GPT-Neo (global and local layers);
- HF encoders: XLNet (permutation masks, memories), ELECTRA, ALBERT (shared layers, groups,
  sentence order), MobileBERT, BigBird, Perceiver, Funnel, Longformer, LED;
- HF vision: Swin, ConvNext, BEiT (and its masked image modeling, whose bool_masked_pos once
  took capture off the model's attention path), DINOv2, Data2VecVision;
- timm: efficientvit_b0, repvit_m0_9, ghostnet_100, inception_next_tiny, caformer_s18,
  sequencer2d_s (LSTMs), gcvit_xxtiny, crossvit_tiny_240, pit_ti_224, tnt_s_patch16_224,
  xcit_nano_12_p16_224, cspresnet50, nest_tiny, coat_lite_tiny.
Some are refused before a step, by design (values read in the forward, numpy's generator, HF's
own checkpointing); the record says which and why.

    python benchmarks/newcomers_fourth.py OUT_DIR [--only NAME ...]
        (CPU; writes newcomers_fourth.json)
"""

import torch
import torch.nn.functional as F

from newcomers_more import VOCAB, CAUSAL, causal, seq2seq, run, timm_classifier
from newcomers_today import SMALL, encoder

DROP = dict(drop_rate=0.1, drop_path_rate=0.1)


def hf_image(model_class, config_class, size=32, labels=10, **config):
    def make():
        import transformers
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(
            getattr(transformers, config_class)(num_labels=labels, **config)).train()
        x, y = torch.randn(2, 3, size, size), torch.randint(0, labels, (2,))
        return model, (), {"pixel_values": x, "labels": y}, lambda out: out.loss
    return make


def led_config():
    import transformers
    return transformers.LEDConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64, attention_window=4, dropout=0.1,
        attention_dropout=0.1, activation_dropout=0.1)


VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
           num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.1,
           attention_probs_dropout_prob=0.1, drop_path_rate=0.1)

MODELS = {
    # HF decoders
    "HF GPT-J": causal("GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB, n_positions=64,
                       n_embd=32, n_layer=2, n_head=4, rotary_dim=4, resid_pdrop=0.1,
                       embd_pdrop=0.1, attn_pdrop=0.1),
    "HF OPT": causal("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32,
                     num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                     max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.1,
                     attention_dropout=0.1, pad_token_id=0),
    # MPT without attention dropout: transformers 5.24 types attn_pdrop as an int
    "HF MPT (alibi)": causal("MptForCausalLM", "MptConfig", vocab_size=VOCAB, d_model=32,
                             n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64,
                             resid_pdrop=0.1, emb_pdrop=0.1),
    "HF StableLM": causal("StableLmForCausalLM", "StableLmConfig", partial_rotary_factor=0.25,
                          hidden_dropout=0.1, **CAUSAL),
    "HF Persimmon": causal("PersimmonForCausalLM", "PersimmonConfig", vocab_size=VOCAB,
                           hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64,
                           hidden_dropout=0.1, attention_dropout=0.1, qk_layernorm=True,
                           partial_rotary_factor=0.5),
    "HF CodeGen": causal("CodeGenForCausalLM", "CodeGenConfig", vocab_size=VOCAB,
                         n_positions=64, n_ctx=64, n_embd=32, n_layer=2, n_head=4,
                         rotary_dim=4, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
    "HF GPTNeo (global+local)": causal(
        "GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=VOCAB, max_position_embeddings=64,
        hidden_size=32, num_layers=2, attention_types=[[["global", "local"], 1]],
        num_heads=4, intermediate_size=64, window_size=8, embed_dropout=0.1,
        attention_dropout=0.1, resid_dropout=0.1),
    # HF encoders
    "HF XLNetLMHeadModel": encoder("XLNetLMHeadModel", "XLNetConfig", "mlm", vocab_size=VOCAB,
                                   d_model=32, n_layer=2, n_head=4, d_inner=64, dropout=0.1,
                                   mem_len=None, use_mems_train=False),
    "HF ElectraForMaskedLM": encoder("ElectraForMaskedLM", "ElectraConfig", "mlm",
                                     embedding_size=16, **SMALL),
    "HF AlbertForMaskedLM (shared layers)": encoder("AlbertForMaskedLM", "AlbertConfig", "mlm",
                                                    embedding_size=16, **SMALL),
    "HF MobileBertForMaskedLM": encoder(
        "MobileBertForMaskedLM", "MobileBertConfig", "mlm", embedding_size=16,
        intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2,
        **SMALL),
    "HF FunnelForMaskedLM": encoder("FunnelForMaskedLM", "FunnelConfig", "mlm",
                                    vocab_size=VOCAB, block_sizes=[1, 1], d_model=32,
                                    n_head=4, d_head=8, d_inner=64, hidden_dropout=0.1,
                                    attention_dropout=0.1, activation_dropout=0.1),
    "HF LongformerForMaskedLM": encoder("LongformerForMaskedLM", "LongformerConfig", "mlm",
                                        attention_window=4, pad_token_id=1,
                                        **{**SMALL, "max_position_embeddings": 40}),
    "HF BigBirdForMaskedLM (block sparse)": encoder(
        "BigBirdForMaskedLM", "BigBirdConfig", "mlm", attention_type="block_sparse",
        block_size=2, num_random_blocks=1, **SMALL),
    "HF BigBirdForMaskedLM (full)": encoder(
        "BigBirdForMaskedLM", "BigBirdConfig", "mlm", attention_type="original_full",
        **SMALL),
    "HF PerceiverForMaskedLM": encoder(
        "PerceiverForMaskedLM", "PerceiverConfig", "mlm", vocab_size=VOCAB, num_latents=8,
        d_latents=32, d_model=32, num_blocks=1, num_self_attends_per_block=2,
        num_self_attention_heads=4, num_cross_attention_heads=4,
        max_position_embeddings=16, attention_probs_dropout_prob=0.1),
    "HF LEDForConditionalGeneration": seq2seq("LEDForConditionalGeneration", led_config),
    # HF vision
    "HF Swin": hf_image("SwinForImageClassification", "SwinConfig", image_size=32,
                        patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                        window_size=4, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1, drop_path_rate=0.1),
    "HF ConvNext": hf_image("ConvNextForImageClassification", "ConvNextConfig",
                            num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], drop_path_rate=0.1),
    "HF BEiT": hf_image("BeitForImageClassification", "BeitConfig",
                        use_relative_position_bias=True, layer_scale_init_value=0.1, **VIT),
    "HF DINOv2": hf_image("Dinov2ForImageClassification", "Dinov2Config", **VIT),
    "HF Data2VecVision": hf_image("Data2VecVisionForImageClassification",
                                  "Data2VecVisionConfig", use_relative_position_bias=True,
                                  **VIT),
    # timm
    "timm efficientvit_b0": timm_classifier("efficientvit_b0", 64, drop_rate=0.1),
    "timm repvit_m0_9 (train)": timm_classifier("repvit_m0_9", 64, drop_rate=0.1),
    "timm ghostnet_100": timm_classifier("ghostnet_100", 64, drop_rate=0.1),
    "timm inception_next_tiny": timm_classifier("inception_next_tiny", 64, **DROP),
    "timm caformer_s18": timm_classifier("caformer_s18", 64, **DROP),
    "timm sequencer2d_s (LSTM)": timm_classifier("sequencer2d_s", 56, img_size=56, **DROP),
    "timm gcvit_xxtiny": timm_classifier("gcvit_xxtiny", 64, img_size=64, **DROP),
    "timm crossvit_tiny_240": timm_classifier("crossvit_tiny_240", 48, img_size=48,
                                              img_scale=(1.0, 1.0), **DROP),
    "timm pit_ti_224": timm_classifier("pit_ti_224", 64, img_size=64, **DROP),
    "timm tnt_s_patch16_224": timm_classifier("tnt_s_patch16_224", 32, img_size=32, **DROP),
    "timm xcit_nano_12_p16_224": timm_classifier("xcit_nano_12_p16_224", 64, img_size=64,
                                                 **DROP),
    "timm cspresnet50": timm_classifier("cspresnet50", 64, **DROP),
    "timm nest_tiny": timm_classifier("nest_tiny", 64, img_size=64, **DROP),
    "timm coat_lite_tiny": timm_classifier("coat_lite_tiny", 64, img_size=64, **DROP),
}


def called_once(make):
    """The model called once (no grad) before it is returned: attributes its forward assigns
    (Funnel's attention_structure) already hold what every call assigns."""
    def build():
        model, args, kwargs, loss_of = make()
        with torch.no_grad():
            model(*args, **kwargs)
        return model, args, kwargs, loss_of
    return build


def beit_mim():
    import transformers
    torch.manual_seed(0)
    config = transformers.BeitConfig(use_mask_token=True, use_shared_relative_position_bias=True,
                                     vocab_size=64, **VIT)
    model = transformers.BeitForMaskedImageModeling(config).train()
    x = torch.randn(2, 3, 32, 32)
    masked = torch.zeros(2, 16, dtype=torch.bool)
    masked[0, ::3] = True
    masked[1, 1::2] = True
    labels = torch.randint(0, 64, (2, 16))
    def loss_of(out):
        return F.cross_entropy(out.logits[masked], labels[masked])
    return model, (), {"pixel_values": x, "bool_masked_pos": masked}, loss_of


def xlnet_mems():
    """XLNet with memory in training (use_mems_train): its output carries mems, a cache."""
    import transformers
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4,
                                      d_inner=64, dropout=0.1, mem_len=8, use_mems_train=True)
    model = transformers.XLNetLMHeadModel(config).train()
    ids = torch.randint(4, VOCAB, (2, 16))
    return model, (), {"input_ids": ids, "labels": ids}, lambda out: out.loss


def xlnet_perm():
    """XLNet with a permutation mask and target mapping (its pretraining objective)."""
    import transformers
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4,
                                      d_inner=64, dropout=0.1, mem_len=None)
    model = transformers.XLNetLMHeadModel(config).train()
    ids = torch.randint(4, VOCAB, (2, 16))
    perm = torch.zeros(2, 16, 16)
    perm[:, :, -4:] = 1.0
    target = torch.zeros(2, 4, 16)
    for k in range(4):
        target[:, k, 12 + k] = 1.0
    return model, (), {"input_ids": ids, "perm_mask": perm, "target_mapping": target,
                       "labels": ids[:, -4:].contiguous()}, lambda out: out.loss


MODELS.update({
    "HF Funnel, called once before": called_once(MODELS["HF FunnelForMaskedLM"]),
    "HF Swin padded (36 px, window 4)": hf_image(
        "SwinForImageClassification", "SwinConfig", size=36, image_size=36, patch_size=4,
        embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, drop_path_rate=0.1),
    "HF Dinov2 interpolated (48 px on 32)": lambda: _interp("Dinov2ForImageClassification",
                                                            "Dinov2Config"),
    "HF BeitForMaskedImageModeling": beit_mim,
    "HF XLNet perm_mask + target_mapping": xlnet_perm,
    "HF XLNet use_mems_train": xlnet_mems,
    "HF OPT post-norm, projected embeddings": causal(
        "OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32,
        num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, max_position_embeddings=64,
        word_embed_proj_dim=16, do_layer_norm_before=False, dropout=0.1,
        attention_dropout=0.1, layerdrop=0.0, pad_token_id=0),
    "HF ALBERT 2 groups, SOP head": None,
})


def _interp(model_class, config_class):
    import transformers
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(
        getattr(transformers, config_class)(num_labels=10, **VIT)).train()
    x, y = torch.randn(2, 3, 48, 48), torch.randint(0, 10, (2,))
    return model, (), {"pixel_values": x, "labels": y}, lambda out: out.loss


def albert_pretraining():
    import transformers
    torch.manual_seed(0)
    config = transformers.AlbertConfig(embedding_size=16, num_hidden_groups=2, **SMALL)
    model = transformers.AlbertForPreTraining(config).train()
    ids = torch.randint(4, VOCAB, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, -5:] = 0
    labels = ids.clone()
    labels[:, ::3] = -100
    return model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels,
                       "sentence_order_label": torch.tensor([0, 1])}, lambda out: out.loss


MODELS["HF ALBERT 2 groups, SOP head"] = albert_pretraining


def electra_discriminator():
    import transformers
    torch.manual_seed(0)
    config = transformers.ElectraConfig(embedding_size=16, **SMALL)
    model = transformers.ElectraForPreTraining(config).train()
    ids = torch.randint(4, VOCAB, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, -5:] = 0
    labels = torch.randint(0, 2, (2, 16))
    return model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels}, \
        lambda out: out.loss


def swin_mim():
    import transformers
    torch.manual_seed(0)
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                     num_heads=[2, 2], window_size=4, hidden_dropout_prob=0.1,
                                     attention_probs_dropout_prob=0.1, drop_path_rate=0.1,
                                     encoder_stride=8)
    model = transformers.SwinForMaskedImageModeling(config).train()
    masked = torch.zeros(2, 64, dtype=torch.bool)
    masked[0, ::3] = True
    masked[1, 1::2] = True
    return model, (), {"pixel_values": torch.randn(2, 3, 32, 32), "bool_masked_pos": masked}, \
        lambda out: out.loss


def perceiver_fourier():
    import transformers
    torch.manual_seed(0)
    config = transformers.PerceiverConfig(num_latents=8, d_latents=32, d_model=32, num_blocks=1,
                                          num_self_attends_per_block=2,
                                          num_self_attention_heads=4,
                                          num_cross_attention_heads=1, num_labels=10,
                                          attention_probs_dropout_prob=0.1)
    model = transformers.PerceiverForImageClassificationFourier(config).train()
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    return model, (), {"pixel_values": x, "labels": y}, lambda out: out.loss


def checkpointed(make):
    """HF's own gradient checkpointing turned on (model.gradient_checkpointing_enable())."""
    def build():
        model, args, kwargs, loss_of = make()
        model.gradient_checkpointing_enable()
        return model, args, kwargs, loss_of
    return build


MODELS.update({
    "HF ElectraForPreTraining (discriminator)": electra_discriminator,
    "HF SwinForMaskedImageModeling": swin_mim,
    "HF PerceiverForImageClassificationFourier": perceiver_fourier,
    "HF GPTNeo + gradient_checkpointing_enable": checkpointed(MODELS["HF GPTNeo (global+local)"]),
    "HF BEiT + gradient_checkpointing_enable": checkpointed(MODELS["HF BEiT"]),
})


def main():
    run(MODELS, "newcomers_fourth.json")


if __name__ == "__main__":
    main()
