"""Grouped GEMM (kernels/gemm_sm90.py): compile-only checks in CI, numerics on the H200."""

import re

import pytest
import torch

from mok_cute.kernels import gemm_sm90

TILE_M = gemm_sm90.TILE_M


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


def test_ptxas_reports_no_spills_and_no_c7508(capfd, tmp_path):
    gemm_sm90.compile_grouped_gemm("swiglu", 256,
                                   options=f"--keep-ptx --dump-dir {tmp_path} remarks{{ptx}}")
    report = capfd.readouterr()
    text = report.out + report.err
    assert "ptxas" in text, "ptxas report was not printed"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert spills and all(int(a) == 0 and int(b) == 0 for a, b in spills)
    assert "C7508" not in text


def test_first_mma_overwrite_removes_the_pingpong_wgmma_wait(capfd, tmp_path, monkeypatch):
    """Pingpong's zero fill made ptxas serialise its first wgmmas (C7517); with
    FIRST_MMA_OVERWRITES the first k-block overwrites the accumulators instead. The
    cooperative kernel ignores the switch (its PTX does not change)."""
    opts = f"--keep-ptx --dump-dir {tmp_path} remarks{{ptx}}"

    def build(pingpong):
        capfd.readouterr()
        compiled = gemm_sm90.compile_grouped_gemm("store", 128, pingpong=pingpong, options=opts)
        report = capfd.readouterr()
        return compiled.__ptx__, report.out + report.err

    coop_off = build(False)[0]
    monkeypatch.setattr(gemm_sm90, "FIRST_MMA_OVERWRITES", True)
    ptx, log = build(True)
    assert "ptxas" in log and "C7517" not in log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(int(a) == 0 and int(b) == 0 for a, b in spills)
    assert build(False)[0] == coop_off


@pytest.mark.parametrize("kernel,tile_n,pingpong", [("gemm_fc2", 256, False),
                                                    ("gemm_fc1", 256, False),
                                                    ("gemm_fc2", 128, True)])
