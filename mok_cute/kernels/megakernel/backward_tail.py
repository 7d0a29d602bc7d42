"""The backward megakernel's group tail (``BackwardMegakernelSm90(ksum_top_k > 0)``): for one
rank of a group in its own process, the group's two barriers and the k-sums run inside the
launch: the barriers on its comm CTAs, the k-sums on every CTA that is free.

    start        comm CTA 0 stores this call's start flag into every peer's buffer (its own
                 fields were copied before the launch); every comm CTA waits for every peer's
                 start flag before its first pull or push
    BARRIER      after every push (REVERSE_DISPATCH) and x re-pull (REPULL_X) of this rank:
                 its done flag into every peer's buffer (and this call's epoch into its
                 sticky failed word when a wait of this launch gave up)
    KSUM (s, c)  tokens ``s * 128 + c * 32 ..``, once every peer's done flag is in:
                 d_x[t] = bf16(fp32(shared_dx[t]) + sum_k fp32(combine[t * K + k])), k
                 ascending, a slot routed nowhere adding zero (``token_ops.weighted_ksum``'s
                 arithmetic, ``k_sum_add``, with unit weights); d_topk[t, k] = the partial
                 sum the slot's expert rank pushed, 0 for a slot routed nowhere; by one
                 ticket counter to whichever CTA is free (``tail_ksum_tickets``): the comm
                 CTAs past their static walk, the compute CTAs past their weight gradients

A peer that never starts or never finishes makes a wait give up (``common.wait_counter``:
the first that does stops every other): this rank's KSUMs then write NaN and its sticky word
says "failed", so its peers' KSUMs write NaN too, even a slower peer whose waits this rank's
next call's flags satisfy; the host raises ``PeerTimeoutError`` from
the error word (``group_backward``). Flags are the forward's (``constants.flag_*``: one epoch
per call, they only grow), read and written at system scope (the peers are other processes).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

from mok_cute.constants import (BACKWARD_KSUM_ROWS, PEER_FAILED, SLOT_ROW_BYTES, TILE_K,
                                TILE_M, VEC_ELEMS, flag_done, flag_started)
from mok_cute.kernels import common
from mok_cute.kernels.megakernel.backward_comm import (COMBINE_OFFSET, PARTIALS_OFFSET, f32_at,
                                                       signal_slot)
from mok_cute.kernels.megakernel.backward_recorder import COMPUTE, START
from mok_cute.kernels.megakernel.comm_tasks import fill_row
from mok_cute.kernels.megakernel.ksum_tasks import gmem_vec, smem_vec
from mok_cute.kernels.token_ops import k_sum_add
from mok_cute.tasks_backward import TILE_COUNTERS, BackwardTaskType, BackwardWord

_SCOPE = "sys"
_KSUM = int(BackwardTaskType.KSUM)


class GroupTail(NamedTuple):
    """What the group tail reads and writes (placeholders without it)."""

    scalars: cute.Tensor  # int64 (SCALARS,): the plan's run-time words (``scheduler.Context``)
    topk_idx: cute.Tensor  # int32 (T, K): global expert ids, out of range = routed nowhere
    shared_dx: cute.Tensor  # bf16 (T, H): the shared expert's dx rows (read with ksum_shared)
    d_x: cute.Tensor  # bf16 (T, H)
    d_topk: cute.Tensor  # fp32 (T, K)


class BackwardTailMixin:
    """The group tail of ``BackwardMegakernelSm90``'s comm CTAs (module docstring)."""

    @cute.jit
    def _flags_in(self, ctx, peer_bases: cute.Tensor, peer) -> cute.Tensor:
        """The barrier flags inside ``peer``'s symmetric buffer (``common.flags_at``)."""
        return common.flags_at(peer_bases[peer] + ctx.flags_offset, cute.size(peer_bases))

    @cute.jit
    def _announce(self, ctx, peer_bases: cute.Tensor, value: Int32, failed_epoch: Int32,
                  tidx: Int32):
        """Threads of one CTA: this rank's flag ``value`` (and ``failed_epoch`` when > 0)
        into every peer's buffer (none from the silent rank, the tests' dead process), after
        this rank's writes so far."""
        if ctx.rank_base != ctx.silent_rank:
            cute.arch.fence_acq_rel_sys()
            for p in cutlass.range(tidx, cute.size(peer_bases), self.threads_per_cta, unroll=1):
                common.store_flag(self._flags_in(ctx, peer_bases, p), ctx.rank_base, value,
                                  failed_epoch, _SCOPE)

    @cute.jit
    def tail_start(self, ctx, peer_bases: cute.Tensor, error: cute.Tensor, task: Int32,
                   tidx: Int32, sync):
        """Every comm CTA before its first task: CTA 0 announces the start; all wait for every
        peer's (``task``: the list index an error names)."""
        if Int32(cute.arch.block_idx()[0]) == self.num_ctas:
            self._announce(ctx, peer_bases, flag_started(ctx.epoch), Int32(0), tidx)
        own = self._flags_in(ctx, peer_bases, ctx.rank_base)
        for p in cutlass.range(tidx, cute.size(peer_bases), self.threads_per_cta, unroll=1):
            common.wait_counter(own, p, flag_started(ctx.epoch), ctx.timeout_ns, error, task,
                                p, Int32(0), _SCOPE, flag_started(ctx.epoch))
        sync.arrive_and_wait()

    @cute.jit
    def tail_barrier(self, ctx, tasks: cute.Tensor, index: Int32, counter_offsets: cute.Tensor,
                     counters: cute.Tensor, error: cute.Tensor, num_tiles: cute.Tensor,
                     timeout_ns: Int64, peer_bases: cute.Tensor, tidx: Int32, sync):
        """The BARRIER task: every push and re-pull of the live tiles done (their counters
        shared out over the CTA's threads), then this rank's done flag to every peer, then
        ``BARRIER_DONE``."""
        for w in cutlass.range(tasks[index, int(BackwardWord.NUM_WAITS)], unroll=1):
            word = int(BackwardWord.WAITS) + 4 * w
            group = tasks[index, word]
            first = tasks[index, word + 1]
            end = first + tasks[index, word + 2]
            for g in cutlass.range_constexpr(len(TILE_COUNTERS)):
                if group == int(TILE_COUNTERS[g]):
                    end = cutlass.min(end, num_tiles[0])
            base = counter_offsets[group]
            for i in cutlass.range(first + tidx, end, self.threads_per_cta, unroll=1):
                common.wait_counter(counters, base + i, tasks[index, word + 3], timeout_ns,
                                    error, index, Int32(0), Int32(0))
        sync.arrive_and_wait()
        failed_epoch = cutlass.select_(common.error_recorded(error), ctx.epoch, Int32(0))
        self._announce(ctx, peer_bases, flag_done(ctx.epoch), failed_epoch, tidx)
        sync.arrive_and_wait()
        if tidx == 0:
            common.counter_publish(counters, signal_slot(tasks, index, counter_offsets), 1)

    @cute.jit
    def tail_ksum_tickets(self, ctx, tasks: cute.Tensor, counter_offsets: cute.Tensor,
                          counters: cute.Tensor, error: cute.Tensor, timeout_ns: Int64,
                          rows, tail: GroupTail, stage, ticket: cute.Tensor, ksum_begin: Int32,
                          tidx: Int32, num_threads: cutlass.Constexpr[int], sync, recorder):
        """A compute CTA's consumer warps past their weight-gradient tickets (``num_threads``
        threads, ``tidx`` from 0): KSUMs by ticket (``ksum_ticket``: the comm queue's
        positions from ``ksum_begin`` on), as the comm CTAs take them past their static walk
        (``backward_comm_loop``). ``tail_ksum``'s barrier after its waits keeps the ticket's
        smem word until every thread has read it. Each KSUM's span is recorded with the
        recorder on (``recorder``: thread 0's ``backward_recorder.Recorder``)."""
        count = cute.size(rows.comm_queue) - ksum_begin
        q = self.ksum_ticket(counters, counter_offsets, ticket, tidx, sync)
        while q < count:
            self.rec_stamp(recorder, START)
            self.tail_ksum(ctx, tasks, rows.comm_queue[ksum_begin + q], counter_offsets,
                           counters, error, timeout_ns, rows, tail, stage, tidx, num_threads,
                           sync)
            self.rec_task(recorder, COMPUTE, _KSUM, rows.comm_queue[ksum_begin + q],
                          epilogue=False)
            q = self.ksum_ticket(counters, counter_offsets, ticket, tidx, sync)

    @cute.jit
    def ksum_ticket(self, counters: cute.Tensor, counter_offsets: cute.Tensor,
                    ticket: cute.Tensor, tidx: Int32, sync) -> Int32:
        """The next KSUM ticket (0, 1, ...: the KSUMs' order in the comm queue), taken by
        thread 0 from the counter after the weight gradients' and passed to every thread
        of ``sync`` through the smem word ``ticket``."""
        if tidx == 0:
            slot = counter_offsets[cute.size(counter_offsets) - 1] + 1
            ticket[0] = cute.arch.atomic_add((counters.iterator + slot).llvm_ptr, Int32(1),
                                             sem="relaxed", scope="gpu")
        sync.arrive_and_wait()
        return ticket[0]

    @cute.jit
    def tail_ksum(self, ctx, tasks: cute.Tensor, index: Int32, counter_offsets: cute.Tensor,
                  counters: cute.Tensor, error: cute.Tensor, timeout_ns: Int64,
                  rows, tail: GroupTail, stage, tidx: Int32, num_threads: cutlass.Constexpr[int],
                  sync):
        """A KSUM task (module docstring): thread 0 waits for ``BARRIER_DONE`` (and, with the
        shared expert's tasks, its dx rows of the tile) and every peer's done flag (a peer
        whose sticky word says "failed" is recorded as PEER_FAILED), then each warp sums
        tokens ``warp, warp + warps, ..`` of the task's 32 (``num_threads / 32`` warps)."""
        peer_bases = rows.peer_bases
        if tidx == 0:
            base = counter_offsets[tasks[index, int(BackwardWord.WAITS)]]
            common.wait_counter(counters, base, 1, timeout_ns, error, index, Int32(0), Int32(0))
            if const_expr(self.shared):  # the shared expert's dx rows, by this launch's tasks
                word = int(BackwardWord.WAITS) + 4  # the second wait: SHARED_DX of the tile
                common.wait_counter(counters, counter_offsets[tasks[index, word]]
                                    + tasks[index, word + 1], tasks[index, word + 3],
                                    timeout_ns, error, index, Int32(0), Int32(0))
            own = self._flags_in(ctx, peer_bases, ctx.rank_base)
            for p in cutlass.range(cute.size(peer_bases), unroll=1):
                common.wait_counter(own, p, flag_done(ctx.epoch), ctx.timeout_ns, error, index,
                                    p, Int32(0), _SCOPE, flag_started(ctx.epoch))
                if common.peer_failed(own, p, ctx.epoch, _SCOPE):
                    common.record_error(error, index, p, Int32(0), PEER_FAILED)
        sync.arrive_and_wait()
        # a wait of this launch gave up, or a peer's launch did: the pushed rows may be
        # garbage, so the rows become NaN, never a plausible wrong gradient
        failed = common.error_recorded(error)
        warp, lane = tidx // 32, cute.arch.lane_idx()
        num_warps = num_threads // 32
        tokens = cute.size(tail.d_x, mode=[0])
        first = (tasks[index, int(BackwardWord.TILE)] * TILE_M
                 + tasks[index, int(BackwardWord.N_TILE)] * BACKWARD_KSUM_ROWS)
        end = cutlass.min(first + BACKWARD_KSUM_ROWS, tokens)
        own_base = peer_bases[ctx.rank_base]
        for t in cutlass.range(first + warp, end, num_warps, unroll=1):
            if failed:
                row = tail.d_x[t, None]
                fill_row(row, float("nan"), cute.size(row) // VEC_ELEMS, lane)
                if lane < self.ksum_top_k:
                    tail.d_topk[t, lane] = Float32(float("nan"))
            else:
                self._ksum_token(ctx, rows, tail, own_base, t, lane, warp, stage)

    def _tail_slots(self) -> tuple[int, int]:
        """16-byte smem slots per thread of the CTA in the B stages and in the A stages (idle
        in a comm CTA, and in a compute CTA past its weight gradients, whose consumer warps
        take the slots of the CTA's first eight warps)."""
        per_thread = self.threads_per_cta * 16
        return (self.ab_stages * self.tile_shape_mnk[1] * TILE_K * 2 // per_thread,
                self.ab_stages * self.tile_shape_mnk[0] * TILE_K * 2 // per_thread)

    @cute.jit
    def _ksum_token(self, ctx, rows, tail: GroupTail, own_base: Int64, t: Int32, lane: Int32,
                    warp: Int32, stage):
        """One token's d_x row and d_topk weights, by one warp. Each step a lane lands as many
        16-byte vectors (its K slots' and the shared row's) as its own smem slots of the A and
        B stages hold (``stage``: their bases) with cp.async (many in flight, few registers),
        waits for them, then
        adds the K slots one at a time (``k_sum_add``: ``k_sum_vector``'s arithmetic with unit
        weights; a slot routed nowhere adds a zero vector)."""
        top_k, has_shared = self.ksum_top_k, self.ksum_shared
        nk = top_k + (1 if const_expr(has_shared) else 0)
        slots_b, slots_a = self._tail_slots()
        assert slots_b + slots_a >= nk, "the stages hold one vector of every slot a lane"
        steps = (slots_b + slots_a) // nk
        # slot j of this lane: in the B stages below slots_b, then in the A stages
        bases = (stage[0].toint() + warp * (slots_b * 32 * 16) + lane * 16,
                 stage[1].toint() + warp * (slots_a * 32 * 16) + lane * 16)
        slot_ptr = lambda j: (smem_vec(bases[0], j) if j < slots_b  # noqa: E731
                              else smem_vec(bases[1], j - slots_b))
        hidden = cute.size(tail.d_x, mode=[1])
        h_vecs = hidden // VEC_ELEMS
        row_bytes = Int64(hidden) * 2
        num_experts = cute.size(rows.peer_bases) * ctx.local_experts
        first_slot = own_base + rows.comm_scalars[COMBINE_OFFSET] + Int64(t) * top_k * row_bytes
        shared_row = tail.shared_dx[t, None].iterator.toint()
        routed = Int32(0)  # bit k: slot k has an expert
        for k in cutlass.range_constexpr(top_k):
            expert = tail.topk_idx[t, k]
            if expert >= 0 and expert < num_experts:
                routed = routed | (1 << k)
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        out_row = tail.d_x[t, None]
        for v0 in cutlass.range(lane, h_vecs, 32 * steps, unroll=1):
            for u in cutlass.range_constexpr(steps):
                if v0 + 32 * u < h_vecs:
                    for k in cutlass.range_constexpr(top_k):
                        if (routed >> k) & 1:
                            nvvm.cp_async_shared_global(
                                slot_ptr(u * nk + k),
                                gmem_vec(first_slot + k * row_bytes, v0 + 32 * u), 16, "cg")
                    if const_expr(has_shared):
                        nvvm.cp_async_shared_global(slot_ptr(u * nk + top_k),
                                                    gmem_vec(shared_row, v0 + 32 * u), 16, "cg")
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)  # this lane's own copies: no other lane reads them
            for u in cutlass.range_constexpr(steps):
                if v0 + 32 * u < h_vecs:
                    acc = cute.make_rmem_tensor((VEC_ELEMS,), Float32)
                    if const_expr(has_shared):
                        base = cute.make_rmem_tensor((VEC_ELEMS,), BFloat16)
                        cute.copy(vec, _vector(slot_ptr(u * nk + top_k)), base)
                        acc.store(base.load().to(Float32))
                    else:
                        acc.fill(0.0)
                    for k in cutlass.range_constexpr(top_k):
                        y = cute.make_rmem_tensor((VEC_ELEMS,), BFloat16)
                        y.fill(0.0)
                        if (routed >> k) & 1:
                            cute.copy(vec, _vector(slot_ptr(u * nk + k)), y)
                        k_sum_add(acc, Float32(1.0), y)
                    res = cute.make_rmem_tensor((VEC_ELEMS,), BFloat16)
                    res.store(acc.load().to(BFloat16))
                    cute.copy(vec, res, cute.local_tile(out_row, (VEC_ELEMS,), (v0 + 32 * u,)))
        if lane < top_k:
            weight = Float32(0.0)
            if (routed >> lane) & 1:
                weight = f32_at(own_base + rows.comm_scalars[PARTIALS_OFFSET]
                                + (Int64(t) * top_k + Int64(lane)) * SLOT_ROW_BYTES)[0]
            tail.d_topk[t, lane] = weight


def _vector(ptr) -> cute.Tensor:
    """A 16-byte smem slot as an 8-element bf16 vector."""
    return cute.make_tensor(ptr, cute.make_layout(VEC_ELEMS))


__all__ = ["BackwardTailMixin", "GroupTail"]
