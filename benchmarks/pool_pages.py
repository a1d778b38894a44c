"""How much more the Tensor Pool counts than a plan counted byte for byte: each tensor it holds
rounded up to CUDA's 2 MiB page, or to the allocator's 512-byte small block for one of at most
1 MiB (pool Rule 5, Machine.pool_bytes). For rows of H200 ratio records, the model is planned on
this machine within the room the record's wrapper had at its last step (its budget less the
memory the model did not own and the calibrated excess), counted byte for byte, as plans were
before Machine.pool_page_bytes, and as the pool counts ("in_pages"); no GPU needed.

    python benchmarks/pool_pages.py OUT_DIR RECORD:RATIO [...]

RECORD is a results/ratio_*.json file. Writes OUT_DIR/pool_pages.json.
"""

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def rounding_at_peak(plan, machine) -> tuple:
    """(the most the pool's pages add at once over the plan's pool tensors, with every
    checkpoint kept; how many tensors it holds then)."""
    from superneurons.planner.predict import live_per_step
    managed = [b for b in plan.buffers if b.managed]
    spans = [((b.intervals[0][0], b.intervals[-1][1]),) for b in managed]
    extra = [dataclasses.replace(b, nbytes=machine.pool_bytes(b.nbytes) - b.nbytes, intervals=s)
             for b, s in zip(managed, spans)]
    added, count = live_per_step(extra, len(plan.steps))
    step = max(range(len(added)), key=added.__getitem__)
    return added[step], count[step]


def row(record_path: str, ratio: float) -> dict:
    from superneurons.planner import H200, plan_graph
    from superneurons.planner.costs import OFF_CUDA
    from ratio import graph_in_record_room
    _, graph, room = graph_in_record_room(record_path, ratio)
    by_bytes = plan_graph(graph, "superneurons", room, machine=OFF_CUDA)
    in_pages = plan_graph(graph, "superneurons", room, machine=H200)
    added, held = rounding_at_peak(by_bytes, H200)
    return {"record": os.path.basename(record_path), "ratio": ratio, "room_bytes": room,
            "by_bytes": {"replayed_layers": by_bytes.num_extra_computations,
                         "pages_added_bytes": added, "tensors_held_then": held,
                         "bytes_to_move_in_pages": dataclasses.replace(
                             by_bytes, costs=in_pages.costs).bytes_to_move(room)},
            "in_pages": {"replayed_layers": in_pages.num_extra_computations,
                         "bytes_to_move_in_pages": in_pages.bytes_to_move(room)}}


def main():
    sys.path.insert(0, HERE)
    from common import write
    from ratio import rows_of_records
    write(os.path.join(sys.argv[1], "pool_pages.json"),
          {"rows": rows_of_records(sys.argv[2:], row)})


if __name__ == "__main__":
    main()
