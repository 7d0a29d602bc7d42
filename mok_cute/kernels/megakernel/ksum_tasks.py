"""The megakernel's KSUM tasks: each token's output row, in the reference's fixed order.

    out[t] = bf16( fp32(shared[t]) + sum_k fp32(w[t,k]) * fp32(y[t,k]) )   ascending k

A KSUM covers ``KSUM_ROWS`` local tokens, one warp per token at a time, on the compute CTAs'
eight consumer warps. Its y rows are in this rank's combine buffer (pushed by the peers), or,
for a rank's own slots with rows in place, in its ring where FC2 wrote them. Every lane lands
its K rows' (and the shared row's) 16-byte vectors in its own smem slots of the GEMM's B
stages with cp.async (idle by then: the KSUMs close every rank's compute queue), then sums
them with ``token_ops.k_sum_vector``, the same arithmetic as the standalone k-sum kernel.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

from mok_cute.constants import PEER_FAILED, TILE_K, VEC_ELEMS, flag_done
from mok_cute.kernels import common
from mok_cute.kernels.megakernel.comm_tasks import Routing, fill_row
from mok_cute.kernels.megakernel.scheduler import TaskTables
from mok_cute.kernels.token_ops import k_sum_vector
from mok_cute.tasks import Role, TaskType, TaskWord

KSUM_WARPS = 8  # the consumer warps of a compute CTA


class KsumTasks:
    """The KSUM tasks of the compute role (``MegakernelSm90`` mixes it in)."""

    def _ksum_stage_vectors(self) -> int:
        """16-B vectors per consumer lane that the B stages hold (eight consumer warps)."""
        return self.ab_stages * self.tile_shape_mnk[1] * TILE_K * 2 // (KSUM_WARPS * 32 * 16)

    @cute.jit
    def _ksum(self, ctx, tt: TaskTables, routing: Routing, ring_y, out, shared_y, timeline_buf,
              index: Int32, rank: Int32, consumer_tidx: Int32, barrier, ksum_stage,
              ttype: Int32):
        """A KSUM task's waits (one thread), then its tokens (``KSUM_WARPS`` warps). A (t, k)
        whose expert id is out of range was routed nowhere: it contributes zero. With no comm
        CTA the BARRIER comes here too (``ttype``): it has no rows and waits for its FC2 tiles
        only (a branch of its own in the task loop made ptxas serialise the wgmmas, C7520)."""
        if const_expr(self.spec.num_comm_ctas == 0):
            # the BARRIER's range of FC2 counters is shared by all the task's threads: one
            # thread reading qwen3's 1024 of them one after another took ~200 us
            barrier_task = ttype == int(TaskType.BARRIER)
            if barrier_task:
                self._wait_task_recorded(ctx, tt, index, rank, timeline_buf, int(Role.COMPUTE),
                                         consumer_tidx == 0, None, consumer_tidx,
                                         KSUM_WARPS * 32)
            elif consumer_tidx == 0:
                self._ksum_waits(ctx, tt, routing.peer_bases, timeline_buf, index, rank)
        elif consumer_tidx == 0:
            self._ksum_waits(ctx, tt, routing.peer_bases, timeline_buf, index, rank)
        barrier.arrive_and_wait()
        # A wait of this launch gave up, or a peer's launch did: this task's rows may be
        # built from garbage, so they become NaN, never a plausible wrong output.
        failed = common.error_recorded(tt.error)
        lane = cute.arch.lane_idx()
        warp = consumer_tidx // 32
        combine_base = self._combine_base(ctx, routing.peer_bases, rank)
        for t in cutlass.range(tt.tasks[index, TaskWord.ROW_BEGIN] + warp,
                               tt.tasks[index, TaskWord.ROW_END], KSUM_WARPS, unroll=1):
            if failed:
                row = out[rank, t, None]
                fill_row(row, float("nan"), cute.size(row) // VEC_ELEMS, lane)
            else:
                self._ksum_token(ctx, routing, rank, t, combine_base, ring_y, out, shared_y,
                                 lane, 0 + warp, ksum_stage)

    @cute.jit
    def _ksum_waits(self, ctx, tt: TaskTables, peer_bases, timeline_buf, index: Int32,
                    rank: Int32):
        """One thread: a KSUM's waits (BARRIER_DONE, the shared expert's tile), then every
        peer's BARRIER flag for this epoch; a peer whose sticky word says its launch failed is
        recorded as PEER_FAILED."""
        self._wait_task_recorded(ctx, tt, index, rank, timeline_buf, int(Role.COMPUTE), True)
        for p in cutlass.range(cute.size(peer_bases, mode=[1]), unroll=1):
            self._wait_flag(ctx, peer_bases, tt.error, rank, p, flag_done(ctx.epoch), index)
            if self._peer_failed(ctx, peer_bases, rank, p):
                common.record_error(tt.error, index, p, ctx.rank_base + rank, PEER_FAILED)

    @cute.jit
    def _combine_base(self, ctx, peer_bases, rank: Int32) -> Int64:
        """Address of ``rank``'s own combine buffer (the y rows its peers pushed to it)."""
        return peer_bases[rank, ctx.rank_base + rank] + ctx.combine_offset

    @cute.jit
    def _ksum_token(self, ctx, routing: Routing, rank: Int32, t: Int32, combine_base: Int64,
                    ring_y, out, shared_y, lane: Int32, warp: Int32, ksum_stage):
        """One token's output row by one warp: the K weights and y-row addresses (0: routed
        nowhere, contributes 0), then the fixed-order sum through this warp's smem slots."""
        top_k = self.spec.top_k
        hidden = cute.size(out, mode=[2])
        h_vecs = hidden // VEC_ELEMS
        row_bytes = Int64(hidden) * 2
        num_experts = cute.size(routing.peer_bases, mode=[1]) * ctx.local_experts
        weights = cute.make_rmem_tensor((top_k,), Float32)
        srcs = cute.make_rmem_tensor((top_k,), Int64)
        for k in cutlass.range_constexpr(top_k):
            weights[k] = Float32(0.0)
            srcs[k] = Int64(0)
            expert = routing.topk_idx[rank, t, k]
            if expert >= 0 and expert < num_experts:
                weights[k] = routing.topk_weights[rank, t, k]
                srcs[k] = self._ksum_row(combine_base, routing.slot_rows, ring_y, rank, t, k,
                                         row_bytes)
        out_row = out[rank, t, None]
        shared_row = Int64(0)
        if const_expr(self.spec.has_shared):
            shared_row = shared_y[t, None, rank].iterator.toint()
        self._ksum_token_staged(srcs, weights, shared_row, out_row, h_vecs, lane, warp,
                                ksum_stage)

    @cute.jit
    def _ksum_token_staged(self, srcs, weights, shared_row: Int64, out_row, h_vecs: Int32,
                           lane: Int32, warp: Int32, ksum_stage):
        """Each step a lane lands up to ``_ksum_stage_vectors()`` 16-B vectors (its K rows' and
        the shared row's) in its own smem slots with cp.async, waits for its own copies, then
        sums them (``k_sum_vector``: same order, same bits as the k-sum kernel)."""
        top_k, has_shared = self.spec.top_k, self.spec.has_shared
        stage_vectors = self._ksum_stage_vectors()
        nk = top_k + (1 if const_expr(has_shared) else 0)
        steps = stage_vectors // nk
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        lane_base = (ksum_stage.toint() + warp * (stage_vectors * 32 * 16)
                     + lane * 16)  # slot j of this lane: lane_base + j * 512 bytes

        for v0 in cutlass.range(lane, h_vecs, 32 * steps, unroll=1):
            for u in cutlass.range_constexpr(steps):
                if v0 + 32 * u < h_vecs:
                    for k in cutlass.range_constexpr(top_k):
                        if srcs[k] != 0:
                            nvvm.cp_async_shared_global(smem_vec(lane_base, u * nk + k),
                                                        gmem_vec(srcs[k], v0 + 32 * u), 16, "cg")
                    if const_expr(has_shared):
                        nvvm.cp_async_shared_global(smem_vec(lane_base, u * nk + top_k),
                                                    gmem_vec(shared_row, v0 + 32 * u), 16, "cg")
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)  # this lane's own copies: no other lane reads them
            for u in cutlass.range_constexpr(steps):
                if v0 + 32 * u < h_vecs:
                    ys = cute.make_rmem_tensor((VEC_ELEMS, 1, top_k), BFloat16)
                    base = cute.make_rmem_tensor((VEC_ELEMS, 1), BFloat16)
                    for k in cutlass.range_constexpr(top_k):
                        if srcs[k] != 0:
                            cute.copy(vec, cute.make_tensor(smem_vec(lane_base, u * nk + k),
                                                            cute.make_layout(VEC_ELEMS)), ys[None, 0, k])
                        else:
                            ys[None, 0, k].fill(0.0)
                    if const_expr(has_shared):
                        cute.copy(vec, cute.make_tensor(smem_vec(lane_base, u * nk + top_k),
                                                        cute.make_layout(VEC_ELEMS)), base[None, 0])
                    res = k_sum_vector(ys, base, weights, 0, top_k, has_shared)
                    cute.copy(vec, res, cute.local_tile(out_row, (VEC_ELEMS,), (v0 + 32 * u,)))

    @cute.jit
    def _ksum_row(self, combine_base: Int64, slot_rows, ring_y, rank: Int32, t, k: int,
                  row_bytes: Int64) -> Int64:
        """Address of the y row of slot (t, k): the combine buffer, or with rows in place the
        ring row itself when the slot's expert is this rank's."""
        addr = combine_base + (Int64(t) * self.spec.top_k + k) * row_bytes
        if const_expr(self.spec.rows_in_place):
            row = slot_rows[rank, t * self.spec.top_k + k]
            if row >= 0:
                addr = ring_y[row, None, rank].iterator.toint()
        return addr


def smem_vec(lane_base, j: int):
    """A lane's smem slot j (16 B; the 32 lanes' slots j are adjacent)."""
    return cute.make_ptr(BFloat16, lane_base + j * 512, cute.AddressSpace.smem, assumed_align=16)


def gmem_vec(addr: Int64, v):
    """The 16-B vector v of the bf16 row at ``addr``."""
    return cute.make_ptr(BFloat16, addr + Int64(v) * 16, cute.AddressSpace.gmem, assumed_align=16)
