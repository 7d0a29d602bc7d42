"""FP8 FC1 grouped GEMM with the SwiGLU epilogue (kernels/gemm_fp8.py, epilogue "swiglu",
issue 33 item 2): compile-only checks and CPU models in CI, numerics on the H200 against the
float64 reference of the dequantized operands (g, u rounded to bf16, h as the reference).

Tolerance of h. g and u are two promoted FP8 GEMMs, each within the FC2 kernel's bounds of
its float64 value (REL_L1 overall, ROW_REL_L1 a row, before rounding). Rounding to bf16 does
not amplify an error in L1 on average: a value moved by d < one bf16 ulp rounds to a
neighbour with probability about d / ulp, so the expected change after rounding is d. Then
h = bf16(silu(g) * u) is the same function of the rounded g, u on both sides (silu by
ex2.approx / rcp.approx in the kernel, about 1e-7 relative: a bf16 flip of h for ~1e-4 of the
elements). So h's error is about the sum of g's (through silu, whose log-derivative is near 1
where h carries its L1 mass) and u's: twice the FC2 bounds. A wrong row or block exponent
moves a row by a factor 2, a wrong expert or half by O(1): both far outside.
"""

import re

import pytest
import torch

from mok_cute import fp8, jit
from mok_cute.constants import TILE_M
from mok_cute.kernels import gemm_fp8
from test_gemm_fp8 import (PIPELINED_ISSUES, REL_L1, ROW_REL_L1, _promoted_model, _quantized,
                           _segments, assert_pipelined_promotion, rel_l1, wgmma_scale_d)
from poison import poison_free_memory

H_REL_L1 = 2 * REL_L1          # 1e-3 over all checked rows
H_ROW_REL_L1 = 2 * ROW_REL_L1  # 6e-3 a row


def _fc1_operands(m, i, k, experts, gen, device="cpu"):
    """A [m, K] with 1 x 128 exponents, W_gate and W_up [E, I, K] with 128 x 128 block
    exponents (the two halves of one draw of ``_quantized``, made contiguous)."""
    a, e_a, w, e_w = _quantized(m, 2 * i, k, experts, gen, device)
    blocks = i // 128
    return (a, e_a, w[:, :i].contiguous(), e_w[:, :blocks].contiguous(),
            w[:, i:].contiguous(), e_w[:, blocks:].contiguous())


# ---------------------------------------------------------------------- compile-only (CI)
@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return jit.inspect_kernel("gemm_fp8_fc1", "sm_90a", tmp_path_factory.mktemp("fp8_fc1"))


def test_fc1_compiles_with_e4m3_wgmma_one_ffma_per_element_and_the_swiglu_epilogue(report):
    ptx = open(report.ptx_path).read()
    assert re.search(r"^\.target sm_90a", ptx, re.M)
    # 128-deep K groups of four k32 e4m3 wgmmas over [gate 64 | up 64], pipelined promotion
    assert_pipelined_promotion(ptx)
    assert "bf16.bf16" not in ptx
    # the core's swiglu epilogue: silu by ex2 / rcp once per h element (64 x 64 / 128 = 32)
    assert len(re.findall(r"ex2\.approx", ptx)) == 32
    assert len(re.findall(r"rcp\.approx", ptx)) == 32
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232", ptx)


def test_fc1_first_wgmma_of_a_group_overwrites_the_partial(report):
    assert wgmma_scale_d(open(report.ptx_path).read()) == [0, 1, 1, 1] * PIPELINED_ISSUES


def test_fc1_no_spills_no_c7508(report):
    assert report.kernels and report.spill_bytes == 0, [k.__dict__ for k in report.kernels]
    assert report.mix["ld.local/st.local"] == 0
    assert not [w for w in report.warnings if "C7508" in w], report.warnings


def test_fc1_bad_configuration_is_named():
    with pytest.raises(ValueError, match="tile_n"):
        gemm_fp8.GroupedGemmFp8Sm90(tile_n=192, epilogue="swiglu")
    with pytest.raises(ValueError, match="tile_n"):
        gemm_fp8.GroupedGemmFp8Sm90(tile_n=256, epilogue="dgated")


def test_fc1_quantize_h_writes_e4m3_h_and_exponents_from_registers(tmp_path):
    """quantize_h (tile_n 256): no bf16 h and no TMA store; per thread 32 conversions
    (64 h values), the row amax over the row's 4 lanes (2 shuffles a row), the row's 16-bit
    chunks transposed over its quad of lanes (2 shuffles, 3 byte permutes a 32-byte span, 4
    spans a row), so each lane stores 8 contiguous bytes (4 stores a row), and one exponent
    byte a row; no spills."""
    rep = jit.inspect_kernel("gemm_fp8_fc1", "sm_90a", tmp_path, tile_n=256, quantize_h=True)
    ptx = open(rep.ptx_path).read()
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 32
    assert ptx.count("shfl.sync.bfly") == 4 + 16
    assert ptx.count("prmt.b32") == 24
    assert ptx.count("st.global.v2.b32") == 8 and ptx.count("st.global.b8") == 2
    assert not re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)
    assert rep.spill_bytes == 0 and rep.mix["ld.local/st.local"] == 0
    with pytest.raises(ValueError, match="quantize_h"):
        gemm_fp8.GroupedGemmFp8Sm90(tile_n=128, epilogue="swiglu", quantize_h=True)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,i,k", [([300, 0, 129, 128], 1024, 2048), ([513, 77], 2048, 7168)])
