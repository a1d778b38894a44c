"""The host store's pages, in one device command: its own mapped 2 MiB pages (runtime/pages.py)
against PyTorch's pinned allocator registering on 16 threads, alternating, each a fresh process
running a claim's first step (claims.py's one(): 12 GiB cap, 11.5 GiB budget). Pinning speed
varies with the host's state (its memory's fragmentation, what ran before), so only runs of
the same command compare.

    python benchmarks/pages_ab.py OUT_DIR [--claim resnet101:896] [--rounds 2] [--steps 1]
    (CUDA; writes OUT_DIR/pages_ab.json)
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(pages_kind: str, network: str, batch: int, steps: int) -> dict:
    sys.path.insert(0, HERE)
    from superneurons.runtime import pages
    pages.MAPPABLE = pages_kind == "mapped"
    from claims import one
    row = one(network, batch, None, steps)
    return {"pages": pages_kind, "plan_s": row.get("plan_s"), "error": row.get("error"),
            "max_rss_bytes": row.get("max_rss_bytes"),
            "steps": [{key: step[key] for key in ("seconds", "host_memory_seconds",
                                                   "peak_allocated_bytes", "budget_held")}
                      for step in row["steps"]]}


def main():
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))),
              flush=True)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--claim", default="resnet101:896")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    network, batch = args.claim.split(":")
    sys.path.insert(0, HERE)
    from common import write
    rows = []
    for round_index in range(args.rounds):
        for pages_kind in ("torch", "mapped"):
            done = subprocess.run([sys.executable, __file__, "--child", pages_kind, network,
                                   batch, str(args.steps)], capture_output=True, text=True,
                                  cwd=HERE)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"pages": pages_kind,
                                                       "error": done.stderr[-800:]}
            row["round"] = round_index
            rows.append(row)
            print(json.dumps(row), flush=True)
    write(os.path.join(args.out, "pages_ab.json"), {
        "command": " ".join(["python", "benchmarks/pages_ab.py"] + sys.argv[1:]),
        "network": network, "batch": int(batch), "results": rows})


if __name__ == "__main__":
    main()
