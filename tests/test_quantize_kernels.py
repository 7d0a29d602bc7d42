"""FP8 quantizer kernels (``mok_cute.kernels.quantize``, issue 33, item 1): compiled for sm_90a
offline (exact conversions, no spills, rows read through the index), their argument checks before
the device, and on the GPU (marked gpu) bit for bit against the reference ``mok_cute.fp8``."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fp8_data import as_bytes, wide_bf16
from mok_cute import fp8

bf16 = torch.bfloat16
e4m3 = torch.float8_e4m3fn


# ------------------------------------------------------------------ DSL kernels (compile, CPU)
@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    from mok_cute import jit

    out = tmp_path_factory.mktemp("quantize_ptx")
    cache = {}

    def get(name, **static):
        key = (name, tuple(sorted(static.items())))
        if key not in cache:
            cache[key] = jit.inspect_kernel(name, "sm_90a", out, **static)
        return cache[key]

    return get


@pytest.mark.parametrize("name,loads,stores", [
    ("quantize_rows", {"ld.global.128b": 1}, {"st.global.64b": 1, "st.global.8b": 1}),
    ("quantize_cols", {"ld.global.128b": 16}, {"st.global.128b": 8, "st.global.8b": 8}),
    # the expert's groups read twice (amax, then quantize); 8 exponents a lane's vector
    ("quantize_cols_per_expert", {"ld.global.128b": 32}, {"st.global.128b": 8, "st.global.8b": 8}),
    ("quantize_blocks", {"ld.global.128b": 16}, {"st.global.64b": 16, "st.global.128b": 8, "st.global.8b": 2}),
])
def test_kernel_compiles_with_exact_conversions_and_no_spills(reports, name, loads, stores):
    rep = reports(name)
    _check_exact_kernel(rep, loads, stores)


def test_quantize_cols_per_expert_gather_reads_rows_through_the_index(reports):
    """gather=True: each group's 16 row sources a lane in four 128-bit index loads per pass
    (32 row loads + 8 index loads), the same stores, no spills, and no more registers than
    the kernel without the index; the cache keys the variant apart."""
    rep = reports("quantize_cols_per_expert", gather=True)
    _check_exact_kernel(rep, {"ld.global.128b": 40}, {"st.global.128b": 8, "st.global.8b": 8})
    plain = reports("quantize_cols_per_expert")
    assert plain.mix["ld.global.128b"] == 32
    assert rep.kernels[0].registers <= plain.kernels[0].registers, (rep.kernels, plain.kernels)
    _assert_gather_cached_apart("quantize_cols_per_expert")


def _assert_gather_cached_apart(name: str, *others: dict):
    """The registry builds ``name`` without the row index by default, and its compile cache
    keys the gather variant (and each of ``others``) apart from the plain one."""
    from mok_cute import jit

    assert jit.KERNELS[name].static == {"gather": False}
    spec = jit.get_spec(name)
    keys = {jit._cache_key(name, "sm_90a", jit._static_args(spec, kw))
            for kw in ({}, {"gather": False}, {"gather": True}, *others)}
    assert len(keys) == 2 + len(others)


def test_quantize_rows_gather_reads_each_row_through_the_index(reports):
    """gather=True: each lane reads its row's index once (one 32-bit load, the same word for
    the 16 lanes of a group), then the plain kernel's one 128-bit load and stores; no spills,
    at most a few registers more; the plain kernel loads no index; the cache keys the
    variant apart; gather and scatter_k exclude each other."""
    from mok_cute.kernels import quantize

    rep = reports("quantize_rows", gather=True)
    _check_exact_kernel(rep, {"ld.global.128b": 1, "ld.global.32b": 1},
                        {"st.global.64b": 1, "st.global.8b": 1})
    plain = reports("quantize_rows")
    assert plain.mix["ld.global.32b"] == 0 and plain.mix["ld.global.128b"] == 1
    assert rep.kernels[0].registers <= plain.kernels[0].registers + 4, (rep.kernels, plain.kernels)
    _assert_gather_cached_apart("quantize_rows", {"scatter_k": 8})
    with pytest.raises(ValueError, match="scatter_k, gather: expected at most one of them"):
        quantize.QuantizeRows(scatter_k=8, gather=True)


def test_quantize_cols_gather_reads_rows_through_the_index(reports):
    """gather=True: a lane's 16 row sources in four 128-bit index loads (16 row loads + 4
    index loads), the same stores, no spills, at most a few registers more than the plain
    kernel; the cache keys the variant apart."""
    rep = reports("quantize_cols", gather=True)
    _check_exact_kernel(rep, {"ld.global.128b": 20}, {"st.global.128b": 8, "st.global.8b": 8})
    plain = reports("quantize_cols")
    assert plain.mix["ld.global.128b"] == 16
    assert rep.kernels[0].registers <= plain.kernels[0].registers + 4, (rep.kernels, plain.kernels)
    _assert_gather_cached_apart("quantize_cols")


def test_quantize_scatter_rows_stores_each_token_k_times(reports):
    """scatter_k = 8: the row quantized once, its 8 bytes and exponent stored at each of the
    token's 8 destination rows (one 128-bit load, 8 + 8 stores), no spills."""
    _check_exact_kernel(reports("quantize_rows", scatter_k=8), {"ld.global.128b": 1},
                        {"st.global.64b": 8, "st.global.8b": 8})


