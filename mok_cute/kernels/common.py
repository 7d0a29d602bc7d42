"""Device-side building blocks shared by every mok_cute kernel.

One place per concept:
- ``NamedBarriers``: named-barrier ids (0 is reserved for __syncthreads).
- ``grouped_raster``: linear tile index -> (m_tile, n_tile), grouped for L2 reuse.
- math helpers used in epilogues (``silu``).
- sync helpers: acquire/release counters, bounded spin waits with nanosleep backoff.
- timers and the timeline recorder (``%globaltimer`` spans into a bounded device buffer).
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Float32

LOG2_E = 1.4426950408889634


class NamedBarriers(enum.IntEnum):
    RESERVED = 0  # bar.sync 0 is __syncthreads
    EPILOGUE = 1  # consumer warpgroups of a GEMM tile


@cute.jit
def grouped_raster(tile_idx: Int32, num_m_tiles: Int32, num_n_tiles: Int32,
                   group_m: cutlass.Constexpr[int]):
    """Linear tile index -> (m_tile, n_tile), so CTAs running together share B tiles.

    Tiles come in groups of ``group_m`` M-tiles; inside a group M moves fastest, then N.
    The last group may be shorter. ``num_m_tiles`` may be a run-time value.
    """
    group_size = group_m * num_n_tiles
    group = tile_idx // group_size
    first_m = group * group_m
    rows_in_group = cutlass.min(group_m, num_m_tiles - first_m)
    local = tile_idx - group * group_size
    return first_m + local % rows_in_group, local // rows_in_group


@cute.jit
def silu(x: Float32) -> Float32:
    """x * sigmoid(x) in fp32 (ex2.approx + rcp.approx; deterministic, not IEEE-exact)."""
    return x * cute.arch.rcp_approx(1.0 + cute.math.exp2(-x * LOG2_E, fastmath=True))
