"""The megakernel (kernels/megakernel_sm90.py, mok_cute/megakernel.py).

CI: compile-only sm_90a checks of the PTX. H200 (marked gpu): moe_forward_virtual on the
megakernel against the reference for R in {1, 2, 3, 4, 8, 16, 72} under uniform and skewed
routing, an empty expert, a rank that receives nothing, a ring smaller than the routed rows and
with / without the shared expert; bitwise identity across runs and across num_comm_sms,
minibatch and ring sizes; a silent peer raises PeerTimeoutError; out-of-range ids with
check_ids=False contribute zero."""

import re

import pytest
import torch

import mok_cute
from mok_cute import reference
from mok_cute.kernels.common import PeerTimeoutError


# The one-rank build of the defaults (no comm CTA, local rows in place, the decoded ring,
# store-warp signals, the staged k-sum, the short task start) with the shared expert and the
# recorder: the compile tests of the one-rank switches start from it.
ONE_RANK_BUILD = dict(num_ranks=1, num_comm_ctas=0, top_k=8, has_shared=True, timeline=True,
                      local_direct=True, dynamic_tickets=True, decoded_tickets=True,
                      ksum_vectors=16, store_warp_signals=True, ksum_staged=True,
                      short_task_start=True)


def _wgmma_pipelined(rep):
    """ptxas kept the wgmmas pipelined: no note that it serialised them (C7520 cost a build
    ~9 % per GEMM tile on the H200, runs 104-105) and no ignored setmaxnreg (C7508)."""
    serial = [w for w in rep.warnings if "serialized" in w or "C7508" in w]
    assert not serial, serial


@pytest.mark.parametrize("has_shared", [False, True])
def test_compiles_to_wgmma_tma_bulk_copies_and_bounded_waits(has_shared, tmp_path):
    from mok_cute.kernels import megakernel_sm90

    compiled = megakernel_sm90.compile_megakernel(
        num_ranks=2, top_k=4, has_shared=has_shared,
        options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = compiled.__ptx__
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads and stores of the GEMM tiles
    assert "setmaxnreg" in ptx
    assert re.search(r"red\.release\.gpu\.global\.add\.s32", ptx)  # counter publish
    assert re.search(r"ld\.acquire\.gpu", ptx)  # counter wait
    assert "nanosleep" in ptx and "globaltimer" in ptx  # bounded spin waits
    assert "multimem" not in ptx  # never NVLink multicast


def test_launches_cooperatively_without_a_cluster_attribute(launches):
    """Every CTA must be co-resident (cooperative launch: the no-deadlock argument), and no
    cluster attribute: a cluster of one cost the GEMM kernels up to 24 % (runs 76-78)."""
    from mok_cute.kernels import megakernel_sm90

    megakernel_sm90.compile_megakernel()
    assert len(launches) == 1
    assert launches[0].get("cooperative") is True
    assert launches[0].get("cluster") is None


def test_recorder_flag_off_emits_no_recorder_instruction(tmp_path):
    """Off: no %smid read and fewer %globaltimer reads (the waits' deadlines keep one per
    wait loop); on: the recorder's reads, tickets and stores are there."""
    from mok_cute.kernels import megakernel_sm90

    opts = f"--keep-ptx --dump-dir {tmp_path}"
    off = megakernel_sm90.compile_megakernel(timeline=False, options=opts).__ptx__
    on = megakernel_sm90.compile_megakernel(timeline=True, options=opts).__ptx__
    assert "%smid" not in off and "%smid" in on
    assert on.count("%globaltimer") > off.count("%globaltimer")


def test_bulk_copy_variant_compiles(tmp_path):
    from mok_cute.kernels import megakernel_sm90

    ptx = megakernel_sm90.compile_megakernel(
        copy="bulk", options=f"--keep-ptx --dump-dir {tmp_path}").__ptx__
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.bulk.global.shared::cta.bulk_group" in ptx


def test_bad_comm_split_is_refused():
    from mok_cute.kernels import megakernel_sm90

    with pytest.raises(ValueError, match="num_comm_ctas"):
        megakernel_sm90.MegakernelSm90(1, num_ctas=8, num_comm_ctas=8, top_k=2, has_shared=False)
    with pytest.raises(ValueError, match="copy"):
        megakernel_sm90.MegakernelSm90(1, 8, 2, 2, False, copy="dma")
    with pytest.raises(ValueError, match="local_direct needs copy='vector'"):
        megakernel_sm90.MegakernelSm90(1, 8, 2, 2, False, copy="bulk", local_direct=True)
    # no comm CTA: one rank only (its BARRIER runs on a compute CTA), the cooperative loop only
    with pytest.raises(ValueError, match="num_comm_ctas=0 needs num_ranks=1"):
        megakernel_sm90.MegakernelSm90(4, 8, 0, 2, False)
    with pytest.raises(ValueError, match="num_comm_ctas=0 needs num_ranks=1"):
        megakernel_sm90.MegakernelSm90(1, 8, 0, 2, False, decoded_tickets=True, pingpong=True)


def test_zero_comm_ctas_compile_without_spills(tmp_path):
    """num_comm_ctas=0 (one rank, the BARRIER on a compute CTA): compiles, with the recorder
    and the shared expert, to wgmmas that ptxas keeps pipelined, without spills."""
    from mok_cute import jit

    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **ONE_RANK_BUILD)
    assert rep.spill_bytes == 0
    assert "wgmma.mma_async" in open(rep.ptx_path).read()
    _wgmma_pipelined(rep)


def test_local_direct_variant_compiles(tmp_path):
    from mok_cute.kernels import megakernel_sm90

    ptx = megakernel_sm90.compile_megakernel(
        num_ranks=4, local_direct=True, options=f"--keep-ptx --dump-dir {tmp_path}").__ptx__
    assert "wgmma.mma_async" in ptx and "multimem" not in ptx
    # FC1's local A rows come by cp.async from x, landing on the stage's full barrier
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    assert "fence.proxy.async.shared::cta" in ptx
    default = megakernel_sm90.compile_megakernel(
        num_ranks=4, options=f"--keep-ptx --dump-dir {tmp_path}").__ptx__
    assert "cp.async.cg" not in default


@pytest.mark.parametrize("local_direct", [False, True])
def test_dynamic_tickets_fit_the_register_file_without_spills(local_direct, tmp_path):
    """dynamic_tickets: the producer's lane 0 takes compute tickets with an atomic (one more
    than the comm CTAs' ticket) and the warps meet at the smem ring's mbarriers. setmaxnreg
    only moves registers inside the CTA's launch allocation (an increase the pool cannot
    cover waits forever, which hung the first GPU run): the split must fit it, with no
    spills."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    static = dict(num_ranks=8, num_comm_ctas=12, local_direct=local_direct, has_shared=True,
                  rank_blocks=True)
    opts = f"--keep-ptx --dump-dir {tmp_path}"
    on = megakernel_sm90.compile_megakernel(**static, dynamic_tickets=True, options=opts).__ptx__
    off = megakernel_sm90.compile_megakernel(**static, options=opts).__ptx__
    atom = r"atom\.global\.add\.u32"
    assert len(re.findall(atom, on)) >= len(re.findall(atom, off)) + 2  # first ticket, one per task
    dec = int(re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", on).group(1))
    inc = int(re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", on).group(1))
    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **static, dynamic_tickets=True)
    assert (dec, inc) == (48, 224) and rep.spill_bytes == 0
    _wgmma_pipelined(rep)
    assert 128 * dec + 256 * inc <= rep.registers * 384


@pytest.mark.parametrize("local_direct", [False, True])
def test_decoded_tickets_move_the_task_lookups_off_the_consumers(local_direct, tmp_path):
    """decoded_tickets: the producer's warp 0 resolves each ticket and the other warps read
    the task's words from the smem ring, so the build has fewer global loads than the bare
    ticket ring (where every warp resolves the ticket itself), spills nothing, and needs
    dynamic tickets."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    static = dict(num_ranks=8, num_comm_ctas=12, local_direct=local_direct, has_shared=True,
                  rank_blocks=True, dynamic_tickets=True, ksum_vectors=16)
    opts = f"--keep-ptx --dump-dir {tmp_path}"
    on = megakernel_sm90.compile_megakernel(**static, decoded_tickets=True, options=opts).__ptx__
    off = megakernel_sm90.compile_megakernel(**static, options=opts).__ptx__
    loads = r"ld\.global\.(?:[a-z0-9]+\.)*[bsu]32"
    assert len(re.findall(loads, on)) < len(re.findall(loads, off))
    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **static, decoded_tickets=True)
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)
    with pytest.raises(ValueError, match="decoded_tickets needs dynamic_tickets"):
        megakernel_sm90.MegakernelSm90(2, 8, 2, 2, False, decoded_tickets=True)


