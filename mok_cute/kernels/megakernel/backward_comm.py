"""The backward megakernel's comm CTAs (``BackwardMegakernelSm90(comm_ctas > 0)``): the rows a
rank's routed dgrads read and write move between the group's symmetric buffers inside the
launch, as tasks of the backward list (``tasks_backward``).

    REVERSE_COMBINE (j, c)  pull the d_out rows of M-tile j's chunk c from their source ranks
                            into the dY rows, and each row's router weight into ``weights`` at
                            the row's g | u slot (what the dgated epilogue reads)
    REPULL_X        (j, c)  pull the x rows (the gate / up weight gradients' operand)
    REVERSE_DISPATCH(j, c)  push each dx row into its source's (token, k) slot of ``combine``,
                            and the row's sum of its dgated partials into ``d_topk_partials``

A comm CTA walks the comm queue at positions ``b - num_ctas, + comm_ctas, ...`` (static: the
queue is in list order and every wait points to a lower task, so the walk cannot deadlock);
a task of an M-tile past ``num_tiles`` is skipped (nothing waits on it). Thread 0 waits
(REVERSE_DISPATCH: every FC1_DGRAD N-tile of the tile), then each warp copies rows
``warp, warp + 12, ...`` of the chunk as 16-byte vectors (``comm_tasks.copy_row``); padding
rows (peer -1) are zero rows in dY and x, as ``peer_rows``' pulls write them. Once every warp
is done, thread 0 fences and publishes with release; the compute side acquires and fences the
async proxy before its TMA loads read the rows.

A row's partial sum is ``expert_backward.row_partial_sums``' order exactly: the columns padded
with zeros to a power of two, then halving adds (``partials[:w/2] + partials[w/2:]``). A lane
holds columns ``lane + 32 m``; halvings above 32 columns add registers, the last five add
``shuffle_down`` partners. So d_topk_weights is bitwise the launches' (virtual ranks, one GPU).

Without the group tail the peers' fields were written before the group's barrier 0 and this
launch's pushes are fenced by barrier 1 (``group_backward``), launches of their own around
this one; with it (``backward_tail``, one rank per process) both barriers and the k-sums are
tasks of this loop.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, const_expr

from mok_cute.constants import (BACKWARD_COMM_ROWS, BACKWARD_COMM_SCALARS,
                                BACKWARD_MAX_PARTIAL_COLS, SLOT_ROW_BYTES, TILE_M, VEC_ELEMS)
from mok_cute.kernels import common
from mok_cute.kernels.megakernel.backward_recorder import COMM, START, Recorder
from mok_cute.kernels.megakernel.comm_tasks import COPY_UNROLL, bf16_row, copy_row, fill_row
from mok_cute.kernels.megakernel.scheduler import Context
from mok_cute.tasks_backward import BackwardTaskType, BackwardWord

# the int64 comm scalars: byte offsets of the symmetric layout's fields, then top_k
D_OUT_OFFSET, X_OFFSET, WEIGHTS_OFFSET, COMBINE_OFFSET, PARTIALS_OFFSET, TOP_K = range(
    BACKWARD_COMM_SCALARS)

_COMBINE = int(BackwardTaskType.REVERSE_COMBINE)
_DISPATCH = int(BackwardTaskType.REVERSE_DISPATCH)
_BARRIER = int(BackwardTaskType.BARRIER)
_KSUM = int(BackwardTaskType.KSUM)


class PeerRows(NamedTuple):
    """What the comm tasks read of the receive schedule and the group (one rank's view)."""

    comm_queue: cute.Tensor  # int32 (Qc,): list indices of the comm tasks, in order
    row_peer: cute.Tensor  # int32 (M,): the source rank of each schedule row, -1 on padding
    row_token: cute.Tensor  # int32 (M,)
    row_k: cute.Tensor  # int32 (M,)
    peer_bases: cute.Tensor  # int64 (P,): every peer's symmetric buffer
    comm_scalars: cute.Tensor  # int64 (BACKWARD_COMM_SCALARS,)
    d_rows: cute.Tensor  # bf16 (M, H): the pulled d_out rows (the FC2 dgrad's A)
    x_rows: cute.Tensor  # bf16 (M, H): the pulled x rows
    dx_rows: cute.Tensor  # bf16 (M, H): the FC1 dgrad's output, pushed home


@cute.jit
def signal_slot(tasks: cute.Tensor, index: Int32, counter_offsets: cute.Tensor) -> Int32:
    """The counter slot backward task ``index`` signals: its group's first slot plus its
    index in the group."""
    return (counter_offsets[tasks[index, int(BackwardWord.SIGNAL_GROUP)]]
            + tasks[index, int(BackwardWord.SIGNAL_INDEX)])


def f32_at(addr: Int64) -> cute.Tensor:
    """One fp32 at a run-time (peer) address."""
    return cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4),
                            cute.make_layout(1))