def test_one_epilogue_barrier_halves_the_epilogue_barriers(kernel, tile_n, pingpong, tmp_path):
    """one_epilogue_barrier: one named-barrier sync per epilogue subtile instead of two (FC2's
    256-wide tile: 8 subtiles, FC1's SwiGLU tile: 4; counted in the PTX, which CI always has),
    no spills."""
    from mok_cute import jit

    subtiles = {"gemm_fc2": tile_n // 32, "gemm_fc1": tile_n // 64}[kernel]
    if pingpong:
        subtiles *= 2  # two 64-row epilogue tiles per 128-row tile
    bars = {}
    for one in (False, True):
        rep = jit.inspect_kernel(kernel, outdir=tmp_path / str(one), tile_n=tile_n,
                                 pingpong=pingpong, one_epilogue_barrier=one)
        assert rep.spill_bytes == 0
        bars[one] = len(re.findall(r"\bbar\.sync\b", open(rep.ptx_path).read()))
    assert bars[False] - bars[True] == subtiles


@pytest.mark.parametrize("kernel", ["gemm_fc2", "gemm_fc1"])
def test_wide_epilogue_halves_the_epilogue_subtiles(kernel, tmp_path):
    """epi_n = 64 (ops.EPILOGUE_N): a cooperative tile's epilogue in half as many subtiles, so
    half as many proxy fences before a TMA store (FC2's 256-wide tile: 8 -> 4, FC1's SwiGLU
    tile: 4 -> 2; counted in the PTX), no spills, no serialised wgmmas; the pingpong kernel
    keeps its 64 x 32 subtiles."""
    from mok_cute import jit
    from mok_cute.kernels import gemm_sm90

    subtiles = {"gemm_fc2": 8, "gemm_fc1": 4}[kernel]
    fences = {}
    for epi_n in (32, 64):
        rep = jit.inspect_kernel(kernel, outdir=tmp_path / str(epi_n), epi_n=epi_n)
        assert rep.spill_bytes == 0
        assert not [w for w in rep.warnings if "serialized" in w]
        fences[epi_n] = open(rep.ptx_path).read().count("fence.proxy.async.shared::cta")
    assert fences[32] - fences[64] == subtiles // 2
    with pytest.raises(ValueError, match="epi_n must be 32 or"):
        gemm_sm90.GroupedGemmSm90(tile_n=128, pingpong=True, epi_n=64)
    with pytest.raises(ValueError, match="epi_n must be 32 or"):
        gemm_sm90.GroupedGemmSm90(epi_n=48)


def test_choose_tile_n():
    assert gemm_sm90.choose_tile_n(2048, "swiglu") == 256
    assert gemm_sm90.choose_tile_n(320, "swiglu") == 128
    assert gemm_sm90.choose_tile_n(7168, "store") == 256
    assert gemm_sm90.choose_tile_n(320, "store") == 128  # 2.5 tiles: TMA clips the last
    assert gemm_sm90.choose_tile_n(2880, "store") == 256
    assert gemm_sm90.choose_tile_n(2880, "swiglu") == 256
    with pytest.raises(ValueError):
        gemm_sm90.choose_tile_n(100, "store")


def test_fc2_takes_the_pingpong_gemm_only_for_short_k(monkeypatch):
    """Measured on the H200: pingpong FC2 gains at K = 768 and 2880, loses at 14336."""
    from mok_cute import ops

    monkeypatch.setattr(ops, "FC2_PINGPONG", True)
    assert ops.fc2_pingpong(768) and ops.fc2_pingpong(2880) and ops.fc2_pingpong(ops.FC2_PINGPONG_MAX_K)
    assert not ops.fc2_pingpong(14336)
    monkeypatch.setattr(ops, "FC2_PINGPONG", False)
    assert not ops.fc2_pingpong(768)


def test_ksum_in_fc2_only_on_the_pingpong_fc2_without_the_shared_expert(monkeypatch):
    from mok_cute import ops

    monkeypatch.setattr(ops, "FC2_PINGPONG", True)
    monkeypatch.setattr(ops, "KSUM_IN_FC2", True)
    assert ops.ksum_in_fc2(2048, False)
    assert not ops.ksum_in_fc2(2048, True)  # the shared expert's rows are summed in too
    assert not ops.ksum_in_fc2(14336, False)  # cooperative FC2
    monkeypatch.setattr(ops, "KSUM_IN_FC2", False)
    assert not ops.ksum_in_fc2(2048, False)


@pytest.mark.parametrize("kwargs", [dict(pingpong=False), dict(pingpong=True, tile_n=64),
                                    dict(pingpong=True, epilogue="swiglu"),
                                    dict(pingpong=True, ksum_top_k=17)])
def test_ksum_in_fc2_is_refused_outside_the_pingpong_store(kwargs):
    args = dict(tile_n=128, epilogue="store", ksum_top_k=4) | kwargs
    with pytest.raises(ValueError, match="ksum_top_k"):
        gemm_sm90.GroupedGemmSm90(**args)


@pytest.mark.parametrize("top_k", [1, 8, 10])
def test_ksum_in_fc2_compiles_to_counted_rows_without_spills(top_k, capfd, tmp_path):
    """ksum_top_k: the store warp waits for its stores to land and releases them, each row
    is counted with an acq_rel atomic, the last arriver's sum is K 16-byte y loads per lane
    and pass in unfused mul / add (as WeightedKSum); 0 spills, no wgmma serialisation added."""
    from mok_cute.kernels import token_ops

    capfd.readouterr()
    ptx = gemm_sm90.compile_grouped_gemm(
        "store", 128, pingpong=True, ksum_top_k=top_k,
        options=f"--keep-ptx --dump-dir {tmp_path} remarks{{ptx}}").__ptx__
    log = capfd.readouterr()
    text = log.out + log.err
    assert re.search(r"cp\.async\.bulk\.wait_group\s+0;\s*fence\.proxy\.async\.global;\s*"
                     r"fence\.acq_rel\.gpu;", ptx)
    assert len(re.findall(r"atom\.global\.acq_rel\.add\.u32", ptx)) == 1
    passes = token_ops.last_arriver_passes(top_k)  # token pairs summed with loads in flight
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == top_k * passes
    assert len(re.findall(r"mul\.rn\.f32", ptx)) == 8 * top_k * passes
    assert "ptxas" in text and "C7520" not in text and "C7511" not in text
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert spills and all(int(a) == 0 and int(b) == 0 for a, b in spills)


@pytest.mark.parametrize("epilogue", ["swiglu", "store"])
def test_cluster_pair_compiles_to_multicast_b_without_spills(epilogue, capfd, tmp_path):
    """cluster_m=2: B boxes by multicast TMA (each CTA half of every box, into both CTAs)
    beside the plain B boxes of the expert-boundary fallback, A by plain TMA; 0 spills, no
    C7508. Refused with pingpong, the recorder, or an odd grid."""
    opts = f"--keep-ptx --dump-dir {tmp_path} remarks{{ptx}}"
    ptx = gemm_sm90.compile_grouped_gemm(epilogue, 256, cluster_m=2, options=opts).__ptx__
    text = "".join(capfd.readouterr())
    mcast = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.tile\.mbarrier"
                       r"::complete_tx::bytes\.multicast::cluster", ptx)
    plain_b = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert mcast and plain_b
    default = gemm_sm90.compile_grouped_gemm(epilogue, 256, options=f"--keep-ptx --dump-dir {tmp_path}").__ptx__
    assert "multicast::cluster" not in default
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert spills and all(int(a) == 0 and int(b) == 0 for a, b in spills)
    assert "C7508" not in text
    for bad in (dict(pingpong=True, tile_n=128), dict(timeline=True), dict(num_sms=131)):
        with pytest.raises(ValueError, match="cluster_m"):
            gemm_sm90.GroupedGemmSm90(**{"tile_n": 256, "epilogue": epilogue, **bad}, cluster_m=2)