def test_store_warp_signals_compile_without_spills(tmp_path):
    """store_warp_signals: the store warp syncs its lanes after waiting for the tile's TMA
    stores (one more bar.warp.sync; its lane 0 then publishes), the CTA-wide epilogue barrier
    stays for KSUM only, and nothing spills."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    static = dict(num_ranks=1, num_comm_ctas=2, local_direct=True, dynamic_tickets=True,
                  decoded_tickets=True, ksum_vectors=16)
    opts = f"--keep-ptx --dump-dir {tmp_path}"
    on = megakernel_sm90.compile_megakernel(**static, store_warp_signals=True, options=opts).__ptx__
    off = megakernel_sm90.compile_megakernel(**static, options=opts).__ptx__
    assert len(re.findall(r"bar\.warp\.sync", on)) == len(re.findall(r"bar\.warp\.sync", off)) + 1
    assert len(re.findall(r"\bbar\.sync", on)) == len(re.findall(r"\bbar\.sync", off))
    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **static, store_warp_signals=True)
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)


@pytest.mark.parametrize("top_k,has_shared", [(8, False), (2, True), (10, True)])
def test_staged_ksum_lands_rows_in_smem_without_spills(top_k, has_shared, tmp_path):
    """ksum_staged: the KSUM lanes copy their y vectors into the B stages with cp.async and
    read them back from smem (the register path's global vector loads go), no spills."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    static = dict(num_ranks=1, num_comm_ctas=2, local_direct=True, dynamic_tickets=True,
                  decoded_tickets=True, ksum_vectors=16, top_k=top_k, has_shared=has_shared)
    opts = f"--keep-ptx --dump-dir {tmp_path}"
    on = megakernel_sm90.compile_megakernel(**static, ksum_staged=True, options=opts).__ptx__
    off = megakernel_sm90.compile_megakernel(**static, options=opts).__ptx__

    def count(pattern, ptx):
        return len(re.findall(pattern, ptx))

    assert count(r"cp\.async\.cg\.shared\.global", on) > count(r"cp\.async\.cg\.shared\.global", off)
    assert count(r"ld\.shared\.v4", on) > count(r"ld\.shared\.v4", off)
    assert count(r"ld\.global\.v4", on) < count(r"ld\.global\.v4", off)
    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **static, ksum_staged=True)
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)
    several = jit.inspect_kernel("megakernel", outdir=tmp_path, **dict(static, num_ranks=8),
                                 rank_blocks=True, ksum_staged=True)
    assert several.spill_bytes == 0


@pytest.mark.parametrize("pingpong", [False, True])
def test_one_epilogue_barrier_drops_a_barrier_per_subtile(pingpong, tmp_path):
    """one_epilogue_barrier: the epilogue's second named barrier per subtile goes (fewer
    bar.sync in the PTX), no spills, in the cooperative and the pingpong consumer loops."""
    from mok_cute import jit

    static = dict(num_ranks=1, num_comm_ctas=1, local_direct=True, dynamic_tickets=True,
                  decoded_tickets=True, ksum_vectors=16, store_warp_signals=True,
                  ksum_staged=not pingpong, pingpong=pingpong, top_k=8, has_shared=True)
    bars = {}
    for one in (False, True):
        rep = jit.inspect_kernel("megakernel", outdir=tmp_path / str(one), **static,
                                 one_epilogue_barrier=one)
        assert rep.spill_bytes == 0
        _wgmma_pipelined(rep)
        bars[one] = len(re.findall(r"\bbar\.sync\b", open(rep.ptx_path).read()))
    assert bars[True] < bars[False]


@pytest.mark.parametrize("num_ranks,local_direct,pingpong", [(1, True, False), (8, False, False),
                                                             (1, True, True)])
def test_short_task_start_widens_the_ring_without_spills(num_ranks, local_direct, pingpong,
                                                          tmp_path):
    """short_task_start: the decoded ring slots grow from 8 to 10 words (the task's first row
    and count of waits), the producer reads them from smem; no spills, with the gathered FC1
    rows (one rank), with TMA rows (several ranks) and in the pingpong loop; only with the
    decoded ring."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    static = dict(num_ranks=num_ranks, num_comm_ctas=1 if num_ranks == 1 else 16,
                  local_direct=local_direct, rank_blocks=num_ranks > 1, dynamic_tickets=True,
                  decoded_tickets=True, ksum_vectors=16, store_warp_signals=True,
                  ksum_staged=not pingpong, pingpong=pingpong, top_k=8, has_shared=True)
    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **static, short_task_start=True)
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)
    mk = megakernel_sm90.MegakernelSm90(num_ranks, 132, static["num_comm_ctas"], 8, True,
                                        short_task_start=True, **{k: static[k] for k in (
                                            "local_direct", "rank_blocks", "dynamic_tickets",
                                            "decoded_tickets", "ksum_staged", "pingpong")})
    assert mk.decoded_words == megakernel_sm90.SHORT_START_WORDS == 10
    with pytest.raises(ValueError, match="short_task_start needs decoded_tickets"):
        megakernel_sm90.MegakernelSm90(1, 8, 1, 2, False, dynamic_tickets=True,
                                       short_task_start=True)


def test_fence_fc1_only_keeps_the_wgmmas_pipelined(tmp_path):
    """fence_fc1_only: the gathered-stage proxy fence behind a test of the task's type (FC1),
    with several ranks, local rows in place, the shared expert and the recorder: the fence is
    still emitted, no spills, and ptxas keeps the wgmmas pipelined."""
    from mok_cute import jit

    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, num_ranks=4, num_comm_ctas=10,
                             top_k=8, has_shared=True, timeline=True, local_direct=True,
                             rank_blocks=True, dynamic_tickets=True, decoded_tickets=True,
                             ksum_vectors=16, store_warp_signals=True, ksum_staged=True,
                             short_task_start=True, fence_fc1_only=True)
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)
    assert "fence.proxy.async.shared::cta" in open(rep.ptx_path).read()


def test_defer_signals_keeps_the_wgmmas_pipelined(tmp_path):
    """defer_signals: the held-back publish (a branch before the mainloop, one after the
    mainloop's first k-tile, one at the loop's end), at one rank with no comm CTA, the shared
    expert and the recorder: no spills, the wgmmas still pipelined, one release publish more
    per flush site; refused where a task could wait on a signal its own CTA holds (several
    ranks) or without the decoded ring and store-warp signals."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    rep = jit.inspect_kernel("megakernel", outdir=tmp_path / "on", **ONE_RANK_BUILD,
                             defer_signals=True)
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)
    base = jit.inspect_kernel("megakernel", outdir=tmp_path / "off", **ONE_RANK_BUILD)
    releases = [open(r.ptx_path).read().count("red.release") for r in (base, rep)]
    assert releases[1] == releases[0] + 3
    with pytest.raises(ValueError, match="defer_signals needs one rank"):
        megakernel_sm90.MegakernelSm90(2, 8, 2, 2, False, dynamic_tickets=True,
                                       decoded_tickets=True, store_warp_signals=True,
                                       defer_signals=True)
    with pytest.raises(ValueError, match="defer_signals needs"):
        megakernel_sm90.MegakernelSm90(1, 8, 0, 2, False, dynamic_tickets=True,
                                       decoded_tickets=True, defer_signals=True)


def test_wide_epilogue_keeps_the_wgmmas_pipelined(tmp_path):
    """epi_n = 64 (megakernel.WIDE_EPILOGUE): the GEMM tasks' epilogue in 128 x 64 subtiles, at
    one rank with no comm CTA, the shared expert and the recorder: no spills, the wgmmas still
    pipelined, fewer proxy fences before TMA stores; refused with the pingpong loop (its
    subtiles are 64 x 32)."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    reps = {n: jit.inspect_kernel("megakernel", outdir=tmp_path / str(n), **ONE_RANK_BUILD,
                                  epi_n=n) for n in (32, 64)}
    assert reps[64].spill_bytes == 0 and reps[64].registers == 168
    _wgmma_pipelined(reps[64])
    fences = [open(reps[n].ptx_path).read().count("fence.proxy.async.shared::cta") for n in (32, 64)]
    assert fences[1] < fences[0]
    with pytest.raises(ValueError, match="epi_n must be 32 or"):
        megakernel_sm90.MegakernelSm90(2, 8, 2, 2, False, dynamic_tickets=True,
                                       decoded_tickets=True, pingpong=True, epi_n=64)


def test_defer_flush_after_ktiles_keeps_the_wgmmas_pipelined(tmp_path):
    """defer_flush_ktiles = 4: the held publish inside the k-loop (after the 4th k-tile's
    wgmmas are issued) and after it (a mainloop of fewer k-tiles), at one rank with the shared
    expert and the recorder: no spills, the wgmmas still pipelined, one release publish more
    than the flush after the first k-tile (two sites instead of one); refused without
    defer_signals."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    reps = [jit.inspect_kernel("megakernel", outdir=tmp_path / str(k), **ONE_RANK_BUILD,
                               defer_signals=True, defer_flush_ktiles=k) for k in (1, 4)]
    assert reps[1].spill_bytes == 0 and reps[1].registers == 168
    _wgmma_pipelined(reps[1])
    releases = [open(r.ptx_path).read().count("red.release") for r in reps]
    assert releases[1] == releases[0] + 1
    with pytest.raises(ValueError, match="defer_flush_ktiles needs defer_signals"):
        megakernel_sm90.MegakernelSm90(1, 8, 0, 2, False, dynamic_tickets=True,
                                       decoded_tickets=True, store_warp_signals=True,
                                       defer_flush_ktiles=4)


