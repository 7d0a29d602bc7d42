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
- ``"store"``:  C = bf16(acc)                                 (FC2: down projection, y rows)
- ``"swiglu"``: C = bf16(silu(A @ Wg^T) * (A @ Wu^T))  (FC1: gate and up in one pass).
  Two TMA descriptors fill the two halves of one B stage: rows [0, tile_n/2) from W_gate
  and rows [tile_n/2, tile_n) from the matching rows of W_up. One wgmma N-tile therefore
  holds matching gate and up columns, every thread owns both halves of its pairs (no
  shuffles), and the weights are used as given: no packed copy.

Roles (384 threads, ``gemm_core.GemmCoreSm90``): warpgroup 0 is the producer (warp 0 issues
TMA loads into an mbarrier ring); warpgroups 1-2 are the consumers (wgmma, then the epilogue
through smem and TMA stores). Cooperative: they split each tile's rows. Pingpong (FC2 with a
short K): they take alternate tiles and turns at the mainloop, so one's epilogue runs under
the other's mainloop. The K loop runs in a fixed order and there is no split-K, so results
are bitwise reproducible.

Tile order: persistent CTAs walk a linear tile index with a grid stride, rasterised in groups
of ``group_m`` M-tiles (``common.grouped_raster``) so CTAs running together share B tiles.

Constraints: bf16 in/out, fp32 accumulation; K % 64 == 0; N % 8 == 0 (a partial last
N-tile is zero-filled on load and clipped on store by TMA); tile_n in {64, 128, 256}
(swiglu: 128 or 256; pingpong: <= 128).
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64, const_expr

from mok_cute import jit
from mok_cute.constants import TILE_K
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import GemmCoreSm90

EPILOGUES = ("store", "swiglu")


