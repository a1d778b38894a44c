"""Tiny modules, each exercising one construct the runtime must keep exact or refuse.

Same contract as today_models.py: ``build()`` -> (model, args, kwargs, loss_fn). A model whose
root has a ``side_effects`` dict (Python state its forward changes) has that dict compared too:
a replayed forward must not run a hook twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from today_models import NUM_CLASSES, Case, _generator, classification_loss

BATCH = 4
FEATURES = 16


def _batch(features=FEATURES):
    g = _generator()
    x = torch.randn(BATCH, features, generator=g)
    y = torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)
    return x, y


def _image_batch(size=8):
    g = _generator()
    x = torch.randn(BATCH, 3, size, size, generator=g)
    y = torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)
    return x, y


def _simple(model, x, y):
    return model.train(), (x,), {}, classification_loss(y)


class RandLike(nn.Module):
    """torch.rand_like in forward: a hand-written dropout mask."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(FEATURES, 32), nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        keep = (torch.rand_like(h) > 0.3).to(h.dtype)
        return self.fc2(h * keep / 0.7)


class NoGradBranch(nn.Module):
    """A frozen branch computed under torch.no_grad() in forward: its weights get no gradient."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh())
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU())
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        with torch.no_grad():
            prior = self.frozen(x)
        return self.head(self.body(x) * prior)


class AutocastDisabledRegion(nn.Module):
    """bf16 autocast over the body, with a torch.autocast('cpu', enabled=False) region (a
    float32 normalisation) inside it, as mixed-precision models keep their sensitive parts."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.fc1(x))
            with torch.autocast("cpu", enabled=False):
                h = self.norm(h.float())
            out = self.fc2(h)
        return out.float()


class AutocastDisabledOnly(nn.Module):
    """torch.autocast('cpu', enabled=False) inside forward with no autocast around it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(FEATURES, 32), nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            h = torch.relu(self.fc1(x))
        return self.fc2(h)


class AutocastBF16Region(nn.Module):
    """A bf16 autocast region inside forward on the CPU; the rest in float32."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.fc2(h))
        return self.fc3(h.float())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class HookedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEATURES, 32)
        self.block = _Block()                    # a module with children
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        return self.head(torch.relu(self.block(torch.relu(self.stem(x)))))


def build_hook_changes_output():
    """A forward hook on a module with children whose return value replaces the output."""
    model = HookedNet()
    model.block.register_forward_hook(lambda module, args, out: out * 0.5 + args[0])
    return _simple(model, *_batch())


def build_hook_side_effect():
    """A forward hook that counts its calls (Python state, not tensors): one per step."""
    model = HookedNet()
    model.side_effects = {"block_forward_calls": 0, "stem_pre_calls": 0}

    def count(module, args, out):
        model.side_effects["block_forward_calls"] += 1

    def count_pre(module, args):
        model.side_effects["stem_pre_calls"] += 1

    model.block.register_forward_hook(count)
    model.stem.register_forward_pre_hook(count_pre)
    return _simple(model, *_batch())


class SpectralNormNet(nn.Module):
    """torch.nn.utils.parametrizations.spectral_norm on a Conv2d and a Linear: each training
    forward runs a power iteration that updates the u (and v) buffers in place."""

    def __init__(self):
        super().__init__()
        sn = torch.nn.utils.parametrizations.spectral_norm
        self.conv = sn(nn.Conv2d(3, 8, 3, padding=1))
        self.fc = sn(nn.Linear(8 * 8 * 8, 32))
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.head(torch.relu(self.fc(h)))


class SharedTwice(nn.Module):
    """One Linear applied twice (its weight used by two layers)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEATURES, 32)
        self.shared = nn.Linear(32, 32)
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = torch.relu(self.shared(h))
        h = torch.relu(self.shared(h)) + h
        return self.head(h)


class InPlaceOnSaved(nn.Module):
    """x.mul_(2) on a tensor an earlier op saved for backward (exp saves its result): plain
    PyTorch raises in backward ("modified by an inplace operation")."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(FEATURES, 32), nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        h = torch.exp(self.fc1(x) * 0.1)     # exp saves its output for its backward
        h.mul_(2)                            # ...which this overwrites
        return self.fc2(h)


class StochasticDepthNet(nn.Module):
    """Residual blocks behind torchvision.ops.StochasticDepth (row mode: per-sample drops)."""

    def __init__(self):
        super().__init__()
        from torchvision.ops import StochasticDepth

        self.stem = nn.Linear(FEATURES, 32)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.drops = nn.ModuleList(StochasticDepth(0.5, "row") for _ in range(3))
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        h = self.stem(x)
        for block, drop in zip(self.blocks, self.drops):
            h = h + drop(block(torch.relu(h)))
        return self.head(h)