def test_strided_tickets_take_no_ticket_atomic(tmp_path):
    """strided_tickets: the compute tickets come by the static stride through the ticket ring,
    at one rank with the one-rank default (no comm CTA, the deferred publish after 8 k-tiles),
    the shared expert and the recorder: the compute loop's ticket atomic goes (the recorder's
    and the comm queue's stay), no spills, the wgmmas still pipelined; refused without the
    ring (dynamic_tickets)."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    static = dict(ONE_RANK_BUILD, defer_signals=True, defer_flush_ktiles=8)
    reps = [jit.inspect_kernel("megakernel", outdir=tmp_path / str(on), **static,
                               strided_tickets=on) for on in (False, True)]
    assert reps[1].spill_bytes == 0 and reps[1].registers == 168
    _wgmma_pipelined(reps[1])
    atomics = [len(re.findall(r"atom\.[a-z.]*add\.[su]32", open(r.ptx_path).read())) for r in reps]
    assert atomics[1] < atomics[0]
    with pytest.raises(ValueError, match="strided_tickets needs dynamic_tickets"):
        megakernel_sm90.MegakernelSm90(1, 8, 0, 2, False, strided_tickets=True)


def test_warp0_tma_stages_keeps_the_wgmmas_pipelined(tmp_path):
    """warp0_tma_stages: the load warp's one arrival of count 128 for a TMA-only stage, at one
    rank with no comm CTA, the shared expert and the recorder: no spills, the wgmmas still
    pipelined, and the counted arrival in the PTX (a register count, not the implicit 1)."""
    from mok_cute import jit

    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **ONE_RANK_BUILD,
                             warp0_tma_stages=True)
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)
    assert re.search(r"mbarrier\.arrive\.shared\.b64\s+%\w+, \[%\w+\], %r\d+;",
                     open(rep.ptx_path).read())


@pytest.mark.parametrize("num_ranks,num_comm_ctas,pingpong", [(1, 0, False), (8, 12, False),
                                                             (1, 2, True)])
def test_release_only_publish_drops_one_fence_per_publish(num_ranks, num_comm_ctas, pingpong,
                                                          tmp_path):
    """release_only_publish: a compute task's publish is its release reduction alone, so the
    PTX has one fence.acq_rel fewer (the publish's; a BARRIER's flag fence stays) and the same
    release reductions; no spills, the wgmmas still pipelined (cooperative and pingpong loops,
    one rank and eight)."""
    from mok_cute import jit

    static = dict(num_ranks=num_ranks, num_comm_ctas=num_comm_ctas, top_k=8, has_shared=True,
                  dynamic_tickets=True, decoded_tickets=True, store_warp_signals=True)
    if num_ranks == 1:
        static["local_direct"] = True
    if pingpong:  # (the staged k-sum does not go with it)
        static["pingpong"] = True
    else:
        static["ksum_staged"] = True
    reps = [jit.inspect_kernel("megakernel", outdir=tmp_path / str(on), **static,
                               release_only_publish=on) for on in (False, True)]
    assert all(r.spill_bytes == 0 for r in reps)
    _wgmma_pipelined(reps[1])
    ptx = [open(r.ptx_path).read() for r in reps]
    fences = [p.count("fence.acq_rel.gpu") for p in ptx]  # (scope gpu: one GPU)
    assert fences[1] == fences[0] - 1 >= 0
    assert ptx[1].count("red.release") == ptx[0].count("red.release") >= 1


@pytest.mark.parametrize("num_ranks,has_shared,timeline", [(1, True, False), (8, True, False),
                                                          (1, False, True)])
def test_pingpong_consumers_compile_without_spills(num_ranks, has_shared, timeline, tmp_path):
    """pingpong: 128 x 128 tasks, one warpgroup each (single-warpgroup wgmma tiles), turns at
    the mainloop through named barriers; no spills under the CTA's 168-register cap. It needs
    the decoded ring and does not combine with the staged k-sum."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    static = dict(num_ranks=num_ranks, num_comm_ctas=2 if num_ranks == 1 else 12,
                  local_direct=True, has_shared=has_shared, rank_blocks=num_ranks > 1,
                  dynamic_tickets=True, decoded_tickets=True, ksum_vectors=16, timeline=timeline)
    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **static, pingpong=True)
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)
    assert "C7508" not in rep.ptxas_log
    ptx = open(rep.ptx_path).read()
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n256k16" not in ptx
    with pytest.raises(ValueError, match="pingpong needs decoded_tickets"):
        megakernel_sm90.MegakernelSm90(1, 8, 2, 2, False, dynamic_tickets=True, pingpong=True)
    with pytest.raises(ValueError, match="do not combine"):
        megakernel_sm90.MegakernelSm90(1, 8, 2, 2, False, dynamic_tickets=True,
                                       decoded_tickets=True, ksum_staged=True, pingpong=True)


def test_rank_blocks_variant_spills_no_more_than_alternating(tmp_path):
    """The block-by-block ticket walk (RANK_BLOCKS) in the configuration virtual R = 8 uses:
    no more spill than the alternating walk (which has 4 + 4 bytes there, as local_direct
    has at R > 1: docs/perf_notes.md)."""
    from mok_cute import jit

    static = dict(num_ranks=8, num_comm_ctas=12, local_direct=True, has_shared=True)
    blocks = jit.inspect_kernel("megakernel", outdir=tmp_path, **static, rank_blocks=True)
    alternating = jit.inspect_kernel("megakernel", outdir=tmp_path, **static)
    assert blocks.spill_bytes is not None and alternating.spill_bytes is not None
    assert blocks.spill_bytes <= alternating.spill_bytes <= 8
    assert blocks.registers == alternating.registers == 168


def test_flat_comm_copy_compiles_without_spills_at_16_vectors(tmp_path):
    """COMM_COPY_VECTORS: the comm CTAs' flat row copy (comm_sm90.copy_rows_flat) in virtual
    R = 8's configuration changes the code and, at 16 vectors per lane, spills nothing (nor
    does the per-row copy there). More vectors spill under the 168-register launch cap (24:
    60 B, 32: 380 B when written). It is refused with the bulk copy."""
    from mok_cute import jit
    from mok_cute.kernels import megakernel_sm90

    static = dict(num_ranks=8, num_comm_ctas=12, local_direct=True, has_shared=True,
                  rank_blocks=True, dynamic_tickets=True, ksum_vectors=16)
    opts = f"--keep-ptx --dump-dir {tmp_path}"
    on = megakernel_sm90.compile_megakernel(**static, copy_vectors=16, options=opts).__ptx__
    off = megakernel_sm90.compile_megakernel(**static, options=opts).__ptx__
    assert on != off
    assert jit.inspect_kernel("megakernel", outdir=tmp_path, **static, copy_vectors=16).spill_bytes == 0
    for bad in (dict(copy="bulk", copy_vectors=16), dict(copy_vectors=65)):
        with pytest.raises(ValueError, match="copy_vectors"):
            megakernel_sm90.MegakernelSm90(2, 8, 2, 2, False, **bad)


# ---------------------------------------------------------------------- CPU: the ticket walk
@pytest.mark.parametrize("R,num_tiles_seed", [(1, 0), (2, 1), (3, 2), (8, 3), (72, 4)])
@pytest.mark.parametrize("fc1_lead", [0, 1, 3])
@pytest.mark.parametrize("rank_blocks", [False, True])
def test_virtual_ticket_walk_runs_every_live_task_once(R, num_tiles_seed, fc1_lead, rank_blocks):
    """Model of the kernel's walk (megakernel.walk_tickets) against tasks.simulate_live_run:
    with R ranks of different tile counts, each rank's tasks that run (or signal as no-ops) are
    visited exactly once, in list order, and nothing dead runs."""
    import numpy as np

    from mok_cute import megakernel, tasks
    from mok_cute.timeline import Role

    rng = np.random.default_rng(num_tiles_seed)
    capacity = 128 * 24
    tl = tasks.build_static(capacity, hidden=512, intermediate=256, num_tokens=200, top_k=4,
                            minibatch_tokens=512, ring_tokens=512 * (fc1_lead + 1),
                            shared_intermediate=128, num_ranks=R, fc1_lead=fc1_lead)
    assert tl.params.fc1_lead == fc1_lead
    dev = tasks.encode_device(tl)
    num_tiles = [int(t) for t in rng.integers(0, 25, size=R)]
    for role in (Role.COMM, Role.COMPUTE):
        walk = megakernel.walk_tickets(dev, num_tiles, int(role), rank_blocks)
        for rank in range(R):
            expected = tasks.simulate_live_run(tl, num_tiles[rank])[role]
            ran = [i for r, i, st in walk if r == rank and st == "run"]
            noop = [i for r, i, st in walk if r == rank and st == "noop"]
            assert ran == expected["ran"]
            assert noop == expected["noop"]


