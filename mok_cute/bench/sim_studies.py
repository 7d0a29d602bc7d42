"""The simulator studies (run by tools/sim_studies.py; results in benchmarks/sim/).

(a) ``study_pull_push``: pull vs push dispatch under uniform and skewed routing at R=8 (H200
    HGX) and R=72 (GB300 NVL72), dispatch alone and the whole layer.
(b) ``study_sweep``: num_comm_sms x minibatch_tokens for MoK's four shapes on both profiles,
    plus the num_comm_sms sweep again with half the assumed per-SM copy rate.
(c) ``study_mok``: predicted TFLOP/s per GPU on GB300 NVL72 (MoK's formula) at EP 8..64 with
    the best point of a sweep, against MoK's published DSV4-Pro BF16 forward number.
``calibration``: fit the GEMM model to benchmark rows (or, until ours land, to the anchors'
    torch grouped-GEMM numbers) with leave-one-out errors; fit the comm copy rate to the real
    megakernel's DISPATCH records (``calibrate.fit_megakernel_comm``) and check the simulated
    megakernel at R = 1 against its measured layer times (``study_megakernel_r1``).
``backward_calibration``: fit the backward megakernel's per-kind speed to its R = 1 probe runs
    (``calibrate.fit_backward``, leave-one-out), then every other committed timing of it
    (``calibrate.backward_checks``) simulated with the model as is and with the fit.

Every function returns plain dicts (written as JSON next to a PNG); nothing here is measured.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from mok_cute.bench import calibrate
from mok_cute.figures import save_png
from mok_cute.schedule import schedule_capacity
from mok_cute.shapes import SINGLE_GPU_SHAPES
from mok_cute.sim.hardware import get_profile
from mok_cute.sim.model import MOK_SHAPES, Routing, SimConfig, SimShape
from mok_cute.sim.run import simulate
from mok_cute.sim.tune import tune_report
from mok_cute.tasks import TaskType

__all__ = ["study_pull_push", "study_sweep", "study_mok", "study_calibration",
           "study_megakernel_r1", "study_backward_calibration", "MOK_GB300",
           "MEGAKERNEL_R1_MEASURED"]

# anchors.md: "DSV4-Pro BF16 fwd: about 1029 TFLOP/s per GB300" (MoK, 2048 tokens per rank).
MOK_GB300 = {"dsv4_pro": 1029.0}
# benchmarks/sim/calibration.json "fit_all": the GEMM tile model fitted to the anchors' five
# torch._grouped_mm rates on one H200 scales the per-SM tensor rate by 0.907 and puts 5.5 us of
# fixed cost on each tile. Study (c) applies the same correction to GB300 as a sensitivity.
GEMM_FIT_H200 = (0.907, 5.5e-6)


def _pool_map(fn, items, workers):
    if workers <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    ctx = mp.get_context("fork")
    with ctx.Pool(workers) as pool:
        return pool.map(fn, items, chunksize=1)


def _workers():
    return max(1, min(2, os.cpu_count() or 1))


# ------------------------------------------------------------------------------------------
# (a) pull vs push


def _pp_point(args):
    shape, R, prof, routing, mode, ncomm, only = args
    cfg = SimConfig(num_comm_sms=ncomm, minibatch_tokens=4096, ring_tokens=32768, dispatch=mode)
    t = time.perf_counter()
    res = simulate(shape, R, cfg, prof, routing, dispatch_only=only)
    row = dict(shape=shape, num_ranks=R, profile=prof, routing=routing.label, dispatch=mode,
               num_comm_sms=ncomm, dispatch_only=only, wall_s=round(time.perf_counter() - t, 2))
    if only:
        row.update(res.dispatch_stats())
    else:
        s = res.summary()
        row.update(layer_time_us=s["layer_time_us"], tflops_per_gpu=s["tflops_per_gpu"],
                   exposed_comm_pct=s["exposed_comm_pct"],
                   exposed_comm_pct_max=s["exposed_comm_pct_max"])
    return row


def study_pull_push(shape: str = "kimi_k2.7", *, workers: int | None = None,
                    skews=(0.25, 0.5), full_layer: bool = True,
                    scarce_shape: str = "qwen3.5_397b") -> dict:
    """Dispatch alone (``shape``) with ample and with scarce comm SMs, and whole layers:
    ``shape`` with ample comm SMs, ``scarce_shape`` (comm-heavier: K=10, small I) with 8 and 16
    comm SMs. Per-pair push at R=72 is simulated for dispatch alone only (it is slow)."""
    points = []
    for R, prof, ample in ((8, "h200_hgx", 16), (72, "gb300_nvl72", 32)):
        for ncomm in (ample, 8):
            for routing in [Routing()] + [Routing("skew", s) for s in skews]:
                for mode in ("pull", "push", "push_hol"):
                    points.append((shape, R, prof, routing, mode, ncomm, True))
                    if full_layer and ncomm == ample and not (R == 72 and mode == "push"):
                        points.append((shape, R, prof, routing, mode, ncomm, False))
        if full_layer:
            for ncomm in (8, 16):
                for routing in (Routing(), Routing("skew", skews[0])):
                    for mode in ("pull", "push", "push_hol"):
                        if not (R == 72 and mode == "push"):
                            points.append((scarce_shape, R, prof, routing, mode, ncomm, False))
    rows = _pool_map(_pp_point, points, workers or _workers())
    return dict(study="a: pull vs push dispatch", shape=shape, scarce_shape=scarce_shape,
                rows=rows)


# ------------------------------------------------------------------------------------------
# (b) sweep


SWEEP_COMM = (4, 8, 12, 16, 24, 32, 40, 48, 64)
SWEEP_MB = (1024, 2048, 4096, 8192)


def _sweep_point(args):
    shape, R, prof, ncomm, mb, copy_scale = args
    hw = get_profile(prof)
    if copy_scale != 1.0:
        hw = hw.replace(sm_copy_bytes_per_s=hw.sm_copy_bytes_per_s * copy_scale,
                        source=f"sensitivity: {copy_scale} x the profile's assumption")
    ring = max(4 * mb, 32768)
    cfg = SimConfig(num_comm_sms=ncomm, minibatch_tokens=mb, ring_tokens=ring)
    res = simulate(shape, R, cfg, hw)
    s = res.summary()
    return dict(shape=shape, num_ranks=R, profile=prof, num_comm_sms=ncomm, minibatch_tokens=mb,
                ring_tokens=ring, copy_scale=copy_scale, layer_time_us=s["layer_time_us"],
                tflops_per_gpu=s["tflops_per_gpu"], exposed_comm_pct=s["exposed_comm_pct"],
                comm_busy_pct=s["comm_busy_pct"], compute_busy_pct=s["compute_busy_pct"],
                dispatch_link_gbps=s["dispatch_link_gbps"])


def study_sweep(*, workers: int | None = None, shapes=MOK_SHAPES, comm=SWEEP_COMM,
                minibatches=SWEEP_MB, setups=((8, "h200_hgx"), (64, "gb300_nvl72"))) -> dict:
    points = [(s, R, p, n, mb, 1.0) for R, p in setups for s in shapes for n in comm
              for mb in minibatches]
    # sensitivity of the comm-SM optimum to the (uncalibrated) per-SM copy rate
    points += [(s, R, p, n, 4096, 0.5) for R, p in setups for s in shapes for n in comm]
    rows = _pool_map(_sweep_point, points, workers or _workers())
    best = {}
    for r in rows:
        k = f"{r['shape']}|{r['profile']}|{r['num_ranks']}|copy{r['copy_scale']}"
        if k not in best or r["layer_time_us"] < best[k]["layer_time_us"]:
            best[k] = r
    return dict(study="b: num_comm_sms x minibatch sweep", rows=rows, best=best)


# ------------------------------------------------------------------------------------------
# (c) against MoK's published numbers


def _mok_point(args):
    shape, R, variant, ncomm, mb = args
    hw = get_profile("gb300_nvl72")
    if variant == "gemm_as_torch_fit":
        scale, overhead = GEMM_FIT_H200
        hw = hw.replace(sm_tensor_flops=hw.sm_tensor_flops * scale,
                        gemm_task_overhead_s=overhead,
                        source="sensitivity: H200 torch grouped-GEMM fit applied to GB300")
    elif variant == "copy_half":
        hw = hw.replace(sm_copy_bytes_per_s=hw.sm_copy_bytes_per_s / 2,
                        source="sensitivity: half the assumed per-SM copy rate")
    cfg = SimConfig(num_comm_sms=ncomm, minibatch_tokens=mb, ring_tokens=max(4 * mb, 32768))
    res = simulate(shape, R, cfg, hw)
    return dict(shape=shape, num_ranks=R, variant=variant, num_comm_sms=ncomm,
                minibatch_tokens=mb, tflops_per_gpu=res.tflops_per_gpu,
                layer_time_us=res.layer_time * 1e6)


def study_mok(*, workers: int | None = None, ranks=(8, 16, 32, 64), shapes=MOK_SHAPES,
              comm=(8, 16, 24, 32, 40), minibatches=(2048, 4096),
              variants=("profile", "gemm_as_torch_fit", "copy_half")) -> dict:
    points = [(s, R, v, n, mb) for v in variants for s in shapes for R in ranks for n in comm
              for mb in minibatches]
    rows = _pool_map(_mok_point, points, workers or _workers())
    best = {}
    for r in rows:
        k = (r["shape"], r["num_ranks"], r["variant"])
        if k not in best or r["tflops_per_gpu"] > best[k]["tflops_per_gpu"]:
            best[k] = r
    table = sorted(best.values(), key=lambda r: (r["variant"], r["shape"], r["num_ranks"]))
    # MoK's own setting (40 comm SMs, 4096-token minibatches) at EP 64, for comparison
    mok_setting = _pool_map(_mok_point, [(s, 64, v, 40, 4096) for v in variants
                                         for s in shapes], workers or _workers())
    return dict(study="c: predicted TFLOP/s per GPU on GB300 vs MoK", published=MOK_GB300,
                best=table, mok_setting=mok_setting, rows=rows)


# ------------------------------------------------------------------------------------------
# calibration


def _recorded_date(path: Path) -> str:
    """The run time a benchmark JSON records (ISO 8601, sorts as text); '' if none."""
    try:
        return str(json.loads(path.read_text()).get("date", ""))
    except (OSError, ValueError):
        return ""


def study_calibration(results_dir: str | Path | None = None, *, comm: bool = True) -> dict:
    """Leave-one-out fits of the GEMM model. Uses our benchmark JSON rows of contender
    'mok_cute' (single-GPU shapes) when ``results_dir`` holds some, else the anchors'
    torch._grouped_mm 'two GEMMs alone' numbers. ``comm``: also the comm copy-rate fits of
    runs 16 and 13 (``calibrate.fit_megakernel_comm``) and ``study_megakernel_r1``."""
    rows, contender, source = [], "torch_grouped_gemm_anchor", "anchors.md torch._grouped_mm"
    if results_dir is not None:
        # oldest run first, so a shape measured again takes the newest run's time
        files = sorted(Path(results_dir).glob("*.json"), key=_recorded_date)
        ours = [r for r in calibrate.load_results(files) if r.get("contender") == "mok_cute"]
        ours = [r for r in ours if r.get("shape") in SINGLE_GPU_SHAPES]
        if len({r["shape"] for r in ours}) >= 3:
            used = list(dict.fromkeys(r["_file"] for r in ours))
            rows, contender, source = ours, "mok_cute", ", ".join(used)
    if not rows:
        rows = calibrate.anchor_rows()
    shapes = sorted({r["shape"] for r in rows if r.get("contender") == contender})
    folds = []
    for held in shapes:
        fit = calibrate.fit_gemm(rows, "h200_hgx", train=[s for s in shapes if s != held],
                                 contender=contender, source=f"calibrated on {source}")
        folds.append(dict(held_out=held, error=fit.errors[held],
                          sm_tensor_flops=fit.profile.sm_tensor_flops,
                          gpu_tflops=fit.profile.gpu_tensor_flops / 1e12,
                          gemm_task_overhead_us=fit.profile.gemm_task_overhead_s * 1e6,
                          report=fit.report()))
    allfit = calibrate.fit_gemm(rows, "h200_hgx", train=shapes, contender=contender,
                                source=f"calibrated on {source}")
    uncal = {s: (calibrate.predict_gemm_ms(s, "h200_hgx") - allfit.measured_ms[s])
             / allfit.measured_ms[s] for s in shapes}
    extra = {}
    if comm:
        extra["comm"] = {run: calibrate.fit_megakernel_comm(run).as_dict()
                         for run in ("run16_bulk", "run13_vector4")}
        extra["megakernel_r1"] = study_megakernel_r1()
    return dict(study="calibration of the H200 profile: GEMM tile model (leave-one-out), comm "
                      "copy rate (megakernel DISPATCH records), megakernel at R = 1 (held out)",
                source=source, contender=contender, **extra, folds=folds,
                mean_abs_held_out_error=float(np.mean([abs(f["error"]) for f in folds])),
                fit_all=dict(gpu_tflops=allfit.profile.gpu_tensor_flops / 1e12,
                             scale=allfit.profile.sm_tensor_flops
                             / get_profile("h200_hgx").sm_tensor_flops,
                             gemm_task_overhead_us=allfit.profile.gemm_task_overhead_s * 1e6,
                             errors=allfit.errors),
                uncalibrated_errors=uncal)


def study_backward_calibration() -> dict:
    """``calibrate.fit_backward`` (the fit and its leave-one-out predictions) and
    ``calibrate.backward_checks`` with the model as is and with the fit (minutes)."""
    from mok_cute.sim.backward import CALIBRATED, UNCALIBRATED

    fit = calibrate.fit_backward()
    stored = CALIBRATED["h200_hgx"]
    return dict(study="calibration of the backward megakernel's simulation (H200): per-kind "
                      "speed of its GEMM tasks fitted at R = 1, every other timing held out",
                fit=fit.as_dict(), stored=dict(dgrad=stored.dgrad, wgrad=stored.wgrad),
                report=fit.report(), uncalibrated=calibrate.backward_checks(UNCALIBRATED),
                calibrated=calibrate.backward_checks(stored))


# ------------------------------------------------------------------------------------------
# the megakernel at R = 1 on one H200: simulated against measured (held out)

# Layer time (ms, CUDA-event mean of back-to-back calls, MoKConfig(check_ids=False)) of the real
# megakernel at R = 1 on one H200, by number of comm CTAs: run 17 of docs/gpu_runs.md (git
# history; vector copies, 16 x 16 B in flight per lane; minibatch 1024, ring = capacity) for 6,
# 8, 12; the 16-CTA points come from another run (runs 13-16). None of these has a timeline.
MEGAKERNEL_R1_MEASURED = {
    "dsv3_ep8_rank": {6: 8.35, 8: 7.00, 12: 6.62, 16: 7.3},
    "sonic_120b": {6: 17.5, 8: 14.2, 12: 13.4, 16: 13.5},
}
# run 17, bulk copies (cp.async.bulk, the run-16 design) with 8 comm CTAs, and the expert path
MEGAKERNEL_R1_BULK8 = {"dsv3_ep8_rank": 6.68, "sonic_120b": 14.4}
EXPERT_PATH_MS = {"dsv3_ep8_rank": 4.69, "sonic_120b": 10.53}
# the profile before the comm calibration (docs/sim.md, in git history)
_H200_COMM_ASSUMED = dict(sm_copy_bytes_per_s=40e9, comm_task_overhead_s=2e-6,
                          comm_task_serial_s=None)


def _r1_config(shape, n_comm, local_direct: bool = False):
    """The configuration of the R = 1 measurements above: every row copied (they predate
    ``MegakernelOptions.rows_in_place``)."""
    cap = schedule_capacity(1, shape.tokens_per_rank, shape.top_k, shape.num_experts, 128)
    return SimConfig(num_comm_sms=n_comm, minibatch_tokens=1024, ring_tokens=cap,
                     local_direct=local_direct)


def _r1_point(shape, n_comm, hw):
    res = simulate(shape, 1, _r1_config(shape, n_comm), hw)
    g, rec = res.graph, res.records
    comb = g.type == TaskType.COMBINE
    s = res.summary()
    return dict(layer_ms=res.layer_time * 1e3,
                last_combine_end_ms=float(rec.end[comb].max()) * 1e3,
                ksum_tail_ms=(res.layer_time - float(rec.end[g.type == TaskType.BARRIER].max()))
                * 1e3,
                combine_held_median_us=float(np.median(rec.end[comb] - rec.take[comb])) * 1e6,
                comm_busy_pct=s["comm_busy_pct"], comm_wait_pct=s["comm_wait_pct"])


def study_megakernel_r1(profile="h200_hgx", comm=(6, 8, 12, 16), *, tuner: bool = True) -> dict:
    """The simulated megakernel at R = 1 (one virtual rank) for dsv3_ep8_rank and sonic_120b
    against the measured layer times (``MEGAKERNEL_R1_MEASURED``, not used by any fit).

    - ``rows``: per (shape, comm SMs) the simulated kernel time with ``profile`` (the comm copy
      rate fitted to run 16) and with the comm values assumed before (40 GB/s, 2 us), and the
      errors against the measured time, raw and after adding ``per_call_offset_ms``.
    - ``records_check``: the simulated kernel at 8 comm SMs with each recorded run's own fit
      against that recording (last COMBINE end, COMBINE hold time incl. its FC2 wait).
    - ``per_call_offset_ms``: time per call outside the kernel (not simulated): measured bulk
      8-CTA time (run 17) minus run 16's recorded kernel (last comm record end + the simulated
      KSUM tail after it). An estimate: two runs, and the recording carries recorder overhead.
    - ``tuner``: ``tune.tune(shape, 1, profile)`` with its wall time, and with the minibatch
      held at the measured 1024.
    """
    hw = get_profile(profile)
    before = hw.replace(source="assumption before the comm calibration", **_H200_COMM_ASSUMED)
    fits = {run: calibrate.fit_megakernel_comm(run) for run in ("run16_bulk", "run13_vector4")}
    recs = np.load(calibrate.MEGAKERNEL_COMM_RECORDS)
    out = dict(profile=hw.name, sm_copy_gbps=hw.sm_copy_bytes_per_s / 1e9,
               comm_task_overhead_us=hw.comm_task_overhead_s * 1e6, measured_source=(
                   "docs/gpu_runs.md (git history) run 17 (vector copies, 16 x 16 B per lane) "
                   "for 6/8/12 comm CTAs; 16 from another run (13-16); bulk 8 from run 17"),
               rows=[], records_check=[], per_call_offset_ms={}, tuner=[])
    for name, meas in MEGAKERNEL_R1_MEASURED.items():
        shape = SimShape.named(name)
        # recorded kernels vs the simulation fed each run's own DISPATCH fit
        for run, fit in fits.items():
            a = recs[f"{run}__{name}"]
            t0 = int(a["start_ns"].min())
            comb = a["task_type"] == int(TaskType.COMBINE)
            hw_run = hw.replace(sm_copy_bytes_per_s=fit.sm_copy_bytes_per_s,
                                comm_task_overhead_s=fit.comm_task_overhead_s,
                                comm_task_serial_s=fit.gap_s,
                                source=f"fit_megakernel_comm({run!r})")
            sim8 = _r1_point(shape, int(np.unique(a["cta_id"]).size), hw_run)
            rec_end = (int(a["end_ns"].max()) - t0) * 1e-6
            rec_comb = (int(a["end_ns"][comb].max()) - t0) * 1e-6
            out["records_check"].append(dict(
                shape=name, run=run, comm_ctas=int(np.unique(a["cta_id"]).size),
                recorded_last_combine_end_ms=rec_comb, recorded_last_record_end_ms=rec_end,
                simulated_last_combine_end_ms=sim8["last_combine_end_ms"],
                error=(sim8["last_combine_end_ms"] - rec_comb) / rec_comb,
                recorded_combine_held_median_us=float(np.median(
                    a["end_ns"][comb] - a["start_ns"][comb])) * 1e-3,
                simulated_combine_held_median_us=sim8["combine_held_median_us"],
                simulated_ksum_tail_ms=sim8["ksum_tail_ms"]))
            if run == "run16_bulk":
                out["per_call_offset_ms"][name] = MEGAKERNEL_R1_BULK8[name] - (
                    rec_end + sim8["ksum_tail_ms"])
        off = out["per_call_offset_ms"][name]
        f13 = fits["run13_vector4"]
        vec4 = hw.replace(sm_copy_bytes_per_s=f13.sm_copy_bytes_per_s,
                          comm_task_overhead_s=f13.comm_task_overhead_s,
                          comm_task_serial_s=f13.gap_s,
                          source="fit_megakernel_comm('run13_vector4')")
        for n in comm:
            p = _r1_point(shape, n, hw)
            b = _r1_point(shape, n, before)
            v = _r1_point(shape, n, vec4)
            m = meas.get(n)
            out["rows"].append(dict(
                shape=name, num_comm_sms=n, measured_ms=m, predicted_ms=p["layer_ms"],
                error=(p["layer_ms"] - m) / m if m else None,
                predicted_plus_offset_ms=p["layer_ms"] + off,
                error_plus_offset=(p["layer_ms"] + off - m) / m if m else None,
                predicted_before_ms=b["layer_ms"],
                error_before=(b["layer_ms"] - m) / m if m else None,
                predicted_run13_fit_plus_offset_ms=v["layer_ms"] + off,
                error_run13_fit_plus_offset=(v["layer_ms"] + off - m) / m if m else None,
                comm_busy_pct=p["comm_busy_pct"], comm_wait_pct=p["comm_wait_pct"]))
        if tuner:
            for fixed_mb, quick in ((None, False), (1024, False), (None, True)):
                t = time.perf_counter()
                rep = tune_report(shape, 1, hw, minibatch_tokens=fixed_mb, quick=quick)
                wall = time.perf_counter() - t
                n = rep["num_comm_sms"]
                best_n = min(meas, key=meas.get)
                out["tuner"].append(dict(
                    shape=name, call=f"tune({name!r}, 1, 'h200_hgx'"
                    + (f", minibatch_tokens={fixed_mb}" if fixed_mb else "")
                    + (", quick=True" if quick else "") + ")",
                    picked=[n, rep["minibatch_tokens"], rep["ring_tokens"]],
                    predicted_us=rep["predicted_us"], wall_s=wall, points=len(rep["table"]),
                    measured_best_comm=best_n, measured_at_pick_ms=meas.get(n),
                    measured_best_ms=meas[best_n],
                    within_5pct=(meas[n] <= 1.05 * meas[best_n]) if n in meas else None))
    return out


# ------------------------------------------------------------------------------------------
# plots


def _pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    save_png(fig, path, dpi=70)
    plt.close(fig)
    return Path(path)


def plot_pull_push(data: dict, path: str | Path) -> Path:
    plt = _pyplot()

    rows = [r for r in data["rows"] if r["dispatch_only"]]
    panels = list(dict.fromkeys((r["num_ranks"], r["profile"], r["num_comm_sms"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    modes = ("pull", "push", "push_hol")
    for ax, (R, prof, nc) in zip(np.atleast_1d(axes), panels):
        sub = [r for r in rows if (r["num_ranks"], r["profile"], r["num_comm_sms"]) == (R, prof, nc)]
        routings = list(dict.fromkeys(r["routing"] for r in sub))
        x = np.arange(len(routings))
        for k, mode in enumerate(modes):
            vals = [next((r["mean_receiver_gbps"] for r in sub if r["routing"] == rt
                          and r["dispatch"] == mode), np.nan) for rt in routings]
            ax.bar(x + (k - 1) * 0.27, vals, 0.27, label=mode)
        ax.set_xticks(x, routings, fontsize=8)
        ax.set_title(f"R={R} {prof}, {nc} comm SMs", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("dispatch ingress GB/s\n(mean over receivers)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.suptitle("SIMULATED: pull vs push dispatch alone, Kimi K2.7 rows (study a)", fontsize=10)
    return _save(plt, fig, path)


def plot_sweep(data: dict, path: str | Path) -> Path:
    plt = _pyplot()

    rows = [r for r in data["rows"] if r["copy_scale"] == 1.0]
    setups = list(dict.fromkeys((r["profile"], r["num_ranks"]) for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(len(setups), len(shapes), figsize=(3.1 * len(shapes),
                                                                 2.6 * len(setups)))
    axes = np.atleast_2d(axes)
    for i, (prof, R) in enumerate(setups):
        for j, shape in enumerate(shapes):
            sub = [r for r in rows if r["profile"] == prof and r["num_ranks"] == R
                   and r["shape"] == shape]
            comm = sorted({r["num_comm_sms"] for r in sub})
            mbs = sorted({r["minibatch_tokens"] for r in sub})
            z = np.full((len(mbs), len(comm)), np.nan)
            for r in sub:
                z[mbs.index(r["minibatch_tokens"]), comm.index(r["num_comm_sms"])] = \
                    r["tflops_per_gpu"]
            ax = axes[i, j]
            im = ax.imshow(z, aspect="auto", origin="lower", cmap="viridis")
            bi = np.unravel_index(np.nanargmax(z), z.shape)
            ax.plot(bi[1], bi[0], "r*", ms=10)
            ax.set_xticks(range(len(comm)), comm, fontsize=7)
            ax.set_yticks(range(len(mbs)), mbs, fontsize=7)
            ax.set_title(f"{shape} {prof} R={R}\nbest {np.nanmax(z):.0f} TFLOP/s", fontsize=8)
            if j == 0:
                ax.set_ylabel("minibatch tokens", fontsize=8)
            if i == len(setups) - 1:
                ax.set_xlabel("num_comm_sms", fontsize=8)
            fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle("SIMULATED TFLOP/s per GPU (MoK formula), uniform routing (study b)",
                 fontsize=10)
    return _save(plt, fig, path)


def plot_mok(data: dict, path: str | Path) -> Path:
    plt = _pyplot()

    rows = data["best"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    ranks = sorted({r["num_ranks"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.2 * len(shapes), 3.2), sharey=True)
    for ax, shape in zip(np.atleast_1d(axes), shapes):
        x = np.arange(len(ranks))
        for k, v in enumerate(variants):
            vals = [next((r["tflops_per_gpu"] for r in rows if r["shape"] == shape
                          and r["variant"] == v and r["num_ranks"] == R), np.nan) for R in ranks]
            ax.bar(x + (k - (len(variants) - 1) / 2) * 0.8 / len(variants), vals,
                   0.8 / len(variants), label=v)
        if shape in data["published"]:
            ax.axhline(data["published"][shape], color="red", ls="--", label="MoK published")
        ax.set_xticks(x, [f"EP{R}" for R in ranks], fontsize=8)
        ax.set_title(shape, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("TFLOP/s per GPU")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.suptitle("SIMULATED GB300 NVL72, best of a sweep, vs MoK's published DSV4-Pro BF16 fwd "
                 "(study c)", fontsize=10)
    return _save(plt, fig, path)


def write_json(data: dict, path: str | Path, command: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(o):
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        if isinstance(o, (np.floating, float)):
            return round(float(o), 4)
        if isinstance(o, np.integer):
            return int(o)
        return o

    # compact, as mok_cute.bench.results: the repo travels to the GPU host
    path.write_text(json.dumps(dict(command=command, simulated=True, **clean(data)),
                               separators=(",", ":")))
    return path
