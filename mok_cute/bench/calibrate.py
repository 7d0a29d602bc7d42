"""Calibration hooks: fit the simulator's uncalibrated rates to measurements.

- ``fit_gemm``: per-SM tensor rate and per-tile overhead from measured layer or GEMM times of
  single-GPU shapes (rows of a benchmark JSON, DESIGN §5 schema: ``{"shape", "contender",
  "pass", "ms", "tflops"}``), fitted on some shapes and checked on the held-out rest.
- ``fit_copy_rate``: per-SM copy rate (and per-task overhead) of comm SMs from the DISPATCH
  records of a timeline (the megakernel in virtual mode, recorded with ``timeline=True``).
- ``fit_megakernel_comm``: ``fit_copy_rate`` on the committed comm records of the real
  megakernel at R = 1 on one H200 (``MEGAKERNEL_COMM_RECORDS``), with the bytes of each task
  taken from the megakernel's own static task list; the H200 profile's copy rate and comm task
  overhead come from this fit.
- ``fit_backward``: the backward megakernel's per-kind speed (``sim.backward.CALIBRATED``) from
  its committed R = 1 probe runs, each shape also left out; ``backward_checks``: its other
  committed timings (R = 1 bench, MoK's shapes, virtual ranks, a group rank's comm CTAs)
  simulated, none of them fitted.

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

from mok_cute.shapes import SHAPES, SINGLE_GPU_SHAPES
from mok_cute.sim.hardware import HardwareProfile, get_profile
from mok_cute.sim.model import Routing, SimShape, receive_layouts, route

__all__ = ["predict_gemm_ms", "fit_gemm", "GemmFit", "fit_copy_rate", "fit_copy_rate_samples",
           "CopyFit", "fit_megakernel_comm", "CommCalibration", "megakernel_dispatch_samples",
           "MEGAKERNEL_COMM_RECORDS", "load_results", "ANCHOR_TORCH_GROUPED_GEMM",
           "BACKWARD_PROBES", "BACKWARD_FIT_SHAPES", "BackwardFit", "fit_backward",
           "backward_rounds", "backward_sim_ms", "backward_check_points", "backward_checks"]

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
    residual_rms_s: float = 0.0  # rms of (measured - fitted) task duration


def fit_copy_rate_samples(nbytes, durations, hw: HardwareProfile | str = "h200_hgx") -> CopyFit:
    """Least squares of ``duration = overhead + bytes / rate`` over tasks (bytes, seconds).

    When the task sizes do not vary the overhead cannot be separated from the rate: the
    profile's overhead is kept. When the least-squares overhead is negative, the constrained
    optimum (overhead >= 0) is the fit through the origin."""
    hw = get_profile(hw)
    by = np.asarray(nbytes, dtype=np.float64)
    dur = np.asarray(durations, dtype=np.float64)
    keep = by > 0
    by, dur = by[keep], dur[keep]
    if by.size < 2:
        raise ValueError(f"need at least 2 DISPATCH records with bytes, got {by.size}")

    def done(rate, ov, note):
        rms = float(np.sqrt(np.mean((dur - ov - by / rate) ** 2)))
        return CopyFit(float(rate), float(ov), int(by.size), note, rms)

    if by.std() > 0.05 * by.mean():
        slope, intercept = np.polyfit(by, dur, 1)
        if slope > 0 and intercept >= 0:
            return done(1.0 / slope, intercept, "least squares")
        if slope > 0:
            return done(float((by * by).sum() / (by * dur).sum()), 0.0,
                        f"least squares through the origin (free intercept was "
                        f"{intercept * 1e6:.1f} us < 0)")
    ov = hw.comm_task_overhead_s
    rate = by.sum() / max((dur - ov).sum(), 1e-12)
    return done(rate, ov, "fixed overhead (task sizes do not vary)")


def _dispatch_samples(timeline, graph_or_bytes):
    """(bytes, seconds) of the DISPATCH records of a Timeline (or a raw record array)."""
    from mok_cute.tasks import TaskType

    rec = getattr(timeline, "records", timeline)
    m = rec["task_type"] == int(TaskType.DISPATCH)
    ranks, ids = rec["rank"][m], rec["task_id"][m]
    dur = (rec["end_ns"][m] - rec["start_ns"][m]) * 1e-9
    if hasattr(graph_or_bytes, "local_id"):
        g = graph_or_bytes
        lookup = {(int(r), int(l)): float(b) for r, l, b in zip(g.rank, g.local_id, g.comm_bytes)}
    else:
        lookup = {(int(k[0]), int(k[1])): float(v) for k, v in dict(graph_or_bytes).items()}
    by = np.array([lookup.get((int(r), int(i)), 0.0) for r, i in zip(ranks, ids)])
    return by, dur


def fit_copy_rate(timeline, graph_or_bytes=None, hw: HardwareProfile | str = "h200_hgx") -> CopyFit:
    """Per-SM copy rate from DISPATCH records: least squares of ``duration = overhead + bytes /
    rate`` over the tasks (see ``fit_copy_rate_samples``). ``timeline`` is a
    ``mok_cute.timeline.Timeline`` or its record array; ``graph_or_bytes`` is a simulator
    ``Graph`` or a mapping ``(rank, task_id) -> bytes`` (for the megakernel: the task list's
    DISPATCH bytes of the real rows; records without bytes are left out). To pool several
    recordings (e.g. two shapes, whose task sizes differ), pass a list of ``(timeline,
    graph_or_bytes)`` pairs as ``timeline``. Record with few comm SMs (2-4) so that the NVLink
    port is not the limit, else this measures the link."""
    pairs = timeline if graph_or_bytes is None else [(timeline, graph_or_bytes)]
    parts = [_dispatch_samples(t, b) for t, b in pairs]
    if not parts:
        raise ValueError("timeline must hold at least one (timeline, bytes) pair")
    return fit_copy_rate_samples(np.concatenate([p[0] for p in parts]),
                                 np.concatenate([p[1] for p in parts]), hw)


# ------------------------------------------------------------------------------------------
# the real megakernel's comm records (one H200, R = 1)

_REPO = Path(__file__).resolve().parents[2]
MEGAKERNEL_COMM_RECORDS = _REPO / "benchmarks" / "results" / \
    "2026-11-29_h200_megakernel_comm_records.npz"
# the megakernel's parameters in those recordings (mok_cute/megakernel.py defaults at R = 1)
_MK_PARAMS = dict(minibatch_tokens=1024, tile_m=128, fc1_tile_n=256, fc2_tile_n=256)
_NOOP_MAX_S = 3e-6  # a no-op task (tile past num_tiles) takes 1.1-2.5 us in the records


def megakernel_dispatch_samples(records: np.ndarray, shape: str, *, minibatch_tokens: int = 1024,
                                tile_m: int = 128, fc1_tile_n: int = 256,
                                fc2_tile_n: int = 256) -> dict:
    """The DISPATCH tasks of one recorded megakernel call at R = 1 (one virtual rank) of a
    single-GPU shape, with their bytes.

    ``task_id`` indexes the megakernel's static task list (``tasks.build_static(capacity)``,
    ring = capacity), which gives each record its M-tile. Tiles past the device's
    ``num_tiles`` are no-ops (they only signal): they are the trailing tiles of the last live
    minibatch whose records are shorter than 3 us, which gives ``num_tiles``. The real rows of
    one call are exactly ``T*K`` at R = 1, so every real tile is given the mean,
    ``T*K / num_tiles`` rows of ``H*2`` bytes: the total is exact, the split between full
    tiles and each expert's partial last tile is not recorded (about 6-12 % of the tiles are
    partial). A least-squares fit over tasks of equal bytes fits the per-shape means, so the
    fit is unbiased by the partial tiles as long as duration is linear in bytes."""
    from mok_cute import tasks as T
    from mok_cute.schedule import schedule_capacity

    if shape not in SINGLE_GPU_SHAPES:
        raise ValueError(f"shape must be one of {sorted(SINGLE_GPU_SHAPES)}, got {shape!r}")
    s = SINGLE_GPU_SHAPES[shape]
    cap = schedule_capacity(1, s.tokens, s.top_k, s.experts, tile_m)
    tl = T.build_static(cap, hidden=s.hidden, intermediate=s.intermediate, num_tokens=s.tokens,
                        top_k=s.top_k, minibatch_tokens=minibatch_tokens, ring_tokens=cap,
                        tile_m=tile_m, fc1_tile_n=fc1_tile_n, fc2_tile_n=fc2_tile_n)
    if np.unique(records["rank"]).size != 1:
        raise ValueError("records must be of one rank (R = 1)")
    m = records["task_type"] == int(T.TaskType.DISPATCH)
    ids = records["task_id"][m].astype(np.int64)
    if ids.size == 0 or ids.max() >= len(tl) or (tl.type[ids] != T.TaskType.DISPATCH).any():
        raise ValueError(f"records' DISPATCH task ids do not index DISPATCH tasks of the "
                         f"static list of {shape} (capacity {cap}, minibatch "
                         f"{minibatch_tokens}): other megakernel parameters?")
    tiles = tl.m_tile_begin[ids]
    dur = (records["end_ns"][m] - records["start_ns"][m]).astype(np.float64) * 1e-9
    o = np.argsort(tiles)
    tiles, dur = tiles[o], dur[o]
    tpm = minibatch_tokens // tile_m
    last_mb = (int(tiles.max()) // tpm) * tpm
    num_tiles = int(tiles.max()) + 1
    while num_tiles - 1 >= last_mb and dur[np.searchsorted(tiles, num_tiles - 1)] < _NOOP_MAX_S:
        num_tiles -= 1
    lo = -(-s.tokens * s.top_k // tile_m)
    if not lo <= num_tiles <= cap // tile_m:
        raise ValueError(f"{shape}: inferred num_tiles={num_tiles} outside [{lo}, "
                         f"{cap // tile_m}]")
    real = tiles < num_tiles
    row_bytes = s.hidden * _BF16
    mean_rows = s.tokens * s.top_k / num_tiles
    # per comm CTA: the gap between the end of one task and the start of the next (ticket
    # fetch, record write): a per-task cost outside the records' durations
    gaps = []
    for c in np.unique(records["cta_id"]):
        mc = records["cta_id"] == c
        st = np.sort(records["start_ns"][mc])
        en = records["end_ns"][mc][np.argsort(records["start_ns"][mc])]
        gaps.append((st[1:] - en[:-1]) * 1e-9)
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    return dict(shape=shape, capacity=cap, num_tiles=num_tiles, tasks=int(real.sum()),
                noop_tasks=int((~real).sum()), row_bytes=row_bytes, mean_rows=mean_rows,
                bytes=np.full(int(real.sum()), mean_rows * row_bytes), durations=dur[real],
                noop_durations=dur[~real], gaps=gaps,
                comm_ctas=int(np.unique(records["cta_id"]).size))


@dataclasses.dataclass
class CommCalibration:
    """``fit_megakernel_comm``'s result: the fit over both shapes, and per shape the measured
    and fitted DISPATCH durations."""
    run: str
    path: str
    fit: CopyFit
    gap_s: float  # median gap between consecutive tasks of a comm CTA (ticket, record)
    shapes: dict

    @property
    def sm_copy_bytes_per_s(self) -> float:
        return self.fit.sm_copy_bytes_per_s

    @property
    def comm_task_overhead_s(self) -> float:
        """The fit's intercept plus the gap between tasks: what one task costs besides its
        bytes, which is what the simulator's ``comm_task_overhead_s`` stands for."""
        return self.fit.comm_task_overhead_s + self.gap_s

    def as_dict(self) -> dict:
        return dict(run=self.run, path=self.path, fit_note=self.fit.note, tasks=self.fit.tasks,
                    sm_copy_gbps=self.fit.sm_copy_bytes_per_s / 1e9,
                    intercept_us=self.fit.comm_task_overhead_s * 1e6,
                    gap_us=self.gap_s * 1e6,
                    comm_task_overhead_us=self.comm_task_overhead_s * 1e6,
                    residual_rms_us=self.fit.residual_rms_s * 1e6, shapes=self.shapes)

    def report(self) -> str:
        lines = [f"{self.run}: sm_copy_bytes_per_s = {self.fit.sm_copy_bytes_per_s / 1e9:.1f} "
                 f"GB/s, intercept {self.fit.comm_task_overhead_s * 1e6:.1f} us + gap "
                 f"{self.gap_s * 1e6:.1f} us = comm_task_overhead "
                 f"{self.comm_task_overhead_s * 1e6:.1f} us ({self.fit.note}, {self.fit.tasks} tasks, rms residual "
                 f"{self.fit.residual_rms_s * 1e6:.1f} us)"]
        for name, d in self.shapes.items():
            lines.append(f"  {name:14s} {d['tasks']:5d} tasks of {d['mean_bytes'] / 1e6:.3f} MB "
                         f"(num_tiles {d['num_tiles']}): measured mean {d['mean_us']:.1f} us "
                         f"(median {d['median_us']:.1f}), fitted {d['fitted_us']:.1f} us; "
                         f"effective {d['effective_gbps']:.1f} GB/s per comm CTA; no-op task "
                         f"{d['noop_us']:.1f} us")
        return "\n".join(lines)