def _run_ctas(tl, num_tiles, ctas_per_role, rank_blocks, seed, dynamic=False, defer=False):
    """CTAs of both roles take tickets (``megakernel.ticket_position``) as the kernel does (comm:
    the next ticket of a shared counter; compute CTA c: tickets c, c + n, c + 2n, ...; with
    ``dynamic`` (DYNAMIC_TICKETS) the next of a shared counter too, each CTA holding the ticket
    after the one it runs, as the producer's lane 0 takes it ahead) and
    finish a task once its dependencies have (a dead task's waits are clipped away in the
    kernel: it counts as done; KSUM also needs every rank's BARRIER). With ``defer``
    (DEFER_SIGNALS, one rank) a compute CTA holds back the publish of a live FC1 / FC2 task:
    at its next task's start it publishes when that task may wait on it (an FC2 after an FC1,
    anything but a live FC1 / FC2), else once that task runs, and when it runs out of tasks.
    Returns the tasks left when nothing can move."""
    import numpy as np

    from mok_cute import megakernel, tasks
    from mok_cute.timeline import Role, TaskType

    R = len(num_tiles)
    dev = tasks.encode_device(tl)
    rng = np.random.default_rng(seed)
    tpm = tl.tiles_per_minibatch
    live_of = [tasks.live_minibatches(t, tpm) for t in num_tiles]
    live_len = dev.queue_live_len.numpy()
    barrier_of = [int(i) for i in range(len(tl)) if tl.type[i] == int(TaskType.BARRIER)]
    done = set()

    fc1, fc2 = int(TaskType.FC1), int(TaskType.FC2)

    def deferrable(rank, i):  # a live FC1 / FC2 tile with rows: the kernel's gemm_runs
        return (defer and tl.type[i] in (fc1, fc2) and tl.minibatch[i] < live_of[rank]
                and tl.m_tile_begin[i] < num_tiles[rank])

    def ready(rank, i):
        if tl.minibatch[i] >= live_of[rank]:
            return True  # dead: skipped
        if not all((rank, int(d)) in done or tl.minibatch[d] >= live_of[rank] for d in tl.deps(i)):
            return False
        if tl.type[i] == int(TaskType.KSUM):
            return all((p, b) in done for p in range(R) for b in barrier_of)
        return True

    roles = []
    for role in (int(Role.COMM), int(Role.COMPUTE)):
        prefix = max(int(live_len[role, live]) for live in live_of)
        n = ctas_per_role[role]
        roles.append(dict(role=role, next=0, prefix=prefix, qlen=int(dev.queue_len[role]),
                          ctas=[dict(task=None, cursor=(0, 0), out=False, q=c - n, ahead=None,
                                     held=None) for c in range(n)]))
    while True:
        moved = False
        for rs in roles:
            for c in rng.permutation(len(rs["ctas"])):
                cta = rs["ctas"][c]
                if cta["out"]:
                    continue
                if cta["task"] is None:
                    if rs["role"] == int(Role.COMM):
                        q = rs["next"]
                        rs["next"] += 1
                    elif dynamic:
                        if cta["ahead"] is None:
                            cta["ahead"] = rs["next"]
                            rs["next"] += 1
                        q, cta["ahead"] = cta["ahead"], rs["next"]
                        rs["next"] += 1
                    else:
                        cta["q"] += len(rs["ctas"])
                        q = cta["q"]
                    pos, rank, cta["cursor"] = megakernel.ticket_position(
                        dev, rs["role"], R, rs["prefix"], rank_blocks, q, cta["cursor"])
                    moved = True
                    if pos >= rs["qlen"]:
                        cta["out"] = True
                    else:
                        cta["task"] = (rank, int(dev.queues[rs["role"], pos]))
                    held = cta["held"]
                    if held is not None and (cta["out"] or not deferrable(*cta["task"]) or (
                            tl.type[held[1]] == fc1 and tl.type[cta["task"][1]] == fc2)):
                        done.add(held)  # published at the next task's start (or the end)
                        cta["held"] = None
                elif ready(*cta["task"]):
                    if cta["held"] is not None:  # published after the next task's mainloop
                        done.add(cta["held"])
                        cta["held"] = None
                    if deferrable(*cta["task"]):
                        cta["held"] = cta["task"]
                    else:
                        done.add(cta["task"])
                    cta["task"] = None
                    moved = True
        if not moved:
            return [c["task"] for rs in roles for c in rs["ctas"] if c["task"] is not None]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("rank_blocks", [False, True])
@pytest.mark.parametrize("R,ctas,tile_order", [(2, (1, 1), "m_major"), (3, (2, 3), "n_major"),
                                               (8, (2, 5), "m_major"), (8, (12, 40), "n_major")])
def test_virtual_ranks_finish_with_few_ctas(dynamic, rank_blocks, R, ctas, tile_order):
    """Both ticket walks, with static or dynamic compute tickets, finish every task with as
    few as one CTA per role, uniform and ragged tile counts (dead and no-op tasks), in random
    CTA orders: no deadlock."""
    import numpy as np

    from mok_cute import tasks

    tl = tasks.build_static(128 * 12, hidden=512, intermediate=256, num_tokens=200, top_k=4,
                            minibatch_tokens=256, ring_tokens=128 * 12, shared_intermediate=128,
                            num_ranks=R, fc1_lead=1, tile_order=tile_order)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        num_tiles = [12] * R if seed == 0 else [int(t) for t in rng.integers(0, 13, size=R)]
        assert _run_ctas(tl, num_tiles, ctas, rank_blocks, seed, dynamic) == [], num_tiles


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fc1_lead", [0, 3])
@pytest.mark.parametrize("ctas", [(1, 1), (1, 5), (2, 40), (0, 1), (0, 5), (0, 40)])
@pytest.mark.parametrize("tile_order", ["m_major", "n_major"])
def test_one_rank_without_comm_tasks_finishes_with_few_ctas(dynamic, fc1_lead, ctas, tile_order):
    """The one-rank list without comm tasks (local_direct, no peer): the comm CTAs only run
    the barrier (with no comm CTA a compute CTA runs it: barrier_in_compute), the compute CTAs
    take their static-stride (or dynamic) tickets; every task finishes."""
    import numpy as np

    from mok_cute import tasks

    tl = tasks.build_static(128 * 12, hidden=512, intermediate=256, num_tokens=200, top_k=4,
                            minibatch_tokens=256, ring_tokens=128 * 12, shared_intermediate=128,
                            fc1_lead=fc1_lead, comm_tasks=False, tile_order=tile_order,
                            barrier_in_compute=ctas[0] == 0)
    assert tl.params.fc1_lead == fc1_lead
    for seed in range(3):
        num_tiles = [12] if seed == 0 else [int(np.random.default_rng(seed).integers(0, 13))]
        assert _run_ctas(tl, num_tiles, ctas, False, seed, dynamic) == [], num_tiles


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fc1_lead", [0, 1, 3])
@pytest.mark.parametrize("ctas", [(0, 1), (0, 2), (0, 5), (0, 40), (1, 3), (2, 40)])
@pytest.mark.parametrize("tile_order", ["m_major", "n_major"])
def test_one_rank_with_deferred_signals_finishes(dynamic, fc1_lead, ctas, tile_order):
    """megakernel.DEFER_SIGNALS: every compute CTA holds back its last live FC1 / FC2 publish
    until its next task needs it out of the way; with one CTA or many, with the BARRIER on a
    compute or a comm CTA, ragged tile counts (dead and no-op tasks) and random CTA orders,
    every task still finishes: no CTA waits on a signal it holds, and no cycle of CTAs does.
    With dynamic tickets and with the static stride (STRIDED_TICKETS, the one-rank default:
    the ring takes the stride's tickets, the order the model walks)."""
    import numpy as np

    from mok_cute import tasks

    tl = tasks.build_static(128 * 12, hidden=512, intermediate=256, num_tokens=200, top_k=4,
                            minibatch_tokens=256, ring_tokens=128 * 12, shared_intermediate=128,
                            fc1_lead=fc1_lead, comm_tasks=False, tile_order=tile_order,
                            barrier_in_compute=ctas[0] == 0)
    for seed in range(6):
        num_tiles = [12] if seed == 0 else [int(np.random.default_rng(seed).integers(0, 13))]
        assert _run_ctas(tl, num_tiles, ctas, False, seed, dynamic, defer=True) == [], num_tiles


@pytest.mark.parametrize("fc1_lead", [0, 1, 3])
def test_virtual_ranks_wait_only_on_lower_tickets(fc1_lead):
    """Why R virtual ranks in one launch cannot deadlock: every wait points to a lower list
    index of the same rank, every role queue is in list order, and KSUM (the only task that
    waits on other ranks, through their BARRIER flags) comes after BARRIER in every list."""
    import numpy as np

    from mok_cute import tasks
    from mok_cute.timeline import Role, TaskType

    tl = tasks.build_static(128 * 16, hidden=512, intermediate=256, num_tokens=300, top_k=4,
                            minibatch_tokens=256, ring_tokens=256 * max(2, fc1_lead + 1),
                            shared_intermediate=128, num_ranks=8, fc1_lead=fc1_lead)
    offsets, deps = tl.deps_csr()
    for i in range(len(tl)):
        assert (deps[offsets[i]:offsets[i + 1]] < i).all()
    for role in (Role.COMM, Role.COMPUTE):
        q = tl.queue(role)
        assert (np.diff(q) > 0).all()
    barrier = np.flatnonzero(tl.type == int(TaskType.BARRIER))
    ksum = np.flatnonzero(tl.type == int(TaskType.KSUM))
    assert barrier.size == 1 and ksum.size and barrier[0] < ksum.min()


# ---------------------------------------------------------------------- H200
@pytest.fixture(autouse=True)
def _own_plans():
    """Every test starts with no cached megakernel plan, so what it asserts about
    ``megakernel._PLANS`` (a switch taken, the recorder's plan) is about its own calls."""
    from mok_cute import megakernel

    megakernel.release_plans()
    yield
    megakernel.release_plans()


