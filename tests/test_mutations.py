"""Mutation tests (issue 30, item 6): one wrong (token, k) slot fails the per-token check.

Each defect is injected where a bug would put it, one slot at a time:

``drop``     the slot is in no receive schedule: the schedule build is monkeypatched to build
             from ids where that slot names no expert, while the k-sum still sees the true
             ids. Its y row is never computed; the k-sum adds what the combine buffer holds
             there, zeroed first, so the defect shows as a missing term, not as poison.
``expert``   the slot's row sits in another expert's segment: the build sees an expert the
             token did not pick (on the other rank at R = 2).
``weight``   its router weight 10 % off (the token's largest).
``swap``     its token's two smallest router weights exchanged.

CPU: the schedules run by ``execute_schedules`` below, a float64 executor written apart from
the kernels and the reference, doing what the kernels do with a schedule: every M-tile's rows
through its expert (bf16 g, u, h, y), each row's y pushed to its source rank's combine slot,
the k-sum as the kernels do it. Unmutated it passes the per-token check against
``mok_cute.reference``; each mutation fails it, and the old whole-output check
(relative Frobenius < 1e-2) passes every one of them. GPU (marked gpu): the same problem and
defects on the expert path and on the megakernel at R = 1 and virtual R = 2; the failing
token is the mutated one, every other token still passes.
"""

from __future__ import annotations

import pytest
import torch

from mok_cute import reference, schedule
from per_token import TOKEN_TOL, assert_tokens_close, frobenius_error, naive_expert, token_errors
from poison import poison_free_memory

T_TOTAL, H, I, E, K = 1024, 256, 128, 8, 4  # 1024 tokens over the ranks; 8 experts in all
MUTATIONS = ["drop", "expert", "weight", "swap"]


def make_problem(R: int, device="cpu"):
    """R ranks' inputs with leading R (drawn on the CPU: the same numbers on every device)."""
    T, E_loc = T_TOTAL // R, E // R
    g = torch.Generator().manual_seed(30_6)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(torch.bfloat16)

    xs = rnd(R, T, H)
    idx = torch.rand(R, T, E, generator=g).topk(K, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(R, T, K, generator=g), dim=-1)
    wg, wu = rnd(R, E_loc, I, H, scale=H ** -0.5), rnd(R, E_loc, I, H, scale=H ** -0.5)
    wd = rnd(R, E_loc, H, I, scale=I ** -0.5)
    return tuple(t.to(device) for t in (xs, idx, w, wg, wu, wd))


def target(args):
    """The mutated token (the last rank's, a third of the way in) and its slots ordered by
    weight, smallest first."""
    xs, idx, w = args[:3]
    R, T = xs.shape[:2]
    r, t = R - 1, T // 3
    order = torch.argsort(w[r, t].cpu()).tolist()
    return r, t, order


