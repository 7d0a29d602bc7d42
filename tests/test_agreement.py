"""The ranks of a group agree before they launch (issue 30, item 3; mok_cute/comm/agreement.py).

CPU processes in a gloo group (tests/gloo_group.py): matching calls pass, many consecutive
calls with a different T per rank (0 included) give every rank its single-process reference
output, every kind of mismatch raises the same message on every rank naming the rank, a rank
that never calls makes its peers raise naming it within the timeout, the IPC megakernel's
flow (padding to the group's T, the id verdict after the launch) with a stand-in for the
kernel, the all_gather transport, and the exchange's cost.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

import mok_cute as mok
from mok_cute import reference as ref
from mok_cute.comm import AgreementTimeout
from mok_cute.comm import agreement

import gloo_group

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)


def _problem(R, tokens, H=32, I=16, E_loc=2, K=2, Is=0, seed=0):
    """The same global problem on every rank: per-rank x, ids, weights; stacked expert weights."""
    gen = torch.Generator().manual_seed(seed)
    E = R * E_loc
    xs = [(torch.randn(T, H, generator=gen) * 0.5).bfloat16() for T in tokens]
    idx = [torch.rand(T, E, generator=gen).topk(K, dim=-1).indices for T in tokens]
    wts = [torch.rand(T, K, generator=gen) + 0.05 for T in tokens]
    bf = lambda *s: (torch.randn(*s, generator=gen) * s[-1] ** -0.5).bfloat16()  # noqa: E731
    weights = (bf(R, E_loc, I, H), bf(R, E_loc, I, H), bf(R, E_loc, H, I))
    shared = (bf(Is, H), bf(Is, H), bf(H, Is)) if Is else None
    return xs, idx, wts, weights, shared


def _global(weights):
    return tuple(w.reshape(-1, *w.shape[2:]) for w in weights)


def _same_error_everywhere(fn, exc_type=Exception):
    """Run fn, which must raise; return the message after checking every rank raised the same."""
    with pytest.raises(exc_type) as info:
        fn()
    text = str(info.value)
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    assert all(t == texts[0] for t in texts), texts
    return text


# ------------------------------------------------------------------------------ matching calls


def _check_varying_tokens(rank, world):
    """Many consecutive calls, T different per rank and per call (0 included), with and without
    the shared expert: every rank gets its single-process reference, bitwise."""
    for call in range(12):
        tokens = [(5 * call + 3 * r) % 9 for r in range(world)]  # zeros on some ranks
        if call == 11:
            tokens = [0] * world  # nobody has tokens: still one agreed call
        Is = 16 if call % 2 else 0
        xs, idx, wts, weights, shared = _problem(world, tokens, Is=Is, seed=call)
        mine = tuple(w[rank] for w in weights)
        out = mok.moe_forward(xs[rank], idx[rank], wts[rank], *mine, shared=shared, group=dist.group.WORLD)
        want = ref.moe_forward(xs[rank], idx[rank], wts[rank], *_global(weights), shared=shared)
        assert out.shape == (tokens[rank], 32) and torch.equal(out, want), (rank, call)


def test_calls_with_different_tokens_per_rank_agree_and_match_the_reference(tmp_path):
    gloo_group.spawn(_check_varying_tokens, 3, tmp_path)


# ------------------------------------------------------------------------------ mismatches


def _call(rank, world, **change):
    """One moe_forward over the group; ``change`` (applied on rank 1 only) edits the inputs."""
    xs, idx, wts, weights, shared = _problem(world, [6] * world, Is=16, seed=3)
    args = dict(x=xs[rank], topk_idx=idx[rank], topk_weights=wts[rank], w_gate=weights[0][rank],
                w_up=weights[1][rank], w_down=weights[2][rank], shared=shared, config=None)
    if rank == 1:
        for name, edit in change.items():
            args[name] = edit(args[name])
    return lambda: mok.moe_forward(**args, group=dist.group.WORLD)


def _bad_id(value):
    def edit(idx):
        idx = idx.clone()
        idx[2, 1] = value
        return idx
    return edit


MISMATCHES = [
    # (what rank 1 changes, expected type, message)
    (dict(x=lambda x: x[:, :16].contiguous(), w_gate=lambda w: w[..., :16].contiguous(),
          w_up=lambda w: w[..., :16].contiguous(), w_down=lambda w: w[:, :16].contiguous(),
          shared=lambda s: (s[0][:, :16].contiguous(), s[1][:, :16].contiguous(), s[2][:16].contiguous())),
     ValueError, "moe_forward(group=...): the ranks disagree on H (x.shape[1]): rank 1 has 16; ranks 0, 2 have 32"),
    (dict(w_gate=lambda w: w[:, :8].contiguous(), w_up=lambda w: w[:, :8].contiguous(),
          w_down=lambda w: w[..., :8].contiguous()),
     ValueError, "the ranks disagree on I (w_gate.shape[1]): rank 1 has 8; ranks 0, 2 have 16"),
    (dict(w_gate=lambda w: w[:1].contiguous(), w_up=lambda w: w[:1].contiguous(),
          w_down=lambda w: w[:1].contiguous(), topk_idx=lambda i: i % 3),
     ValueError, "the ranks disagree on E_loc (w_gate.shape[0]): rank 1 has 1; ranks 0, 2 have 2"),
    (dict(topk_idx=lambda i: i[:, :1].contiguous(), topk_weights=lambda w: w[:, :1].contiguous()),
     ValueError, "the ranks disagree on K (topk_idx.shape[1]): rank 1 has 1; ranks 0, 2 have 2"),
    (dict(shared=lambda s: None),
     ValueError, "the ranks disagree on Is (the shared expert's intermediate size, 0 without one): "
                 "rank 1 has 0; ranks 0, 2 have 16"),
    (dict(topk_weights=lambda w: w.bfloat16()),
     ValueError, "the ranks disagree on topk_weights.dtype: rank 1 has torch.bfloat16; ranks 0, 2 have torch.float32"),
    (dict(topk_idx=lambda i: i.int()),
     ValueError, "the ranks disagree on topk_idx.dtype: rank 1 has torch.int32; ranks 0, 2 have torch.int64"),
    (dict(config=lambda c: mok.MoKConfig(check_ids=False)),
     ValueError, "the ranks disagree on MoKConfig.check_ids: rank 1 has one value; ranks 0, 2 another"),
    (dict(config=lambda c: mok.MoKConfig(backend="reference")),
     ValueError, "the ranks disagree on MoKConfig.backend"),
    (dict(x=lambda x: x.clone().requires_grad_(True)),
     ValueError, "the ranks disagree on the path (each rank picks it from its own device and "
                 "install, and trains when an input requires grad: mok_cute.forward_path()): rank 1 "
                 "has reference (training); ranks 0, 2 have reference"),
    (dict(topk_idx=_bad_id(6)),
     ValueError, "topk_idx: expected global expert ids in [0, 6), got id 6 on rank 1 (its ids span [0, 6])"),
    (dict(topk_idx=_bad_id(-1)),
     ValueError, "topk_idx: expected global expert ids in [0, 6), got id -1 on rank 1 (its ids span [-1, 5])"),
    (dict(topk_idx=_bad_id(2**32 + 1)),
     ValueError, f"got id {2**32 + 1} on rank 1"),
]


def _check_mismatches(rank, world):
    for change, exc_type, message in MISMATCHES:
        text = _same_error_everywhere(_call(rank, world, **change), exc_type)
        assert message in text, (text, message)
    # a rank whose own checks fail raises its own error; its peers hear of it instead of
    # waiting in all_to_all
    bad_dtype = dict(x=lambda x: x.half())
    if rank == 1:
        with pytest.raises(TypeError, match=r"x: expected dtype torch.bfloat16, got torch.float16"):
            _call(rank, world, **bad_dtype)()
    else:
        with pytest.raises(RuntimeError, match=r"moe_forward\(group=...\): rank 1 rejected the call "
                                               r"\(rank 1: TypeError: x: expected dtype torch.bfloat16"):
            _call(rank, world, **bad_dtype)()
    # the path: a rank that cannot run the megakernel rejects, the others are told
    if rank == 1:
        with pytest.raises(RuntimeError, match="config.backend is 'megakernel' but it cannot run on cpu"):
            _call(rank, world, config=lambda c: mok.MoKConfig(backend="megakernel"))()
    else:
        with pytest.raises(RuntimeError, match="rank 1 rejected the call .*cannot run on cpu"):
            _call(rank, world, config=lambda c: mok.MoKConfig(backend="megakernel"))()
    # FP8 over a group runs on the IPC megakernel only: every rank raises the same refusal
    xs, idx, wts, weights, _ = _problem(world, [4] * world, seed=5)
    text = _same_error_everywhere(lambda: mok.moe_forward(
        xs[rank], idx[rank], wts[rank], *(w[rank] for w in weights), group=dist.group.WORLD,
        config=mok.MoKConfig(precision="fp8")), ValueError)
    assert "config.precision='fp8'" in text and "IPC megakernel only" in text
    # still in step: a matching call passes, and the reference's own group form agrees too
    _call(rank, world)()
    xs, idx, wts, weights, _ = _problem(world, [4] * world, seed=4)
    if rank == 2:
        idx[rank][0, 0] = 99
    text = _same_error_everywhere(lambda: ref.moe_forward(
        xs[rank], idx[rank], wts[rank], *(w[rank] for w in weights), group=dist.group.WORLD), ValueError)
    assert "got id 99 on rank 2" in text


def test_each_mismatch_raises_the_same_error_on_every_rank(tmp_path):
    gloo_group.spawn(_check_mismatches, 3, tmp_path)


# ------------------------------------------------------------------------------ a silent peer


def _check_silent_peer(rank, world):
    config = mok.MoKConfig(group_timeout_s=1.0)
    xs, idx, wts, weights, _ = _problem(world, [5] * world, seed=6)
    call = lambda: mok.moe_forward(xs[rank], idx[rank], wts[rank],  # noqa: E731
                                   *(w[rank] for w in weights), group=dist.group.WORLD, config=config)
    call()  # the group's first call sets the exchange up
    if rank == 1:
        dist.barrier()  # rank 1 skips a call: rank 0 gives up waiting for it
        with pytest.raises(AgreementTimeout, match=r"rank 0 gave up waiting for its peers at exchange 2"):
            call()  # rank 1's late call: it raises too instead of running alone
    else:
        start = time.monotonic()
        with pytest.raises(AgreementTimeout, match=r"rank 1 did not reach exchange 2 of this group "
                                                   r"within 1 s \(rank 1 is at exchange 1\)"):
            call()
        assert time.monotonic() - start < 10
        dist.barrier()
    call()  # both at exchange 3: in step again


def test_a_rank_that_never_calls_makes_its_peers_raise_naming_it(tmp_path):
    gloo_group.spawn(_check_silent_peer, 2, tmp_path)


# ------------------------------------------------------------------------------ megakernel flow


def _check_megakernel_flow(rank, world):
    """The IPC megakernel's host flow with the kernel replaced by the reference over the group:
    each rank pads to the group's T (the stand-in checks it), ids reach the launch as int32
    with out-of-range int64 ids clamped to ids of no expert, each rank gets its first T rows,
    and a bad id on one rank raises on every rank after the launch (the id verdict)."""
    from mok_cute import api, megakernel
    from mok_cute.sim import tune

    launched = []

    def stand_in(x, ids, w, wg, wu, wd, shared, config, group=None):
        launched.append(x.shape[0])
        assert ids.dtype == torch.int32 and group is dist.group.WORLD
        return ref._forward(x, ids, w, wg, wu, wd, shared, group)

    api._kernel_status = lambda device: (True, "a stand-in")
    api._megakernel_fallback = lambda dims, config: False
    tune.tuned_config = lambda config, *shape: config
    megakernel.moe_forward = stand_in
    for check_ids in (True, False):
        config = mok.MoKConfig(backend="megakernel", check_ids=check_ids)
        for call, tokens in enumerate(([3, 0], [0, 7], [4, 4], [0, 0])):
            xs, idx, wts, weights, shared = _problem(world, tokens, Is=16, seed=10 + call)
            mine = tuple(w[rank] for w in weights)
            out = mok.moe_forward(xs[rank], idx[rank], wts[rank], *mine, shared=shared,
                                  group=dist.group.WORLD, config=config)
            want = ref.moe_forward(xs[rank], idx[rank], wts[rank], *_global(weights), shared=shared)
            assert out.shape == (tokens[rank], 32) and torch.equal(out, want), (rank, tokens)
            if max(tokens):
                assert launched.pop() == megakernel.plan_tokens(max(tokens)) == 128
        assert not launched  # T = 0 everywhere: no launch on any rank
    xs, idx, wts, weights, _ = _problem(world, [6] * world, seed=20)
    mine = tuple(w[rank] for w in weights)
    bad = idx[rank].clone()
    if rank == 0:
        bad[1, 0], bad[4, 1] = 2**32 + 1, -(2**40)
    text = _same_error_everywhere(lambda: mok.moe_forward(
        xs[rank], bad, wts[rank], *mine, group=dist.group.WORLD, config=mok.MoKConfig(backend="megakernel")),
        ValueError)
    assert f"got id {-(2**40)} on rank 0 (its ids span [{-(2**40)}, {2**32 + 1}])" in text
    # unchecked: those slots add nothing, like zero weights
    out = mok.moe_forward(xs[rank], bad, wts[rank], *mine, group=dist.group.WORLD,
                          config=mok.MoKConfig(backend="megakernel", check_ids=False))
    zeroed = wts[rank].clone()
    if rank == 0:
        zeroed[1, 0] = zeroed[4, 1] = 0.0
    assert torch.equal(out, ref.moe_forward(xs[rank], idx[rank], zeroed, *_global(weights)))


    # no token on any rank, training: no launch, but the output stays in the graph, so every
    # trained input gets its (zero) gradient, as a data-parallel reducer waits for
    xs, idx, wts, weights, _ = _problem(world, [0] * world, seed=21)
    trained = [w[rank].clone().requires_grad_(True) for w in weights]
    out = mok.moe_forward(xs[rank], idx[rank], wts[rank], *trained, group=dist.group.WORLD,
                          config=mok.MoKConfig(backend="megakernel"))
    assert out.shape == (0, 32) and out.requires_grad
    out.float().sum().backward()
    assert all(w.grad is not None and not w.grad.any() for w in trained)


def test_megakernel_flow_pads_to_the_group_tokens_and_agrees_on_ids(tmp_path):
    gloo_group.spawn(_check_megakernel_flow, 2, tmp_path)


# ------------------------------------------------------------------------------ before a collective


def _check_failure_before_collective(rank, world):
    """A rank that raises between a call's agreement and the collective after it makes every
    rank raise (its own error there, a RuntimeError naming it on the peers) instead of leaving
    the peers in the collective until gloo's timeout; the exchanges stay in step after it,
    nested stretches tell once, and a failure after the last gate exchanges nothing."""
    group = dist.group.WORLD

    def call(fail_rank, nested=False):
        with agreement.until_collective(group, 20.0):
            with (agreement.until_collective(group, 20.0) if nested else contextlib.nullcontext()):
                if rank == fail_rank:
                    raise ValueError(f"no room on rank {rank} (stand-in)")
            agreement.ready_for_collective(group, last=True)
            dist.all_gather_object([None] * world, rank, group=group)

    for fail_rank, nested in ((1, False), (0, True), (1, True)):
        with pytest.raises((ValueError, RuntimeError)) as info:
            call(fail_rank, nested)
        if rank == fail_rank:
            assert info.type is ValueError
        else:
            assert info.type is RuntimeError
            assert f"rank {fail_rank} failed before a collective (rank {fail_rank}: ValueError: " \
                   f"no room on rank {fail_rank} (stand-in))" in str(info.value)
        call(-1)  # the next call meets as usual: the exchanges are in step
    # past the last gate a failure is the launch's business: nothing exchanged
    with pytest.raises(KeyError) if rank == 1 else contextlib.nullcontext():
        with agreement.until_collective(group, 20.0):
            agreement.ready_for_collective(group, last=True)
            dist.barrier()
            if rank == 1:
                raise KeyError("after")
    call(-1)


def test_a_rank_failing_before_a_collective_makes_every_rank_raise(tmp_path):
    gloo_group.spawn(_check_failure_before_collective, 3, tmp_path)


def _check_ipc_launch_failure(rank, world):
    """The IPC megakernel's host flow: one rank's plan fails (out of memory, say) while the
    peer's goes on to the routing's all_gather (the real `_IpcSide.schedules` on gloo): every
    rank raises, with and without the id check, and later calls go on in step. The group
    backward's first-build alignment likewise: a rank failing between its two barrier
    launches' all_reduces."""
    import threading
    import types

    from mok_cute import api, group_backward, megakernel
    from mok_cute.sim import tune

    group = dist.group.WORLD
    side = megakernel._IpcSide.__new__(megakernel._IpcSide)
    side.group, side.num_peers, side.local_experts, side.rank_base = group, world, 2, rank
    class Key:  # hashable, as a PlanKey
        spec = types.SimpleNamespace(fp8=False)

    plan = types.SimpleNamespace(key=Key(), lock=threading.Lock(), side=side, calls=0)

    def run(xs, ids, wts, wg, wu, wd, shared, timeout_ms, fp8_weights=None,
            saved_rows_factor=None, saved_rows_pool=None):
        side.schedules(ids)  # the gate, then the all_gather
        return ref._forward(xs[0], ids[0], wts[0], wg[0], wu[0], wd[0], None, group)[None]

    fail = {"rank": -1}

    def plan_for(*args, **kwargs):
        if rank == fail["rank"]:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return plan

    plan.run = run
    api._kernel_status = lambda device: (True, "a stand-in")
    api._megakernel_fallback = lambda dims, config: False
    tune.tuned_config = lambda config, *shape: config
    megakernel.plan_for = plan_for
    xs, idx, wts, weights, _ = _problem(world, [5] * world, seed=30)
    mine = tuple(w[rank] for w in weights)
    want = ref.moe_forward(xs[rank], idx[rank], wts[rank], *_global(weights))
    for check_ids in (True, False):
        config = mok.MoKConfig(backend="megakernel", check_ids=check_ids)

        def call():
            return mok.moe_forward(xs[rank], idx[rank], wts[rank], *mine, group=group,
                                   config=config)

        fail["rank"] = 1
        with pytest.raises((torch.OutOfMemoryError, RuntimeError)) as info:
            call()
        assert (info.type is torch.OutOfMemoryError) == (rank == 1)
        assert "CUDA out of memory (stand-in)" in str(info.value)
        fail["rank"] = -1
        assert torch.equal(call(), want)

    bwd_plan = types.SimpleNamespace(side=side, aligned_builds=set(),
                                     peer_bases=torch.zeros(1, world, dtype=torch.int64))
    align = group_backward._first_build_alignment(bwd_plan, ("bf16",), launches=2)
    with pytest.raises((ValueError, RuntimeError)) as info:
        with agreement.until_collective(group, 20.0):
            align()
            if rank == 0:
                raise ValueError("an FP8 dgrad failed to compile (stand-in)")
            align()
    assert (info.type is ValueError) == (rank == 0)
    # that first call failed before its last alignment: the next call aligns, on every rank
    again = group_backward._first_build_alignment(bwd_plan, ("bf16",), launches=1)
    with agreement.until_collective(group, 20.0):
        again()
    assert group_backward._first_build_alignment(bwd_plan, ("bf16",), launches=1) is None