def _problem(R, T, H, I, E_loc, K, Is=0, seed=0, skew=False, empty_expert=None,
             silent_receiver=None):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(torch.bfloat16)

    E = R * E_loc
    scores = torch.rand(R, T, E, device="cuda", generator=g)
    if skew:  # expert 0 takes about half of all tokens
        scores[..., 0] += 2.0 * (torch.rand(R, T, device="cuda", generator=g) < 0.5)
    if empty_expert is not None:
        scores[..., empty_expert] = -1.0
    if silent_receiver is not None:  # no token routes to that rank's experts
        scores[..., silent_receiver * E_loc:(silent_receiver + 1) * E_loc] = -1.0
    idx = scores.topk(K, dim=2).indices.to(torch.int32)
    w = torch.softmax(torch.randn(R, T, K, device="cuda", generator=g), dim=2)
    xs = rnd(R, T, H)
    wg, wu = rnd(R, E_loc, I, H, scale=H ** -0.5), rnd(R, E_loc, I, H, scale=H ** -0.5)
    wd = rnd(R, E_loc, H, I, scale=I ** -0.5)
    sh = None
    if Is:
        sh = (rnd(R, Is, H, scale=H ** -0.5), rnd(R, Is, H, scale=H ** -0.5),
              rnd(R, H, Is, scale=Is ** -0.5))
    return xs, idx, w, wg, wu, wd, sh


def _run(args, **cfg):
    """Poison the allocator's next blocks, then run on the megakernel."""
    xs = args[0]
    torch.full((2, *xs.shape), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison
    config = mok_cute.MoKConfig(timeout_ms=5000.0, **cfg)
    out = mok_cute.moe_forward_virtual(*args[:6], shared=args[6], config=config)
    torch.cuda.synchronize()
    return out


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


CASES = {
    # name: (R, T, H, I, E_loc, K, Is, problem kwargs, config kwargs)
    "R1": (1, 300, 512, 256, 8, 4, 0, {}, {}),
    "R1_shared_T77_K10": (1, 77, 256, 128, 16, 10, 128, {}, {}),
    "R2_shared_skew": (2, 160, 512, 256, 4, 4, 256, {"skew": True}, {}),
    "R3_empty_expert": (3, 100, 512, 320, 4, 2, 0, {"empty_expert": 5}, {}),
    "R4_silent_receiver": (4, 96, 256, 192, 4, 2, 64, {"silent_receiver": 2}, {}),
    "R8_ring_wrap": (8, 128, 512, 256, 2, 4, 0, {}, {"ring_tokens": 256, "minibatch_tokens": 128}),
    "R16": (16, 32, 256, 128, 2, 2, 0, {}, {}),
    "R72_shared": (72, 16, 256, 128, 1, 2, 64, {}, {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_virtual_megakernel_matches_the_reference(name):
    R, T, H, I, E_loc, K, Is, pkw, ckw = CASES[name]
    args = _problem(R, T, H, I, E_loc, K, Is, **pkw)
    out = _run(args, **ckw)
    assert mok_cute.api.choose_path(args[0].device, mok_cute.MoKConfig(), virtual=True).path == "megakernel"
    ref = reference.moe_forward_virtual(*args[:6], shared=args[6])
    assert not torch.isnan(out.float()).any()
    assert _rel(out, ref) < 1e-2
    again = _run(args, **ckw)
    assert torch.equal(out, again), "not bitwise reproducible across two runs"


@pytest.mark.gpu
def test_bitwise_identical_across_comm_sms_minibatch_and_ring():
    args = _problem(4, 256, 512, 256, 4, 4, 128, seed=3, skew=True)
    base = _run(args)
    for cfg in ({"num_comm_sms": 2}, {"num_comm_sms": 8}, {"num_comm_sms": 16},
                {"num_comm_sms": 32}, {"minibatch_tokens": 128}, {"minibatch_tokens": 512},
                {"ring_tokens": 512, "minibatch_tokens": 256},
                {"ring_tokens": 256, "minibatch_tokens": 128, "num_comm_sms": 3}):
        assert torch.equal(_run(args, **cfg), base), f"output changed with {cfg}"


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 4])
def test_local_rows_left_in_the_ring_give_the_same_bits(R, monkeypatch):
    """megakernel.LOCAL_DIRECT: a rank's own rows are never copied (FC1 reads them from x,
    the k-sum reads their y from the ring); the output must not change by a bit."""
    from mok_cute import megakernel

    args = _problem(R, 200, 512, 256, 4, 4, 128, seed=17, skew=True)
    monkeypatch.setattr(megakernel, "LOCAL_DIRECT", False)
    base = _run(args)  # every row copied by the comm CTAs
    monkeypatch.setattr(megakernel, "LOCAL_DIRECT", True)
    direct = _run(args)
    assert any(k.local_direct for k in megakernel._PLANS)
    assert any(not k.local_direct for k in megakernel._PLANS)
    assert torch.equal(direct, base)
    wrapped = _run(args, ring_tokens=256, minibatch_tokens=128)  # wraps: falls back to combining
    assert torch.equal(wrapped, base)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 4])
def test_fc1_of_the_next_minibatch_first_gives_the_same_bits(R, monkeypatch):
    """megakernel.FC1_LEAD: only the order of the compute queue changes, never a bit."""
    from mok_cute import megakernel

    args = _problem(R, 300, 512, 256, 4, 4, 128, seed=23, skew=True)
    base = _run(args, minibatch_tokens=128)
    monkeypatch.setattr(megakernel, "FC1_LEAD", True)  # the auto lead
    lead = _run(args, minibatch_tokens=128)
    assert any(k.fc1_lead for k in megakernel._PLANS)
    assert torch.equal(lead, base)
    monkeypatch.setattr(megakernel, "FC1_LEAD_MINIBATCHES", 2)  # a lead shorter than the list
    two = _run(args, minibatch_tokens=128)
    assert any(k.fc1_lead == 2 for k in megakernel._PLANS)
    assert torch.equal(two, base)
    monkeypatch.setattr(megakernel, "N_MAJOR_TILES", True)  # and N-tile-major minibatches
    n_major = _run(args, minibatch_tokens=256)
    assert any(k.tile_order == "n_major" for k in megakernel._PLANS)
    assert torch.equal(n_major, base)


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring", [(4, None), (8, 256), (3, None)])
def test_ticket_blocks_give_the_same_bits(R, ring, monkeypatch):
    """megakernel.RANK_BLOCKS: virtual ranks walk the list block by block instead of task by
    task; only the order in which CTAs take tasks changes, never a bit (with and without a
    wrapping ring, with ragged per-rank tile counts from skewed routing)."""
    from mok_cute import megakernel

    args = _problem(R, 300, 512, 256, 4, 4, 128, seed=29, skew=True)
    sizes = {} if ring is None else {"ring_tokens": ring, "minibatch_tokens": 128}
    monkeypatch.setattr(megakernel, "RANK_BLOCKS", False)
    base = _run(args, num_comm_sms=3, **sizes)
    monkeypatch.setattr(megakernel, "RANK_BLOCKS", True)
    blocks = _run(args, num_comm_sms=3, **sizes)
    again = _run(args, num_comm_sms=16, **sizes)
    assert any(k.rank_blocks for k in megakernel._PLANS)
    assert any(not k.rank_blocks for k in megakernel._PLANS)
    assert torch.equal(blocks, base) and torch.equal(again, base)


# (R, ring rows, LOCAL_DIRECT, shared intermediate) for a megakernel switch's bitwise test: one
# rank with the gathered FC1 rows, with the shared expert, several ranks, a wrapping ring where
# FC1 waits on DISPATCHED, an odd rank count
SWITCH_CASES = [(1, None, True, 0), (1, None, True, 128), (4, None, True, 0),
                (8, 256, False, 128), (3, None, False, 0)]


def _switch_keeps_the_bits(monkeypatch, switch, off, on, args, R, sizes=None, few_ctas=True):
    """megakernel.<switch> = off, then = on twice (and, with few_ctas, on 6 compute CTAs,
    where a small ring wraps): every output bitwise equal, and a plan of R ranks took the
    ``on`` setting (PlanKey field ``switch.lower()``)."""
    from mok_cute import megakernel

    sizes = sizes or {}
    monkeypatch.setattr(megakernel, switch, off)
    base = _run(args, **sizes)
    monkeypatch.setattr(megakernel, switch, on)
    outs = [_run(args, **sizes), _run(args, **sizes)]
    if few_ctas:
        monkeypatch.setattr(megakernel, "_num_sms", lambda device: 8)
        outs.append(_run(args, num_comm_sms=2, **sizes))
    assert any(getattr(k, switch.lower()) == on and k.num_ranks == R for k in megakernel._PLANS)
    for out in outs:
        assert torch.equal(out, base)


def _check_switch(monkeypatch, switch, args, R, ring=None, local_direct=None):
    """A boolean megakernel switch: same bits off and on (``_switch_keeps_the_bits``, with a
    ring of ``ring`` rows and 128-token minibatches when given, and LOCAL_DIRECT set when
    given), then recorded and against the reference with it on."""
    from mok_cute import megakernel

    sizes = None if ring is None else {"ring_tokens": ring, "minibatch_tokens": 128}
    if local_direct is not None:
        monkeypatch.setattr(megakernel, "LOCAL_DIRECT", local_direct)
    _switch_keeps_the_bits(monkeypatch, switch, False, True, args, R, sizes)
    _switch_on_is_recorded_and_correct(switch, args, sizes)


