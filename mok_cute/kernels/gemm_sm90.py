"""Persistent, warp-specialised grouped GEMM for MoE experts on Hopper (sm_90a).

    C[rows of M-tile m, n-tile] = epilogue( A[rows of m, :] @ B[expert(m), n-tile, :]^T )

- A ``(M_cap, K)`` bf16, K-major: the expert-sorted, tile-padded activation rows (the
  receive schedule pads every expert segment to ``TILE_M`` rows, so each M-tile belongs to
  exactly one expert).
- B ``(E, N, K)`` bf16, K-major: the expert weights in nn.Linear layout, one TMA descriptor
  over all experts; the expert of an M-tile is read at run time from ``tile_expert``.
- ``num_m_tiles`` is a one-element device tensor: the token histogram never causes a
  recompile or a host sync; tiles past it are simply not scheduled.

Epilogues (compile-time):
- ``"store"``:  C = bf16(acc)          (FC2: down projection, y rows; FC1's dgrad: dx rows)
- ``"swiglu"``: C = bf16(silu(g) * u) with g = bf16(A @ Wg^T), u = bf16(A @ Wu^T) (FC1: gate
  and up in one pass). Two TMA descriptors fill the two halves of one B stage: rows
  [0, tile_n/2) from W_gate and rows [tile_n/2, tile_n) from the matching rows of W_up. One
  wgmma N-tile therefore holds matching gate and up columns, every thread owns both halves of
  its pairs (no shuffles), and the weights are used as given: no packed copy. With
  ``save_preact`` (a training forward) the bf16 g and u of each routed row are also stored,
  from registers as bf16 pairs, into row ``slot`` (t * K + k) of mPreact ([slots, 2I]: g
  then u): exactly T * K rows kept for the backward, none for padding.
- ``"dgated"`` (FC2's dgrad, A = d_out rows, B = W_down as (I, H, E), N-major): with
  acc = (d_out @ W_down)[row, i], w the row's router weight and g, u the saved
  pre-activations (row ``slot`` of mPreact, as the forward stored them), s = sigmoid(g),
  h = bf16(silu(g) * u) (the forward's h, bit for bit):
  C = dG = bf16(w acc u s (1 + g (1 - s))), C2 = dU = bf16(w acc silu(g)), C3 = h' =
  bf16(w h) (the down projection's weight gradient reads it), and per (row, N-tile) the
  partial sum of acc * h (fp32; summed over N-tiles it is d_topk_weights = <d_out, y>,
  computed without dividing by w). Padding rows (slot -1) give exact zeros whatever the
  saved g, u hold there (and are never read). g and u arrive as 32-bit bf16 pairs, loaded
  ``row_epilogue.DGATED_PREFETCH`` subtiles ahead; cooperative or pingpong (``expert_backward``
  picks). Both row-addressed epilogues live in ``row_epilogue.RowEpilogueMixin``.

Operands: K-major by default; ``b_mn_major`` for B stored (E, K, N) (the dgrads' weights);
``b_split_k``: B's first K columns from ``mB``, the rest from ``mB2`` (FC1's dgrad: the
gate and up weights along one K = 2I).

Roles (384 threads, ``gemm_core.GemmCoreSm90``): warpgroup 0 is the producer (warp 0 issues
TMA loads into an mbarrier ring); warpgroups 1-2 are the consumers (wgmma, then the epilogue
through smem and TMA stores). Cooperative: they split each tile's rows. Pingpong (FC2 and its
dgrad up to a K): they take alternate tiles and turns at the mainloop, so one's epilogue runs under
the other's mainloop. The K loop runs in a fixed order and there is no split-K, so results
are bitwise reproducible.

Tile order: persistent CTAs walk a linear tile index with a grid stride, rasterised in groups
of ``group_m`` M-tiles (``common.grouped_raster``) so CTAs running together share B tiles.

Constraints: bf16 in/out, fp32 accumulation; K % 64 == 0; N % 8 == 0 (a partial last
N-tile is zero-filled on load and clipped on store by TMA); tile_n in {64, 128, 256}
(swiglu: 128 or 256; pingpong: <= 128).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, const_expr

from mok_cute import jit
from mok_cute.constants import TILE_K, TILE_M
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import GemmCoreSm90
from mok_cute.kernels.row_epilogue import RowEpilogueMixin

EPILOGUES = ("store", "swiglu", "dgated")
class AbTiles(NamedTuple):
    """TMA partitions of A and B (``GroupedGemmSm90.partition_ab``): global k-tiles, stages."""

    tAgA: cute.Tensor
    tAsA: cute.Tensor
    tBgB: cute.Tensor
    tBsB: cute.Tensor
    tBgB_up: Optional[cute.Tensor]
    tBsB_up: Optional[cute.Tensor]


class GroupedGemmSm90(RowEpilogueMixin, GemmCoreSm90):
    """Grouped (per-expert) GEMM with a run-time tile -> expert table.

    :param tile_n: CTA tile width in N (64, 128 or 256; swiglu needs >= 128).
    :param epilogue: ``"store"`` or ``"swiglu"``.
    :param group_m: M-tiles per rasterisation group (L2 reuse of B).
    :param num_sms: persistent grid size (132 on H100/H200).
    :param timeline: record one (start, end) span per tile (``mok_cute.timeline`` format).
    :param task_type: ``mok_cute.tasks.TaskType`` value written in the records.
    :param pingpong: the consumer warpgroups take alternate whole tiles and turns at the
        mainloop (two named barriers, ``NamedBarriers.MMA_ORDER``: an mbarrier parity wait
        tells only the current phase from the previous one, so a warpgroup must not wait on
        stages a whole tile ahead of the producer).
    :param save_preact: swiglu: also store the bf16 pre-activations g and u.
    :param b_mn_major: B's N mode is contiguous.
    :param b_split_k: B's k-tiles from two tensors (``mB`` then ``mB2``).
    :param max_ab_stages: at most this many operand stages (None: as many as smem holds).
    """

    def __init__(self, tile_n: int = 256, epilogue: str = "store", group_m: int = 8,
                 num_sms: int = 132, timeline: bool = False, task_type: int | None = None,
                 pingpong: bool = False, save_preact: bool = False, b_mn_major: bool = False,
                 b_split_k: bool = False, max_ab_stages: int | None = None):
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        if save_preact and epilogue != "swiglu":
            raise ValueError("save_preact needs the swiglu epilogue")
        if b_split_k and epilogue == "swiglu":
            raise ValueError("b_split_k: swiglu already takes two B tensors (N halves)")
        outputs = 3 if epilogue == "dgated" else 1
        super().__init__(tile_n, pingpong, b_mn_major=b_mn_major, epi_outputs=outputs,
                         max_ab_stages=max_ab_stages)
        if epilogue == "swiglu" and tile_n < 128:
            raise ValueError(f"the swiglu epilogue needs tile_n >= 128, got {tile_n}")
        if group_m < 1:
            raise ValueError(f"group_m must be >= 1, got {group_m}")
        self.save_preact = save_preact
        self.b_split_k = b_split_k
        self.epilogue = epilogue
        self.group_m = group_m
        self.num_sms = num_sms
        # one span per output tile into a bounded buffer (compile-time: nothing when off)
        self.timeline = timeline
        self.task_type = task_type if task_type is not None else (1 if epilogue == "swiglu" else 2)
        # SwiGLU halves the N width of the stored tile; each B stage is loaded as two boxes
        # (gate rows, then the matching up rows)
        self.out_tile_n = tile_n // 2 if epilogue == "swiglu" else tile_n
        self.b_rows_per_load = self.out_tile_n

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mB_up: Optional[cute.Tensor],
                 mC: cute.Tensor, mTileExpert: cute.Tensor, mNumMTiles: cute.Tensor,
                 mTimeline: Optional[cute.Tensor], mC2: Optional[cute.Tensor],
                 mC3: Optional[cute.Tensor], mPreact: Optional[cute.Tensor],
                 mRowSlot: Optional[cute.Tensor],
                 mWeights: Optional[cute.Tensor], mPartials: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        """mA (M_cap, K, 1), mB (N, K, E), mC (M_cap, N_out, 1) (N_out contiguous).
        swiglu: mB is W_gate and mB_up is W_up, both (I, K, E); b_split_k: mB_up holds B's
        k-tiles past mB's; else None. mTimeline: int64 recorder buffer, or None when the
        timeline flag is off. Three outputs (dgated): mC2, mC3 like mC. save_preact and
        dgated: mPreact (slots, 2I) bf16 pre-activations by slot (g then u), mRowSlot (M_cap,) int32
        (the row's (token, k) slot, -1 on padding); dgated: mWeights fp32 (slots,), mPartials
        fp32 (M_cap, N-tiles)."""
        self.a_dtype = mA.element_type
        self.b_dtype = mB.element_type
        self.c_dtype = mC.element_type
        if const_expr(self.a_dtype != self.b_dtype):
            raise TypeError(f"A and B dtypes differ: {self.a_dtype} vs {self.b_dtype}")
        self._setup_attributes()

        tile_m, tile_n, tile_k = self.tile_shape_mnk
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_a, tma_tensor_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mA, cute.slice_(self.a_smem_layout_staged, (None, None, 0)), (tile_m, tile_k))
        # B rows per TMA box: the whole tile, or each gate / up half of it.
        b_box = (self.b_rows_per_load, tile_k)
        b_box_layout = cute.slice_(self.staged_layout(self.b_dtype, b_box, 1, self.b_mn_major), (None, None, 0))
        tma_atom_b, tma_tensor_b = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mB, b_box_layout, b_box)
        tma_atom_b_up, tma_tensor_b_up = None, None
        if const_expr(self.epilogue == "swiglu" or self.b_split_k):
            tma_atom_b_up, tma_tensor_b_up = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mB_up, b_box_layout, b_box)
        s2g = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        epi_layout = cute.slice_(self.epi_smem_layout_staged, (None, None, 0))
        tma_atom_c, tma_tensor_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            s2g, mC, epi_layout, self.epi_tile)
        extra_c = (None,) * 4
        if const_expr(self.epi_outputs == 3):
            extra_c = (*cute.nvgpu.cpasync.make_tiled_tma_atom(s2g, mC2, epi_layout, self.epi_tile),
                       *cute.nvgpu.cpasync.make_tiled_tma_atom(s2g, mC3, epi_layout, self.epi_tile))

        self.shared_storage = self.make_shared_storage()
        self.kernel(
            tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tma_atom_b_up, tma_tensor_b_up,
            tma_atom_c, tma_tensor_c, mTileExpert, mNumMTiles, mTimeline, self.tiled_mma,
            self.a_smem_layout_staged, self.b_smem_layout_staged, self.epi_smem_layout_staged,
            *extra_c, mPreact, mRowSlot, mWeights, mPartials,
        ).launch(grid=[self.num_sms, 1, 1], block=[self.threads_per_cta, 1, 1],
                 min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor,
               tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor,
               tma_atom_b_up: Optional[cute.CopyAtom], mBup_nkl: Optional[cute.Tensor],
               tma_atom_c: cute.CopyAtom, mC_mnl: cute.Tensor,
               mTileExpert: cute.Tensor, mNumMTiles: cute.Tensor,
               mTimeline: Optional[cute.Tensor], tiled_mma: cute.TiledMma,
               a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout,
               tma_atom_c2: Optional[cute.CopyAtom], mC2_mnl: Optional[cute.Tensor],
               tma_atom_c3: Optional[cute.CopyAtom], mC3_mnl: Optional[cute.Tensor],
               mPreact: Optional[cute.Tensor],
               mRowSlot: Optional[cute.Tensor], mWeights: Optional[cute.Tensor],
               mPartials: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)

        if const_expr(self.timeline):
            if tidx == 0 and cute.arch.block_idx()[0] == 0:
                common.timeline_mark_start(mTimeline, common.timeline_now())
        self.warp_roles(tidx, warp_idx, warpgroup_idx,
                        (tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, tma_atom_b_up, mBup_nkl),
                        tma_atom_c, mTileExpert, mNumMTiles,
                        (a_smem_layout_staged, b_smem_layout_staged, epi_smem_layout_staged),
                        (tiled_mma, ((tma_atom_c, mC_mnl), (tma_atom_c2, mC2_mnl),
                                     (tma_atom_c3, mC3_mnl)),
                         (mPreact, mRowSlot, mWeights, mPartials), mTimeline))

    @cute.jit
    def warp_roles(self, tidx: Int32, warp_idx: Int32, warpgroup_idx: Int32, ab_operands,
                   tma_atom_c: cute.CopyAtom, mTileExpert: cute.Tensor, mNumMTiles: cute.Tensor,
                   smem_layouts, consumer_args):
        """The kernel's roles, after its own prologue (this class's and the FP8 GEMM's): smem,
        the A / B partitions, then warpgroup 0's load warp streaming the tiles' k-tiles by TMA
        and the two consumer warpgroups' ``consumer_loop(..., *consumer_args)``.
        ``ab_operands``: (atom, tensor) of A, B and B_up; ``smem_layouts``: the staged A, B and
        epilogue layouts."""
        tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, tma_atom_b_up, mBup_nkl = ab_operands
        if warp_idx == self.load_warp:
            self.prefetch_descriptors(tma_atom_a, tma_atom_b, tma_atom_b_up, tma_atom_c)
        _, ab_pipeline, sA, sB, sC = self.operand_smem(*smem_layouts)

        ab, k_tile_cnt, num_n_tiles, k_split = self.partition_ab(
            tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, tma_atom_b_up, mBup_nkl, sA, sB)
        num_m_tiles = mNumMTiles[0]
        num_tiles = num_m_tiles * num_n_tiles

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            # ---------------- producer warpgroup: warp 0 streams A and B tiles with TMA
            if warp_idx == self.load_warp:
                self.producer_loop(ab_pipeline, tma_atom_a, tma_atom_b, tma_atom_b_up, ab,
                                   mTileExpert, num_m_tiles, num_n_tiles, k_tile_cnt, k_split)
        else:
            # ---------------- consumer warpgroups: wgmma mainloop + epilogue
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consumer_loop(ab_pipeline, sA, sB, sC, tidx, warp_idx, warpgroup_idx,
                               k_tile_cnt, k_split, num_m_tiles, num_n_tiles, num_tiles,
                               *consumer_args)

    @cute.jit
    def consumer_loop(self, ab_pipeline, sA, sB, sC, tidx: Int32, warp_idx: Int32,
                      warpgroup_idx: Int32, k_tile_cnt: Int32, k_split: Int32,
                      num_m_tiles: Int32, num_n_tiles: Int32, num_tiles: Int32,
                      tiled_mma: cute.TiledMma, c_outputs, row_tensors,
                      mTimeline: Optional[cute.Tensor]):
        """A consumer warpgroup's tiles: the mainloop, then the epilogue's subtiles through
        smem, TMA-stored by one warp. ``c_outputs``: (atom, tensor) of each output;
        ``row_tensors``: the row-addressed epilogues' (saved g | u, row -> slot, weights, row
        partials); ``mTimeline``: the recorder's buffer (``timeline``)."""
        tile_m = self.tile_shape_mnk[0]
        consumer = warpgroup_idx - 1  # 0 or 1
        # pingpong: each warpgroup is a whole single-warpgroup MMA; cooperative: the two
        # warpgroups are the two row halves of one MMA.
        tile_tidx = tidx % self.threads_per_warpgroup if const_expr(self.pingpong) \
            else tidx - self.threads_per_warpgroup
        mma_slice = 0 if const_expr(self.pingpong) else consumer * self.threads_per_warpgroup
        tCrA, tCrB, acc, num_k_blocks, epi = self.consumer_parts(
            tiled_mma, sA, sB, sC, mma_slice, tile_tidx)
        epi_m = tile_m // self.epi_tile[0]
        out_n = self.out_tile_n // self.epi_tile[1]
        outputs = self.output_views(c_outputs)
        coords = None
        if const_expr(self.epilogue == "dgated" or self.save_preact):
            coords = self.epi_coords(epi, tile_tidx)
        tma_store_pipeline, epilogue_barrier, is_store_warp = self.epilogue_sync(
            warp_idx, warpgroup_idx)
        # pingpong: each warpgroup's own epi_stages x epi_outputs buffers
        epi_base = consumer * self.epi_stages * self.epi_outputs if const_expr(self.pingpong) else 0

        grid_size = cute.arch.grid_dim()[0]
        tile_stride = grid_size
        tile_idx = cute.arch.block_idx()[0]
        loads = Int32(0)  # stage uses before this warpgroup's next tile
        first_tile = tile_idx
        my_turn, their_turn = None, None
        if const_expr(self.pingpong):
            # warpgroup 1 takes this CTA's odd tiles and skips the stages of the first
            loads = consumer * k_tile_cnt
            tile_idx += consumer * tile_stride
            tile_stride = tile_stride * 2
            # the warpgroups take turns at the mainloop: each waits on its own barrier
            # and arrives on the other's (mainloop_begin / mainloop_end)
            my_turn = pipeline.NamedBarrier(
                barrier_id=int(common.NamedBarriers.MMA_ORDER) + consumer,
                num_threads=self.num_mma_threads)
            their_turn = pipeline.NamedBarrier(
                barrier_id=int(common.NamedBarriers.MMA_ORDER) + 1 - consumer,
                num_threads=self.num_mma_threads)
        # the other warpgroup's tile owns the next k_tile_cnt stages (pingpong)
        loads_per_tile = k_tile_cnt * (2 if const_expr(self.pingpong) else 1)
        subtiles_done = Int32(0)
        record_slot = Int64(0)
        record_capacity = Int64(0)
        if const_expr(self.timeline):
            # one ticket for all the tiles this tile owner will run (known up front), and
            # the capacity read once: a record then costs no load on the store warp
            if tile_tidx == 0:
                my_tiles = cutlass.max(num_tiles - tile_idx + tile_stride - 1, 0) // tile_stride
                record_slot = common.timeline_reserve(mTimeline, my_tiles)
                record_capacity = common.timeline_capacity(mTimeline)
        while tile_idx < num_tiles:
            m_tile, n_tile = common.grouped_raster(tile_idx, num_m_tiles, num_n_tiles, self.group_m)
            t_start = Int64(0)
            if const_expr(self.timeline):
                if tile_tidx == 0:  # only the record's writer reads the timer
                    t_start = common.timeline_now()
            release = self.mainloop(ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads,
                                    k_tile_cnt, num_k_blocks,
                                    (my_turn, their_turn, tile_idx, first_tile, grid_size,
                                     num_tiles))
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release)
            loads += loads_per_tile

            # ---- epilogue: subtiles through smem, TMA-stored by one warp
            self.store_tile(epi, outputs, m_tile, n_tile, coords, row_tensors, epi_base,
                            subtiles_done, epilogue_barrier, tma_store_pipeline, is_store_warp,
                            tile_tidx)
            subtiles_done += epi_m * out_n
            if const_expr(self.timeline):
                if tile_tidx == 0:
                    common.timeline_write(mTimeline, record_slot, 1, self.task_type,
                                          tile_idx, 0, t_start, common.timeline_now(),
                                          record_capacity)
                record_slot += 1
            tile_idx += tile_stride
        tma_store_pipeline.producer_tail()

    # ------------------------------------------------------------------ mainloop hooks
    @cute.jit
    def mainloop_begin(self, hook_args):
        """pingpong: wait until the other warpgroup has issued its tile's last k-tile.
        Without this turn, warpgroup 1 waits on stage barriers a whole tile (k_tile_cnt
        stages) ahead of the producer, and an mbarrier parity wait can only tell the current
        phase from the previous one: it passes on a stale phase, consumes the other tile's
        data and over-arrives on the empty barrier."""
        if const_expr(self.pingpong):
            my_turn, _, tile_idx, first_tile, grid_size, _ = hook_args
            if tile_idx >= first_tile + grid_size:
                my_turn.arrive_and_wait()

    @cute.jit
    def mainloop_end(self, k_tiles: Int32, hook_args):
        """pingpong: every stage of this tile has been waited for, so the next tile (the
        other warpgroup's) may start waiting on its stages while ours drain."""
        if const_expr(self.pingpong):
            _, their_turn, tile_idx, _, grid_size, num_tiles = hook_args
            if tile_idx + grid_size < num_tiles:
                their_turn.arrive()


    # ------------------------------------------------------------------ operand loads
    def partition_ab(self, tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, tma_atom_b_up, mBup_nkl, sA,
                     sB):
        """Trace time, inside a kernel: the TMA partitions of A's and B's k-tiles and stages
        (``AbTiles``), A's k-tile count, the N-tile count and B's k-tiles in mB. swiglu: the
        up half of every B stage comes from mBup; b_split_k: B's k-tiles past mB's come from
        mBup into the whole stage."""
        tile_m, _, tile_k = self.tile_shape_mnk
        # (bM, bK, RestM, RestK, RestL) / (bN, bK, RestN, RestK, RestE)
        gA_mkl = cute.local_tile(mA_mkl, (tile_m, tile_k), (None, None, None))
        gB_nkl = cute.local_tile(mB_nkl, (self.b_rows_per_load, tile_k), (None, None, None))
        single_cta = cute.make_layout(1)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, 0, single_cta, cute.group_modes(sA, 0, 2), cute.group_modes(gA_mkl, 0, 2))
        # (rows, bK, halves, 1, stages): the gate half and the up half of every B stage
        sB_halves = cute.flat_divide(sB, (self.b_rows_per_load, tile_k))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, single_cta, cute.group_modes(sB_halves[(None, None, 0, 0, None)], 0, 2),
            cute.group_modes(gB_nkl, 0, 2))
        tBsB_up, tBgB_up = None, None
        if self.epilogue == "swiglu" or self.b_split_k:
            # swiglu: the up half of every B stage; b_split_k: the whole stage
            half = 1 if self.epilogue == "swiglu" else 0
            gBup_nkl = cute.local_tile(mBup_nkl, (self.b_rows_per_load, tile_k), (None, None, None))
            tBsB_up, tBgB_up = cute.nvgpu.cpasync.tma_partition(
                tma_atom_b_up, 0, single_cta,
                cute.group_modes(sB_halves[(None, None, half, 0, None)], 0, 2),
                cute.group_modes(gBup_nkl, 0, 2))
        ab = AbTiles(tAgA, tAsA, tBgB, tBsB, tBgB_up, tBsB_up)
        return (ab, cute.size(gA_mkl, mode=[3]), cute.size(gB_nkl, mode=[2]),
                cute.size(gB_nkl, mode=[3]))

    @cute.jit
    def producer_loop(self, ab_pipeline, tma_atom_a, tma_atom_b, tma_atom_b_up, ab,
                      mTileExpert: cute.Tensor, num_m_tiles: Int32, num_n_tiles: Int32,
                      k_tile_cnt: Int32, k_split: Int32):
        """The load warp: every tile of this CTA (stride: the grid), each k-tile's A box and
        B box(es) by TMA into the next stage."""
        tAgA, tAsA, tBgB, tBsB, tBgB_up, tBsB_up = ab
        producer_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.ab_stages)
        num_tiles = num_m_tiles * num_n_tiles
        tile_idx = cute.arch.block_idx()[0]
        while tile_idx < num_tiles:
            m_tile, n_tile = common.grouped_raster(tile_idx, num_m_tiles, num_n_tiles, self.group_m)
            expert = mTileExpert[m_tile]
            tAgA_k = tAgA[(None, m_tile, None, 0)]
            for k_tile in range(k_tile_cnt):
                ab_pipeline.producer_acquire(producer_state)
                barrier = ab_pipeline.producer_get_barrier(producer_state)
                cute.copy(tma_atom_a, tAgA_k[(None, k_tile)],
                          tAsA[(None, producer_state.index)], tma_bar_ptr=barrier)
                if const_expr(self.b_split_k):
                    if k_tile < k_split:
                        cute.copy(tma_atom_b, tBgB[(None, n_tile, k_tile, expert)],
                                  tBsB[(None, producer_state.index)], tma_bar_ptr=barrier)
                    else:
                        cute.copy(tma_atom_b_up,
                                  tBgB_up[(None, n_tile, k_tile - k_split, expert)],
                                  tBsB_up[(None, producer_state.index)], tma_bar_ptr=barrier)
                else:
                    cute.copy(tma_atom_b, tBgB[(None, n_tile, k_tile, expert)],
                              tBsB[(None, producer_state.index)], tma_bar_ptr=barrier)
                if const_expr(self.epilogue == "swiglu"):
                    cute.copy(tma_atom_b_up, tBgB_up[(None, n_tile, k_tile, expert)],
                              tBsB_up[(None, producer_state.index)], tma_bar_ptr=barrier)
                ab_pipeline.producer_commit(producer_state)
                producer_state.advance()
            tile_idx += cute.arch.grid_dim()[0]
        ab_pipeline.producer_tail(producer_state)

    def output_views(self, outputs):
        """The epilogue's first ``epi_outputs`` outputs, ((TMA atom, (M, N_out, 1) tensor), ...),
        as (atom, (TILE_M, N_out tile, RestM, RestN, 1) tiled view) pairs. Traced inline."""
        tile = (TILE_M, self.out_tile_n)
        return tuple((atom, cute.local_tile(t, tile, (None, None, None)))
                     for atom, t in outputs[:self.epi_outputs])

    def store_tile(self, epi, outputs, m_tile: Int32, n_tile: Int32, coords, row_tensors,
                   epi_base, subtiles_done: Int32, barrier, store_pipeline, is_store_warp,
                   tidx: Int32):
        """One output tile's epilogue, for the bf16 and the FP8 grouped kernels: every output's
        (m_tile, n_tile) tile through smem and TMA (``outputs``: ``output_views``), with the row
        setup of the row-addressed kinds first and dgated's row partials after
        (``row_tensors``: mPreact, mRowSlot, mWeights, mPartials). Traced inline."""
        atoms = tuple(atom for atom, _ in outputs)
        g_tiles = tuple(view[(None, None, m_tile, n_tile, 0)] for _, view in outputs)
        mPreact, mRowSlot, mWeights, mPartials = row_tensors
        rows, visit_args = None, None
        if const_expr(self.epilogue == "dgated" or self.save_preact):
            rows, visit_args = self.row_visit_args(epi, self.epilogue, coords, m_tile, n_tile,
                                                   mPreact, mRowSlot, mWeights, tidx)
        self.tile_epilogue(epi, atoms, g_tiles, self.epilogue, epi_base, subtiles_done, barrier,
                           store_pipeline, is_store_warp, visit_args)
        if const_expr(self.epilogue == "dgated"):
            self._store_row_sums(rows, mPartials, m_tile, n_tile, tidx)


