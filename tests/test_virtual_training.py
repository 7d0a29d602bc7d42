"""Training on virtual ranks (mok_cute/virtual_backward.py, the virtual custom ops of
mok_cute/autograd.py): ``moe_forward_virtual`` with inputs that require grad.

CPU: the concatenation of R receive schedules into one schedule of R * E_loc experts puts
every receive row exactly once, with its expert, its source (peer, token, k) slot and its
saved g | u row, in its rank's order, inside the capacity bound (tight when every expert has
one row); each saved row gets its slot's router weight; bad tables are refused naming the
argument; the custom ops' fakes give the real shapes; the megakernel's config survives the
op's int list.

H200 (marked gpu): every gradient against autograd on ``reference.moe_forward_virtual``
(relative L1 <= 1e-2, cosine >= 0.9999 as tests/test_backward.py; out and each token's d_xs
row one by one, tests/per_token.py) for R in {1, 2, 3, 4, 8, 16, 72}: uniform and skewed
routing, an empty expert, a rank that receives nothing, the shared expert, K = 10, T = 1,
out-of-range ids without the check; bitwise repeats with poisoned memory; d_xs and
d_topk_weights bitwise equal to one rank holding the same tokens and experts (by construction:
each row's dgrads depend on that row alone and the k-sum's order is fixed; the routed weight
gradients are not compared bitwise, as an expert sums its rows in schedule order, peers
interleaved on R ranks, token order on one); needs_input_grad; opcheck; torch.compile; no host
sync in a step with ``check_ids=False``.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import mok_cute as mok
from mok_cute import reference
from mok_cute.schedule import build_receive_schedules, saved_preact_rows, schedule_capacity
from mok_cute.virtual_backward import concat_schedules, weights_by_preact_row
from per_token import DX_TOKEN_TOL, assert_tokens_close
from test_backward import NAMES, NO_MAIN, _close
from poison import poison_free_memory

TILE = 128


# ---------------------------------------------------------------------- the tables (CPU)
def _tables(idx: torch.Tensor, E_loc: int):
    """The schedule tables a training forward saves (``VirtualSaved`` less the g | u), built
    by the torch schedule on idx's device; row_slot as ``megakernel.Plan._saved_preact``
    lays the saved rows out: by (token, k) slot at one rank, by receive row on several.
    Returns (tables dict, saved rows a rank P)."""
    R, T, K = idx.shape
    s = build_receive_schedules(idx, E_loc, TILE, validate=False, gpu_build=False)
    valid = s.row_token >= 0
    rows = saved_preact_rows(R, R, T, K, E_loc, TILE)
    if R == 1:
        index = s.row_token * K + s.row_k
    else:  # one pool by global slot (peer, token, k)
        index = (s.row_peer * T + s.row_token) * K + s.row_k
    row_slot = torch.where(valid, index, torch.full_like(index, -1)).to(torch.int32)
    return dict(row_peer=s.row_peer, row_token=s.row_token, row_k=s.row_k, row_slot=row_slot,
                tile_expert=s.tile_expert, num_tiles=s.num_tiles,
                expert_offsets=s.expert_offsets), rows


def _routing(R, T, K, E_loc, routing, gen):
    E = R * E_loc
    scores = torch.rand(R, T, E, generator=gen)
    if routing == "skew":  # expert 0 takes about half of all tokens
        scores[..., 0] += 2.0 * (torch.rand(R, T, generator=gen) < 0.5)
    elif routing == "empty_expert":
        scores[..., E - 2] = -1.0
    elif routing == "silent_rank":  # no token routes to rank R - 1's experts
        scores[..., (R - 1) * E_loc:] = -1.0
    return scores.topk(K, dim=2).indices.to(torch.int32)


def _check_concat(t, P, concat, R, T, K, E_loc):
    """Every receive row lands exactly once, with its expert, slot and saved row, in its
    rank's order; padding and the tail are padding; row_of_slot inverts slot."""
    cap = t["row_token"].shape[1]
    M = concat.capacity
    assert M == schedule_capacity(1, R * T, K, R * E_loc, TILE) <= R * cap
    token_row, slot, preact_row = (concat.token_row.tolist(), concat.slot.tolist(),
                                   concat.preact_row.tolist())
    tile_expert, offsets = concat.tile_expert.tolist(), concat.expert_offsets.tolist()
    live = sum(t["num_tiles"].tolist())
    assert concat.num_tiles.tolist() == [live] and offsets[-1] == live * TILE <= M
    assert all(e == -1 for e in tile_expert[live:])
    assert all(s == -1 for s in slot[live * TILE:])
    row_of = {}
    for m, s in enumerate(slot):
        if s >= 0:
            assert s not in row_of, f"slot {s} in rows {row_of[s]} and {m}"
            row_of[s] = m
    received = 0
    for r in range(R):
        eo = t["expert_offsets"][r].tolist()
        for e in range(E_loc):
            g = r * E_loc + e
            seg = range(offsets[g], offsets[g + 1])
            assert len(seg) == eo[e + 1] - eo[e], (r, e)
            assert all(tile_expert[m // TILE] == g for m in seg), (r, e)
            for m, i in zip(seg, range(eo[e], eo[e + 1])):
                token = int(t["row_token"][r, i])
                if token < 0:
                    assert slot[m] == token_row[m] == preact_row[m] == -1
                    continue
                received += 1
                peer, k = int(t["row_peer"][r, i]), int(t["row_k"][r, i])
                assert token_row[m] == peer * T + token, (r, i)
                assert slot[m] == (peer * T + token) * K + k, (r, i)
                assert preact_row[m] == int(t["row_slot"][r, i]) < P, (r, i)
    assert received == len(row_of)
    want = torch.full((R * T * K,), -1, dtype=torch.int32)
    for s, m in row_of.items():
        want[s] = m
    assert torch.equal(concat.row_of_slot.cpu(), want)


@pytest.mark.parametrize("R,T,K,E_loc,routing", [
    (1, 77, 4, 8, "uniform"), (1, 50, 10, 16, "skew"), (2, 160, 4, 4, "skew"),
    (3, 100, 2, 4, "empty_expert"), (4, 96, 2, 4, "silent_rank"), (8, 64, 10, 2, "uniform"),
    (8, 1, 2, 2, "uniform"), (16, 32, 2, 2, "skew"), (72, 4, 2, 1, "uniform")])
def test_concatenation_places_every_receive_row_once(R, T, K, E_loc, routing, gen):
    idx = _routing(R, T, K, E_loc, routing, gen)
    t, P = _tables(idx, E_loc)
    concat = concat_schedules(**t, num_tokens=T, top_k=K)
    _check_concat(t, P, concat, R, T, K, E_loc)
    # every routed slot has a row (all ids valid here)
    assert bool((concat.row_of_slot >= 0).all())
    if routing == "silent_rank":
        assert int(t["num_tiles"][-1]) == 0
    # the dgated epilogue reads each row's weight through its saved row
    weights = torch.rand(R, T, K, generator=gen)
    by_row = weights_by_preact_row(concat, weights, P)
    assert by_row.dtype == torch.float32 and by_row.shape == (P,)
    hit = concat.preact_row >= 0
    assert torch.equal(by_row[concat.preact_row[hit].long()],
                       weights.reshape(-1)[concat.slot[hit].long()])
    unsaved = torch.ones(P, dtype=torch.bool)
    unsaved[concat.preact_row[hit].long()] = False
    assert bool((by_row[unsaved] == 0).all())


def test_concatenation_fits_the_worst_padding_exactly():
    """Every one of the R * E_loc experts receives one row: each pads 127 rows, and the live
    rows fill the capacity bound exactly (no row dropped, no slack)."""
    R, T, K, E_loc = 4, 2, 2, 4
    idx = torch.arange(R * T * K, dtype=torch.int32).view(R, T, K)  # a distinct expert each
    t, P = _tables(idx, E_loc)
    concat = concat_schedules(**t, num_tokens=T, top_k=K)
    _check_concat(t, P, concat, R, T, K, E_loc)
    assert int(concat.num_tiles) * TILE == concat.capacity == R * E_loc * TILE


def test_out_of_range_ids_get_no_row(gen):
    """Without the id check an id outside [0, E) matches no expert: its slot has no row (its
    d_x share and d_topk_weight are then zero)."""
    R, T, K, E_loc = 3, 20, 3, 2
    idx = _routing(R, T, K, E_loc, "uniform", gen)
    idx[0, 3, 1], idx[2, 7, 0] = 1000, -5
    t, P = _tables(idx, E_loc)
    concat = concat_schedules(**t, num_tokens=T, top_k=K)
    _check_concat(t, P, concat, R, T, K, E_loc)
    missing = (concat.row_of_slot < 0).nonzero().flatten().tolist()
    assert missing == [(0 * T + 3) * K + 1, (2 * T + 7) * K + 0]


@pytest.mark.parametrize("field,change,match", [
    ("tile_expert", lambda t: t[:, :-1], "tile_expert: expected shape"),
    ("num_tiles", lambda t: t[:1], "num_tiles: expected shape"),
    ("row_slot", lambda t: t.float(), "row_slot: expected an int32"),
    ("row_token", lambda t: t[:, :100], "row_token: expected"),
    ("expert_offsets", lambda t: t[:, :1], "expert_offsets: expected"),
])
def test_bad_tables_are_refused_naming_the_argument(field, change, match, gen):
    idx = _routing(2, 30, 2, 2, "uniform", gen)
    t, P = _tables(idx, 2)
    t[field] = change(t[field])
    with pytest.raises(ValueError, match=match):
        concat_schedules(**t, num_tokens=30, top_k=2)
    t, P = _tables(idx, 2)
    with pytest.raises(ValueError, match="top_k"):
        concat_schedules(**t, num_tokens=30, top_k=0)


def test_backward_refuses_a_d_out_of_another_shape():
    from mok_cute.virtual_backward import VirtualSaved, moe_backward_virtual

    R, T, H, I, E_loc, K = 2, 8, 64, 64, 2, 2
    xs = torch.zeros(R, T, H, dtype=torch.bfloat16)
    w = torch.zeros(R, T, K)
    wg = torch.zeros(R, E_loc, I, H, dtype=torch.bfloat16)
    wd = torch.zeros(R, E_loc, H, I, dtype=torch.bfloat16)
    saved = VirtualSaved(*[torch.zeros(1)] * 9)
    with pytest.raises(ValueError, match=r"d_out: expected shape \[2, 8, 64\]"):
        moe_backward_virtual(xs[:, :4], xs, w, wg, wg, wd, None, saved)
    with pytest.raises(ValueError, match="d_out: expected bfloat16"):
        moe_backward_virtual(xs.float(), xs, w, wg, wg, wd, None, saved)


# ---------------------------------------------------------------------- the plumbing (CPU)
def _emulated_dgrads(d_rows, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
                     num_tiles, want_dx, options, fp8=False, dgrads="kernels"):
    """``expert_backward._dgrads`` in fp32 torch: each live row's expert from its tile, its
    g | u and weight through ``row_slot``: (d_preact, hw, partials [rows, 1], dx rows)."""
    rows, inter = d_rows.shape[0], w_gate.shape[1]
    live = torch.arange(rows) < min(rows, int(num_tiles[0]) * TILE)
    expert = tile_expert.long().repeat_interleave(TILE)[:rows]
    slot = row_slot.long()
    ok = (live & (slot >= 0) & (expert >= 0)).unsqueeze(1)
    e, slot = expert.clamp(min=0), slot.clamp(min=0)
    pre = preact.float()[slot]
    g, u = pre[:, :inter], pre[:, inter:]
    w = weights.float()[slot].unsqueeze(1)
    dy = torch.einsum("mh,mhi->mi", d_rows.float(), w_down.float()[e])
    sig = torch.sigmoid(g)
    h = g * sig * u
    partials = torch.where(ok, (dy * h).sum(1, keepdim=True), 0.0)
    d_pre = torch.where(ok, torch.cat([w * dy * u * sig * (1 + g * (1 - sig)), w * dy * g * sig],
                                      1), 0.0).to(torch.bfloat16)
    hw = torch.where(ok, w * h, 0.0).to(torch.bfloat16)
    dx = (torch.einsum("mi,mih->mh", d_pre[:, :inter].float(), w_gate.float()[e])
          + torch.einsum("mi,mih->mh", d_pre[:, inter:].float(), w_up.float()[e]))
    dx = torch.where(ok, dx, 0.0).to(torch.bfloat16)
    return d_pre, hw, partials, dx if want_dx else None


def _emulated_weight_grads(d_pre, hw, d_rows, x_rows, w_gate, w_down, offsets, want_gate_up,
                           want_down, fp8=False, rows_per_expert=0.0, main=None):
    """``expert_backward._weight_grads`` in fp32 torch: each expert's over its rows
    [offsets[e], offsets[e + 1]); ``main``: buffers the fp32 products are added into (None
    returned for each)."""
    rows, inter = d_rows.shape[0], w_gate.shape[1]
    main = main or (None, None, None)
    dws = [torch.zeros(w.shape) for w in (w_gate, w_gate, w_down)]
    for ex in range(w_gate.shape[0]):
        seg = slice(int(offsets[ex]), min(int(offsets[ex + 1]), rows))
        if want_gate_up:
            dws[0][ex] = d_pre[seg, :inter].float().t() @ x_rows[seg].float()
            dws[1][ex] = d_pre[seg, inter:].float().t() @ x_rows[seg].float()
        if want_down:
            dws[2][ex] = d_rows[seg].float().t() @ hw[seg].float()
    out = []
    for g, buf, want in zip(dws, main, (want_gate_up, want_gate_up, want_down)):
        if want and buf is not None:
            buf += g
        out.append(g.to(torch.bfloat16) if want and buf is None else None)
    return tuple(out)


def _emulated_expert_backward(d_rows, x_rows, w_gate, w_up, w_down, preact, row_slot, weights,
                              tile_expert, num_tiles, offsets, want_dx, want_gate_up,
                              want_down, want_partials, options, fp8=False, dgrads="kernels",
                              fp8_transposed=None, rows_per_expert=0.0, main=None,
                              timeline=None, reduce_dx=None):
    """``expert_backward._expert_backward`` in fp32 torch: the two emulations above (bf16;
    nothing recorded)."""
    from mok_cute.expert_backward import _owned

    assert not fp8 and fp8_transposed is None and timeline is None
    d_rows, x_rows = _owned(d_rows), _owned(x_rows)
    assert isinstance(d_rows, torch.Tensor) and (x_rows is None or isinstance(x_rows, torch.Tensor))
    d_pre, hw, partials, dx = _emulated_dgrads(d_rows, w_gate, w_up, w_down, preact, row_slot,
                                               weights, tile_expert, num_tiles, want_dx, options)
    dwg, dwu, dwd = _emulated_weight_grads(d_pre, hw, d_rows, x_rows, w_gate, w_down, offsets,
                                           want_gate_up, want_down, main=main)
    if reduce_dx is not None and dx is not None:
        dx = reduce_dx(dx)
    return dx, dwg, dwu, dwd, partials


def _emulated_expert_grads(d_rows, x_rows, w_gate, w_up, w_down, preact, row_slot, weights,
                           tile_expert, num_tiles, offsets, shared=None, main_grads=None,
                           timeline=None, rows_per_expert=None):
    """``megakernel_backward.expert_grads`` with every rank's shared expert (``shared``), in
    fp32 torch: the routed experts' emulation above, the shared experts' through
    ``shared_backward_ranks`` on it (d_preact and hw are not returned: None; nothing
    recorded: ``timeline`` None)."""
    assert timeline is None
    from mok_cute.config import ExpertPathOptions
    from mok_cute.expert_backward import shared_backward_rank_by_rank
    from mok_cute.megakernel_backward import SharedGrads

    main = main_grads or (None,) * 6
    dx, dwg, dwu, dwd, partials = _emulated_expert_backward(
        d_rows, x_rows, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
        num_tiles, offsets, True, True, True, True, ExpertPathOptions(), main=main[:3])
    s_dx, s_dw = shared_backward_rank_by_rank(shared.d_out, shared.x, shared[2:5],
                                              shared.preact, main=main[3:])
    # the launch's dx rows: each rank's T rows of a buffer padded to whole tiles (a view)
    T = s_dx[0].shape[0]
    padded = torch.zeros(len(s_dx), -(-T // TILE) * TILE, s_dx[0].shape[1], dtype=s_dx[0].dtype)
    padded[:, :T] = torch.stack(s_dx)
    return None, None, partials, dx, dwg, dwu, dwd, SharedGrads(padded[:, :T], *s_dw)


def _emulated_saved(leaves, idx, E_loc):
    """What the megakernel's training forward saves, computed in torch (NaN where nothing is
    saved, so a row read through a wrong index shows)."""
    from mok_cute.virtual_backward import VirtualSaved

    xs, w, wg, wu, wd, *sh = (t.detach() for t in leaves)
    R, T, K = idx.shape
    inter = wg.shape[2]
    t, P = _tables(idx, E_loc)
    preact = torch.full((P, 2 * inter), float("nan"), dtype=torch.bfloat16)
    gate_up = torch.cat([wg, wu], dim=2).reshape(R * E_loc, 2 * inter, -1).float()
    for r in range(R):
        rows = (t["row_token"][r] >= 0).nonzero().flatten()
        peer, token, k = (t[f][r][rows].long() for f in ("row_peer", "row_token", "row_k"))
        x_rows = xs[peer, token].float()
        experts = idx[peer, token, k].long()
        preact[t["row_slot"][r][rows].long()] = torch.einsum(
            "mh,mih->mi", x_rows, gate_up[experts]).to(torch.bfloat16)
    shared_preact = torch.empty(0, dtype=torch.bfloat16)
    if sh:
        shared_preact = torch.cat([xs.float() @ sh[0].float().transpose(1, 2),
                                   xs.float() @ sh[1].float().transpose(1, 2)],
                                  dim=2).to(torch.bfloat16)
    return VirtualSaved(preact, shared_preact, t["row_slot"], t["row_peer"], t["row_token"],
                        t["row_k"], t["tile_expert"], t["num_tiles"], t["expert_offsets"])


def _cpu_problem(R, T, H, I, E_loc, K, Is, routing, gen):
    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(torch.bfloat16)

    idx = _routing(R, T, K, E_loc, routing, gen)
    w = torch.softmax(torch.randn(R, T, K, generator=gen), dim=2)
    leaves = [rnd(R, T, H), w, rnd(R, E_loc, I, H, scale=H ** -0.5),
              rnd(R, E_loc, I, H, scale=H ** -0.5), rnd(R, E_loc, H, I, scale=I ** -0.5)]
    if Is:
        leaves += [rnd(R, Is, H, scale=H ** -0.5), rnd(R, Is, H, scale=H ** -0.5),
                   rnd(R, H, Is, scale=Is ** -0.5)]
    return leaves, idx


@pytest.mark.parametrize("R,T,K,E_loc,Is,routing", [
    (1, 40, 4, 8, 64, "skew"), (3, 30, 3, 2, 64, "silent_rank"), (4, 16, 10, 4, 0, "uniform"),
    (8, 1, 2, 2, 64, "uniform"),
    (5, 9, 2, 1, 64, "empty_expert")])
def test_backward_plumbing_matches_autograd_with_emulated_kernels(R, T, K, E_loc, Is, routing,
                                                                  gen, monkeypatch):
    """``moe_backward_virtual`` end to end on the CPU, its kernels (the gathers, the
    backward megakernel, the shared expert's GEMMs, the k-sum) replaced by torch emulations and
    the forward's saved g | u computed in torch: every gradient matches autograd on the
    reference, so each row reads its own g | u and weight, each expert its own rows, and
    every dx row and partial reaches its (peer, token, k)."""
    from mok_cute import expert_backward, virtual_backward
    from mok_cute.kernels import token_ops

    from mok_cute import megakernel_backward

    monkeypatch.setattr(expert_backward, "_expert_backward", _emulated_expert_backward)
    monkeypatch.setattr(virtual_backward, "_expert_backward", _emulated_expert_backward)
    # with a shared expert (Is = 64) every rank's runs in the launch: emulated with it
    in_launch = []
    monkeypatch.setattr(megakernel_backward, "expert_grads",
                        lambda *a, **kw: in_launch.append(1) or _emulated_expert_grads(*a, **kw))
    monkeypatch.setattr(token_ops, "gather_rows", token_ops.gather_rows_ref)
    def weighted_ksum(y, w, shared=None, out=None, row_index=None):
        assert shared is None or shared.is_contiguous()  # the kernel's precondition
        return token_ops.weighted_ksum_ref(token_ops.gather_rows_ref(y, row_index), w, shared)

    monkeypatch.setattr(token_ops, "weighted_ksum", weighted_ksum)
    H, I = 64, 64
    leaves, idx = _cpu_problem(R, T, H, I, E_loc, K, Is, routing, gen)
    d_out = torch.randn(R, T, H, generator=gen).to(torch.bfloat16)
    xs, w, wg, wu, wd, *sh = leaves
    got = virtual_backward.moe_backward_virtual(d_out, xs, w, wg, wu, wd, tuple(sh) or None,
                                                _emulated_saved(leaves, idx, E_loc))
    for t in leaves:
        t.requires_grad_(True)
    reference.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared=tuple(sh) or None).backward(d_out)
    for name, g, t in zip(NAMES, got, leaves):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        _close(g.float(), t.grad.float(), name)
    assert_tokens_close(got[0], xs.grad, tol=DX_TOKEN_TOL, what="d_xs")
    assert len(in_launch) == (1 if Is else 0)
    if not Is:
        assert got[5:] == (None, None, None)


@pytest.mark.parametrize("R,T,K,E_loc,Is,routing", [
    (3, 30, 3, 2, 64, "empty_expert"), (2, 24, 10, 5, 0, "skew")])
def test_backward_plumbing_adds_weight_gradients_into_main_grads(R, T, K, E_loc, Is, routing,
                                                                 gen, monkeypatch):
    """``moe_backward_virtual(main_grads=...)`` on the emulated kernels (as above): every
    weight gradient is added into its fp32 buffer (random to start with: an accumulation,
    not a store), None is returned for it, and the sum is autograd's gradient; a weight
    without a buffer (up) still gets its gradient returned."""
    from mok_cute import expert_backward, megakernel_backward, virtual_backward
    from mok_cute.kernels import token_ops

    monkeypatch.setattr(expert_backward, "_expert_backward", _emulated_expert_backward)
    monkeypatch.setattr(virtual_backward, "_expert_backward", _emulated_expert_backward)
    monkeypatch.setattr(megakernel_backward, "expert_grads", _emulated_expert_grads)
    monkeypatch.setattr(token_ops, "gather_rows", token_ops.gather_rows_ref)
    monkeypatch.setattr(token_ops, "weighted_ksum",
                        lambda y, w, shared=None, out=None, row_index=None:
                        token_ops.weighted_ksum_ref(token_ops.gather_rows_ref(y, row_index), w,
                                                    shared))
    H, I = 64, 64
    leaves, idx = _cpu_problem(R, T, H, I, E_loc, K, Is, routing, gen)
    d_out = torch.randn(R, T, H, generator=gen).to(torch.bfloat16)
    xs, w, wg, wu, wd, *sh = leaves
    weights = [wg, wu, wd, *sh] + [None] * (3 - len(sh))
    starts = [None if t is None or i == 1 else torch.randn(t.shape, generator=gen) * 0.01
              for i, t in enumerate(weights)]
    buffers = [None if b is None else b.clone() for b in starts]
    got = virtual_backward.moe_backward_virtual(
        d_out, xs, w, wg, wu, wd, tuple(sh) or None, _emulated_saved(leaves, idx, E_loc),
        main_grads=expert_backward.MainGrads(*buffers))
    for t in leaves:
        t.requires_grad_(True)
    reference.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared=tuple(sh) or None).backward(d_out)
    for i, (name, t) in enumerate(zip(NAMES[2:], weights)):
        if t is None:
            continue
        if starts[i] is None:  # no buffer: returned as before
            _close(got[2 + i].float(), t.grad.float(), name)
        else:
            assert got[2 + i] is None, name
            _close(buffers[i] - starts[i], t.grad.float(), name)
    _close(got[0].float(), xs.grad.float(), "d_xs")


@pytest.mark.parametrize("R,Is", [(1, 64), (3, 0), (3, 128)])
def test_fake_implementations_give_the_real_shapes(R, Is):
    """The virtual custom ops' fakes: what torch.compile traces with."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    importlib.import_module("mok_cute.autograd")  # registers the ops

    T, H, I, E_loc, K = 77, 256, 192, 4, 3
    cap = schedule_capacity(R, T, K, E_loc, TILE)
    rows = saved_preact_rows(R, R, T, K, E_loc, TILE)
    with FakeTensorMode():
        xs = torch.empty(R, T, H, dtype=torch.bfloat16, device="cuda")
        idx = torch.empty(R, T, K, dtype=torch.int32, device="cuda")
        w = torch.empty(R, T, K, dtype=torch.float32, device="cuda")
        wg = torch.empty(R, E_loc, I, H, dtype=torch.bfloat16, device="cuda")
        wd = torch.empty(R, E_loc, H, I, dtype=torch.bfloat16, device="cuda")
        sh = ((torch.empty(R, Is, H, dtype=torch.bfloat16, device="cuda"),) * 2
              + (torch.empty(R, H, Is, dtype=torch.bfloat16, device="cuda"),)
              if Is else (None,) * 3)
        outs = torch.ops.mok_cute.moe_forward_virtual_train(
            xs, idx, w, wg, wg, wd, *sh, True, [128, -1, -1, -1, 0, 1 << 16, 1, -1, -1, 0],
            5000.0, [8192, 8, 8], *NO_MAIN, None)
        assert [tuple(o.shape) for o in outs] == [
            (R, T, H), (rows, 2 * I), (R, T, 2 * Is) if Is else (0,), (R, cap), (R, cap),
            (R, cap), (R, cap), (R, cap // TILE), (R,), (R, E_loc + 1)]
        grads = torch.ops.mok_cute.moe_backward_virtual(xs, xs, w, wg, wg, wd, *sh,
                                                        list(outs[1:]), [True] * 6,
                                                        [8192, 8, 8], "bf16", 0, *NO_MAIN)
        want = [(R, T, H), (R, T, K), (R, E_loc, I, H), (R, E_loc, I, H), (R, E_loc, H, I)]
        want += [(R, Is, H), (R, Is, H), (R, H, Is)] if Is else [(0,)] * 3
        assert [tuple(g.shape) for g in grads] == want


@pytest.mark.parametrize("config", [
    mok.MoKConfig(),
    mok.MoKConfig(num_comm_sms=8, minibatch_tokens=256, ring_tokens=512, timeline=True,
                  timeline_capacity=4096, megakernel=mok.MegakernelOptions(
                      rows_in_place=False, tickets="strided", fc1_lead=2)),
])
def test_megakernel_config_survives_the_custom_op_arguments(config):
    from mok_cute.autograd import _launch_config, _launch_fields

    back = _launch_config(_launch_fields(config), 1234.0)
    for field in ("tile_m", "num_comm_sms", "minibatch_tokens", "ring_tokens", "timeline",
                  "timeline_capacity", "megakernel"):
        assert getattr(back, field) == getattr(config, field), field
    assert back.timeout_ms == 1234.0 and back.backend == "megakernel" and not back.check_ids


# ---------------------------------------------------------------------- numerics (GPU)
def _problem(R, T, H, I, E_loc, K, Is=0, seed=0, routing="uniform", same_shared=False):
    """Leaves [xs, w, wg, wu, wd, (ws_gate, ws_up, ws_down)] with a leading R, and the ids."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(torch.bfloat16)

    idx = _routing(R, T, K, E_loc, routing, torch.Generator().manual_seed(seed)).cuda()
    w = torch.softmax(torch.randn(R, T, K, device="cuda", generator=g), dim=2)
    leaves = [rnd(R, T, H), w, rnd(R, E_loc, I, H, scale=H ** -0.5),
              rnd(R, E_loc, I, H, scale=H ** -0.5), rnd(R, E_loc, H, I, scale=I ** -0.5)]
    if Is:
        n = 1 if same_shared else R
        shared = [rnd(n, Is, H, scale=H ** -0.5), rnd(n, Is, H, scale=H ** -0.5),
                  rnd(n, H, Is, scale=Is ** -0.5)]
        leaves += [s.expand(R, -1, -1).contiguous() for s in shared]
    for t in leaves:
        t.requires_grad_(True)
    return leaves, idx


def _forward(impl, leaves, idx, config=None):
    xs, w, wg, wu, wd, *sh = leaves
    shared = tuple(sh) if sh else None
    if impl == "reference":
        return reference.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared=shared,
                                             config=config)
    return mok.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared=shared,
                                   config=config or mok.MoKConfig(timeout_ms=5000.0))


