"""The backward over a group (mok_cute/group_backward.py): the comm of the backward through the
plan's symmetric buffers (kernels/peer_rows.py: row copies by address, the unicast barrier).

CPU: bad input is refused naming the argument; both kernels compile for sm_90a (the
compile-only checks of test_jit cover every registered kernel).

H200 (marked gpu):
- on virtual ranks' buffers (one process; the same comm as IPC at gpu scope): every gradient
  bitwise equal to the virtual backward (``virtual_backward``: no comm, one launch), which is
  itself checked against autograd on the reference; with the fields, the combine buffer and the
  partials poisoned (NaN) before the call, twice (bitwise repeats); skew, an
  empty expert, a rank that receives nothing, the shared expert, K = 10 (R = 2, 3, 4: each R
  compiles its own forward);
- a silent rank in the backward raises PeerTimeoutError naming the backward, the waiting rank
  and the peer; the next call is whole again;
- two processes on one GPU over IPC (legacy handles): each rank's gradients bitwise equal to the
  virtual backward's for that rank;
- FP8 (a plan with ``precision="fp8"``): on virtual buffers bitwise the FP8 virtual backward
  (FP8 weight gradients at I = 1024, bf16 ones with H, I padded), and training over IPC (two
  processes on one GPU) bitwise the FP8 virtual ranks' training.
"""

from __future__ import annotations

import os
import tempfile
import types

import pytest
import torch

import mok_cute as mok
from mok_cute.expert_backward import Needs
from mok_cute.shared_state import StreamOrder

from test_virtual_training import _problem

NAMES = ("d_xs", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down", "d_ws_gate", "d_ws_up",
         "d_ws_down")


# ---------------------------------------------------------------------- bad input (CPU)
def test_a_backward_without_a_saving_launch_is_refused():
    from mok_cute.group_backward import moe_backward_group
    from mok_cute.megakernel import SavedPreact

    t = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="saved: expected the SavedPreact of a saving"):
        moe_backward_group(t, t, t, t, t, t, t, None, SavedPreact(t, t, None))


def test_row_copies_refuse_host_tensors_and_odd_rows():
    from mok_cute.kernels.peer_rows import copy_rows_by_address, peer_barrier

    a = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(TypeError, match="src_addr: expected an int64 CUDA tensor"):
        copy_rows_by_address(a, a, 16)
    with pytest.raises(TypeError, match="src_addr: expected an int64 CUDA tensor"):
        copy_rows_by_address(a.int(), a, 16)
    with pytest.raises(TypeError, match="peer_bases: expected an int64 CUDA tensor"):
        peer_barrier(a.view(2, 2), a, a[:1], 0, "sys")


# ---------------------------------------------------------------------- the plumbing (CPU)
def _cpu_copy_rows(src_addr, dst_addr, row_bytes):
    """``peer_rows.copy_rows_by_address`` on host memory: a memmove per row (source 0: a zero
    row, destination 0: skipped)."""
    import ctypes

    for src, dst in zip(src_addr.tolist(), dst_addr.tolist()):
        if dst:
            if src:
                ctypes.memmove(dst, src, row_bytes)
            else:
                ctypes.memset(dst, 0, row_bytes)


def _cpu_grads_over_peers(w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
                          num_tiles, expert_offsets, peers, wgrads=True, comm_ctas=16,
                          tail=None, shared=None, main_grads=None, timeline=None,
                          before_launch=None, rows_per_expert=None):
    """``megakernel_backward.expert_grads_over_peers`` on host memory: its comm tasks' reads
    and writes by address (``peers.scalars``: the fields' offsets, top_k) around the dgrads
    and weight gradients emulated in torch (several ranks of one process: no group tail);
    the rank's shared expert (``shared``) through ``shared_backward_ranks`` on the
    emulation; nothing recorded (``timeline``: the kernel's)."""
    import ctypes

    assert tail is None and timeline is None and before_launch is None  # no group: no line-up

    from mok_cute.expert_backward import row_partial_sums
    from test_virtual_training import _emulated_dgrads, _emulated_weight_grads

    rows, H = row_slot.shape[0], w_gate.shape[2]
    d_out_off, x_off, weight_off, combine_off, partial_off, K = peers.scalars.tolist()
    d_rows = torch.zeros(rows, H, dtype=torch.bfloat16)
    x_rows = torch.zeros(rows, H, dtype=torch.bfloat16)
    live = range(min(rows, int(num_tiles[0]) * 128))
    f32 = ctypes.c_float
    for p in live:
        peer = int(peers.row_peer[p])
        if peer < 0:
            continue
        base = int(peers.peer_bases[peer])
        token, slot = int(peers.row_token[p]), int(peers.row_token[p]) * K + int(peers.row_k[p])
        ctypes.memmove(d_rows[p].data_ptr(), base + d_out_off + token * H * 2, H * 2)
        ctypes.memmove(x_rows[p].data_ptr(), base + x_off + token * H * 2, H * 2)
        weights[int(row_slot[p])] = f32.from_address(base + weight_off + slot * 16).value
    d_pre, hw, partials, dx_rows = _emulated_dgrads(d_rows, w_gate, w_up, w_down, preact,
                                                    row_slot, weights, tile_expert, num_tiles,
                                                    True, None)
    sums = row_partial_sums(partials)
    for p in live:
        peer = int(peers.row_peer[p])
        if peer < 0:
            continue
        base = int(peers.peer_bases[peer])
        slot = int(peers.row_token[p]) * K + int(peers.row_k[p])
        ctypes.memmove(base + combine_off + slot * H * 2, dx_rows[p].data_ptr(), H * 2)
        f32.from_address(base + partial_off + slot * 16).value = float(sums[p])
    main = main_grads or (None,) * 6
    dw = _emulated_weight_grads(d_pre, hw, d_rows, x_rows, w_gate, w_down, expert_offsets,
                                True, True, main=main[:3]) if wgrads else ()
    if shared is None:
        return (d_rows, x_rows, d_pre, hw, partials, dx_rows, *dw)
    from mok_cute.expert_backward import shared_backward
    from mok_cute.megakernel_backward import SharedGrads

    s_dx, s_dw = shared_backward(shared.d_out, shared.x,
                                 (shared.w_gate, shared.w_up, shared.w_down), shared.preact,
                                 main=main[3:])
    return (d_rows, x_rows, d_pre, hw, partials, dx_rows, *dw, SharedGrads(s_dx, *s_dw))