def test_fp8_fc1_quantize_h_is_the_row_quantizer_of_its_bf16_h(counts, i, k, gen):
    """FC1 with h quantized in its epilogue: bitwise ``quantize.quantize_rows`` of the bf16 h
    the same 256-wide kernel writes without it, on every scheduled row."""
    from mok_cute.kernels import quantize

    dev = "cuda"
    tile_expert, num_tiles, row_valid = _segments(counts, dev)
    m = row_valid.numel()
    a, e_a, wg, eg, wu, eu = _fc1_operands(m, i, k, len(counts), gen, dev)
    h = gemm_fp8.grouped_gemm_fp8_swiglu(a, e_a, wg, eg, wu, eu, tile_expert, num_tiles,
                                         tile_n=256)
    poison_free_memory()
    hq, eh = gemm_fp8.grouped_gemm_fp8_swiglu(a, e_a, wg, eg, wu, eu, tile_expert, num_tiles,
                                              tile_n=256, quantize_h=True)
    want_q, want_e = quantize.quantize_rows(h)
    assert torch.equal(hq.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(eh, want_e)


def test_fc1_256_wide_tiles_promote_halves_and_keep_h_tiles_128_wide(tmp_path):
    """tile_n 256: [gate 128 | up 128], one 128-wide h tile = one whole 1 x 128 scale group of
    h; two batches of four wgmmas a group, 128 FFMA, silu once per h element (128 x 128 / 256
    threads = 64), no spills (also saving g | u)."""
    for static in ({"tile_n": 256}, {"tile_n": 256, "save_preact": True}):
        rep = jit.inspect_kernel("gemm_fp8_fc1", "sm_90a", tmp_path, **static)
        ptx = open(rep.ptx_path).read()
        assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx)) == 8
        assert len(re.findall(r"fma\.rn\.f32", ptx)) == 128
        assert len(re.findall(r"ex2\.approx", ptx)) == 64
        assert rep.spill_bytes == 0 and rep.mix["ld.local/st.local"] == 0, static
    with pytest.raises(ValueError, match="epilogue"):
        gemm_fp8.GroupedGemmFp8Sm90(epilogue="gelu")


