"""FP8 FC1 dgrad: the promoted grouped GEMM with K split between two weight tensors
(kernels/gemm_fp8.py, ``b_split_k``; issue 33 item 2, the first training variant):
``dx rows = [dG | dU] . [W_gate^T; W_up^T]`` on the weights' exact transposed e4m3 copies.
Compile-only checks and the CPU model in CI; on the H200 against the float64 reference of the
dequantized operands, at the FC2 kernel's bounds (the same arithmetic: one K, two sources of
W k-tiles and of their block exponents).
"""

import re

import pytest
import torch

from mok_cute import fp8, jit
from mok_cute.constants import TILE_M
from mok_cute.kernels import gemm_fp8
from test_gemm_fp8 import (REL_L1, ROW_REL_L1, _check, _promoted_model, _quantized, _segments,
                           assert_pipelined_promotion, rel_l1)


def _split_operands(m, n, k1, k2, experts, gen, device="cpu"):
    """A [m, K1 + K2] with 1 x 128 exponents, W1 [E, N, K1] and W2 [E, N, K2] with 128 x 128
    block exponents (one draw of ``_quantized`` over K1 + K2, cut along K)."""
    a, e_a, w, e_w = _quantized(m, n, k1 + k2, experts, gen, device)
    g1 = k1 // 128
    return (a, e_a, w[:, :, :k1].contiguous(), e_w[:, :, :g1].contiguous(),
            w[:, :, k1:].contiguous(), e_w[:, :, g1:].contiguous(), w, e_w)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return jit.inspect_kernel("gemm_fp8_fc1_dgrad", "sm_90a", tmp_path_factory.mktemp("fp8_dgrad"))


def test_split_k_compiles_like_fc2_with_two_w_sources(report, tmp_path):
    ptx = open(report.ptx_path).read()
    assert_pipelined_promotion(ptx)
    # the producer's two W sources: twice the FC2 kernel's 3-D TMA loads of W [N, K, E]
    # (one copy of its issue code for each tensor: k < K1 from W1, else W2)
    fc2 = open(jit.inspect_kernel("gemm_fp8_fc2", "sm_90a", tmp_path).ptx_path).read()
    w_loads = "cp.async.bulk.tensor.3d.shared::cta.global"
    assert ptx.count(w_loads) == 2 * fc2.count(w_loads) > 0
    assert report.spill_bytes == 0 and report.mix["ld.local/st.local"] == 0
    assert not [w for w in report.warnings if "C7508" in w]


def test_split_k_needs_the_store_epilogue_and_128_wide_tiles():
    with pytest.raises(ValueError, match="b_split_k"):
        gemm_fp8.GroupedGemmFp8Sm90(tile_n=256, b_split_k=True)
    with pytest.raises(ValueError, match="b_split_k"):
        gemm_fp8.GroupedGemmFp8Sm90(epilogue="swiglu", b_split_k=True)


def test_split_k_reference_is_the_unsplit_reference(gen):
    """Cutting W along K changes nothing in the exact product: the oracle equals the FC2
    kernel's oracle on the uncut weights, and the promoted model meets the tolerance."""
    counts = [200, 0, 56]
    tiles = [(c + TILE_M - 1) // TILE_M for c in counts]
    te = torch.tensor([e for e, t in enumerate(tiles) for _ in range(t)], dtype=torch.int32)
    a, e_a, w1, e1, w2, e2, w, e_w = _split_operands(sum(tiles) * TILE_M, 256, 384, 256,
                                                     len(counts), gen)
    ref = gemm_fp8.grouped_gemm_fp8_split_k_ref(a, e_a, w1, e1, w2, e2, te, sum(tiles))
    assert torch.equal(ref, gemm_fp8.grouped_gemm_fp8_ref(a, e_a, w, e_w, te, sum(tiles)))
    model = _promoted_model(a, e_a, w, e_w, te, sum(tiles))
    assert rel_l1(model, ref) < REL_L1 / 5
    assert (rel_l1(model, ref, dim=1) < ROW_REL_L1).all()


def test_split_k_bad_arguments_are_named(gen):
    a, e_a, w1, e1, w2, e2, _, _ = _split_operands(128, 256, 256, 128, 2, gen)
    te, nt = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    f = gemm_fp8.grouped_gemm_fp8_split_k
    with pytest.raises(ValueError, match="a: expected K = K1 \\+ K2"):
        f(a[:, :256], e_a[:, :2], w1, e1, w2, e2, te, nt)
    with pytest.raises(ValueError, match="w2: expected"):
        f(a, e_a, w1, e1, w2[:, :128], e2[:, :1], te, nt)
    with pytest.raises(ValueError, match="e_w2: expected shape"):
        f(a, e_a, w1, e1, w2, e2[:, :, :0], te, nt)
    with pytest.raises(TypeError, match="w1: expected dtype float8_e4m3fn"):
        f(a, e_a, w1.float(), e1, w2, e2, te, nt)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor"):
        f(a, e_a, w1, e1, w2, e2, te, nt)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,n,k1,k2", [
    ([300, 0, 129, 128], 4096, 1024, 1024),  # an expert with zero tiles; K1 = K2 = I
    ([513, 77], 7168, 2048, 2048),           # dsv3's FC1 dgrad: N = H, K = 2I = 4096
    ([200, 0, 260], 2048, 768, 768),         # qwen3's: an odd number of 128-groups a half
])
def test_fp8_split_k_matches_float64_reference(counts, n, k1, k2, gen):
    dev = "cuda"
    tile_expert, num_tiles, row_valid = _segments(counts, dev)
    m = row_valid.numel()
    a, e_a, w1, e1, w2, e2, _, _ = _split_operands(m + TILE_M, n, k1, k2, len(counts), gen, dev)
    te = torch.cat([tile_expert, torch.zeros(1, dtype=torch.int32, device=dev)])
    out = torch.full((m + TILE_M, n), float("nan"), device=dev, dtype=torch.bfloat16)
    gemm_fp8.grouped_gemm_fp8_split_k(a, e_a, w1, e1, w2, e2, te, num_tiles, out=out)
    ref = gemm_fp8.grouped_gemm_fp8_split_k_ref(a, e_a, w1, e1, w2, e2, te, num_tiles)
    _check(out[:m], ref, row_valid, f"counts {counts}, N {n}, K {k1} + {k2}")
    assert torch.isnan(out[m:]).all(), "rows past num_m_tiles were written"
    again = torch.full_like(out, float("nan"))
    gemm_fp8.grouped_gemm_fp8_split_k(a, e_a, w1, e1, w2, e2, te, num_tiles, out=again)
    assert torch.equal(out[:m], again[:m]), "not bitwise reproducible"


