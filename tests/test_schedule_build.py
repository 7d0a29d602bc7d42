"""The GPU build of a rank's receive schedule (kernels/schedule_build.py).

CI: the kernels compile for sm_90a (match.any, warp shuffles, no spills), and a step-by-step
Python model of the two kernels (their chunks, rounds, warps, scan, (j, peer) placement and
search, with the same constants) equals the torch build for R = 1 to 8 peers, so the
algorithm is checked without a GPU.
GPU: the kernels equal the torch build bitwise on random, skewed and invalid routing.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mok_cute import schedule as sched_mod
from mok_cute.kernels import schedule_build as sb


def _as_numpy(s, T: int, K: int) -> dict:
    """The schedule's fields; ``slot_rows`` as ``row_of_slot`` of the schedule's own rank."""
    out = {name: getattr(s, name).cpu().numpy().astype(np.int64)
           for name in ("row_token", "row_k", "row_peer", "expert_counts", "expert_offsets",
                        "tile_expert", "num_tiles")}
    out["slot_rows"] = sched_mod.row_of_slot(s, T, K, s.rank).cpu().numpy().astype(np.int64)
    return out


def _torch_build(ids: torch.Tensor, rank: int, E: int) -> dict:
    R, T, K = ids.shape
    return _as_numpy(sched_mod.build_receive_schedule(ids, rank, E, 128, validate=False,
                                                      gpu_build=False), T, K)


def _model(ids: np.ndarray, rank: int, E: int, tile_m: int) -> dict:
    """The two kernels, step by step, in numpy (one CTA at a time; threads as vectors)."""
    R, T, K = ids.shape
    n = T * K
    flat = ids.reshape(R, n).astype(np.int64) - rank * E
    capacity = sched_mod.schedule_capacity(R, T, K, E, tile_m)
    chunks = sb.num_chunks(n)
    expert_of = np.where((flat >= 0) & (flat < E), flat, E)
    rank_in_chunk = np.zeros((R, n), np.int64)
    chunk_counts = np.zeros((E + 1, chunks, R), np.int64)
    # count kernel, CTA (c, p)
    for p in range(R):
        for c in range(chunks):
            running = np.zeros(E + 1, np.int64)
            for r in range(sb.ROUNDS):
                slots = c * sb.CHUNK + r * sb.THREADS + np.arange(sb.THREADS)
                ex = np.where(slots < n, expert_of[p, np.minimum(slots, n - 1)], E)
                warp_counts = np.zeros((sb.WARPS, E + 1), np.int64)
                below = np.zeros(sb.THREADS, np.int64)
                for w in range(sb.WARPS):
                    lanes = ex[32 * w:32 * w + 32]
                    for lane in range(32):
                        below[32 * w + lane] = np.sum(lanes[:lane] == lanes[lane])
                    for e in np.unique(lanes):
                        warp_counts[w, e] = np.sum(lanes == e)
                new_running = running.copy()
                for t in range(sb.THREADS):
                    w, e = t // 32, ex[t]
                    earlier = running[e] + warp_counts[:w, e].sum()
                    if slots[t] < n:
                        rank_in_chunk[p, slots[t]] = earlier + below[t]
                    if below[t] == 0 and warp_counts[w + 1:, e].sum() == 0:
                        new_running[e] = earlier + warp_counts[w, e]
                running = new_running
            chunk_counts[:, c, p] = running
    # place kernel: the same n[q, e], totals and offsets in every CTA; bases differ
    peer_rows = chunk_counts[:E].sum(axis=1).T  # [R, E]
    total = peer_rows.sum(axis=0)
    seg = sb.ScheduleBuild(E, tile_m).scan_segment
    padded = (total + tile_m - 1) // tile_m * tile_m
    partial = np.array([padded[t * seg:(t + 1) * seg].sum() for t in range(sb.THREADS)])
    per_lane = sb.THREADS // 32
    lane_sums = partial.reshape(32, per_lane).sum(axis=1)
    inclusive = lane_sums.copy()
    for s in range(sb.SCAN_STEPS):  # shfl.up scan: lanes below 2**s keep their value
        up = np.concatenate([inclusive[:1 << s], inclusive[:-(1 << s)]])
        inclusive = np.where(np.arange(32) >= (1 << s), inclusive + up, inclusive)
    seg_base = np.concatenate([[0], np.cumsum(partial)[:-1]])
    assert (seg_base.reshape(32, per_lane)[:, 0] == inclusive - lane_sums).all()
    offsets = np.zeros(E + 1, np.int64)
    for t in range(sb.THREADS):
        run = seg_base[t]
        for e in range(t * seg, min((t + 1) * seg, E)):
            offsets[e] = run
            run += padded[e]
    offsets[E] = inclusive[31]
    row_token = np.full(capacity, -99, np.int64)
    row_k = np.full(capacity, -99, np.int64)
    row_peer = np.full(capacity, -99, np.int64)
    slot_rows = np.full(n, -99, np.int64)
    for p in range(R):
        for c in range(chunks):
            base = chunk_counts[:E, :c, p].sum(axis=1)
            for slot in range(c * sb.CHUNK, min((c + 1) * sb.CHUNK, n)):
                e = expert_of[p, slot]
                row = -1
                if e < E:
                    j = base[e] + rank_in_chunk[p, slot]
                    row = offsets[e]
                    for q in range(R):
                        row += min(peer_rows[q, e], j) + (1 if q < p and peer_rows[q, e] > j else 0)
                    row_token[row], row_k[row], row_peer[row] = slot // K, slot % K, p
                if p == rank:
                    slot_rows[slot] = row
    for c in range(chunks):  # peer-0 CTAs
        for e in range(c, E, chunks):
            for row in range(offsets[e] + total[e], offsets[e + 1]):
                row_token[row] = row_k[row] = row_peer[row] = -1
    row_token[offsets[E]:] = row_k[offsets[E]:] = row_peer[offsets[E]:] = -1
    tile_expert = np.full(capacity // tile_m, -1, np.int64)
    steps = sb.ScheduleBuild(E, tile_m).search_steps
    for tile in range(capacity // tile_m):
        start = tile * tile_m
        if start < offsets[E]:
            lo, hi = 0, E
            for _ in range(steps):
                mid = (lo + hi) // 2
                if lo < hi:
                    lo, hi = (mid + 1, hi) if offsets[mid + 1] <= start else (lo, mid)
            tile_expert[tile] = lo
    return dict(row_token=row_token, row_k=row_k, row_peer=row_peer, expert_counts=total,
                expert_offsets=offsets, tile_expert=tile_expert,
                num_tiles=np.array([offsets[E] // tile_m]), slot_rows=slot_rows)


def _routing(kind: str, R: int, T: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """[R, T, K] global ids over R * E experts."""
    G = R * E
    if kind == "uniform":
        return torch.rand(R, T, max(G, K), generator=gen).topk(K, dim=-1).indices % G
    if kind == "one_expert":
        return torch.full((R, T, K), G - 1, dtype=torch.int64)
    if kind == "skewed":  # half the slots on expert 0, some experts empty
        ids = torch.randint(0, max(G // 2, 1), (R, T, K), generator=gen)
        return torch.where(torch.rand(R, T, K, generator=gen) < 0.5, torch.zeros_like(ids), ids)
    if kind == "invalid":  # ids outside [0, R * E) route nowhere
        return torch.randint(-3, G + 3, (R, T, K), generator=gen)
    raise ValueError(kind)


MODEL_CASES = [  # (routing, R, rank, T, K, E)
    ("uniform", 1, 0, 77, 3, 5),  # E not a power of two, K odd
    ("skewed", 1, 0, 300, 8, 32),  # 2400 slots: two chunks
    ("invalid", 1, 0, 100, 10, 7),
    ("one_expert", 1, 0, 129, 2, 4),
    ("uniform", 1, 0, 1, 1, 1),
    ("uniform", 1, 0, 700, 6, 300),  # E > THREADS: two experts per scan segment
    ("uniform", 2, 1, 90, 4, 6),
    ("skewed", 3, 0, 300, 8, 4),  # several chunks per peer, a rank with most rows
    ("one_expert", 4, 3, 33, 2, 2),  # every row to the last rank's last expert
    ("invalid", 8, 5, 20, 10, 3),
    ("uniform", 8, 2, 0, 4, 3),  # no tokens
]


@pytest.mark.parametrize("kind,R,rank,T,K,E", MODEL_CASES)
def test_model_of_the_kernels_equals_the_torch_build(kind, R, rank, T, K, E, gen):
    ids = _routing(kind, R, T, K, E, gen)
    want = _torch_build(ids, rank, E)
    if T == 0:  # the host wrapper launches nothing; the model needs a slot
        assert want["num_tiles"][0] == 0 and (want["row_token"] == -1).all()
        return
    got = _model(ids.numpy(), rank, E, 128)
    for name, value in want.items():
        assert np.array_equal(got[name], value), name


@pytest.mark.parametrize("num_experts,ids_int64", [(32, True), (5, False), (1024, True)])
def test_compiles_for_sm90a(num_experts, ids_int64, tmp_path):
    compiled = sb.compile_schedule_build(num_experts=num_experts, ids_int64=ids_int64,
                                         options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = compiled.__ptx__
    assert "match.any.sync" in ptx and "shfl.sync.up" in ptx
    assert len(re.findall(r"\.visible \.entry", ptx)) == 2  # count, place


def _gpu_builds(ids, E, first_rank=0, count=None, poison=None):
    """The GPU build of ranks first_rank .. + count - 1 as ReceiveSchedules."""
    R, T, K = ids.shape
    capacity = sched_mod.schedule_capacity(R, T, K, E, 128)
    return sched_mod.ReceiveSchedules(**sb.build_schedules(
        ids, E, 128, capacity, first_rank=first_rank, count=count, poison=poison))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="num_experts"):
        sb.ScheduleBuild(sb.MAX_EXPERTS + 1)
    with pytest.raises(TypeError, match="topk_idx_all"):
        _gpu_builds(torch.zeros(1, 4, 2, dtype=torch.float32), 4)
    with pytest.raises(ValueError, match="topk_idx_all"):
        sb.build_schedules(torch.zeros(4, 2, dtype=torch.int64), 4, 128, 128)
    with pytest.raises(ValueError, match="first_rank"):
        _gpu_builds(torch.zeros(2, 4, 2, dtype=torch.int64), 4, first_rank=2)
    assert not sb.supports(8, sb.MAX_PEER_EXPERTS // 8 + 1) and sb.supports(72, 64)


@pytest.mark.parametrize("first_rank,count", [(0, None), (1, 2), (3, 1)])
def test_stacked_schedules_equal_the_per_rank_builds(first_rank, count, gen):
    """build_receive_schedules (the torch path here) stacks exactly the per-rank schedules."""
    ids = _routing("skewed", 4, 40, 3, 5, gen)
    got = sched_mod.build_receive_schedules(ids, 5, 16, first_rank=first_rank, count=count)
    ranks = range(first_rank, 4 if count is None else first_rank + count)
    assert len(got) == len(ranks) and got.first_rank == first_rank
    for i, r in enumerate(ranks):
        want = _as_numpy(sched_mod.build_receive_schedule(ids, r, 5, 16), 40, 3)
        have = _as_numpy(got[i], 40, 3)
        assert got[i].rank == r
        for name, value in want.items():
            assert np.array_equal(have[name], value), (r, name)
    assert list(s.rank for s in got) == list(ranks)
    with pytest.raises(IndexError):
        got[len(ranks)]


def test_stacked_schedules_name_bad_arguments(gen):
    ids = _routing("uniform", 2, 8, 2, 3, gen)
    with pytest.raises(ValueError, match="first_rank"):
        sched_mod.build_receive_schedules(ids, 3, first_rank=2)
    with pytest.raises(ValueError, match="count"):
        sched_mod.build_receive_schedules(ids, 3, first_rank=1, count=2)
    with pytest.raises(ValueError, match="topk_idx_all"):
        sched_mod.build_receive_schedules(ids[0], 3)
    with pytest.raises(ValueError, match="topk_idx_all"):
        sched_mod.build_receive_schedules(ids + 6, 3)  # ids past R * E


def test_cpu_ids_take_the_torch_build_even_with_gpu_build_on(gen):
    ids = _routing("uniform", 2, 16, 2, 3, gen)
    got = sched_mod.build_receive_schedule(ids, 1, 3, gpu_build=True)
    assert got.slot_rows is None  # the torch general build, not the kernels


GPU_CASES = MODEL_CASES + [
    ("uniform", 1, 0, 4096, 8, 32),  # dsv3_ep8_rank: 16 chunks
    ("uniform", 1, 0, 32768, 4, 64),  # sonic_120b: 64 chunks
    ("skewed", 1, 0, 16384, 8, 128),
    ("invalid", 1, 0, 1000, 10, 1024),
    ("uniform", 8, 3, 2048, 8, 48),  # kimi_k2.7 at EP 8
    ("skewed", 72, 71, 64, 4, 4),  # NVL72-sized group, small shapes
]


@pytest.mark.gpu
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("kind,R,rank,T,K,E", GPU_CASES)
def test_gpu_build_equals_the_torch_build(kind, R, rank, T, K, E, ids_dtype, gen):
    ids = _routing(kind, R, T, K, E, gen).to(ids_dtype).cuda()
    want = _torch_build(ids, rank, E)
    got = _gpu_builds(ids, E, rank, 1, poison=-77)[0]
    again = _gpu_builds(ids, E, rank, 1, poison=12345)[0]
    got_np, again_np = _as_numpy(got, T, K), _as_numpy(again, T, K)
    for name, value in want.items():
        assert np.array_equal(got_np[name], value), name
        assert np.array_equal(again_np[name], value), f"{name}: not reproducible"


@pytest.mark.gpu
@pytest.mark.parametrize("kind,R,T,K,E", [("uniform", 8, 2048, 8, 48), ("skewed", 3, 300, 4, 5),
                                          ("invalid", 16, 64, 10, 4), ("skewed", 72, 16, 2, 4)])
def test_all_ranks_in_one_pair_of_launches_equal_the_torch_build(kind, R, T, K, E, gen):
    """The virtual launch's build: every rank's schedule from the same two launches (grid z =
    rank), each rank's slice bitwise equal to its own torch build, outputs poisoned first."""
    ids = _routing(kind, R, T, K, E, gen).cuda()
    for first, count in ((0, R), (R // 2, R - R // 2), (R - 1, 1)):
        got = _gpu_builds(ids, E, first, count, poison=-77)
        assert len(got) == count
        for i in range(count):
            want = _torch_build(ids, first + i, E)
            have = _as_numpy(got[i], T, K)
            for name, value in want.items():
                assert np.array_equal(have[name], value), (first + i, name)
