"""The megakernel's GEMM tasks on the compute CTAs: producer warps and consumer warpgroups.

The roles and the mainloop are the GEMM core's (``gemm_core.GemmCoreSm90``), 128 x 256 x 64
tiles, cooperative: a GEMM task is one output tile of FC1 (gate and up halves, SwiGLU
epilogue -> h), FC2 (-> y) or the shared expert's two GEMMs.

Tickets. "static": every warp of the CTA walks tickets c, c + n, ... itself. "dynamic" /
"strided": lane 0 of the producer's warp 0 takes the next ticket (from a counter when its
producer is ready for it, or by the stride), resolves it (task row, run / no-op, tiles, the
expert, the counter to publish, first row, count of waits) and hands the words to every other
warp through the smem ticket ring, so the consumers make no global load between tasks.

Producer. Warp 0 waits on a GEMM task's counters, then fills the stages by TMA. With rows in
place, the whole producer warpgroup fills them: warp 0 issues the B loads (and A, except for
FC1), and every thread lands its share of FC1's A rows with cp.async, each from this rank's
own x when the row is its own (never dispatched) or from the ring.

Consumers. The mainloop, then the epilogue's TMA stores; the store warp waits for them to land
and lane 0 publishes the task's counter (the other warps start the next task at once). At one
rank with no comm task a GEMM task's publish may be deferred until the CTA's next task needs
it out of the way, or until that task's mainloop has issued ``DEFER_FLUSH_KTILES`` k-tiles.
A KSUM (or, with no comm CTA, the BARRIER) runs on all eight consumer warps.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Int32, Int64, const_expr
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

from mok_cute import fp8
from mok_cute.constants import TILE_K, TILE_M
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import pipeline_state, tma_tiles
from mok_cute.kernels.megakernel.comm_tasks import Routing
from mok_cute.kernels.megakernel.scheduler import (
    D_EXPERT, D_INDEX, D_MTILE, D_NTILE, D_NUM_WAITS, D_RANK, D_RING_TILE, D_ROW_BEGIN,
    D_SIGNAL, D_TYPE, NOOP_FLAG, RUN_FLAG, TICKET_SLOTS, TaskTables, ring_give_back, ring_next,
    ring_wait_empty, ring_wait_full, ring_words)
from mok_cute.tasks import Role, TaskType, TaskWord

PRODUCER_THREADS = 128  # rows in place: the producer warpgroup, each thread one arrival per stage
# every k-tile row is one 128-byte swizzle row: 64 bf16 or 128 e4m3 (fp8 plans)
K_TILE_BYTES = TILE_K * 2
DEFER_FLUSH_KTILES = 8  # k-tiles of the next mainloop before a deferred publish goes out
# a GEMM task's wait for its first stage shorter than this is not recorded as a STAGE_WAIT span
# (the recorder's clock ticks every 32 ns on the H200)
STAGE_WAIT_RECORD_MIN_NS = 64
# cp.async A-row gather: thread t of the producer warpgroup lands chunk t % 8 (16 B) of rows
# t // 8 + 16 i, so a warp's cp.async covers four whole 128-B row segments (4 L1 wavefronts;
# one row per thread would take 32)
GATHER_ROW_STRIDE = 128 // 8
GATHER_ROWS_PER_THREAD = TILE_M // GATHER_ROW_STRIDE
# The GEMM task types sit below KSUM and BARRIER: one compare tells a compute task's kind
assert max(TaskType.FC1, TaskType.FC2, TaskType.SHARED_FC1, TaskType.SHARED_FC2) < TaskType.KSUM \
    < TaskType.BARRIER


class TmaOperands(NamedTuple):
    """The TMA atoms and tensors of the GEMM tasks' loads: routed x / h rows and gate / up /
    down weights, then the shared expert's (None without one)."""

    a_x: object
    t_a_x: object
    a_h: object
    t_a_h: object
    wg: object
    t_wg: object
    wu: object
    t_wu: object
    wd: object
    t_wd: object
    sh_a_x: object
    t_sh_a_x: object
    sh_a_h: object
    t_sh_a_h: object
    sh_wg: object
    t_sh_wg: object
    sh_wu: object
    t_sh_wu: object
    sh_wd: object
    t_sh_wd: object


class TmaLoads(NamedTuple):
    """The producer's TMA atoms with their (global, smem) partitions, built once per CTA
    (``GemmTasks._tma_loads``), in ``TmaOperands``' order."""

    a_x: object
    g_a_x: object
    s_a_x: object
    a_h: object
    g_a_h: object
    s_a_h: object
    wg: object
    g_wg: object
    s_wg: object
    wu: object
    g_wu: object
    s_wu: object
    wd: object
    g_wd: object
    s_wd: object
    sh_a_x: object
    g_sh_a_x: object
    s_sh_a_x: object
    sh_a_h: object
    g_sh_a_h: object
    s_sh_a_h: object
    sh_wg: object
    g_sh_wg: object
    s_sh_wg: object
    sh_wu: object
    g_sh_wu: object
    s_sh_wu: object
    sh_wd: object
    g_sh_wd: object
    s_sh_wd: object


class TmaStores(NamedTuple):
    """The consumers' TMA store atoms and tensors: routed h and y, then the shared expert's."""

    h: object
    t_h: object
    y: object
    t_y: object
    sh_h: object
    t_sh_h: object
    sh_y: object
    t_sh_y: object


class SavedRows(NamedTuple):
    """save_preact: where FC1 tasks store g | u. ``preact (rows, 2I, R)`` bf16 and ``row_slot
    (R, capacity)`` int32 (each schedule row's preact row, -1: padding) for the routed experts;
    ``shared_preact (T, 2Is, R)`` and ``shared_rows (T,)`` int32 (0 .. T - 1) for the shared
    expert's. None when not saving."""

    preact: object
    row_slot: object
    shared_preact: object
    shared_rows: object


