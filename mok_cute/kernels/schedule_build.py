"""The one-rank receive schedule (``mok_cute.schedule`` at R = 1) built on the GPU in two launches.

``mok_cute.schedule._build_single_rank`` (the torch reference beside this kernel) is a stable
sort of the T*K routed slots by expert, padded per expert to whole M-tiles. In torch it is
about 50 small launches (about 0.7 ms of host time per layer call, and GPU time between
launches). Here it is two:

``count``  (one CTA per chunk of ``CHUNK`` slots)
    Each slot's rank among the earlier slots of its chunk that go to the same expert, and the
    chunk's per-expert counts. A round of ``THREADS`` consecutive slots is ranked with
    ``match.any.sync`` inside each warp plus per-warp counts in shared memory, so ranks follow
    slot order: the sort is stable, as the reference's is.

``place``  (the same grid)
    Every CTA sums the chunk counts (per-expert totals, and its own chunk's base), scans the
    tile-padded totals into segment offsets, and writes its slots' rows: ``row_token``,
    ``row_k``, ``row_peer`` at ``offset[e] + base[e] + rank``, and ``slot_rows`` for each slot.
    Padding rows, the tile table and the counts are shared out among the CTAs.

Integer work only, each output element written by one thread: bitwise equal to the torch
build and deterministic. Ids outside ``[0, E)`` route nowhere (``slot_rows`` -1), as in the
reference. ``E`` (local experts) and the id dtype are compile-time; T and K are not.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, const_expr

from mok_cute import jit

THREADS = 256
WARPS = THREADS // 32
ROUNDS = 8  # rounds of THREADS slots per chunk
CHUNK = THREADS * ROUNDS
MAX_EXPERTS = 1024  # count kernel smem: (WARPS + 1) x (E + 1) words, under the 48 KiB default
SCAN_STEPS = 5  # lanes of a warp scan: 2**5 = 32


def num_chunks(num_slots: int) -> int:
    return -(-num_slots // CHUNK)


class ScheduleBuild:
    """The R = 1 receive schedule of ``num_experts`` experts, padded to ``tile_m`` rows.

    :param num_experts: local experts (compile-time: shared-memory tables are sized by it).
    :param tile_m: M-tile rows every expert segment is padded to.
    :param ids_int64: the routing ids are int64 (torch's ``topk``) rather than int32.
    """

    def __init__(self, num_experts: int, tile_m: int = 128, ids_int64: bool = False):
        if not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
            raise ValueError(f"num_experts must be an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
        if not isinstance(tile_m, int) or tile_m < 1:
            raise ValueError(f"tile_m must be a positive int, got {tile_m!r}")
        self.num_experts = num_experts
        self.tile_m = tile_m
        self.ids_int64 = bool(ids_int64)
        # experts per thread in the offset scan, and binary-search steps over E + 1 offsets
        self.scan_segment = -(-num_experts // THREADS)
        self.search_steps = max(1, num_experts.bit_length())

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, ids: cute.Pointer, rank_in_chunk: cute.Pointer, chunk_counts: cute.Pointer,
                 row_token: cute.Pointer, row_k: cute.Pointer, row_peer: cute.Pointer,
                 slot_rows: cute.Pointer, expert_counts: cute.Pointer,
                 expert_offsets: cute.Pointer, tile_expert: cute.Pointer, num_tiles: cute.Pointer,
                 num_slots: Int32, top_k: Int32, capacity: Int32, stream: cuda_driver.CUstream):
        E = self.num_experts
        chunks = (num_slots + CHUNK - 1) // CHUNK
        mIds = cute.make_tensor(ids, cute.make_layout(num_slots))
        mRank = cute.make_tensor(rank_in_chunk, cute.make_layout(num_slots))
        mChunkCounts = cute.make_tensor(chunk_counts, cute.make_layout((E + 1, chunks)))
        mRowToken = cute.make_tensor(row_token, cute.make_layout(capacity))
        mRowK = cute.make_tensor(row_k, cute.make_layout(capacity))
        mRowPeer = cute.make_tensor(row_peer, cute.make_layout(capacity))
        mSlotRows = cute.make_tensor(slot_rows, cute.make_layout(num_slots))
        mCounts = cute.make_tensor(expert_counts, cute.make_layout(E))
        mOffsets = cute.make_tensor(expert_offsets, cute.make_layout(E + 1))
        mTileExpert = cute.make_tensor(tile_expert, cute.make_layout(capacity // self.tile_m))
        mNumTiles = cute.make_tensor(num_tiles, cute.make_layout(1))
        self.count_kernel(mIds, mRank, mChunkCounts, num_slots).launch(
            grid=[chunks, 1, 1], block=[THREADS, 1, 1], stream=stream)
        self.place_kernel(mIds, mRank, mChunkCounts, mRowToken, mRowK, mRowPeer, mSlotRows,
                          mCounts, mOffsets, mTileExpert, mNumTiles, num_slots, top_k,
                          capacity).launch(grid=[chunks, 1, 1], block=[THREADS, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def _expert_of(self, mIds: cute.Tensor, slot: Int32, num_slots: Int32) -> Int32:
        """Local expert of ``slot``; E ("routes nowhere") for an id outside [0, E) or a slot
        past the end."""
        E = self.num_experts
        expert = Int32(E)
        if slot < num_slots:
            if const_expr(self.ids_int64):
                raw = Int64(mIds[slot])
                if raw >= Int64(0) and raw < Int64(E):
                    expert = Int32(raw)
            else:
                raw32 = Int32(mIds[slot])
                if raw32 >= 0 and raw32 < E:
                    expert = raw32
        return expert

    # ------------------------------------------------------------------ kernel 1: count
    @cute.kernel
    def count_kernel(self, mIds: cute.Tensor, mRank: cute.Tensor, mChunkCounts: cute.Tensor,
                     num_slots: Int32):
        E = self.num_experts
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.utils.SmemAllocator()
        # warp_counts[w, e]: slots of expert e in warp w's 32 slots of the current round
        warp_counts = smem.allocate_tensor(Int32, cute.make_layout((WARPS, E + 1), stride=(E + 1, 1)), 16)
        running = smem.allocate_tensor(Int32, cute.make_layout(E + 1), 16)  # chunk's count so far
        for i in cutlass.range(tidx, WARPS * (E + 1), THREADS, unroll=1):
            warp_counts[i // (E + 1), i % (E + 1)] = 0
        for e in cutlass.range(tidx, E + 1, THREADS, unroll=1):
            running[e] = 0
        cute.arch.sync_threads()

        first = chunk * CHUNK
        for r in cutlass.range(ROUNDS, unroll=1):
            slot = first + r * THREADS + tidx
            expert = self._expert_of(mIds, slot, num_slots)
            same = cute.arch.match_sync(0xFFFFFFFF, expert)
            below = cute.arch.popc(same & cute.arch.lanemask_lt())
            in_warp = cute.arch.popc(same)
            leader = below == 0
            if leader:
                warp_counts[warp, expert] = Int32(in_warp)
            cute.arch.sync_threads()
            earlier = running[expert]
            later = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                if w < warp:
                    earlier += warp_counts[w, expert]
                if w > warp:
                    later += warp_counts[w, expert]
            if slot < num_slots:
                mRank[slot] = earlier + Int32(below)
            cute.arch.sync_threads()
            if leader:
                warp_counts[warp, expert] = 0
                if later == 0:  # the last warp of this round with this expert carries the count on
                    running[expert] = earlier + Int32(in_warp)
            cute.arch.sync_threads()
        for e in cutlass.range(tidx, E + 1, THREADS, unroll=1):
            mChunkCounts[e, chunk] = running[e]

    # ------------------------------------------------------------------ kernel 2: place
    @cute.kernel
    def place_kernel(self, mIds: cute.Tensor, mRank: cute.Tensor, mChunkCounts: cute.Tensor,
                     mRowToken: cute.Tensor, mRowK: cute.Tensor, mRowPeer: cute.Tensor,
                     mSlotRows: cute.Tensor, mCounts: cute.Tensor, mOffsets: cute.Tensor,
                     mTileExpert: cute.Tensor, mNumTiles: cute.Tensor, num_slots: Int32,
                     top_k: Int32, capacity: Int32):
        E = self.num_experts
        tile_m = self.tile_m
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        chunks, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        smem = cutlass.utils.SmemAllocator()
        total = smem.allocate_tensor(Int32, cute.make_layout(E + 1), 16)  # rows per expert
        base = smem.allocate_tensor(Int32, cute.make_layout(E + 1), 16)  # rows in earlier chunks
        offsets = smem.allocate_tensor(Int32, cute.make_layout(E + 1), 16)  # padded segment starts
        partial = smem.allocate_tensor(Int32, cute.make_layout(THREADS), 16)

        # 1. totals and this chunk's base, per expert (a column of chunk counts per thread)
        for e in cutlass.range(tidx, E, THREADS, unroll=1):
            before = Int32(0)
            after = Int32(0)
            for c in cutlass.range(chunks, unroll=1):
                n = mChunkCounts[e, c]
                if c < chunk:
                    before += n
                else:
                    after += n
            base[e] = before
            total[e] = before + after

        # 2. offsets = exclusive scan of the tile-padded totals: thread t sums its segment of
        #    experts, warp 0 scans the THREADS partial sums, then each segment is written
        cute.arch.sync_threads()
        seg = self.scan_segment
        seg_sum = Int32(0)
        for i in cutlass.range_constexpr(seg):
            e = tidx * seg + i
            if e < E:
                seg_sum += (total[e] + (tile_m - 1)) // tile_m * tile_m
        partial[tidx] = seg_sum
        cute.arch.sync_threads()
        if tidx < 32:
            per_lane = THREADS // 32
            lane_sum = Int32(0)
            for i in cutlass.range_constexpr(per_lane):
                lane_sum += partial[lane * per_lane + i]
            inclusive = lane_sum
            for s in cutlass.range_constexpr(SCAN_STEPS):
                up = cute.arch.shuffle_sync_up(inclusive, 1 << s)
                if lane >= (1 << s):
                    inclusive += up
            run = inclusive - lane_sum
            for i in cutlass.range_constexpr(per_lane):
                v = partial[lane * per_lane + i]
                partial[lane * per_lane + i] = run
                run += v
            if lane == 31:
                offsets[E] = inclusive
        cute.arch.sync_threads()
        run = partial[tidx]
        for i in cutlass.range_constexpr(seg):
            e = tidx * seg + i
            if e < E:
                offsets[e] = run
                run += (total[e] + (tile_m - 1)) // tile_m * tile_m
        cute.arch.sync_threads()

        # 3. this chunk's slots -> their rows
        first = chunk * CHUNK
        for i in cutlass.range(tidx, CHUNK, THREADS, unroll=1):
            slot = first + i
            if slot < num_slots:
                expert = self._expert_of(mIds, slot, num_slots)
                row = Int32(-1)
                if expert < E:
                    row = offsets[expert] + base[expert] + mRank[slot]
                    mRowToken[row] = slot // top_k
                    mRowK[row] = slot % top_k
                    mRowPeer[row] = 0
                mSlotRows[slot] = row

        # 4. padding rows: each CTA the tail rows of the experts e = chunk (mod chunks), and
        #    a share of the rows past the last segment
        for e in cutlass.range(chunk, E, chunks, unroll=1):
            for row in cutlass.range(offsets[e] + total[e] + tidx, offsets[e + 1], THREADS, unroll=1):
                mRowToken[row] = -1
                mRowK[row] = -1
                mRowPeer[row] = -1
        stride = chunks * THREADS
        for row in cutlass.range(offsets[E] + chunk * THREADS + tidx, capacity, stride, unroll=1):
            mRowToken[row] = -1
            mRowK[row] = -1
            mRowPeer[row] = -1

        # 5. the tile table: expert of each M-tile (binary search of the offsets), -1 past the end
        for tile in cutlass.range(chunk * THREADS + tidx, capacity // tile_m, stride, unroll=1):
            start = tile * tile_m
            expert = Int32(-1)
            if start < offsets[E]:
                lo = Int32(0)  # number of experts whose segment ends at or before start
                hi = Int32(E)
                for _ in cutlass.range_constexpr(self.search_steps):
                    mid = (lo + hi) // 2
                    if lo < hi:
                        if offsets[mid + 1] <= start:
                            lo = mid + 1
                        else:
                            hi = mid
                expert = lo
            mTileExpert[tile] = expert

        # 6. counts, offsets and the tile count (CTA 0)
        if chunk == 0:
            for e in cutlass.range(tidx, E + 1, THREADS, unroll=1):
                mOffsets[e] = offsets[e]
                if e < E:
                    mCounts[e] = total[e]
            if tidx == 0:
                mNumTiles[0] = offsets[E] // tile_m


# ----------------------------------------------------------------------------------------
# Tensor-free compile function (registered in mok_cute.jit.KERNELS) and the torch entry point
# ----------------------------------------------------------------------------------------


def _placeholder_ptr(dtype) -> cute.Pointer:
    return cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=4)


def compile_schedule_build(arch: str = "sm_90a", *, options: str = "", num_experts: int = 32,
                           tile_m: int = 128, ids_int64: bool = True):
    """Compile ``ScheduleBuild`` for ``arch`` without a GPU or tensors."""
    op = ScheduleBuild(num_experts, tile_m, ids_int64)
    ids = _placeholder_ptr(Int64 if ids_int64 else Int32)
    i32 = [_placeholder_ptr(Int32) for _ in range(10)]
    return cute.compile(op, ids, *i32, Int32(1), Int32(1), Int32(1),
                        cute.runtime.make_fake_stream(), options=jit.compile_options(arch, options))


def build_single_rank(topk_idx: torch.Tensor, num_experts: int, tile_m: int = 128, *,
                      poison: int | None = None):
    """``mok_cute.schedule.ReceiveSchedule`` of one rank (R = 1) for ``topk_idx [T, K]`` (int32
    or int64, CUDA), built by the two kernels above; equal to ``schedule._build_single_rank``.
    ``poison`` (tests): fill every output with this value first, so an element the kernels
    failed to write shows."""
    from mok_cute.schedule import ReceiveSchedule, schedule_capacity

    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be 2-D [T, K], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if topk_idx.device.type != "cuda":
        raise ValueError(f"topk_idx must be a CUDA tensor, got {topk_idx.device}")
    if not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
    T, K = topk_idx.shape
    num_slots = T * K
    if num_slots >= 2**31 - CHUNK:
        raise ValueError(f"topk_idx: T*K must be below 2**31, got {num_slots}")
    device = topk_idx.device
    capacity = schedule_capacity(1, T, K, num_experts, tile_m)
    ids = topk_idx.contiguous()
    i32 = dict(dtype=torch.int32, device=device)
    row_token = torch.empty(capacity, **i32)
    row_k = torch.empty(capacity, **i32)
    row_peer = torch.empty(capacity, **i32)
    slot_rows = torch.empty(num_slots, **i32)
    counts = torch.empty(num_experts, **i32)
    offsets = torch.empty(num_experts + 1, **i32)
    tile_expert = torch.empty(capacity // tile_m, **i32)
    num_tiles = torch.empty(1, **i32)
    if poison is not None:
        for t in (row_token, row_k, row_peer, slot_rows, counts, offsets, tile_expert, num_tiles):
            t.fill_(poison)
    if num_slots == 0:  # no launch: every row is padding, every segment empty
        for t in (row_token, row_k, row_peer, tile_expert):
            t.fill_(-1)
        for t in (counts, offsets, num_tiles):
            t.zero_()
    else:
        rank_in_chunk = torch.empty(num_slots, **i32)
        chunk_counts = torch.empty(num_chunks(num_slots) * (num_experts + 1), **i32)
        compiled = jit.compile_kernel("schedule_build", arch=jit.device_arch(device),
                                      num_experts=num_experts, tile_m=tile_m,
                                      ids_int64=ids.dtype == torch.int64)
        ptr = lambda t, dt: cute.runtime.make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem,  # noqa: E731
                                                  assumed_align=4)
        compiled(ptr(ids, Int64 if ids.dtype == torch.int64 else Int32),
                 *(ptr(t, Int32) for t in (rank_in_chunk, chunk_counts, row_token, row_k, row_peer,
                                           slot_rows, counts, offsets, tile_expert, num_tiles)),
                 Int32(num_slots), Int32(K), Int32(capacity),
                 cuda_driver.CUstream(torch.cuda.current_stream(device).cuda_stream))
    return ReceiveSchedule(
        rank=0, num_ranks=1, num_local_experts=num_experts, tile_m=tile_m, capacity=capacity,
        row_peer=row_peer, row_token=row_token, row_k=row_k, expert_counts=counts,
        expert_offsets=offsets, tile_expert=tile_expert, num_tiles=num_tiles, slot_rows=slot_rows)
