"""What holds a plan's peak: for rows of stored ratio records, each in the room its wrapper had
at its last step (ratio.graph_in_record_room), the plan the planner chooses there and the plan
replaying every block's convolutions alone (policy Rule 8, the family with the fewest
normalizations replayed), each with its peak as kept on the device, the limit a plan that moves
nothing must stay under (PLANNED_SHARE of the room), the step of its peak and the largest
storages live there. Planner only, on the CPU, at the H200's default rates.

    PYTHONPATH=.:benchmarks python benchmarks/plan_peak.py OUT.json RECORD:RATIO [...] [--top N]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def live_at_peak(plan, top: int) -> dict:
    """The plan's kept peak (every checkpoint on the device), its step, and the ``top`` largest
    storages live then: a pool buffer over its whole life, others only where the plan has them
    (a replayed one from its replay on)."""
    kept = plan._kept_live
    peak = max(kept)
    at = kept.index(peak)
    live = [b for b in plan.buffers if ((b.intervals[0][0] <= at <= b.intervals[-1][1])
                                        if b.managed else b.live_at(at))]
    live.sort(key=lambda b: -b.nbytes)
    return {"kept_peak_bytes": peak, "peak_step": at, "steps": len(kept),
            "resident_bytes": plan.resident_bytes, "live_storages": len(live),
            "largest": [{"label": b.label, "bytes": b.nbytes} for b in live[:top]]}


def convolutions_alone(graph, room: int):
    """The plan replaying every block's CONV, FC and ATTN layers alone, the rest kept."""
    from superneurons.planner import H200
    from superneurons.planner.plan import _build, build_route, build_timeline, layer_costs
    from superneurons.planner.policy import (CHECKPOINT_KINDS, Policy, Strategy,
                                             find_segments, route_cuts)
    order = build_route(graph)
    costs = layer_costs(graph, H200)
    keep = route_cuts(graph, order, ambient=False) | {
        layer for layer in order if graph.layers[layer].kind not in CHECKPOINT_KINDS}
    segments = find_segments(graph, order, Strategy.COST_AWARE, costs, keep=keep)
    return _build(graph, order, build_timeline(graph, order), costs, Policy.SUPERNEURONS,
                  Strategy.COST_AWARE, room, segments, "device")


def row(record_path: str, ratio: float, top: int) -> dict:
    from superneurons.planner import H200, plan_graph
    from superneurons.planner.trim import PLANNED_SHARE, replay_work
    from ratio import graph_in_record_room
    record, graph, room = graph_in_record_room(record_path, ratio)
    plans = {"chosen": plan_graph(graph, "superneurons", room, machine=H200),
             "convolutions_alone": convolutions_alone(graph, room)}
    return {"record": os.path.basename(record_path), "model": record["model"],
            "dtype": record["dtype"], "ratio": ratio, "room_bytes": room,
            "limit_bytes": int(PLANNED_SHARE * room),
            **{name: {"replayed_layers": plan.num_extra_computations,
                      "replay_ms": round(replay_work(plan) * 1e3, 3),
                      **live_at_peak(plan, top)} for name, plan in plans.items()}}


def main():
    sys.path.insert(0, HERE)
    from common import write
    from ratio import rows_of_records
    args = sys.argv[2:]
    top = 12
    if "--top" in args:
        at = args.index("--top")
        top, args = int(args[at + 1]), args[:at] + args[at + 2:]
    rows = rows_of_records(args, lambda path, ratio: row(path, ratio, top),
                           ("model", "dtype", "ratio", "room_bytes"))
    write(sys.argv[1], {"command": "python benchmarks/plan_peak.py " + " ".join(sys.argv[2:]),
                        "rows": rows})


if __name__ == "__main__":
    main()
