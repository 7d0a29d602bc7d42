"""Receive schedule: which (peer, token, k) rows each local expert of this rank pulls, where.

For rank `rank` of an EP group of R ranks with E_loc experts each, the all-gathered routing
`topk_idx_all [R, T, K]` (global expert ids) determines, for every local expert e, the rows
routed to global expert `rank * E_loc + e`. They are laid out in one padded row buffer:

    expert 0 rows | pad | expert 1 rows | pad | ...        each segment padded to tile_m

so every M-tile of the grouped GEMM belongs to exactly one expert. Inside a segment rows are
interleaved round-robin over peers: the j-th row of peer 0, the j-th row of peer 1, ...
(skipping peers with fewer than j+1 rows), then j+1; a peer's own rows are in ascending
(token, k) order. Consecutive rows therefore come from different GPUs during dispatch.

Everything is built with sort / cumsum / searchsorted / gather on the device of
`topk_idx_all`: no host synchronisation, no Python loop over rows, and a capacity computed
from shapes alone (every (peer, token, k) could land on this rank), so the kernels compile
once per shape and never recompile when counts change. Keys are unique, so the result is
deterministic and identical on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import check_expert_ids, check_int, check_tensor

__all__ = [
    "ReceiveSchedule",
    "ReceiveSchedules",
    "build_receive_schedule",
    "build_receive_schedules",
    "schedule_capacity",
    "slot_of_rows",
    "row_of_slot",
]


@dataclass
class ReceiveSchedule:
    """One rank's receive schedule. All tensors are int32 on the device of topk_idx_all."""

    rank: int
    num_ranks: int
    num_local_experts: int
    tile_m: int
    capacity: int  # static bound on padded rows, from shapes only (multiple of tile_m)
    row_peer: torch.Tensor  # [capacity] source rank of each padded row, -1 for padding rows
    row_token: torch.Tensor  # [capacity] token index on that peer, -1 for padding
    row_k: torch.Tensor  # [capacity] k slot, -1 for padding
    expert_counts: torch.Tensor  # [E_loc] real rows per local expert
    expert_offsets: torch.Tensor  # [E_loc + 1] padded segment starts; [-1] = total padded rows
    tile_expert: torch.Tensor  # [capacity // tile_m] local expert of each M-tile, -1 past the end
    num_tiles: torch.Tensor  # [1] number of valid M-tiles (device scalar)
    # [T * K] padded row of each of this rank's own (token, k) slots, -1 if none; filled by
    # the R == 1 torch build (a by-product of its scatter) and by the GPU build, None
    # otherwise: `row_of_slot` computes it then.
    slot_rows: torch.Tensor | None = None