# ---------------------------------------------------------------------- host helpers
# Relative cost per output column of narrower tiles (less wgmma work per smem byte),
# from a tile_n sweep on the H200.
_TILE_COST = {256: 1.0, 128: 1.15, 64: 1.5}


def choose_tile_n(n_out: int, epilogue: str) -> int:
    """Tile width with the least padded work for ``n_out`` output columns.

    A partial last N-tile is fine (TMA zero-fills loads past N and clips stores), so any
    ``n_out % 8 == 0`` works; narrower tiles only win when they cut much padding.
    """
    if n_out <= 0 or n_out % 8:
        raise ValueError(f"output width must be a positive multiple of 8, got {n_out}")
    options = (256, 128) if epilogue == "swiglu" else (256, 128, 64)

    def cost(tile_n):
        out = tile_n // 2 if epilogue == "swiglu" else tile_n
        return -(-n_out // out) * out * _TILE_COST[out if epilogue != "swiglu" else tile_n]
    return min(options, key=lambda t: (cost(t), -t))


def _fake_operands(gemm: GroupedGemmSm90, timeline: bool):
    """Fake (M, K, 1) A, (N, K, E) B (two of them for swiglu and b_split_k), (M, N_out, 1)
    C and the extra tensors of the three-output epilogues, with run-time extents and
    strides (what a strided torch view passes through TVM-FFI)."""
    bf16 = cutlass.BFloat16
    m, num_experts = cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32(divisibility=TILE_K)
    n = cute.sym_int32(divisibility=8)  # partial last N-tiles are handled by TMA bounds
    n_out = cute.sym_int32(divisibility=8)
    a = common.fake_kmajor_tensor(bf16, (m, k, 1))
    b_mode = 0 if gemm.b_mn_major else 1  # the contiguous mode of B
    k_b = cute.sym_int32(divisibility=TILE_K) if gemm.b_split_k else k  # B's K: part of A's
    b = common.fake_strided_tensor(bf16, (n, k_b, num_experts), contiguous_mode=b_mode)
    b_up = None
    if gemm.epilogue == "swiglu" or gemm.b_split_k:
        k2 = cute.sym_int32(divisibility=TILE_K) if gemm.b_split_k else k
        b_up = common.fake_strided_tensor(bf16, (n, k2, num_experts), contiguous_mode=b_mode)
    c = common.fake_kmajor_tensor(bf16, (m, n_out, 1))
    tile_expert = common.fake_vector(Int32)
    num_m_tiles = common.fake_vector(Int32)
    timeline = common.fake_vector(Int64, align_bytes=8) if timeline else None
    extra = (None,) * 6
    if gemm.epi_outputs == 3:
        extra = (common.fake_kmajor_tensor(bf16, (m, n_out, 1)),
                 common.fake_kmajor_tensor(bf16, (m, n_out, 1))) + (None,) * 4
    if gemm.epilogue == "dgated" or gemm.save_preact:
        # the pre-activations: one row per (token, k) slot, g then u (2I: even)
        preact = common.fake_kmajor_tensor(bf16, (cute.sym_int32(),
                                                  cute.sym_int32(divisibility=16)))
        extra = extra[:2] + (preact, common.fake_vector(Int32))
        if gemm.epilogue == "dgated":
            extra += (common.fake_vector(Float32),
                      common.fake_strided_tensor(Float32, (m, cute.sym_int32()), align_bytes=4))
        else:
            extra += (None, None)
    return a, b, b_up, c, tile_expert, num_m_tiles, timeline, *extra


def compile_grouped_gemm(epilogue: str = "store", tile_n: int = 256, group_m: int = 8,
                         num_sms: int = 132, timeline: bool = False, task_type: int | None = None,
                         pingpong: bool = False, save_preact: bool = False,
                         b_mn_major: bool = False, b_split_k: bool = False,
                         max_ab_stages: int | None = None, arch: str = "sm_90a",
                         options: str = ""):
    """Compile one static configuration on fake tensors (no GPU needed).

    M, N, K and the expert count are run-time extents: one compile serves every shape
    with K % 64 == 0 and N % 8 == 0. The result takes torch tensors directly (TVM-FFI):
    ``A (M,K,1)``, ``B (N,K,E)``, ``B_up`` (swiglu) or None, ``C (M,N_out,1)`` strided views,
    the int32 tile -> expert table, the one-element M-tile count and the int64 timeline
    buffer (None when ``timeline`` is off), then C2, C3 (three-output epilogues) and the
    dgated epilogue's tensors (``__call__``; None where unused); it runs on torch's current
    stream.
    """
    gemm = GroupedGemmSm90(tile_n=tile_n, epilogue=epilogue, group_m=group_m, num_sms=num_sms,
                           timeline=timeline, task_type=task_type, pingpong=pingpong,
                           save_preact=save_preact, b_mn_major=b_mn_major, b_split_k=b_split_k,
                           max_ab_stages=max_ab_stages)
    args = _fake_operands(gemm, timeline)
    return cute.compile(gemm, *args, common.fake_stream(),
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))
