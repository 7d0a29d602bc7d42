"""The megakernel's task walk: tickets, waits, signals and the cross-rank flags.

Every CTA walks one role's queue of the task list (``mok_cute.tasks``) by tickets. Ticket
``q`` of a role maps to a queue position and a virtual rank (``_ticket``; its host model, used
by the tests and the simulator, is ``mok_cute.tickets.ticket_position``):

- alternating (one rank, or an IPC rank): position ``q // R`` of rank ``q % R``; past the
  largest live prefix of any rank, the dead middle of the queue is jumped over to the tail;
- rank blocks (virtual ranks): the queue is cut into one block per minibatch plus the tail,
  and ``R * size`` tickets walk a block, every rank's share in turn, so concurrent tiles
  share one rank's weights in L2.

A task runs when its minibatch is live, is a no-op (signals without work) when its M-tile
is past the live count, and is skipped otherwise. Before running, a task waits on its
counters (acquire, each wait bounded by the timeout); when done it publishes its one counter
(release). Cross-rank flags live in every rank's symmetric buffer: flag ``s`` is written only
by rank ``s`` (``constants.flag_started`` at launch start, ``flag_done`` after its last
combine, beside it the sticky epoch of its last failed launch), so it only grows and never
needs a reset.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from mok_cute.constants import SCALARS, TICKETS, flag_done, flag_started
from mok_cute.kernels import common
from mok_cute.tasks import CounterGroup, TaskType, TaskWord

# The ticket ring (compute CTAs with tickets "dynamic" or "strided"): TICKET_SLOTS decoded
# tasks in smem, written by lane 0 of the producer's warp 0, read by every other warp.
TICKET_SLOTS = 4
# The words of one ring slot
D_INDEX, D_RANK, D_TYPE, D_MTILE, D_NTILE, D_RING_TILE, D_EXPERT, D_SIGNAL = range(8)
D_ROW_BEGIN, D_NUM_WAITS = 8, 9
DECODED_WORDS = 10
RUN_FLAG, NOOP_FLAG = 1 << 8, 1 << 9  # or-ed into D_TYPE above the task type
WAIT_RECORD_MIN_NS = 1000  # shorter dependency waits are not recorded as WAIT spans


class TaskTables(NamedTuple):
    """The encoded task list (``task_encoding.encode_device``) and its counters."""

    tasks: cute.Tensor  # int32 (N, TASK_WORDS)
    queues: cute.Tensor  # int32 (2, Q): list indices per role, in walk order
    queue_len: cute.Tensor  # int32 (2,)
    queue_live_len: cute.Tensor  # int32 (2, MB + 1): live prefix per live-minibatch count
    queue_blocks: cute.Tensor  # int32 (2, MB + 1): first position of each ticket block
    counter_offsets: cute.Tensor  # int32 (G + 1,): where each counter group starts
    counters: cute.Tensor  # int32 (R, num_counters + TICKETS), zero at launch
    error: cute.Tensor  # int64 (1,): the first timed-out wait
    num_tiles: cute.Tensor  # int32 (R,): live M-tiles of each rank's schedule


class Context:
    """Per-launch run-time scalars (``constants.SCALAR_FIELDS``), read once per thread.
    Carried through run-time loops as DSL values."""

    _FIELDS = ("epoch", "rank_base", "tiles_per_minibatch", "x_offset", "combine_offset",
               "flags_offset", "timeout_ns", "local_experts", "static_tiles", "silent_rank")
    _TYPES = (Int32, Int32, Int32, Int64, Int64, Int64, Int64, Int32, Int32, Int32)

    def __init__(self, scalars: cute.Tensor = None, values=None):
        if values is None:
            values = [t(scalars[i]) for i, t in zip(range(SCALARS), self._TYPES)]
        for name, v in zip(self._FIELDS, values):
            setattr(self, name, v)

    def __extract_mlir_values__(self):
        return [getattr(self, n).ir_value() for n in self._FIELDS]

    def __new_from_mlir_values__(self, values):
        return Context(values=[t(v) for t, v in zip(self._TYPES, values)])

    def live_minibatches(self, tiles):
        return (tiles + self.tiles_per_minibatch - 1) // self.tiles_per_minibatch


class SchedulerMixin:
    """Ticket walk, waits, signals and flags (``MegakernelSm90`` mixes it in)."""

    @cute.jit
    def _live_prefix(self, ctx, tt: TaskTables, role: cutlass.Constexpr[int]) -> Int32:
        """Queue positions below the largest live prefix of any rank are walked in order;
        past it the dead middle of every rank's queue is jumped over (read once per CTA:
        the tile counts do not change during the launch)."""
        live_prefix = Int32(0)
        for r in cutlass.range(self.num_ranks, unroll=1):
            live = ctx.live_minibatches(tt.num_tiles[r])
            live_prefix = cutlass.max(live_prefix, tt.queue_live_len[role, live])
        return live_prefix

    @cute.jit
    def _block(self, tt: TaskTables, live_prefix: Int32, role: cutlass.Constexpr[int],
               blk: Int32):
        """(first queue position, size) of ticket block ``blk``: a minibatch's block clipped to
        the live prefix, or (the last) the tail."""
        queue_blocks = tt.queue_blocks
        tail_blk = cute.size(queue_blocks, mode=[1]) - 1
        start = queue_blocks[role, tail_blk]
        size = tt.queue_len[role] - start
        if blk < tail_blk:
            start = queue_blocks[role, blk]
            size = cutlass.max(cutlass.min(queue_blocks[role, blk + 1], live_prefix) - start, 0)
        return start, size

    @cute.jit
    def _ticket(self, tt: TaskTables, live_prefix: Int32, role: cutlass.Constexpr[int],
                q: Int32, blk: Int32, q_base: Int32):
        """Ticket -> (list index, or -1 once the role's queue is exhausted; rank; the CTA's
        block cursor (block, its first ticket), carried to its next, larger ticket)."""
        R = self.num_ranks
        queue_len, queue_blocks = tt.queue_len, tt.queue_blocks
        pos = q // R
        rank = q % R
        if const_expr(self.spec.rank_blocks):
            last_blk = cute.size(queue_blocks, mode=[1]) - 1
            never = Int32(0x7FFFFFFF)  # past the tail block: no ticket ends it
            start, size = self._block(tt, live_prefix, role, blk)
            end = cutlass.select_(blk <= last_blk, q_base + R * size, never)
            while q >= end:
                q_base = end
                blk += 1
                start, size = self._block(tt, live_prefix, role, blk)
                end = cutlass.select_(blk <= last_blk, q_base + R * size, never)
            pos = queue_len[role]  # exhausted
            rank = Int32(0)
            if blk <= last_blk:
                off = q - q_base
                rank = off // size
                pos = start + off % size
        else:
            if pos >= live_prefix:
                pos = queue_blocks[role, cute.size(queue_blocks, mode=[1]) - 1] + (pos - live_prefix)
        index = Int32(-1)
        if pos < queue_len[role]:
            index = tt.queues[role, pos]
        return index, rank, blk, q_base

    @cute.jit
    def _task_state(self, ctx, tt: TaskTables, index: Int32, rank: Int32):
        """(run, noop) of a task on ``rank``: a dead minibatch is skipped (run False);
        a tile past the live count signals without work (noop True)."""
        minibatch = tt.tasks[index, TaskWord.MINIBATCH]
        tiles = tt.num_tiles[rank]
        run = minibatch < ctx.live_minibatches(tiles)
        noop = minibatch >= 0 and tt.tasks[index, TaskWord.M_TILE] >= tiles
        return run, noop

    @cute.jit
    def _wait_task(self, ctx, tt: TaskTables, index: Int32, rank: Int32, num_waits=None,
                   lane=None, lanes=None):
        """Spin until every wait of the task holds (waits on tiles past the live ones are
        clipped away). Called by one thread or by a whole warp (each lane waits).
        ``num_waits``: the task's count of waits when the caller has it (from the ring).
        ``lane`` / ``lanes``: ``lanes`` threads share each range, thread ``lane`` waiting for
        every ``lanes``-th counter (the caller then syncs them)."""
        tasks = tt.tasks
        tiles = tt.num_tiles[rank]
        live_mb = ctx.live_minibatches(tiles)
        live_tile_end = cutlass.min(live_mb * ctx.tiles_per_minibatch, ctx.static_tiles)
        rank_counters = tt.counters[rank, None]
        if const_expr(num_waits is None):
            num_waits = tasks[index, TaskWord.NUM_WAITS]
        for w in cutlass.range(num_waits, unroll=1):
            group = tasks[index, TaskWord.WAITS + 4 * w]
            first = tasks[index, TaskWord.WAITS + 4 * w + 1]
            end = first + tasks[index, TaskWord.WAITS + 4 * w + 2]
            target = tasks[index, TaskWord.WAITS + 4 * w + 3]
            if group == int(CounterGroup.DISPATCHED_MB):
                end = cutlass.min(end, live_mb)
            elif group <= int(CounterGroup.COMBINED):
                end = cutlass.min(end, live_tile_end)  # per-tile groups (0, 2, 3, 4)
            base = tt.counter_offsets[group]
            step = 1
            if const_expr(lanes is not None):
                first, step = first + lane, lanes
            for i in cutlass.range(first, end, step, unroll=1):
                me = ctx.rank_base + rank
                common.wait_counter(rank_counters, base + i, target, ctx.timeout_ns, tt.error,
                                    index, me, me, self.spec.scope)

    @cute.jit
    def _wait_task_recorded(self, ctx, tt: TaskTables, index: Int32, rank: Int32,
                            timeline_buf, role: cutlass.Constexpr[int], leader, num_waits=None,
                            lane=None, lanes=None):
        """``_wait_task``; with the recorder on, a wait longer than WAIT_RECORD_MIN_NS also
        becomes a WAIT span (written by ``leader``), so the timeline shows waits apart from work."""
        t0 = self._now_if_recording()
        self._wait_task(ctx, tt, index, rank, num_waits, lane, lanes)
        self._record_wait(ctx, timeline_buf, role, int(TaskType.WAIT), index, rank, t0, leader,
                          WAIT_RECORD_MIN_NS)

    @cute.jit
    def _record_wait(self, ctx, timeline_buf, role: cutlass.Constexpr[int],
                     task_type: cutlass.Constexpr[int], index: Int32, rank: Int32, t0: Int64,
                     leader, min_ns: cutlass.Constexpr[int]):
        """With the recorder on: a wait that began at ``t0`` (``_now_if_recording``) and ends
        now becomes a ``task_type`` span of task ``index``, written by ``leader``, when it lasted
        over ``min_ns``; nothing is emitted with the recorder off."""
        if const_expr(self.spec.timeline):
            t1 = common.timeline_now()
            if leader and t1 - t0 > min_ns:
                slot = common.timeline_reserve(timeline_buf, 1)
                common.timeline_write(timeline_buf, slot, role, task_type, index,
                                      ctx.rank_base + rank, t0, t1)

    @cute.jit
    def _now_if_recording(self) -> Int64:
        """%globaltimer with the recorder on; nothing is emitted with it off."""
        t = Int64(0)
        if const_expr(self.spec.timeline):
            t = common.timeline_now()
        return t

    @cute.jit
    def _signal_task(self, tt: TaskTables, index: Int32, rank: Int32):
        """Release-publish the task's counter (caller has made its writes visible)."""
        group = tt.tasks[index, TaskWord.SIGNAL_GROUP]
        slot = tt.counter_offsets[group] + tt.tasks[index, TaskWord.SIGNAL_INDEX]
        common.counter_publish(tt.counters[rank, None], slot, 1, self.spec.scope)

    @cute.jit
    def _fence(self):
        """Make what this thread has seen and written visible before a release."""
        if const_expr(self.spec.scope == "sys"):
            cute.arch.fence_acq_rel_sys()
        else:
            cute.arch.fence_acq_rel_gpu()

    @cute.jit
    def _take_ticket(self, counters, slot: Int32) -> Int32:
        return cute.arch.atomic_add((counters.iterator + slot).llvm_ptr, Int32(1),
                                    sem="relaxed", scope="gpu")

    @cute.jit
    def _ticket_slot(self, counters, role: cutlass.Constexpr[int]) -> Int32:
        """The ticket counter of ``role``, after rank 0's task counters."""
        return cute.size(counters, mode=[1]) - TICKETS + role

    # ------------------------------------------------------------------ cross-rank flags
    @cute.jit
    def _flag_tensor(self, ctx, peer_bases, rank: Int32, peer: Int32):
        """The barrier_flags inside peer ``peer``'s symmetric buffer (seen from rank)."""
        return common.flags_at(peer_bases[rank, peer] + ctx.flags_offset,
                               cute.size(peer_bases, mode=[1]))

    @cute.jit
    def _store_flag(self, ctx, peer_bases, rank: Int32, peer: Int32, value: Int32,
                    failed_epoch=0):
        common.store_flag(self._flag_tensor(ctx, peer_bases, rank, peer), ctx.rank_base + rank,
                          value, failed_epoch, self.spec.scope)

    @cute.jit
    def _wait_flag(self, ctx, peer_bases, error, rank: Int32, peer: Int32, target: Int32,
                   index: Int32):
        """Wait until ``peer`` has stored >= target into this rank's flag ``peer`` (a flag
        still below this launch's start value names a peer that never started)."""
        me = ctx.rank_base + rank
        own = self._flag_tensor(ctx, peer_bases, rank, me)
        common.wait_counter(own, peer, target, ctx.timeout_ns, error, index, peer, me,
                            self.spec.scope, flag_started(ctx.epoch))

    @cute.jit
    def _peer_failed(self, ctx, peer_bases, rank: Int32, peer: Int32) -> cutlass.Boolean:
        """After ``_wait_flag`` for this call's done value: ``common.peer_failed``."""
        own = self._flag_tensor(ctx, peer_bases, rank, ctx.rank_base + rank)
        return common.peer_failed(own, peer, ctx.epoch, self.spec.scope)

    @cute.jit
    def _announce_start(self, ctx, peer_bases, tidx: Int32):
        """Comm CTA 0: each rank's start flag into every peer's buffer."""
        if cute.arch.block_idx()[0] == 0:
            num_peers = cute.size(peer_bases, mode=[1])
            for i in cutlass.range(tidx, self.num_ranks * num_peers, self.threads_per_cta, unroll=1):
                rank = i // num_peers
                if rank != ctx.silent_rank:
                    self._store_flag(ctx, peer_bases, rank, i - rank * num_peers,
                                     flag_started(ctx.epoch))

    @cute.jit
    def _announce_done(self, ctx, peer_bases, error, rank: Int32):
        """The BARRIER's flag, after its waits: this rank's combines are all done, told to
        every peer (unicast flags): ``flag_done``, with this call's epoch in the sticky
        failed word when a wait of this launch has given up (then the rows it pushed may be
        garbage, and every peer's k-sum writes NaN instead of a plausible wrong output)."""
        self._fence()
        if common.error_recorded(error):
            for p in cutlass.range(cute.size(peer_bases, mode=[1]), unroll=1):
                self._store_flag(ctx, peer_bases, rank, p, flag_done(ctx.epoch), ctx.epoch)
        else:
            for p in cutlass.range(cute.size(peer_bases, mode=[1]), unroll=1):
                self._store_flag(ctx, peer_bases, rank, p, flag_done(ctx.epoch))