# ---------------------------------------------------------------------- CPU models
def test_swiglu_scale_slot_gives_gate_columns_the_gate_block():
    """Accumulator element v of lane l sits at column 8 (v // 4) + 2 (l % 4) + v % 2 of the
    [gate 64 | up 64] tile: slot 0 (W_gate's block) exactly for columns < 64, else 1 (W_up's)."""
    for lane in range(4):
        for v in range(64):
            col = 8 * (v // 4) + 2 * lane + v % 2
            assert gemm_fp8.scale_slot(v, 128, swiglu=True) == (0 if col < 64 else 1), (lane, v)


def test_fc1_promoted_model_meets_the_tolerance_on_cpu(gen):
    """The kernel's numerics modelled on the CPU (exact partials per group, fp32 promotion,
    g and u rounded to bf16, h in fp32 rounded once) against the float64 reference: inside
    the tolerance the GPU tests use, with margin."""
    counts = [200, 0, 56]
    tiles = [(c + TILE_M - 1) // TILE_M for c in counts]
    tile_expert = torch.tensor([e for e, t in enumerate(tiles) for _ in range(t)], dtype=torch.int32)
    a, e_a, wg, eg, wu, eu = _fc1_operands(sum(tiles) * TILE_M, 384, 1024, len(counts), gen)
    ref = gemm_fp8.grouped_gemm_fp8_swiglu_ref(a, e_a, wg, eg, wu, eu, tile_expert, sum(tiles))
    g = _promoted_model(a, e_a, wg, eg, tile_expert, sum(tiles)).float()
    u = _promoted_model(a, e_a, wu, eu, tile_expert, sum(tiles)).float()
    model = (torch.nn.functional.silu(g) * u).bfloat16()
    assert rel_l1(model, ref) < H_REL_L1 / 5
    assert (rel_l1(model, ref, dim=1) < H_ROW_REL_L1).all()


def test_fc1_reference_rounds_g_and_u_then_h():
    """g and u are the float64 products rounded once to bf16; h = bf16(silu(g) * u) in fp32."""
    gen = torch.Generator().manual_seed(33)
    a, e_a, wg, eg, wu, eu = _fc1_operands(128, 256, 256, 1, gen)
    ref = gemm_fp8.grouped_gemm_fp8_swiglu_ref(a, e_a, wg, eg, wu, eu,
                                               torch.zeros(1, dtype=torch.int32), 1)
    x = fp8.dequantize_rows(a, e_a).double()
    g = (x @ fp8.dequantize_blocks(wg[0], eg[0]).double().T).bfloat16().float()
    u = (x @ fp8.dequantize_blocks(wu[0], eu[0]).double().T).bfloat16().float()
    assert torch.equal(ref, (torch.nn.functional.silu(g) * u).bfloat16())


def test_fc1_bad_arguments_are_named(gen):
    a, e_a, wg, eg, wu, eu = _fc1_operands(128, 256, 256, 2, gen)
    te, nt = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    f = gemm_fp8.grouped_gemm_fp8_swiglu
    with pytest.raises(TypeError, match="w_up: expected dtype float8_e4m3fn"):
        f(a, e_a, wg, eg, wu.float(), eu, te, nt)
    with pytest.raises(ValueError, match="w_up: expected the shape of w_gate"):
        f(a, e_a, wg, eg, wu[:, :128], eu[:, :1], te, nt)
    with pytest.raises(ValueError, match="e_up: expected shape"):
        f(a, e_a, wg, eg, wu, eu[:, :, :1], te, nt)
    with pytest.raises(TypeError, match="e_gate: expected an int8 tensor"):
        f(a, e_a, wg, eg.int(), wu, eu, te, nt)
    with pytest.raises(ValueError, match="w_gate: expected K = 256"):
        f(a, e_a, wg[:, :, :128], eg[:, :, :1], wu, eu, te, nt)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor"):
        f(a, e_a, wg, eg, wu, eu, te, nt)


# ---------------------------------------------------------------------- numerics (GPU)
def _check_h(got, ref, what):
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all(), f"{what}: rows not written (poison left) or non-finite"
    total = rel_l1(got, ref).item()
    assert total <= H_REL_L1, f"{what}: rel-L1 {total:.3g} > {H_REL_L1}"
    rows = rel_l1(got, ref, dim=1)
    worst = int(rows.argmax())
    assert rows.max().item() <= H_ROW_REL_L1, f"{what}: row {worst} rel-L1 {rows.max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("counts,i,k", [
    ([300, 0, 129, 128], 1024, 2048),   # an expert with zero tiles, partial segments
    ([513, 77], 2048, 7168),            # dsv3's FC1 (I = 2048, H = 7168): 56 promotions
    ([200, 0, 260], 384, 1024),         # I = 384: an odd number of 128-blocks, 6 h tiles
])
def test_fp8_fc1_matches_float64_reference(counts, i, k, tile_n, gen):
    dev = "cuda"
    tile_expert, num_tiles, row_valid = _segments(counts, dev)
    m = row_valid.numel()
    # one more M-tile of data past num_tiles: it must not be computed or written
    a, e_a, wg, eg, wu, eu = _fc1_operands(m + TILE_M, i, k, len(counts), gen, dev)
    te = torch.cat([tile_expert, torch.zeros(1, dtype=torch.int32, device=dev)])
    out = torch.full((m + TILE_M, i), float("nan"), device=dev, dtype=torch.bfloat16)
    gemm_fp8.grouped_gemm_fp8_swiglu(a, e_a, wg, eg, wu, eu, te, num_tiles, out=out,
                                     tile_n=tile_n)
    ref = gemm_fp8.grouped_gemm_fp8_swiglu_ref(a, e_a, wg, eg, wu, eu, te, num_tiles)
    # every row of a scheduled tile is computed (padding rows too): check them all
    _check_h(out[:m], ref, f"counts {counts}, I {i}, K {k}, tile_n {tile_n}")
    assert torch.isnan(out[m:]).all(), "rows past num_m_tiles were written"
    again = torch.full_like(out, float("nan"))
    gemm_fp8.grouped_gemm_fp8_swiglu(a, e_a, wg, eg, wu, eu, te, num_tiles, out=again,
                                     tile_n=tile_n)
    assert torch.equal(out[:m], again[:m]), "not bitwise reproducible"