@pytest.mark.parametrize("kwargs,cluster", [
    (dict(epilogue="swiglu", tile_n=256), None), (dict(epilogue="store", tile_n=128, pingpong=True), None),
    (dict(epilogue="swiglu", tile_n=256, cluster_m=2), [2, 1, 1])])
def test_only_real_clusters_launch_with_a_cluster_attribute(kwargs, cluster, launches):
    """A plain GEMM launched with a 1 x 1 x 1 cluster attribute ran its pingpong FC2 19-24 %
    slower and the layer 7-10 % (runs 76-78): only cluster_m > 1 may pass ``cluster`` to the
    launch."""
    gemm_sm90.compile_grouped_gemm(**kwargs)
    assert [kw.get("cluster") for kw in launches] == [cluster]


# ---------------------------------------------------------------------- numerics (GPU)
def _segments(counts, device):
    """Tile-padded row layout for per-expert row counts: (row_expert, tile_expert, num_tiles)."""
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
    return torch.nn.functional.silu(matmul(w)) * matmul(w_up)


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
    from mok_cute import ops
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
    ops.grouped_gemm(a_pad, w, te, num_tiles, epilogue, out=out, w_up=w_up, tile_n=tile_n,
                     pingpong=pingpong)
    ref = _expected(a, w, tile_expert, w_up)
    got = out[:m].float()
    assert torch.isfinite(got).all(), "some output rows were not written"
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-2, f"relative error {rel:.3e}"
    assert torch.isnan(out[m:]).all(), "rows past num_m_tiles were written"
    again = torch.full_like(out, float("nan"))
    ops.grouped_gemm(a_pad, w, te, num_tiles, epilogue, out=again, w_up=w_up, tile_n=tile_n,
                     pingpong=pingpong)
    assert torch.equal(out[:m], again[:m]), "not bitwise reproducible"


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["store", "swiglu"])
def test_pingpong_first_mma_overwrite_gives_the_same_bits(epilogue, monkeypatch):
    """gemm_sm90.FIRST_MMA_OVERWRITES: the pingpong tile's first k-block overwrites the
    accumulators instead of adding to zeros; on random data not a bit may change."""
    from mok_cute import jit, ops

    torch.manual_seed(41)
    counts, n, k = [300, 0, 129, 513], 256, 512
    tile_expert, num_tiles, row_valid = _segments(counts, "cuda")
    a = torch.randn(row_valid.numel(), k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(counts), n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    w_up = torch.randn_like(w) if epilogue == "swiglu" else None
    run = lambda: ops.grouped_gemm(a, w, tile_expert, num_tiles, epilogue, w_up=w_up,  # noqa: E731
                                   tile_n=128, pingpong=True)
    try:
        outs = {}
        for flag in (False, True):  # read when a kernel is built: rebuild for each
            monkeypatch.setattr(gemm_sm90, "FIRST_MMA_OVERWRITES", flag)
            jit.clear_cache()
            outs[flag] = run().clone()
    finally:
        monkeypatch.undo()
        jit.clear_cache()
    ref = _expected(a, w, tile_expert, w_up)
    rel = (outs[True].float() - ref).norm() / ref.norm()
    assert rel < 1e-2, f"relative error {rel:.3e}"
    assert torch.equal(outs[True], outs[False])


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
    from mok_cute import ops
    assert ops.unsupported_shape_reason(7168, 2048, 8, None) == ""
    assert "x: hidden size" in ops.unsupported_shape_reason(100, 2048, 8, None)
    assert "w_gate: intermediate size" in ops.unsupported_shape_reason(1024, 100, 8, None)
    assert "shared: intermediate size" in ops.unsupported_shape_reason(1024, 256, 8, 100)
    assert "topk_idx: K must be <= 16" in ops.unsupported_shape_reason(1024, 256, 17, None)
    assert "config.tile_m" in ops.unsupported_shape_reason(1024, 256, 8, None, tile_m=64)


def _setting_keeps_the_bits(monkeypatch, setting, values, counts, n, k, epilogue, seed,
                            **gemm_kwargs):
    """``ops.<setting>`` at each of ``values`` in turn, one grouped GEMM each on the same
    random problem with an extra M-tile past num_m_tiles: every output bitwise equal to the
    first, those rows untouched, and the second against torch."""
    from mok_cute import ops
    torch.manual_seed(seed)
    dev = "cuda"
    tile_expert, num_tiles, row_valid = _segments(counts, dev)
    m = row_valid.numel()
    a = torch.randn(m + TILE_M, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(len(counts), n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    w_up = torch.randn_like(w) if epilogue == "swiglu" else None
    te = torch.cat([tile_expert, torch.zeros(1, dtype=torch.int32, device=dev)])
    outs = []
    for value in values:
        monkeypatch.setattr(ops, setting, value)
        out = torch.full((m + TILE_M, n), float("nan"), device=dev, dtype=torch.bfloat16)
        ops.grouped_gemm(a, w, te, num_tiles, epilogue, out=out, w_up=w_up, **gemm_kwargs)
        outs.append(out)
    torch.cuda.synchronize()
    ref = _expected(a[:m], w, tile_expert, w_up)
    rel = (outs[1][:m].float() - ref).norm() / ref.norm()
    assert rel < 1e-2, f"relative error {rel:.3e}"
    for out in outs[1:]:
        assert torch.equal(out[:m], outs[0][:m])
        assert torch.isnan(out[m:]).all(), "rows past num_m_tiles were written"


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["store", "swiglu"])
@pytest.mark.parametrize("counts,n,k", [
    ([77, 0, 300, 128, 1], 512, 256),   # pairs straddle experts, an empty expert
    ([1000], 256, 512),                  # one expert: every pair multicasts
    ([300, 200], 448, 192),              # 5 M-tiles: the last pair's second CTA repeats a tile
    ([100], 256, 256),                   # one M-tile
    ([513, 700, 1], 1024, 1024),
])
def test_cluster_pairs_give_the_same_bits(epilogue, counts, n, k, monkeypatch):
    """ops.GEMM_CLUSTER_M = 2: pairs of CTAs share B by multicast where both M-tiles are one
    expert's and load it alone at expert boundaries; the repeated tile of an odd count is not
    stored. Against the plain kernel: the same bits, and rows past num_m_tiles untouched."""
    _setting_keeps_the_bits(monkeypatch, "GEMM_CLUSTER_M", (1, 2, 2), counts, n, k, epilogue,
                            len(counts) * 11 + n + k)


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue,pingpong,cluster_m", [
    ("store", False, 1), ("swiglu", False, 1), ("store", True, 1), ("swiglu", True, 1),
    ("store", False, 2)])
