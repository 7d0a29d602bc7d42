"""The backward megakernel's FC2_DGRAD tasks in the pingpong form (``backward.py``), for H up
to ``constants.FC2_DGRAD_PINGPONG_MAX_K``: the form of ``expert_backward.fc2_dgrad``'s launch,
so the dgated epilogue of one consumer warpgroup runs under the other's mainloop.

    FC2_DGRAD (j, n)  dY rows of M-tile j @ W_down[e] (K = H): a 128 x 128 tile, one consumer
                      warpgroup's; the dgated epilogue (dG | dU, w * h, the rows' partials of
                      N-tile n) in 64 x 32 subtiles; its counter published once its stores land

A CTA's live FC2_DGRAD positions alternate between the two warpgroups (the n-th live one to
warpgroup n % 2), which take turns at the mainloop (``NamedBarriers.MMA_ORDER``: a warpgroup
starts waiting on stages only once the other has waited on all of its tile's, so a parity
wait never meets a stage two fills ahead). The list queues every FC2_DGRAD before any
FC1_DGRAD (one minibatch), so the form holds for a prefix of the walk: the phase ends at
``fc2_end`` (a scalar: the queue's FC2_DGRAD count).

Smem: its own ring of ``FC2_STAGES`` stages of 32 KB (a 128 x 64 A box, then a 128 x 64
MN-major B box) with its own mbarriers, over the bytes of the cooperative form's A and B stages
(3 x 48 KB); its epilogue buffers (per warpgroup two stages of three 64 x 32 outputs) over the
cooperative ones. Before the cooperative tasks, the producer waits until every stage of this
ring has been released (``producer_tail``) and the consumers drain their stores
(``switch_forms``).
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Int32, Int64, const_expr

from mok_cute.constants import FC2_DGRAD_PINGPONG_TILE_N, TILE_K, TILE_M
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import GemmCoreSm90, pipeline_state, smem_overlay, tma_tiles
from mok_cute.kernels.megakernel.backward_comm import signal_slot
from mok_cute.kernels.megakernel.backward_recorder import COMPUTE, EPILOGUE, START, Recorder
from mok_cute.kernels.megakernel.backward_shared import SHARED_FC2_DGRAD, SharedOperands
from mok_cute.kernels.row_epilogue import RowEpilogueMixin
from mok_cute.tasks_backward import BackwardWord

FC2_STAGES = 4  # 4 x 32 KB within the cooperative form's 3 x 48 KB of operand stages


class Fc2PingpongForm(RowEpilogueMixin, GemmCoreSm90):
    """``expert_backward.fc2_dgrad``'s pingpong tile form (dgated, W_down read MN-major) on a
    ring of ``FC2_STAGES`` stages laid over a host kernel's operand smem."""

    def __init__(self):
        super().__init__(FC2_DGRAD_PINGPONG_TILE_N, pingpong=True, b_mn_major=True, epi_outputs=3)
        self.save_preact = False
        self.a_dtype = self.b_dtype = self.c_dtype = BFloat16
        self._setup_attributes()
        self.ab_stages = FC2_STAGES
        self.a_smem_layout_staged = self.staged_layout(BFloat16, (TILE_M, TILE_K), FC2_STAGES)
        self.b_smem_layout_staged = self.staged_layout(
            BFloat16, (FC2_DGRAD_PINGPONG_TILE_N, TILE_K), FC2_STAGES, mn_major=True)

    def check_fits(self, a_staged, b_staged):
        """Host side: the ring fits in a host kernel's A and B stages (laid out back to back)."""
        ring = cute.cosize(self.a_smem_layout_staged) + cute.cosize(self.b_smem_layout_staged)
        assert ring <= cute.cosize(a_staged) + cute.cosize(b_staged), "the FC2 ring needs more smem"

    def kernel_args(self):
        """What the kernel takes of this form: its tiled MMA, staged A and B box layouts and
        staged epilogue layout."""
        return (self.tiled_mma, self.a_smem_layout_staged, self.b_smem_layout_staged,
                self.epi_smem_layout_staged)

    @cute.jit
    def mainloop_begin(self, hook_args):
        """Wait for this warpgroup's turn (not before the CTA's first FC2_DGRAD)."""
        my_turn, _, waits, _, _, _, _ = hook_args
        if waits:
            my_turn.arrive_and_wait()

    @cute.jit
    def mainloop_end(self, k_tiles: Int32, hook_args):
        """Every stage of this tile has been waited on: the other warpgroup's turn, if the CTA
        has a next live FC2_DGRAD (looked up here, not held through the mainloop)."""
        _, their_turn, _, host, walk, pos, fc2_end = hook_args
        if host._next_live_fc2(walk, pos + host.num_ctas, fc2_end) < fc2_end:
            their_turn.arrive()