# ---------------------------------------------------------------------- ticket ring
# TICKET_SLOTS slots of DECODED_WORDS words in smem (``ticket_q``), with TICKET_SLOTS full
# mbarriers then TICKET_SLOTS empty ones (``bars``). Lane 0 of the producer's warp 0 writes a
# slot and arrives on its full barrier; every reader warp (warp 0 too) waits on it, reads the
# slot, and every one of its lanes arrives on the empty one when it gives the slot back. Use k
# of the ring is slot k % TICKET_SLOTS in phase (k // TICKET_SLOTS) & 1; a reader keeps its
# slot until it takes the next one (it reads the words while it runs the task). Every lane
# waits and arrives itself: a lane-0 arrive after __syncwarp left the other lanes' reads
# unordered for compute-sanitizer racecheck (the warp sync compiles to nothing), which then
# reported write-after-read hazards once the ring wrapped.
@cute.jit
def ticket_ring_init(bars, reader_warps: cutlass.Constexpr[int]):
    for s in cutlass.range_constexpr(TICKET_SLOTS):
        cute.arch.mbarrier_init(bars + s, 1)
        cute.arch.mbarrier_init(bars + TICKET_SLOTS + s, 32 * reader_warps)
    cute.arch.mbarrier_init_fence()


@cute.jit
def ring_wait_empty(bars, k: Int32):
    """The writer of ring use k: wait until every reader has given back the slot's last use."""
    cute.arch.mbarrier_wait(bars + TICKET_SLOTS + k % TICKET_SLOTS, ((k // TICKET_SLOTS) & 1) ^ 1)


@cute.jit
def ring_wait_full(bars, k: Int32):
    """A reader of ring use k: wait until the writer has published it."""
    cute.arch.mbarrier_wait(bars + k % TICKET_SLOTS, (k // TICKET_SLOTS) & 1)


@cute.jit
def ring_words(ticket_q, k: Int32):
    """The words of ring use k."""
    return cute.make_tensor(ticket_q + (k % TICKET_SLOTS) * DECODED_WORDS,
                            cute.make_layout(DECODED_WORDS))


@cute.jit
def ring_give_back(bars, k: Int32):
    """Every lane of a reader warp: done with ring use k - 1 (none before use 0)."""
    if k > 0:
        cute.arch.mbarrier_arrive(bars + TICKET_SLOTS + (k - 1) % TICKET_SLOTS)


@cute.jit
def ring_next(ticket_q, bars, k: Int32):
    """A whole reader warp: give back ring use k - 1, wait for use k; its (index, rank)."""
    ring_give_back(bars, k)
    ring_wait_full(bars, k)
    slot = ring_words(ticket_q, k)
    return slot[D_INDEX], slot[D_RANK]
