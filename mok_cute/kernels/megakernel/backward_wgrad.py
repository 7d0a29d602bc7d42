"""The backward megakernel's weight-gradient tasks (``backward.py``): ``gemm_wgrad``'s tiles as
tasks of the same launch, on the same operand stages and epilogue buffers.

    WGRAD_DOWN    (e, m, n)  dW_down[e] rows 256 m .. of H, columns 128 n .. of I:
                             warpgroup w multiplies dY rows' H block 2 m + w by w * h
    WGRAD_GATE_UP (e, m, n)  dW_gate[e] and dW_up[e] rows 128 m .. of I, columns 128 n .. of H:
                             warpgroup 0 dG, warpgroup 1 dU, both by the same x rows

K runs over expert e's schedule rows ``[offsets[e], offsets[e + 1])`` in order (an expert
without rows writes zeros), each output tile has one owner: the bits of ``gemm_wgrad``. With ``accumulate_wgrads`` the
outputs are fp32 (the weights' ``main_grad``) and each tile's accumulator is added into them in
one of ``gemm_wgrad``'s two ways (``main_grad_add``): by TMA reduce-add, or main_grad read into
registers (``gemm_core.AddendTile``, the shared expert's tile as its run-time alternative) and
the sums stored by plain TMA stores.

How the two tile forms share the CTA's smem: a stage of the dgrads holds a 128 x 64 A box
(16 KB) and a 256 x 64 B box (32 KB); a weight-gradient stage holds two 128 x 64 A boxes and
one 128 x 64 B box, all MN-major: the same 48 KB and the same TMA byte count, so one stage
ring (and its mbarriers) serves both. The weight gradients put their two A boxes in the dgrad
B box's bytes (warpgroup w's at 16 KB x w) and their B box in the dgrad A box's bytes. Their
epilogue (each warpgroup its own 128 x 128 tile in 64 x 32 subtiles, ``gemm_wgrad``'s) views
the dgrads' epilogue buffers; a CTA whose next task is of the other form first drains its
TMA stores (``switch_forms``), since the two forms' buffers overlap.

The tiles go out by ticket: lane 0 of the load warp takes tail position t from one counter
(the slot after the task counters, zeroed per launch), writes it and the tile's decoded words
into ring use k of a smem ticket ring (``scheduler``'s: ``TICKET_SLOTS`` slots, full / empty
mbarriers) and loads the tile; the consumer warps read use k to learn which tile their stages
hold; a position past the tail ends both. Each tile still has one owner running its expert's
rows in order: the bits do not depend on which CTA runs it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, const_expr

from mok_cute.constants import TILE_K
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import (AddendTile, GemmCoreSm90, pipeline_state, smem_overlay,
                                        tma_tiles)
from mok_cute.kernels.megakernel.backward_recorder import COMPUTE, EPILOGUE, START
from mok_cute.kernels.megakernel.backward_shared import SHARED_WGRAD_GATE_UP
from mok_cute.kernels.megakernel.scheduler import (D_EXPERT, D_INDEX, D_MTILE, D_NTILE, D_RANK,
                                                   D_ROW_BEGIN, D_TYPE, TICKET_SLOTS, ring_next,
                                                   ring_wait_empty, ring_words)
from mok_cute.tasks_backward import BackwardTaskType, BackwardWord

WG_ROWS = 128  # output rows per consumer warpgroup
_WGRAD_GATE_UP = int(BackwardTaskType.WGRAD_GATE_UP)
WGRAD_TILE_N = 128
# a tail ticket's words in its ring slot (the dgrads' decoded-word slots, reused)
T_POS, T_INDEX, T_TYPE, T_MBLOCK, T_NTILE, T_EXPERT, T_KTILES = (
    D_INDEX, D_RANK, D_TYPE, D_MTILE, D_NTILE, D_EXPERT, D_ROW_BEGIN)


class WgradForm(GemmCoreSm90):
    """``gemm_wgrad``'s tile form (a warpgroup per 128 output rows, both operands MN-major) on
    the stage ring of a host kernel (``stages``: the host's stage count). ``accumulate``,
    ``adds_by_load``: ``gemm_wgrad``'s, the fp32 outputs added into by TMA reduce-add or by
    loads and plain stores (two epilogue stages a warpgroup: 32 KB of fp32 subtiles, within
    the dgrads' 48 KB of epilogue buffers)."""

    def __init__(self, stages: int, accumulate: bool = False, adds_by_load: bool = False):
        super().__init__(WGRAD_TILE_N, pingpong=True, a_mn_major=True, b_mn_major=True)
        self.a_dtype = self.b_dtype = BFloat16
        self.c_dtype = Float32 if accumulate else BFloat16
        self.accumulate = accumulate
        self.adds_by_load = accumulate and adds_by_load
        if accumulate:
            self.fp32_epilogue()
        self._setup_attributes()
        self.ab_stages = stages
        # one 128 x 64 MN-major box per stage (8192 elements, the dgrads' A box size)
        self.box_layout_staged = self.staged_layout(BFloat16, (WG_ROWS, TILE_K), stages,
                                                    mn_major=True)


class WgradTasksMixin:
    """Weight-gradient tasks of ``BackwardMegakernelSm90`` (module docstring). The host class
    sets ``self.wgrad = WgradForm(self.ab_stages)`` in ``__call__``."""

    def wgrad_box(self):
        """The TMA box of every weight-gradient operand (host side)."""
        return cute.slice_(self.wgrad.box_layout_staged, (None, None, 0))

    def wgrad_kernel_args(self):
        """What the kernel takes of the weight-gradient form (host-built values enter the
        kernel as arguments): its tiled MMA, the staged operand box and epilogue layouts."""
        return (self.wgrad.tiled_mma, self.wgrad.box_layout_staged,
                self.wgrad.epi_smem_layout_staged)

    def wgrad_a_stages(self, sB, warpgroup, box):
        """Warpgroup ``warpgroup``'s weight-gradient A boxes: in the dgrads' B region, box
        ``warpgroup`` of each stage (stage stride two boxes); ``box`` the staged box layout.
        Traced inline."""
        box_elems = cute.cosize(cute.slice_(box, (None, None, 0)))
        return smem_overlay(sB, box, warpgroup * box_elems, 2 * box_elems)

    def wgrad_b_stages(self, sA, box):
        """The weight-gradient B boxes: the dgrads' A region, one box a stage. Traced inline."""
        return smem_overlay(sA, box)

    def wgrad_epi_buffers(self, sC, epi):
        """The weight gradients' epilogue buffers (64 x 32, per warpgroup; fp32 with
        ``accumulate``) over the dgrads'; ``epi`` their staged layout. Traced inline."""
        return smem_overlay(sC, epi, dtype=self.wgrad.c_dtype)

    # ------------------------------------------------------------------ producer
    def wgrad_load_parts(self, sA, sB, ops, layouts):
        """The load warp's TMA partitions of the weight-gradient operands; traced inline.
        ``ops``: (atom, tensor) pairs of dG, dU, x rows, dY rows, w * h, each (cols, rows, 1)
        MN-major; ``layouts``: ``wgrad_kernel_args``."""
        box = layouts[1]
        s_a = [self.wgrad_a_stages(sB, w, box) for w in range(2)]
        s_b = self.wgrad_b_stages(sA, box)
        parts = []
        box_mk = (WG_ROWS, TILE_K)
        for i in range(5):
            atom, tensor = ops[2 * i], ops[2 * i + 1]
            if i in (2, 4):  # x rows, w * h: the B box
                g_part, s_part = tma_tiles(atom, tensor, s_b, box_mk)
                parts.append((g_part, s_part, s_part))
            else:
                g_part, s0 = tma_tiles(atom, tensor, s_a[0], box_mk)
                _, s1 = tma_tiles(atom, tensor, s_a[1], box_mk)
                parts.append((g_part, s0, s1))
        return parts

    @cute.jit
    def wgrad_rows(self, offsets: cute.Tensor, expert: Int32):
        """(first row k-tile, row k-tiles) of expert ``expert``'s schedule rows (clamped to an
        expert: the walk decodes one task ahead, past its weight gradients too)."""
        expert = cutlass.max(cutlass.min(expert, cute.size(offsets) - 2), 0)
        first = offsets[expert]
        return first // TILE_K, (offsets[expert + 1] - first) // TILE_K

    @cute.jit
    def wgrad_load(self, ab_pipeline, loads: Int32, gated, m_block: Int32, n_tile: Int32,
                   k0: Int32, k_tiles: Int32, ops, parts, batch=0):
        """The TMA loads of one weight-gradient tile: per row k-tile both A boxes and B, of
        the operands' batch ``batch`` (the shared experts' rank)."""
        atom_dg, _, atom_du, _, atom_x, _, atom_dy, _, atom_hw, _ = ops
        (g_dg, s_dg0, _), (g_du, _, s_du1), (g_x, s_x, _), (g_dy, s_dy0, s_dy1), (g_hw, s_hw, _) = parts
        state = pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages, loads)
        for k in range(k_tiles):
            ab_pipeline.producer_acquire(state)
            bar = ab_pipeline.producer_get_barrier(state)
            stage = state.index
            if gated:
                cute.copy(atom_dg, g_dg[(None, m_block, k0 + k, batch)], s_dg0[(None, stage)], tma_bar_ptr=bar)
                cute.copy(atom_du, g_du[(None, m_block, k0 + k, batch)], s_du1[(None, stage)], tma_bar_ptr=bar)
                cute.copy(atom_x, g_x[(None, n_tile, k0 + k, batch)], s_x[(None, stage)], tma_bar_ptr=bar)
            else:
                # past H's last 128-row block TMA fills zeros, and the store clips them
                cute.copy(atom_dy, g_dy[(None, 2 * m_block, k0 + k, batch)], s_dy0[(None, stage)], tma_bar_ptr=bar)
                cute.copy(atom_dy, g_dy[(None, 2 * m_block + 1, k0 + k, batch)], s_dy1[(None, stage)],
                          tma_bar_ptr=bar)
                cute.copy(atom_hw, g_hw[(None, n_tile, k0 + k, batch)], s_hw[(None, stage)], tma_bar_ptr=bar)
            ab_pipeline.producer_commit(state)
            state.advance()

    @cute.jit
    def _take_ticket(self, counters: cute.Tensor, slot: Int32, ring, k: Int32) -> Int32:
        """Lane 0 of the load warp takes the next tail ticket (relaxed: the ring orders it)
        once ring use ``k``'s slot is free; every lane gets it."""
        _, bars = ring
        t = Int32(0)
        if cute.arch.lane_idx() == 0:
            ring_wait_empty(bars, k)
            t = cute.arch.atomic_add((counters.iterator + slot).llvm_ptr, Int32(1),
                                     sem="relaxed", scope="gpu")
        return cute.arch.shuffle_sync(t, 0)

    @cute.jit
    def _publish_ticket(self, ring, k: Int32, t: Int32, index: Int32, ttype: Int32,
                        expert: Int32, m_block: Int32, n_tile: Int32, k_tiles: Int32):
        """Lane 0 publishes ring use ``k``: tail position ``t`` and the tile's words, decoded
        once here for the loads (the consumers read them from smem, not through the chain of
        global loads position -> list index -> task -> expert rows; past the tail only ``t``
        is read)."""
        tail_q, bars = ring
        if cute.arch.lane_idx() == 0:
            words = ring_words(tail_q, k)
            words[T_POS], words[T_INDEX], words[T_TYPE] = t, index, ttype
            words[T_EXPERT], words[T_MBLOCK], words[T_NTILE] = expert, m_block, n_tile
            words[T_KTILES] = k_tiles
            cute.arch.mbarrier_arrive(bars + k % TICKET_SLOTS)  # release: the words, then the phase

    @cute.jit
    def wgrad_producer_tickets(self, walk, ring, expert_offsets: cute.Tensor,
                               counter_offsets: cute.Tensor, counters: cute.Tensor,
                               error: cute.Tensor, timeout_ns, ab_pipeline, loads: Int32, ops,
                               parts, shared=None, shared_parts=None,
                               timeline_buf=None) -> Int32:
        """The load warp's tail by tickets: the launch's tail positions go out in order from
        one counter (the slot after the task counters), so the tiles running at any time are
        a window of consecutive positions, as in a ``gemm_wgrad`` launch, however far apart
        the CTAs finished their dgrads. Per ticket: the tile's words published to the
        consumers, the expert's dgrads waited on (once per run of its tasks; the expert's
        M-tile counters spread over the warp's lanes: one round trip, not one per M-tile),
        then the tile's loads. Returns the stage uses so far. ``shared``: the shared expert's
        ``SharedOperands`` (its tiles, their rank in the list's tile, run over the rank's T
        tokens), ``shared_parts`` their partitions; ``timeline_buf``: the recorder's buffer
        (``backward_recorder``)."""
        tasks, queue, _, _, tail_begin, queue_len = walk
        tail_len = queue_len - tail_begin
        slot = counter_offsets[cute.size(counter_offsets) - 1]
        waited_expert = Int32(-1)  # shared_wgrad_key: an expert, or -2 - a shared rank
        k = Int32(0)
        t = self._take_ticket(counters, slot, ring, k)
        while t < tail_len:
            index = queue[tail_begin + t]
            ttype = tasks[index, int(BackwardWord.TYPE)]
            expert = tasks[index, int(BackwardWord.TILE)]
            m_block = tasks[index, int(BackwardWord.M_BLOCK)]
            n_tile = tasks[index, int(BackwardWord.N_TILE)]
            k0, k_tiles = self.wgrad_rows(expert_offsets, expert)
            key = expert
            if const_expr(self.shared):
                key = self.shared_wgrad_key(ttype, expert)
                if key < -1:
                    k0, k_tiles = Int32(0), self.shared_k_tiles(shared)
            self._publish_ticket(ring, k, t, index, ttype, expert, m_block, n_tile, k_tiles)
            if key != waited_expert:
                self.wait_task_recorded(tasks, index, expert_offsets, counter_offsets, counters,
                                        error, timeout_ns, timeline_buf, COMPUTE,
                                        cute.arch.lane_idx() == 0, lane_strided=True)
                cute.arch.fence_proxy("async.global")
                waited_expert = key
            if const_expr(self.shared):
                if key < -1:  # the rank is the operands' batch
                    self.wgrad_load(ab_pipeline, loads, ttype == SHARED_WGRAD_GATE_UP, m_block,
                                    n_tile, k0, k_tiles, shared.w_loads, shared_parts, expert)
                else:
                    self.wgrad_load(ab_pipeline, loads, ttype == _WGRAD_GATE_UP, m_block,
                                    n_tile, k0, k_tiles, ops, parts)
            else:
                self.wgrad_load(ab_pipeline, loads, ttype == _WGRAD_GATE_UP, m_block, n_tile,
                                k0, k_tiles, ops, parts)
            loads += k_tiles
            k += 1
            t = self._take_ticket(counters, slot, ring, k)
        zero = Int32(0)
        self._publish_ticket(ring, k, t, zero, zero, zero, zero, zero, zero)  # the end
        return loads

    @cute.jit
    def wgrad_consumer_tickets(self, walk, ring, ab_pipeline, tiled_mma, parts, loads: Int32,
                               stores, warpgroup_idx: Int32, shared=None, recorder=None):
        """Both consumer warpgroups' tail by tickets: each ring use names the tail position
        the producer loaded next (past the tail: the end) and its tile's words. ``recorder``:
        the first consumer warpgroup's ``backward_recorder.Recorder``, which records each
        tile."""
        _, _, _, _, tail_begin, queue_len = walk
        tail_q, bars = ring
        tail_len = queue_len - tail_begin
        subtiles = Int32(0)
        k = Int32(0)
        t = ring_next(tail_q, bars, k)[0]
        while t < tail_len:
            words = ring_words(tail_q, k)
            index, ttype, expert = words[T_INDEX], words[T_TYPE], words[T_EXPERT]
            m_block, n_tile, k_tiles = words[T_MBLOCK], words[T_NTILE], words[T_KTILES]
            self.rec_stamp(recorder, START)
            if const_expr(self.shared):  # its tiles (the list's tile: the rank) over T tokens
                is_shared = self.shared_wgrad_key(ttype, expert) < -1
                self.wgrad_tile(ab_pipeline, tiled_mma, parts, loads, k_tiles,
                                ttype == _WGRAD_GATE_UP or ttype == SHARED_WGRAD_GATE_UP,
                                expert, m_block, n_tile, subtiles, stores, warpgroup_idx,
                                recorder, (shared.w_stores, is_shared))
            else:
                self.wgrad_tile(ab_pipeline, tiled_mma, parts, loads, k_tiles,
                                ttype == _WGRAD_GATE_UP, expert, m_block, n_tile, subtiles,
                                stores, warpgroup_idx, recorder)
            if const_expr(self.timeline):
                self.rec_task(recorder, COMPUTE, ttype, index)
            loads += k_tiles
            subtiles += self.wgrad_subtiles()
            k += 1
            t = ring_next(tail_q, bars, k)[0]

    # ------------------------------------------------------------------ consumers
    def wgrad_consumer_parts(self, sA, sB, sC, layouts, tidx, warp_idx, warpgroup_idx):
        """A consumer thread's weight-gradient fragments, accumulator, epilogue partitions and
        store synchronisation (``gemm_wgrad``'s, for its warpgroup), built once after the
        dgrads. Traced inline."""
        tiled_mma, box, epi_layout = layouts
        wg = warpgroup_idx - 1
        parts = self.wgrad.consumer_parts(
            tiled_mma, self.wgrad_a_stages(sB, wg, box), self.wgrad_b_stages(sA, box),
            self.wgrad_epi_buffers(sC, epi_layout), 0, tidx % self.threads_per_warpgroup)
        return (*parts, *self.wgrad.epilogue_sync(warp_idx, warpgroup_idx))

    @cute.jit
    def wgrad_tile(self, ab_pipeline, tiled_mma, parts, loads: Int32, k_tiles: Int32, gated,
                   expert: Int32, m_block: Int32, n_tile: Int32, subtiles: Int32, stores,
                   warpgroup_idx: Int32, recorder, shared=None):
        """One weight-gradient tile on both consumer warpgroups: warpgroup w's 128 x 128
        block over the expert's row k-tiles (zeros without rows), then its TMA stores.
        ``parts``: ``wgrad_consumer_parts``; ``stores``: (atom, tensor) of dW_gate, dW_up,
        dW_down, each (rows, cols, E); ``shared``: (the shared expert's such pairs, a
        run-time flag: store there instead); ``recorder``: the mainloop's end is its EPILOGUE
        mark (``backward_recorder``)."""
        tCrA, tCrB, acc, num_k_blocks, epi, store_pipeline, barrier, is_store_warp = parts
        wg = warpgroup_idx - 1
        if k_tiles > 0:
            release = self.wgrad.mainloop(ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads,
                                          k_tiles, num_k_blocks)
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release)
        else:
            acc.fill(0.0)  # an expert with no rows
        self.rec_stamp(recorder, EPILOGUE)
        args = (epi, wg * self.wgrad.epi_stages, subtiles, barrier, store_pipeline,
                is_store_warp, n_tile, expert)
        if gated:
            if wg == 0:
                self._wgrad_store(args, stores, shared, 0, m_block)
            else:
                self._wgrad_store(args, stores, shared, 1, m_block)
        else:
            self._wgrad_store(args, stores, shared, 2, 2 * m_block + wg)

    def _wgrad_store(self, args, stores, shared, o: int, m: Int32):
        """A warpgroup's 128 x 128 block ``m`` of weight-gradient output ``o`` (0: dW_gate,
        1: dW_up, 2: dW_down) by TMA; the shared expert's instead where ``shared`` (stores,
        flag) says so. ``stores``: (atom, TMA tensor) of each output, then, where main_grad
        is read into registers, the three outputs' tensors. Traced inline."""
        epi, base, subtiles, barrier, store_pipeline, is_store_warp, n_tile, expert = args
        tile, where = (WG_ROWS, WGRAD_TILE_N), (None, None, m, n_tile, expert)

        def output(outs):
            view = cute.local_tile(outs[2 * o + 1], tile, (None, None, None))
            return (outs[2 * o],), (view[where],)

        def addend(outs):  # main_grad's tile, its coordinates, its bounds
            t = outs[6 + o]
            coords = cute.make_identity_tensor(t.shape)
            return (cute.local_tile(t, tile, (None, None, None))[where],
                    cute.local_tile(coords, tile, (None, None, None))[where], t.shape)

        atoms, g_tiles = output(stores)
        alt, use_alt = None, None
        if const_expr(shared is not None):
            alt, use_alt = output(shared[0]), shared[1]
        kind, visit = "store", None
        if const_expr(self.wgrad.adds_by_load):
            kind = "add"
            tidx = cute.arch.thread_idx()[0] % self.threads_per_warpgroup
            # three subtiles ahead: four spill 360 B beside the shared expert's tiles, two 16 B
            visit = AddendTile(self.wgrad, epi, addend(stores), tidx, depth=3,
                               alt=None if const_expr(shared is None) else addend(shared[0]),
                               use_alt=use_alt)
        self.wgrad.tile_epilogue(epi, atoms, g_tiles, kind, base, subtiles, barrier,
                                 store_pipeline, is_store_warp, visit, alt=alt, use_alt=use_alt)

    def wgrad_subtiles(self) -> int:
        """Epilogue subtiles a warpgroup stores per weight-gradient tile."""
        return (WG_ROWS // self.wgrad.epi_tile[0]) * (WGRAD_TILE_N // self.wgrad.epi_tile[1])

    @cute.jit
    def switch_forms(self):
        """Before a task of the other tile form: every thread's TMA stores have read their
        epilogue buffers (the forms' buffers overlap), then all consumer threads meet."""
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.FORM_SWITCH),
                              num_threads=self.num_mma_threads).arrive_and_wait()


__all__ = ["WgradForm", "WgradTasksMixin", "WG_ROWS", "WGRAD_TILE_N"]
