"""The megakernel's routed GEMM tasks in an fp8 plan (``MegakernelSpec.fp8``), a mixin of
``MegakernelSm90`` beside ``GemmTasks``: the promoting mainloop of ``fp8_mainloop`` on a task's
tile, its exponents found by address (a consumer thread's two rows' bytes in their packed
rows, the W block rows' in the block exponents), and FC1's h (and in a training forward its
bf16 g | u) stored from the accumulator by generic stores.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int8, Int32, Int64, const_expr

from mok_cute.constants import TILE_M
from mok_cute.kernels.megakernel.comm_tasks import Routing
from mok_cute.kernels.megakernel.gemm_tasks import SavedRows
from mok_cute.kernels.megakernel.scheduler import D_EXPERT, D_ROW_BEGIN, TaskTables, ring_words
from mok_cute.tasks import TaskType, TaskWord


class Fp8Operands(NamedTuple):
    """fp8 plans (``spec.fp8``): the rings' e4m3 views (int8, packed rows: each row's
    exponents follow its data, ``fp8.packed_row_bytes``), h's exponent view, the weights'
    128 x 128 block exponents and the routed GEMMs' k-tiles (128 deep); None in bf16 plans."""

    ring_x: cute.Tensor  # int8 (C, H', R)
    ring_h: cute.Tensor  # int8 (C, I', R)
    h_exps: cute.Tensor  # int8 (C, I' / 128, R)
    e_gate: cute.Tensor  # int8 (E, I' / 128, H' / 128)
    e_up: cute.Tensor
    e_down: cute.Tensor  # int8 (E, H' / 128, I' / 128)


class TaskExponents(NamedTuple):
    """An FP8 task's exponent bytes of K group 0 for one consumer thread (the group's byte is
    ``group`` further): its two A rows' and the tile's two W blocks' (one per N-half)."""

    a0: Int64
    a1: Int64
    w0: Int64
    w1: Int64


