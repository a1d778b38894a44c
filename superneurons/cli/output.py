"""Tables and plots for the command line; rich and matplotlib are optional and loaded lazily."""

import json
from pathlib import Path


def print_table(title: str, columns: list, rows: list) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text still says everything
        widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(str(c).ljust(w) for c, w in zip(columns, widths)))
        for row in rows:
            print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)))
        return
    table = Table(title=title)
    for index, column in enumerate(columns):
        table.add_column(str(column), justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*(str(v) for v in row))
    Console().print(table)


def write_json(path: str, record: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


def plot_steps(path: str, title: str, series: dict, num_layers: int) -> None:
    """Memory per step, one line per policy: the paper's Figure 10 for any network."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("plots need matplotlib: pip install 'superneurons[plot]'") from error
    figure, axis = plt.subplots(figsize=(10, 4.5))
    for label, values in series.items():
        axis.plot(range(1, len(values) + 1), [v / 2**20 for v in values], label=label, lw=1.2)
    axis.axvline(num_layers + 0.5, color="grey", ls=":", lw=1)
    axis.set_xlabel("step (forward, then backward)")
    axis.set_ylabel("live memory (MiB)")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")
