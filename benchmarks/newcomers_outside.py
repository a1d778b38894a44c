"""A newcomers pass for gradients from outside the model (planner/gradients.py Rule 5,
runtime/outside.py): models nobody here wrote that return their loss beside the logits it is
computed from, run as the other newcomers_*.py passes run them (3 AdamW steps from one seed,
dropout on where a model takes it, losses and every parameter and buffer compared bit for bit
with plain PyTorch, under offload at its plan's peak, recompute and superneurons at its floor
and halfway), each in two modes:

- loss_only: the step backpropagates the model's own loss (labels given): the plan counts
  backward from that loss alone, and no "from outside the model" warning may come;
- distill: the step backpropagates the model's loss plus a distillation term through the
  logits (their log-softmax against fixed teacher probabilities): a gradient reaches the
  logits from outside, the warning must come exactly once per wrapped model, and the wrapper
  must have planned again with outside gradients (wrapped.outside_gradients).

Each row keeps the warnings, and the peak of the plan the wrapper holds for the call
(wrapped.plan_for) before the first step and after the last, with whether it counts outside
gradients. Budgets come from the plans of the model's loss alone, in both modes: a replan
counting outside gradients may need more than such a budget (a BudgetError, a row with its
error, as expected where it names the outside gradient). Models, from tiny configs: HF GPT-2,
Llama, Qwen2 and Mistral (2 sequences of 16 tokens, the second left-padded by 5), Bart and
T5 (fp32, no autocast: 16 tokens in, 8 label tokens out), BertForMaskedLM (the second sequence
right-padded by 5) and nanoGPT (tests/nanogpt.py: returns (logits, loss) given targets).

On the CPU the wrapper reads no device memory, so a plan that fits its budget untouched (offload
at its own peak, on models without convolutions: liveness) runs the model itself, and no
executor watches its outputs. With --cuda-reading the wrapper reads device memory as on CUDA
(newcomers_exact.py --untouched's stand-in: nothing the model does not own): the first step of
such a call then runs managed (untouched.py Rule 1), where an outside gradient is seen.

    python benchmarks/newcomers_outside.py OUT_DIR [--only NAME ...] [--cuda-reading]
        (CPU; writes newcomers_outside.json, or newcomers_outside_cuda_reading.json)
"""

import copy
import os
import sys
import warnings

import torch

import superneurons as sn
from superneurons.planner.plan import BudgetError
from common import write
from newcomers_exact import STEPS, floor_or_refusal, read_as_on_cuda, runs, train
from newcomers_more import CAUSAL, MODELS as MORE, VOCAB, causal
from newcomers_today import SMALL, encoder

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

OUTSIDE = "from outside the model"          # runtime/outside.py's warning
MODES = ("loss_only", "distill")


def nanogpt():
    """karpathy/nanoGPT's decoder (tests/nanogpt.py) with dropout, 2 sequences of 16 tokens;
    its forward returns (logits, loss) given targets."""
    from nanogpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32,
                          dropout=0.1)).train()
    ids = torch.randint(0, VOCAB, (2, 16))
    targets = torch.roll(ids, -1, 1)
    targets[1, :5] = -1                                          # nanoGPT's ignore_index
    return model, (), {"idx": ids, "targets": targets}, lambda out: out[1]


def hf_logits(out):
    return out.logits


def tuple_logits(out):
    return out[0]


