"""Receive schedule: exact comparison against a slow pure-Python oracle."""

from __future__ import annotations

import pytest
import torch

from mok_cute.schedule import (
    ReceiveSchedule,
    build_receive_schedule,
    row_of_slot,
    schedule_capacity,
    slot_of_rows,
)


def oracle_schedule(topk_idx_all: list, rank: int, E_loc: int, tile_m: int) -> dict:
    """The schedule written out literally from its definition (lists, loops)."""
    R = len(topk_idx_all)
    T = len(topk_idx_all[0])
    K = len(topk_idx_all[0][0]) if T else 0
    per_expert = []
    for e in range(E_loc):
        target = rank * E_loc + e
        # Each peer's rows for this expert, (token, k) ascending.
        queues = [
            [(p, t, k) for t in range(T) for k in range(K) if topk_idx_all[p][t][k] == target]
            for p in range(R)
        ]
        rows = []
        j = 0
        while any(j < len(q) for q in queues):
            for q in queues:
                if j < len(q):
                    rows.append(q[j])
            j += 1
        per_expert.append(rows)
    counts = [len(rows) for rows in per_expert]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + (c + tile_m - 1) // tile_m * tile_m)
    capacity = ((R * T * K + E_loc * (tile_m - 1)) + tile_m - 1) // tile_m * tile_m
    row_peer = [-1] * capacity
    row_token = [-1] * capacity
    row_k = [-1] * capacity
    for e, rows in enumerate(per_expert):
        for i, (p, t, k) in enumerate(rows):
            row_peer[offsets[e] + i] = p
            row_token[offsets[e] + i] = t
            row_k[offsets[e] + i] = k
    tile_expert = []
    for tile in range(capacity // tile_m):
        start = tile * tile_m
        owner = -1
        for e in range(E_loc):
            if offsets[e] <= start < offsets[e + 1]:
                owner = e
        tile_expert.append(owner)
    return dict(
        capacity=capacity,
        row_peer=row_peer,
        row_token=row_token,
        row_k=row_k,
        expert_counts=counts,
        expert_offsets=offsets,
        tile_expert=tile_expert,
        num_tiles=[offsets[-1] // tile_m],
    )


def assert_matches_oracle(topk_idx_all: torch.Tensor, rank: int, E_loc: int, tile_m: int) -> ReceiveSchedule:
    sched = build_receive_schedule(topk_idx_all, rank, E_loc, tile_m)
    want = oracle_schedule(topk_idx_all.tolist(), rank, E_loc, tile_m)
    assert sched.capacity == want["capacity"]
    assert sched.capacity % tile_m == 0
    assert (sched.rank, sched.num_ranks, sched.num_local_experts, sched.tile_m) == (
        rank, topk_idx_all.shape[0], E_loc, tile_m,
    )
    for field in ("row_peer", "row_token", "row_k", "expert_counts", "expert_offsets", "tile_expert", "num_tiles"):
        got = getattr(sched, field)
        assert got.dtype == torch.int32, field
        assert got.device == topk_idx_all.device, field
        assert got.tolist() == want[field], field
    return sched


def random_routing(gen: torch.Generator, R: int, T: int, K: int, E: int, distinct: bool = True) -> torch.Tensor:
    """[R, T, K] global expert ids; distinct per token (like top-k) unless distinct=False."""
    if distinct:
        scores = torch.rand(R, T, E, generator=gen)
        return scores.topk(K, dim=-1).indices
    return torch.randint(0, E, (R, T, K), generator=gen)


# (R, T, K, E_loc): covers R = 1 ... 72, K = 1 and K = 10, T = 1.
CASES = [
    (1, 37, 4, 8),
    (1, 1, 1, 1),
    (1, 300, 10, 16),
    (2, 50, 2, 3),
    (3, 23, 5, 4),
    (8, 19, 8, 4),
    (16, 6, 10, 2),
    (72, 3, 6, 1),
    (72, 1, 10, 2),
    (5, 1, 1, 7),
]


@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("R,T,K,E_loc", CASES)
def test_matches_oracle_random(R, T, K, E_loc, tile_m):
    gen = torch.Generator().manual_seed(1000 * R + 10 * T + K + tile_m)
    # Distinct ids per token when possible (top-k routing); otherwise repeated ids.
    idx = random_routing(gen, R, T, K, R * E_loc, distinct=K <= R * E_loc and tile_m == 128)
    for rank in sorted({0, R // 2, R - 1}):
        assert_matches_oracle(idx, rank, E_loc, tile_m)


@pytest.mark.parametrize("R,T,K,E_loc", [(1, 200, 3, 4), (4, 40, 2, 3), (8, 20, 1, 2)])
def test_every_token_on_one_expert(R, T, K, E_loc):
    """All routing of every peer hits the same few experts of rank 0; other experts stay empty."""
    gen = torch.Generator().manual_seed(7)
    hot = torch.arange(K)  # K distinct experts, all on rank 0 when K <= E_loc ...
    idx = hot.view(1, 1, K).expand(R, T, K).contiguous()
    idx = idx[..., torch.randperm(K, generator=gen)].contiguous()
    sched = assert_matches_oracle(idx, 0, max(E_loc, K), 64)
    counts = sched.expert_counts.tolist()
    assert sum(counts) == R * T * K
    assert counts[:K] == [R * T] * K
    if R > 1:  # and rank 1 receives nothing at all
        empty = assert_matches_oracle(idx, 1, max(E_loc, K), 64)
        assert empty.num_tiles.tolist() == [0]
        assert (empty.row_peer == -1).all()
        assert (empty.tile_expert == -1).all()


def test_empty_experts_and_duplicates():
    """Routing with repeated ids inside a token and experts nobody picks."""
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 3, (4, 30, 4), generator=gen) * 3  # only experts 0, 3, 6 of 12
    for rank in range(4):
        sched = assert_matches_oracle(idx, rank, 3, 64)
        assert sched.expert_counts[1:].tolist() == [0, 0]


def test_single_token_single_expert():
    idx = torch.tensor([[[0]]])
    sched = assert_matches_oracle(idx, 0, 1, 128)
    assert sched.row_peer[:2].tolist() == [0, -1]
    assert sched.expert_offsets.tolist() == [0, 128]
    assert sched.num_tiles.tolist() == [1]


@pytest.mark.parametrize("tile_m", [1, 3, 8])
def test_small_and_odd_tile_heights(tile_m):
    gen = torch.Generator().manual_seed(tile_m)
    idx = random_routing(gen, 3, 11, 2, 6, distinct=False)
    for rank in range(3):
        assert_matches_oracle(idx, rank, 2, tile_m)
    empty = assert_matches_oracle(torch.empty(1, 0, 2, dtype=torch.int64), 0, 3, tile_m)
    assert empty.capacity == schedule_capacity(1, 0, 2, 3, tile_m)
    assert row_of_slot(empty, 0, 2).numel() == 0


def test_zero_tokens():
    idx = torch.empty(3, 0, 4, dtype=torch.int64)
    sched = assert_matches_oracle(idx, 2, 5, 64)
    assert sched.num_tiles.tolist() == [0]
    assert sched.capacity == schedule_capacity(3, 0, 4, 5, 64) == 5 * 64


def test_round_robin_order_by_hand():
    """A small case written out: peers interleave, a peer's rows stay in (token, k) order."""
    # R=2, T=3, K=2, E_loc=1 on rank 0 -> global experts {0 (rank 0), 1 (rank 1)}.
    idx = torch.tensor(
        [
            [[0, 1], [0, 1], [1, 0]],  # peer 0 sends (0,0), (1,0), (2,1) to expert 0
            [[1, 0], [1, 0], [1, 0]],  # peer 1 sends (0,1), (1,1), (2,1)
        ],
        dtype=torch.int32,
    )
    sched = build_receive_schedule(idx, 0, 1, tile_m=4)
    n = sched.expert_counts.tolist()[0]
    assert n == 6
    pairs = list(zip(sched.row_peer.tolist()[:8], sched.row_token.tolist()[:8], sched.row_k.tolist()[:8]))
    assert pairs == [(0, 0, 0), (1, 0, 1), (0, 1, 0), (1, 1, 1), (0, 2, 1), (1, 2, 1), (-1, -1, -1), (-1, -1, -1)]
    assert sched.expert_offsets.tolist() == [0, 8]
    assert sched.capacity == 16  # 2*3*2 + 1*3 = 15 -> 16
    assert sched.tile_expert.tolist() == [0, 0, -1, -1]


def test_int32_and_int64_agree():
    gen = torch.Generator().manual_seed(11)
    idx = random_routing(gen, 4, 17, 3, 8)
    a = build_receive_schedule(idx, 1, 2, 64)
    b = build_receive_schedule(idx.to(torch.int32), 1, 2, 64)
    for field in ("row_peer", "row_token", "row_k", "expert_counts", "expert_offsets", "tile_expert", "num_tiles"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_slot_maps_are_inverse_for_one_rank():
    gen = torch.Generator().manual_seed(5)
    T, K, E = 41, 6, 9
    idx = random_routing(gen, 1, T, K, E)
    sched = build_receive_schedule(idx, 0, E, 64)
    slots = slot_of_rows(sched, K)
    rows = row_of_slot(sched, T, K)
    assert slots.dtype == rows.dtype == torch.int32
    assert slots.shape == (sched.capacity,) and rows.shape == (T * K,)
    # Every slot has exactly one row, and mapping back gives the slot.
    assert (rows >= 0).all()
    assert sorted(rows.tolist()) == sorted(i for i, s in enumerate(slots.tolist()) if s >= 0)
    assert torch.equal(slots[rows.long()], torch.arange(T * K, dtype=torch.int32))
    # The row of slot (t, k) sits in the segment of its expert.
    offsets = sched.expert_offsets.tolist()
    for s, r in enumerate(rows.tolist()):
        e = int(idx[0].reshape(-1)[s])
        assert offsets[e] <= r < offsets[e + 1]
    # Padding rows map to -1.
    assert ((slots == -1) == (sched.row_token == -1)).all()


def test_row_of_slot_for_one_peer_of_many():
    gen = torch.Generator().manual_seed(9)
    R, T, K, E_loc = 3, 12, 2, 2
    idx = random_routing(gen, R, T, K, R * E_loc)
    sched = build_receive_schedule(idx, 1, E_loc, 64)
    for peer in range(R):
        rows = row_of_slot(sched, T, K, peer=peer)
        flat = idx[peer].reshape(-1)
        mine = (flat >= E_loc) & (flat < 2 * E_loc)
        assert ((rows >= 0) == mine).all()
        hit = rows[rows >= 0].long()
        assert (sched.row_peer[hit] == peer).all()
        assert torch.equal(slot_of_rows(sched, K)[hit], torch.nonzero(mine).flatten().to(torch.int32))


def test_bad_arguments_name_the_argument():
    idx = torch.zeros(2, 3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"topk_idx_all: expected shape \[R, T, K\]"):
        build_receive_schedule(idx[0], 0, 2)
    with pytest.raises(TypeError, match="topk_idx_all: expected dtype"):
        build_receive_schedule(idx.float(), 0, 2)
    with pytest.raises(ValueError, match="rank: expected an int <= 1, got 2"):
        build_receive_schedule(idx, 2, 2)
    with pytest.raises(ValueError, match="num_local_experts: expected an int >= 1, got 0"):
        build_receive_schedule(idx, 0, 0)
    with pytest.raises(ValueError, match="tile_m: expected an int >= 1, got 0"):
        build_receive_schedule(idx, 0, 2, tile_m=0)
    with pytest.raises(ValueError, match=r"topk_idx_all: expected global expert ids in \[0, 4\)"):
        build_receive_schedule(idx + 4, 0, 2)
    with pytest.raises(ValueError, match=r"topk_idx_all: expected global expert ids in \[0, 4\)"):
        build_receive_schedule(idx - 1, 0, 2)
    sched = build_receive_schedule(idx, 0, 2)
    with pytest.raises(ValueError, match="peer: expected an int <= 1, got 5"):
        row_of_slot(sched, 3, 2, peer=5)


def test_validate_false_skips_host_read():
    """validate=False must not read ids back: an out-of-range id just lands on no expert."""
    idx = torch.tensor([[[0, 7]]])
    sched = build_receive_schedule(idx, 0, 2, 64, validate=False)
    assert sched.expert_counts.tolist() == [1, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu():
    gen = torch.Generator().manual_seed(21)
    for R, T, K, E_loc in [(1, 4096, 8, 32), (8, 512, 8, 4), (72, 64, 10, 2)]:
        idx = random_routing(gen, R, T, K, R * E_loc)
        for rank in (0, R - 1):
            cpu = build_receive_schedule(idx, rank, E_loc, 128)
            gpu = build_receive_schedule(idx.cuda(), rank, E_loc, 128, validate=False)
            for field in ("row_peer", "row_token", "row_k", "expert_counts", "expert_offsets", "tile_expert", "num_tiles"):
                assert torch.equal(getattr(cpu, field), getattr(gpu, field).cpu()), field


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_build_has_no_host_sync():
    idx = torch.randint(0, 64, (8, 256, 8), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        build_receive_schedule(idx, 3, 8, 128, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
