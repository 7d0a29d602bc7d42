"""The backward megakernel in the simulator (issue 32): every rank's backward task list
(``mok_cute.tasks_backward``) as one task graph the engine runs, costed like the forward's
(``model.py``), and the search over its comm split and minibatch (``tune_backward``).

Costs:
- GEMM tiles: ``overhead + max(tile FLOPs / per-SM tensor rate, HBM bytes / per-SM share)``,
  over the kind's measured speed (``BackwardEfficiency``, below).
  FC2_DGRAD (tile_m x dgated_tile_n x H): its dy tile once per M-tile's N-tiles, its W_down
  tile once per the M-tiles of its (minibatch, expert) group in flight on that N-tile (the
  list's raster: raster_m of them, more when the N-tiles fill fewer than the compute SMs), and
  per output element the saved g, u read and dG, dU, w*h written (5 bf16). FC1_DGRAD (tile_m x
  dx_tile_n x 2I): the same over [W_gate; W_up]. Weight gradients (block x block x an expert's
  rows): the expert's operands read from HBM once for all its tiles (they run together), one
  (down) or two (gate, up) bf16 outputs written.
- REVERSE_COMBINE and REPULL_X: pulls, like the forward's dispatch (the source's egress, the
  receiver's ingress); REVERSE_DISPATCH: pushes, like its combine. Rows whose source is the
  receiver cost no flow (read and written in place). A comm task's latency is the profile's
  per row (fitted on the forward's 128-row tasks) over its ``comm_task_rows``
  (``comm_rows_profile``). BARRIER: the group barrier's latency;
  every rank's KSUM waits on every rank's BARRIER. KSUM: K dx rows (and a shared row) read,
  one d_x row written, over the per-SM HBM share (over a group, as the kernel's group tail
  does, they go by ticket to whichever SM is past its own queue, ``Graph.tail_queues``, each
  at one SM's share of HBM among all the SMs).
One rank (R = 1) runs without comm tasks and without comm SMs (the list's in-place form),
after the two launches that gather d_out's and x's rows into the schedule's order
(``BackwardSimResult.gather_s``: their bytes over HBM, part of its time).

The rates are the forward's. Against the H200 (``mok_cute.bench.calibrate.fit_backward``,
``benchmarks/sim/backward_calibration.json``): at R = 1 on the five single-GPU shapes the model
as is ran the backward megakernel's dgrads alone 13-22 % and its one launch 10-18 % faster than
measured (2026-12-03 probe runs, 8 rounds); the fit puts the dgrad tasks at 0.845 and the
weight gradients at 0.909 of the model's speed (``CALIBRATED``; residuals -8 to +3 %, each
shape left out -10 to +4 %). Held out: the whole backward at R = 1 (bench of record) within
-4 to +1 %; MoK's shapes at T = 2048 (an older kernel) -7 to +2 %; 8 virtual ranks in one
launch -12 to +3 % (simulated as one rank of their work); rank 0 of 8 over a group's buffers on
one GPU with 16 / 32 comm CTAs -11 to -1 %, where the comm CTAs move rows slower than the
forward's fit says (qwen3.5 on 8 of them: 1.43 x its time on 16 measured, 1.17 simulated). No
NVLink timing of the backward exists: the link side is the forward's model, unchecked.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..constants import fc2_dgrad_pingpong, fc2_dgrad_tile_n
from ..tasks import Role
from ..tasks_backward import (BackwardCounter as BC, BackwardListParams,
                              BackwardTaskType as BT, build_backward_task_list,
                              expert_tile_ranges)
from .engine import SimRecords, run_graph
from .hardware import HardwareProfile, get_profile
from .model import Graph, Routing, SimShape, _GraphBuilder, receive_layouts, route

__all__ = ["BackwardEfficiency", "BackwardSimConfig", "BackwardSimResult", "CALIBRATED",
           "UNCALIBRATED", "build_backward_graph", "comm_rows_profile", "efficiency_for",
           "simulate_backward", "tune_backward"]

_BF16 = 2
_PULLS = (BT.REVERSE_COMBINE, BT.REPULL_X)
_DGRADS = (BT.FC2_DGRAD, BT.FC1_DGRAD, BT.SHARED_FC2_DGRAD, BT.SHARED_FC1_DGRAD)


@dataclasses.dataclass(frozen=True)
class BackwardEfficiency:
    """Speed of the backward megakernel's tasks against this model at the profile's rates, per
    kind (model time / measured time; each task of the kind runs ``1 / factor`` times its
    modelled duration). 1: the model as is."""
    dgrad: float = 1.0  # FC2_DGRAD, FC1_DGRAD and the shared expert's dgrads
    wgrad: float = 1.0  # the weight gradients, routed and shared

    def __post_init__(self):
        for f in ("dgrad", "wgrad"):
            if not getattr(self, f) > 0:
                raise ValueError(f"BackwardEfficiency.{f} must be > 0, got {getattr(self, f)!r}")


UNCALIBRATED = BackwardEfficiency()
# fitted by mok_cute.bench.calibrate.fit_backward (0.8446 / 0.9091) to the backward
# megakernel's dgrads alone and one launch at R = 1 on the five single-GPU shapes of one H200
# (calibrate.BACKWARD_PROBES; module docstring); other profiles: unmeasured, the model as is
CALIBRATED = {"h200_hgx": BackwardEfficiency(dgrad=0.845, wgrad=0.909)}
# The rows of the DISPATCH tasks whose records the profile's comm latency was fitted on
# (hardware.py: comm_task_overhead_s, per-row latency valid for 128-row tasks)
_COMM_FIT_ROWS = 128


def efficiency_for(hw: HardwareProfile) -> BackwardEfficiency:
    """The profile's measured speeds (``CALIBRATED``), else the model as is."""
    return CALIBRATED.get(hw.name, UNCALIBRATED)


