"""Models nobody here wrote, outside the test matrix, trained under each policy against plain
PyTorch: torchvision shufflenet_v2_x0_5 (channel shuffles: views, transposes, chunks), HF
RobertaForMaskedLM from a small config (dropout, its own loss, which superneurons slices), timm
mobilevit_xxs (unfold and fold around attention, drop path), HF
DistilBertForSequenceClassification (a padded attention mask, dropout, its own loss) and
torchvision's lraspp_mobilenet_v3_large segmenter (a dict output, a per-pixel loss).
3 AdamW steps from the same start and seed; losses and every parameter and buffer compared bit
for bit. Policies: offload, recompute, superneurons at its floor and at a budget halfway to
liveness (where the pool starts copies ahead of need, executor Rule 8). Also torchvision
mnasnet0_5 (depthwise convolutions, dropout), timm regnetx_002 (grouped convolutions) and
torchvision squeezenet1_1 (fire modules' concatenations, in-place ReLUs, dropout).

With --fit, every executor step runs as a calibrating CUDA step would, fitting each
convolution's workspace (executor Rule 9: the limits, their lifting while saved tensors come
back, the backward hooks) against a fake allocator: the CPU runs that path, and the record
counts the limits set and whether the caller's fraction came back.

With --untouched, the device's memory is read as CUDA's would be (nothing the model does not
own), and superneurons runs at a budget its liveness plan fits with the untouched margin: the
first step managed, the later ones untouched (runtime/untouched.py); the record says which.

    python benchmarks/newcomers_exact.py OUT_DIR [--fit | --untouched]
        (CPU; writes newcomers_exact.json, newcomers_fit.json or newcomers_untouched.json)
"""

import copy
import os
import sys

import torch
import torch.nn.functional as F

import superneurons as sn
from common import write

STEPS = 3


def _classifier(build, batch: int = 4):
    """An image classifier from ``build()`` (10 classes), a batch of 64 px images, its loss."""
    torch.manual_seed(0)
    model = build().train()
    x, y = torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,))
    return model, (x,), {}, lambda out: F.cross_entropy(out, y)


def shufflenet():
    import torchvision
    return _classifier(lambda: torchvision.models.shufflenet_v2_x0_5(num_classes=10))


def roberta():
    import transformers
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=500, hidden_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, intermediate_size=128,
                                        max_position_embeddings=80)
    model = transformers.RobertaForMaskedLM(config).train()
    ids = torch.randint(3, 500, (4, 64))
    labels = ids.clone()
    labels[:, ::3] = -100
    return model, (), {"input_ids": ids, "labels": labels}, lambda out: out.loss


def mobilevit():
    import timm
    return _classifier(lambda: timm.create_model("mobilevit_xxs", pretrained=False,
                                                 num_classes=10, drop_path_rate=0.1), batch=2)


def distilbert():
    import transformers
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2,
                                           hidden_dim=64, max_position_embeddings=64,
                                           dropout=0.1, attention_dropout=0.1,
                                           seq_classif_dropout=0.2, num_labels=3)
    model = transformers.DistilBertForSequenceClassification(config).train()
    ids = torch.randint(1, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, -5:] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}
    return model, (), kwargs, lambda out: out.loss


def lraspp():
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=10).train()
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2, 64, 64))
    return model, (x,), {}, lambda out: F.cross_entropy(out["out"], y)


def mnasnet():
    import torchvision
    return _classifier(lambda: torchvision.models.mnasnet0_5(num_classes=10))


def squeezenet():
    import torchvision
    return _classifier(lambda: torchvision.models.squeezenet1_1(num_classes=10))


def regnetx():
    import timm
    return _classifier(lambda: timm.create_model("regnetx_002", pretrained=False,
                                                 num_classes=10))


MODELS = {"torchvision shufflenet_v2_x0_5": shufflenet, "HF RobertaForMaskedLM": roberta,
          "timm mobilevit_xxs": mobilevit, "HF DistilBertForSequenceClassification": distilbert,
          "torchvision lraspp_mobilenet_v3_large": lraspp, "torchvision mnasnet0_5": mnasnet,
          "timm regnetx_002": regnetx, "torchvision squeezenet1_1": squeezenet}


