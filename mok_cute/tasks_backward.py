"""The backward megakernel's ordered task list, built on the host (issue 32: the design, run on
the CPU by the float64 model in ``tests/backward_task_model.py`` before any kernel runs it).

One layer backward on one rank is one ordered list of tasks, the forward's design
(``mok_cute.tasks``) run in reverse: comm CTAs take the COMM tasks in list order, compute CTAs
the COMPUTE tasks, each task waits only on tasks with a lower index, so the forward's
deadlock-freedom argument holds unchanged (``BackwardTaskList.check`` proves the premise).

Buffers of the expert side (rank r, padded receive-schedule rows ``p``), all kept for the whole
launch (no ring: a weight gradient reads every row of its expert, so its operands cannot be
overwritten before the last tile of the expert has been reduced)::

    dy[p, H]        d_out row of p's (peer, token), pulled by REVERSE_COMBINE
    dpre[p, 2I]     dG | dU of p (FC2_DGRAD's dgated epilogue)
    hw[p, I]        w * h of p (FC2_DGRAD), the down projection's weight-gradient operand
    part[p, n]      fp32 partial of <d_out, y> per dgated N-tile n (FC2_DGRAD)
    dx[p, H]        dx row of p (FC1_DGRAD), pushed home by REVERSE_DISPATCH
    x[p, H]         x row of p: kept by the training forward, or pulled again (REPULL_X)

and of the source side (this rank's own tokens)::

    dx_slot[t*K+k, H], part_slot[t*K+k]    filled by the expert ranks' REVERSE_DISPATCH
    shared: sdpre[t, 2Is], shw[t, Is], sdx[t, H]

Task types (values after ``tasks.TaskType``'s, so one timeline can hold both)::

    REVERSE_COMBINE (j, c)  comm     pull the d_out rows of M-tile j (chunk c) into dy
    REPULL_X        (j, c)  comm     pull the x rows of M-tile j again (forward ring too small)
    FC2_DGRAD       (j, n)  compute  dy @ W_down[e] with the SwiGLU backward: dpre, hw, part
    FC1_DGRAD       (j, n)  compute  dpre @ [W_gate; W_up][e]: dx of M-tile j, H N-tile n
    REVERSE_DISPATCH(j, c)  comm     push dx rows and summed partials to their (peer, slot)
    WGRAD_GATE_UP   (e, m, n) compute dW_gate, dW_up[e] row block m of I, column block n of H
    WGRAD_DOWN      (e, m, n) compute dW_down[e] row block m of H, column block n of I
    SHARED_FC2_DGRAD(s, n), SHARED_FC1_DGRAD(s, n), SHARED_WGRAD_GATE_UP (m, n),
    SHARED_WGRAD_DOWN (m, n)  compute  the shared expert (local tokens, weight 1)
    BARRIER                 comm     group barrier after this rank's last push (compute role
                                     when there are no comm tasks)
    KSUM            (s, c)  comm     d_x = sum_k dx_slot (+ sdx) in fixed k order, and
                                     d_topk_weights = part_slot, for local tokens (compute
                                     role when there are no comm tasks)

Dependencies (``waits``: spin until ``counter[group][i] >= target`` for i in a range; each
target is the number of tasks that signal that counter)::

    FC2_DGRAD(j, n)        <- PULLED[j]                  (every chunk of the tile's dy rows)
    FC1_DGRAD(j, n)        <- DGATED[j]                  (K = 2I: every dgated N-tile)
    REVERSE_DISPATCH(j, c) <- DX_DONE[j]                 (every H N-tile; partials before it)
    WGRAD_GATE_UP(e, ...)  <- DGATED[tiles of e], X_PULLED[tiles of e] (when re-pulled)
    WGRAD_DOWN(e, ...)     <- DGATED[tiles of e]         (hw; dy came before DGATED)
    SHARED_FC1_DGRAD(s, n) <- SHARED_DGATED[s]
    SHARED_WGRAD_*         <- SHARED_DGATED[all s]
    BARRIER                <- PUSHED[all tiles], X_PULLED[all tiles] when re-pulled
                                                         (then every peer's flag)
    KSUM(s, c)             <- BARRIER_DONE, SHARED_DX[s]

Order. Compute: the FC2_DGRAD tiles of minibatch 0, and per minibatch m those of m + 1 then
the FC1_DGRAD tiles of m (which so find their dG | dU done); the shared expert's FC2 dgrads
lead minibatch 0's (they need no communication, so they hide the first pulls) and its FC1
dgrads close minibatch 0's FC1 block (after the routed dx rows the pushes wait for); they are
live whatever the routing (``queue_tables``); each block rasterised (groups of
``raster_m`` M-tiles, N-tiles outer: concurrent tiles share weight N-tiles in L2), then every weight
gradient expert by expert (so the last pushes and the group barrier run under them), the
shared expert's weight gradients. Comm: each tile's pulls at the start of the
minibatch before its own (one minibatch of lookahead), its pushes once its FC1_DGRAD tiles
are done, re-pulls of x during the last minibatch's dgrads, the BARRIER, then the KSUMs (they
close the comm queue; the backward megakernel's group tail hands them out by one ticket to
whichever CTA is free, comm CTAs past their static walk and compute CTAs past their weight
gradients, and so does the simulator; without comm tasks the BARRIER and the KSUMs close the
compute queue).
Both queues are merged by that estimated ready time, measured in cumulative compute FLOPs.

Two forms. ``build_backward_task_list`` builds from the actual tile -> expert table (the
simulator's view). ``build_backward_static`` builds what a kernel gets without a host sync: the
schedule's static capacity (every M-tile present) and the forward's run-time rules (``tasks``):
with ``live = ceil(num_tiles / tiles per minibatch)``, a routed task of a minibatch >= live is
dead (skipped, no signal), one of a live minibatch whose M-tile is >= num_tiles is a no-op that
still signals, and a wait on per-tile counters is clipped to the live tiles. One element is new:
a weight-gradient task waits on its expert's M-tiles, a range that moves with the routing, so its
wait says ``EXPERT_TILES`` and is resolved at run time from the schedule's expert offsets (every
wait of the forward is a static range); the static list has every expert's weight-gradient
tiles, and an expert with no rows writes zeros, as ``gemm_wgrad`` does. The CPU model runs both
forms (tests/test_tasks_backward.py).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from mok_cute.tasks import Role

__all__ = ["BackwardTaskType", "BackwardCounter", "BackwardTask", "BackwardListParams",
           "BackwardTaskList", "build_backward_task_list", "build_backward_static",
           "expert_tile_ranges", "EXPERT_TILES", "TILE_COUNTERS", "BackwardWord",
           "encode_backward", "decode_backward", "queue_tables", "SHARED_DGRADS"]

# a wait's (first, count) that means "the M-tiles of this task's expert", resolved at run time
EXPERT_TILES = -1
WGRAD_RASTER_M = 4  # M-blocks per raster group of an expert's weight-gradient tiles (gemm_wgrad's)


class BackwardTaskType(enum.IntEnum):
    REVERSE_COMBINE = 12
    REPULL_X = 13
    FC2_DGRAD = 14
    FC1_DGRAD = 15
    REVERSE_DISPATCH = 16
    WGRAD_GATE_UP = 17
    WGRAD_DOWN = 18
    SHARED_FC2_DGRAD = 19
    SHARED_FC1_DGRAD = 20
    SHARED_WGRAD_GATE_UP = 21
    SHARED_WGRAD_DOWN = 22
    BARRIER = 23
    KSUM = 24


class BackwardCounter(enum.IntEnum):
    PULLED = 0  # [tile] REVERSE_COMBINE chunks done
    X_PULLED = 1  # [tile] REPULL_X chunks done
    DGATED = 2  # [tile] FC2_DGRAD N-tiles done
    DX_DONE = 3  # [tile] FC1_DGRAD N-tiles done
    PUSHED = 4  # [tile] REVERSE_DISPATCH chunks done
    SHARED_DGATED = 5  # [s] SHARED_FC2_DGRAD N-tiles done
    SHARED_DX = 6  # [s] SHARED_FC1_DGRAD N-tiles done
    WGRAD_DONE = 7  # [1] weight-gradient tiles done (nothing waits: the launch's end)
    BARRIER_DONE = 8  # [1] 1 once every rank of the group has passed its barrier
    KSUM_DONE = 9  # [1]


BT, BC = BackwardTaskType, BackwardCounter
SHARED_DGRADS = (BT.SHARED_FC2_DGRAD, BT.SHARED_FC1_DGRAD)
# per-M-tile counters: waits on them are clipped to the live tiles (static lists)
TILE_COUNTERS = (BC.PULLED, BC.X_PULLED, BC.DGATED, BC.DX_DONE, BC.PUSHED)
_COMM = (BT.REVERSE_COMBINE, BT.REPULL_X, BT.REVERSE_DISPATCH)


@dataclasses.dataclass(frozen=True)
class BackwardTask:
    index: int
    type: BackwardTaskType
    role: Role
    minibatch: int  # -1: weight gradients, barrier, k-sum (the shared expert's dgrads: 0)
    tile: int  # M-tile j; expert e (WGRAD_*); local token tile s (SHARED_*DGRAD, KSUM); rank
    #            (SHARED_WGRAD_*); else -1
    n_tile: int  # GEMM N-tile, comm chunk or KSUM chunk
    m_block: int  # weight-gradient row block; else -1
    flops: int
    signal: tuple[BackwardCounter, int]
    waits: tuple[tuple[BackwardCounter, int, int, int], ...]  # (group, first, count, target)


@dataclasses.dataclass(frozen=True)
class BackwardListParams:
    hidden: int
    intermediate: int
    num_tokens: int  # this rank's own tokens (the KSUM and shared-expert side)
    top_k: int
    tile_m: int = 128
    dgated_tile_n: int = 128  # FC2_DGRAD N-tile over I
    dx_tile_n: int = 256  # FC1_DGRAD N-tile over H
    minibatch_tokens: int = 1024
    raster_m: int = 8  # M-tiles per raster group of a minibatch's dgrad tiles (L2 reuse)
    comm_task_rows: int = 32
    ksum_rows: int = 32
    shared_intermediate: int = 0
    # shared experts, one per local rank (a virtual ranks' launch), each over num_tokens
    # tokens: token tile s of rank r is shared tile r * ceil(num_tokens / tile_m) + s, and a
    # shared weight-gradient task's ``tile`` is its rank
    shared_ranks: int = 1
    comm_tasks: bool = True  # False: one rank reading d_out in place and k-summing dx in place
    x_resident: bool = True  # the training forward kept every x row of the receive schedule
    # weight-gradient output tiles (gemm_wgrad's): gate/up (I rows of each, H columns), down
    # (H rows, I columns)
    wgrad_gate_up_tile: tuple[int, int] = (128, 128)
    wgrad_down_tile: tuple[int, int] = (256, 128)

    def __post_init__(self):
        for name in ("hidden", "intermediate", "top_k", "tile_m", "dgated_tile_n", "dx_tile_n",
                     "minibatch_tokens", "raster_m", "comm_task_rows", "ksum_rows",
                     "shared_ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("num_tokens", "shared_intermediate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name, of in (("minibatch_tokens", "tile_m"), ("tile_m", "comm_task_rows"),
                         ("tile_m", "ksum_rows")):
            if getattr(self, name) % getattr(self, of):
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of "
                                 f"{of}={getattr(self, of)}")
        if not self.comm_tasks and not self.x_resident:
            raise ValueError("x_resident=False needs comm tasks (x rows are pulled again)")
        if self.shared_ranks > 1 and self.comm_tasks:
            raise ValueError("shared_ranks > 1 is a virtual ranks' launch: no comm tasks")


@dataclasses.dataclass
class BackwardTaskList:
    params: BackwardListParams
    tile_expert: np.ndarray | None  # [tiles] local expert of each real M-tile; None: static
    tasks: list[BackwardTask]
    counter_sizes: dict[BackwardCounter, int]

    @property
    def static(self) -> bool:
        return self.tile_expert is None

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> BackwardTask:
        return self.tasks[i]

    def __iter__(self):
        return iter(self.tasks)

    def queue(self, role: Role) -> list[BackwardTask]:
        return [t for t in self.tasks if t.role == role]

    def check(self) -> None:
        """The premises of deadlock freedom and of exact waits: every counter a task waits on
        is signalled by exactly ``target`` tasks, all with lower list indices; signals stay in
        their counter's range; waits point at counters that exist. Raises AssertionError."""
        signallers: dict[tuple[BackwardCounter, int], list[int]] = {}
        for t in self.tasks:
            group, index = t.signal
            assert 0 <= index < self.counter_sizes[group], (t, self.counter_sizes[group])
            signallers.setdefault(t.signal, []).append(t.index)
        for t in self.tasks:
            for group, first, count, target in t.waits:
                if group == BC.BARRIER_DONE:
                    # passed by the group barrier, not by tasks of this list alone
                    assert (first, count, target) == (0, 1, 1), t
                    barriers = signallers.get((BC.BARRIER_DONE, 0), [])
                    assert len(barriers) == 1 and barriers[0] < t.index, t
                    continue
                if first == EXPERT_TILES:
                    # resolved at run time to a sub-range of the tiles: check them all
                    assert self.static and count == EXPERT_TILES, t
                    first, count = 0, self.counter_sizes[group]
                assert count >= 1 and 0 <= first and first + count <= self.counter_sizes[group], t
                for i in range(first, first + count):
                    who = signallers.get((group, i), [])
                    assert len(who) == target, (t, group, i, len(who), target)
                    assert max(who) < t.index, (t, group, i, max(who))