def fit_megakernel_comm(run: str = "run16_bulk", path: str | Path = MEGAKERNEL_COMM_RECORDS,
                        shapes: Sequence[str] | None = None,
                        hw: HardwareProfile | str = "h200_hgx") -> CommCalibration:
    """Fit the per-comm-SM copy rate and per-task overhead to the DISPATCH records of one run
    of ``path`` (keys ``{run}__{shape}``, records of one megakernel call at R = 1), pooled over
    its shapes. DISPATCH only: at R = 1 a dispatch waits on nothing at its start (the ring
    holds every row), while a COMBINE's duration includes its wait for the tile's FC2."""
    path = Path(path)
    data = np.load(path)
    keys = [k for k in data.files if k.startswith(run + "__")]
    if shapes is not None:
        keys = [k for k in keys if k.split("__", 1)[1] in shapes]
    if not keys:
        raise ValueError(f"run must name records in {path.name} (keys {data.files}), got {run!r}")
    samples = [megakernel_dispatch_samples(data[k], k.split("__", 1)[1], **_MK_PARAMS)
               for k in keys]
    fit = fit_copy_rate_samples(np.concatenate([s["bytes"] for s in samples]),
                                np.concatenate([s["durations"] for s in samples]), hw)
    gap = float(np.median(np.concatenate([s["gaps"] for s in samples])))
    per = {}
    for s in samples:
        mb = float(s["bytes"][0])
        per[s["shape"]] = dict(
            tasks=s["tasks"], num_tiles=s["num_tiles"], comm_ctas=s["comm_ctas"],
            mean_rows=s["mean_rows"], mean_bytes=mb,
            mean_us=float(s["durations"].mean() * 1e6),
            median_us=float(np.median(s["durations"]) * 1e6),
            fitted_us=(fit.comm_task_overhead_s + mb / fit.sm_copy_bytes_per_s) * 1e6,
            effective_gbps=mb / s["durations"].mean() / 1e9,
            noop_us=float(np.median(s["noop_durations"]) * 1e6) if s["noop_tasks"] else None,
            gap_us=float(np.median(s["gaps"]) * 1e6))
    return CommCalibration(run=run, path=str(path.relative_to(_REPO)) if path.is_relative_to(
        _REPO) else str(path), fit=fit, gap_s=gap, shapes=per)


