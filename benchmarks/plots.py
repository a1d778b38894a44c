"""Plots from the JSON records only (run after run.py): largest batch, speed, bytes moved,
recomputations (Table 1), workspace headroom, pooled allocation (Table 2), deepest networks,
DenseNet memory against depth.

    python benchmarks/plots.py [RESULTS_DIR]
"""

import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


# a network whose model changed: its rows measured before are another model's (AlexNet's LRN
# became models.layers.LocalResponseNorm, sliced over the batch; BENCHMARKS.md, largest batch)
MODEL_CHANGED = {"alexnet": "2026-11-29T20:40"}


def _current(network: str, record: dict) -> bool:
    return record.get("date", "") >= MODEL_CHANGED.get(network, "")


def _records(folder: str, part: str) -> list:
    """The part's records, oldest first (a later record's numbers replace an earlier one's)."""
    records = []
    for path in glob.glob(os.path.join(folder, f"{part}*.json")):
        with open(path) as file:
            records.append(json.load(file))
    return sorted(records, key=lambda record: record.get("date", ""))


def largest_batch(folder: str) -> None:
    table = {}
    for record in _records(folder, "batch"):
        for network, systems in record["results"].items():
            if not _current(network, record):
                continue
            for system, value in systems.items():
                table.setdefault(network, {})[system] = value["batch"]
    if not table:
        return
    systems = ["plain", "checkpoint", "save_on_cpu", "superneurons"]
    figure, axis = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(systems)
    for index, system in enumerate(systems):
        values = [table[n].get(system, 0) for n in table]
        axis.bar([i + index * width for i in range(len(table))], values, width, label=system)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(table))], list(table), rotation=20)
    axis.set_ylabel("largest batch, 12 GiB cap")
    axis.legend(fontsize=8)
    _save(figure, folder, "batch.png")


def speed(folder: str) -> None:
    """Images/s against batch, one panel per network (Figure 14); later rows replace earlier."""
    rows = {}
    for record in _records(folder, "speed"):
        for network, network_rows in record["results"].items():
            for row in network_rows if _current(network, record) else ():
                rows[network, row["batch"], row["dtype"], row["system"]] = row
    networks = sorted({key[0] for key in rows})
    if not networks:
        return
    columns = min(4, len(networks))
    figure, axes = plt.subplots((len(networks) + columns - 1) // columns, columns,
                                figsize=(3.2 * columns, 2.8 * ((len(networks) - 1) // columns + 1)),
                                squeeze=False)
    for axis, network in zip(axes.flat, networks):
        for system in sorted({key[3] for key in rows}):
            for dtype, style in (("fp32", "-"), ("bf16", ":")):
                points = sorted((key[1], row["images_per_s"]) for key, row in rows.items()
                                if (key[0], key[2], key[3]) == (network, dtype, system)
                                and row["images_per_s"])
                if points:
                    axis.plot(*zip(*points), style, marker="o", label=f"{system} {dtype}")
        axis.set_title(network, fontsize=9)
        axis.set_xlabel("batch (12 GiB cap)", fontsize=8)
        axis.set_ylabel("images / s", fontsize=8)
    for axis in list(axes.flat)[len(networks):]:
        axis.axis("off")
    legend = {}                                  # every panel's lines, each label once
    for axis in axes.flat:
        legend.update(zip(*reversed(axis.get_legend_handles_labels())))
    figure.legend(list(legend.values()), list(legend), fontsize=7, loc="lower right")
    _save(figure, folder, "speed.png")


def bytes_moved(folder: str) -> None:
    records = _records(folder, "cache")
    if not records:
        return
    rows = records[-1]["results"]["resnet50"]
    figure, axis = plt.subplots(figsize=(5, 3.5))
    for label in ("with_cache", "without_cache"):
        # records before CACHE_STEPS hold the first step alone
        steps = ("first_step", "last_step") if any("last_step" in r[label] for r in rows) \
            else (None,)
        for step in steps:
            points = [(r["batch"], ((r[label].get(step) or {}) if step else r[label])
                       .get("offloaded_bytes", 0) / 2**30) for r in rows]
            axis.plot(*zip(*points), marker="o", label=" ".join(
                [label.replace("_", " "), (step or "first_step").replace("_", " ")]))
    _finish(figure, axis, folder, "cache.png", "batch (ResNet-50)", "GiB offloaded per step",
            legend_size=None)


def recomputations(folder: str) -> None:
    records = _records(folder, "recompute")
    if not records:
        return
    table = records[-1]["results"]
    strategies = ["speed-centric", "memory-centric", "cost-aware"]
    figure, axis = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(strategies)
    for index, strategy in enumerate(strategies):
        axis.bar([i + index * width for i in range(len(table))],
                 [row[strategy]["extra_layer_computations"] for row in table.values()], width,
                 label=strategy)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(table))], list(table), rotation=20)
    axis.set_ylabel("extra layer computations / step")
    axis.legend(fontsize=8)
    _save(figure, folder, "recompute.png")


