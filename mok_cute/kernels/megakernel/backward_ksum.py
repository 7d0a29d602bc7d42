"""The backward megakernel's last tasks (``backward.py``), after the weight gradients in the
tail the CTAs take by ticket:

    BARRIER      waits until every live M-tile's dx rows are stored (``DX_DONE``), then
                 publishes ``BARRIER_DONE``; one rank has no peer to wait for, so this is the
                 barrier's whole job here (across ranks it is the group barrier, issue 32)
    KSUM (s, c)  tokens ``s * 128 + c * ksum_rows ..`` of d_x:
                 d_x[t] = bf16(fp32(shared_dx[t]) + sum_k fp32(dx_rows[row(t, k)])), k ascending

The k-sum is the forward's (``ksum_tasks.ksum_token_staged``: the standalone k-sum kernel's
arithmetic) with unit weights, each token's rows found through ``row_of_slot`` (-1: the slot
has no row and adds zero, as in ``token_ops.weighted_ksum``). Both run on the consumer warps,
which by then have consumed every stage they were loaded: the B stages are idle and stage the
k-sum's cp.async copies. Taking them by ticket behind the weight gradients lets the CTAs that
finish their last weight-gradient tile early sum d_x while the others finish theirs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, const_expr

from mok_cute.constants import TILE_M, VEC_ELEMS
from mok_cute.kernels import common
from mok_cute.kernels.megakernel.ksum_tasks import (KSUM_WARPS, ksum_stage_vectors,
                                                    ksum_token_staged, nan_row)
from mok_cute.tasks_backward import TILE_COUNTERS, BackwardTaskType, BackwardWord

KSUM_ROWS = 32  # tokens per KSUM task (the list's ``ksum_rows``)
_KSUM = int(BackwardTaskType.KSUM)


class BackwardKsumMixin:
    """BARRIER and KSUM of ``BackwardMegakernelSm90``'s tail (module docstring). The host class
    sets ``self.ksum_top_k`` (0: no k-sum in the launch) and ``self.ksum_shared``."""

    @cute.jit
    def tail_sum(self, tasks: cute.Tensor, index: Int32, args, consumer_tidx: Int32):
        """A BARRIER or KSUM ticket on both consumer warpgroups. ``args``: (counter_offsets,
        counters, error, timeout_ns, num_tiles, row_of_slot, dx_rows (M, H, 1), d_x (N, H),
        shared_dx (N, H), the B stages' smem address)."""
        (counter_offsets, counters, error, timeout_ns, num_tiles, row_of_slot, dx_rows, d_x,
         shared_dx, stage) = args
        sync = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.BACKWARD_TAIL),
                                     num_threads=self.num_mma_threads)
        self._wait_shared(tasks, index, counter_offsets, counters, error, timeout_ns,
                          num_tiles, consumer_tidx)
        sync.arrive_and_wait()
        ttype = tasks[index, int(BackwardWord.TYPE)]
        if ttype == _KSUM:
            # a wait of this launch gave up: its rows would be built from garbage, so they
            # become NaN, never a plausible wrong gradient
            failed = common.error_recorded(error)
            lane = cute.arch.lane_idx()
            warp = consumer_tidx // 32
            first = (tasks[index, int(BackwardWord.TILE)] * TILE_M
                     + tasks[index, int(BackwardWord.N_TILE)] * KSUM_ROWS)
            end = cutlass.min(first + KSUM_ROWS, cute.size(d_x, mode=[0]))
            for t in cutlass.range(first + warp, end, KSUM_WARPS, unroll=1):
                if failed:
                    nan_row(d_x[t, None], lane)
                else:
                    self._ksum_dx_token(t, row_of_slot, dx_rows, d_x, shared_dx, lane, warp,
                                        stage)
        else:  # the BARRIER: every dx row waited on above; now the k-sums may start
            if consumer_tidx == 0:
                cute.arch.fence_acq_rel_gpu()
                common.counter_publish(counters, self._signal_slot(tasks, index,
                                                                   counter_offsets), 1)

    @cute.jit
    def _signal_slot(self, tasks: cute.Tensor, index: Int32, counter_offsets: cute.Tensor):
        return (counter_offsets[tasks[index, int(BackwardWord.SIGNAL_GROUP)]]
                + tasks[index, int(BackwardWord.SIGNAL_INDEX)])

    @cute.jit
    def _wait_shared(self, tasks: cute.Tensor, index: Int32, counter_offsets: cute.Tensor,
                     counters: cute.Tensor, error: cute.Tensor, timeout_ns: Int64,
                     num_tiles: cute.Tensor, consumer_tidx: Int32):
        """Every wait of task ``index``, its counters shared out over the consumer threads (the
        BARRIER's range spans every M-tile: one thread reading them one after another took
        ~200 us on qwen3 in the forward); per-tile ranges clipped to the live tiles."""
        for w in cutlass.range(tasks[index, int(BackwardWord.NUM_WAITS)], unroll=1):
            word = int(BackwardWord.WAITS) + 4 * w
            group = tasks[index, word]
            first = tasks[index, word + 1]
            end = first + tasks[index, word + 2]
            for g in cutlass.range_constexpr(len(TILE_COUNTERS)):
                if group == int(TILE_COUNTERS[g]):
                    end = cutlass.min(end, num_tiles[0])
            base = counter_offsets[group]
            for i in cutlass.range(first + consumer_tidx, end, self.num_mma_threads, unroll=1):
                common.wait_counter(counters, base + i, tasks[index, word + 3], timeout_ns,
                                    error, index, Int32(0), Int32(0))

    @cute.jit
    def _ksum_dx_token(self, t: Int32, row_of_slot: cute.Tensor, dx_rows: cute.Tensor,
                       d_x: cute.Tensor, shared_dx: cute.Tensor, lane: Int32, warp: Int32,
                       stage):
        """One token's d_x row by one warp: its K dx rows (address 0 where the slot has no
        row: zero, weight 0), plus its shared-expert dx row."""
        top_k = self.ksum_top_k
        hidden = cute.size(d_x, mode=[1])
        weights = cute.make_rmem_tensor((top_k,), Float32)
        srcs = cute.make_rmem_tensor((top_k,), Int64)
        for k in cutlass.range_constexpr(top_k):
            row = row_of_slot[t * top_k + k]
            weights[k] = Float32(0.0)
            srcs[k] = Int64(0)
            if row >= 0:
                weights[k] = Float32(1.0)
                srcs[k] = dx_rows[row, None, 0].iterator.toint()
        shared_row = Int64(0)
        if const_expr(self.ksum_shared):
            shared_row = shared_dx[t, None].iterator.toint()
        ksum_token_staged(srcs, weights, shared_row, d_x[t, None], hidden // VEC_ELEMS, lane,
                          warp, stage, top_k, self.ksum_shared,
                          ksum_stage_vectors(self.ab_stages, self.tile_shape_mnk[1]))


__all__ = ["BackwardKsumMixin", "KSUM_ROWS"]