def _check_exact_kernel(rep, loads, stores):
    ptx = open(rep.ptx_path).read()
    assert re.search(r"^\.target sm_90a", ptx, re.M)
    assert rep.spill_bytes == 0 and rep.mix["ld.local/st.local"] == 0
    for key, n in {**loads, **stores}.items():
        assert rep.mix[key] == n, (key, rep.mix)
    # the data path: mul.rn.f32 by a power of two then cvt.rn.satfinite to e4m3, nothing else
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "mul.rn.f32" in ptx
    assert ".ftz" not in ptx and "approx" not in ptx
    assert rep.mix["fma.f32"] == 0 and rep.mix["atom"] == 0 and rep.mix["red"] == 0
    assert ptx.count("mul.rn.f32") == 2 * ptx.count("cvt.rn.satfinite.e4m3x2.f32")
    if rep.sass_mix is not None:  # SASS when an nvdisasm >= 13.4 is at hand
        sass = open(rep.sass_path).read()
        assert "F2FP.SATFINITE.E4M3.F32" in sass and "FMUL.FTZ" not in sass


def test_blocks_kernel_writes_only_what_is_asked(reports):
    q_only = reports("quantize_blocks", write_q=True, write_qt=False)
    t_only = reports("quantize_blocks", write_q=False, write_qt=True)
    assert q_only.mix["st.global.64b"] == 16 and q_only.mix["st.global.128b"] == 0
    assert t_only.mix["st.global.128b"] == 8 and t_only.mix["st.global.64b"] == 0
    from mok_cute.kernels import quantize

    with pytest.raises(ValueError, match="write_q, write_qt: expected at least one output"):
        quantize.QuantizeBlocks(write_q=False, write_qt=False)


def test_kernel_entry_points_check_arguments_before_the_device():
    from mok_cute.kernels import quantize

    x = torch.zeros(4, 256, dtype=bf16)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16, got torch.float32"):
        quantize.quantize_rows(x.float())
    with pytest.raises(ValueError, match=r"x: expected K \(dim 1\) a multiple of 128"):
        quantize.quantize_rows(torch.zeros(4, 200, dtype=bf16))
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        quantize.quantize_rows(x)
    with pytest.raises(ValueError, match=r"x: expected M \(dim 0\) a multiple of 128"):
        quantize.quantize_cols(x)
    with pytest.raises(ValueError, match="x: expected a unit stride"):
        quantize.quantize_cols(torch.zeros(256, 128, dtype=bf16).t())
    with pytest.raises(ValueError, match=r"w: expected K \(dim 2\) a multiple of 8"):
        quantize.quantize_blocks(torch.zeros(2, 128, 100, dtype=bf16))
    with pytest.raises(ValueError, match="w: expected a 2-D or 3-D tensor"):
        quantize.quantize_blocks(torch.zeros(128, dtype=bf16))
    assert quantize.quantize_rows_ref is fp8.quantize_rows


def test_quantize_cols_per_expert_row_index_checked_before_the_device():
    """row_index: int32 [M], M a multiple of 128 (the output's rows); x then any T rows."""
    from mok_cute.kernels import quantize

    x = torch.zeros(77, 64, dtype=bf16)  # T = 77: fine with a row index
    offsets = torch.tensor([0, 128], dtype=torch.int32)
    idx = torch.zeros(128, dtype=torch.int32)
    bad = [(idx.long(), "int64"), (idx.float(), "float32"), (idx[:100], r"shape=\(100,\)"),
           (idx.view(2, 64), r"shape=\(2, 64\)"), ([0] * 128, "list")]
    for row_index, given in bad:
        with pytest.raises(ValueError, match=f"row_index: expected a 1-D int32 tensor .*{given}"):
            quantize.quantize_cols_per_expert(x, offsets, 1, row_index=row_index)
    with pytest.raises(ValueError, match="row_index: expected a contiguous, 16-byte aligned"):
        quantize.quantize_cols_per_expert(x, offsets, 1, row_index=torch.zeros(256, dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match=r"x: expected M \(dim 0\) a multiple of 128"):
        quantize.quantize_cols_per_expert(x, offsets, 1)  # without the index: x's rows are M
    with pytest.raises(ValueError, match=r"x: expected K \(dim 1\) a multiple of 8"):
        quantize.quantize_cols_per_expert(torch.zeros(77, 60, dtype=bf16), offsets, 1, row_index=idx)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):  # the shapes passed
        quantize.quantize_cols_per_expert(x, offsets, 1, row_index=idx)