def other_expert(args, r, t, k) -> int:
    """An expert token (r, t) did not pick, on another rank than slot k's expert if R > 1."""
    idx, E_loc = args[1], args[3].shape[1]
    picked = set(idx[r, t].tolist())
    owner = int(idx[r, t, k]) // E_loc
    candidates = [e for e in range(E) if e not in picked and (E == E_loc or e // E_loc != owner)]
    return candidates[0]


def mutate(mutation: str, args, monkeypatch):
    """Inject ``mutation`` into the schedule build (drop, expert) or the weights (weight,
    swap). Returns the arguments to run with and (rank, token)."""
    r, t, order = target(args)
    xs, idx, w, *rest = args
    if mutation in ("drop", "expert"):
        k = order[0]  # the token's smallest weight: the hardest slot to see
        new_id = E if mutation == "drop" else other_expert(args, r, t, k)
        build = schedule.build_receive_schedule

        def mutated_build(topk_idx_all, *a, **kw):
            ids = topk_idx_all.clone()
            ids[r, t, k] = new_id  # E: no rank's expert (a slot routed nowhere)
            return build(ids, *a, **kw)

        monkeypatch.setattr(schedule, "build_receive_schedule", mutated_build)
        return args, (r, t)
    w = w.clone()
    if mutation == "weight":
        w[r, t, order[-1]] *= 1.1
    else:  # swap the two smallest (two nearly equal weights swapped change nothing)
        a, b = order[0], order[1]
        w[r, t, a], w[r, t, b] = args[2][r, t, b], args[2][r, t, a]
    return (xs, idx, w, *rest), (r, t)


def assert_caught(out, ref, hit):
    """The per-token check fails, at the mutated token and there only; the output is finite
    (the failure is the defect, not unwritten memory)."""
    assert torch.isfinite(out.float()).all()
    with pytest.raises(AssertionError, match="relative error"):
        assert_tokens_close(out, ref)
    errs = token_errors(out, ref)
    bad = (errs > TOKEN_TOL).nonzero().tolist()
    assert bad == [list(hit)], f"tokens over the tolerance: {bad}, mutated {hit}"


# ------------------------------------------------------------------------------ CPU
def execute_schedules(xs, idx, w, wg, wu, wd, tile_m=128):
    """What the kernels do with the receive schedules, in float64 with the bf16 roundings:
    each rank runs its M-tiles (rows of one expert; padding rows skipped), sends every row's
    y to its source rank's combine slot (token, k); each rank's k-sum then adds, for ascending
    k, fp32(w) * fp32(combine[t, k]) from 0 (a slot whose id is out of range adds 0)."""
    R, T = xs.shape[:2]
    E_loc = wg.shape[1]
    scheds = schedule.build_receive_schedules(idx, E_loc, tile_m, validate=False)
    combine = torch.zeros(R, T, K, H, dtype=torch.bfloat16)
    for r in range(R):
        s = scheds[r]
        for tile in range(int(s.num_tiles[0])):
            rows = slice(tile * tile_m, (tile + 1) * tile_m)
            peer, tok, k = (f[rows].long() for f in (s.row_peer, s.row_token, s.row_k))
            real = tok >= 0
            if not real.any():
                continue
            e = int(s.tile_expert[tile])
            v = xs[peer[real], tok[real]]
            combine[peer[real], tok[real], k[real]] = naive_expert(v, wg[r, e], wu[r, e], wd[r, e])
    out = torch.zeros(R, T, H)
    valid = (idx >= 0) & (idx < R * E_loc)
    for k in range(K):
        wk = torch.where(valid[..., k], w[..., k].float(), torch.zeros(()))
        out = out + wk[..., None] * combine[:, :, k].float()
    return out.to(torch.bfloat16)


@pytest.mark.parametrize("R", [1, 2])
def test_cpu_schedule_executor_passes_the_per_token_check(R):
    args = make_problem(R)
    out = execute_schedules(*args)
    ref = reference.moe_forward_virtual(*args)
    assert_tokens_close(out, ref, what=f"schedule executor R={R}")


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("R", [1, 2])
def test_cpu_mutation_is_caught_and_the_old_check_missed_it(R, mutation, monkeypatch):
    args = make_problem(R)
    ref = reference.moe_forward_virtual(*args)
    run_args, hit = mutate(mutation, args, monkeypatch)
    out = execute_schedules(*run_args)
    assert_caught(out, ref, hit)
    assert float(token_errors(out, ref)[hit]) >= 3 * TOKEN_TOL  # a clear margin
    old = frobenius_error(out, ref)
    assert old < 1e-2, f"the old check would have caught this one too: {old:.2e}"


def test_cpu_mutations_change_the_schedule():
    """The monkeypatched build really moves the slot: gone from every schedule (drop), in the
    other rank's segment of the new expert (expert)."""
    args = make_problem(2)
    r, t, order = target(args)
    k, E_loc = order[0], args[3].shape[1]
    with pytest.MonkeyPatch.context() as mp:
        mutate("drop", args, mp)
        scheds = schedule.build_receive_schedules(args[1], E_loc, validate=False)
        for q in range(2):
            s = scheds[q]
            assert not ((s.row_peer == r) & (s.row_token == t) & (s.row_k == k)).any()
    new = other_expert(args, r, t, k)
    with pytest.MonkeyPatch.context() as mp:
        mutate("expert", args, mp)
        s = schedule.build_receive_schedules(args[1], E_loc, validate=False)[new // E_loc]
        row = ((s.row_peer == r) & (s.row_token == t) & (s.row_k == k)).nonzero().flatten()
        assert row.numel() == 1
        assert int(s.tile_expert[int(row) // 128]) == new % E_loc
        assert new // E_loc != int(args[1][r, t, k]) // E_loc


# ------------------------------------------------------------------------------ GPU
def _poison_allocator(nbytes: int = 1 << 28):
    poison_free_memory(nbytes)


@pytest.fixture
def own_plans():
    from mok_cute import megakernel

    megakernel.release_plans()
    yield
    megakernel.release_plans()


def _expert_path(args):
    import mok_cute as mok

    _poison_allocator()
    out = mok.moe_forward(*(a[0] for a in args), config=mok.MoKConfig(backend="kernel"))
    torch.cuda.synchronize()
    return out.unsqueeze(0)


def _megakernel(args, combine_fill: float):
    """One launch of the plan for these shapes; every rank's combine buffer filled with
    ``combine_fill`` first (NaN: a slot the k-sum reads unwritten shows; 0: a dropped slot is a
    missing term), the output poisoned."""
    from mok_cute import megakernel
    from mok_cute.config import MoKConfig

    xs, idx, w, wg, wu, wd = args
    config = MoKConfig(timeout_ms=5000.0)
    plan = megakernel.plan_for(xs, wg, wd, None, idx, config)
    for r in range(xs.shape[0]):
        plan.side.peers.view(r, "combine").fill_(combine_fill)
    out = torch.full(xs.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    plan.run(xs, idx, w, wg, wu, wd, None, config.timeout_ms, out=out)
    plan.raise_pending_errors()
    torch.cuda.synchronize()
    return out


PATHS = {"expert_path": 1, "megakernel_r1": 1, "megakernel_r2": 2}


def _run_path(path, args, mutation):
    if path == "expert_path":
        return _expert_path(args)
    return _megakernel(args, 0.0 if mutation == "drop" else float("nan"))


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
def test_gpu_unmutated_passes(path, own_plans):
    args = make_problem(PATHS[path], "cuda")
    out = _run_path(path, args, None)
    assert_tokens_close(out, reference.moe_forward_virtual(*args), what=path)


@pytest.mark.gpu
@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("path", list(PATHS))
def test_gpu_mutation_is_caught(path, mutation, monkeypatch, own_plans):
    args = make_problem(PATHS[path], "cuda")
    ref = reference.moe_forward_virtual(*args)
    run_args, hit = mutate(mutation, args, monkeypatch)
    out = _run_path(path, run_args, mutation)
    assert_caught(out, ref, hit)
