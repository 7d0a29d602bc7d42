"""The comm-CTA tasks of the megakernel as standalone kernels: pull dispatch, push combine.

``PullDispatch``: for every receiving rank ``r`` and every live M-tile of its receive
schedule, copy the tile's 128 rows ``x[row_peer, row_token]`` from the symmetric buffer of
the rank that owns each token (its base address read from the peer table at run time) into
rank r's ring, in schedule order; padding rows (peer -1) become zeros. Then thread 0
publishes ``dispatched[r, tile] += 1`` (release): what the tile's FC1 tasks wait on.

``PushCombine``: for every live M-tile of rank r, store each expert output row ``y`` of the
ring into the combine buffer of the rank the token came from, at slot ``token * K + k``,
then publish ``combined[r, tile] += 1``. The source rank's fixed-order k-sum then reads its
own ``[T * K, H]`` combine buffer.

- Virtual backend: every rank's CTAs are in this one launch (``(rank, tile)`` tasks walked
  with a grid stride) and ``peer_bases`` is the [R, R] table of ``VirtualPeers``; with the
  IPC backend the same kernels run per process with one receiving rank (and ``scope="sys"``
  for counters that a peer GPU reads).
- Rows move as 16-byte vectors, one warp per row; token counts and the hidden size are
  run-time values; no host sync.

Status: both compile for sm_90a (PTX checked in CI). NOT yet run on a GPU: their GPU tests
(tests/test_comm_kernels.py) are the first megakernel steps of docs/megakernel_plan.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from mok_cute import jit
from mok_cute.kernels import common

VEC_ELEMS = 8  # bf16 per 16-byte vector
TILE_M = 128


def bf16_row(addr: Int64, hidden: Int32) -> cute.Tensor:
    """A bf16 row of ``hidden`` elements at a run-time (peer) address, 16-byte aligned."""
    return cute.make_tensor(
        cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16),
        cute.make_layout(hidden))


@cute.jit
def copy_row(src: cute.Tensor, dst: cute.Tensor, h_vecs: Int32, lane: Int32,
             unroll: cutlass.Constexpr[int] = 1):
    """One warp copies a row as 16-byte vectors (lane-strided, coalesced); each lane issues
    ``unroll`` loads before their stores, so several vectors per lane are in flight (what
    hides the latency of a peer read)."""
    vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    for v0 in cutlass.range(lane, h_vecs, 32 * unroll, unroll=1):
        frag = cute.make_rmem_tensor((VEC_ELEMS, unroll), BFloat16)
        for u in cutlass.range_constexpr(unroll):
            if v0 + 32 * u < h_vecs:
                cute.copy(vec, cute.local_tile(src, (VEC_ELEMS,), (v0 + 32 * u,)), frag[None, u])
        for u in cutlass.range_constexpr(unroll):
            if v0 + 32 * u < h_vecs:
                cute.copy(vec, frag[None, u], cute.local_tile(dst, (VEC_ELEMS,), (v0 + 32 * u,)))


@cute.jit
def copy_rows_flat(row_src: cute.Tensor, row_dst: cute.Tensor, num_rows: Int32, h_vecs: Int32,
                   warp: Int32, num_warps: cutlass.Constexpr[int], lane: Int32,
                   vectors: cutlass.Constexpr[int]):
    """The warps of a CTA copy rows 0 .. num_rows-1 (byte addresses in ``row_src`` /
    ``row_dst``; a source of 0 is a row to skip) as one row-major run of 16-byte vectors:
    warp w takes chunks w, w + num_warps, ... of ``32 * vectors`` consecutive vectors, lane l
    vectors l, l + 32, ... of a chunk, all loads before the stores. Every lane keeps
    ``vectors`` loads in flight whatever the row length, where ``copy_row`` (a warp per row)
    keeps at most one row's share: 16 per lane for H = 4096, and its second pass over a
    7168-wide row is 12 of 16."""
    vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    total = num_rows * h_vecs
    hidden = h_vecs * VEC_ELEMS
    chunk = 32 * vectors
    for c0 in cutlass.range(warp * chunk + lane, total, num_warps * chunk, unroll=1):
        frag = cute.make_rmem_tensor((VEC_ELEMS, vectors), BFloat16)
        for u in cutlass.range_constexpr(vectors):
            g = c0 + 32 * u
            row = cutlass.min(g // h_vecs, num_rows - 1)
            src = row_src[row]
            if g < total and src != 0:
                v = g - row * h_vecs
                cute.copy(vec, cute.local_tile(bf16_row(src, hidden), (VEC_ELEMS,), (v,)),
                          frag[None, u])
        for u in cutlass.range_constexpr(vectors):
            g = c0 + 32 * u
            row = cutlass.min(g // h_vecs, num_rows - 1)
            if g < total and row_src[row] != 0:
                v = g - row * h_vecs
                cute.copy(vec, frag[None, u],
                          cute.local_tile(bf16_row(row_dst[row], hidden), (VEC_ELEMS,), (v,)))


@cute.jit
def zero_row(dst: cute.Tensor, h_vecs: Int32, lane: Int32):
    vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    zeros = cute.make_rmem_tensor((VEC_ELEMS,), BFloat16)
    zeros.fill(0.0)
    for v in cutlass.range(lane, h_vecs, 32, unroll=1):
        cute.copy(vec, zeros, cute.local_tile(dst, (VEC_ELEMS,), (v,)))


@cute.jit
def _publish_tile(counters: cute.Tensor, index, scope: cutlass.Constexpr[str]):
    """Every row of the tile is written (CTA barrier) before thread 0 publishes it."""
    cute.arch.barrier()
    if cute.arch.thread_idx()[0] == 0:
        if cutlass.const_expr(scope == "sys"):
            cute.arch.fence_acq_rel_sys()
        else:
            cute.arch.fence_acq_rel_gpu()
        common.counter_publish(counters, index, 1, scope)


class _RowExchange:
    """Shared body of both comm tasks: a persistent grid walks (rank, M-tile) tasks, one warp
    per row; ``pull`` copies peer x rows into the ring, push copies ring rows to the peers'
    combine slots. Each finished tile is release-published in ``counters``."""

    pull: bool = True

    def __init__(self, num_warps: int = 8, num_ctas: int = 132, scope: str = "gpu"):
        if num_warps < 1 or num_ctas < 1:
            raise ValueError(f"num_warps and num_ctas must be >= 1, got {num_warps}, {num_ctas}")
        if scope not in ("gpu", "sys"):
            raise ValueError(f"scope must be 'gpu' or 'sys', got {scope!r}")
        self.num_warps = num_warps
        self.num_ctas = num_ctas
        self.scope = scope

    @cute.jit
    def _launch(self, peer_bases, row_peer, row_token, row_k, ring, num_tiles, counters,
                offset_bytes: Int64, top_k: Int32):
        self.kernel(peer_bases, row_peer, row_token, row_k, ring, num_tiles, counters,
                    offset_bytes, top_k).launch(grid=[self.num_ctas, 1, 1],
                                                block=[32 * self.num_warps, 1, 1])

    @cute.kernel
    def kernel(self, peer_bases: cute.Tensor, row_peer: cute.Tensor, row_token: cute.Tensor,
               row_k: cute.Tensor, ring: cute.Tensor, num_tiles: cute.Tensor,
               counters: cute.Tensor, offset_bytes: Int64, top_k: Int32):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        num_ranks = cute.size(ring, mode=[0])
        hidden = cute.size(ring, mode=[2])
        h_vecs = hidden // VEC_ELEMS
        row_bytes = Int64(hidden) * 2
        tiles_cap = cute.size(counters, mode=[1])
        task = cute.arch.block_idx()[0]
        while task < num_ranks * tiles_cap:
            rank = task // tiles_cap
            tile = task - rank * tiles_cap
            if tile < num_tiles[rank]:
                for r in cutlass.range(warp, TILE_M, self.num_warps, unroll=1):
                    row = tile * TILE_M + r
                    peer = row_peer[rank, row]
                    local = ring[rank, row, None]
                    if peer >= 0:
                        # pull: x row `token` of the peer; push: combine slot token*K + k
                        index = Int64(row_token[rank, row])
                        if cutlass.const_expr(not self.pull):
                            index = index * Int64(top_k) + Int64(row_k[rank, row])
                        remote = bf16_row(peer_bases[rank, peer] + offset_bytes + index * row_bytes,
                                           hidden)
                        if cutlass.const_expr(self.pull):
                            copy_row(remote, local, h_vecs, lane)
                        else:
                            copy_row(local, remote, h_vecs, lane)
                    elif cutlass.const_expr(self.pull):
                        zero_row(local, h_vecs, lane)  # padding rows of the ring read as zeros
                _publish_tile(counters, rank * tiles_cap + tile, self.scope)
            task += cute.arch.grid_dim()[0]


class PullDispatch(_RowExchange):
    """Copy schedule rows from the owning ranks' ``x`` into each rank's ring."""

    pull = True

    @cute.jit
    def __call__(self, peer_bases: cute.Tensor, row_peer: cute.Tensor, row_token: cute.Tensor,
                 ring: cute.Tensor, num_tiles: cute.Tensor, dispatched: cute.Tensor,
                 x_offset_bytes: Int64):
        """peer_bases int64 (R, P): base address of peer p's buffer as seen by rank r;
        row_peer / row_token int32 (R, capacity); ring bf16 (R, capacity, H);
        num_tiles int32 (R,); dispatched int32 (R, capacity / 128); x lives at
        ``x_offset_bytes`` inside every peer buffer as a row-major [T_max, H] bf16 array."""
        self._launch(peer_bases, row_peer, row_token, row_token, ring, num_tiles, dispatched,
                     x_offset_bytes, Int32(1))


class PushCombine(_RowExchange):
    """Store each expert output row to its source rank's combine buffer at (token, k)."""

    pull = False

    @cute.jit
    def __call__(self, peer_bases: cute.Tensor, row_peer: cute.Tensor, row_token: cute.Tensor,
                 row_k: cute.Tensor, ring_y: cute.Tensor, num_tiles: cute.Tensor,
                 combined: cute.Tensor, combine_offset_bytes: Int64, top_k: Int32):
        """As PullDispatch, plus row_k int32 (R, capacity) and ring_y bf16 (R, capacity, H);
        the combine buffer lives at ``combine_offset_bytes`` in every peer buffer as a
        row-major [T_max * top_k, H] bf16 array."""
        self._launch(peer_bases, row_peer, row_token, row_k, ring_y, num_tiles, combined,
                     combine_offset_bytes, top_k)