# ------------------------------------------------------------------------------------------
# the backward megakernel (one H200): per-kind speed of its GEMM tasks, checked held out

_RESULTS = _REPO / "benchmarks" / "results"
# The R = 1 probe runs of the backward megakernel as kept since the tenth session (weight
# gradients by tickets, pingpong FC2 dgrads, one minibatch), pooled: the variants without
# "[static tail]" / "[ticket ahead]" of these two A/B runs are that code.
BACKWARD_PROBES = ("2026-12-03_h200_bwd_megakernel_tail_tickets_ab.json",
                   "2026-12-03_h200_megakernel_backward_probe_ticket_ahead.json")
BACKWARD_FIT_SHAPES = ("qwen3_30b", "gptoss_120b", "mixtral", "dsv3_ep8_rank", "sonic_120b")
_DGRADS_ALONE, _ONE_LAUNCH = "dgrads: megakernel", "GEMMs: megakernel, one launch"


def backward_rounds(file: str, shape: str, variant: str, tokens: int | None = None,
                    key: str | None = None) -> list:
    """Measured ms of one variant of a committed backward result: a probe's ``ms_rounds``
    (``shapes`` entries; ``tokens``: their ``tokens_per_rank``) or a bench's bwd rows
    (``variant`` = the contender); ``key``: the run's key in a file of several runs."""
    data = json.loads((_RESULTS / file).read_text())
    if key is not None:
        data = data[key]
    if "shapes" in data:
        rows = [s["ms_rounds"][variant] for s in data["shapes"] if s["shape"] == shape
                and tokens in (None, s.get("tokens_per_rank"))]
    else:
        rows = [r["ms_rounds"] for r in data["results"] if r.get("shape") == shape
                and r.get("contender") == variant and r.get("pass") == "bwd"]
    if len(rows) != 1:
        raise ValueError(f"{file}: expected one {variant!r} of {shape} (tokens {tokens}), "
                         f"found {len(rows)}")
    return [float(v) for v in rows[0]]