def _speed_by_condition(folder: str, part: str, name: str) -> None:
    """Bars of img/s per (network, batch, system) for each condition of a child-process part."""
    records = _records(folder, part)
    if not records:
        return
    # records with the latest's conditions are merged (a later row replaces an earlier one)
    conditions = {condition: {} for condition in records[-1]["results"]}
    for record in records:
        if set(record["results"]) != set(conditions):
            continue
        for condition, networks in record["results"].items():
            for network, network_rows in networks.items():
                for row in network_rows:
                    conditions[condition][network, row["batch"], row["system"]] = row
    keys = sorted({key for rows in conditions.values() for key in rows})
    labels = [" ".join(map(str, key)) for key in keys]
    bars = {condition: [(rows[key].get("images_per_s") or 0) if key in rows else 0
                        for key in keys] for condition, rows in conditions.items()}
    figure, axis = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(bars)
    for index, (condition, values) in enumerate(bars.items()):
        axis.bar([i + index * width for i in range(len(values))], values, width, label=condition)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=20,
                    fontsize=7)
    axis.set_ylabel("images / s (0: out of memory)")
    axis.legend(fontsize=7)
    _save(figure, folder, name)


def deepest(folder: str) -> None:
    for part, key, label in (("depth", "depth", "deepest ResNet, batch 16"),
                             ("densenet", "depth", "deepest DenseNet-BC, batch 64")):
        table = {}                               # later records' systems replace earlier ones'
        for record in _records(folder, part):
            table.update(record["results"].get("deepest", record["results"]))
        if part == "densenet":
            table.pop("memory_by_depth", None)
        if not table:
            continue
        figure, axis = plt.subplots(figsize=(5, 3.5))
        axis.bar(list(table), [row[key] for row in table.values()])
        axis.set_ylabel(f"{label} (layers)")
        _save(figure, folder, f"{part}.png")


def densenet_memory(folder: str) -> None:
    """Predictions from the latest record; each system's measured peaks from the latest record
    that measured it (a run of superneurons alone keeps plain's and checkpoint's lines)."""
    records = [r for r in _records(folder, "densenet") if r["results"].get("memory_by_depth")]
    if not records:
        return
    rows = records[-1]["results"]["memory_by_depth"]
    measured = {}                                 # system -> {depth: bytes}
    for record in records:
        for row in record["results"]["memory_by_depth"]:
            for name, nbytes in row.get("measured_peak_bytes", {}).items():
                if nbytes:
                    measured.setdefault(name, {})[row["depth"]] = nbytes
    figure, axis = plt.subplots(figsize=(6, 3.5))
    depths = [row["depth"] for row in rows]
    for policy in ("liveness", "superneurons"):
        axis.plot(depths, [row["predicted_peak_bytes"][policy] / 2**30 for row in rows],
                  ls="--", marker=".", label=f"{policy} predicted")
    for name, by_depth in measured.items():
        points = sorted((depth, nbytes / 2**30) for depth, nbytes in by_depth.items())
        axis.plot(*zip(*points), marker="o", label=f"{name} measured")
    axis.set_yscale("log")          # plain grows with depth squared, the others linearly
    _finish(figure, axis, folder, "densenet_memory.png",
            "DenseNet-BC depth (k=12, 32 px, batch 64)", "GiB")


def _finish(figure, axis, folder: str, name: str, xlabel: str, ylabel: str,
            legend_size: int | None = 7) -> None:
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.legend(fontsize=legend_size)
    _save(figure, folder, name)


def _save(figure, folder: str, name: str) -> None:
    figure.tight_layout()
    figure.savefig(os.path.join(folder, name), dpi=110)
    plt.close(figure)
    print(f"wrote {os.path.join(folder, name)}")


if __name__ == "__main__":
    results = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__),
                                                                   "results")
    largest_batch(results)
    speed(results)
    bytes_moved(results)
    recomputations(results)
    _speed_by_condition(results, "workspace", "workspace.png")
    _speed_by_condition(results, "pool", "pool.png")
    deepest(results)
    densenet_memory(results)
