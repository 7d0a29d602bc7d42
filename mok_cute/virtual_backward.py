"""The backward of ``moe_forward_virtual``: R expert-parallel ranks emulated on one GPU, every
gradient from d_out [R, T, H] and what the megakernel's training forward saved
(``megakernel.moe_forward_virtual(save=True)``: each expert rank's g | u by receive row and
the launch's receive schedules).

The routed experts of all R ranks run in ONE backward-megakernel launch
(``megakernel_backward.expert_grads``: both dgrads and every weight gradient; with frozen
expert weights the dgrads' launch and ``gemm_wgrad`` for what is wanted, as
``expert_backward`` does): the R receive schedules are laid end to end as one schedule of
R * E_loc experts, rank r's live tiles right after rank r - 1's, its experts renumbered
r * E_loc + e. The concatenation is torch ops on the
device (the counts never reach the host: no sync), and its size comes from the shapes alone:
every (peer, token, k) lands on at most one rank and each expert pads fewer than tile_m rows,
so all ranks' live rows fit ``schedule_capacity(1, R * T, K, R * E_loc, tile_m)`` rows (at most
R per-rank capacities; no row is ever dropped).

    d_out [R*T, H] --gather (peer*T + token)--> dY rows     (zeros on padding rows)
    xs    [R*T, H] --gather-------------------> x rows
    one launch: dG | dU (dgated; g | u read through each row's saved row), dx rows, d_topk
                partials, dW_gate / dW_up / dW_down of all R * E_loc experts
    dx rows --k-sum per (peer, token), k ascending, fp32 (+ the shared expert's dx)--> d_xs
    partials summed per row, read by (peer, token, k) --> d_topk_weights

Numerics: a row's dgrads depend on that row alone and the k-sum runs in ascending k in fp32,
rounded once, so d_xs and d_topk_weights are bitwise those of the same tokens and experts on
one rank (R = 1 with R * T tokens). The weight gradients sum an expert's rows in its schedule
order (peers interleaved), one owner per tile: deterministic run to run. The shared expert is
each rank's own one-expert backward: in the same launch, every rank's as tasks of it
(``kernels/megakernel/backward_shared.py``), when its weight gradients come with the routed
ones (``expert_backward.shared_in_launch``), else ``expert_backward.shared_backward`` rank by
rank; the same bits either way.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from mok_cute.config import ExpertPathOptions
from mok_cute.constants import TILE_M
from mok_cute.expert_backward import (MainGrads, Needs, _expert_backward, check_timeline,
                                      fp8_reads_only, routed_rows, shared_backward_ranks,
                                      shared_in_launch, slot_sums, wanted_shared_grads)
from mok_cute.schedule import schedule_capacity

__all__ = ["VirtualSaved", "ConcatSchedule", "concat_schedules", "weights_by_preact_row",
           "moe_backward_virtual"]


class VirtualSaved(NamedTuple):
    """What the virtual backward reads of a training forward (R ranks; P saved rows in one
    pool: T * K by slot at one rank, R * T * K by global slot (peer, token, k) on several,
    ``schedule.saved_preact_rows``)."""

    preact: torch.Tensor  # [P, 2I] bf16: g | u of every routed row
    shared_preact: torch.Tensor  # [R, T, 2Is] bf16 by token, or an empty tensor
    row_slot: torch.Tensor  # [R, capacity] int32: each schedule row's row in preact, -1 on padding
    row_peer: torch.Tensor  # [R, capacity] int32: the schedules' source of each row (-1: pad)
    row_token: torch.Tensor  # [R, capacity] int32
    row_k: torch.Tensor  # [R, capacity] int32
    tile_expert: torch.Tensor  # [R, capacity // tile_m] int32
    num_tiles: torch.Tensor  # [R] int32
    expert_offsets: torch.Tensor  # [R, E_loc + 1] int32

    @classmethod
    def from_forward(cls, saved) -> "VirtualSaved":
        """From ``megakernel.SavedPreact`` (its ``schedules`` the launch's ReceiveSchedules)."""
        s = saved.schedules
        shared = saved.shared_preact
        return cls(saved.preact, saved.preact.new_empty(0) if shared is None else shared,
                   saved.row_slot, s.row_peer, s.row_token, s.row_k, s.tile_expert,
                   s.num_tiles, s.expert_offsets)


class ConcatSchedule(NamedTuple):
    """R ranks' receive schedules end to end: one schedule of R * E_loc experts over M rows
    (``capacity``), int32 on the device. -1 marks padding rows and slots routed nowhere."""

    token_row: torch.Tensor  # [M] each row's token in the flat [R * T] rows: peer * T + token
    slot: torch.Tensor  # [M] its (peer, token, k) as (peer * T + token) * K + k
    preact_row: torch.Tensor  # [M] its saved g | u row (its rank's row_slot: one pool for all)
    row_of_slot: torch.Tensor  # [R * T * K] the row of each (peer, token, k)
    tile_expert: torch.Tensor  # [M // tile_m] expert r * E_loc + e of each tile (-1: past the live)
    num_tiles: torch.Tensor  # [1] live tiles of all ranks
    expert_offsets: torch.Tensor  # [R * E_loc + 1] each expert's first row; [-1] = live rows

    @property
    def capacity(self) -> int:
        return self.token_row.shape[0]


def _check_table(name: str, t, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32 (or int64) tensor of shape {list(shape)}, "
                         f"got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")


def _inverse(keys: torch.Tensor, size: int) -> torch.Tensor:
    """[size] int64: the position of each value 0 .. size - 1 in ``keys`` (unique where >= 0),
    -1 where absent. A sort and a lookup (gathers only: deterministic, no host sync)."""
    device = keys.device
    wanted = torch.arange(size, dtype=torch.int64, device=device)
    if keys.numel() == 0:
        return torch.full_like(wanted, -1)
    key = torch.where(keys >= 0, keys, torch.full_like(keys, size))
    key_sorted, order = torch.sort(key, stable=True)
    at = torch.searchsorted(key_sorted, wanted).clamp_(max=keys.numel() - 1)
    return torch.where(key_sorted[at] == wanted, order[at], torch.full_like(wanted, -1))


def concat_schedules(row_peer, row_token, row_k, row_slot, tile_expert, num_tiles,
                     expert_offsets, *, num_tokens: int, top_k: int,
                     tile_m: int = TILE_M) -> ConcatSchedule:
    """Lay R ranks' receive schedules ([R, capacity] tables, as ``VirtualSaved`` holds them)
    end to end: rank r's live tiles after those of ranks 0 .. r - 1, its experts renumbered
    r * E_loc + e, each row keeping its source (peer, token, k) and its saved row (``row_slot``:
    a row of the launch's one pool). Torch ops on the tables' device, no host sync, on CPU
    tensors too."""
    if not isinstance(row_token, torch.Tensor) or row_token.dim() != 2:
        raise ValueError(f"row_token: expected an int32 [R, capacity] tensor, got "
                         f"{getattr(row_token, 'shape', type(row_token).__name__)}")
    R, capacity = row_token.shape
    if R < 1 or capacity % tile_m:
        raise ValueError(f"row_token: expected [R >= 1, capacity (a multiple of tile_m={tile_m})]"
                         f", got {list(row_token.shape)}")
    if not isinstance(expert_offsets, torch.Tensor) or expert_offsets.dim() != 2:
        raise ValueError(f"expert_offsets: expected an int32 [R, E_loc + 1] tensor, got "
                         f"{getattr(expert_offsets, 'shape', type(expert_offsets).__name__)}")
    E_loc = expert_offsets.shape[1] - 1
    if E_loc < 1:
        raise ValueError(f"expert_offsets: expected [R, E_loc + 1] with E_loc >= 1, got "
                         f"{list(expert_offsets.shape)}")
    device = row_token.device
    for name, t, shape in (("row_peer", row_peer, (R, capacity)), ("row_k", row_k, (R, capacity)),
                           ("row_slot", row_slot, (R, capacity)),
                           ("tile_expert", tile_expert, (R, capacity // tile_m)),
                           ("num_tiles", num_tiles, (R,)),
                           ("expert_offsets", expert_offsets, (R, E_loc + 1))):
        _check_table(name, t, shape, device)
    for name, value, least in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")

    T, K = num_tokens, top_k
    i64 = dict(dtype=torch.int64, device=device)
    tiles_per_rank = capacity // tile_m
    M = schedule_capacity(1, R * T, K, R * E_loc, tile_m)
    # tiles of each rank (a schedule never has more than its capacity: the clamp only keeps
    # the gathers below in bounds), then each concatenated tile's rank and tile there
    live_tiles = num_tiles.to(torch.int64).clamp(0, tiles_per_rank)
    tile_end = torch.cumsum(live_tiles, 0)
    tile_start = tile_end - live_tiles
    tile = torch.arange(M // tile_m, **i64)
    rank = torch.searchsorted(tile_end, tile, right=True)  # R past every live tile
    live = rank < R
    rank = rank.clamp(max=R - 1)
    src_tile = rank * tiles_per_rank + torch.where(live, tile - tile_start[rank], 0)
    expert = tile_expert.reshape(-1)[src_tile].to(torch.int64)
    live &= expert >= 0
    tile_expert_cat = torch.where(live, expert + rank * E_loc, -1)

    # rows: each concatenated row's row in its rank's schedule
    src_row = (src_tile.unsqueeze(1) * tile_m + torch.arange(tile_m, **i64)).reshape(-1)
    take = lambda t: t.reshape(-1)[src_row].to(torch.int64)  # noqa: E731
    token, peer, k, saved_row = take(row_token), take(row_peer), take(row_k), take(row_slot)
    valid = live.repeat_interleave(tile_m) & (token >= 0)
    minus1 = torch.full_like(token, -1)
    token_row = torch.where(valid, peer * T + token, minus1)
    slot = torch.where(valid, token_row * K + k, minus1)
    preact_row = torch.where(valid & (saved_row >= 0), saved_row, minus1)

    starts = expert_offsets[:, :E_loc].to(torch.int64) + (tile_start * tile_m).unsqueeze(1)
    offsets = torch.cat([starts.reshape(-1), tile_end[-1:] * tile_m])
    i32 = torch.int32
    return ConcatSchedule(
        token_row=token_row.to(i32), slot=slot.to(i32), preact_row=preact_row.to(i32),
        row_of_slot=_inverse(slot, R * T * K).to(i32), tile_expert=tile_expert_cat.to(i32),
        num_tiles=tile_end[-1:].to(i32), expert_offsets=offsets.to(i32))


def weights_by_preact_row(concat: ConcatSchedule, topk_weights: torch.Tensor,
                          preact_rows: int) -> torch.Tensor:
    """fp32 [preact_rows]: the router weight of each saved g | u row (0 where no row is saved):
    the dgated epilogue reads a row's weight through the same index as its g | u."""
    weights = topk_weights.reshape(-1).to(torch.float32)
    row = _inverse(concat.preact_row.to(torch.int64), preact_rows)
    slot = concat.slot.to(torch.int64)[row.clamp(min=0)]
    found = (row >= 0) & (slot >= 0)
    return torch.where(found, weights[slot.clamp(min=0)], 0.0).contiguous()


def moe_backward_virtual(d_out, xs, topk_weights, w_gate, w_up, w_down, shared,
                         saved: VirtualSaved, needs: Needs = Needs(),
                         options: ExpertPathOptions = ExpertPathOptions(),
                         precision: str = "bf16", main_grads=None, timeline=None):
    """Every gradient of ``megakernel.moe_forward_virtual(..., save=True)`` given d_out
    [R, T, H] (inputs as ``mok_cute.api.moe_forward_virtual`` checked them): (d_xs [R, T, H],
    d_topk_weights [R, T, K] in topk_weights' dtype, d_w_gate, d_w_up [R, E_loc, I, H],
    d_w_down [R, E_loc, H, I], d_ws_gate, d_ws_up [R, Is, H], d_ws_down [R, H, Is]), None
    where ``needs`` says no (and for the shared expert's three without one).
    ``precision="fp8"`` (an FP8 training forward): the routed experts' dgrads and weight
    gradients on the one-GPU FP8 kernels over the concatenated schedule
    (``expert_backward._expert_backward(fp8=True)``, several launches; the backward
    megakernel is bf16), the shared expert in bf16. ``main_grads``: an
    ``expert_backward.MainGrads`` of fp32 buffers shaped as the weights ([R, E_loc, ...],
    [R, Is, H], ...): each weight gradient with one is added into it, None returned.
    ``timeline``: a ``mok_cute.timeline.TimelineBuffer`` that the one backward-megakernel launch
    records into (bf16 with every routed weight gradient wanted, ``records_backward``)."""
    check_timeline(timeline, precision, "megakernel", needs)
    R, T, H = xs.shape
    K = topk_weights.shape[-1]
    E_loc, I = w_gate.shape[1], w_gate.shape[2]
    if not isinstance(d_out, torch.Tensor) or tuple(d_out.shape) != (R, T, H):
        raise ValueError(f"d_out: expected shape {[R, T, H]} like xs, got "
                         f"{getattr(d_out, 'shape', type(d_out).__name__)}")
    if d_out.dtype != torch.bfloat16:
        raise ValueError(f"d_out: expected bfloat16, got {d_out.dtype}")
    if saved.preact.dim() != 2 or saved.preact.shape[1] != 2 * I:
        raise ValueError(f"saved.preact: expected [rows, {2 * I}], got "
                         f"{list(saved.preact.shape)}")
    from mok_cute.kernels import token_ops

    d_out = d_out.contiguous()
    rows = saved.preact.shape[0]
    concat = concat_schedules(saved.row_peer, saved.row_token, saved.row_k, saved.row_slot,
                              saved.tile_expert, saved.num_tiles, saved.expert_offsets,
                              num_tokens=T, top_k=K)
    fp8 = precision == "fp8"
    d_src = d_out.view(R * T, H)
    if fp8:  # the FP8 dgrad's K: H zero-padded to whole 128 groups
        from mok_cute.expert_path_fp8 import pad_cols, padded, transposed_weights
        d_src = pad_cols(d_src, padded(H))
    # zeros on padding rows; read in place where FP8 quantizers are their only readers
    d_fp8_only, x_fp8_only = fp8_reads_only(precision, H, I, T * K / E_loc, needs)
    # made when first read, held by the backward alone (dropped after their last reader)
    d_rows = partial(routed_rows, d_src, concat.token_row, d_fp8_only, concat.row_of_slot)
    x_rows = (partial(routed_rows, xs.reshape(R * T, H), concat.token_row, x_fp8_only)
              if needs.w_gate_up else None)
    ones = torch.ones(R * T, K, dtype=torch.float32, device=xs.device)
    k_sum = partial(token_ops.weighted_ksum, w=ones, row_index=concat.row_of_slot)
    flat = lambda w: w.reshape(R * E_loc, *w.shape[2:])  # noqa: E731  every rank's experts
    weights = weights_by_preact_row(concat, topk_weights, rows)
    routed_main = shared_main = None  # every rank's experts as one expert list, as the weights
    if main_grads is not None:
        # views (a copy would take the gradients away from the caller's buffers)
        routed_main = tuple(None if b is None else b.view(R * E_loc, *b.shape[2:])
                            for b in main_grads.routed)
        shared_main = main_grads.shared
    if shared_in_launch(shared, precision, needs):
        # every GEMM in one launch, every rank's shared expert too
        from mok_cute import megakernel_backward
        *_, partials, dx_rows, dwg, dwu, dwd, s = megakernel_backward.expert_grads(
            d_rows(), x_rows(), flat(w_gate), flat(w_up), flat(w_down), saved.preact,
            concat.preact_row, weights, concat.tile_expert, concat.num_tiles,
            concat.expert_offsets, shared=megakernel_backward.SharedExpert(
                d_out, xs.contiguous(), *(w.contiguous() for w in shared),
                saved.shared_preact),
            main_grads=None if main_grads is None else MainGrads(*routed_main, *shared_main),
            timeline=timeline, rows_per_expert=T * K / E_loc)
        d_shared = wanted_shared_grads(s, needs)
        # [R, T, H] of the launch's padded rows: one copy into the k-sum's contiguous rows (a
        # view where T = 1 would keep the padded stride, which the k-sum refuses)
        d_xs = k_sum(dx_rows, shared=s.dx.reshape(R * T, H).contiguous()) if needs.x else None
    else:
        # the shared expert's first: the k-sum then runs as soon as the routed dx rows exist
        shared_dx, d_shared = shared_backward_ranks(d_out, xs, shared, saved.shared_preact,
                                                    needs, options, shared_main)
        shared_dx = None if shared_dx[0] is None else torch.cat(shared_dx)  # [R * T, H]
        d_xs, dwg, dwu, dwd, partials = _expert_backward(
            d_rows, x_rows, flat(w_gate), flat(w_up), flat(w_down),
            saved.preact, concat.preact_row, weights, concat.tile_expert,
            concat.num_tiles, concat.expert_offsets, needs.x, needs.w_gate_up, needs.w_down,
            needs.topk_weights, options, fp8=fp8, dgrads="kernels" if fp8 else "megakernel",
            # the caller's [R, E_loc, ...] tensors: the copies its forward made (cache hits)
            fp8_transposed=transposed_weights(w_gate, w_up, w_down) if fp8 else None,
            rows_per_expert=T * K / E_loc,  # R * T * K rows over R * E_loc experts
            main=routed_main, timeline=timeline, reduce_dx=partial(k_sum, shared=shared_dx))

    d_xs = None if d_xs is None else d_xs.view(R, T, H)
    d_topk = None
    if needs.topk_weights:
        d_topk = slot_sums(partials, concat.row_of_slot).view(R, T, K).to(topk_weights.dtype)
    unflat = lambda g: None if g is None else g.view(R, E_loc, *g.shape[1:])  # noqa: E731
    return (d_xs, d_topk, unflat(dwg), unflat(dwu), unflat(dwd), *d_shared)