def _cpu_plan(R, T, H, I, E_loc, K):
    """What ``moe_backward_group`` reads of a plan, over ``VirtualPeers`` in host memory."""
    import threading

    from mok_cute.comm import VirtualPeers, moe_symmetric_layout

    peers = VirtualPeers(R, moe_symmetric_layout(T, H, K, R, training=True), device="cpu")
    for name in ("x", "d_out", "router_weights", "combine", "d_topk_partials"):
        for r in range(R):
            peers.view(r, name).fill_(float("nan"))  # a row read from the wrong place shows
    side = types.SimpleNamespace(launch_ranks=R, num_peers=R, rank_base=0, scope="gpu",
                                 layout=peers.layout, peers=peers,
                                 fields=lambda name: [peers.view(r, name) for r in range(R)])
    key = types.SimpleNamespace(spec=types.SimpleNamespace(save_preact=True, fp8=False),
                                tokens=T, hidden=H,
                                top_k=K, intermediate=I, local_experts=E_loc)
    return types.SimpleNamespace(
        side=side, key=key, peer_bases=peers.bases_matrix(), lock=threading.Lock(),
        order=StreamOrder(),
        scalars=torch.zeros(10, dtype=torch.int64), begin_backward=lambda silent_rank: None,
        backward_calls=0,
        backward_error=torch.zeros(1, dtype=torch.int64),
        backward_errors=types.SimpleNamespace(check=lambda **kw: None, record=lambda call: None))


def _emulated_group_backward(R, T, K, E_loc, Is, routing, monkeypatch, relayout=None):
    """``moe_backward_group`` end to end on the CPU over virtual ranks' buffers in host memory
    (poisoned with NaN), its copies by address as memmoves, its barriers no-ops (one process
    runs every rank's phase before the next), its kernels emulated in torch (the backward
    megakernel's comm tasks by address from the comm scalars) and the forward's saved g | u
    computed in torch. ``relayout(saved) -> saved``: another layout of the saved rows.
    Returns (the gradients, the leaves with autograd's gradients on the reference, the plan)."""
    from mok_cute import expert_backward, group_backward, megakernel_backward, reference
    from mok_cute.kernels import peer_rows, token_ops
    from mok_cute.megakernel import SavedPreact
    from test_virtual_training import (_cpu_problem, _emulated_dgrads, _emulated_expert_backward,
                                       _emulated_saved, _emulated_weight_grads)

    monkeypatch.setattr(expert_backward, "_expert_backward", _emulated_expert_backward)
    monkeypatch.setattr(group_backward, "_dgrads", _emulated_dgrads)
    monkeypatch.setattr(group_backward, "_weight_grads", _emulated_weight_grads)
    monkeypatch.setattr(peer_rows, "copy_rows_by_address", _cpu_copy_rows)
    monkeypatch.setattr(peer_rows, "peer_barrier", lambda *args, **kwargs: None)
    monkeypatch.setattr(megakernel_backward, "expert_grads_over_peers", _cpu_grads_over_peers)

    def weighted_ksum(y, w, shared=None, out=None, row_index=None):
        return token_ops.weighted_ksum_ref(token_ops.gather_rows_ref(y, row_index), w, shared)

    monkeypatch.setattr(token_ops, "weighted_ksum", weighted_ksum)
    H, I = 64, 64
    gen = torch.Generator().manual_seed(R * 100 + K)
    leaves, idx = _cpu_problem(R, T, H, I, E_loc, K, Is, routing, gen)
    d_out = torch.randn(R, T, H, generator=gen).to(torch.bfloat16)
    xs, w, wg, wu, wd, *sh = leaves
    v = _emulated_saved(leaves, idx, E_loc)
    schedules = types.SimpleNamespace(row_peer=v.row_peer, row_token=v.row_token, row_k=v.row_k,
                                      tile_expert=v.tile_expert, num_tiles=v.num_tiles,
                                      expert_offsets=v.expert_offsets)
    plan = _cpu_plan(R, T, H, I, E_loc, K)
    saved = SavedPreact(v.preact, v.row_slot, v.shared_preact if Is else None, schedules, plan)
    if relayout is not None:
        saved = relayout(saved)
    got = group_backward.moe_backward_group(d_out, xs, idx, w, wg, wu, wd, tuple(sh) or None,
                                            saved)
    for t in leaves:
        t.requires_grad_(True)
    reference.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared=tuple(sh) or None).backward(d_out)
    return got, leaves, plan


def _assert_reference_grads(got, leaves):
    from per_token import DX_TOKEN_TOL, assert_tokens_close
    from test_backward import _close

    for name, g, t in zip(NAMES, got, leaves):
        assert g is not None and g.shape == t.shape and g.dtype == t.dtype, name
        _close(g.float(), t.grad.float(), name)
    assert_tokens_close(got[0], leaves[0].grad, tol=DX_TOKEN_TOL, what="d_xs")


@pytest.mark.parametrize("R,T,K,E_loc,Is,routing", [
    (2, 24, 3, 2, 64, "skew"), (3, 30, 3, 2, 64, "silent_rank"), (4, 16, 10, 4, 0, "uniform"),
    (5, 9, 2, 1, 64, "empty_expert"), (2, 300, 2, 3, 0, "skew")])  # the last: experts of 1-3 tiles
def test_group_backward_plumbing_matches_autograd_with_emulated_kernels(R, T, K, E_loc, Is,
                                                                        routing, monkeypatch):
    """Every gradient of the emulated group backward (``_emulated_group_backward``) matches
    autograd on the reference, so every row is pulled from its source's field and each dx row
    and partial reaches its (peer, token, k) slot."""
    got, leaves, _ = _emulated_group_backward(R, T, K, E_loc, Is, routing, monkeypatch)
    _assert_reference_grads(got, leaves)