def _fake_schedule_args(extra_row_arrays: int):
    ranks, peers, cap = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(divisibility=TILE_M)
    hidden, tiles = cute.sym_int32(divisibility=VEC_ELEMS), cute.sym_int32()
    fake = common.fake_strided_tensor
    rows = [fake(Int32, (ranks, cap), align_bytes=4) for _ in range(2 + extra_row_arrays)]
    return (fake(Int64, (ranks, peers), align_bytes=8), *rows,
            fake(BFloat16, (ranks, cap, hidden), align_bytes=16), common.fake_vector(Int32),
            fake(Int32, (ranks, tiles), align_bytes=4))


def compile_pull_dispatch(arch: str = "sm_90a", *, options: str = "", num_warps: int = 8,
                          num_ctas: int = 132, scope: str = "gpu"):
    """Compile on fake tensors (no GPU): every extent is a run-time value."""
    op = PullDispatch(num_warps=num_warps, num_ctas=num_ctas, scope=scope)
    return cute.compile(op, *_fake_schedule_args(0), Int64(0),
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))


def compile_push_combine(arch: str = "sm_90a", *, options: str = "", num_warps: int = 8,
                         num_ctas: int = 132, scope: str = "gpu"):
    """Compile on fake tensors (no GPU): every extent is a run-time value."""
    op = PushCombine(num_warps=num_warps, num_ctas=num_ctas, scope=scope)
    return cute.compile(op, *_fake_schedule_args(1), Int64(0), Int32(1),
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))
