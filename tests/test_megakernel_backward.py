"""The backward megakernel (mok_cute/megakernel_backward.py, kernels/megakernel/backward.py,
backward_wgrad.py): a rank's routed dgrads and weight gradients as tasks of one launch.

CI: the kernel compiles for sm_90a without spills, with both wgmma operand forms (dgrads: A
K-major, B MN-major; weight gradients: both MN-major) and no atomics but the counters'
publish; bad sizes and inputs are refused by name (the launch's queues and walk:
``test_megakernel_backward_queues.py``). H200 (marked gpu): the four dgrad outputs bitwise equal to the
two grouped-GEMM dgrad launches (``expert_backward.fc2_dgrad`` on the cooperative 128 x 256
GEMM, ``fc1_dgrad``) on every scheduled row, and the three weight gradients bitwise equal to
``expert_backward.wgrad``'s, over odd shapes (T = 1, T not a multiple of the tile, a hot
expert, empty experts, K = 10, I not a multiple of 256), bitwise repeats with poisoned
memory; and ``moe_backward(dgrads="megakernel")`` (one launch for every GEMM) gives every
gradient of the default backward (d_topk_weights to fp32 rounding: other N-tile widths sum
its partials in another order) and matches autograd on the reference. The shared expert's
tasks in the launch (``SharedExpert``): CI checks every tensor the host passes against the
compiled signature (one rank, the group tail, virtual ranks, none); the H200 its bits against
``expert_backward.shared_backward``'s launches.
"""

from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path

import pytest
import torch
from poison import poison_free_memory