@dataclass
class ReceiveSchedules:
    """The receive schedules of ranks ``first_rank`` .. ``first_rank + len - 1`` of one routing,
    stacked: each ``ReceiveSchedule`` tensor with a leading rank axis (``num_tiles`` [n]), as
    one megakernel launch over several ranks reads them. ``self[i]`` is rank
    ``first_rank + i``'s schedule (views)."""

    first_rank: int
    num_ranks: int
    num_local_experts: int
    tile_m: int
    capacity: int
    row_peer: torch.Tensor  # [n, capacity]
    row_token: torch.Tensor  # [n, capacity]
    row_k: torch.Tensor  # [n, capacity]
    expert_counts: torch.Tensor  # [n, E_loc]
    expert_offsets: torch.Tensor  # [n, E_loc + 1]
    tile_expert: torch.Tensor  # [n, capacity // tile_m]
    num_tiles: torch.Tensor  # [n]
    slot_rows: torch.Tensor | None = None  # [n, T * K], or None (see ReceiveSchedule)

    def __len__(self) -> int:
        return self.num_tiles.shape[0]

    def __getitem__(self, i: int) -> ReceiveSchedule:
        if not isinstance(i, int) or not 0 <= i < len(self):
            raise IndexError(f"schedule index {i!r} out of range for {len(self)} ranks")
        return ReceiveSchedule(
            rank=self.first_rank + i, num_ranks=self.num_ranks,
            num_local_experts=self.num_local_experts, tile_m=self.tile_m, capacity=self.capacity,
            row_peer=self.row_peer[i], row_token=self.row_token[i], row_k=self.row_k[i],
            expert_counts=self.expert_counts[i], expert_offsets=self.expert_offsets[i],
            tile_expert=self.tile_expert[i], num_tiles=self.num_tiles[i:i + 1],
            slot_rows=None if self.slot_rows is None else self.slot_rows[i])

    @classmethod
    def stack(cls, schedules: list[ReceiveSchedule]) -> "ReceiveSchedules":
        """Consecutive ranks' schedules built one by one (one rank: views, no copy)."""
        first = schedules[0]
        if [s.rank for s in schedules] != list(range(first.rank, first.rank + len(schedules))):
            raise ValueError("schedules: expected consecutive ranks")
        stack = (lambda ts: ts[0].unsqueeze(0)) if len(schedules) == 1 else torch.stack
        field = lambda name: stack([getattr(s, name) for s in schedules])  # noqa: E731
        slot_rows = None
        if all(s.slot_rows is not None for s in schedules):
            slot_rows = field("slot_rows")
        return cls(first_rank=first.rank, num_ranks=first.num_ranks,
                   num_local_experts=first.num_local_experts, tile_m=first.tile_m,
                   capacity=first.capacity, row_peer=field("row_peer"),
                   row_token=field("row_token"), row_k=field("row_k"),
                   expert_counts=field("expert_counts"), expert_offsets=field("expert_offsets"),
                   tile_expert=field("tile_expert"), num_tiles=field("num_tiles").reshape(-1),
                   slot_rows=slot_rows)