@pytest.mark.gpu
def test_fp8_fc1_rows_not_a_multiple_of_the_tile(gen):
    """A with M = 2 * 128 + 77 rows and 3 scheduled tiles: the last tile's rows past M read as
    zeros (TMA) and its stores are clipped at M (the rows after the view stay poisoned)."""
    dev = "cuda"
    m, i, k = 2 * TILE_M + 77, 512, 2048
    a, e_a, wg, eg, wu, eu = _fc1_operands(m, i, k, 2, gen, dev)
    te = torch.tensor([0, 1, 1], dtype=torch.int32, device=dev)
    nt = torch.tensor([3], dtype=torch.int32, device=dev)
    full = torch.full((3 * TILE_M + TILE_M, i), float("nan"), device=dev, dtype=torch.bfloat16)
    gemm_fp8.grouped_gemm_fp8_swiglu(a, e_a, wg, eg, wu, eu, te, nt, out=full[:m])
    pad = 3 * TILE_M - m
    a_pad = torch.cat([a.view(torch.uint8), torch.zeros(pad, k, dtype=torch.uint8, device=dev)]
                      ).view(torch.float8_e4m3fn)
    e_pad = torch.cat([e_a, torch.full((pad, k // 128), fp8.EXP_MIN, dtype=torch.int8, device=dev)])
    ref = gemm_fp8.grouped_gemm_fp8_swiglu_ref(a_pad, e_pad, wg, eg, wu, eu, te, nt)[:m]
    _check_h(full[:m], ref, f"M = {m}")
    assert torch.isnan(full[m:]).all(), "stores past M were not clipped"


@pytest.mark.gpu
def test_fp8_fc1_empty_schedule_writes_nothing(gen):
    dev = "cuda"
    a, e_a, wg, eg, wu, eu = _fc1_operands(TILE_M, 256, 256, 1, gen, dev)
    out = torch.full((TILE_M, 256), float("nan"), device=dev, dtype=torch.bfloat16)
    gemm_fp8.grouped_gemm_fp8_swiglu(a, e_a, wg, eg, wu, eu,
                                     torch.zeros(1, dtype=torch.int32, device=dev),
                                     torch.zeros(1, dtype=torch.int32, device=dev), out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


# ---------------------------------------------------------------------- the training forward
def test_fc1_save_preact_compiles_with_g_and_u_stored_by_slot(tmp_path):
    """save_preact: h by TMA as without it, g and u from registers as 32-bit bf16 pairs (two
    64-wide h subtiles x 8 pairs x g, u a thread), 0 spills."""
    rep = jit.inspect_kernel("gemm_fp8_fc1", "sm_90a", tmp_path, save_preact=True)
    ptx = open(rep.ptx_path).read()
    assert len(re.findall(r"st\.global\.(b32|u32)", ptx)) == 2 * 8 * 2
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)) == 2
    assert rep.spill_bytes == 0 and rep.mix["ld.local/st.local"] == 0


@pytest.mark.gpu
def test_fp8_fc1_saves_each_rows_g_and_u_at_its_slot(gen):
    """The training forward's FP8 FC1: h as without saving (bitwise), and each routed row's
    g | u at its slot within the FC2 kernel's bounds of the float64 products (rounded to bf16);
    padding rows store nothing (their slots' rows stay poisoned: no slot is theirs)."""
    dev = "cuda"
    counts, i, k = [300, 0, 129, 128], 512, 1024
    tile_expert, num_tiles, row_valid = _segments(counts, dev)
    m = row_valid.numel()
    a, e_a, wg, eg, wu, eu = _fc1_operands(m, i, k, len(counts), gen, dev)
    slots = int(row_valid.sum())
    row_slot = torch.full((m,), -1, dtype=torch.int32)
    row_slot[row_valid.cpu()] = torch.randperm(slots, generator=gen).to(torch.int32)
    row_slot = row_slot.to(dev)
    preact = torch.full((slots + 1, 2 * i), float("nan"), device=dev, dtype=torch.bfloat16)
    h = gemm_fp8.grouped_gemm_fp8_swiglu(a, e_a, wg, eg, wu, eu, tile_expert, num_tiles,
                                         preact_out=preact, preact_slot=row_slot)
    plain = gemm_fp8.grouped_gemm_fp8_swiglu(a, e_a, wg, eg, wu, eu, tile_expert, num_tiles)
    assert torch.equal(h[row_valid], plain[row_valid])
    assert torch.isnan(preact[slots]).all(), "a row no slot maps to was written"
    x = fp8.dequantize_rows(a, e_a).double()
    want = torch.empty(m, 2 * i, dtype=torch.float64, device=dev)
    for t, e in enumerate(tile_expert.tolist()):
        w = torch.cat([fp8.dequantize_blocks(wg[e], eg[e]), fp8.dequantize_blocks(wu[e], eu[e])]).double()
        want[t * TILE_M:(t + 1) * TILE_M] = x[t * TILE_M:(t + 1) * TILE_M] @ w.T
    got = preact[row_slot[row_valid].long()].double()
    want = want[row_valid].bfloat16().double()
    assert torch.isfinite(got).all()
    assert rel_l1(got, want).item() <= REL_L1
    assert rel_l1(got, want, dim=1).max().item() <= ROW_REL_L1