def expert_tile_ranges(tile_expert: np.ndarray, num_local_experts: int) -> np.ndarray:
    """[E_loc + 1] first M-tile of each local expert (expert-sorted tiles; empty experts have
    an empty range)."""
    tile_expert = np.asarray(tile_expert, dtype=np.int64)
    if tile_expert.size and (np.diff(tile_expert) < 0).any():
        raise ValueError("tile_expert must be sorted by expert (the receive schedule's order)")
    return np.searchsorted(tile_expert, np.arange(num_local_experts + 1)).astype(np.int64)


def build_backward_task_list(tile_expert, num_local_experts: int,
                             params: BackwardListParams) -> BackwardTaskList:
    """The ordered backward task list of one rank (module docstring) from the local expert
    of each real M-tile of its receive schedule."""
    tile_expert = np.asarray(tile_expert, dtype=np.int64)
    return _Builder(tile_expert.size, tile_expert, num_local_experts, params).build()


def build_backward_static(capacity_tiles: int, num_local_experts: int,
                          params: BackwardListParams) -> BackwardTaskList:
    """The list a kernel gets: every one of the schedule's ``capacity_tiles`` M-tiles, the
    weight gradients of every expert with ``EXPERT_TILES`` waits (module docstring)."""
    if isinstance(capacity_tiles, bool) or not isinstance(capacity_tiles, int) or capacity_tiles < 0:
        raise ValueError(f"capacity_tiles must be an int >= 0, got {capacity_tiles!r}")
    return _Builder(capacity_tiles, None, num_local_experts, params).build()


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _grouped(m_begin: int, m_end: int, n_tiles: int, group: int):
    """(M, N) tiles of M in [m_begin, m_end) in raster order: groups of ``group`` M-tiles,
    within a group N-tile by N-tile (the CTAs running together share N-tiles in L2)."""
    for g0 in range(m_begin, m_end, group):
        for n in range(n_tiles):
            for m in range(g0, min(g0 + group, m_end)):
                yield m, n