def schedule_capacity(num_ranks: int, tokens: int, top_k: int, num_local_experts: int, tile_m: int) -> int:
    """Padded-row bound: all R*T*K rows on this rank plus < tile_m padding per expert."""
    rows = num_ranks * tokens * top_k + num_local_experts * (tile_m - 1)
    return -(-rows // tile_m) * tile_m


def saved_preact_rows(launch_ranks: int, num_peers: int, tokens: int, top_k: int,
                      num_local_experts: int, tile_m: int) -> int:
    """Rows of the g | u a training launch of the megakernel saves for its ranks: one rank
    alone keeps them by (token, k) slot (T * K); one rank of a group by receive row (its
    schedule's capacity); several virtual ranks in one pool by global slot (peer * T + token)
    * K + k: every (peer, token, k) lands on exactly one rank, so R * T * K rows, no padding."""
    if num_peers == 1:
        return tokens * top_k
    if launch_ranks == 1:
        return schedule_capacity(num_peers, tokens, top_k, num_local_experts, tile_m)
    return launch_ranks * tokens * top_k


def _check_routing(topk_idx_all: torch.Tensor, num_local_experts: int, tile_m: int) -> tuple[int, int, int]:
    """The build's argument checks; returns (R, T, K) of ``topk_idx_all``."""
    check_tensor("topk_idx_all", topk_idx_all, dtype=(torch.int32, torch.int64), contiguous=False)
    if topk_idx_all.dim() != 3:
        raise ValueError(
            f"topk_idx_all: expected shape [R, T, K], got {list(topk_idx_all.shape)}"
        )
    R, T, K = topk_idx_all.shape
    if R < 1 or K < 1:
        raise ValueError(f"topk_idx_all: expected R >= 1 and K >= 1, got shape {list(topk_idx_all.shape)}")
    check_int("num_local_experts", num_local_experts, min_value=1)
    check_int("tile_m", tile_m, min_value=1)
    return R, T, K


def build_receive_schedule(
    topk_idx_all: torch.Tensor,
    rank: int,
    num_local_experts: int,
    tile_m: int = 128,
    *,
    validate: bool = True,
    gpu_build: bool | None = None,
) -> ReceiveSchedule:
    """Build rank `rank`'s receive schedule from the all-gathered `topk_idx_all [R, T, K]`.

    validate=True also checks that every id is in [0, R * num_local_experts); on CUDA that is
    one device->host read. Callers that already validated (the kernel path) pass False to keep
    the build free of host synchronisation. gpu_build: CUDA ids built by the two kernels of
    kernels/schedule_build.py (True, and None: bitwise equal to the torch build and faster:
    dsv3 layer 5.15 -> 4.93 ms) or by torch ops (False).
    """
    R, T, K = _check_routing(topk_idx_all, num_local_experts, tile_m)
    check_int("rank", rank, min_value=0, max_value=R - 1)
    E_loc = num_local_experts
    if validate:
        check_expert_ids(topk_idx_all, R * E_loc, "topk_idx_all")
    if gpu_build is not False and topk_idx_all.is_cuda:
        from mok_cute.kernels import schedule_build

        if schedule_build.supports(R, E_loc):
            capacity = schedule_capacity(R, T, K, E_loc, tile_m)
            return ReceiveSchedules(**schedule_build.build_schedules(
                topk_idx_all, E_loc, tile_m, capacity, first_rank=rank, count=1))[0]
    if R == 1:
        return _build_single_rank(topk_idx_all[0], E_loc, tile_m)

    device = topk_idx_all.device
    TK = T * K
    N = R * TK  # candidate rows: every (peer, slot)
    capacity = schedule_capacity(R, T, K, E_loc, tile_m)
    i64 = dict(dtype=torch.int64, device=device)

    # Candidate c = peer * T*K + slot (slot = token * K + k); its local expert, E_loc = "not mine".
    local = topk_idx_all.reshape(N).to(torch.int64) - rank * E_loc
    expert = torch.where((local >= 0) & (local < E_loc), local, torch.full_like(local, E_loc))
    candidate = torch.arange(N, **i64)
    TK1 = max(TK, 1)

    # j = position of a row among the rows of its own (peer, expert) pair, in slot order.
    # Candidates are enumerated peer-major, slot ascending, so a stable sort on
    # (peer, expert) keeps slot order inside each pair.
    pair_sorted, pair_order = torch.sort(torch.div(candidate, TK1, rounding_mode="floor") * (E_loc + 1) + expert, stable=True)
    j = candidate - torch.searchsorted(pair_sorted, pair_sorted, right=False)
    pair_expert = pair_sorted % (E_loc + 1)
    pair_peer = torch.div(pair_sorted, E_loc + 1, rounding_mode="floor")

    # Final order: (expert, j, peer), a unique key; "not mine" rows (expert E_loc) sort last.
    row_sorted, order_in_pairs = torch.sort((pair_expert * TK1 + j) * R + pair_peer, stable=True)
    row_order = pair_order[order_in_pairs]  # candidate index of each row, in final order
    row_expert = torch.div(row_sorted, TK1 * R, rounding_mode="floor")  # E_loc past my rows

    # Counts and padded offsets per local expert (rows of expert e are contiguous in row_order).
    expert_ids = torch.arange(E_loc + 1, **i64)
    real_start = torch.searchsorted(row_expert, expert_ids, right=False)  # [E_loc + 1]
    counts = real_start[1:] - real_start[:-1]
    padded = torch.div(counts + (tile_m - 1), tile_m, rounding_mode="floor") * tile_m
    offsets = torch.cat([torch.zeros(1, **i64), torch.cumsum(padded, 0)])

    # Fill the padded buffer by gathering: padded row -> (expert, index inside segment).
    pos = torch.arange(capacity, **i64)
    pos_expert = torch.searchsorted(offsets[1:], pos, right=True).clamp_(max=E_loc - 1)
    in_segment = pos - offsets[pos_expert]
    valid = (in_segment < counts[pos_expert]) & (pos < offsets[-1])
    if N:
        source = row_order[(real_start[pos_expert] + in_segment).clamp_(0, N - 1)]
        minus1 = torch.full_like(pos, -1)
        row_peer = torch.where(valid, torch.div(source, TK1, rounding_mode="floor"), minus1)
        row_slot = torch.where(valid, source % TK1, minus1)
        row_token = torch.where(valid, torch.div(row_slot, K, rounding_mode="floor"), minus1)
        row_k = torch.where(valid, row_slot % K, minus1)
    else:
        row_peer = row_token = row_k = torch.full((capacity,), -1, **i64)

    tile_expert, num_tiles = _tile_table(offsets, capacity, tile_m)

    i32 = torch.int32
    return ReceiveSchedule(
        rank=rank,
        num_ranks=R,
        num_local_experts=E_loc,
        tile_m=tile_m,
        capacity=capacity,
        row_peer=row_peer.to(i32),
        row_token=row_token.to(i32),
        row_k=row_k.to(i32),
        expert_counts=counts.to(i32),
        expert_offsets=offsets.to(i32),
        tile_expert=tile_expert.to(i32),
        num_tiles=num_tiles.to(i32),
    )


def build_receive_schedules(
    topk_idx_all: torch.Tensor,
    num_local_experts: int,
    tile_m: int = 128,
    *,
    first_rank: int = 0,
    count: int | None = None,
    validate: bool = True,
    gpu_build: bool | None = None,
) -> ReceiveSchedules:
    """The receive schedules of ranks ``first_rank`` .. ``+ count - 1`` (default: all from
    ``first_rank`` on), one ``build_receive_schedule`` each, stacked. (All of them from one
    pair of GPU launches measured level with one pair per rank: docs/measurements.md.)"""
    R = _check_routing(topk_idx_all, num_local_experts, tile_m)[0]
    check_int("first_rank", first_rank, min_value=0, max_value=R - 1)
    if count is None:
        count = R - first_rank
    check_int("count", count, min_value=1, max_value=R - first_rank)
    if validate:
        check_expert_ids(topk_idx_all, R * num_local_experts, "topk_idx_all")
    return ReceiveSchedules.stack([
        build_receive_schedule(topk_idx_all, r, num_local_experts, tile_m, validate=False,
                               gpu_build=gpu_build)
        for r in range(first_rank, first_rank + count)])


def _tile_table(offsets: torch.Tensor, capacity: int, tile_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of each M-tile, -1 past the last valid tile; number of valid M-tiles)."""
    tile_start = torch.arange(capacity // tile_m, dtype=torch.int64, device=offsets.device) * tile_m
    tile_expert = torch.searchsorted(offsets[1:], tile_start, right=True)
    tile_expert = torch.where(tile_start < offsets[-1], tile_expert, torch.full_like(tile_expert, -1))
    return tile_expert, torch.div(offsets[-1:], tile_m, rounding_mode="floor")


def _build_single_rank(topk_idx: torch.Tensor, E: int, tile_m: int) -> ReceiveSchedule:
    """R == 1: rows of expert e in (token, k) order = one stable sort of the flat ids.

    Same result as the general build (no peers to interleave), in about a third of the
    device work and host launches; also fills ``row_of_slot`` by a permutation scatter.
    """
    T, K = topk_idx.shape
    device = topk_idx.device
    TK = T * K
    capacity = schedule_capacity(1, T, K, E, tile_m)
    i64 = dict(dtype=torch.int64, device=device)
    flat = topk_idx.reshape(TK).to(torch.int64)
    expert = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))  # E = "not mine"
    sorted_expert, slot_order = torch.sort(expert, stable=True)
    starts = torch.searchsorted(sorted_expert, torch.arange(E + 1, **i64))  # [E + 1]
    counts = starts[1:] - starts[:-1]
    padded = torch.div(counts + (tile_m - 1), tile_m, rounding_mode="floor") * tile_m
    offsets = torch.cat([torch.zeros(1, **i64), torch.cumsum(padded, 0)])

    # Padded row of the i-th sorted slot; slots with no local expert go to a dump row.
    mine = sorted_expert < E
    e_i = sorted_expert.clamp(max=E - 1)
    pos = offsets[e_i] + torch.arange(TK, **i64) - starts[e_i]
    pos = torch.where(mine, pos, torch.full_like(pos, capacity))
    row_token = torch.full((capacity + 1,), -1, **i64)
    row_k = torch.full((capacity + 1,), -1, **i64)
    row_token.scatter_(0, pos, torch.div(slot_order, K, rounding_mode="floor"))
    row_k.scatter_(0, pos, slot_order % K)
    row_token, row_k = row_token[:capacity], row_k[:capacity]
    row_peer = torch.where(row_token >= 0, torch.zeros_like(row_token), row_token)
    slot_rows = torch.empty(TK, **i64)
    slot_rows.scatter_(0, slot_order, torch.where(mine, pos, torch.full_like(pos, -1)))

    tile_expert, num_tiles = _tile_table(offsets, capacity, tile_m)
    i32 = torch.int32
    return ReceiveSchedule(
        rank=0, num_ranks=1, num_local_experts=E, tile_m=tile_m, capacity=capacity,
        row_peer=row_peer.to(i32), row_token=row_token.to(i32), row_k=row_k.to(i32),
        expert_counts=counts.to(i32), expert_offsets=offsets.to(i32),
        tile_expert=tile_expert.to(i32),
        num_tiles=num_tiles.to(i32),
        slot_rows=slot_rows.to(i32),
    )


def slot_of_rows(schedule: ReceiveSchedule, K: int) -> torch.Tensor:
    """[capacity] int32: `row_token * K + row_k` (the row's slot on its source peer), -1 on padding."""
    check_int("K", K, min_value=1)
    token = schedule.row_token.to(torch.int64)
    slot = token * K + schedule.row_k.to(torch.int64)
    return torch.where(token >= 0, slot, torch.full_like(slot, -1)).to(torch.int32)


def row_of_slot(schedule: ReceiveSchedule, T: int, K: int, peer: int = 0) -> torch.Tensor:
    """[T * K] int32: padded row that peer `peer`'s slot (token * K + k) went to, -1 if none.

    With R == 1 (peer 0) every slot has a row: this is the inverse of `slot_of_rows`.
    T and K must be the extents the schedule was built with.
    """
    check_int("T", T, min_value=0)
    check_int("K", K, min_value=1)
    check_int("peer", peer, min_value=0, max_value=schedule.num_ranks - 1)
    if schedule.slot_rows is not None and peer == schedule.rank and schedule.slot_rows.numel() == T * K:
        return schedule.slot_rows  # the build's own by-product (R == 1, or the GPU build)
    slots = slot_of_rows(schedule, K).to(torch.int64)
    hit = (slots >= 0) & (schedule.row_peer.to(torch.int64) == peer)
    device = slots.device
    # Sort rows by their slot (non-hits last) and look every slot up: gathers only, no scatter,
    # so the result is deterministic on every device and in torch's deterministic mode.
    TK = T * K
    key = torch.where(hit, slots, torch.full_like(slots, TK))
    if key.numel() == 0:
        return torch.full((TK,), -1, dtype=torch.int32, device=device)
    key_sorted, row = torch.sort(key, stable=True)
    wanted = torch.arange(TK, dtype=torch.int64, device=device)
    at = torch.searchsorted(key_sorted, wanted).clamp_(max=key_sorted.numel() - 1)
    found = key_sorted[at] == wanted
    return torch.where(found, row[at], torch.full_like(wanted, -1)).to(torch.int32)
