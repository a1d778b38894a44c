"""Models nobody here wrote, trained through a trial of lower budgets (trial.py Rule 7) against
plain PyTorch, on the CPU: HF GPT2LMHeadModel from a small config (its embedding tied to its
head, dropout, its own loss), timm convnext_atto (depthwise convolutions, layer scale, drop
path), torchvision mobilenet_v3_small (squeeze-excitation, hardswish, dropout) and HF
BertForMaskedLM (a padded attention mask, dropout).

The allocator never retries on the CPU, so every step is said to have retried, and the trial's
clock times a step by its executor's budget (the lower, the faster): the plan for the lowest
budget that fits is kept and trains on. superneurons runs at 0.8 of the way from its floor to
liveness's peak, where the lower budgets have plans. AdamW from the same start and seed through
the trial and STEPS_AFTER steps more; losses and every parameter and buffer compared bit for
bit, and every step's peak against the budget of the executor that ran it.

    python benchmarks/newcomers_room_trial.py OUT_DIR
        (CPU; writes newcomers_room_trial.json)
"""

import copy
import itertools
import os
import sys
from types import SimpleNamespace

import torch

import superneurons as sn
import superneurons.runtime.untouched as untouched
from common import write
from newcomers_exact import _classifier
from superneurons.runtime.trial import LONGEST_TRIAL_STEPS

STEPS_AFTER = 3
SHARE = 0.8


def gpt2():
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=3,
                                     n_head=4, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 300, (4, 48))
    return model, (), {"input_ids": ids, "labels": ids}, lambda out: out.loss


def convnext():
    import timm
    return _classifier(lambda: timm.create_model("convnext_atto", pretrained=False,
                                                 num_classes=10, drop_path_rate=0.1))


def mobilenet():
    import torchvision
    return _classifier(lambda: torchvision.models.mobilenet_v3_small(num_classes=10))


def bert():
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=64)
    model = transformers.BertForMaskedLM(config).train()
    ids = torch.randint(1, 200, (4, 32))
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[2, -9:] = 0
    labels = ids.clone()
    labels[:, ::2] = -100
    return model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels}, \
        lambda out: out.loss


MODELS = {"HF GPT2LMHeadModel": gpt2, "timm convnext_atto": convnext,
          "torchvision mobilenet_v3_small": mobilenet, "HF BertForMaskedLM": bert}


def budget_clock(budget: int):
    """A trial clock whose step takes 1 s within ``budget`` and less the lower its executor's."""
    clock = SimpleNamespace(now=0.0, running=None, seconds=lambda start, end: end - start)

    def mark():
        if clock.running is not None:
            clock.now += clock.running.budget_bytes / budget
        return clock.now
    clock.mark = mark
    return clock


def train(model, run, args, kwargs, loss_of, each=lambda: None) -> list:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    losses = []
    for _ in range(1 + LONGEST_TRIAL_STEPS + STEPS_AFTER):   # the trial begins at step 2
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(run(*args, **kwargs))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        each()
    return losses


def row(name: str, make) -> dict:
    base, args, kwargs, loss_of = make()
    floor = sn.plan(copy.deepcopy(base), args, kwargs=kwargs).peak_bytes
    liveness = sn.plan(copy.deepcopy(base), args, "liveness", kwargs=kwargs).peak_bytes
    budget = int(floor + (liveness - floor) * SHARE)
    plain = copy.deepcopy(base)
    expected = train(plain, plain, args, kwargs, loss_of)
    managed = copy.deepcopy(base)
    wrapped = sn.wrap(managed, policy="superneurons", budget=budget)
    clock = budget_clock(budget)
    wrapped._trials.clock = lambda device: clock
    held, budgets = [], []

    def each():
        clock.running = wrapped._last[1]
        budgets.append(clock.running.budget_bytes)
        held.append(wrapped.stats.peak_bytes <= clock.running.budget_bytes <= budget)
    counted = untouched.allocator_retries
    calls = itertools.count()
    untouched.allocator_retries = lambda device: next(calls)   # a retry between any two reads
    try:
        got = train(managed, wrapped, args, kwargs, loss_of, each)
    finally:
        untouched.allocator_retries = counted
    same = torch.equal(torch.stack(expected), torch.stack(got)) and all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                          managed.state_dict().values()))
    trials = wrapped.plan_trials
    return {"model": name, "budget_bytes": budget, "floor_bytes": floor,
            "liveness_bytes": liveness, "bit_identical": same, "budgets_held": all(held),
            "tried_gives_bytes": [p["gives_bytes"] for p in trials[0]["plans"]] if trials
            else [], "kept_gives_bytes": budget - budgets[-1],
            "moved_bytes_last_step": wrapped.stats.offloaded_bytes
            + wrapped.stats.prefetched_bytes, "steps": len(got)}


def main():
    rows = []
    for name, make in MODELS.items():
        rows.append(row(name, make))
        print(rows[-1], flush=True)
    write(os.path.join(sys.argv[1], "newcomers_room_trial.json"),
          {"share": SHARE, "steps_after": STEPS_AFTER, "rows": rows})


if __name__ == "__main__":
    main()