class _Builder:
    def __init__(self, num_tiles: int, tile_expert: np.ndarray | None, num_local_experts: int,
                 p: BackwardListParams):
        self.p = p
        self.tile_expert = tile_expert
        self.num_experts = num_local_experts
        self.nt = int(num_tiles)
        self.tpm = p.minibatch_tokens // p.tile_m
        self.nmb = _ceil(self.nt, self.tpm)
        self.expert_tiles = (None if tile_expert is None
                             else expert_tile_ranges(tile_expert, num_local_experts))
        self.chunks = p.tile_m // p.comm_task_rows
        self.n_dgated = _ceil(p.intermediate, p.dgated_tile_n)
        self.n_dx = _ceil(p.hidden, p.dx_tile_n)
        self.st = _ceil(p.num_tokens, p.tile_m)
        self.sst = p.shared_ranks * self.st  # the shared experts' token tiles, rank by rank
        self.shared = p.shared_intermediate > 0
        self.ns_dgated = _ceil(p.shared_intermediate, p.dgated_tile_n) if self.shared else 0
        self.counter_sizes = {
            BC.PULLED: self.nt if p.comm_tasks else 0,
            BC.X_PULLED: self.nt if not p.x_resident else 0,
            BC.DGATED: self.nt, BC.DX_DONE: self.nt,
            BC.PUSHED: self.nt if p.comm_tasks else 0,
            BC.SHARED_DGATED: self.sst if self.shared else 0,
            BC.SHARED_DX: self.sst if self.shared else 0,
            BC.WGRAD_DONE: 1, BC.BARRIER_DONE: 1, BC.KSUM_DONE: 1,
        }
        self.records: list[dict] = []

    def _raster(self, mb: int, n_tiles: int):
        """(M-tile, N-tile) of minibatch ``mb``'s tiles in raster order (``_grouped``, groups of
        ``raster_m`` M-tiles)."""
        return _grouped(mb * self.tpm, min((mb + 1) * self.tpm, self.nt), n_tiles, self.p.raster_m)

    @staticmethod
    def _wgrad_raster(m_blocks: int, n_tiles: int):
        """(M-block, N-tile) of an expert's weight-gradient tiles in ``gemm_wgrad``'s raster
        (groups of ``WGRAD_RASTER_M`` M-blocks; measured: an M-block's N-tiles in a row were
        0-6 % slower in gemm_wgrad)."""
        return _grouped(0, m_blocks, n_tiles, WGRAD_RASTER_M)

    # one record per task; "key" orders the comm queue, "flops" positions the compute queue
    def _add(self, queue: list, kind: BackwardTaskType, *, tile=-1, n_tile=0, m_block=-1,
             minibatch=-1, flops=0, signal, waits=(), key=0.0):
        queue.append(dict(type=kind, tile=tile, n_tile=n_tile, m_block=m_block,
                          minibatch=minibatch, flops=flops, signal=signal, waits=tuple(waits),
                          key=key))

    def _gemm_flops(self, n: int, k: int, m: int | None = None) -> int:
        return 2 * (m or self.p.tile_m) * n * k

    def build(self) -> BackwardTaskList:
        p = self.p
        compute: list[dict] = []
        # per minibatch its FC2_DGRAD tiles, then (one minibatch later, so that they find their
        # dG | dU done) its FC1_DGRAD tiles; each block rasterised: groups of raster_m M-tiles,
        # N-tiles outer, so the CTAs running together share the weights' N-tiles in L2. The
        # shared expert's FC2 dgrads lead minibatch 0's (no communication: they run under the
        # first pulls; among the FC2 dgrads, a kernel's pingpong phase), its FC1 dgrads close
        # minibatch 0's (the routed dx rows, which the pushes wait for, first)
        fc2_blocks, fc1_blocks = [], []
        for mb in range(max(self.nmb, 1 if self.shared and self.st else 0)):
            fc2, fc1 = [], []
            for s in range(self.sst if self.shared and mb == 0 else 0):
                for n in range(self.ns_dgated):
                    self._add(fc2, BT.SHARED_FC2_DGRAD, tile=s, n_tile=n, minibatch=0,
                              flops=self._gemm_flops(p.dgated_tile_n, p.hidden),
                              signal=(BC.SHARED_DGATED, s))
            for j, n in self._raster(mb, self.n_dgated):
                waits = [(BC.PULLED, j, 1, self.chunks)] if p.comm_tasks else []
                self._add(fc2, BT.FC2_DGRAD, tile=j, n_tile=n, minibatch=mb,
                          flops=self._gemm_flops(p.dgated_tile_n, p.hidden),
                          signal=(BC.DGATED, j), waits=waits)
            for j, n in self._raster(mb, self.n_dx):
                self._add(fc1, BT.FC1_DGRAD, tile=j, n_tile=n, minibatch=mb,
                          flops=self._gemm_flops(p.dx_tile_n, 2 * p.intermediate),
                          signal=(BC.DX_DONE, j), waits=[(BC.DGATED, j, 1, self.n_dgated)])
            for s in range(self.sst if self.shared and mb == 0 else 0):
                for n in range(self.n_dx):
                    self._add(fc1, BT.SHARED_FC1_DGRAD, tile=s, n_tile=n, minibatch=0,
                              flops=self._gemm_flops(p.dx_tile_n, 2 * p.shared_intermediate),
                              signal=(BC.SHARED_DX, s),
                              waits=[(BC.SHARED_DGATED, s, 1, self.ns_dgated)])
            fc2_blocks.append(fc2)
            fc1_blocks.append(fc1)
        for mb in range(len(fc2_blocks)):
            if mb == 0:
                compute += fc2_blocks[0]
            if mb + 1 < len(fc2_blocks):
                compute += fc2_blocks[mb + 1]
            compute += fc1_blocks[mb]
        for e in range(self.num_experts):
            if self.expert_tiles is None:  # static: the expert's tiles resolved at run time
                first, count = EXPERT_TILES, EXPERT_TILES
                rows = self.nt * p.tile_m // max(self.num_experts, 1)  # for the order only
            else:
                first = int(self.expert_tiles[e])
                count = int(self.expert_tiles[e + 1]) - first
                if count == 0:
                    continue  # no rows: the host zero-fills its weight gradients
                rows = count * p.tile_m
            dgated = (BC.DGATED, first, count, self.n_dgated)
            for m, n in self._wgrad_raster(_ceil(p.hidden, p.wgrad_down_tile[0]),
                                           _ceil(p.intermediate, p.wgrad_down_tile[1])):
                self._add(compute, BT.WGRAD_DOWN, tile=e, n_tile=n, m_block=m,
                          flops=self._gemm_flops(p.wgrad_down_tile[1], rows,
                                                 p.wgrad_down_tile[0]),
                          signal=(BC.WGRAD_DONE, 0), waits=[dgated])
            x_waits = [] if p.x_resident else [(BC.X_PULLED, first, count, self.chunks)]
            for m, n in self._wgrad_raster(_ceil(p.intermediate, p.wgrad_gate_up_tile[0]),
                                           _ceil(p.hidden, p.wgrad_gate_up_tile[1])):
                self._add(compute, BT.WGRAD_GATE_UP, tile=e, n_tile=n, m_block=m,
                          flops=2 * self._gemm_flops(p.wgrad_gate_up_tile[1], rows,
                                                     p.wgrad_gate_up_tile[0]),
                          signal=(BC.WGRAD_DONE, 0), waits=[dgated, *x_waits])
        for r in range(p.shared_ranks if self.shared and self.st else 0):
            all_s = (BC.SHARED_DGATED, r * self.st, self.st, self.ns_dgated)
            rows = self.st * p.tile_m
            for m in range(_ceil(p.hidden, p.wgrad_down_tile[0])):
                for n in range(_ceil(p.shared_intermediate, p.wgrad_down_tile[1])):
                    self._add(compute, BT.SHARED_WGRAD_DOWN, tile=r, n_tile=n, m_block=m,
                              flops=self._gemm_flops(p.wgrad_down_tile[1], rows,
                                                     p.wgrad_down_tile[0]),
                              signal=(BC.WGRAD_DONE, 0), waits=[all_s])
            for m in range(_ceil(p.shared_intermediate, p.wgrad_gate_up_tile[0])):
                for n in range(_ceil(p.hidden, p.wgrad_gate_up_tile[1])):
                    self._add(compute, BT.SHARED_WGRAD_GATE_UP, tile=r, n_tile=n, m_block=m,
                              flops=2 * self._gemm_flops(p.wgrad_gate_up_tile[1], rows,
                                                         p.wgrad_gate_up_tile[0]),
                              signal=(BC.WGRAD_DONE, 0), waits=[all_s])
        barrier_waits = []
        if p.comm_tasks and self.nt:
            # every push, and every x re-pull (a peer may rewrite its x field once it is past
            # the barrier)
            barrier_waits = [(BC.PUSHED, 0, self.nt, self.chunks)]
            if not p.x_resident:
                barrier_waits.append((BC.X_PULLED, 0, self.nt, self.chunks))
        if not p.comm_tasks:
            # nothing to push: the barrier only orders this rank's dx rows before the k-sum
            barrier_waits = [(BC.DX_DONE, 0, self.nt, self.n_dx)] if self.nt else []
            self._add(compute, BT.BARRIER, signal=(BC.BARRIER_DONE, 0), waits=barrier_waits)
        # the k-sums: closing the comm queue over a group (the kernel hands them out by ticket
        # to whichever CTA is free), else the compute queue's tail
        ksums = []
        for s in range(self.st):
            for c in range(p.tile_m // p.ksum_rows):
                waits = [(BC.BARRIER_DONE, 0, 1, 1)]
                if self.shared:
                    waits.append((BC.SHARED_DX, s, 1, self.n_dx))
                self._add(ksums, BT.KSUM, tile=s, n_tile=c, signal=(BC.KSUM_DONE, 0),
                          waits=waits, key=float("inf"))
        ksum_begin = len(compute)
        if not p.comm_tasks:
            compute += ksums

        # positions along the compute queue, in cumulative FLOPs
        ends = np.cumsum([r["flops"] for r in compute]) if compute else np.zeros(0)
        starts = ends - np.array([r["flops"] for r in compute]) if compute else ends
        first_of_mb = {}
        last_dx_of_tile = {}
        for i, r in enumerate(compute):
            if r["type"] in (BT.FC2_DGRAD, BT.FC1_DGRAD):
                first_of_mb.setdefault(r["minibatch"], i)
            if r["type"] == BT.FC1_DGRAD:
                last_dx_of_tile[r["tile"]] = i
        ksum_start = float(starts[ksum_begin]) if ksum_begin < len(compute) else float("inf")

        comm: list[dict] = []
        if p.comm_tasks:
            for j in range(self.nt):
                mb = j // self.tpm
                key = float(starts[first_of_mb[max(mb - 1, 0)]])  # one minibatch ahead
                for c in range(self.chunks):
                    self._add(comm, BT.REVERSE_COMBINE, tile=j, n_tile=c, minibatch=mb,
                              signal=(BC.PULLED, j), key=key)
            if not p.x_resident and self.nt:
                key = float(starts[first_of_mb[self.nmb - 1]])  # under the last dgrads
                for j in range(self.nt):
                    for c in range(self.chunks):
                        self._add(comm, BT.REPULL_X, tile=j, n_tile=c, minibatch=j // self.tpm,
                                  signal=(BC.X_PULLED, j), key=key)
            for j in range(self.nt):
                key = float(ends[last_dx_of_tile[j]])
                for c in range(self.chunks):
                    self._add(comm, BT.REVERSE_DISPATCH, tile=j, n_tile=c,
                              minibatch=j // self.tpm, signal=(BC.PUSHED, j),
                              waits=[(BC.DX_DONE, j, 1, self.n_dx)], key=key)
            self._add(comm, BT.BARRIER, signal=(BC.BARRIER_DONE, 0), waits=barrier_waits,
                      key=ksum_start)
            comm += ksums
        comm.sort(key=lambda r: r["key"])  # stable: queue order among equal keys

        # merge: before each compute task, every comm task that is ready by its start
        merged, ci = [], 0
        for i, r in enumerate(compute):
            while ci < len(comm) and comm[ci]["key"] <= starts[i]:
                merged.append((Role.COMM, comm[ci]))
                ci += 1
            merged.append((Role.COMPUTE, r))
        merged.extend((Role.COMM, r) for r in comm[ci:])
        tasks = [BackwardTask(index=i, type=r["type"], role=role, minibatch=r["minibatch"],
                              tile=r["tile"], n_tile=r["n_tile"], m_block=r["m_block"],
                              flops=int(r["flops"]), signal=r["signal"], waits=r["waits"])
                 for i, (role, r) in enumerate(merged)]
        return BackwardTaskList(p, self.tile_expert, tasks, dict(self.counter_sizes))


# ------------------------------------------------------------------------------------------
# device encoding (of a static list)

class BackwardWord(enum.IntEnum):
    """Word offsets of a task row of ``encode_backward``."""

    TYPE = 0
    ROLE = 1
    MINIBATCH = 2
    TILE = 3  # M-tile; expert (weight gradients); token tile (shared dgrads, KSUM); rank (shared
    #          weight gradients); else -1
    N_TILE = 4
    M_BLOCK = 5
    SIGNAL_GROUP = 6
    SIGNAL_INDEX = 7
    NUM_WAITS = 8
    WAITS = 9  # wait w: words WAITS + 4 w .. + 3 = (group, first, count, target)


BACKWARD_MAX_WAITS = 2  # a gate/up weight gradient (dG | dU and, re-pulled, x); a shared KSUM
BACKWARD_TASK_WORDS = BackwardWord.WAITS + 4 * BACKWARD_MAX_WAITS


def encode_backward(tl: BackwardTaskList):
    """int32 ``[num_tasks, BACKWARD_TASK_WORDS]``, row i = task i (``BackwardWord``); unused
    wait slots are (-1, 0, 0, 0); an ``EXPERT_TILES`` wait keeps its -1 first and count."""
    import torch

    out = np.zeros((len(tl), BACKWARD_TASK_WORDS), dtype=np.int64)
    for t in tl:
        if len(t.waits) > BACKWARD_MAX_WAITS:
            raise ValueError(f"task {t.index} ({t.type.name}) has {len(t.waits)} waits, room "
                             f"for {BACKWARD_MAX_WAITS}")
        waits = [w for wait in t.waits for w in wait]
        waits += [-1, 0, 0, 0] * (BACKWARD_MAX_WAITS - len(t.waits))
        out[t.index] = [t.type, t.role, t.minibatch, t.tile, t.n_tile, t.m_block, t.signal[0],
                        t.signal[1], len(t.waits), *waits]
    if out.size and (out.max() > np.iinfo(np.int32).max or out.min() < np.iinfo(np.int32).min):
        raise ValueError("backward task list does not fit the int32 encoding")
    return torch.from_numpy(out.astype(np.int32))


def decode_backward(rows) -> list[BackwardTask]:
    """Inverse of ``encode_backward`` (flops are not encoded: 0)."""
    a = np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows, dtype=np.int64)
    out = []
    for i, r in enumerate(a):
        waits = tuple((BackwardCounter(int(r[BackwardWord.WAITS + 4 * w])),
                       *(int(v) for v in r[BackwardWord.WAITS + 4 * w + 1:BackwardWord.WAITS + 4 * w + 4]))
                      for w in range(int(r[BackwardWord.NUM_WAITS])))
        out.append(BackwardTask(
            index=i, type=BackwardTaskType(int(r[0])), role=Role(int(r[1])),
            minibatch=int(r[2]), tile=int(r[3]), n_tile=int(r[4]), m_block=int(r[5]), flops=0,
            signal=(BackwardCounter(int(r[6])), int(r[7])), waits=waits))
    return out


