"""Grouped GEMM (kernels/gemm_sm90.py): compile-only checks in CI, numerics on the H200."""

import re

import pytest
import torch

from mok_cute import expert_path
from mok_cute.config import ExpertPathOptions
from mok_cute.constants import TILE_M
from mok_cute.kernels import gemm_sm90
from per_token import assert_tokens_close


# ---------------------------------------------------------------------- compile-only (CI)
@pytest.mark.parametrize("epilogue,tile_n,pingpong", [
    ("swiglu", 256, False), ("swiglu", 128, False), ("store", 256, False), ("store", 128, False),
    ("store", 64, False), ("swiglu", 128, True), ("store", 128, True)])
def test_compiles_for_sm90a_with_wgmma_tma_setmaxnreg(epilogue, tile_n, pingpong, tmp_path):
    compiled = gemm_sm90.compile_grouped_gemm(epilogue, tile_n, pingpong=pingpong,
                                              options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = compiled.__ptx__
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k16\.f32\.bf16\.bf16", ptx)
    # TMA loads of A and B into smem, completing on an mbarrier; TMA store of C
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232", ptx)
    if epilogue == "swiglu":
        assert "ex2.approx" in ptx
    if pingpong:
        # the mainloop turn of the two consumer warpgroups (256 threads: both warpgroups)
        assert re.search(r"bar\.sync\s+%r\d+, 256;", ptx) and re.search(r"bar\.arrive\s+%r\d+, 256;", ptx)


@pytest.mark.parametrize("epilogue,tile_n,pingpong", [("swiglu", 256, False),
                                                     ("store", 256, False), ("store", 128, True)])
def test_ptxas_reports_no_spills_and_no_c7508(epilogue, tile_n, pingpong, capfd, tmp_path):
    capfd.readouterr()
    gemm_sm90.compile_grouped_gemm(epilogue, tile_n, pingpong=pingpong,
                                   options=f"--keep-ptx --dump-dir {tmp_path} remarks{{ptx}}")
    report = capfd.readouterr()
    text = report.out + report.err
    assert "ptxas" in text, "ptxas report was not printed"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert spills and all(int(a) == 0 and int(b) == 0 for a, b in spills)
    assert "C7508" not in text


def test_choose_tile_n():
    assert gemm_sm90.choose_tile_n(2048, "swiglu") == 256
    assert gemm_sm90.choose_tile_n(320, "swiglu") == 128
    assert gemm_sm90.choose_tile_n(7168, "store") == 256
    assert gemm_sm90.choose_tile_n(320, "store") == 128  # 2.5 tiles: TMA clips the last
    assert gemm_sm90.choose_tile_n(2880, "store") == 256
    assert gemm_sm90.choose_tile_n(2880, "swiglu") == 256
    with pytest.raises(ValueError):
        gemm_sm90.choose_tile_n(100, "store")


def test_fc2_takes_the_pingpong_gemm_only_for_short_k():
    """Measured on the H200: pingpong FC2 gains at K = 768 and 2880, loses at 14336."""
    options = ExpertPathOptions()
    assert options.fc2_pingpong(768) and options.fc2_pingpong(2880)
    assert options.fc2_pingpong(options.fc2_pingpong_max_k)
    assert not options.fc2_pingpong(14336)
    assert not ExpertPathOptions(fc2_pingpong_max_k=0).fc2_pingpong(768)
    with pytest.raises(ValueError, match="ExpertPathOptions.fc1_group_m"):
        ExpertPathOptions(fc1_group_m=0)


@pytest.mark.parametrize("kwargs", [dict(epilogue="swiglu", tile_n=256),
                                    dict(epilogue="store", tile_n=128, pingpong=True)])
def test_gemms_launch_without_a_cluster_attribute(kwargs, launches):
    """A plain GEMM launched with a 1 x 1 x 1 cluster attribute ran its pingpong FC2 19-24 %
    slower and the layer 7-10 % (runs 76-78)."""
    gemm_sm90.compile_grouped_gemm(**kwargs)
    assert [kw.get("cluster") for kw in launches] == [None]


# ---------------------------------------------------------------------- numerics (GPU)
def _segments(counts, device):
    """Tile-padded rows for per-expert row counts: (tile_expert, num_tiles, row_valid)."""
    tiles = [(c + TILE_M - 1) // TILE_M for c in counts]
    tile_expert = torch.tensor([e for e, t in enumerate(tiles) for _ in range(t)] or [0],
                               dtype=torch.int32, device=device)
    row_valid = torch.zeros(sum(tiles) * TILE_M, dtype=torch.bool, device=device)
    start = 0
    for c, t in zip(counts, tiles):
        row_valid[start:start + c] = True
        start += t * TILE_M
    num_tiles = torch.tensor([sum(tiles)], dtype=torch.int32, device=device)
    return tile_expert, num_tiles, row_valid


def _expected(a, w, tile_expert, w_up=None):
    rows_expert = tile_expert.repeat_interleave(TILE_M)[: a.shape[0]].long()

    def matmul(weights):
        return torch.cat([a[i:i + TILE_M].float() @ weights[rows_expert[i]].float().T
                          for i in range(0, a.shape[0], TILE_M)])
    if w_up is None:
        return matmul(w)
    gate = matmul(w).bfloat16().float()  # the bf16 pre-activations
    up = matmul(w_up).bfloat16().float()
    return torch.nn.functional.silu(gate) * up


@pytest.mark.gpu
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("epilogue", ["store", "swiglu"])
@pytest.mark.parametrize("counts,n,k", [
    ([77, 0, 300, 128, 1], 512, 256),       # empty expert, partial tiles
    ([1000], 256, 512),                       # one expert takes everything
    ([130, 5, 64, 129], 320, 320),            # N, K multiples of 64, not of 256
    ([513, 700, 1], 1024, 1024),
    ([300, 200], 448, 192),                   # partial last N-tile (448 = 1.75 x 256)
])
def test_grouped_gemm_matches_torch(epilogue, counts, n, k, pingpong):
    torch.manual_seed(len(counts) * 7 + n + k)
    dev = "cuda"
    tile_expert, num_tiles, row_valid = _segments(counts, dev)
    m = row_valid.numel()
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(len(counts), n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    w_up = (torch.randn_like(w) if epilogue == "swiglu" else None)
    n_out = n
    out = torch.full((m + TILE_M, n_out), float("nan"), device=dev, dtype=torch.bfloat16)
    # extra M-tile past num_tiles must stay untouched
    a_pad = torch.cat([a, torch.randn(TILE_M, k, device=dev, dtype=torch.bfloat16)])
    te = torch.cat([tile_expert, torch.zeros(1, dtype=torch.int32, device=dev)])
    tile_n = 128 if pingpong else None
    expert_path.grouped_gemm(a_pad, w, te, num_tiles, epilogue, out=out, w_up=w_up, tile_n=tile_n,
                     pingpong=pingpong)
    ref = _expected(a, w, tile_expert, w_up)
    got = out[:m].float()
    assert torch.isfinite(got).all(), "some output rows were not written"
    # row by row (a row sent to the wrong expert's weights fails), not one norm over all rows
    assert_tokens_close(got, ref, what=f"grouped GEMM {epilogue} rows")
    assert torch.isnan(out[m:]).all(), "rows past num_m_tiles were written"
    again = torch.full_like(out, float("nan"))
    expert_path.grouped_gemm(a_pad, w, te, num_tiles, epilogue, out=again, w_up=w_up, tile_n=tile_n,
                     pingpong=pingpong)
    assert torch.equal(out[:m], again[:m]), "not bitwise reproducible"


def test_timeline_flag_off_emits_no_recorder_instruction(tmp_path):
    """The recorder is a compile-time flag: off, no timer read and no atomic in the PTX."""
    opts = f"--keep-ptx --dump-dir {tmp_path}"
    off = gemm_sm90.compile_grouped_gemm("swiglu", 256, timeline=False, options=opts).__ptx__
    on = gemm_sm90.compile_grouped_gemm("swiglu", 256, timeline=True, options=opts).__ptx__
    for marker in ("%globaltimer", "atom.global", "%smid"):
        assert marker not in off
        assert marker in on
    # one ticket per tile owner, reserved before the tile loop: a single atom.add
    assert len(re.findall(r"atom\.global\.add", on)) == 1


def test_unsupported_sizes_are_named_before_launch():
    ops = expert_path
    assert ops.unsupported_shape_reason(7168, 2048, 8, None) == ""
    assert "x: hidden size" in ops.unsupported_shape_reason(100, 2048, 8, None)
    assert "w_gate: intermediate size" in ops.unsupported_shape_reason(1024, 100, 8, None)
    assert "shared: intermediate size" in ops.unsupported_shape_reason(1024, 256, 8, 100)
    assert "topk_idx: K must be <= 16" in ops.unsupported_shape_reason(1024, 256, 17, None)
    assert "config.tile_m" in ops.unsupported_shape_reason(1024, 256, 8, None, tile_m=64)


@pytest.mark.gpu
def test_layer_fc2_gemm_choice_gives_the_same_bits():
    """FC2 on the pingpong GEMM (the default at this K) and on the cooperative one
    (``fc2_pingpong_max_k=0``): a row's result does not depend on the kernel that ran it."""
    import mok_cute
    torch.manual_seed(19)
    T, H, I, E, K = 700, 512, 384, 8, 4
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device="cuda"), dim=1)
    wg, wu = (torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5 for _ in range(2))
    wd = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5
    pingpong = mok_cute.moe_forward(x, idx, w, wg, wu, wd, config=mok_cute.MoKConfig(backend="kernel"))
    cooperative = mok_cute.moe_forward(
        x, idx, w, wg, wu, wd, config=mok_cute.MoKConfig(
            backend="kernel", expert_path=ExpertPathOptions(fc2_pingpong_max_k=0)))
    assert torch.equal(pingpong, cooperative)
