"""The row-addressed epilogues of the grouped GEMMs, a mixin on ``gemm_core.GemmCoreSm90``
shared by every kernel that runs them (``gemm_sm90``, ``gemm_fp8``, the megakernel's FC1
tasks): each consumer thread looks up, once a tile, the (token, k) slot of the two rows per
subtile row block its accumulator elements sit on (-1: padding), then

- ``swiglu`` with ``save_preact`` (a training forward): besides h, the bf16 g and u of each
  routed row are stored from registers as 32-bit bf16 pairs into row ``slot`` of mPreact
  ([slots, 2I]: g then u); padding rows and columns past I are not stored;
- ``dgated`` (FC2's dgrad): g and u are loaded back from there ``DGATED_PREFETCH`` subtiles
  ahead, and the SwiGLU backward runs on the accumulator (``gemm_sm90``'s module docstring
  has the formulas); each row's partial of <acc, h> is reduced over its four lanes and
  stored per N-tile.

What the class using it provides: ``epi_tile``, ``tile_shape_mnk`` and ``save_preact``
attributes, the core's ``epi_coords`` / ``swiglu_preact`` / ``epi_visit_subtile``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from mok_cute.constants import TILE_M
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import GemmCoreSm90

# dgated: subtiles of saved g and u loaded ahead of the one being computed
DGATED_PREFETCH = 2
# pre-activation row offsets are kept in units of this many 32-bit words (a row is I words)
PREACT_ROW_ALIGN = 8


class TileRows(NamedTuple):
    """Per consumer thread and tile (dgated, save_preact), its rows' (2 per subtile row
    block) partial sums of acc * h (dgated), (token, k) slots (-1: padding), router weights
    (dgated) and their pre-activation rows' offsets (``_load_row_info``: in 32-byte units, so
    an Int32 holds them; 64-bit ones kept live through the epilogue spilled registers)."""

    sums: cute.Tensor
    slot: cute.Tensor
    weight: cute.Tensor
    offset: cute.Tensor



class RowEpilogueMixin:
    """``save_preact`` and ``dgated`` (module docstring) for a ``GemmCoreSm90`` kernel."""

    @cute.jit
    def epi_visit_subtile(self, epi, kind: cutlass.Constexpr[str], sm: cutlass.Constexpr[int],
                          sn: cutlass.Constexpr[int], outs, visit_args):
        if const_expr(kind == "dgated"):
            self._visit_dgated(epi, sm, sn, outs, visit_args)
        elif const_expr(kind == "swiglu" and self.save_preact):
            gate, up = self.swiglu_preact(epi, sm, sn)
            for v in cutlass.range_constexpr(cute.size(outs[0])):
                outs[0][v] = common.silu(gate[v]) * up[v]
            self._store_preact(epi, gate, up, sm, sn, visit_args)
        else:
            # named, not super(): the DSL re-traces this body without its class cell, and a
            # zero-argument super() then resolves against a subclass and recurses
            GemmCoreSm90.epi_visit_subtile(self, epi, kind, sm, sn, outs, visit_args)

    @cute.jit
    def _visit_dgated(self, epi, sm: cutlass.Constexpr[int], sn: cutlass.Constexpr[int], outs,
                      visit_args):
        """Subtile (sm, sn) of dG, dU and h' (module docstring), and each row's share of the
        partial sum of acc * h into ``rows.sums``. The saved g and u arrive in registers
        ``DGATED_PREFETCH`` subtiles ahead (32-bit loads of bf16 pairs from row ``slot``,
        padding rows never read), so their latency hides behind the subtiles before."""
        m_tile, n_tile, coords, rows, preact, mPreact, tidx = visit_args
        frag_size = cute.size(outs[0])
        out_n = self.tile_shape_mnk[1] // self.epi_tile[1]
        subtile = sm * out_n + sn
        total = (TILE_M // self.epi_tile[0]) * out_n
        if const_expr(subtile == 0):
            for ahead in cutlass.range_constexpr(min(DGATED_PREFETCH, total)):
                self._load_preact(epi, preact, ahead, coords, rows, mPreact, n_tile, out_n)
        buf = subtile % DGATED_PREFETCH
        first = subtile * frag_size
        on_hi_row = self._pairs_on_hi_row(epi)
        for p in cutlass.range_constexpr(frag_size // 2):
            r = 2 * sm + on_hi_row[p]
            weight = rows.weight[r]
            valid = rows.slot[r] >= 0
            gates = common.bf16_pair_to_f32(preact[buf, p])
            ups = common.bf16_pair_to_f32(preact[buf, frag_size // 2 + p])
            share = Float32(0.0)
            for e in cutlass.range_constexpr(2):
                v = 2 * p + e
                gate, up = gates[e], ups[e]
                sig = cute.arch.rcp_approx(1.0 + cute.math.exp2(-gate * common.LOG2_E,
                                                                fastmath=True))
                silu = gate * sig
                hidden = Float32(BFloat16(silu * up))  # the forward's h, bit for bit
                d_hidden = weight * epi.acc[first + v]
                outs[0][v] = cutlass.select_(valid, d_hidden * up * sig * (1.0 + gate * (1.0 - sig)),
                                             Float32(0.0))
                outs[1][v] = cutlass.select_(valid, d_hidden * silu, Float32(0.0))
                outs[2][v] = cutlass.select_(valid, weight * hidden, Float32(0.0))
                share = share + cutlass.select_(valid, epi.acc[first + v] * hidden, Float32(0.0))
            rows.sums[r] = rows.sums[r] + share
        if const_expr(subtile + DGATED_PREFETCH < total):
            self._load_preact(epi, preact, subtile + DGATED_PREFETCH, coords, rows, mPreact,
                              n_tile, out_n)

    def row_visit_args(self, epi, kind: str, coords, m_tile: Int32, n_tile: Int32, mPreact,
                       mRowSlot, mWeights, tidx: Int32):
        """Per tile, before the epilogue of the row-addressed kinds (dgated, save_preact): this
        thread's ``TileRows`` (slots, weights and offsets loaded; dgated: zeroed sums) and
        the epilogue's visit arguments (dgated: with the g / u prefetch buffers). Traced inline
        (a plain method); every kernel with these epilogues calls it."""
        epi_m = TILE_M // self.epi_tile[0]
        rows = TileRows(*(cute.make_rmem_tensor((2 * epi_m,), t)
                          for t in (Float32, Int32, Float32, Int32)))
        self._load_row_info(rows, mRowSlot, mWeights, mPreact, m_tile, tidx)
        preact = None
        if const_expr(kind == "dgated"):
            rows.sums.fill(0.0)
            preact = cute.make_rmem_tensor((DGATED_PREFETCH, cute.size(epi.frag_shape)), Int32)
        return rows, (m_tile, n_tile, coords, rows, preact, mPreact, tidx)

    def _pairs_on_hi_row(self, epi) -> list[int]:
        """For each element pair (2 p, 2 p + 1) of a thread's subtile fragment: 1 if it sits on
        the thread's second row (+8), else 0. The same for every thread, so read from thread
        0's coordinates, which are compile-time values: no per-pair select at run time."""
        coords = self.epi_coords(epi, 0)
        return [int(int(coords[2 * p][0]) >= 8) for p in range(cute.size(epi.frag_shape) // 2)]

    def _preact_row(self, words: cute.Tensor, rows, r: int) -> cute.Tensor:
        """Row entry ``r``'s pre-activations as 32-bit words (g pairs, then u pairs), from
        its precomputed offset. Traced inline."""
        return cute.make_tensor(words.iterator + Int64(rows.offset[r]) * PREACT_ROW_ALIGN,
                                cute.make_layout(cute.size(words, mode=[1])))

    def _my_rows(self, tidx):
        """The two rows of an epilogue subtile that this consumer thread's accumulator
        elements sit on: warp w of the tile's threads holds rows 16 w .. 16 w + 15, lane l
        rows l / 4 and l / 4 + 8 (the wgmma layout; cooperative: 8 warps over a 128-row
        subtile, pingpong: 4 over 64). Traced inline."""
        base = (tidx // 32) * 16 + (tidx % 32) // 4
        return base, base + 8

    @cute.jit
    def _load_row_info(self, rows, mRowSlot: cute.Tensor, mWeights: Optional[cute.Tensor],
                       mPreact: cute.Tensor, m_tile: Int32, tidx: Int32):
        """The slot (-1: padding) and router weight (with ``mWeights``) of each of this
        thread's tile rows: entry 2 sm + hi for subtile row block sm. Issued before the
        epilogue's first subtile, once a tile."""
        mine = self._my_rows(tidx)
        # in units of PREACT_ROW_ALIGN words (I % 8 == 0): Int32 reaches 64 GiB of
        # pre-activations where 64-bit offsets kept live would spill
        row_units = Int32(cute.recast_tensor(mPreact, Int32).layout.stride[0]) // PREACT_ROW_ALIGN
        for r in cutlass.range_constexpr(cute.size(rows.slot)):
            row = m_tile * TILE_M + (r // 2) * self.epi_tile[0] + mine[r % 2]
            slot = Int32(-1)
            if row < cute.size(mRowSlot):
                slot = mRowSlot[row]
            rows.slot[r] = slot
            rows.offset[r] = cutlass.max(slot, 0) * row_units
            if const_expr(mWeights is not None):
                weight = Float32(0.0)
                if slot >= 0:
                    weight = mWeights[slot]
                rows.weight[r] = weight

    @cute.jit
    def _load_preact(self, epi, preact: cute.Tensor, subtile: cutlass.Constexpr[int], coords, rows,
                     mPreact: cute.Tensor, n_tile: Int32, out_n: cutlass.Constexpr[int]):
        """Issue the loads of subtile ``subtile``'s g and u pairs into its prefetch buffer;
        zeros where the row is padding or the columns lie past I (so their share is zero)."""
        sm, sn = subtile // out_n, subtile % out_n
        buf = subtile % DGATED_PREFETCH
        pairs = cute.size(preact, mode=[1]) // 2
        words = cute.recast_tensor(mPreact, Int32)  # (slots, I): g pairs, then u pairs
        half = cute.size(words, mode=[1]) // 2
        on_hi_row = self._pairs_on_hi_row(epi)
        col0 = n_tile * self.tile_shape_mnk[1] + sn * self.epi_tile[1]
        for p in cutlass.range_constexpr(pairs):
            r = 2 * sm + on_hi_row[p]
            pair = (col0 + coords[2 * p][1]) // 2
            g_word, u_word = Int32(0), Int32(0)
            if rows.slot[r] >= 0 and pair < half:
                row = self._preact_row(words, rows, r)
                g_word = row[pair]
                u_word = row[half + pair]
            preact[buf, p] = g_word
            preact[buf, pairs + p] = u_word

    @cute.jit
    def _store_preact(self, epi, gate: cute.Tensor, up: cute.Tensor, sm: cutlass.Constexpr[int],
                      sn: cutlass.Constexpr[int], visit_args):
        """save_preact: this thread's g and u of subtile (sm, sn) (bf16 values in fp32) into
        row ``slot`` of mPreact as 32-bit bf16 pairs; padding rows and columns past I are not
        stored."""
        m_tile, n_tile, coords, rows, _, mPreact, tidx = visit_args
        words = cute.recast_tensor(mPreact, Int32)  # (slots, I): g pairs, then u pairs
        half = cute.size(words, mode=[1]) // 2
        on_hi_row = self._pairs_on_hi_row(epi)
        col0 = n_tile * (self.tile_shape_mnk[1] // 2) + sn * self.epi_tile[1]  # swiglu's h tile
        for p in cutlass.range_constexpr(cute.size(gate) // 2):
            r = 2 * sm + on_hi_row[p]
            pair = (col0 + coords[2 * p][1]) // 2
            if rows.slot[r] >= 0 and pair < half:
                row = self._preact_row(words, rows, r)
                row[pair] = common.bf16_pair_bits(gate[2 * p], gate[2 * p + 1])
                row[half + pair] = common.bf16_pair_bits(up[2 * p], up[2 * p + 1])

    @cute.jit
    def _store_row_sums(self, rows, mPartials, m_tile: Int32, n_tile: Int32, tidx: Int32):
        """The four lanes holding a row's columns add their sums (fixed order), and the first
        writes the row's partial for this N-tile."""
        mine = self._my_rows(tidx)
        for r in cutlass.range_constexpr(cute.size(rows.sums)):
            total = rows.sums[r]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            row = m_tile * TILE_M + (r // 2) * self.epi_tile[0] + mine[r % 2]
            if tidx % 4 == 0 and row < cute.size(mPartials, mode=[0]):
                mPartials[row, n_tile] = total
