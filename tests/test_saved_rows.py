"""``mok_cute.SavedRowsPool`` (mok_cute/saved_rows.py): one buffer for the saved g | u rows of every
training call over a group that names it (``MoKConfig(saved_rows_pool=...)``).

CPU (the pool's arithmetic is torch on the pool's device; its GPU test is
test_group_backward.py's ``bf16_pool`` IPC case):
- each call's rows are packed in schedule order from the first whole row of its width past what
  earlier calls took; a call that finds too few rows left counts the rest (never drops them);
- the pool empties only when no earlier call's rows are held (their lease freed; a training call
  over a group saves its lease for its backward, so autograd frees it once the backward ran);
- the megakernel's saved buffers of one rank of a group are the pool's, and the emulated
  group backward over that layout gives autograd's gradients;
- the configuration refuses anything but a pool, and a pool beside ``saved_rows_factor``.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

import mok_cute as mok
from mok_cute.saved_rows import SavedRowsPool, kept_saved_rows, packed_saved_slots


def _valid(*rows):
    """A [1, capacity] schedule row mask: True where routed."""
    return torch.tensor([list(rows)], dtype=torch.bool)


def test_a_row_budget_packs_the_routed_rows_and_counts_the_rest():
    """``MoKConfig.saved_rows_factor`` for one rank of a group: the budget is the factor times
    T * K rows, rounded up, at most every peer's T * K (and None without a factor); the routed
    rows of a schedule are packed in order, padding and rows past the budget get -1, and the
    count of those past it is returned on the tensors' device."""
    assert kept_saved_rows(8, 2048, 8, None) is None
    assert kept_saved_rows(8, 2048, 8, 2.0) == 2 * 2048 * 8
    assert kept_saved_rows(8, 100, 3, 1.001) == 301  # rounded up
    assert kept_saved_rows(2, 100, 3, 5.0) == 2 * 100 * 3  # never past the worst case
    assert kept_saved_rows(2, 1, 1, 1e-9) == 1
    # a rank's schedule: two experts' segments padded to 4 rows (-1 where row_token < 0)
    row_token = torch.tensor([[5, 0, 7, -1, 2, 2, 9, 3, 1, -1, -1, -1]])
    valid = row_token >= 0
    slots, missing = packed_saved_slots(valid, 8)
    assert slots.dtype == torch.int32 and slots.shape == valid.shape
    assert slots.tolist() == [[0, 1, 2, -1, 3, 4, 5, 6, 7, -1, -1, -1]]
    assert missing.dtype == torch.int64 and missing.dim() == 0 and int(missing) == 0
    slots, missing = packed_saved_slots(valid, 6)
    assert slots.tolist() == [[0, 1, 2, -1, 3, 4, 5, -1, -1, -1, -1, -1]] and int(missing) == 2


def test_calls_take_rows_one_after_another_in_whole_rows_of_their_width():
    pool = SavedRowsPool(1000, device="cpu")  # I = 4: 16-byte rows, 62 of them
    assert repr(pool) == "SavedRowsPool(nbytes=1000)" and pool.held_calls == 0
    preact, slots, missing, lease = pool.take(_valid(1, 1, 0, 1, 0, 0, 1, 1), inter=4)
    assert lease.numel() == 0
    assert preact.shape == (62, 8) and preact.dtype == torch.bfloat16
    assert preact.data_ptr() == pool.buffer.data_ptr()  # the pool's memory, as a call's rows
    assert slots.dtype == torch.int32 and slots.tolist() == [[0, 1, -1, 2, -1, -1, 3, 4]]
    assert int(missing) == 0 and int(pool.used) == 5 * 16 and pool.held_calls == 1
    # I = 6: 24-byte rows; 80 bytes taken -> the first whole row past them is row 4
    wide, slots6, missing6, lease6 = pool.take(_valid(1, 0, 1), inter=6)
    assert wide.shape == (41, 12) and slots6.tolist() == [[4, -1, 5]] and int(missing6) == 0
    assert int(pool.used) == 6 * 24 and pool.held_calls == 2
    # I = 4 again: 144 bytes taken = row 9 of 16 bytes
    _, slots4, _, lease4 = pool.take(_valid(1, 1), inter=4)
    assert slots4.tolist() == [[9, 10]] and int(pool.used) == 11 * 16
    # rows written through one call's view land in the pool's bytes where its slots say
    preact[3] = 7.0
    assert torch.equal(pool.buffer[3 * 16:4 * 16].view(torch.bfloat16),
                       torch.full((8,), 7.0, dtype=torch.bfloat16))


def test_a_call_that_finds_too_few_rows_left_counts_the_rest():
    pool = SavedRowsPool(6 * 16, device="cpu")  # six rows at I = 4
    first = pool.take(_valid(1, 1, 1, 1), inter=4)
    _, slots, missing, second = pool.take(_valid(1, 0, 1, 1, 1), inter=4)
    assert slots.tolist() == [[4, -1, 5, -1, -1]]  # two fit, past them nothing is written
    assert missing.dtype == torch.int64 and missing.dim() == 0 and int(missing) == 2
    assert int(pool.used) == 6 * 16  # full, not past it
    _, slots, missing, third = pool.take(_valid(1), inter=4)
    assert slots.tolist() == [[-1]] and int(missing) == 1
    with pytest.raises(ValueError, match=r"MoKConfig.saved_rows_pool: 96 bytes hold no g \| u "
                                         r"row of 2I = 64 bf16 \(128 bytes\)"):
        pool.take(_valid(1), inter=32)
    del first