class GroupedGemmSm90(GemmCoreSm90):
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
    """

    def __init__(self, tile_n: int = 256, epilogue: str = "store", group_m: int = 8,
                 num_sms: int = 132, timeline: bool = False, task_type: int | None = None,
                 pingpong: bool = False):
        super().__init__(tile_n, pingpong)
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        if epilogue == "swiglu" and tile_n < 128:
            raise ValueError(f"the swiglu epilogue needs tile_n >= 128, got {tile_n}")
        if group_m < 1:
            raise ValueError(f"group_m must be >= 1, got {group_m}")
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
                 mTimeline: Optional[cute.Tensor], stream: cuda.CUstream):
        """mA (M_cap, K, 1), mB (N, K, E), mC (M_cap, N_out, 1): all K- / N-major.
        swiglu: mB is W_gate and mB_up is W_up, both (I, K, E); store: mB_up is None.
        mTimeline: int64 recorder buffer, or None when the timeline flag is off."""
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
        if const_expr(self.epilogue == "swiglu"):
            tma_atom_b_up, tma_tensor_b_up = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mB_up, b_box_layout, b_box)
        tma_atom_c, tma_tensor_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC,
            cute.slice_(self.epi_smem_layout_staged, (None, None, 0)), self.epi_tile)

        @cute.struct
        class SharedStorage:
            ab_full_empty: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_layout_staged)],
                self.buffer_align_bytes]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_layout_staged)],
                self.buffer_align_bytes]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout_staged)],
                self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tma_atom_b_up, tma_tensor_b_up,
            tma_atom_c, tma_tensor_c, mTileExpert, mNumMTiles, mTimeline, self.tiled_mma,
            self.a_smem_layout_staged, self.b_smem_layout_staged, self.epi_smem_layout_staged,
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
               epi_smem_layout_staged: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)
        tile_m, tile_n, tile_k = self.tile_shape_mnk

        if const_expr(self.timeline):
            if tidx == 0 and cute.arch.block_idx()[0] == 0:
                common.timeline_mark_start(mTimeline, common.timeline_now())
        if warp_idx == self.load_warp:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            if const_expr(self.epilogue == "swiglu"):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b_up)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_c)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tma_bytes = (cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem_layout_staged, (None, None, 0)))
                     + cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_layout_staged, (None, None, 0))))
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_full_empty.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            # one arrive per warp that consumes the stage
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.threads_per_tile // 32),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner)

        # (bM, bK, RestM, RestK, RestL) / (bN, bK, RestN, RestK, RestE) / (bM, bNout, RestM, RestN, 1)
        gA_mkl = cute.local_tile(mA_mkl, (tile_m, tile_k), (None, None, None))
        gB_nkl = cute.local_tile(mB_nkl, (self.b_rows_per_load, tile_k), (None, None, None))
        gC_mnl = cute.local_tile(mC_mnl, (tile_m, self.out_tile_n), (None, None, None))
        single_cta = cute.make_layout(1)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, 0, single_cta, cute.group_modes(sA, 0, 2), cute.group_modes(gA_mkl, 0, 2))
        # (rows, bK, halves, 1, stages): the gate half and the up half of every B stage
        sB_halves = cute.flat_divide(sB, (self.b_rows_per_load, tile_k))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, single_cta, cute.group_modes(sB_halves[(None, None, 0, 0, None)], 0, 2),
            cute.group_modes(gB_nkl, 0, 2))
        tBsB_up, tBgB_up = None, None
        if const_expr(self.epilogue == "swiglu"):
            gBup_nkl = cute.local_tile(mBup_nkl, (self.b_rows_per_load, tile_k), (None, None, None))
            tBsB_up, tBgB_up = cute.nvgpu.cpasync.tma_partition(
                tma_atom_b_up, 0, single_cta,
                cute.group_modes(sB_halves[(None, None, 1, 0, None)], 0, 2),
                cute.group_modes(gBup_nkl, 0, 2))

        k_tile_cnt = cute.size(gA_mkl, mode=[3])
        num_n_tiles = cute.size(gB_nkl, mode=[2])
        num_m_tiles = mNumMTiles[0]
        num_tiles = num_m_tiles * num_n_tiles

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            # ---------------- producer warpgroup: warp 0 streams A and B tiles with TMA
            if warp_idx == self.load_warp:
                producer_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.ab_stages)
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
                        cute.copy(tma_atom_b, tBgB[(None, n_tile, k_tile, expert)],
                                  tBsB[(None, producer_state.index)], tma_bar_ptr=barrier)
                        if const_expr(self.epilogue == "swiglu"):
                            cute.copy(tma_atom_b_up, tBgB_up[(None, n_tile, k_tile, expert)],
                                      tBsB_up[(None, producer_state.index)], tma_bar_ptr=barrier)
                        ab_pipeline.producer_commit(producer_state)
                        producer_state.advance()
                    tile_idx += cute.arch.grid_dim()[0]
                ab_pipeline.producer_tail(producer_state)
        else:
            # ---------------- consumer warpgroups: wgmma mainloop + epilogue
            cute.arch.setmaxregister_increase(self.consumer_regs)
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
            tma_store_pipeline = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.threads_per_tile))
            epilogue_barrier = pipeline.NamedBarrier(
                barrier_id=int(common.NamedBarriers.EPILOGUE) + (consumer if const_expr(self.pingpong) else 0),
                num_threads=self.threads_per_tile)
            is_store_warp = warp_idx == 4 * warpgroup_idx if const_expr(self.pingpong) else warp_idx == 4
            epi_base = consumer * self.epi_stages if const_expr(self.pingpong) else 0

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
                self.tile_epilogue(epi, (tma_atom_c,), (gC_mnl[(None, None, m_tile, n_tile, 0)],),
                                   self.epilogue, epi_base, subtiles_done, epilogue_barrier,
                                   tma_store_pipeline, is_store_warp)
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


def _fake_operands(swiglu: bool, timeline: bool):
    """Fake (M, K, 1) A, (N, K, E) B (two of them for swiglu: gate and up, N = I),
    (M, N_out, 1) C and int32 vectors with run-time extents and strides (what a strided
    torch view passes through TVM-FFI)."""
    bf16 = cutlass.BFloat16
    m, num_experts = cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32(divisibility=TILE_K)
    n = cute.sym_int32(divisibility=8)  # partial last N-tiles are handled by TMA bounds
    n_out = cute.sym_int32(divisibility=8)
    a = common.fake_kmajor_tensor(bf16, (m, k, 1))
    b = common.fake_kmajor_tensor(bf16, (n, k, num_experts))
    b_up = common.fake_kmajor_tensor(bf16, (n, k, num_experts)) if swiglu else None
    c = common.fake_kmajor_tensor(bf16, (m, n_out, 1))
    tile_expert = common.fake_vector(Int32)
    num_m_tiles = common.fake_vector(Int32)
    timeline = common.fake_vector(Int64, align_bytes=8) if timeline else None
    return a, b, b_up, c, tile_expert, num_m_tiles, timeline


def compile_grouped_gemm(epilogue: str = "store", tile_n: int = 256, group_m: int = 8,
                         num_sms: int = 132, timeline: bool = False, task_type: int | None = None,
                         pingpong: bool = False, arch: str = "sm_90a", options: str = ""):
    """Compile one static configuration on fake tensors (no GPU needed).

    M, N, K and the expert count are run-time extents: one compile serves every shape
    with K % 64 == 0 and N % 8 == 0. The result takes torch tensors directly (TVM-FFI):
    ``A (M,K,1)``, ``B (N,K,E)``, ``B_up`` (swiglu) or None, ``C (M,N_out,1)`` strided views,
    the int32 tile -> expert table, the one-element M-tile count and the int64 timeline
    buffer (None when ``timeline`` is off); it runs on torch's current stream.
    """
    gemm = GroupedGemmSm90(tile_n=tile_n, epilogue=epilogue, group_m=group_m, num_sms=num_sms,
                           timeline=timeline, task_type=task_type, pingpong=pingpong)
    args = _fake_operands(epilogue == "swiglu", timeline)
    return cute.compile(gemm, *args, common.fake_stream(),
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))