class FakeFit:
    """CUDA's per-process fraction and allocator statistics faked (an 80 GiB device, 1 GiB
    allocated), and every executor step made a calibrating one that fits its convolutions."""

    def __init__(self):
        from superneurons.runtime import workspaces
        from superneurons.runtime.executor import Executor
        self.fraction, self.limits = 1.0, 0
        torch.cuda.get_device_properties = \
            lambda index: type("Properties", (), {"total_memory": 80 << 30})
        torch.cuda.get_per_process_memory_fraction = lambda index=None: self.fraction
        torch.cuda.set_per_process_memory_fraction = self.set
        torch.cuda.empty_cache = lambda: None
        workspaces._stats = lambda index: (1 << 30, (1 << 30) + (64 << 20))
        run = Executor.run

        def calibrating_run(executor, args, foreign=None):
            if executor.workspaces is None:
                executor.workspaces = workspaces.WorkspaceFit(
                    torch.device("cuda", 0), budget_bytes=2 << 30, slack_bytes=0)
                executor.calibration.read = lambda: 0          # no CUDA statistics
            executor.calibrating = True     # run() sets it on CUDA only: it stays
            return run(executor, args, foreign)
        Executor.run = calibrating_run

    def set(self, fraction, index=None):
        self.fraction = fraction
        self.limits += fraction < 1.0


def read_as_on_cuda():
    """The wrapper reads device memory as on CUDA, finding nothing the model does not own."""
    from superneurons.runtime import module
    module.reads_device_memory = lambda device: True
    module.foreign_bytes = lambda *args, **kwargs: 0


def train(model, run, args, kwargs, loss_of, policies=None) -> list:
    """STEPS AdamW steps; each step's policy appended to ``policies`` (a wrapper's)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(run(*args, **kwargs))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if policies is not None:
            policies.append(run.stats.policy)
    return losses


def floor_or_refusal(name: str, base, args, kwargs, rows: list):
    """superneurons' floor for the model's step, or None where capture or planning refused it
    before a step: then a row saying why is added to ``rows``."""
    try:
        return sn.plan(copy.deepcopy(base), args, kwargs=kwargs).peak_bytes
    except ValueError as error:
        rows.append({"model": name, "refused": str(error).splitlines()[0][:400]})
        print(rows[-1], flush=True)
        return None


def runs(floor: int, liveness: int, untouched: bool) -> tuple:
    """(policy, budget) pairs to compare with plain PyTorch."""
    if untouched:
        from superneurons.runtime.untouched import UNTOUCHED_MARGIN
        return (("superneurons", liveness + int(UNTOUCHED_MARGIN * liveness)),)
    return (("offload", None), ("recompute", None), ("superneurons", None),
            ("superneurons", (floor + liveness) // 2))


def main():
    fit = FakeFit() if "--fit" in sys.argv else None
    untouched = "--untouched" in sys.argv
    if untouched:
        read_as_on_cuda()
    rows = compare(MODELS, untouched, fit)
    name = "newcomers_fit.json" if fit else \
        "newcomers_untouched.json" if untouched else "newcomers_exact.json"
    write(os.path.join(sys.argv[1], name),
          {"steps": STEPS, "fit": fit is not None, "untouched": untouched, "rows": rows})


def compare(models: dict, untouched: bool = False, fit=None, offload_moving: bool = False
            ) -> list:
    """Per model of ``models`` (name -> make()) and policy, whether training under the wrapper
    is bit for bit plain PyTorch's. ``offload_moving``: offload at its own plan's peak, where it
    moves data, instead of without a budget (where it moves only convolution outputs, as the
    paper's offload does: none on a model without convolutions)."""
    rows = []
    for name, make in models.items():
        base, args, kwargs, loss_of = make()
        floor = floor_or_refusal(name, base, args, kwargs, rows)
        if floor is None:
            continue
        liveness = sn.plan(copy.deepcopy(base), args, "liveness", kwargs=kwargs).peak_bytes
        plain = copy.deepcopy(base)
        expected = train(plain, plain, args, kwargs, loss_of)
        pairs = runs(floor, liveness, untouched)
        if offload_moving:
            offload = sn.plan(copy.deepcopy(base), args, "offload", kwargs=kwargs).peak_bytes
            pairs = (("offload", offload),) + pairs[1:]
        for policy, budget in pairs:
            managed = copy.deepcopy(base)
            wrapped = sn.wrap(managed, policy=policy, budget=budget)
            policies = []
            got = train(managed, wrapped, args, kwargs, loss_of, policies)
            same = torch.equal(torch.stack(expected), torch.stack(got)) and all(
                torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                  managed.state_dict().values()))
            stats = wrapped.stats
            rows.append({"model": name, "policy": policy, "budget_bytes": budget,
                         "bit_identical": same, "peak_bytes": stats.peak_bytes,
                         "budget_held": budget is None or stats.peak_bytes <= budget,
                         "offloaded_bytes": stats.offloaded_bytes,
                         "recomputed_layers": stats.recomputed_layers,
                         "step_policies": policies})
            if fit is not None:
                rows[-1].update(limits_set=fit.limits, callers_fraction_back=fit.fraction == 1.0)
                fit.limits = 0
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