@pytest.mark.gpu
def test_fp8_fc1_dgrad_on_the_transposed_weight_copies(gen):
    """The real use: dG | dU quantized per row along K = 2I, W_gate and W_up quantized once
    with their exact transposed copies ([E, H, I]): dx rows within the bounds of the float64
    product of the dequantized operands."""
    dev = "cuda"
    E, H, I = 2, 1024, 512
    tile_expert, num_tiles, row_valid = _segments([200, 100], dev)
    m = row_valid.numel()
    d_pre = (torch.randn(m, 2 * I, generator=gen) / 8).bfloat16().to(dev)
    wg = (torch.randn(E, I, H, generator=gen) / H ** 0.5).bfloat16().to(dev)
    wu = (torch.randn(E, I, H, generator=gen) / H ** 0.5).bfloat16().to(dev)
    a, e_a = fp8.quantize_rows(d_pre)
    qg, eg = fp8.quantize_blocks(wg, transposed=True)
    qu, eu = fp8.quantize_blocks(wu, transposed=True)
    out = gemm_fp8.grouped_gemm_fp8_split_k(a, e_a, qg, eg, qu, eu, tile_expert, num_tiles)
    x = fp8.dequantize_rows(a, e_a).double()
    want = torch.empty(m, H, dtype=torch.float64, device=dev)
    for t, e in enumerate(tile_expert.tolist()):
        w = torch.cat([fp8.dequantize_blocks(qg[e], eg[e]), fp8.dequantize_blocks(qu[e], eu[e])],
                      dim=1).double()
        want[t * TILE_M:(t + 1) * TILE_M] = x[t * TILE_M:(t + 1) * TILE_M] @ w.T
    _check(out, want.bfloat16(), row_valid, "FC1 dgrad on transposed copies")


# ---------------------------------------------------------------------- FC2's dgrad (dgated)
@pytest.fixture(scope="module")
def dgated_report(tmp_path_factory):
    return jit.inspect_kernel("gemm_fp8_fc2_dgrad", "sm_90a", tmp_path_factory.mktemp("fp8_dgated"))


def test_fp8_dgated_compiles_with_the_promotion_and_three_stored_outputs(dgated_report):
    ptx = open(dgated_report.ptx_path).read()
    assert_pipelined_promotion(ptx, epilogue_ffmas=128)  # the dgated epilogue's own 128
    # dG, dU, h' through smem by TMA: 3 outputs x 4 subtiles of a 128-wide tile
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)) == 3 * 4
    assert ptx.count("shfl.sync.bfly") == 4  # the row partials: two rows, two shuffles each
    assert not re.findall(r"ld\.global(\.nc)?\.(u16|b16)", ptx)  # g, u as bf16 pairs
    assert dgated_report.spill_bytes == 0 and dgated_report.mix["ld.local/st.local"] == 0
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx


def test_fp8_dgated_takes_128_wide_tiles_only():
    with pytest.raises(ValueError, match="tile_n"):
        gemm_fp8.GroupedGemmFp8Sm90(tile_n=192, epilogue="dgated")


