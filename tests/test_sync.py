"""Sync helpers of kernels/common.py: PTX of the counters and bounded waits (CI), their
behaviour across CTAs and the timeout path (GPU), and the host-side error decoding."""

import re

import pytest
import torch

from mok_cute import jit
from mok_cute.constants import PEER_FAILED, PEER_NEVER_STARTED, WAIT_TIMEOUT
from mok_cute.errors import PeerTimeoutError, decode_wait_error, error_word, raise_on_wait_error
from mok_cute.kernels import common


def _compile_probe(tmp_path=None):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    @cute.kernel
    def probe(counters: cute.Tensor, error: cute.Tensor, out: cute.Tensor, timeout_ns: Int64):
        """CTA 0 writes out[0] then publishes counter 0; CTA 1 waits for it and copies
        out[0] + 1 to out[1]; CTA 2 (rank 5) waits on counter 1, which nobody publishes."""
        bid = cute.arch.block_idx()[0]
        if cute.arch.thread_idx()[0] == 0:
            if bid == 0:
                out[0] = Int32(7)
                common.counter_publish(counters, 0, 1)
            elif bid == 1:
                if common.wait_counter(counters, 0, 1, timeout_ns, error, 11, 0, 1):
                    out[1] = out[0] + 1
            else:
                if not common.wait_counter(counters, 1, 1, timeout_ns, error, 42, 3, 5):
                    out[2] = Int32(-1)

    @cute.jit
    def launch(counters: cute.Tensor, error: cute.Tensor, out: cute.Tensor, timeout_ns: Int64,
               num_ctas: cutlass.Constexpr[int]):
        probe(counters, error, out, timeout_ns).launch(grid=[num_ctas, 1, 1], block=[32, 1, 1])

    extra = f"--keep-ptx --dump-dir {tmp_path}" if tmp_path else ""
    return {n: cute.compile(launch, common.fake_vector(Int32), common.fake_vector(Int64, align_bytes=8),
                            common.fake_vector(Int32), Int64(0), n,
                            options=jit.compile_options("sm_90a", f"--enable-tvm-ffi {extra}"))
            for n in (2, 3)}


def test_counters_and_waits_compile_to_release_acquire_and_nanosleep(tmp_path):
    ptx = _compile_probe(tmp_path)[3].__ptx__
    assert re.search(r"red\.release\.gpu\.global\.add\.s32", ptx)
    assert re.search(r"ld\.acquire\.gpu(\.global)?\.(b|s|u)32", ptx)
    assert "nanosleep.u32" in ptx
    assert "%globaltimer" in ptx
    assert re.search(r"atom(\.relaxed\.gpu)?\.global\.max\.s64", ptx)  # the error word


def test_error_word_round_trip_names_call_rank_task_and_peer():
    word = error_word(41, 3, 71, WAIT_TIMEOUT)
    assert word > 0  # positive: the kernels record it with a signed atomic max
    assert decode_wait_error(word) == (41, 3, 71, WAIT_TIMEOUT)
    assert decode_wait_error(error_word(2**31, 4095, 4095, PEER_NEVER_STARTED)) == (
        2**31, 4095, 4095, PEER_NEVER_STARTED)
    assert decode_wait_error(0) is None
    raise_on_wait_error(0)
    with pytest.raises(PeerTimeoutError,
                       match="megakernel call 9: rank 71: task 41 timed out waiting for peer 3"):
        raise_on_wait_error(word, call=9)
    with pytest.raises(PeerTimeoutError, match="rank 1: task 7: peer 0 reported that its own"):
        raise_on_wait_error(error_word(7, 0, 1, PEER_FAILED))