def test_one_epilogue_barrier_gives_the_same_bits(epilogue, pingpong, cluster_m, monkeypatch):
    """ops.ONE_EPILOGUE_BARRIER: one barrier per epilogue subtile, the store warp's buffer
    acquire a subtile ahead. A buffer written before its last TMA store read it would change
    the output, so: bitwise against two barriers, on tiles of many subtiles (N = 1024, 8 per
    cooperative FC2 tile, across tile boundaries), rows past num_m_tiles untouched, and
    against torch."""
    from mok_cute import ops
    monkeypatch.setattr(ops, "GEMM_CLUSTER_M", cluster_m)
    _setting_keeps_the_bits(monkeypatch, "ONE_EPILOGUE_BARRIER", (False, True, True),
                            [77, 0, 513, 700, 1], 1024, 512, epilogue, 53,
                            tile_n=128 if pingpong else None, pingpong=pingpong)


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue,cluster_m,one_barrier", [
    ("store", 1, False), ("swiglu", 1, False), ("store", 2, False), ("store", 1, True)])
def test_wide_epilogue_gives_the_same_bits(epilogue, cluster_m, one_barrier, monkeypatch):
    """ops.EPILOGUE_N = 64: 128 x 64 subtiles through two buffers. A buffer written before its
    last TMA store read it, or a SwiGLU pairing off by a subtile, would change the output:
    bitwise against 32, on tiles of many subtiles across tile boundaries (N = 1024), with
    cluster pairs and with one barrier per subtile, rows past num_m_tiles untouched, and
    against torch."""
    from mok_cute import ops
    monkeypatch.setattr(ops, "GEMM_CLUSTER_M", cluster_m)
    monkeypatch.setattr(ops, "ONE_EPILOGUE_BARRIER", one_barrier)
    _setting_keeps_the_bits(monkeypatch, "EPILOGUE_N", (32, 64, 64), [77, 0, 513, 700, 1], 1024,
                            512, epilogue, 59, pingpong=False)


