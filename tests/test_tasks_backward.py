"""The backward megakernel's task list (mok_cute/tasks_backward.py, issue 32), on the CPU.

The list's structure: every wait is on counters signalled by exactly ``target`` tasks of lower
index (deadlock freedom, ``check``), the design's order (pulls before their dgrads, weight
gradients after every dgrad, the barrier before the first k-sum). Its semantics: the float64 CPU
model (tests/backward_task_model.py) runs every rank's list in a random order its waits allow
and gives the gradients of autograd on the reference, on R = 1 (in place, and with comm tasks),
2, 3 and 4 ranks, skewed routing, an empty expert, a rank that receives nothing, the shared
expert, x rows pulled again, K = 10. A forgotten dependency or an impossible wait is caught.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from backward_task_model import Problem, run_backward_lists
from mok_cute import reference
from mok_cute.tasks import Role
from mok_cute.tasks_backward import (EXPERT_TILES, BackwardCounter as BC, BackwardListParams,
                                     BackwardTaskType as BT, build_backward_static,
                                     build_backward_task_list)

TILE_M = 16


def _params(T, H, I, K, Is=0, **kw):
    base = dict(hidden=H, intermediate=I, num_tokens=T, top_k=K, tile_m=TILE_M, dgated_tile_n=16,
                dx_tile_n=32, minibatch_tokens=32, comm_task_rows=8, ksum_rows=8,
                shared_intermediate=Is, wgrad_gate_up_tile=(16, 32), wgrad_down_tile=(32, 16))
    base.update(kw)
    return BackwardListParams(**base)


@pytest.mark.parametrize("kw", [{}, {"x_resident": False}, {"comm_tasks": False},
                                {"shared_intermediate": 128}])
def test_list_is_well_formed_and_ordered(kw):
    p = BackwardListParams(hidden=512, intermediate=384, num_tokens=300, top_k=4, **kw)
    tile_expert = np.array([0, 0, 0, 2, 2, 3, 3, 3, 3, 4])  # expert 1 and 5 empty
    tl = build_backward_task_list(tile_expert, 6, p)
    tl.check()
    kinds = [t.type for t in tl]
    last_dgrad = max(i for i, k in enumerate(kinds) if k in (BT.FC2_DGRAD, BT.FC1_DGRAD))
    first_wgrad = min(i for i, k in enumerate(kinds) if k in (BT.WGRAD_GATE_UP, BT.WGRAD_DOWN))
    first_ksum = kinds.index(BT.KSUM)
    assert last_dgrad < first_wgrad
    assert kinds.index(BT.BARRIER) < first_ksum
    assert all(k == BT.KSUM for k in kinds[first_ksum:])
    # one wgrad tile per (expert with rows, block): experts 1 and 5 have none
    assert {t.tile for t in tl if t.type == BT.WGRAD_DOWN} == {0, 2, 3, 4}
    assert sum(k == BT.WGRAD_GATE_UP for k in kinds) == 4 * 3 * 4
    assert sum(k == BT.FC2_DGRAD for k in kinds) == 10 * 3
    comm = tl.queue(Role.COMM)
    ksums = [t for t in tl if t.type == BT.KSUM]
    assert len(ksums) == 3 * (128 // 32)  # 300 tokens: three token tiles of four chunks
    if kw.get("comm_tasks", True):
        # over a group the comm CTAs run the BARRIER, then the k-sums (under the weight
        # gradients); the BARRIER waits on every push and every x re-pull
        tail = [t.type for t in comm[-len(ksums) - 1:]]
        assert tail == [BT.BARRIER] + [BT.KSUM] * len(ksums)
        assert all(t.role == Role.COMM for t in ksums)
        barrier = next(t for t in tl if t.type == BT.BARRIER)
        pulled = [w for w in barrier.waits if w[0] == BC.X_PULLED]
        assert pulled == ([] if kw.get("x_resident", True) else [(BC.X_PULLED, 0, 10, 4)])
        assert sum(t.type == BT.REVERSE_COMBINE for t in comm) == 10 * 4
        assert sum(t.type == BT.REPULL_X for t in comm) == (0 if kw.get("x_resident", True) else 40)
    else:
        assert comm == [] and BT.REVERSE_COMBINE not in kinds


@pytest.mark.parametrize("kw", [{}, {"x_resident": False}, {"comm_tasks": False}])
def test_static_list_has_every_tile_and_every_experts_weight_gradients(kw):
    p = BackwardListParams(hidden=512, intermediate=384, num_tokens=300, top_k=4, **kw)
    tl = build_backward_static(20, 6, p)
    tl.check()
    assert tl.static
    assert sum(t.type == BT.FC2_DGRAD for t in tl) == 20 * 3
    assert {t.tile for t in tl if t.type == BT.WGRAD_DOWN} == set(range(6))
    waits = {w for t in tl if t.type in (BT.WGRAD_DOWN, BT.WGRAD_GATE_UP) for w in t.waits}
    assert all(w[1] == w[2] == EXPERT_TILES for w in waits)
    assert {t.minibatch for t in tl if t.type == BT.FC2_DGRAD} == set(range(3))  # 8 tiles a mb


def test_check_rejects_a_wait_on_a_later_task_and_a_wrong_target():
    p = BackwardListParams(hidden=256, intermediate=128, num_tokens=100, top_k=2)
    tl = build_backward_task_list(np.array([0, 1, 1]), 2, p)
    tl.check()
    ksum = next(i for i, t in enumerate(tl.tasks) if t.type == BT.KSUM)
    barrier = next(i for i, t in enumerate(tl.tasks) if t.type == BT.BARRIER)
    moved = list(tl.tasks)
    moved[barrier], moved[ksum] = moved[ksum], moved[barrier]
    bad = dataclasses.replace(tl, tasks=[dataclasses.replace(t, index=i) for i, t in enumerate(moved)])
    with pytest.raises(AssertionError):
        bad.check()
    fc1 = next(i for i, t in enumerate(tl.tasks) if t.type == BT.FC1_DGRAD)
    wrong = list(tl.tasks)
    wrong[fc1] = dataclasses.replace(wrong[fc1], waits=((BC.DGATED, 0, 1, 99),))
    with pytest.raises(AssertionError):
        dataclasses.replace(tl, tasks=wrong).check()


def _problem(R, T, H, I, E, K, Is=0, routing="uniform", seed=0):
    g = torch.Generator().manual_seed(seed)
    E_loc = E // R
    scores = torch.rand(R, T, E, generator=g)
    if routing == "hot":
        scores[..., 0] += 2.0  # global expert 0 in every token's top-k
    elif routing == "quiet_rank":
        scores[..., (R - 1) * E_loc:] -= 2.0  # the last rank's experts never chosen
    elif routing == "empty":
        scores[..., 1] -= 2.0
    idx = scores.topk(K, dim=-1).indices
    w = torch.softmax(torch.randn(R, T, K, generator=g, dtype=torch.float64), dim=-1)
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g, dtype=torch.float64) * scale  # noqa: E731
    shared = None
    if Is:
        shared = (rnd(R, Is, H, scale=H ** -0.5), rnd(R, Is, H, scale=H ** -0.5),
                  rnd(R, H, Is, scale=Is ** -0.5))
    return Problem(xs=rnd(R, T, H), idx=idx, w=w, wg=rnd(R, E_loc, I, H, scale=H ** -0.5),
                   wu=rnd(R, E_loc, I, H, scale=H ** -0.5), wd=rnd(R, E_loc, H, I, scale=I ** -0.5),
                   d_out=rnd(R, T, H), shared=shared)


def _reference_grads(prob: Problem):
    leaves = [prob.xs, prob.w, prob.wg, prob.wu, prob.wd, *(prob.shared or ())]
    leaves = [t.clone().requires_grad_(True) for t in leaves]
    xs, w, wg, wu, wd, *sh = leaves
    with reference._exact_numerics():
        out = reference.moe_forward_virtual(xs, prob.idx, w, wg, wu, wd,
                                            shared=tuple(sh) if sh else None)
    out.backward(prob.d_out)
    return [t.grad for t in leaves]


CASES = {
    # name: (R, T, H, I, E, K, Is, routing, list keywords)
    "R1_in_place": (1, 45, 64, 48, 4, 2, 0, "uniform", {"comm_tasks": False}),
    "R1_comm_shared": (1, 45, 64, 48, 4, 2, 32, "uniform", {}),
    "R2_hot": (2, 40, 64, 48, 8, 3, 0, "hot", {}),
    "R3_repull_x_shared": (3, 33, 64, 40, 6, 2, 24, "uniform", {"x_resident": False}),
    "R4_quiet_rank": (4, 24, 32, 48, 8, 2, 0, "quiet_rank", {}),
    "R2_empty_expert_K10": (2, 20, 32, 32, 12, 10, 16, "empty", {}),
}


@pytest.mark.parametrize("static", [False, True], ids=["actual", "static"])
@pytest.mark.parametrize("name", list(CASES))
def test_model_of_the_list_gives_the_reference_gradients(name, static):
    """``static``: the lists a kernel gets (every capacity tile, dead and no-op tasks, each
    weight gradient's expert range at run time), run by the run-time rules."""
    R, T, H, I, E, K, Is, routing, kw = CASES[name]
    prob = _problem(R, T, H, I, E, K, Is, routing, seed=len(name))
    params = _params(T, H, I, K, Is, **kw)
    got = run_backward_lists(prob, params, tile_m=TILE_M, seed=R, static=static)
    want = _reference_grads(prob)
    names = ["d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"]
    pairs = list(zip(names, got[:5], want[:5]))
    if Is:
        pairs += list(zip(["d_ws_gate", "d_ws_up", "d_ws_down"], got[5], want[5:]))
    for what, a, b in pairs:
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-10, f"{name}: {what} off by {err:.2e}"


def test_a_forgotten_dependency_is_a_read_before_write():
    """FC1_DGRAD without its wait on the tile's dgated N-tiles: some order the remaining waits
    allow runs it first, and the model sees it read dG | dU nobody wrote."""
    prob = _problem(2, 40, 64, 48, 8, 3)

    def forget(tl):
        tl.tasks = [dataclasses.replace(t, waits=()) if t.type == BT.FC1_DGRAD else t
                    for t in tl.tasks]

    caught = 0
    for seed in range(4):
        try:
            run_backward_lists(prob, _params(40, 64, 48, 3), tile_m=TILE_M, seed=seed,
                               mutate=forget)
        except AssertionError as exc:
            assert "FC1_DGRAD" in str(exc) and "before it was written" in str(exc)
            caught += 1
    assert caught >= 3


def test_an_unsatisfiable_wait_is_reported_not_hung():
    prob = _problem(2, 40, 64, 48, 8, 3)

    def impossible(tl):
        tl.tasks = [dataclasses.replace(t, waits=((BC.PUSHED, 0, 1, 99),))
                    if t.type == BT.BARRIER else t for t in tl.tasks]

    with pytest.raises(RuntimeError, match="no task can run"):
        run_backward_lists(prob, _params(40, 64, 48, 3), tile_m=TILE_M, mutate=impossible)


@pytest.mark.parametrize("kw", [{}, {"x_resident": False}, {"comm_tasks": False},
                                {"shared_intermediate": 128}])
def test_device_encoding_round_trips_and_the_ticket_walk_reaches_every_live_task(kw):
    """encode_backward / decode_backward give the tasks back (flops are not encoded); for
    every number of live minibatches the ticket walk of queue_tables (the live prefix, then
    the tail) fetches every task that is not dead, each once, in queue order."""
    from mok_cute.tasks_backward import (SHARED_DGRADS, decode_backward, encode_backward,
                                         queue_tables)

    p = BackwardListParams(hidden=512, intermediate=384, num_tokens=300, top_k=4, **kw)
    tl = build_backward_static(20, 6, p)
    rows = encode_backward(tl)
    assert rows.dtype == torch.int32
    assert decode_backward(rows) == [dataclasses.replace(t, flops=0) for t in tl]
    qtab, live_len, tail_begin = queue_tables(tl)
    for role in (Role.COMM, Role.COMPUTE):
        queue = [i for i in qtab[role] if i >= 0]
        for live in range(live_len.shape[1]):
            walk = queue[:live_len[role, live]] + queue[tail_begin[role]:]
            def alive(t):  # the shared expert's dgrads whatever the routing
                return t.minibatch < live or t.type in SHARED_DGRADS

            fetched = [i for i in walk if alive(tl[i])]  # the rest: dead, skipped
            wanted = [t.index for t in tl if t.role == role and alive(t)]
            assert fetched == wanted, (role, live)


def test_a_virtual_launch_lists_every_ranks_shared_expert():
    """``shared_ranks`` = L (a virtual ranks' launch, no comm tasks): L ranks' shared dgrads
    (rank r's token tile s as tile r * ceil(T / tile_m) + s), each FC1 dgrad waiting on its
    own tile's FC2 dgrads, and per rank its weight gradients (tile: the rank) waiting on that
    rank's tiles alone; the list checks, and comm tasks with L > 1 are refused."""
    T, tiles, L = 300, -(-300 // 128), 3
    p = BackwardListParams(hidden=512, intermediate=256, num_tokens=T, top_k=2,
                           shared_intermediate=384, shared_ranks=L, comm_tasks=False)
    tl = build_backward_static(5, 4, p)
    tl.check()
    assert tl.counter_sizes[BC.SHARED_DGATED] == tl.counter_sizes[BC.SHARED_DX] == L * tiles
    fc2 = [t for t in tl if t.type == BT.SHARED_FC2_DGRAD]
    assert sorted({t.tile for t in fc2}) == list(range(L * tiles))
    for t in tl:
        if t.type == BT.SHARED_FC1_DGRAD:
            assert t.waits == ((BC.SHARED_DGATED, t.tile, 1, -(-384 // p.dgated_tile_n)),)
        if t.type in (BT.SHARED_WGRAD_GATE_UP, BT.SHARED_WGRAD_DOWN):
            assert t.waits[0][:3] == (BC.SHARED_DGATED, t.tile * tiles, tiles)
    wgrads = {t.tile for t in tl if t.type == BT.SHARED_WGRAD_DOWN}
    assert wgrads == set(range(L))
    with pytest.raises(ValueError, match="shared_ranks"):
        BackwardListParams(hidden=512, intermediate=256, num_tokens=T, top_k=2,
                           shared_intermediate=384, shared_ranks=L)
