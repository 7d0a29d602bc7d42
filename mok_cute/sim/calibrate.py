"""Calibration hooks: fit the simulator's uncalibrated rates to measurements.

- ``fit_gemm``: per-SM tensor rate and per-tile overhead from measured layer or GEMM times of
  single-GPU shapes (rows of a benchmark JSON, DESIGN §5 schema: ``{"shape", "contender",
  "pass", "ms", "tflops"}``), fitted on some shapes and checked on the held-out rest.
- ``fit_copy_rate``: per-SM copy rate (and per-task overhead) of comm SMs from the DISPATCH
  records of a timeline (the megakernel in virtual mode, recorded with ``timeline=True``).

The prediction a GEMM row is compared with (``predict_gemm_ms``) is the two grouped GEMMs of
the expert-kernel path on one GPU: every FC1 tile of the padded schedule on all SMs, then every
FC2 tile (two launches), each tile costed by the same model as the megakernel simulation.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .hardware import HardwareProfile, get_profile
from .model import Routing, SimShape, receive_layouts, route

__all__ = ["predict_gemm_ms", "fit_gemm", "GemmFit", "fit_copy_rate", "CopyFit",
           "load_results", "ANCHOR_TORCH_GROUPED_GEMM"]

_BF16 = 2

# anchors.md, "Single-GPU MoE layer forward", column "its two GEMMs alone" (torch._grouped_mm,
# measured on one H200, TFLOP/s by 6*T*K*H*I/t). Not our kernels: a stand-in until
# benchmarks/results/ holds mok_cute's own GEMM rows.
ANCHOR_TORCH_GROUPED_GEMM = {
    "dsv3_ep8_rank": 580.0,
    "sonic_120b": 562.0,
    "qwen3_30b": 462.0,
    "mixtral": 580.0,
    "gptoss_120b": 392.0,
}


def _single_gpu_shape(shape) -> SimShape:
    if isinstance(shape, SimShape):
        return shape
    from ..benchmark import SHAPES

    s = SHAPES[shape]
    return SimShape(name=s.name, tokens_per_rank=s.tokens, hidden=s.hidden,
                    intermediate=s.intermediate, num_experts=s.experts, top_k=s.top_k,
                    shared_intermediate=0)


def _list_schedule(durations: np.ndarray, num_sms: int) -> float:
    """Makespan of tasks taken in order by the earliest-free of ``num_sms`` SMs."""
    if durations.size == 0:
        return 0.0
    free = [0.0] * min(num_sms, durations.size)
    heapq.heapify(free)
    end = 0.0
    for d in durations.tolist():
        t = heapq.heappop(free) + d
        heapq.heappush(free, t)
        end = t if t > end else end
    return end


@dataclasses.dataclass(frozen=True)
class _GemmWork:
    """Tile counts of one single-GPU shape (independent of the rates being fitted)."""
    shape: SimShape
    tile_expert: np.ndarray
    n1: int
    n2: int


_WORK_CACHE: dict = {}


def _gemm_work(shape: SimShape, tile_m: int, fc1_tile_n: int, fc2_tile_n: int, seed: int):
    key = (shape, tile_m, fc1_tile_n, fc2_tile_n, seed)
    if key not in _WORK_CACHE:
        ids = route(shape, 1, Routing(seed=seed))
        lay = receive_layouts(ids, shape.num_experts, tile_m)[0]
        _WORK_CACHE[key] = _GemmWork(shape, lay.tile_expert,
                                     -(-2 * shape.intermediate // fc1_tile_n),
                                     -(-shape.hidden // fc2_tile_n))
    return _WORK_CACHE[key]


def predict_gemm_ms(shape, hw: HardwareProfile | str = "h200_hgx", *, tile_m: int = 128,
                    fc1_tile_n: int = 256, fc2_tile_n: int = 256, seed: int = 0) -> float:
    """Predicted time (ms) of the two grouped GEMMs (FC1 then FC2) of a single-GPU shape."""
    hw = get_profile(hw)
    s = _single_gpu_shape(shape)
    w = _gemm_work(s, tile_m, fc1_tile_n, fc2_tile_n, seed)
    nsm = hw.num_sms
    hbm_per_sm = hw.hbm_bytes_per_s / nsm
    tiles_of_expert = np.bincount(w.tile_expert)[w.tile_expert] if w.tile_expert.size else \
        np.zeros(0)
    total = 0.0
    for kdim, tn, ntiles, outc in ((s.hidden, fc1_tile_n, w.n1, fc1_tile_n // 2),
                                   (s.intermediate, fc2_tile_n, w.n2, fc2_tile_n)):
        reuse = np.minimum(tiles_of_expert, max(1, nsm // ntiles))
        mem = (tile_m * kdim * _BF16 / ntiles + tn * kdim * _BF16 / reuse
               + tile_m * outc * _BF16)
        t_tile = hw.gemm_task_overhead_s + np.maximum(
            2.0 * tile_m * tn * kdim / hw.sm_tensor_flops, mem / hbm_per_sm)
        total += _list_schedule(np.repeat(t_tile, ntiles), nsm)  # tile-major, N inner
    return total * 1e3


@dataclasses.dataclass
class GemmFit:
    profile: HardwareProfile  # with the fitted sm_tensor_flops and gemm_task_overhead_s
    errors: dict  # shape -> (predicted - measured) / measured, every shape given
    train: list
    held_out: list
    measured_ms: dict
    predicted_ms: dict

    def report(self) -> str:
        lines = [f"fitted sm_tensor_flops = {self.profile.sm_tensor_flops / 1e12:.3f} TFLOP/s "
                 f"per SM ({self.profile.gpu_tensor_flops / 1e12:.0f} per GPU), "
                 f"gemm_task_overhead = {self.profile.gemm_task_overhead_s * 1e6:.2f} us"]
        for s in self.train + self.held_out:
            tag = "train" if s in self.train else "HELD OUT"
            lines.append(f"  {s:16s} {tag:8s} measured {self.measured_ms[s]:8.3f} ms  predicted "
                         f"{self.predicted_ms[s]:8.3f} ms  error {100 * self.errors[s]:+6.1f}%")
        return "\n".join(lines)


def _rows_ms(rows: Iterable[dict], contender: str, pass_: str) -> dict:
    out = {}
    for r in rows:
        if r.get("contender") == contender and r.get("pass", "fwd") == pass_ and r.get("ms"):
            out[r["shape"]] = float(r["ms"])
    return out


def fit_gemm(rows: Iterable[dict], hw: HardwareProfile | str = "h200_hgx", *,
             train: Sequence[str] | None = None, contender: str = "mok_cute",
             pass_: str = "fwd", source: str = "calibrated") -> GemmFit:
    """Fit ``sm_tensor_flops`` and ``gemm_task_overhead_s`` to measured rows (least squares on
    log time over the ``train`` shapes; default: all but the last shape), then report the
    relative error on every shape, the held-out ones included."""
    hw = get_profile(hw)
    measured = _rows_ms(rows, contender, pass_)
    if not measured:
        raise ValueError(f"rows must hold results of contender={contender!r} pass={pass_!r} "
                         "with an 'ms' field; none found")
    shapes = sorted(measured)
    train = list(train) if train is not None else shapes[:-1] if len(shapes) > 1 else shapes
    missing = [s for s in train if s not in measured]
    if missing:
        raise ValueError(f"train must name shapes present in rows, missing {missing}")
    held = [s for s in shapes if s not in train]

    def loss(scale, ov):
        p = hw.replace(sm_tensor_flops=hw.sm_tensor_flops * scale, gemm_task_overhead_s=ov,
                       source="fit candidate")
        return sum(math.log(predict_gemm_ms(s, p) / measured[s]) ** 2 for s in train)

    def best_scale(ov):
        lo, hi = math.log(0.2), math.log(2.0)  # golden section on log scale
        g = (math.sqrt(5) - 1) / 2
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        fa, fb = loss(math.exp(a), ov), loss(math.exp(b), ov)
        for _ in range(18):
            if fa < fb:
                hi, b, fb = b, a, fa
                a = hi - g * (hi - lo)
                fa = loss(math.exp(a), ov)
            else:
                lo, a, fa = a, b, fb
                b = lo + g * (hi - lo)
                fb = loss(math.exp(b), ov)
        return (math.exp(a), fa) if fa < fb else (math.exp(b), fb)

    best = None
    for ov in np.linspace(0.0, 12e-6, 13):
        sc, f = best_scale(float(ov))
        if best is None or f < best[2]:
            best = (sc, float(ov), f)
    # refine the overhead around the best grid point
    for ov in np.linspace(max(0.0, best[1] - 1e-6), best[1] + 1e-6, 5):
        sc, f = best_scale(float(ov))
        if f < best[2]:
            best = (sc, float(ov), f)
    scale, ov, _ = best
    fitted = hw.replace(sm_tensor_flops=hw.sm_tensor_flops * scale, gemm_task_overhead_s=ov,
                        source=f"{source}: fit_gemm on {', '.join(train)} ({contender} {pass_})")
    pred = {s: predict_gemm_ms(s, fitted) for s in shapes}
    err = {s: (pred[s] - measured[s]) / measured[s] for s in shapes}
    return GemmFit(profile=fitted, errors=err, train=train, held_out=held,
                   measured_ms=measured, predicted_ms=pred)


def anchor_rows() -> list[dict]:
    """The anchors' torch grouped-GEMM numbers as benchmark rows (ms from TFLOP/s)."""
    from ..benchmark import SHAPES

    rows = []
    for name, tf in ANCHOR_TORCH_GROUPED_GEMM.items():
        s = SHAPES[name]
        flops = 6.0 * s.tokens * s.top_k * s.hidden * s.intermediate
        rows.append({"shape": name, "contender": "torch_grouped_gemm_anchor", "pass": "fwd",
                     "ms": flops / (tf * 1e12) * 1e3, "tflops": tf})
    return rows