class DirectRows(NamedTuple):
    """What the producer threads need to gather FC1's A rows themselves (rows in place)."""

    sA_base: object  # the A stages' smem address
    tidx: Int32
    warp_idx: Int32


class MainloopArgs(NamedTuple):
    """Run-time values of the megakernel's mainloop hooks."""

    ctx: object
    timeline_buf: object
    index: Int32
    rank: Int32
    leader: object  # the thread that records the STAGE_WAIT span
    counters: object  # deferred publish: the counters, the held counter (-1: none), ...
    held: Int32
    is_store_warp: object
    consumer_tidx: Int32


class GemmTasks:
    """The compute role's GEMM tasks (``MegakernelSm90`` mixes it in)."""

    # ------------------------------------------------------------------ producer
    def _tma_loads(self, ops: TmaOperands, sA, sB, bf16_stages) -> TmaLoads:
        """The loads' (global, smem) partitions: A boxes of 128 x 64, the gate and up halves
        of a B stage (half_n x 64 each), W_down's whole B stage; fp8: the routed GEMMs' boxes
        128 deep, the shared expert's bf16 ones on ``bf16_stages``. Traced inline."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk

        def part(atom, tensor, s, box):
            return (atom, *tma_tiles(atom, tensor, s, box))

        def smem_boxes(stage_a, stage_b, depth):
            half = (tile_n // 2, depth)
            halves = cute.flat_divide(stage_b, half)
            return ((stage_a, (tile_m, depth)), (stage_a, (tile_m, depth)),
                    (halves[(None, None, 0, 0, None)], half),
                    (halves[(None, None, 1, 0, None)], half), (stage_b, (tile_n, depth)))

        routed = [part(ops[2 * i], ops[2 * i + 1], s, box)
                  for i, (s, box) in enumerate(smem_boxes(sA, sB, tile_k))]
        shared = [(None, None, None)] * 5
        if const_expr(self.spec.has_shared):
            shared = [part(ops[10 + 2 * i], ops[11 + 2 * i], s, box)
                      for i, (s, box) in enumerate(smem_boxes(*bf16_stages, TILE_K))]
        return TmaLoads(*(v for triple in routed + shared for v in triple))

    @cute.jit
    def producer_loop(self, ctx, tt: TaskTables, routing: Routing, ab_pipeline, ops: TmaOperands,
                      sA, sB, ring_x, compute_cta, ticket_q, ticket_bars, timeline_buf, direct,
                      bf16_stages):
        """Warp 0 (or, with rows in place, the whole producer warpgroup with ``direct``: a
        ``DirectRows``) walks the compute tickets, waits on each GEMM task's counters and
        fills its stages (``bf16_stages``: the shared expert's, ``_tma_loads``)."""
        tma = self._tma_loads(ops, sA, sB, bf16_stages)
        loads = Int32(0)  # k-tiles issued so far: the pipeline state is derived from it
        live_prefix = self._live_prefix(ctx, tt, int(Role.COMPUTE))
        blk, q_base = Int32(0), Int32(0)  # ticket block cursor (rank_blocks)
        taken = Int32(0)  # ticket ring: uses so far
        q = compute_cta
        q_next = Int32(0)  # "dynamic": lane 0's ticket after q, taken ahead of time
        q, q_next, index, rank, blk, q_base = self._producer_task(
            ctx, tt, routing, live_prefix, ticket_q, ticket_bars, taken, q, q_next, blk, q_base,
            True)
        if const_expr(self.spec.ticket_ring):
            taken += 1
        while index >= 0:
            run, noop, ttype = self._task_kind(ctx, tt, ticket_q, taken, index, rank)
            k_tiles = self._k_tiles(ttype, ops.t_a_x, ops.t_a_h, ops.t_sh_a_h, ops.t_sh_a_x)
            if run and not noop and self._is_gemm(ttype):
                num_waits, row_begin = None, None  # loaded from the task's row where needed
                if const_expr(self.spec.ticket_ring):
                    slot = ring_words(ticket_q, taken - 1)
                    num_waits, row_begin = slot[D_NUM_WAITS], slot[D_ROW_BEGIN]
                if const_expr(self.spec.rows_in_place):
                    if direct.warp_idx == self.load_warp:
                        self._wait_task_recorded(ctx, tt, index, rank, timeline_buf,
                                                 int(Role.COMPUTE), cute.arch.lane_idx() == 0,
                                                 num_waits)
                        cute.arch.fence_proxy("async.global")
                    self._producer_sync().arrive_and_wait()  # the task's inputs are there for all 4 warps
                else:
                    self._wait_task_recorded(ctx, tt, index, rank, timeline_buf, int(Role.COMPUTE),
                                             cute.arch.lane_idx() == 0, num_waits)
                    # rows written by other CTAs (generic or TMA stores) are read through TMA next
                    cute.arch.fence_proxy("async.global")
                m_tile, n_tile, ring_tile = self._task_tile(tt, ticket_q, taken, index)
                expert = Int32(0)
                if const_expr(self.spec.ticket_ring):
                    expert = ring_words(ticket_q, taken - 1)[D_EXPERT]
                else:
                    expert = self._expert_of(ctx, routing.tile_expert, rank, m_tile)
                state = pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages, loads)
                if const_expr(self.spec.rows_in_place):
                    self._fill_stages_direct(ctx, tt, routing, index, rank, ttype, k_tiles, state,
                                             ab_pipeline, ring_x, direct, m_tile, n_tile,
                                             ring_tile, expert, tma, row_begin)
                if const_expr(not self.spec.rows_in_place):
                    for k in range(k_tiles):
                        ab_pipeline.producer_acquire(state)
                        bar = ab_pipeline.producer_get_barrier(state)
                        self._issue_tma_loads(tma, ttype, k, state.index, bar, m_tile, n_tile,
                                              ring_tile, expert, rank, True)
                        ab_pipeline.producer_commit(state)
                        state.advance()
            loads += self._loads_of(run, noop, ttype, k_tiles)
            q, q_next, index, rank, blk, q_base = self._producer_task(
                ctx, tt, routing, live_prefix, ticket_q, ticket_bars, taken, q, q_next, blk,
                q_base, False)
            if const_expr(self.spec.ticket_ring):
                taken += 1
        tail = pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages, loads)
        if const_expr(self.spec.rows_in_place):
            cute.arch.cp_async_wait_group(0)
            if direct.warp_idx == self.load_warp:
                ab_pipeline.producer_tail(tail)
        else:
            ab_pipeline.producer_tail(tail)

    def _producer_sync(self):
        """The producer warpgroup's named barrier (rows in place)."""
        return pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.PRODUCER),
                                     num_threads=PRODUCER_THREADS)

    @cute.jit
    def _producer_task(self, ctx, tt: TaskTables, routing: Routing, live_prefix: Int32,
                       ticket_q, ticket_bars, taken: Int32, q: Int32, q_next: Int32, blk: Int32,
                       q_base: Int32, first: cutlass.Constexpr[bool]):
        """A producer warp's next compute task: (q, q_next, index, rank, blk, q_base), index -1
        once the queue is exhausted. "static": every warp resolves the ticket itself. With the
        ticket ring, warp 0 takes and resolves it and its lane 0 publishes the task's words
        (``_publish_task``); the other producer warps read them from the ring."""
        index, rank = Int32(-1), Int32(0)
        if const_expr(self.spec.ticket_ring):
            q, q_next = self._producer_ticket(tt.counters, q, q_next, first)
        elif const_expr(not first):
            q += self.num_compute_ctas
        if const_expr(self.spec.ticket_ring):
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == self.load_warp:
                index, rank, blk, q_base = self._ticket(tt, live_prefix, int(Role.COMPUTE), q,
                                                        blk, q_base)
                ring_give_back(ticket_bars, taken)  # warp 0 reads the slots it writes too
                if cute.arch.lane_idx() == 0:
                    self._publish_task(ctx, tt, routing.tile_expert, ticket_q, ticket_bars,
                                       taken, index, rank)
                ring_wait_full(ticket_bars, taken)  # lane 0's slot words, for every lane
            else:
                index, rank = ring_next(ticket_q, ticket_bars, taken)
        else:
            index, rank, blk, q_base = self._ticket(tt, live_prefix, int(Role.COMPUTE), q, blk,
                                                    q_base)
        return q, q_next, index, rank, blk, q_base

    @cute.jit
    def _producer_ticket(self, counters, q: Int32, q_next: Int32, first: cutlass.Constexpr[bool]):
        """Ticket ring, a producer warp: this CTA's next compute ticket and lane 0's ticket
        after it. Lane 0 of warp 0 takes the following ticket now, so the atomic's latency
        hides behind a task; holding one ticket ahead cannot deadlock (it is larger than the
        one being run). "strided": the tickets come by the stride from ``q`` (the CTA's
        compute index on the first call) instead of from the counter."""
        first_q = q
        q = Int32(0)
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == self.load_warp:
            if cute.arch.lane_idx() == 0:
                slot = self._ticket_slot(counters, int(Role.COMPUTE))
                if const_expr(first):
                    if const_expr(self.spec.tickets == "strided"):
                        q_next = first_q
                    else:
                        q_next = self._take_ticket(counters, slot)
                q = q_next
                if const_expr(self.spec.tickets == "strided"):
                    q_next = q + self.num_compute_ctas
                else:
                    q_next = self._take_ticket(counters, slot)
            q = cute.arch.shuffle_sync(q, 0)
        return q, q_next

    @cute.jit
    def _publish_task(self, ctx, tt: TaskTables, tile_expert, ticket_q, ticket_bars, k: Int32,
                      index: Int32, rank: Int32):
        """Lane 0 of the producer's warp 0: ring use k holds task ``index`` of ``rank`` as the
        compute warps need it (``D_*`` words; index -1 ends the walk)."""
        tasks = tt.tasks
        tword, m_tile, n_tile, ring_tile = Int32(0), Int32(0), Int32(0), Int32(0)
        expert, signal, row_begin, num_waits = Int32(0), Int32(0), Int32(0), Int32(0)
        if index >= 0:
            row_begin, num_waits = tasks[index, TaskWord.ROW_BEGIN], tasks[index, TaskWord.NUM_WAITS]
            run, noop = self._task_state(ctx, tt, index, rank)
            ttype = tasks[index, TaskWord.TYPE]
            tword = (ttype + cutlass.select_(run, Int32(RUN_FLAG), Int32(0))
                     + cutlass.select_(noop, Int32(NOOP_FLAG), Int32(0)))
            m_tile, n_tile, ring_tile = self._row_tile(tt, index)
            if run and not noop and self._is_gemm(ttype):
                expert = self._expert_of(ctx, tile_expert, rank, m_tile)
            signal = (tt.counter_offsets[tasks[index, TaskWord.SIGNAL_GROUP]]
                      + tasks[index, TaskWord.SIGNAL_INDEX])
        ring_wait_empty(ticket_bars, k)
        words = ring_words(ticket_q, k)
        words[D_INDEX] = index
        words[D_RANK] = rank
        words[D_TYPE] = tword
        words[D_MTILE] = m_tile
        words[D_NTILE] = n_tile
        words[D_RING_TILE] = ring_tile
        words[D_EXPERT] = expert
        words[D_SIGNAL] = signal
        words[D_ROW_BEGIN] = row_begin
        words[D_NUM_WAITS] = num_waits
        cute.arch.mbarrier_arrive(ticket_bars + k % TICKET_SLOTS)  # release: readers that see the phase see the words

    @cute.jit
    def _task_kind(self, ctx, tt: TaskTables, ticket_q, taken: Int32, index: Int32, rank: Int32):
        """(run, noop, type) of the task being walked (ring use ``taken - 1``, else its row)."""
        if const_expr(self.spec.ticket_ring):
            tword = ring_words(ticket_q, taken - 1)[D_TYPE]
            run = (tword & RUN_FLAG) != 0
            noop = (tword & NOOP_FLAG) != 0
            ttype = tword & (RUN_FLAG - 1)
        else:
            run, noop = self._task_state(ctx, tt, index, rank)
            ttype = tt.tasks[index, TaskWord.TYPE]
        return run, noop, ttype

    @cute.jit
    def _task_tile(self, tt: TaskTables, ticket_q, taken: Int32, index: Int32):
        """(m_tile, n_tile, ring tile) of the GEMM task being walked."""
        m_tile, n_tile, ring_tile = Int32(0), Int32(0), Int32(0)
        if const_expr(self.spec.ticket_ring):
            words = ring_words(ticket_q, taken - 1)
            m_tile, n_tile, ring_tile = words[D_MTILE], words[D_NTILE], words[D_RING_TILE]
        else:
            m_tile, n_tile, ring_tile = self._row_tile(tt, index)
        return m_tile, n_tile, ring_tile

    @cute.jit
    def _row_tile(self, tt: TaskTables, index: Int32):
        """(m_tile, n_tile, ring tile) from task ``index``'s row."""
        return (tt.tasks[index, TaskWord.M_TILE], tt.tasks[index, TaskWord.N_TILE],
                tt.tasks[index, TaskWord.RING_ROW] // TILE_M)

    @cute.jit
    def _expert_of(self, ctx, tile_expert, rank: Int32, m_tile: Int32) -> Int32:
        """The launch-wide expert index of ``rank``'s M-tile (weights are stacked rank-major)."""
        return rank * ctx.local_experts + tile_expert[rank, cutlass.max(m_tile, 0)]

    @cute.jit
    def _issue_tma_loads(self, tma: TmaLoads, ttype, k, stage, bar, m_tile, n_tile, ring_tile,
                         expert, rank, fc1_a: cutlass.Constexpr[bool]):
        """The TMA loads of k-tile ``k`` of a GEMM task into ``stage``: FC1 x rows (when
        ``fc1_a``) and the gate / up halves, FC2 h rows and W_down, or the shared expert's."""
        if ttype == int(TaskType.FC1):
            if const_expr(fc1_a):
                cute.copy(tma.a_x, tma.g_a_x[(None, ring_tile, k, rank)], tma.s_a_x[(None, stage)], tma_bar_ptr=bar)
            cute.copy(tma.wg, tma.g_wg[(None, n_tile, k, expert)], tma.s_wg[(None, stage)], tma_bar_ptr=bar)
            cute.copy(tma.wu, tma.g_wu[(None, n_tile, k, expert)], tma.s_wu[(None, stage)], tma_bar_ptr=bar)
        elif ttype == int(TaskType.FC2):
            cute.copy(tma.a_h, tma.g_a_h[(None, ring_tile, k, rank)], tma.s_a_h[(None, stage)], tma_bar_ptr=bar)
            cute.copy(tma.wd, tma.g_wd[(None, n_tile, k, expert)], tma.s_wd[(None, stage)], tma_bar_ptr=bar)
        if const_expr(self.spec.has_shared):
            if ttype == int(TaskType.SHARED_FC1):
                cute.copy(tma.sh_a_x, tma.g_sh_a_x[(None, m_tile, k, rank)], tma.s_sh_a_x[(None, stage)], tma_bar_ptr=bar)
                cute.copy(tma.sh_wg, tma.g_sh_wg[(None, n_tile, k, rank)], tma.s_sh_wg[(None, stage)], tma_bar_ptr=bar)
                cute.copy(tma.sh_wu, tma.g_sh_wu[(None, n_tile, k, rank)], tma.s_sh_wu[(None, stage)], tma_bar_ptr=bar)
            elif ttype == int(TaskType.SHARED_FC2):
                cute.copy(tma.sh_a_h, tma.g_sh_a_h[(None, m_tile, k, rank)], tma.s_sh_a_h[(None, stage)], tma_bar_ptr=bar)
                cute.copy(tma.sh_wd, tma.g_sh_wd[(None, n_tile, k, rank)], tma.s_sh_wd[(None, stage)], tma_bar_ptr=bar)

    @cute.jit
    def _fill_stages_direct(self, ctx, tt: TaskTables, routing: Routing, index, rank, ttype,
                            k_tiles, state, ab_pipeline, ring_x, direct: DirectRows, m_tile,
                            n_tile, ring_tile, expert, tma: TmaLoads, row_begin=None):
        """Rows in place: one GEMM task's k-tiles, by the whole producer warpgroup. Every stage
        takes 1 + 128 arrivals: warp 0 arms it with the TMA bytes (B only for FC1, A and B
        otherwise) and issues the TMA loads; each thread then either lands its share of FC1's
        A rows with cp.async (arrival when they land) or arrives at once."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        b_bytes = tile_n * K_TILE_BYTES
        tidx, warp_idx = direct.tidx, direct.warp_idx
        rows = gathered_rows_of(tidx)
        srcs = [Int64(0) for _ in rows]
        if ttype == int(TaskType.FC1):
            srcs = self._direct_row_addresses(ctx, tt, routing, index, rank, ring_x, ring_tile,
                                              rows, row_begin)
        for k in range(k_tiles):
            ab_pipeline.sync_object_empty.wait(state.index, state.phase)
            bar = ab_pipeline.producer_get_barrier(state)
            stage = state.index
            if warp_idx == self.load_warp:
                tx = b_bytes + tile_m * K_TILE_BYTES
                if ttype == int(TaskType.FC1):
                    tx = b_bytes
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, tx)
                # FC1's A rows come by cp.async below, not by TMA
                self._issue_tma_loads(tma, ttype, k, stage, bar, m_tile, n_tile, ring_tile,
                                      expert, rank, False)
            if ttype == int(TaskType.FC1):
                cp_async_a_rows(direct.sA_base + stage * (tile_m * TILE_K), srcs, rows, k, tidx)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
            else:
                cute.arch.mbarrier_arrive(bar)
            state.advance()

    def _direct_row_addresses(self, ctx, tt: TaskTables, routing: Routing, index, rank, ring_x,
                              ring_tile, rows, row_begin=None):
        """Byte addresses of an FC1 task's A rows ``rows``: this rank's own x row for a local
        row (never copied into the ring), the ring row otherwise. Traced inline (a plain
        method: a list of DSL values cannot leave a ``cute.jit`` function)."""
        tile_m = self.tile_shape_mnk[0]
        row_bytes = Int64(self.x_row_bytes(ring_x))
        x_base = routing.peer_bases[rank, ctx.rank_base + rank] + ctx.x_offset
        first = tt.tasks[index, TaskWord.ROW_BEGIN] if row_begin is None else row_begin
        return [self.x_row_address(ctx, routing, ring_x, rank, ring_tile * tile_m, first, r,
                                   x_base, row_bytes) for r in rows]

    def x_row_address(self, ctx, routing: Routing, ring_x, rank, ring_first, first, r,
                      x_base=None, row_bytes=None, offset=None) -> Int64:
        """Byte address (plus ``offset``) of row ``r`` of a tile's x rows as FC1 reads them
        with rows in place: this rank's own x row for a local row (schedule row ``first +
        r``), never copied into the ring, else ring row ``ring_first + r``. ``x_base`` and
        ``row_bytes`` (this rank's x rows and their stride) are derived when not given (a
        caller with several rows hoists them). Traced inline."""
        in_ring = ring_x[ring_first + r, None, rank].iterator.toint()
        if offset is not None:
            in_ring = in_ring + offset
        if x_base is None:
            x_base = routing.peer_bases[rank, ctx.rank_base + rank] + ctx.x_offset
        if row_bytes is None:
            row_bytes = Int64(self.x_row_bytes(ring_x))
        in_x = x_base + Int64(routing.row_token[rank, first + r]) * row_bytes
        if offset is not None:
            in_x = in_x + offset
        return Int64(cutlass.select_(routing.row_peer[rank, first + r] == ctx.rank_base + rank,
                                     in_x, in_ring))

    @cute.jit
    def _k_tiles(self, ttype: Int32, t_a_x, t_a_h, s_t_a_h, t_hidden, fp8_ops=None) -> Int32:
        """K-tiles of a GEMM task: H / 64 for the gate/up GEMMs, I (or Is) / 64 for down.
        fp8 (``fp8_ops``, or the producer's fp8 TMA tensors ``t_a_x`` / ``t_a_h``): the routed
        GEMMs' H' / 128 and I' / 128, the shared expert's as in bf16 (``t_hidden``: H wide)."""
        k_tiles = cute.size(t_a_x, mode=[1]) // TILE_K
        if const_expr(self.spec.fp8):
            if const_expr(fp8_ops is not None):
                t_a_x, t_a_h = fp8_ops.ring_x, fp8_ops.ring_h
            k_tiles = cute.size(t_a_x, mode=[1]) // fp8.GROUP
            if ttype == int(TaskType.FC2):
                k_tiles = cute.size(t_a_h, mode=[1]) // fp8.GROUP
        elif ttype == int(TaskType.FC2):
            k_tiles = cute.size(t_a_h, mode=[1]) // TILE_K
        if const_expr(self.spec.has_shared):
            if const_expr(self.spec.fp8):
                if ttype == int(TaskType.SHARED_FC1):
                    k_tiles = cute.size(t_hidden, mode=[1]) // TILE_K
            if ttype == int(TaskType.SHARED_FC2):
                k_tiles = cute.size(s_t_a_h, mode=[1]) // TILE_K
        return k_tiles

    @cute.jit
    def _loads_of(self, run, noop, ttype: Int32, k_tiles: Int32) -> Int32:
        """Pipeline stages a task consumes: its k-tiles if it is a GEMM that runs, else 0."""
        loads = Int32(0)
        if run and not noop and self._is_gemm(ttype):
            loads = k_tiles
        return loads

    @cute.jit
    def _is_gemm(self, ttype: Int32):
        """A compute task that runs through the stage pipeline: FC1, FC2 and the shared
        expert's, whose types are below KSUM's (not a KSUM, nor a BARRIER run by a compute CTA
        when there is no comm CTA)."""
        return ttype < int(TaskType.KSUM)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consumer_loop(self, ctx, tt: TaskTables, routing: Routing, ring_y, out, shared_y,
                      timeline_buf, ab_pipeline, tiled_mma, sA, sB, sC, stores: TmaStores, tidx,
                      warp_idx, warpgroup_idx, compute_cta, ticket_q, ticket_bars, ksum_stage,
                      saved: SavedRows, fp8_ops=None, half_mma=None, bf16_stages=None,
                      bf16_mma=None):
        consumer_tidx = tidx - 128
        mma_slice = (warpgroup_idx - 1) * 128
        tCrA, tCrB, acc, num_k_blocks, epi = self.consumer_parts(
            tiled_mma, sA, sB, sC, mma_slice, consumer_tidx)
        halves = None  # fp8: one N-half's fragments and the partial (PromotingMainloop)
        bf16_parts = None  # fp8 with a shared expert: its bf16 wgmmas' fragments, the same acc
        if const_expr(self.spec.fp8):
            halves = self.half_fragments(half_mma, sA, sB, mma_slice)
            if const_expr(self.spec.has_shared):
                thr = bf16_mma.get_slice(mma_slice)
                bf16_parts = (bf16_mma.make_fragment_A(thr.partition_A(bf16_stages[0])),
                              bf16_mma.make_fragment_B(thr.partition_B(bf16_stages[1])))
        coords = None  # save_preact: this thread's subtile coordinates, for its rows' stores
        if const_expr(self.spec.save_preact):
            coords = self.epi_coords(epi, consumer_tidx)
        tma_store_pipeline, barrier, is_store_warp = self.epilogue_sync(warp_idx, warpgroup_idx)

        loads = Int32(0)
        subtiles = Int32(0)
        live_prefix = self._live_prefix(ctx, tt, int(Role.COMPUTE))
        blk, q_base = Int32(0), Int32(0)  # ticket block cursor (rank_blocks)
        taken = Int32(0)  # ticket ring uses read
        q = compute_cta
        index, rank = Int32(-1), Int32(0)
        if const_expr(self.spec.ticket_ring):
            index, rank = ring_next(ticket_q, ticket_bars, taken)
            taken += 1
        else:
            index, rank, blk, q_base = self._ticket(tt, live_prefix, int(Role.COMPUTE), q, blk,
                                                    q_base)
        # defer_signals: the counter of the FC1 / FC2 task whose publish is held back (-1:
        # none) and its type
        held, held_type = Int32(-1), Int32(-1)
        while index >= 0:
            run, noop, ttype = self._task_kind(ctx, tt, ticket_q, taken, index, rank)
            k_tiles = self._k_tiles(ttype, stores.t_y, stores.t_h, stores.t_sh_h, stores.t_y,
                                    fp8_ops)
            t_start = self._now_if_recording()
            # with the recorder, a GEMM task's EPILOGUE and SIGNAL phases (tasks.TaskType)
            t_epilogue, t_signal = t_start, t_start
            gemm_runs = run and not noop and self._is_gemm(ttype)
            deferrable = False
            if const_expr(self.spec.defer_signals):
                deferrable = gemm_runs and (ttype == int(TaskType.FC1) or ttype == int(TaskType.FC2))
                fc1_then_fc2 = held_type == int(TaskType.FC1) and ttype == int(TaskType.FC2)
                if held >= 0 and (not deferrable or fc1_then_fc2):
                    # this task may wait on the held one (an FC2 on FC1's h, a KSUM on all)
                    self._flush_signal(tt.counters, held, is_store_warp, consumer_tidx)
                    held = Int32(-1)
            if gemm_runs:
                if const_expr(self.spec.fp8):
                    # the routed GEMMs promote every 128-deep group (PromotingMainloop, the
                    # stages released inside); the shared expert's run the bf16 mainloop
                    routed = True
                    if const_expr(self.spec.has_shared):
                        routed = ttype == int(TaskType.FC1) or ttype == int(TaskType.FC2)
                    hook_args = MainloopArgs(ctx, timeline_buf, index, rank, consumer_tidx == 0,
                                             tt.counters, held, is_store_warp, consumer_tidx)
                    if routed:
                        # the promoting mainloop takes hooks in recorder builds only (STAGE_WAIT)
                        self._fp8_mainloop(ctx, tt, routing, ticket_q, taken, index, rank,
                                           ttype, fp8_ops, ab_pipeline, half_mma, acc, halves,
                                           loads, k_tiles, consumer_tidx,
                                           hook_args if const_expr(self.spec.timeline) else None)
                    if const_expr(self.spec.has_shared):
                        if not routed:
                            release = self.mainloop(
                                ab_pipeline, bf16_mma, acc, bf16_parts[0], bf16_parts[1],
                                loads, k_tiles, cute.size(bf16_parts[0], mode=[2]), hook_args)
                            cute.nvgpu.warpgroup.wait_group(0)
                            ab_pipeline.consumer_release(release)
                    t_epilogue = self._now_if_recording()
                else:
                    # defer_signals: the held publish goes out inside this mainloop, after its
                    # first DEFER_FLUSH_KTILES k-tiles (the tensor cores busy meanwhile), not
                    # after the whole mainloop: other CTAs' FC2 tasks wait on a held FC1 counter
                    release = self.mainloop(ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads,
                                            k_tiles, num_k_blocks,
                                            MainloopArgs(ctx, timeline_buf, index, rank,
                                                         consumer_tidx == 0, tt.counters, held,
                                                         is_store_warp, consumer_tidx))
                    cute.nvgpu.warpgroup.wait_group(0)
                    t_epilogue = self._now_if_recording()
                    ab_pipeline.consumer_release(release)
                    if const_expr(self.spec.defer_signals):
                        held = Int32(-1)  # published in the mainloop

                subtiles, t_signal = self._store_task(epi, ttype, tt, ticket_q, taken, index,
                                                      rank, subtiles, barrier, tma_store_pipeline,
                                                      is_store_warp, stores, saved, coords,
                                                      consumer_tidx, not deferrable)
                if const_expr(self.spec.fp8):
                    if ttype == int(TaskType.FC1):  # h as e4m3 rows by generic stores
                        self._store_h_fp8(tt, ticket_q, taken, index, rank, fp8_ops, acc,
                                          consumer_tidx, saved)
                        t_signal = self._now_if_recording()
            elif run and not noop:
                # a KSUM, or with no comm CTA the BARRIER (no rows: it only waits, and stores
                # its flag when it publishes)
                self._ksum(ctx, tt, routing, ring_y, out, shared_y, timeline_buf, index, rank,
                           consumer_tidx, barrier, ksum_stage, ttype)
            if run:
                if not self._is_gemm(ttype):  # KSUM: every warp's rows are written first
                    barrier.arrive_and_wait()
                if const_expr(self.spec.fp8):
                    if ttype == int(TaskType.FC1):  # fp8's h: every thread stored its rows
                        barrier.arrive_and_wait()
                if deferrable:  # published by a later task's _flush_signal
                    held, held_type = ring_words(ticket_q, taken - 1)[D_SIGNAL], ttype
                if consumer_tidx == 0:  # lane 0 of the store warp (warp 4)
                    self._publish_compute_task(ctx, tt, routing.peer_bases, ticket_q, taken,
                                               index, rank, ttype, t_start, timeline_buf,
                                               t_epilogue, t_signal, deferrable)
            loads += self._loads_of(run, noop, ttype, k_tiles)
            if const_expr(self.spec.ticket_ring):
                index, rank = ring_next(ticket_q, ticket_bars, taken)
                taken += 1
            else:
                q += self.num_compute_ctas
                index, rank, blk, q_base = self._ticket(tt, live_prefix, int(Role.COMPUTE), q,
                                                        blk, q_base)
        if const_expr(self.spec.defer_signals):
            if held >= 0:
                self._flush_signal(tt.counters, held, is_store_warp, consumer_tidx)
        tma_store_pipeline.producer_tail()

    @cute.jit
    def _store_task(self, epi, ttype: Int32, tt: TaskTables, ticket_q, taken: Int32,
                    index: Int32, rank: Int32, subtiles: Int32, barrier, store_pipeline,
                    is_store_warp, stores: TmaStores, saved: SavedRows, coords,
                    consumer_tidx: Int32, wait_stores=True):
        """A GEMM task's epilogue: its output tile (h of FC1, y of FC2, the shared expert's
        h / y) stored by TMA, then the store warp waits for the stores to land and syncs its
        lanes, so that lane 0 may publish without a barrier. save_preact: an FC1 task's
        epilogue also stores its rows' g | u (``row_epilogue``), the rows found through the
        schedule tile ``m_tile`` (the ring tile only places h). Returns the epilogue subtiles
        used so far and, with the recorder, the time before the store warp's wait (the start
        of its SIGNAL phase). ``wait_stores`` False (a task whose publish is deferred): the
        store warp does not wait here (``_flush_signal`` does)."""
        m_tile, n_tile, ring_tile = self._task_tile(tt, ticket_q, taken, index)
        if ttype == int(TaskType.FC1):
            if const_expr(not self.spec.fp8):  # fp8: _store_h_fp8
                visit_args = None
                if const_expr(self.spec.save_preact):
                    _, visit_args = self.row_visit_args(
                        epi, "swiglu", coords, m_tile, n_tile, saved.preact[(None, None, rank)],
                        saved.row_slot[(rank, None)], None, consumer_tidx)
                self._store_tile(epi, stores.h, stores.t_h, ring_tile, n_tile, rank, True,
                                 subtiles, barrier, store_pipeline, is_store_warp, visit_args)
        elif ttype == int(TaskType.FC2):
            self._store_tile(epi, stores.y, stores.t_y, ring_tile, n_tile, rank, False, subtiles,
                             barrier, store_pipeline, is_store_warp)
        if const_expr(self.spec.has_shared):
            if ttype == int(TaskType.SHARED_FC1):
                visit_args = None
                if const_expr(self.spec.save_preact):
                    _, visit_args = self.row_visit_args(
                        epi, "swiglu", coords, m_tile, n_tile,
                        saved.shared_preact[(None, None, rank)], saved.shared_rows, None,
                        consumer_tidx)
                self._store_tile(epi, stores.sh_h, stores.t_sh_h, m_tile, n_tile, rank, True,
                                 subtiles, barrier, store_pipeline, is_store_warp, visit_args)
            elif ttype == int(TaskType.SHARED_FC2):
                self._store_tile(epi, stores.sh_y, stores.t_sh_y, m_tile, n_tile, rank, False,
                                 subtiles, barrier, store_pipeline, is_store_warp)
        t_signal = self._now_if_recording()  # the store warp's: its last store issued
        if is_store_warp and wait_stores:
            self._stores_landed()
        return subtiles + self._epi_subtiles(ttype), t_signal

    @cute.jit
    def _stores_landed(self):
        """The store warp: its TMA stores have landed and are ordered before a generic
        release, and its lanes are synced so that lane 0 may publish."""
        common.tma_stores_landed()
        cute.arch.sync_warp()  # lane 0 signals after the storing lane's wait

    @cute.jit
    def _flush_signal(self, counters, signal: Int32, is_store_warp, consumer_tidx: Int32):
        """defer_signals: publish the held-back task's counter ``signal`` (one rank) once the
        store warp has seen its stores land."""
        common.publish_stored(counters[0, None], signal, is_store_warp, consumer_tidx == 0,
                              self.spec.scope)

    @cute.jit
    def _publish_compute_task(self, ctx, tt: TaskTables, peer_bases, ticket_q, taken: Int32,
                              index: Int32, rank: Int32, ttype: Int32, t_start: Int64,
                              timeline_buf, t_epilogue: Int64, t_signal: Int64, held):
        """One thread, after the task's writes are complete: release-publish its counter (from
        the ticket ring or the task row) and, with the recorder, its span and for a GEMM task
        its EPILOGUE (from ``t_epilogue``, the mainloop's end) and SIGNAL (from ``t_signal``,
        its last store issued) phases. With no comm CTA a BARRIER's flag is stored here too,
        by the thread that waited for its FC2 tiles. ``held`` (defer_signals): the counter is
        published later (``_flush_signal``); only the span is recorded, ending with its stores
        issued."""
        t_end = t_start
        if held:
            t_end = t_signal
        else:
            self._fence()
            if const_expr(self.spec.num_comm_ctas == 0):
                if ttype == int(TaskType.BARRIER):
                    self._announce_done(ctx, peer_bases, tt.error, rank)
            if const_expr(self.spec.ticket_ring):
                signal = ring_words(ticket_q, taken - 1)[D_SIGNAL]
                common.counter_publish(tt.counters[rank, None], signal, 1, self.spec.scope)
            else:
                self._signal_task(tt, index, rank)
            if const_expr(self.spec.timeline):
                t_end = common.timeline_now()
        if const_expr(self.spec.timeline):
            self._record_compute_task(ctx, index, rank, ttype, t_start, t_end, timeline_buf,
                                      t_epilogue, t_signal)

    @cute.jit
    def _record_compute_task(self, ctx, index: Int32, rank: Int32, ttype: Int32, t_start: Int64,
                             t_end: Int64, timeline_buf, t_epilogue: Int64, t_signal: Int64):
        """The recorder: a compute task's span and, for a GEMM task, its EPILOGUE and SIGNAL
        phases (the SIGNAL ends with the task)."""
        slot = common.timeline_reserve(timeline_buf, 1)
        common.timeline_write(timeline_buf, slot, int(Role.COMPUTE), ttype, index,
                              ctx.rank_base + rank, t_start, t_end)
        if self._is_gemm(ttype):
            phases = common.timeline_reserve(timeline_buf, 2)
            common.timeline_write(timeline_buf, phases, int(Role.COMPUTE),
                                  int(TaskType.EPILOGUE), index, ctx.rank_base + rank,
                                  t_epilogue, t_signal)
            common.timeline_write(timeline_buf, phases + 1, int(Role.COMPUTE),
                                  int(TaskType.SIGNAL), index, ctx.rank_base + rank,
                                  t_signal, t_end)

    @cute.jit
    def _epi_subtiles(self, ttype: Int32) -> Int32:
        acc_n = self.tile_shape_mnk[1] // self.epi_tile[1]
        n = Int32(acc_n)
        if ttype == int(TaskType.FC1) or ttype == int(TaskType.SHARED_FC1):
            n = Int32(acc_n // 2)
        if const_expr(self.spec.fp8):
            if ttype == int(TaskType.FC1):
                n = Int32(0)  # h leaves by generic stores (_store_h_fp8)
        return n * (TILE_M // self.epi_tile[0])

    @cute.jit
    def _store_tile(self, epi, tma_atom, t_out, m_tile: Int32, n_tile: Int32, rank: Int32,
                    swiglu: cutlass.Constexpr[bool], subtiles: Int32, barrier, store_pipeline,
                    is_store_warp, visit_args=None):
        """The task's output tile of ``t_out`` (rows, columns, rank) through the GEMM core's
        epilogue (``visit_args``: save_preact's rows, ``row_epilogue``)."""
        tile_m, tile_n, _ = self.tile_shape_mnk
        out_tile_n = tile_n // 2 if const_expr(swiglu) else tile_n
        g_out = cute.local_tile(t_out, (tile_m, out_tile_n), (None, None, None))
        self.tile_epilogue(epi, (tma_atom,), (g_out[(None, None, m_tile, n_tile, rank)],),
                           "swiglu" if const_expr(swiglu) else "store", 0, subtiles, barrier,
                           store_pipeline, is_store_warp, visit_args)

    # ------------------------------------------------------------------ mainloop hooks
    @cute.jit
    def first_stage_wait(self, hook_args) -> Int64:
        return self._now_if_recording()

    @cute.jit
    def first_stage_ready(self, t0: Int64, hook_args):
        """The recorder: the wait for a task's first stage (the producer still resolving the
        task or loading its first k-tile) as a STAGE_WAIT span, when it is long enough."""
        self._record_wait(hook_args.ctx, hook_args.timeline_buf, int(Role.COMPUTE),
                          int(TaskType.STAGE_WAIT), hook_args.index, hook_args.rank, t0,
                          hook_args.leader, STAGE_WAIT_RECORD_MIN_NS)

    @cute.jit
    def stage_ready(self, hook_args):
        """Rows in place: FC1's A rows land by cp.async (generic proxy) and wgmma reads smem
        through the async proxy, so every consumer fences the proxies after a stage's wait
        (CUTLASS's cp.async mainloops rely on the mbarrier alone; not measured without)."""
        if const_expr(self.spec.rows_in_place):
            cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def k_tile_issued(self, k: Int32, hook_args):
        """defer_signals: the held publish goes out once DEFER_FLUSH_KTILES k-tiles are issued."""
        if const_expr(self.spec.defer_signals):
            if k == DEFER_FLUSH_KTILES - 1 and hook_args.held >= 0:
                self._flush_signal(hook_args.counters, hook_args.held, hook_args.is_store_warp,
                                   hook_args.consumer_tidx)

    @cute.jit
    def mainloop_end(self, k_tiles: Int32, hook_args):
        """defer_signals: ... or at the end of a mainloop shorter than that."""
        if const_expr(self.spec.defer_signals):
            if k_tiles < DEFER_FLUSH_KTILES and hook_args.held >= 0:
                self._flush_signal(hook_args.counters, hook_args.held, hook_args.is_store_warp,
                                   hook_args.consumer_tidx)


# ---------------------------------------------------------------------- gathered A rows
def gathered_rows_of(tidx):
    """The A-tile rows whose chunk ``tidx & 7`` producer thread ``tidx`` (0..127) loads."""
    return [(tidx >> 3) + GATHER_ROW_STRIDE * i for i in range(GATHER_ROWS_PER_THREAD)]


def cp_async_a_rows(stage, srcs, rows, k_tile, tidx):
    """This thread's cp.async.cg copies of A k-tile ``k_tile`` into ``stage`` (the stage's bf16
    smem pointer, 128B-swizzled K-major: chunk j of row r lands at r * 64 + (j ^ (r % 8)) * 8
    elements). ``srcs[i]`` is the global byte address of row ``rows[i]``."""
    chunk = tidx & 7
    for src, r in zip(srcs, rows):
        gsrc = cute.make_ptr(BFloat16, src + (k_tile * TILE_K + chunk * 8) * 2,
                             cute.AddressSpace.gmem, assumed_align=16)
        nvvm.cp_async_shared_global(stage + r * TILE_K + ((chunk ^ (r & 7)) * 8), gsrc, 16, "cg")
