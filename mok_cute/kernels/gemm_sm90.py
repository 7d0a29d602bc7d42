"""Persistent, warp-specialised grouped GEMM for MoE experts on Hopper (sm_90a).

    C[rows of M-tile m, n-tile] = epilogue( A[rows of m, :] @ B[expert(m), n-tile, :]^T )

- A ``(M_cap, K)`` bf16, K-major: the expert-sorted, tile-padded activation rows (the
  receive schedule pads every expert segment to ``tile_m`` rows, so each M-tile belongs to
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

Roles (384 threads): warpgroup 0 is the producer (warp 0 issues TMA loads into a
``num_stages``-deep mbarrier ring, registers lowered with setmaxnreg); warpgroups 1-2 are
the consumers (each owns 64 rows of the 128-row tile, wgmma with fp32 accumulators,
registers raised with setmaxnreg), then run the epilogue through shared memory and TMA
stores. The K loop runs in a fixed order and there is no split-K, so results are bitwise
reproducible.

Tile order: persistent CTAs walk a linear tile index with a grid stride. The index is
rasterised in groups of ``group_m`` M-tiles: inside a group the M index moves fastest,
so CTAs running at the same time share B tiles (one expert's weight slice) and the A
rows of the group stay hot in L2.

Constraints: bf16 in/out, fp32 accumulation; K % 64 == 0; N % 8 == 0 (a partial last
N-tile is zero-filled on load and clipped on store by TMA); tile_m = 128;
tile_n in {64, 128, 256} (swiglu: 128 or 256).
"""

from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64, Float32, const_expr
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

from mok_cute import jit
from mok_cute.config import experimental_switch
from mok_cute.kernels import common, token_ops

# The pingpong kernel: a tile's first k-block overwrites the accumulators (wgmma scale-d = 0)
# instead of adding to zeros that 64 movs per thread wrote first. ptxas serialises the first
# wgmmas around that zero fill (C7517, "warpgroup.wait is injected"); CUTLASS starts tiles this
# way. Read when a kernel is built. Measured on the H200 (run 39): bitwise equal, FC2 -2.4 %
# to +2.1 %, less than a repeat's spread, so off. MOK_FIRST_MMA_OVERWRITES=1.
FIRST_MMA_OVERWRITES = experimental_switch("FIRST_MMA_OVERWRITES", False)
# How much of the fused k-sum (ksum_top_k) ops builds: 3 all of it; 2, 1 and 0 stop after
# the counting atomics, after the stores' landing wait and barrier, and before either. Below 3
# out is not written: a diagnostic for tools/ksum_fc2_probe.py, which times where the fused
# k-sum's cost goes.
KSUM_STAGES = 3
TILE_M = 128
TILE_K = 64
EPILOGUES = ("store", "swiglu")