def _packed(spare: int):
    """A relayout of the saved g | u as ranks of a group keep them with a row budget
    (``MoKConfig.saved_rows_factor``): each rank's routed rows packed in schedule order
    (``saved_rows.packed_saved_slots``) into ``kept`` = the most any rank received + ``spare``
    rows (negative: that many too few for the fullest rank), the ranks' budgets side by side
    in one pool; the count of rows that found no place as the forward leaves it."""
    from mok_cute.saved_rows import packed_saved_slots

    def relayout(saved):
        valid = saved.row_slot >= 0
        kept = int(valid.sum(dim=1).max()) + spare
        pool = torch.full((valid.shape[0] * kept, saved.preact.shape[1]), float("nan"),
                          dtype=saved.preact.dtype)
        slots, missing = [], torch.zeros((), dtype=torch.int64)
        for r in range(valid.shape[0]):
            packed, short = packed_saved_slots(valid[r], kept)
            on = packed >= 0
            pool[packed[on].long() + r * kept] = saved.preact[saved.row_slot[r][on].long()]
            slots.append(torch.where(on, packed + r * kept, packed))
            missing = torch.maximum(missing, short)
        return saved._replace(preact=pool, row_slot=torch.stack(slots), missing=missing)
    return relayout


def test_training_over_a_group_frees_its_saved_rows_once_the_backward_ran(monkeypatch):
    """``autograd.moe_forward_group`` (its launches emulated): the forward's g | u rows (up to
    every peer's T * K rows of 2I a layer) and a ``SavedRowsPool``'s lease on them are saved
    tensors, so autograd frees them once the backward has run while the graph lives on (as the
    one-GPU and virtual paths' are), not with the graph: the pool is free for the next step;
    under ``retain_graph`` a second backward gets them again."""
    import gc
    import weakref

    from mok_cute import autograd as ag, group_backward, megakernel

    gen = torch.Generator().manual_seed(5)
    T, H, I, E, K = 8, 32, 16, 2, 2
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).requires_grad_()
    w = [torch.randn(E, I, H, generator=gen).to(torch.bfloat16) for _ in range(2)]
    wd = torch.randn(E, H, I, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32)
    topk_w = torch.rand(T, K, generator=gen)
    alive, seen = [], []
    pool = mok.SavedRowsPool(T * K * 4 * I, device="cpu")  # one call's rows

    def forward(x, ids, topk_weights, wg, wu, wd, shared, config, group=None, save=False):
        preact, row_slot, missing, lease = pool.take(torch.ones(1, T * K, dtype=torch.bool), I)
        preact.copy_(torch.randn(T * K, 2 * I, generator=gen))
        alive.append(weakref.ref(preact))
        return x * 2, megakernel.SavedPreact(preact, row_slot[0], None, schedules="schedules",
                                             plan="plan", missing=missing, lease=lease)

    def backward_group(d_out1, x1, ids1, w1, wg1, wu1, wd1, shared1, saved, needs, options,
                       **kwargs):
        assert saved.schedules == "schedules" and saved.plan == "plan"
        assert saved.preact.shape == (T * K, 2 * I)
        assert saved.row_slot.shape == (1, T * K)  # the launch's rank dim
        seen.append(saved.preact.float().sum())
        return (2 * d_out1, None, None, None, None, None, None, None)

    monkeypatch.setattr(megakernel, "moe_forward", forward)
    monkeypatch.setattr(group_backward, "moe_backward_group", backward_group)
    config = mok.MoKConfig()
    out = ag.moe_forward_group(x, idx, topk_w, *w, wd, None, config, object())
    gc.collect()
    assert alive[0]() is not None and pool.held_calls == 1  # held for the backward
    out.backward(torch.ones_like(out))
    gc.collect()
    assert alive[0]() is None, "the saved g | u rows outlived the backward"
    assert pool.held_calls == 0, "the pool's rows stayed held after the backward"
    assert out.grad_fn is not None  # while the graph itself lives on
    assert torch.equal(x.grad, torch.full_like(x, 2))

    out = ag.moe_forward_group(x, idx, topk_w, *w, wd, None, config, object())
    out.backward(torch.ones_like(out), retain_graph=True)
    gc.collect()
    assert alive[1]() is not None and pool.held_calls == 1  # retain_graph: kept for the next
    out.backward(torch.ones_like(out))
    assert torch.equal(seen[1], seen[2])  # the same rows, twice
    gc.collect()
    assert alive[1]() is None and pool.held_calls == 0


def test_a_budget_of_saved_rows_keeps_the_gradients_and_a_short_one_is_reported(monkeypatch):
    """Saved rows packed under a budget (``MoKConfig.saved_rows_factor``) that fits: the same
    gradients as autograd, nothing reported. A budget one row short for the fullest rank: the
    backward still runs (every rank joins the collective), and its error word decodes to
    SavedRowsError counting the missing row."""
    from mok_cute.errors import SavedRowsError, raise_on_wait_error

    got, leaves, plan = _emulated_group_backward(2, 40, 3, 2, 64, "skew", monkeypatch,
                                                 relayout=_packed(0))
    _assert_reference_grads(got, leaves)
    assert int(plan.backward_error) == 0
    _, _, plan = _emulated_group_backward(2, 40, 3, 2, 64, "skew", monkeypatch,
                                          relayout=_packed(-1))
    with pytest.raises(SavedRowsError, match=r"call 7: rank 3 received 1 routed row more than "
                                             r"the rows whose g \| u its forward keeps") as err:
        raise_on_wait_error(int(plan.backward_error), call=7, rank_base=3)
    assert (err.value.missing, err.value.rank) == (1, 3)


# ---------------------------------------------------------------------- GPU
def _forward_saved(leaves, idx, config):
    from mok_cute import megakernel

    xs, w, wg, wu, wd, *sh = (t.detach() for t in leaves)
    with torch.no_grad():
        return megakernel.moe_forward_virtual(xs, idx, w, wg, wu, wd, tuple(sh) or None,
                                              config, save=True)


def _virtual_grads(leaves, idx, saved, d_out):
    from mok_cute.virtual_backward import VirtualSaved, moe_backward_virtual

    xs, w, wg, wu, wd, *sh = (t.detach() for t in leaves)
    precision = "fp8" if saved.plan.key.spec.fp8 else "bf16"
    return moe_backward_virtual(d_out, xs, w, wg, wu, wd, tuple(sh) or None,
                                VirtualSaved.from_forward(saved), precision=precision)


def _group_grads(leaves, idx, saved, d_out, **kw):
    from mok_cute.group_backward import moe_backward_group

    xs, w, wg, wu, wd, *sh = (t.detach() for t in leaves)
    return moe_backward_group(d_out, xs, idx, w, wg, wu, wd, tuple(sh) or None, saved, **kw)