class SharedBatchNorm(nn.Module):
    """One BatchNorm1d (one block holding it) applied at two places: its running statistics
    are updated twice a step."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, 32)
        self.norm = nn.Sequential(nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        h = self.norm(self.fc1(x))
        h = self.norm(self.fc2(h))
        return self.head(h)


class KwargsDict(nn.Module):
    """forward(x, scale=2.0, mask=None) -> {'logits': ..., 'features': ...}."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(FEATURES, 32), nn.Linear(32, NUM_CLASSES)

    def forward(self, x, scale=2.0, mask=None):
        h = torch.relu(self.fc1(x)) * scale
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return {"logits": self.fc2(h), "features": h}


def build_kwargs_dict():
    model = KwargsDict()
    x, y = _batch()
    mask = torch.zeros(BATCH, 32, dtype=torch.bool)
    mask[:, ::3] = True

    def loss_fn(out):
        return F.cross_entropy(out["logits"], y) + 1e-3 * out["features"].pow(2).mean()

    return model.train(), (x,), dict(scale=0.5, mask=mask), loss_fn


class ShiftedNorm(nn.BatchNorm2d):
    """A batch norm whose output reads its running mean, which its forward writes first."""

    def forward(self, x):
        out = super().forward(x)
        return out + self.running_mean.view(1, -1, 1, 1)


class BatchNormKinds(nn.Module):
    """Batch norms a replay must leave as the forward left them: in training (one called twice
    in a row, one without running statistics), frozen in eval mode, and a subclass whose
    output reads the running statistics it writes."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.frozen = nn.BatchNorm2d(8)
        self.untracked = nn.BatchNorm2d(8, track_running_stats=False)
        self.shifted = ShiftedNorm(8)
        self.head = nn.Linear(8, NUM_CLASSES)
        with torch.no_grad():
            self.frozen.running_mean.uniform_(-1, 1)
            self.frozen.running_var.uniform_(0.5, 2)

    def train(self, mode: bool = True):
        super().train(mode)
        self.frozen.eval()
        return self

    def forward(self, x):
        h = torch.relu(self.norm(self.norm(self.conv1(x))))
        h = self.shifted(torch.relu(self.untracked(self.frozen(self.conv2(h)))))
        return self.head(torch.tanh(h).mean((2, 3)))


def build_batchnorm_leaves():
    """BatchNormKinds' norms in training as leaf modules (an nn.Sequential, captured by fx
    rather than exported): one called twice in a row, one untracked, the subclass."""
    norm = nn.BatchNorm2d(8)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm, norm, ShiftedNorm(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1),
                          nn.BatchNorm2d(8, track_running_stats=False), nn.Tanh(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, NUM_CLASSES))
    return _simple(model, *_image_batch())


def _plain(cls, batch=_batch):
    def build():
        return _simple(cls(), *batch())

    build.__name__ = f"build_{cls.__name__}"
    return build


def cases() -> dict[str, Case]:
    def case(name, build, note, **options):
        return (f"c_{name}", Case(f"c_{name}", build, "construct", default=True, note=note,
                                  **options))

    return dict([
        case("rand_like", _plain(RandLike), "torch.rand_like in forward"),
        case("no_grad_branch", _plain(NoGradBranch),
             "with torch.no_grad(): a frozen branch (no gradient for its weights)"),
        case("autocast_disabled_region", _plain(AutocastDisabledRegion),
             "bf16 autocast in forward with an autocast(enabled=False) region inside"),
        case("autocast_disabled_only", _plain(AutocastDisabledOnly),
             "autocast('cpu', enabled=False) in forward, no autocast around it"),
        case("autocast_bf16_region", _plain(AutocastBF16Region),
             "autocast('cpu', bfloat16) region inside forward"),
        case("hook_changes_output", build_hook_changes_output,
             "forward hook on a module with children replaces its output"),
        case("hook_side_effect", build_hook_side_effect,
             "forward and pre-forward hooks counting calls (Python side effect)"),
        case("spectral_norm", _plain(SpectralNormNet, _image_batch),
             "parametrizations.spectral_norm on Conv2d and Linear (u, v updated in forward)"),
        case("shared_twice", _plain(SharedTwice), "one Linear called twice"),
        case("inplace_on_saved", _plain(InPlaceOnSaved),
             "x.mul_(2) on a tensor saved for backward: plain PyTorch raises in backward",
             plain_raises=RuntimeError),
        case("stochastic_depth", _plain(StochasticDepthNet),
             "torchvision.ops.StochasticDepth(0.5, 'row') on residual blocks",
             requires=("torchvision",)),
        case("shared_batchnorm", _plain(SharedBatchNorm),
             "one BatchNorm1d block applied twice (running stats updated twice)"),
        case("batchnorm_kinds", _plain(BatchNormKinds, _image_batch),
             "batch norms in training (one twice in a row), in eval, untracked, and a subclass "
             "reading its running mean"),
        case("batchnorm_leaves", build_batchnorm_leaves,
             "batchnorm_kinds' norms in training as leaf modules of an nn.Sequential"),
        case("kwargs_dict", build_kwargs_dict,
             "forward(x, scale=2.0, mask=None) called with kwargs, returns a dict"),
    ])


CONSTRUCTS = cases()
