"""Device-side building blocks shared by every mok_cute kernel.

One place per concept:
- ``NamedBarriers``: named-barrier ids (0 is reserved for __syncthreads).
- ``grouped_raster``: linear tile index -> (m_tile, n_tile), grouped for L2 reuse.
- math helpers used in epilogues (``silu``).
- sync helpers: acquire/release counters, bounded spin waits with nanosleep backoff.
- timers and the timeline recorder (``%globaltimer`` spans into a bounded device buffer).
- host-side compile helpers: fake tensors with run-time extents and strides and the fake
  stream of the TVM-FFI calling convention (compiled kernels take torch tensors and run on
  torch's current stream); the option string is ``mok_cute.jit.compile_options``.
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Float32

LOG2_E = 1.4426950408889634


class NamedBarriers(enum.IntEnum):
    RESERVED = 0  # bar.sync 0 is __syncthreads
    EPILOGUE = 1  # consumer warpgroups of a GEMM tile (pingpong: EPILOGUE + warpgroup, 1 and 2)


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


# ---------------------------------------------------------------------- compile helpers
def fake_kmajor_tensor(dtype, shape, align_bytes: int = 16):
    """Fake tensor whose mode 1 is contiguous and whose other strides are run-time values."""
    div = align_bytes * 8 // dtype.width
    stride = tuple(1 if i == 1 else cute.sym_int64(divisibility=div) for i in range(len(shape)))
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align_bytes)


def fake_vector(dtype, length=None, align_bytes: int = 4):
    """Fake contiguous 1-D tensor (run-time length unless given)."""
    n = cute.sym_int32() if length is None else length
    return cute.runtime.make_fake_tensor(dtype, (n,), stride=(1,), assumed_align=align_bytes)


def fake_stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


# ---------------------------------------------------------------------- timeline recorder
# Layout (decoded by mok_cute.timeline): int64 buf[8 + 4 * capacity]; buf[0] capacity,
# buf[1] ticket counter (may pass capacity: the excess is the dropped count), buf[2] start
# ns (first writer wins). Record i = buf[8 + 4i : 8 + 4i + 4]:
#   word0 role | type << 8 | rank << 16 | sm << 32 | cta << 48, word1 task id, word2/3 ns.
TIMELINE_HEADER_WORDS = 8
TIMELINE_RECORD_WORDS = 4


@cute.jit
def timeline_now() -> Int64:
    return cute.arch.globaltimer()


@cute.jit
def timeline_mark_start(buf: cute.Tensor, t_ns: Int64):
    """Stamp the layer start once: only the first caller's time sticks."""
    cute.arch.atomic_cas((buf.iterator + 2).llvm_ptr, cmp=Int64(0), val=t_ns)


@cute.jit
def timeline_reserve(buf: cute.Tensor, count) -> Int64:
    """Take ``count`` consecutive record slots with one ticket; returns the first slot.

    A CTA that knows how many spans it will write reserves them all up front, so its
    records are plain stores and no warp waits for an atomic's reply between tasks."""
    return cute.arch.atomic_add((buf.iterator + 1).llvm_ptr, Int64(count))


@cute.jit
def timeline_write(buf: cute.Tensor, slot: Int64, role: int, task_type: int, task_id, rank,
                   t_start: Int64, t_end: Int64):
    """Write one span into a reserved slot; slots past the capacity are only counted."""
    if slot < buf[0]:
        base = TIMELINE_HEADER_WORDS + slot * TIMELINE_RECORD_WORDS
        sm = Int64(cute.arch.smid())
        cta = Int64(cute.arch.block_idx()[0])
        word0 = (Int64(role) | (Int64(task_type) << 8) | (Int64(rank) << 16)
                 | (sm << 32) | (cta << 48))
        buf[base] = word0
        buf[base + 1] = Int64(task_id)
        buf[base + 2] = t_start
        buf[base + 3] = t_end


@cute.jit
def timeline_record(buf: cute.Tensor, role: int, task_type: int, task_id, rank,
                    t_start: Int64, t_end: Int64):
    """Append one span with its own ticket (for tasks whose count is not known ahead)."""
    timeline_write(buf, timeline_reserve(buf, 1), role, task_type, task_id, rank, t_start, t_end)