# ``BackwardSimConfig.minibatch_tokens``: one minibatch of every M-tile, what the backward
# megakernel runs (``megakernel_backward.tiles_per_minibatch``: its pingpong FC2 phase needs
# every FC2 dgrad ahead of the FC1 dgrads)
ONE_MINIBATCH = 0


@dataclasses.dataclass(frozen=True)
class BackwardSimConfig:
    num_comm_sms: int  # ignored (0) at R = 1
    minibatch_tokens: int = 1024  # ONE_MINIBATCH: the kernel's
    tile_m: int = 128
    comm_task_rows: int = 32
    # the kernel's: over a group the backward megakernel pulls x's rows again for the weight
    # gradients (megakernel_backward.task_list); one rank reads them in place
    x_resident: bool = False


@dataclasses.dataclass
class BackwardSimResult:
    graph: Graph
    time_s: float  # the slowest rank's last task, after gather_s
    rank_time_s: np.ndarray  # [R]
    flops_per_rank: float  # 12 (T K H I + T H Is): MoK's backward formula
    compute_busy: float  # compute SMs' busy fraction of R * time * compute SMs
    records: SimRecords | None = None  # every task's take, start and end, from the launch
    gather_s: float = 0.0  # R = 1: the row gathers before the launch

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_rank / self.time_s / 1e12


