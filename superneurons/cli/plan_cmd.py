"""superneurons plan: every policy's predicted peak for a zoo network, without a GPU."""

import argparse

import torch

from .. import models
from ..capture import capture
from ..planner import Policy, plan_graph
from ..planner.policy import CHECKPOINT_KINDS
from ..units import format_bytes, parse_bytes
from .output import plot_steps, print_table, write_json

POLICIES = [p for p in Policy if p is not Policy.AUTO]


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--strategy", default="cost-aware",
                        help="recomputation: speed-centric, memory-centric or cost-aware")
    parser.add_argument("--json", help="write every policy's per-step memory here")
    parser.add_argument("--plot", help="write a PNG of memory per step for every policy here")
    parser.add_argument("--explain", action="store_true",
                        help="print the superneurons plan (with --budget: the plan auto picks)")
    parser.add_argument("--budget", type=budget,
                        help="also plan within this budget (e.g. 11.5GiB): the policy auto picks, "
                             "its replays and the bytes it moves")
    parser.add_argument("--bf16", action="store_true",
                        help="a step under torch.autocast('cuda', dtype=torch.bfloat16)")


def add_model_arguments(parser) -> None:
    parser.add_argument("model", choices=sorted(models.ZOO), help="a network of the paper")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--image", type=int, help="image size in pixels (default: the usual)")
    parser.add_argument("--depth", type=int, help="depth for 'resnet' and 'densenet'")
    parser.add_argument("--growth", type=int, help="growth rate for DenseNet")
    parser.add_argument("--efficient", action="store_true",
                        help="DenseNet's memory-efficient implementation (shared storage); "
                             "under a policy it is planned, and managed, as the plain one")


def budget(text: str) -> int:
    """--budget as bytes, read by the parser: a bad size stops there, before a model is built."""
    try:
        return parse_bytes(text)
    except ValueError as error:   # argparse shows this message; a ValueError it would replace
        raise argparse.ArgumentTypeError(str(error)) from None


def build_meta(args):
    """The zoo network on the meta device: planning allocates nothing."""
    with torch.device("meta"):
        model = models.build(args.model, depth=args.depth, growth=args.growth,
                             efficient=args.efficient)
    return model, models.input_shape(args.model, args.batch, args.image)


def run(args) -> None:
    model, shape = build_meta(args)
    graph = capture(model, shape, ("cuda", torch.bfloat16) if args.bf16 else None)
    plans = {p: plan_graph(graph, p, strategy=args.strategy) for p in POLICIES}
    any_plan = plans[Policy.SUPERNEURONS]
    # at a policy's floor every tensor it may offload goes to the host: what the host must hold
    rows = [[str(p), format_bytes(pl.peak_bytes),
             f"{pl.peak_bytes / plans[Policy.BASELINE].peak_bytes:.1%}",
             pl.num_extra_computations,
             format_bytes(pl.offloaded_bytes) if p.offloads else "-"] for p, pl in plans.items()]
    print_table(f"{args.model}, input {shape}{', bf16 autocast' if args.bf16 else ''}: "
                f"{len(any_plan.order)} layers, resident "
                f"{format_bytes(any_plan.resident_bytes)}, l_peak "
                f"{format_bytes(any_plan.max_layer_bytes)} (resident + l_peak = "
                f"{format_bytes(any_plan.resident_bytes + any_plan.max_layer_bytes)})",
                ["policy", "predicted peak", "of baseline", "extra layer computations",
                 "to the host a step"], rows)
    chosen = None
    if args.budget:
        chosen = plan_graph(graph, Policy.AUTO, args.budget, args.strategy)
        blocks = sum(1 for s in chosen.segments
                     if any(graph.layers[l].kind in CHECKPOINT_KINDS for l in s.layers))
        moved = chosen.bytes_to_move()
        print(f"within {format_bytes(chosen.budget_bytes)}: policy {chosen.policy}, "
              f"{chosen.num_extra_computations} layers replayed ({blocks} replays of whole, cut "
              f"or merged blocks), "
              + (f"the cache moves about {format_bytes(moved)} a step to the host and back"
                 if moved else "nothing moved"))
    if args.explain:
        print((chosen or any_plan).explain())
    if args.json:
        write_json(args.json, {
            "model": args.model, "input_shape": list(shape), "strategy": args.strategy,
            "num_layers": len(any_plan.order), "resident_bytes": any_plan.resident_bytes,
            "max_layer_bytes": any_plan.max_layer_bytes, "route": any_plan.route,
            "extra_computations": {str(k): v for k, v in any_plan.extra_computations.items()},
            "policies": {str(p): pl.to_dict() for p, pl in plans.items()}})
    if args.plot:
        plot_steps(args.plot, f"{args.model}, batch {args.batch}: predicted memory per step",
                   {str(p): [s.live_bytes for s in pl.steps] for p, pl in plans.items()},
                   len(any_plan.order))
