"""What the simulator runs: shapes, routing, per-rank receive layouts and the task graph.

One layer call of an EP group of R ranks becomes one task graph: every rank's megakernel task
list (``mok_cute.tasks``, built from that rank's actual tile count) with its per-task costs:

- GEMM tiles (FC1, FC2, shared): ``overhead + max(tile FLOPs / per-SM tensor rate,
  HBM bytes / per-SM share of HBM)``. The tile always computes ``tile_m x tile_n`` (padding
  rows and partial N-tiles cost full time). HBM bytes assume L2 reuse inside what runs at
  once: the A tile is read once per M-tile (its N-tiles run back to back), a weight tile once
  per (minibatch, expert) group of up to ``compute SMs / N-tiles`` M-tiles.
- KSUM: its bytes over the per-SM share of HBM.
- DISPATCH / COMBINE: a fixed overhead, then a flow of the payload bytes through the fabric
  (engine.py): pull dispatch reads from each source peer (egress of the peer, ingress of the
  receiver), combine writes back (egress of the receiver, ingress of each source peer).
  Rows whose source is the receiver itself are a local copy (no link); with ``local_direct``
  (the kernel's default, ``MegakernelOptions.rows_in_place``) they are not copied at all while the
  ring holds every row of the rank: only the task overhead remains.
- BARRIER: ``barrier_latency_s``; every rank's KSUM waits on every rank's BARRIER.

``SimConfig.precision="fp8"`` (``MoKConfig(precision="fp8")``'s megakernel, forward): DISPATCH
copies packed e4m3 x rows (``fp8.packed_row_bytes`` of H padded to whole 128 groups), COMBINE
still bf16 y rows; the routed FC1 / FC2 tiles run at ``sm_fp8_tensor_flops`` over K padded to
whole 128 groups, their operands 1 byte an element plus the rows' and blocks' exponents, FC1's
h stored as e4m3. The shared expert and KSUM stay bf16. x's quantization (a pass before the
launch) is not modelled.

Push dispatch (``dispatch="push"``, for study (a)): the receivers' DISPATCH tasks are replaced
by sender-side tasks, one per (sender, receiver, receiver minibatch) chunk of at most
``tile_m`` rows, in each sender's comm queue; a receiver's FC1 of a minibatch waits on every
push into that minibatch (so push is compared with pull at ``dispatch_wait="minibatch"``), a
push waits on the receiver's ring slot (the receiver's FC1 of the previous occupant).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import tasks as T
from ..config import PRECISIONS
from ..expert_path_fp8 import padded
from ..fp8 import GROUP, packed_row_bytes
from ..schedule import schedule_capacity
from ..shapes import SHAPES, Shape
from .hardware import HardwareProfile

__all__ = [
    "SimShape",
    "Routing",
    "SimConfig",
    "RankLayout",
    "Graph",
    "route",
    "expert_owner",
    "receive_layouts",
    "build_graph",
    "dispatch_row_bytes",
]

_BF16 = 2


@dataclasses.dataclass(frozen=True)
class SimShape:
    name: str
    tokens_per_rank: int
    hidden: int
    intermediate: int
    num_experts: int  # routed experts of the whole EP group
    top_k: int
    shared_intermediate: int = 0

    def __post_init__(self):
        for f in ("tokens_per_rank", "hidden", "intermediate", "num_experts", "top_k"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"SimShape.{f} must be an int >= 1, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"SimShape.top_k must be <= num_experts={self.num_experts}, "
                             f"got {self.top_k}")
        if self.shared_intermediate < 0:
            raise ValueError(f"SimShape.shared_intermediate must be >= 0, got "
                             f"{self.shared_intermediate}")

    @classmethod
    def named(cls, name: str) -> SimShape:
        """A shape of ``mok_cute.shapes.SHAPES`` (EP shapes: tokens per rank; their shared
        expert has size I)."""
        if name not in SHAPES:
            raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {name!r}")
        return cls.of(SHAPES[name])

    @classmethod
    def of(cls, s: Shape) -> SimShape:
        """A ``mok_cute.shapes.Shape`` (its tokens per rank; a shared expert of size I)."""
        return cls(name=s.name, tokens_per_rank=s.tokens, hidden=s.hidden,
                   intermediate=s.intermediate, num_experts=s.experts, top_k=s.top_k,
                   shared_intermediate=s.intermediate if s.shared else 0)

    def layer_flops(self) -> float:
        """Per-rank forward FLOPs by MoK's formula 6*(T*K + T*[shared])*H*I (with a shared
        expert of size Is != I counted as 6*T*H*Is)."""
        t = self.tokens_per_rank
        return 6.0 * self.hidden * (t * self.top_k * self.intermediate
                                    + t * self.shared_intermediate)


MOK_SHAPES = ("kimi_k2.7", "glm_5.2", "qwen3.5_397b", "dsv4_pro")


@dataclasses.dataclass(frozen=True)
class Routing:
    """``uniform``: each token picks top_k distinct experts uniformly. ``skew``: a fraction
    ``hot_fraction`` of all tokens (on every rank) picks ``hot_expert`` as one of its top_k,
    the rest of the choices uniform over the other experts."""

    kind: str = "uniform"
    hot_fraction: float = 0.0
    hot_expert: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("uniform", "skew"):
            raise ValueError(f"Routing.kind must be 'uniform' or 'skew', got {self.kind!r}")
        if not 0.0 <= self.hot_fraction <= 1.0:
            raise ValueError(f"Routing.hot_fraction must be in [0, 1], got {self.hot_fraction}")

    @property
    def label(self) -> str:
        return "uniform" if self.kind == "uniform" else f"skew{self.hot_fraction:g}"


@dataclasses.dataclass(frozen=True)
class SimConfig:
    num_comm_sms: int
    minibatch_tokens: int
    ring_tokens: int
    tile_m: int = 128
    fc1_tile_n: int = 256
    fc2_tile_n: int = 256
    dispatch: str = "pull"  # "pull" | "push" (per-pair fair links) | "push_hol" (FIFO egress)
    dispatch_wait: str = "tile"
    comm_task_rows: int | None = None
    dispatch_lookahead_tokens: int | None = None
    local_direct: bool = True  # as MegakernelOptions.rows_in_place: own rows never cross a comm CTA
    fc1_lead: int = 0  # tasks.build_task_list's: FC1 of minibatch m + 1 queued before FC2 of m
    precision: str = "bf16"  # MoKConfig.precision: "fp8" packs dispatched rows, FP8 routed GEMMs

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"SimConfig.precision must be one of {PRECISIONS}, got "
                             f"{self.precision!r}")
        if self.dispatch not in ("pull", "push", "push_hol"):
            raise ValueError(f"SimConfig.dispatch must be 'pull', 'push' or 'push_hol', got "
                             f"{self.dispatch!r}")
        if self.num_comm_sms < 1:
            raise ValueError(f"SimConfig.num_comm_sms must be >= 1, got {self.num_comm_sms}")


def dispatch_row_bytes(hidden: int, precision: str = "bf16") -> int:
    """Bytes DISPATCH copies per x row: bf16, or FP8's packed row (the megakernel's ring rows:
    e4m3 data of H padded to whole 128 groups, then the row's exponents padded to 16 B)."""
    return packed_row_bytes(padded(hidden)) if precision == "fp8" else hidden * _BF16