def test_quantize_rows_row_index_checked_before_the_device():
    """row_index: int32 [M] for any M (the output's rows), contiguous, 16-byte aligned, on
    x's device; x then any T rows."""
    from mok_cute.kernels import quantize

    x = torch.zeros(77, 256, dtype=bf16)
    idx = torch.zeros(100, dtype=torch.int32)  # M = 100: fine for rows
    bad = [(idx.long(), "int64"), (idx.float(), "float32"), (idx.view(4, 25), r"shape=\(4, 25\)"),
           (torch.zeros((), dtype=torch.int32), r"shape=\(\)"), ([0] * 100, "list")]
    for row_index, given in bad:
        with pytest.raises(ValueError, match=f"row_index: expected a 1-D int32 tensor \\[M\\] .*{given}"):
            quantize.quantize_rows(x, row_index=row_index)
    for row_index in (torch.zeros(200, dtype=torch.int32)[::2],  # not contiguous
                      torch.zeros(101, dtype=torch.int32)[1:]):  # 4 bytes past 16-byte alignment
        with pytest.raises(ValueError, match="row_index: expected a contiguous, 16-byte aligned "
                                             "tensor on cpu"):
            quantize.quantize_rows(x, row_index=row_index)
    with pytest.raises(ValueError, match=r"x: expected K \(dim 1\) a multiple of 128"):
        quantize.quantize_rows(torch.zeros(77, 200, dtype=bf16), row_index=idx)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16"):
        quantize.quantize_rows(x.float(), row_index=idx)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):  # the shapes passed
        quantize.quantize_rows(x, row_index=idx)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):  # M = 0, T = 0 too
        quantize.quantize_rows(torch.zeros(0, 256, dtype=bf16), row_index=idx[:0])


def test_quantize_cols_row_index_checked_before_the_device():
    """row_index: int32 [M], M a multiple of 128 (the output's rows), contiguous, 16-byte
    aligned, on x's device; x then any T rows (K a multiple of 8, as without the index)."""
    from mok_cute.kernels import quantize

    x = torch.zeros(77, 72, dtype=bf16)  # T = 77: fine with a row index
    idx = torch.zeros(128, dtype=torch.int32)
    bad = [(idx.long(), "int64"), (idx.float(), "float32"), (idx[:100], r"shape=\(100,\)"),
           (idx.view(2, 64), r"shape=\(2, 64\)"), ([0] * 128, "list")]
    for row_index, given in bad:
        with pytest.raises(ValueError, match=f"row_index: expected a 1-D int32 tensor \\[M\\] with M a "
                                             f"multiple of 128 .*{given}"):
            quantize.quantize_cols(x, row_index=row_index)
    for row_index in (torch.zeros(256, dtype=torch.int32)[::2], torch.zeros(129, dtype=torch.int32)[1:]):
        with pytest.raises(ValueError, match="row_index: expected a contiguous, 16-byte aligned "
                                             "tensor on cpu"):
            quantize.quantize_cols(x, row_index=row_index)
    with pytest.raises(ValueError, match=r"x: expected M \(dim 0\) a multiple of 128"):
        quantize.quantize_cols(x)  # without the index: x's rows are M
    with pytest.raises(ValueError, match=r"x: expected K \(dim 1\) a multiple of 8"):
        quantize.quantize_cols(torch.zeros(77, 60, dtype=bf16), row_index=idx)
    with pytest.raises(ValueError, match="x: expected a unit stride"):
        quantize.quantize_cols(torch.zeros(72, 77, dtype=bf16).t(), row_index=idx)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):  # the shapes passed
        quantize.quantize_cols(x, row_index=idx)


def test_fp8_weight_grads_quantize_x_through_the_row_index(gen, monkeypatch):
    """``expert_backward._weight_grads`` with x and d_out rows as ``IndexedRows`` gives the
    bits of the gathered rows', on the FP8 weight gradients (the index handed to the column
    quantizers, no gather) and on the bf16 ones (the rows gathered first); the kernels are
    replaced by their references on the CPU."""
    from mok_cute import expert_backward
    from mok_cute.kernels import gemm_wgrad_fp8, quantize, token_ops

    calls = []

    def cols_per_expert(x, offsets, num_experts, out=None, scale_out=None, row_index=None):
        calls.append((x, row_index))
        rows = x if row_index is None else token_ops.gather_rows_ref(x, row_index)
        return fp8.quantize_cols_per_expert(rows, offsets)

    def wgrad_fp8(a_t, e_a, b_t, e_b, offsets, num_experts, a2_t=None, e_a2=None, main_grads=None):
        c = gemm_wgrad_fp8.grouped_wgrad_fp8_ref(a_t, e_a, b_t, e_b, offsets)
        return c if a2_t is None else (c, gemm_wgrad_fp8.grouped_wgrad_fp8_ref(a2_t, e_a2, b_t, e_b, offsets))

    def wgrad(a, a2, b, offsets, num_experts, out_rows, main_grads=None, rows_per_expert=None):
        calls.append((b, None))
        ref = lambda m: torch.stack([(m[lo:hi].double().t() @ b[lo:hi].double()).to(bf16)  # noqa: E731
                                     for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
        return ref(a) if a2 is None else (ref(a), ref(a2))

    def cols(x, out=None, scale_out=None, row_index=None):
        calls.append((x, row_index))
        return fp8.quantize_cols(x if row_index is None else token_ops.gather_rows_ref(x, row_index))

    monkeypatch.setattr(quantize, "quantize_cols", cols)
    monkeypatch.setattr(quantize, "quantize_cols_per_expert", cols_per_expert)
    monkeypatch.setattr(gemm_wgrad_fp8, "grouped_wgrad_fp8", wgrad_fp8)
    monkeypatch.setattr(expert_backward, "wgrad", wgrad)
    monkeypatch.setattr(token_ops, "gather_rows", token_ops.gather_rows_ref)
    monkeypatch.setattr(expert_backward, "FP8_WGRAD_MIN_INTER", 0)
    monkeypatch.setattr(expert_backward, "FP8_WGRAD_MIN_ROWS", 0)
    T, H, I, E, rows = 77, 128, 128, 2, 384
    x = wide_bf16(gen, T, H, zero_groups=False)
    idx = torch.randint(0, T, (rows,), generator=gen, dtype=torch.int32)
    idx[::7] = -1
    idx[5] = T  # past the end: a zero row
    offsets = torch.tensor([0, 256, 384], dtype=torch.int32)
    d_pre = wide_bf16(gen, rows, 2 * I, zero_groups=False)
    hw, dy = wide_bf16(gen, rows, I), wide_bf16(gen, T, H)
    w_gate, w_down = torch.zeros(E, I, H, dtype=bf16), torch.zeros(E, H, I, dtype=bf16)
    x_rows, d_rows = token_ops.gather_rows_ref(x, idx), token_ops.gather_rows_ref(dy, idx)
    for use_fp8 in (True, False):
        calls.clear()
        tail = (w_gate, w_down, offsets, True, True, use_fp8, 4096.0)
        got = expert_backward._weight_grads(d_pre, hw, expert_backward.IndexedRows(dy, idx),
                                            expert_backward.IndexedRows(x, idx), *tail)
        # dW_down first (its operands can then be dropped), then dW_gate | dW_up
        if use_fp8:  # the source rows and the index reach the column quantizers
            assert calls[1][0] is dy and calls[1][1] is idx  # d_out's 128-row groups
            assert calls[-1][0] is x and calls[-1][1] is idx  # x's per-expert pass
        else:  # the bf16 GEMMs read the gathered rows
            assert torch.equal(calls[-1][0], x_rows)
        want = expert_backward._weight_grads(d_pre, hw, d_rows, x_rows, *tail)
        for g, w in zip(got, want):
            assert g.dtype == bf16 and torch.equal(g, w)


# ------------------------------------------------------------------ kernels vs reference (GPU)
def _poison(shape, dtype, device="cuda"):
    """An output filled with 0x5A bytes (a value no correct write leaves behind everywhere)."""
    return torch.full(tuple(shape), 0x5A, dtype=torch.uint8, device=device).view(dtype)


def _assert_same(got, want, what):
    g, w = as_bytes(got).cpu() if got.dtype == e4m3 else got.cpu(), as_bytes(want) if want.dtype == e4m3 else want
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} elements differ, first at {bad[:5].tolist()}: "
                             f"got {g[tuple(bad[0])].item():#x}, want {w[tuple(bad[0])].item():#x}")


