"""The expert weight gradients in FP8 on Hopper (sm_90a), issue 33: ``gemm_wgrad`` on e4m3.

    C[e][m, n] = bf16( 2^e_b[e, n] * sum over the 128-row groups g of expert e's rows
                       2^e_a[g, m] * (A_q[m, rows of g] . B_q[n, rows of g]) )

- A ``(M, rows)`` (the gradients: dG, dU, d_out rows) is column-quantized per 128 rows
  (``fp8.quantize_cols``, the issue's 1 x 128 along K); B ``(N, rows)`` (the activations: x
  rows, w * h) one scale per column and expert (``fp8.quantize_cols_per_expert``). Both are
  K-major (rows contiguous), the only FP8 wgmma layout. A's exponents become group-major fp32
  scales ``(rows/128, M)`` (``scales_of``), B's fp32 ``(E, N)`` (``pow2_scales``).
- The promotion every 128-row group is one FFMA an accumulator element with the row's scale,
  ``acc += partial * 2^e_a[g, m]`` (as ``gemm_fp8``'s); the column scale multiplies the tile
  once, after its last group (16 fp32 pairs, 64-bit loads). With B per (column, group) too the
  promotion was an FMUL and an FFMA an element and the kernel instruction-bound (0.72-1.02 x
  bf16, ncu; docs/measurements.md); B per column and expert keeps each column's precision
  (e4m3's range covers a column's spread over the rows: the product's per-column error equals
  the 1 x 128 form's, tests/test_gemm_fp8_wgrad.py) and runs 1.1-1.4 x bf16.
- A thread's two rows' scales are loaded a group ahead of their promotion, under the next
  group's wgmmas (their L2 latency outlasts one group's wgmmas).
- Scales are ``2^max(e, -126)``: -127 is the exponent of an
  all-zero group (whose products are zero whatever the scale); a non-zero group with an
  exponent of -127 (amax below 448 * 2^-127, values under 1e-35) is scaled as 2^-126.
- Tiles: each consumer warpgroup owns 64 rows of M and a 64 x 128 fp32 accumulator beside two
  64 x 128 partials (192 registers: a 128-row warpgroup tile would need 256 for one); the
  promotion of group k runs while group k + 1's wgmmas do (``TwoPartialMainloop``). ``gated``: the
  two warpgroups take the same 64 weight rows of gate (A = dG^T) and up (A2 = dU^T), sharing
  every loaded x tile (B); otherwise two consecutive 64-row blocks of A. K groups are 128 rows
  (one 128-byte swizzle atom); an expert's row segment is a multiple of 128 (the receive
  schedule pads it), so no group spans two experts.
- Deterministic as ``gemm_wgrad``: one owner per output tile, its expert's groups in order.

Roles, schedule, epilogue and the expert with no rows: ``gemm_wgrad.WgradGemmSm90``, unchanged;
this class replaces the operands' types, the tile geometry and the tile's products.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int8, Int32, const_expr

from mok_cute import fp8, jit
from mok_cute.config import describe
from mok_cute.kernels import common
from mok_cute.kernels.fp8_mainloop import TwoPartialMainloop, ffma
from mok_cute.kernels.gemm_wgrad import WgradGemmSm90, wgrad_outputs

GROUP = fp8.GROUP  # 128 rows: one scale group, one k-tile
WG_ROWS = 64  # M rows per consumer warpgroup
MIN_NORMAL_EXP = -126


def pow2_scales(e: torch.Tensor) -> torch.Tensor:
    """int8 exponents -> fp32 ``2^max(e, -126)`` (module docstring), same shape."""
    bits = (e.to(torch.int32).clamp(min=MIN_NORMAL_EXP) + 127) << 23
    return bits.contiguous().view(torch.float32)


def scales_of(e: torch.Tensor) -> torch.Tensor:
    """A's int8 exponents ``[M, groups]`` -> the group-major fp32 scales ``[groups, M]`` the
    kernel reads, built once per operand on the host side."""
    return pow2_scales(e.t())


class WgradGemmFp8Sm90(TwoPartialMainloop, WgradGemmSm90):
    """Grouped weight-gradient GEMM on e4m3 with per-(column, 128-row group) scales on both
    operands and a promoting mainloop (module docstring).

    :param gated: two A operands (gate and up) sharing each B tile.
    :param group_m: M-tiles per rasterisation group inside an expert.
    :param num_sms: persistent grid size.
    :param accumulate: add into fp32 C (``gemm_wgrad``'s, after the column scales), always by
        TMA reduce-add: ``gemm_wgrad``'s "load" form tied here (FP8 weight gradients run from
        1024 rows an expert, where it stops gaining; docs/measurements.md, Tried and dropped).
    """

    def __init__(self, gated: bool, group_m: int = 4, num_sms: int = 132,
                 accumulate: bool = False):
        super().__init__(gated=gated, group_m=group_m, num_sms=num_sms, accumulate=accumulate)
        self.a_mn_major = self.b_mn_major = False  # e4m3 wgmma: K-major operands only
        self.wg_rows = WG_ROWS
        self.tile_shape_mnk = (WG_ROWS, self.tile_shape_mnk[1], GROUP)

    def operands(self, mA, mA2, mB):
        """The int8 views as e4m3. Traced inline."""
        e4m3 = cutlass.Float8E4M3FN
        return (cute.recast_tensor(mA, e4m3),
                None if mA2 is None else cute.recast_tensor(mA2, e4m3),
                cute.recast_tensor(mB, e4m3))

    # ------------------------------------------------------------------ promoting products
    # TwoPartialMainloop's hooks: a group's row scales, read under its wgmmas (their L2
    # latency outlasts one group's wgmmas: they are promoted a group later)
    scales_under_wgmma = True

    def group_scales(self, src, group: Int32):
        """This thread's two rows' scales of the tile's K group ``group`` (gated: warpgroup
        1's from ``mSA2``); ``src`` = (mSA, mSA2, warpgroup, first row, the expert's first
        group). Traced inline."""
        mSA, mSA2, wg, row0, k0 = src
        scales = []
        for r in range(2):
            s = mSA[k0 + group, row0 + 8 * r]
            if const_expr(self.gated):
                s = cutlass.select_(wg == 0, s, mSA2[k0 + group, row0 + 8 * r])
            scales.append(s)
        return tuple(scales)

    def promote_group(self, acc: cute.Tensor, partial: cute.Tensor, scales):
        """acc += partial * 2^e_a[row], the row scales of ``group_scales``. Element v of the
        accumulator ((2, 2, 16) values) sits at column 8 (v // 4) + 2 (lane % 4) + v % 2 and
        row (v // 2) % 2 * 8 + this thread's first row. Traced inline."""
        accv = cute.flatten(acc)
        partv = cute.flatten(partial)
        for v in range(cute.size(accv)):
            accv[v] = ffma(partv[v], scales[(v // 2) % 2], accv[v])

    def scale_columns(self, acc: cute.Tensor, mSB: cute.Tensor, expert: Int32, pair0: Int32):
        """acc *= 2^e_b[expert, column] once per tile: its 16 column pairs (columns 2 pair +
        {0, 1} of pair ``pair0 + 4 j``), one 64-bit load each. Traced inline."""
        pairs = cute.flat_divide(mSB, (1, 2))  # (1, 2, E, N / 2)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32,
                                   num_bits_per_copy=64)
        sb = cute.make_rmem_tensor((2, 16), cutlass.Float32)
        for j in range(16):
            cute.copy(atom, pairs[0, None, expert, pair0 + 4 * j], sb[None, j])
        accv = cute.flatten(acc)
        for v in range(cute.size(accv)):
            accv[v] = accv[v] * sb[v % 2, v // 4]

    @cute.jit
    def tile_mma(self, ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads: Int32, k_tiles: Int32,
                 num_k_blocks: cutlass.Constexpr[int], scale_args):
        """One output tile over its expert's ``k_tiles`` 128-row groups (>= 1): the two-partial
        mainloop (``fp8_mainloop.TwoPartialMainloop``: group k - 1 promoted by its row scales
        while group k's wgmmas run; against one partial bitwise the same, gate / up 8-17 % and
        down -2 to +4 % faster, H200, 2026-12-04), then the expert's column scales."""
        mEA, mEA2, mEB, wg, block, n_tile, k0, wg_tidx, expert = scale_args
        lane = wg_tidx % 32
        row0 = block * WG_ROWS + (wg_tidx // 32) * 16 + lane // 4
        pair0 = n_tile * (self.tile_shape_mnk[1] // 2) + lane % 4
        self.two_partial_mainloop(ab_pipeline, tiled_mma, acc,
                                  cute.make_rmem_tensor(acc.shape, self.acc_dtype), tCrA, tCrB,
                                  loads, k_tiles, num_k_blocks, (mEA, mEA2, wg, row0, k0))
        self.scale_columns(acc, mEB, expert, pair0)


def compile_wgrad_gemm_fp8(gated: bool = True, group_m: int = 4, num_sms: int = 132,
                           arch: str = "sm_90a", options: str = "", accumulate: bool = False):
    """Compile on fake tensors (no GPU needed): ``A (M, rows, 1)``, ``A2`` (gated) or None,
    ``B (N, rows, 1)`` int8 views of the e4m3 data (rows contiguous), ``C (M, N, E)``, ``C2``
    (gated) or None bf16 (fp32 with ``accumulate``; N contiguous), the int32 expert row offsets, then the fp32 scales
    ``s_a (rows/128, M)``, ``s_a2`` (gated) or None (``scales_of``) and ``s_b (E, N)``
    (``pow2_scales``); it runs on torch's current stream."""
    gemm = WgradGemmFp8Sm90(gated=gated, group_m=group_m, num_sms=num_sms, accumulate=accumulate)
    rows = cute.sym_int32(divisibility=GROUP)
    m, n, experts = (cute.sym_int32(divisibility=GROUP), cute.sym_int32(divisibility=GROUP),
                     cute.sym_int32())
    groups = cute.sym_int32()
    a = common.fake_kmajor_tensor(Int8, (m, rows, 1))
    a2 = common.fake_kmajor_tensor(Int8, (m, rows, 1)) if gated else None
    b = common.fake_kmajor_tensor(Int8, (n, rows, 1))
    c_type = cutlass.Float32 if accumulate else cutlass.BFloat16
    c = common.fake_kmajor_tensor(c_type, (m, n, experts))
    c2 = common.fake_kmajor_tensor(c_type, (m, n, experts)) if gated else None
    # the fp32 scales: A's (groups, M), B's (E, N) with rows 8-byte aligned (N even: pair loads)
    f32 = cutlass.Float32
    e_a = common.fake_strided_tensor(f32, (groups, m), align_bytes=4)
    e_a2 = common.fake_strided_tensor(f32, (groups, m), align_bytes=4) if gated else None
    e_b = common.fake_strided_tensor(f32, (experts, n), align_bytes=8)
    return cute.compile(gemm, a, a2, b, c, c2, common.fake_vector(Int32), common.fake_stream(),
                        e_a, e_a2, e_b,
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))


# ---------------------------------------------------------------------- torch entry + reference
def _check_operand(name: str, q: object, e: object, rows: int | None = None,
                   num_experts: int | None = None):
    """(M, rows) of an operand; its exponents ``[M, rows/128]``, or with ``num_experts``
    (B) ``[E, M]``."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D float8_e4m3fn tensor [M, rows], got {describe(q)}")
    m, r = q.shape
    if m % GROUP or r % GROUP or (rows is not None and r != rows):
        raise ValueError(f"{name}: expected M and rows multiples of {GROUP}"
                         f"{'' if rows is None else f' and {rows} rows'}, got {tuple(q.shape)}")
    want = (m, r // GROUP) if num_experts is None else (num_experts, m)
    if not isinstance(e, torch.Tensor) or e.dtype != torch.int8 or tuple(e.shape) != want:
        raise ValueError(f"exponents of {name}: expected int8 [{want[0]}, {want[1]}] ("
                         f"{'fp8.quantize_cols' if num_experts is None else 'fp8.quantize_cols_per_expert'}"
                         f"), got {describe(e)}")
    if not q.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (rows contiguous)")
    return m, r


def grouped_wgrad_fp8(a_t: torch.Tensor, e_a: torch.Tensor, b_t: torch.Tensor, e_b: torch.Tensor,
                      offsets: torch.Tensor, num_experts: int, a2_t: torch.Tensor | None = None,
                      e_a2: torch.Tensor | None = None, group_m: int = 4, main_grads=None):
    """Per-expert weight gradients on FP8: ``C[e] = A[:, rows of e] . B[:, rows of e]^T``
    -> ``[E, M, N]`` bf16, and with ``a2_t`` (gate and up sharing B) the pair (C, C2).
    ``a_t [M, rows]`` e4m3 with ``e_a [M, rows/128]`` int8: ``fp8.quantize_cols`` of the row
    buffer ``[rows, M]`` (on the GPU: ``kernels.quantize.quantize_cols``); ``b_t [N, rows]``
    e4m3 with ``e_b [E, N]`` int8: ``fp8.quantize_cols_per_expert`` of ``[rows, N]`` (one
    scale per column and expert); ``offsets [E + 1]`` int32 on the device, each expert's
    first row (multiples of 128); an expert with no rows gets zeros. No host sync.
    ``main_grads``: (C's, C2's) fp32 buffers or None each, added into instead (None returned
    for each given; ``expert_backward.wgrad``'s rule)."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {describe(num_experts)}")
    m, rows = _check_operand("a_t", a_t, e_a)
    n, _ = _check_operand("b_t", b_t, e_b, rows, num_experts)
    if a2_t is not None:
        if _check_operand("a2_t", a2_t, e_a2, rows)[0] != m:
            raise ValueError(f"a2_t: expected a_t's shape {tuple(a_t.shape)}, got {tuple(a2_t.shape)}")
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (num_experts + 1,):
        raise ValueError(f"offsets: expected int32 [{num_experts + 1}], got {describe(offsets)}")
    gated = a2_t is not None
    shape = (num_experts, m, n)
    (c, *c2), returned = wgrad_outputs((shape, shape)[:1 + gated], a_t.device,
                                       None if main_grads is None else main_grads[:1 + gated],
                                       "main_grads")
    c2 = c2[0] if gated else None
    kernel = jit.compile_kernel("gemm_wgrad_fp8", jit.device_arch(a_t.device), gated=gated,
                                group_m=group_m, accumulate=main_grads is not None,
                                num_sms=torch.cuda.get_device_properties(a_t.device).multi_processor_count)
    scales = (scales_of(e_a), None if e_a2 is None else scales_of(e_a2), pow2_scales(e_b))
    kernel(a_t.view(torch.int8).unsqueeze(2), None if a2_t is None else a2_t.view(torch.int8).unsqueeze(2),
           b_t.view(torch.int8).unsqueeze(2), c.permute(1, 2, 0),
           None if c2 is None else c2.permute(1, 2, 0), offsets, *scales)
    out = returned()
    return out if gated else out[0]


def grouped_wgrad_fp8_ref(a_t: torch.Tensor, e_a: torch.Tensor, b_t: torch.Tensor,
                          e_b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The oracle: the dequantized operands (exact) in float64, each expert's row segment,
    rounded once to bf16 -> ``[E, M, N]``."""
    a = fp8.dequantize_rows(a_t, e_a, dtype=torch.float64)
    b = fp8.dequantize_cols_per_expert(b_t, e_b, offsets, dtype=torch.float64)
    bounds = offsets.tolist()
    out = torch.zeros(len(bounds) - 1, a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi > lo:
            out[e] = a[:, lo:hi] @ b[:, lo:hi].T
    return out.to(torch.bfloat16)
