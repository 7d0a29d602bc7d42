"""Sum Nsight Compute's per-kernel counters (``ncu --csv`` output) per kernel name.

    python tools/ncu_summary.py ncu_mixtral.csv [ncu_qwen3_30b.csv ...] [--json F]

Each file is one shape's run of ``tools/ncu_layer.py`` (one call of the expert path, one of
the megakernel). Prints, per kernel name, the launches and each metric summed over them
(byte, instruction and time counters) or averaged (rates and percentages), then each path's
total (``by_path``: the launches of each path's call, told apart by ``ncu_layer.py``'s marker
launch before each call; in a log without markers, every kernel but the megakernel against it).
``--per-launch``: a line per launch instead (FC1 and FC2 may share a kernel name). Kernels print
by ``short_names``; the JSON keeps full names.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter, defaultdict

MEGAKERNEL = re.compile(r"megakernel", re.IGNORECASE)
# ncu_layer.py's torch.cuda._sleep before each path's call, the paths in its order
MARKER = re.compile(r"spin_kernel")
PATHS = ("expert_kernels", "megakernel")
CUTE_CLASS = re.compile(r"([A-Z][A-Za-z0-9]*)_object_at_")  # CuTe DSL: <module><Class>_object_at_...


def read_rows(path: str) -> list[dict]:
    """The CSV rows of an ``ncu --csv`` log (ncu's own ``==PROF==`` lines skipped)."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    return list(csv.DictReader(lines))


def _summed(metric: str) -> bool:
    """Byte, instruction and time counters add up over launches; rates and percentages do not."""
    return metric.endswith(".sum") or metric.startswith("gpu__time_duration")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def launches(rows: list[dict]) -> dict[tuple, dict]:
    """{(launch ID, kernel name): {metric: value}}, numbers only, in launch order."""
    per_launch: dict[tuple, dict] = defaultdict(dict)
    for r in rows:
        value = _number(r.get("Metric Value", ""))
        if value is not None:
            per_launch[(r["ID"], r["Kernel Name"])][r["Metric Name"]] = value
    return dict(per_launch)


def summarize(rows: list[dict]) -> dict:
    """{kernel name: {"launches": n, metric: value}}: ``.sum`` metrics and durations summed
    over the launches, the others (rates, percentages) averaged."""
    out: dict[str, dict] = {}
    for (_, name), metrics in launches(rows).items():
        k = out.setdefault(name, {"launches": 0})
        k["launches"] += 1
        for m, v in metrics.items():
            k.setdefault(m, []).append(v)
    for k in out.values():
        for m, vs in list(k.items()):
            if isinstance(vs, list):
                k[m] = sum(vs) if _summed(m) else sum(vs) / len(vs)
    return out


def short_names(names) -> dict[str, str]:
    """{name: label}: a CuTe kernel's class (its mangled names differ only past ~70 characters),
    "marker" for ncu_layer.py's marker launch, else the name up to its first template argument,
    at most 48 characters; a label two names share gets #1, #2, ... in order."""
    base = {}
    for name in names:
        m = CUTE_CLASS.search(name)
        base[name] = (m.group(1) if m else "marker" if MARKER.search(name)
                      else name.removeprefix("void ").split("<")[0][:48])
    counts = Counter(base.values())
    seen: Counter = Counter()
    out = {}
    for name, label in base.items():
        if counts[label] > 1:
            seen[label] += 1
            label = f"{label}#{seen[label]}"
        out[name] = label
    return out


def by_path(rows: list[dict]) -> dict:
    """Each path's launches summed (sums only; the markers left out): a launch belongs to the
    path whose marker came last before it (``PATHS`` in turn), so the megakernel path's own
    prep launches count as its, though the expert path runs kernels of the same names. Before
    any marker (a log without them), by name: the megakernel against every other kernel."""
    paths: dict[str, dict] = {p: defaultdict(float) for p in PATHS}
    markers = 0
    for (_, name), metrics in sorted(launches(rows).items(), key=lambda kv: int(kv[0][0])):
        if MARKER.search(name):
            markers += 1
            continue
        if markers:
            path = paths[PATHS[(markers - 1) % len(PATHS)]]
        else:
            path = paths["megakernel" if MEGAKERNEL.search(name) else "expert_kernels"]
        path["launches"] += 1
        for m, v in metrics.items():
            if _summed(m):
                path[m] += v
    return {p: dict(v) for p, v in paths.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", default=None)
    ap.add_argument("--per-launch", action="store_true", help="one line a launch, not a kernel name")
    a = ap.parse_args()
    report = {}
    for path in a.files:
        rows = read_rows(path)
        kernels = summarize(rows)
        report[path] = {"kernels": kernels, "paths": by_path(rows)}
        print(f"== {path}")
        labels = short_names(kernels)
        lines = ([(f"#{launch} {labels[name]}", k) for (launch, name), k in launches(rows).items()]
                 if a.per_launch else [(labels[name], k) for name, k in kernels.items()])
        for label, k in lines:
            print(f"  {label}: " + ", ".join(f"{m}={v:.4g}" for m, v in k.items()))
        for p, sums in report[path]["paths"].items():
            print(f"  [{p}] " + ", ".join(f"{m}={v:.4g}" for m, v in sums.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