# ---------------------------------------------------------------------- CI
@pytest.mark.parametrize("fc2_pingpong", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_backward_megakernel_compiles_without_spills(tmp_path, fc2_pingpong, shared):
    """Both FC2_DGRAD forms, with and without the shared expert's tasks."""
    from mok_cute import jit

    rep = jit.inspect_kernel("megakernel_backward", outdir=tmp_path, fc2_pingpong=fc2_pingpong,
                             shared=shared)
    # no build spills (the pingpong form spilled 16 B, stored and refilled once per FC2_DGRAD
    # tile, until the tail's consumers took their words from the ticket ring: 2026-12-06)
    assert rep.spill_bytes == 0 and rep.registers == 168
    assert not [w for w in rep.warnings if "serialized" in w or "C7508" in w]
    ptx = open(rep.ptx_path).read()
    bits = set(re.findall(r"\}, %rd\d+, %rd\d+, p, 1,\s+1, (\d), (\d);", ptx))
    # A K-major, B MN-major: both dgrads; both MN-major: the weight gradients
    assert bits == {("0", "1"), ("1", "1")}, bits
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx
    # the recorder is a build of its own: no record slot taken here (the bounded waits read
    # %globaltimer in every build)
    assert "atom.global.add.u64" not in ptx


@pytest.mark.parametrize("static, spill_bound", [
    ({}, 48), ({"fc2_pingpong": True}, 48), ({"comm_ctas": 16, "ksum_top_k": 8}, 48)])
def test_the_recorder_build_reads_the_timer_and_spills_little(tmp_path, static, spill_bound):
    """``timeline=True`` (``backward_recorder``): the same registers; what it spills is a few
    words of the cooperative dgated epilogue and the buffer's address (measured 24 B, 32 B
    pingpong, 8 B with the group tail, against 0 without), so the recorded times are those of
    the kernel (the comm tasks' starts go through smem: held in registers
    through the row copies they spilled 216 B)."""
    from mok_cute import jit

    rep = jit.inspect_kernel("megakernel_backward", outdir=tmp_path, timeline=True, **static)
    assert rep.registers == 168 and rep.spill_bytes <= spill_bound
    assert "atom.global.add.u64" in open(rep.ptx_path).read()  # record slots taken


@pytest.mark.parametrize("kernel,static", [
    ("gemm_wgrad", dict(gated=True)), ("gemm_wgrad", dict(gated=False)),
    ("gemm_wgrad_fp8", dict(gated=True)),
    ("megakernel_backward", dict(fc2_pingpong=True, shared=True)),
    ("megakernel_backward", dict(num_ctas=116, comm_ctas=16, ksum_top_k=10, ksum_shared=True,
                                 shared=True))])
def test_the_accumulating_builds_add_by_tma_reduce_without_new_spills(tmp_path, kernel, static):
    """main_grad's builds: every weight-gradient subtile goes out as one fp32 TMA reduce-add
    (``cp.reduce.async.bulk.tensor ... .add``) from 8-byte smem stores, no plain TMA store of
    a weight gradient is left, no atomics, and the registers and spills of the bf16 builds
    (16 B in the pingpong backward megakernel, 0 elsewhere; measured offline)."""
    from mok_cute import jit

    flag = "accumulate_wgrads" if kernel == "megakernel_backward" else "accumulate"
    rep = jit.inspect_kernel(kernel, outdir=tmp_path, **static, **{flag: True})
    ptx = open(rep.ptx_path).read()
    reduces = re.findall(r"cp\.reduce\.async\.bulk\.tensor\.3d\.global\.shared::cta\.add", ptx)
    # the 64 x 32 subtiles of a warpgroup's block (128 x 128; FP8 64 x 128) per output
    # branch (gated: one per warpgroup); the megakernel's three outputs and the shared
    # expert's alternatives
    want = {"gemm_wgrad": 16 if static.get("gated") else 8,
            "gemm_wgrad_fp8": 8, "megakernel_backward": 48}[kernel]
    assert len(reduces) == want, len(reduces)
    assert "st.shared.v2.b32" in ptx
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx
    assert rep.registers == 168
    assert rep.spill_bytes <= (32 if static.get("fc2_pingpong") else 0)


@pytest.mark.parametrize("gated", [True, False])
def test_the_loading_main_grad_build_reads_it_and_stores_plainly(tmp_path, gated):
    """``gemm_wgrad(accumulate=True, main_grad_add="load")`` (few rows an expert): every
    subtile's main_grad comes in by 8-byte loads (``gemm_core.AddendTile``; gated, each pair
    from dW_gate or dW_up by warpgroup), the sums go out by plain TMA stores from 8-byte smem
    stores, no reduce-add, no atomics, the registers of the bf16 build and no spills."""
    from mok_cute import jit

    rep = jit.inspect_kernel("gemm_wgrad", outdir=tmp_path, gated=gated, accumulate=True,
                             main_grad_add="load")
    ptx = open(rep.ptx_path).read()
    assert "cp.reduce.async.bulk" not in ptx
    stores = re.findall(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta", ptx)
    assert len(stores) == (16 if gated else 8), len(stores)  # one atom per output (gated: 2)
    # 8 subtiles a 128 x 128 block, 8 column pairs a thread each (gated: either tensor's)
    loads = re.findall(r"ld\.global\.v2\.(?:b32|f32)", ptx)
    assert len(loads) == 8 * 8 * (2 if gated else 1), len(loads)
    assert "st.shared.v2.b32" in ptx
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx
    assert rep.registers == 168 and rep.spill_bytes == 0


@pytest.mark.parametrize("static", [
    dict(fc2_pingpong=True, shared=True), dict(fc2_pingpong=False),
    dict(num_ctas=116, comm_ctas=16, ksum_top_k=10, ksum_shared=True, shared=True)])
def test_the_backward_megakernel_reads_main_grad_and_stores_plainly(tmp_path, static):
    """The backward megakernel's ``main_grad_add="load"`` builds: each weight-gradient
    subtile's main_grad comes in by 8-byte loads (the routed output's or, at run time, the
    shared expert's), no reduce-add is left, no atomics, the registers of the bf16 builds and
    no spills (``AddendTile`` three subtiles ahead: four spill 360 B with the shared expert)."""
    from mok_cute import jit

    rep = jit.inspect_kernel("megakernel_backward", outdir=tmp_path, accumulate_wgrads=True,
                             main_grad_add="load", **static)
    ptx = open(rep.ptx_path).read()
    assert "cp.reduce.async.bulk" not in ptx
    # three outputs' 128 x 128 blocks, 8 subtiles of 8 column pairs a thread (each pair from
    # the routed or the shared expert's tensor where the build has both)
    loads = re.findall(r"ld\.global\.v2\.(?:b32|f32)", ptx)
    assert len(loads) >= 3 * 8 * 8 * (2 if static.get("shared") else 1), len(loads)
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx
    assert rep.registers == 168 and rep.spill_bytes == 0


def test_main_grad_add_by_rows_an_expert():
    """The rule that picks how a launch adds into main_grad, by the routing's expected rows an
    expert where the caller gives them, else by its schedule's capacity rows (T K + E 127
    rounded to tiles): by load up to 1024 routed rows an expert (gptoss_120b's 256, dsv3 /
    qwen3's 1024), by reduce-add at more (sonic / mixtral's 2048); the backward megakernel by
    the same rule (the shared expert's T tokens where only its tasks run)."""
    from mok_cute import megakernel_backward as mb
    from mok_cute.kernels import gemm_wgrad
    from mok_cute.kernels.megakernel.backward import BackwardMegakernelSm90
    from mok_cute.schedule import schedule_capacity

    rule, max_rows = gemm_wgrad.main_grad_add, gemm_wgrad.MAIN_GRAD_LOAD_MAX_ROWS
    for tokens, top_k, experts, want in ((8192, 4, 128, "load"), (4096, 8, 32, "load"),
                                         (16384, 8, 128, "load"), (8192, 2, 8, "reduce"),
                                         (32768, 4, 64, "reduce")):
        rows = schedule_capacity(1, tokens, top_k, experts, 128)
        assert rule(rows, experts) == want, (tokens, top_k, experts)
        assert mb._main_grad_add(rows, experts, (0, 0, 0), True) == want
    assert rule(max_rows * 8, 8) == "load"
    assert rule(max_rows * 8 + 128, 8) == "reduce"
    # over a group the capacity holds every rank's tokens: the routing's expected rows decide
    capacity = schedule_capacity(8, 2048, 8, 16, 128)  # 8 ranks, 1024 routed rows an expert
    assert rule(capacity, 16) == "reduce" and rule(capacity, 16, 1024.0) == "load"
    assert mb._main_grad_add(capacity, 16, (0, 0, 0), True, 1024.0) == "load"
    assert rule(128 * 8, 8, 2048.0) == "reduce"
    assert mb._main_grad_add(128, 1, (4096, 128, 0), False) == "reduce"  # the shared expert's T
    assert mb._main_grad_add(1 << 20, 1, (512, 128, 0), False) == "load"
    with pytest.raises(ValueError, match="main_grad_add"):
        gemm_wgrad.WgradGemmSm90(gated=True, accumulate=True, main_grad_add="atomic")
    with pytest.raises(ValueError, match="main_grad_add"):
        BackwardMegakernelSm90(accumulate_wgrads=True, main_grad_add="atomic")
    # tools/main_grad_probe.py --modes forces either way for a call, then restores the rule
    path = Path(__file__).resolve().parents[1] / "tools" / "main_grad_probe.py"
    spec = importlib.util.spec_from_file_location("main_grad_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.forced("load", lambda: rule(1 << 30, 1))() == "load"
    assert probe.forced("reduce", lambda: rule(128, 1))() == "reduce"
    assert gemm_wgrad.MAIN_GRAD_LOAD_MAX_ROWS == max_rows


@pytest.mark.parametrize("fc2_pingpong", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_the_group_tail_build_keeps_the_registers_of_the_build_without_it(tmp_path, fc2_pingpong,
                                                                          shared):
    """Comm CTAs with the group tail (K = 10 and a shared expert: the largest k-sum; its
    backward before the launch, or as tasks of it): 168
    registers, no more spills than the comm build without the tail (pingpong: 20 B stored
    and refilled, its dgated epilogue's; ``spill_bytes`` counts stores and loads; measured 0
    for both forms with the KSUM tickets, with the shared expert's tasks too), the k-sum's
    slots landed by cp.async through the
    operand stages, the flags at system scope (the sticky failed word a relaxed store before
    the release of the progress word), and the compute CTAs' consumer warps on KSUM tickets
    (their named barrier, ``NamedBarriers.TAIL_KSUM``)."""
    from mok_cute import jit

    rep = jit.inspect_kernel("megakernel_backward", outdir=tmp_path, fc2_pingpong=fc2_pingpong,
                             num_ctas=116, comm_ctas=16, ksum_top_k=10, ksum_shared=True,
                             shared=shared)
    from mok_cute.kernels.common import NamedBarriers

    assert rep.registers == 168 and rep.spill_bytes <= (40 if fc2_pingpong else 0)
    ptx = open(rep.ptx_path).read()
    assert "cp.async.cg.shared.global" in ptx
    assert re.search(r"st\.release\.sys", ptx) and re.search(r"ld\.acquire\.sys", ptx)
    assert re.search(r"st\.relaxed\.sys", ptx)
    assert re.search(rf"bar\.sync\s+{int(NamedBarriers.TAIL_KSUM)},\s*256;", ptx)


def test_expert_dgrads_rejects_sizes_it_cannot_take():
    from mok_cute import expert_backward as eb
    from mok_cute import megakernel_backward as mb

    z = torch.zeros
    with pytest.raises(ValueError, match="multiples of 64"):
        mb.expert_dgrads(z(128, 96, dtype=torch.bfloat16), z(2, 64, 96), z(2, 64, 96),
                         z(2, 96, 64), None, None, None, z(1, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="dgrads"):
        eb.moe_backward(*(None,) * 8, saved=None, dgrads="fused")
    with pytest.raises(ValueError, match="x_rows"):
        mb.expert_grads(z(128, 64, dtype=torch.bfloat16), z(64, 64, dtype=torch.bfloat16),
                        z(2, 64, 64), z(2, 64, 64), z(2, 64, 64), None, None, None,
                        z(1, dtype=torch.int32), None, z(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="expert_offsets"):
        mb.expert_grads(z(128, 64, dtype=torch.bfloat16), z(128, 64, dtype=torch.bfloat16),
                        z(2, 64, 64), z(2, 64, 64), z(2, 64, 64), None, None, None,
                        z(1, dtype=torch.int32), None, z(2, dtype=torch.int32))


def test_a_bad_shared_expert_is_refused_naming_the_tensor():
    """``check_shared``: a wrong shape, a rank dimension on some tensors only, Is not a
    multiple of 64, no token: a ValueError naming it; a wrong dtype or not a SharedExpert:
    a TypeError."""
    from mok_cute import megakernel_backward as mb

    T, H, Is = 10, 128, 64
    bf = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
    good = mb.SharedExpert(bf(T, H), bf(T, H), bf(Is, H), bf(Is, H), bf(H, Is), bf(T, 2 * Is))
    assert mb.check_shared(good, H, "cpu") == (T, Is, 0)
    ranked = mb.SharedExpert(*(t.expand(3, *t.shape).contiguous() for t in good))
    assert mb.check_shared(ranked, H, "cpu") == (T, Is, 3)
    cases = [(good._replace(w_down=bf(Is, H)), "shared.w_down"),
             (good._replace(x=bf(3, T, H)), "shared.x"),
             (ranked._replace(w_gate=bf(Is, H)), "shared.w_gate"),
             (mb.SharedExpert(bf(T, H), bf(T, H), bf(96, H), bf(96, H), bf(H, 96),
                              bf(T, 192)), "multiple of 64"),
             (mb.SharedExpert(bf(0, H), bf(0, H), *good[2:5], bf(0, 2 * Is)), "one token")]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            mb.check_shared(bad, H, "cpu")
    with pytest.raises(TypeError, match="shared.preact"):
        mb.check_shared(good._replace(preact=torch.zeros(T, 2 * Is)), H, "cpu")
    with pytest.raises(TypeError, match="SharedExpert"):
        mb.check_shared(tuple(good), H, "cpu")


def test_moe_backward_refuses_a_bad_d_out_or_no_saved_forward():
    from mok_cute import expert_backward as eb
    from mok_cute.expert_path import SavedForBackward

    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    idx = torch.zeros(8, 2, dtype=torch.int32)
    saved = SavedForBackward(*[torch.zeros(1)] * 7)
    args = (x, idx, torch.ones(8, 2), None, None, None, None)
    with pytest.raises(TypeError, match="saved: expected the SavedForBackward"):
        eb.moe_backward(x, *args, saved=None)
    with pytest.raises(ValueError, match=r"d_out: expected shape \[8, 64\]"):
        eb.moe_backward(x[:4], *args, saved=saved)
    with pytest.raises(ValueError, match="d_out: expected bfloat16"):
        eb.moe_backward(x.float(), *args, saved=saved)
    # only the one backward-megakernel launch records a timeline
    from mok_cute.timeline import TimelineBuffer

    buf = TimelineBuffer(4, device="cpu")
    with pytest.raises(ValueError, match="timeline: only the one backward-megakernel launch"):
        eb.moe_backward(x, *args, saved=saved, timeline=buf)
    with pytest.raises(ValueError, match="timeline: only the one backward-megakernel launch"):
        eb.moe_backward(x, *args, saved=saved, dgrads="megakernel", timeline=buf,
                        needs=eb.Needs(w_down=False))


def _call_names() -> list[str]:
    """The names of the backward megakernel's ``__call__`` arguments, in order."""
    import inspect

    from mok_cute.kernels.megakernel.backward import BackwardMegakernelSm90

    return list(inspect.signature(BackwardMegakernelSm90.__call__).parameters)[1:]


def _assert_as_compiled(args, fakes):
    """Each tensor argument of a launch as the compiled signature takes it (TVM-FFI checks
    them at the call): its fake's rank and dtype, static extents equal, run-time extents and
    strides of their divisibility, the stride-1 mode stride 1 (modes of extent 1 excepted),
    and one value for each run-time extent that several arguments share."""
    import cutlass

    dtypes = {cutlass.BFloat16: torch.bfloat16, cutlass.Float32: torch.float32,
              cutlass.Int32: torch.int32, cutlass.Int64: torch.int64}
    names = _call_names()
    assert len(args) == len(fakes) - 1 == len(names) - 1  # the stream last
    extents = {}  # a shared run-time extent: its first value and who set it
    for name, a, f in zip(names, args, fakes):
        assert isinstance(a, torch.Tensor), name
        assert a.dim() == len(f.shape) and a.dtype == dtypes[f.element_type], (name, a.shape, f)
        for mode, (n, st) in enumerate(zip(f.shape, f.stride)):
            if isinstance(n, int):
                assert a.shape[mode] == n, (name, mode)
            else:
                assert a.shape[mode] % n.divisibility == 0, (name, mode, a.shape)
                first = extents.setdefault(id(n), (a.shape[mode], name))
                assert first[0] == a.shape[mode], (name, mode, a.shape[mode], first)
            if a.shape[mode] == 1:
                continue
            if isinstance(st, int):
                assert a.stride(mode) == st, (name, mode, a.stride())
            else:
                assert a.stride(mode) % st.divisibility == 0, (name, mode, a.stride())


@pytest.mark.parametrize("form", ["no_shared", "one_rank", "group_tail", "virtual_ranks",
                                  "shared_only"])
def test_the_shared_experts_tensors_reach_the_kernel_as_it_was_compiled(monkeypatch, form):
    """CPU, the launch's host side with a ``SharedExpert`` (one rank; one rank of a group with
    the group tail; three virtual ranks' shared experts) and without: the kernel built with
    its tasks, every tensor of the call as the compiled signature takes it
    (``backward.fake_arguments``: the placeholders of a launch without it too, and of one
    with its tasks alone, ``shared_expert_grads``), its outputs
    the ``SharedGrads`` returned, with the tail its dx rows what the k-sums add; its tasks
    queued (its FC2 dgrads at the head of the pingpong phase's, its FC1 dgrads after the
    routed ones, its weight gradients last)."""
    from mok_cute import expert_path, jit
    from mok_cute import megakernel_backward as mb
    from mok_cute import tasks_backward as tb
    from mok_cute.kernels.megakernel.backward import fake_arguments
    from mok_cute.schedule import schedule_capacity

    calls = []
    monkeypatch.setattr(jit, "compile_kernel", lambda name, arch, **kw: (
        lambda *args: calls.append((name, kw, args))))
    monkeypatch.setattr(jit, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(expert_path, "_num_sms", lambda index: 132)
    monkeypatch.setattr(mb, "PendingErrors", lambda *a, **k: types.SimpleNamespace(
        check=lambda **kw: None, record=lambda call: None))
    monkeypatch.setattr(mb, "_TABLES", mb.BoundedCache(32))
    T, H, I, Is, E, K = 100, 512, 192, 128, 4, 2
    rows = schedule_capacity(1, T, K, E, 128)
    bf16 = dict(dtype=torch.bfloat16)
    i32 = dict(dtype=torch.int32)
    w_gate, w_up, w_down = torch.randn(E, I, H, **bf16), torch.randn(E, I, H, **bf16), torch.randn(E, H, I, **bf16)
    routed = (w_gate, w_up, w_down, torch.randn(T * K, 2 * I, **bf16),
              torch.zeros(rows, **i32), torch.ones(T * K), torch.zeros(rows // 128, **i32),
              torch.ones(1, **i32), torch.zeros(E + 1, **i32))
    lead = (3,) if form in ("virtual_ranks", "shared_only") else ()
    shared = mb.SharedExpert(*(torch.randn(*lead, *shape, **bf16) for shape in (
        (T, H), (T, H), (Is, H), (Is, H), (H, Is), (T, 2 * Is))))
    if form == "no_shared":
        mb.expert_grads(torch.randn(rows, H, **bf16), torch.randn(rows, H, **bf16), *routed)
        (name, kw, args), = calls
        assert not kw["shared"]
        _assert_as_compiled(args, fake_arguments())
        return
    if form == "shared_only":
        out = (mb.shared_expert_grads(shared),)
    elif form in ("one_rank", "virtual_ranks"):
        out = mb.expert_grads(torch.randn(rows, H, **bf16), torch.randn(rows, H, **bf16),
                              *routed, shared=shared)
    else:
        from mok_cute.constants import BACKWARD_COMM_SCALARS, SCALARS
        peers = mb.PeerRows(torch.zeros(8, dtype=torch.int64), *(torch.zeros(rows, **i32),) * 3,
                            torch.zeros(BACKWARD_COMM_SCALARS, dtype=torch.int64))
        tail = mb.GroupTail(torch.zeros(SCALARS, dtype=torch.int64),
                            torch.zeros(1, dtype=torch.int64), torch.zeros(T, K, **i32), None,
                            torch.empty(T, H, **bf16), torch.empty(T, K))
        out = mb.expert_grads_over_peers(*routed, peers, comm_ctas=16, tail=tail, shared=shared)
    (name, kw, args), = calls
    assert name == "megakernel_backward" and kw["shared"]
    assert kw["ksum_shared"] == (form == "group_tail")
    _assert_as_compiled(args, fake_arguments())
    grads = out[-1]
    assert isinstance(grads, mb.SharedGrads)
    arg = dict(zip(_call_names(), args))
    L = lead[0] if lead else 1
    # the dx rows: rank r's at r * T_pad of the launch's buffer
    assert grads.dx.shape == (*lead, T, H)
    padded = arg["s_dx_rows"].view(L, -1, H)
    assert padded.shape[1] == -(-T // 128) * 128
    assert grads.dx.data_ptr() == padded.data_ptr()
    assert grads.dx.stride()[-2] == H and (not lead or grads.dx.stride(0) == padded.stride(0))
    for got, name, like in ((grads.w_gate, "s_dw_gate", shared.w_gate),
                            (grads.w_up, "s_dw_up", shared.w_up),
                            (grads.w_down, "s_dw_down", shared.w_down)):
        assert got.data_ptr() == arg[name].data_ptr() and got.shape == like.shape
    # the padded rows' slots: rank r's row r * T_pad + t is slot r * T + t, -1 past T
    slots = arg["s_rows"].view(L, -1)
    assert torch.equal(slots[:, :T], torch.arange(L * T, dtype=torch.int32).view(L, T))
    assert (slots[:, T:] == -1).all()
    if form == "group_tail":  # the k-sums add the rows the launch writes
        assert arg["shared_dx"].data_ptr() == grads.dx.data_ptr()
    if form == "shared_only":  # its tasks alone: no routed one queued
        tl, kinds = mb.task_list(1, L, H, Is, shared=(T, Is, L), routed=False)
        queue, _, _, queue_len = mb.compute_queue(tl, kinds)
        assert {tl[int(i)].type for i in queue[:queue_len]} == {
            tb.BackwardTaskType.SHARED_FC2_DGRAD, tb.BackwardTaskType.SHARED_FC1_DGRAD,
            tb.BackwardTaskType.SHARED_WGRAD_GATE_UP, tb.BackwardTaskType.SHARED_WGRAD_DOWN}
        assert mb.fc2_head(tl, queue[:queue_len]) == L * -(-T // 128) * -(-Is // mb.fc2_tile_n(H))
        return
    tl, kinds = mb.task_list(rows // 128, E, H, I, form == "group_tail",
                             T if form == "group_tail" else 0, K, (T, Is, lead[0] if lead else 0))
    queue, _, tail_begin, queue_len = mb.compute_queue(tl, kinds)
    types_ = [tl[int(i)].type for i in queue[:queue_len]]
    fc2 = mb.fc2_head(tl, queue[:queue_len])
    n_s2 = L * -(-T // 128) * -(-Is // mb.fc2_tile_n(H))
    assert types_[:n_s2] == [tb.BackwardTaskType.SHARED_FC2_DGRAD] * n_s2
    n_s1 = L * -(-T // 128) * -(-H // 256)
    assert types_[fc2] == tb.BackwardTaskType.FC1_DGRAD  # the routed dx rows first (pushes)
    assert types_[tail_begin - n_s1:tail_begin] == [tb.BackwardTaskType.SHARED_FC1_DGRAD] * n_s1
    assert types_[-1] in (tb.BackwardTaskType.SHARED_WGRAD_GATE_UP,
                          tb.BackwardTaskType.SHARED_WGRAD_DOWN)


# ---------------------------------------------------------------------- H200
CASES = {
    # name: (T, H, I, E, K, routing)
    "dsv3_reduced": (512, 7168, 2048, 32, 8, "uniform"),
    "gptoss_reduced": (300, 2880, 2880, 32, 4, "uniform"),  # I % 256 != 0: a partial N-tile
    "T1": (1, 512, 256, 8, 2, "uniform"),
    "hot_expert": (600, 1024, 512, 16, 4, "hot"),
    "empty_experts_T333": (333, 576, 448, 16, 4, "empty"),
    "K10": (333, 576, 192, 16, 10, "uniform"),
}


def _saved_problem(name):
    import mok_cute as mok
    from mok_cute import expert_path
    from test_backward import _problem

    T, H, I, E, K, routing = CASES[name]
    leaves, idx = _problem(T, H, I, E, K, seed=T + K, routing=routing, requires_grad=False)
    x, w, wg, wu, wd = leaves
    config = mok.MoKConfig(backend="kernel")
    _, saved = expert_path.moe_forward_kernel(x, idx, w, wg, wu, wd, None, config, save=True)
    return leaves, idx, saved, config


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_megakernel_dgrads_equal_the_two_launches_bitwise(name):
    from mok_cute import expert_backward as eb
    from mok_cute import megakernel_backward as mb
    from mok_cute.kernels import token_ops

    (x, w, wg, wu, wd), idx, saved, config = _saved_problem(name)
    K = idx.shape[1]
    d_out = torch.randn_like(x)
    d_rows = token_ops.gather_rows(d_out, saved.row_token(K))
    weights = w.float().contiguous().view(-1)
    # the launch's form at this H (pingpong 128 x 128 up to FC2_DGRAD_PINGPONG_MAX_K), as the
    # megakernel's FC2_DGRAD tasks
    d_preact, hw, partials = eb.fc2_dgrad(d_rows, wd, saved.preact, saved.row_slot, weights,
                                          saved.tile_expert, saved.num_tiles,
                                          config.expert_path)
    assert partials.shape[1] == -(-wd.shape[2] // mb.fc2_tile_n(x.shape[1]))
    want = (d_preact, hw, partials,
            eb.fc1_dgrad(d_preact, wg, wu, saved.tile_expert, saved.num_tiles,
                         config.expert_path))
    rows = int(saved.num_tiles.item()) * 128
    # the 3-stage launch the one-GPU backward picks for few rows an expert: the same bits
    few_stages = eb.fc1_dgrad(d_preact, wg, wu, saved.tile_expert, saved.num_tiles,
                              config.expert_path, rows_per_expert=1.0)
    assert torch.equal(few_stages[:rows], want[3][:rows]), f"{name}: 3-stage FC1 dgrad differs"
    runs = []
    for _ in range(2):
        poison_free_memory()
        runs.append(mb.expert_dgrads(d_rows, wg, wu, wd, saved.preact, saved.row_slot, weights,
                                     saved.tile_expert, saved.num_tiles, check=True))
    for got in runs:
        for label, a, b in zip(("dG|dU", "w*h", "row partials", "dx rows"), got, want):
            a, b = a[:rows], b[:rows]
            assert torch.isfinite(a).all(), f"{name}: {label} not finite"
            assert torch.equal(a, b), f"{name}: {label} differs from the two launches"


def _backward_rows(name: str, seed: int):
    """A case's saved forward and what its backward launches read: ((w_gate, w_up, w_down),
    saved, d_out's rows and x's rows in schedule order, the router weights flat, the
    generator that drew d_out)."""
    from mok_cute.kernels import token_ops

    (x, w, wg, wu, wd), idx, saved, _ = _saved_problem(name)
    K = idx.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d_out = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
    return ((wg, wu, wd), saved, token_ops.gather_rows(d_out, saved.row_token(K)),
            token_ops.gather_rows(x, saved.row_token(K)), w.float().contiguous().view(-1), gen)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_megakernel_weight_gradients_equal_gemm_wgrad_bitwise(name):
    from mok_cute import expert_backward as eb
    from mok_cute import megakernel_backward as mb

    (wg, wu, wd), saved, d_rows, x_rows, weights, _ = _backward_rows(name, seed=7)
    E, inter = wg.shape[0], wg.shape[1]
    dgrads = mb.expert_dgrads(d_rows, wg, wu, wd, saved.preact, saved.row_slot, weights,
                              saved.tile_expert, saved.num_tiles)
    d_preact, hw = dgrads[0], dgrads[1]
    want = (*eb.wgrad(d_preact[:, :inter], d_preact[:, inter:], x_rows, saved.expert_offsets,
                      E, inter),
            eb.wgrad(d_rows, None, hw, saved.expert_offsets, E, wd.shape[1]))
    rows = int(saved.num_tiles.item()) * 128
    runs = []
    for _ in range(2):
        poison_free_memory()
        runs.append(mb.expert_grads(d_rows, x_rows, wg, wu, wd, saved.preact, saved.row_slot,
                                    weights, saved.tile_expert, saved.num_tiles,
                                    saved.expert_offsets, check=True))
    for got in runs:
        for label, a, b in zip(("dG|dU", "w*h", "row partials", "dx rows"), got, dgrads):
            assert torch.equal(a[:rows], b[:rows]), f"{name}: {label} differs from the dgrads' launch"
        for label, a, b in zip(("dW_gate", "dW_up", "dW_down"), got[4:], want):
            assert torch.isfinite(a).all(), f"{name}: {label} not finite"
            assert torch.equal(a, b), f"{name}: {label} differs from gemm_wgrad"
    # an expert with no rows gets zeros (the empty-expert case has some)
    counts = (saved.expert_offsets[1:] - saved.expert_offsets[:-1]).cpu()
    for e in torch.nonzero(counts == 0).flatten().tolist():
        assert not runs[0][4][e].any() and not runs[0][6][e].any()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gptoss_reduced", "dsv3_reduced", "empty_experts_T333"])
def test_the_recorder_build_records_every_task_once_and_changes_no_bit(name):
    """``expert_grads(timeline=...)`` (both FC2_DGRAD forms: pingpong at H = 2880 and 576,
    cooperative at H = 7168): the outputs bitwise those of the launch without the recorder;
    every live dgrad and every weight-gradient tile recorded once, on a compute CTA, with its
    EPILOGUE phase inside its span ending with it; a CTA's cooperative tiles one after
    another (only the pingpong FC2_DGRAD tiles of its two warpgroups overlap); the load
    warp's WAIT spans name tasks of the launch."""
    import numpy as np

    from mok_cute import megakernel_backward as mb
    from mok_cute import tasks_backward as tb
    from mok_cute.tasks import Role, TaskType
    from mok_cute.timeline import TimelineBuffer, is_phase, is_wait

    (wg, wu, wd), saved, d_rows, x_rows, weights, _ = _backward_rows(name, seed=11)
    args = (d_rows, x_rows, wg, wu, wd, saved.preact, saved.row_slot, weights, saved.tile_expert,
            saved.num_tiles, saved.expert_offsets)
    want = mb.expert_grads(*args, check=True)
    rows = int(saved.num_tiles.item()) * 128
    E, I, H = wg.shape
    BT = tb.BackwardTaskType
    tl_host, kinds = mb.task_list(d_rows.shape[0] // 128, E, H, I)
    queue, _, _, queue_len = mb.compute_queue(tl_host, kinds)
    live = rows // 128
    expected = {(int(tl_host[int(i)].type), int(i)) for i in queue[:queue_len]
                if tl_host[int(i)].type in (BT.WGRAD_GATE_UP, BT.WGRAD_DOWN)
                or tl_host[int(i)].tile < live}
    for _ in range(2):
        buf = TimelineBuffer(1 << 18)  # dsv3_reduced: ~45k tasks, two records each
        poison_free_memory()
        got = mb.expert_grads(*args, check=True, timeline=buf)
        for label, a, b in zip(("dG|dU", "w*h", "row partials", "dx rows"), got, want):
            assert torch.equal(a[:rows], b[:rows]), f"{name}: {label} differs with the recorder"
        for label, a, b in zip(("dW_gate", "dW_up", "dW_down"), got[4:], want[4:]):
            assert torch.equal(a, b), f"{name}: {label} differs with the recorder"
        tl = buf.decode()
        assert tl.check(expected_task_ids=expected) == [], name
        rec = tl.records
        assert (rec["role"] == int(Role.COMPUTE)).all() and (rec["start_ns"] >= 0).all()
        work = rec[~is_wait(rec) & ~is_phase(rec)]
        assert {(int(t), int(i)) for t, i in zip(work["task_type"], work["task_id"])} == expected
        span = {int(i): (int(s), int(e), int(c)) for i, s, e, c in zip(
            work["task_id"], work["start_ns"], work["end_ns"], work["cta_id"])}
        phases = rec[rec["task_type"] == int(TaskType.EPILOGUE)]
        assert len(phases) == len(work)
        for i, s, e, c in zip(phases["task_id"], phases["start_ns"], phases["end_ns"],
                              phases["cta_id"]):
            start, end, cta = span[int(i)]
            assert cta == c and start <= s <= e == end, f"{name}: task {i}'s EPILOGUE"
        one_at_a_time = work[work["task_type"] != int(BT.FC2_DGRAD)]
        if not mb.fc2_pingpong(H):
            one_at_a_time = work
        for cta in np.unique(one_at_a_time["cta_id"]):
            mine = one_at_a_time[one_at_a_time["cta_id"] == cta]
            mine = mine[np.argsort(mine["start_ns"], kind="stable")]
            assert (mine["end_ns"][:-1] <= mine["start_ns"][1:]).all(), f"CTA {cta} overlaps"
        waits = rec[rec["task_type"] == int(TaskType.WAIT)]
        assert {int(i) for i in waits["task_id"]} <= {i for _, i in expected}


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hot_expert", "empty_experts_T333", "K10"])
def test_weight_gradients_added_into_main_grads_are_gemm_wgrads_bitwise(name):
    """The accumulating builds (``gemm_wgrad(accumulate=True)``, the backward megakernel's
    ``accumulate_wgrads``): from zero buffers the fp32 sums round to the bf16 kernels' bits;
    from random buffers the launch and the launches add the same fp32 accumulators (bitwise,
    twice, poisoned between), None is returned for each buffered weight and a weight without
    a buffer gets its bf16 gradient."""
    from mok_cute import expert_backward as eb
    from mok_cute import megakernel_backward as mb

    (wg, wu, wd), saved, d_rows, x_rows, weights, gen = _backward_rows(name, seed=11)
    E, inter = wg.shape[0], wg.shape[1]
    d_preact, hw = mb.expert_dgrads(d_rows, wg, wu, wd, saved.preact, saved.row_slot, weights,
                                    saved.tile_expert, saved.num_tiles)[:2]
    gate_up = (d_preact[:, :inter], d_preact[:, inter:], x_rows, saved.expert_offsets, E, inter)
    down = (d_rows, None, hw, saved.expert_offsets, E, wd.shape[1])
    want = (*eb.wgrad(*gate_up), eb.wgrad(*down))
    zeros = [torch.zeros(t.shape, device="cuda") for t in want]
    assert eb.wgrad(*gate_up, main_grads=zeros[:2]) == (None, None)
    assert eb.wgrad(*down, main_grads=zeros[2:]) is None
    for label, z, b in zip(("dW_gate", "dW_up", "dW_down"), zeros, want):
        assert torch.equal(z.to(torch.bfloat16), b), f"{name}: {label} from zeros"
    starts = [torch.randn(t.shape, device="cuda", generator=gen) for t in want]
    launches = [s.clone() for s in starts]
    eb.wgrad(*gate_up, main_grads=launches[:2])
    eb.wgrad(*down, main_grads=launches[2:])
    for _ in range(2):
        poison_free_memory()
        bufs = [s.clone() for s in starts]
        got = mb.expert_grads(d_rows, x_rows, wg, wu, wd, saved.preact, saved.row_slot,
                              weights, saved.tile_expert, saved.num_tiles,
                              saved.expert_offsets, check=True, main_grads=eb.MainGrads(*bufs))
        assert got[4:7] == (None, None, None)
        for label, a, b in zip(("dW_gate", "dW_up", "dW_down"), bufs, launches):
            assert torch.equal(a, b), f"{name}: {label} differs from gemm_wgrad's sum"
    for label, a, s, b in zip(("dW_gate", "dW_up", "dW_down"), launches, starts, want):
        added, ref = a - s, b.float()  # the unrounded sum within bf16's rounding of it
        assert ((added - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6 * (1 + s.abs())).all(), label
    one = starts[0].clone()  # only dW_gate buffered: the others come back in bf16
    got = mb.expert_grads(d_rows, x_rows, wg, wu, wd, saved.preact, saved.row_slot, weights,
                          saved.tile_expert, saved.num_tiles, saved.expert_offsets,
                          check=True, main_grads=eb.MainGrads(one))
    assert got[4] is None and torch.equal(one, launches[0])
    assert torch.equal(got[5], want[1]) and torch.equal(got[6], want[2])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["T77_shared", "empty_experts", "K10_zero_weights"])
def test_the_shared_expert_in_the_launch_is_shared_backward_bitwise(name):
    """``expert_grads(shared=...)``: the shared expert's dgrads and weight gradients as tasks
    of the launch give ``expert_backward.shared_backward``'s bits (its launches on one expert
    over the tokens), the routed outputs those of the launch without it, twice over poisoned
    memory (T = 77 and Is = 192: a partial token tile and a partial FC2 N-tile); so do its
    tasks alone (``shared_expert_grads``), for one rank and for two ranks' experts at once;
    and with main_grad buffers for some of its weights (the accumulating build)."""
    import mok_cute as mok
    from mok_cute import expert_backward as eb
    from mok_cute import expert_path
    from mok_cute import megakernel_backward as mb
    from mok_cute.kernels import token_ops
    from test_backward import CASES as ONE_GPU_CASES
    from test_backward import _problem

    T, H, I, E, K, Is, routing, zero_w = ONE_GPU_CASES[name]
    leaves, idx = _problem(T, H, I, E, K, Is, seed=T + K, routing=routing, zero_weights=zero_w,
                           requires_grad=False)
    x, w, wg, wu, wd, *sh = leaves
    _, saved = expert_path.moe_forward_kernel(x, idx, w, wg, wu, wd, tuple(sh),
                                              mok.MoKConfig(backend="kernel"), save=True)
    gen = torch.Generator(device="cuda").manual_seed(T)
    d_out = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
    d_rows = token_ops.gather_rows(d_out, saved.row_token(K))
    x_rows = token_ops.gather_rows(x, saved.row_token(K))
    routed = (d_rows, x_rows, wg, wu, wd, saved.preact, saved.row_slot,
              w.float().contiguous().view(-1), saved.tile_expert, saved.num_tiles,
              saved.expert_offsets)
    want_routed = mb.expert_grads(*routed, check=True)
    want_dx, want_dw = eb.shared_backward(d_out, x, tuple(sh), saved.shared_preact)
    shared = mb.SharedExpert(d_out, x, *sh, saved.shared_preact)
    rows = int(saved.num_tiles.item()) * 128
    for _ in range(2):
        poison_free_memory()
        *got, s = mb.expert_grads(*routed, check=True, shared=shared)
        for label, a, b in zip(("dG|dU", "w*h", "row partials", "dx rows"), got, want_routed):
            assert torch.equal(a[:rows], b[:rows]), f"{name}: {label} differs without it"
        for label, a, b in zip(("dW_gate", "dW_up", "dW_down"), got[4:], want_routed[4:]):
            assert torch.equal(a, b), f"{name}: {label} differs without it"
        for label, a, b in zip(("shared dx", "dWs_gate", "dWs_up", "dWs_down"), s,
                               (want_dx, *want_dw)):
            assert torch.isfinite(a).all(), f"{name}: {label} not finite"
            assert torch.equal(a, b), f"{name}: {label} differs from shared_backward"
    # its tasks alone (shared_expert_grads), one rank and two (the second with its own d_out)
    poison_free_memory()
    for label, a, b in zip(("alone dx", "alone dWs_gate", "alone dWs_up", "alone dWs_down"),
                           mb.shared_expert_grads(shared, check=True), (want_dx, *want_dw)):
        assert torch.equal(a, b), f"{name}: {label} differs from shared_backward"
    d_out2 = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
    want2 = eb.shared_backward(d_out2, x, tuple(sh), saved.shared_preact)
    both = lambda t: torch.stack([t, t])  # noqa: E731  two ranks, the same tokens and weights
    two = mb.shared_expert_grads(mb.SharedExpert(
        torch.stack([d_out, d_out2]), *(both(t) for t in (x, *sh, saved.shared_preact))),
        check=True)
    for r, (dx_r, dw_r) in enumerate(((want_dx, want_dw), want2)):
        for label, a, b in zip(("dx", "dWs_gate", "dWs_up", "dWs_down"), (g[r] for g in two),
                               (dx_r, *dw_r)):
            assert torch.equal(a, b), f"{name}: rank {r} of two, {label}"
    # main_grad buffers (the accumulating build): with the routed experts, and alone over two
    # ranks; from zeros the bf16 bits, dWs_up left without a buffer comes back in bf16
    bufs = [torch.zeros(t.shape, device="cuda") for t in sh]
    *got, s = mb.expert_grads(*routed, check=True, shared=shared,
                              main_grads=eb.MainGrads(None, None, None, bufs[0], None, bufs[2]))
    assert (s.w_gate, s.w_down) == (None, None) and torch.equal(s.w_up, want_dw[1])
    for label, a, b in zip(("dW_gate", "dW_up", "dW_down"), got[4:], want_routed[4:]):
        assert torch.equal(a, b), f"{name}: {label} with the shared main_grads"
    for label, buf, b in (("dWs_gate", bufs[0], want_dw[0]), ("dWs_down", bufs[2], want_dw[2])):
        assert torch.equal(buf.to(torch.bfloat16), b), f"{name}: {label} into main_grad"
    bufs2 = [torch.zeros(2, *t.shape, device="cuda") for t in sh]
    two_mg = mb.shared_expert_grads(mb.SharedExpert(
        torch.stack([d_out, d_out2]), *(both(t) for t in (x, *sh, saved.shared_preact))),
        check=True, main_grads=eb.MainGrads(None, None, None, *bufs2))
    assert torch.equal(two_mg.dx, two.dx) and two_mg[1:] == (None, None, None)
    for i, label in enumerate(("dWs_gate", "dWs_up", "dWs_down")):
        assert torch.equal(bufs2[i].to(torch.bfloat16), two[1 + i]), f"{name}: two ranks, {label}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dsv3_reduced", "empty_experts_T333", "K10"])
def test_backward_with_megakernel_dgrads_gives_the_default_gradients(name):
    from mok_cute import expert_backward as eb
    from test_backward import _close

    (x, w, wg, wu, wd), idx, saved, _ = _saved_problem(name)
    d_out = torch.randn_like(x)
    default = eb.moe_backward(d_out, x, idx, w, wg, wu, wd, None, saved)
    poison_free_memory()
    got = eb.moe_backward(d_out, x, idx, w, wg, wu, wd, None, saved, dgrads="megakernel")
    names = ("d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down")
    for label, a, b in zip(names, got, default):  # FC2_DGRAD in the launch's form at this H
        assert torch.isfinite(a).all(), label
        assert torch.equal(a, b), f"{name}: {label}"
    # and against autograd on the reference
    from mok_cute import reference
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    ref = reference.moe_forward(leaves[0], idx, *leaves[1:])
    ref.backward(d_out)
    for label, a, leaf in zip(names, got, leaves):
        _close(a.float() if label == "d_topk_weights" else a,
               leaf.grad.float() if label == "d_topk_weights" else leaf.grad, label)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dsv3_reduced", "T77_shared", "empty_experts", "K10_zero_weights",
                                  "T1"])
def test_megakernel_backend_trains_like_the_kernel_backend(name):
    """``MoKConfig(backend="megakernel")`` with inputs that require grad: the megakernel's
    forward at one rank and the backward megakernel's dgrads. The output and every gradient
    bitwise those of ``backend="kernel"`` (d_topk_weights too: FC2_DGRAD runs in the one-GPU
    launch's tile form at each H), close to autograd on the reference, and bitwise on a repeat."""
    import mok_cute as mok
    from test_backward import CASES, NAMES, _assert_repeats_bitwise, _close, _grads, _problem

    T, H, I, E, K, Is, routing, zero_w = CASES[name]
    leaves, idx = _problem(T, H, I, E, K, Is, seed=T + K, routing=routing, zero_weights=zero_w)
    gen = torch.Generator(device="cuda").manual_seed(T)
    d_out = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    config = mok.MoKConfig(backend="megakernel")
    out, got = _grads("kernel", leaves, idx, d_out, config)
    out_k, want = _grads("kernel", leaves, idx, d_out, mok.MoKConfig(backend="kernel"))
    assert torch.equal(out, out_k), f"{name}: the megakernel's training forward differs"
    for label, a, b in zip(NAMES, got, want):
        if a is None and b is None:
            continue
        assert torch.equal(a, b), f"{name}: {label}"
    _, ref = _grads("reference", leaves, idx, d_out)
    for label, a, b in zip(NAMES, got, ref):
        if a is not None:
            _close(a.float() if label == "d_topk_weights" else a,
                   b.float() if label == "d_topk_weights" else b, label)
    _assert_repeats_bitwise(leaves, idx, d_out, out, got, config)


@pytest.mark.gpu
def test_a_failed_backward_launch_is_raised_not_silent():
    """A launch whose wait gave up (its error word set, as ``wait_counter`` sets it) is raised
    as PeerTimeoutError by ``mok.check_errors()`` (or the next call), once."""
    import mok_cute as mok
    from mok_cute import megakernel_backward as mb
    from mok_cute.constants import WAIT_TIMEOUT
    from mok_cute.errors import error_word
    from mok_cute.kernels import token_ops

    (x, w, wg, wu, wd), idx, saved, _ = _saved_problem("K10")
    d_rows = token_ops.gather_rows(torch.randn_like(x), saved.row_token(idx.shape[1]))
    args = (d_rows, wg, wu, wd, saved.preact, saved.row_slot, w.float().contiguous().view(-1),
            saved.tile_expert, saved.num_tiles)
    mb._TABLES.clear()  # this test's launches alone use the one table made below
    mb.expert_dgrads(*args)
    mok.check_errors()  # nothing failed
    (tables,) = mb._TABLES.values()
    tables.error.fill_(error_word(5, 0, 0, WAIT_TIMEOUT))  # a wait of the next launch gave up
    mb.expert_dgrads(*args)
    # (the launch's own waits that miss then give up at once and may name a later task)
    with pytest.raises(mok.PeerTimeoutError, match="backward megakernel call 2: .* timed out "
                       "waiting for peer 0.*gradients of that call are incomplete"):
        mok.check_errors()
    mok.check_errors()  # reported once
    mb.expert_dgrads(*args, check=True)  # and the tables work again
