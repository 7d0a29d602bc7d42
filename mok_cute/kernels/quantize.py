"""FP8 quantizer kernels (issue 33, item 1): bf16 -> E4M3 with power-of-two scales, bit for bit
the PyTorch reference ``mok_cute.fp8`` (the numerics, the scale rule and its proof live there).

``QuantizeRows``
    1 x 128 groups along K (x before FC1, h, d_out rows): ``x [M, K]`` -> ``q [M, K]``,
    ``e [M, K/128]``. A half-warp per group: each lane loads one 16-byte vector (8 bf16),
    the group's amax is an integer max over the 16 lanes (4 butterfly shuffles), each lane
    stores 8 e4m3 bytes (one 64-bit store) and lane 0 of the half the exponent.
``QuantizeCols``
    The column-quantized transposed copy a weight gradient reads (x, h, d_out rows, dG, dU):
    groups of 128 along M, ``x [M, K]`` -> ``qt [K, M]``, ``e [K, M/128]``. A warp per
    128 x 32 tile of x: lane (tr, tc) = (lane / 4, lane % 4) loads rows 16 tr .. 16 tr + 15 of
    the 8 columns 8 tc .. 8 tc + 7 (sixteen 16-byte loads), each column's amax is an integer
    max over the 16 rows and the 8 lanes of that tc (3 shuffles), and each lane stores 16
    e4m3 bytes per column (one 128-bit store; the 8 lanes of a tc write a full 128-byte row
    of qt).
``QuantizeBlocks``
    Weights in 128 x 128 blocks, once per weight update: ``w [E, N, K]`` -> ``q [E, N', K']``
    and / or the exact transposed copy ``qt [E, K', N']`` (the same bytes, the same scale per
    block), ``e [E, N'/128, K'/128]`` / ``et [E, K'/128, N'/128]``, where N', K' are N, K
    rounded up to whole blocks: w is read in place and its missing rows and columns count as
    zeros (bitwise the reference on ``w`` zero-padded, without the padded copy). A CTA of 4
    warps per block, each warp the column kernel's 128 x 32 tile; the block's amax crosses the
    warps in smem.

Numerics (``mok_cute.fp8``): amax is the integer max of the bf16 bit patterns with the sign
cleared (a NaN's pattern is above inf's); ``e = max(B - 135 + (m > 0x600000), -127)`` from the
fp32 pattern ``amax << 16`` (B its biased exponent, m its mantissa), ``127`` when the group holds
an inf or a NaN; the data is ``mul.rn.f32`` by ``2**-e`` (built as ``(127 - e) << 23``, a normal
fp32) then ``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even, saturating; it never
saturates a finite group), all in inline PTX so nothing is fused, flushed or approximated;
a non-finite group's data is written as NaN (0x7F). The kernels read and write raw bits:
x as int32 pairs of bf16, q as int32 quads of e4m3 (the torch entry points pass ``.view``s).

Constraints: bf16 in, row-major with 16-byte aligned rows; rows: ``K % 128 == 0``; cols:
``M % 128 == 0``, ``K % 8 == 0``; blocks: ``K % 8 == 0`` (any N; both padded to 128).

Row index (``gather``; ``row_index=`` of ``quantize_rows`` / ``quantize_cols`` /
``quantize_cols_per_expert``): output row r is read from row ``row_index[r]`` of x ``[T, K]``
(any T; a zero row where the index is outside ``[0, T)``), bitwise the quantizer on
``token_ops.gather_rows_ref(x, row_index)`` without the gathered bf16 copy. The index is int32
``[M]``, contiguous and 16-byte aligned (cols: ``M % 128 == 0``).

Each kernel has a tensor-free compile function on fake tensors with run-time extents and
strides (``compile_quantize_rows`` / ``_cols`` / ``_blocks``, registered in
``mok_cute.jit.KERNELS``; TVM-FFI, no GPU needed), a torch entry point that launches the
cached compiled kernel on torch's current stream, and the reference beside it (``*_ref``,
from ``mok_cute.fp8``).

Run on a GPU host::

    python3 -c "import torch, mok_cute.kernels.quantize as k; \\
        x = torch.randn(77, 1024, device='cuda', dtype=torch.bfloat16); \\
        q, e = k.quantize_rows(x); r = k.quantize_rows_ref(x); \\
        print(torch.equal(q.view(torch.uint8), r[0].view(torch.uint8)), torch.equal(e, r[1]))"
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.memory
import cutlass.cute as cute
import torch
from cutlass import Int8, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from mok_cute import fp8, jit
from mok_cute.config import check_int, describe
from mok_cute.kernels import common

GROUP = fp8.GROUP
_NAN4 = fp8.E4M3_NAN_BITS * 0x01010101  # four e4m3 NaN bytes
_LO_MASK = 0x7FFF  # a bf16 pattern without its sign
_HI_HALF = -65536  # 0xFFFF0000: the upper bf16 of a word, in place, is its fp32 pattern

quantize_rows_ref = fp8.quantize_rows
quantize_cols_ref = fp8.quantize_cols
quantize_cols_per_expert_ref = fp8.quantize_cols_per_expert
quantize_blocks_ref = fp8.quantize_blocks


# ---------------------------------------------------------------------- device helpers
@dsl_user_op
def e4m3x4(f0: Int32, f1: Int32, f2: Int32, f3: Int32, mult: Int32, *, loc=None, ip=None) -> Int32:
    """Four e4m3 bytes (``f0``'s in the low byte) of the fp32 values with bit patterns
    ``f0 .. f3``, each times the fp32 ``mult`` (bit pattern): ``mul.rn.f32`` then
    ``cvt.rn.satfinite.e4m3x2.f32``, no FTZ, nothing fused. ``cvt ... d, a, b`` puts a's byte
    above b's, so each pair goes in (high, low) order. Each input's sign bit is then OR-ed
    into its byte: a no-op wherever the conversion keeps the sign, and it makes a value that
    rounds to zero a signed zero (as the reference's conversion gives) whatever the hardware
    does with the sign of a zero result."""
    args = [Int32(v).ir_value(loc=loc, ip=ip) for v in (f0, f1, f2, f3, mult)]
    return Int32(
        llvm.inline_asm(
            T.i32(),
            args,
            "{\n.reg .f32 a, b, c, d;\n.reg .b16 lo, hi;\n.reg .b32 q, s, t;\n"
            "mov.b32 a, $1;\nmov.b32 b, $2;\nmov.b32 c, $3;\nmov.b32 d, $4;\n"
            "mul.rn.f32 a, a, $5;\nmul.rn.f32 b, b, $5;\nmul.rn.f32 c, c, $5;\nmul.rn.f32 d, d, $5;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, b, a;\ncvt.rn.satfinite.e4m3x2.f32 hi, d, c;\n"
            "mov.b32 q, {lo, hi};\n"
            "shr.b32 s, $1, 31;\nshl.b32 s, s, 7;\n"
            "shr.b32 t, $2, 31;\nshl.b32 t, t, 15;\nor.b32 s, s, t;\n"
            "shr.b32 t, $3, 31;\nshl.b32 t, t, 23;\nor.b32 s, s, t;\n"
            "and.b32 t, $4, 0x80000000;\nor.b32 s, s, t;\n"
            "or.b32 $0, q, s;\n}",
            "=r,r,r,r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def bf16_abs_max(word: Int32, acc: Int32) -> Int32:
    """``acc`` maxed with the sign-less bit patterns of the two bf16 in ``word`` (integers:
    for non-negative floats integer order is float order, NaN above inf). Traced inline."""
    return cutlass.max(acc, cutlass.max(word & _LO_MASK, (word >> 16) & _LO_MASK))


def bf16_half_abs(word: Int32, half: int) -> Int32:
    """The sign-less bit pattern of bf16 number ``half`` (0 low, 1 high) of ``word``."""
    return (word >> 16) & _LO_MASK if half else word & _LO_MASK


def bf16_as_f32_bits(word: Int32, half: int) -> Int32:
    """The fp32 bit pattern of bf16 number ``half`` of ``word`` (exact: a shift or a mask)."""
    return word & _HI_HALF if half else word << 16


def scale_exponent(amax16: Int32):
    """(e, mult, nonfinite) of a group whose amax has the bf16 pattern ``amax16``: the scale
    exponent of ``mok_cute.fp8.scale_exponent_from_bits``, the fp32 pattern of ``2**-e`` and
    whether the group holds an inf or a NaN. Integer arithmetic only; traced inline."""
    bits = amax16 << 16
    e = (bits >> 23) - 135 + cutlass.select_((bits & 0x7FFFFF) > 0x600000, Int32(1), Int32(0))
    e = cutlass.max(e, Int32(fp8.EXP_MIN))
    nonfinite = bits >= 0x7F800000
    e = cutlass.select_(nonfinite, Int32(fp8.EXP_NONFINITE), e)
    mult = (127 - e) << 23  # 2**-e: a normal fp32 for e in [-127, 126]; 0 for a NaN group
    return e, mult, nonfinite


def quantize_quad(f0: Int32, f1: Int32, f2: Int32, f3: Int32, mult: Int32, nonfinite) -> Int32:
    """Four e4m3 bytes of four fp32 patterns in a group of exponent ``2**-e = mult``; NaN
    bytes for a non-finite group."""
    return cutlass.select_(nonfinite, Int32(_NAN4), e4m3x4(f0, f1, f2, f3, mult))


def _copy_atom(dtype, bits: int) -> cute.CopyAtom:
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)


def _warp_max(value: Int32, offsets) -> Int32:
    for off in offsets:
        value = cutlass.max(value, cute.arch.shuffle_sync_bfly(value, offset=off))
    return value


class _ColumnTile:
    """The 128 x 32 tile of a warp in ``QuantizeCols`` and ``QuantizeBlocks``: lane (tr, tc)
    holds rows 16 tr .. 16 tr + 15 of columns 8 tc .. 8 tc + 7 as ``words (4, 16)`` (int32
    pairs of bf16; element (row i, column c) is half c % 2 of word (c / 2, i))."""

    ROWS_PER_LANE = 16
    LANE_ROWS = 8  # tr
    LANE_COLS = 4  # tc

    @staticmethod
    def lane_coords():
        lane = cute.arch.lane_idx()
        return lane // _ColumnTile.LANE_COLS, lane % _ColumnTile.LANE_COLS

    @staticmethod
    def load(gX: cute.Tensor, first_row: Int32, tr: Int32, kv: Int32, words: cute.Tensor):
        """This lane's 16 rows (from ``first_row + 16 tr``) of its vector ``kv`` of 8 columns
        into ``words``; ``gX`` is x as (1, 4, M, K/8) int32."""
        for i in range(_ColumnTile.ROWS_PER_LANE):
            row = first_row + tr * _ColumnTile.ROWS_PER_LANE + i
            cute.copy(_copy_atom(Int32, 128), gX[0, None, row, kv], words[None, i])

    @staticmethod
    def column_amax(words: cute.Tensor, c: int) -> Int32:
        """This lane's amax (bf16 pattern) of column c over its 16 rows."""
        a = Int32(0)
        for i in range(_ColumnTile.ROWS_PER_LANE):
            a = cutlass.max(a, bf16_half_abs(words[c // 2, i], c % 2))
        return a

    @staticmethod
    def column_quads(words: cute.Tensor, c: int, mult: Int32, nonfinite, out: cute.Tensor):
        """Column c's 16 e4m3 bytes (rows in order) into ``out (4,)`` int32."""
        for j in range(4):
            f = [bf16_as_f32_bits(words[c // 2, 4 * j + r], c % 2) for r in range(4)]
            out[j] = quantize_quad(f[0], f[1], f[2], f[3], mult, nonfinite)

    @staticmethod
    def row_quads(words: cute.Tensor, i: int, mult: Int32, nonfinite, out: cute.Tensor):
        """Row i's 8 e4m3 bytes (columns in order) into ``out (2,)`` int32."""
        for j in range(2):
            w0, w1 = words[2 * j, i], words[2 * j + 1, i]
            out[j] = quantize_quad(bf16_as_f32_bits(w0, 0), bf16_as_f32_bits(w0, 1),
                                   bf16_as_f32_bits(w1, 0), bf16_as_f32_bits(w1, 1), mult, nonfinite)


# ---------------------------------------------------------------------- kernels
class QuantizeRows:
    """1 x 128 groups along K: a half-warp per group, 16 bytes of bf16 per lane.

    :param scatter_k: 0, or K: each row t of x is also the source of the K destination rows
        ``rows[t * K + k]`` (-1: none), which its quantized groups and exponents are written to
        instead of row t (the FP8 expert path's x, quantized once per token straight into
        expert order: the scatter's pass over the e4m3 rows and the exponent gather gone).
    :param gather: the opposite direction: output row r is the quantization of row
        ``row_index[r]`` of x (a zero row, exponents -127, where that is outside ``[0, T)``):
        ``quantize_rows(gather_rows(x, row_index))`` without the gathered bf16 copy. Each lane
        reads its row's index once (the 16 lanes of a group read the same word)."""

    LANES_PER_GROUP = 16

    def __init__(self, num_warps: int = 4, scatter_k: int = 0, gather: bool = False):
        if scatter_k and gather:
            raise ValueError(f"scatter_k, gather: expected at most one of them, got scatter_k = "
                             f"{scatter_k} and gather = True")
        self.num_warps = num_warps
        self.scatter_k = scatter_k
        self.gather = bool(gather)
        self.num_threads = None

    def _setup_attributes(self):
        self.num_threads = 32 * self.num_warps

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mE: cute.Tensor,
                 mRows: Optional[cute.Tensor], stream):
        """mX (M, K/2) int32 (bf16 pairs), mQ (M', K/4) int32 (e4m3 quads), mE (M', K/128) int8;
        mRows int32 (M * scatter_k) with scatter_k (M' any); with ``gather`` the row index
        (M',) int32 (M any: x's rows are read through it); else None (M' = M)."""
        self._setup_attributes()
        groups = mE.shape[1]
        units = mX.shape[0] * groups
        if const_expr(self.gather):
            units = mQ.shape[0] * groups  # the output's rows
        warps = (units + 1) // 2
        grid_x = (warps + self.num_warps - 1) // self.num_warps
        self.kernel(mX, mQ, mE, mRows, units, groups).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mE: cute.Tensor,
               mRows: Optional[cute.Tensor], units: Int32, groups: Int32):
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        sub = lane % self.LANES_PER_GROUP
        unit = (bidx * self.num_warps + warp) * 2 + lane // self.LANES_PER_GROUP
        valid = unit < units
        row = unit // groups
        g = unit - row * groups
        vec = g * self.LANES_PER_GROUP + sub  # this lane's 8-element vector of the row
        gX = cute.flat_divide(mX, (1, 4))  # (1, 4, M, K/8): 16 bytes of bf16
        gQ = cute.flat_divide(mQ, (1, 2))  # (1, 2, M, K/8): 8 bytes of e4m3
        words = cute.make_rmem_tensor((4,), Int32)
        words.fill(0)
        if const_expr(self.gather):
            src = Int32(-1)
            if valid:
                src = mRows[row]
            if src >= 0 and src < mX.shape[0]:  # else a zero row
                cute.copy(_copy_atom(Int32, 128), gX[0, None, src, vec], words)
        elif valid:
            cute.copy(_copy_atom(Int32, 128), gX[0, None, row, vec], words)
        amax = Int32(0)
        for j in cutlass.range_constexpr(4):
            amax = bf16_abs_max(words[j], amax)
        # every lane shuffles (idle halves with zeros): offsets < 16 stay inside a half-warp
        amax = _warp_max(amax, (8, 4, 2, 1))
        e, mult, nonfinite = scale_exponent(amax)
        out = cute.make_rmem_tensor((2,), Int32)
        for j in cutlass.range_constexpr(2):
            w0, w1 = words[2 * j], words[2 * j + 1]
            out[j] = quantize_quad(bf16_as_f32_bits(w0, 0), bf16_as_f32_bits(w0, 1),
                                   bf16_as_f32_bits(w1, 0), bf16_as_f32_bits(w1, 1), mult, nonfinite)
        if const_expr(self.scatter_k):
            for k in cutlass.range_constexpr(self.scatter_k):
                dest = Int32(-1)
                if valid:
                    dest = mRows[row * self.scatter_k + k]
                if dest >= 0:
                    cute.copy(_copy_atom(Int32, 64), out, gQ[0, None, dest, vec])
                    if sub == 0:
                        mE[dest, g] = Int8(e)
        elif valid:
            cute.copy(_copy_atom(Int32, 64), out, gQ[0, None, row, vec])
            if sub == 0:
                mE[row, g] = Int8(e)


class QuantizeCols:
    """Groups of 128 rows per column, written transposed: a warp per 128 x 32 tile of x.

    :param gather: read row r of the tile from row ``row_index[r]`` of x (a zero row where
        that is outside ``[0, T)``): the quantization of ``gather_rows(x, row_index)`` without
        the gathered bf16 copy (``_load_indexed``)."""

    TILE_K = 32

    def __init__(self, num_warps: int = 4, gather: bool = False):
        self.num_warps = num_warps
        self.gather = bool(gather)
        self.num_threads = None

    def _setup_attributes(self):
        self.num_threads = 32 * self.num_warps

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mE: cute.Tensor,
                 mRowIndex: Optional[cute.Tensor], stream):
        """mX (M, K/2) int32 (bf16 pairs), mQ (K, M/4) int32 (e4m3 quads), mE (K, M/128) int8;
        with ``gather`` mRowIndex (M,) int32 (16-byte aligned) and mX (T, K/2) for any T, else
        None."""
        self._setup_attributes()
        k_vecs = mQ.shape[0] // 8
        k_tiles = (mQ.shape[0] + self.TILE_K - 1) // self.TILE_K
        units = mE.shape[1] * k_tiles
        grid_x = (units + self.num_warps - 1) // self.num_warps
        self.kernel(mX, mQ, mE, mRowIndex, units, k_tiles, k_vecs).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mE: cute.Tensor,
               mRowIndex: Optional[cute.Tensor], units: Int32, k_tiles: Int32, k_vecs: Int32):
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tr, tc = _ColumnTile.lane_coords()
        unit = bidx * self.num_warps + warp
        mg = unit // k_tiles  # the group of 128 rows
        kt = unit - mg * k_tiles
        kv = kt * (self.TILE_K // 8) + tc  # this lane's vector of 8 columns
        valid = unit < units and kv < k_vecs
        gX = cute.flat_divide(mX, (1, 4))  # (1, 4, M, K/8)
        gQ = cute.flat_divide(mQ, (1, 4))  # (1, 4, K, M/16)
        gIndex = self._row_sources(mRowIndex)
        words = cute.make_rmem_tensor((4, _ColumnTile.ROWS_PER_LANE), Int32)
        self._load(gX, gIndex, mg, tr, kv, valid, words)
        out = cute.make_rmem_tensor((4,), Int32)
        for c in cutlass.range_constexpr(8):
            # the 8 lanes of a tc are lanes tc + 4 tr: xor 4, 8, 16
            amax = _warp_max(_ColumnTile.column_amax(words, c), (4, 8, 16))
            e, mult, nonfinite = scale_exponent(amax)
            _ColumnTile.column_quads(words, c, mult, nonfinite, out)
            if valid:
                col = kv * 8 + c
                cute.copy(_copy_atom(Int32, 128), out, gQ[0, None, col, mg * 8 + tr])
                if tr == 0:
                    mE[col, mg] = Int8(e)

    def _row_sources(self, mRowIndex: Optional[cute.Tensor]):
        """With ``gather``, the row index as (4, M/4) int32: four rows' sources to a 128-bit
        load; else None."""
        return cute.flat_divide(mRowIndex, (4,)) if const_expr(self.gather) else None

    @cute.jit
    def _load(self, gX: cute.Tensor, gIndex: Optional[cute.Tensor], g: Int32, tr: Int32,
              kv: Int32, valid, words: cute.Tensor):
        """This lane's 16 rows of 128-row group ``g`` (zeros where not ``valid``); with
        ``gather`` through the row index ``gIndex``."""
        words.fill(0)
        if valid:
            if const_expr(self.gather):
                self._load_indexed(gX, gIndex, g * GROUP, tr, kv, words)
            else:
                _ColumnTile.load(gX, g * GROUP, tr, kv, words)

    @cute.jit
    def _load_indexed(self, gX: cute.Tensor, gIndex: cute.Tensor, first_row: Int32, tr: Int32,
                      kv: Int32, words: cute.Tensor):
        """``_ColumnTile.load`` through the row index: this lane's 16 rows r (from
        ``first_row + 16 tr``) read row ``index[r]`` of x, a zero row where that is outside
        ``[0, T)`` (``words`` holds zeros). ``gIndex`` is the index as (4, M/4) int32: a row's
        source is looked up once per load of the group, four rows to a 128-bit load (the four
        lanes of a tr read the same 64 bytes), then the 16 predicated row loads."""
        num_src = gX.shape[2]
        src = cute.make_rmem_tensor((4,), Int32)
        quad0 = (first_row + tr * _ColumnTile.ROWS_PER_LANE) // 4
        for j in cutlass.range_constexpr(_ColumnTile.ROWS_PER_LANE // 4):
            cute.copy(_copy_atom(Int32, 128), gIndex[None, quad0 + j], src)
            for r in cutlass.range_constexpr(4):
                if src[r] >= 0 and src[r] < num_src:
                    cute.copy(_copy_atom(Int32, 128), gX[0, None, src[r], kv],
                              words[None, 4 * j + r])


class QuantizeColsPerExpert(QuantizeCols):
    """One scale per column and expert, written transposed: a warp per (expert, 32-column
    strip) walks the expert's 128-row groups twice, first for the columns' amax, then to
    quantize, with ``QuantizeCols``' 128 x 32 tiles; rows outside every expert are not
    written.

    :param gather: read row r of the tile from row ``row_index[r]`` of x (a zero row where
        that is outside ``[0, T)``): the quantization of ``gather_rows(x, row_index)`` without
        the gathered bf16 copy (the FP8 weight gradients' x rows)."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mE: cute.Tensor,
                 mOffsets: cute.Tensor, mRowIndex: Optional[cute.Tensor], stream):
        """mX (M, K/2) int32 (bf16 pairs), mQ (K, M/4) int32 (e4m3 quads), mE (E, K) int8,
        mOffsets (E + 1,) int32 the experts' first rows (multiples of 128); with ``gather``
        mRowIndex (M,) int32 (16-byte aligned) and mX (T, K/2) for any T, else None."""
        self._setup_attributes()
        k_vecs = mQ.shape[0] // 8
        k_tiles = (mQ.shape[0] + self.TILE_K - 1) // self.TILE_K
        units = mE.shape[0] * k_tiles
        grid_x = (units + self.num_warps - 1) // self.num_warps
        self.kernel(mX, mQ, mE, mOffsets, mRowIndex, units, k_tiles, k_vecs).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mE: cute.Tensor, mOffsets: cute.Tensor,
               mRowIndex: Optional[cute.Tensor], units: Int32, k_tiles: Int32, k_vecs: Int32):
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tr, tc = _ColumnTile.lane_coords()
        unit = bidx * self.num_warps + warp
        expert = unit // k_tiles
        kt = unit - expert * k_tiles
        kv = kt * (self.TILE_K // 8) + tc  # this lane's vector of 8 columns
        valid = unit < units and kv < k_vecs
        g0, g1 = Int32(0), Int32(0)
        if unit < units:
            g0 = mOffsets[expert] // GROUP
            g1 = mOffsets[expert + 1] // GROUP
        gX = cute.flat_divide(mX, (1, 4))  # (1, 4, M, K/8)
        gQ = cute.flat_divide(mQ, (1, 4))  # (1, 4, K, M/16)
        gIndex = self._row_sources(mRowIndex)
        words = cute.make_rmem_tensor((4, _ColumnTile.ROWS_PER_LANE), Int32)
        amax = cute.make_rmem_tensor((8,), Int32)
        amax.fill(0)
        for g in cutlass.range(g0, g1, unroll=1):  # the columns' amax over the expert's rows
            self._load(gX, gIndex, g, tr, kv, valid, words)
            for c in cutlass.range_constexpr(8):
                amax[c] = cutlass.max(amax[c], _ColumnTile.column_amax(words, c))
        mult = cute.make_rmem_tensor((8,), Int32)
        nonfinite = cute.make_rmem_tensor((8,), cutlass.Boolean)
        for c in cutlass.range_constexpr(8):
            e, mult[c], nonfinite[c] = scale_exponent(_warp_max(amax[c], (4, 8, 16)))
            if valid and tr == 0:
                mE[expert, kv * 8 + c] = Int8(e)
        out = cute.make_rmem_tensor((4,), Int32)
        for g in cutlass.range(g0, g1, unroll=1):  # quantize with the expert's column scales
            self._load(gX, gIndex, g, tr, kv, valid, words)
            for c in cutlass.range_constexpr(8):
                _ColumnTile.column_quads(words, c, mult[c], nonfinite[c], out)
                if valid:
                    cute.copy(_copy_atom(Int32, 128), out, gQ[0, None, kv * 8 + c, g * 8 + tr])


class QuantizeBlocks:
    """128 x 128 weight blocks: a CTA of 4 warps per block, each warp a 128 x 32 column tile;
    writes ``q`` (row-major like w) and / or ``qt`` (the exact transposed copy)."""

    NUM_WARPS = GROUP // QuantizeCols.TILE_K

    def __init__(self, write_q: bool = True, write_qt: bool = True):
        if not (write_q or write_qt):
            raise ValueError("write_q, write_qt: expected at least one output, got both False")
        self.write_q = bool(write_q)
        self.write_qt = bool(write_qt)
        self.num_threads = None

    def _setup_attributes(self):
        self.num_threads = 32 * self.NUM_WARPS

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: Optional[cute.Tensor], mE: Optional[cute.Tensor],
                 mQt: Optional[cute.Tensor], mEt: Optional[cute.Tensor], stream):
        """mX (E, N, K/2) int32 (bf16 pairs); mQ (E, N', K'/4) int32, mE (E, N'/128, K'/128)
        int8; mQt (E, K', N'/4) int32, mEt (E, K'/128, N'/128) int8 (None where not written);
        N', K' = N, K rounded up to 128."""
        self._setup_attributes()
        n_blocks = (mX.shape[1] + GROUP - 1) // GROUP
        k_blocks = (mX.shape[2] + GROUP // 2 - 1) // (GROUP // 2)
        self.kernel(mX, mQ, mE, mQt, mEt).launch(
            grid=[k_blocks, n_blocks, mX.shape[0]], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: Optional[cute.Tensor], mE: Optional[cute.Tensor],
               mQt: Optional[cute.Tensor], mEt: Optional[cute.Tensor]):
        kb, nb, b = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tr, tc = _ColumnTile.lane_coords()
        smem = cutlass.memory.SmemAllocator()
        warp_amax = smem.allocate_tensor(Int32, cute.make_layout(self.NUM_WARPS), 16)
        kv = kb * (GROUP // 8) + warp * (QuantizeCols.TILE_K // 8) + tc  # vector of 8 columns
        row0 = nb * GROUP + tr * _ColumnTile.ROWS_PER_LANE
        gX = cute.flat_divide(mX, (1, 1, 4))  # (1, 1, 4, E, N, K/8)
        words = cute.make_rmem_tensor((4, _ColumnTile.ROWS_PER_LANE), Int32)
        words.fill(0)  # rows and columns past w's: the zero padding
        in_cols = kv * 4 < mX.shape[2]
        for i in cutlass.range_constexpr(_ColumnTile.ROWS_PER_LANE):
            if in_cols and row0 + i < mX.shape[1]:
                cute.copy(_copy_atom(Int32, 128), gX[0, 0, None, b, row0 + i, kv], words[None, i])
        amax = Int32(0)
        for j in cutlass.range_constexpr(4):
            for i in cutlass.range_constexpr(_ColumnTile.ROWS_PER_LANE):
                amax = bf16_abs_max(words[j, i], amax)
        amax = _warp_max(amax, (16, 8, 4, 2, 1))
        if cute.arch.lane_idx() == 0:
            warp_amax[warp] = amax
        cute.arch.sync_threads()
        for w in cutlass.range_constexpr(self.NUM_WARPS):
            amax = cutlass.max(amax, warp_amax[w])
        e, mult, nonfinite = scale_exponent(amax)
        if const_expr(self.write_q):
            gQ = cute.flat_divide(mQ, (1, 1, 2))  # (1, 1, 2, E, N, K/8)
            out = cute.make_rmem_tensor((2,), Int32)
            for i in cutlass.range_constexpr(_ColumnTile.ROWS_PER_LANE):
                _ColumnTile.row_quads(words, i, mult, nonfinite, out)
                cute.copy(_copy_atom(Int32, 64), out, gQ[0, 0, None, b, row0 + i, kv])
        if const_expr(self.write_qt):
            gQt = cute.flat_divide(mQt, (1, 1, 4))  # (1, 1, 4, E, K, N/16)
            out_t = cute.make_rmem_tensor((4,), Int32)
            for c in cutlass.range_constexpr(8):
                _ColumnTile.column_quads(words, c, mult, nonfinite, out_t)
                cute.copy(_copy_atom(Int32, 128), out_t, gQt[0, 0, None, b, kv * 8 + c, nb * 8 + tr])
        if warp == 0 and cute.arch.lane_idx() == 0:
            if const_expr(self.write_q):
                mE[b, nb, kb] = Int8(e)
            if const_expr(self.write_qt):
                mEt[b, kb, nb] = Int8(e)


# ---------------------------------------------------------------------- compile (no GPU)
def _fake_words(rows, cols_div: int):
    """Fake row-major (rows, cols) int32 with a run-time row stride keeping rows 16-B aligned."""
    return common.fake_strided_tensor(Int32, (rows, cute.sym_int32(divisibility=cols_div)))


def _fake_exponents(rows, cols):
    return common.fake_strided_tensor(Int8, (rows, cols), align_bytes=1)


def _compile(op, args, arch: str, options: str):
    return cute.compile(op, *args, common.fake_stream(),
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))


def compile_quantize_rows(arch: str = "sm_90a", *, options: str = "", num_warps: int = 4,
                          scatter_k: int = 0, gather: bool = False):
    """Compile ``QuantizeRows`` on fake tensors: M and K (a multiple of 128) at run time;
    ``scatter_k``: the destination rows' count M' too, and the int32 row map; ``gather``:
    x's row count T (any) too, and the int32 row index [M] (16-byte aligned)."""
    m = cute.sym_int32()
    dest = cute.sym_int32() if scatter_k else m
    rows = common.fake_vector(Int32) if scatter_k else None
    if gather:
        rows = common.fake_vector(Int32, m, align_bytes=16)
    args = (_fake_words(cute.sym_int32() if gather else m, GROUP // 2),
            _fake_words(dest, GROUP // 4), _fake_exponents(dest, cute.sym_int32()), rows)
    return _compile(QuantizeRows(num_warps=num_warps, scatter_k=scatter_k, gather=gather), args,
                    arch, options)


def compile_quantize_cols(arch: str = "sm_90a", *, options: str = "", num_warps: int = 4,
                          gather: bool = False):
    """Compile ``QuantizeCols`` on fake tensors: M (a multiple of 128) and K (of 8) at run time;
    ``gather``: x's row count T (any) too, and the int32 row index [M] (16-byte aligned)."""
    m, k = cute.sym_int32(divisibility=GROUP), cute.sym_int32(divisibility=8)
    args = (_fake_words(cute.sym_int32() if gather else m, 4), _fake_words(k, GROUP // 4),
            _fake_exponents(k, cute.sym_int32()),
            common.fake_vector(Int32, m, align_bytes=16) if gather else None)
    return _compile(QuantizeCols(num_warps=num_warps, gather=gather), args, arch, options)


def compile_quantize_cols_per_expert(arch: str = "sm_90a", *, options: str = "",
                                     num_warps: int = 4, gather: bool = False):
    """Compile ``QuantizeColsPerExpert`` on fake tensors: M (a multiple of 128), K (of 8) and
    the expert count at run time; ``gather``: x's row count T (any) too, and the int32 row
    index [M] (16-byte aligned)."""
    m, k = cute.sym_int32(divisibility=GROUP), cute.sym_int32(divisibility=8)
    args = (_fake_words(cute.sym_int32() if gather else m, 4), _fake_words(k, GROUP // 4),
            _fake_exponents(cute.sym_int32(), k), common.fake_vector(Int32),
            common.fake_vector(Int32, m, align_bytes=16) if gather else None)
    return _compile(QuantizeColsPerExpert(num_warps=num_warps, gather=gather), args, arch, options)


def compile_quantize_blocks(arch: str = "sm_90a", *, options: str = "", write_q: bool = True,
                            write_qt: bool = True):
    """Compile ``QuantizeBlocks`` on fake tensors: E, N and K (of 8) at run time, the outputs'
    N' and K' (multiples of 128)."""
    batch = cute.sym_int32()
    n_out, k_out = cute.sym_int32(divisibility=GROUP), cute.sym_int32(divisibility=GROUP)

    def words(rows, cols_div):
        return common.fake_strided_tensor(Int32, (batch, rows, cute.sym_int32(divisibility=cols_div)))

    def exponents():
        return common.fake_strided_tensor(Int8, (batch, cute.sym_int32(), cute.sym_int32()), align_bytes=1)

    args = (words(cute.sym_int32(), 4),
            words(n_out, GROUP // 4) if write_q else None, exponents() if write_q else None,
            words(k_out, GROUP // 4) if write_qt else None, exponents() if write_qt else None)
    return _compile(QuantizeBlocks(write_q=write_q, write_qt=write_qt), args, arch, options)


# ---------------------------------------------------------------------- torch entry points
def _check_bf16(name: str, x: object, dims: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {describe(x)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name}: expected dtype bfloat16, got {x.dtype}")
    if x.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor, got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: expected a unit stride along the last dim, got strides {x.stride()}")
    return x


def _check_device(name: str, x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor for the kernel path, got {x.device}")
    if x.data_ptr() % 16 or any(s % 8 for s in x.stride()[:-1]):
        raise ValueError(f"{name}: expected 16-byte aligned rows, got address 0x{x.data_ptr():x} "
                         f"and strides {x.stride()}")


def _multiple(name: str, x: torch.Tensor, dim: int, what: str, of: int) -> None:
    if x.shape[dim] % of:
        raise ValueError(f"{name}: expected {what} (dim {dim % x.dim()}) a multiple of {of}, "
                         f"got shape {tuple(x.shape)}")


def _out(name: str, t, shape, dtype, device) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected a {dtype} tensor of shape {tuple(shape)}, got {describe(t)}")
    if t.device != device or not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"{name}: expected a contiguous, 16-byte aligned tensor on {device}, "
                         f"got {describe(t)}")
    return t


def _check_row_index(row_index: object, x: torch.Tensor, of: int = 1) -> torch.Tensor:
    """A row index: int32 ``[M]`` (M a multiple of ``of``), contiguous, 16-byte aligned, on
    x's device. Checked before anything needs CUDA (x's device is checked after it)."""
    if (not isinstance(row_index, torch.Tensor) or row_index.dtype != torch.int32
            or row_index.dim() != 1 or row_index.shape[0] % of):
        what = f" with M a multiple of {of}" if of > 1 else ""
        raise ValueError(f"row_index: expected a 1-D int32 tensor [M]{what} (the output's rows), "
                         f"got {describe(row_index)}")
    if row_index.device != x.device or not row_index.is_contiguous() or row_index.data_ptr() % 16:
        raise ValueError(f"row_index: expected a contiguous, 16-byte aligned tensor on "
                         f"{x.device} (x's device), got {describe(row_index)} at address "
                         f"0x{row_index.data_ptr():x}")
    return row_index


def _cols_input(x: object, row_index: object) -> tuple[int, int]:
    """Check a column quantizer's input: x bf16 ``[M, K]`` (M % 128 == 0), or with a row index
    (``_check_row_index``, M % 128 == 0) ``[T, K]`` for any T; K % 8 == 0. Returns (M, K)."""
    _check_bf16("x", x, 2)
    if row_index is None:
        _multiple("x", x, 0, "M", GROUP)
    _multiple("x", x, 1, "K", 8)
    if row_index is not None:
        _check_row_index(row_index, x, GROUP)
    _check_device("x", x)
    return (x.shape[0] if row_index is None else row_index.shape[0]), x.shape[1]


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).view(torch.int32)


def quantize_rows(x: torch.Tensor, out: torch.Tensor | None = None,
                  scale_out: torch.Tensor | None = None,
                  row_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_rows`` on the GPU: ``x [M, K]`` bf16 (K % 128 == 0) -> ``(q [M, K]
    float8_e4m3fn, e [M, K/128] int8)``, bitwise the reference. No host sync.

    ``row_index``: int32 ``[M]`` on x's device (any M, contiguous, 16-byte aligned), x then
    ``[T, K]`` for any T: the output is that of ``token_ops.gather_rows_ref(x, row_index)``
    (a zero row, exponents -127, where ``row_index[r]`` is outside ``[0, T)``), each row read
    from x in place (no gathered bf16 copy)."""
    _check_bf16("x", x, 2)
    _multiple("x", x, 1, "K", GROUP)
    if row_index is not None:
        _check_row_index(row_index, x)
    _check_device("x", x)
    k = x.shape[1]
    m = x.shape[0] if row_index is None else row_index.shape[0]
    q = _out("out", out, (m, k), torch.float8_e4m3fn, x.device)
    e = _out("scale_out", scale_out, (m, k // GROUP), torch.int8, x.device)
    if m and k:
        compiled = jit.compile_kernel("quantize_rows", jit.device_arch(x.device),
                                      gather=row_index is not None)
        compiled(_words(x), _bytes(q), e, row_index)
    return q, e


def quantize_packed_rows(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``quantize_rows(x)`` written as packed rows (``fp8.pack_rows``, padding bytes not
    written): ``x [M, K]`` bf16 (K % 128 == 0), ``out [M, fp8.packed_row_bytes(K)]`` uint8
    with unit stride along a row and 16-byte aligned rows (a view into a larger buffer is
    fine: the megakernel's symmetric x). Returns ``out``. No host sync."""
    _check_bf16("x", x, 2)
    _multiple("x", x, 1, "K", GROUP)
    _check_device("x", x)
    m, k = x.shape
    width = fp8.packed_row_bytes(k)
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8
            or tuple(out.shape) != (m, width) or out.device != x.device or out.stride(1) != 1
            or out.stride(0) % 16 or out.data_ptr() % 16):
        raise ValueError(f"out: expected uint8 [{m}, {width}] on {x.device}, unit stride along "
                         f"a row and 16-byte aligned rows, got {describe(out)}")
    if m and k:
        compiled = jit.compile_kernel("quantize_rows", jit.device_arch(x.device))
        q = out[:, :k].view(torch.int32)
        compiled(_words(x), q, out[:, k:k + k // GROUP].view(torch.int8), None)
    return out


def quantize_scatter_rows(x: torch.Tensor, rows: torch.Tensor, num_rows: int,
                          out: torch.Tensor | None = None,
                          scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(x)`` with each token's row written to its K destination rows instead:
    ``x [T, H]`` bf16 (H % 128 == 0), ``rows [T * K]`` int32 (the padded row of each slot, -1:
    routed nowhere; distinct) -> ``(q [num_rows, H] float8_e4m3fn, e [num_rows, H/128] int8)``
    with ``q[rows[t * K + k]] = quantize_rows(x)[0][t]`` (and e alike); other rows are not
    written. One pass over x, no host sync."""
    _check_bf16("x", x, 2)
    _multiple("x", x, 1, "K", GROUP)
    _check_device("x", x)
    t, h = x.shape
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int32 or rows.dim() != 1 \
            or not rows.is_contiguous() or rows.device != x.device:
        raise ValueError(f"rows: expected a contiguous 1-D int32 tensor on {x.device}, got "
                         f"{describe(rows)}")
    if t == 0 or rows.numel() % t:
        raise ValueError(f"rows: expected K rows per token of x (T = {t}), got {rows.numel()}")
    top_k = rows.numel() // t
    q = _out("out", out, (num_rows, h), torch.float8_e4m3fn, x.device)
    e = _out("scale_out", scale_out, (num_rows, h // GROUP), torch.int8, x.device)
    if num_rows and h:
        compiled = jit.compile_kernel("quantize_rows", jit.device_arch(x.device), scatter_k=top_k)
        compiled(_words(x), _bytes(q), e, rows)
    return q, e


def quantize_cols(x: torch.Tensor, out: torch.Tensor | None = None,
                  scale_out: torch.Tensor | None = None,
                  row_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_cols`` on the GPU: ``x [M, K]`` bf16 (M % 128 == 0, K % 8 == 0) ->
    ``(qt [K, M] float8_e4m3fn, e [K, M/128] int8)``, bitwise the reference.

    ``row_index``: int32 ``[M]`` on x's device (M % 128 == 0, contiguous, 16-byte aligned),
    x then ``[T, K]`` for any T: the output is that of ``token_ops.gather_rows_ref(x,
    row_index)`` (a zero row where ``row_index[r]`` is outside ``[0, T)``), each row read from
    x in place (no gathered bf16 copy)."""
    m, k = _cols_input(x, row_index)
    q = _out("out", out, (k, m), torch.float8_e4m3fn, x.device)
    e = _out("scale_out", scale_out, (k, m // GROUP), torch.int8, x.device)
    if m and k:
        compiled = jit.compile_kernel("quantize_cols", jit.device_arch(x.device),
                                      gather=row_index is not None)
        compiled(_words(x), _bytes(q), e, row_index)
    return q, e


def quantize_cols_per_expert(x: torch.Tensor, offsets: torch.Tensor, num_experts: int,
                             out: torch.Tensor | None = None,
                             scale_out: torch.Tensor | None = None,
                             row_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_cols_per_expert`` on the GPU: ``x [M, K]`` bf16 (M % 128 == 0,
    K % 8 == 0), ``offsets [E + 1]`` int32 on x's device (the experts' first rows, multiples
    of 128, at most M: not checked, no host sync) -> ``(qt [K, M] float8_e4m3fn, e [E, K]
    int8)``, bitwise the reference inside the experts' rows (rows outside them are not
    written).

    ``row_index``: int32 ``[M]`` on x's device (M % 128 == 0, 16-byte aligned), x then
    ``[T, K]`` for any T: the output is that of ``token_ops.gather_rows_ref(x, row_index)``
    (a zero row where ``row_index[r]`` is outside ``[0, T)``), each row read from x in place
    (no gathered bf16 copy)."""
    m, k = _cols_input(x, row_index)
    check_int("num_experts", num_experts, min_value=1)
    if (not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32
            or tuple(offsets.shape) != (num_experts + 1,) or offsets.device != x.device):
        raise ValueError(f"offsets: expected int32 [{num_experts + 1}] on {x.device}, got "
                         f"{describe(offsets)}")
    q = _out("out", out, (k, m), torch.float8_e4m3fn, x.device)
    e = _out("scale_out", scale_out, (num_experts, k), torch.int8, x.device)
    if m and k:
        gather = row_index is not None
        compiled = jit.compile_kernel("quantize_cols_per_expert", jit.device_arch(x.device),
                                      gather=gather)
        compiled(_words(x), _bytes(q), e, offsets, row_index)
    return q, e


def quantize_blocks(w: torch.Tensor, transposed: bool = False, both: bool = False, *,
                    out: tuple[torch.Tensor | None, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """``fp8.quantize_blocks`` on the GPU: ``w [N, K]`` or ``[E, N, K]`` bf16 (K % 8 == 0)
    -> ``(q, e)``, or with ``transposed=True`` the exact transposed copy ``(qt, et)``, bitwise
    the reference; ``both=True`` writes both in one pass and returns ``(q, e, qt, et)``.
    N or K not a multiple of 128: the outputs are those of w zero-padded to whole blocks
    (``q [N', K']`` etc., N', K' rounded up to 128), w read in place. ``out``: the tensors to
    write, in the order returned."""
    if not isinstance(w, torch.Tensor) or w.dim() not in (2, 3):
        raise ValueError(f"w: expected a 2-D or 3-D tensor, got {describe(w)}")
    if not isinstance(transposed, bool) or not isinstance(both, bool):
        raise TypeError(f"transposed, both: expected bools, got {describe(transposed)}, {describe(both)}")
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    _check_bf16("w", w3, 3)
    _multiple("w", w, -1, "K", 8)
    _check_device("w", w3)
    b, n, k = w3.shape
    n, k = -(-n // GROUP) * GROUP, -(-k // GROUP) * GROUP  # the outputs' whole blocks
    write_q, write_qt = both or not transposed, both or transposed
    lead = tuple(w.shape[:-2])
    shapes = {"q": lead + (n, k), "e": lead + (n // GROUP, k // GROUP),
              "qt": lead + (k, n), "et": lead + (k // GROUP, n // GROUP)}
    names = (["q", "e"] if write_q else []) + (["qt", "et"] if write_qt else [])
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != len(names)):
        raise ValueError(f"out: expected {len(names)} tensors ({', '.join(names)}), got {describe(out)}")
    given = dict(zip(names, out if out is not None else [None] * len(names)))
    made = {name: _out(f"out[{i}]", given[name], shapes[name],
                       torch.int8 if name.startswith("e") else torch.float8_e4m3fn, w.device)
            for i, name in enumerate(names)}
    full = {name: (t if w.dim() == 3 else t.unsqueeze(0)) for name, t in made.items()}
    if b and n and k:
        compiled = jit.compile_kernel("quantize_blocks", jit.device_arch(w.device), write_q=write_q,
                                      write_qt=write_qt)
        compiled(_words(w3), _bytes(full["q"]) if write_q else None, full.get("e"),
                 _bytes(full["qt"]) if write_qt else None, full.get("et"))
    return tuple(made[name] for name in names)