def _distinct_uniform(rng, n, k, e_avail):
    """n rows of k distinct ints from range(e_avail) (rejection on duplicate rows)."""
    if k > e_avail:
        raise ValueError(f"cannot pick {k} distinct experts out of {e_avail}")
    if 2 * k > e_avail:  # dense regime: random permutations
        return np.argsort(rng.random((n, e_avail)), axis=1)[:, :k]
    out = rng.integers(0, e_avail, size=(n, k))
    while k > 1:
        s = np.sort(out, axis=1)
        dup = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
        if dup.size == 0:
            break
        out[dup] = rng.integers(0, e_avail, size=(dup.size, k))
    return out


def route(shape: SimShape, num_ranks: int, routing: Routing = Routing()) -> np.ndarray:
    """Global expert ids ``[R, T, K]`` (int32), distinct per token, deterministic per seed."""
    rng = np.random.default_rng(routing.seed)
    R, Tk, K, E = num_ranks, shape.tokens_per_rank, shape.top_k, shape.num_experts
    n = R * Tk
    if routing.kind == "uniform" or routing.hot_fraction == 0.0:
        ids = _distinct_uniform(rng, n, K, E)
    else:
        h = routing.hot_expert
        if not 0 <= h < E:
            raise ValueError(f"Routing.hot_expert must be in [0, {E}), got {h}")
        hot = rng.random(n) < routing.hot_fraction
        ids = np.empty((n, K), dtype=np.int64)
        rows = np.flatnonzero(hot)
        # hot tokens: the hot expert in a random slot plus K-1 others
        others = _distinct_uniform(rng, rows.size, K - 1, E - 1) if K > 1 else \
            np.zeros((rows.size, 0), dtype=np.int64)
        others = others + (others >= h)
        slot = rng.integers(0, K, size=rows.size)
        full = np.insert(others, 0, h, axis=1) if K > 1 else np.full((rows.size, 1), h)
        perm = (np.arange(K)[None, :] + slot[:, None]) % K  # rotate h into its slot
        ids[rows] = np.take_along_axis(full, np.argsort(perm, axis=1), axis=1)
        # the other tokens avoid the hot expert (unless K == E leaves no choice)
        cold = np.flatnonzero(~hot)
        if K <= E - 1:
            c = _distinct_uniform(rng, cold.size, K, E - 1)
            ids[cold] = c + (c >= h)
        else:
            ids[cold] = _distinct_uniform(rng, cold.size, K, E)
    return ids.reshape(R, Tk, K).astype(np.int32)


