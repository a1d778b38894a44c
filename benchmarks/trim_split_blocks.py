"""What the plans a budget forces to move data would move, with blocks split at convolutions
(trim.split_blocks) among them and without. For rows of H200 ratio records, the model is planned
on this machine within the room the record's wrapper had at its last step (its budget less the
memory the model did not own and the calibrated excess), as pool_pages.py does; no GPU needed.

    python benchmarks/trim_split_blocks.py OUT_DIR RECORD:RATIO [...]

For each row: the plan chosen now; the policy's own plan, every block replayed, and each split
plan, with their floors (the peak less the model's input), replay seconds and bytes to move a
step; and the plan chosen with no split plans to weigh, as the planner chose before them. Writes
OUT_DIR/trim_split_blocks.json.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def described(plan, room: int) -> dict:
    from superneurons.planner.trim import _floor, replay_work
    moved = plan.bytes_to_move(room)
    return {"segments": len(plan.segments), "floor_bytes": _floor(plan),
            "replay_s": replay_work(plan), "bytes_to_move": moved,
            "cost_s": replay_work(plan) + plan.costs.machine.move_seconds(moved)}


def row(record_path: str, ratio: float) -> dict:
    from superneurons.planner import H200, plan_graph, trim
    from superneurons.planner.plan import _build
    from superneurons.planner.policy import Policy, Strategy, find_segments, route_cuts
    from superneurons.planner.trim import split_blocks
    from ratio import graph_in_record_room
    record, graph, room = graph_in_record_room(record_path, ratio)
    chosen = plan_graph(graph, "superneurons", room, machine=H200)
    own = plan_graph(graph, "superneurons", machine=H200)
    order = list(own.order)
    strategy = Strategy.COST_AWARE

    def segments_for(keep, offloads=False):
        return find_segments(graph, order, strategy, own.costs, offloads=offloads, keep=keep)

    def make(policy, segments=None):
        return _build(graph, order, own.timeline, own.costs, policy, strategy, room, segments,
                      "device")
    own = make(Policy.SUPERNEURONS)
    cuts = route_cuts(graph, order)
    blocks = make(Policy.SUPERNEURONS, segments_for(cuts))
    split = split_blocks(own, make, segments_for, cuts, trim._BLOCKS_FLOOR_SHARE * room)
    trim.split_blocks = lambda *_: []          # the planner as it was before them
    try:
        before = plan_graph(graph, "superneurons", room, machine=H200)
    finally:
        trim.split_blocks = split_blocks
    return {"record": os.path.basename(record_path), "model": record["model"],
            "dtype": record["dtype"], "ratio": ratio, "room_bytes": room,
            "chosen": described(chosen, room), "chosen_before": described(before, room),
            "own": described(own, room), "every_block": described(blocks, room),
            "split": [described(p, room) for p in split]}


def main():
    sys.path.insert(0, HERE)
    from common import write
    from ratio import rows_of_records
    rows = rows_of_records(sys.argv[2:], row,
                           ("model", "dtype", "ratio", "chosen", "chosen_before"))
    write(os.path.join(sys.argv[1], "trim_split_blocks.json"), {"rows": rows})


if __name__ == "__main__":
    main()