def _twice_into_poison(run, q_shape, e_shape, want_q, want_e, what):
    """``run(q, e)`` into poisoned outputs, twice: it returns them, every byte the reference's,
    the same bits both times."""
    runs = []
    for _ in range(2):
        q, e = _poison(q_shape, e4m3), _poison(e_shape, torch.int8)
        got = run(q, e)
        torch.cuda.synchronize()
        assert got[0] is q and got[1] is e
        _assert_same(q, want_q, f"q {what}")
        _assert_same(e, want_e, f"e {what}")
        runs.append((as_bytes(q).clone(), e.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def _edge_rows(x: torch.Tensor) -> torch.Tensor:
    """Overwrite a few rows of x (bf16 [M, K], M >= 6) with the hard cases: bf16 subnormals,
    huge values, 448 * 2**k exactly, signed zeros, ties of the e4m3 rounding."""
    k = x.shape[1]
    ramp = torch.linspace(-3.0, 3.0, k, dtype=torch.float64) * (1 + torch.arange(k) % 7)
    x[0] = (ramp * 2.0 ** -128).to(bf16)  # mostly bf16 subnormals
    x[1] = (ramp * torch.pow(2.0, -(torch.arange(k) % 40).to(torch.float64)) * 2.0 ** 110).to(bf16)
    x[2] = torch.tensor([448.0 * 2.0 ** ((i % 9) - 4) * (1 - 2 * (i % 2)) for i in range(k)]).to(bf16)
    x[3] = -0.0
    x[4, ::2] = 1.0625  # a tie between 1.0 and 1.125 at scale 1 when the group's amax is 448
    x[4, 1::2] = 448.0
    x[4, 2::8] = 3 * 2.0 ** -10  # e4m3 subnormal tie: rounds to the even 2**-8
    x[4, 4::8] = -(2.0 ** -10)  # tie between 0 and 2**-9: rounds to -0
    x[5] = torch.tensor([2.0 ** -133] * k).to(bf16)  # the smallest bf16 subnormal
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 77, 300])
@pytest.mark.parametrize("k", [128, 1408, 7168])
def test_quantize_rows_kernel_is_bitwise_the_reference(gen, m, k):
    from mok_cute.kernels import quantize

    x = wide_bf16(gen, m, k)
    if m >= 6:
        x = _edge_rows(x)
    want_q, want_e = fp8.quantize_rows(x)
    xd = x.cuda()
    _twice_into_poison(lambda q, e: quantize.quantize_rows(xd, out=q, scale_out=e),
                       (m, k), (m, k // 128), want_q, want_e, f"m={m} k={k}")


@pytest.mark.gpu
def test_quantize_rows_kernel_strided_rows_and_non_finite_groups(gen):
    from mok_cute.kernels import quantize

    wide = wide_bf16(gen, 50, 1024 + 256)
    wide[7, 128 + 3] = float("inf")
    wide[8, 128 + 600] = -float("inf")
    wide[9, 128 + 1000] = float("nan")
    x = wide.cuda()[:, 128:128 + 1024]  # rows 2560 bytes apart, 256 bytes in
    q, e = quantize.quantize_rows(x)
    want_q, want_e = fp8.quantize_rows(wide[:, 128:128 + 1024])
    _assert_same(q, want_q, "q")
    _assert_same(e, want_e, "e")
    assert e[7, 0] == e[8, 4] == e[9, 7] == fp8.EXP_NONFINITE


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 384])
@pytest.mark.parametrize("k", [8, 72, 1032, 2048])
def test_quantize_cols_kernel_is_bitwise_the_reference(gen, m, k):
    from mok_cute.kernels import quantize

    x = wide_bf16(gen, m, k, zero_groups=False)
    x = _edge_rows(x.t().contiguous()).t().contiguous() if k >= 6 else x  # edge columns
    x[:128, k // 2] = 0  # an all-zero column group
    want_q, want_e = fp8.quantize_cols(x)
    xd = x.cuda()
    _twice_into_poison(lambda q, e: quantize.quantize_cols(xd, out=q, scale_out=e),
                       (k, m), (k, m // 128), want_q, want_e, f"(transposed) m={m} k={k}")


def test_quantize_cols_per_expert_reference_scales_each_expert_segment(gen):
    """One scale per column over each expert's rows: the exponents are those of the segment's
    column amax, an expert without rows gets -127 and no data, rows past the last expert stay
    zero, and the dequantized copy is within e4m3's rounding of x."""
    x = wide_bf16(gen, 640, 72, zero_groups=False)
    offsets = torch.tensor([0, 256, 256, 512], dtype=torch.int32)
    qt, e = fp8.quantize_cols_per_expert(x, offsets)
    assert qt.shape == (72, 640) and e.shape == (3, 72) and (e[1] == -127).all()
    for i, (lo, hi) in enumerate(((0, 256), (256, 256), (256, 512))):
        if hi > lo:
            seg = x[lo:hi].float().abs().amax(0)
            want = fp8.scale_exponent_from_bits(seg.view(torch.int32) & 0x7FFFFFFF)
            assert torch.equal(e[i].long(), want.long())
    assert (qt[:, 512:].view(torch.uint8) == 0).all()
    # e4m3's rounding (1/16 relative), or half a subnormal step of the segment's column
    # (< amax * 2^-17.8) for elements that far below it
    y = (torch.randn(512, 72, generator=gen) * torch.exp(3 * torch.randn(72, generator=gen))).to(bf16)
    d = fp8.dequantize_cols_per_expert(*fp8.quantize_cols_per_expert(y, offsets), offsets).T
    yf = y.float()
    col_max = torch.cat([yf[:256].abs().amax(0, keepdim=True).expand(256, 72),
                         yf[256:].abs().amax(0, keepdim=True).expand(256, 72)])
    assert ((d - yf).abs() <= yf.abs() / 16 + col_max * 2.0 ** -17.8).all()


@pytest.mark.gpu
@pytest.mark.parametrize("counts,k", [([128, 0, 384], 72), ([1024, 128, 0, 256], 2048),
                                      ([0, 128], 8), ([128] * 9, 1032)])
def test_quantize_cols_per_expert_kernel_is_bitwise_the_reference(gen, counts, k):
    """Empty experts, one hot expert, K not a multiple of the 32-column strip; an all-zero
    column segment and edge columns; rows past the last expert untouched (the poison stays)."""
    from mok_cute.kernels import quantize

    m = sum(counts) + 128  # one group past the last expert
    x = wide_bf16(gen, m, k, zero_groups=False)
    x = _edge_rows(x.t().contiguous()).t().contiguous() if k >= 6 else x
    x[:128, k // 2] = 0
    offsets = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
    want_q, want_e = fp8.quantize_cols_per_expert(x, offsets)
    xd, od = x.cuda(), offsets.cuda()
    live = int(offsets[-1])
    runs = []
    for _ in range(2):
        q, e = _poison((k, m), e4m3), _poison((len(counts), k), torch.int8)
        quantize.quantize_cols_per_expert(xd, od, len(counts), out=q, scale_out=e)
        torch.cuda.synchronize()
        _assert_same(q[:, :live].contiguous(), want_q[:, :live].contiguous(), f"qt {counts} k={k}")
        _assert_same(e, want_e, f"e {counts} k={k}")
        assert (as_bytes(q[:, live:].contiguous()) == as_bytes(_poison((k, m - live), e4m3))).all()
        runs.append((as_bytes(q).clone(), e.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def _row_index(gen, rows: int, t: int) -> torch.Tensor:
    """int32 [rows]: tokens of x [t, K] drawn with repeats (a token on several rows), every
    7th row padding (-1) and a few indices outside [0, t): past the end, far past, negative."""
    idx = torch.randint(0, max(t, 1), (rows,), generator=gen, dtype=torch.int32)
    idx[::7] = -1
    for r, v in zip((3, 130, rows - 2), (t, t + 1000, -5)):
        if r < rows:
            idx[r] = v
    idx[1:rows:11] = 2 ** 31 - 1
    return idx


@pytest.mark.gpu
@pytest.mark.parametrize("counts,k,t", [([128, 0, 384], 72, 300), ([1024, 128, 0, 256], 2048, 77),
                                        ([0, 128], 8, 1), ([128] * 9, 1032, 1000),
                                        ([256, 128], 128, 0)])
def test_quantize_cols_per_expert_gather_is_bitwise_the_reference_on_gathered_rows(gen, counts, k, t):
    """row_index: the bits of ``fp8.quantize_cols_per_expert(gather_rows_ref(x, row_index))``
    with x [T, K] read in place: T not a multiple of 128 (and 0: every row a zero row), padding
    rows, indices past the end, tokens on several rows, an empty expert, a hot expert, K not
    a multiple of the 32-column strip, a NaN column; rows past the last expert untouched (the
    poison stays); a repeat gives the same bits."""
    from mok_cute.kernels import quantize, token_ops

    m = sum(counts) + 128  # one group past the last expert
    x = wide_bf16(gen, t, k, zero_groups=False)
    if t >= 1 and k >= 6:
        x = _edge_rows(x.t().contiguous()).t().contiguous()
        x[t // 2, k - 1] = float("nan")
    idx = _row_index(gen, m, t)
    offsets = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
    want_q, want_e = fp8.quantize_cols_per_expert(token_ops.gather_rows_ref(x, idx), offsets)
    xd, od, idd = x.cuda(), offsets.cuda(), idx.cuda()
    live = int(offsets[-1])
    runs = []
    for _ in range(2):
        q, e = _poison((k, m), e4m3), _poison((len(counts), k), torch.int8)
        got = quantize.quantize_cols_per_expert(xd, od, len(counts), out=q, scale_out=e, row_index=idd)
        torch.cuda.synchronize()
        assert got[0] is q and got[1] is e
        what = f"{counts} k={k} t={t}"
        _assert_same(q[:, :live].contiguous(), want_q[:, :live].contiguous(), f"qt {what}")
        _assert_same(e, want_e, f"e {what}")
        assert (as_bytes(q[:, live:].contiguous()) == as_bytes(_poison((k, m - live), e4m3))).all()
        runs.append((as_bytes(q).clone(), e.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    if t:  # the path it replaces: the gathered bf16 copy, quantized
        q2, e2 = quantize.quantize_cols_per_expert(token_ops.gather_rows(xd, idd), od, len(counts))
        _assert_same(q2[:, :live].contiguous(), want_q[:, :live].contiguous(), "qt of gather_rows")
        _assert_same(e2, want_e, "e of gather_rows")


@pytest.mark.gpu
def test_quantize_cols_per_expert_row_index_on_the_device():
    from mok_cute.kernels import quantize

    x = torch.zeros(77, 64, dtype=bf16, device="cuda")
    offsets = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="row_index: expected a contiguous, 16-byte aligned tensor on cuda"):
        quantize.quantize_cols_per_expert(x, offsets, 1, row_index=torch.zeros(128, dtype=torch.int32))
    with pytest.raises(ValueError, match="row_index: expected a contiguous, 16-byte aligned"):
        quantize.quantize_cols_per_expert(
            x, offsets, 1, row_index=torch.zeros(129, dtype=torch.int32, device="cuda")[1:])


def _gather_index(gen, rows: int, t: int) -> torch.Tensor:
    """``_row_index`` for any row count (0 included)."""
    return torch.zeros(0, dtype=torch.int32) if rows == 0 else _row_index(gen, rows, t)


@pytest.mark.gpu
@pytest.mark.parametrize("t,m,k", [(300, 333, 128), (77, 200, 7168), (1000, 128, 1408),
                                   (1, 50, 256), (0, 40, 128)])
def test_quantize_rows_gather_is_bitwise_the_reference_on_gathered_rows(gen, t, m, k):
    """row_index: the bits of ``fp8.quantize_rows(gather_rows_ref(x, row_index))`` with x
    [T, K] read in place: T not a multiple of 128, T = 1 and T = 0 (every row a zero row),
    M unrelated to T and not a multiple of anything, padding rows (-1), indices past the end,
    far past it and negative (zero rows, exponents -127), tokens on several rows, edge rows, a
    NaN and an inf group; every output byte written (poisoned before); a repeat gives the same
    bits; the gathered bf16 copy through ``gather_rows`` and the plain kernel agrees."""
    from mok_cute.kernels import quantize, token_ops

    x = wide_bf16(gen, t, k)
    if t >= 6:
        x = _edge_rows(x)
    if t:
        x[t // 2, k - 1] = float("nan")
    if t >= 3:
        x[t // 3, 5] = -float("inf")
    idx = _gather_index(gen, m, t)
    want_q, want_e = fp8.quantize_rows(token_ops.gather_rows_ref(x, idx))
    outside = (idx < 0) | (idx >= t)
    assert outside.any() and (t == 0 or not outside.all())
    assert (want_e[outside] == fp8.EXP_MIN).all() and (as_bytes(want_q[outside]) == 0).all()
    xd, idd = x.cuda(), idx.cuda()
    _twice_into_poison(lambda q, e: quantize.quantize_rows(xd, out=q, scale_out=e, row_index=idd),
                       (m, k), (m, k // 128), want_q, want_e, f"t={t} m={m} k={k}")
    q3, e3 = quantize.quantize_rows(xd, row_index=idd)  # outputs allocated by the call
    _assert_same(q3, want_q, "q allocated")
    _assert_same(e3, want_e, "e allocated")
    if t:  # the path it replaces: the gathered bf16 copy, quantized
        q2, e2 = quantize.quantize_rows(token_ops.gather_rows(xd, idd))
        _assert_same(q2, want_q, "q of gather_rows")
        _assert_same(e2, want_e, "e of gather_rows")


@pytest.mark.gpu
def test_quantize_rows_gather_strided_x(gen):
    """x a column slice of a wider tensor (rows 2560 bytes apart, 256 bytes in), read
    through the row index: the reference on the gathered slice."""
    from mok_cute.kernels import quantize, token_ops

    wide = wide_bf16(gen, 50, 1024 + 256)
    wide[7, 128 + 3] = float("inf")
    wide[9, 128 + 1000] = float("nan")
    idx = _row_index(gen, 97, 50)
    idx[:3] = torch.tensor([7, 9, 49], dtype=torch.int32)
    x = wide.cuda()[:, 128:128 + 1024]
    q, e = quantize.quantize_rows(x, row_index=idx.cuda())
    want_q, want_e = fp8.quantize_rows(token_ops.gather_rows_ref(wide[:, 128:128 + 1024], idx))
    _assert_same(q, want_q, "q")
    _assert_same(e, want_e, "e")
    assert e[0, 0] == e[1, 7] == fp8.EXP_NONFINITE


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,t", [(384, 72, 300), (128, 8, 1), (1024, 2048, 77),
                                   (256, 1032, 1000), (256, 128, 0)])
def test_quantize_cols_gather_is_bitwise_the_reference_on_gathered_rows(gen, m, k, t):
    """row_index: the bits of ``fp8.quantize_cols(gather_rows_ref(x, row_index))`` with x
    [T, K] read in place: T not a multiple of 128, T = 1 and T = 0 (every row a zero row),
    padding rows, indices past the end, tokens on several rows, K not a multiple of the
    32-column strip, edge columns, a NaN and an inf column group; every output byte written
    (poisoned before); a repeat gives the same bits; ``gather_rows`` + the plain kernel agrees."""
    from mok_cute.kernels import quantize, token_ops

    x = wide_bf16(gen, t, k, zero_groups=False)
    if t >= 1 and k >= 6:
        x = _edge_rows(x.t().contiguous()).t().contiguous()
        x[t // 2, k - 1] = float("nan")
    if t >= 3:
        x[t // 3, k // 2] = float("inf")
    idx = _row_index(gen, m, t)
    want_q, want_e = fp8.quantize_cols(token_ops.gather_rows_ref(x, idx))
    xd, idd = x.cuda(), idx.cuda()
    _twice_into_poison(lambda q, e: quantize.quantize_cols(xd, out=q, scale_out=e, row_index=idd),
                       (k, m), (k, m // 128), want_q, want_e, f"m={m} k={k} t={t}")
    if t:  # the path it replaces: the gathered bf16 copy, quantized
        q2, e2 = quantize.quantize_cols(token_ops.gather_rows(xd, idd))
        _assert_same(q2, want_q, "qt of gather_rows")
        _assert_same(e2, want_e, "e of gather_rows")


@pytest.mark.gpu
def test_quantize_rows_and_cols_row_index_on_the_device():
    """A row index on the CPU or misaligned on the GPU is refused; an empty one launches
    nothing."""
    from mok_cute.kernels import quantize

    x = torch.zeros(77, 256, dtype=bf16, device="cuda")
    for fn in (quantize.quantize_rows, quantize.quantize_cols):
        with pytest.raises(ValueError, match="row_index: expected a contiguous, 16-byte aligned "
                                             "tensor on cuda"):
            fn(x, row_index=torch.zeros(128, dtype=torch.int32))
        with pytest.raises(ValueError, match="row_index: expected a contiguous, 16-byte aligned"):
            fn(x, row_index=torch.zeros(129, dtype=torch.int32, device="cuda")[1:])
    empty = torch.zeros(0, dtype=torch.int32, device="cuda")
    q, e = quantize.quantize_rows(x, row_index=empty)
    assert q.shape == (0, 256) and e.shape == (0, 2)
    qt, et = quantize.quantize_cols(x, row_index=empty)
    assert qt.shape == (256, 0) and et.shape == (256, 0)


@pytest.mark.gpu
def test_fp8_weight_grads_through_the_row_index_are_the_gathered_rows_bits(gen):
    """The FP8 weight gradients (``_gate_up_grads_fp8``, ``_down_grad_fp8``) on the GPU
    kernels: x and d_out quantized through the row index (``IndexedRows``) give the bits of
    their gathered rows (``moe_backward``'s FP8 weight gradients without the gathers)."""
    from mok_cute import expert_backward
    from mok_cute.kernels import token_ops

    T, H, I, rows = 300, 256, 128, 1024
    counts = [512, 0, 384]  # an empty expert; 128 rows past the last
    offsets = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32).cuda()
    x = wide_bf16(gen, T, H, zero_groups=False).cuda()
    idx = _row_index(gen, rows, T).cuda()
    d_pre = (torch.randn(rows, 2 * I, generator=gen) * 0.1).to(bf16).cuda()
    hw, dy = (torch.randn(rows, I, generator=gen).to(bf16).cuda(),
              torch.randn(T, H, generator=gen).to(bf16).cuda())

    def grads(d_rows, x_rows):
        return (*expert_backward._gate_up_grads_fp8(d_pre, x_rows, offsets, len(counts), I),
                expert_backward._down_grad_fp8(hw, d_rows, offsets, len(counts)))

    want = grads(token_ops.gather_rows(dy, idx), token_ops.gather_rows(x, idx))
    in_place = expert_backward.IndexedRows
    for _ in range(2):
        got = grads(in_place(dy, idx), in_place(x, idx))
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 128), (384, 256), (3, 256, 640), (2048, 7168),
                                   (3, 200, 328), (2, 320, 2880), (64, 8)])
@pytest.mark.parametrize("mode", ["q", "qt", "both"])
def test_quantize_blocks_kernel_is_bitwise_the_reference(gen, shape, mode):
    """Bitwise the reference, both copies; N or K not a multiple of 128 (gptoss's 2880): the
    reference on w zero-padded to whole blocks, the kernel reading w in place."""
    from mok_cute.kernels import quantize

    w = wide_bf16(gen, math.prod(shape[:-1]), shape[-1]).reshape(shape)
    w.view(-1, shape[-1])[:128, -128:] = 0  # an all-zero block
    if mode == "both":
        w.view(-1, shape[-1])[-1, 5] = float("nan")  # the last block row: a NaN block
    n, k = shape[-2:]
    padded = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128))
    want = fp8.quantize_blocks(padded) + fp8.quantize_blocks(padded, transposed=True)
    names = {"q": (0, 1), "qt": (2, 3), "both": (0, 1, 2, 3)}[mode]
    wd = w.cuda()
    runs = []
    for _ in range(2):
        outs = tuple(_poison(want[i].shape, want[i].dtype) for i in names)
        got = quantize.quantize_blocks(wd, transposed=mode == "qt", both=mode == "both", out=outs)
        torch.cuda.synchronize()
        assert all(g is o for g, o in zip(got, outs))
        for i, g in zip(names, got):
            _assert_same(g, want[i], f"{mode}[{i}] shape={shape}")
        runs.append([(as_bytes(g) if g.dtype == e4m3 else g).clone() for g in got])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
def test_kernels_on_empty_inputs_launch_nothing():
    from mok_cute.kernels import quantize

    q, e = quantize.quantize_rows(torch.zeros(0, 256, dtype=bf16, device="cuda"))
    assert q.shape == (0, 256) and e.shape == (0, 2)
    qt, et = quantize.quantize_cols(torch.zeros(0, 64, dtype=bf16, device="cuda"))
    assert qt.shape == (64, 0) and et.shape == (64, 0)


@pytest.mark.gpu
def test_reference_gives_the_same_bits_on_cuda(gen):
    """mok_cute.fp8 is also the fallback on the GPU: torch's CUDA ops give the CPU's bits."""
    x = _edge_rows(wide_bf16(gen, 256, 1024))
    x[9, 17] = float("nan")
    for fn in (fp8.quantize_rows, fp8.quantize_cols, fp8.quantize_blocks):
        q, e = fn(x)
        qd, ed = fn(x.cuda())
        _assert_same(qd, q, f"{fn.__name__} q")
        _assert_same(ed, e, f"{fn.__name__} e")
    q, e = fp8.quantize_rows(x)
    s = fp8.to_mxfp8(q, e)[1]
    s[:, 1::4] = (s[:, 1::4].to(torch.int32) - 3).clamp(min=0).to(torch.uint8)  # shifted on the way in
    q2, e2 = fp8.from_mxfp8(q, s)
    q2d, e2d = fp8.from_mxfp8(q.cuda(), s.cuda())
    _assert_same(q2d, q2, "from_mxfp8 q")
    _assert_same(e2d, e2, "from_mxfp8 e")


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_quantize_scatter_rows_writes_each_token_to_its_rows(gen, top_k):
    """The FP8 path's x into expert order: each token's quantized row and exponents at each of
    its K destination rows, bitwise ``fp8.quantize_rows``; -1 slots and the rows no slot names
    are not written (they keep their poison)."""
    from mok_cute.kernels import quantize

    t, h, rows_total = 77, 384, 77 * top_k + 50
    x = (torch.randn(t, h, generator=gen) * 3).bfloat16()
    perm = torch.randperm(rows_total, generator=gen)[: t * top_k].to(torch.int32)
    perm[::5] = -1  # routed nowhere
    q_out = torch.full((rows_total, h), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).cuda()
    e_out = torch.full((rows_total, h // 128), 99, dtype=torch.int8).cuda()
    q, e = quantize.quantize_scatter_rows(x.cuda(), perm.cuda(), rows_total, out=q_out,
                                          scale_out=e_out)
    want_q, want_e = fp8.quantize_rows(x)
    token = torch.arange(t * top_k) // top_k
    written = perm >= 0
    dest = perm[written].long()
    assert torch.equal(q.cpu().view(torch.uint8)[dest], want_q.view(torch.uint8)[token[written]])
    assert torch.equal(e.cpu()[dest], want_e[token[written]])
    untouched = torch.ones(rows_total, dtype=torch.bool)
    untouched[dest] = False
    assert (q.cpu().view(torch.uint8)[untouched] == 0x7F).all() and (e.cpu()[untouched] == 99).all()
