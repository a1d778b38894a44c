"""A fifth newcomers pass: models not in the other newcomers_*.py passes or the tests, and
constructs the tests' matrix covers in its own small networks, written here once more, run as
the other passes run them (3 AdamW steps from one seed, dropout on where a model takes it,
losses and every parameter and buffer compared bit for bit with plain PyTorch, under offload at
its plan's peak, recompute and superneurons at its floor and halfway):

- HF decoders from tiny configs (2 sequences of 16 tokens, the second left-padded by 5):
  GPTBigCode (multi-query attention), OLMoE (4 experts, top 2, its router loss), Granite (its
  embedding, residual, attention and logits multipliers), Cohere (parallel block, qk norm,
  logit scale), Starcoder2 (residual and embedding dropout, sliding window), Nemotron (partial
  rotary, layer norm 1p), RecurrentGemma (recurrent and local attention blocks) and RWKV (its
  time-mixing recurrence, no dropout);
- HF vision: SiglipForImageClassification (a 32 px vision tower with a classification head);
- timm at 64 px: starnet_s1, mambaout_femto, rdnet_tiny, fastvit_sa12, nextvit_small, and
  efficientformer_l1 narrowed at 224 px (its attention biases are 7 x 7), with dropout and
  drop path;
- plain PyTorch constructs in small modules written here: a forward pre-hook and a forward
  hook on a submodule that scale its input and output; one module used twice in a forward
  (shared weights, dropout inside); a torch.no_grad() region inside the forward (a detached
  scale, and a buffer updated in place); a torch.autocast("cpu", bfloat16) region inside the
  forward; in-place ops on activations (add_, mul_, relu_); a dict input and a dict output.

    python benchmarks/newcomers_fifth.py OUT_DIR [--only NAME ...]
        (CPU; writes newcomers_fifth.json)
"""

import torch
import torch.nn.functional as F
from torch import nn

from newcomers_more import CAUSAL, VOCAB, causal, run, timm_classifier
from newcomers_fourth import DROP, hf_image


# Plain-PyTorch constructs, each a small classifier of 2 x 16 features into 4 classes.

def _inputs():
    return torch.randn(2, 16), torch.randint(0, 4, (2,))


class Hooked(nn.Module):
    """A forward pre-hook halving the middle layer's input and a forward hook scaling and
    shifting its output, both registered on the submodule."""

    def __init__(self):
        super().__init__()
        self.fc1, self.mid, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.1)
        self.mid.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
        self.mid.register_forward_hook(lambda module, args, out: out * 2.0 + 0.1)

    def forward(self, x):
        x = self.drop(F.gelu(self.fc1(x)))
        return self.fc2(F.gelu(self.mid(x)))


class Shared(nn.Module):
    """One block (linear, layer norm, dropout) applied twice: its weights get two gradients."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 4)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU(),
                                   nn.Dropout(0.1))

    def forward(self, x):
        x = self.inp(x)
        x = x + self.block(x)
        x = x + self.block(x)
        return self.out(x)


class NoGradRegion(nn.Module):
    """A torch.no_grad() region in the forward: a scale computed from the activations without
    gradient, and a running mean buffer updated in place."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("running", torch.zeros(32))

    def forward(self, x):
        h = self.drop(torch.tanh(self.fc1(x)))
        with torch.no_grad():
            scale = h.abs().amax(dim=-1, keepdim=True) + 1.0
            self.running.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.fc2(h / scale + self.running)


class AutocastRegion(nn.Module):
    """A torch.autocast("cpu", bfloat16) region in the forward around two linears; its output
    cast back to float32 for the head."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc2(self.drop(F.gelu(self.fc1(x))))
        return self.head(h.float())


class InPlace(nn.Module):
    """In-place ops on activations: add_ of a parameter, mul_ by a constant, relu_ (tensor and
    functional)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.shift = nn.Parameter(torch.full((32,), 0.1))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.fc1(x)
        h.add_(self.shift)
        h.relu_()
        h = self.drop(h)
        g = self.fc2(h)
        g.mul_(0.5)
        F.relu_(g)
        return self.fc3(g)