class GroupedGemmSm90:
    """Grouped (per-expert) GEMM with a run-time tile -> expert table.

    :param tile_n: CTA tile width in N (64, 128 or 256; swiglu needs >= 128).
    :param epilogue: ``"store"`` or ``"swiglu"``.
    :param group_m: M-tiles per rasterisation group (L2 reuse of B).
    :param num_sms: persistent grid size (132 on H100/H200).
    :param timeline: record one (start, end) span per tile (``mok_cute.timeline`` format).
    :param task_type: ``mok_cute.timeline.TaskType`` value written in the records.
    :param pingpong: the two consumer warpgroups take alternate whole tiles (one runs its
        epilogue while the other runs its mainloop) instead of sharing each tile.
        Its first H200 run hung: the two warpgroups waited on stage barriers a tile apart,
        beyond the one phase an mbarrier parity wait can tell apart. They now take turns at
        the mainloop through two named barriers (``NamedBarriers.MMA_ORDER``), as CUTLASS's
        pingpong kernel orders its math warpgroups; its GPU tests pass (fifth session).
        ``mok_cute.ops`` selects it for FC2 with a short K (``ops.fc2_pingpong``).
    :param cluster_m: 1, or 2 for clusters of two CTAs on M-tiles 2i and 2i + 1 of one
        N-tile (cooperative only). When both tiles are the same expert's, each CTA loads half
        of the B tile and multicasts it to both, so B crosses L2 once for the pair; at an
        expert boundary each loads all of B itself. With an odd M-tile count the last
        pair's second CTA recomputes the first's tile and stores nothing. ``num_sms`` is
        then the grid (2 x the co-resident clusters). Why: B is two thirds of FC1's bytes
        per k-tile (32 of 48 KB), and the GEMMs run at 82-86 % of cuBLAS, which uses
        clusters.
    :param one_epilogue_barrier: one named barrier per epilogue subtile instead of two
        (``store_tile_epilogue``'s ``one_barrier``).
    :param epi_n: columns of an epilogue subtile, cooperative kernels (32 or 64).
    :param ksum_top_k: 0, or K for FC2 on the pingpong kernel (``tile_n`` 128, ``"store"``)
        with the weighted k-sum fused into its epilogue: the tile that brings a token's
        (token, N-tile) counter to K sums that token's K y rows into ``out``
        (``token_ops.sum_finished_tokens``). Why: the k-sum kernel runs alone after FC2
        with the tensor cores idle (dsv3 ~0.17 ms of ~5 ms); in the pingpong kernel one
        warpgroup's epilogue overlaps the other's mainloop. Measured slower on the H200
        (``ops.KSUM_IN_FC2``, off): the sums outlast the other warpgroup's mainloop.
    :param ksum_stages: ``KSUM_STAGES`` (a diagnostic: below 3 ``out`` is not written).
    :param ksum_deferred: count and sum each tile's rows after the warpgroup's next tile.
    """

    def __init__(self, tile_n: int = 256, epilogue: str = "store", group_m: int = 8,
                 num_sms: int = 132, timeline: bool = False, task_type: int | None = None,
                 pingpong: bool = False, cluster_m: int = 1, one_epilogue_barrier: bool = False,
                 epi_n: int = 32, ksum_top_k: int = 0, ksum_stages: int = 3,
                 ksum_deferred: bool = False):
        if tile_n not in (64, 128, 256):
            raise ValueError(f"tile_n must be 64, 128 or 256, got {tile_n}")
        if epilogue == "swiglu" and tile_n < 128:
            raise ValueError(f"the swiglu epilogue needs tile_n >= 128, got {tile_n}")
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        if group_m < 1:
            raise ValueError(f"group_m must be >= 1, got {group_m}")
        if pingpong and tile_n > 128:
            raise ValueError(f"pingpong keeps a whole 128 x tile_n accumulator per warpgroup: "
                             f"tile_n must be <= 128, got {tile_n}")
        if epi_n not in (32, 64) or (pingpong and epi_n != 32):
            raise ValueError(f"epi_n must be 32 or (cooperative only) 64, got {epi_n} "
                             f"with pingpong={pingpong}")
        if cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {cluster_m}")
        if cluster_m > 1 and (pingpong or timeline):
            raise ValueError("cluster_m=2 is written for the cooperative kernel without the "
                             "recorder (pingpong and timeline take cluster_m=1)")
        if num_sms % cluster_m:
            raise ValueError(f"num_sms must be a multiple of cluster_m={cluster_m}, got {num_sms}")
        if ksum_top_k and not (pingpong and epilogue == "store"
                               and tile_n == token_ops.LAST_ARRIVER_TILE_N):
            raise ValueError(f"ksum_top_k is written for the pingpong store epilogue with "
                             f"tile_n={token_ops.LAST_ARRIVER_TILE_N}, got pingpong={pingpong}, "
                             f"epilogue={epilogue!r}, tile_n={tile_n}")
        if not 0 <= ksum_top_k <= token_ops.MAX_K:
            raise ValueError(f"ksum_top_k must be in [0, {token_ops.MAX_K}], got {ksum_top_k}")
        self.ksum_top_k = ksum_top_k
        self.ksum_stages = ksum_stages  # KSUM_STAGES
        # count and sum a tile's rows after the warpgroup's next tile's stores are issued, when
        # its own have long landed (no wait for them in the epilogue)
        self.ksum_deferred = ksum_deferred and ksum_top_k > 0
        self.cluster_m = cluster_m
        self.one_epilogue_barrier = one_epilogue_barrier
        self.tile_shape_mnk = (TILE_M, tile_n, TILE_K)
        # pingpong only: the cooperative kernels' SASS gets worse with it (32 HGMMA unrolled
        # and 8 wgmma waits instead of 8 and 2), the pingpong one loses its C7517 wait
        self.first_mma_overwrites = FIRST_MMA_OVERWRITES and pingpong
        self.epilogue = epilogue
        self.group_m = group_m
        self.num_sms = num_sms
        # Timeline: one span per output tile into a bounded buffer (compile-time flag, so
        # nothing is emitted when off). Task type defaults to FC1 for swiglu, FC2 otherwise.
        self.timeline = timeline
        self.task_type = task_type if task_type is not None else (1 if epilogue == "swiglu" else 2)
        self.acc_dtype = Float32
        # Output tile: SwiGLU halves the N width of the stored tile.
        self.out_tile_n = tile_n // 2 if epilogue == "swiglu" else tile_n
        # SwiGLU loads each B stage as two boxes (gate rows, then the matching up rows).
        self.b_rows_per_load = self.out_tile_n
        # One producer warpgroup and two consumer warpgroups. Cooperative: the consumers
        # split each tile's 128 rows (64 each) and store it together. Pingpong: each
        # consumer owns whole tiles (two m64 wgmmas per k-block) and the two alternate.
        self.pingpong = pingpong
        self.atom_layout_mnk = (1, 1, 1) if pingpong else (2, 1, 1)
        self.num_mma_warpgroups = 2
        self.threads_per_warpgroup = 128
        self.threads_per_cta = (1 + self.num_mma_warpgroups) * self.threads_per_warpgroup
        self.num_mma_threads = self.num_mma_warpgroups * self.threads_per_warpgroup
        # threads that work on one tile, arrive on its stages and sync its epilogue
        self.threads_per_tile = self.threads_per_warpgroup if pingpong else self.num_mma_threads
        self.load_warp = 0
        self.producer_regs = 40
        self.consumer_regs = 232
        # cooperative: epi_n = 64 stores a tile in half as many subtiles (each one fence, two
        # barriers and one TMA store fewer) through 2 buffers of 16 KB instead of 4 of 8 KB
        self.epi_tile = (64, 32) if pingpong else (TILE_M, epi_n)
        self.epi_stages = 4 * 32 // epi_n
        # pingpong: each consumer warpgroup has its own epilogue buffers
        self.epi_buffers = self.epi_stages * (2 if pingpong else 1)
        self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")
        self.buffer_align_bytes = 1024
        # Derived in _setup_attributes once dtypes are known.
        self.tiled_mma = None
        self.ab_stages = None
        self.a_smem_layout_staged = None
        self.b_smem_layout_staged = None
        self.epi_smem_layout_staged = None

    # ------------------------------------------------------------------ derived attributes
    def _setup_attributes(self):
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype,
            cute.nvgpu.warpgroup.OperandMajorMode.K, cute.nvgpu.warpgroup.OperandMajorMode.K,
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_shape_mnk[1]),
        )
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        ab_bytes_per_stage = (tile_m + tile_n) * tile_k * self.a_dtype.width // 8
        epi_bytes = math.prod(self.epi_tile) * self.c_dtype.width // 8 * self.epi_buffers
        reserved = 1024  # mbarriers and alignment slack
        self.ab_stages = (self.smem_capacity - reserved - epi_bytes) // ab_bytes_per_stage
        self.a_smem_layout_staged = self._staged_kmajor_layout(
            self.a_dtype, (tile_m, tile_k), self.ab_stages)
        self.b_smem_layout_staged = self._staged_kmajor_layout(
            self.b_dtype, (tile_n, tile_k), self.ab_stages)
        epi_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.c_dtype,
                                            self.epi_tile[1]),
            self.c_dtype)
        self.epi_smem_layout_staged = cute.tile_to_shape(
            epi_atom, cute.append(self.epi_tile, self.epi_buffers), order=(0, 1, 2))

    @staticmethod
    def _staged_kmajor_layout(dtype, tile_mk, stages):
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, dtype, tile_mk[1]),
            dtype)
        return cute.tile_to_shape(atom, cute.append(tile_mk, stages), order=(0, 1, 2))

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mB_up: Optional[cute.Tensor],
                 mC: cute.Tensor,
                 mTileExpert: cute.Tensor, mNumMTiles: cute.Tensor,
                 mTimeline: Optional[cute.Tensor], mRowToken: Optional[cute.Tensor],
                 mSlotRows: Optional[cute.Tensor], mWeights: Optional[cute.Tensor],
                 mCounters: Optional[cute.Tensor], mOut: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        """mA (M_cap, K, 1), mB (N, K, E), mC (M_cap, N_out, 1): all K- / N-major.
        swiglu: mB is W_gate and mB_up is W_up, both (I, K, E); store: mB_up is None.
        mTimeline: int64 recorder buffer, or None when the timeline flag is off.
        ksum_top_k: the k-sum's row tokens, slot rows, fp32 weights ([T*K]), zeroed counters
        ([T * N-tiles]) and out (T, N); None without it."""
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
        b_box_layout = cute.slice_(self._staged_kmajor_layout(self.b_dtype, b_box, 1), (None, None, 0))
        tma_atom_b, tma_tensor_b = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mB, b_box_layout, b_box)
        tma_atom_b_up, tma_tensor_b_up = None, None
        if const_expr(self.epilogue == "swiglu"):
            tma_atom_b_up, tma_tensor_b_up = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mB_up, b_box_layout, b_box)
        # cluster_m = 2: the same B boxes, each CTA loading half and multicasting it
        mcast = (None,) * 4
        if const_expr(self.cluster_m > 1):
            g2s_mc = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            mcast = (*cute.nvgpu.cpasync.make_tiled_tma_atom(
                         g2s_mc, mB, b_box_layout, b_box, num_multicast=self.cluster_m),
                     None, None)
            if const_expr(self.epilogue == "swiglu"):
                mcast = (*mcast[:2], *cute.nvgpu.cpasync.make_tiled_tma_atom(
                    g2s_mc, mB_up, b_box_layout, b_box, num_multicast=self.cluster_m))
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
        ksum = (None,) * 6
        if const_expr(self.ksum_top_k > 0):
            # y and out as rows of 16-byte vectors, for the last arriver's sums
            h_vecs = cute.size(mC, mode=[1]) // token_ops.VEC_ELEMS
            ksum = (token_ops._row_vectors(mC.iterator, h_vecs, cute.size(mC, mode=[0])),
                    token_ops._row_vectors(mOut.iterator, h_vecs, cute.size(mOut, mode=[0])),
                    mRowToken, mSlotRows, mWeights, mCounters)
        self.kernel(
            tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tma_atom_b_up, tma_tensor_b_up,
            tma_atom_c, tma_tensor_c, *mcast,
            mTileExpert, mNumMTiles, mTimeline, self.tiled_mma,
            self.a_smem_layout_staged, self.b_smem_layout_staged, self.epi_smem_layout_staged,
            *ksum,
        ).launch(
            grid=[self.num_sms, 1, 1],
            block=[self.threads_per_cta, 1, 1],
            # a cluster attribute only for real clusters: the plain kernels launched as clusters
            # of one lost 19-24 % on the pingpong FC2 (run 78)
            cluster=[self.cluster_m, 1, 1] if self.cluster_m > 1 else None,
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor,
               tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor,
               tma_atom_b_up: Optional[cute.CopyAtom], mBup_nkl: Optional[cute.Tensor],
               tma_atom_c: cute.CopyAtom, mC_mnl: cute.Tensor,
               tma_atom_bm: Optional[cute.CopyAtom], mBm_nkl: Optional[cute.Tensor],
               tma_atom_bm_up: Optional[cute.CopyAtom], mBm_up_nkl: Optional[cute.Tensor],
               mTileExpert: cute.Tensor, mNumMTiles: cute.Tensor,
               mTimeline: Optional[cute.Tensor], tiled_mma: cute.TiledMma,
               a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout,
               mYVecs: Optional[cute.Tensor], mOutVecs: Optional[cute.Tensor],
               mRowToken: Optional[cute.Tensor], mSlotRows: Optional[cute.Tensor],
               mWeights: Optional[cute.Tensor], mCounters: Optional[cute.Tensor]):
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
            if const_expr(self.cluster_m > 1):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_bm)
                if const_expr(self.epilogue == "swiglu"):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_bm_up)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tma_bytes = (cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem_layout_staged, (None, None, 0)))
                     + cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_layout_staged, (None, None, 0))))
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_full_empty.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            # one arrive per warp that consumes the stage, in each CTA of the cluster (a
            # multicast writes the stage in both, so both must have released it)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.threads_per_tile // 32 * self.cluster_m),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

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

        # cluster_m = 2: this CTA's half of each multicast B box, and the mask of both CTAs
        rank_in_cluster = Int32(0)
        tBsBm, tBgBm, tBsBm_up, tBgBm_up, b_mcast_mask = None, None, None, None, None
        if const_expr(self.cluster_m > 1):
            rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cluster_layout = cute.make_layout((self.cluster_m, 1, 1))
            b_mcast_mask = cute.make_layout_image_mask(
                cluster_layout, cluster_layout.get_flat_coord(rank_in_cluster), mode=0)
            pair_layout = cute.make_layout(self.cluster_m)
            tBsBm, tBgBm = cute.nvgpu.cpasync.tma_partition(
                tma_atom_bm, rank_in_cluster, pair_layout,
                cute.group_modes(sB_halves[(None, None, 0, 0, None)], 0, 2),
                cute.group_modes(cute.local_tile(mBm_nkl, (self.b_rows_per_load, tile_k),
                                                 (None, None, None)), 0, 2))
            if const_expr(self.epilogue == "swiglu"):
                tBsBm_up, tBgBm_up = cute.nvgpu.cpasync.tma_partition(
                    tma_atom_bm_up, rank_in_cluster, pair_layout,
                    cute.group_modes(sB_halves[(None, None, 1, 0, None)], 0, 2),
                    cute.group_modes(cute.local_tile(mBm_up_nkl, (self.b_rows_per_load, tile_k),
                                                     (None, None, None)), 0, 2))

        k_tile_cnt = cute.size(gA_mkl, mode=[3])
        num_n_tiles = cute.size(gB_nkl, mode=[2])
        num_m_tiles = mNumMTiles[0]
        num_tiles = num_m_tiles * num_n_tiles
        if const_expr(self.cluster_m > 1):
            # the persistent loop walks pairs of M-tiles (one per cluster)
            num_tiles = (num_m_tiles + 1) // 2 * num_n_tiles

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))

        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            # ---------------- producer warpgroup: warp 0 streams A and B tiles with TMA
            if warp_idx == self.load_warp:
                producer_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.ab_stages)
                if const_expr(self.cluster_m > 1):
                    self._cluster_producer(ab_pipeline, producer_state, tma_atom_a, tAgA, tAsA,
                                           tma_atom_b, tBgB, tBsB, tma_atom_b_up, tBgB_up,
                                           tBsB_up, tma_atom_bm, tBgBm, tBsBm, tma_atom_bm_up,
                                           tBgBm_up, tBsBm_up, b_mcast_mask, mTileExpert,
                                           num_m_tiles, num_n_tiles, num_tiles, k_tile_cnt,
                                           rank_in_cluster)
                else:
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
                            self._copy_b((tma_atom_b, tBgB, tBsB, tma_atom_b_up, tBgB_up, tBsB_up),
                                         n_tile, k_tile, expert, producer_state.index, barrier)
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
            thr_mma = tiled_mma.get_slice(mma_slice)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((tile_m, tile_n)), self.acc_dtype)
            num_k_blocks = cute.size(tCrA, mode=[2])

            # Epilogue partitions: registers -> smem (stmatrix) -> gmem (TMA store).
            stmatrix = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.c_dtype)
            tiled_copy_r2s = cute.make_tiled_copy_S(
                sm90_utils.sm90_get_smem_store_op(utils.LayoutEnum.ROW_MAJOR,
                                                  elem_ty_d=self.c_dtype,
                                                  elem_ty_acc=self.acc_dtype),
                cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
            thr_copy_r2s = tiled_copy_r2s.get_slice(tile_tidx)
            epi = TileEpilogue(tiled_copy_r2s, thr_copy_r2s.partition_D(sC),
                               tiled_copy_r2s.retile(acc),
                               cute.shape(thr_copy_r2s.partition_S(sC))[:3], sC)
            epi_m = tile_m // self.epi_tile[0]
            out_n = self.out_tile_n // self.epi_tile[1]
            tma_store_pipeline = pipeline.PipelineTmaStore.create(
                num_stages=store_pipeline_stages(self.epi_stages, self.one_epilogue_barrier),
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.threads_per_tile))
            epilogue_barrier = pipeline.NamedBarrier(
                barrier_id=int(common.NamedBarriers.EPILOGUE) + (consumer if const_expr(self.pingpong) else 0),
                num_threads=self.threads_per_tile)
            is_store_warp = warp_idx == 4 * warpgroup_idx if const_expr(self.pingpong) else warp_idx == 4
            epi_base = consumer * self.epi_stages if const_expr(self.pingpong) else 0

            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages)
            grid_size = cute.arch.grid_dim()[0]
            tile_stride = grid_size
            tile_idx = cute.arch.block_idx()[0]
            if const_expr(self.cluster_m > 1):  # a pair of M-tiles per cluster
                tile_stride = grid_size // self.cluster_m
                tile_idx = tile_idx // self.cluster_m
            first_tile = tile_idx
            my_turn, their_turn = None, None
            if const_expr(self.pingpong):
                # warpgroup 1 takes this CTA's odd tiles and skips the stages of the first
                # (branch-free: state mutated inside a run-time `if` is not carried out of it)
                read_state.advance(consumer * k_tile_cnt)
                tile_idx += consumer * tile_stride
                tile_stride = tile_stride * 2
                # the warpgroups take turns at the mainloop: each waits on its own barrier
                # and arrives on the other's (see the mainloop below)
                my_turn = pipeline.NamedBarrier(
                    barrier_id=int(common.NamedBarriers.MMA_ORDER) + consumer,
                    num_threads=self.num_mma_threads)
                their_turn = pipeline.NamedBarrier(
                    barrier_id=int(common.NamedBarriers.MMA_ORDER) + 1 - consumer,
                    num_threads=self.num_mma_threads)
            release_state = read_state.clone()
            subtiles_done = Int32(0)
            held_m = Int32(-1)  # ksum_deferred: the tile not yet counted
            held_n = Int32(0)
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
                stores = is_store_warp
                if const_expr(self.cluster_m > 1):
                    m_tile, n_tile, real = self._cluster_tile(tile_idx, num_m_tiles, num_n_tiles,
                                                              rank_in_cluster)
                    stores = is_store_warp & real  # the last pair's repeated tile is not stored
                else:
                    m_tile, n_tile = common.grouped_raster(tile_idx, num_m_tiles, num_n_tiles, self.group_m)
                t_start = Int64(0)
                if const_expr(self.timeline):
                    if tile_tidx == 0:  # only the record's writer reads the timer
                        t_start = common.timeline_now()

                # ---- mainloop: one wgmma batch stays in flight; a stage is released once
                # the batch that read it has retired. Plain `range` lets the compiler unroll.
                if const_expr(not self.first_mma_overwrites):
                    acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                if const_expr(self.pingpong):
                    # Wait for the other warpgroup to have issued its tile's last k-tile.
                    # Without this turn, warpgroup 1 waits on stage barriers a whole tile
                    # (k_tile_cnt stages) ahead of the producer, and an mbarrier parity wait
                    # can only tell the current phase from the previous one: it passes on a
                    # stale phase, consumes the other tile's data and over-arrives on the
                    # empty barrier (the 2026-11-29 hang).
                    if tile_idx >= first_tile + grid_size:
                        my_turn.arrive_and_wait()
                cute.nvgpu.warpgroup.fence()
                ab_pipeline.consumer_wait(read_state)
                first_kb = 0
                if const_expr(self.first_mma_overwrites):  # k-block 0 overwrites acc
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, 0, read_state.index)],
                              tCrB[(None, None, 0, read_state.index)], acc)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    first_kb = 1
                self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index, num_k_blocks,
                                 first_kb)
                read_state.advance()
                for k_tile in range(1, k_tile_cnt):
                    ab_pipeline.consumer_wait(read_state)
                    self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index, num_k_blocks)
                    cute.nvgpu.warpgroup.wait_group(1)
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()
                    read_state.advance()
                if const_expr(self.pingpong):
                    # every stage of this tile has been waited for: the next tile (the other
                    # warpgroup's) may start waiting on its stages while ours drain
                    if tile_idx + grid_size < num_tiles:
                        their_turn.arrive()
                cute.nvgpu.warpgroup.wait_group(0)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                if const_expr(self.pingpong):
                    # the other warpgroup's tile owns the next k_tile_cnt stages
                    read_state.advance(k_tile_cnt)
                    release_state.advance(k_tile_cnt)

                # ---- epilogue: subtiles through smem, TMA-stored by one warp
                store_tile_epilogue(epi, tma_atom_c, gC_mnl[(None, None, m_tile, n_tile, 0)],
                                    self.epi_tile, self.epi_stages, tile_n,
                                    self.epilogue == "swiglu", epi_base, subtiles_done,
                                    epilogue_barrier, tma_store_pipeline, stores,
                                    self.one_epilogue_barrier)
                subtiles_done += epi_m * out_n
                if const_expr(self.ksum_top_k > 0 and not self.ksum_deferred):
                    self._sum_tile_tokens(mYVecs, mOutVecs, mRowToken, mSlotRows, mWeights,
                                          mCounters, m_tile, n_tile, num_n_tiles, tile_tidx,
                                          is_store_warp, epilogue_barrier, 0)
                if const_expr(self.ksum_deferred):
                    if held_m >= 0:  # the previous tile's stores: all but this tile's landed
                        self._sum_tile_tokens(mYVecs, mOutVecs, mRowToken, mSlotRows, mWeights,
                                              mCounters, held_m, held_n, num_n_tiles, tile_tidx,
                                              is_store_warp, epilogue_barrier, epi_m * out_n)
                # (assigned outside any `if`: a loop-carried value must be, to leave the body)
                held_m = m_tile
                held_n = n_tile
                if const_expr(self.timeline):
                    if tile_tidx == 0:
                        common.timeline_write(mTimeline, record_slot, 1, self.task_type,
                                              tile_idx, 0, t_start, common.timeline_now(),
                                              record_capacity)
                    record_slot += 1
                tile_idx += tile_stride
            if const_expr(self.ksum_deferred):
                if held_m >= 0:
                    self._sum_tile_tokens(mYVecs, mOutVecs, mRowToken, mSlotRows, mWeights,
                                          mCounters, held_m, held_n, num_n_tiles, tile_tidx,
                                          is_store_warp, epilogue_barrier, 0)
            tma_store_pipeline.producer_tail()

    @cute.jit
    def _sum_tile_tokens(self, mYVecs, mOutVecs, mRowToken, mSlotRows, mWeights, mCounters,
                         m_tile: Int32, n_tile: Int32, num_n_tiles: Int32, tile_tidx: Int32,
                         is_store_warp, epilogue_barrier, stores_after: cutlass.Constexpr[int]):
        """ksum_top_k: once the store warp has seen tile (m_tile, n_tile)'s y rows land (all
        but its last ``stores_after`` store groups, which are a later tile's) and released
        them, the warpgroup counts the tile's rows and sums the tokens it completes
        (``token_ops.sum_finished_tokens``)."""
        if const_expr(self.ksum_stages >= 1):
            if is_store_warp:
                common.tma_stores_landed(stores_after)
                cute.arch.fence_acq_rel_gpu()
            epilogue_barrier.arrive_and_wait()
            if const_expr(self.ksum_stages >= 2):  # (stage 1: the landing wait alone)
                token_ops.sum_finished_tokens(mYVecs, mOutVecs, mRowToken, mSlotRows, mWeights,
                                              mCounters, m_tile * TILE_M + tile_tidx, n_tile,
                                              num_n_tiles, self.ksum_top_k,
                                              self.ksum_stages >= 3)

    def _copy_b(self, loads, n_tile, k_tile, expert, stage, barrier, mcast_mask=None):
        """B's TMA loads of k-tile ``k_tile`` into ``stage``: ``loads`` = (atom, gmem and smem
        partitions) for B, then for B_up (swiglu; else None). With ``mcast_mask`` each load is
        this CTA's share of a multicast. Traced inline."""
        atom_b, g_b, s_b, atom_up, g_up, s_up = loads
        mcast = {} if mcast_mask is None else {"mcast_mask": mcast_mask}
        cute.copy(atom_b, g_b[(None, n_tile, k_tile, expert)], s_b[(None, stage)],
                  tma_bar_ptr=barrier, **mcast)
        if const_expr(self.epilogue == "swiglu"):
            cute.copy(atom_up, g_up[(None, n_tile, k_tile, expert)], s_up[(None, stage)],
                      tma_bar_ptr=barrier, **mcast)

    @cute.jit
    def _cluster_tile(self, pair_idx: Int32, num_m_tiles: Int32, num_n_tiles: Int32, rank: Int32):
        """cluster_m = 2: (M-tile, N-tile, real) of CTA ``rank`` in pair ``pair_idx``. Pairs
        are M-tiles 2i and 2i + 1 of one N-tile, rasterised like single tiles; with an odd
        M-tile count the last pair's second CTA repeats the first's tile (real = False)."""
        pair_m, n_tile = common.grouped_raster(pair_idx, (num_m_tiles + 1) // 2, num_n_tiles,
                                               max(1, self.group_m // 2))
        m = 2 * pair_m + rank
        return cutlass.min(m, num_m_tiles - 1), n_tile, m < num_m_tiles

    @cute.jit
    def _cluster_producer(self, ab_pipeline, state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB,
                          tBsB, tma_atom_b_up, tBgB_up, tBsB_up, tma_atom_bm, tBgBm, tBsBm,
                          tma_atom_bm_up, tBgBm_up, tBsBm_up, mcast_mask, mTileExpert,
                          num_m_tiles, num_n_tiles, num_pairs, k_tile_cnt, rank):
        """cluster_m = 2, warp 0: this CTA's A tile by TMA; B multicast by halves when both
        tiles of the pair are one expert's (each CTA loads half the rows of every B box into
        both CTAs' stage), else all of B by this CTA. Either way a stage receives A + B bytes,
        and both CTAs decide alike (from the same two tile_expert entries)."""
        pair_idx = cute.arch.block_idx()[0] // self.cluster_m
        while pair_idx < num_pairs:
            m_tile, n_tile, _ = self._cluster_tile(pair_idx, num_m_tiles, num_n_tiles, rank)
            m_peer, _, _ = self._cluster_tile(pair_idx, num_m_tiles, num_n_tiles, 1 - rank)
            expert = mTileExpert[m_tile]
            multicast = mTileExpert[m_peer] == expert
            tAgA_k = tAgA[(None, m_tile, None, 0)]
            for k_tile in range(k_tile_cnt):
                ab_pipeline.producer_acquire(state)
                barrier = ab_pipeline.producer_get_barrier(state)
                cute.copy(tma_atom_a, tAgA_k[(None, k_tile)], tAsA[(None, state.index)],
                          tma_bar_ptr=barrier)
                if multicast:
                    self._copy_b((tma_atom_bm, tBgBm, tBsBm, tma_atom_bm_up, tBgBm_up, tBsBm_up),
                                 n_tile, k_tile, expert, state.index, barrier, mcast_mask)
                else:
                    self._copy_b((tma_atom_b, tBgB, tBsB, tma_atom_b_up, tBgB_up, tBsB_up),
                                 n_tile, k_tile, expert, state.index, barrier)
                ab_pipeline.producer_commit(state)
                state.advance()
            pair_idx += cute.arch.grid_dim()[0] // self.cluster_m
        ab_pipeline.producer_tail(state)

    @cute.jit
    def _mma_k_tile(self, tiled_mma, acc, tCrA, tCrB, stage, num_k_blocks: cutlass.Constexpr,
                    first_kb: cutlass.Constexpr = 0):
        """Issue the wgmmas of one K-tile (k-blocks ``first_kb`` .. num_k_blocks-1, k16 each)
        from smem stage ``stage``."""
        for kb in cutlass.range_constexpr(first_kb, num_k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], acc)
        cute.nvgpu.warpgroup.commit_group()


# ----------------------------------------------------------------- A rows gathered by cp.async
# (the megakernel's local_direct producer: FC1 reads a rank's own rows from x). A producer warpgroup (128 threads) lands a 128 x 64 bf16 A k-tile as 16 rows x 8 chunks of
# 16 B per instruction: thread t owns chunk t % 8 of rows t // 8 + 16 i. A warp's cp.async then
# covers four whole 128-B row segments (4 L1 wavefronts); one row per thread would take 32.
GATHER_ROW_STRIDE = 128 // 8  # rows between one thread's consecutive rows
GATHER_ROWS_PER_THREAD = TILE_M // GATHER_ROW_STRIDE


def gathered_rows_of(tidx):
    """The A-tile rows whose chunk ``tidx & 7`` producer thread ``tidx`` (0..127) loads."""
    return [(tidx >> 3) + GATHER_ROW_STRIDE * i for i in range(GATHER_ROWS_PER_THREAD)]


# cp.async lands A through the generic proxy and wgmma reads smem through the async proxy.
# With this set, every consumer thread fences the proxies after each gathered stage's full
# wait. CUTLASS's and quack's cp.async + GMMA mainloops rely on the mbarrier completion alone;
# tools/megakernel_probe.py times both (read at trace time: clear jit's cache after a change).
FENCE_GATHERED_A = True


@cute.jit
def a_visible_to_wgmma(gathered: cutlass.Constexpr[bool]):
    """After a stage's full wait, before wgmma reads it: the proxy fence for gathered A
    stages (see FENCE_GATHERED_A); nothing is emitted for TMA-loaded ones."""
    if const_expr(gathered and FENCE_GATHERED_A):
        cute.arch.fence_proxy("async.shared", space="cta")


def cp_async_a_rows(stage, srcs, rows, k_tile, tidx):
    """This thread's cp.async.cg copies of A k-tile ``k_tile`` into ``stage`` (the stage's bf16
    smem pointer, 128B-swizzled K-major: chunk j of row r lands at r * 64 + (j ^ (r % 8)) * 8
    elements). ``srcs[i]`` is the global byte address of row ``rows[i]``."""
    chunk = tidx & 7
    for src, r in zip(srcs, rows):
        gsrc = cute.make_ptr(cutlass.BFloat16, src + (k_tile * TILE_K + chunk * 8) * 2,
                             cute.AddressSpace.gmem, assumed_align=16)
        nvvm.cp_async_shared_global(stage + r * TILE_K + ((chunk ^ (r & 7)) * 8), gsrc, 16, "cg")


class TileEpilogue:
    """A consumer thread's epilogue partitions, built once per CTA: the register -> smem
    (stmatrix) copy, its smem destination, the accumulator as that copy sees it, the
    per-subtile fragment shape, and the staged epilogue smem."""

    def __init__(self, tiled_copy, tRS_sC, acc, frag_shape, sC):
        self.tiled_copy, self.tRS_sC, self.acc, self.frag_shape, self.sC = (
            tiled_copy, tRS_sC, acc, frag_shape, sC)


@cute.jit
def store_tile_epilogue(epi: TileEpilogue, tma_atom: cute.CopyAtom, g_tile: cute.Tensor,
                        epi_tile: cutlass.Constexpr, epi_stages: cutlass.Constexpr[int],
                        acc_tile_n: cutlass.Constexpr[int], swiglu: cutlass.Constexpr[bool],
                        buf_base, subtiles_done, barrier, store_pipeline, is_store_warp,
                        one_barrier: cutlass.Constexpr[bool] = False):
    """One output tile: accumulator -> bf16 (SwiGLU: silu(gate) * up, the gate and up halves
    of the accumulator side by side) -> smem subtiles (stmatrix) -> TMA stores by the store
    warp, through ``epi_stages`` rotating buffers from ``buf_base``. ``g_tile`` is the tile's
    (TILE_M rows, output columns) view of the TMA store tensor. Shared by the grouped GEMM and
    the megakernel's GEMM tasks.

    A buffer is written again only once the store warp has seen its last TMA store read it.
    Two barriers per subtile: the second one passes on the store warp's acquire (the store
    three subtiles back has read its buffer) before anyone writes the next one. With
    ``one_barrier`` the acquire runs one subtile ahead instead (``store_pipeline`` built with
    ``store_pipeline_stages``: the store two back has read its buffer), so the next subtile's
    barrier passes it on before anyone writes the buffer after that; the second barrier goes."""
    out_tile_n = acc_tile_n // 2 if const_expr(swiglu) else acc_tile_n
    gC = cute.zipped_divide(g_tile, epi_tile)
    bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1), cute.group_modes(epi.sC, 0, 2), gC)
    r_out = cute.make_rmem_tensor(epi.frag_shape, Float32)
    r_out_c = cute.make_rmem_tensor(epi.frag_shape, cutlass.BFloat16)
    frag_size = cute.size(r_out)
    epi_m = TILE_M // epi_tile[0]
    acc_n = acc_tile_n // epi_tile[1]  # accumulator subtiles run row-major over (epi_m, acc_n)
    out_n = out_tile_n // epi_tile[1]
    for sm in cutlass.range_constexpr(epi_m):
        for sn in cutlass.range_constexpr(out_n):
            first = (sm * acc_n + sn) * frag_size
            if const_expr(swiglu):
                for v in cutlass.range_constexpr(frag_size):
                    r_out[v] = common.silu(epi.acc[first + v]) * epi.acc[first + out_n * frag_size + v]
            else:
                for v in cutlass.range_constexpr(frag_size):
                    r_out[v] = epi.acc[first + v]
            r_out_c.store(r_out.load().to(cutlass.BFloat16))
            buf = buf_base + (subtiles_done + sm * out_n + sn) % epi_stages
            cute.copy(epi.tiled_copy, r_out_c, epi.tRS_sC[(None, None, None, buf)])
            # stmatrix writes are generic-proxy; TMA reads through the async proxy
            cute.arch.fence_proxy("async.shared", space="cta")
            barrier.arrive_and_wait()
            if is_store_warp:
                cute.copy(tma_atom, bSG_sC[(None, buf)], bSG_gC[(None, (sm, sn))])
                store_pipeline.producer_commit()
                store_pipeline.producer_acquire()
            if const_expr(not one_barrier):
                barrier.arrive_and_wait()


