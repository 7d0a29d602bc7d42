"""The shared expert's backward as tasks of the backward megakernel (``backward.py`` built with
``shared=True``): one expert over a rank's T tokens with weight 1 (L of them, one per local
rank, in a virtual ranks' launch), on the routed tasks' tile forms and stage rings, its
operands through TMA atoms of their own, each with a rank mode (extent L).

    SHARED_FC2_DGRAD (s, n)   d_out rows of token tile s @ Ws_down: the dgated epilogue (dG | dU,
                              h) into the shared expert's buffers, from its g | u saved by
                              token; no row partials (it has no router weight)
    SHARED_FC1_DGRAD (s, n)   its dG | dU of token tile s @ [Ws_gate; Ws_up]: its dx rows
    SHARED_WGRAD_GATE_UP / SHARED_WGRAD_DOWN (r; m, n)   dWs over the T tokens (K), TMA
                              filling zeros past T

A dgrad's tile numbers the ranks' token tiles in order (``shared_tile``: rank s // ceil(T /
128), tile s % ..); a weight gradient's tile is its rank. The launch's own buffers (dG | dU, h,
dx rows) pad each rank's rows to whole tiles (T_pad), so the consumers address them by the
task's tile as the routed rows (no rank there); d_out's rows (the caller's) are read by (token
tile, rank), the weight gradients' operands by rank.

The tasks are ``expert_backward.shared_backward``'s tiles (the routed kernels on one expert,
identity rows, unit weights), so the bits are its. A TMA atom cannot be chosen at run time
(the DSL rejects an atom assigned in a branch), so where a task may be either expert's the
copies branch (``tile_epilogue``'s ``alt`` for the stores); the dgated epilogue's row tensors
(saved g | u, row -> slot, weight) are chosen at run time: the shared expert's identity rows
and ones have the routed tensors' types.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32, const_expr

from mok_cute.constants import TILE_K, TILE_M
from mok_cute.tasks_backward import BackwardTaskType

SHARED_FC2_DGRAD = int(BackwardTaskType.SHARED_FC2_DGRAD)
SHARED_FC1_DGRAD = int(BackwardTaskType.SHARED_FC1_DGRAD)
SHARED_WGRAD_GATE_UP = int(BackwardTaskType.SHARED_WGRAD_GATE_UP)
SHARED_WGRAD_DOWN = int(BackwardTaskType.SHARED_WGRAD_DOWN)


class SharedOperands(NamedTuple):
    """The shared expert's (TMA atom, tensor) pairs, each tuple in the order of its routed
    counterpart in ``backward.py``, and its dgated rows."""

    loads: tuple  # d_out rows (T, H, L), Ws_down, dG | dU (L T_pad, 2Is, 1), Ws_gate, Ws_up
    stores: tuple  # dG, dU, h, dx rows
    w_loads: tuple  # dG, dU, x, d_out, h: (cols, T, 1) MN-major
    w_stores: tuple  # dWs_gate, dWs_up, dWs_down; then their tensors where main_grad is loaded
    rows: tuple  # saved g | u (L T, 2Is), padded row -> slot (int32, -1 past T), ones (fp32)


class SharedTasksMixin:
    """What ``BackwardMegakernelSm90`` adds for the shared expert's tasks (module docstring);
    ``self.shared`` says whether the build has them (without, every helper is a constant)."""

    def shared_operands(self, tensors, boxes, w_store_op) -> SharedOperands:
        """Host side: the shared expert's TMA atoms. ``tensors``: (d_out rows, Ws_down, dG | dU,
        Ws_gate, Ws_up, dG, dU, h, dx rows, dG^T, dU^T, x^T, d_out^T, h^T, dWs_gate, dWs_up,
        dWs_down, saved g | u, rows, ones); ``boxes``: for each of the first 17, (smem box,
        tile) as its routed counterpart's; ``w_store_op``: the routed weight gradients' TMA
        store op (a reduce-add where they are added into main_grad by it; where main_grad is
        read into registers, ``w_stores`` ends with the three weight gradients' tensors)."""
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        s2g = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        mk = cute.nvgpu.cpasync.make_tiled_tma_atom
        ops = [w_store_op if i in (14, 15, 16) else s2g if i in (5, 6, 7, 8) else g2s
               for i in range(17)]
        pairs = [mk(op, t, box, tile)
                 for op, t, (box, tile) in zip(ops, tensors[:17], boxes)]
        flat = [v for pair in pairs for v in pair]
        w_stores = tuple(flat[28:34])
        if const_expr(self.wgrad.adds_by_load):
            w_stores += tuple(tensors[14:17])
        return SharedOperands(tuple(flat[0:10]), tuple(flat[10:18]), tuple(flat[18:28]),
                              w_stores, tuple(tensors[17:]))

    @cute.jit
    def is_shared_task(self, ttype: Int32):
        """Whether a task of type ``ttype`` is the shared expert's (builds with its tasks)."""
        return ttype >= SHARED_FC2_DGRAD and ttype <= SHARED_WGRAD_DOWN

    @cute.jit
    def shared_wgrad_key(self, ttype: Int32, expert: Int32) -> Int32:
        """Which operands a weight-gradient task waited on: its expert, or -2 - rank for the
        shared expert's (its list tile is the rank)."""
        key = expert
        if const_expr(self.shared):
            if self.is_shared_task(ttype):
                key = -2 - expert
        return key

    @cute.jit
    def shared_tile(self, tile: Int32, shared: SharedOperands):
        """(token tile, rank) of a shared dgrad's tile."""
        tiles = (cute.size(shared.loads[1], mode=[0]) + TILE_M - 1) // TILE_M  # d_out (T, H, L)
        return tile % tiles, tile // tiles

    @cute.jit
    def dgated_rows(self, ttype: Int32, preact: cute.Tensor, row_slot: cute.Tensor,
                    weights: cute.Tensor, shared: SharedOperands):
        """The dgated epilogue's (saved g | u, row -> slot, weight) of a task: the routed
        rows', or the shared experts' (row r T_pad + t: slot r T + t, -1 past T; weight 1)."""
        rows = (preact, row_slot, weights)
        if const_expr(self.shared):
            if ttype == SHARED_FC2_DGRAD:
                rows = shared.rows
        return rows

    @cute.jit
    def shared_k_tiles(self, shared: SharedOperands) -> Int32:
        """K-tiles of the shared expert's weight gradients: its T tokens, rounded up."""
        tokens = cute.size(shared.w_loads[5], mode=[1])  # x^T: (H, T, 1)
        return (tokens + TILE_K - 1) // TILE_K


__all__ = ["SharedOperands", "SharedTasksMixin", "SHARED_FC2_DGRAD", "SHARED_FC1_DGRAD",
           "SHARED_WGRAD_GATE_UP", "SHARED_WGRAD_DOWN"]
