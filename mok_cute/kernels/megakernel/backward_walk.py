"""The backward megakernel's walk (``backward.py``) and the ring that hands the dgrads' decoded
words from the load warp to the consumer warps.

The walk is the compute queue's live prefix (``queue_live_len`` of the live minibatch count:
the dgrads), then the tail (the weight gradients, by ticket: ``backward_wgrad``); a CTA takes
the dgrad positions ``b, b + num_ctas, ...``. The load warp decodes one position ahead
(``_task``: the next task's loads wait under this one's mainloop), and its lane 0 publishes
each dgrad's decoded words (list index, type and run flag, M-tile, N-tile, counter slot, wait
count, the defer rule's counter groups) into a smem ring (``scheduler``'s ticket ring), use k
for the CTA's k-th dgrad position (``_ring_use``). The consumer warps read them there
(``_dgrad_words``; the next one's for the defer rule: ``_next_dgrad_words``) instead of
decoding them again from global memory between two tasks. ``_wait_task``: the spin on a
task's waits (the load warp's and the comm CTAs', through ``wait_task_recorded``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from mok_cute.constants import TILE_M
from mok_cute.kernels import common
from mok_cute.kernels.megakernel.backward_comm import signal_slot
from mok_cute.kernels.megakernel.scheduler import (D_INDEX, D_MTILE, D_NTILE, D_NUM_WAITS,
                                                   D_RANK, D_RING_TILE, D_SIGNAL, D_TYPE,
                                                   RUN_FLAG, TICKET_SLOTS, ring_next,
                                                   ring_wait_empty, ring_wait_full, ring_words)
from mok_cute.tasks_backward import EXPERT_TILES, BackwardWord

# the dgrads' ring of decoded tasks has the forward's slots (``scheduler``'s D_* words); two the
# backward has no use for hold the counter groups of the defer rule: the task's signal group
# and its first wait's group
D_SIGNAL_GROUP, D_WAIT_GROUP = D_RANK, D_RING_TILE


class BackwardWalkMixin:
    """The walk and the dgrads' decoded-word ring of ``BackwardMegakernelSm90`` (module
    docstring)."""

    @cute.jit
    def _live_len(self, queue_live_len: cute.Tensor, num_tiles: cute.Tensor,
                  scalars: cute.Tensor) -> Int32:
        """The compute queue's live prefix: every task of the live minibatches."""
        per_minibatch = Int32(scalars[1])
        live = (num_tiles[0] + per_minibatch - 1) // per_minibatch
        return queue_live_len[cutlass.min(live, cute.size(queue_live_len) - 1)]

    @cute.jit
    def _walk(self, tasks: cute.Tensor, queue: cute.Tensor, queue_live_len: cute.Tensor,
              num_tiles: cute.Tensor, scalars: cute.Tensor):
        """The walk: (tasks, queue, live prefix, num_tiles, tail begin, queue length)."""
        return (tasks, queue, self._live_len(queue_live_len, num_tiles, scalars), num_tiles,
                Int32(scalars[2]), Int32(scalars[3]))

    @cute.jit
    def _walk_len(self, walk) -> Int32:
        """Positions a CTA walks: the live prefix, then the tail."""
        _, _, live_len, _, tail_begin, queue_len = walk
        return live_len + queue_len - tail_begin

    @cute.jit
    def _index(self, walk, pos: Int32) -> Int32:
        """The list index at walk position ``pos`` (the live prefix, then the tail)."""
        _, queue, live_len, _, tail_begin, _ = walk
        at = pos
        if pos >= live_len:
            at = tail_begin + pos - live_len
        return queue[at]

    @cute.jit
    def _task(self, walk, pos: Int32, counter_offsets: cute.Tensor):
        """Task words of walk position ``pos`` (clamped to the walk: a CTA decodes the task
        after the one it runs, so that their loads wait under its mainloop): (run, type,
        M-tile or expert, N-tile, M-block, wait count, counter slot it signals, list index); a
        dgrad past the live M-tiles does not run (a weight gradient's ``run`` is unused)."""
        tasks, _, _, num_tiles, _, _ = walk
        index = self._index(walk, cutlass.max(cutlass.min(pos, self._walk_len(walk) - 1), 0))
        tile = tasks[index, int(BackwardWord.TILE)]
        signal = signal_slot(tasks, index, counter_offsets)
        run = tile < num_tiles[0]
        ttype = tasks[index, int(BackwardWord.TYPE)]
        if const_expr(self.shared):  # its token tiles run whatever the routing
            run = run or self.is_shared_task(ttype)
        return (run, ttype, tile,
                tasks[index, int(BackwardWord.N_TILE)], tasks[index, int(BackwardWord.M_BLOCK)],
                tasks[index, int(BackwardWord.NUM_WAITS)], signal, index)

    @cute.jit
    def _ring_base(self, first: Int32) -> Int32:
        """The dgrads' ring's use of walk position p is p // num_ctas minus this: the CTA's
        first position's p // num_ctas (0 without the pingpong phase, whose positions the
        walk skips here). Computed from positions on both sides: a use counter carried
        through the loops spilled."""
        base = Int32(0)
        if const_expr(self.fc2_pingpong):
            base = first // self.num_ctas
        return base

    @cute.jit
    def _ring_use(self, pos: Int32, base: Int32) -> Int32:
        """The dgrad ring's use of walk position ``pos`` (``_ring_base``)."""
        return pos // self.num_ctas - base

    @cute.jit
    def _publish_dgrad(self, ring, k: Int32, tasks: cute.Tensor, counter_offsets: cute.Tensor,
                       run, ttype: Int32, m_tile: Int32, n_tile: Int32, index: Int32):
        """Lane 0 of the load warp writes the decoded words of a dgrad walk position
        (``_task``'s; its counter slot, wait count and groups read again here, from lines the
        decode brought into L1: held through the loads they spilled) as ring use ``k`` (the
        type with ``RUN_FLAG``, the counter groups of the defer rule), once the consumers
        have given back use k - ``TICKET_SLOTS``."""
        ring_q, bars = ring
        if cute.arch.lane_idx() == 0:
            ring_wait_empty(bars, k)
            words = ring_words(ring_q, k)
            words[D_INDEX] = index
            words[D_TYPE] = ttype + cutlass.select_(run, Int32(RUN_FLAG), Int32(0))
            words[D_MTILE] = m_tile
            words[D_NTILE] = n_tile
            words[D_SIGNAL] = signal_slot(tasks, index, counter_offsets)
            words[D_NUM_WAITS] = tasks[index, int(BackwardWord.NUM_WAITS)]
            words[D_SIGNAL_GROUP] = tasks[index, int(BackwardWord.SIGNAL_GROUP)]
            words[D_WAIT_GROUP] = tasks[index, int(BackwardWord.WAITS)]
            cute.arch.mbarrier_arrive(bars + k % TICKET_SLOTS)  # release: the words, then the phase

    @cute.jit
    def _dgrad_words(self, task_ring, k: Int32):
        """A consumer thread's (run, type, M-tile, N-tile, list index) of its dgrad walk
        position whose ring use is ``k`` (use k - 1 given back; ``_publish_dgrad``; the
        counter slot is read after the epilogue: held through it, it spilled)."""
        ring_q, bars = task_ring
        ring_next(ring_q, bars, k)
        words = ring_words(ring_q, k)
        tword = words[D_TYPE]
        run, ttype = (tword & RUN_FLAG) != 0, tword & (RUN_FLAG - 1)
        return run, ttype, words[D_MTILE], words[D_NTILE], words[D_INDEX]

    @cute.jit
    def _next_dgrad_words(self, task_ring, k: Int32):
        """What the publish of the CTA's task at ring use k - 1 asks of the next one (use
        ``k``, published once the task before's loads were out: no wait in practice; held until
        the consumers take k + 1): (its run flag, wait count and first wait's counter group,
        the task before's signal group). ``k`` from the next position, not from the task
        before's use: that one, held through the dgated epilogue, spilled."""
        ring_q, bars = task_ring
        ring_wait_full(bars, k)
        words = ring_words(ring_q, k)
        return ((words[D_TYPE] & RUN_FLAG) != 0, words[D_NUM_WAITS], words[D_WAIT_GROUP],
                ring_words(ring_q, k - 1)[D_SIGNAL_GROUP])

    @cute.jit
    def _wait_task(self, tasks: cute.Tensor, index: Int32, expert_offsets: cute.Tensor,
                   counter_offsets: cute.Tensor, counters: cute.Tensor, error: cute.Tensor,
                   timeout_ns: Int64, lane_strided: cutlass.Constexpr[bool] = False):
        """Spin until every wait of task ``index`` holds: counter[group][i] >= target for
        i in [first, first + count) (a dgrad's waits name its own M-tile, which is live; an
        ``EXPERT_TILES`` wait the M-tiles of the task's expert, from its schedule rows).
        Every lane of the calling warp spins on each counter, or with ``lane_strided`` lane l
        on counters first + l, first + l + 32, ... (one round trip for an expert's M-tiles),
        then the warp syncs (ordering every lane's acquire before what the warp issues next)."""
        for w in cutlass.range(tasks[index, int(BackwardWord.NUM_WAITS)], unroll=1):
            word = int(BackwardWord.WAITS) + 4 * w
            base = counter_offsets[tasks[index, word]]
            first = tasks[index, word + 1]
            count = tasks[index, word + 2]
            target = tasks[index, word + 3]
            if first == EXPERT_TILES:
                expert = tasks[index, int(BackwardWord.TILE)]
                first = expert_offsets[expert] // TILE_M
                count = expert_offsets[expert + 1] // TILE_M - first
            end, step = first + count, 1
            if const_expr(lane_strided):
                first, step = first + cute.arch.lane_idx(), 32
            for i in cutlass.range(first, end, step, unroll=1):
                common.wait_counter(counters, base + i, target, timeout_ns, error, index,
                                    Int32(0), Int32(0))
        if const_expr(lane_strided):
            cute.arch.sync_warp()


__all__ = ["BackwardWalkMixin"]
