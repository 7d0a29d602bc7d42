"""A megakernel call that cannot complete never returns a plausible wrong output (issue 30,
items 1 and 2): its incomplete rows are NaN and it raises ``PeerTimeoutError`` naming the
call, the rank and the peer: from the call itself when it synchronises anyway
(``check_ids=True``), else at a later call of the same plan or at ``mok_cute.check_errors()``.
The plan is usable again at once.

A stalled peer is the ``silent_rank`` test hook of ``megakernel.Plan.run``: that virtual rank
never announces its start, as if its process had died. Host-side pieces run on the CPU."""

from __future__ import annotations

import time

import pytest
import torch

import mok_cute
from mok_cute import reference
from mok_cute.errors import PeerTimeoutError, error_word
from mok_cute.constants import WAIT_TIMEOUT, flag_done, flag_started
from per_token import assert_tokens_close

TIMEOUT_MS = 50.0


def test_flag_values_only_grow():
    """A stale flag of call e is below call e + 1's start, so no wait of a later call passes
    on it (the converse, a later call's flag passing a wait of call e, is why a failure is
    also kept in the sticky word: tests/test_group_backward.py)."""
    for e in range(1, 50):
        assert 0 < flag_started(e) < flag_done(e) < flag_started(e + 1)


def test_check_errors_without_a_megakernel_does_nothing():
    mok_cute.check_errors()


def test_the_error_names_the_call_the_rank_and_the_peer():
    from mok_cute.errors import raise_on_wait_error

    with pytest.raises(PeerTimeoutError) as info:
        raise_on_wait_error(error_word(12, 2, 3, WAIT_TIMEOUT), call=4)
    err = info.value
    assert (err.call, err.rank, err.peer, err.task_id) == (4, 3, 2, 12)
    assert "megakernel call 4: rank 3:" in str(err) and "peer 2" in str(err)
    assert "NaN" in str(err)


def _problem(R=4, T=96, H=256, I=128, E_loc=2, K=2, seed=9):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(torch.bfloat16)

    idx = torch.rand(R, T, R * E_loc, device="cuda", generator=g).topk(K, dim=2).indices
    w = torch.softmax(torch.randn(R, T, K, device="cuda", generator=g), dim=2)
    return (rnd(R, T, H), idx.to(torch.int32), w, rnd(R, E_loc, I, H, scale=H ** -0.5),
            rnd(R, E_loc, I, H, scale=H ** -0.5), rnd(R, E_loc, H, I, scale=I ** -0.5))


@pytest.fixture
def silence(monkeypatch):
    """``silence(r)``: from now on every megakernel launch has virtual rank ``r`` silent;
    ``silence(None)``: none."""
    from mok_cute import megakernel

    run = megakernel.Plan.run
    state = {"rank": -1}

    def run_with_silent_rank(self, *args, **kwargs):
        kwargs.setdefault("silent_rank", state["rank"])
        return run(self, *args, **kwargs)

    monkeypatch.setattr(megakernel.Plan, "run", run_with_silent_rank)
    return lambda rank: state.update(rank=-1 if rank is None else rank)


def _assert_rows_nan_or_correct(out, ref):
    """Every token row is all NaN or bitwise the clean call's (a row missing one slot's share
    is not complete); at least one is NaN."""
    nan_rows = out.isnan().all(dim=-1)
    assert (out.isnan().any(dim=-1) == nan_rows).all(), "a row is partly NaN"
    assert nan_rows.any(), "a failed call returned no NaN row"
    good = ~nan_rows
    assert torch.equal(out[good], ref[good]), "a completed row differs from the clean call's"


def _clean_outputs(args, config):
    out = mok_cute.moe_forward_virtual(*args, config=config)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
def test_without_the_check_a_stalled_peer_gives_nan_rows_and_raises_later(silence):
    """check_ids=False: the call returns without raising, with NaN rows; the error surfaces at
    the next call of the plan, naming the call, the rank and the peer, and only once; the next
    clean call is bitwise the same as before the failure."""
    args = _problem()
    config = mok_cute.MoKConfig(timeout_ms=TIMEOUT_MS, check_ids=False)
    before = _clean_outputs(args, config)
    silence(2)
    start = time.perf_counter()
    failed = mok_cute.moe_forward_virtual(*args, config=config)  # must not raise here
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    silence(None)
    # one timeout, not one per wait: every wait gives up once the first has
    assert elapsed < 20 * TIMEOUT_MS / 1e3, f"the failed launch took {elapsed:.3f} s"
    _assert_rows_nan_or_correct(failed, before)
    with pytest.raises(PeerTimeoutError, match=r"megakernel call \d+: rank \d+: .*peer 2") as info:
        mok_cute.moe_forward_virtual(*args, config=config)  # the next call reports it
    assert info.value.peer == 2
    mok_cute.check_errors()  # reported once, not again
    again = _clean_outputs(args, config)
    mok_cute.check_errors()
    assert torch.equal(again, before)


@pytest.mark.gpu
def test_check_errors_reports_a_failed_call_that_nothing_else_waited_for(silence):
    args = _problem(seed=10)
    config = mok_cute.MoKConfig(timeout_ms=TIMEOUT_MS, check_ids=False)
    before = _clean_outputs(args, config)
    silence(1)
    failed = mok_cute.moe_forward_virtual(*args, config=config)
    silence(None)
    with pytest.raises(PeerTimeoutError, match="peer 1"):
        mok_cute.check_errors()
    mok_cute.check_errors()
    _assert_rows_nan_or_correct(failed, before)
    assert torch.equal(_clean_outputs(args, config), before)


@pytest.mark.gpu
def test_with_the_check_the_failed_call_itself_raises(silence):
    """check_ids=True synchronises on the id check anyway: the same wait reports the
    failure from the call that failed."""
    args = _problem(seed=11)
    config = mok_cute.MoKConfig(timeout_ms=TIMEOUT_MS)
    silence(2)
    with pytest.raises(PeerTimeoutError, match="peer 2"):
        mok_cute.moe_forward_virtual(*args, config=config)
    silence(None)
    out = mok_cute.moe_forward_virtual(*args, config=config)
    mok_cute.check_errors()
    xs, idx, w, wg, wu, wd = args
    ref = reference.moe_forward_virtual(xs, idx, w, wg, wu, wd)
    assert_tokens_close(out, ref, tol=2e-2, floor=0.0)
