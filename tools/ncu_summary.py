"""Sum Nsight Compute's per-kernel counters (``ncu --csv`` output) per kernel name.

    python tools/ncu_summary.py ncu_mixtral.csv [ncu_qwen3_30b.csv ...] [--json F]

Each file is one shape's run of ``tools/ncu_layer.py`` (one call of the expert path, one of
the megakernel). Prints, per kernel name, the launches and each metric summed over them
(byte, instruction and time counters) or averaged (rates and percentages), then the total of
the expert path's kernels (every kernel but the megakernel) against the megakernel's.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import defaultdict

MEGAKERNEL = re.compile(r"megakernel", re.IGNORECASE)


def read_rows(path: str) -> list[dict]:
    """The CSV rows of an ``ncu --csv`` log (ncu's own ``==PROF==`` lines skipped)."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    return list(csv.DictReader(lines))


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(rows: list[dict]) -> dict:
    """{kernel name: {"launches": n, metric: value}}: ``.sum`` metrics and durations summed
    over the launches, the others (rates, percentages) averaged."""
    per_launch: dict[tuple, dict] = defaultdict(dict)
    for r in rows:
        value = _number(r.get("Metric Value", ""))
        if value is not None:
            per_launch[(r["ID"], r["Kernel Name"])][r["Metric Name"]] = value
    out: dict[str, dict] = {}
    for (_, name), metrics in per_launch.items():
        k = out.setdefault(name, {"launches": 0})
        k["launches"] += 1
        for m, v in metrics.items():
            k.setdefault(m, []).append(v)
    for k in out.values():
        for m, vs in list(k.items()):
            if isinstance(vs, list):
                summed = m.endswith(".sum") or m.startswith("gpu__time_duration")
                k[m] = sum(vs) if summed else sum(vs) / len(vs)
    return out


def by_path(kernels: dict) -> dict:
    """The expert path's kernels summed, against the megakernel's (sums only)."""
    paths: dict[str, dict] = {"expert_kernels": defaultdict(float), "megakernel": defaultdict(float)}
    for name, k in kernels.items():
        path = paths["megakernel" if MEGAKERNEL.search(name) else "expert_kernels"]
        for m, v in k.items():
            if m == "launches" or m.endswith(".sum") or m.startswith("gpu__time_duration"):
                path[m] += v
    return {p: dict(v) for p, v in paths.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    report = {}
    for path in a.files:
        kernels = summarize(read_rows(path))
        report[path] = {"kernels": kernels, "paths": by_path(kernels)}
        print(f"== {path}")
        for name, k in kernels.items():
            print(f"  {name[:70]}: " + ", ".join(f"{m}={v:.4g}" for m, v in k.items()))
        for p, sums in report[path]["paths"].items():
            print(f"  [{p}] " + ", ".join(f"{m}={v:.4g}" for m, v in sums.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