class DictInOut(nn.Module):
    """A dict input (two tensors) and a dict output (logits and an auxiliary score)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(8, 32)
        self.head, self.aux = nn.Linear(32, 4), nn.Linear(32, 1)
        self.drop = nn.Dropout(0.1)

    def forward(self, batch):
        h = self.drop(F.gelu(self.a(batch["x"]) + self.b(batch["extra"])))
        return {"logits": self.head(h), "score": self.aux(h).squeeze(-1)}


def construct(module_class):
    """A builder for one of the construct modules above, with cross-entropy on 4 classes."""
    def make():
        torch.manual_seed(0)
        model = module_class().train()
        x, y = _inputs()
        return model, (x,), {}, lambda out: F.cross_entropy(out, y)
    return make


def dict_in_out():
    """DictInOut with its loss: cross-entropy on the logits plus the score's squared error."""
    torch.manual_seed(0)
    model = DictInOut().train()
    x, y = _inputs()
    batch = {"x": x, "extra": torch.randn(2, 8)}
    target = torch.randn(2)
    return model, (batch,), {}, lambda out: F.cross_entropy(out["logits"], y) + \
        F.mse_loss(out["score"], target)


SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=8, attention_dropout=0.1)

MODELS = {
    # HF decoders
    "HF GPTBigCode (multi-query)": causal(
        "GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB, n_positions=64,
        n_embd=32, n_layer=2, n_head=4, n_inner=64, multi_query=True, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1),
    "HF OLMoE (4 experts, top 2, router loss)": causal(
        "OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02, **CAUSAL),
    "HF Granite (multipliers)": causal(
        "GraniteForCausalLM", "GraniteConfig", embedding_multiplier=4.0,
        residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0, **CAUSAL),
    "HF Cohere (qk norm)": causal("CohereForCausalLM", "CohereConfig", use_qk_norm=True,
                                  logit_scale=0.5, **CAUSAL),
    "HF Starcoder2 (sliding window)": causal(
        "Starcoder2ForCausalLM", "Starcoder2Config", sliding_window=8, residual_dropout=0.1,
        embedding_dropout=0.1, **CAUSAL),
    "HF Nemotron (partial rotary)": causal("NemotronForCausalLM", "NemotronConfig", **CAUSAL),
    "HF RecurrentGemma": causal(
        "RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, lru_width=32, attention_window_size=8, conv1d_width=4,
        attention_dropout=0.1),
    "HF RWKV": causal("RwkvForCausalLM", "RwkvConfig", vocab_size=VOCAB, context_length=64,
                      hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                      intermediate_size=64),
    # HF vision
    "HF SiglipForImageClassification": hf_image("SiglipForImageClassification", "SiglipConfig",
                                                vision_config=SIGLIP),
    # timm
    "timm starnet_s1": timm_classifier("starnet_s1", 64, **DROP),
    "timm mambaout_femto": timm_classifier("mambaout_femto", 64, **DROP),
    "timm rdnet_tiny": timm_classifier("rdnet_tiny", 64, **DROP),
    # its attention biases are fixed at 7 x 7 (224 px); smaller stages to keep it small
    "timm efficientformer_l1 (224 px, narrow)": timm_classifier(
        "efficientformer_l1", 224, depths=(1, 1, 1, 2), embed_dims=(16, 32, 48, 96), **DROP),
    "timm fastvit_sa12": timm_classifier("fastvit_sa12", 64, **DROP),
    "timm nextvit_small": timm_classifier("nextvit_small", 64, **DROP),
    # plain PyTorch constructs
    "forward pre-hook and forward hook on a submodule": construct(Hooked),
    "one module used twice (shared weights)": construct(Shared),
    "torch.no_grad() region in the forward (buffer updated in place)": construct(NoGradRegion),
    "torch.autocast(cpu, bfloat16) region in the forward": construct(AutocastRegion),
    "in-place ops on activations (add_, mul_, relu_)": construct(InPlace),
    "dict input and dict output": dict_in_out,
}


def main():
    run(MODELS, "newcomers_fifth.json")


if __name__ == "__main__":
    main()
