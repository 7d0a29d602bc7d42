"""Result files of a bench run: the JSON of DESIGN §5 (with the ``MoKConfig`` the mok_cute
contenders ran under, so a result says which code it timed) and its PNG bar chart."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mok_cute.config import MoKConfig
from mok_cute.figures import save_png


def versions() -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version()}
    for dist in ("torch", "triton", "nvidia-cutlass-dsl", "mok-cute", "sonic-moe", "quack-kernels", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    out["cuda"] = torch.version.cuda
    return out


def source_record() -> dict[str, Any]:
    """Which code ran: a SHA-256 over the package's Python sources (works where no .git
    travelled, as on the GPU host), ``MOK_GIT_REV`` when the caller sets it, and the git
    revision where a checkout is at hand."""
    import hashlib
    import subprocess

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    record: dict[str, Any] = {"package_sha256": digest.hexdigest()[:16]}
    rev = os.environ.get("MOK_GIT_REV")
    if not rev:
        try:
            rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            rev = ""
    if rev:
        record["git_rev"] = rev
    return record


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"


def gpu_slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = re.sub(r"^nvidia-", "", slug)
    return slug.split("-")[0] if slug.startswith("cpu") else slug


def result_path(out_dir: Path, gpu: str, tag: str, date: str) -> Path:
    stem = f"{date}_{gpu_slug(gpu)}_{re.sub(r'[^A-Za-z0-9_.-]+', '-', tag)}"
    path, n = out_dir / f"{stem}.json", 2
    while path.exists():  # one file per run: never overwrite an earlier run
        path, n = out_dir / f"{stem}_{n}.json", n + 1
    return path


def config_record(config: MoKConfig) -> dict[str, Any]:
    """A ``MoKConfig`` as JSON: every field, the options objects' fields nested."""
    return dataclasses.asdict(config)


# JSON schema of a result file: DESIGN §5 plus the extra keys the harness writes.
RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["gpu", "date", "command", "versions", "results"],
    "properties": {
        "gpu": {"type": "string"},
        "date": {"type": "string"},
        "command": {"type": "string"},
        "versions": {"type": "object"},
        "source": {"type": "object"},
        "mok_config": {"type": "object"},
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["shape", "contender", "pass", "ms", "tflops"],
                "properties": {
                    "shape": {"type": "string"},
                    "contender": {"type": "string"},
                    "pass": {"enum": ["fwd", "bwd", "train"]},
                    "ms": {"type": ["number", "null"], "exclusiveMinimum": 0},
                    "tflops": {"type": ["number", "null"], "exclusiveMinimum": 0},
                    "status": {"enum": ["ok", "check_failed", "skipped", "error"]},
                    "rel_err": {"type": ["number", "null"]},
                    "ratio_vs_torch": {"type": ["number", "null"]},
                    "frac_cublas": {"type": ["number", "null"]},
                    "path": {"type": "string"},
                    "config": {"type": "object"},
                    "error": {"type": "string"},
                },
            },
        },
    },
}


def chart_dependency_missing() -> str | None:
    """Why no chart can be drawn here, or None: matplotlib comes with the ``bench`` extra."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed; install the bench extra: pip install 'mok-cute[bench]'"
    return None


def plot_results(results: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> Path:
    """Grouped bar chart: TFLOP/s per shape and contender, the cuBLAS ceiling as a dashed line,
    each bar labelled with its ratio to the torch pipeline; failed or skipped contenders marked."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    layer = [r for r in results if not r["contender"].startswith("cublas_")]  # the ceilings
    shapes = list(dict.fromkeys(r["shape"] for r in layer))
    names = list(dict.fromkeys(r["contender"] for r in layer))
    cublas = next((r["tflops"] for r in results if r["contender"] == "cublas_8192" and r.get("tflops")), None)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(shapes) * max(1, len(names)) / 3 + 3), 5))
    width = 0.8 / max(1, len(names))
    cmap = matplotlib.colormaps["tab10"]
    top = max((r["tflops"] or 0 for r in results), default=0.0) or 1.0
    for j, name in enumerate(names):
        for s_i, shape in enumerate(shapes):
            r = next((r for r in layer if r["shape"] == shape and r["contender"] == name), None)
            if r is None:
                continue
            xpos = s_i + (j - (len(names) - 1) / 2) * width
            if r.get("tflops"):
                ax.bar(xpos, r["tflops"], width, color=cmap(j % 10), label=name if s_i == 0 else None)
                ratio = r.get("ratio_vs_torch")
                label = f"{ratio:.2f}x" if ratio else f"{r['tflops']:.0f}"
                ax.text(xpos, r["tflops"], label, ha="center", va="bottom", fontsize=7, rotation=90)
            else:
                ax.bar(xpos, top * 0.02, width, color="white", edgecolor=cmap(j % 10), hatch="xx", label=name if s_i == 0 else None)
                ax.text(xpos, top * 0.03, r.get("status", "failed"), ha="center", va="bottom", fontsize=7, rotation=90, color="red")
    if cublas:
        ax.axhline(cublas, color="black", linestyle="--", linewidth=1)
        ax.text(len(shapes) - 0.5, cublas, f"cuBLAS bf16 8192^3: {cublas:.0f}", ha="right", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=15)
    ax.set_ylabel("TFLOP/s  (6 (TK + T[shared]) H I / t)")
    ax.set_ylim(0, top * 1.18)
    ax.set_title(title or "MoE layer forward")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path


def save_results(results: list[dict[str, Any]], out_dir: Path, tag: str, gpu: str, command: str,
                 argv: Sequence[str], config: MoKConfig, extra: dict[str, Any],
                 title: Callable[[str], str],
                 chart: list[dict[str, Any]] | None = None) -> tuple[Path, Path]:
    """The results JSON (DESIGN §5: GPU, date, command, versions; ``mok_config``, the
    ``MoKConfig`` the mok_cute contenders ran under, each row's ``config`` the one it ran;
    ``extra``; results) and its bar chart (of ``chart``, default ``results``; ``title(date)``)."""
    now = time.localtime()
    doc = {
        "gpu": gpu,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", now),
        "command": command,
        "argv": list(argv),
        "versions": versions(),
        "source": source_record(),
        "mok_config": config_record(config),
        **extra,
        "results": results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = result_path(out_dir, gpu, tag, time.strftime("%Y-%m-%d", now))
    with open(json_path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))  # compact: the repo travels to the GPU host
    png_path = plot_results(results if chart is None else chart, json_path.with_suffix(".png"),
                            title=title(doc["date"][:10]))
    return json_path, png_path
