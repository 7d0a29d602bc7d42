"""The split-accumulation mainloops of FP8 tiles and FC1's e4m3 h epilogue, mixins for every
kernel that runs FP8 tiles (``gemm_fp8.GroupedGemmFp8Sm90``, the megakernel's FP8 tasks,
``gemm_wgrad_fp8.WgradGemmFp8Sm90``), with their device helpers. 128-wide tiles:
``TwoPartialMainloop``. 256-wide tiles (``PromotingMainloop``):

Per 128-deep K group (one stage: 128 e4m3 bytes a row), N-half 0's wgmmas run into a
half-wide fp32 partial (the group's first wgmma with accumulate off), wait, and promote:
``acc += 2^(e_a[row] + e_b[block]) * partial`` with one FFMA an element (``pow2_f32``: the
scale built from its exponent bits, exact); then N-half 1's, whose wgmmas hide the next
group's exponent loads. With ``turns`` the two consumer warpgroups issue their batches in
turns, one's promotion under the other's wgmmas (``wait_mma_turn``). The class that mixes it
in supplies ``group_exponents(exps, group) -> (ea0, ea1, eb0, eb1)``: this thread's two rows'
A exponents and the tile's two W block exponents (one per N-half) of K group ``group``, from
what it passed as ``exps``.
``gemm_fp8``'s module docstring has the numerics and the measured costs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int8, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from mok_cute import fp8
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import pipeline_state

GROUP = fp8.GROUP  # 128: the K depth of a scale group, one k-tile


# ---------------------------------------------------------------------- device helpers
@dsl_user_op
def ffma(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """``a * b + c`` rounded once (``fma.rn.f32``: one FFMA, nothing flushed)."""
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c)]
    return Float32(llvm.inline_asm(T.f32(), args, "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def prmt(a: Int32, b: Int32, selector: Int32, *, loc=None, ip=None) -> Int32:
    """``prmt.b32``: byte i of the result is byte ``selector``'s nibble i of (b:a), bytes 0-3
    a's, 4-7 b's."""
    args = [Int32(v).ir_value(loc=loc, ip=ip) for v in (a, b, selector)]
    return Int32(llvm.inline_asm(T.i32(), args, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


def transpose_quad(w0: Int32, w1: Int32, lane4: Int32):
    """A row's 4 x 4 matrix of 16-bit chunks over its quad of lanes transposed: lane ``lane4``
    holds chunks (c = 0, 1 in ``w0``, 2, 3 in ``w1``, low half first) and gets chunk ``lane4``
    of lanes 0 .. 3 in order (8 contiguous bytes of the row). Two xor-shuffles: whole words
    across lane pairs 2 apart, then halves across neighbours. Traced inline."""
    upper = (lane4 & 2) != 0
    recv = cute.arch.shuffle_sync_bfly(cutlass.select_(upper, w0, w1), offset=2)
    w0, w1 = cutlass.select_(upper, recv, w0), cutlass.select_(upper, w1, recv)
    odd = (lane4 & 1) != 0
    recv = cute.arch.shuffle_sync_bfly(
        prmt(w0, w1, cutlass.select_(odd, Int32(0x5410), Int32(0x7632))), offset=1)
    return (prmt(w0, recv, cutlass.select_(odd, Int32(0x3254), Int32(0x5410))),
            prmt(w1, recv, cutlass.select_(odd, Int32(0x3276), Int32(0x7610))))


def pow2_f32(e: Int32) -> Float32:
    """``2.0 ** e`` as fp32, exact for integer e in [-149, 127] (subnormals included), 0 below,
    inf above: ``mok_cute.fp8.pow2`` in integers. Traced inline."""
    normal = (cutlass.min(cutlass.max(e, Int32(-126)), Int32(128)) + 127) << 23
    sub = Int32(1) << cutlass.min(cutlass.max(e + 149, Int32(0)), Int32(22))
    bits = cutlass.select_(e >= -126, normal, cutlass.select_(e >= -149, sub, Int32(0)))
    return common.f32_from_bits(bits)


def bf16_pair(lo: Float32, hi: Float32) -> Int32:
    """Two fp32 values that are bf16 values as one 32-bit bf16 pair, ``lo`` at the lower
    address."""
    return (common.f32_bits(hi) & Int32(-65536)) | ((common.f32_bits(lo) >> 16) & 0xFFFF)


class TwoPartialMainloop:
    """The split-accumulation mainloop of 128-wide FP8 tiles (64 fp32 of accumulator a thread),
    a mixin of ``gemm_fp8.GroupedGemmFp8Sm90`` and ``gemm_wgrad_fp8.WgradGemmFp8Sm90``. The
    class that mixes it in supplies ``group_scales(src, group)``, what K group ``group``'s
    promotion needs (read from ``src``), ``promote_group(acc, partial, scales)`` (one FFMA an
    element) and ``scales_under_wgmma``: whether a group's scales are read after its wgmmas
    are issued (under them) or before its stage's wait."""

    @cute.jit
    def two_partial_mainloop(self, ab_pipeline, tiled_mma, acc, partial, tCrA, tCrB,
                             loads: Int32, k_tiles: Int32, num_k_blocks: cutlass.Constexpr[int],
                             src):
        """One tile over its ``k_tiles`` 128-deep groups (>= 1), from stage use ``loads`` on,
        with two partials (``partial`` and one more): group k's wgmmas (the first of a group
        overwriting its partial) are issued into partial k % 2 before group k - 1's are waited
        for (``wait_group(1)``), released and promoted from the other, so a warpgroup's tensor
        work runs under its own promotion (2026-12-04, against one partial waited for and
        promoted each group: FC1's dgrad 4-11 % faster, FC2 -2 to +7 %, the FP8 weight
        gradients' gate / up 8-17 %; bitwise the same). Group 0 is peeled, the loop takes
        whole pairs and the last group follows it: no guard inside the loop, so every path
        into its head has the same partial in flight (with a guarded group inside, ptxas
        serialized every wgmma, C7514). A group's issue and retirement are written out at
        each of their places: the accumulate field set in a helper, and a pipeline state
        advanced in one, escape the loop's region (the DSL refuses both). Returns the state
        after the tile's last stage."""
        parts = (partial, cute.make_rmem_tensor(partial.shape, self.acc_dtype))
        read = pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages, loads)
        done = pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages, loads)
        acc.fill(0.0)
        s_prev = self.group_scales(src, Int32(0))
        ab_pipeline.consumer_wait(read)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(num_k_blocks):
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(tiled_mma, parts[0], tCrA[(None, None, kb, read.index)],
                      tCrB[(None, None, kb, read.index)], parts[0])
        cute.nvgpu.warpgroup.commit_group()
        read.advance()
        for kk in range(1, k_tiles - 1, 2):
            for j in cutlass.range_constexpr(2):  # group kk + j into partial 1 - j
                if const_expr(not self.scales_under_wgmma):
                    s_next = self.group_scales(src, kk + j)
                ab_pipeline.consumer_wait(read)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range_constexpr(num_k_blocks):
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb != 0)
                    cute.gemm(tiled_mma, parts[1 - j], tCrA[(None, None, kb, read.index)],
                              tCrB[(None, None, kb, read.index)], parts[1 - j])
                cute.nvgpu.warpgroup.commit_group()
                read.advance()
                if const_expr(self.scales_under_wgmma):
                    s_next = self.group_scales(src, kk + j)
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipeline.consumer_release(done)
                done.advance()
                self.promote_group(acc, parts[j], s_prev)
                s_prev = s_next
        if k_tiles % 2 == 0:  # the last group (k_tiles - 1, odd) into partial 1
            if const_expr(not self.scales_under_wgmma):
                s_next = self.group_scales(src, k_tiles - 1)
            ab_pipeline.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(num_k_blocks):
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(tiled_mma, parts[1], tCrA[(None, None, kb, read.index)],
                          tCrB[(None, None, kb, read.index)], parts[1])
            cute.nvgpu.warpgroup.commit_group()
            read.advance()
            if const_expr(self.scales_under_wgmma):
                s_next = self.group_scales(src, k_tiles - 1)
            cute.nvgpu.warpgroup.wait_group(1)
            ab_pipeline.consumer_release(done)
            done.advance()
            self.promote_group(acc, parts[0], s_prev)
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(done)
            self.promote_group(acc, parts[1], s_next)
        else:
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(done)
            self.promote_group(acc, parts[0], s_prev)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        return read


