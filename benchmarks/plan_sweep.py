"""Plans of many models at budgets from below superneurons' floor to the liveness peak: what each
plan would move a step and replay, to compare two planners (run with each tree on PYTHONPATH).
Planner only, on the CPU: today's models (tests/today_models.py), a small U-Net, and the zoo on
the meta device.

    PYTHONPATH=TREE python benchmarks/plan_sweep.py OUT.json [--against OLD.json]

With --against, counts the (model, budget) pairs where this planner's plan moves less, or
moves as much with less replay work (better), the reverse (worse), or neither, and lists the
worse ones and any budget one planner fits and the other refuses.
"""

import argparse
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
# of the way from the floor to the liveness peak
SHARES = (-0.05, 0.0, 0.01, 0.03, 0.06, 0.1, 0.2, 0.35, 0.5, 0.75)
TODAY = ("unet", "nanogpt", "hf_gpt2", "hf_llama", "hf_bert_mlm", "hf_vit", "nanogpt_nobias",
         "nn_mha", "nn_encoder_layer", "nn_encoder_layer_norm_first", "timm_vit_tiny",
         "tv_vit_small", "tv_swin_t", "tv_resnet18", "tv_resnet50", "tv_densenet121",
         "tv_efficientnet_b0", "tv_mobilenet_v2", "tv_googlenet", "tv_inception_v3",
         "tv_squeezenet1_0", "tv_convnext_tiny", "tv_shufflenet_v2_x0_5", "timm_convnext_atto",
         "timm_efficientnet_b0", "tv_maxvit_t", "tv_regnet_x_400mf", "tv_mnasnet0_5")
ZOO = ("resnet50@16", "densenet121@8", "inception_v4@8", "vgg16@8", "alexnet@16",
       "resnet152@8", "densenet_cifar@16")


def _unet():
    import torch
    from torch import nn

    class UNet(nn.Module):
        """Three levels down and up, each level's output concatenated on the way up: long
        skips live across most of the route."""

        def __init__(self, c=8, depth=3):
            super().__init__()
            self.inc = nn.Conv2d(3, c, 3, padding=1)
            self.down = nn.ModuleList(nn.Sequential(
                nn.Conv2d(c * 2 ** i, c * 2 ** (i + 1), 3, padding=1), nn.ReLU(),
                nn.MaxPool2d(2)) for i in range(depth))
            self.up = nn.ModuleList(nn.Sequential(
                nn.Upsample(scale_factor=2), nn.Conv2d(c * 2 ** (i + 1), c * 2 ** i, 3,
                                                       padding=1), nn.ReLU())
                for i in reversed(range(depth)))
            self.mix = nn.ModuleList(nn.Conv2d(c * 2 ** (i + 1), c * 2 ** i, 3, padding=1)
                                     for i in reversed(range(depth)))
            self.out = nn.Conv2d(c, 2, 1)

        def forward(self, x):
            x = torch.relu(self.inc(x))
            skips = [x]
            for down in self.down:
                x = down(x)
                skips.append(x)
            skips.pop()
            for up, mix in zip(self.up, self.mix):
                x = torch.relu(mix(torch.cat([up(x), skips.pop()], 1)))
            return self.out(x)
    torch.manual_seed(0)
    return UNet(), (torch.randn(2, 3, 64, 64),), {}


def today_model(name: str) -> tuple:
    """(model, args, kwargs) of one of TODAY, built on the CPU."""
    import torch
    if name == "unet":
        return _unet()
    import today_models
    torch.manual_seed(0)
    model, args, kwargs, _ = today_models.cases()[name].build()
    return model, args, kwargs


def graph_of(name: str):
    import torch
    from superneurons.models import zoo
    from superneurons.planner.plan import captured_step
    if name in ZOO:
        network, batch = name.rsplit("@", 1)
        with torch.device("meta"):
            model = zoo.build(network)
        return captured_step(model, zoo.input_shape(network, int(batch)))
    model, args, kwargs = today_model(name)
    return captured_step(model, args, kwargs=kwargs, device_type="cpu")


def sweep(name: str) -> dict:
    from superneurons.planner import plan_graph
    from superneurons.planner.plan import BudgetError
    from superneurons.planner.trim import replay_work
    graph = graph_of(name)
    floor = plan_graph(graph, "superneurons").peak_bytes
    liveness = plan_graph(graph, "liveness").peak_bytes
    rows = {}
    for share in SHARES:
        budget = int(floor + (liveness - floor) * share)
        started = time.perf_counter()
        try:
            plan = plan_graph(graph, "superneurons", budget)
            rows[str(share)] = {"budget": budget, "peak": plan.peak_bytes,
                                "move": plan.bytes_to_move(budget), "work": replay_work(plan),
                                "segments": len(plan.segments)}
        except BudgetError as error:
            rows[str(share)] = {"budget": budget, "refused_needing": error.peak_bytes}
        rows[str(share)]["seconds"] = round(time.perf_counter() - started, 3)
    return {"floor": floor, "liveness": liveness, "budgets": rows}


def compare(new: dict, old: dict) -> dict:
    counts, worse, fit_changed = {"better": 0, "worse": 0, "same": 0}, [], []
    for name, model in new["models"].items():
        for share, now in model["budgets"].items():
            before = old["models"][name]["budgets"][share]
            if ("move" in now) != ("move" in before):
                fit_changed.append(f"{name} at {share}")
                continue
            if "move" not in now:
                continue
            key = (now["move"], now["work"])
            was = (before["move"], before["work"] * 1.001)
            if key > was:
                counts["worse"] += 1
                worse.append(f"{name} at {share}: moves {before['move']} -> {now['move']}, "
                             f"replay {before['work']:.3g} -> {now['work']:.3g} s")
            elif now["move"] < before["move"] or now["work"] < before["work"] * 0.999:
                counts["better"] += 1
            else:
                counts["same"] += 1
    return {**counts, "worse_cases": worse, "fit_changed": fit_changed}


def sweep_arguments():
    """OUT.json and --against OLD.json parsed; the benchmarks and tests folders importable
    (today_models), warnings off: this sweep's and plan_under_autocast.py's command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--against")
    args = parser.parse_args()
    sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
    warnings.filterwarnings("ignore")
    return args


def main():
    args = sweep_arguments()
    from common import environment, write
    record = {**environment(), "shares": SHARES, "models": {}}
    for name in TODAY + ZOO:
        record["models"][name] = sweep(name)
        print(name, flush=True)
    if args.against:
        with open(args.against) as f:
            record["against"] = {"record": os.path.basename(args.against),
                                 **compare(record, json.load(f))}
        print(json.dumps(record["against"], indent=1))
    write(args.out, record)


if __name__ == "__main__":
    main()
