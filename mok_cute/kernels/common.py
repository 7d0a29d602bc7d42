"""Device-side building blocks shared by every mok_cute kernel.

One place per concept:
- ``NamedBarriers``: named-barrier ids (0 is reserved for __syncthreads).
- ``grouped_raster``: linear tile index -> (m_tile, n_tile), grouped for L2 reuse.
- math helpers used in epilogues (``silu``).
- sync helpers: release-published / acquire-loaded counters, bounded spin waits with
  nanosleep backoff that record (task, peer) in an error word instead of hanging.
- timers and the timeline recorder (``%globaltimer`` spans into a bounded device buffer).
- host-side compile helpers: fake tensors with run-time extents and strides and the fake
  stream of the TVM-FFI calling convention (compiled kernels take torch tensors and run on
  torch's current stream); the option string is ``mok_cute.jit.compile_options``.
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Float32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from mok_cute.constants import (ERROR_CODE_SHIFT, ERROR_PEER_SHIFT, ERROR_RANK_SHIFT,
                                PEER_NEVER_STARTED, TIMELINE_HEADER_WORDS, TIMELINE_RECORD_WORDS,
                                WAIT_TIMEOUT)

LOG2_E = 1.4426950408889634


class NamedBarriers(enum.IntEnum):
    RESERVED = 0  # bar.sync 0 is __syncthreads
    EPILOGUE = 1  # consumer warpgroups of a GEMM tile (pingpong: EPILOGUE + warpgroup, 1 and 2)
    COMM = 3  # the comm workers of a megakernel comm CTA
    PRODUCER = 4  # the producer warpgroup of a megakernel compute CTA (local_direct)
    MMA_ORDER = 5  # pingpong GEMM: warpgroup w waits on MMA_ORDER + w for its mainloop turn (5, 6)
    FORM_SWITCH = 7  # backward megakernel: consumer warpgroups between tasks of two tile forms
    TAIL_KSUM = 8  # backward megakernel: a compute CTA's consumer warps on k-sum tickets


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


@dsl_user_op
def f32_from_bits(bits: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 whose bit pattern is ``bits``."""
    return Float32(llvm.bitcast(T.f32(), Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def f32_bits(value: Float32, *, loc=None, ip=None) -> Int32:
    """The bit pattern of the fp32 ``value``."""
    return Int32(llvm.bitcast(T.i32(), Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def bf16_pair_bits(lo: Float32, hi: Float32) -> Int32:
    """The 32-bit word of two bf16 (``lo`` at the lower address) from fp32 values that are
    already bf16 (exact: their low 16 bits are zero). Traced inline."""
    return ((f32_bits(lo) >> 16) & Int32(0xFFFF)) | (f32_bits(hi) & Int32(-65536))


def bf16_pair_to_f32(word: Int32):
    """The two bf16 of a 32-bit word (element 2 i in the low half, as memory holds them) as
    fp32, exactly. Traced inline."""
    return f32_from_bits(word << 16), f32_from_bits(word & Int32(-65536))


# ---------------------------------------------------------------------- sync helpers
# Integer counters in global memory order the tasks of a persistent launch: a producer
# publishes with release semantics, a consumer spins with acquire loads until the counter
# reaches its target. A wait is bounded, measured from when it began: past its deadline it
# records who it was waiting for in an error word and gives up, so a stalled peer becomes a
# host-side exception, not a hang; once any wait has given up, every other wait gives up at
# once, so the launch ends promptly. Error word layout: ``mok_cute.constants`` (the waiting
# rank, the peer waited for, the task, a code); ``mok_cute.errors`` decodes it. Every waiter
# that gives up records its word with an atomic max, so the highest code wins: the peer that
# never started outranks the peers stalled behind it.
SPIN_SLEEP_MIN_NS = 32
SPIN_SLEEP_MAX_NS = 2048


@cute.jit
def counter_publish(counter: cute.Tensor, index, value, scope: cutlass.Constexpr[str] = "gpu"):
    """counter[index] += value, release: every write before it is visible to an acquirer."""
    cute.arch.red((counter.iterator + index).llvm_ptr, Int32(value), op="add", dtype="s32",
                  sem="release", scope=scope)


@cute.jit
def publish_stored(counter: cute.Tensor, index, is_store_warp, leader,
                   scope: cutlass.Constexpr[str] = "gpu"):
    """A task whose outputs went out by TMA publishes counter[index] += 1 for readers in
    other CTAs: the store warp waits for its stores to land (its lanes synced after), then
    ``leader`` (a lane of that warp) fences and release-publishes."""
    if is_store_warp:
        tma_stores_landed()
        cute.arch.sync_warp()  # the leader signals after the storing lane's wait
    if leader:
        if const_expr(scope == "sys"):
            cute.arch.fence_acq_rel_sys()
        else:
            cute.arch.fence_acq_rel_gpu()
        counter_publish(counter, index, 1, scope)


@cute.jit
def counter_load(counter: cute.Tensor, index, scope: cutlass.Constexpr[str] = "gpu") -> Int32:
    """Acquire load of counter[index]: later reads see what was published before it."""
    return cute.arch.load((counter.iterator + index).llvm_ptr, Int32, sem="acquire", scope=scope)


@cute.jit
def nanosleep(ns: Int32):
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(ns)])


@cute.jit
def tma_stores_landed(pending: cutlass.Constexpr[int] = 0):
    """This thread's TMA stores, all but the last ``pending`` commit groups, have written
    global memory and are ordered before its later generic accesses, so that a release
    after this (by this thread, or by one synced with it) covers them."""
    cute.arch.cp_async_bulk_wait_group(pending, read=False)
    cute.arch.fence_proxy("async.global")


@cute.jit
def record_error(error: cute.Tensor, task_id, peer, rank, code):
    """Record (task, peer, waiting rank, code) in the error word; the highest word wins."""
    word = ((Int64(task_id) + 1) | (Int64(peer) << ERROR_PEER_SHIFT)
            | (Int64(rank) << ERROR_RANK_SHIFT) | (Int64(code) << ERROR_CODE_SHIFT))
    cute.arch.atomic_max(error.iterator.llvm_ptr, word)


@cute.jit
def error_recorded(error: cute.Tensor) -> cutlass.Boolean:
    """Has any wait of this launch given up (relaxed read of the error word)?"""
    return cute.arch.load(error.iterator.llvm_ptr, Int64, sem="relaxed", scope="gpu") != 0


@cute.jit
def wait_counter(counter: cute.Tensor, index, target, timeout_ns: Int64, error: cute.Tensor,
                 task_id, peer, rank, scope: cutlass.Constexpr[str] = "gpu",
                 started_at=0) -> cutlass.Boolean:
    """Spin (nanosleep, doubling backoff) until counter[index] >= target, at most
    ``timeout_ns`` from the wait's first miss.

    Returns True when the target was reached. A waiter gives up at its deadline, or as soon
    as anyone has recorded an error (one stall stops every waiter), and records (task, peer,
    ``rank`` = the waiting rank) into ``error[0]``: code PEER_NEVER_STARTED when the counter
    is still below ``started_at`` (a peer's flag before its start announcement), WAIT_TIMEOUT
    otherwise. Returns False then.
    """
    value = counter_load(counter, index, scope)
    reached = value >= target
    done = reached  # leaves the spin: reached, or given up
    if not reached:
        deadline_ns = cute.arch.globaltimer() + timeout_ns  # read only by waits that miss
        sleep_ns = Int32(SPIN_SLEEP_MIN_NS)
        while not done:
            nanosleep(sleep_ns)
            sleep_ns = cutlass.min(sleep_ns * 2, SPIN_SLEEP_MAX_NS)
            value = counter_load(counter, index, scope)
            reached = value >= target
            done = reached
            if not reached:
                if cute.arch.globaltimer() > deadline_ns or error_recorded(error):
                    code = cutlass.select_(value < started_at, Int32(PEER_NEVER_STARTED),
                                           Int32(WAIT_TIMEOUT))
                    record_error(error, task_id, peer, rank, code)
                    done = True  # the caller sees the error word
    # no load after the spin: an acquire round trip per wait that nobody needed
    return reached


# ---------------------------------------------------------------------- cross-rank flags
@cute.jit
def flags_at(address: Int64, num_ranks) -> cute.Tensor:
    """The ``barrier_flags`` of one rank's symmetric buffer at ``address``: 2R int32 words
    (``constants``: progress words, then the sticky failed epochs)."""
    return cute.make_tensor(cute.make_ptr(Int32, address, cute.AddressSpace.gmem, assumed_align=4),
                            cute.make_layout(2 * num_ranks))


@cute.jit
def store_flag(flags: cute.Tensor, rank, value, failed_epoch, scope: cutlass.Constexpr[str]):
    """Rank ``rank``'s progress ``value`` into a peer's ``flags``; when ``failed_epoch`` > 0
    (this launch failed) that epoch first into the rank's sticky word. The progress word's
    release store publishes both: a peer that acquires it, or any later value, sees the
    failure."""
    if failed_epoch > 0:
        cute.arch.store((flags.iterator + cute.size(flags) // 2 + rank).llvm_ptr,
                        Int32(failed_epoch), sem="relaxed", scope=scope)
    cute.arch.store((flags.iterator + rank).llvm_ptr, Int32(value), sem="release", scope=scope)


@cute.jit
def peer_failed(flags: cute.Tensor, peer, epoch, scope: cutlass.Constexpr[str]) -> cutlass.Boolean:
    """After this rank acquired ``peer``'s progress word at call ``epoch``'s done value or
    above: did ``peer``'s launch of this call fail (or of a later one, which only a broken
    group reaches while this call runs)?"""
    return counter_load(flags, cute.size(flags) // 2 + peer, scope) >= epoch


# ---------------------------------------------------------------------- compile helpers
def fake_strided_tensor(dtype, shape, contiguous_mode: int = -1, align_bytes: int = 16):
    """Fake tensor with one stride-1 mode; the other strides are run-time values divisible
    so that every row stays ``align_bytes`` aligned."""
    contiguous_mode %= len(shape)
    div = max(1, align_bytes * 8 // dtype.width)
    stride = tuple(1 if i == contiguous_mode else cute.sym_int64(divisibility=div)
                   for i in range(len(shape)))
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align_bytes)


def fake_kmajor_tensor(dtype, shape, align_bytes: int = 16):
    """Fake (rows, K, batch) GEMM operand: mode 1 (K) is contiguous."""
    return fake_strided_tensor(dtype, shape, contiguous_mode=1, align_bytes=align_bytes)


def fake_vector(dtype, length=None, align_bytes: int = 4):
    """Fake contiguous 1-D tensor (run-time length unless given)."""
    n = cute.sym_int32() if length is None else length
    return cute.runtime.make_fake_tensor(dtype, (n,), stride=(1,), assumed_align=align_bytes)


def fake_stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


# ---------------------------------------------------------------------- timeline recorder
# The buffer layout is in mok_cute.constants (decoded by mok_cute.timeline).


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
def timeline_capacity(buf: cute.Tensor) -> Int64:
    """The buffer's record capacity: read it once, before a task loop, and pass it to
    ``timeline_write`` so no record waits for a global load."""
    return buf[0]


@cute.jit
def timeline_write(buf: cute.Tensor, slot: Int64, role: int, task_type: int, task_id, rank,
                   t_start: Int64, t_end: Int64, capacity: Int64 = None):
    """Write one span into a reserved slot; slots past the capacity are only counted.
    ``capacity``: from ``timeline_capacity`` (else ``buf[0]`` is loaded here, on the
    writer's critical path)."""
    if const_expr(capacity is None):
        capacity = buf[0]
    if slot < capacity:
        base = TIMELINE_HEADER_WORDS + slot * TIMELINE_RECORD_WORDS
        sm = Int64(cute.arch.smid())
        cta = Int64(cute.arch.block_idx()[0])
        word0 = (Int64(role) | (Int64(task_type) << 8) | (Int64(rank) << 16)
                 | (sm << 32) | (cta << 48))
        buf[base] = word0
        buf[base + 1] = Int64(task_id)
        buf[base + 2] = t_start
        buf[base + 3] = t_end

