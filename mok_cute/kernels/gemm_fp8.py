"""FP8 grouped GEMM with split (promoted) accumulation on Hopper (sm_90a), issue 33 item 2.

    out[rows of M-tile m, :] = bf16( sum_g 2^(e_a[row, g] + e_b[expert(m), n / 128, g])
                                      * (A_q[row, 128 g : 128 g + 128] . W_q[expert(m), n, same]) )

the FC2-shaped grouped GEMM with the plain store epilogue, on FP8 operands:

- A ``[M, K]`` float8_e4m3fn with 1 x 128 row scales along K: int8 exponents ``e_a [M, K/128]``
  (``mok_cute.fp8.quantize_rows``); M is the expert-sorted, tile-padded row count (each
  expert's segment padded to 128 rows, so each M-tile belongs to one expert: the tile ->
  expert table of ``GroupedGemmSm90``).
- W ``[E, N, K]`` float8_e4m3fn with 128 x 128 block scales: ``e_b [E, N/128, K/128]``
  (``mok_cute.fp8.quantize_blocks``).
- out ``[M, N]`` bf16; rows of M-tiles past ``num_m_tiles`` are not written.

Split accumulation. Hopper's FP8 wgmma accumulates with reduced precision (rel-L1 1.7e-3 at
K = 8192 against 1.2e-4 promoted: ``../shared/notes/anchors.md``), so each 128-deep K group
(one TMA k-tile: 128 e4m3 bytes per row, the 128-byte swizzle atom) runs its four k32 wgmmas
into a *partial* fp32 accumulator (the group's first wgmma with accumulate off: it
overwrites the partial, no zeroing), waits for them (``wait_group(0)``), releases the
stage, and promotes: ``acc += s * partial`` with one FFMA (``fma.rn.f32``) per accumulator
element, where ``s = 2^(e_a[row] + e_b[block])`` is exact: one integer add and the fp32
built from its exponent bits (``pow2_f32``: normal, subnormal down to 2^-149, 0 below, inf
above 2^127). The tensor cores idle while a warpgroup promotes, unless other wgmmas are in
flight: a 128-wide tile keeps two partials beside its accumulator (64 + 64 + 64 fp32 a
thread), so each warpgroup issues the next group's wgmmas before it promotes
(``TwoPartialMainloop``); a 256-wide tile (128 fp32 of accumulator a thread) promotes
one N-half at a time from a half-wide partial (``PromotingMainloop``), and in FC1 the two
warpgroups issue their wgmma batches in turns (``PromotingMainloop.wait_mma_turn``), one
warpgroup's promotion under the other's wgmmas. (A 128 x 192 tile with two full accumulators,
96 + 96 fp32, ran 850-890 TFLOP/s on dsv3's FC2 against about 1000 for 128 and 256: removed.)

Scales. Each consumer thread owns two rows of the tile (the wgmma accumulator layout: warp w
rows 16 w .. 16 w + 15, lane l rows l / 4 and l / 4 + 8) and reads their exponents from
global memory with plain byte loads, one group ahead (issued before the wait for the
current group's wgmmas, so their latency hides under the tensor work): 2 loads of e_a and
1-2 warp-uniform loads of e_b per thread and group, all L1/L2 hits after the first touch
(e_a is M * K / 128 bytes). A 128-wide tile uses one W block (swiglu: W_gate's and W_up's),
a 256-wide one two, one an N-half.

FC1 (``epilogue="swiglu"``, ``grouped_gemm_fp8_swiglu``): W_gate and W_up ``[E, I, H]`` e4m3
with their own 128 x 128 exponents. As in the bf16 kernel each B stage is two TMA boxes, 64
W_gate rows and the matching 64 W_up rows, so one 128-wide wgmma tile is [g | u] of a
128 x 64 tile of h; the promotion takes W_gate's block exponent for the first 64 columns and
W_up's for the others (I % 128 == 0: one block each). The accumulator and the partial stay
64 + 64 fp32 a thread (168 registers, 0 spills offline); h tiles 128 wide ([g | u] 256 wide,
128 + 128 fp32) spilled 428 bytes. The epilogue is the core's "swiglu" (``GemmCoreSm90.
epi_visit_subtile``): h = bf16(silu(bf16(g)) * bf16(u)), silu in fp32, the bf16 kernel's
code and rounding points; h is stored in bf16 (its e4m3 quantization is a later step).

FC1 in a training forward (``save_preact``): also g and u of each routed row at its slot, from
registers, as the bf16 kernel (``row_epilogue``), for the backward. The saved rows may be
narrower than the padded I (g | u at the layer's own I: the padding columns are zeros, neither
stored nor read).

FC1's dgrad (``b_split_k``, ``grouped_gemm_fp8_split_k``): ``dx rows = [dG | dU] .
[W_gate^T; W_up^T]``, K = 2I from two weight tensors, the exact transposed e4m3 copies
``fp8.quantize_blocks(w, transposed=True)`` [E, H, I] (e4m3 wgmma reads K-major operands only):
the producer takes a k-tile from the first below K1 and from the second above
(``GroupedGemmSm90.producer_loop``), and each K group's block exponent comes from the matching
exponent tensor. The store epilogue, 128-wide tiles.

FC2's dgrad (``epilogue="dgated"``, ``grouped_gemm_fp8_dgated``): d_out rows (e4m3, 1 x 128)
times W_down's exact transposed copy [E, I, H], the promoted accumulator then through the bf16
kernel's dgated epilogue unchanged (``row_epilogue.RowEpilogueMixin``: g, u by slot two
subtiles ahead; dG, dU, w*h by TMA; the row partials of d_topk_weights); 128-wide
tiles.

Roles and order as ``gemm_sm90.GroupedGemmSm90`` (cooperative only: the two consumer
warpgroups split each tile's rows): warp 0 of the producer warpgroup streams A and B k-tiles
by TMA into an mbarrier ring; the consumers run the promoting mainloop above and the core's
tile epilogue (``GemmCoreSm90.tile_epilogue``, "store"). Fixed K order, no split-K: repeat
runs agree bitwise.

Constraints: K % 128 == 0 (K >= 128), N % 128 == 0 (the block scales), tile_n in {128, 256}
(a partial last N-tile is zero-filled on load and clipped on store by TMA), 16-byte aligned
rows. The kernel takes the e4m3 data as int8 views (``q.view(torch.int8)``) and reinterprets
them as e4m3 for TMA and wgmma.

Run on a GPU host::

    python3 -c "import torch; from mok_cute import fp8; import mok_cute.kernels.gemm_fp8 as g; \\
        a, ea = fp8.quantize_rows(torch.randn(256, 2048, device='cuda')); \\
        w, ew = fp8.quantize_blocks(torch.randn(2, 1024, 2048, device='cuda') / 45); \\
        te = torch.tensor([0, 1], dtype=torch.int32, device='cuda'); nt = te[:1] * 0 + 2; \\
        y = g.grouped_gemm_fp8(a, ea, w, ew, te, nt); r = g.grouped_gemm_fp8_ref(a, ea, w, ew, te, nt); \\
        print(((y.double() - r.double()).abs().sum() / r.double().abs().sum()).item())"
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int8, Int32, const_expr

from mok_cute import fp8, jit
from mok_cute.config import describe
from mok_cute.constants import TILE_M
from mok_cute.kernels import common
from mok_cute.kernels.fp8_mainloop import PromotingMainloop, TwoPartialMainloop, ffma, pow2_f32
from mok_cute.kernels.gemm_sm90 import GroupedGemmSm90

GROUP = fp8.GROUP  # 128: the K depth of a scale group, one k-tile
TILE_NS = (128, 256)
EPILOGUES = ("store", "swiglu", "dgated")
# swiglu: the wgmma tile is [gate | up], tile_n / 2 columns of h. 128 (h 64 wide) keeps the
# accumulator and the partial at 64 + 64 fp32 a thread; 256 (h 128 wide, one whole scale group
# of h a tile) promotes one N-half at a time: 128 + 64
SWIGLU_TILE_NS = (128, 256)
HALF_PROMOTE_TILE_N = 256  # wider tiles run the wgmmas and the promotion one N-half at a time


# ---------------------------------------------------------------------- device helpers
def scale_slot(v: int, tile_n: int, swiglu: bool = False) -> int:
    """Which of a row's two scales accumulator element ``v`` of a 128-wide tile takes (trace
    time): 0 the tile's W block; ``swiglu``: 0 (W_gate's block) in the tile's first half, 1
    (W_up's) in its second. Element v covers columns 8 (v // 4) .. 8 (v // 4) + 7 of the tile
    (wgmma layout)."""
    return 1 if swiglu and v // 4 >= tile_n // 16 else 0


# ---------------------------------------------------------------------- a tile's exponents
class GroupExponents(NamedTuple):
    """What ``GroupedGemmFp8Sm90.group_exponents`` reads a K group's exponents from: A's and
    W's exponent tensors (``mEB_up``: W_up's (swiglu) or the second K part's (b_split_k)),
    this thread's two rows, the tile's expert and N-tile, and where b_split_k's second part
    starts."""

    mEA: cute.Tensor
    mEB: cute.Tensor
    mEB_up: object
    row0: Int32
    row1: Int32
    expert: Int32
    n_tile: Int32
    k_split: Int32


# ---------------------------------------------------------------------- the kernel
class GroupedGemmFp8Sm90(PromotingMainloop, TwoPartialMainloop, GroupedGemmSm90):
    """``GroupedGemmSm90`` on e4m3 operands with 1 x 128 / 128 x 128 power-of-two scales and a
    promoting mainloop (module docstring). Cooperative consumers.

    :param tile_n: CTA tile width in N (the wgmma width). store: 128 (two partials,
        pipelined) or 256 (one N-half promoted at a time; the layer's FC2).
        swiglu: 128 = 64 gate + 64 up columns, h tiles 128 x 64; 256 (the layer's FC1).
    :param epilogue: ``"store"`` (FC2: out = bf16(acc)) or ``"swiglu"`` (FC1: gate and up
        from two weight tensors into the two halves of each B stage, as ``GroupedGemmSm90``;
        h = bf16(silu(bf16(g)) * bf16(u)) by the core's swiglu epilogue, the same code and
        rounding points as the bf16 kernel) or ``"dgated"`` (FC2's dgrad: the bf16 kernel's
        dgated epilogue on the promoted accumulator; 128-wide tiles).
    :param group_m: M-tiles per rasterisation group (L2 reuse of W).
    :param num_sms: persistent grid size (132 on H100/H200).
    :param save_preact: swiglu: also store the bf16 g and u of each routed row by slot, as the
        bf16 kernel's training forward (``row_epilogue``: from registers, padding never).
    :param b_split_k: store only, tile_n 128: W's first K groups from ``mB``, the rest from
        ``mB_up``, each with its own block exponents (FC1's dgrad: ``[dG | dU] . [W_gate^T;
        W_up^T]``, K = 2I, on the weights' exact transposed e4m3 copies).
    """

    def __init__(self, tile_n: int = 128, epilogue: str = "store", group_m: int = 8,
                 num_sms: int = 132, b_split_k: bool = False, save_preact: bool = False,
                 quantize_h: bool = False):
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        widths = {"store": TILE_NS, "swiglu": SWIGLU_TILE_NS, "dgated": (128,)}[epilogue]
        if tile_n not in widths:
            raise ValueError(f"tile_n must be one of {widths} ({epilogue}), got {tile_n}")
        if b_split_k and (epilogue != "store" or tile_n != GROUP):
            raise ValueError(f"b_split_k needs the store epilogue and tile_n {GROUP}, got "
                             f"{epilogue!r}, {tile_n}")
        if quantize_h and (epilogue != "swiglu" or tile_n != HALF_PROMOTE_TILE_N or save_preact):
            raise ValueError(f"quantize_h needs the swiglu epilogue, tile_n "
                             f"{HALF_PROMOTE_TILE_N} (a whole 1 x 128 group of h a tile) and no "
                             f"save_preact, got {epilogue!r}, {tile_n}, save_preact={save_preact}")
        # the core checks widths for bf16 tiles; the FP8 tile is set below
        super().__init__(tile_n=128, epilogue=epilogue, group_m=group_m, num_sms=num_sms,
                         b_split_k=b_split_k, save_preact=save_preact)
        self.tile_shape_mnk = (TILE_M, tile_n, GROUP)
        self.swiglu = epilogue == "swiglu"
        # 256 wide: the partial covers one N-half (64 fp32 a thread beside the 128 of the
        # accumulator); each 128-K group runs half 0's wgmmas, promotes them, then half 1's
        self.half_promote = tile_n == HALF_PROMOTE_TILE_N
        self.half_mma = None
        # FC1 writes h as e4m3 with its 1 x 128 exponents (``store_h_fp8``), not bf16
        self.quantize_h = quantize_h
        # 256-wide FC1: the consumer warpgroups issue their wgmma batches in turns
        # (``PromotingMainloop.wait_mma_turn``; FC2 and the 128-wide tiles tied or lost)
        self.mma_turns = self.swiglu and self.half_promote
        # swiglu: h tiles are half as wide; each B stage is loaded as a gate and an up box
        self.out_tile_n = tile_n // 2 if self.swiglu else tile_n
        self.b_rows_per_load = self.out_tile_n

    def _setup_attributes(self):
        super()._setup_attributes()
        if self.half_promote:
            self.half_mma = self.make_half_mma()

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mB_up: Optional[cute.Tensor],
                 mC: cute.Tensor, mEA: cute.Tensor, mEB: cute.Tensor,
                 mEB_up: Optional[cute.Tensor], mTileExpert: cute.Tensor,
                 mNumMTiles: cute.Tensor, mC2: Optional[cute.Tensor],
                 mC3: Optional[cute.Tensor], mPreact: Optional[cute.Tensor],
                 mRowSlot: Optional[cute.Tensor], mWeights: Optional[cute.Tensor],
                 mPartials: Optional[cute.Tensor], stream: cuda.CUstream,
                 mHq: Optional[cute.Tensor] = None, mEh: Optional[cute.Tensor] = None):
        """mA (M, K, 1) and mB (N, K, E) int8 views of the e4m3 data, mC (M, N_out, 1) bf16,
        mEA (M, K/128) and mEB (E, N/128, K/128) int8 exponents, mTileExpert int32,
        mNumMTiles int32 [1]. swiglu: mB is W_gate and mB_up W_up (I, K, E), mEB and mEB_up
        their exponents (E, I/128, K/128), mC (M, I, 1) is h; b_split_k: mB (N, K1, E) and
        mB_up (N, K2, E) with K1 + K2 = K, mEB and mEB_up their exponents; else mB_up,
        mEB_up None. dgated: mC2, mC3 (dU, h') like mC (dG) and the epilogue's tensors as
        ``GroupedGemmSm90.__call__`` takes them; else None."""
        mA = cute.recast_tensor(mA, cutlass.Float8E4M3FN)
        mB = cute.recast_tensor(mB, cutlass.Float8E4M3FN)
        tma_atom_b_up, tma_tensor_b_up = None, None
        self.a_dtype = mA.element_type
        self.b_dtype = mB.element_type
        self.c_dtype = cutlass.BFloat16  # quantize_h: no bf16 output (mC None)
        self._setup_attributes()

        tile_m, tile_n, tile_k = self.tile_shape_mnk
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_a, tma_tensor_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mA, cute.slice_(self.a_smem_layout_staged, (None, None, 0)), (tile_m, tile_k))
        if const_expr(self.swiglu):
            # one box per half of a B stage: W_gate rows, then the matching W_up rows
            mB_up = cute.recast_tensor(mB_up, cutlass.Float8E4M3FN)
            b_box = (self.b_rows_per_load, tile_k)
            b_box_layout = cute.slice_(self.staged_layout(self.b_dtype, b_box, 1), (None, None, 0))
            tma_atom_b, tma_tensor_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mB, b_box_layout, b_box)
            tma_atom_b_up, tma_tensor_b_up = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mB_up, b_box_layout, b_box)
        else:
            b_layout = cute.slice_(self.b_smem_layout_staged, (None, None, 0))
            tma_atom_b, tma_tensor_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mB, b_layout, (tile_n, tile_k))
            if const_expr(self.b_split_k):
                mB_up = cute.recast_tensor(mB_up, cutlass.Float8E4M3FN)
                tma_atom_b_up, tma_tensor_b_up = cute.nvgpu.cpasync.make_tiled_tma_atom(
                    g2s, mB_up, b_layout, (tile_n, tile_k))
        s2g = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        epi_layout = cute.slice_(self.epi_smem_layout_staged, (None, None, 0))
        tma_atom_c, tma_tensor_c = None, None
        if const_expr(not self.quantize_h):
            tma_atom_c, tma_tensor_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
                s2g, mC, epi_layout, self.epi_tile)
        extra_c = (None,) * 4
        if const_expr(self.epi_outputs == 3):
            extra_c = (*cute.nvgpu.cpasync.make_tiled_tma_atom(s2g, mC2, epi_layout, self.epi_tile),
                       *cute.nvgpu.cpasync.make_tiled_tma_atom(s2g, mC3, epi_layout, self.epi_tile))
        self.shared_storage = self.make_shared_storage()
        self.kernel(
            tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tma_atom_b_up, tma_tensor_b_up,
            tma_atom_c, tma_tensor_c, mEA, mEB, mEB_up, mTileExpert, mNumMTiles, self.tiled_mma,
            self.a_smem_layout_staged, self.b_smem_layout_staged, self.epi_smem_layout_staged,
            *extra_c, mPreact, mRowSlot, mWeights, mPartials, self.half_mma, mHq, mEh,
        ).launch(grid=[self.num_sms, 1, 1], block=[self.threads_per_cta, 1, 1],
                 min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor,
               tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor,
               tma_atom_b_up: Optional[cute.CopyAtom], mBup_nkl: Optional[cute.Tensor],
               tma_atom_c: cute.CopyAtom, mC_mnl: cute.Tensor,
               mEA: cute.Tensor, mEB: cute.Tensor, mEB_up: Optional[cute.Tensor],
               mTileExpert: cute.Tensor, mNumMTiles: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout,
               tma_atom_c2: Optional[cute.CopyAtom], mC2_mnl: Optional[cute.Tensor],
               tma_atom_c3: Optional[cute.CopyAtom], mC3_mnl: Optional[cute.Tensor],
               mPreact: Optional[cute.Tensor], mRowSlot: Optional[cute.Tensor],
               mWeights: Optional[cute.Tensor], mPartials: Optional[cute.Tensor],
               half_mma: Optional[cute.TiledMma], mHq: Optional[cute.Tensor],
               mEh: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)

        # the roles of the bf16 GEMM's kernel (GroupedGemmSm90.warp_roles), this consumer_loop
        self.warp_roles(tidx, warp_idx, warpgroup_idx,
                        (tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, tma_atom_b_up, mBup_nkl),
                        tma_atom_c, mTileExpert, mNumMTiles,
                        (a_smem_layout_staged, b_smem_layout_staged, epi_smem_layout_staged),
                        (tiled_mma, half_mma, mTileExpert, (mEA, mEB, mEB_up),
                         ((tma_atom_c, mC_mnl), (tma_atom_c2, mC2_mnl), (tma_atom_c3, mC3_mnl)),
                         (mPreact, mRowSlot, mWeights, mPartials), (mHq, mEh)))

    @cute.jit
    def consumer_loop(self, ab_pipeline, sA, sB, sC, tidx: Int32, warp_idx: Int32,
                      warpgroup_idx: Int32, k_tile_cnt: Int32, k_split: Int32,
                      num_m_tiles: Int32, num_n_tiles: Int32, num_tiles: Int32,
                      tiled_mma: cute.TiledMma, half_mma, mTileExpert: cute.Tensor, exponents,
                      c_outputs, row_tensors, h_fp8):
        """The consumer warpgroups' tiles: the promoting mainloop (half-promoting at 256 wide,
        two partials at 128), then the epilogue. ``exponents``: the block-scale exponents of
        A, B (and B_up); ``c_outputs``: (atom, tensor) of each output; ``row_tensors``: the
        row-addressed epilogues' (saved g | u, row -> slot, weights, row partials);
        ``h_fp8``: quantize_h's e4m3 h and its exponents."""
        mEA, mEB, mEB_up = exponents
        mHq, mEh = h_fp8
        tile_m = self.tile_shape_mnk[0]
        consumer = warpgroup_idx - 1
        tile_tidx = tidx - self.threads_per_warpgroup
        tCrA, tCrB, acc, num_k_blocks, epi = self.consumer_parts(
            tiled_mma, sA, sB, sC, consumer * self.threads_per_warpgroup, tile_tidx)
        tCrB_up = None
        if const_expr(self.half_promote):
            tCrA, tCrB, tCrB_up, partial = self.half_fragments(
                half_mma, sA, sB, consumer * self.threads_per_warpgroup)
        else:
            partial = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
        my_rows = self._my_rows(tile_tidx)
        epi_m = tile_m // self.epi_tile[0]
        out_n = self.out_tile_n // self.epi_tile[1]
        tma_store_pipeline, epilogue_barrier, is_store_warp = self.epilogue_sync(
            warp_idx, warpgroup_idx)
        outputs = None
        if const_expr(not self.quantize_h):
            outputs = self.output_views(c_outputs)
        coords = None
        if const_expr(self.epilogue == "dgated" or self.save_preact):
            coords = self.epi_coords(epi, tile_tidx)

        tile_idx = cute.arch.block_idx()[0]
        loads = Int32(0)
        subtiles_done = Int32(0)
        turns = None  # (mine, theirs): the warpgroups' turns at issuing wgmmas
        if const_expr(self.mma_turns):
            turns = (pipeline.NamedBarrier(
                barrier_id=int(common.NamedBarriers.MMA_ORDER) + consumer,
                num_threads=self.num_mma_threads),
                pipeline.NamedBarrier(
                barrier_id=int(common.NamedBarriers.MMA_ORDER) + 1 - consumer,
                num_threads=self.num_mma_threads))
        while tile_idx < num_tiles:
            m_tile, n_tile = common.grouped_raster(tile_idx, num_m_tiles, num_n_tiles, self.group_m)
            expert = mTileExpert[m_tile]
            exps = GroupExponents(mEA, mEB, mEB_up, m_tile * tile_m + my_rows[0],
                                  m_tile * tile_m + my_rows[1], expert, n_tile, k_split)
            if const_expr(self.half_promote):
                self.half_promoting_mainloop(
                    ab_pipeline, half_mma, acc, partial, tCrA, tCrB, tCrB_up, loads,
                    k_tile_cnt, num_k_blocks, exps,
                    turns=None if const_expr(turns is None) else
                    (*turns, consumer + loads))
            else:
                self.two_partial_mainloop(ab_pipeline, tiled_mma, acc, partial, tCrA, tCrB,
                                          loads, k_tile_cnt, num_k_blocks, exps)
            loads += k_tile_cnt
            # swiglu: h = bf16(silu(bf16(g)) * bf16(u)) in the core's epilogue (the bf16
            # kernel's code); with quantize_h straight to e4m3 (a whole group a tile)
            if const_expr(self.quantize_h):
                self.store_h_fp8(acc, mHq, mEh, m_tile * tile_m + my_rows[0],
                                 m_tile * tile_m + my_rows[1], n_tile, tile_tidx)
            else:
                self.store_tile(epi, outputs, m_tile, n_tile, coords, row_tensors, 0,
                                subtiles_done, epilogue_barrier, tma_store_pipeline,
                                is_store_warp, tile_tidx)
            subtiles_done += epi_m * out_n
            tile_idx += cute.arch.grid_dim()[0]
        tma_store_pipeline.producer_tail()

    # ------------------------------------------------------------------ promoting mainloop
    def group_exponents(self, exps: GroupExponents, group: Int32):
        """This thread's two rows' e_a and the tile's first and second W block exponents for
        K group ``group`` (a row past A's rows reads row M - 1: such rows are never stored;
        a block past N is clamped: its columns are clipped on store). swiglu: the W_gate
        block and the W_up block of the tile's h columns (I % 128 == 0 and 64-wide h tiles:
        one block each). b_split_k: groups from ``k_split`` on are mB_up's (both read, from
        clamped indices, and one selected: no branch). Traced inline (a plain method: the
        values go back to the caller)."""
        mEA, mEB, mEB_up, row0, row1, expert, n_tile, k_split = exps
        last_row = cute.size(mEA, mode=[0]) - 1
        ea0 = Int32(mEA[cutlass.min(row0, last_row), group])
        ea1 = Int32(mEA[cutlass.min(row1, last_row), group])
        block0 = n_tile * self.out_tile_n // GROUP
        if const_expr(self.b_split_k):
            first = Int32(mEB[expert, block0, cutlass.min(group, k_split - 1)])
            second = Int32(mEB_up[expert, block0, cutlass.max(group - k_split, 0)])
            eb0 = cutlass.select_(group < k_split, first, second)
        else:
            eb0 = Int32(mEB[expert, block0, group])
        eb1 = eb0
        if const_expr(self.swiglu):
            eb1 = Int32(mEB_up[expert, block0, group])
        elif const_expr(self.tile_shape_mnk[1] > GROUP):
            last_block = cute.size(mEB, mode=[1]) - 1
            eb1 = Int32(mEB[expert, cutlass.min(block0 + 1, last_block), group])
        return ea0, ea1, eb0, eb1

    # TwoPartialMainloop's hooks: a group's exponents, read before its stage's wait
    scales_under_wgmma = False

    def group_scales(self, exps: GroupExponents, group: Int32):
        return self.group_exponents(exps, group)

    def promote_group(self, acc: cute.Tensor, partial: cute.Tensor, exponents):
        """A 128-wide tile's acc += 2^(e_a[row] + e_b[block]) * partial, one FFMA per element,
        ``exponents`` = (ea0, ea1, eb0, eb1) of ``group_exponents``. Element v of the wgmma
        accumulator ((2, 2, 16) values) sits at column 8 (v // 4) + 2 (lane % 4) + v % 2 and
        row (v // 2) % 2 * 8 + this thread's first row; swiglu's second half takes W_up's
        block (``scale_slot``). Traced inline."""
        ea0, ea1, eb0, eb1 = exponents
        tile_n = self.tile_shape_mnk[1]
        scales = []
        for ea in (ea0, ea1):
            first = pow2_f32(ea + eb0)
            scales.append((first, pow2_f32(ea + eb1) if const_expr(self.swiglu) else first))
        accv = cute.flatten(acc)
        partv = cute.flatten(partial)
        for v in range(cute.size(accv)):
            slot = scale_slot(v, tile_n, self.swiglu)
            accv[v] = ffma(partv[v], scales[(v // 2) % 2][slot], accv[v])

# ---------------------------------------------------------------------- compile (no GPU)
def compile_grouped_gemm_fp8(arch: str = "sm_90a", *, options: str = "", tile_n: int = 128,
                             epilogue: str = "store", group_m: int = 8, num_sms: int = 132,
                             b_split_k: bool = False, save_preact: bool = False,
                             quantize_h: bool = False):
    """Compile ``GroupedGemmFp8Sm90`` on fake tensors (no GPU needed): M, N (% 128), K (% 128)
    and the expert count at run time. The result takes torch tensors (TVM-FFI): ``A (M, K, 1)``
    and ``W (N, K, E)`` int8 views of the e4m3 data, ``W_up (N, K, E)`` (swiglu; else None),
    ``out (M, N_out, 1)`` bf16 (swiglu: N_out = N, h), ``e_a (M, K/128)``, ``e_b`` and
    ``e_up`` (swiglu; else None) ``(E, N/128, K/128)`` int8, the int32 tile -> expert table
    and the one-element M-tile count, then the dgated epilogue's six tensors (None unless
    ``epilogue="dgated"``: dU, h', the pre-activations by slot, row slots, router weights,
    partials); it runs on torch's current stream. ``b_split_k``: ``W (N, K1, E)`` and
    ``W_up (N, K2, E)``, ``e_b`` / ``e_up`` their exponents. ``quantize_h``: ``out`` is None
    and the last two arguments are h's e4m3 bytes ``(M, I)`` int8 and exponents ``(M, I/128)``
    int8."""
    gemm = GroupedGemmFp8Sm90(tile_n=tile_n, epilogue=epilogue, group_m=group_m, num_sms=num_sms,
                              b_split_k=b_split_k, save_preact=save_preact, quantize_h=quantize_h)
    m, num_experts = cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32(divisibility=GROUP)
    n = cute.sym_int32(divisibility=GROUP)
    a = common.fake_kmajor_tensor(Int8, (m, k, 1))
    b = common.fake_kmajor_tensor(Int8, (n, k, num_experts))
    # store: C may have fewer columns than W has rows (W zero-padded to whole 128-row blocks;
    # the N-tiles come from W and TMA clips the store)
    c_cols = cute.sym_int32(divisibility=8) if epilogue == "store" else n
    c = common.fake_kmajor_tensor(cutlass.BFloat16, (m, c_cols, 1))
    e_a = common.fake_strided_tensor(Int8, (m, cute.sym_int32()), align_bytes=1)

    def fake_e_b():
        return common.fake_strided_tensor(Int8, (num_experts, cute.sym_int32(), cute.sym_int32()),
                                          align_bytes=1)
    b_up, e_up = None, None
    if gemm.swiglu:
        b_up, e_up = common.fake_kmajor_tensor(Int8, (n, k, num_experts)), fake_e_b()
    elif b_split_k:  # B's K halves: any K1 + K2 = K, each a multiple of 128
        b = common.fake_kmajor_tensor(Int8, (n, cute.sym_int32(divisibility=GROUP), num_experts))
        b_up = common.fake_kmajor_tensor(Int8, (n, cute.sym_int32(divisibility=GROUP),
                                                num_experts))
        e_up = fake_e_b()
    dgated = (None,) * 6
    if epilogue == "dgated":  # dU, h' like dG; pre-activations by slot; slots; weights; partials
        bf16 = cutlass.BFloat16
        dgated = (common.fake_kmajor_tensor(bf16, (m, n, 1)), common.fake_kmajor_tensor(bf16, (m, n, 1)),
                  common.fake_kmajor_tensor(bf16, (cute.sym_int32(), cute.sym_int32(divisibility=16))),
                  common.fake_vector(Int32), common.fake_vector(cutlass.Float32),
                  common.fake_strided_tensor(cutlass.Float32, (m, cute.sym_int32()), align_bytes=4))
    if save_preact:  # g | u by slot, the row -> slot map
        dgated = (None, None, common.fake_kmajor_tensor(
            cutlass.BFloat16, (cute.sym_int32(), cute.sym_int32(divisibility=16))),
            common.fake_vector(Int32), None, None)
    h_out = ()
    if quantize_h:
        c = None
        h_out = (common.fake_strided_tensor(Int8, (m, n)),
                 common.fake_strided_tensor(Int8, (m, cute.sym_int32()), align_bytes=1))
    args = (a, b, b_up, c, e_a, fake_e_b(), e_up, common.fake_vector(Int32),
            common.fake_vector(Int32), *dgated)
    return cute.compile(gemm, *args, common.fake_stream(), *h_out,
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))


# ---------------------------------------------------------------------- torch entry + reference
def _check_fp8(name: str, t: object, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {describe(t)}")
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: expected dtype float8_e4m3fn, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor, got shape {tuple(t.shape)}")
    return t


def _check_exp(name: str, t: object, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int8:
        raise TypeError(f"{name}: expected an int8 tensor, got {describe(t)}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _check_args(a, e_a, w, e_w, tile_expert, num_m_tiles, names=("w", "e_w")):
    _check_fp8("a", a, 2)
    _check_fp8(names[0], w, 3)
    m, k = a.shape
    num_experts, n, k_w = w.shape
    if k_w != k:
        raise ValueError(f"{names[0]}: expected K = {k} (from a), got shape {tuple(w.shape)}")
    if k % GROUP or k == 0:
        raise ValueError(f"a: expected K (dim 1) a positive multiple of {GROUP}, got shape {tuple(a.shape)}")
    if n % GROUP or n == 0:
        raise ValueError(f"{names[0]}: expected N (dim 1) a positive multiple of {GROUP}, "
                         f"got shape {tuple(w.shape)}")
    _check_exp("e_a", e_a, (m, k // GROUP))
    _check_exp(names[1], e_w, (num_experts, n // GROUP, k // GROUP))
    _check_tiles(tile_expert, num_m_tiles)
    return m, n, k


def _check_tiles(tile_expert, num_m_tiles) -> None:
    for name, t in (("tile_expert", tile_expert), ("num_m_tiles", num_m_tiles)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"{name}: expected a 1-D int32 tensor, got {describe(t)}")


def _kernel_operands(operands, out: torch.Tensor | None, m: int, n: int) -> torch.Tensor:
    """The kernel's layout checks of its FP8 operands ((name, tensor) pairs: CUDA, unit stride
    along K, 16-byte aligned rows), and its bf16 output [m, n] (allocated when None). A given
    ``out`` may have fewer columns than n, by less than 128 (W zero-padded to whole blocks:
    TMA clips the padding columns of the last N-tile on store)."""
    for name, t in operands:
        if t.device.type != "cuda" or t.stride(-1) != 1 or t.data_ptr() % 16 \
                or any(s % 16 for s in t.stride()[:-1]):
            raise ValueError(f"{name}: expected a CUDA tensor with 16-byte aligned rows and unit "
                             f"stride along K, got {describe(t)}")
    if out is None:
        return torch.empty(m, n, dtype=torch.bfloat16, device=operands[0][1].device)
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16
            or out.dim() != 2 or out.shape[0] != m or not n - GROUP < out.shape[1] <= n
            or out.stride(-1) != 1 or out.data_ptr() % 16 or out.stride(0) % 8):
        raise ValueError(f"out: expected a bf16 tensor [{m}, {n}] (or up to {GROUP - 1} columns "
                         f"fewer) with 16-byte aligned rows, got {describe(out)}")
    return out


def _compiled(name: str, device: torch.device, tile_n: int, group_m: int, **static):
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return jit.compile_kernel(name, jit.device_arch(device), tile_n=tile_n, group_m=group_m,
                              num_sms=num_sms, **static)


def grouped_gemm_fp8(a: torch.Tensor, e_a: torch.Tensor, w: torch.Tensor, e_w: torch.Tensor,
                     tile_expert: torch.Tensor, num_m_tiles: torch.Tensor,
                     out: torch.Tensor | None = None, tile_n: int = 128,
                     group_m: int = 8) -> torch.Tensor:
    """``out [M, N] bf16 = A · W[expert(M-tile)]^T`` with promoted FP8 accumulation (module
    docstring). ``a [M, K]`` float8_e4m3fn with ``e_a [M, K/128]`` int8 (``fp8.quantize_rows``),
    ``w [E, N, K]`` float8_e4m3fn with ``e_w [E, N/128, K/128]`` int8 (``fp8.quantize_blocks``),
    ``tile_expert [>= M-tiles]`` int32 and ``num_m_tiles [1]`` int32 on the device (read there:
    no host sync). Rows of M-tiles past ``num_m_tiles`` are untouched. No host sync."""
    m, n, k = _check_args(a, e_a, w, e_w, tile_expert, num_m_tiles)
    out = _kernel_operands((("a", a), ("w", w)), out, m, n)
    compiled = _compiled("gemm_fp8_fc2", a.device, tile_n, group_m)
    compiled(a.view(torch.int8).unsqueeze(2), w.view(torch.int8).permute(1, 2, 0), None,
             out.unsqueeze(2), e_a.contiguous(), e_w.contiguous(), None, tile_expert, num_m_tiles,
             *(None,) * 6)
    return out


def grouped_gemm_fp8_ref(a: torch.Tensor, e_a: torch.Tensor, w: torch.Tensor, e_w: torch.Tensor,
                         tile_expert: torch.Tensor, num_m_tiles: int | torch.Tensor) -> torch.Tensor:
    """The oracle: the dequantized operands (``fp8.dequantize_rows`` / ``_blocks``, exact) in
    float64, each 128-row tile times its expert's weights, rounded once to bf16. Returns
    ``[num_m_tiles * 128, N]`` (the rows the kernel writes)."""
    m, n, k = _check_args(a, e_a, w, e_w, tile_expert,
                          num_m_tiles if isinstance(num_m_tiles, torch.Tensor)
                          else torch.tensor([num_m_tiles], dtype=torch.int32))
    tiles = int(num_m_tiles.reshape(-1)[0]) if isinstance(num_m_tiles, torch.Tensor) else int(num_m_tiles)
    if tiles * TILE_M > m:
        raise ValueError(f"num_m_tiles: {tiles} tiles need {tiles * TILE_M} rows, a has {m}")
    x = fp8.dequantize_rows(a, e_a, dtype=torch.float64)
    experts = tile_expert[:tiles].tolist()
    out = torch.empty(tiles * TILE_M, n, dtype=torch.float64, device=a.device)
    cache = {}
    for t, e in enumerate(experts):
        if e not in cache:
            cache[e] = fp8.dequantize_blocks(w[e], e_w[e], dtype=torch.float64)
        out[t * TILE_M:(t + 1) * TILE_M] = x[t * TILE_M:(t + 1) * TILE_M] @ cache[e].T
    return out.to(torch.bfloat16)


# ---------------------------------------------------------------------- FC1: gate, up, SwiGLU
def _check_fc1_args(a, e_a, w_gate, e_gate, w_up, e_up, tile_expert, num_m_tiles):
    m, n, k = _check_args(a, e_a, w_gate, e_gate, tile_expert, num_m_tiles, ("w_gate", "e_gate"))
    _check_args(a, e_a, w_up, e_up, tile_expert, num_m_tiles, ("w_up", "e_up"))
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up: expected the shape of w_gate {tuple(w_gate.shape)}, "
                         f"got {tuple(w_up.shape)}")
    return m, n, k


def grouped_gemm_fp8_swiglu(a: torch.Tensor, e_a: torch.Tensor, w_gate: torch.Tensor,
                            e_gate: torch.Tensor, w_up: torch.Tensor, e_up: torch.Tensor,
                            tile_expert: torch.Tensor, num_m_tiles: torch.Tensor,
                            out: torch.Tensor | None = None, tile_n: int = 128,
                            group_m: int = 8, preact_out: torch.Tensor | None = None,
                            preact_slot: torch.Tensor | None = None, quantize_h: bool = False):
    """FC1 on FP8: ``h [M, I] bf16 = bf16(silu(bf16(g)) * bf16(u))`` with ``g = A · W_gate[e]^T``
    and ``u = A · W_up[e]^T`` accumulated with promotion every 128 K (module docstring),
    e = the M-tile's expert. ``a [M, H]`` float8_e4m3fn with ``e_a [M, H/128]`` int8
    (``fp8.quantize_rows``); ``w_gate``, ``w_up [E, I, H]`` float8_e4m3fn with ``e_gate``,
    ``e_up [E, I/128, H/128]`` int8 (``fp8.quantize_blocks``); ``tile_expert`` and
    ``num_m_tiles [1]`` int32 on the device. Rows of M-tiles past ``num_m_tiles`` are
    untouched. No host sync.
    A training forward passes ``preact_out`` ([slots, 2I] bf16: g then u) and ``preact_slot``
    ([M] int32, -1: padding): each routed row's g and u are stored at its slot.
    ``quantize_h`` (tile_n 256, no ``out``): returns h as ``(hq [M, I] float8_e4m3fn, e
    [M, I/128] int8)``, bitwise ``quantize.quantize_rows`` of the bf16 h, from the epilogue."""
    m, n, k = _check_fc1_args(a, e_a, w_gate, e_gate, w_up, e_up, tile_expert, num_m_tiles)
    if quantize_h:
        if out is not None or preact_out is not None or tile_n != HALF_PROMOTE_TILE_N:
            raise ValueError(f"quantize_h: needs tile_n={HALF_PROMOTE_TILE_N}, no out and no "
                             f"preact_out, got tile_n={tile_n}")
        _kernel_operands((("a", a), ("w_gate", w_gate), ("w_up", w_up)), None, 0, n)
        hq = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=a.device)
        eh = torch.empty(m, n // GROUP, dtype=torch.int8, device=a.device)
        compiled = _compiled("gemm_fp8_fc1", a.device, tile_n, group_m, quantize_h=True)
        compiled(a.view(torch.int8).unsqueeze(2), w_gate.view(torch.int8).permute(1, 2, 0),
                 w_up.view(torch.int8).permute(1, 2, 0), None, e_a.contiguous(),
                 e_gate.contiguous(), e_up.contiguous(), tile_expert, num_m_tiles,
                 *(None,) * 6, hq.view(torch.int8), eh)
        return hq, eh
    out = _kernel_operands((("a", a), ("w_gate", w_gate), ("w_up", w_up)), out, m, n)
    extra = (None,) * 6
    if preact_out is not None:
        _check_padded_preact(preact_out, n, preact_slot, m, "preact_slot")
        extra = (None, None, preact_out, preact_slot, None, None)
    compiled = _compiled("gemm_fp8_fc1", a.device, tile_n, group_m,
                         save_preact=preact_out is not None)
    compiled(a.view(torch.int8).unsqueeze(2), w_gate.view(torch.int8).permute(1, 2, 0),
             w_up.view(torch.int8).permute(1, 2, 0), out.unsqueeze(2), e_a.contiguous(),
             e_gate.contiguous(), e_up.contiguous(), tile_expert, num_m_tiles, *extra)
    return out


def grouped_gemm_fp8_swiglu_ref(a: torch.Tensor, e_a: torch.Tensor, w_gate: torch.Tensor,
                                e_gate: torch.Tensor, w_up: torch.Tensor, e_up: torch.Tensor,
                                tile_expert: torch.Tensor,
                                num_m_tiles: int | torch.Tensor) -> torch.Tensor:
    """The oracle: g and u are the float64 products of the dequantized operands, each rounded
    once to bf16 (``grouped_gemm_fp8_ref``), then h = bf16(silu(g) * u) in fp32, the
    ``mok_cute.reference.swiglu_hidden`` numerics after its matmuls. Returns
    ``[num_m_tiles * 128, I]`` bf16."""
    _check_fc1_args(a, e_a, w_gate, e_gate, w_up, e_up, tile_expert,
                    num_m_tiles if isinstance(num_m_tiles, torch.Tensor)
                    else torch.tensor([num_m_tiles], dtype=torch.int32))
    g = grouped_gemm_fp8_ref(a, e_a, w_gate, e_gate, tile_expert, num_m_tiles).float()
    u = grouped_gemm_fp8_ref(a, e_a, w_up, e_up, tile_expert, num_m_tiles).float()
    return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)


# ---------------------------------------------------------------------- FC1's dgrad: split K
def _check_split_args(a, e_a, w1, e_w1, w2, e_w2, tile_expert, num_m_tiles):
    """(M, N): A's K is w1's K1 then w2's K2, each a positive multiple of 128."""
    _check_fp8("a", a, 2)
    _check_fp8("w1", w1, 3)
    _check_fp8("w2", w2, 3)
    m, k = a.shape
    num_experts, n, k1 = w1.shape
    k2 = w2.shape[2]
    if tuple(w2.shape[:2]) != (num_experts, n):
        raise ValueError(f"w2: expected [E, N, K2] with w1's E, N = {num_experts}, {n}, got shape "
                         f"{tuple(w2.shape)}")
    if not k1 or not k2 or k1 % GROUP or k2 % GROUP or n % GROUP or not n:
        raise ValueError(f"w1, w2: expected N, K1 and K2 positive multiples of {GROUP}, got shapes "
                         f"{tuple(w1.shape)} and {tuple(w2.shape)}")
    if k != k1 + k2:
        raise ValueError(f"a: expected K = K1 + K2 = {k1} + {k2}, got shape {tuple(a.shape)}")
    _check_exp("e_a", e_a, (m, k // GROUP))
    _check_exp("e_w1", e_w1, (num_experts, n // GROUP, k1 // GROUP))
    _check_exp("e_w2", e_w2, (num_experts, n // GROUP, k2 // GROUP))
    _check_tiles(tile_expert, num_m_tiles)
    return m, n


def grouped_gemm_fp8_split_k(a: torch.Tensor, e_a: torch.Tensor, w1: torch.Tensor,
                             e_w1: torch.Tensor, w2: torch.Tensor, e_w2: torch.Tensor,
                             tile_expert: torch.Tensor, num_m_tiles: torch.Tensor,
                             out: torch.Tensor | None = None, group_m: int = 8) -> torch.Tensor:
    """``out [M, N] bf16 = A . [W1[e] | W2[e]]^T`` with K split between two weight tensors:
    ``a [M, K1 + K2]`` e4m3 with ``e_a [M, (K1 + K2)/128]``; ``w1 [E, N, K1]``, ``w2 [E, N, K2]``
    e4m3 with ``e_w1 [E, N/128, K1/128]``, ``e_w2 [E, N/128, K2/128]``. FC1's dgrad:
    ``dx rows = [dG | dU] . [W_gate^T; W_up^T]`` with ``w1``, ``w2`` the exact transposed
    copies ``fp8.quantize_blocks(w_gate, transposed=True)`` ([E, H, I]: e4m3 wgmma reads K-major
    operands only). Promoted every 128 K (module docstring). No host sync."""
    m, n = _check_split_args(a, e_a, w1, e_w1, w2, e_w2, tile_expert, num_m_tiles)
    out = _kernel_operands((("a", a), ("w1", w1), ("w2", w2)), out, m, n)
    compiled = _compiled("gemm_fp8_fc1_dgrad", a.device, 128, group_m)
    compiled(a.view(torch.int8).unsqueeze(2), w1.view(torch.int8).permute(1, 2, 0),
             w2.view(torch.int8).permute(1, 2, 0), out.unsqueeze(2), e_a.contiguous(),
             e_w1.contiguous(), e_w2.contiguous(), tile_expert, num_m_tiles, *(None,) * 6)
    return out


def grouped_gemm_fp8_split_k_ref(a: torch.Tensor, e_a: torch.Tensor, w1: torch.Tensor,
                                 e_w1: torch.Tensor, w2: torch.Tensor, e_w2: torch.Tensor,
                                 tile_expert: torch.Tensor,
                                 num_m_tiles: int | torch.Tensor) -> torch.Tensor:
    """The oracle of ``grouped_gemm_fp8_split_k``: ``grouped_gemm_fp8_ref`` on the two weights
    (and their block exponents) concatenated along K."""
    w = torch.cat([w1.view(torch.uint8), w2.view(torch.uint8)], dim=2).view(torch.float8_e4m3fn)
    return grouped_gemm_fp8_ref(a, e_a, w, torch.cat([e_w1, e_w2], dim=2), tile_expert,
                                num_m_tiles)


def _check_padded_preact(preact, n: int, slot, m: int, slot_name: str) -> None:
    """The saved g | u as the FP8 kernels take them: [slots, 2I] with I the padded N or the
    layer's own I below it (n - 128 < I <= n; the kernels store and read only I columns)."""
    from mok_cute.expert_path import check_preact

    inter = preact.shape[1] // 2 if isinstance(preact, torch.Tensor) and preact.dim() == 2 else n
    if not n - GROUP < inter <= n:
        raise ValueError(f"preact: expected [slots, 2I] with {n - GROUP} < I <= {n}, got "
                         f"{describe(preact)}")
    check_preact(preact, inter, slot, m, slot_name)


# ---------------------------------------------------------------------- FC2's dgrad: dgated
def grouped_gemm_fp8_dgated(a: torch.Tensor, e_a: torch.Tensor, w: torch.Tensor,
                            e_w: torch.Tensor, preact: torch.Tensor, row_slot: torch.Tensor,
                            weights: torch.Tensor, tile_expert: torch.Tensor,
                            num_m_tiles: torch.Tensor, group_m: int = 8):
    """FC2's dgrad in FP8 with the SwiGLU backward in its epilogue (``gemm_sm90``'s "dgated",
    on the promoted accumulator): ``a [M, H]`` e4m3 d_out rows with ``e_a [M, H/128]``
    (``fp8.quantize_rows``), ``w [E, I, H]`` e4m3, W_down's exact transposed copy
    (``fp8.quantize_blocks(w_down, transposed=True)``) with ``e_w [E, I/128, H/128]``,
    ``preact [slots, 2I]`` bf16 g | u by slot (or at the unpadded I: the columns past it read
    as zeros), ``row_slot [M]`` int32 (-1: padding), ``weights`` fp32 [slots]. Returns (dG | dU
    [M, 2I], w * h [M, I], row partials [M, I/128] fp32), as ``expert_backward.fc2_dgrad``. No
    host sync."""
    m, n, _ = _check_args(a, e_a, w, e_w, tile_expert, num_m_tiles)
    _check_padded_preact(preact, n, row_slot, m, "row_slot")
    if weights.dtype != torch.float32 or weights.dim() != 1:
        raise ValueError(f"weights: expected a 1-D float32 tensor, got {describe(weights)}")
    d_preact = _kernel_operands((("a", a), ("w", w)), None, m, 2 * n)
    hw = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    partials = torch.empty(m, n // GROUP, dtype=torch.float32, device=a.device)
    compiled = _compiled("gemm_fp8_fc2_dgrad", a.device, 128, group_m)
    compiled(a.view(torch.int8).unsqueeze(2), w.view(torch.int8).permute(1, 2, 0), None,
             d_preact[:, :n].unsqueeze(2), e_a.contiguous(), e_w.contiguous(), None,
             tile_expert, num_m_tiles, d_preact[:, n:].unsqueeze(2), hw.unsqueeze(2), preact,
             row_slot, weights, partials)
    return d_preact, hw, partials

