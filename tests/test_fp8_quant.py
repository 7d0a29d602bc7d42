"""FP8 quantizers' reference (issue 33, item 1): ``mok_cute.fp8`` on the CPU against independent
fp64 computations (scale rule, rows, columns, weight blocks, MXFP8, bad input). The DSL kernels
against this reference: ``test_quantize_kernels.py``."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_data import as_bytes, wide_bf16
from mok_cute import fp8

bf16 = torch.bfloat16
e4m3 = torch.float8_e4m3fn


# ------------------------------------------------------------------ independent fp64 model
def _exact_exponent(a: float) -> int:
    """The smallest integer e with a <= 448 * 2**e (= ceil(log2(a / 448))), clamped to
    EXP_MIN; fp64 log2 as a first guess, then exact comparisons (448 * 2**e is exact)."""
    if a == 0.0:
        return fp8.EXP_MIN
    e = math.ceil(math.log2(a) - math.log2(448.0))
    while math.ldexp(448.0, e - 1) >= a:
        e -= 1
    while math.ldexp(448.0, e) < a:
        e += 1
    return max(e, fp8.EXP_MIN)


def _e4m3_grid() -> torch.Tensor:
    """The 127 non-negative finite e4m3 values in increasing order (byte = index)."""
    return torch.arange(0, 0x7F, dtype=torch.uint8).view(e4m3).to(torch.float64)


def _rne_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even of fp64 ``y`` (|y| <= 448) to e4m3 bytes, from the value grid:
    an independent model of the conversion (ties go to the even byte code)."""
    grid = _e4m3_grid()
    a = y.abs().reshape(-1)
    hi = torch.searchsorted(grid, a).clamp(max=grid.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo).to(torch.uint8)
    sign = (y.reshape(-1) < 0) | ((y.reshape(-1) == 0) & (torch.copysign(torch.ones_like(a), y.reshape(-1)) < 0))
    code = code | (sign.to(torch.uint8) << 7)
    return code.reshape(y.shape)


