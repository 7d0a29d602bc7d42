"""``mok-cute tune``: pick num_comm_sms, minibatch and ring size with the simulator.

``tune(shape, num_ranks, profile)`` simulates a grid of (num_comm_sms, minibatch_tokens) for
uniform routing and returns the fastest, then the smallest ring (from a few multiples of the
minibatch up to the expected routed rows) within 0.5% of the fastest ring's time. By default
the simulation is *symmetric* (rank 0 only, its port use mirrored: every rank is assumed to do
what rank 0 does, which is what uniform routing gives on average); ``full=True`` simulates
every rank. ``precision="fp8"`` tunes ``MoKConfig(precision="fp8")``'s megakernel (packed e4m3
dispatch rows, FP8 routed GEMMs: ``model.py``); the precision is part of the cache key. Results
are cached per process.

``resolve_config(config, shape, num_ranks, profile)`` fills the ``None`` fields of a
``MoKConfig`` (fields the caller set are kept, and held fixed while tuning the rest) for the
config's own precision.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence

from ..config import PRECISIONS
from ..shapes import resolve_shape
from .hardware import HardwareProfile, get_profile
from .model import Routing, SimConfig, SimShape
from .run import simulate

__all__ = ["tune", "tune_report", "resolve_config", "tuned_config", "main", "default_ring_tokens"]

# 1: one GPU with local rows in place, where the comm CTAs run the barrier only (measured
# best of 1, 2 in the thirteenth session). The model keeps the BARRIER on a comm SM, so 0 (the
# megakernel's choice at one rank with no comm task, the BARRIER on a compute CTA) is
# not in the grid.
COMM_SMS_GRID = (1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48)
COMM_SMS_QUICK = (1, 2, 8, 16, 24, 32)
MINIBATCH_GRID = (1024, 2048, 4096, 8192)
MINIBATCH_QUICK = (2048, 4096)


def _shape(shape) -> SimShape:
    return shape if isinstance(shape, SimShape) else SimShape.named(shape)


def _round_up(x: int, m: int) -> int:
    return -(-int(x) // m) * m


def expected_rows(shape: SimShape, num_ranks: int, tile_m: int = 128) -> int:
    """Padded rows a rank receives on average (uniform routing): T*K plus half a tile of
    padding per local expert."""
    e_loc = -(-shape.num_experts // num_ranks)
    return shape.tokens_per_rank * shape.top_k + e_loc * tile_m // 2


def default_ring_tokens(shape: SimShape, num_ranks: int, minibatch_tokens: int,
                        tile_m: int = 128) -> int:
    """The ring that holds the expected rows of one layer call (so uniform routing never
    wraps), and at least two minibatches."""
    rows = _round_up(expected_rows(shape, num_ranks, tile_m), minibatch_tokens)
    return max(rows, 2 * minibatch_tokens)


@functools.lru_cache(maxsize=256)
def _tune_cached(shape: SimShape, num_ranks: int, hw: HardwareProfile, quick: bool, full: bool,
                 tile_m: int, fixed_comm: int | None, fixed_mb: int | None,
                 fixed_ring: int | None, seed: int, precision: str):
    comm_grid = (fixed_comm,) if fixed_comm else (COMM_SMS_QUICK if quick else COMM_SMS_GRID)
    comm_grid = tuple(c for c in comm_grid if c < hw.num_sms)
    rows = expected_rows(shape, num_ranks, tile_m)
    if fixed_mb:
        mb_grid = (fixed_mb,)
    else:
        mb_grid = tuple(m for m in (MINIBATCH_QUICK if quick else MINIBATCH_GRID)
                        if m <= max(rows, MINIBATCH_GRID[0])) or (MINIBATCH_GRID[0],)
        mb_grid = tuple(_round_up(m, tile_m) for m in mb_grid)
    routing = Routing(seed=seed)
    table = []

    def run(n, mb, ring):
        cfg = SimConfig(num_comm_sms=n, minibatch_tokens=mb, ring_tokens=ring, tile_m=tile_m,
                        precision=precision)
        res = simulate(shape, num_ranks, cfg, hw, routing, symmetric=not full)
        return res.layer_time

    for n in comm_grid:
        for mb in mb_grid:
            ring = fixed_ring if fixed_ring else default_ring_tokens(shape, num_ranks, mb, tile_m)
            if ring < mb:
                continue
            table.append(dict(num_comm_sms=n, minibatch_tokens=mb, ring_tokens=ring,
                              predicted_us=run(n, mb, ring) * 1e6))
    if not table:
        raise ValueError(f"ring_tokens={fixed_ring} is smaller than every minibatch candidate")
    best = min(table, key=lambda r: (r["predicted_us"], r["num_comm_sms"], r["ring_tokens"]))
    if not fixed_ring:
        # smallest ring that keeps the time (fewer bytes of ring buffers)
        mb = best["minibatch_tokens"]
        for k in (2, 4, 8):
            ring = k * mb
            if ring >= best["ring_tokens"]:
                break
            t = run(best["num_comm_sms"], mb, ring) * 1e6
            table.append(dict(num_comm_sms=best["num_comm_sms"], minibatch_tokens=mb,
                              ring_tokens=ring, predicted_us=t))
            if t <= best["predicted_us"] * 1.005:
                best = table[-1]
                break
    return best, tuple(tuple(sorted(r.items())) for r in table)


def tune_report(shape, num_ranks: int, profile: HardwareProfile | str = "h200_hgx", *,
                quick: bool = False, full: bool = False, tile_m: int = 128,
                num_comm_sms: int | None = None, minibatch_tokens: int | None = None,
                ring_tokens: int | None = None, seed: int = 0, precision: str = "bf16") -> dict:
    """The best configuration with its predicted time, and every point simulated, for the
    megakernel in ``precision`` ("bf16" or "fp8")."""
    hw = get_profile(profile)
    shape = _shape(shape)
    if not 1 <= num_ranks <= hw.num_gpus:
        raise ValueError(f"num_ranks must be in [1, {hw.num_gpus}] for {hw.name}, "
                         f"got {num_ranks}")
    if tile_m < 1:
        raise ValueError(f"tile_m must be >= 1, got {tile_m}")
    best, table = _tune_cached(shape, int(num_ranks), hw, bool(quick), bool(full), int(tile_m),
                               num_comm_sms, minibatch_tokens, ring_tokens, int(seed), precision)
    return dict(best, shape=shape.name, num_ranks=num_ranks, profile=hw.name,
                precision=precision, symmetric=not full, tflops_per_gpu=shape.layer_flops()
                / (best["predicted_us"] * 1e-6) / 1e12,
                table=[dict(r) for r in table])


def tune(shape, num_ranks: int, profile: HardwareProfile | str = "h200_hgx",
         **kwargs) -> tuple[int, int, int]:
    """(num_comm_sms, minibatch_tokens, ring_tokens) with the lowest simulated layer time."""
    r = tune_report(shape, num_ranks, profile, **kwargs)
    return r["num_comm_sms"], r["minibatch_tokens"], r["ring_tokens"]


def resolve_config(config, shape, num_ranks: int, profile: HardwareProfile | str = "h200_hgx",
                   **kwargs):
    """A copy of ``config`` (a ``MoKConfig``, or None for the defaults) whose ``None`` tuning
    fields (num_comm_sms, minibatch_tokens, ring_tokens) are filled by ``tune`` for
    ``config.precision``; fields the caller set are kept and held fixed while the others are
    tuned."""
    from ..config import MoKConfig

    if config is None:
        config = MoKConfig()
    names = ("num_comm_sms", "minibatch_tokens", "ring_tokens")
    if all(getattr(config, n) is not None for n in names):
        return config
    best = tune_report(shape, num_ranks, profile, tile_m=config.tile_m,
                       num_comm_sms=config.num_comm_sms,
                       minibatch_tokens=config.minibatch_tokens,
                       ring_tokens=config.ring_tokens, precision=config.precision, **kwargs)
    return dataclasses.replace(config, **{n: best[n] for n in names if getattr(config, n) is None})


def tuned_config(config, num_peers: int, tokens: int, hidden: int, intermediate: int,
                 num_experts: int, top_k: int, shared_intermediate: int,
                 profile: str = "h200_hgx"):
    """``config`` with its ``None`` tuning fields (num_comm_sms, minibatch_tokens,
    ring_tokens) filled by the tuner for an EP group of ``num_peers`` GPUs over NVLink;
    fields the caller set are kept and held fixed. Tuned for ``config.precision`` (an FP8
    plan moves about half the dispatch bytes and runs faster GEMMs, so its picks may differ).
    Resolved before the megakernel's plan (which never imports the simulator). Cached per
    shape and precision (1-5 s for a new one)."""
    shape = SimShape("plan", tokens, hidden, intermediate, num_experts, top_k, shared_intermediate)
    return resolve_config(config, shape, num_peers, profile)


def _parse_shape(spec: str) -> SimShape:
    return SimShape.of(resolve_shape(spec))  # a name or custom:T,H,I,E,K[,shared]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="mok-cute tune",
        description="Pick num_comm_sms, minibatch_tokens and ring_tokens for a shape on a "
                    "hardware profile by simulating the megakernel (CPU only).")
    ap.add_argument("--shape", default="kimi_k2.7",
                    help="a named shape (mok_cute.shapes.SHAPES; EP shapes are per rank) or "
                         "custom:T,H,I,E,K[,shared] with T tokens per rank")
    ap.add_argument("--ranks", type=int, default=8, help="EP group size")
    ap.add_argument("--profile", default="h200_hgx", help="h200_hgx | gb300_nvl72")
    ap.add_argument("--quick", action="store_true", help="a coarser grid")
    ap.add_argument("--full", action="store_true",
                    help="simulate every rank instead of the symmetric one-rank model")
    ap.add_argument("--tile-m", type=int, default=128)
    ap.add_argument("--precision", choices=PRECISIONS, default="bf16",
                    help="the megakernel's MoKConfig.precision: fp8 dispatches packed e4m3 "
                         "rows and runs the routed GEMMs in FP8")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--table", action="store_true", help="also print every simulated point")
    ap.add_argument("--backward", action="store_true",
                    help="tune the backward megakernel's comm split instead (mok_cute.sim"
                         ".backward: every rank simulated, ~10 s a point at R = 8)")
    ap.add_argument("--minibatches", default="",
                    help="with --backward: also simulate these minibatch sizes (tokens, a "
                         "comma list; what-ifs: the kernel runs one minibatch)")
    args = ap.parse_args(argv)
    if args.backward:
        if args.precision != "bf16":  # the backward model's rows and GEMMs are bf16
            print("mok-cute tune: --backward models the bf16 backward megakernel only; "
                  "--precision fp8 applies to the forward", file=sys.stderr)
            return 2
        return _main_backward(args)
    try:
        shape = _parse_shape(args.shape)
        rep = tune_report(shape, args.ranks, args.profile, quick=args.quick, full=args.full,
                          tile_m=args.tile_m, precision=args.precision)
    except ValueError as e:
        print(f"mok-cute tune: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {k: v for k, v in rep.items() if args.table or k != "table"}
        print(json.dumps(out, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{shape.name}[/bold] {rep['precision']} on {rep['profile']} x{args.ranks} "
              f"({'symmetric model' if rep['symmetric'] else 'every rank simulated'}): "
              f"num_comm_sms={rep['num_comm_sms']} minibatch_tokens={rep['minibatch_tokens']} "
              f"ring_tokens={rep['ring_tokens']} -> predicted {rep['predicted_us']:.0f} us, "
              f"{rep['tflops_per_gpu']:.0f} TFLOP/s per GPU (simulated, not measured)")
    if args.table:
        t = Table("num_comm_sms", "minibatch", "ring", "predicted us")
        for r in sorted(rep["table"], key=lambda r: r["predicted_us"]):
            t.add_row(str(r["num_comm_sms"]), str(r["minibatch_tokens"]),
                      str(r["ring_tokens"]), f"{r['predicted_us']:.0f}")
        con.print(t)
    return 0


def _main_backward(args) -> int:
    from .backward import CALIBRATED, tune_backward

    grid = dict(comm_sms=(16, 28, 40)) if args.quick else {}
    try:
        if args.minibatches:  # what-ifs of the task list: the kernel runs one minibatch
            sizes = [v.strip() for v in args.minibatches.split(",")]
            if not all(v.isdigit() for v in sizes):
                raise ValueError(f"--minibatches: expected a comma list of token counts (0: one "
                                 f"minibatch), got {args.minibatches!r}")
            grid["minibatch_tokens"] = tuple(int(v) for v in sizes)
        shape = _parse_shape(args.shape)
        best, rows = tune_backward(shape, args.ranks, args.profile, **grid)
    except ValueError as e:
        print(f"mok-cute tune: {e}", file=sys.stderr)
        return 2
    flops = 12.0 * shape.hidden * shape.tokens_per_rank * (
        shape.top_k * shape.intermediate + shape.shared_intermediate)
    table = [dict(num_comm_sms=c.num_comm_sms if args.ranks > 1 else 0,
                  minibatch_tokens=c.minibatch_tokens or "one", predicted_us=t * 1e6)
             for c, t in rows]
    calibrated = get_profile(args.profile).name in CALIBRATED
    out = {"shape": shape.name, "ranks": args.ranks, "profile": args.profile, "pass": "bwd",
           **table[0], "tflops_per_gpu": flops / (table[0]["predicted_us"] * 1e-6) / 1e12,
           "calibrated": calibrated}
    if args.table:
        out["table"] = table
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{shape.name} backward on {args.profile} x{args.ranks}: num_comm_sms="
              f"{out['num_comm_sms']} minibatch_tokens={out['minibatch_tokens']} -> predicted "
              f"{out['predicted_us']:.0f} us, {out['tflops_per_gpu']:.0f} TFLOP/s per GPU "
              + ("(simulated: its GEMM tasks' speed fitted to the backward megakernel on one "
                 "H200 at R = 1; its other one-GPU timings, virtual ranks and a group rank's "
                 "comm CTAs included, held out within -12 to +3 %; NVLink unmeasured)"
                 if calibrated else "(simulated, not measured: no backward timing on this "
                 "profile)"))
        for row in table[1:] if args.table else ():
            print(f"  {row['num_comm_sms']:3d} comm SMs, minibatch {row['minibatch_tokens']!s:>5}: "
                  f"{row['predicted_us']:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
