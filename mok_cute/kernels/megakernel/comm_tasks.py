"""The megakernel's comm CTAs: DISPATCH (pull x rows), COMBINE (push y rows), BARRIER.

``COMM_THREADS`` threads per comm CTA take tickets from an atomic counter (a CTA blocked on
a COMBINE's wait then holds no later task hostage). Per task, thread ``t`` resolves the source
and destination address of the task's row ``t`` into smem; then every warp copies rows as
16-byte vectors, ``COPY_UNROLL`` loads in flight per lane (what hides a peer read's latency).
The copy is published with release once every warp is done.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Int32, Int64, const_expr

from mok_cute import fp8
from mok_cute.constants import TILE_M, VEC_ELEMS, flag_started
from mok_cute.kernels import common
from mok_cute.kernels.megakernel.scheduler import TaskTables
from mok_cute.tasks import Role, TaskType, TaskWord

COMM_THREADS = 384  # comm CTA threads (the first TILE_M resolve one row address each)
COPY_UNROLL = 16  # 16-byte vectors in flight per lane in the row copy


class Routing(NamedTuple):
    """Each rank's receive schedule (``schedule.ReceiveSchedules``) and routing."""

    tile_expert: cute.Tensor  # int32 (R, tiles)
    row_peer: cute.Tensor  # int32 (R, capacity): -1 on padding rows
    row_token: cute.Tensor  # int32 (R, capacity)
    row_k: cute.Tensor  # int32 (R, capacity)
    slot_rows: cute.Tensor  # int32 (R, T * K): ring row of an own slot (rows in place), else -1
    peer_bases: cute.Tensor  # int64 (R, P): every peer's symmetric buffer, seen from rank r
    topk_weights: cute.Tensor  # fp32 (R, T, K)
    topk_idx: cute.Tensor  # int32 (R, T, K)


def bf16_row(addr: Int64, hidden: Int32) -> cute.Tensor:
    """A bf16 row of ``hidden`` elements at a run-time (peer) address, 16-byte aligned."""
    return cute.make_tensor(
        cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16),
        cute.make_layout(hidden))


@cute.jit
def copy_row(src: cute.Tensor, dst: cute.Tensor, h_vecs: Int32, lane: Int32,
             unroll: cutlass.Constexpr[int] = 1):
    """One warp copies a row as 16-byte vectors (lane-strided, coalesced); each lane issues
    ``unroll`` loads before their stores, so several vectors per lane are in flight."""
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
def fill_row(dst: cute.Tensor, value: cutlass.Constexpr[float], h_vecs: Int32, lane: Int32):
    """One warp writes ``value`` into the first ``h_vecs`` 16-byte vectors of the bf16 row
    ``dst`` (zeros: a padding row of a pulled buffer; NaN: a row a failed launch could not
    build)."""
    vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    fill = cute.make_rmem_tensor((VEC_ELEMS,), BFloat16)
    fill.fill(value)
    for v in cutlass.range(lane, h_vecs, 32, unroll=1):
        cute.copy(vec, fill, cute.local_tile(dst, (VEC_ELEMS,), (v,)))


