"""Entry point: a thin parser that calls into the library."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="superneurons", description="Train deep networks beyond GPU memory (SuperNeurons).")
    commands = parser.add_subparsers(dest="command")
    from . import plan_cmd
    plan_cmd.add_arguments(commands.add_parser("plan", help="predict memory for every policy"))
    try:
        from . import train_cmd
        train_cmd.add_arguments(commands.add_parser("train", help="train a zoo network"))
        from . import demo_cmd
        demo_cmd.add_arguments(commands.add_parser("demo", help="the default job (CPU is fine)"))
    except ImportError:
        train_cmd = demo_cmd = None
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:
        if demo_cmd is None:
            parser.print_help()
            return 0
        args = parser.parse_args(["demo", *argv])
    module = {"plan": plan_cmd, "train": train_cmd, "demo": demo_cmd}[args.command]
    try:
        module.run(args)
    except ValueError as error:
        print(f"superneurons: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
