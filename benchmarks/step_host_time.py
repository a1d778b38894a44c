"""Host time the executor adds to a training step, per layer, where kernels cost almost nothing:
a ResNet-50-shaped network 16 times narrower (the same 227 layers), batch 4 of 16 px, on the
CPU with one thread. Where a layer's kernels take less than this host time, the device waits
for it, so it is device time there too.

Plain PyTorch and the wrapped model alternate, ROUNDS rounds of STEPS SGD steps each, after
warm-up steps; the record keeps every round's mean step and the median difference per layer,
for superneurons at a budget near the liveness plan's peak (managed, acting little) and at its
floor (replaying and moving all it can), and for recompute at its floor. With --profile it adds
where the managed step spends its host time (cProfile, superneurons' own functions by their
own time).

    python benchmarks/step_host_time.py OUT_DIR [--tag NAME] [--profile]
        [--network resnet|densenet|gpt2] [--bf16]
        (CPU; writes OUT_DIR/step_host_time[_NAME].json)
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROUNDS, STEPS, WARMUP = 7, 10, 3
WIDTHS = (4, 8, 16, 32)            # ResNet-50's (64, 128, 256, 512), 16 times narrower
BLOCKS = (3, 4, 6, 3)


class Bottleneck(nn.Module):
    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(in_channels, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, 4 * width, 1, bias=False)
        self.bn3, self.relu = nn.BatchNorm2d(4 * width), nn.ReLU(inplace=True)
        self.downsample = None if stride == 1 and in_channels == 4 * width else nn.Sequential(
            nn.Conv2d(in_channels, 4 * width, 1, stride, bias=False), nn.BatchNorm2d(4 * width))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


def narrow_resnet50() -> nn.Module:
    layers, channels = [nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                        nn.ReLU(inplace=True)], 4
    for stage, (blocks, width) in enumerate(zip(BLOCKS, WIDTHS)):
        for index in range(blocks):
            layers.append(Bottleneck(channels, width, 2 if index == 0 and stage else 1))
            channels = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def tiny_gpt2() -> nn.Module:
    """GPT-2 small's graph (12 blocks, the same operations) at width 32, 2 heads, 64
    positions and a vocabulary of 128: its layers cost the host what GPT-2 small's do."""
    from common import gpt2
    return gpt2(layers=12, width=32, heads=2, positions=64, vocab=128)


def narrow_densenet121() -> nn.Module:
    """torchvision's DenseNet-121 graph (its 121 layers, concatenations and transitions) at a
    growth rate of 4 from 8 channels: its layers cost the host what DenseNet-121's do."""
    from torchvision.models.densenet import DenseNet
    return DenseNet(growth_rate=4, block_config=(6, 12, 24, 16), num_init_features=8,
                    bn_size=2, num_classes=10)


NETWORKS = {  # name: (the model, its batch, its loss from the model and the batch)
    "resnet": (narrow_resnet50, lambda: (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))),
               lambda model, x, y: F.cross_entropy(model(x), y)),
    "densenet": (narrow_densenet121,
                 lambda: (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))),
                 lambda model, x, y: F.cross_entropy(model(x), y)),
    "gpt2": (tiny_gpt2, lambda: (torch.randint(0, 128, (2, 64)),) * 2,
             lambda model, x, y: model(input_ids=x, labels=y, use_cache=False).loss),
}


def trainer(model, x, y, loss_of, autocast):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def steps(count: int) -> float:
        """Mean seconds of ``count`` steps."""
        began = time.perf_counter()
        for _ in range(count):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=autocast or torch.float32,
                                enabled=autocast is not None):
                loss = loss_of(model, x, y)
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - began) / count
    return steps


def measure(network: str, policy: str, toward_liveness: float, profile: bool,
            autocast=None) -> dict:
    import superneurons as sn
    build, batch, loss_of = NETWORKS[network]
    x, y = batch()
    example, kwargs = (x, None) if network != "gpt2" else \
        ((), {"input_ids": x, "labels": y, "use_cache": False})
    torch.manual_seed(0)
    plain = trainer(build().train(), x, y, loss_of, autocast)
    model = build().train()

    def peak(planned_policy: str) -> int:
        return sn.plan(model, example, policy=planned_policy, autocast=autocast,
                       device_type="cpu", kwargs=kwargs).peak_bytes
    liveness, floor = peak("liveness"), peak(policy)
    budget = int(floor + toward_liveness * (liveness - floor))
    wrapped = sn.wrap(model, policy=policy, budget=budget)
    managed = trainer(wrapped, x, y, loss_of, autocast)
    plain(WARMUP), managed(WARMUP)
    rounds = [(plain(STEPS), managed(STEPS)) for _ in range(ROUNDS)]
    executor = wrapped._last[1]
    layers = executor.num_layers
    row = {"network": network, "autocast": str(autocast), "policy": policy,
           "budget_toward_liveness": toward_liveness, "budget_bytes": budget,
           "layers": layers, "recomputed_layers": executor.recomputed_layers,
           "offloaded_bytes": executor.pool.offloaded_bytes,
           "rounds_plain_ms": [p * 1e3 for p, _ in rounds],
           "rounds_wrapped_ms": [w * 1e3 for _, w in rounds],
           "median_added_us_per_layer": statistics.median(
               (w - p) / layers * 1e6 for p, w in rounds)}
    if profile:
        row["profile"] = where(managed)
    return row


def where(steps) -> list:
    """superneurons' own functions by their own host time in a step, under cProfile (which
    slows every call, so these are shares, not times)."""
    profiler = cProfile.Profile()
    profiler.enable()
    steps(STEPS)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    own = [(total, calls, f"{file.split('superneurons/')[-1]}:{line} {name}")
           for (file, line, name), (_, calls, total, _, _) in stats.items()
           if "superneurons/" in file]
    everything = sum(total for _, _, total, _, _ in stats.values())
    own.sort(reverse=True)
    return [{"function": name, "calls_per_step": calls // STEPS,
             "share_of_step": total / everything} for total, calls, name in own[:15]]


def main():
    from common import environment, write
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tag", default="")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--network", choices=sorted(NETWORKS), default="resnet")
    parser.add_argument("--bf16", action="store_true", help="under CPU bf16 autocast")
    args = parser.parse_args()
    torch.set_num_threads(1)
    autocast = torch.bfloat16 if args.bf16 else None
    rows = [measure(args.network, policy, toward, args.profile and index == 0, autocast)
            for index, (policy, toward) in enumerate(
                (("superneurons", 0.98), ("superneurons", 0.0), ("recompute", 0.0)))]
    name = "step_host_time" + (f"_{args.tag}" if args.tag else "") + ".json"
    write(os.path.join(args.out, name), {
        "command": " ".join(["python", "benchmarks/step_host_time.py"] + sys.argv[1:]),
        "environment": environment(), "cpu_count": os.cpu_count(),
        "network": {"resnet": "ResNet-50 shape, 16x narrower; batch 4, 16 px",
                    "densenet": "DenseNet-121 graph, growth 4 from 8 channels; batch 2, "
                                "32 px",
                    "gpt2": "GPT-2 small's 12 blocks at width 32, 2 heads; batch 2 of 64 "
                            "tokens, labels given"}[args.network] + "; one thread",
        "rounds": ROUNDS, "steps_per_round": STEPS, "rows": rows})


if __name__ == "__main__":
    main()