class CommTasks:
    """The comm role (``MegakernelSm90`` mixes it in)."""

    def x_row_bytes(self, ring_x):
        """Bytes of one x row as the symmetric buffers and the ring hold it: bf16 H, or with
        fp8 the packed row of the e4m3 view's H' (``fp8.packed_row_bytes``). Traced inline."""
        if const_expr(self.spec.fp8):
            return fp8.packed_row_bytes(cute.size(ring_x, mode=[1]))
        return cute.size(ring_x, mode=[1]) * 2

    @cute.jit
    def comm_loop(self, ctx, tt: TaskTables, routing: Routing, ring_x, ring_y, timeline_buf,
                  storage, tidx):
        """Walk the comm queue: each task's waits (thread 0), its rows' addresses (a thread
        per row), the copy (every warp), then the release publish (thread 0)."""
        # a DISPATCH moves x rows (bf16, or fp8's packed rows), a COMBINE bf16 y rows
        hidden = cute.size(ring_x, mode=[1])
        x_row_bytes = hidden * 2
        y_row_bytes = x_row_bytes
        if const_expr(self.spec.fp8):
            x_row_bytes = self.x_row_bytes(ring_x)
            y_row_bytes = cute.size(ring_y, mode=[1]) * 2
        peer_bases = routing.peer_bases
        num_peers = cute.size(peer_bases, mode=[1])
        row_src = storage.row_src.get_tensor(cute.make_layout(TILE_M))
        row_dst = storage.row_dst.get_tensor(cute.make_layout(TILE_M))
        words = storage.comm_words.get_tensor(cute.make_layout(4))  # ticket, real rows
        sync = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.COMM),
                                     num_threads=COMM_THREADS)
        peers_started = Int32(0)  # every peer's start flag seen (checked once per CTA)
        live_prefix = self._live_prefix(ctx, tt, int(Role.COMM))
        blk, q_base = Int32(0), Int32(0)  # ticket block cursor (rank_blocks)
        ticket_slot = self._ticket_slot(tt.counters, int(Role.COMM))
        q = self._shared_ticket(tt.counters, ticket_slot, words, sync, tidx)
        index, rank, blk, q_base = self._ticket(tt, live_prefix, int(Role.COMM), q, blk, q_base)
        while index >= 0:
            run, noop = self._task_state(ctx, tt, index, rank)
            if run:
                t_start = self._now_if_recording()
                ttype = tt.tasks[index, TaskWord.TYPE]
                moves = not noop and ttype != int(TaskType.BARRIER)
                if tidx == 0:
                    self._wait_task_recorded(ctx, tt, index, rank, timeline_buf, int(Role.COMM),
                                             True)
                    if ttype == int(TaskType.BARRIER):
                        self._announce_done(ctx, peer_bases, tt.error, rank)
                    elif peers_started == 0:
                        # pulling from / pushing to a peer needs its start flag for this epoch
                        for r in cutlass.range(self.num_ranks, unroll=1):
                            for p in cutlass.range(num_peers, unroll=1):
                                self._wait_flag(ctx, peer_bases, tt.error, r, p,
                                                flag_started(ctx.epoch), index)
                        peers_started = Int32(1)
                    words[1] = 0
                sync.arrive_and_wait()
                row_elems = hidden  # in bf16 elements: the copy moves 16-byte vectors
                if const_expr(self.spec.fp8):
                    row_elems = y_row_bytes // 2
                    if ttype == int(TaskType.DISPATCH):
                        row_elems = x_row_bytes // 2
                if moves:
                    self._resolve_row(ctx, tt, routing, index, rank, ttype, ring_x, ring_y,
                                      x_row_bytes, y_row_bytes, row_src, row_dst, words, tidx)
                sync.arrive_and_wait()
                if moves:
                    for r in cutlass.range(tidx // 32, words[1], COMM_THREADS // 32, unroll=1):
                        if row_src[r] != 0:  # 0: a local row left in place (rows_in_place)
                            copy_row(bf16_row(row_src[r], row_elems),
                                     bf16_row(row_dst[r], row_elems), row_elems // VEC_ELEMS,
                                     cute.arch.lane_idx(), COPY_UNROLL)
                sync.arrive_and_wait()
                if tidx == 0:
                    self._fence()
                    self._signal_task(tt, index, rank)
                    if const_expr(self.spec.timeline):
                        slot = common.timeline_reserve(timeline_buf, 1)
                        common.timeline_write(timeline_buf, slot, int(Role.COMM), ttype, index,
                                              ctx.rank_base + rank, t_start, common.timeline_now())
            q = self._shared_ticket(tt.counters, ticket_slot, words, sync, tidx)
            index, rank, blk, q_base = self._ticket(tt, live_prefix, int(Role.COMM), q, blk,
                                                    q_base)

    @cute.jit
    def _shared_ticket(self, counters, slot: Int32, words, sync, tidx) -> Int32:
        """Thread 0 takes the next ticket; every comm thread of the CTA gets it."""
        if tidx == 0:
            words[0] = self._take_ticket(counters, slot)
        sync.arrive_and_wait()
        q = words[0]
        sync.arrive_and_wait()  # read before thread 0 may overwrite it
        return q

    @cute.jit
    def _resolve_row(self, ctx, tt: TaskTables, routing: Routing, index, rank, ttype, ring_x,
                     ring_y, x_row_bytes, y_row_bytes, row_src, row_dst, words, tidx):
        """Thread t: the addresses of the task's row t. DISPATCH: the owner's x row -> the
        ring x row. COMBINE: the ring y row -> slot ``token * K + k`` of the source rank's
        combine buffer. Padding rows (peer -1) are skipped: a GEMM row depends only on its
        own input row and padding outputs are never combined. A tile lies in one expert
        segment, whose padding is at its end, so the real rows are a prefix; the thread at
        its end writes its length. With rows in place a rank's own rows are not copied
        (source 0)."""
        tasks, row_peer = tt.tasks, routing.row_peer
        row_begin = tasks[index, TaskWord.ROW_BEGIN]
        num_rows = tasks[index, TaskWord.ROW_END] - row_begin
        if tidx < cutlass.min(num_rows, TILE_M):
            row = row_begin + tidx
            ring_row = tasks[index, TaskWord.RING_ROW] + tidx
            peer = row_peer[rank, row]
            if peer >= 0:
                token = Int64(routing.row_token[rank, row])
                base = routing.peer_bases[rank, peer]
                if ttype == int(TaskType.DISPATCH):
                    row_src[tidx] = base + ctx.x_offset + token * Int64(x_row_bytes)
                    row_dst[tidx] = ring_x[ring_row, None, rank].iterator.toint()
                    if const_expr(self.spec.rows_in_place):
                        if peer == ctx.rank_base + rank:
                            row_src[tidx] = Int64(0)  # FC1 reads this row from x itself
                else:
                    slot = token * Int64(self.spec.top_k) + Int64(routing.row_k[rank, row])
                    row_src[tidx] = ring_y[ring_row, None, rank].iterator.toint()
                    row_dst[tidx] = base + ctx.combine_offset + slot * Int64(y_row_bytes)
                    if const_expr(self.spec.rows_in_place):
                        if peer == ctx.rank_base + rank:
                            row_src[tidx] = Int64(0)  # read from the ring by this rank's k-sum
                last = tidx + 1 == num_rows
                if not last:
                    last = row_peer[rank, row + 1] < 0
                if last:
                    words[1] = tidx + 1
