"""Pull dispatch: the first comm-CTA task of the megakernel, as a standalone kernel.

For every receiving rank ``r`` and every live M-tile of its receive schedule, copy the tile's
128 rows ``x[row_peer, row_token]`` from the symmetric buffer of the rank that owns each
token (its base address read from the peer table at run time) into rank r's ring, in
schedule order; padding rows (peer -1) are written as zeros. After a tile is complete,
thread 0 publishes ``dispatched[r, tile] += 1`` with release semantics, which is the
counter the FC1 tasks of that tile will wait on.

- Virtual backend: every rank's CTAs are in this one launch (``(rank, tile)`` tasks walked
  with a grid stride) and ``peer_bases`` is the [R, R] table of ``VirtualPeers``; with the
  IPC backend the same kernel runs per process with R = 1 receiving rank.
- Rows move as 16-byte vectors, one warp per row; the token count and hidden size are
  run-time values; no host sync.

Status: compiles for sm_90a (PTX checked in CI). NOT yet run on a GPU: its GPU test
(tests/test_dispatch.py) is the first megakernel step of docs/megakernel_plan.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from mok_cute import jit
from mok_cute.kernels import common

VEC_ELEMS = 8  # bf16 per 16-byte vector
TILE_M = 128


class PullDispatch:
    """Copy schedule rows from the owning ranks' ``x`` into each rank's ring.

    :param num_warps: warps per CTA (one row per warp at a time).
    :param num_ctas: persistent grid size.
    """

    def __init__(self, num_warps: int = 8, num_ctas: int = 132):
        if num_warps < 1 or num_ctas < 1:
            raise ValueError(f"num_warps and num_ctas must be >= 1, got {num_warps}, {num_ctas}")
        self.num_warps = num_warps
        self.num_ctas = num_ctas

    @cute.jit
    def __call__(self, peer_bases: cute.Tensor, row_peer: cute.Tensor, row_token: cute.Tensor,
                 ring: cute.Tensor, num_tiles: cute.Tensor, dispatched: cute.Tensor,
                 x_offset_bytes: Int64):
        """peer_bases int64 (R, P): base address of peer p's buffer as seen by rank r;
        row_peer / row_token int32 (R, capacity); ring bf16 (R, capacity, H);
        num_tiles int32 (R,); dispatched int32 (R, capacity / 128); x lives at
        ``x_offset_bytes`` inside every peer buffer as a row-major [T_max, H] bf16 array."""
        self.kernel(peer_bases, row_peer, row_token, ring, num_tiles, dispatched,
                    x_offset_bytes).launch(grid=[self.num_ctas, 1, 1],
                                           block=[32 * self.num_warps, 1, 1])

    @cute.kernel
    def kernel(self, peer_bases: cute.Tensor, row_peer: cute.Tensor, row_token: cute.Tensor,
               ring: cute.Tensor, num_tiles: cute.Tensor, dispatched: cute.Tensor,
               x_offset_bytes: Int64):
        tidx = cute.arch.thread_idx()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        num_ranks = cute.size(ring, mode=[0])
        hidden = cute.size(ring, mode=[2])
        h_vecs = hidden // VEC_ELEMS
        tiles_cap = cute.size(dispatched, mode=[1])
        row_bytes = Int64(hidden) * 2
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        zeros = cute.make_rmem_tensor((VEC_ELEMS,), BFloat16)
        zeros.fill(0.0)

        task = cute.arch.block_idx()[0]
        while task < num_ranks * tiles_cap:
            rank = task // tiles_cap
            tile = task - rank * tiles_cap
            if tile < num_tiles[rank]:
                for r in cutlass.range(warp, TILE_M, self.num_warps, unroll=1):
                    row = tile * TILE_M + r
                    peer = row_peer[rank, row]
                    dst = ring[rank, row, None]
                    if peer >= 0:
                        src_addr = (peer_bases[rank, peer] + x_offset_bytes
                                    + Int64(row_token[rank, row]) * row_bytes)
                        src = cute.make_tensor(
                            cute.make_ptr(BFloat16, src_addr, cute.AddressSpace.gmem,
                                          assumed_align=16),
                            cute.make_layout(hidden))
                        for v in cutlass.range(lane, h_vecs, 32, unroll=1):
                            frag = cute.make_rmem_tensor((VEC_ELEMS,), BFloat16)
                            cute.copy(vec, cute.local_tile(src, (VEC_ELEMS,), (v,)), frag)
                            cute.copy(vec, frag, cute.local_tile(dst, (VEC_ELEMS,), (v,)))
                    else:
                        for v in cutlass.range(lane, h_vecs, 32, unroll=1):
                            cute.copy(vec, zeros, cute.local_tile(dst, (VEC_ELEMS,), (v,)))
                # every row of the tile is written before the tile is published
                cute.arch.barrier()
                if tidx == 0:
                    cute.arch.fence_acq_rel_gpu()
                    common.counter_publish(dispatched, rank * tiles_cap + tile, 1)
            task += cute.arch.grid_dim()[0]


def compile_pull_dispatch(arch: str = "sm_90a", *, options: str = "", num_warps: int = 8,
                          num_ctas: int = 132):
    """Compile on fake tensors (no GPU): every extent is a run-time value."""
    op = PullDispatch(num_warps=num_warps, num_ctas=num_ctas)
    ranks, peers, cap = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(divisibility=TILE_M)
    hidden = cute.sym_int32(divisibility=VEC_ELEMS)
    tiles = cute.sym_int32()

    def rowmajor(dtype, shape, align):
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = cute.sym_int64(divisibility=VEC_ELEMS if dtype is BFloat16 else 1)
        return cute.runtime.make_fake_tensor(dtype, shape, stride=tuple(stride), assumed_align=align)

    return cute.compile(
        op,
        rowmajor(Int64, (ranks, peers), 8),
        rowmajor(Int32, (ranks, cap), 4),
        rowmajor(Int32, (ranks, cap), 4),
        rowmajor(BFloat16, (ranks, cap, hidden), 16),
        common.fake_vector(Int32),
        rowmajor(Int32, (ranks, tiles), 4),
        Int64(0),
        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"),
    )