def store_pipeline_stages(epi_stages: int, one_barrier: bool) -> int:
    """Stages of the TMA store pipeline behind ``store_tile_epilogue``'s ``epi_stages``
    buffers: its acquire waits until at most stages - 1 stores are unread, so with
    ``one_barrier`` one fewer than the buffers (the acquire one subtile ahead)."""
    return epi_stages - 1 if one_barrier else epi_stages


# ---------------------------------------------------------------------- host helpers
# Relative cost per output column of narrower tiles (less wgmma work per smem byte),
# from the tile_n sweep in tools/gemm_probe.py on the H200.
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


def _fake_operands(tile_n: int, out_tile_n: int, swiglu: bool, timeline: bool, ksum: bool):
    """Fake (M, K, 1) A, (N, K, E) B (two of them for swiglu: gate and up, N = I),
    (M, N_out, 1) C and int32 vectors with run-time extents and strides (what a strided
    torch view passes through TVM-FFI); with ``ksum`` the fused k-sum's vectors and its
    (T, N) out."""
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
    ksum_args = (None,) * 5
    if ksum:
        ksum_args = (common.fake_vector(Int32), common.fake_vector(Int32),
                     common.fake_vector(Float32), common.fake_vector(Int32),
                     common.fake_strided_tensor(bf16, (cute.sym_int32(), n_out)))
    return a, b, b_up, c, tile_expert, num_m_tiles, timeline, *ksum_args


