"""The default job: plan ResNet-50 for a GPU, then train a small network on this machine under
its tightest budget and check every number against plain PyTorch."""

import copy

import torch
import torch.nn.functional as F

from .. import models, plan, wrap
from ..units import format_bytes
from .output import print_table
from .progress import Progress


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=3)


def run(args) -> None:
    with Progress() as progress:          # capture, planning and steps, on stderr
        _run(args, progress)


def _run(args, progress: Progress) -> None:
    progress.say("planning ResNet-50 at batch 64 under five policies, on the meta device")
    with torch.device("meta"):
        resnet50 = models.resnet(50)
    rows = []
    for policy in ("baseline", "liveness", "offload", "recompute", "superneurons"):
        p = plan(resnet50, (64, 3, 224, 224), policy=policy)
        rows.append([policy, format_bytes(p.peak_bytes)])
    print_table(f"ResNet-50, batch 64, predicted peak (l_peak {format_bytes(p.max_layer_bytes)}, "
                f"resident {format_bytes(p.resident_bytes)})", ["policy", "peak"], rows)

    torch.manual_seed(0)
    model = models.resnet(blocks=(2, 2, 2, 2), num_classes=10)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    rows = []
    policies = ("offload", "recompute", "superneurons")
    progress.say(f"training a small ResNet for {args.steps} steps, plainly and under "
                 f"{', '.join(policies)}")
    progress.steps((1 + len(policies)) * args.steps)
    plain = copy.deepcopy(model)
    reference = _train(plain, x, y, args.steps, progress, "plain")
    for policy in policies:
        managed = copy.deepcopy(model)
        wrapped = wrap(managed, policy=policy)
        losses = _train(wrapped, x, y, args.steps, progress, policy)
        same = losses == reference and all(
            torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                              managed.state_dict().values()))
        stats = wrapped.stats
        rows.append([policy, format_bytes(stats.predicted_peak_bytes),
                     format_bytes(stats.peak_bytes), format_bytes(stats.offloaded_bytes),
                     stats.recomputed_layers, "yes" if same else "NO"])
    progress.finish()                     # the bar ends before the table
    print_table(f"ResNet-18-style bottleneck net on {x.device}, batch 8, {args.steps} SGD steps "
                "at each policy's tightest budget", ["policy", "predicted peak",
                                                     "accounted peak", "offloaded",
                                                     "layers recomputed",
                                                     "same as PyTorch"], rows)
    if any(row[-1] != "yes" for row in rows):
        raise SystemExit("a policy diverged from plain PyTorch: please report this")


def _train(model, x, y, steps: int, progress: Progress, name: str) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        progress.step(run=name, loss=f"{losses[-1]:.3f}")
    return losses