class Fc2PingpongTasksMixin:
    """The pingpong FC2_DGRAD phase of ``BackwardMegakernelSm90`` (module docstring). The host
    class sets ``self.fc2 = Fc2PingpongForm()`` and ``self.fc2_pingpong``."""

    def fc2_stages(self, sA, layouts):
        """The ring's A and B stages over the cooperative A (then B) stages' bytes: stage s
        holds its A box at 2 s boxes, its B box at 2 s + 1. Traced inline."""
        _, a_staged, b_staged, _ = layouts
        box = cute.cosize(cute.slice_(a_staged, (None, None, 0)))
        assert box == cute.cosize(cute.slice_(b_staged, (None, None, 0)))
        return (smem_overlay(sA, a_staged, 0, 2 * box), smem_overlay(sA, b_staged, box, 2 * box))

    def fc2_pipeline(self, storage, layouts):
        """The ring's pipeline on its own mbarriers (one consumer warpgroup a stage); traced
        inline before the kernel's ``pipeline_init_wait``."""
        _, a_staged, b_staged, _ = layouts
        ring = self.fc2.make_ab_pipeline(storage, a_staged, b_staged,
                                         barriers=storage.fc2_full_empty)
        cute.arch.mbarrier_init_fence()
        return ring

    @cute.jit
    def _next_live_fc2(self, walk, pos: Int32, fc2_end: Int32) -> Int32:
        """This CTA's first position from ``pos`` whose FC2_DGRAD runs (>= ``fc2_end``: none);
        ``walk``: (tasks, queue, num_tiles), the phase's positions being queue positions."""
        tasks, queue, num_tiles = walk
        at = pos
        searching = at < fc2_end
        while searching:
            live = tasks[queue[at], int(BackwardWord.TILE)] < num_tiles[0]
            if const_expr(self.shared):  # its token tiles run whatever the routing
                live = live or tasks[queue[at], int(BackwardWord.TYPE)] == SHARED_FC2_DGRAD
            if live:
                searching = False
            else:
                at += self.num_ctas
                searching = at < fc2_end
        return at

    @cute.jit
    def _fc2_task(self, walk, pos: Int32, counter_offsets: cute.Tensor):
        """(M-tile, N-tile, counter slot it signals, list index) of the phase's position ``pos``."""
        tasks, queue, _ = walk
        index = queue[pos]
        signal = signal_slot(tasks, index, counter_offsets)
        return (tasks[index, int(BackwardWord.TILE)], tasks[index, int(BackwardWord.N_TILE)],
                signal, index)

    @cute.jit
    def _first_after(self, fc2_end: Int32) -> Int32:
        """This CTA's first walk position at or past ``fc2_end``."""
        first = Int32(cute.arch.block_idx()[0])
        if fc2_end > first:
            first += (fc2_end - first + self.num_ctas - 1) // self.num_ctas * self.num_ctas
        return first

    # ------------------------------------------------------------------ producer
    @cute.jit
    def fc2_producer(self, walk, fc2_end: Int32, tile_expert: cute.Tensor,
                     expert_offsets: cute.Tensor, counter_offsets: cute.Tensor,
                     counters: cute.Tensor, error: cute.Tensor, timeout_ns: Int64, ring, sA,
                     layouts, ops, shared: SharedOperands, timeline_buf: cute.Tensor) -> Int32:
        """The load warp's FC2_DGRAD phase (the shared expert's SHARED_FC2_DGRAD among them):
        per live task its waits, then its k-tiles' A and B boxes; at the end, every stage
        released (the cooperative stages reuse the bytes). Returns the CTA's first position
        past the phase."""
        tma_dy, t_dy, tma_wd, t_wd = ops
        s_a, s_b = self.fc2_stages(sA, layouts)
        parts = self._fc2_ring_parts(s_a, s_b, ops)
        s_parts = None
        if const_expr(self.shared):
            s_parts = self._fc2_ring_parts(s_a, s_b, shared.loads[:4])
        k_tiles = cute.size(t_dy, mode=[1]) // TILE_K
        tasks = walk[0]
        loads = Int32(0)
        pos = self._next_live_fc2(walk, Int32(cute.arch.block_idx()[0]), fc2_end)
        while pos < fc2_end:
            m_tile, n_tile, _, index = self._fc2_task(walk, pos, counter_offsets)
            self.wait_task_recorded(tasks, index, expert_offsets, counter_offsets, counters, error,
                                    timeout_ns, timeline_buf, COMPUTE, cute.arch.lane_idx() == 0)
            cute.arch.fence_proxy("async.global")
            state = pipeline_state(pipeline.PipelineUserType.Producer, FC2_STAGES, loads)
            if const_expr(self.shared):
                if tasks[index, int(BackwardWord.TYPE)] == SHARED_FC2_DGRAD:
                    s_tile, s_rank = self.shared_tile(m_tile, shared)  # the rank is the batch
                    self._fc2_ring_loads(ring, state, k_tiles, s_tile, n_tile, s_rank, s_parts,
                                         s_rank)
                else:
                    self._fc2_ring_loads(ring, state, k_tiles, m_tile, n_tile,
                                         tile_expert[m_tile], parts)
            else:
                self._fc2_ring_loads(ring, state, k_tiles, m_tile, n_tile, tile_expert[m_tile],
                                     parts)
            loads += k_tiles
            pos = self._next_live_fc2(walk, pos + self.num_ctas, fc2_end)
        ring.producer_tail(pipeline_state(pipeline.PipelineUserType.Producer, FC2_STAGES, loads))
        return self._first_after(fc2_end)

    def _fc2_ring_parts(self, s_a, s_b, ops):
        """The ring's TMA partitions of one expert's dY rows and W_down: (atom, global, smem)
        each; ``ops`` their (atom, tensor) pairs. Traced inline."""
        tma_dy, t_dy, tma_wd, t_wd = ops
        g_dy, s_dy = tma_tiles(tma_dy, t_dy, s_a, (TILE_M, TILE_K))
        g_wd, s_wd = tma_tiles(tma_wd, t_wd, s_b, (FC2_DGRAD_PINGPONG_TILE_N, TILE_K))
        return (tma_dy, g_dy, s_dy, tma_wd, g_wd, s_wd)

    @cute.jit
    def _fc2_ring_loads(self, ring, state, k_tiles: Int32, m_tile: Int32, n_tile: Int32,
                        expert: Int32, parts, a_batch=0):
        """One task's k-tiles into the ring (``state`` advanced past them); the dY rows of
        batch ``a_batch`` (the shared expert's rank)."""
        tma_dy, g_dy, s_dy, tma_wd, g_wd, s_wd = parts
        for k in range(k_tiles):
            ring.producer_acquire(state)
            bar = ring.producer_get_barrier(state)
            cute.copy(tma_dy, g_dy[(None, m_tile, k, a_batch)], s_dy[(None, state.index)],
                      tma_bar_ptr=bar)
            cute.copy(tma_wd, g_wd[(None, n_tile, k, expert)], s_wd[(None, state.index)], tma_bar_ptr=bar)
            ring.producer_commit(state)
            state.advance()

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def fc2_consumers(self, walk, fc2_end: Int32, counter_offsets: cute.Tensor,
                      counters: cute.Tensor, preact: cute.Tensor, row_slot: cute.Tensor,
                      weights: cute.Tensor, partials: cute.Tensor, ring, sA, sC, layouts,
                      stores, t_dy: cute.Tensor, tidx: Int32, warp_idx: Int32,
                      warpgroup_idx: Int32, shared: SharedOperands,
                      recorder: Recorder) -> Int32:
        """Both consumer warpgroups' FC2_DGRAD phase: the n-th live task of the CTA on
        warpgroup n % 2, mainloop in turns, the dgated epilogue, the task's counter published
        once its stores land (the warpgroup then waits for its turn anyway). Returns the CTA's
        first position past the phase. ``recorder``: this warpgroup's, which records its
        tiles."""
        tiled_mma, _, _, epi_staged = layouts
        wg = warpgroup_idx - 1
        wg_tidx = tidx % self.threads_per_warpgroup
        s_a, s_b = self.fc2_stages(sA, layouts)
        tCrA, tCrB, acc, num_k_blocks, epi = self.fc2.consumer_parts(
            tiled_mma, s_a, s_b, smem_overlay(sC, epi_staged), 0, wg_tidx)
        coords = self.fc2.epi_coords(epi, wg_tidx)
        store_pipeline, barrier, is_store_warp = self.fc2.epilogue_sync(warp_idx, warpgroup_idx)
        my_turn = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.MMA_ORDER) + wg,
                                        num_threads=self.num_mma_threads)
        their_turn = pipeline.NamedBarrier(
            barrier_id=int(common.NamedBarriers.MMA_ORDER) + 1 - wg, num_threads=self.num_mma_threads)
        tma_dg, t_dg, tma_du, t_du, tma_hw, t_hw = stores
        tile = (TILE_M, FC2_DGRAD_PINGPONG_TILE_N)
        views = [cute.local_tile(t, tile, (None, None, None)) for t in (t_dg, t_du, t_hw)]
        s_views = None  # the shared expert's dG, dU, h
        if const_expr(self.shared):
            s_views = [cute.local_tile(shared.stores[2 * o + 1], tile, (None, None, None))
                       for o in range(3)]
        buf_base = wg * self.fc2.epi_stages * self.fc2.epi_outputs
        subtiles_per_task = (TILE_M // self.fc2.epi_tile[0]) * (FC2_DGRAD_PINGPONG_TILE_N // self.fc2.epi_tile[1])
        k_tiles = cute.size(t_dy, mode=[1]) // TILE_K
        subtiles = Int32(0)
        live = Int32(0)  # live FC2_DGRAD tasks of this CTA before pos
        pos = self._next_live_fc2(walk, Int32(cute.arch.block_idx()[0]), fc2_end)
        while pos < fc2_end:
            if live % 2 == wg:
                m_tile, n_tile, _, index = self._fc2_task(walk, pos, counter_offsets)
                uses = live * k_tiles  # the ring's stage uses before this tile
                wait_turn = live > 0  # in the mainloop's first hook
                if const_expr(self.timeline):  # the span starts once the turn has come
                    if wait_turn:
                        my_turn.arrive_and_wait()
                    wait_turn = live < 0
                self.rec_stamp(recorder, START)
                release = self.fc2.mainloop(ring, tiled_mma, acc, tCrA, tCrB, uses, k_tiles,
                                            num_k_blocks, (my_turn, their_turn, wait_turn, self,
                                                           walk, pos, fc2_end))
                cute.nvgpu.warpgroup.wait_group(0)
                self.rec_stamp(recorder, EPILOGUE)
                ring.consumer_release(release)
                if const_expr(self.shared):
                    ttype = walk[0][index, int(BackwardWord.TYPE)]
                    rows, visit_args = self.fc2.row_visit_args(
                        epi, "dgated", coords, m_tile, n_tile,
                        *self.dgated_rows(ttype, preact, row_slot, weights, shared), wg_tidx)
                    self.fc2.tile_epilogue(
                        epi, (tma_dg, tma_du, tma_hw),
                        tuple(v[(None, None, m_tile, n_tile, 0)] for v in views), "dgated",
                        buf_base, subtiles, barrier, store_pipeline, is_store_warp, visit_args,
                        alt=((shared.stores[0], shared.stores[2], shared.stores[4]),
                             tuple(v[(None, None, m_tile, n_tile, 0)] for v in s_views)),
                        use_alt=ttype == SHARED_FC2_DGRAD)
                    if ttype != SHARED_FC2_DGRAD:  # no router weight: no row partials
                        self.fc2._store_row_sums(rows, partials, m_tile, n_tile, wg_tidx)
                else:
                    rows, visit_args = self.fc2.row_visit_args(epi, "dgated", coords, m_tile,
                                                               n_tile, preact, row_slot,
                                                               weights, wg_tidx)
                    self.fc2.tile_epilogue(epi, (tma_dg, tma_du, tma_hw),
                                           tuple(v[(None, None, m_tile, n_tile, 0)] for v in views),
                                           "dgated", buf_base, subtiles, barrier, store_pipeline,
                                           is_store_warp, visit_args)
                    self.fc2._store_row_sums(rows, partials, m_tile, n_tile, wg_tidx)
                if const_expr(self.comm_ctas > 0):
                    barrier.arrive_and_wait()  # the partials before the publish (comm reads them)
                if const_expr(self.timeline):
                    self.rec_task(recorder, COMPUTE, walk[0][index, int(BackwardWord.TYPE)],
                                  index)
                subtiles += subtiles_per_task
                signal = self._fc2_task(walk, pos, counter_offsets)[2]  # decoded again: fewer live registers
                common.publish_stored(counters, signal, is_store_warp, wg_tidx == 0)
            pos = self._next_live_fc2(walk, pos + self.num_ctas, fc2_end)
            live += 1
        return self._first_after(fc2_end)


__all__ = ["FC2_STAGES", "Fc2PingpongForm", "Fc2PingpongTasksMixin"]
