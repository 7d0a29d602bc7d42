"""Sync helpers of kernels/common.py: PTX of the counters and bounded waits (CI), their
behaviour across CTAs and the timeout path (GPU), and the host-side error decoding."""

import re

import pytest
import torch

from mok_cute import jit
from mok_cute.constants import PEER_NEVER_STARTED, WAIT_TIMEOUT
from mok_cute.errors import PeerTimeoutError, decode_wait_error, raise_on_wait_error
from mok_cute.kernels import common


def _compile_probe(tmp_path=None):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    @cute.kernel
    def probe(counters: cute.Tensor, error: cute.Tensor, out: cute.Tensor, timeout_ns: Int64):
        """CTA 0 writes out[0] then publishes counter 0; CTA 1 waits for it and copies
        out[0] + 1 to out[1]; CTA 2 waits on counter 1, which nobody publishes."""
        bid = cute.arch.block_idx()[0]
        if cute.arch.thread_idx()[0] == 0:
            deadline = cute.arch.globaltimer() + timeout_ns
            if bid == 0:
                out[0] = Int32(7)
                common.counter_publish(counters, 0, 1)
            elif bid == 1:
                if common.wait_counter(counters, 0, 1, deadline, error, 11, 0):
                    out[1] = out[0] + 1
            else:
                if not common.wait_counter(counters, 1, 1, deadline, error, 42, 3):
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


def test_error_word_round_trip_names_task_and_peer():
    word = (41 + 1) | (3 << 32) | (WAIT_TIMEOUT << 48)
    assert decode_wait_error(word) == (41, 3, WAIT_TIMEOUT)
    assert decode_wait_error(0) is None
    raise_on_wait_error(0)
    with pytest.raises(PeerTimeoutError, match="task 41 timed out waiting for peer 3"):
        raise_on_wait_error(word)


def test_a_peer_that_never_started_outranks_the_peers_stalled_behind_it():
    """Waiters record with an atomic max: the word of a wait on a peer that never announced
    its start is larger than any WAIT_TIMEOUT word, whatever its task and peer."""
    stalled_behind = (4000 + 1) | (71 << 32) | (WAIT_TIMEOUT << 48)
    never_started = (0 + 1) | (2 << 32) | (PEER_NEVER_STARTED << 48)
    assert max(stalled_behind, never_started) == never_started
    with pytest.raises(PeerTimeoutError, match="peer 2 .*never announced its start"):
        raise_on_wait_error(never_started)


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
    assert decode_wait_error(error.item()) == (42, 3, WAIT_TIMEOUT)
    with pytest.raises(PeerTimeoutError, match="peer 3"):
        raise_on_wait_error(error.item())