def _model_rows(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 model of quantize_rows for finite x: (bytes [M, K], e [M, K/group])."""
    m, k = x.shape
    xg = x.to(torch.float64).reshape(m, k // group, group)
    amax = xg.abs().amax(dim=2)
    e = torch.tensor([[_exact_exponent(float(a)) for a in row] for row in amax], dtype=torch.int64)
    y = xg / torch.pow(2.0, e.to(torch.float64)).unsqueeze(2)
    assert y.abs().max() <= 448.0
    return _rne_e4m3(y).reshape(m, k), e


# ------------------------------------------------------------------ scale rule (CPU)
def _edge_amax() -> torch.Tensor:
    vals = [0.0, 448.0, 447.99, 448.01, 224.0, 1.0, 1.75, 1.7500001, 3.4028234663852886e38]
    for k in range(-140, 121):
        base = math.ldexp(448.0, k)
        vals += [base, math.ldexp(1.0, k), math.ldexp(1.75, k)]
    t = torch.tensor(vals, dtype=torch.float64).to(torch.float32)
    t = t[torch.isfinite(t)]
    bits = t.view(torch.int32)
    near = torch.cat([bits - 1, bits + 1]).clamp(0, 0x7F7FFFFF).view(torch.float32)
    sub = torch.tensor([1, 2, 3, 0x3FFFFF, 0x400000, 0x600000, 0x600001, 0x7FFFFF], dtype=torch.int32)
    return torch.cat([t, near, sub.view(torch.float32)])


def test_scale_rule_is_ceil_log2_of_amax_over_448(gen):
    """e = ceil(log2(amax / 448)) (clamped to -127) from integer bit arithmetic, against an
    exact fp64 computation: random fp32 patterns over the whole finite range, exact powers
    of two times 448 and their neighbours, mantissa 1.75 boundaries, subnormals, zero."""
    rand_bits = torch.randint(0, 0x7F800000, (20000,), generator=gen, dtype=torch.int32)
    amax = torch.cat([_edge_amax(), rand_bits.view(torch.float32)])
    got = fp8.scale_exponent(amax).tolist()
    want = [_exact_exponent(float(a)) for a in amax.to(torch.float64)]
    bad = [(float(a), g, w) for a, g, w in zip(amax, got, want) if g != w]
    assert not bad, bad[:10]
    assert max(got) == 120  # the largest finite fp32 needs 2**120


def test_scale_rule_edges():
    e = fp8.scale_exponent(torch.tensor([448.0, 448.0 * 2 ** 10, 449.0, 0.0, 2.0 ** -149,
                                         float("inf"), float("nan"), -448.0]))
    assert e.tolist() == [0, 10, 1, fp8.EXP_MIN, fp8.EXP_MIN, fp8.EXP_NONFINITE,
                          fp8.EXP_NONFINITE, 0]


def test_pow2_is_exact_over_the_exponent_range():
    e = torch.arange(-160, 128)
    want = torch.tensor([math.ldexp(1.0, int(v)) if v >= -149 else 0.0 for v in e], dtype=torch.float64)
    assert torch.equal(fp8.pow2(e).to(torch.float64), want)


# ------------------------------------------------------------------ rows / cols (CPU)
@pytest.mark.parametrize("m,k", [(1, 128), (77, 1024), (300, 1408)])
def test_quantize_rows_matches_the_fp64_model(gen, m, k):
    x = wide_bf16(gen, m, k)
    q, e = fp8.quantize_rows(x)
    assert q.dtype == e4m3 and q.shape == (m, k) and e.dtype == torch.int8 and e.shape == (m, k // 128)
    want_q, want_e = _model_rows(x)
    assert torch.equal(e.to(torch.int64), want_e)
    assert torch.equal(as_bytes(q), want_q)


def test_quantize_rows_round_trip_error_bounds(gen):
    x = wide_bf16(gen, 200, 1024)
    q, e = fp8.quantize_rows(x)
    d = fp8.dequantize_rows(q, e).to(torch.float64)
    xf = x.to(torch.float64)
    scale = torch.pow(2.0, e.to(torch.float64)).repeat_interleave(128, dim=1)
    normal = xf.abs() >= 2.0 ** -6 * scale  # the scaled value is a normal e4m3
    rel = (d - xf).abs() / xf.abs()
    assert rel[normal].max() <= 2.0 ** -4
    # subnormal range: absolute error at most half the smallest e4m3 step, 2**-10 * scale
    assert ((d - xf).abs()[~normal] <= 2.0 ** -10 * scale[~normal]).all()


def test_quantize_rows_scale_is_tight_and_never_saturates(gen):
    """Every group with e > EXP_MIN has its amax in (224, 448] after scaling: the ceil rule
    leaves no headroom unused and never clips."""
    x = wide_bf16(gen, 64, 2048)
    q, e = fp8.quantize_rows(x)
    qa = q.to(torch.float32).abs().reshape(64, 16, 128).amax(dim=2)
    live = e > fp8.EXP_MIN
    assert (qa[live] >= 224).all() and (qa <= 448).all()


def test_zero_subnormal_and_power_of_two_groups():
    x = torch.zeros(4, 512, dtype=torch.float32)
    v = _e4m3_grid()[0x20:0x60].to(torch.float32)  # normal e4m3 values 2**-3 .. 15
    x[1, 128:256] = torch.cat([v, -v]) * 2.0 ** -130  # fp32 subnormals, e4m3 values at 2**-130
    x[2, 256] = 448.0 * 2.0 ** 7  # exact power of two times 448
    x[2, 257] = -3.0
    x[3, 384:] = -0.0
    q, e = fp8.quantize_rows(x)
    assert e[0].tolist() == [fp8.EXP_MIN] * 4 and (as_bytes(q[0]) == 0).all()
    assert e[1, 1] == fp8.EXP_MIN
    assert torch.equal(fp8.dequantize_rows(q, e)[1], x[1])  # 2**-130 * 2**127: exact
    assert e[2, 2] == 7 and as_bytes(q)[2, 256] == 0x7E and q[2, 257].float() == -3.0 / 128
    assert e[3, 3] == fp8.EXP_MIN and (as_bytes(q[3, 384:]) == 0x80).all()  # signed zeros kept


def test_non_finite_groups_are_poisoned_whole():
    x = torch.ones(3, 384, dtype=bf16)
    x[0, 5] = float("inf")
    x[1, 130] = -float("inf")
    x[2, 300] = float("nan")
    q, e = fp8.quantize_rows(x)
    assert e.tolist() == [[127, -8, -8], [-8, 127, -8], [-8, -8, 127]]
    b = as_bytes(q).reshape(3, 3, 128)
    for r, g in ((0, 0), (1, 1), (2, 2)):
        assert (b[r, g] == 0x7F).all()
    assert (fp8.dequantize_rows(q, e).isnan().reshape(3, 3, 128).any(dim=2)
            == torch.eye(3, dtype=torch.bool)).all()


@pytest.mark.parametrize("dtype", [bf16, torch.float16, torch.float32])
def test_input_dtypes_agree_when_values_agree(gen, dtype):
    x = torch.randn(8, 256, generator=gen).to(bf16)  # exact in fp16 and fp32 too
    q, e = fp8.quantize_rows(x.to(dtype))
    q2, e2 = fp8.quantize_rows(x.to(torch.float32))
    assert torch.equal(as_bytes(q), as_bytes(q2)) and torch.equal(e, e2)


def test_quantize_cols_is_rows_of_the_transpose(gen):
    x = wide_bf16(gen, 384, 72, zero_groups=False)
    x[128:256, 7] = 0  # an all-zero column group
    qt, e = fp8.quantize_cols(x)
    assert qt.shape == (72, 384) and e.shape == (72, 3)
    q2, e2 = fp8.quantize_rows(x.t().contiguous())
    assert torch.equal(as_bytes(qt), as_bytes(q2)) and torch.equal(e, e2)
    assert e[7, 1] == fp8.EXP_MIN
    d = fp8.dequantize_cols(qt, e)
    assert d.shape == x.shape
    assert torch.equal(d, fp8.dequantize_rows(qt, e).t())


# ------------------------------------------------------------------ weight blocks (CPU)
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (3, 384, 256)])
def test_quantize_blocks_scale_per_block_and_exact_transposed_copy(gen, shape):
    lead = shape[:-2]
    nb, kb = shape[-2] // 128, shape[-1] // 128
    scale = torch.pow(2.0, torch.randint(-12, 13, lead + (nb, kb), generator=gen).to(torch.float32))
    scale = scale.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
    w = (torch.randn(*shape, generator=gen) * scale).to(bf16)
    if len(shape) == 3:
        w[1, :128, 128:256] = 0  # an all-zero block
    q, e = fp8.quantize_blocks(w)
    qt, et = fp8.quantize_blocks(w, transposed=True)
    assert q.shape == shape and e.shape == lead + (nb, kb)
    assert qt.shape == lead + (shape[-1], shape[-2]) and et.shape == lead + (kb, nb)
    assert torch.equal(as_bytes(qt), as_bytes(q).transpose(-1, -2))
    assert torch.equal(et, e.transpose(-1, -2))
    assert torch.equal(fp8.dequantize_blocks(qt, et), fp8.dequantize_blocks(q, e).transpose(-1, -2))
    blocks = w.to(torch.float32).reshape(-1, nb, 128, kb, 128).abs().amax(dim=(2, 4))
    assert torch.equal(e.reshape(-1, nb, kb).to(torch.int32), fp8.scale_exponent(blocks))
    if len(shape) == 3:
        assert e[1, 0, 1] == fp8.EXP_MIN and (as_bytes(q[1, :128, 128:256]) == 0).all()
    # a block's data is its rows quantized with the block's exponent
    w2 = w.reshape(-1, shape[-2], shape[-1])[0, :128, :128].to(torch.float64)
    assert torch.equal(as_bytes(q.reshape(-1, shape[-2], shape[-1])[0, :128, :128]),
                       _rne_e4m3(w2 / 2.0 ** int(e.reshape(-1, nb, kb)[0, 0, 0])))


def test_quantize_blocks_relative_error(gen):
    w = torch.randn(256, 256, generator=gen).to(bf16)
    q, e = fp8.quantize_blocks(w)
    d = fp8.dequantize_blocks(q, e).double()
    wf = w.double()
    scale = torch.pow(2.0, e.double()).repeat_interleave(128, 0).repeat_interleave(128, 1)
    normal = wf.abs() >= 2.0 ** -6 * scale
    assert ((d - wf).abs() / wf.abs())[normal].max() <= 2.0 ** -4


# ------------------------------------------------------------------ MXFP8 (CPU)
def _mx_dequant(q: torch.Tensor, s: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """MXFP8 values: q * 2**(s - 127) per 1 x 32 (fp64 never overflows)."""
    exp = s.view(torch.uint8).to(torch.int32) - 127
    scale = fp8.pow2(exp) if dtype == torch.float32 else torch.pow(2.0, exp.to(torch.float64))
    return q.to(dtype) * scale.repeat_interleave(32, dim=-1)


def test_to_mxfp8_is_lossless_and_from_mxfp8_inverts_it(gen):
    x = wide_bf16(gen, 40, 512)
    x[3, 5] = float("inf")
    q, e = fp8.quantize_rows(x)
    mq, s = fp8.to_mxfp8(q, e)
    assert mq is q and s.dtype == torch.uint8 and s.shape == (40, 16)
    assert torch.equal(s.to(torch.int32), (e.to(torch.int32) + 127).repeat_interleave(4, dim=1))
    d_mx, d = _mx_dequant(mq, s), fp8.dequantize_rows(q, e)
    assert torch.equal(d_mx.isnan(), d.isnan())
    assert torch.equal(d_mx.nan_to_num(), d.nan_to_num())
    q2, e2 = fp8.from_mxfp8(mq, s)
    assert torch.equal(as_bytes(q2), as_bytes(q)) and torch.equal(e2, e)
    q3, e3 = fp8.from_mxfp8(mq, s.view(torch.float8_e8m0fnu))
    assert torch.equal(as_bytes(q3), as_bytes(q)) and torch.equal(e3, e)


def test_blocks_to_mxfp8_is_lossless(gen):
    w = torch.randn(2, 256, 384, generator=gen).to(bf16)
    q, e = fp8.quantize_blocks(w)
    mq, s = fp8.to_mxfp8(q, e)
    assert s.shape == (2, 256, 12)
    assert torch.equal(_mx_dequant(mq, s), fp8.dequantize_blocks(q, e))


def test_from_mxfp8_requantizes_to_the_largest_sub_block_exponent(gen):
    m = 64
    codes = torch.randint(0, 0x7F, (m, 128), generator=gen, dtype=torch.uint8)
    codes |= (torch.rand(m, 128, generator=gen) < 0.5).to(torch.uint8) << 7
    q = codes.view(e4m3)
    s = torch.randint(100, 140, (m, 4), generator=gen, dtype=torch.int32)
    s[0] = 130  # equal exponents: exact
    s[1] = torch.tensor([0, 0, 0, 254])  # extremes of E8M0
    s = s.to(torch.uint8)
    q2, e = fp8.from_mxfp8(q, s)
    nonzero = (codes & 0x7F).reshape(m, 4, 32).amax(dim=2) > 0  # zero sub-blocks add nothing
    want_e = torch.where(nonzero, s.to(torch.int32) - 127, -127).amax(dim=1)
    assert torch.equal(e.to(torch.int32)[:, 0], want_e)
    # independent model: RNE of the MX value at the new exponent, in fp64
    value = _mx_dequant(q, s, torch.float64)
    want = _rne_e4m3(value / torch.pow(2.0, e.to(torch.float64)))
    assert torch.equal(as_bytes(q2), want)
    assert torch.equal(as_bytes(q2[0]), codes[0])
    # lossless where representable: a sub-block one exponent below the max, data with a zero
    # last mantissa bit and at least 2**-5 in size, halves exactly
    d = fp8.dequantize_rows(q2, e)
    exact = torch.tensor([c for c in range(0x10, 0x7F) if c % 2 == 0] * 3, dtype=torch.uint8)[:128].view(e4m3)
    qs = exact.reshape(1, 128).clone()
    ss = torch.tensor([[131, 130, 131, 131]], dtype=torch.uint8)
    q4, e4 = fp8.from_mxfp8(qs, ss)
    assert e4.item() == 4 and torch.equal(fp8.dequantize_rows(q4, e4), _mx_dequant(qs, ss))
    assert d.shape == (m, 128)


def test_from_mxfp8_ignores_the_scale_of_a_zero_sub_block():
    """A producer that writes byte 127 (2**0) for an all-zero sub-block: the group's exponent
    comes from the other sub-blocks, whose values survive exactly (the largest sub-block
    scale would have flushed them to zero)."""
    q = torch.zeros(1, 128).to(e4m3)
    q[0, 32:] = 1.0
    s = torch.tensor([[127, 107, 107, 107]], dtype=torch.uint8)  # 2**0 on zeros, 2**-20
    q2, e = fp8.from_mxfp8(q, s)
    assert e.item() == -20
    assert torch.equal(fp8.dequantize_rows(q2, e), _mx_dequant(q, s))
    assert (fp8.dequantize_rows(q2, e)[0, 32:] == 2.0 ** -20).all()


def test_dequantize_in_float64_keeps_groups_near_the_bf16_maximum():
    """A group at e = 120 holds values above fp32's maximum (448 * 2**120): float64, what the
    oracles take, keeps them; fp32 gives inf there."""
    x = torch.zeros(1, 128, dtype=bf16)
    x[0, 0], x[0, 1] = 3.3e38, -1.0e38
    q, e = fp8.quantize_rows(x)
    assert e.item() == 120
    d = fp8.dequantize_rows(q, e, dtype=torch.float64)
    assert d.dtype == torch.float64 and d.isfinite().all()
    assert abs(d[0, 0].item() / 3.3e38 - 1) < 0.07 and abs(d[0, 1].item() / -1.0e38 - 1) < 0.07
    assert fp8.dequantize_rows(q, e).isinf()[0, 0]  # fp32: the documented limit
    w = torch.zeros(128, 128, dtype=bf16)
    w[5, 7] = 3.3e38
    d = fp8.dequantize_blocks(*fp8.quantize_blocks(w), dtype=torch.float64)
    assert d.isfinite().all() and d[5, 7] > 3e38
    with pytest.raises(TypeError, match="dtype"):
        fp8.dequantize_rows(q, e, dtype=torch.bfloat16)


def test_from_mxfp8_nan_scale_or_data_poisons_the_group():
    q = torch.ones(2, 256).to(e4m3)
    s = torch.full((2, 8), 127, dtype=torch.uint8)
    s[0, 2] = 0xFF
    q.view(torch.uint8)[1, 200] = 0xFF  # -NaN data
    q2, e = fp8.from_mxfp8(q, s)
    assert e.tolist() == [[127, 0], [0, 127]]
    b = as_bytes(q2)
    assert (b[0, :128] == 0x7F).all() and (b[1, 128:] == 0x7F).all()
    assert (b[0, 128:] == 0x38).all() and (b[1, :128] == 0x38).all()  # 1.0


# ------------------------------------------------------------------ bad input (CPU)
def test_bad_input_names_the_argument():
    x = torch.zeros(4, 256, dtype=bf16)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        fp8.quantize_rows([[1.0]])
    with pytest.raises(TypeError, match="x: expected dtype bfloat16, float16 or float32, got torch.float64"):
        fp8.quantize_rows(x.double())
    with pytest.raises(TypeError, match="x: expected dtype"):
        fp8.quantize_rows(x.to(torch.int32))
    with pytest.raises(ValueError, match=r"x: expected K \(dim 1\) a multiple of 128, got shape \(4, 200\)"):
        fp8.quantize_rows(torch.zeros(4, 200))
    with pytest.raises(ValueError, match="x: expected a 2-D tensor"):
        fp8.quantize_rows(torch.zeros(256))
    with pytest.raises(ValueError, match="group: expected an int >= 1"):
        fp8.quantize_rows(x, group=0)
    with pytest.raises(TypeError, match="group: expected an int"):
        fp8.quantize_rows(x, group=128.0)
    with pytest.raises(ValueError, match=r"x: expected M \(dim 0\) a multiple of 128"):
        fp8.quantize_cols(torch.zeros(100, 256))
    with pytest.raises(ValueError, match=r"w: expected N \(dim 0\) a multiple of 128"):
        fp8.quantize_blocks(torch.zeros(100, 256))
    with pytest.raises(ValueError, match=r"w: expected K \(dim 2\) a multiple of 128"):
        fp8.quantize_blocks(torch.zeros(2, 128, 100))
    with pytest.raises(ValueError, match="w: expected a 2-D or 3-D tensor"):
        fp8.quantize_blocks(torch.zeros(2, 2, 128, 128))
    with pytest.raises(TypeError, match="transposed: expected a bool"):
        fp8.quantize_blocks(torch.zeros(128, 128), transposed=1)
    q, e = fp8.quantize_rows(x)
    with pytest.raises(TypeError, match="q: expected dtype float8_e4m3fn"):
        fp8.dequantize_rows(x, e)
    with pytest.raises(ValueError, match=r"e: expected shape \(4, 2\), got \(4, 3\)"):
        fp8.dequantize_rows(q, torch.zeros(4, 3, dtype=torch.int8))
    with pytest.raises(TypeError, match="e: expected an integer dtype"):
        fp8.dequantize_rows(q, e.float())
    with pytest.raises(ValueError, match="e: expected shape"):
        fp8.to_mxfp8(q, torch.zeros(4, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"e: expected exponents in \[-127, 127\]"):
        fp8.to_mxfp8(q, torch.full((4, 2), -128, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"s: expected shape \(4, 8\)"):
        fp8.from_mxfp8(q, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="s: expected dtype uint8 or float8_e8m0fnu"):
        fp8.from_mxfp8(q, torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="group: expected a multiple of 32"):
        fp8.from_mxfp8(q, torch.zeros(4, 8, dtype=torch.uint8), group=48)