MODELS = {   # name -> (make, the logits among the outputs)
    "HF GPT2LMHeadModel": (causal(
        "GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
        n_inner=64, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
        hf_logits),
    "HF LlamaForCausalLM": (causal("LlamaForCausalLM", "LlamaConfig", **CAUSAL), hf_logits),
    "HF Qwen2ForCausalLM (sliding window)": (MORE["HF Qwen2 (sliding window)"], hf_logits),
    "HF MistralForCausalLM (sliding window, eager)": (
        MORE["HF Mistral (sliding window, eager)"], hf_logits),
    "HF BartForConditionalGeneration": (MORE["HF BartForConditionalGeneration"], hf_logits),
    "HF T5ForConditionalGeneration": (MORE["HF T5ForConditionalGeneration"], hf_logits),
    "HF BertForMaskedLM": (encoder("BertForMaskedLM", "BertConfig", "mlm", **SMALL),
                           hf_logits),
    "nanoGPT (tests/nanogpt.py)": (nanogpt, tuple_logits),
}


def teacher(shape) -> torch.Tensor:
    """Fixed teacher probabilities of the logits' shape, from a generator of their own (the
    global seed, which dropout draws from, is left alone)."""
    generator = torch.Generator().manual_seed(7)
    return torch.randn(shape, generator=generator).softmax(-1)


def with_mode(loss_of, logits_of, mode: str):
    """The step's loss: the model's own, or with a distillation term through its logits."""
    if mode == "loss_only":
        return loss_of

    def distilled(out):
        logits = logits_of(out)
        term = (logits.float().log_softmax(-1) * teacher(logits.shape)).sum(-1).mean().neg()
        return loss_of(out) + 0.5 * term
    return distilled


def held_plan(wrapped, args, kwargs) -> dict:
    plan = wrapped.plan_for(*args, **kwargs)[0]
    return {"peak_bytes": plan.peak_bytes, "outside_gradients": plan.graph.outside_gradients}


class Counted:
    """The wrapper, counting the steps it ran untouched (no executor: the model itself)."""

    def __init__(self, wrapped):
        self.wrapped, self.untouched = wrapped, 0

    def __call__(self, *args, **kwargs):
        out = self.wrapped(*args, **kwargs)
        self.untouched += self.wrapped._last[1] is None
        return out

    @property
    def stats(self):
        return self.wrapped.stats


def compare(name: str, make, logits_of) -> list:
    """Per mode and policy, whether the wrapper trains as plain PyTorch does, and what it
    warned and planned."""
    rows = []
    base, args, kwargs, loss_of = make()
    floor = floor_or_refusal(name, base, args, kwargs, rows)
    if floor is None:
        return rows
    liveness = sn.plan(copy.deepcopy(base), args, "liveness", kwargs=kwargs).peak_bytes
    offload = sn.plan(copy.deepcopy(base), args, "offload", kwargs=kwargs).peak_bytes
    pairs = (("offload", offload),) + runs(floor, liveness, False)[1:]
    for mode in MODES:
        step_loss = with_mode(loss_of, logits_of, mode)
        plain = copy.deepcopy(base)
        expected = train(plain, plain, args, kwargs, step_loss)
        for policy, budget in pairs:
            managed = copy.deepcopy(base)
            wrapped = sn.wrap(managed, policy=policy, budget=budget)
            row = {"model": name, "mode": mode, "policy": policy, "budget_bytes": budget}
            policies, said, counted = [], [], Counted(wrapped)
            try:
                row["plan_before"] = held_plan(wrapped, args, kwargs)
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    got = train(managed, counted, args, kwargs, step_loss, policies)
                row["plan_after"] = held_plan(wrapped, args, kwargs)
            except Exception as error:       # a step that fails is a row, not the end of the run
                outside = sum(OUTSIDE in str(w.message) for w in said)
                row.update(exact=False, error=f"{type(error).__name__}: "
                                              f"{str(error).splitlines()[0][:700]}",
                           steps_run=len(policies), step_policies=policies,
                           untouched_steps=counted.untouched, outside_warnings=outside,
                           outside_gradients=wrapped.outside_gradients,
                           # a budget that held the loss alone, refused once the outside
                           # gradient is counted, saying so, after the warning
                           as_expected=mode == "distill" and outside == 1 and
                           isinstance(error, BudgetError) and
                           "gradient from outside the model" in str(error))
                rows.append(row)
                print(row, flush=True)
                continue
            losses = torch.equal(torch.stack(expected), torch.stack(got))
            differ = [key for (key, a), b in zip(plain.state_dict().items(),
                                                 managed.state_dict().values())
                      if not torch.equal(a, b)]
            outside = sum(OUTSIDE in str(w.message) for w in said)
            row.update(exact=losses and not differ, losses_equal=losses,
                       differing_state=differ[:8], outside_warnings=outside,
                       other_warnings=sorted({str(w.message)[:160] for w in said
                                              if OUTSIDE not in str(w.message)}),
                       outside_gradients=wrapped.outside_gradients, step_policies=policies,
                       # steps the model ran itself: no executor watched its outputs
                       untouched_steps=counted.untouched,
                       offloaded_bytes=wrapped.stats.offloaded_bytes,
                       recomputed_layers=wrapped.stats.recomputed_layers)
            # an executor watched a distillation step: said once, at the next forward
            watched = mode == "distill" and counted.untouched < STEPS
            row["as_expected"] = row["exact"] and outside == int(watched) and \
                wrapped.outside_gradients == watched
            rows.append(row)
            print(row, flush=True)
    return rows


def main():
    reading = "--cuda-reading" in sys.argv
    if reading:
        read_as_on_cuda()
    only = [a for a in sys.argv[sys.argv.index("--only") + 1:] if a != "--cuda-reading"] \
        if "--only" in sys.argv else None
    rows = []
    for name, (make, logits_of) in MODELS.items():
        if only is None or any(part in name for part in only):
            rows += compare(name, make, logits_of)
    name = "newcomers_outside_cuda_reading.json" if reading else "newcomers_outside.json"
    write(os.path.join(sys.argv[1], name),
          {"steps": STEPS, "modes": MODES, "cuda_reading": reading, "rows": rows})


if __name__ == "__main__":
    main()