def backward_sim_ms(shape: SimShape, ranks: int = 1, comm_sms: int = 0, efficiency=None,
                    hw: HardwareProfile | str = "h200_hgx") -> dict:
    """Simulated ms of the backward megakernel as the kernel runs it (one minibatch of the
    schedule's capacity, ``megakernel_backward.tiles_per_minibatch``; over a group x pulled
    again): ``dgrads`` (its last dgrad), ``launch`` (its last GEMM), ``total`` (the list,
    KSUMs included: the k-sum launch at R = 1) and ``rank0``."""
    from mok_cute.schedule import schedule_capacity
    from mok_cute.sim.backward import BackwardSimConfig, simulate_backward
    from mok_cute.tasks_backward import BackwardTaskType as BT

    cap = schedule_capacity(ranks, shape.tokens_per_rank, shape.top_k,
                            shape.num_experts // ranks, 128)
    cfg = BackwardSimConfig(num_comm_sms=comm_sms, minibatch_tokens=cap, x_resident=ranks == 1)
    res = simulate_backward(shape, ranks, cfg, hw, efficiency=efficiency)
    g, end = res.graph, res.records.end
    dg = np.isin(g.type, [int(BT.FC2_DGRAD), int(BT.FC1_DGRAD)])
    gemm = g.flops > 0
    return dict(dgrads=end[dg].max() * 1e3, launch=end[gemm].max() * 1e3,
                total=res.time_s * 1e3, rank0=float(res.rank_time_s[0]) * 1e3)


@dataclasses.dataclass
class BackwardFit:
    """``fit_backward``'s result: the fitted speed per kind, and per shape the measured
    (median of the pooled rounds, and their range) and simulated dgrads-alone and one-launch
    times, ms; ``held_out[shape]``: the fit on the other shapes and its prediction there."""
    efficiency: object  # sim.backward.BackwardEfficiency
    train: list
    measured: dict  # shape -> {"dgrads": (median, lo, hi), "launch": (median, lo, hi)}
    uncalibrated: dict  # shape -> backward_sim_ms(..., efficiency 1)
    predicted: dict  # shape -> backward_sim_ms(..., the fit)
    held_out: dict  # shape -> {"efficiency": (dgrad, wgrad), "dgrads": ms, "launch": ms}

    def error(self, shape: str, what: str, table: dict | None = None) -> float:
        return (table or self.predicted)[shape][what] / self.measured[shape][what][0] - 1.0

    def as_dict(self) -> dict:
        return dict(dgrad=self.efficiency.dgrad, wgrad=self.efficiency.wgrad, train=self.train,
                    sources=list(BACKWARD_PROBES),
                    shapes={s: dict(measured=self.measured[s], uncalibrated=self.uncalibrated[s],
                                    predicted=self.predicted[s], held_out=self.held_out.get(s))
                            for s in self.measured})

    def report(self) -> str:
        e = self.efficiency
        lines = [f"backward megakernel speed against the model: dgrads {e.dgrad:.3f}, weight "
                 f"gradients {e.wgrad:.3f} (fitted on {', '.join(self.train)})"]
        for s in self.measured:
            for w in ("dgrads", "launch"):
                m, lo, hi = self.measured[s][w]
                ho = self.held_out.get(s)
                model = self.uncalibrated[s][w]
                lines.append(
                    f"  {s:14s} {w:7s} measured {m:7.3f} ms ({lo:.2f}-{hi:.2f})  model "
                    f"{model:7.3f} ({100 * self.error(s, w, self.uncalibrated):+5.1f}%)"
                    f"  fit {self.predicted[s][w]:7.3f} ({100 * self.error(s, w):+5.1f}%)"
                    + (f"  held out {ho[w]:7.3f} ({100 * (ho[w] / m - 1):+5.1f}%)" if ho else ""))
        return "\n".join(lines)


def _fit_speeds(measured: dict, base: dict, shapes) -> tuple[float, float]:
    """(dgrad, wgrad) speeds minimising the squared log errors of the dgrads-alone and the
    one-launch times over ``shapes``. The dgrads run before any weight gradient, so their
    time scales as 1 / dgrad exactly; the launch is taken as dgrads + the weight-gradient
    phase / wgrad (the simulator then checks the fit: ``fit_backward``'s predictions)."""
    d0 = np.array([base[s]["dgrads"] for s in shapes])
    w0 = np.array([base[s]["launch"] for s in shapes]) - d0
    dm = np.array([measured[s]["dgrads"][0] for s in shapes])
    om = np.array([measured[s]["launch"][0] for s in shapes])
    dgrad = float(np.exp(np.mean(np.log(d0 / dm))))
    grid = np.exp(np.linspace(np.log(0.3), np.log(3.0), 4001))
    loss = [np.sum(np.log((d0 / dgrad + w0 / w) / om) ** 2) for w in grid]
    return dgrad, float(grid[int(np.argmin(loss))])


def fit_backward(train: Sequence[str] | None = None,
                 hw: HardwareProfile | str = "h200_hgx") -> BackwardFit:
    """Fit the backward megakernel's per-kind speed (``sim.backward.BackwardEfficiency``) to
    the dgrads-alone and one-launch times of ``BACKWARD_PROBES`` at R = 1 (default: all five
    shapes), then leave each shape out in turn and predict it from the other four."""
    from mok_cute.sim.backward import UNCALIBRATED, BackwardEfficiency

    shapes = list(BACKWARD_FIT_SHAPES)
    train = list(train) if train is not None else shapes
    measured = {}
    for s in shapes:
        measured[s] = {}
        for w, variant in (("dgrads", _DGRADS_ALONE), ("launch", _ONE_LAUNCH)):
            v = [t for f in BACKWARD_PROBES for t in backward_rounds(f, s, variant)]
            measured[s][w] = (float(np.median(v)), min(v), max(v))
    base = {s: backward_sim_ms(_single_gpu_shape(s), efficiency=UNCALIBRATED, hw=hw)
            for s in shapes}
    eff = BackwardEfficiency(*_fit_speeds(measured, base, train))
    predicted = {s: backward_sim_ms(_single_gpu_shape(s), efficiency=eff, hw=hw) for s in shapes}
    held = {}
    for s in train if len(train) > 1 else ():
        fold = BackwardEfficiency(*_fit_speeds(measured, base, [t for t in train if t != s]))
        sim = backward_sim_ms(_single_gpu_shape(s), efficiency=fold, hw=hw)
        held[s] = dict(efficiency=(fold.dgrad, fold.wgrad), dgrads=sim["dgrads"],
                       launch=sim["launch"])
    return BackwardFit(eff, train, measured, base, predicted, held)


def _named(name: str, **changes) -> SimShape:
    return dataclasses.replace(SimShape.named(name), **changes)


# the group backward probe's runs of 2026-12-04, one a shape (keys: BACKWARD_SPLITS' names)
GROUP_ONE_LAUNCH = "2026-12-04_h200_group_backward_one_launch.json"


def backward_check_points() -> list[dict]:
    """The backward megakernel's committed timings not fitted by ``fit_backward``, each with
    what the simulator predicts for it: ``sim`` = (shape, ranks, comm SMs, which of
    ``backward_sim_ms``'s times)."""
    pts = []
    # R = 1, the bench of record (L2 flushed): the whole backward, whose row gathers before
    # the launch (d_out's and x's rows, 4 T K H bf16 bytes) are not in the list
    for s in BACKWARD_FIT_SHAPES:
        pts.append(dict(label=f"{s} R=1 whole backward", file="2026-12-03_h200_train_"
                        "megakernel_r1.json", shape=s, variant="mok_megakernel",
                        sim=(_single_gpu_shape(s), 1, 0, "total")))
    # MoK's shapes, T = 2048: one rank (R = 1) and 8 virtual ranks in one launch (the same
    # work on one GPU: simulated as R = 1), whole backward, the kernel of 2026-12-02 (before
    # one minibatch, the pingpong FC2 dgrads and the tickets)
    for s, f in (("glm_5.2", ""), ("kimi_k2.7", ""), ("qwen3.5_397b", "_qwen_dsv4"),
                 ("dsv4_pro", "_qwen_dsv4")):
        for variant, what in (("mok_megakernel", "R=1"), ("mok_virtual", "virtual R=8")):
            pts.append(dict(label=f"{s} T=2048 {what} whole backward", variant=variant,
                            file=f"2026-12-02_h200_train_virtual_r8_global_slot_pool{f}.json",
                            shape=s, sim=(SimShape.named(s), 1, 0, "total")))
    # 8 virtual ranks of T tokens in one launch (group_backward_probe's virtual backward)
    for s, f in (("qwen3.5_397b", "qwen35"), ("glm_5.2", "glm")):
        pts.append(dict(label=f"{s} virtual R=8 x 2048 tokens", variant="virtual bf16",
                        file=GROUP_ONE_LAUNCH, key=f, shape=s,
                        tokens=2048, sim=(_named(s, tokens_per_rank=8 * 2048), 1, 0, "total")))
        pts.append(dict(label=f"{s} virtual R=8 x 256 tokens", variant="virtual bf16",
                        file="2026-12-01_05_probes.json",
                        key="2026-12-03_h200_fp8_virtual_backward_r8_kernels", shape=s,
                        tokens=256, sim=(_named(s, tokens_per_rank=8 * 256), 1, 0, "total")))
    # rank 0 of 8 over a group's buffers on one GPU (its peers' pushes in place): the launch
    # with its comm CTAs and the group tail; the shared expert runs before it
    for s, c, run in (("qwen3.5_397b", 16, "final"), ("glm_5.2", 16, "final"),
                      ("qwen3.5_397b", 32, "splits")):
        pts.append(dict(label=f"{s} group rank 0 of 8, {c} comm CTAs", shape=s, key=run,
                        file="2026-12-04_h200_group_tail_one_rank.json", variant=f"one launch c{c}",
                        tokens=2048, sim=(_named(s, shared_intermediate=0), 8, c, "rank0")))
    return pts


# the whole group backward of 8 ranks on one GPU (ranks one after another) on several comm
# splits: only its ratio to the default split (16) is compared with the rank's simulated time
BACKWARD_SPLITS = (("qwen3.5_397b", "qwen35", (8, 32)), ("glm_5.2", "glm", (12, 24)))


def backward_checks(efficiency=None, hw: HardwareProfile | str = "h200_hgx") -> dict:
    """Every ``backward_check_points`` point measured (median, range) and simulated, and the
    group backward's comm splits (``BACKWARD_SPLITS``) measured and simulated against 16."""
    cache = {}

    def sim(shape, ranks, comm):
        key = (shape, ranks, comm)
        if key not in cache:
            cache[key] = backward_sim_ms(shape, ranks, comm, efficiency, hw)
        return cache[key]

    points = []
    for p in backward_check_points():
        v = backward_rounds(p["file"], p["shape"], p["variant"], p.get("tokens"), p.get("key"))
        shape, ranks, comm, what = p["sim"]
        points.append(dict(label=p["label"], file=p["file"], variant=p["variant"],
                           measured=(float(np.median(v)), min(v), max(v)),
                           predicted=sim(shape, ranks, comm)[what]))
    splits = []
    for s, f, others in BACKWARD_SPLITS:
        file = GROUP_ONE_LAUNCH
        ref = float(np.median(backward_rounds(file, s, "group bf16", 2048, f)))
        shape = _named(s, shared_intermediate=0)
        ref_sim = sim(shape, 8, 16)["rank0"]
        for c in others:
            m = float(np.median(backward_rounds(file, s, f"group bf16 c{c}", 2048, f)))
            splits.append(dict(shape=s, comm_sms=c, file=file, measured_over_16=m / ref,
                               predicted_over_16=sim(shape, 8, c)["rank0"] / ref_sim))
    return dict(points=points, splits=splits)