def _params(shape: SimShape, cfg: BackwardSimConfig, R: int) -> BackwardListParams:
    minibatch = cfg.minibatch_tokens
    if minibatch == ONE_MINIBATCH:  # past any rank's rows: every (peer, token, k) and padding
        rows = R * shape.tokens_per_rank * shape.top_k + shape.num_experts * cfg.tile_m
        minibatch = -(-rows // cfg.tile_m) * cfg.tile_m
    return BackwardListParams(
        hidden=shape.hidden, intermediate=shape.intermediate, num_tokens=shape.tokens_per_rank,
        dgated_tile_n=fc2_dgrad_tile_n(fc2_dgrad_pingpong(shape.hidden)),  # the kernel's form
        top_k=shape.top_k, tile_m=cfg.tile_m, minibatch_tokens=minibatch,
        comm_task_rows=cfg.comm_task_rows, shared_intermediate=shape.shared_intermediate,
        comm_tasks=R > 1, x_resident=cfg.x_resident or R == 1)


def _durations(tl, lay, e_loc: int, p: BackwardListParams, hw: HardwareProfile,
               n_compute: int, eff: BackwardEfficiency = UNCALIBRATED):
    hbm = hw.hbm_bytes_per_s / max(n_compute, 1)
    tm, H, I = p.tile_m, p.hidden, p.intermediate
    tpm = p.minibatch_tokens // tm
    group_tiles = (np.bincount((np.arange(lay.num_tiles) // tpm) * e_loc + lay.tile_expert)
                   if lay.num_tiles else np.zeros(0, dtype=np.int64))
    n_dg, n_dx = -(-I // p.dgated_tile_n), -(-H // p.dx_tile_n)
    # M-tiles in flight on one weight N-tile: the list's raster runs raster_m M-tiles of an
    # N-tile together (N-tiles outer), more when its N-tiles fill fewer than the SMs
    window_dg, window_dx = (max(p.raster_m, n_compute // n) for n in (n_dg, n_dx))
    rows_of = np.diff(expert_tile_ranges(lay.tile_expert, e_loc)) * tm
    dur = np.zeros(len(tl))
    for i, t in enumerate(tl):
        if t.role == Role.COMM and t.type != BT.KSUM:
            dur[i] = hw.barrier_latency_s if t.type == BT.BARRIER else hw.comm_serial_s
            continue
        if t.type in (BT.FC2_DGRAD, BT.FC1_DGRAD):
            grp = (t.tile // tpm) * e_loc + int(lay.tile_expert[t.tile])
            reuse = min(int(group_tiles[grp]), window_dg if t.type == BT.FC2_DGRAD else window_dx)
            if t.type == BT.FC2_DGRAD:
                k, tn, ntiles, out_bytes = H, p.dgated_tile_n, n_dg, 5 * tm * p.dgated_tile_n * _BF16
            else:
                k, tn, ntiles, out_bytes = 2 * I, p.dx_tile_n, n_dx, tm * p.dx_tile_n * _BF16
            mem = tm * k * _BF16 / ntiles + tn * k * _BF16 / reuse + out_bytes
            flops = 2.0 * tm * tn * k
        elif t.type in (BT.SHARED_FC2_DGRAD, BT.SHARED_FC1_DGRAD):
            Is = p.shared_intermediate
            k, tn = (H, p.dgated_tile_n) if t.type == BT.SHARED_FC2_DGRAD else (2 * Is, p.dx_tile_n)
            flops = 2.0 * tm * tn * k
            mem = tm * k * _BF16 + tn * k * _BF16 / max(1, n_compute // max(n_dx, 1)) + \
                (5 if t.type == BT.SHARED_FC2_DGRAD else 1) * tm * tn * _BF16
        elif t.type in (BT.WGRAD_GATE_UP, BT.WGRAD_DOWN, BT.SHARED_WGRAD_GATE_UP,
                        BT.SHARED_WGRAD_DOWN):
            gated = t.type in (BT.WGRAD_GATE_UP, BT.SHARED_WGRAD_GATE_UP)
            bm, bn = p.wgrad_gate_up_tile if gated else p.wgrad_down_tile
            rows = (int(rows_of[t.tile]) if t.type in (BT.WGRAD_GATE_UP, BT.WGRAD_DOWN)
                    else -(-p.num_tokens // tm) * tm)
            outs = 2 if gated else 1
            m_dim, n_dim = (I if t.type == BT.WGRAD_GATE_UP else p.shared_intermediate, H) \
                if gated else (H, I if t.type == BT.WGRAD_DOWN else p.shared_intermediate)
            tasks = -(-m_dim // bm) * -(-n_dim // bn)
            flops = 2.0 * outs * bm * bn * rows
            # an expert's tiles run together: its operands come from HBM once, shared by them
            mem = (outs * m_dim + n_dim) * rows * _BF16 / tasks + outs * bm * bn * _BF16
        elif t.type == BT.KSUM:
            flops = 0.0
            rows = min(p.ksum_rows, max(p.num_tokens - t.tile * tm - t.n_tile * p.ksum_rows, 0))
            reads = p.top_k + (1 if p.shared_intermediate else 0)
            mem = rows * H * _BF16 * (reads + 1)
            if t.role == Role.COMM:  # over a group: by ticket on any free SM, all SMs' share
                dur[i] = hw.gemm_task_overhead_s + mem / (hw.hbm_bytes_per_s / hw.num_sms)
                continue
        else:  # the in-place BARRIER (compute role)
            dur[i] = hw.barrier_latency_s
            continue
        speed = 1.0 if not flops else eff.dgrad if t.type in _DGRADS else eff.wgrad  # KSUM: 1
        dur[i] = (hw.gemm_task_overhead_s + max(flops / hw.sm_tensor_flops, mem / hbm)) / speed
    return dur


def comm_rows_profile(hw: HardwareProfile, rows: int) -> HardwareProfile:
    """``hw`` with its comm latency, per row and fitted on 128-row tasks, spent on ``rows``."""
    if rows == _COMM_FIT_ROWS or hw.comm_latency_s == 0.0:
        return hw
    return hw.replace(comm_task_overhead_s=hw.comm_serial_s + hw.comm_latency_s * rows
                      / _COMM_FIT_ROWS, source=f"{hw.sources.get('comm_task_overhead_s', '')}; "
                      f"its latency scaled to {rows}-row tasks (sim.backward)")


def build_backward_graph(shape: SimShape, num_ranks: int, routing: Routing,
                         cfg: BackwardSimConfig, hw: HardwareProfile,
                         topk_idx: np.ndarray | None = None,
                         efficiency: BackwardEfficiency | None = None) -> tuple[Graph, list]:
    """Every rank's backward list as one graph (module docstring); also the lists. The
    graph's ``meta["hw"]`` is the profile to run it on (comm latency over the task's rows);
    ``efficiency``: None for the profile's calibration (``CALIBRATED``)."""
    eff = efficiency_for(hw) if efficiency is None else efficiency
    hw = comm_rows_profile(hw, cfg.comm_task_rows)
    R = num_ranks
    if R < 1 or R > hw.num_gpus:
        raise ValueError(f"num_ranks must be in [1, {hw.num_gpus}] for profile {hw.name}, got {R}")
    n_comm = cfg.num_comm_sms if R > 1 else 0
    if R > 1 and not 1 <= n_comm < hw.num_sms:
        raise ValueError(f"num_comm_sms must be in [1, {hw.num_sms}) with {R} ranks, got {n_comm}")
    n_compute = hw.num_sms - n_comm
    if topk_idx is None:
        topk_idx = route(shape, R, routing)
    layouts = receive_layouts(topk_idx, shape.num_experts, cfg.tile_m, cfg.comm_task_rows)
    p = _params(shape, cfg, R)
    e_loc = shape.num_experts // R
    b = _GraphBuilder(R, 2 * R, False)
    cs = cfg.tile_m // cfg.comm_task_rows
    row_bytes = shape.hidden * _BF16
    lists, barrier_counters, ksum_ids = [], [], []
    for lay in layouts:
        r = lay.rank
        tl = build_backward_task_list(lay.tile_expert, e_loc, p)
        lists.append(tl)
        groups = list(BC)
        offsets = np.concatenate([[0], np.cumsum([tl.counter_sizes[g] for g in groups])])
        coff = b.add_counters(None, offsets)
        counter = {g: coff + int(offsets[i]) for i, g in enumerate(groups)}
        n = len(tl)
        signal = np.array([counter[t.signal[0]] + t.signal[1] for t in tl], dtype=np.int64)
        lens, flat = [], []
        for t in tl:
            ids = [counter[g] + first + i for g, first, count, _ in t.waits
                   if g != BC.BARRIER_DONE for i in range(count)]  # the group barrier: below
            lens.append(len(ids))
            flat.extend(ids)
        comm_bytes, link = np.zeros(n), np.zeros(n)
        coef_rows, cls = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        for i, t in enumerate(tl):
            if t.type not in (*_PULLS, BT.REVERSE_DISPATCH):
                continue
            per_peer = lay.chunk_peer_rows[t.tile * cs + t.n_tile].astype(np.float64) * row_bytes
            tot = per_peer.sum()
            remote = tot - per_peer[r]
            comm_bytes[i] = link[i] = remote  # own rows: read and written in place
            frac = per_peer / tot if tot > 0 else np.zeros(R)
            frac[r] = 0.0
            coef = np.zeros((1, 2 * R))
            pull = t.type in _PULLS
            if pull:  # the source's egress, this rank's ingress
                coef[0, :R] = frac
                coef[0, R + r] = remote / tot if tot > 0 else 0.0
            else:  # this rank's egress, the source's ingress
                coef[0, r] = remote / tot if tot > 0 else 0.0
                coef[0, R:] = frac
            coef_rows[i] = b.add_coef(coef)[0]
            cls[i] = r if pull else R + r
        base = b.add_tasks(
            rank=np.full(n, r), role=np.array([int(t.role) for t in tl]),
            type=np.array([int(t.type) for t in tl]), local_id=np.arange(n),
            tile=np.array([t.tile for t in tl]), signal=signal,
            waits=(np.array(lens, dtype=np.int64), np.array(flat, dtype=np.int64)),
            duration=_durations(tl, lay, e_loc, p, hw, n_compute, eff), comm_bytes=comm_bytes,
            comm_class=cls, comm_row=coef_rows, link_bytes=link,
            flops=np.array([t.flops for t in tl]), minibatch=np.array([t.minibatch for t in tl]),
            receiver=np.full(n, -1))
        barrier_counters.append(counter[BC.BARRIER_DONE])
        ksum_ids.extend(base + t.index for t in tl if t.type == BT.KSUM)
    # every rank's KSUM waits on every rank's BARRIER (the group barrier)
    if ksum_ids:
        bc = np.asarray(barrier_counters, dtype=np.int64)
        owners = np.asarray(ksum_ids, dtype=np.int64)
        b.extra_waits.append((np.repeat(owners, bc.size), np.tile(bc, owners.size)))
    g = b.finish(n_comm, n_compute)
    if n_comm:  # the KSUMs leave the comm queues: any SM past its own queue takes them
        g.tail_queues = []
        for per_role in g.queues:
            comm = per_role[int(Role.COMM)]
            is_ksum = g.type[comm] == int(BT.KSUM)
            g.tail_queues.append(comm[is_ksum])
            per_role[int(Role.COMM)] = comm[~is_ksum]
    g.meta.update(shape=shape, routing=routing, cfg=cfg, hw=hw, layouts=layouts, lists=lists,
                  efficiency=eff)
    return g, lists


def simulate_backward(shape: SimShape | str, num_ranks: int, config: BackwardSimConfig,
                      profile: HardwareProfile | str = "h200_hgx",
                      routing: Routing = Routing(), *,
                      topk_idx: np.ndarray | None = None,
                      efficiency: BackwardEfficiency | None = None) -> BackwardSimResult:
    """Simulate one layer backward on every rank of an EP group of ``num_ranks`` GPUs
    (``efficiency``: None for the profile's calibration, ``UNCALIBRATED`` for the model as is)."""
    hw = get_profile(profile)
    if isinstance(shape, str):
        shape = SimShape.named(shape)
    g, _ = build_backward_graph(shape, num_ranks, routing, config, hw, topk_idx, efficiency)
    rec = run_graph(g, g.meta["hw"])
    rank_time = np.array([rec.end[g.rank == r].max(initial=0.0) for r in range(num_ranks)])
    span = float(rank_time.max())
    # one rank: d_out's and x's rows gathered into the schedule's order by two launches
    # before the list's (expert_backward.routed_rows): real rows read, padded rows written
    rows = shape.tokens_per_rank * shape.top_k + g.meta["layouts"][0].num_tiles * config.tile_m
    gather_s = 2 * rows * shape.hidden * _BF16 / hw.hbm_bytes_per_s if num_ranks == 1 else 0.0
    busy = float((rec.end - rec.start)[g.role == int(Role.COMPUTE)].sum())
    flops = 12.0 * shape.hidden * shape.tokens_per_rank * (
        shape.top_k * shape.intermediate + shape.shared_intermediate)
    return BackwardSimResult(g, span + gather_s, rank_time + gather_s, flops,
                             busy / max(span * g.num_compute_sms * num_ranks, 1e-30), rec,
                             gather_s)


def tune_backward(shape: SimShape | str, num_ranks: int,
                  profile: HardwareProfile | str = "h200_hgx", routing: Routing = Routing(), *,
                  comm_sms=(8, 16, 24, 32, 40), minibatch_tokens=(ONE_MINIBATCH,),
                  comm_task_rows: int = 32) -> tuple[BackwardSimConfig, list]:
    """The (comm SMs, minibatch) of least simulated backward time, and every candidate's
    (config, time_s), fastest first. One rank has no comm SMs: only the minibatch varies. The
    default minibatch is the kernel's one (``ONE_MINIBATCH``); others are what-ifs of the
    task list (the kernel takes none of them)."""
    if isinstance(shape, str):
        shape = SimShape.named(shape)
    topk_idx = route(shape, num_ranks, routing)
    splits = comm_sms if num_ranks > 1 else (0,)
    rows = []
    for c in splits:
        for mb in minibatch_tokens:
            cfg = BackwardSimConfig(num_comm_sms=c, minibatch_tokens=mb,
                                    comm_task_rows=comm_task_rows)
            res = simulate_backward(shape, num_ranks, cfg, profile, routing, topk_idx=topk_idx)
            rows.append((cfg, res.time_s))
    rows.sort(key=lambda row: row[1])
    return rows[0][0], rows