def _poison(plan):
    for name in ("x", "d_out", "router_weights", "combine", "d_topk_partials"):
        for field in plan.side.fields(name):
            field.fill_(float("nan"))


def _assert_bitwise(got, want, what):
    for name, g, w in zip(NAMES, got, want):
        assert (g is None) == (w is None), f"{what}: {name}"
        if g is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: {name}"
            assert torch.equal(g.view(torch.int16) if g.dtype == torch.bfloat16 else g,
                               w.view(torch.int16) if w.dtype == torch.bfloat16 else w), \
                f"{what}: {name} differs"


CASES = {
    # name: (R, T, H, I, E_loc, K, Is, routing)
    "R2_shared_skew": (2, 160, 256, 128, 4, 4, 128, "skew"),
    "R3_empty_expert_K10": (3, 100, 320, 192, 4, 10, 0, "empty_expert"),
    "R4_silent_receiver_shared": (4, 96, 256, 128, 4, 2, 64, "silent_rank"),
}


# the backward megakernel's comm tasks: I = 4224 gives 33 dgated partial columns a row (the
# partial sum's register halvings), H = 6208 the cooperative FC2 dgrad form
COMM_CASES = {
    "R2_wide_I": (2, 64, 256, 4224, 2, 2, 0, "skew"),
    "R2_wide_H": (2, 64, 6208, 128, 2, 3, 0, "uniform"),
}


def _saved_problem(name, seed, timeout_ms=5000.0, precision="bf16"):
    """A case's problem, its saving virtual forward and a d_out: (leaves, idx, saved, d_out)."""
    R, T, H, I, E_loc, K, Is, routing = {**CASES, **FP8_CASES, **COMM_CASES}[name]
    leaves, idx = _problem(R, T, H, I, E_loc, K, Is, seed=seed, routing=routing)
    _, saved = _forward_saved(leaves, idx, mok.MoKConfig(timeout_ms=timeout_ms,
                                                         precision=precision))
    return leaves, idx, saved, torch.randn(R, T, H, device="cuda").to(torch.bfloat16)


