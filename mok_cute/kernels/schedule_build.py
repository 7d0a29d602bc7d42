"""A rank's receive schedule (``mok_cute.schedule``) built on the GPU in two launches.

The torch build (``schedule.build_receive_schedule``, the reference beside this kernel) sorts
the R*T*K candidate rows (every peer's routed slots) into expert segments padded to whole
M-tiles, rows of a segment in (j, peer) order, j being a row's rank among its own peer's rows
of that expert (in slot order). In torch that is 50-70 small launches per rank (about 0.7 ms
of host time per layer call, and GPU time between launches). Here it is two:

``count``  (grid: chunks of ``CHUNK`` slots x peers)
    Each slot's rank among the earlier slots of its chunk (same peer) that go to the same
    local expert, and the chunk's per-expert counts. A round of ``THREADS`` consecutive slots
    is ranked with ``match.any.sync`` inside each warp plus per-warp counts in shared memory,
    so ranks follow slot order.

``place``  (the same grid)
    Every CTA sums the chunk counts into the per-(peer, expert) row counts ``n[p, e]`` and its
    own chunk's base, scans the tile-padded expert totals into segment offsets, and writes
    its slots' rows. A row with rank j among peer p's rows of expert e lands at
    ``offset[e] + sum_q min(n[q, e], j) + #{q < p : n[q, e] > j}`` (the (j, peer) order).
    ``row_token``, ``row_k``, ``row_peer`` go there; for this rank's own slots also
    ``slot_rows`` (the inverse map the k-sum reads). Padding rows, the tile table and the
    counts are shared out among the CTAs of peer 0.

Several ranks' schedules of one routing (the R virtual ranks of one megakernel launch) come
from the same two launches: the grid's third axis is the rank, every output and scratch array
stacked with one slice per rank (``build_schedules``).

Integer work only, each output element written by one thread: bitwise equal to the torch
build and deterministic. Ids outside this rank's experts route nowhere here, as in the
reference. ``E`` (local experts) and the id dtype are compile-time; R, the ranks, T and K
are not.
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
MAX_PEER_EXPERTS = 6144  # place kernel smem: the n[peer, expert] table, R * E words (24 KiB)
SCAN_STEPS = 5  # lanes of a warp scan: 2**5 = 32


def num_chunks(num_slots: int) -> int:
    return -(-num_slots // CHUNK)


class ScheduleBuild:
    """Receive schedules of ``num_built`` consecutive ranks over ``num_experts`` local experts
    each, padded to ``tile_m`` rows.

    :param num_experts: local experts per rank (compile-time: shared-memory tables are sized
        by it).
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
                 num_peers: Int32, first_rank: Int32, num_built: Int32, num_slots: Int32,
                 top_k: Int32, capacity: Int32, stream: cuda_driver.CUstream):
        """``ids`` [num_peers, num_slots] (every peer's routing, global expert ids);
        ``num_slots`` = T * K slots per peer. Ranks ``first_rank`` .. ``+ num_built - 1``; every
        other pointer holds ``num_built`` consecutive arrays of the layouts below."""
        E = self.num_experts
        chunks = (num_slots + CHUNK - 1) // CHUNK
        per_peer = cute.make_layout((num_slots, num_peers), stride=(1, num_slots))
        mIds = cute.make_tensor(ids, per_peer)
        mRank = cute.make_tensor(rank_in_chunk, per_peer)
        mChunkCounts = cute.make_tensor(
            chunk_counts, cute.make_layout((E + 1, chunks, num_peers),
                                           stride=(1, E + 1, (E + 1) * chunks)))
        mRowToken = cute.make_tensor(row_token, cute.make_layout(capacity))
        mRowK = cute.make_tensor(row_k, cute.make_layout(capacity))
        mRowPeer = cute.make_tensor(row_peer, cute.make_layout(capacity))
        mSlotRows = cute.make_tensor(slot_rows, cute.make_layout(num_slots))
        mCounts = cute.make_tensor(expert_counts, cute.make_layout(E))
        mOffsets = cute.make_tensor(expert_offsets, cute.make_layout(E + 1))
        mTileExpert = cute.make_tensor(tile_expert, cute.make_layout(capacity // self.tile_m))
        mNumTiles = cute.make_tensor(num_tiles, cute.make_layout(1))
        self.count_kernel(mIds, mRank, mChunkCounts, first_rank, num_slots).launch(
            grid=[chunks, num_peers, num_built], block=[THREADS, 1, 1], stream=stream)
        self.place_kernel(mIds, mRank, mChunkCounts, mRowToken, mRowK, mRowPeer, mSlotRows,
                          mCounts, mOffsets, mTileExpert, mNumTiles, first_rank, num_slots, top_k,
                          capacity).launch(grid=[chunks, num_peers, num_built],
                                           block=[THREADS, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def _of_built(self, t: cute.Tensor, built: Int32) -> cute.Tensor:
        """Rank ``built``'s array of a stacked argument (64-bit offset: R ranks of R*T*K)."""
        return cute.make_tensor(t.iterator + Int64(built) * Int64(cute.size(t)), t.layout)

    def _this_block(self, first_rank: Int32, *stacked):
        """(chunk, peer, rank) of this CTA, and its rank's array of each stacked argument
        (grid z = the rank built). Traced inline (a plain method: rebound tensors cannot leave
        a ``cute.jit`` function)."""
        chunk, peer, built = cute.arch.block_idx()
        return chunk, peer, first_rank + built, [self._of_built(t, built) for t in stacked]

    @cute.jit
    def _expert_of(self, mIds: cute.Tensor, slot: Int32, peer: Int32, rank: Int32,
                   num_slots: Int32) -> Int32:
        """Local expert (of ``rank``) of ``peer``'s ``slot``; E ("not routed here") for an id
        outside this rank's experts or a slot past the end."""
        E = self.num_experts
        expert = Int32(E)
        if slot < num_slots:
            if const_expr(self.ids_int64):
                local = Int64(mIds[slot, peer]) - Int64(rank) * Int64(E)
                if local >= Int64(0) and local < Int64(E):
                    expert = Int32(local)
            else:
                local32 = Int32(mIds[slot, peer]) - rank * E
                if local32 >= 0 and local32 < E:
                    expert = local32
        return expert

    # ------------------------------------------------------------------ kernel 1: count
    @cute.kernel
    def count_kernel(self, mIds: cute.Tensor, mRank: cute.Tensor, mChunkCounts: cute.Tensor,
                     first_rank: Int32, num_slots: Int32):
        E = self.num_experts
        tidx, _, _ = cute.arch.thread_idx()
        chunk, peer, rank, (mRank, mChunkCounts) = self._this_block(first_rank, mRank, mChunkCounts)
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
            expert = self._expert_of(mIds, slot, peer, rank, num_slots)
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
                mRank[slot, peer] = earlier + Int32(below)
            cute.arch.sync_threads()
            if leader:
                warp_counts[warp, expert] = 0
                if later == 0:  # the last warp of this round with this expert carries the count on
                    running[expert] = earlier + Int32(in_warp)
            cute.arch.sync_threads()
        for e in cutlass.range(tidx, E + 1, THREADS, unroll=1):
            mChunkCounts[e, chunk, peer] = running[e]

    # ------------------------------------------------------------------ kernel 2: place
    @cute.kernel
    def place_kernel(self, mIds: cute.Tensor, mRank: cute.Tensor, mChunkCounts: cute.Tensor,
                     mRowToken: cute.Tensor, mRowK: cute.Tensor, mRowPeer: cute.Tensor,
                     mSlotRows: cute.Tensor, mCounts: cute.Tensor, mOffsets: cute.Tensor,
                     mTileExpert: cute.Tensor, mNumTiles: cute.Tensor, first_rank: Int32,
                     num_slots: Int32, top_k: Int32, capacity: Int32):
        E = self.num_experts
        tile_m = self.tile_m
        tidx, _, _ = cute.arch.thread_idx()
        chunk, peer, rank, stacked = self._this_block(
            first_rank, mRank, mChunkCounts, mRowToken, mRowK, mRowPeer, mSlotRows, mCounts,
            mOffsets, mTileExpert, mNumTiles)
        (mRank, mChunkCounts, mRowToken, mRowK, mRowPeer, mSlotRows, mCounts, mOffsets,
         mTileExpert, mNumTiles) = stacked
        chunks, num_peers, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        smem = cutlass.utils.SmemAllocator()
        peer_rows = smem.allocate_tensor(Int32, cute.make_layout(MAX_PEER_EXPERTS), 16)  # n[q, e] at q * E + e
        total = smem.allocate_tensor(Int32, cute.make_layout(E + 1), 16)  # rows per expert
        base = smem.allocate_tensor(Int32, cute.make_layout(E + 1), 16)  # this peer's rows in earlier chunks
        offsets = smem.allocate_tensor(Int32, cute.make_layout(E + 1), 16)  # padded segment starts
        partial = smem.allocate_tensor(Int32, cute.make_layout(THREADS), 16)

        # 1. n[q, e] (rows of peer q for expert e) and this chunk's base, from the chunk counts
        for i in cutlass.range(tidx, num_peers * E, THREADS, unroll=1):
            q = i // E
            e = i - q * E
            before = Int32(0)
            after = Int32(0)
            for c in cutlass.range(chunks, unroll=1):
                n = mChunkCounts[e, c, q]
                if c < chunk:
                    before += n
                else:
                    after += n
            peer_rows[i] = before + after
            if q == peer:
                base[e] = before
        cute.arch.sync_threads()
        for e in cutlass.range(tidx, E, THREADS, unroll=1):
            rows = Int32(0)
            for q in cutlass.range(num_peers, unroll=1):
                rows += peer_rows[q * E + e]
            total[e] = rows

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

        # 3. this chunk's slots -> their rows: rank j among this peer's rows of the expert,
        #    then the (j, peer) order inside the segment
        first = chunk * CHUNK
        for i in cutlass.range(tidx, CHUNK, THREADS, unroll=1):
            slot = first + i
            if slot < num_slots:
                expert = self._expert_of(mIds, slot, peer, rank, num_slots)
                row = Int32(-1)
                if expert < E:
                    j = base[expert] + mRank[slot, peer]
                    row = offsets[expert]
                    for q in cutlass.range(num_peers, unroll=1):
                        n = peer_rows[q * E + expert]
                        row += cutlass.min(n, j)
                        if q < peer and n > j:
                            row += 1
                    mRowToken[row] = slot // top_k
                    mRowK[row] = slot % top_k
                    mRowPeer[row] = peer
                if peer == rank:
                    mSlotRows[slot] = row

        # 4. (peer-0 CTAs) padding rows: each CTA the tail rows of the experts e = chunk
        #    (mod chunks), and a share of the rows past the last segment
        if peer == 0:
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

            # 5. the tile table: expert of each M-tile (binary search of the offsets), -1 past
            #    the end
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

            # 6. counts, offsets and the tile count (CTA (0, 0))
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
    return cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=dtype.width // 8)


def compile_schedule_build(arch: str = "sm_90a", *, options: str = "", num_experts: int = 32,
                           tile_m: int = 128, ids_int64: bool = True):
    """Compile ``ScheduleBuild`` for ``arch`` without a GPU or tensors."""
    op = ScheduleBuild(num_experts, tile_m, ids_int64)
    ids = _placeholder_ptr(Int64 if ids_int64 else Int32)
    i32 = [_placeholder_ptr(Int32) for _ in range(10)]
    return cute.compile(op, ids, *i32, Int32(1), Int32(0), Int32(1), Int32(1), Int32(1), Int32(1),
                        cute.runtime.make_fake_stream(), options=jit.compile_options(arch, options))


def supports(num_ranks: int, num_local_experts: int) -> bool:
    """Whether the kernels' shared-memory tables hold this many (peers x) local experts."""
    return num_local_experts <= MAX_EXPERTS and num_ranks * num_local_experts <= MAX_PEER_EXPERTS


def build_schedules(topk_idx_all: torch.Tensor, num_local_experts: int, tile_m: int,
                    capacity: int, *, first_rank: int = 0, count: int | None = None,
                    poison: int | None = None) -> dict:
    """The fields of the ``mok_cute.schedule.ReceiveSchedules`` of ranks ``first_rank`` ..
    ``+ count - 1`` (default: every rank from ``first_rank`` on) from every peer's routing
    ``topk_idx_all [R, T, K]`` (global expert ids, int32 or int64, CUDA), all built by the same
    two launches, each tensor with a leading rank dim. ``capacity`` is
    ``schedule.schedule_capacity(R, T, K, num_local_experts, tile_m)``. Each rank's slice
    equals ``schedule.build_receive_schedule(..., gpu_build=False)``, and ``slot_rows`` holds
    each rank's own slots (``schedule.row_of_slot`` of that peer). ``poison`` (tests): fill
    every output with this value first, so an element the kernels failed to write shows."""
    from mok_cute.config import check_int, check_tensor

    check_tensor("topk_idx_all", topk_idx_all, shape=("R", "T", "K"),
                 dtype=(torch.int32, torch.int64), contiguous=False)
    R, T, K = topk_idx_all.shape
    check_int("first_rank", first_rank, min_value=0, max_value=R - 1)
    if count is None:
        count = R - first_rank
    check_int("count", count, min_value=1, max_value=R - first_rank)
    check_int("num_local_experts", num_local_experts, min_value=1)
    if not supports(R, num_local_experts):
        raise ValueError(f"num_local_experts: the kernels hold at most {MAX_EXPERTS} local experts "
                         f"and {MAX_PEER_EXPERTS} (peers x experts), got {num_local_experts} with {R} peers")
    if topk_idx_all.device.type != "cuda":
        raise ValueError(f"topk_idx_all: expected a CUDA tensor, got one on {topk_idx_all.device}")
    num_slots = T * K
    if num_slots >= 2**31 - CHUNK or R * T * K + num_local_experts * tile_m >= 2**31:
        raise ValueError(f"topk_idx_all: R*T*K must be below 2**31, got {R * num_slots}")
    E = num_local_experts
    device = topk_idx_all.device
    ids = topk_idx_all.contiguous()
    i32 = dict(dtype=torch.int32, device=device)
    row_token = torch.empty(count, capacity, **i32)
    row_k = torch.empty(count, capacity, **i32)
    row_peer = torch.empty(count, capacity, **i32)
    slot_rows = torch.empty(count, num_slots, **i32)
    counts = torch.empty(count, E, **i32)
    offsets = torch.empty(count, E + 1, **i32)
    tile_expert = torch.empty(count, capacity // tile_m, **i32)
    num_tiles = torch.empty(count, **i32)
    if poison is not None:
        for t in (row_token, row_k, row_peer, slot_rows, counts, offsets, tile_expert, num_tiles):
            t.fill_(poison)
    if num_slots == 0:  # no launch: every row is padding, every segment empty
        for t in (row_token, row_k, row_peer, tile_expert):
            t.fill_(-1)
        for t in (counts, offsets, num_tiles):
            t.zero_()
    else:
        rank_in_chunk = torch.empty(count * R * num_slots, **i32)
        chunk_counts = torch.empty(count * R * num_chunks(num_slots) * (E + 1), **i32)
        compiled = jit.compile_kernel("schedule_build", arch=jit.device_arch(device),
                                      num_experts=E, tile_m=tile_m,
                                      ids_int64=ids.dtype == torch.int64)
        ptr = lambda t, dt: cute.runtime.make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem,  # noqa: E731
                                                  assumed_align=dt.width // 8)
        compiled(ptr(ids, Int64 if ids.dtype == torch.int64 else Int32),
                 *(ptr(t, Int32) for t in (rank_in_chunk, chunk_counts, row_token, row_k, row_peer,
                                           slot_rows, counts, offsets, tile_expert, num_tiles)),
                 Int32(R), Int32(first_rank), Int32(count), Int32(num_slots), Int32(K),
                 Int32(capacity), cuda_driver.CUstream(torch.cuda.current_stream(device).cuda_stream))
    return dict(
        first_rank=first_rank, num_ranks=R, num_local_experts=E, tile_m=tile_m, capacity=capacity,
        row_peer=row_peer, row_token=row_token, row_k=row_k, expert_counts=counts,
        expert_offsets=offsets, tile_expert=tile_expert, num_tiles=num_tiles, slot_rows=slot_rows)