class PromotingMainloop:
    """The mixin (module docstring): ``half_promoting_mainloop``, its fragments and MMA,
    ``store_h_fp8`` and ``store_preact_pairs``."""

    # ------------------------------------------------------------------ FC1's e4m3 h
    def store_h_fp8(self, acc: cute.Tensor, mHq: cute.Tensor, mEh: cute.Tensor, row0: Int32,
                    row1: Int32, n_tile: Int32, tidx: Int32):
        """h of this 128 x 128 tile straight from the accumulator as e4m3 with one exponent per
        row (the tile's 128 columns are one 1 x 128 group): h = bf16(silu(bf16(g)) * bf16(u))
        as the swiglu epilogue computes it, then exactly ``quantize.quantize_rows`` of those
        bf16 values (the row amax over the 4 lanes that hold the row, its scale exponent, the
        same conversion). Thread's elements: v = c + 2 r + 4 j, column 8 j + 2 (lane % 4) + c
        of row r, gate for j < 16 and up at j + 16. A row's e4m3 chunks (2 bytes, chunk j of
        lane l at column 8 j + 2 l) are transposed over its quad of lanes 4 chunks at a time
        (``transpose_quad``), so lane l stores the 8 bytes from column 32 g + 8 l: 4 eight-byte
        stores a row, whole 32-byte sectors (2-byte stores straight from the accumulator
        layout: 16 a row, a quarter of each sector; the layer 4-6 % slower, 2026-12-03). The
        row's exponent byte comes from each of its 4 lanes (the same value). Traced inline."""
        from mok_cute.kernels import quantize

        accv = cute.flatten(acc)
        half = cute.size(accv) // 2  # 64: the gate elements, then the up ones
        gate = cute.make_rmem_tensor((half,), Float32)
        up = cute.make_rmem_tensor((half,), Float32)
        for v in range(half):
            gate[v] = accv[v]
            up[v] = accv[half + v]
        gate.store(gate.load().to(cutlass.BFloat16).to(Float32))
        up.store(up.load().to(cutlass.BFloat16).to(Float32))
        h = cute.make_rmem_tensor((half,), Float32)
        for v in range(half):
            h[v] = common.silu(gate[v]) * up[v]
        h.store(h.load().to(cutlass.BFloat16).to(Float32))
        bits = [common.f32_bits(h[v]) for v in range(half)]
        amax = [Int32(0), Int32(0)]
        for v in range(half):
            r = (v // 2) % 2
            amax[r] = cutlass.max(amax[r], (bits[v] >> 16) & 0x7FFF)
        lane = tidx % 32
        rows = (row0, row1)
        lane4 = lane % 4
        store8 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=64)
        out = cute.make_rmem_tensor((2,), Int32)
        for r in range(2):
            for offset in (1, 2):  # the row's 4 lanes: lane / 4 equal
                amax[r] = cutlass.max(amax[r], cute.arch.shuffle_sync_bfly(amax[r], offset))
            e, mult, nonfinite = quantize.scale_exponent(amax[r])
            for g in range(half // 16):  # chunks 4 g .. 4 g + 3: 32 bytes of the row
                words = []
                for j in (4 * g, 4 * g + 2):  # chunks (j, j + 1): four bytes
                    v0, v1 = 4 * j + 2 * r, 4 * (j + 1) + 2 * r
                    words.append(quantize.quantize_quad(bits[v0], bits[v0 + 1], bits[v1],
                                                        bits[v1 + 1], mult, nonfinite))
                out[0], out[1] = transpose_quad(words[0], words[1], lane4)
                col = n_tile * GROUP + 32 * g + 8 * lane4  # 8-byte aligned: every h row
                addr = (mHq[rows[r], None].iterator + col).toint()  # starts 16-byte aligned
                cute.copy(store8, out, cute.make_tensor(
                    cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=8),
                    cute.make_layout(2)))
            mEh[rows[r], n_tile] = Int8(e)  # the row's 4 lanes store the same byte


    @cute.jit
    def store_preact_pairs(self, acc: cute.Tensor, words: cute.Tensor, slot0: Int32,
                           slot1: Int32, inter: Int32, n_tile: Int32, lane: Int32):
        """A training forward's bf16 g | u of this thread's two rows of a 256-wide swiglu
        tile, straight from the accumulator (``store_h_fp8``'s element order), into row
        ``slot`` of ``words`` ([rows, I] int32, each a bf16 pair: g's columns, then u's at
        I / 2 on); padding rows (slot -1) and columns past I are not stored (I % 64 == 0: a
        tile's columns all, or its first 64). Each row's stores at constant offsets from one
        address; each pair rounded as it is stored (no copy of the tile)."""
        accv = cute.flatten(acc)
        half = cute.size(accv) // 2
        slots = (slot0, slot1)
        full = n_tile * GROUP + GROUP <= inter
        first = n_tile * (GROUP // 2) + lane % 4  # this lane's first pair of the tile
        pair = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            if slots[r] >= 0:
                row = words[slots[r], None].iterator
                rows = (cute.make_tensor(row + first, cute.make_layout(GROUP // 2)),
                        cute.make_tensor(row + (inter // 2 + first), cute.make_layout(GROUP // 2)))
                for j in cutlass.range_constexpr(half // 8):  # the tile's first 64 columns
                    self._store_pair(accv, pair, rows, half, j, r)
                if full:
                    for j in cutlass.range_constexpr(half // 8, half // 4):
                        self._store_pair(accv, pair, rows, half, j, r)

    @staticmethod
    def _store_pair(accv, pair, rows, half: int, j: int, r: int):
        """``store_preact_pairs``' stores of chunk ``j`` of row ``r``: g's pair, then u's.
        Traced inline."""
        for part in range(2):
            v = part * half + 4 * j + 2 * r
            pair[0], pair[1] = accv[v], accv[v + 1]
            pair.store(pair.load().to(cutlass.BFloat16).to(Float32))
            rows[part][4 * j] = bf16_pair(pair[0], pair[1])

    @cute.jit
    def wait_mma_turn(self, turns, k):
        """Wait for this warpgroup's turn to issue a wgmma batch. The two consumer warpgroups
        take turns (two named barriers, ``turns = (mine, theirs, before)``: each waits on its
        own and arrives on the other's once its batch is issued), so the tensor cores run one
        warpgroup's batch while the other promotes its partial. Free-running, both wait for
        the same stage and promote at the same time with the tensor cores idle: FC1 on dsv3
        ran 7-10 % slower at 1980 MHz (2026-12-04). ``before`` is 0 only for warpgroup 0's
        first tile of the kernel, whose first batch (``k`` == 0, N-half 0) opens the turns
        without waiting; ``k`` None: a batch that always waits. Its last arrive is never
        waited on (a named barrier needs no balance at exit)."""
        mine, _, before = turns
        if const_expr(k is None):
            mine.arrive_and_wait()
        else:
            if before + k != 0:
                mine.arrive_and_wait()

    def half_fragments(self, half_mma, sA, sB, mma_slice):
        """One N-half's wgmma fragments for MMA thread slice ``mma_slice``: A as it is, B's
        two row halves, and the half-wide fp32 partial -> (tCrA, tCrB, tCrB_up, partial).
        Traced inline."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        thr_half = half_mma.get_slice(mma_slice)
        sB_halves = cute.flat_divide(sB, (tile_n // 2, tile_k))
        tCrA = half_mma.make_fragment_A(thr_half.partition_A(sA))
        tCrB = half_mma.make_fragment_B(thr_half.partition_B(sB_halves[(None, None, 0, 0, None)]))
        tCrB_up = half_mma.make_fragment_B(
            thr_half.partition_B(sB_halves[(None, None, 1, 0, None)]))
        partial = cute.make_rmem_tensor(thr_half.partition_shape_C((tile_m, tile_n // 2)),
                                        self.acc_dtype)
        return tCrA, tCrB, tCrB_up, partial

    def make_half_mma(self):
        """The wgmmas of one N-half of a 256-wide FP8 tile: the same rows, half the columns."""
        return sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, cute.nvgpu.warpgroup.OperandMajorMode.K,
            cute.nvgpu.warpgroup.OperandMajorMode.K, self.acc_dtype, self.atom_layout_mnk,
            tiler_mn=(64, self.tile_shape_mnk[1] // 2))

    def promote_half(self, acc: cute.Tensor, partial: cute.Tensor, half: int, ea0: Int32,
                     ea1: Int32, eb: Int32):
        """acc[N-half ``half``] += 2^(e_a[row] + e_b) * partial: the half's accumulator
        elements are the flattened accumulator's ``half``-th half (8-column chunks in order),
        with one W block a half (store: the tile's two blocks; swiglu: W_gate's, then W_up's).
        Traced inline."""
        scales = (pow2_f32(ea0 + eb), pow2_f32(ea1 + eb))
        accv = cute.flatten(acc)
        partv = cute.flatten(partial)
        base = half * cute.size(partv)
        for v in range(cute.size(partv)):
            accv[base + v] = ffma(partv[v], scales[(v // 2) % 2], accv[base + v])

    @cute.jit
    def half_promoting_mainloop(self, ab_pipeline, half_mma, acc, partial, tCrA, tCrB, tCrB_up,
                                loads: Int32, k_tiles: Int32,
                                num_k_blocks: cutlass.Constexpr[int], exps,
                                first_exps_after_wait: cutlass.Constexpr[bool] = False,
                                hook_args=None, turns=None):
        """One 256-wide tile over its ``k_tiles`` 128-deep groups, from stage use ``loads`` on:
        per group, N-half 0's wgmmas into the half-wide partial, wait, promote; then N-half 1's,
        wait, release the stage, promote. The tensor cores wait for each half's promotion (the
        partial is reused); the A tile is read from smem for 256 columns. The next group's
        exponents load under half 1's wgmmas; group 0's before the first stage wait (inputs
        written before the launch), or with ``first_exps_after_wait`` under the first group's
        half 0 wgmmas, after its stage's wait (rows that other CTAs of the launch write: the
        wait orders them). ``hook_args`` (the megakernel's recorder builds): the core's
        ``first_stage_wait`` / ``first_stage_ready`` hooks around the first stage's wait.
        ``turns`` (the expert path's FC1): each half's batch is issued in this warpgroup's
        turn (``wait_mma_turn``), so the other warpgroup's wgmmas run while it promotes."""
        read = pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages, loads)
        acc.fill(0.0)
        ea0, ea1, eb0, eb1 = Int32(0), Int32(0), Int32(0), Int32(0)
        if const_expr(not first_exps_after_wait):
            ea0, ea1, eb0, eb1 = self.group_exponents(exps, Int32(0))
        t0 = self.first_stage_wait(hook_args) if const_expr(hook_args is not None) else None
        for k in range(k_tiles):
            ab_pipeline.consumer_wait(read)
            if const_expr(hook_args is not None):
                if k == 0:
                    self.first_stage_ready(t0, hook_args)
            self.stage_ready(None)
            for half in cutlass.range_constexpr(2):
                if const_expr(turns is not None):
                    self.wait_mma_turn(turns, k if const_expr(half == 0) else None)
                # the wgmma issue written out, as in TwoPartialMainloop.two_partial_mainloop: the
                # DSL loses the accumulate field set in a helper called from this run-time loop
                cute.nvgpu.warpgroup.fence()
                tCrB_half = (tCrB, tCrB_up)[half]
                for kb in cutlass.range_constexpr(num_k_blocks):
                    half_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb != 0)
                    cute.gemm(half_mma, partial, tCrA[(None, None, kb, read.index)],
                              tCrB_half[(None, None, kb, read.index)], partial)
                cute.nvgpu.warpgroup.commit_group()
                if const_expr(turns is not None):
                    turns[1].arrive()
                if const_expr(half == 0 and first_exps_after_wait):
                    if k == 0:  # group 0's, under its own wgmmas
                        ea0, ea1, eb0, eb1 = self.group_exponents(exps, Int32(0))
                if const_expr(half == 1):  # the next group's, under the wgmmas
                    nxt = self.group_exponents(exps, cutlass.min(k + 1, k_tiles - 1))
                cute.nvgpu.warpgroup.wait_group(0)
                if const_expr(half == 1):
                    ab_pipeline.consumer_release(read)
                    read.advance()
                self.promote_half(acc, partial, half, ea0, ea1, (eb0, eb1)[half])
            ea0, ea1, eb0, eb1 = nxt
        half_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        return read
