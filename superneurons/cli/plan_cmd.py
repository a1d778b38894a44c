"""superneurons plan: every policy's predicted peak for a zoo network or a model of today
(torchvision:NAME, timm:NAME, hf:MODEL), without a GPU."""

import argparse
import warnings

import torch

from .. import models
from ..capture import capture
from ..planner import Policy, plan_graph
from ..planner.policy import CHECKPOINT_KINDS
from ..units import format_bytes, parse_bytes
from .output import plot_steps, print_table, write_json
from .today import is_named, settings

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
    parser.add_argument("--state", default="device", choices=["device", "host"],
                        help="plan with parameters, gradients and optimizer state on the "
                             "device, or in host memory, streamed layer by layer")


def add_model_arguments(parser) -> None:
    parser.add_argument("model", type=network,
                        help=f"a network of the paper ({', '.join(sorted(models.ZOO))}) or a "
                             "model of today: torchvision:NAME, timm:NAME, hf:MODEL (an HF "
                             "model type such as gpt2, or a configuration's directory)")
    parser.add_argument("--batch", type=positive, required=True)
    parser.add_argument("--image", type=positive,
                        help="image size in pixels (default: the usual)")
    parser.add_argument("--seq", type=positive,
                        help="tokens per sequence for hf:MODEL (default: up to 1024)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="a torchvision or timm builder's argument, or an HF "
                             "configuration's field (num_hidden_layers=4); repeatable")
    parser.add_argument("--depth", type=int, help="depth for 'resnet' and 'densenet'")
    parser.add_argument("--growth", type=int, help="growth rate for DenseNet")
    parser.add_argument("--efficient", action="store_true",
                        help="DenseNet's memory-efficient implementation (shared storage); "
                             "under a policy it is planned, and managed, as the plain one")


def network(text: str) -> str:
    """The model argument, read by the parser: a zoo name or SOURCE:NAME."""
    if text in models.ZOO or is_named(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a network of the paper ({', '.join(sorted(models.ZOO))}) nor "
        "torchvision:NAME, timm:NAME or hf:MODEL")


def options_refused(args) -> None:
    """A network of the paper takes --depth, --growth and --efficient; a model of today --seq
    and --set: each refuses the other's."""
    if is_named(args.model):
        given = [flag for flag, value in (("--depth", args.depth), ("--growth", args.growth),
                                          ("--efficient", args.efficient)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} "
                             f"to the paper's networks, not to "
                             f"{args.model}: drop them (--set sets its builder's arguments)")
    elif args.seq or args.set:
        raise ValueError("--seq and --set apply to torchvision:, timm: and hf: models, not to "
                         f"the paper's {args.model}: drop them (--depth and --growth shape "
                         "its networks)")


def positive(text: str) -> int:
    """A count read by the parser (--batch, --image, --seq, --steps): a whole number, 1 or
    more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, 1 or more: {text!r}")
    return value


def budget(text: str) -> int:
    """--budget as bytes, read by the parser: a bad size stops there, before a model is built."""
    try:
        return parse_bytes(text)
    except ValueError as error:   # argparse shows this message; a ValueError it would replace
        raise argparse.ArgumentTypeError(str(error)) from None


def build_meta(args):
    """(the model on the meta device, its positional inputs, its keyword inputs, the inputs
    as the summary says them): planning allocates nothing."""
    options_refused(args)
    if is_named(args.model):
        from .today import build
        named = build(args.model, args.batch, "meta", image=args.image, seq=args.seq,
                      options=settings(args.set))
        return named.model, named.args, named.kwargs, named.inputs
    with torch.device("meta"):
        model = models.build(args.model, depth=args.depth, growth=args.growth,
                             efficient=args.efficient)
    shape = models.input_shape(args.model, args.batch, args.image)
    return model, shape, None, f"input {shape}"


def run(args) -> None:
    model, example, kwargs, inputs = build_meta(args)
    graph = capture(model, example, ("cuda", torch.bfloat16) if args.bf16 else None, kwargs)
    with warnings.catch_warnings(record=True) as said:   # said once, below the table
        warnings.simplefilter("always")
        plans = {p: plan_graph(graph, p, strategy=args.strategy, state=args.state)
                 for p in POLICIES}
    any_plan = plans[Policy.SUPERNEURONS]
    # at a policy's floor every tensor it may offload goes to the host: what the host must hold
    rows = [[str(p), format_bytes(pl.peak_bytes),
             f"{pl.peak_bytes / plans[Policy.BASELINE].peak_bytes:.1%}",
             pl.num_extra_computations,
             format_bytes(pl.offloaded_bytes) if p.offloads else "-"] for p, pl in plans.items()]
    print_table(f"{args.model}, {inputs}{', bf16 autocast' if args.bf16 else ''}"
                f"{', state on the host' if args.state == 'host' else ''}: "
                f"{len(any_plan.order)} layers, resident "
                f"{format_bytes(any_plan.resident_bytes)}, l_peak "
                f"{format_bytes(any_plan.max_layer_bytes)} (resident + l_peak = "
                f"{format_bytes(any_plan.resident_bytes + any_plan.max_layer_bytes)})",
                ["policy", "predicted peak", "of baseline", "extra layer computations",
                 "to the host a step"], rows)
    chosen = None
    if args.budget:
        with warnings.catch_warnings(record=True) as said_within:
            warnings.simplefilter("always")
            chosen = plan_graph(graph, Policy.AUTO, args.budget, args.strategy, args.state)
        said += said_within
        blocks = sum(1 for s in chosen.segments
                     if any(graph.layers[l].kind in CHECKPOINT_KINDS for l in s.layers))
        moved = chosen.bytes_to_move()
        print(f"within {format_bytes(chosen.budget_bytes)}: policy {chosen.policy}, "
              f"{chosen.num_extra_computations} layers replayed ({blocks} replays of whole, cut "
              f"or merged blocks), "
              + (f"the cache moves about {format_bytes(moved)} a step to the host and back"
                 if moved else "nothing moved"))
    for message in dict.fromkeys(str(w.message) for w in said):
        print(f"note: {message}")
    if args.explain:
        print((chosen or any_plan).explain())
    if args.json:
        write_json(args.json, {
            "model": args.model, "inputs": inputs, "strategy": args.strategy,
            "state": args.state,
            **({} if is_named(args.model) else {"input_shape": list(example)}),
            "num_layers": len(any_plan.order), "resident_bytes": any_plan.resident_bytes,
            "max_layer_bytes": any_plan.max_layer_bytes, "route": any_plan.route,
            "extra_computations": {str(k): v for k, v in any_plan.extra_computations.items()},
            "policies": {str(p): pl.to_dict() for p, pl in plans.items()}})
    if args.plot:
        plot_steps(args.plot, f"{args.model}, batch {args.batch}: predicted memory per step",
                   {str(p): [s.live_bytes for s in pl.steps] for p, pl in plans.items()},
                   len(any_plan.order))