class BackwardCommMixin:
    """The comm role of ``BackwardMegakernelSm90`` (module docstring)."""

    @cute.jit
    def backward_comm_loop(self, tasks: cute.Tensor, counter_offsets: cute.Tensor,
                           counters: cute.Tensor, error: cute.Tensor, num_tiles: cute.Tensor,
                           timeout_ns: Int64, expert_offsets: cute.Tensor, rows: PeerRows,
                           row_slot: cute.Tensor, weights: cute.Tensor, partials: cute.Tensor,
                           tail, ksum_args, tidx: Int32, recorder: Recorder):
        """Every thread of a comm CTA: its tasks of the comm queue, in order. With the group
        tail (``backward_tail``): the peers' start awaited first, BARRIER tasks too, and past
        the static walk (which ends where the KSUMs begin) KSUMs by ticket, staged through
        the CTA's idle B and A stages (``ksum_args``: the stages, the ticket's smem word, the
        comm queue position of the first KSUM). Each task's span is recorded with the
        recorder on (``recorder``: thread 0's; a KSUM's and a BARRIER's here, the others' in
        ``_rows_task``)."""
        sync = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.COMM),
                                     num_threads=self.threads_per_cta)
        queue_len = cute.size(rows.comm_queue)
        pos = Int32(cute.arch.block_idx()[0]) - self.num_ctas
        if const_expr(self.ksum_top_k > 0):
            stage, ticket, ksum_begin = ksum_args
            ctx = Context(tail.scalars)
            self.tail_start(ctx, rows.peer_bases, error, rows.comm_queue[0], tidx, sync)
            # one loop for both walks (two loops made ptxas spill in the consumers' code)
            while pos < queue_len:
                if pos >= ksum_begin:  # the static walk is over: KSUMs by ticket
                    pos = ksum_begin + self.ksum_ticket(counters, counter_offsets, ticket,
                                                        tidx, sync)
                    if pos < queue_len:
                        self.rec_stamp(recorder, START)
                        self.tail_ksum(ctx, tasks, rows.comm_queue[pos], counter_offsets,
                                       counters, error, timeout_ns, rows, tail, stage, tidx,
                                       self.threads_per_cta, sync)
                        self.rec_task(recorder, COMM, _KSUM, rows.comm_queue[pos],
                                      epilogue=False)
                        pos = ksum_begin  # the next ticket
                else:
                    index = rows.comm_queue[pos]
                    if tasks[index, int(BackwardWord.TYPE)] == _BARRIER:
                        self.rec_stamp(recorder, START)
                        self.tail_barrier(ctx, tasks, index, counter_offsets, counters, error,
                                          num_tiles, timeout_ns, rows.peer_bases, tidx, sync)
                        self.rec_task(recorder, COMM, _BARRIER, index, epilogue=False)
                    else:
                        self._rows_task(tasks, index, counter_offsets, counters, error,
                                        num_tiles, timeout_ns, expert_offsets, rows, row_slot,
                                        weights, partials, tidx, sync, recorder)
                    pos += self.comm_ctas
        else:
            while pos < queue_len:
                self._rows_task(tasks, rows.comm_queue[pos], counter_offsets, counters, error,
                                num_tiles, timeout_ns, expert_offsets, rows, row_slot, weights,
                                partials, tidx, sync, recorder)
                pos += self.comm_ctas

    @cute.jit
    def _rows_task(self, tasks: cute.Tensor, index: Int32, counter_offsets: cute.Tensor,
                   counters: cute.Tensor, error: cute.Tensor, num_tiles: cute.Tensor,
                   timeout_ns: Int64, expert_offsets: cute.Tensor, rows: PeerRows,
                   row_slot: cute.Tensor, weights: cute.Tensor, partials: cute.Tensor,
                   tidx: Int32, sync, recorder: Recorder):
        """One pull or push task (module docstring), skipped past the live M-tiles; its span
        and its wait recorded with the recorder on."""
        warp, lane = tidx // 32, cute.arch.lane_idx()
        num_warps = self.threads_per_cta // 32
        hidden = cute.size(rows.d_rows, mode=[1])
        row_bytes = Int64(hidden * 2)
        h_vecs = hidden // VEC_ELEMS
        top_k = Int64(rows.comm_scalars[TOP_K])
        tile = tasks[index, int(BackwardWord.TILE)]
        if tile < num_tiles[0]:
            self.rec_stamp(recorder, START)
            ttype = tasks[index, int(BackwardWord.TYPE)]
            if tidx == 0:
                self.wait_task_recorded(tasks, index, expert_offsets, counter_offsets, counters,
                                        error, timeout_ns, recorder.buf, COMM, True)
            sync.arrive_and_wait()
            row0 = tile * TILE_M + tasks[index, int(BackwardWord.N_TILE)] * BACKWARD_COMM_ROWS
            for r in cutlass.range(warp, BACKWARD_COMM_ROWS, num_warps, unroll=1):
                row = row0 + r
                peer = rows.row_peer[row]
                token = Int64(cutlass.max(rows.row_token[row], 0))
                slot = token * top_k + Int64(cutlass.max(rows.row_k[row], 0))
                base = rows.peer_bases[cutlass.max(peer, 0)]
                if ttype == _DISPATCH:
                    if peer >= 0:
                        copy_row(bf16_row(rows.dx_rows[row, None].iterator.toint(), hidden),
                                 bf16_row(base + rows.comm_scalars[COMBINE_OFFSET]
                                          + slot * row_bytes, hidden),
                                 h_vecs, lane, COPY_UNROLL)
                        total = self._row_partial_sum(partials, row, lane)
                        if lane == 0:
                            f32_at(base + rows.comm_scalars[PARTIALS_OFFSET]
                                   + slot * SLOT_ROW_BYTES)[0] = total
                else:
                    dst = rows.x_rows[row, None].iterator.toint()
                    field = rows.comm_scalars[X_OFFSET]
                    if ttype == _COMBINE:
                        dst = rows.d_rows[row, None].iterator.toint()
                        field = rows.comm_scalars[D_OUT_OFFSET]
                    out = bf16_row(dst, hidden)
                    if peer >= 0:
                        copy_row(bf16_row(base + field + token * row_bytes, hidden), out,
                                 h_vecs, lane, COPY_UNROLL)
                        if ttype == _COMBINE:
                            # a row whose g | u the forward could not keep (slot -1, with
                            # saved_rows_factor or saved_rows_pool): no weight, the dgrads skip it
                            saved_row = row_slot[row]
                            if lane == 0 and saved_row >= 0:
                                weights[saved_row] = f32_at(
                                    base + rows.comm_scalars[WEIGHTS_OFFSET]
                                    + slot * SLOT_ROW_BYTES)[0]
                    else:
                        fill_row(out, 0.0, h_vecs, lane)
            sync.arrive_and_wait()
            if tidx == 0:
                cute.arch.fence_acq_rel_gpu()
                common.counter_publish(counters, signal_slot(tasks, index, counter_offsets), 1)
            self.rec_task(recorder, COMM, ttype, index, epilogue=False)

    @cute.jit
    def _row_partial_sum(self, partials: cute.Tensor, row: Int32, lane: Int32) -> Float32:
        """Row ``row``'s sum of its dgated partials in ``row_partial_sums``' order (module
        docstring); the whole warp calls it, lane 0 holds the sum."""
        cols = cute.size(partials, mode=[1])
        held = BACKWARD_MAX_PARTIAL_COLS // 32
        v = cute.make_rmem_tensor((held,), Float32)
        for m in cutlass.range_constexpr(held):
            v[m] = Float32(0.0)
            if lane + 32 * m < cols:
                v[m] = partials[row, lane + 32 * m]
        width = Int32(1)
        while width < cols:
            width *= 2
        for level in cutlass.range_constexpr(3):  # widths 256, 128, 64: in registers
            c = BACKWARD_MAX_PARTIAL_COLS >> level
            if width == c:
                for m in cutlass.range_constexpr(c // 64):
                    v[m] = v[m] + v[m + c // 64]
                width = Int32(c // 2)
        total = v[0]
        for level in cutlass.range_constexpr(5):  # widths 32 .. 2: shuffle partners
            offset = 16 >> level
            other = cute.arch.shuffle_sync_down(total, offset)
            if offset < width:
                total = total + other
        return total


__all__ = ["BackwardCommMixin", "PeerRows"]
