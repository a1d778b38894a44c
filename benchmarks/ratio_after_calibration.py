"""ratio.py's records timed again from their own step times: the median of the steps after the
warm-up and after the first steps in which superneurons calibrated (ratio.after_warm_up), for
records made before ratio.py timed so.

    python benchmarks/ratio_after_calibration.py OUT_FILE RECORD.json [...]

Writes OUT_FILE: per record and row, the throughput as recorded and as timed again, and each as
a share of the record's first plain row that ran. A row whose every step after the warm-up
calibrated has none to time (null).
"""

import json
import os
import sys

from ratio import after_warm_up, per_second


def again(row: dict, model: str):
    flags = [step.get("calibrating", False) for step in row.get("steps", [])]
    timed = after_warm_up(row["step_s"], flags)
    return (per_second(model, timed) if timed else None), len(timed)


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write
    out, paths = sys.argv[1], sys.argv[2:]
    records = []
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        plain = next(r["per_s"] for r in record["rows"]       # the reference: the first plain
                     if r["system"] == "plain" and r.get("ok"))
        rows = []
        for row in record["rows"]:
            if not row.get("ok") or "step_s" not in row:
                continue
            per_s, timed = again(row, record["model"])
            rows.append({"system": row["system"], "ratio": row["ratio"],
                         "control": row["control"], "per_s": row["per_s"],
                         "of_plain": row["per_s"] / plain, "per_s_after_calibration": per_s,
                         "of_plain_after_calibration": per_s / plain if per_s else None,
                         "timed_steps": timed})
        records.append({"record": os.path.basename(path), "model": record["model"],
                        "dtype": record["dtype"], "rows": rows})
    write(out, {"command": "python benchmarks/ratio_after_calibration.py " + " ".join(
        [os.path.basename(out)] + [os.path.basename(p) for p in paths]), "records": records})


if __name__ == "__main__":
    main()