def test_the_root_cause_outranks_the_waits_behind_it():
    """Waiters record with an atomic max: a wait on a peer that never announced its start
    outranks any timed-out wait, which outranks a peer's reported failure, whatever their
    task, peer and rank."""
    failed_peer = error_word(2**31, 4095, 4095, PEER_FAILED)
    stalled_behind = error_word(4000, 71, 4095, WAIT_TIMEOUT)
    never_started = error_word(0, 2, 0, PEER_NEVER_STARTED)
    assert failed_peer < stalled_behind < never_started
    with pytest.raises(PeerTimeoutError, match="peer 2 .*never announced its start"):
        raise_on_wait_error(max(failed_peer, stalled_behind, never_started))


@pytest.mark.gpu
def test_publish_then_acquire_across_ctas_and_a_stalled_peer_times_out():
    compiled = _compile_probe()
    counters = torch.zeros(2, dtype=torch.int32, device="cuda")
    error = torch.zeros(1, dtype=torch.int64, device="cuda")
    out = torch.zeros(3, dtype=torch.int32, device="cuda")
    compiled[2](counters, error, out, 2_000_000_000)  # 2 s: never reached
    torch.cuda.synchronize()
    assert out.tolist()[:2] == [7, 8] and error.item() == 0
    counters.zero_(); out.zero_()
    compiled[3](counters, error, out, 1_000_000)  # 1 ms: CTA 2 must give up
    torch.cuda.synchronize()
    assert out.tolist() == [7, 8, -1]
    assert decode_wait_error(error.item()) == (42, 3, 5, WAIT_TIMEOUT)
    with pytest.raises(PeerTimeoutError, match="peer 3"):
        raise_on_wait_error(error.item())


def _compile_late_wait_probe():
    """CTA 0 spins ``publish_after_ns`` then publishes counter 0; CTA 1 spins
    ``wait_after_ns`` and only then waits for it, bounded by ``timeout_ns``."""
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    @cute.jit
    def spin(ns: Int64):
        until = cute.arch.globaltimer() + ns
        while cute.arch.globaltimer() < until:
            common.nanosleep(Int32(1000))

    @cute.kernel
    def probe(counters: cute.Tensor, error: cute.Tensor, out: cute.Tensor, timeout_ns: Int64,
              publish_after_ns: Int64, wait_after_ns: Int64):
        if cute.arch.thread_idx()[0] == 0:
            if cute.arch.block_idx()[0] == 0:
                spin(publish_after_ns)
                common.counter_publish(counters, 0, 1)
            else:
                spin(wait_after_ns)
                if common.wait_counter(counters, 0, 1, timeout_ns, error, 5, 0, 1):
                    out[0] = Int32(1)

    @cute.jit
    def launch(counters: cute.Tensor, error: cute.Tensor, out: cute.Tensor, timeout_ns: Int64,
               publish_after_ns: Int64, wait_after_ns: Int64):
        probe(counters, error, out, timeout_ns, publish_after_ns, wait_after_ns).launch(
            grid=[2, 1, 1], block=[32, 1, 1])

    return cute.compile(launch, common.fake_vector(Int32), common.fake_vector(Int64, align_bytes=8),
                        common.fake_vector(Int32), Int64(0), Int64(0), Int64(0),
                        options=jit.compile_options("sm_90a", "--enable-tvm-ffi"))


@pytest.mark.gpu
def test_the_deadline_counts_from_when_the_wait_began():
    """A healthy launch that runs longer than the timeout: a wait that begins 45 ms in and
    is served 5 ms later succeeds under a 20 ms timeout (a deadline counted from the launch's
    start failed it); a wait served 60 ms after it began times out."""
    compiled = _compile_late_wait_probe()
    ms = 1_000_000
    for publish_after, wait_after, served in ((50 * ms, 45 * ms, True), (80 * ms, 20 * ms, False)):
        counters = torch.zeros(1, dtype=torch.int32, device="cuda")
        error = torch.zeros(1, dtype=torch.int64, device="cuda")
        out = torch.zeros(1, dtype=torch.int32, device="cuda")
        compiled(counters, error, out, 20 * ms, publish_after, wait_after)
        torch.cuda.synchronize()
        assert (out.item() == 1) == served and (error.item() == 0) == served, (publish_after, wait_after)