def _grads(impl, leaves, idx, d_out, config=None):
    for t in leaves:
        t.grad = None
    out = _forward(impl, leaves, idx, config)
    if impl != "reference":  # the kernels' custom op, not a fallback to the reference
        assert "moe_forward_virtual_train" in out.grad_fn.name(), out.grad_fn.name()
    out.backward(d_out)
    return out.detach(), [None if t.grad is None else t.grad.detach().clone() for t in leaves]


def _assert_matches_reference(name, leaves, idx, d_out, config=None, ref_config=None):
    out, got = _grads("kernel", leaves, idx, d_out, config)
    ref_out, want = _grads("reference", leaves, idx, d_out, ref_config)
    assert_tokens_close(out, ref_out, what=f"{name}: out")
    for name_, g, w in zip(NAMES, got, want):
        if name_ == "d_topk_weights":
            g, w = g.float(), w.float()
        _close(g, w, f"{name}: {name_}")
    assert_tokens_close(got[0], want[0], tol=DX_TOKEN_TOL, what=f"{name}: d_xs")
    return out, got


CASES = {
    # name: (R, T, H, I, E_loc, K, Is, routing)
    "R1": (1, 200, 256, 128, 8, 4, 0, "uniform"),
    "R1_shared_K10": (1, 77, 256, 128, 16, 10, 64, "uniform"),
    "R2_shared_skew": (2, 160, 256, 128, 4, 4, 128, "skew"),
    "R3_empty_expert": (3, 100, 320, 192, 4, 2, 0, "empty_expert"),
    "R4_silent_rank_shared": (4, 96, 256, 128, 4, 2, 64, "silent_rank"),
    "R8_K10": (8, 64, 256, 128, 2, 10, 0, "uniform"),
    "R8_T1_shared": (8, 1, 256, 128, 2, 2, 64, "uniform"),
    "R16_skew": (16, 32, 256, 128, 2, 2, 0, "skew"),
    "R72_shared": (72, 16, 256, 128, 1, 2, 64, "uniform"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_autograd_on_the_reference(name):
    R, T, H, I, E_loc, K, Is, routing = CASES[name]
    leaves, idx = _problem(R, T, H, I, E_loc, K, Is, seed=R + K, routing=routing)
    d_out = torch.randn(R, T, H, device="cuda").to(torch.bfloat16)
    out, got = _assert_matches_reference(name, leaves, idx, d_out)
    # a second run, the allocator's next blocks poisoned: the same bits
    poison_free_memory()
    out2, again = _grads("kernel", leaves, idx, d_out)
    assert torch.equal(out, out2)
    for name_, a, b in zip(NAMES, got, again):
        assert torch.equal(a, b), f"{name}: {name_} not bitwise reproducible"


@pytest.mark.gpu
def test_out_of_range_ids_without_the_check_get_zero_gradients():
    R, T, H, I, E_loc, K = 3, 64, 256, 128, 2, 3
    leaves, idx = _problem(R, T, H, I, E_loc, K, seed=4)
    bad = idx.clone()
    bad[0, 3, 1], bad[2, 7, 0] = 1000, -5
    d_out = torch.randn(R, T, H, device="cuda").to(torch.bfloat16)
    unchecked = mok.MoKConfig(timeout_ms=5000.0, check_ids=False)
    _, got = _assert_matches_reference("bad ids", leaves, bad, d_out, unchecked,
                                       mok.MoKConfig(check_ids=False))
    assert got[1][0, 3, 1] == 0 and got[1][2, 7, 0] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("R,Is", [(2, 0), (4, 64), (8, 128)])
def test_d_xs_and_d_topk_equal_one_rank_with_the_same_tokens_bitwise(R, Is):
    """R ranks of T tokens and E_loc experts each, against one rank holding all R * T tokens
    and R * E_loc experts (the same shared expert on every rank): out, d_xs and d_topk_weights
    bit for bit, on one virtual rank and on the one-GPU megakernel backend alike."""
    T, H, I, E_loc, K = 96, 256, 192, 4, 4
    leaves, idx = _problem(R, T, H, I, E_loc, K, Is, seed=R, routing="skew", same_shared=True)
    d_out = torch.randn(R, T, H, device="cuda").to(torch.bfloat16)
    out, got = _grads("kernel", leaves, idx, d_out)

    def one_rank(t, i):
        if i in (0, 1):  # xs, w: R * T tokens
            return t.detach().reshape(1, R * T, *t.shape[2:])
        if i < 5:  # every rank's experts on one
            return t.detach().reshape(1, R * E_loc, *t.shape[2:])
        return t.detach()[:1]  # the shared expert, the same on every rank

    single = [one_rank(t, i).clone().requires_grad_(True) for i, t in enumerate(leaves)]
    out1, got1 = _grads("kernel", single, idx.reshape(1, R * T, K), d_out.reshape(1, R * T, H))
    assert torch.equal(out.reshape(1, R * T, H), out1)
    assert torch.equal(got[0].reshape(1, R * T, H), got1[0]), "d_xs"
    assert torch.equal(got[1].reshape(1, R * T, K), got1[1]), "d_topk_weights"
    # the one-GPU training path of the megakernel backend
    x, w, wg, wu, wd, *sh = (t[0].detach().clone().requires_grad_(True) for t in single)
    gpu = mok.moe_forward(x, idx.reshape(R * T, K), w, wg, wu, wd, shared=tuple(sh) or None,
                          config=mok.MoKConfig(backend="megakernel", timeout_ms=5000.0))
    gpu.backward(d_out.reshape(R * T, H))
    assert torch.equal(gpu.detach(), out1[0])
    assert torch.equal(x.grad, got1[0][0]) and torch.equal(w.grad, got1[1][0])


@pytest.mark.gpu
def test_gradients_are_bitwise_across_comm_split_minibatch_and_ring():
    """Training through forwards of other comm splits, minibatches and a ring smaller than the
    routed rows (it wraps): every gradient bit for bit the same."""
    R, T, H, I, E_loc, K = 4, 256, 256, 128, 4, 4
    leaves, idx = _problem(R, T, H, I, E_loc, K, 64, seed=9, routing="skew")
    d_out = torch.randn(R, T, H, device="cuda").to(torch.bfloat16)
    base = mok.MoKConfig(timeout_ms=5000.0)
    out, want = _grads("kernel", leaves, idx, d_out, base)
    other = mok.MoKConfig(timeout_ms=5000.0, num_comm_sms=6, minibatch_tokens=256,
                          ring_tokens=512)
    out2, got = _grads("kernel", leaves, idx, d_out, other)
    assert torch.equal(out, out2)
    for name_, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), f"{name_} differs across comm split / minibatch / ring"


@pytest.mark.gpu
def test_frozen_inputs_get_no_gradient():
    """needs_input_grad: frozen experts skip their weight gradients, a frozen input skips
    d_xs; the gradients that are computed equal those of a call where everything trains."""
    leaves, idx = _problem(3, 64, 256, 128, 2, 2, 64, seed=5)
    d_out = torch.randn(3, 64, 256, device="cuda").to(torch.bfloat16)
    _, full = _grads("kernel", leaves, idx, d_out)
    for frozen in ([0], [2, 3], [4], [2, 3, 4], [5, 6, 7], [1]):
        for i, t in enumerate(leaves):
            t.requires_grad_(i not in frozen)
        _, part = _grads("kernel", leaves, idx, d_out)
        for i, (a, b) in enumerate(zip(part, full)):
            if i in frozen:
                assert a is None, (frozen, NAMES[i])
            else:
                assert torch.equal(a, b), (frozen, NAMES[i])


@pytest.mark.gpu
def test_config_timeline_records_the_training_step():
    """``MoKConfig(timeline=True)`` under autograd, 3 virtual ranks with a shared expert: the
    forward's and the backward's launches recorded in turn, the bits unchanged
    (``test_backward.assert_records_the_training_step``)."""
    from test_backward import assert_records_the_training_step

    leaves, idx = _problem(3, 64, 256, 128, 2, 2, 64, seed=6)
    d_out = torch.randn(3, 64, 256, device="cuda").to(torch.bfloat16)
    assert_records_the_training_step(lambda c: _forward("kernel", leaves, idx, c), leaves,
                                     d_out, mok.MoKConfig(timeout_ms=5000.0, check_ids=False))


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 3])
def test_opcheck(R):
    from mok_cute.autograd import _launch_fields

    leaves, idx = _problem(R, 64, 256, 128, 2, 2, 64, seed=7)
    xs, w, wg, wu, wd, sg, su, sd = (t.detach() for t in leaves)
    args = (xs, idx, w, wg, wu, wd, sg, su, sd, False,
            _launch_fields(mok.MoKConfig()), 5000.0, [8192, 8, 8], *NO_MAIN, None)
    torch.library.opcheck(torch.ops.mok_cute.moe_forward_virtual_train, args,
                          test_utils=("test_schema", "test_faketensor"))
    outs = torch.ops.mok_cute.moe_forward_virtual_train(*args)
    d_out = torch.randn_like(xs)
    torch.library.opcheck(torch.ops.mok_cute.moe_backward_virtual,
                          (d_out, xs, w, wg, wu, wd, sg, su, sd, list(outs[1:]), [True] * 6,
                           [8192, 8, 8], "bf16", 0, *NO_MAIN),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_compiled_call_equals_eager_bitwise():
    """torch.compile(fullgraph=True) of one moe_forward_virtual call and its backward: the
    custom ops run unchanged, so the output and every gradient equal eager's bit for bit."""
    leaves, idx = _problem(2, 96, 256, 128, 4, 4, 64, seed=5)
    d_out = torch.randn(2, 96, 256, device="cuda").to(torch.bfloat16)
    config = mok.MoKConfig(timeout_ms=5000.0, check_ids=False)

    def step(*ts):
        return _forward("kernel", list(ts), idx, config)

    from test_backward import _assert_compiled_equals_eager
    _assert_compiled_equals_eager(step, leaves, d_out)


@pytest.mark.gpu
def test_a_training_step_takes_no_host_sync():
    """With check_ids=False neither the saving launch nor the backward (the concatenation,
    the gathers, the backward megakernel, the shared expert, the k-sum) waits for the GPU."""
    leaves, idx = _problem(4, 64, 256, 128, 2, 4, 64, seed=3, routing="skew")
    d_out = torch.randn(4, 64, 256, device="cuda").to(torch.bfloat16)
    config = mok.MoKConfig(timeout_ms=5000.0, check_ids=False)
    _, want = _grads("kernel", leaves, idx, d_out, config)  # warm-up: compiles, caches tables
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _forward("kernel", leaves, idx, config)
        out.backward(d_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, t, w in zip(NAMES, leaves, want):
        assert torch.equal(t.grad, w), name