def _switch_on_is_recorded_and_correct(switch, args, sizes=None):
    """With megakernel.<switch> on: a recorded call gives the same bits as an unrecorded one,
    a plan with the switch and the recorder exists, and the output matches the reference."""
    from mok_cute import megakernel

    sizes = sizes or {}
    out = _run(args, **sizes)
    recorded = _run(args, timeline=True, **sizes)
    assert any(getattr(k, switch.lower()) and k.timeline for k in megakernel._PLANS)
    assert torch.equal(recorded, out)
    assert not torch.isnan(out.float()).any()
    assert _rel(out, reference.moe_forward_virtual(*args[:6], shared=args[6])) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T,shared", [(300, 0), (77, 128), (1000, 0)])
def test_zero_comm_ctas_give_the_same_bits(T, shared, monkeypatch):
    """num_comm_sms=0 at one rank: the BARRIER runs on a compute CTA and every SM computes.
    Bitwise equal to one comm CTA (also on 8 SMs), recorded with the BARRIER on a compute
    lane, against the reference; elsewhere 0 is refused by name."""
    from mok_cute import megakernel
    from mok_cute.timeline import Role, TaskType

    args = _problem(1, T, 512, 256, 8, 4, shared, seed=19, skew=True)
    base = _run(args, num_comm_sms=1)
    outs = [_run(args, num_comm_sms=0), _run(args, num_comm_sms=0)]
    assert any(k.num_comm_ctas == 0 and k.local_only for k in megakernel._PLANS)
    recorded = _run(args, num_comm_sms=0, timeline=True)
    plan = next(p for k, p in megakernel._PLANS.items() if k.timeline and k.num_comm_ctas == 0)
    rec = plan.timeline.decode().records
    barrier = rec[rec["task_type"] == int(TaskType.BARRIER)]
    assert len(barrier) == 1 and int(barrier["role"][0]) == int(Role.COMPUTE)
    monkeypatch.setattr(megakernel, "_num_sms", lambda device: 8)
    outs += [recorded, _run(args, num_comm_sms=0)]
    for out in outs:
        assert torch.equal(out, base)
    assert _rel(base, reference.moe_forward_virtual(*args[:6], shared=args[6])) < 1e-2
    with pytest.raises(ValueError, match="num_comm_sms=0"):
        _run(_problem(2, 64, 256, 128, 2, 2, seed=9), num_comm_sms=0)


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct", [(1, None, True), (4, None, True), (8, 256, False),
                                                 (3, None, False)])