def compile_grouped_gemm(epilogue: str = "store", tile_n: int = 256, group_m: int = 8,
                         num_sms: int = 132, timeline: bool = False, task_type: int | None = None,
                         pingpong: bool = False, cluster_m: int = 1, arch: str = "sm_90a",
                         options: str = "", one_epilogue_barrier: bool = False,
                         epi_n: int = 32, ksum_top_k: int = 0, ksum_stages: int = 3,
                         ksum_deferred: bool = False):
    """Compile one static configuration on fake tensors (no GPU needed).

    M, N, K and the expert count are run-time extents: one compile serves every shape
    with K % 64 == 0 and N % tile_n == 0. The result takes torch tensors directly
    (TVM-FFI): ``A (M,K,1)``, ``B (N,K,E)``, ``B_up`` (swiglu) or None, ``C (M,N_out,1)``
    strided views, the int32
    tile -> expert table, the one-element M-tile count, the int64 timeline buffer (None
    when ``timeline`` is off), then the fused k-sum's row tokens, slot rows, fp32 weights,
    zeroed counters and (T, N) out (five Nones when ``ksum_top_k`` is 0); it runs on torch's
    current stream.
    """
    gemm = GroupedGemmSm90(tile_n=tile_n, epilogue=epilogue, group_m=group_m, num_sms=num_sms,
                           timeline=timeline, task_type=task_type, pingpong=pingpong,
                           cluster_m=cluster_m, one_epilogue_barrier=one_epilogue_barrier,
                           epi_n=epi_n, ksum_top_k=ksum_top_k, ksum_stages=ksum_stages,
                           ksum_deferred=ksum_deferred)
    args = _fake_operands(tile_n, gemm.out_tile_n, epilogue == "swiglu", timeline, ksum_top_k > 0)
    return cute.compile(gemm, *args, common.fake_stream(),
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))
