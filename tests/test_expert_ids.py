"""Out-of-range expert ids (issue 30, item 4): int64 ids >= 2**31 are never truncated, and with
``check_ids=False`` an out-of-range id matches no expert and its (token, k) slot adds exactly
zero on every path (reference, CPU schedule build; on the GPU the expert kernels, the
megakernel on one GPU and on virtual ranks): the output equals the output with those slots'
weights zeroed. With ``check_ids=True`` every path raises the ValueError naming topk_idx."""

from __future__ import annotations

import pytest
import torch

import mok_cute as mok
from mok_cute import reference as ref
from mok_cute.config import MoKConfig, ids_for_int32
from mok_cute.schedule import build_receive_schedule, row_of_slot

UNCHECKED = MoKConfig(check_ids=False)
# E = 8 below: ids that wrap onto a valid expert when narrowed to int32 (2**32 + 1 -> 1,
# 2**33 + 6 -> 6), negative, one past the end, and 2**31 (-2**31 as int32)
BAD_IDS = (2**32 + 1, -1, 8, 2**31, 2**33 + 6, -(2**40))


def _problem(T=16, H=64, I=64, E=8, K=4, Is=0, R=None, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    lead = () if R is None else (R,)
    E_loc = E if R is None else E // R
    bf = lambda *s: (torch.randn(*s, generator=gen) * s[-1] ** -0.5).bfloat16().to(device)  # noqa: E731
    x = bf(*lead, T, H)
    idx = torch.rand(*lead, T, E, generator=gen).topk(K, dim=-1).indices.to(device)
    w = (torch.rand(*lead, T, K, generator=gen) + 0.05).to(device)
    weights = [bf(*lead, E_loc, I, H), bf(*lead, E_loc, I, H), bf(*lead, E_loc, H, I)]
    shared = (bf(*lead, Is, H), bf(*lead, Is, H), bf(*lead, H, Is)) if Is else None
    return x, idx, w, weights, shared


def _corrupt(idx, w):
    """idx with BAD_IDS in some slots (spread over tokens and k), and w with those slots 0."""
    bad, zeroed = idx.clone(), w.clone()
    flat_bad, flat_zeroed = bad.view(-1, bad.shape[-1]), zeroed.view(-1, zeroed.shape[-1])
    for i, value in enumerate(BAD_IDS):
        t, k = (3 * i + 1) % flat_bad.shape[0], i % flat_bad.shape[1]
        flat_bad[t, k] = value
        flat_zeroed[t, k] = 0.0
    return bad, zeroed


# ------------------------------------------------------------------------------ CPU


def test_ids_for_int32_clamps_before_narrowing():
    ids = torch.tensor([0, 7, 8, -1, 2**31, 2**32 + 1, -(2**40)])
    assert ids_for_int32(ids, 8).tolist() == [0, 7, 8, -1, 8, 8, -1]
    assert ids_for_int32(ids, 8).dtype == torch.int32
    i32 = torch.tensor([3, 9, -4], dtype=torch.int32)
    assert ids_for_int32(i32, 8) is i32


@pytest.mark.parametrize("Is", [0, 64])
def test_reference_unchecked_bad_ids_add_zero(Is):
    x, idx, w, weights, shared = _problem(Is=Is, seed=1)
    bad, zeroed = _corrupt(idx, w)
    want = ref.moe_forward(x, idx, zeroed, *weights, shared=shared)
    assert torch.equal(ref.moe_forward(x, bad, w, *weights, shared=shared, config=UNCHECKED), want)
    assert torch.equal(mok.moe_forward(x, bad, w, *weights, shared=shared, config=UNCHECKED), want)
    # a NaN weight on such a slot is dropped too
    nan_w = w.clone()
    nan_w[bad.lt(0) | bad.ge(8)] = float("nan")
    assert torch.equal(mok.moe_forward(x, bad, nan_w, *weights, shared=shared, config=UNCHECKED), want)


def test_reference_unchecked_bad_ids_add_zero_on_virtual_ranks():
    x, idx, w, weights, _ = _problem(R=2, seed=2)
    bad, zeroed = _corrupt(idx, w)
    want = ref.moe_forward_virtual(x, idx, zeroed, *weights)
    assert torch.equal(ref.moe_forward_virtual(x, bad, w, *weights, config=UNCHECKED), want)
    assert torch.equal(mok.moe_forward_virtual(x, bad, w, *weights, config=UNCHECKED), want)


def test_reference_unchecked_all_ids_bad():
    x, idx, w, weights, shared = _problem(Is=64, seed=3)
    bad = torch.full_like(idx, 2**32 + 1)
    want = ref.moe_forward(x, idx, torch.zeros_like(w), *weights, shared=shared)
    assert torch.equal(mok.moe_forward(x, bad, w, *weights, shared=shared, config=UNCHECKED), want)


def test_checked_int64_ids_beyond_int32_raise_naming_topk_idx():
    x, idx, w, weights, _ = _problem(seed=4)
    for value in (2**31, 2**32 + 1, -(2**40)):
        bad = idx.clone()
        bad[5, 2] = value
        match = rf"topk_idx: expected global expert ids in \[0, 8\), got id {value}"
        with pytest.raises(ValueError, match=match):
            mok.moe_forward(x, bad, w, *weights)
        with pytest.raises(ValueError, match=match):
            ref.moe_forward(x, bad, w, *weights)
    xs, idx, w, weights, _ = _problem(R=2, seed=5)
    bad = idx.clone()
    bad[1, 0, 0] = 2**32 + 1
    with pytest.raises(ValueError, match=r"topk_idx: expected global expert ids in \[0, 8\), got id 4294967297"):
        mok.moe_forward_virtual(xs, bad, w, *weights)


@pytest.mark.parametrize("R", [1, 2])
def test_cpu_schedule_build_gives_bad_ids_no_row(R):
    """The torch build (R = 1 and R > 1): int64 ids >= 2**31 and negative ids are 'no expert'
    like -1, exactly: the schedule equals the one of the ids with -1 in those slots."""
    _, idx, w, _, _ = _problem(T=40, R=R, seed=6)
    bad, _ = _corrupt(idx, w)
    minus1 = torch.where((bad >= 0) & (bad < 8), bad, torch.full_like(bad, -1))
    for rank in range(R):
        got = build_receive_schedule(bad, rank, 8 // R, validate=False, gpu_build=False)
        want = build_receive_schedule(minus1, rank, 8 // R, validate=False, gpu_build=False)
        for field in ("row_peer", "row_token", "row_k", "expert_counts", "expert_offsets",
                      "tile_expert", "num_tiles"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        for peer in range(R):  # no rank gave any of them a row
            rows = row_of_slot(got, 40, 4, peer=peer).view(40, 4)
            assert (rows[(bad[peer] < 0) | (bad[peer] >= 8)] == -1).all()


# ------------------------------------------------------------------------------ GPU


def _cuda_problem(**kw):
    return _problem(device="cuda", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kernel", "megakernel"])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_gpu_unchecked_bad_ids_add_zero(backend, id_dtype):
    x, idx, w, weights, shared = _cuda_problem(T=77, H=256, I=128, Is=128, seed=7)
    bad, zeroed = _corrupt(idx, w)
    if id_dtype == torch.int32:  # int32 ids cannot hold the big ones: the small bad ids only
        bad = torch.where(bad.abs() < 2**31, bad, torch.full_like(bad, -1)).to(torch.int32)
    config = MoKConfig(backend=backend, check_ids=False)
    # a slot routed nowhere adds zero whatever its weight, as in the reference
    w_bad = torch.where(bad == idx, w, torch.full_like(w, float("nan")))
    with torch.no_grad():
        out = mok.moe_forward(x, bad, w, *weights, shared=shared, config=config)
        out_nan_weights = mok.moe_forward(x, bad, w_bad, *weights, shared=shared, config=config)
        want = mok.moe_forward(x, idx, zeroed, *weights, shared=shared, config=MoKConfig(backend=backend))
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(out_nan_weights, want)


@pytest.mark.gpu
def test_gpu_virtual_megakernel_unchecked_bad_ids_add_zero():
    xs, idx, w, weights, shared = _cuda_problem(T=64, H=256, I=128, R=2, Is=128, seed=8)
    bad, zeroed = _corrupt(idx, w)
    with torch.no_grad():
        out = mok.moe_forward_virtual(xs, bad, w, *weights, shared=shared, config=UNCHECKED)
        want = mok.moe_forward_virtual(xs, idx, zeroed, *weights, shared=shared)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kernel", "megakernel", "virtual"])
def test_gpu_checked_int64_ids_beyond_int32_raise(backend):
    R = 2 if backend == "virtual" else None
    x, idx, w, weights, _ = _cuda_problem(T=64, H=256, I=128, R=R, seed=9)
    for value in (2**31, 2**32 + 1):
        bad = idx.clone()
        bad.view(-1)[11] = value
        with pytest.raises(ValueError, match=rf"topk_idx: expected global expert ids in \[0, 8\), got id {value}"):
            if backend == "virtual":
                mok.moe_forward_virtual(x, bad, w, *weights)
            else:
                mok.moe_forward(x, bad, w, *weights, config=MoKConfig(backend=backend))
        torch.cuda.synchronize()