def _dgated_reference(a, e_a, wt, e_wt, preact, row_slot, weights, tile_expert, tiles):
    """float64 acc of the dequantized operands, then the dgated formulas (gemm_sm90's
    docstring) in float64 from the bf16 g, u and h = bf16(silu(g) u): (dG | dU, w h, the row
    sums of acc h and the L2 norms of their terms); padding rows zero."""
    x = fp8.dequantize_rows(a, e_a).double()
    rows = tiles * TILE_M
    n = wt.shape[1]
    acc = torch.zeros(rows, n, dtype=torch.float64, device=a.device)
    for t, e in enumerate(tile_expert[:tiles].tolist()):
        acc[t * TILE_M:(t + 1) * TILE_M] = x[t * TILE_M:(t + 1) * TILE_M] @ \
            fp8.dequantize_blocks(wt[e], e_wt[e]).double().T
    slot = row_slot[:rows].long()
    valid = (slot >= 0).unsqueeze(1)
    g = preact[slot.clamp_min(0), :n].double()
    u = preact[slot.clamp_min(0), n:].double()
    w = weights[slot.clamp_min(0)].double().unsqueeze(1)
    sig = torch.sigmoid(g)
    h = (g * sig * u).float().bfloat16().double()
    zero = torch.zeros((), dtype=torch.float64, device=a.device)
    d_g = torch.where(valid, w * acc * u * sig * (1 + g * (1 - sig)), zero)
    d_u = torch.where(valid, w * acc * g * sig, zero)
    hw = torch.where(valid, w * h, zero)
    terms = torch.where(valid, acc * h, zero)
    return torch.cat([d_g, d_u], dim=1), hw, terms.sum(dim=1), terms.norm(dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,hidden,inter", [([300, 0, 129, 128], 2048, 512),
                                                 ([513, 77], 7168, 2048)])
def test_fp8_dgated_matches_the_float64_epilogue(counts, hidden, inter, gen):
    """dG, dU and h' against the float64 formulas on the dequantized product (overall rel-L1
    <= 3e-3: the promoted GEMM's 5e-4 plus the outputs' bf16 rounding; each row <= 2e-2), the
    row partials summed over N-tiles against the float64 row sums (within 1e-2 of the norm of
    each row's terms), padding rows exactly zero."""
    dev = "cuda"
    tile_expert, num_tiles, row_valid = _segments(counts, dev)
    m = row_valid.numel()
    E = len(counts)
    d_rows = (torch.randn(m, hidden, generator=gen) / 4).bfloat16().to(dev)
    w_down = (torch.randn(E, hidden, inter, generator=gen) / inter ** 0.5).bfloat16().to(dev)
    a, e_a = fp8.quantize_rows(d_rows)
    wt, e_wt = fp8.quantize_blocks(w_down, transposed=True)
    slots = int(row_valid.sum())
    preact = torch.randn(slots, 2 * inter, generator=gen).bfloat16().to(dev)
    row_slot = torch.full((m,), -1, dtype=torch.int32)
    row_slot[row_valid.cpu()] = torch.randperm(slots, generator=gen).to(torch.int32)
    row_slot = row_slot.to(dev)
    weights = torch.rand(slots, generator=gen).to(dev)
    d_pre, hw, partials = gemm_fp8.grouped_gemm_fp8_dgated(a, e_a, wt, e_wt, preact, row_slot,
                                                           weights, tile_expert, num_tiles)
    want_pre, want_hw, want_sums, term_norms = _dgated_reference(a, e_a, wt, e_wt, preact, row_slot, weights,
                                                     tile_expert, int(num_tiles.item()))
    for got, want, what in ((d_pre, want_pre, "dG | dU"), (hw, want_hw, "h'")):
        got, want = got.double(), want
        assert torch.isfinite(got).all(), what
        assert (got[~row_valid] == 0).all(), f"{what}: padding rows not zero"
        total = rel_l1(got[row_valid], want[row_valid]).item()
        assert total <= 3e-3, f"{what}: rel-L1 {total:.3g}"
        assert rel_l1(got[row_valid], want[row_valid], dim=1).max().item() <= 2e-2, what
    # a row sum of I terms of both signs cancels: its error is measured against the terms'
    # L2 norm (FP8 wgmma's ~1e-3 relative error per term gives ~1e-3 of it), not the sum
    sums = partials.double().sum(dim=1)
    err = ((sums - want_sums).abs()[row_valid] / term_norms[row_valid].clamp_min(1e-30)).max()
    assert err.item() <= 1e-2, f"row partials off by {err.item():.3g} of their terms' norm"
    again = gemm_fp8.grouped_gemm_fp8_dgated(a, e_a, wt, e_wt, preact, row_slot, weights,
                                             tile_expert, num_tiles)
    assert torch.equal(d_pre[row_valid], again[0][row_valid]), "not bitwise reproducible"