def load_results(paths: Iterable[str | Path]) -> list[dict]:
    """Result rows of benchmark JSON files (DESIGN §5 schema), each tagged with its file."""
    rows = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        for r in data.get("results", []):
            rows.append({**r, "_file": str(p), "_gpu": data.get("gpu")})
    return rows


@dataclasses.dataclass
class CopyFit:
    sm_copy_bytes_per_s: float
    comm_task_overhead_s: float
    tasks: int
    note: str


def fit_copy_rate(timeline, graph_or_bytes, hw: HardwareProfile | str = "h200_hgx") -> CopyFit:
    """Per-SM copy rate from DISPATCH records: least squares of ``duration = overhead + bytes /
    rate`` over the tasks (falls back to the profile's overhead when the task sizes do not
    vary). ``graph_or_bytes`` is a simulator ``Graph`` or a mapping ``(rank, task_id) ->
    bytes`` (for the megakernel: the task list's DISPATCH bytes of the real rows). Record with
    few comm SMs (2-4) so that the NVLink port is not the limit, else this measures the link."""
    from ..tasks import TaskType

    hw = get_profile(hw)
    rec = timeline.records
    m = rec["task_type"] == int(TaskType.DISPATCH)
    ranks, ids = rec["rank"][m], rec["task_id"][m]
    dur = (rec["end_ns"][m] - rec["start_ns"][m]) * 1e-9
    if hasattr(graph_or_bytes, "local_id"):
        g = graph_or_bytes
        lookup = {(int(r), int(l)): float(b) for r, l, b in zip(g.rank, g.local_id, g.comm_bytes)}
    else:
        lookup = {(int(k[0]), int(k[1])): float(v) for k, v in dict(graph_or_bytes).items()}
    by = np.array([lookup[(int(r), int(i))] for r, i in zip(ranks, ids)])
    keep = by > 0
    by, dur = by[keep], dur[keep]
    if by.size < 2:
        raise ValueError(f"timeline must hold at least 2 DISPATCH records with bytes, got {by.size}")
    if by.std() > 0.05 * by.mean():
        slope, intercept = np.polyfit(by, dur, 1)
        if slope > 0 and intercept >= 0:
            return CopyFit(1.0 / slope, float(intercept), int(by.size), "least squares")
    ov = hw.comm_task_overhead_s
    rate = by.sum() / max((dur - ov).sum(), 1e-12)
    return CopyFit(float(rate), ov, int(by.size), "fixed overhead (task sizes do not vary)")