def test_dynamic_tickets_give_the_same_bits(R, ring, local_direct, monkeypatch):
    """megakernel.DYNAMIC_TICKETS: compute CTAs take tickets from a counter (through the smem
    ticket ring) instead of the static stride; which CTA runs a tile changes, never a bit
    (with the FC1 lead, N-major tiles, skewed routing, a wrapping ring, few and many CTAs)."""
    from mok_cute import megakernel

    args = _problem(R, 300, 512, 256, 4, 4, 128, seed=37, skew=True)
    sizes = None if ring is None else {"ring_tokens": ring, "minibatch_tokens": 128}
    monkeypatch.setattr(megakernel, "LOCAL_DIRECT", local_direct)
    _switch_keeps_the_bits(monkeypatch, "DYNAMIC_TICKETS", False, True, args, R, sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct,shared", SWITCH_CASES)
def test_decoded_tickets_give_the_same_bits(R, ring, local_direct, shared, monkeypatch):
    """megakernel.DECODED_TICKETS: the compute warps read each task's words from the smem
    ticket ring instead of resolving the ticket in global memory; the tasks and their order
    are the same, so not a bit changes (skewed routing, the shared expert's tasks, a
    wrapping ring, the FC1 lead, few and many CTAs)."""
    from mok_cute import megakernel

    monkeypatch.setattr(megakernel, "DYNAMIC_TICKETS", True)
    args = _problem(R, 300, 512, 256, 4, 4, shared, seed=41, skew=True)
    _check_switch(monkeypatch, "DECODED_TICKETS", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct,shared", SWITCH_CASES)
def test_store_warp_signals_give_the_same_bits(R, ring, local_direct, shared, monkeypatch):
    """megakernel.STORE_WARP_SIGNALS: only the store warp waits for a GEMM tile's stores and
    publishes; the other warps start the next task at once. Consumers of the tile still see
    it complete (FC2 reads FC1's h, the k-sum and COMBINE read y), so not a bit changes."""
    args = _problem(R, 300, 512, 256, 4, 4, shared, seed=43, skew=True)
    _check_switch(monkeypatch, "STORE_WARP_SIGNALS", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct,shared", SWITCH_CASES[:4])
def test_one_epilogue_barrier_gives_the_same_bits(R, ring, local_direct, shared, monkeypatch):
    """megakernel.ONE_EPILOGUE_BARRIER: one barrier per epilogue subtile in the GEMM tasks,
    the store warp's buffer acquire a subtile ahead; an epilogue buffer overwritten before its
    TMA store read it would change h or y, so: the same bits as two barriers (H = 1024: 8
    subtiles per FC2 tile, subtile counts running on across tasks; the shared expert; several
    ranks; a wrapping ring; recorded; against the reference)."""
    args = _problem(R, 300, 1024, 256, 4, 4, shared, seed=67, skew=True)
    _check_switch(monkeypatch, "ONE_EPILOGUE_BARRIER", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct,shared", SWITCH_CASES)
def test_short_task_start_gives_the_same_bits(R, ring, local_direct, shared, monkeypatch):
    """megakernel.SHORT_TASK_START: the producer takes a task's first row and count of waits
    from the decoded ring instead of the task list; a wrong first row would gather the wrong
    x rows and a wrong count skip a wait, so: the same bits as without it (one rank with the
    gathered FC1 rows, with the shared expert, several ranks, a wrapping ring where FC1
    waits on DISPATCHED, recorded, against the reference)."""
    args = _problem(R, 300, 512, 256, 4, 4, shared, seed=73, skew=True)
    _check_switch(monkeypatch, "SHORT_TASK_START", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct,shared", SWITCH_CASES[:3])
def test_fence_fc1_only_gives_the_same_bits(R, ring, local_direct, shared, monkeypatch):
    """megakernel.FENCE_FC1_ONLY: the consumers fence only FC1's gathered stages (FC2's and
    the shared expert's arrive by TMA); a missing fence would let wgmma read stale A rows, so:
    the same bits as with every stage fenced (one rank with and without the shared expert,
    four ranks with local rows in place), recorded, against the reference."""
    args = _problem(R, 300, 512, 256, 4, 4, shared, seed=79, skew=True)
    _check_switch(monkeypatch, "FENCE_FC1_ONLY", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("K,shared", [(4, 0), (4, 128), (1, 0), (8, 128)])
def test_defer_signals_gives_the_same_bits(K, shared, monkeypatch):
    """megakernel.DEFER_SIGNALS (one rank): an FC1 / FC2 counter published by the CTA's next
    task; a publish before the stores land would let an FC2 read stale h or the k-sum stale
    y (wrong bits), one never made would hang (a timeout error). The same bits as without it,
    recorded, against the reference; with and without the shared expert, K = 1 to 8 (8 experts
    for K = 8: top-k needs k distinct experts)."""
    from mok_cute import megakernel

    monkeypatch.setattr(megakernel, "DEFER_FLUSH_KTILES", 1)  # the flush after the first k-tile
    args = _problem(1, 300, 512, 256, max(4, K), K, shared, seed=89, skew=True)
    _check_switch(monkeypatch, "DEFER_SIGNALS", args, 1, None, True)
    # a held task's span ends with its stores issued: the CTA's spans still follow one another
    plan = next(p for k, p in megakernel._PLANS.items() if k.timeline and k.defer_signals)
    assert plan.timeline.decode().check() == []


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct,shared", SWITCH_CASES)
def test_wide_epilogue_gives_the_same_bits(R, ring, local_direct, shared, monkeypatch):
    """megakernel.WIDE_EPILOGUE: FC1's SwiGLU and FC2's stores in 128 x 64 subtiles through two
    buffers (and, with the shared expert, its tiles too). A buffer reused under an unread
    store or a SwiGLU pairing off by a subtile would change the bits: the same bits as the
    32-column subtiles on one, three, four and eight ranks (a wrapping ring), on 132 and 8
    SMs, recorded, against the reference."""
    args = _problem(R, 300, 512, 256, 4, 4, shared, seed=103, skew=True)
    _check_switch(monkeypatch, "WIDE_EPILOGUE", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("flush_k,K,shared,I", [(4, 4, 128, 768), (8, 8, 0, 256), (4, 1, 0, 512)])
def test_defer_flush_after_ktiles_gives_the_same_bits(flush_k, K, shared, I, monkeypatch):
    """megakernel.DEFER_FLUSH_KTILES with DEFER_SIGNALS: a held FC1 / FC2 counter published
    after the next mainloop's flush_k-th k-tile, or after a shorter mainloop (I = 256: FC2 has
    4 k-tiles, fewer than 8). A publish never made would hang (timeout error), one before the
    stores landed could give stale bits: the same bits as without DEFER_SIGNALS, on 132 and 8
    SMs, recorded (spans still follow one another per CTA), against the reference."""
    from mok_cute import megakernel

    monkeypatch.setattr(megakernel, "DEFER_FLUSH_KTILES", flush_k)
    args = _problem(1, 300, 512, I, max(4, K), K, shared, seed=107, skew=True)
    _check_switch(monkeypatch, "DEFER_SIGNALS", args, 1, None, True)
    plan = next(p for k, p in megakernel._PLANS.items()
                if k.timeline and k.defer_signals and k.defer_flush_ktiles == flush_k)
    assert plan.timeline.decode().check() == []


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct,shared", SWITCH_CASES)
@pytest.mark.parametrize("K,I", [(4, 256), (10, 192)])
def test_strided_tickets_give_the_same_bits(R, ring, local_direct, shared, K, I, monkeypatch):
    """megakernel.STRIDED_TICKETS: compute tickets by the static stride through the ticket
    ring (decoded words, the short start and, at one rank, the deferred publish stay on). A
    ticket taken twice or skipped would give wrong bits or a timeout error: the same bits as
    dynamic tickets on one, three, four and eight ranks (a wrapping ring), on 132 and 6
    compute CTAs, K = 4 and 10, recorded, against the reference. (Several virtual ranks take
    it with STRIDED_TICKETS_VIRTUAL only.)"""
    from mok_cute import megakernel

    monkeypatch.setattr(megakernel, "STRIDED_TICKETS_VIRTUAL", True)
    args = _problem(R, 300, 512, I, max(4, K), K, shared, seed=131, skew=True)
    _check_switch(monkeypatch, "STRIDED_TICKETS", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct,shared", SWITCH_CASES)
def test_release_only_publish_gives_the_same_bits(R, ring, local_direct, shared, monkeypatch):
    """megakernel.RELEASE_ONLY_PUBLISH: a task's counter published without the fence before
    its release; were the release not cumulative over the tile's stores and the k-sum's rows,
    a waiter could read stale h or y (wrong bits). The same bits as with the fence, on one,
    three, four and eight ranks (a wrapping ring), recorded, against the reference."""
    args = _problem(R, 300, 512, 256, 4, 4, shared, seed=97, skew=True)
    _check_switch(monkeypatch, "RELEASE_ONLY_PUBLISH", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,local_direct,shared", SWITCH_CASES[:3])
def test_warp0_tma_stages_gives_the_same_bits(R, ring, local_direct, shared, monkeypatch):
    """megakernel.WARP0_TMA_STAGES: the load warp alone fills FC2's and the shared expert's
    stages and arrives for all 128 producer threads; a miscounted arrival would let the
    consumers read a stage before its bytes land (wrong bits) or never release it (a timeout
    error), so: the same bits as with every producer thread arriving (one rank with and
    without the shared expert, four ranks with local rows in place), recorded, against the
    reference."""
    args = _problem(R, 300, 512, 256, 4, 4, shared, seed=83, skew=True)
    _check_switch(monkeypatch, "WARP0_TMA_STAGES", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("R,K,E_loc,H,shared_inter,ring", [(1, 1, 4, 576, 0, None),
                                                           (1, 2, 4, 512, 128, None),
                                                           (1, 8, 8, 576, 0, None),
                                                           (3, 10, 4, 512, 128, None),
                                                           (8, 4, 2, 512, 0, 256)])
def test_staged_ksum_gives_the_same_bits(R, K, E_loc, H, shared_inter, ring, monkeypatch):
    """megakernel.KSUM_STAGED: the k-sum's y vectors come through smem by cp.async instead of
    registers; same sums in the same order, so the same bits (H = 576: 72 vectors per row,
    so a lane's last step is partial; K = 1 and 10; the shared expert's row; several ranks,
    whose KSUMs come after every rank's GEMM tickets; a wrapping ring; recorded too)."""
    args = _problem(R, 300, H, 256, E_loc, K, shared_inter, seed=47, skew=True)
    _check_switch(monkeypatch, "KSUM_STAGED", args, R, ring, False if ring is not None else None)


@pytest.mark.gpu
@pytest.mark.parametrize("R,shared", [(1, 0), (1, 128), (4, 0)])
def test_ksum_rows_give_the_same_bits(R, shared, monkeypatch):
    """megakernel.KSUM_ROWS: KSUM tasks of 8 tokens instead of 16 (one per consumer warp):
    the same sums in the same order, so the same bits."""
    args = _problem(R, 300, 512, 256, 4, 4, shared, seed=67, skew=True)
    _switch_keeps_the_bits(monkeypatch, "KSUM_ROWS", 16, 8, args, R)


@pytest.mark.gpu
@pytest.mark.parametrize("R,H,ring,local_direct,shared", [(1, 512, None, True, 0),
                                                         (1, 576, None, True, 128),
                                                         (4, 512, None, True, 0),
                                                         (8, 512, 256, False, 128),
                                                         (3, 576, None, False, 0)])
def test_pingpong_consumers_give_the_same_bits(R, H, ring, local_direct, shared, monkeypatch):
    """megakernel.PINGPONG: 128-wide tasks, each run whole by one consumer warpgroup, the two
    taking turns at the mainloop. Every output element still sums its K in the same k-tile
    order, so not a bit changes (H = 576: a partial last N-tile; a wrapping ring; the
    shared expert; KSUM on one warpgroup; few and many CTAs; recorded too)."""
    args = _problem(R, 300, H, 320, 4, 4, shared, seed=59, skew=True)
    _check_switch(monkeypatch, "PINGPONG", args, R, ring, local_direct)


@pytest.mark.gpu
@pytest.mark.parametrize("R,H,ring,local_direct,vectors", [(2, 512, None, True, 16),
                                                          (4, 576, None, False, 24),
                                                          (8, 512, 256, True, 16),
                                                          (3, 1024, None, False, 32)])
def test_flat_comm_copy_gives_the_same_bits(R, H, ring, local_direct, vectors, monkeypatch):
    """megakernel.COMM_COPY_VECTORS: the comm CTAs copy a task's rows as one flat run of
    16-byte vectors instead of a warp per row; only which lane moves which bytes changes, so
    not a bit does (H = 576: 72-vector rows, so chunks cross rows; local rows skipped; a
    wrapping ring; the spilling 32-vector build; few CTAs)."""
    from mok_cute import megakernel

    args = _problem(R, 300, H, 256, 4, 4, 128, seed=53, skew=True)
    sizes = None if ring is None else {"ring_tokens": ring, "minibatch_tokens": 128}
    monkeypatch.setattr(megakernel, "LOCAL_DIRECT", local_direct)
    _switch_keeps_the_bits(monkeypatch, "COMM_COPY_VECTORS", 0, vectors, args, R, sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("R,K,E_loc,H,shared_inter", [(1, 1, 4, 576, 0), (1, 3, 4, 512, 128),
                                                      (1, 8, 8, 576, 0), (3, 10, 4, 512, 128),
                                                      (4, 2, 4, 576, 0)])
def test_ksum_vectors_give_the_same_bits(R, K, E_loc, H, shared_inter, monkeypatch):
    """megakernel.KSUM_VECTORS: more loads in flight per KSUM lane change the unroll of the
    fixed-order k-sum, never its order: the same bits for K = 1..10, H not a multiple of the
    unrolled step, with and without the shared expert, at one and at several ranks."""
    args = _problem(R, 300, H, 256, E_loc, K, shared_inter, seed=43, skew=True)
    _switch_keeps_the_bits(monkeypatch, "KSUM_VECTORS", 8, 16, args, R, few_ctas=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shared_inter", [0, 128])
def test_x_read_in_place_gives_the_same_bits(shared_inter, monkeypatch):
    """megakernel.X_IN_PLACE: at one rank FC1's local rows and the shared expert read the
    caller's x where it lies (no copy into the symmetric buffer); x changes between calls."""
    from mok_cute import megakernel

    args = _problem(1, 300, 512, 256, 4, 4, shared_inter, seed=31)
    base = _run(args)
    monkeypatch.setattr(megakernel, "X_IN_PLACE", True)
    in_place = _run(args)
    assert any(k.x_in_place for k in megakernel._PLANS)
    assert torch.equal(in_place, base)
    other = list(args)
    other[0] = args[0].flip(1).contiguous()  # new x at a new address: the offset is rewritten
    monkeypatch.setattr(megakernel, "X_IN_PLACE", False)
    want = _run(tuple(other))
    monkeypatch.setattr(megakernel, "X_IN_PLACE", True)
    assert torch.equal(_run(tuple(other)), want)
    assert torch.equal(_run(args), base)  # and back


@pytest.mark.gpu
def test_one_gpu_megakernel_equals_the_expert_kernel_path_bitwise():
    args = _problem(1, 500, 512, 384, 8, 4, 128, seed=5)
    x, idx, w, wg, wu, wd = (a[0] for a in args[:6])
    shared = tuple(t[0] for t in args[6])
    mega = mok_cute.moe_forward(x, idx, w, wg, wu, wd, shared=shared,
                                config=mok_cute.MoKConfig(backend="megakernel"))
    experts = mok_cute.moe_forward(x, idx, w, wg, wu, wd, shared=shared,
                                   config=mok_cute.MoKConfig(backend="kernel"))
    assert torch.equal(mega, experts)


@pytest.mark.gpu
def test_a_silent_peer_raises_peer_timeout_naming_it():
    from mok_cute import megakernel

    xs, idx, w, wg, wu, wd, sh = _problem(4, 64, 256, 128, 2, 2, seed=9)
    config = mok_cute.MoKConfig(timeout_ms=50.0)
    plan = megakernel.plan_for(xs, wg, wd, sh, idx, config)
    plan.run(xs, idx, w, wg, wu, wd, sh, config.timeout_ms, silent_rank=2)
    with pytest.raises(PeerTimeoutError, match="peer 2"):
        plan.raise_pending_errors()
    # the plan is usable again afterwards
    out = plan.run(xs, idx, w, wg, wu, wd, sh, 5000.0)
    plan.raise_pending_errors()
    assert _rel(out, reference.moe_forward_virtual(xs, idx, w, wg, wu, wd)) < 1e-2


@pytest.mark.gpu
def test_out_of_range_ids_contribute_zero_without_the_check():
    xs, idx, w, wg, wu, wd, sh = _problem(2, 64, 256, 128, 4, 4, seed=11)
    bad = idx.clone()
    bad[0, 3, 1] = 1000
    bad[1, 7, 0] = -5
    out = _run((xs, bad, w, wg, wu, wd, sh), check_ids=False)
    w_zeroed = w.clone()
    w_zeroed[0, 3, 1] = 0.0
    w_zeroed[1, 7, 0] = 0.0
    ref = reference.moe_forward_virtual(xs, idx, w_zeroed, wg, wu, wd)
    assert _rel(out, ref) < 1e-2
    with pytest.raises(ValueError, match="topk_idx"):
        _run((xs, bad, w, wg, wu, wd, sh))


@pytest.mark.gpu
def test_recorded_megakernel_timeline_is_sane():
    """Every task that runs is recorded once; comm CTAs record only comm tasks; each CTA's
    task spans follow one another (WAIT spans, written by the waiting thread, may overlap
    the work of the CTA's other warps); a STAGE_WAIT span (a GEMM task's consumers waiting
    for its first stage) lies inside its own GEMM task's span on the same CTA, and so do a
    GEMM task's EPILOGUE and SIGNAL phases, one of each, the SIGNAL starting where the
    EPILOGUE ends and ending with the task."""
    import numpy as np

    from mok_cute import megakernel, tasks
    from mok_cute.timeline import GEMM_TASK_TYPES, Role, TaskType, is_phase, is_wait

    xs, idx, w, wg, wu, wd, sh = _problem(2, 256, 512, 256, 4, 4, 128, seed=13, skew=True)
    config = mok_cute.MoKConfig(timeline=True, num_comm_sms=4)
    mok_cute.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared=sh, config=config)
    torch.cuda.synchronize()
    plan = next(p for k, p in megakernel._PLANS.items() if k.timeline)
    tl = plan.timeline.decode()
    assert tl.dropped == 0
    rec = tl.records
    work = rec[~is_wait(rec) & ~is_phase(rec)]
    expected = set()
    for rank, sched in enumerate(plan.side.schedules(idx.to(torch.int32))):
        live = tasks.simulate_live_run(plan.task_list, int(sched.num_tiles.item()))
        for role in (Role.COMM, Role.COMPUTE):
            expected |= {(rank, i) for i in live[role]["ran"] + live[role]["noop"]}
    got = list(zip(work["rank"].tolist(), work["task_id"].tolist()))
    assert len(got) == len(set(got)), "a task was recorded twice"
    assert set(got) == expected
    comm = work["cta_id"] < config.num_comm_sms
    assert np.isin(work["task_type"][comm], [int(TaskType.DISPATCH), int(TaskType.COMBINE),
                                             int(TaskType.BARRIER)]).all()
    assert (work["role"][comm] == int(Role.COMM)).all() and (work["role"][~comm] == int(Role.COMPUTE)).all()
    for cta in np.unique(work["cta_id"]):
        spans = work[work["cta_id"] == cta]
        spans = spans[np.argsort(spans["start_ns"], kind="stable")]
        assert (spans["start_ns"] <= spans["end_ns"]).all()
        assert (spans["end_ns"][:-1] <= spans["start_ns"][1:]).all(), f"CTA {cta}: spans overlap"
    gemm = work[np.isin(work["task_type"], [int(t) for t in GEMM_TASK_TYPES])]
    task_span = {(int(r), int(c), int(i)): (int(s), int(e)) for r, c, i, s, e in zip(
        gemm["rank"], gemm["cta_id"], gemm["task_id"], gemm["start_ns"], gemm["end_ns"])}
    stage_waits = rec[rec["task_type"] == int(TaskType.STAGE_WAIT)]
    for r, c, i, s, e in zip(stage_waits["rank"], stage_waits["cta_id"], stage_waits["task_id"],
                             stage_waits["start_ns"], stage_waits["end_ns"]):
        start, end = task_span[(int(r), int(c), int(i))]
        assert start <= s <= e <= end, "a STAGE_WAIT outside its task's span"
    phases = {}
    for t, r, c, i, s, e in zip(rec["task_type"], rec["rank"], rec["cta_id"], rec["task_id"],
                                rec["start_ns"], rec["end_ns"]):
        if t in (int(TaskType.EPILOGUE), int(TaskType.SIGNAL)):
            assert (int(t), int(r), int(c), int(i)) not in phases, "a phase recorded twice"
            phases[(int(t), int(r), int(c), int(i))] = (int(s), int(e))
    assert len(phases) == 2 * len(task_span), "a GEMM task without its two phases"
    for (r, c, i), (start, end) in task_span.items():
        e0, e1 = phases[(int(TaskType.EPILOGUE), r, c, i)]
        s0, s1 = phases[(int(TaskType.SIGNAL), r, c, i)]
        assert start <= e0 <= e1 == s0 <= s1 == end, "phases not inside their task, in order"


# ---------------------------------------------------------------------- CPU: the comm split
def test_one_gpu_comm_split_is_the_simulators_pick():
    """At R = 1 with local_direct (the comm queue is only the barrier then) the simulator's
    tuner picks the fewest comm SMs its model tells apart (1 and 2 within 0.1 %; the H200
    measured 1 faster, runs 95 and 97). Its model keeps the BARRIER on a comm SM, so its grid
    starts at 1; megakernel.LOCAL_ONLY_COMM_CTAS went below it, to 0 (the BARRIER on a compute
    CTA, measured faster in run 107)."""
    from mok_cute import megakernel
    from mok_cute.config import MoKConfig
    from mok_cute.schedule import schedule_capacity
    from mok_cute.sim import SimShape, tune

    T, H, I, E, K = 4096, 7168, 2048, 32, 8  # dsv3_ep8_rank
    cap = schedule_capacity(1, T, K, E, 128)
    fixed = MoKConfig(minibatch_tokens=1024, ring_tokens=cap)
    tuned = megakernel.tuned_config(fixed, 1, T, H, I, E, K, 0)
    assert tuned.num_comm_sms <= 2
    assert (tuned.minibatch_tokens, tuned.ring_tokens) == (1024, cap)
    table = tune.tune_report(SimShape("plan", T, H, I, E, K, 0), 1, "h200_hgx",
                             minibatch_tokens=1024, ring_tokens=cap)["table"]
    predicted = {r["num_comm_sms"]: r["predicted_us"] for r in table}
    assert predicted[1] <= 1.001 * min(predicted.values())
    assert megakernel.LOCAL_ONLY_COMM_CTAS <= 1
    assert megakernel.default_num_comm_ctas(1, H, K, 132, local_direct=True) == \
        megakernel.LOCAL_ONLY_COMM_CTAS
    # the pingpong loop runs no BARRIER: it keeps a comm CTA for it
    assert megakernel.default_num_comm_ctas(1, H, K, 132, local_direct=True, pingpong=True) == \
        max(megakernel.LOCAL_ONLY_COMM_CTAS, 1)
    assert megakernel.default_num_comm_ctas(1, H, K, 132, local_direct=False) == \
        megakernel.DEFAULT_COMM_CTAS
    # virtual R = 8: glm gets the floor with local rows in place, 10 (better than 12, run 63);
    # qwen3.5 (little compute per copied row) the comm / compute balance, 16, the best of
    # 12-24 measured (runs 59-60)
    assert megakernel.default_num_comm_ctas(8, 6144, 8, 132, True, 2048, 2048) == \
        megakernel.LOCAL_DIRECT_COMM_CTAS
    assert megakernel.default_num_comm_ctas(8, 4096, 10, 132, True, 1024, 1024) == 16
    assert megakernel.default_num_comm_ctas(8, 512, 2, 132, True, 64, 0) == 132 // 4  # capped


def test_ep_group_sizes_come_from_the_tuner_and_fit_the_plan():
    """On the IPC path the None fields come from the tuner, set ones are kept, and the result
    passes the plan's own size checks."""
    from mok_cute import megakernel
    from mok_cute.config import MoKConfig
    from mok_cute.schedule import schedule_capacity
    from mok_cute.sim import tune

    T, H, I, E, K = 2048, 6144, 2048, 256, 8  # glm_5.2 per rank, on 2 GPUs
    tuned = megakernel.tuned_config(MoKConfig(), 2, T, H, I, E, K, I)
    assert tuned.num_comm_sms in tune.COMM_SMS_GRID
    assert tuned.minibatch_tokens in tune.MINIBATCH_GRID
    assert tuned.ring_tokens % tuned.minibatch_tokens == 0
    assert tuned == megakernel.tuned_config(MoKConfig(), 2, T, H, I, E, K, I)  # deterministic
    cap = schedule_capacity(2, T, K, E // 2, 128)
    minibatch, ring = megakernel.resolve_sizes(tuned, cap, T)
    assert 0 < minibatch <= ring <= cap
    kept = megakernel.tuned_config(MoKConfig(num_comm_sms=7), 2, T, H, I, E, K, I)
    assert kept.num_comm_sms == 7 and kept.minibatch_tokens is not None
