"""The plans a tree chooses for rows of stored ratio records, each in the room its wrapper had
at its last step (ratio.graph_in_record_room), at the H200's default rates: the chosen plan and
the alternatives the runtime's trial would time, each with its segments, replayed layers by
kind, replays of a convolution alone, replay time and floor, and the normalizations replayed
with the bytes their forwards read and write. Planner only, on the CPU: run it
with two trees on PYTHONPATH to compare their choices.

    PYTHONPATH=TREE:benchmarks python benchmarks/plans_in_rooms.py OUT.json RECORD:RATIO [...]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def described(plan) -> dict:
    from common import replayed_alone
    from superneurons.planner.trim import _floor, replay_work
    from superneurons.capture import Kind
    layers = plan.graph.layers
    kinds: dict = {}
    for segment in plan.segments:
        for layer in segment.layers:
            kinds[layers[layer].kind.value] = kinds.get(layers[layer].kind.value, 0) + 1
    norms = [layer for s in plan.segments for layer in s.layers if layers[layer].kind is Kind.BN]
    return {"segments": len(plan.segments), "replayed_layers": plan.num_extra_computations,
            "replayed_by_kind": kinds, "replayed_alone": replayed_alone(plan),
            "replay_ms": round(replay_work(plan) * 1e3, 3), "floor_bytes": _floor(plan),
            # the normalizations replayed, and the bytes their forwards read and write (l_f)
            "replayed_norms": [layers[layer].name for layer in norms],
            "replayed_norm_forward_bytes": sum(plan.costs.forward[layer] for layer in norms)}


def row(record_path: str, ratio: float) -> dict:
    from superneurons.planner import H200, plan_graph
    from ratio import graph_in_record_room
    record, graph, room = graph_in_record_room(record_path, ratio)
    chosen = plan_graph(graph, "superneurons", room, machine=H200)
    return {"record": os.path.basename(record_path), "model": record["model"],
            "dtype": record["dtype"], "ratio": ratio, "room_bytes": room,
            "chosen": described(chosen),
            "alternatives": [described(p) for p in chosen.alternatives]}


def main():
    sys.path.insert(0, HERE)
    from common import write
    from ratio import rows_of_records
    rows = rows_of_records(sys.argv[2:], row, ("model", "dtype", "ratio", "chosen"))
    write(sys.argv[1], {"rows": rows})


if __name__ == "__main__":
    main()
