"""Host time the wrapper spends on its own bookkeeping, on the CPU (no device needed):

- per call, the plan key's read of every module's training mode, every parameter's
  requires_grad and the modules' scalar attributes (runtime/structure.py) on torchvision's
  DenseNet-121, against walking the module tree at every call as the wrapper did before;
- per plan, a budget's search with the state on the host: how many plans of one graph it
  builds and the time spent listing the graph's state tensors (planner/state.py);
- per saved tensor, the executor's check that it was not written in place since it was saved
  (executor Rule 7, runtime/handles.py Written), made at saving and read at backward.

    python benchmarks/host_overhead.py OUT_DIR
"""

import os
import sys
import time
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def key_read() -> dict:
    import torchvision
    from superneurons.runtime.structure import Structure
    model = torchvision.models.densenet121()
    structure = Structure(model)
    structure.read()

    def walk():
        return (tuple(m.training for m in model.modules()),
                tuple(p.requires_grad for p in model.parameters()))
    kept = min(timeit.repeat(structure.read, number=200, repeat=5)) / 200
    walked = min(timeit.repeat(walk, number=50, repeat=5)) / 50
    scalars = min(timeit.repeat(structure._scalars, number=200, repeat=5)) / 200
    return {"model": "torchvision densenet121", "modules": len(list(model.modules())),
            "parameters": len(list(model.parameters())),
            "kept_lists_checked_ms": kept * 1e3, "tree_walked_ms": walked * 1e3,
            # of the first: the modules' scalar attributes, keyed (module Rule 1)
            "scalar_attributes": len(structure._scalar_names), "scalars_read_ms": scalars * 1e3}


def state_listing(n3: int = 100) -> dict:
    import superneurons as sn
    import superneurons.planner.state as state
    plan_module = sys.modules["superneurons.planner.plan"]   # the package's "plan" is plan()
    counted = {"asked": 0, "listed": 0, "listing_s": 0.0}
    asked, listing = plan_module.state_tensors, state._state_tensors

    def ask(graph):
        counted["asked"] += 1
        return asked(graph)

    def timed(graph):
        began = time.perf_counter()
        try:
            return listing(graph)
        finally:
            counted["listed"] += 1
            counted["listing_s"] += time.perf_counter() - began
    plan_module.state_tensors, state._state_tensors = ask, timed
    try:
        began = time.perf_counter()
        plan = sn.plan(sn.models.resnet(blocks=(3, 4, n3, 3)), (16, 3, 224, 224),
                       policy="superneurons", budget="11.5GiB", state="host")
        seconds = time.perf_counter() - began
    finally:
        plan_module.state_tensors, state._state_tensors = asked, listing
    return {"model": f"zoo ResNet [3, 4, {n3}, 3]", "layers": len(plan.order),
            "planning_s": seconds, "plans_asking_for_state": counted["asked"],
            "state_listings": counted["listed"], "state_listing_s": counted["listing_s"],
            "resident_tensors": len(plan.resident_state)}


def written_check() -> dict:
    import torch
    from superneurons.runtime.handles import Written
    base = torch.empty(64, 64)
    view = base[1:]                               # a view: the check follows its base
    count = 100_000
    seconds = min(timeit.repeat(lambda: Written(view).check(), number=count, repeat=5)) / count
    return {"saved_tensor": "a view of a 64 x 64 float32 tensor", "per_saved_tensor_us": seconds * 1e6}


def main():
    from common import environment, write
    out = sys.argv[1]
    write(os.path.join(out, "host_overhead.json"),
          {"command": " ".join(sys.argv), "environment": environment(), "cpu_count": os.cpu_count(),
           "key_read": key_read(), "state_listing": state_listing(),
           "written_check": written_check()})


if __name__ == "__main__":
    main()