class Fp8Tasks:
    """The fp8 plan's FC1 / FC2 task bodies (``GemmTasks.consumer_loop`` calls them)."""

    @cute.jit
    def _fp8_mainloop(self, ctx, tt: TaskTables, routing: Routing, ticket_q, taken: Int32,
                      index: Int32, rank: Int32, ttype: Int32, fp8_ops: Fp8Operands, ab_pipeline,
                      half_mma, acc, halves, loads: Int32, k_tiles: Int32, consumer_tidx: Int32,
                      hook_args=None):
        """An FC1 / FC2 task of an fp8 plan: the 256-wide tile one N-half at a time, each
        128-deep group promoted (``PromotingMainloop.half_promoting_mainloop``), the first
        group's exponents read after its stage wait (rows that other CTAs of this launch
        write: the producer's acquire precedes the stage). ``hook_args`` (recorder builds):
        the wait for the task's first stage is recorded as a STAGE_WAIT, as in bf16."""
        m_tile, n_tile, ring_tile = self._task_tile(tt, ticket_q, taken, index)
        expert = Int32(0)
        row_begin = Int32(0)
        if const_expr(self.spec.ticket_ring):
            slot = ring_words(ticket_q, taken - 1)
            expert, row_begin = slot[D_EXPERT], slot[D_ROW_BEGIN]
        else:
            expert = self._expert_of(ctx, routing.tile_expert, rank, m_tile)
            row_begin = tt.tasks[index, TaskWord.ROW_BEGIN]
        exps = self._task_exponents(ctx, routing, fp8_ops, ttype, rank, ring_tile, n_tile,
                                    expert, row_begin, consumer_tidx)
        tCrA, tCrB, tCrB_up, shape_of = halves
        # allocated per task: the partial is dead between tasks (the shared expert's bf16
        # mainloop then has its registers)
        partial = cute.make_rmem_tensor(shape_of.layout, self.acc_dtype)
        num_k_blocks = cute.size(tCrA, mode=[2])
        self.half_promoting_mainloop(ab_pipeline, half_mma, acc, partial, tCrA, tCrB, tCrB_up,
                                     loads, k_tiles, num_k_blocks, exps,
                                     first_exps_after_wait=True, hook_args=hook_args)

    def _task_exponents(self, ctx, routing: Routing, fp8_ops: Fp8Operands, ttype: Int32,
                        rank: Int32, ring_tile: Int32, n_tile: Int32, expert: Int32,
                        row_begin: Int32, consumer_tidx: Int32) -> TaskExponents:
        """Where this thread's exponent bytes of an FP8 task sit (K group 0): A's in its rows'
        packed rows (FC1: the ring x row, or with rows in place a local row's own x row; FC2:
        the ring h row), W's in the block rows of W_gate and W_up (FC1: the tile is 128 h
        columns, one block of each) or of W_down (FC2: blocks 2 n and 2 n + 1, clamped; the
        columns past H are clipped on store). Traced inline."""
        is_fc1 = ttype == int(TaskType.FC1)
        ring_x, ring_h = fp8_ops.ring_x, fp8_ops.ring_h
        hidden_p = cute.size(ring_x, mode=[1])  # a packed row's exponents follow its data
        inter_p = cute.size(ring_h, mode=[1])
        rows = []
        for r in self._my_rows(consumer_tidx):
            ring_row = ring_tile * TILE_M + r
            if const_expr(self.spec.rows_in_place):  # a local row: this rank's own packed row
                in_x = self.x_row_address(ctx, routing, ring_x, rank, ring_tile * TILE_M,
                                          row_begin, r, offset=Int64(hidden_p))
            else:
                in_x = ring_x[ring_row, None, rank].iterator.toint() + Int64(hidden_p)
            in_h = ring_h[ring_row, None, rank].iterator.toint() + Int64(inter_p)
            rows.append(Int64(cutlass.select_(is_fc1, in_x, in_h)))
        last_block = cute.size(fp8_ops.e_down, mode=[1]) - 1
        gate = fp8_ops.e_gate[expert, n_tile, None].iterator.toint()
        up = fp8_ops.e_up[expert, n_tile, None].iterator.toint()
        down0 = fp8_ops.e_down[expert, cutlass.min(2 * n_tile, last_block), None].iterator.toint()
        down1 = fp8_ops.e_down[expert, cutlass.min(2 * n_tile + 1, last_block), None].iterator.toint()
        return TaskExponents(rows[0], rows[1], Int64(cutlass.select_(is_fc1, gate, down0)),
                             Int64(cutlass.select_(is_fc1, up, down1)))

    def group_exponents(self, exps: TaskExponents, group: Int32):
        """The exponents of K group ``group`` (``PromotingMainloop``): four byte loads."""
        return tuple(Int32(byte_at(addr + Int64(group))) for addr in exps)

    @cute.jit
    def _store_h_fp8(self, tt: TaskTables, ticket_q, taken: Int32, index: Int32, rank: Int32,
                     fp8_ops: Fp8Operands, acc, consumer_tidx: Int32, saved: SavedRows):
        """An fp8 FC1 task's h tile (128 columns: one 1 x 128 group) into the ring's packed h
        rows, e4m3 with its exponent (``PromotingMainloop.store_h_fp8``); save_preact: its
        rows' bf16 g | u too, into the rows the schedule rows' row map names."""
        m_tile, n_tile, ring_tile = self._task_tile(tt, ticket_q, taken, index)
        rows = self._my_rows(consumer_tidx)
        if const_expr(self.spec.save_preact):
            self.store_preact_pairs(acc, cute.recast_tensor(saved.preact[(None, None, rank)], Int32),
                                    saved.row_slot[rank, m_tile * TILE_M + rows[0]],
                                    saved.row_slot[rank, m_tile * TILE_M + rows[1]],
                                    cute.size(saved.preact, mode=[1]) // 2, n_tile,
                                    consumer_tidx % 32)
        self.store_h_fp8(acc, fp8_ops.ring_h[(None, None, rank)],
                         fp8_ops.h_exps[(None, None, rank)], ring_tile * TILE_M + rows[0],
                         ring_tile * TILE_M + rows[1], n_tile, consumer_tidx)


@cute.jit
def byte_at(addr: Int64) -> Int8:
    """The signed byte at a global address."""
    return cute.make_tensor(cute.make_ptr(Int8, addr, cute.AddressSpace.gmem, assumed_align=1),
                            cute.make_layout(1))[0]