def test_the_pool_empties_only_when_no_earlier_calls_rows_are_held():
    pool = SavedRowsPool(10 * 16, device="cpu")
    a = pool.take(_valid(1, 1, 1), inter=4)[3]
    rows, _, _, b = pool.take(_valid(1, 1), inter=4)
    del a
    gc.collect()
    assert pool.held_calls == 1
    del rows  # the rows' tensor is the pool's view: the lease alone holds them
    gc.collect()
    assert pool.held_calls == 1
    _, slots, _, c = pool.take(_valid(1), inter=4)  # b's rows held: after them, not over them
    assert slots.tolist() == [[5]]
    del b, c
    gc.collect()
    assert pool.held_calls == 0
    _, slots, _, d = pool.take(_valid(1, 1), inter=4)  # none held: from row 0 again
    assert slots.tolist() == [[0, 1]] and int(pool.used) == 2 * 16 and pool.held_calls == 1


def test_the_configuration_takes_a_pool_and_not_beside_a_factor():
    pool = SavedRowsPool(64, device="cpu")
    assert mok.MoKConfig(saved_rows_pool=pool).saved_rows_pool is pool
    with pytest.raises(TypeError, match="MoKConfig.saved_rows_pool: expected None or a "
                                        "mok_cute.SavedRowsPool, got int"):
        mok.MoKConfig(saved_rows_pool=1 << 20)
    with pytest.raises(ValueError, match="MoKConfig.saved_rows_pool: a pool or "
                                         "saved_rows_factor, not both"):
        mok.MoKConfig(saved_rows_pool=pool, saved_rows_factor=2.0)
    with pytest.raises(ValueError, match="SavedRowsPool: nbytes"):
        SavedRowsPool(0, device="cpu")
    with pytest.raises(ValueError, match="MoKConfig.saved_rows_pool: on cpu, the call's rows "
                                         "are on meta"):
        pool.take(torch.ones(1, 2, dtype=torch.bool, device="meta"), inter=4)


def test_the_error_names_the_pool():
    err = mok.SavedRowsError(3, rank=1, call=4, pool_bytes=4096)
    assert str(err).startswith("megakernel call 4: rank 1 received 3 routed rows more than the "
                               "rows its SavedRowsPool of 4096 bytes had left")
    assert "a larger pool" in str(err)


def test_one_rank_of_a_group_saves_into_the_pool(monkeypatch):
    """``Plan._saved_preact`` for one rank of a group with a pool (what a saving launch writes
    and reads): the pool's view and this call's rows packed after what the pool's earlier
    calls took, the overflow counted; without a group rank (virtual ranks) the pool is unused."""
    from mok_cute.megakernel import Plan

    T, K, I = 4, 2, 8
    key = types.SimpleNamespace(tokens=T, top_k=K, intermediate=I, local_experts=2,
                                shared_intermediate=0)
    plan = types.SimpleNamespace(key=key, side=types.SimpleNamespace(num_peers=2, launch_ranks=1),
                                 _receive_rows=torch.arange(16).view(1, 16))
    row_token = torch.tensor([[0, 2, -1, -1, 1, 3, 3, 0, 2, 1, -1, -1, -1, -1, -1, -1]])
    scheds = types.SimpleNamespace(row_token=row_token, row_k=torch.zeros_like(row_token),
                                   row_peer=torch.zeros_like(row_token))
    pool = SavedRowsPool(10 * 4 * I, device="cpu")  # ten rows
    held = pool.take(_valid(1, 1, 1), inter=I)
    saved = Plan._saved_preact(plan, scheds, False, None, pool)
    assert saved.preact.shape == (10, 2 * I) and saved.preact.data_ptr() == pool.buffer.data_ptr()
    assert saved.row_slot.tolist() == [[3, 4, -1, -1, 5, 6, 7, 8, 9, -1, -1, -1, -1, -1, -1, -1]]
    assert int(saved.missing) == 1  # eight routed rows, seven left
    assert saved.lease is not None and pool.held_calls == 2
    plan.side.num_peers = 1  # one GPU: its own layout, the pool unused
    alone = Plan._saved_preact(plan, scheds, False, None, pool)
    assert alone.missing is None and alone.lease is None
    assert alone.preact.shape == (T * K, 2 * I) and pool.held_calls == 2
    del held


def test_the_group_backward_over_a_pools_layout_matches_autograd(monkeypatch):
    """The emulated group backward (test_group_backward's) with every rank's saved rows taken
    from one pool after rows another call holds: autograd's gradients, nothing reported."""
    from test_group_backward import _assert_reference_grads, _emulated_group_backward

    def relayout(saved):
        valid = saved.row_slot >= 0
        inter = saved.preact.shape[1] // 2
        pool = SavedRowsPool(int(valid.sum() + 5) * 4 * inter, device="cpu")
        held = pool.take(torch.ones(1, 5, dtype=torch.bool), inter)[3]  # rows 0-4 held
        slots, missing, leases = [], torch.zeros((), dtype=torch.int64), [held]
        pool.buffer.view(torch.bfloat16).fill_(float("nan"))  # a row read from the wrong place
        for r in range(valid.shape[0]):
            rows, slot, short, lease = pool.take(valid[r:r + 1], inter)
            leases.append(lease)
            on = slot[0] >= 0
            rows[slot[0][on].long()] = saved.preact[saved.row_slot[r][on].long()]
            slots.append(slot[0])
            missing = torch.maximum(missing, short)
        assert int(missing) == 0 and int(torch.stack(slots).min()) == -1
        assert int(torch.stack(slots)[0].max()) >= 5  # after the held rows
        assert pool.held_calls == 3
        return saved._replace(preact=rows, row_slot=torch.stack(slots), missing=missing,
                              lease=leases)

    got, leaves, plan = _emulated_group_backward(2, 40, 3, 2, 64, "skew", monkeypatch,
                                                 relayout=relayout)
    _assert_reference_grads(got, leaves)
    assert int(plan.backward_error) == 0