def expert_owner(num_experts: int, num_ranks: int) -> np.ndarray:
    """Rank owning each global expert: contiguous balanced blocks (``e * R // E``); equals
    ``e // E_loc`` when R divides E (the layout of DESIGN §1)."""
    return (np.arange(num_experts, dtype=np.int64) * num_ranks) // num_experts


@dataclasses.dataclass
class RankLayout:
    rank: int
    experts: np.ndarray  # global ids of the local experts
    expert_counts: np.ndarray  # real rows per local expert
    tile_rows: np.ndarray  # [nt] real rows per M-tile
    tile_expert: np.ndarray  # [nt] local expert index of each M-tile
    chunk_peer_rows: np.ndarray  # [nt * chunks_per_tile, R] real rows per (comm chunk, peer)
    row_peer: np.ndarray | None = None  # [nt * tile_m] source peer per padded row (-1 padding)

    @property
    def num_tiles(self) -> int:
        return int(self.tile_rows.size)


def receive_layouts(topk_idx: np.ndarray, num_experts: int, tile_m: int = 128,
                    comm_task_rows: int | None = None, ranks=None,
                    keep_rows: bool = False) -> list[RankLayout]:
    """Every rank's receive-schedule layout, the same row order as
    ``mok_cute.schedule.build_receive_schedule`` (rows of an expert round-robin over peers,
    each peer's rows in (token, k) order, segments padded to ``tile_m``); tested against it."""
    topk_idx = np.asarray(topk_idx)
    R = topk_idx.shape[0]
    cr = tile_m if comm_task_rows is None else comm_task_rows
    cs = tile_m // cr
    flat = topk_idx.reshape(R, -1).astype(np.int64)
    counts = np.bincount((flat * R + np.arange(R)[:, None]).ravel(),
                         minlength=num_experts * R).reshape(num_experts, R)
    owner = expert_owner(num_experts, R)
    out = []
    for r in (range(R) if ranks is None else ranks):
        experts = np.flatnonzero(owner == r)
        C = counts[experts]  # [E_loc, R]
        e_loc = experts.size
        per_expert = C.sum(axis=1)
        tiles_per_expert = -(-per_expert // tile_m)
        nt = int(tiles_per_expert.sum())
        cnt = C.ravel()
        le = np.repeat(np.repeat(np.arange(e_loc), R), cnt)
        peer = np.repeat(np.tile(np.arange(R), e_loc), cnt)
        within = np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        key = (le * (int(cnt.max(initial=0)) + 1) + within) * R + peer
        order = np.argsort(key, kind="stable")
        le, peer = le[order], peer[order]
        real_start = np.concatenate([[0], np.cumsum(per_expert)])
        pad_start = np.concatenate([[0], np.cumsum(tiles_per_expert * tile_m)])
        pos = pad_start[le] + (np.arange(le.size) - real_start[le])
        chunk_peer = np.bincount((pos // cr) * R + peer, minlength=nt * cs * R).reshape(nt * cs, R)
        tile_rows = T.tile_rows_from_expert_counts(per_expert, tile_m)
        tile_expert = np.repeat(np.arange(e_loc), tiles_per_expert)
        row_peer = None
        if keep_rows:
            row_peer = np.full(nt * tile_m, -1, dtype=np.int64)
            row_peer[pos] = peer
        out.append(RankLayout(rank=r, experts=experts, expert_counts=per_expert,
                              tile_rows=tile_rows, tile_expert=tile_expert,
                              chunk_peer_rows=chunk_peer, row_peer=row_peer))
    return out


# ------------------------------------------------------------------------------------------
# the task graph the engine runs


@dataclasses.dataclass
class Graph:
    """All ranks' tasks. Waits are on counters: a task may start once every counter it waits
    on has been signalled by all of its signallers (the kernel's (counter, target) waits)."""

    num_ranks: int
    num_comm_sms: int
    num_compute_sms: int
    rank: np.ndarray  # [N]
    role: np.ndarray
    type: np.ndarray
    local_id: np.ndarray  # index in the rank's task list (the timeline task id)
    tile: np.ndarray  # M-tile (routed) / token tile (shared, KSUM), -1 otherwise
    signal: np.ndarray  # [N] global counter each task signals
    wait_off: np.ndarray  # [N+1] CSR into wait_idx
    wait_idx: np.ndarray  # global counters waited on
    num_signallers: np.ndarray  # [num_counters]
    queues: list  # [rank][role] -> array of global task ids in ticket order
    duration: np.ndarray  # compute: whole task; comm: fixed overhead before the flow
    comm_bytes: np.ndarray  # payload bytes of a comm task (0: no flow)
    comm_class: np.ndarray  # fabric sharing class of a comm task
    comm_coef: np.ndarray  # [N_comm_rows, 2R] port use per byte moved (egress 0..R-1, ingress R..)
    comm_row: np.ndarray  # [N] row of comm_coef, -1 for none
    link_bytes: np.ndarray  # [N] bytes a comm task puts on NVLink (non-local part)
    flops: np.ndarray  # executed MMA FLOPs of GEMM tasks
    symmetric: bool = False
    num_classes: int = 0
    num_spread_classes: int = 0
    receiver: np.ndarray | None = None  # dispatch: rank whose ring it fills; else -1
    # [rank] -> global task ids any SM of the rank takes, in order, once its own role's queue
    # is exhausted (the backward's KSUM tickets); None: none
    tail_queues: list | None = None
    meta: dict = dataclasses.field(default_factory=dict)

    def __len__(self):
        return int(self.rank.size)


@functools.lru_cache(maxsize=64)
def _cached_list(nt: int, key: tuple) -> T.TaskList:
    kw = dict(key)
    return T.build_task_list(np.full(nt, kw["tile_m"], dtype=np.int64), **kw)


def _list_kwargs(shape: SimShape, cfg: SimConfig, num_ranks: int, dispatch_wait: str) -> tuple:
    return tuple(sorted(dict(
        hidden=shape.hidden, intermediate=shape.intermediate, num_tokens=shape.tokens_per_rank,
        top_k=shape.top_k, minibatch_tokens=cfg.minibatch_tokens, ring_tokens=cfg.ring_tokens,
        tile_m=cfg.tile_m, fc1_tile_n=cfg.fc1_tile_n, fc2_tile_n=cfg.fc2_tile_n,
        shared_intermediate=shape.shared_intermediate, num_ranks=num_ranks,
        dispatch_wait=dispatch_wait, comm_task_rows=cfg.comm_task_rows,
        dispatch_lookahead_tokens=cfg.dispatch_lookahead_tokens, fc1_lead=cfg.fc1_lead).items()))


def task_list_for(shape: SimShape, cfg: SimConfig, num_ranks: int, num_tiles: int,
                  dispatch_wait: str | None = None) -> T.TaskList:
    """The megakernel's list for one rank with ``num_tiles`` M-tiles (structure only: the
    bytes of comm tasks assume full tiles; the graph uses the real per-peer rows)."""
    dw = dispatch_wait or cfg.dispatch_wait
    return _cached_list(int(num_tiles), _list_kwargs(shape, cfg, num_ranks, dw))


def _gemm_durations(tl: T.TaskList, lay: RankLayout, shape: SimShape, cfg: SimConfig,
                    hw: HardwareProfile, n_compute: int) -> np.ndarray:
    """Per-task compute time (s) of a rank's list (0 for comm tasks)."""
    p = tl.params
    tm = p.tile_m
    dur = np.zeros(len(tl))
    hbm_per_sm = hw.hbm_bytes_per_s / max(n_compute, 1)
    ty = tl.type
    tile = tl.m_tile_begin
    n1, n2 = tl.fc1_n_tiles, tl.fc2_n_tiles
    # M-tiles of the same expert inside one minibatch share weight tiles in L2, up to the
    # number of M-tiles in flight at once (compute SMs / N-tiles per M-tile).
    e_loc = max(int(lay.tile_expert.max(initial=-1)) + 1, 1)
    tpm = tl.tiles_per_minibatch
    if lay.num_tiles:
        group = (np.arange(lay.num_tiles) // tpm) * e_loc + lay.tile_expert
        group_tiles = np.bincount(group)[group]
    else:
        group_tiles = np.zeros(0, dtype=np.int64)
    st = -(-p.num_tokens // tm)
    specs = [
        # type, K dim, tile_n, n tiles, output columns per tile, reuse per task
        (T.TaskType.FC1, p.hidden, p.fc1_tile_n, n1, p.fc1_tile_n // 2),
        (T.TaskType.FC2, p.intermediate, p.fc2_tile_n, n2, p.fc2_tile_n),
        (T.TaskType.SHARED_FC1, p.hidden, p.fc1_tile_n,
         -(-2 * p.shared_intermediate // p.fc1_tile_n), p.fc1_tile_n // 2),
        (T.TaskType.SHARED_FC2, p.shared_intermediate, p.fc2_tile_n, n2, p.fc2_tile_n),
    ]
    fp8 = cfg.precision == "fp8"
    for ttype, kdim, tn, ntiles, outc in specs:
        idx = np.flatnonzero(ty == ttype)
        if not idx.size:
            continue
        window = max(1, n_compute // max(ntiles, 1))
        routed = ttype in (T.TaskType.FC1, T.TaskType.FC2)
        if routed:
            reuse = np.minimum(group_tiles[tile[idx]], window)
        else:
            reuse = np.full(idx.size, min(st, window))
        if fp8 and routed:  # the shared expert stays bf16
            kdim = padded(kdim)
            a_bytes = tm * packed_row_bytes(kdim) / ntiles  # rows from the ring, packed
            b_bytes = tn * kdim * (1 + 1 / GROUP**2) / reuse  # + one exponent per 128 x 128 block
            # FC1's h leaves as e4m3 (one 1 x 128 group a tile, one exponent); FC2's y as bf16
            c_bytes = tm * (outc + outc // GROUP) if ttype == T.TaskType.FC1 else tm * outc * _BF16
            rate = hw.sm_fp8_tensor_flops
        else:
            a_bytes = tm * kdim * _BF16 / ntiles
            b_bytes = tn * kdim * _BF16 / reuse
            c_bytes = tm * outc * _BF16
            rate = hw.sm_tensor_flops
        t_mma = 2.0 * tm * tn * kdim / rate
        t_mem = (a_bytes + b_bytes + c_bytes) / hbm_per_sm
        dur[idx] = hw.gemm_task_overhead_s + np.maximum(t_mma, t_mem)
    k = np.flatnonzero(ty == T.TaskType.KSUM)
    dur[k] = hw.gemm_task_overhead_s + tl.bytes[k] / hbm_per_sm
    return dur


def build_graph(shape: SimShape, num_ranks: int, routing: Routing, cfg: SimConfig,
                hw: HardwareProfile, *, symmetric: bool = False, dispatch_only: bool = False,
                topk_idx: np.ndarray | None = None) -> Graph:
    """The task graph of one layer call.

    ``symmetric``: simulate rank 0 only and mirror its port use (every other rank is assumed
    to do the same thing at the same time: under uniform routing each port's egress carries
    what its ingress carries). ``dispatch_only``: only the dispatch tasks (no ring reuse, no
    compute), to measure dispatch bandwidth alone.
    """
    R = num_ranks
    if R < 1 or R > hw.num_gpus:
        raise ValueError(f"num_ranks must be in [1, {hw.num_gpus}] for profile {hw.name}, "
                         f"got {R}")
    if cfg.num_comm_sms >= hw.num_sms:
        raise ValueError(f"num_comm_sms must be < {hw.num_sms} SMs of {hw.name}, "
                         f"got {cfg.num_comm_sms}")
    if symmetric and cfg.dispatch != "pull":
        raise ValueError(f"symmetric=True models pull dispatch only; got dispatch={cfg.dispatch!r}")
    n_compute = hw.num_sms - cfg.num_comm_sms
    if topk_idx is None:
        topk_idx = route(shape, R, routing)
    ranks = [0] if symmetric else list(range(R))
    layouts = receive_layouts(topk_idx, shape.num_experts, cfg.tile_m, cfg.comm_task_rows,
                              ranks=ranks)
    push = cfg.dispatch in ("push", "push_hol")
    dispatch_wait = "minibatch" if push else cfg.dispatch_wait
    if dispatch_only:
        cfg = dataclasses.replace(cfg, ring_tokens=max(
            cfg.ring_tokens, max(l.num_tiles for l in layouts) * cfg.tile_m))
    lists = [task_list_for(shape, cfg, R, lay.num_tiles, dispatch_wait) for lay in layouts]
    nports = 2 * R if not symmetric else 2
    b = _GraphBuilder(R, nports, symmetric)
    cs = cfg.tile_m // (cfg.comm_task_rows or cfg.tile_m)
    row_bytes = {T.TaskType.DISPATCH: dispatch_row_bytes(shape.hidden, cfg.precision),
                 T.TaskType.COMBINE: shape.hidden * _BF16}  # y rows stay bf16

    # the kernel's condition (megakernel.plan_for): the ring holds the static capacity
    local_direct = cfg.local_direct and not push and cfg.ring_tokens >= schedule_capacity(
        R, shape.tokens_per_rank, shape.top_k, shape.num_experts // R, cfg.tile_m)

    barrier_counters = []
    ksum_tasks = []
    for lay, tl in zip(layouts, lists):
        r = lay.rank
        n = len(tl)
        keep = np.ones(n, dtype=bool)
        if dispatch_only:
            keep = tl.type == T.TaskType.DISPATCH
        if push:
            keep &= tl.type != T.TaskType.DISPATCH
        dur = _gemm_durations(tl, lay, shape, cfg, hw, n_compute)
        is_comm = tl.role == T.Role.COMM
        dur[is_comm] = np.where(tl.type[is_comm] == T.TaskType.BARRIER, hw.barrier_latency_s,
                                hw.comm_serial_s)
        coff = b.add_counters(tl.counter_sizes, tl.counter_offsets)
        sig = coff + tl.counter_offsets[tl.signal_group] + tl.signal_index
        # waits, expanded to single counters (CSR); in push mode the FC1 waits on the
        # receiver's dispatch counters become placeholders for the push counters
        drop = [] if symmetric else [T.CounterGroup.BARRIER_DONE]  # re-added group-wide
        wlens, wflat = _expand_waits(
            tl, keep, coff, rank=r, skip_all=dispatch_only, drop_groups=drop,
            placeholder_groups=(T.CounterGroup.DISPATCHED, T.CounterGroup.DISPATCHED_MB)
            if push else ())
        # comm payloads
        comm_bytes = np.zeros(n)
        coef_rows = np.full(n, -1, dtype=np.int64)
        link = np.zeros(n)
        cls = np.full(n, -1, dtype=np.int64)
        for ttype, kind in ((T.TaskType.DISPATCH, 0), (T.TaskType.COMBINE, 1)):
            idx = np.flatnonzero((tl.type == ttype) & keep)
            if not idx.size:
                continue
            chunk = tl.m_tile_begin[idx] * cs + tl.n_tile[idx]
            per_peer = lay.chunk_peer_rows[chunk].astype(np.float64) * row_bytes[ttype]
            tot = per_peer.sum(axis=1)
            local = per_peer[:, r]
            comm_bytes[idx] = tot - local if local_direct else tot
            link[idx] = tot - local
            frac = np.divide(per_peer, tot[:, None], out=np.zeros_like(per_peer),
                             where=tot[:, None] > 0)
            nonlocal_frac = np.divide(tot - local, tot, out=np.zeros_like(tot), where=tot > 0)
            coef = np.zeros((idx.size, nports))
            if symmetric:
                coef[:, 0] = nonlocal_frac
                coef[:, 1] = nonlocal_frac
            else:
                frac[:, r] = 0.0
                if kind == 0:  # pull: source egress, receiver ingress
                    coef[:, :R] = frac
                    coef[:, R + r] = nonlocal_frac
                else:  # combine push-back: receiver egress, source ingress
                    coef[:, r] = nonlocal_frac
                    coef[:, R:] = frac
            coef_rows[idx] = b.add_coef(coef)
            cls[idx] = kind if symmetric else kind * R + r
        base = b.add_tasks(
            rank=np.full(keep.sum(), r), role=tl.role[keep], type=tl.type[keep],
            local_id=np.flatnonzero(keep), tile=np.where(tl.minibatch >= 0, tl.m_tile_begin,
                                                         tl.m_tile_begin)[keep],
            signal=sig[keep], waits=(wlens, wflat),
            duration=dur[keep], comm_bytes=comm_bytes[keep], comm_class=cls[keep],
            comm_row=coef_rows[keep], link_bytes=link[keep],
            flops=_executed_flops(tl, shape, cfg)[keep],
            minibatch=tl.minibatch[keep],
            receiver=np.where(tl.type[keep] == T.TaskType.DISPATCH, r, -1))
        b.rank_lists.append((r, tl, keep, base))
        if tl.params.finish and not dispatch_only:
            bar = int(np.flatnonzero(tl.type == T.TaskType.BARRIER)[0])
            barrier_counters.append(int(sig[bar]))
            ks = np.flatnonzero((tl.type == T.TaskType.KSUM) & keep)
            ksum_tasks.append((base, ks, np.flatnonzero(keep)))

    # every rank's KSUM waits on every rank's BARRIER (the group barrier)
    if not symmetric and barrier_counters:
        bc = np.asarray(barrier_counters, dtype=np.int64)
        for base, ks, kept in ksum_tasks:
            gids = base + np.searchsorted(kept, ks)
            b.extra_waits.append((np.repeat(gids, bc.size), np.tile(bc, gids.size)))

    if push:
        _add_push_dispatch(b, shape, cfg, hw, layouts, lists, R, row_bytes[T.TaskType.DISPATCH],
                           hol=cfg.dispatch == "push_hol")

    g = b.finish(cfg.num_comm_sms, n_compute)
    g.meta.update(shape=shape, routing=routing, cfg=cfg, hw=hw, layouts=layouts,
                  dispatch_only=dispatch_only, lists=lists)
    return g


def _executed_flops(tl: T.TaskList, shape: SimShape, cfg: SimConfig) -> np.ndarray:
    """The list's MMA FLOPs per task; FP8's routed GEMMs run K padded to whole 128 groups."""
    if cfg.precision != "fp8":
        return tl.flops
    flops = tl.flops.astype(np.float64)
    for ttype, k in ((T.TaskType.FC1, shape.hidden), (T.TaskType.FC2, shape.intermediate)):
        flops[tl.type == ttype] *= padded(k) / k
    return flops


_PLACEHOLDER_STRIDE = 1 << 24


def _expand_waits(tl, keep, coff, *, rank, skip_all, drop_groups, placeholder_groups):
    """CSR (lens, flat) of the single counters each kept task waits on."""
    w = tl.waits[keep]
    n = w.shape[0]
    if skip_all or n == 0:
        return np.zeros(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
    g, first, cnt = w[:, :, 0], w[:, :, 1], w[:, :, 2]
    valid = (g >= 0) & (cnt > 0)
    for dg in drop_groups:
        valid &= g != int(dg)
    ph = np.zeros_like(valid)
    for pg in placeholder_groups:
        ph |= g == int(pg)
    ph &= valid
    c = np.where(valid, np.where(ph, 1, cnt), 0)
    base = np.where(ph, -(1 + rank * _PLACEHOLDER_STRIDE + first),
                    coff + tl.counter_offsets[np.maximum(g, 0)] + first)
    cf, bf, pf = c.ravel(), base.ravel(), ph.ravel()
    total = int(cf.sum())
    within = np.arange(total) - np.repeat(np.cumsum(cf) - cf, cf)
    flat = np.repeat(bf, cf) + np.where(np.repeat(pf, cf), 0, within)
    return c.sum(axis=1), flat


def _add_push_dispatch(b, shape, cfg, hw, layouts, lists, R, row_bytes, hol):
    """Sender-side dispatch tasks replacing the receivers' pulls (see module docstring).
    ``hol``: all of a sender's pushes form one fabric class (a FIFO egress: a store stream
    stalled by a congested receiver stalls the sender's stores to every receiver); otherwise
    one class per (sender, receiver) pair (per-destination fair sharing, no head-of-line
    blocking)."""
    tm = cfg.tile_m
    # (receiver, minibatch) -> counter signalled by every push into it
    push_counter = {}
    push_tasks = []  # (sender, key, receiver, mb, rows, ring wait counters)
    for lay, tl in zip(layouts, lists):
        d = lay.rank
        tpm = tl.tiles_per_minibatch
        cs = tl.comm_chunks_per_tile
        tile_peer = lay.chunk_peer_rows.reshape(lay.num_tiles, cs, R).sum(axis=1)
        comm_q = tl.queue(T.Role.COMM)
        disp_pos = {}
        for qpos, i in enumerate(comm_q):
            if tl.type[i] == T.TaskType.DISPATCH:
                disp_pos.setdefault(int(tl.minibatch[i]), i)
        coff = b.counter_base[d]
        for m in range(tl.num_minibatches):
            tiles = np.arange(m * tpm, min((m + 1) * tpm, lay.num_tiles))
            rows_from = tile_peer[tiles].sum(axis=0)
            c = b.new_counter()
            push_counter[(d, m)] = c
            # ring: the receiver's FC1 of the previous occupants of these tiles
            ring = set()
            for j in tiles:
                for gq, first, count, _ in tl.waits[np.flatnonzero(
                        (tl.type == T.TaskType.DISPATCH) & (tl.m_tile_begin == j))[0]]:
                    if gq >= 0:
                        base = coff + int(tl.counter_offsets[gq]) + int(first)
                        ring.update(range(base, base + int(count)))
            key = int(disp_pos[m])  # list index of the receiver's first dispatch of m
            for s in range(R):
                rows = int(rows_from[s])
                for k in range(-(-rows // tm)):
                    nrows = min(tm, rows - k * tm)
                    push_tasks.append((s, key, (d - s) % R, d, m, nrows, c, sorted(ring)))
    # resolve the receivers' FC1 waits on their dispatch counters (placeholders)
    b.placeholders = {_PLACEHOLDER_STRIDE * d + m: c for (d, m), c in push_counter.items()}
    # add the push tasks, and merge them into each sender's comm queue by estimated time
    push_tasks.sort(key=lambda x: (x[0], x[1], x[2]))
    for s in range(R):
        mine = [p for p in push_tasks if p[0] == s]
        ids, keys = [], []
        for _, key, _, d, m, nrows, c, ring in mine:
            coef = np.zeros((1, 2 * R))
            if s != d:
                coef[0, s] = 1.0
                coef[0, R + d] = 1.0
            gid = b.add_tasks(
                rank=np.array([s]), role=np.array([T.Role.COMM]),
                type=np.array([T.TaskType.DISPATCH]), local_id=np.array([-1]),
                tile=np.array([m]), signal=np.array([c]),
                waits=(np.array([len(ring)]), np.asarray(ring, dtype=np.int64)),
                duration=np.array([hw.comm_serial_s]),
                comm_bytes=np.array([nrows * row_bytes]),
                comm_class=np.array([2 * R + s if hol else 3 * R + s * R + d]),
                comm_row=np.array([b.add_coef(coef)[0]]), receiver=np.array([d]),
                link_bytes=np.array([0.0 if s == d else nrows * row_bytes]),
                flops=np.array([0]), minibatch=np.array([m]))
            ids.append(gid)
            keys.append(key)
        b.extra_comm[s] = (ids, keys)


class _GraphBuilder:
    def __init__(self, R, nports, symmetric):
        self.R = R
        self.nports = nports
        self.symmetric = symmetric
        self.cols = {k: [] for k in ("rank", "role", "type", "local_id", "tile", "signal",
                                     "duration", "comm_bytes", "comm_class", "comm_row",
                                     "link_bytes", "flops", "minibatch", "receiver")}
        self.waits = []  # CSR parts (lens, flat) per add_tasks call
        self.extra_waits = []  # (owners, counters) appended in finish()
        self.placeholders = {}
        self.coef = []
        self.ncoef = 0
        self.ncount = 0
        self.counter_base = {}
        self.rank_lists = []
        self.extra_comm = {}
        self.n = 0
        # classes: [0,R) pull dispatch per receiver, [R,2R) combine per rank, [2R,3R) push
        # per sender (FIFO egress); then R*R push pairs (sender, receiver)
        self.num_spread_classes = 3 * R if not symmetric else 2
        self.num_classes = self.num_spread_classes + (R * R if not symmetric else 0)

    def add_counters(self, sizes, offsets):
        base = self.ncount
        self.counter_base[len(self.counter_base)] = base
        self.ncount += int(offsets[-1])
        return base

    def new_counter(self):
        self.ncount += 1
        return self.ncount - 1

    def add_coef(self, coef):
        self.coef.append(coef)
        rows = np.arange(self.ncoef, self.ncoef + coef.shape[0])
        self.ncoef += coef.shape[0]
        return rows

    def add_tasks(self, waits, **cols):
        base = self.n
        for k, v in cols.items():
            self.cols[k].append(np.asarray(v))
        lens, flat = waits
        self.waits.append((np.asarray(lens, dtype=np.int64), np.asarray(flat, dtype=np.int64)))
        self.n += len(lens)
        return base

    def finish(self, n_comm, n_compute) -> Graph:
        c = {k: np.concatenate(v) if v else np.zeros(0) for k, v in self.cols.items()}
        n = self.n
        signal = c["signal"].astype(np.int64)
        nsig = np.bincount(signal, minlength=self.ncount)
        lens = np.concatenate([l for l, _ in self.waits]) if self.waits else np.zeros(0, int)
        flat = np.concatenate([f for _, f in self.waits]) if self.waits else np.zeros(0, int)
        owners = np.repeat(np.arange(n), lens)
        if self.extra_waits:
            owners = np.concatenate([owners] + [o for o, _ in self.extra_waits])
            flat = np.concatenate([flat] + [c for _, c in self.extra_waits])
        neg = flat < 0
        if neg.any():
            keys = -(flat[neg] + 1)
            flat[neg] = [self.placeholders[int(k)] for k in keys]
        order = np.argsort(owners, kind="stable")
        wait_idx = flat[order]
        wait_off = np.concatenate([[0], np.cumsum(np.bincount(owners, minlength=n))])
        rank = c["rank"].astype(np.int64)
        role = c["role"].astype(np.int64)
        queues = []
        for r in range(self.R if not self.symmetric else 1):
            per_role = []
            for ro in (T.Role.COMM, T.Role.COMPUTE):
                ids = np.flatnonzero((rank == r) & (role == ro))
                if ro == T.Role.COMM and r in self.extra_comm:
                    # merge sender pushes with the rank's own comm tasks by list position
                    own_keys = c["local_id"][ids].astype(np.float64)
                    pids, pkeys = self.extra_comm[r]
                    pids = np.asarray(pids, dtype=np.int64)
                    allids = np.concatenate([ids[~np.isin(ids, pids)], pids])
                    keys = np.concatenate([own_keys[~np.isin(ids, pids)],
                                           np.asarray(pkeys, dtype=np.float64) - 0.5])
                    is_barrier = c["type"][allids] == T.TaskType.BARRIER
                    keys = np.where(is_barrier, np.inf, keys)
                    ids = allids[np.lexsort((allids, keys))]
                per_role.append(ids)
            queues.append(per_role)
        coef = np.concatenate(self.coef) if self.coef else np.zeros((0, self.nports))
        return Graph(
            num_ranks=self.R, num_comm_sms=n_comm, num_compute_sms=n_compute, rank=rank,
            role=role, type=c["type"].astype(np.int64), local_id=c["local_id"].astype(np.int64),
            tile=c["tile"].astype(np.int64), signal=signal, wait_off=wait_off,
            wait_idx=wait_idx, num_signallers=nsig, queues=queues,
            duration=c["duration"].astype(np.float64),
            comm_bytes=c["comm_bytes"].astype(np.float64),
            comm_class=c["comm_class"].astype(np.int64), comm_coef=coef,
            comm_row=c["comm_row"].astype(np.int64), link_bytes=c["link_bytes"].astype(np.float64),
            flops=c["flops"].astype(np.float64), symmetric=self.symmetric,
            num_classes=self.num_classes, num_spread_classes=self.num_spread_classes,
            receiver=c["receiver"].astype(np.int64),
            meta=dict(minibatch=c["minibatch"].astype(np.int64)))