@pytest.mark.gpu
def test_layer_with_cluster_pairs_gives_the_same_bits(monkeypatch):
    import mok_cute
    from mok_cute import ops
    torch.manual_seed(19)
    T, H, I, E, K = 700, 512, 384, 8, 4
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device="cuda"), dim=1)
    wg, wu = (torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5 for _ in range(2))
    wd = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5
    cfg = mok_cute.MoKConfig(backend="kernel")
    monkeypatch.setattr(ops, "FC2_PINGPONG", False)  # FC2 on the cooperative kernel too
    monkeypatch.setattr(ops, "GEMM_CLUSTER_M", 1)  # no clusters (H = 512 is below the rule's K)
    base = mok_cute.moe_forward(x, idx, w, wg, wu, wd, config=cfg)
    monkeypatch.setattr(ops, "GEMM_CLUSTER_M", 2)
    assert torch.equal(mok_cute.moe_forward(x, idx, w, wg, wu, wd, config=cfg), base)


def test_cluster_rule_takes_pairs_where_k_is_long(monkeypatch):
    """ops.gemm_cluster_m: clusters of two for the cooperative, unrecorded GEMM where K >=
    GEMM_CLUSTER_MIN_K (measured: short K lost 2-3 %); MOK_GEMM_CLUSTER_M=1 / 2 force it."""
    from mok_cute import ops
    long_k, short_k = ops.GEMM_CLUSTER_MIN_K, ops.GEMM_CLUSTER_MIN_K - 64
    monkeypatch.setattr(ops, "GEMM_CLUSTER_M", 0)
    assert ops.gemm_cluster_m(long_k, pingpong=False, recorded=False) == 2
    assert ops.gemm_cluster_m(short_k, pingpong=False, recorded=False) == 1
    assert ops.gemm_cluster_m(long_k, pingpong=True, recorded=False) == 1
    assert ops.gemm_cluster_m(long_k, pingpong=False, recorded=True) == 1
    monkeypatch.setattr(ops, "GEMM_CLUSTER_M", 1)
    assert ops.gemm_cluster_m(long_k, pingpong=False, recorded=False) == 1
    monkeypatch.setattr(ops, "GEMM_CLUSTER_M", 2)
    assert ops.gemm_cluster_m(short_k, pingpong=False, recorded=False) == 2