# FP8 (issue 33): the FP8 dgrads; I = 1024 takes the FP8 weight gradients (the rows threshold
# lowered), I = 192 (padded to 256) and H = 320 (padded to 384) the bf16 ones
FP8_CASES = {
    "R2_fp8_wgrad_shared": (2, 160, 256, 1024, 2, 4, 128, "skew"),
    "R3_fp8_padded_K10": (3, 100, 320, 192, 4, 10, 0, "empty_expert"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name,precision", [(n, "bf16") for n in sorted(CASES)]
                         + [(n, "fp8") for n in sorted(FP8_CASES)])
def test_backward_over_peers_is_the_virtual_backward_bitwise(name, precision, monkeypatch):
    from mok_cute import expert_backward

    monkeypatch.setattr(expert_backward, "FP8_WGRAD_MIN_ROWS", 0)  # FP8 weight grads at I = 1024
    leaves, idx, saved, d_out = _saved_problem(name, seed=3, precision=precision)
    want = _virtual_grads(leaves, idx, saved, d_out)
    first = None
    for repeat in range(2):
        _poison(saved.plan)
        got = _group_grads(leaves, idx, saved, d_out)
        torch.cuda.synchronize()
        mok.check_errors()
        _assert_bitwise(got, want, f"{name} (call {repeat})")
        if first is not None:
            _assert_bitwise(got, first, f"{name}: repeat")
        first = got


def test_a_rank_with_no_schedule_row_gets_zero_weight_gradients_without_a_launch():
    """expert_grads_over_peers on an empty receive schedule (no row, no tile): the outputs in
    the launch's order (pulled d_out and x rows, dG | dU, w * h, partials, dx rows, dW_*),
    the weight gradients zeros; no kernel runs (so this holds on the CPU too)."""
    from mok_cute.megakernel_backward import PeerRows, expert_grads_over_peers

    E, I, H = 2, 128, 256
    wg, wu = torch.randn(E, I, H).bfloat16(), torch.randn(E, I, H).bfloat16()
    wd = torch.randn(E, H, I).bfloat16()
    none = torch.zeros(0, dtype=torch.int32)
    peers = PeerRows(torch.zeros(2, dtype=torch.int64), none, none, none,
                     torch.zeros(6, dtype=torch.int64))
    out = expert_grads_over_peers(wg, wu, wd, torch.zeros(0, 2 * I, dtype=torch.bfloat16), none,
                                  torch.zeros(0), none, torch.zeros(1, dtype=torch.int32),
                                  torch.zeros(E + 1, dtype=torch.int32), peers)
    assert len(out) == 9
    assert [tuple(t.shape) for t in out[:6]] == [(0, H), (0, H), (0, 2 * I), (0, I), (0, 1),
                                                  (0, H)]
    for dw, w in zip(out[6:], (wg, wu, wd)):
        assert dw.shape == w.shape and not dw.any()


@pytest.mark.gpu
@pytest.mark.parametrize("name,comm_ctas", [("R3_empty_expert_K10", 3), ("R2_wide_I", 16),
                                            ("R2_wide_H", 5)])
def test_the_comm_in_the_backward_launch_keeps_the_bits_for_any_split(name, comm_ctas):
    """The bf16 backward over peers runs its pulls and pushes as comm tasks of the backward
    megakernel: bitwise the virtual backward with few comm CTAs (each walks many tasks), with
    33 partial columns a row (the partial sums' register halvings) and with the cooperative
    FC2 dgrad form (H > 6144); the fields poisoned before each call."""
    leaves, idx, saved, d_out = _saved_problem(name, seed=6)
    want = _virtual_grads(leaves, idx, saved, d_out)
    for repeat in range(2):
        _poison(saved.plan)
        got = _group_grads(leaves, idx, saved, d_out, comm_sms=comm_ctas)
        torch.cuda.synchronize()
        mok.check_errors()
        _assert_bitwise(got, want, f"{name}, {comm_ctas} comm CTAs (call {repeat})")


def test_the_comm_scalars_name_the_fields_where_the_kernel_reads_them():
    from mok_cute.comm import moe_symmetric_layout
    from mok_cute.kernels.megakernel import backward_comm as kernel
    from mok_cute.megakernel_backward import comm_scalars

    layout = moe_symmetric_layout(16, 64, 3, 2, training=True)
    got = comm_scalars(layout, 3, "cpu").tolist()
    assert len(got) == kernel.BACKWARD_COMM_SCALARS and got[kernel.TOP_K] == 3
    for index, field in ((kernel.D_OUT_OFFSET, "d_out"), (kernel.X_OFFSET, "x"),
                         (kernel.WEIGHTS_OFFSET, "router_weights"),
                         (kernel.COMBINE_OFFSET, "combine"),
                         (kernel.PARTIALS_OFFSET, "d_topk_partials")):
        assert got[index] == layout.offset(field), field
    assert layout.field("router_weights").shape[-1] * 4 == kernel.SLOT_ROW_BYTES
    assert layout.field("d_topk_partials").shape[-1] * 4 == kernel.SLOT_ROW_BYTES


@pytest.mark.gpu
def test_frozen_experts_and_inputs_skip_their_gradients_but_still_push():
    leaves, idx, saved, d_out = _saved_problem("R2_shared_skew", seed=4)
    want = _virtual_grads(leaves, idx, saved, d_out)
    needs = Needs(x=False, topk_weights=True, w_gate_up=False, w_down=True,
                  shared_gate_up=False, shared_down=False)
    got = _group_grads(leaves, idx, saved, d_out, needs=needs)
    assert got[0] is None and got[2] is None and got[3] is None and got[5:] == (None,) * 3
    _assert_bitwise([None, got[1], None, None, got[4]], [None, want[1], None, None, want[4]],
                    "frozen")


@pytest.mark.gpu
def test_a_silent_rank_in_the_backward_raises_peer_timeout_naming_it():
    leaves, idx, saved, d_out = _saved_problem("R2_shared_skew", seed=5, timeout_ms=200.0)
    _group_grads(leaves, idx, saved, d_out, silent_rank=1)
    with pytest.raises(mok.PeerTimeoutError, match=r"backward over the group call \d+: rank "
                                                   r"\d: .*peer 1"):
        mok.check_errors()
    want = _virtual_grads(leaves, idx, saved, d_out)
    _assert_bitwise(_group_grads(leaves, idx, saved, d_out), want, "after the silent call")
    torch.cuda.synchronize()
    mok.check_errors()


def _one_rank_tail(leaves, idx, saved, d_out, rank, silent_peer=-1, failed_peer=-1,
                   shared_in_launch=False):
    """Rank ``rank``'s backward alone over a virtual group's buffers with the group tail, its
    peers' pushes in place (a whole group call just made them) and their flags set by hand to
    this call's "done" (all but ``silent_peer``'s). ``failed_peer``'s flag says instead that
    it failed this call and has started its next one: (d_x, d_topk, dW_gate, dW_up, dW_down),
    then with ``shared_in_launch`` (the shared expert's backward as tasks of the launch, not
    before it) its dWs_gate, dWs_up, dWs_down."""
    from mok_cute import megakernel_backward as mb
    from mok_cute.constants import SCALAR_INDEX, flag_done, flag_started
    from mok_cute.expert_backward import shared_backward_ranks

    xs, w, wg, wu, wd, *sh = (t.detach() for t in leaves)
    plan, sched = saved.plan, saved.schedules
    T, K, H = xs.shape[1], idx.shape[2], xs.shape[2]
    plan.begin_backward()
    scalars = plan.scalars.clone()
    scalars[SCALAR_INDEX["rank_base"]] = rank  # the launch's rank: rank of the group
    epoch = int(scalars[SCALAR_INDEX["epoch"]].item())
    flags = plan.side.fields("barrier_flags")[rank]
    R = flags.shape[0] // 2  # progress words, then the sticky failed epochs
    for p in range(R):
        if p not in (rank, silent_peer):
            flags[p] = flag_done(epoch)
    if failed_peer >= 0:
        flags[failed_peer] = flag_started(epoch + 1)
        flags[R + failed_peer] = epoch
    shared, shared_dx = None, None
    if shared_in_launch:
        shared = mb.SharedExpert(d_out[rank].contiguous(), xs[rank].contiguous(),
                                 *(w[rank].contiguous() for w in sh), saved.shared_preact[rank])
    else:
        shared_dx = shared_backward_ranks(d_out, xs, tuple(sh) or None,
                                          saved.shared_preact)[0][rank]
    peers = mb.PeerRows(plan.peer_bases[rank], sched.row_peer[rank], sched.row_token[rank],
                        sched.row_k[rank], mb.comm_scalars(plan.side.layout, K, xs.device))
    weights = torch.zeros(saved.preact.shape[0], dtype=torch.float32, device=xs.device)
    d_x = torch.full((T, H), 7.0, dtype=torch.bfloat16, device=xs.device)  # poisoned
    d_topk = torch.full((T, K), 7.0, dtype=torch.float32, device=xs.device)
    out = mb.expert_grads_over_peers(
        wg[rank], wu[rank], wd[rank], saved.preact, saved.row_slot[rank], weights,
        sched.tile_expert[rank], sched.num_tiles[rank:rank + 1], sched.expert_offsets[rank],
        peers, True, 5, tail=mb.GroupTail(scalars, plan.backward_error,
                                          idx[rank].to(torch.int32).contiguous(), shared_dx,
                                          d_x, d_topk), shared=shared)
    if shared_in_launch:
        return (d_x, d_topk, *out[6:9], *out[9][1:])
    return (d_x, d_topk, *out[6:])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["R2_shared_skew", "R3_empty_expert_K10",
                                  "R4_silent_receiver_shared"])
