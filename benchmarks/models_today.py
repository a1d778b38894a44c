"""Models people train today under every policy: exact, refused (with the reason) or FAILED.

    python benchmarks/models_today.py [--cases NAME ...] [--policies P ...] [--default-only]
                                      [--skip-slow] [--steps 3] [--out PATH] [--markdown REC]

Runs tests/matrix.py's comparison (the same one tests/test_models_today.py asserts) for every
case of tests/today_models.py and tests/today_constructs.py, outside pytest, on the CPU: each
model trained plainly and wrapped at the forcing budget, from the same seeds. Prints a table
(model, the outcome per policy, the reason of the first that is not exact) and writes the
records to benchmarks/results/models_today.json (command, versions, one record per model and
policy, timings; a selection's to models_today_partial.json); the README's table is generated
from that file:

    python benchmarks/models_today.py --markdown benchmarks/results/models_today.json
"""

import argparse
import importlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

import matrix  # noqa: E402
from common import write  # noqa: E402
from today_constructs import CONSTRUCTS  # noqa: E402
from today_models import MODELS  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "models_today.json")
PARTIAL_OUT = os.path.join(HERE, "results", "models_today_partial.json")   # a selection's
SHORT = {"exact": "exact", "refused": "refused", "FAILED": "FAILED", "skipped": "skipped"}


def versions() -> dict:
    out = {}
    for name in ("torchvision", "transformers", "timm"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    return out


def select(args) -> dict:
    cases = {**MODELS, **CONSTRUCTS}
    if args.cases:      # a case's exact name selects it alone, anything else as a substring
        exact = [s for s in args.cases if s in cases]
        parts = [s for s in args.cases if s not in cases]
        cases = {n: c for n, c in cases.items() if n in exact or any(s in n for s in parts)}
    if args.default_only:
        cases = {n: c for n, c in cases.items() if c.default}
    if args.skip_slow:
        cases = {n: c for n, c in cases.items() if not c.slow}
    return cases


def reason_of(outcomes) -> str:
    """The reason of the first policy that is not exact, and how many others differ."""
    reasons = [o.reason for o in outcomes if o.status not in ("exact",) and o.reason]
    if not reasons:
        return ""
    others = len(set(reasons)) - 1
    return reasons[0] + (f" (+{others} other reason{'s' * (others > 1)})" if others else "")


def table(rows, policies, width=110):
    """rows: (case, group, [Outcome per policy])."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        style = {"exact": "green", "refused": "yellow", "FAILED": "bold red", "skipped": "dim"}
        t = Table(title="models today: plain PyTorch against superneurons.wrap")
        t.add_column("model")
        t.add_column("group")
        for p in policies:
            t.add_column(p)
        t.add_column("reason", overflow="fold", max_width=width)
        for case, group, outcomes in rows:
            t.add_row(case, group, *[f"[{style[o.status]}]{SHORT[o.status]}[/]" for o in outcomes],
                      reason_of(outcomes))
        Console(width=max(160, width + 60)).print(t)
        return
    head = f"{'model':34s} {'group':12s} " + " ".join(f"{p:12s}" for p in policies) + " reason"
    print(head)
    print("-" * len(head))
    for case, group, outcomes in rows:
        print(f"{case:34s} {group:12s} " + " ".join(f"{SHORT[o.status]:12s}" for o in outcomes)
              + " " + reason_of(outcomes)[:width])


def markdown(paths: list) -> str:
    """The README's table from records written by this script (several: one table)."""
    import json

    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    record = records[0]
    policies = record["policies"]
    by_case = {}
    for r in (r for each in records for r in each["results"]):
        by_case.setdefault(r["case"], {"group": r["group"], "runs": {}})["runs"][r["policy"]] = r
    cell = {"exact": "exact", "refused": "refused", "FAILED": "**FAILED**", "skipped": "skipped"}
    lines = [f"| model | group | {' | '.join(policies)} | reason |",
             "|" + "---|" * (len(policies) + 3)]
    for case, entry in by_case.items():
        runs = [entry["runs"].get(p) for p in policies]
        outcomes = [matrix.Outcome(case, p, r["status"], r["reason"]) for p, r in
                    zip(policies, runs) if r]
        reason = reason_of(outcomes)[:200].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {case} | {entry['group']} | "
                     + " | ".join(cell[r["status"]] if r else "" for r in runs)
                     + f" | {reason} |")
    versions_line = ", ".join(f"{k} {record.get(k)}" for k in
                              ("torch", "torchvision", "transformers", "timm"))
    commands = "; ".join(each["command"] for each in records)
    return "\n".join(lines) + f"\n\n({commands}; {versions_line})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*",
                        help="case names, or substrings of them (default: every case)")
    parser.add_argument("--policies", nargs="*", default=list(matrix.POLICIES))
    parser.add_argument("--default-only", action="store_true",
                        help="only the subset every test run covers")
    parser.add_argument("--skip-slow", action="store_true",
                        help="leave out the cases marked slow (big networks, 224+ inputs)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help=f"the record (default {os.path.relpath(DEFAULT_OUT)}; "
                        f"a selection's: {os.path.relpath(PARTIAL_OUT)})")
    parser.add_argument("--quiet", action="store_true", help="no line per run while running")
    parser.add_argument("--markdown", metavar="RECORD", nargs="+",
                        help="print the records' table in Markdown (for the README) and run "
                             "nothing")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0

    cases = select(args)
    whole = not (args.cases or args.default_only or args.skip_slow) and \
        list(args.policies) == list(matrix.POLICIES) and args.steps == 3
    out = args.out or (DEFAULT_OUT if whole else PARTIAL_OUT)
    rows, records = [], []
    start = time.perf_counter()
    for name, case in cases.items():
        missing = case.missing()
        outcomes = []
        for policy in args.policies:
            if missing:
                outcome = matrix.Outcome(name, policy, "skipped", f"needs {', '.join(missing)}")
            else:
                outcome = matrix.run(case, policy, steps=args.steps)
                expected = matrix.expected_refusal(name, policy)
                if outcome.status == "refused" and expected:
                    outcome.notes.append(f"expected refusal: {expected}")
                elif outcome.status == "refused":
                    outcome.notes.append("refusal not listed in matrix.EXPECTED_REFUSALS")
            outcomes.append(outcome)
            records.append({**outcome.record(), "group": case.group, "default": case.default,
                            "slow": case.slow, "note": case.note})
            if not args.quiet:
                print(f"{name:34s} {policy:13s} {str(outcome)[:150]}  "
                      f"(plain {outcome.plain_s:.1f}s, plan {outcome.plan_s:.1f}s, "
                      f"wrapped {outcome.wrapped_s:.1f}s)", flush=True)
        rows.append((name, case.group, outcomes))
        _write(out, args, records, start, complete=False)     # a stopped run keeps its cases

    table(rows, args.policies)
    counts = _write(out, args, records, start, complete=True)
    print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
          f"in {time.perf_counter() - start:.0f} s")
    return 0 if not counts.get("FAILED") else 1


def _write(out: str, args, records: list, start: float, complete: bool) -> dict:
    counts = {}
    for record in records:
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    write(out, {**versions(), "threads": torch.get_num_threads(), "steps": args.steps,
                "policies": args.policies, "summary": counts, "complete": complete,
                "seconds": round(time.perf_counter() - start, 1), "results": records},
          quiet=True)
    return counts


if __name__ == "__main__":
    sys.exit(main())