def test_a_rank_failing_before_the_ipc_launch_makes_every_rank_raise(tmp_path):
    gloo_group.spawn(_check_ipc_launch_failure, 2, tmp_path)


# ------------------------------------------------------------------------------ transports, cost


def _check_all_gather_transport(rank, world):
    shm = agreement.agreement_for(dist.group.WORLD)
    assert shm.transport == "shared memory"
    slow = agreement.GroupAgreement(dist.group.WORLD, shared_memory=False)
    assert slow.transport == "all_gather"
    for n in range(3):
        rows = slow.exchange(bytes([rank, n]), 5.0)
        assert [row[:2] for row in rows] == [bytes([r, n]) for r in range(world)]


def test_the_all_gather_transport(tmp_path):
    gloo_group.spawn(_check_all_gather_transport, 3, tmp_path)


def _time_exchanges(rank, world, out_dir):
    """Median µs of 3000 back-to-back exchanges, and of 3000 whole agreements (packing the
    header, the exchange, the comparison)."""
    from mok_cute.config import MoKConfig, check_moe_inputs

    group = agreement.agreement_for(dist.group.WORLD)
    xs, idx, wts, weights, _ = _problem(world, [4] * world, seed=7)
    dims = check_moe_inputs(xs[rank], idx[rank], wts[rank], *(w[rank] for w in weights), num_ranks=world)
    header = agreement.call_header(dims, xs[rank], idx[rank], wts[rank], weights[0][rank],
                                   "megakernel", MoKConfig(), None)
    medians = []
    for fn in (lambda: group.exchange(b"x" * 64, 5.0),
               lambda: agreement.agree_on_call(dist.group.WORLD, header, 5.0)):
        for _ in range(200):
            fn()
        dist.barrier()
        times = []
        for _ in range(3000):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        medians.append(sorted(times)[len(times) // 2] * 1e6)
    if rank == 0:
        (out_dir / "cost.txt").write_text(" ".join(f"{m:.1f}" for m in medians))


def test_exchange_cost(tmp_path, capsys):
    gloo_group.spawn(_time_exchanges, 2, tmp_path, tmp_path)
    bare, full = map(float, (tmp_path / "cost.txt").read_text().split())
    with capsys.disabled():
        print(f"\nagreement between 2 CPU processes (medians): {bare:.1f} µs an exchange, "
              f"{full:.1f} µs an agree_on_call")
    assert full < 500  # a loose bound for shared CI machines; ~7 µs measured on an idle one


def test_no_group_exchanges_nothing(monkeypatch):
    def no_exchange(*args, **kwargs):
        raise AssertionError("a call without a group must not exchange anything")

    monkeypatch.setattr(agreement, "agreement_for", no_exchange)
    xs, idx, wts, weights, _ = _problem(1, [5], seed=8)
    out = mok.moe_forward(xs[0], idx[0], wts[0], *(w[0] for w in weights))
    assert torch.equal(out, ref.moe_forward(xs[0], idx[0], wts[0], *(w[0] for w in weights)))


def test_plan_tokens_bounds_the_plans_of_variable_length_batches():
    """Eight plan sizes per doubling of T, at least 128 rows, at most 12.5 % padding above
    1024 tokens; the named shapes' T are plan sizes themselves."""
    from mok_cute.megakernel import plan_tokens

    assert plan_tokens(0) == 0 and plan_tokens(1) == plan_tokens(128) == 128
    for t in (1024, 2048, 4096, 8192, 16384, 32768, 6144, 12288):
        assert plan_tokens(t) == t
    sizes = {plan_tokens(t) for t in range(4097, 8193)}  # one doubling: 4608, 5120, ..., 8192
    assert len(sizes) == 8 and min(sizes) == 4608 and max(sizes) == 8192
    for t in range(1024, 40000, 37):
        assert t <= plan_tokens(t) <= t * 1.125


def test_a_group_plan_that_a_failed_call_built_is_dropped(monkeypatch):
    """``megakernel.moe_forward(group=...)``: a call that raised after building its plan (on
    every rank: one rank's build failed, so it has none) drops it, so no rank keeps a plan its
    peers lack (the next call's setup collective would meet a peer's routing all_gather)."""
    import types

    from mok_cute import megakernel

    group = object()
    plan = types.SimpleNamespace(key="k", calls=0, lock=contextlib.nullcontext(),
                                 side=None)

    def plan_for(*args, **kwargs):
        megakernel._PLANS.put("k", plan)
        return plan

    def run(*args, **kwargs):
        raise RuntimeError("rank 1 failed before a collective (stand-in)")

    plan.run = run
    monkeypatch.setattr(megakernel, "plan_for", plan_for)
    monkeypatch.setattr(megakernel, "fp8_weights_of", lambda *args, **kwargs: None)
    monkeypatch.setattr(agreement, "until_collective", lambda g, t: contextlib.nullcontext())
    x = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="stand-in"):
        megakernel.moe_forward(x, torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2),
                               x.new_zeros(2, 8, 8), x.new_zeros(2, 8, 8), x.new_zeros(2, 8, 8),
                               group=group)
    assert "k" not in megakernel._PLANS
    plan.calls = 1  # a plan that ran before stays
    with pytest.raises(RuntimeError, match="stand-in"):
        megakernel.moe_forward(x, torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2),
                               x.new_zeros(2, 8, 8), x.new_zeros(2, 8, 8), x.new_zeros(2, 8, 8),
                               group=group)
    assert megakernel._PLANS.get("k") is plan
    megakernel._PLANS.pop("k")
