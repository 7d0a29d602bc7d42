"""The expert weight gradients on Hopper (sm_90a): one persistent, warp-specialised GEMM.

    C[e][m, n] = sum over the rows r of expert e of  A[r, m] * B[r, n]

- A ``(rows, M)`` and B ``(rows, N)`` bf16 as they are stored (the backward's expert-sorted,
  tile-padded row buffers), read as MN-major operands: TMA boxes and wgmma descriptors take
  the M (N) mode as the contiguous one, so nothing is transposed in memory.
- The K of expert e is its row segment ``[offsets[e], offsets[e + 1])`` (a multiple of 128:
  the receive schedule pads every segment), read at run time; an expert with no rows writes
  zeros. Padding rows hold zeros in A and B (their producers write them), so they add
  nothing even where the saved activations they came from were never written.
- One tile is 256 x 128 (M x N) x 64: each consumer warpgroup owns 128 rows of M with its own
  A box and 128 x 128 accumulator, both read every stage's B box. ``gated`` (the gate and up
  weights): warpgroup 0's rows come from A (dG) and go to C (dW_gate), warpgroup 1's from A2
  (dU) into C2 (dW_up), the same weight rows, so gate and up share every loaded x tile.
  Otherwise (dW_down) the two warpgroups take consecutive 128-row blocks of A and C.
- Deterministic: each output tile has one owner, which runs its expert's rows in order.
- ``accumulate`` (``MoKConfig(fuse_wgrad_accumulation=True)``): C is fp32 (a weight's
  ``main_grad``) and each tile's unrounded fp32 accumulator is added into it, one owner and
  one add per element per launch (deterministic), in one of two ways (``main_grad_add``) of
  the same bits but for subnormal fp32 values, which the reduce-add may flush to zero as
  PTX's f32 reductions do: "reduce", TMA reduce-add stores (``cp.reduce.async.bulk.tensor
  .add.f32``); "load", main_grad read into registers four epilogue subtiles ahead
  (``gemm_core.AddendTile``), added there and stored by plain TMA stores. "load" makes the
  backward 1-10 % faster where experts have up to ~1024 rows (short K: the epilogue is a
  large part of a tile) and up to 8 % slower at 2048 (``main_grad_add``'s rule;
  docs/measurements.md). Its fp32 epilogue buffers run two stages per warpgroup instead of
  four, so the operand stages stay as many as with bf16 C.

Tiles are walked expert-major (an expert's tiles run together and share its rows in L2), each
expert's tiles rasterised in groups of ``group_m`` M-tiles.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import torch
from cutlass import Int32, const_expr

from mok_cute import jit
from mok_cute.config import check_tensor
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import AddendTile, GemmCoreSm90

WG_ROWS = 128  # M rows per consumer warpgroup
WGRAD_TILE_N = 128
# Experts with at most this many rows on average (the launch's rows over its experts, the
# schedule's < 128 padding rows each included: 1024 routed rows plus a tile) add into main_grad
# by "load", more by "reduce" (module docstring); the backward megakernel takes the same rule.
# H100, backward with main_grad, "load" / "reduce", launches (megakernel): 256 rows (gptoss_120b)
# 0.90 (0.90); 512-1024 rows at gptoss's H and I 0.88-0.95 (0.98-1.00); dsv3_ep8_rank and
# qwen3_30b (1024) 0.97-0.99 (0.99-1.01); 2048 (sonic_120b, mixtral) 1.00-1.08 (1.06), the
# gate | up launch alone 1.15 (docs/measurements.md)
MAIN_GRAD_LOAD_MAX_ROWS = 1152


def adds_by_load(accumulate: bool, main_grad_add: str) -> bool:
    """Whether an ``accumulate`` build adds into main_grad through registers ("load") rather
    than by TMA reduce-add ("reduce"); ValueError for any other ``main_grad_add``."""
    if main_grad_add not in ("reduce", "load"):
        raise ValueError(f"main_grad_add must be 'reduce' or 'load', got {main_grad_add!r}")
    return accumulate and main_grad_add == "load"


def main_grad_add(rows: int, experts: int, rows_per_expert: float | None = None) -> str:
    """How a weight-gradient launch over ``rows`` schedule rows of ``experts`` experts adds
    into main_grad: "load" or "reduce" (``MAIN_GRAD_LOAD_MAX_ROWS``), by ``rows_per_expert``,
    the routing's expected rows an expert, where the caller knows it (a schedule's capacity
    holds every rank's tokens: over a group of R ranks it overstates them R-fold), else (0 or
    None) by ``rows / experts``."""
    per_expert = rows_per_expert if rows_per_expert else rows / max(experts, 1)
    return "load" if per_expert <= MAIN_GRAD_LOAD_MAX_ROWS else "reduce"


class WgradGemmSm90(GemmCoreSm90):
    """Grouped weight-gradient GEMM with a variable K per expert.

    :param gated: two A / C pairs (gate and up) sharing each B tile.
    :param group_m: M-tiles per rasterisation group inside an expert.
    :param num_sms: persistent grid size.
    :param accumulate: add into fp32 C instead of storing bf16 C (module docstring).
    :param main_grad_add: how ``accumulate`` adds: "reduce" or "load" (module docstring).
    """

    def __init__(self, gated: bool, group_m: int = 4, num_sms: int = 132,
                 accumulate: bool = False, main_grad_add: str = "reduce"):
        # each warpgroup is a whole single-warpgroup MMA over its 128 rows (the pingpong
        # layout: 64 x 32 epilogue subtiles, buffers and barriers per warpgroup)
        super().__init__(WGRAD_TILE_N, pingpong=True, a_mn_major=True, b_mn_major=True)
        self.wg_rows = WG_ROWS  # M rows per consumer warpgroup (its A box, its C block)
        self.gated = gated
        self.group_m = group_m
        self.num_sms = num_sms
        self.accumulate = accumulate
        self.adds_by_load = adds_by_load(accumulate, main_grad_add)
        if accumulate:
            self.fp32_epilogue()

    def _setup_attributes(self):
        super()._setup_attributes()
        tile_n, tile_k = self.tile_shape_mnk[1], self.tile_shape_mnk[2]
        # a stage holds two warpgroups' A boxes and one B box
        ab_bytes_per_stage = (2 * self.wg_rows + tile_n) * tile_k * self.a_dtype.width // 8
        epi_bytes = 64 * 32 * self.c_dtype.width // 8 * self.epi_buffers
        self.ab_stages = self.operand_stages(
            (self.smem_capacity - 1024 - epi_bytes) // ab_bytes_per_stage)
        self.a_smem_layout_staged = self.staged_layout(self.a_dtype, (self.wg_rows, tile_k),
                                                       self.ab_stages, mn_major=self.a_mn_major)
        self.b_smem_layout_staged = self.staged_layout(self.b_dtype, (tile_n, tile_k),
                                                       self.ab_stages, mn_major=self.b_mn_major)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mA: cute.Tensor, mA2: Optional[cute.Tensor], mB: cute.Tensor,
                 mC: cute.Tensor, mC2: Optional[cute.Tensor], mOffsets: cute.Tensor,
                 stream: cuda.CUstream, mEA: Optional[cute.Tensor] = None,
                 mEA2: Optional[cute.Tensor] = None, mEB: Optional[cute.Tensor] = None):
        """mA, mA2 (M, rows, 1) and mB (N, rows, 1), M / N contiguous; mC, mC2 (M, N, E),
        N contiguous (fp32 with ``accumulate``, else bf16); mOffsets int32 (E + 1,): each expert's first row (128-aligned).
        mEA, mEA2, mEB: the FP8 subclass's exponents (None here)."""
        mA, mA2, mB = self.operands(mA, mA2, mB)
        self.a_dtype = mA.element_type
        self.b_dtype = mB.element_type
        self.c_dtype = mC.element_type
        self._setup_attributes()
        tile_n, tile_k = self.tile_shape_mnk[1], self.tile_shape_mnk[2]
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        s2g = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        if const_expr(self.accumulate and not self.adds_by_load):
            s2g = cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD)
        a_layout = cute.slice_(self.a_smem_layout_staged, (None, None, 0))
        b_layout = cute.slice_(self.b_smem_layout_staged, (None, None, 0))
        epi_layout = cute.slice_(self.epi_smem_layout_staged, (None, None, 0))
        mk = cute.nvgpu.cpasync.make_tiled_tma_atom
        tma_a, t_a = mk(g2s, mA, a_layout, (self.wg_rows, tile_k))
        tma_a2, t_a2 = None, None
        tma_c2, t_c2 = None, None
        if const_expr(self.gated):
            tma_a2, t_a2 = mk(g2s, mA2, a_layout, (self.wg_rows, tile_k))
            tma_c2, t_c2 = mk(s2g, mC2, epi_layout, self.epi_tile)
        tma_b, t_b = mk(g2s, mB, b_layout, (tile_n, tile_k))
        tma_c, t_c = mk(s2g, mC, epi_layout, self.epi_tile)

        self.shared_storage = self.make_shared_storage(a_tiles_per_stage=2)
        self.kernel(tma_a, t_a, tma_a2, t_a2, tma_b, t_b, tma_c, t_c, tma_c2, t_c2, mOffsets,
                    self.tiled_mma, self.a_smem_layout_staged, self.b_smem_layout_staged,
                    self.epi_smem_layout_staged, mEA, mEA2, mEB,
                    mC if const_expr(self.adds_by_load) else None,
                    mC2 if const_expr(self.adds_by_load) else None
                    ).launch(grid=[self.num_sms, 1, 1], block=[self.threads_per_cta, 1, 1],
                             min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_a2: Optional[cute.CopyAtom],
               mA2: Optional[cute.Tensor], tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_c: cute.CopyAtom, mC: cute.Tensor, tma_c2: Optional[cute.CopyAtom],
               mC2: Optional[cute.Tensor], mOffsets: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout, mEA: Optional[cute.Tensor],
               mEA2: Optional[cute.Tensor], mEB: Optional[cute.Tensor],
               mCm: Optional[cute.Tensor], mC2m: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)
        tile_n, tile_k = self.tile_shape_mnk[1], self.tile_shape_mnk[2]
        if warp_idx == self.load_warp:
            self.prefetch_descriptors(tma_a, tma_b, tma_c, tma_a2, tma_c2)
        # both warpgroups read every stage (one arrive per consumer warp)
        storage, ab_pipeline, _, sB, sC = self.operand_smem(
            a_smem_layout_staged, b_smem_layout_staged, epi_smem_layout_staged,
            a_tiles_per_stage=2, consumer_warps=self.num_mma_threads // 32)

        # the two A halves (one per warpgroup), each a staged (wg_rows, tile_k) layout
        a_elems = cute.cosize(a_smem_layout_staged)
        sA_ptr = storage.sA.data_ptr()
        sA0 = cute.make_tensor(cute.recast_ptr(sA_ptr, a_smem_layout_staged.inner),
                               a_smem_layout_staged.outer)
        sA1 = cute.make_tensor(cute.recast_ptr(sA_ptr + a_elems, a_smem_layout_staged.inner),
                               a_smem_layout_staged.outer)

        single = cute.make_layout(1)
        # (128, 64, M-blocks, row k-tiles, 1) / (128, 64, N-tiles, row k-tiles, 1)
        gA = cute.local_tile(mA, (self.wg_rows, tile_k), (None, None, None))
        gB = cute.local_tile(mB, (tile_n, tile_k), (None, None, None))
        tAsA0, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, single, cute.group_modes(sA0, 0, 2), cute.group_modes(gA, 0, 2))
        tAsA1, _ = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, single, cute.group_modes(sA1, 0, 2), cute.group_modes(gA, 0, 2))
        tAgA2 = None
        if const_expr(self.gated):
            gA2 = cute.local_tile(mA2, (self.wg_rows, tile_k), (None, None, None))
            _, tAgA2 = cute.nvgpu.cpasync.tma_partition(
                tma_a2, 0, single, cute.group_modes(sA1, 0, 2), cute.group_modes(gA2, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, single, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        # M-tiles: gated, wg_rows weight rows of both gate and up; else two blocks of them
        m_blocks = cute.size(gA, mode=[2])
        num_m_tiles = m_blocks if const_expr(self.gated) else (m_blocks + 1) // 2
        num_n_tiles = cute.size(gB, mode=[2])
        num_experts = cute.size(mOffsets) - 1
        tiles_per_expert = num_m_tiles * num_n_tiles
        num_tiles = num_experts * tiles_per_expert

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == self.load_warp:
                # ---------------- producer: the tile's A boxes and B box for each row k-tile
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     self.ab_stages)
                tile_idx = cute.arch.block_idx()[0]
                while tile_idx < num_tiles:
                    expert, m_tile, n_tile = self._tile(tile_idx, num_m_tiles, num_n_tiles)
                    k0, k_tiles = self._rows(mOffsets, expert)
                    m0 = m_tile if const_expr(self.gated) else 2 * m_tile
                    for k in range(k_tiles):
                        ab_pipeline.producer_acquire(state)
                        bar = ab_pipeline.producer_get_barrier(state)
                        cute.copy(tma_a, tAgA[(None, m0, k0 + k, 0)], tAsA0[(None, state.index)],
                                  tma_bar_ptr=bar)
                        if const_expr(self.gated):
                            cute.copy(tma_a2, tAgA2[(None, m_tile, k0 + k, 0)],
                                      tAsA1[(None, state.index)], tma_bar_ptr=bar)
                        else:
                            # past the last 128-row block TMA fills zeros, and C clips them
                            cute.copy(tma_a, tAgA[(None, m0 + 1, k0 + k, 0)],
                                      tAsA1[(None, state.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBgB[(None, n_tile, k0 + k, 0)], tBsB[(None, state.index)],
                                  tma_bar_ptr=bar)
                        ab_pipeline.producer_commit(state)
                        state.advance()
                    tile_idx += cute.arch.grid_dim()[0]
                ab_pipeline.producer_tail(state)
        else:
            # ---------------- consumers: warpgroup w multiplies its A half by B
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg = warpgroup_idx - 1
            wg_tidx = tidx % self.threads_per_warpgroup
            sA_mine = cute.make_tensor(
                cute.recast_ptr(sA_ptr + wg * a_elems, a_smem_layout_staged.inner),
                a_smem_layout_staged.outer)
            tCrA, tCrB, acc, num_k_blocks, epi = self.consumer_parts(
                tiled_mma, sA_mine, sB, sC, 0, wg_tidx)
            store_pipeline, barrier, is_store_warp = self.epilogue_sync(warp_idx, warpgroup_idx)
            gC = cute.local_tile(mC, (self.wg_rows, tile_n), (None, None, None))
            gC2 = None
            if const_expr(self.gated):
                gC2 = cute.local_tile(mC2, (self.wg_rows, tile_n), (None, None, None))
            kind = "store"
            gCm, gC2m, cC = None, None, None
            if const_expr(self.adds_by_load):  # main_grad read into registers (AddendTile)
                kind = "add"
                gCm = cute.local_tile(mCm, (self.wg_rows, tile_n), (None, None, None))
                if const_expr(self.gated):
                    gC2m = cute.local_tile(mC2m, (self.wg_rows, tile_n), (None, None, None))
                cC = cute.local_tile(cute.make_identity_tensor(mCm.shape), (self.wg_rows, tile_n),
                                     (None, None, None))
            loads = Int32(0)
            subtiles = Int32(0)
            tile_idx = cute.arch.block_idx()[0]
            while tile_idx < num_tiles:
                expert, m_tile, n_tile = self._tile(tile_idx, num_m_tiles, num_n_tiles)
                k0, k_tiles = self._rows(mOffsets, expert)
                block = m_tile if const_expr(self.gated) else 2 * m_tile + wg
                if k_tiles > 0:
                    self.tile_mma(ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads, k_tiles,
                                  num_k_blocks, (mEA, mEA2, mEB, wg, block, n_tile, k0, wg_tidx,
                                                  expert))
                else:
                    acc.fill(0.0)  # an expert with no rows
                loads += k_tiles
                where = (None, None, block, n_tile, expert)
                if const_expr(self.gated):
                    if wg == 0:
                        self.tile_epilogue(epi, (tma_c,), (gC[where],), kind, wg * self.epi_stages,
                                           subtiles, barrier, store_pipeline, is_store_warp,
                                           self.addend(epi, gCm, cC, mCm, where, wg_tidx))
                    else:
                        self.tile_epilogue(epi, (tma_c2,), (gC2[where],), kind,
                                           wg * self.epi_stages, subtiles, barrier,
                                           store_pipeline, is_store_warp,
                                           self.addend(epi, gC2m, cC, mCm, where, wg_tidx))
                else:
                    self.tile_epilogue(epi, (tma_c,), (gC[where],), kind, wg * self.epi_stages,
                                       subtiles, barrier, store_pipeline, is_store_warp,
                                       self.addend(epi, gCm, cC, mCm, where, wg_tidx))
                subtiles += (self.wg_rows // self.epi_tile[0]) * (tile_n // self.epi_tile[1])
                tile_idx += cute.arch.grid_dim()[0]
            store_pipeline.producer_tail()

    def addend(self, epi, g_main, c_main, mCm, where, wg_tidx):
        """The ``"add"`` epilogue's main_grad tile at ``where`` (None when it reduce-adds).
        Traced inline."""
        if const_expr(not self.adds_by_load):
            return None
        return AddendTile(self, epi, (g_main[where], c_main[where], mCm.shape), wg_tidx)

    def operands(self, mA, mA2, mB):
        """The operands as the kernel reads them (the FP8 subclass reinterprets int8 views).
        Traced inline."""
        return mA, mA2, mB

    @cute.jit
    def tile_mma(self, ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads: Int32, k_tiles: Int32,
                 num_k_blocks: cutlass.Constexpr[int], scale_args):
        """One output tile's products over its expert's ``k_tiles`` row k-tiles (>= 1) into
        ``acc``, every stage released. The FP8 subclass promotes per 128-row group."""
        release = self.mainloop(ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads, k_tiles,
                                num_k_blocks)
        cute.nvgpu.warpgroup.wait_group(0)
        ab_pipeline.consumer_release(release)

    @cute.jit
    def _tile(self, tile_idx: Int32, num_m_tiles: Int32, num_n_tiles: Int32):
        """(expert, M-tile, N-tile) of a linear tile index: expert-major, then rasterised."""
        per_expert = num_m_tiles * num_n_tiles
        expert = tile_idx // per_expert
        m_tile, n_tile = common.grouped_raster(tile_idx - expert * per_expert, num_m_tiles,
                                               num_n_tiles, self.group_m)
        return expert, m_tile, n_tile

    @cute.jit
    def _rows(self, mOffsets: cute.Tensor, expert: Int32):
        """(first row k-tile, row k-tiles) of the expert's segment."""
        tile_k = self.tile_shape_mnk[2]
        first = mOffsets[expert]
        return first // tile_k, (mOffsets[expert + 1] - first) // tile_k


def compile_wgrad_gemm(gated: bool = True, group_m: int = 4, num_sms: int = 132,
                       arch: str = "sm_90a", options: str = "", accumulate: bool = False,
                       main_grad_add: str = "reduce"):
    """Compile on fake tensors (no GPU needed): ``A (M, rows, 1)``, ``A2`` (gated) or None,
    ``B (N, rows, 1)`` (M / N contiguous), ``C (M, N, E)``, ``C2`` (gated) or None (N
    contiguous; fp32 with ``accumulate``), the int32 expert row offsets; it runs on torch's
    current stream."""
    gemm = WgradGemmSm90(gated=gated, group_m=group_m, num_sms=num_sms, accumulate=accumulate,
                         main_grad_add=main_grad_add)
    bf16 = cutlass.BFloat16
    rows = cute.sym_int32()  # the shared expert's K is every token: any count
    m, n, experts = (cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=8),
                     cute.sym_int32())
    mn_major = lambda extent: common.fake_strided_tensor(bf16, (extent, rows, 1),  # noqa: E731
                                                         contiguous_mode=0)
    a = mn_major(m)
    a2 = mn_major(m) if gated else None
    b = mn_major(n)
    c_type = cutlass.Float32 if accumulate else bf16
    c = common.fake_kmajor_tensor(c_type, (m, n, experts))
    c2 = common.fake_kmajor_tensor(c_type, (m, n, experts)) if gated else None
    return cute.compile(gemm, a, a2, b, c, c2, common.fake_vector(Int32), common.fake_stream(),
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))


# ---------------------------------------------------------------------- torch side
def wgrad_outputs(shapes, device, buffers, name: str):
    """The weight-gradient outputs of a launch (weights of ``shapes``) and what it returns for
    them once queued: bf16 ones (``buffers`` None), or, for the build that adds into fp32,
    each weight's main_grad buffer (None returned: the gradient went there) or fp32 zeros
    where a weight has none (returned rounded to bf16: the bf16 build's bits)."""
    if buffers is None:
        outs = tuple(torch.empty(shape, dtype=torch.bfloat16, device=device) for shape in shapes)
        return outs, lambda: outs
    for i, (shape, b) in enumerate(zip(shapes, buffers)):
        if b is not None:  # contiguous too
            check_tensor(f"{name}[{i}]", b, shape=tuple(shape), dtype=torch.float32,
                         device=device)
    outs = tuple(torch.zeros(shape, dtype=torch.float32, device=device) if b is None else b
                 for shape, b in zip(shapes, buffers))
    return outs, lambda: tuple(None if b is not None else o.to(torch.bfloat16)
                               for o, b in zip(outs, buffers))
