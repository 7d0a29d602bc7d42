"""Rows between ranks' symmetric buffers by address, and the unicast group barrier: the two
small kernels of the backward over a group (``mok_cute.group_backward``).

``CopyRowsByAddress``   row i: ``dst_addr[i] <- src_addr[i]``, 16-byte vectors, one warp a
                        row; a source address 0 writes a zero row (padding rows), a
                        destination 0 skips the row. Pulls (a peer's row into this rank) and
                        pushes (this rank's row into a peer's slot) are the same copy: the
                        host builds both address tables from the receive schedule.
``PeerBarrier``         ``comm.BarrierSpec``'s protocol over the plan's flags: every local
                        rank stores the call's flag value into every peer's flag slot (release
                        after a fence), then waits until each of its own flags has reached it,
                        a bounded wait that names the peer (``errors.PeerTimeoutError``).

Both read the megakernel plan's run-time scalars (``constants.SCALAR_FIELDS``): the epoch, the
first rank of the launch, the flags' offset, the wait bound and the silent rank (a test hook:
that rank never stores its flags, as if its process had died).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda_driver
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from mok_cute import jit
from mok_cute.constants import PEER_FAILED, SCALAR_INDEX, SCALARS, VEC_ELEMS, flag_started
from mok_cute.kernels import common
from mok_cute.kernels.megakernel.comm_tasks import bf16_row, copy_row, fill_row
# token_ops' pointer and stream helpers: one place for how a kernel entry takes torch tensors
from mok_cute.kernels.token_ops import _placeholder_ptr, _ptr, _stream

COPY_UNROLL = 4  # 16-byte vectors in flight per lane (the peer read's latency)
BARRIER_THREADS = 128
# the scalars read here
_EPOCH, _RANK_BASE, _FLAGS_OFFSET, _TIMEOUT_NS, _SILENT_RANK = (
    SCALAR_INDEX[name] for name in ("epoch", "rank_base", "flags_offset", "timeout_ns",
                                    "silent_rank"))


class CopyRowsByAddress:
    """``num_rows`` rows of ``h_vecs`` 16-byte vectors, each from and to its own address."""

    def __init__(self, num_warps: int = 4):
        self.num_warps = num_warps

    @cute.jit
    def __call__(self, src_addr: cute.Pointer, dst_addr: cute.Pointer, num_rows: Int32,
                 h_vecs: Int32, stream: cuda_driver.CUstream):
        src = cute.make_tensor(src_addr, cute.make_layout(num_rows))
        dst = cute.make_tensor(dst_addr, cute.make_layout(num_rows))
        grid = (num_rows + self.num_warps - 1) // self.num_warps
        self.kernel(src, dst, num_rows, h_vecs).launch(
            grid=[grid, 1, 1], block=[32 * self.num_warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, num_rows: Int32, h_vecs: Int32):
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        row = bidx * self.num_warps + warp
        if row < num_rows:
            to = dst[row]
            if to != 0:
                out = bf16_row(to, h_vecs * VEC_ELEMS)
                frm = src[row]
                if frm != 0:
                    copy_row(bf16_row(frm, h_vecs * VEC_ELEMS), out, h_vecs, lane, COPY_UNROLL)
                else:
                    fill_row(out, 0.0, h_vecs, lane)


class PeerBarrier:
    """One CTA: flag value ``flag_started(epoch) + step`` (step 0: "started", 1: "done" of
    ``constants.flag_started`` / ``flag_done``) from each of ``launch_ranks`` local ranks to
    each of ``num_peers`` peers, then the waits; ``scope`` "sys" over IPC, "gpu" for virtual
    ranks. Step 1 also carries failures both ways: a local rank whose call has an error in
    ``error`` stores this epoch into its sticky failed word, and a peer whose sticky word
    says so is recorded as PEER_FAILED (``common.store_flag`` / ``peer_failed``)."""

    def __init__(self, scope: str = "sys"):
        if scope not in ("sys", "gpu"):
            raise ValueError(f"scope: expected 'sys' or 'gpu', got {scope!r}")
        self.scope = scope

    @cute.jit
    def __call__(self, peer_bases: cute.Pointer, scalars: cute.Pointer, error: cute.Pointer,
                 launch_ranks: Int32, num_peers: Int32, step: Int32,
                 stream: cuda_driver.CUstream):
        bases = cute.make_tensor(peer_bases, cute.make_layout((launch_ranks, num_peers),
                                                              stride=(num_peers, 1)))
        words = cute.make_tensor(scalars, cute.make_layout(SCALARS))
        err = cute.make_tensor(error, cute.make_layout(1))
        self.kernel(bases, words, err, launch_ranks, num_peers, step).launch(
            grid=[1, 1, 1], block=[BARRIER_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, bases: cute.Tensor, words: cute.Tensor, error: cute.Tensor,
               launch_ranks: Int32, num_peers: Int32, step: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        epoch = Int32(words[_EPOCH])
        rank_base = Int32(words[_RANK_BASE])
        flags_offset = words[_FLAGS_OFFSET]
        timeout_ns = words[_TIMEOUT_NS]
        silent = Int32(words[_SILENT_RANK])
        started = flag_started(epoch)
        value = started + step
        failed_epoch = Int32(0)
        if step == 1:
            if common.error_recorded(error):
                failed_epoch = epoch
        pairs = launch_ranks * num_peers
        # what this rank wrote before (the fields, earlier kernels of the stream) goes out first
        if cutlass.const_expr(self.scope == "sys"):
            cute.arch.fence_acq_rel_sys()
        else:
            cute.arch.fence_acq_rel_gpu()
        for i in cutlass.range(tidx, pairs, BARRIER_THREADS, unroll=1):
            rank = i // num_peers
            if rank_base + rank != silent:
                flags = self._flags(bases, rank, i - rank * num_peers, flags_offset, num_peers)
                common.store_flag(flags, rank_base + rank, value, failed_epoch, self.scope)
        for i in cutlass.range(tidx, pairs, BARRIER_THREADS, unroll=1):
            rank = i // num_peers
            peer = i - rank * num_peers
            own = self._flags(bases, rank, rank_base + rank, flags_offset, num_peers)
            common.wait_counter(own, peer, value, timeout_ns, error, step, peer, rank,
                                self.scope, started)
            if step == 1:
                if common.peer_failed(own, peer, epoch, self.scope):
                    common.record_error(error, step, peer, rank, PEER_FAILED)

    @cute.jit
    def _flags(self, bases: cute.Tensor, rank, peer, flags_offset: Int64, num_peers: Int32):
        """The barrier flags inside ``peer``'s symmetric buffer, seen from local ``rank``."""
        return common.flags_at(bases[rank, peer] + flags_offset, num_peers)