def test_one_ranks_launch_with_the_group_tail_gives_its_group_gradients(name):
    """Each rank's launch with the group tail (its barriers and k-sums inside), run alone on
    a virtual group's buffers after a whole group call: d_x, d_topk_weights and the weight
    gradients bitwise that call's for the rank, so with the shared expert's backward as tasks
    of the launch (a rank that receives nothing runs them too). With a peer that never flags, the launch
    names it (code PEER_NEVER_STARTED) and writes NaN, never a plausible gradient; so with a
    peer that failed this call and has started its next (PEER_FAILED, its sticky word)."""
    from mok_cute.constants import PEER_FAILED, PEER_NEVER_STARTED
    from mok_cute.errors import decode_wait_error

    leaves, idx, saved, d_out = _saved_problem(name, seed=7, timeout_ms=300.0)
    whole = _group_grads(leaves, idx, saved, d_out)
    torch.cuda.synchronize()
    mok.check_errors()
    R = idx.shape[0]
    for rank in range(R):
        got = _one_rank_tail(leaves, idx, saved, d_out, rank)
        torch.cuda.synchronize()
        assert int(saved.plan.backward_error.item()) == 0, f"rank {rank}"
        want = [whole[0][rank], whole[1][rank], *(g[rank] for g in whole[2:5])]
        _assert_bitwise([got[0], got[1].to(want[1].dtype), *got[2:]], want,
                        f"{name}: rank {rank} alone")
        if whole[5] is not None:  # the shared expert's backward inside the launch: same bits
            got = _one_rank_tail(leaves, idx, saved, d_out, rank, shared_in_launch=True)
            torch.cuda.synchronize()
            assert int(saved.plan.backward_error.item()) == 0, f"rank {rank}, shared"
            want += [g[rank] for g in whole[5:8]]
            _assert_bitwise([got[0], got[1].to(want[1].dtype), *got[2:]], want,
                            f"{name}: rank {rank} alone, the shared expert in the launch")
    def assert_named_and_nan(code, **peer):  # rank 0's launch with a peer silent or failed
        got = _one_rank_tail(leaves, idx, saved, d_out, 0, **peer)
        torch.cuda.synchronize()
        _, named, _, got_code = decode_wait_error(int(saved.plan.backward_error.item()))
        assert (named, got_code) == (R - 1, code)
        assert torch.isnan(got[0].float()).all() and torch.isnan(got[1]).all()
        saved.plan.backward_error.zero_()

    assert_named_and_nan(PEER_NEVER_STARTED, silent_peer=R - 1)
    # a peer that failed this call and went on to its next: its progress word passes every
    # wait, and only its sticky failed word tells; an older failure of it does not count
    flags = saved.plan.side.fields("barrier_flags")[0]
    assert_named_and_nan(PEER_FAILED, failed_peer=R - 1)
    got = _one_rank_tail(leaves, idx, saved, d_out, 0)  # the sticky word holds an old epoch
    torch.cuda.synchronize()
    assert int(flags[R + R - 1].item()) > 0 and int(saved.plan.backward_error.item()) == 0
    want = [whole[0][0], whole[1][0], *(g[0] for g in whole[2:5])]
    _assert_bitwise([got[0], got[1].to(want[1].dtype), *got[2:]], want, f"{name}: after a failure")


def _on_processes(fn, world: int, seed: int, *args):
    """``fn(rank, world, seed, out_dir, *args)`` in ``world`` processes of a gloo group on one
    GPU; each rank writes ``ok<rank>`` into out_dir once its checks passed."""
    import gloo_group

    with tempfile.TemporaryDirectory() as tmp:
        gloo_group.spawn(fn, world, tmp, seed, tmp, *args)
        assert {f"ok{r}" for r in range(world)} <= set(os.listdir(tmp))


def _ipc_setup(rank, seed, wait_ns, case="R2_shared_skew"):
    """One process of an IPC test: the virtual forward of all ranks (the same bits in both
    processes) gives this rank's saved g | u and schedule, the IPC plan of the group its
    buffers; (call(**kw): this rank's moe_backward_group, want: the virtual gradients of
    this rank, plan)."""
    from mok_cute import megakernel
    from mok_cute.group_backward import moe_backward_group

    torch.cuda.set_device(0)  # both ranks on one GPU
    R, T, H, I, E_loc, K, Is, routing = CASES[case]
    leaves, idx = _problem(R, T, H, I, E_loc, K, Is, seed=seed, routing=routing)
    config = mok.MoKConfig(timeout_ms=60000.0, backend="megakernel")
    _, saved = _forward_saved(leaves, idx, config)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    d_out = torch.randn(R, T, H, device="cuda", generator=g).to(torch.bfloat16)
    want = _virtual_grads(leaves, idx, saved, d_out)
    xs, w, wg, wu, wd, *sh = (t.detach()[rank:rank + 1] for t in leaves)
    group = torch.distributed.group.WORLD
    plan = megakernel.plan_for(xs, wg, wd, tuple(sh) or None, idx[rank:rank + 1], config,
                               group, "legacy", save=True)
    # the wait bound (the plan's own, which a call's silent rank rewrites with it: no IPC
    # forward ran to set it); the other processes share the GPU
    plan._set_waits((int(wait_ns), -1))
    s = saved.schedules
    mine = types.SimpleNamespace(**{f: getattr(s, f)[rank:rank + 1] for f in (
        "row_peer", "row_token", "row_k", "tile_expert", "num_tiles", "expert_offsets")})
    one = saved._replace(row_slot=saved.row_slot[rank:rank + 1],  # into the virtual pool
                         shared_preact=None if Is == 0 else saved.shared_preact[rank:rank + 1],
                         schedules=mine, plan=plan)

    def call(**kw):
        return moe_backward_group(d_out[rank:rank + 1], xs, idx[rank:rank + 1], w, wg, wu, wd,
                                  tuple(sh) or None, one, **kw)

    return call, [None if t is None else t[rank:rank + 1] for t in want], plan


def _ipc_rank(rank, world, seed, out_dir, case):
    """The backward over IPC (one launch a rank: its barriers and k-sums inside) against the
    other processes, twice: bitwise the virtual ranks' gradients."""
    call, want, plan = _ipc_setup(rank, seed, 60e9, case)
    for _ in range(2):
        got = call()
        torch.cuda.synchronize()
        plan.check_device_error()
        _assert_bitwise(got, want, f"rank {rank} over IPC")
    open(os.path.join(out_dir, f"ok{rank}"), "w").close()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["R2_shared_skew", "R3_empty_expert_K10"])
def test_processes_on_one_gpu_over_ipc_give_the_virtual_bits(case):
    """One process a rank (K = 4 with a shared expert; K = 10, an empty expert, three
    processes): each rank's backward is one launch with its barriers and k-sums."""
    _on_processes(_ipc_rank, CASES[case][0], 11, case)


