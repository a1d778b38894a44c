"""Plots from the JSON records only (run after run.py): largest batch, speed, bytes moved.

    python benchmarks/plots.py [RESULTS_DIR]
"""

import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _records(folder: str, part: str) -> list:
    return [json.load(open(path)) for path in sorted(glob.glob(os.path.join(folder, f"{part}*.json")))]


def largest_batch(folder: str) -> None:
    table = {}
    for record in _records(folder, "batch"):
        for network, systems in record["results"].items():
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
    rows = [row for record in _records(folder, "speed") for network in record["results"]
            for row in record["results"][network] if row.get("images_per_s")]
    if not rows:
        return
    figure, axis = plt.subplots(figsize=(7, 3.5))
    for system in sorted({r["system"] for r in rows}):
        for dtype in ("fp32", "bf16"):
            points = sorted((r["batch"], r["images_per_s"]) for r in rows
                            if r["system"] == system and r["dtype"] == dtype)
            if points:
                axis.plot(*zip(*points), marker="o", label=f"{system} {dtype}")
    axis.set_xlabel("batch (ResNet-50, 12 GiB cap)")
    axis.set_ylabel("images / s")
    axis.legend(fontsize=7)
    _save(figure, folder, "speed.png")


def bytes_moved(folder: str) -> None:
    records = _records(folder, "cache")
    if not records:
        return
    rows = records[-1]["results"]["resnet50"]
    figure, axis = plt.subplots(figsize=(5, 3.5))
    for label in ("with_cache", "without_cache"):
        axis.plot([r["batch"] for r in rows],
                  [r[label].get("offloaded_bytes", 0) / 2**30 for r in rows], marker="o",
                  label=label.replace("_", " "))
    axis.set_xlabel("batch (ResNet-50)")
    axis.set_ylabel("GiB offloaded per step")
    axis.legend()
    _save(figure, folder, "cache.png")


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