# ---------------------------------------------------------------------- compile helpers
def compile_copy_rows_by_address(arch: str = "sm_90a", *, options: str = "",
                                 num_warps: int = 4):
    """Compile ``CopyRowsByAddress`` for ``arch`` without a GPU or tensors."""
    return cute.compile(CopyRowsByAddress(num_warps), _placeholder_ptr(Int64, 8),
                        _placeholder_ptr(Int64, 8), Int32(1),
                        Int32(1), cute.runtime.make_fake_stream(),
                        options=jit.compile_options(arch, options))


def compile_peer_barrier(arch: str = "sm_90a", *, options: str = "", scope: str = "sys"):
    """Compile ``PeerBarrier`` for ``arch`` without a GPU or tensors."""
    return cute.compile(PeerBarrier(scope), *(_placeholder_ptr(Int64, 8) for _ in range(3)),
                        Int32(1), Int32(1), Int32(0), cute.runtime.make_fake_stream(),
                        options=jit.compile_options(arch, options))


# ---------------------------------------------------------------------- host side
def _check_addresses(name: str, t, numel: int | None = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or not t.is_cuda:
        raise TypeError(f"{name}: expected an int64 CUDA tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if not t.is_contiguous() or (numel is not None and t.numel() != numel):
        raise ValueError(f"{name}: expected a contiguous tensor of {numel} addresses, got shape "
                         f"{list(t.shape)}")


def copy_rows_by_address(src_addr: torch.Tensor, dst_addr: torch.Tensor, row_bytes: int) -> None:
    """Row i: ``row_bytes`` bytes from address ``src_addr[i]`` to ``dst_addr[i]`` (int64 CUDA
    tensors of device addresses, 16-byte aligned: local or a peer's mapped buffer); a source 0
    writes zeros, a destination 0 skips the row. On the current stream."""
    _check_addresses("src_addr", src_addr)
    _check_addresses("dst_addr", dst_addr, src_addr.numel())
    if not isinstance(row_bytes, int) or row_bytes <= 0 or row_bytes % 16:
        raise ValueError(f"row_bytes: expected a positive multiple of 16, got {row_bytes!r}")
    if src_addr.numel() == 0:
        return
    kernel = jit.compile_kernel("copy_rows_by_address", jit.device_arch(src_addr.device))
    kernel(_ptr(src_addr, Int64, 8), _ptr(dst_addr, Int64, 8), Int32(src_addr.numel()),
           Int32(row_bytes // 16), _stream(src_addr.device))


def peer_barrier(peer_bases: torch.Tensor, scalars: torch.Tensor, error: torch.Tensor,
                 step: int, scope: str, before_launch=None) -> None:
    """One group barrier (``PeerBarrier``) of the call whose epoch ``scalars[0]`` holds:
    ``peer_bases`` int64 [launch ranks, peers] (row r: every peer's buffer seen from local rank
    r), ``scalars`` the plan's int64 run-time words, ``error`` its int64 error word; ``step``
    0 or 1. On the current stream; a wait that gives up records into ``error``.
    ``before_launch``: called between the kernel's compile and its launch."""
    _check_addresses("peer_bases", peer_bases)
    _check_addresses("scalars", scalars, SCALARS)
    _check_addresses("error", error, 1)
    if step not in (0, 1):
        raise ValueError(f"step: expected 0 or 1, got {step!r}")
    kernel = jit.compile_kernel("peer_barrier", jit.device_arch(peer_bases.device), scope=scope)
    if before_launch is not None:
        before_launch()
    kernel(_ptr(peer_bases, Int64, 8), _ptr(scalars, Int64, 8), _ptr(error, Int64, 8),
           Int32(peer_bases.shape[0]), Int32(peer_bases.shape[1]), Int32(step),
           _stream(peer_bases.device))