def _ipc_silent_rank(rank, world, seed, out_dir):
    """Rank 1 stores no flag in the first call (its process as if dead; it waits for its own
    start flag too): both launches give up waiting for rank 1 and name it, and both write NaN
    d_x and d_topk_weights, never plausible gradients. The next call is whole."""
    call, want, plan = _ipc_setup(rank, seed, 3e9)
    got = call(silent_rank=1)
    torch.cuda.synchronize()
    with pytest.raises(mok.PeerTimeoutError, match=f"rank {rank}: .*peer 1"):
        mok.check_errors()
    assert torch.isnan(got[0].float()).all() and torch.isnan(got[1]).all(), f"rank {rank}"
    # every process past the failed call before the next starts: flags only grow, so a
    # peer's next start flag would satisfy a slower rank's waits of the failed call
    torch.distributed.barrier()
    plan._set_waits((int(60e9), -1))
    got = call()
    torch.cuda.synchronize()
    plan.check_device_error()
    _assert_bitwise(got, want, f"rank {rank} after the silent call")
    open(os.path.join(out_dir, f"ok{rank}"), "w").close()


@pytest.mark.gpu
def test_a_silent_process_in_the_backward_launch_raises_and_writes_nan():
    _on_processes(_ipc_silent_rank, 2, 13)


IPC_TRAIN_CASES = {  # besides R2_shared_skew: odd T, K = 10, an empty expert, 2 processes
    "R2_T77_K10_empty_expert": (2, 77, 320, 192, 8, 10, 0, "empty_expert"),
}


def _ipc_train_rank(rank, world, seed, out_dir, precision="bf16"):
    """One process: ``mok.moe_forward(group=...)`` trains through the IPC megakernel (two
    processes time-share one GPU, so the waits are long): out and every gradient of this rank
    bitwise those of the virtual ranks' training on the same problem, again in a second
    backward over the retained graph. ``fp8_rows_rule``: FP8 with the weight gradients' row
    threshold between the real T's rows an expert (T = 160: 320) and the group plan's padded
    T's (256: 512), so both backends must count the real tokens to pick the same kernels."""
    torch.cuda.set_device(0)
    from mok_cute import expert_backward

    # this process's: FP8 weight gradients at I = 1024 (fp8), or only from 400 rows an expert
    expert_backward.FP8_WGRAD_MIN_ROWS = 400 if precision == "fp8_rows_rule" else 0
    saved_rows = precision == "bf16_saved_rows"  # a budget that holds the fullest rank exactly
    precision = precision.removesuffix("_rows_rule").removesuffix("_saved_rows")
    if precision in IPC_TRAIN_CASES:
        R, T, H, I, E_loc, K, Is, routing = IPC_TRAIN_CASES[precision]
        precision = "bf16"
    else:
        R, T, H, I, E_loc, K, Is, routing = (CASES["R2_shared_skew"] if precision == "bf16"
                                             else FP8_CASES["R2_fp8_wgrad_shared"])
    leaves, idx = _problem(R, T, H, I, E_loc, K, Is, seed=seed, routing=routing)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    d_out = torch.randn(R, T, H, device="cuda", generator=g).to(torch.bfloat16)
    xs, w, wg, wu, wd, *sh = leaves
    factor = _saved_rows_factor(idx, E_loc, T, K)[0] if saved_rows else None
    # with a budget the forward reads its count where check_ids synchronises: that path too
    config = mok.MoKConfig(timeout_ms=60000.0, backend="megakernel", check_ids=saved_rows,
                           precision=precision, saved_rows_factor=factor)
    want_out = mok.moe_forward_virtual(xs, idx, w, wg, wu, wd, tuple(sh) or None, config)
    want_out.backward(d_out)
    want = [t.grad[rank].clone() for t in leaves]
    mine = [t.detach()[rank].clone().requires_grad_(True) for t in leaves]
    out = mok.moe_forward(mine[0], idx[rank], *mine[1:5], shared=tuple(mine[5:]) or None,
                          config=config, group=torch.distributed.group.WORLD)
    fns, names = [out.grad_fn], []
    while fns and len(names) < 8:  # the api's slice of the padded rows, then the kernels' op
        fn = fns.pop()
        names.append(fn.name())
        fns += [f for f, _ in fn.next_functions if f is not None]
    assert any("GroupTrain" in n for n in names), names
    out.backward(d_out[rank], retain_graph=True)
    torch.cuda.synchronize()
    mok.check_errors()
    assert torch.equal(out.detach(), want_out.detach()[rank]), "out"
    for name, t, wt in zip(NAMES, mine, want):
        assert torch.equal(t.grad, wt), f"rank {rank}: {name} differs"
    for t in mine:  # a second backward over the retained graph: the same bits
        t.grad = None
    out.backward(d_out[rank])
    torch.cuda.synchronize()
    for name, t, wt in zip(NAMES, mine, want):
        assert torch.equal(t.grad, wt), f"rank {rank}: {name} differs in the second backward"
    open(os.path.join(out_dir, f"ok{rank}"), "w").close()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_rows_rule", "bf16_saved_rows",
                                       *IPC_TRAIN_CASES])
def test_training_over_ipc_on_one_gpu_gives_the_virtual_bits(precision):
    _on_processes(_ipc_train_rank, 2, 12, precision)


def _saved_rows_factor(idx, E_loc, T, K, short: bool = False):
    """A ``MoKConfig.saved_rows_factor`` whose budget (``saved_rows.kept_saved_rows``, over the
    plan's padded T) holds exactly the rows the fullest rank of ``idx`` [R, T, K] receives, or
    (``short``) one row fewer -> (factor, the rows it keeps, each rank's received rows)."""
    from mok_cute.megakernel import plan_tokens
    from mok_cute.saved_rows import kept_saved_rows

    R = idx.shape[0]
    received = [int(((idx >= r * E_loc) & (idx < (r + 1) * E_loc)).sum()) for r in range(R)]
    need = max(received)
    factor = (need - (1.5 if short else 0.5)) / (plan_tokens(T) * K)  # ceil: need (- 1)
    kept = kept_saved_rows(R, plan_tokens(T), K, factor)
    assert kept == need - short < R * plan_tokens(T) * K, (kept, need)  # below the worst case
    return factor, kept, received