def queue_tables(tl: BackwardTaskList, kinds=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ticket walk's tables, as the forward's (``task_encoding.encode_device``): per role the
    queue (list indices in order, -1 padded), and ``live_len[role, live]``, the queue prefix
    that holds every task of minibatches < ``live`` (the head of tasks without a minibatch
    included), and ``tail_begin[role]``, where the tasks after the last routed one begin
    (weight gradients, barrier, k-sum). A CTA's ticket q takes queue position q while
    q < live_len and ``tail_begin + (q - live_len)`` after it. ``kinds``: only tasks of these
    types enter the queues (a kernel that runs part of the list; what they wait on must be
    among them, which is checked)."""
    p = tl.params
    nmb = -(-tl.counter_sizes[BackwardCounter.DGATED] // (p.minibatch_tokens // p.tile_m))
    kept = [t for t in tl if kinds is None or t.type in kinds]
    if kinds is not None:
        signalled = {t.signal[0] for t in kept}
        for t in kept:
            missing = [w[0].name for w in t.waits if w[0] not in signalled]
            if missing:
                raise ValueError(f"queue_tables: {t.type.name} waits on {missing}, which no "
                                 f"task of kinds {sorted(k.name for k in kinds)} signals")
    queues = [[t for t in kept if t.role == r] for r in (Role.COMM, Role.COMPUTE)]
    qtab = np.full((2, max(1, max(len(q) for q in queues))), -1, dtype=np.int64)
    live_len = np.zeros((2, nmb + 1), dtype=np.int64)
    tail_begin = np.zeros(2, dtype=np.int64)
    for r, q in enumerate(queues):
        qtab[r, :len(q)] = [t.index for t in q]
        routed = [i for i, t in enumerate(q) if t.minibatch >= 0]
        head_len = routed[0] if routed else len(q)
        tail_begin[r] = routed[-1] + 1 if routed else len(q)
        # the shared expert's dgrads (in minibatch 0) run whatever the routing: live always
        shared = max((i for i in routed if q[i].type in SHARED_DGRADS), default=-1)
        for live in range(nmb + 1):
            last = max((i for i in routed if q[i].minibatch < live), default=-1)
            live_len[r, live] = max(head_len, last + 1, shared + 1)
    return qtab, live_len, tail_begin
