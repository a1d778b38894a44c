"""A seventh newcomers pass: models not in the other newcomers_*.py passes or the tests, run as
those run them (3 AdamW steps from one seed, dropout on where a model takes it, losses and every
parameter and buffer compared bit for bit with plain PyTorch, under offload at its plan's peak,
recompute and superneurons at its floor and halfway), each step's peak against its budget too:

- HF Falcon from tiny configs (2 sequences of 16 tokens, the second left-padded by 5): rotary
  with parallel attention, and ALiBi with the new decoder architecture (eager);
- timm at 64 px: tresnet_m (space-to-depth stem, anti-aliased downsampling), nfnet_l0 (scaled
  weight standardization, a downsampling shortcut beside the main branch), coatnet_nano_rw_224
  (convolution then relative-position attention stages), with dropout and drop path.

    python benchmarks/newcomers_seventh.py OUT_DIR [--only NAME ...]
        (CPU; writes newcomers_seventh.json)
"""

from newcomers_fourth import DROP
from newcomers_more import CAUSAL, causal, run, timm_classifier

FALCON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, attention_dropout=0.1, hidden_dropout=0.1)
assert CAUSAL["vocab_size"] == FALCON["vocab_size"]          # the batch's token ids fit both

MODELS = {
    "HF Falcon (rotary, parallel attention)": causal(
        "FalconForCausalLM", "FalconConfig", parallel_attn=True, **FALCON),
    "HF Falcon (ALiBi, new decoder architecture, eager)": causal(
        "FalconForCausalLM", "FalconConfig", "eager", alibi=True,
        new_decoder_architecture=True, num_kv_heads=2, **FALCON),
    "timm tresnet_m": timm_classifier("tresnet_m", 64, **DROP),
    "timm nfnet_l0": timm_classifier("nfnet_l0", 64, **DROP),
    "timm coatnet_nano_rw_224": timm_classifier("coatnet_nano_rw_224", 64, img_size=64,
                                                **DROP),
}


def main():
    run(MODELS, "newcomers_seventh.json")


if __name__ == "__main__":
    main()