def _ipc_short_save_rank(rank, world, seed, out_dir):
    """A budget of saved rows one short of what the fullest rank receives. Without check_ids
    the backward completes on every rank, and a short rank's ``check_errors`` raises
    SavedRowsError counting its missing rows (the others' pass); with check_ids the forward
    raises on every rank: SavedRowsError on a short rank, RuntimeError naming it on the
    others."""
    torch.cuda.set_device(0)
    R, T, H, I, E_loc, K, Is, routing = CASES["R2_shared_skew"]
    leaves, idx = _problem(R, T, H, I, E_loc, K, Is, seed=seed, routing=routing)
    factor, kept, received = _saved_rows_factor(idx, E_loc, T, K, short=True)
    short = [r for r in range(R) if received[r] > kept]
    missing = received[rank] - kept
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    d_out = torch.randn(R, T, H, device="cuda", generator=g).to(torch.bfloat16)
    mine = [t.detach()[rank].clone().requires_grad_(True) for t in leaves]
    rows = "1 routed row" if missing == 1 else f"{missing} routed rows"
    for check_ids in (False, True):
        config = mok.MoKConfig(timeout_ms=60000.0, backend="megakernel", check_ids=check_ids,
                               saved_rows_factor=factor)

        def call():
            return mok.moe_forward(mine[0], idx[rank], *mine[1:5],
                                   shared=tuple(mine[5:]) or None, config=config,
                                   group=torch.distributed.group.WORLD)
        if not check_ids:
            call().backward(d_out[rank])
            torch.cuda.synchronize()
            if rank in short:
                with pytest.raises(mok.SavedRowsError, match=f"rank {rank} received {rows} more"):
                    mok.check_errors()
            else:
                mok.check_errors()
        elif rank in short:
            with pytest.raises(mok.SavedRowsError,
                               match=f"rank {rank} received {rows} more than the {kept} rows"):
                call()
        else:
            with pytest.raises(RuntimeError, match=f"rank {short[0]}"):
                call()
    open(os.path.join(out_dir, f"ok{rank}"), "w").close()


def _ipc_pool_rank(rank, world, seed, out_dir):
    """Two training calls of one graph over IPC (two "layers": x, then x / 2) keep their g | u
    in one ``SavedRowsPool`` sized for exactly the fullest rank's rows of both, the second's
    packed after the first's: every gradient bitwise that of the same two calls on virtual
    ranks (the second call's rows overwrote none of the first's); the pool holds both calls
    until the backward has run, then none, and the next step's call starts from row 0."""
    import gc

    torch.cuda.set_device(0)
    R, T, H, I, E_loc, K, Is, routing = CASES["R2_shared_skew"]
    leaves, idx = _problem(R, T, H, I, E_loc, K, Is, seed=seed, routing=routing)
    received = [int(((idx >= r * E_loc) & (idx < (r + 1) * E_loc)).sum()) for r in range(R)]
    pool = mok.SavedRowsPool(2 * max(received) * 4 * I)  # the same size on every rank
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    d_out = torch.randn(R, T, H, device="cuda", generator=g).to(torch.bfloat16)
    config = mok.MoKConfig(timeout_ms=60000.0, backend="megakernel", check_ids=True,
                           saved_rows_pool=pool)
    virtual = mok.MoKConfig(timeout_ms=60000.0, backend="megakernel")
    xs, w, wg, wu, wd, *sh = leaves
    want_out = (mok.moe_forward_virtual(xs, idx, w, wg, wu, wd, tuple(sh) or None, virtual)
                + mok.moe_forward_virtual(xs / 2, idx, w, wg, wu, wd, tuple(sh) or None, virtual))
    want_out.backward(d_out)
    want = [t.grad[rank].clone() for t in leaves]
    mine = [t.detach()[rank].clone().requires_grad_(True) for t in leaves]

    def call(x):
        return mok.moe_forward(x, idx[rank], *mine[1:5], shared=tuple(mine[5:]) or None,
                               config=config, group=torch.distributed.group.WORLD)
    out = call(mine[0]) + call(mine[0] / 2)
    assert pool.held_calls == 2
    assert int(pool.used) == 2 * received[rank] * 4 * I  # the second call after the first
    out.backward(d_out[rank])
    torch.cuda.synchronize()
    mok.check_errors()
    assert torch.equal(out.detach(), want_out.detach()[rank]), "out"
    for name, t, wt in zip(NAMES, mine, want):
        assert torch.equal(t.grad, wt), f"rank {rank}: {name} differs"
    gc.collect()
    assert pool.held_calls == 0  # freed by the backward while the graph (out) lives on
    call(mine[0]).sum().backward()  # the next step: from row 0 again
    torch.cuda.synchronize()
    assert int(pool.used) == received[rank] * 4 * I
    open(os.path.join(out_dir, f"ok{rank}"), "w").close()


@pytest.mark.gpu
def test_calls_sharing_a_saved_rows_pool_over_ipc_give_the_virtual_bits():
    _on_processes(_ipc_pool_rank, 2, 12)


@pytest.mark.gpu
def test_a_rank_short_of_saved_rows_raises_on_the_group_never_drops():
    _on_processes(_ipc_short_save_rank, 2, 12)


def test_the_first_call_of_a_build_lines_the_group_up_after_its_compile(monkeypatch):
    """Over a process group, a backward build's first call on a plan gets one stream-ordered
    all_reduce to run between its kernels' compile and their launch (a rank still compiling,
    a minute or two, would make its peers' waits give up); later calls of that build, and
    one process's virtual ranks, get none."""
    import torch.distributed as dist

    from mok_cute import group_backward

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append(group))
    group = object()
    plan = types.SimpleNamespace(side=types.SimpleNamespace(group=group), aligned_builds=set(),
                                 peer_bases=torch.zeros(1))
    build = (False, True, False, False, False)
    align = group_backward._first_build_alignment(plan, build, launches=1)
    assert callable(align) and calls == []
    align()  # outside a stretch (`until_collective`): no gate, the all_reduce alone
    assert calls == [group]
    assert group_backward._first_build_alignment(plan, build, launches=1) is None
    assert callable(group_backward._first_build_alignment(plan, (True, *build[1:]), launches=2))
    virtual = types.SimpleNamespace(side=types.SimpleNamespace(), aligned_builds=set(),
                                    peer_bases=torch.zeros(1))
    assert group_backward._first_build_alignment(virtual, build, launches=1) is None
