"""The MoK megakernel for Hopper (sm_90a): one persistent launch per MoE layer call.

    comm CTAs     DISPATCH (pull x rows from their owner's symmetric buffer into the ring)
                  COMBINE  (push y rows to the source rank's combine buffer, slot token*K+k)
                  BARRIER  (after this rank's last combine: a unicast flag to every peer)
    compute CTAs  SHARED_FC1 / FC1  (gate+up GEMM, SwiGLU epilogue -> h)
                  SHARED_FC2 / FC2  (down GEMM, store epilogue -> y)
                  KSUM     (out[t] = bf16(shared[t] + sum_k w[t,k] * combine[t*K+k]), fixed k order)

The work is the ordered task list of ``mok_cute.tasks`` (its docstring defines the task
rows, counters and waits); this kernel is its executor. CTA ``b < num_comm_ctas`` walks the
COMM queue, the others the COMPUTE queue (with ``num_comm_ctas = 0``, one rank reading its own
rows in place, every CTA computes and runs the BARRIER as a compute task). Comm CTAs take tickets from a counter; compute CTAs
either from a counter too (``dynamic_tickets``: the producer's lane 0 takes them, one ahead,
and hands them to the other warps through an smem ring; with ``decoded_tickets`` the ring
carries the resolved task's words instead, so no other warp reads the task list; with
``strided_tickets`` lane 0 takes them by the static stride instead of the counter) or with a
static stride. With
``R`` virtual ranks in one launch (``comm.virtual``), ticket ``q`` is task position
``q // R`` of rank ``q % R``: every rank's list is built from the same static capacity, so
their positions line up and every wait still points to a lower (position, rank) ticket.
With the IPC backend ``R = 1`` and the peers are other processes' launches.

Why it cannot deadlock: every CTA is resident (cooperative launch, one CTA per SM), each
takes its tickets in increasing order, and every wait points to a lower ticket. The lowest
unfinished ticket therefore waits on nothing unfinished and its CTA is running it. The only
cross-rank waits are KSUM's (every peer's BARRIER flag), which are lower tickets too.

Inside a compute CTA the roles are those of ``gemm_sm90.GroupedGemmSm90``: warp 0 waits on a
task's counters, then TMA-loads A and B into a 4-stage mbarrier ring; two consumer
warpgroups run wgmma and the task's epilogue through smem and TMA stores. A GEMM task
publishes its counter after its TMA stores have completed (``cp.async.bulk.wait_group 0``).
KSUM runs on the consumer warps. The FC1 stage (A 128x64, gate 128x64, up 128x64) and the FC2
stage (A 128x64, W_down 256x64) have the same byte count, so one ring serves both.

Ordering rules (docs/megakernel_plan.md): a reader of rows another CTA wrote acquires the
counter, and a TMA reader then issues ``fence.proxy.async.global``; a TMA writer waits for
its stores, fences the async proxy, then publishes with release. Every wait is bounded: the
first timeout writes (task, peer) into the error word and ends all other waits; the host
raises ``PeerTimeoutError``.

Cross-rank flags (the symmetric ``barrier_flags[R]`` of every rank; flag ``s`` is written
only by rank ``s``, so it only grows): at launch start rank ``s`` stores ``2*epoch - 1``
into every peer's flag ``s`` ("my x is ready and my previous call is over"), and its BARRIER
stores ``2*epoch`` ("my combines into you are done"). DISPATCH from peer p and COMBINE into
peer p wait for flag p >= 2*epoch - 1; KSUM waits for every flag >= 2*epoch. No counter
that a peer writes ever needs a reset, and no NVLink multicast is used.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

from mok_cute import jit
from mok_cute.kernels import common
from mok_cute.kernels.comm_sm90 import VEC_ELEMS, bf16_row, copy_row, copy_rows_flat
from mok_cute.kernels.gemm_sm90 import (TILE_K, TILE_M, GroupedGemmSm90, TileEpilogue,
                                       a_visible_to_wgmma, cp_async_a_rows, gathered_rows_of,
                                       store_pipeline_stages, store_tile_epilogue)
from mok_cute.kernels.token_ops import MAX_K as MAX_K_SUM, k_sum_unroll, k_sum_vector
from mok_cute.tasks import CounterGroup, TASK_WORDS
from mok_cute.timeline import Role, TaskType

# Task row words (mok_cute.tasks.encode).
W_TYPE, W_ROLE, W_MINIBATCH, W_MTILE, W_MTILE_END, W_NTILE = 0, 1, 2, 3, 4, 5
W_ROW_BEGIN, W_ROW_END, W_RING_ROW, W_SIGNAL_GROUP, W_SIGNAL_INDEX, W_NUM_WAITS = 6, 7, 8, 9, 10, 11
W_WAITS = 12

# Output columns of a GEMM task, FC1 and FC2 alike (FC1: half gate, half up columns -> half as
# many h columns): cooperative tasks 256 wide, pingpong ones 128 (megakernel.task_tile_n)
TASK_TILE_N = 256
PINGPONG_TILE_N = 128
MAX_ROW_SLOTS = 32  # comm rows staged in smem at once (bounded by the 128 KB B-stage region)
STORES_IN_FLIGHT = 4  # row stores whose smem may still be unread when a slot is reloaded
COMM_THREADS = 384  # comm CTA threads (the first TILE_M resolve one row address each)
PRODUCER_THREADS = 128  # local_direct: the producer warpgroup, each thread one arrival per stage
COPY_UNROLL = 16  # 16-byte vectors in flight per lane in the vector row copy
COPY_MODES = ("vector", "bulk")
WAIT_RECORD_MIN_NS = 1000  # shorter dependency waits are not recorded as WAIT spans
# a GEMM task's wait for its first stage shorter than this is not recorded as a STAGE_WAIT span
# (the recorder's clock ticks every 32 ns on the H200)
STAGE_WAIT_RECORD_MIN_NS = 64
TICKETS = 2  # extra int32 words after the counters of rank 0: the comm / compute ticket counters
TICKET_SLOTS = 4  # dynamic_tickets: compute tickets in flight from the producer to the other warps
# decoded_tickets: the words of one ticket-ring slot, written by the producer's warp 0
D_INDEX, D_RANK, D_TYPE, D_MTILE, D_NTILE, D_RING_TILE, D_EXPERT, D_SIGNAL = range(8)
DECODED_WORDS = 8
# short_task_start: two more words per slot, the task's first row and its count of waits
D_ROW_BEGIN, D_NUM_WAITS = 8, 9
SHORT_START_WORDS = 10
RUN_FLAG, NOOP_FLAG = 1 << 8, 1 << 9  # or-ed into D_TYPE above the task type
# _is_gemm tells a compute task's kind by one compare: the GEMM types sit below KSUM and BARRIER
assert max(TaskType.FC1, TaskType.FC2, TaskType.SHARED_FC1, TaskType.SHARED_FC2) < TaskType.KSUM \
    < TaskType.BARRIER


class MegakernelSm90:
    """One persistent launch: dispatch, expert GEMMs, combine, barrier and k-sum.

    :param num_ranks: virtual ranks in this launch (1 with the IPC backend).
    :param num_ctas: grid size (<= SMs; every CTA must be resident).
    :param num_comm_ctas: CTAs ``0 .. num_comm_ctas - 1`` run the comm queue; 0 at one rank
        whose list has no comm task (the BARRIER is then a compute task).
    :param top_k: K (the k-sum is unrolled over it).
    :param has_shared: the shared expert's tasks are in the list.
    :param scope: "gpu" (virtual ranks) or "sys" (peers on other GPUs) for flags and counters.
    :param timeline: record one span per task (``mok_cute.timeline`` format).
    """

    def __init__(self, num_ranks: int, num_ctas: int, num_comm_ctas: int, top_k: int,
                 has_shared: bool, scope: str = "gpu", timeline: bool = False,
                 copy: str = "vector", local_direct: bool = False, rank_blocks: bool = False,
                 dynamic_tickets: bool = False, ksum_vectors: int = 8, copy_vectors: int = 0,
                 decoded_tickets: bool = False, store_warp_signals: bool = False,
                 ksum_staged: bool = False, pingpong: bool = False,
                 one_epilogue_barrier: bool = False, short_task_start: bool = False,
                 fence_fc1_only: bool = False, warp0_tma_stages: bool = False,
                 defer_signals: bool = False, release_only_publish: bool = False,
                 epi_n: int = 32, defer_flush_ktiles: int = 1, strided_tickets: bool = False):
        if not 0 <= num_comm_ctas < num_ctas:
            raise ValueError(f"num_comm_ctas must be in [0, num_ctas={num_ctas}), got {num_comm_ctas}")
        # num_comm_ctas = 0: one rank whose list has no comm task and whose BARRIER is a compute
        # task (tasks.build_task_list's barrier_in_compute); the compute loop then runs it, and
        # no CTA stores a start flag (at one rank only the rank's own k-sum reads its flag, for
        # the 2*epoch its BARRIER stores)
        if num_comm_ctas == 0 and (num_ranks != 1 or pingpong):
            raise ValueError("num_comm_ctas=0 needs num_ranks=1 and the cooperative loop "
                             f"(pingpong=False), got num_ranks={num_ranks}, pingpong={pingpong}")
        if not 1 <= top_k <= MAX_K_SUM:
            raise ValueError(f"top_k must be in [1, {MAX_K_SUM}], got {top_k}")
        if scope not in ("gpu", "sys"):
            raise ValueError(f"scope must be 'gpu' or 'sys', got {scope!r}")
        if copy not in COPY_MODES:
            raise ValueError(f"copy must be one of {COPY_MODES}, got {copy!r}")
        # How comm CTAs move rows: "vector" = every warp copies rows with 16-byte loads and
        # stores, COPY_UNROLL in flight per lane; "bulk" = one thread issues cp.async.bulk
        # copies through smem staging slots.
        self.copy = copy
        # copy_vectors (vector copy): 0 = a warp per row (copy_row); N > 0 = the task's rows as
        # one flat run of vectors, N in flight per lane (comm_sm90.copy_rows_flat). Why: a comm
        # CTA moved ~22 GB/s at virtual R = 8 (run 58), about what 12 warps with one 8 KB row
        # each in flight give at a few microseconds of loaded latency; more bytes in flight per
        # CTA would let fewer comm CTAs keep up and give SMs back to the GEMMs.
        if copy_vectors and copy != "vector":
            raise ValueError("copy_vectors needs copy='vector'")
        if not 0 <= copy_vectors <= 64:
            raise ValueError(f"copy_vectors must be in [0, 64], got {copy_vectors}")
        self.copy_vectors = copy_vectors
        # local_direct: rows a rank routes to its own experts are never copied. FC1's producer
        # warpgroup reads them from the rank's x with cp.async (dispatch skips them), and the
        # k-sum reads their y from the ring through `slot_rows` (combine skips them). Needs a
        # ring that never wraps (the host's promise) and the vector copy (skipped rows break
        # the bulk copy's row prefix).
        if local_direct and copy != "vector":
            raise ValueError("local_direct needs copy='vector'")
        self.local_direct = local_direct
        # KSUM: 16-B vectors in flight per consumer lane (k_sum_unroll). One CTA per SM runs it
        # with 8 warps, so the k-sum is latency-bound unless each lane keeps many loads in
        # flight; the consumers hold 224 registers, more than the standalone kernel's ~100.
        self.ksum_vectors = ksum_vectors
        # rank_blocks (virtual ranks): tickets walk the task list block by block (a block per
        # minibatch), every rank's share of a block in turn, instead of alternating ranks task
        # by task, so concurrent tiles share one rank's weights in L2 (tasks.ticket_blocks).
        self.rank_blocks = rank_blocks
        # dynamic_tickets: a compute CTA takes its next ticket from a counter when its producer
        # is ready for it, instead of the static stride compute_cta + k * compute CTAs. With the
        # stride, each CTA's share of a block mixes long FC1 and short FC2 tiles differently and
        # nothing resynchronises the CTAs once no task waits on the previous wave (the FC1
        # lead): they drift apart until tiles of many ranks and minibatches run at once and
        # stop sharing weight tiles in L2 (dsv4_pro at virtual R = 8: one minibatch's FC1 tiles
        # started over 2.6 ms instead of 0.19, each 47 % slower). The producer's lane 0 takes
        # the ticket and hands it to the other warps through a small smem ring.
        self.dynamic_tickets = dynamic_tickets
        # decoded_tickets (with dynamic_tickets): the producer's warp 0 resolves each ticket
        # (queue entry, task row, live-tile count, expert, signal counter) and puts the words
        # into the ring slot instead of the bare ticket. Why: the consumers otherwise make two
        # or three dependent global loads per task between a tile's signal and the next
        # mainloop, while the tensor cores wait (mixtral at one rank: 17.5 us per ms per CTA
        # between tasks against 2.2 in the expert GEMM; docs/perf_notes.md). A reader holds its
        # slot until it takes the next one, and reads the words where it read the task row.
        if decoded_tickets and not dynamic_tickets:
            raise ValueError("decoded_tickets needs dynamic_tickets")
        self.decoded_tickets = decoded_tickets
        # strided_tickets (with dynamic_tickets): the producer's lane 0 still hands its
        # tickets to the other warps through the ring (decoded, with the short start and the
        # deferred publish where they are on), but takes them by the static stride
        # (compute_cta, + compute CTAs each time) instead of from the counter. Why: CTAs on a
        # stride start the tiles that share a weight box together and walk K in step, as the
        # expert GEMMs do, and the GPU merges their requests for the same sectors before the
        # L2. Under dynamic tickets mixtral's megakernel reads 57.1 GB at L2 against the expert
        # path's 38.9 for the same tiles, 45.4 with the bare static stride (eighteenth session,
        # Nsight Compute), and at the 700 W cap L2 bytes cost clock.
        if strided_tickets and not dynamic_tickets:
            raise ValueError("strided_tickets needs dynamic_tickets (the ticket ring)")
        self.strided_tickets = strided_tickets
        # store_warp_signals: after a GEMM task only the store warp, whose lane issued the
        # tile's TMA stores, waits for them to land; its lane 0 then publishes the task's
        # counter. The other seven consumer warps go on to the next task without the CTA-wide
        # epilogue barrier, so the second warpgroup's next mainloop overlaps that wait. Why:
        # the recorded calls (run 87) still spend 12.9 (mixtral) to 32 (qwen3) us per ms per CTA
        # between tasks, most of it this wait, the fence and the publish. The epilogue's smem
        # buffers need no barrier here: the store warp frees each buffer (store_pipeline
        # acquire) before the subtile barrier that every warp passes later. KSUM keeps it.
        self.store_warp_signals = store_warp_signals
        # ksum_staged: a KSUM lane lands its y vectors in smem with cp.async (the B stages,
        # idle once a CTA's tickets reach the KSUMs: they are every rank's queue tail, and
        # both ticket walks hand out the tail after every live GEMM position of every rank)
        # and sums them from there, instead of holding the loads in registers. Why: the k-sum
        # at the end of a one-rank call is latency-bound on 8 warps per SM (mixtral, run 56:
        # 0.11 ms where the expert path's k-sum kernel takes 0.07), and 32 vectors per lane in
        # registers spill; smem holds ksum_stage_vectors (32) per lane, twice the register
        # path's 16.
        self.ksum_staged = ksum_staged
        # pingpong: the two consumer warpgroups take alternate compute tickets, each running a
        # whole 128 x 128 task, and take turns at the mainloop, so one warpgroup's epilogue,
        # signal and next-task lookup overlap the other's mainloop (the expert path's FC2
        # does this; docs/megakernel_plan.md, "a pingpong consumer loop"). Needs the decoded
        # ring (every warp reads every task's words from it) and 128-wide task lists.
        if pingpong and not decoded_tickets:
            raise ValueError("pingpong needs decoded_tickets")
        if pingpong and ksum_staged:
            # a KSUM may start while the other warpgroup's last wgmmas still read the stages
            raise ValueError("pingpong and ksum_staged do not combine")
        self.pingpong = pingpong
        # one_epilogue_barrier: one named barrier per epilogue subtile instead of two, the store
        # warp's buffer acquire one subtile ahead (gemm_sm90.store_tile_epilogue's one_barrier)
        self.one_epilogue_barrier = one_epilogue_barrier
        # short_task_start: the decoded ring also carries a task's first row and its count of
        # waits, loaded by warp 0 with the other task words, so the producer's start of a task
        # skips two dependent global loads: the wait count before the counter waits (none, for
        # FC1 at one rank) and the first row before FC1's A-row addresses. Why: an FC1 start
        # with gathered A is a chain of ~7 dependent global loads (ticket's queue entry, task
        # words, expert, wait count, first row, the rows' tokens, the rows themselves) against
        # ~4 stages of slack, and the megakernel's FC1 tiles run 2-6 % slower per tile than the
        # expert path's (run 96), more where FC1 has few k-tiles (gptoss).
        if short_task_start and not decoded_tickets:
            raise ValueError("short_task_start needs decoded_tickets")
        self.short_task_start = short_task_start
        # fence_fc1_only (local_direct): the consumers' proxy fence after a stage's wait only
        # on FC1 tasks, whose A rows the producer warps gather by cp.async; FC2's and the
        # shared expert's stages arrive by TMA alone. Why: that fence (MEMBAR.ALL.CTA +
        # FENCE.VIEW.ASYNC.S per k-tile) is the one difference between this kernel's SASS
        # k-loop and the expert FC1's, and it ran on every GEMM task
        self.fence_fc1_only = fence_fc1_only
        # warp0_tma_stages (local_direct): a TMA-only stage (FC2's, the shared expert's) is
        # filled by the load warp alone, which also arrives for the other 127 producer threads
        # (one arrival of count 128); warps 1-3 skip those tasks' stages instead of waiting on
        # every empty barrier to arrive once each. Why: the H200 runs both paths at its 700 W
        # cap, and mixtral's megakernel at a ~3 % lower SM clock than the expert path, whose
        # producer is one warp (fifteenth session, tools/clock_probe.py)
        self.warp0_tma_stages = warp0_tma_stages
        # defer_signals (one rank, no comm task, the cooperative loop with the decoded ring and
        # store-warp signals): an FC1 or FC2 task is published only once the CTA's next task
        # needs it out of the way: at that task's start if it may wait on it (an FC2 after an
        # FC1: FC2 waits on FC1's h; a KSUM or BARRIER on everything), else once its mainloop
        # has issued defer_flush_ktiles k-tiles (below: the stores have landed by then, and the
        # tensor cores have those k-tiles to work on), and at the end. Flushing after the whole
        # next mainloop measured slower (qwen3 +6.5 %, sixteenth session): other CTAs' FC2
        # tasks waited a whole FC1 mainloop on a held FC1 counter. At one rank FC1 waits on
        # nothing and FC2 only on FC1, so a held counter is published within defer_flush_ktiles
        # k-tiles of a task that waits on nothing it holds, or at once: nothing waits on a
        # signal its own CTA holds back. Why: the store warp's wait for a tile's TMA stores to
        # land, its fence and its publish hold its warpgroup's next mainloop; qwen3's FC2 tasks
        # (12 k-tiles) ran one every 10.98 us against ~9.7 for the expert path's cooperative
        # tiles (fifteenth session). The sixth session's DEFER_FC2_SIGNALS measured slower, in
        # a kernel whose wgmmas no test checked for serialisation (C7520 since the fourteenth)
        if defer_signals and not (num_ranks == 1 and decoded_tickets and store_warp_signals
                                  and not pingpong):
            raise ValueError("defer_signals needs one rank, decoded_tickets, store_warp_signals "
                             "and the cooperative loop")
        self.defer_signals = defer_signals
        # defer_flush_ktiles (defer_signals): a held publish goes out once the next mainloop has
        # issued this many k-tiles (or at its end, if it has fewer), not after its first. Why:
        # the store warp's wait for a tile's TMA stores to land (~2.1 us on qwen3, the SIGNAL
        # phase) holds its warpgroup's wgmmas, which need all four warps (the other
        # warpgroup runs on alone for at most the 4 loaded stages); after one k-tile most of
        # that wait is still ahead (measured level, sixteenth session), after the whole
        # mainloop other CTAs waited on the held counters (slower). A few k-tiles (~0.55 us
        # each) is about when the stores have landed anyway, so the publish is not later than
        # today's and the wait is short.
        if not 1 <= defer_flush_ktiles <= 64:
            raise ValueError(f"defer_flush_ktiles must be in [1, 64], got {defer_flush_ktiles}")
        if defer_flush_ktiles != 1 and not defer_signals:
            raise ValueError("defer_flush_ktiles needs defer_signals")
        self.defer_flush_ktiles = defer_flush_ktiles
        # release_only_publish: a compute task's counter is published by its release reduction
        # alone, without the fence.acq_rel before it. The release is that fence (cumulative:
        # it covers the writes of the threads synced with the publisher by the epilogue
        # barrier too), so each publish emitted two MEMBAR.ALL.GPU where one is needed. Why:
        # the store warp's SIGNAL phase (its wait for the stores, its fences and the publish)
        # is 2.0-2.2 us per GEMM task (sixteenth session, recorded), on its warpgroup's way to
        # the next mainloop
        self.release_only_publish = release_only_publish
        self.decoded_words = SHORT_START_WORDS if short_task_start else DECODED_WORDS
        self.num_ranks = num_ranks
        self.num_ctas = num_ctas
        self.num_comm_ctas = num_comm_ctas
        self.num_compute_ctas = num_ctas - num_comm_ctas
        self.top_k = top_k
        self.has_shared = has_shared
        self.scope = scope
        self.timeline = timeline
        # The GEMM roles and layouts are GroupedGemmSm90's (cooperative, 128 x 256 x 64).
        # one width for FC1 and FC2 tasks; FC1's gate and up halves are half of it
        self.tile_n = PINGPONG_TILE_N if pingpong else TASK_TILE_N
        # epi_n (cooperative loop): columns of an epilogue subtile, 64 for half as many
        # subtiles (ops.EPILOGUE_N says why)
        self.gemm = GroupedGemmSm90(tile_n=self.tile_n, epilogue="store", pingpong=pingpong,
                                    epi_n=epi_n)
        # setmaxnreg moves registers within the CTA's launch allocation (168 x 384 threads =
        # 40 x 128 + 232 x 256): an increase that the pool cannot cover waits forever. The
        # ticket ring's state spills the local_direct producer at 40, so with dynamic_tickets
        # the producer gets 48 and the consumers 224.
        self.producer_regs, self.consumer_regs = (
            (48, 224) if dynamic_tickets else (self.gemm.producer_regs, self.gemm.consumer_regs))
        assert self.producer_regs * 128 + self.consumer_regs * 256 <= 168 * 384
        self.tile_shape_mnk = self.gemm.tile_shape_mnk
        self.threads_per_cta = self.gemm.threads_per_cta
        self.num_warps = self.threads_per_cta // 32
        self.epi_tile = self.gemm.epi_tile
        self.epi_stages = self.gemm.epi_stages
        self.half_n = self.tile_n // 2

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, tasks: cute.Tensor, queues: cute.Tensor, queue_len: cute.Tensor,
                 queue_live_len: cute.Tensor, queue_blocks: cute.Tensor,
                 counter_offsets: cute.Tensor, counters: cute.Tensor, error: cute.Tensor,
                 num_tiles: cute.Tensor, tile_expert: cute.Tensor, row_peer: cute.Tensor,
                 row_token: cute.Tensor, row_k: cute.Tensor, peer_bases: cute.Tensor,
                 ring_x: cute.Tensor, ring_h: cute.Tensor, ring_y: cute.Tensor,
                 w_gate: cute.Tensor, w_up: cute.Tensor, w_down: cute.Tensor,
                 x_all: Optional[cute.Tensor], ws_gate: Optional[cute.Tensor],
                 ws_up: Optional[cute.Tensor], ws_down: Optional[cute.Tensor],
                 shared_h: Optional[cute.Tensor], shared_y: Optional[cute.Tensor],
                 topk_weights: cute.Tensor, topk_idx: cute.Tensor, slot_rows: cute.Tensor,
                 out: cute.Tensor, timeline_buf: Optional[cute.Tensor], scalars: cute.Tensor,
                 stream: cuda.CUstream):
        """Shapes (R ranks, P peers, E = R * E_loc experts, C ring rows, T tokens):
        tasks int32 (N, TASK_WORDS); queues int32 (2, Q); queue_len int32 (2,);
        queue_live_len int32 (2, MB + 1); queue_blocks int32 (2, MB + 1); counter_offsets
        int32 (G + 1,); counters int32 (R, num_counters), zero at launch; error int64 (1,);
        num_tiles int32 (R,); tile_expert int32 (R, tiles); row_peer / row_token / row_k
        int32 (R, capacity); peer_bases int64 (R, P); ring_x / ring_y bf16 (C, H, R);
        ring_h bf16 (C, I, R); w_gate / w_up (I, H, E); w_down (H, I, E); shared: x_all
        (T, H, R) (a view of the symmetric x), ws_gate / ws_up (Is, H, R), ws_down (H, Is, R),
        shared_h (T, Is, R), shared_y (T, H, R); topk_weights fp32 (R, T, K); topk_idx int32
        (R, T, K) (a (token, k) whose id is out of range contributes zero); slot_rows int32
        (R, T * K): the ring row of rank r's own slot (token, k) when its expert is r's, else
        -1 (read only with local_direct); out bf16
        (R, T, H); scalars int64 (10,): epoch, rank of the first virtual rank, tiles per
        minibatch, x / combine / flags byte offsets, timeout ns, local experts, static M-tiles,
        silent rank (a test hook: that virtual rank never announces its start, like a peer
        whose process died; -1 in normal use)."""
        self.a_dtype = BFloat16
        self.c_dtype = BFloat16
        self.gemm.a_dtype = self.gemm.b_dtype = self.gemm.c_dtype = BFloat16
        self.gemm._setup_attributes()
        g = self.gemm
        # ksum_staged: 16-B vectors per consumer lane in the B stages (8 consumer warps)
        self.ksum_stage_vectors = g.ab_stages * self.tile_n * TILE_K * 2 // (8 * 32 * 16)
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        a_box = cute.slice_(g.a_smem_layout_staged, (None, None, 0))
        half_box = (self.half_n, tile_k)
        half_layout = cute.slice_(g._staged_kmajor_layout(BFloat16, half_box, 1), (None, None, 0))
        full_layout = cute.slice_(g.b_smem_layout_staged, (None, None, 0))
        epi_layout = cute.slice_(g.epi_smem_layout_staged, (None, None, 0))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        s2g = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        mk = cute.nvgpu.cpasync.make_tiled_tma_atom
        # Routed FC1: A = ring x, B = gate / up halves, C = ring h. FC2: A = ring h, B = down.
        tma_a_x, t_a_x = mk(g2s, ring_x, a_box, (tile_m, tile_k))
        tma_a_h, t_a_h = mk(g2s, ring_h, a_box, (tile_m, tile_k))
        tma_wg, t_wg = mk(g2s, w_gate, half_layout, half_box)
        tma_wu, t_wu = mk(g2s, w_up, half_layout, half_box)
        tma_wd, t_wd = mk(g2s, w_down, full_layout, (tile_n, tile_k))
        tma_st_h, t_st_h = mk(s2g, ring_h, epi_layout, self.epi_tile)
        tma_st_y, t_st_y = mk(s2g, ring_y, epi_layout, self.epi_tile)
        shared_atoms = (None,) * 14
        if const_expr(self.has_shared):
            s_a_x = mk(g2s, x_all, a_box, (tile_m, tile_k))
            s_a_h = mk(g2s, shared_h, a_box, (tile_m, tile_k))
            s_wg = mk(g2s, ws_gate, half_layout, half_box)
            s_wu = mk(g2s, ws_up, half_layout, half_box)
            s_wd = mk(g2s, ws_down, full_layout, (tile_n, tile_k))
            s_st_h = mk(s2g, shared_h, epi_layout, self.epi_tile)
            s_st_y = mk(s2g, shared_y, epi_layout, self.epi_tile)
            shared_atoms = (*s_a_x, *s_a_h, *s_wg, *s_wu, *s_wd, *s_st_h, *s_st_y)

        ticket_words = TICKET_SLOTS * (self.decoded_words if const_expr(self.decoded_tickets) else 1)

        @cute.struct
        class SharedStorage:
            ab_full_empty: cute.struct.MemRange[cutlass.Int64, g.ab_stages * 2]
            row_full: cute.struct.MemRange[cutlass.Int64, MAX_ROW_SLOTS]
            row_src: cute.struct.MemRange[cutlass.Int64, TILE_M]
            row_dst: cute.struct.MemRange[cutlass.Int64, TILE_M]
            comm_words: cute.struct.MemRange[Int32, 4]
            ticket_q: cute.struct.MemRange[Int32, ticket_words]  # dynamic_tickets
            ticket_full_empty: cute.struct.MemRange[cutlass.Int64, 2 * TICKET_SLOTS]
            sA: cute.struct.Align[
                cute.struct.MemRange[BFloat16, cute.cosize(g.a_smem_layout_staged)],
                g.buffer_align_bytes]
            sB: cute.struct.Align[
                cute.struct.MemRange[BFloat16, cute.cosize(g.b_smem_layout_staged)],
                g.buffer_align_bytes]
            sC: cute.struct.Align[
                cute.struct.MemRange[BFloat16, cute.cosize(g.epi_smem_layout_staged)],
                g.buffer_align_bytes]

        self.shared_storage = SharedStorage
        self.kernel(
            tasks, queues, queue_len, queue_live_len, queue_blocks, counter_offsets,
            counters, error, num_tiles, tile_expert, row_peer, row_token, row_k, peer_bases,
            ring_x, ring_y, topk_weights, topk_idx, slot_rows, out, shared_y, timeline_buf,
            scalars,
            tma_a_x, t_a_x, tma_a_h, t_a_h, tma_wg, t_wg, tma_wu, t_wu, tma_wd, t_wd,
            tma_st_h, t_st_h, tma_st_y, t_st_y, *shared_atoms,
            g.tiled_mma, g.a_smem_layout_staged, g.b_smem_layout_staged, g.epi_smem_layout_staged,
        ).launch(grid=[self.num_ctas, 1, 1], block=[self.threads_per_cta, 1, 1],
                 min_blocks_per_mp=1, cooperative=True, stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tasks: cute.Tensor, queues: cute.Tensor, queue_len: cute.Tensor,
               queue_live_len: cute.Tensor, queue_blocks: cute.Tensor,
               counter_offsets: cute.Tensor, counters: cute.Tensor, error: cute.Tensor,
               num_tiles: cute.Tensor, tile_expert: cute.Tensor, row_peer: cute.Tensor,
               row_token: cute.Tensor, row_k: cute.Tensor, peer_bases: cute.Tensor,
               ring_x: cute.Tensor, ring_y: cute.Tensor, topk_weights: cute.Tensor,
               topk_idx: cute.Tensor, slot_rows: cute.Tensor, out: cute.Tensor,
               shared_y: Optional[cute.Tensor],
               timeline_buf: Optional[cute.Tensor], scalars: cute.Tensor,
               tma_a_x: cute.CopyAtom, t_a_x: cute.Tensor, tma_a_h: cute.CopyAtom, t_a_h: cute.Tensor,
               tma_wg: cute.CopyAtom, t_wg: cute.Tensor, tma_wu: cute.CopyAtom, t_wu: cute.Tensor,
               tma_wd: cute.CopyAtom, t_wd: cute.Tensor,
               tma_st_h: cute.CopyAtom, t_st_h: cute.Tensor, tma_st_y: cute.CopyAtom, t_st_y: cute.Tensor,
               s_tma_a_x: Optional[cute.CopyAtom], s_t_a_x: Optional[cute.Tensor],
               s_tma_a_h: Optional[cute.CopyAtom], s_t_a_h: Optional[cute.Tensor],
               s_tma_wg: Optional[cute.CopyAtom], s_t_wg: Optional[cute.Tensor],
               s_tma_wu: Optional[cute.CopyAtom], s_t_wu: Optional[cute.Tensor],
               s_tma_wd: Optional[cute.CopyAtom], s_t_wd: Optional[cute.Tensor],
               s_tma_st_h: Optional[cute.CopyAtom], s_t_st_h: Optional[cute.Tensor],
               s_tma_st_y: Optional[cute.CopyAtom], s_t_st_y: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma, a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        g = self.gemm
        ctx = _Context(scalars, cute.arch.globaltimer())

        if const_expr(self.timeline):
            if tidx == 0 and bidx == 0:
                common.timeline_mark_start(timeline_buf, common.timeline_now())

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tma_bytes = (cute.size_in_bytes(BFloat16, cute.slice_(a_smem_layout_staged, (None, None, 0)))
                     + cute.size_in_bytes(BFloat16, cute.slice_(b_smem_layout_staged, (None, None, 0))))
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_full_empty.data_ptr(), num_stages=g.ab_stages,
            # local_direct: FC1's A rows arrive by cp.async from the 128 producer threads
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 1 + (PRODUCER_THREADS if const_expr(self.local_direct) else 0)),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, g.threads_per_tile // 32),
            tx_count=tma_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        # dynamic_tickets: the ring's slots and its full / empty mbarriers
        ticket_q, ticket_bars = storage.ticket_q.data_ptr(), storage.ticket_full_empty.data_ptr()
        if const_expr(self.dynamic_tickets):
            if tidx == 0:
                # readers: the consumer warps, and the other three producer warps with direct rows
                ticket_ring_init(ticket_bars, g.num_mma_threads // 32
                                 + (3 if const_expr(self.local_direct) else 0))
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if bidx < self.num_comm_ctas:
            self._announce_start(ctx, peer_bases, tidx)
            if tidx < COMM_THREADS:
                self._comm_loop(ctx, tasks, queues, queue_len, queue_live_len, queue_blocks,
                                counter_offsets, counters, error, num_tiles, row_peer, row_token,
                                row_k, peer_bases, ring_x, ring_y, timeline_buf, storage, tidx)
        else:
            sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
            sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
            sC = storage.sC.get_tensor(epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner)
            warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
            compute_cta = bidx - self.num_comm_ctas
            if warpgroup_idx == 0:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if const_expr(self.local_direct):
                    # all four producer warps: they gather FC1's local A rows themselves
                    self._producer_loop(
                        ctx, tasks, queues, queue_len, queue_live_len, queue_blocks,
                        counter_offsets, counters, error, num_tiles, tile_expert, ab_pipeline,
                        sA, sB, tma_a_x, t_a_x, tma_a_h, t_a_h, tma_wg, t_wg, tma_wu, t_wu,
                        tma_wd, t_wd, s_tma_a_x, s_t_a_x, s_tma_a_h, s_t_a_h, s_tma_wg, s_t_wg,
                        s_tma_wu, s_t_wu, s_tma_wd, s_t_wd, compute_cta, ticket_q, ticket_bars,
                        timeline_buf, _DirectA(row_peer, row_token, peer_bases, ring_x,
                                 storage.sA.data_ptr(), tidx, warp_idx))
                elif warp_idx == g.load_warp:
                    for atom in (tma_a_x, tma_a_h, tma_wg, tma_wu, tma_wd):
                        cute.nvgpu.cpasync.prefetch_descriptor(atom)
                    self._producer_loop(
                        ctx, tasks, queues, queue_len, queue_live_len, queue_blocks,
                        counter_offsets, counters, error, num_tiles, tile_expert, ab_pipeline,
                        sA, sB, tma_a_x, t_a_x, tma_a_h, t_a_h, tma_wg, t_wg, tma_wu, t_wu,
                        tma_wd, t_wd, s_tma_a_x, s_t_a_x, s_tma_a_h, s_t_a_h, s_tma_wg, s_t_wg,
                        s_tma_wu, s_t_wu, s_tma_wd, s_t_wd, compute_cta, ticket_q, ticket_bars,
                        timeline_buf, None)
            elif const_expr(self.pingpong):
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self._pingpong_loop(
                    ctx, tasks, counter_offsets, counters, error, num_tiles, peer_bases,
                    topk_weights, topk_idx, slot_rows, ring_y, out, shared_y, timeline_buf,
                    ab_pipeline, tiled_mma, sA, sB, sC, tma_st_h, t_st_h, tma_st_y, t_st_y,
                    s_tma_st_h, s_t_st_h, s_tma_st_y, s_t_st_y, tidx, warp_idx, warpgroup_idx,
                    ticket_q, ticket_bars, storage.sB.data_ptr())
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self._consumer_loop(
                    ctx, tasks, queues, queue_len, queue_live_len, queue_blocks,
                    counter_offsets, counters, error, num_tiles, peer_bases, topk_weights,
                    topk_idx, slot_rows, ring_y, out, shared_y, timeline_buf, ab_pipeline,
                    tiled_mma, sA, sB, sC, tma_st_h, t_st_h, tma_st_y, t_st_y, s_tma_st_h,
                    s_t_st_h, s_tma_st_y, s_t_st_y, tidx, warp_idx, warpgroup_idx, compute_cta,
                    ticket_q, ticket_bars, storage.sB.data_ptr())

    # ------------------------------------------------------------------ task walking
    @cute.jit
    def _live_prefix(self, ctx, queue_live_len, num_tiles, role: cutlass.Constexpr[int]) -> Int32:
        """Queue positions below the largest live prefix of any rank are walked in order;
        past it the dead middle of every rank's queue is jumped over (read once per CTA:
        the tile counts do not change during the launch)."""
        live_prefix = Int32(0)
        for r in cutlass.range(self.num_ranks, unroll=1):
            live = ctx.live_minibatches(num_tiles[r])
            live_prefix = cutlass.max(live_prefix, queue_live_len[role, live])
        return live_prefix

    @cute.jit
    def _block(self, queue_blocks, queue_len, live_prefix: Int32, role: cutlass.Constexpr[int],
               blk: Int32):
        """(first queue position, size) of ticket block ``blk``: a minibatch's block clipped to
        the live prefix, or (the last) the tail."""
        tail_blk = cute.size(queue_blocks, mode=[1]) - 1
        start = queue_blocks[role, tail_blk]
        size = queue_len[role] - start
        if blk < tail_blk:
            start = queue_blocks[role, blk]
            size = cutlass.max(cutlass.min(queue_blocks[role, blk + 1], live_prefix) - start, 0)
        return start, size

    @cute.jit
    def _ticket(self, queues, queue_len, queue_blocks, live_prefix: Int32,
                role: cutlass.Constexpr[int], q: Int32, blk: Int32, q_base: Int32):
        """Ticket -> (list index, or -1 once the role's queue is exhausted; rank; the CTA's
        block cursor (block, its first ticket), carried to its next, larger ticket).
        Alternating: queue position q // R of rank q % R, past the live prefix the tail.
        ``rank_blocks``: R * size tickets per block, rank-major (``megakernel.ticket_position``
        is the Python model)."""
        R = self.num_ranks
        pos = q // R
        rank = q % R
        if const_expr(self.rank_blocks):
            last_blk = cute.size(queue_blocks, mode=[1]) - 1
            never = Int32(0x7FFFFFFF)  # past the tail block: no ticket ends it
            start, size = self._block(queue_blocks, queue_len, live_prefix, role, blk)
            end = cutlass.select_(blk <= last_blk, q_base + R * size, never)
            while q >= end:
                q_base = end
                blk += 1
                start, size = self._block(queue_blocks, queue_len, live_prefix, role, blk)
                end = cutlass.select_(blk <= last_blk, q_base + R * size, never)
            pos = queue_len[role]  # exhausted
            rank = Int32(0)
            if blk <= last_blk:
                off = q - q_base
                rank = off // size
                pos = start + off % size
        else:
            if pos >= live_prefix:
                pos = queue_blocks[role, cute.size(queue_blocks, mode=[1]) - 1] + (pos - live_prefix)
        index = Int32(-1)
        if pos < queue_len[role]:
            index = queues[role, pos]
        return index, rank, blk, q_base

    @cute.jit
    def _task_state(self, ctx, tasks, num_tiles, index: Int32, rank: Int32):
        """(run, noop) of a task on ``rank``: a dead minibatch is skipped (run False);
        a tile past the live count signals without work (noop True)."""
        minibatch = tasks[index, W_MINIBATCH]
        tiles = num_tiles[rank]
        run = minibatch < ctx.live_minibatches(tiles)
        noop = minibatch >= 0 and tasks[index, W_MTILE] >= tiles
        return run, noop

    @cute.jit
    def _wait_task(self, ctx, tasks, counter_offsets, counters, error, num_tiles,
                   index: Int32, rank: Int32, num_waits=None, lane=None, lanes=None):
        """Spin until every wait of the task holds (waits on tiles past the live ones are
        clipped away). Called by one thread or by a whole warp (each lane waits).
        ``num_waits``: the task's count of waits when the caller has it (short_task_start).
        ``lane`` / ``lanes``: ``lanes`` threads share each range, thread ``lane`` waiting for
        every ``lanes``-th counter (the caller then syncs them)."""
        tiles = num_tiles[rank]
        live_mb = ctx.live_minibatches(tiles)
        live_tile_end = cutlass.min(live_mb * ctx.tiles_per_minibatch, ctx.static_tiles)
        rank_counters = counters[rank, None]
        if const_expr(num_waits is None):
            num_waits = tasks[index, W_NUM_WAITS]
        for w in cutlass.range(num_waits, unroll=1):
            group = tasks[index, W_WAITS + 4 * w]
            first = tasks[index, W_WAITS + 4 * w + 1]
            end = first + tasks[index, W_WAITS + 4 * w + 2]
            target = tasks[index, W_WAITS + 4 * w + 3]
            if group == int(CounterGroup.DISPATCHED_MB):
                end = cutlass.min(end, live_mb)
            elif group <= int(CounterGroup.COMBINED):
                end = cutlass.min(end, live_tile_end)  # per-tile groups (0, 2, 3, 4)
            base = counter_offsets[group]
            step = 1
            if const_expr(lanes is not None):
                first, step = first + lane, lanes
            for i in cutlass.range(first, end, step, unroll=1):
                common.wait_counter(rank_counters, base + i, target, ctx.deadline, error,
                                    index, ctx.rank_base + rank, self.scope)

    @cute.jit
    def _wait_task_recorded(self, ctx, tasks, counter_offsets, counters, error, num_tiles,
                            index: Int32, rank: Int32, timeline_buf, role: cutlass.Constexpr[int],
                            leader, num_waits=None, lane=None, lanes=None):
        """``_wait_task``; with the recorder on, a wait longer than WAIT_RECORD_MIN_NS also
        becomes a WAIT span (written by ``leader``), so the timeline shows waits apart from work."""
        t0 = self._now_if_recording()
        self._wait_task(ctx, tasks, counter_offsets, counters, error, num_tiles, index, rank,
                        num_waits, lane, lanes)
        self._record_wait(ctx, timeline_buf, role, int(TaskType.WAIT), index, rank, t0, leader,
                          WAIT_RECORD_MIN_NS)

    @cute.jit
    def _record_wait(self, ctx, timeline_buf, role: cutlass.Constexpr[int],
                     task_type: cutlass.Constexpr[int], index: Int32, rank: Int32, t0: Int64,
                     leader, min_ns: cutlass.Constexpr[int]):
        """With the recorder on: a wait that began at ``t0`` (``_now_if_recording``) and ends
        now becomes a ``task_type`` span of task ``index``, written by ``leader``, when it lasted
        over ``min_ns``; nothing is emitted with the recorder off."""
        if const_expr(self.timeline):
            t1 = common.timeline_now()
            if leader and t1 - t0 > min_ns:
                slot = common.timeline_reserve(timeline_buf, 1)
                common.timeline_write(timeline_buf, slot, role, task_type, index,
                                      ctx.rank_base + rank, t0, t1)

    @cute.jit
    def _now_if_recording(self) -> Int64:
        """%globaltimer with the recorder on; nothing is emitted with it off."""
        t = Int64(0)
        if const_expr(self.timeline):
            t = common.timeline_now()
        return t

    @cute.jit
    def _signal_task(self, tasks, counter_offsets, counters, index: Int32, rank: Int32):
        """Release-publish the task's counter (caller has made its writes visible)."""
        group = tasks[index, W_SIGNAL_GROUP]
        slot = counter_offsets[group] + tasks[index, W_SIGNAL_INDEX]
        common.counter_publish(counters[rank, None], slot, 1, self.scope)

    @cute.jit
    def _flag_tensor(self, ctx, peer_bases, rank: Int32, peer: Int32):
        """The barrier_flags array inside peer ``peer``'s symmetric buffer (seen from rank)."""
        addr = peer_bases[rank, peer] + ctx.flags_offset
        return cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4),
                                cute.make_layout(cute.size(peer_bases, mode=[1])))

    @cute.jit
    def _store_flag(self, ctx, peer_bases, rank: Int32, peer: Int32, value: Int32):
        flags = self._flag_tensor(ctx, peer_bases, rank, peer)
        cute.arch.store((flags.iterator + (ctx.rank_base + rank)).llvm_ptr, value,
                        sem="release", scope=self.scope)

    @cute.jit
    def _wait_flag(self, ctx, peer_bases, error, rank: Int32, peer: Int32, target: Int32,
                   index: Int32):
        """Wait until ``peer`` has stored >= target into this rank's flag ``peer`` (a flag
        still below this launch's start value 2*epoch - 1 names a peer that never started)."""
        me = ctx.rank_base + rank
        own = self._flag_tensor(ctx, peer_bases, rank, me)
        common.wait_counter(own, peer, target, ctx.deadline, error, index, peer, self.scope,
                            2 * ctx.epoch - 1)

    @cute.jit
    def _announce_start(self, ctx, peer_bases, tidx: Int32):
        """Comm CTA 0: each rank's start flag (2*epoch - 1) into every peer's buffer."""
        if cute.arch.block_idx()[0] == 0:
            num_peers = cute.size(peer_bases, mode=[1])
            for i in cutlass.range(tidx, self.num_ranks * num_peers, self.threads_per_cta, unroll=1):
                rank = i // num_peers
                if rank != ctx.silent_rank:
                    self._store_flag(ctx, peer_bases, rank, i - rank * num_peers, 2 * ctx.epoch - 1)

    @cute.jit
    def _announce_done(self, ctx, peer_bases, rank: Int32):
        """The BARRIER's flag, after its waits: this rank's combines are all done, told to
        every peer (unicast flags, 2*epoch)."""
        self._fence()
        for p in cutlass.range(cute.size(peer_bases, mode=[1]), unroll=1):
            self._store_flag(ctx, peer_bases, rank, p, 2 * ctx.epoch)

    # ------------------------------------------------------------------ comm role
    @cute.jit
    def _comm_loop(self, ctx, tasks, queues, queue_len, queue_live_len, queue_blocks,
                   counter_offsets, counters, error, num_tiles, row_peer, row_token, row_k,
                   peer_bases, ring_x, ring_y, timeline_buf, storage, tidx):
        """``COMM_THREADS`` threads per comm CTA. Tickets come from an atomic counter (a CTA
        blocked on a COMBINE's wait holds no later task hostage). Per task, thread ``t``
        resolves the source and destination address of row ``t`` into smem; thread 0 then
        moves the rows with bulk copies through smem: ``cp.async.bulk`` global -> smem
        (completing on the slot's mbarrier), then smem -> global, many rows in flight (the
        staging area is the GEMM's B-stage region, unused by comm CTAs)."""
        hidden = cute.size(ring_x, mode=[1])
        row_bytes = hidden * 2
        staging_bytes = self.gemm.ab_stages * self.tile_n * TILE_K * 2  # the B stages
        slots = cutlass.min(MAX_ROW_SLOTS, staging_bytes // row_bytes)
        num_peers = cute.size(peer_bases, mode=[1])
        row_full = storage.row_full.data_ptr()
        staging = storage.sB.data_ptr()
        row_src = storage.row_src.get_tensor(cute.make_layout(TILE_M))
        row_dst = storage.row_dst.get_tensor(cute.make_layout(TILE_M))
        words = storage.comm_words.get_tensor(cute.make_layout(4))  # ticket, real rows
        sync = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.COMM),
                                     num_threads=COMM_THREADS)
        if tidx == 0:
            for i in cutlass.range(MAX_ROW_SLOTS, unroll=1):
                cute.arch.mbarrier_init(row_full + i, 1)
            cute.arch.mbarrier_init_fence()
        phases = Int32(0)  # bit s: parity the next wait on slot s expects (thread 0)
        peers_started = Int32(0)  # every peer's start flag seen (checked once per CTA)
        live_prefix = self._live_prefix(ctx, queue_live_len, num_tiles, int(Role.COMM))
        blk, q_base = Int32(0), Int32(0)  # ticket block cursor (rank_blocks)
        ticket_slot = cute.size(counters, mode=[1]) - TICKETS
        q = self._shared_ticket(counters, ticket_slot, words, sync, tidx)
        index, rank, blk, q_base = self._ticket(queues, queue_len, queue_blocks, live_prefix,
                                                   int(Role.COMM), q, blk, q_base)
        while index >= 0:
            run, noop = self._task_state(ctx, tasks, num_tiles, index, rank)
            if run:
                t_start = self._now_if_recording()
                ttype = tasks[index, W_TYPE]
                moves = not noop and ttype != int(TaskType.BARRIER)
                if tidx == 0:
                    self._wait_task_recorded(ctx, tasks, counter_offsets, counters, error,
                                             num_tiles, index, rank, timeline_buf,
                                             int(Role.COMM), True)
                    if ttype == int(TaskType.BARRIER):
                        self._announce_done(ctx, peer_bases, rank)
                    elif peers_started == 0:
                        # pulling from / pushing to a peer needs its start flag for this epoch
                        for r in cutlass.range(self.num_ranks, unroll=1):
                            for p in cutlass.range(num_peers, unroll=1):
                                self._wait_flag(ctx, peer_bases, error, r, p, 2 * ctx.epoch - 1, index)
                        peers_started = Int32(1)
                    words[1] = 0
                sync.arrive_and_wait()
                if moves:
                    self._resolve_row(ctx, tasks, index, rank, ttype, row_peer, row_token, row_k,
                                      peer_bases, ring_x, ring_y, row_bytes, row_src, row_dst,
                                      words, tidx)
                sync.arrive_and_wait()
                if const_expr(self.copy == "vector"):
                    if moves:
                        if const_expr(self.copy_vectors > 0):
                            copy_rows_flat(row_src, row_dst, words[1], hidden // VEC_ELEMS,
                                           tidx // 32, COMM_THREADS // 32, cute.arch.lane_idx(),
                                           self.copy_vectors)
                        else:
                            for r in cutlass.range(tidx // 32, words[1], COMM_THREADS // 32, unroll=1):
                                if row_src[r] != 0:  # 0: a local row left in the ring (local_direct)
                                    copy_row(bf16_row(row_src[r], hidden), bf16_row(row_dst[r], hidden),
                                             hidden // VEC_ELEMS, cute.arch.lane_idx(), COPY_UNROLL)
                    sync.arrive_and_wait()
                if tidx == 0:
                    if const_expr(self.copy == "bulk"):
                        if moves:
                            phases = self._move_rows(words[1], row_src, row_dst, row_full, staging,
                                                     slots, row_bytes, phases)
                    self._fence()
                    self._signal_task(tasks, counter_offsets, counters, index, rank)
                    if const_expr(self.timeline):
                        slot = common.timeline_reserve(timeline_buf, 1)
                        common.timeline_write(timeline_buf, slot, int(Role.COMM), ttype, index,
                                              ctx.rank_base + rank, t_start, common.timeline_now())
            q = self._shared_ticket(counters, ticket_slot, words, sync, tidx)
            index, rank, blk, q_base = self._ticket(queues, queue_len, queue_blocks, live_prefix,
                                                       int(Role.COMM), q, blk, q_base)

    @cute.jit
    def _shared_ticket(self, counters, slot: Int32, words, sync, tidx) -> Int32:
        """Thread 0 takes the next ticket; every comm thread of the CTA gets it."""
        if tidx == 0:
            words[0] = self._take_ticket(counters, slot)
        sync.arrive_and_wait()
        q = words[0]
        sync.arrive_and_wait()  # read before thread 0 may overwrite it
        return q

    @cute.jit
    def _resolve_row(self, ctx, tasks, index, rank, ttype, row_peer, row_token, row_k,
                     peer_bases, ring_x, ring_y, row_bytes, row_src, row_dst, words, tidx):
        """Thread t: the addresses of the task's row t. DISPATCH: the owner's x row -> the
        ring x row. COMBINE: the ring y row -> slot ``token * K + k`` of the source rank's
        combine buffer. Padding rows (peer -1) are skipped: a GEMM row depends only on its
        own input row and padding outputs are never combined. A tile lies in one expert
        segment, whose padding is at its end, so the real rows are a prefix; the thread at
        its end writes its length."""
        row_begin = tasks[index, W_ROW_BEGIN]
        num_rows = tasks[index, W_ROW_END] - row_begin
        if tidx < cutlass.min(num_rows, TILE_M):
            row = row_begin + tidx
            ring_row = tasks[index, W_RING_ROW] + tidx
            peer = row_peer[rank, row]
            if peer >= 0:
                token = Int64(row_token[rank, row])
                base = peer_bases[rank, peer]
                if ttype == int(TaskType.DISPATCH):
                    row_src[tidx] = base + ctx.x_offset + token * Int64(row_bytes)
                    row_dst[tidx] = ring_x[ring_row, None, rank].iterator.toint()
                    if const_expr(self.local_direct):
                        if peer == ctx.rank_base + rank:
                            row_src[tidx] = Int64(0)  # FC1 reads this row from x itself
                else:
                    slot = token * Int64(self.top_k) + Int64(row_k[rank, row])
                    row_src[tidx] = ring_y[ring_row, None, rank].iterator.toint()
                    row_dst[tidx] = base + ctx.combine_offset + slot * Int64(row_bytes)
                    if const_expr(self.local_direct):
                        if peer == ctx.rank_base + rank:
                            row_src[tidx] = Int64(0)  # read from the ring by this rank's k-sum
                last = tidx + 1 == num_rows
                if not last:
                    last = row_peer[rank, row + 1] < 0
                if last:
                    words[1] = tidx + 1

    @cute.jit
    def _fence(self):
        """Make what this thread has seen and written visible before a release."""
        if const_expr(self.scope == "sys"):
            cute.arch.fence_acq_rel_sys()
        else:
            cute.arch.fence_acq_rel_gpu()

    @cute.jit
    def _publish_fence(self):
        """The fence before a compute task's release publish, unless release_only_publish."""
        if const_expr(not self.release_only_publish):
            self._fence()

    @cute.jit
    def _take_ticket(self, counters, slot: Int32) -> Int32:
        return cute.arch.atomic_add((counters.iterator + slot).llvm_ptr, Int32(1),
                                    sem="relaxed", scope="gpu")

    @cute.jit
    def _producer_ticket(self, counters, ticket_q, ticket_bars, taken: Int32, q: Int32,
                         q_next: Int32, first: cutlass.Constexpr[bool]):
        """dynamic_tickets, a producer warp: this CTA's next compute ticket and lane 0's
        ticket after it. Lane 0 of the taker warp (warp 0) puts the ticket it took last time
        into the ring for the consumers (and the other producer warps, which read it there)
        and takes the following one now, so the atomic's latency hides behind a task.
        Holding one ticket ahead cannot deadlock: it is larger than the one being run.
        With decoded_tickets, warp 0 only takes it here (``_producer_task`` publishes).
        strided_tickets: the tickets come by the stride from ``q`` (the CTA's compute index
        on the first call) instead of from the counter."""
        first_q = q
        q = Int32(0)
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == self.gemm.load_warp:
            if cute.arch.lane_idx() == 0:
                slot = cute.size(counters, mode=[1]) - TICKETS + int(Role.COMPUTE)
                if const_expr(first):
                    if const_expr(self.strided_tickets):
                        q_next = first_q
                    else:
                        q_next = self._take_ticket(counters, slot)
                q = q_next
                if const_expr(not self.decoded_tickets):
                    ticket_ring_publish(ticket_q, ticket_bars, taken, q)
                if const_expr(self.strided_tickets):
                    q_next = q + self.num_compute_ctas
                else:
                    q_next = self._take_ticket(counters, slot)
            q = cute.arch.shuffle_sync(q, 0)
        elif const_expr(not self.decoded_tickets):
            q = ticket_ring_read(ticket_q, ticket_bars, taken)
        return q, q_next

    @cute.jit
    def _producer_task(self, ctx, tasks, queues, queue_len, queue_blocks, live_prefix: Int32,
                       counter_offsets, counters, num_tiles, tile_expert, ticket_q, ticket_bars,
                       taken: Int32, q: Int32, q_next: Int32, blk: Int32, q_base: Int32,
                       first: cutlass.Constexpr[bool]):
        """A producer warp's next compute task: (q, q_next, index, rank, blk, q_base), index -1
        once the queue is exhausted. Static stride or dynamic tickets: every warp resolves the
        ticket itself. decoded_tickets: warp 0 takes and resolves it and its lane 0 publishes
        the task's words (``_publish_task``); the other producer warps read them from the ring."""
        index, rank = Int32(-1), Int32(0)
        if const_expr(self.dynamic_tickets):
            q, q_next = self._producer_ticket(counters, ticket_q, ticket_bars, taken, q, q_next,
                                              first)
        elif const_expr(not first):
            q += self.num_compute_ctas
        if const_expr(self.decoded_tickets):
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == self.gemm.load_warp:
                index, rank, blk, q_base = self._ticket(queues, queue_len, queue_blocks,
                                                        live_prefix, int(Role.COMPUTE), q, blk,
                                                        q_base)
                if cute.arch.lane_idx() == 0:
                    self._publish_task(ctx, tasks, counter_offsets, num_tiles, tile_expert,
                                       ticket_q, ticket_bars, taken, index, rank)
                cute.arch.sync_warp()  # lane 0's slot words are visible to the warp
            else:
                index, rank = self._ring_next(ticket_q, ticket_bars, taken)
        else:
            index, rank, blk, q_base = self._ticket(queues, queue_len, queue_blocks, live_prefix,
                                                    int(Role.COMPUTE), q, blk, q_base)
        return q, q_next, index, rank, blk, q_base

    @cute.jit
    def _publish_task(self, ctx, tasks, counter_offsets, num_tiles, tile_expert, ticket_q,
                      ticket_bars, k: Int32, index: Int32, rank: Int32):
        """decoded_tickets, lane 0 of the producer's warp 0: ring use k holds task ``index`` of
        ``rank`` as the compute warps need it (``D_*`` words; index -1 ends the walk)."""
        tword, m_tile, n_tile, ring_tile = Int32(0), Int32(0), Int32(0), Int32(0)
        expert, signal, row_begin, num_waits = Int32(0), Int32(0), Int32(0), Int32(0)
        if index >= 0:
            if const_expr(self.short_task_start):
                row_begin, num_waits = tasks[index, W_ROW_BEGIN], tasks[index, W_NUM_WAITS]
            run, noop = self._task_state(ctx, tasks, num_tiles, index, rank)
            ttype = tasks[index, W_TYPE]
            tword = (ttype + cutlass.select_(run, Int32(RUN_FLAG), Int32(0))
                     + cutlass.select_(noop, Int32(NOOP_FLAG), Int32(0)))
            m_tile, n_tile, ring_tile = self._row_tile(tasks, index)
            if run and not noop and self._is_gemm(ttype):
                expert = self._expert_of(ctx, tile_expert, rank, m_tile)
            signal = counter_offsets[tasks[index, W_SIGNAL_GROUP]] + tasks[index, W_SIGNAL_INDEX]
        ring_wait_empty(ticket_bars, k)
        words = self._ring_words(ticket_q, k)
        words[D_INDEX] = index
        words[D_RANK] = rank
        words[D_TYPE] = tword
        words[D_MTILE] = m_tile
        words[D_NTILE] = n_tile
        words[D_RING_TILE] = ring_tile
        words[D_EXPERT] = expert
        words[D_SIGNAL] = signal
        if const_expr(self.short_task_start):
            words[D_ROW_BEGIN] = row_begin
            words[D_NUM_WAITS] = num_waits
        cute.arch.mbarrier_arrive(ticket_bars + k % TICKET_SLOTS)  # release: readers that see the phase see the words

    @cute.jit
    def _ring_words(self, ticket_q, k: Int32):
        """decoded_tickets: the words of ring use k (``decoded_words`` per slot)."""
        return task_ring_words(ticket_q, k, self.decoded_words)

    @cute.jit
    def _ring_next(self, ticket_q, ticket_bars, k: Int32):
        """decoded_tickets: a reader warp's (index, rank) of ring use k (``task_ring_next``)."""
        return task_ring_next(ticket_q, ticket_bars, k, self.decoded_words)

    @cute.jit
    def _task_kind(self, ctx, tasks, num_tiles, ticket_q, taken: Int32, index: Int32,
                   rank: Int32):
        """(run, noop, type) of the task being walked (ring use ``taken - 1`` with
        decoded_tickets, else its task row)."""
        if const_expr(self.decoded_tickets):
            tword = self._ring_words(ticket_q, taken - 1)[D_TYPE]
            run = (tword & RUN_FLAG) != 0
            noop = (tword & NOOP_FLAG) != 0
            ttype = tword & (RUN_FLAG - 1)
        else:
            run, noop = self._task_state(ctx, tasks, num_tiles, index, rank)
            ttype = tasks[index, W_TYPE]
        return run, noop, ttype

    @cute.jit
    def _task_tile(self, tasks, ticket_q, taken: Int32, index: Int32):
        """(m_tile, n_tile, ring tile) of the GEMM task being walked."""
        m_tile, n_tile, ring_tile = Int32(0), Int32(0), Int32(0)
        if const_expr(self.decoded_tickets):
            words = self._ring_words(ticket_q, taken - 1)
            m_tile, n_tile, ring_tile = words[D_MTILE], words[D_NTILE], words[D_RING_TILE]
        else:
            m_tile, n_tile, ring_tile = self._row_tile(tasks, index)
        return m_tile, n_tile, ring_tile

    @cute.jit
    def _row_tile(self, tasks, index: Int32):
        """(m_tile, n_tile, ring tile) from task ``index``'s row."""
        return (tasks[index, W_MTILE], tasks[index, W_NTILE],
                tasks[index, W_RING_ROW] // self.tile_shape_mnk[0])

    @cute.jit
    def _expert_of(self, ctx, tile_expert, rank: Int32, m_tile: Int32) -> Int32:
        """The launch-wide expert index of ``rank``'s M-tile (weights are stacked rank-major)."""
        return rank * ctx.local_experts + tile_expert[rank, cutlass.max(m_tile, 0)]

    @cute.jit
    def _move_rows(self, num_rows, row_src, row_dst, row_full, staging, slots, row_bytes,
                   phases):
        """One thread moves ``num_rows`` rows (addresses in smem) with bulk copies through
        smem staging slots. Returns the updated slot parities; every store has landed when
        it returns (the caller then publishes)."""
        row_elems = row_bytes // 2
        # Slot s is reloaded `slots` rows after its last load; by then the rows loaded in
        # between are either in flight (lag) or stored; at most STORES_IN_FLIGHT of those
        # stores may still be reading smem. Small slot counts (huge rows) wait for every store.
        deep = slots > STORES_IN_FLIGHT + 1
        lag = slots - 1
        if deep:
            lag = slots - 1 - STORES_IN_FLIGHT
        for i in cutlass.range(num_rows + lag, unroll=1):
            if i < num_rows:
                slot = i % slots
                # the slot's previous row (i - slots) must be read out of smem first
                if deep:
                    cute.arch.cp_async_bulk_wait_group(STORES_IN_FLIGHT, read=True)
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.mbarrier_arrive_and_expect_tx(row_full + slot, row_bytes)
                src = cute.make_ptr(BFloat16, row_src[i], cute.AddressSpace.gmem, assumed_align=16)
                nvvm.cp_async_bulk_shared_cluster_global(staging + slot * row_elems, src,
                                                         row_full + slot, row_bytes)
            j = i - lag
            if j >= 0:
                slot = j % slots
                cute.arch.mbarrier_wait(row_full + slot, (phases >> slot) & 1)
                phases = phases ^ (1 << slot)
                dst = cute.make_ptr(BFloat16, row_dst[j], cute.AddressSpace.gmem, assumed_align=16)
                nvvm.cp_async_bulk_global_shared_cta(dst, staging + slot * row_elems, row_bytes)
                cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        return phases

    # ------------------------------------------------------------------ compute: producer
    @cute.jit
    def _producer_loop(self, ctx, tasks, queues, queue_len, queue_live_len, queue_blocks,
                       counter_offsets, counters, error, num_tiles, tile_expert, ab_pipeline,
                       sA, sB, tma_a_x, t_a_x, tma_a_h, t_a_h, tma_wg, t_wg, tma_wu, t_wu,
                       tma_wd, t_wd, s_tma_a_x, s_t_a_x, s_tma_a_h, s_t_a_h, s_tma_wg, s_t_wg,
                       s_tma_wu, s_t_wu, s_tma_wd, s_t_wd, compute_cta, ticket_q, ticket_bars,
                       timeline_buf, direct):
        """Warp 0 (or, with local_direct, the whole producer warpgroup with ``direct``: a
        ``_DirectA``) walks the compute tickets, waits on each GEMM task's counters and fills
        the stages: A and B by TMA; with local_direct, FC1's A rows by cp.async, each row from
        this rank's own x when the row is local (never dispatched) or from the ring."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        one = cute.make_layout(1)
        sB_halves = cute.flat_divide(sB, (self.half_n, tile_k))
        sB_gate = cute.group_modes(sB_halves[(None, None, 0, 0, None)], 0, 2)
        sB_up = cute.group_modes(sB_halves[(None, None, 1, 0, None)], 0, 2)
        sA_g = cute.group_modes(sA, 0, 2)
        sB_g = cute.group_modes(sB, 0, 2)

        def part(atom, tensor, s, box):
            return cute.nvgpu.cpasync.tma_partition(
                atom, 0, one, s, cute.group_modes(cute.local_tile(tensor, box, (None, None, None)), 0, 2))

        a_box, half_box, b_box = (tile_m, tile_k), (self.half_n, tile_k), (tile_n, tile_k)
        sAx, gAx = part(tma_a_x, t_a_x, sA_g, a_box)
        sAh, gAh = part(tma_a_h, t_a_h, sA_g, a_box)
        sBg, gBg = part(tma_wg, t_wg, sB_gate, half_box)
        sBu, gBu = part(tma_wu, t_wu, sB_up, half_box)
        sBd, gBd = part(tma_wd, t_wd, sB_g, b_box)
        s_sAx, s_gAx, s_sAh, s_gAh = None, None, None, None
        s_sBg, s_gBg, s_sBu, s_gBu, s_sBd, s_gBd = None, None, None, None, None, None
        if const_expr(self.has_shared):
            s_sAx, s_gAx = part(s_tma_a_x, s_t_a_x, sA_g, a_box)
            s_sAh, s_gAh = part(s_tma_a_h, s_t_a_h, sA_g, a_box)
            s_sBg, s_gBg = part(s_tma_wg, s_t_wg, sB_gate, half_box)
            s_sBu, s_gBu = part(s_tma_wu, s_t_wu, sB_up, half_box)
            s_sBd, s_gBd = part(s_tma_wd, s_t_wd, sB_g, b_box)
        tma = _TmaLoads(tma_a_x, gAx, sAx, tma_a_h, gAh, sAh, tma_wg, gBg, sBg, tma_wu, gBu, sBu,
                        tma_wd, gBd, sBd, s_tma_a_x, s_gAx, s_sAx, s_tma_a_h, s_gAh, s_sAh,
                        s_tma_wg, s_gBg, s_sBg, s_tma_wu, s_gBu, s_sBu, s_tma_wd, s_gBd, s_sBd)
        # local_direct: the _DirectA fields as plain locals (an object used in the task loop
        # would have to be carried through it)
        d_row_peer, d_row_token, d_peer_bases, d_ring_x = None, None, None, None
        d_sA_base, d_tidx, d_warp, d_sync = None, None, None, None
        if const_expr(self.local_direct):
            d_row_peer, d_row_token, d_peer_bases, d_ring_x = (
                direct.row_peer, direct.row_token, direct.peer_bases, direct.ring_x)
            d_sA_base, d_tidx, d_warp, d_sync = (direct.sA_base, direct.tidx, direct.warp_idx,
                                                 direct.sync)

        loads = Int32(0)  # k-tiles issued so far: the pipeline state is derived from it
        live_prefix = self._live_prefix(ctx, queue_live_len, num_tiles, int(Role.COMPUTE))
        blk, q_base = Int32(0), Int32(0)  # ticket block cursor (rank_blocks)
        taken = Int32(0)  # dynamic_tickets: tickets this CTA has taken
        q = compute_cta
        q_next = Int32(0)  # dynamic_tickets: lane 0's ticket after q, taken ahead of time
        q, q_next, index, rank, blk, q_base = self._producer_task(
            ctx, tasks, queues, queue_len, queue_blocks, live_prefix, counter_offsets, counters,
            num_tiles, tile_expert, ticket_q, ticket_bars, taken, q, q_next, blk, q_base, True)
        if const_expr(self.dynamic_tickets):
            taken += 1
        while index >= 0:
            run, noop, ttype = self._task_kind(ctx, tasks, num_tiles, ticket_q, taken, index, rank)
            k_tiles = self._k_tiles(ttype, t_a_x, t_a_h, s_t_a_h)
            if run and not noop and self._is_gemm(ttype):
                num_waits, row_begin = None, None  # loaded from the task's row where needed
                if const_expr(self.short_task_start):
                    slot = self._ring_words(ticket_q, taken - 1)
                    num_waits, row_begin = slot[D_NUM_WAITS], slot[D_ROW_BEGIN]
                if const_expr(self.local_direct):
                    if d_warp == self.gemm.load_warp:
                        self._wait_task_recorded(ctx, tasks, counter_offsets, counters, error,
                                                 num_tiles, index, rank, timeline_buf,
                                                 int(Role.COMPUTE), cute.arch.lane_idx() == 0,
                                                 num_waits)
                        cute.arch.fence_proxy("async.global")
                    d_sync.arrive_and_wait()  # the task's inputs are there for all 4 warps
                else:
                    self._wait_task_recorded(ctx, tasks, counter_offsets, counters, error, num_tiles,
                                             index, rank, timeline_buf, int(Role.COMPUTE),
                                             cute.arch.lane_idx() == 0, num_waits)
                    # rows written by other CTAs (generic or TMA stores) are read through TMA next
                    cute.arch.fence_proxy("async.global")
                m_tile, n_tile, ring_tile = self._task_tile(tasks, ticket_q, taken, index)
                expert = Int32(0)
                if const_expr(self.decoded_tickets):
                    expert = self._ring_words(ticket_q, taken - 1)[D_EXPERT]
                else:
                    expert = self._expert_of(ctx, tile_expert, rank, m_tile)
                state = _pipeline_state(pipeline.PipelineUserType.Producer, g_stages(self), loads)
                if const_expr(self.local_direct):
                    self._fill_stages_direct(ctx, tasks, index, rank, ttype, k_tiles, state,
                                             ab_pipeline, d_row_peer, d_row_token, d_peer_bases,
                                             d_ring_x, d_sA_base, d_tidx, d_warp, m_tile, n_tile,
                                             ring_tile, expert, tma, row_begin)
                if const_expr(not self.local_direct):
                    for k in range(k_tiles):
                        ab_pipeline.producer_acquire(state)
                        bar = ab_pipeline.producer_get_barrier(state)
                        self._issue_tma_loads(tma, ttype, k, state.index, bar, m_tile, n_tile,
                                              ring_tile, expert, rank, True)
                        ab_pipeline.producer_commit(state)
                        state.advance()
            loads += self._loads_of(run, noop, ttype, k_tiles)
            q, q_next, index, rank, blk, q_base = self._producer_task(
                ctx, tasks, queues, queue_len, queue_blocks, live_prefix, counter_offsets,
                counters, num_tiles, tile_expert, ticket_q, ticket_bars, taken, q, q_next, blk,
                q_base, False)
            if const_expr(self.dynamic_tickets):
                taken += 1
        tail = _pipeline_state(pipeline.PipelineUserType.Producer, g_stages(self), loads)
        if const_expr(self.local_direct):
            cute.arch.cp_async_wait_group(0)
            if d_warp == self.gemm.load_warp:
                ab_pipeline.producer_tail(tail)
        else:
            ab_pipeline.producer_tail(tail)

    @cute.jit
    def _issue_tma_loads(self, tma, ttype, k, stage, bar, m_tile, n_tile, ring_tile, expert,
                         rank, fc1_a: cutlass.Constexpr[bool]):
        """The TMA loads of k-tile ``k`` of a GEMM task into ``stage``: FC1 x rows (when
        ``fc1_a``) and the gate / up halves, FC2 h rows and W_down, or the shared expert's."""
        if ttype == int(TaskType.FC1):
            if const_expr(fc1_a):
                cute.copy(tma.a_x, tma.g_a_x[(None, ring_tile, k, rank)], tma.s_a_x[(None, stage)], tma_bar_ptr=bar)
            cute.copy(tma.wg, tma.g_wg[(None, n_tile, k, expert)], tma.s_wg[(None, stage)], tma_bar_ptr=bar)
            cute.copy(tma.wu, tma.g_wu[(None, n_tile, k, expert)], tma.s_wu[(None, stage)], tma_bar_ptr=bar)
        elif ttype == int(TaskType.FC2):
            cute.copy(tma.a_h, tma.g_a_h[(None, ring_tile, k, rank)], tma.s_a_h[(None, stage)], tma_bar_ptr=bar)
            cute.copy(tma.wd, tma.g_wd[(None, n_tile, k, expert)], tma.s_wd[(None, stage)], tma_bar_ptr=bar)
        if const_expr(self.has_shared):
            if ttype == int(TaskType.SHARED_FC1):
                cute.copy(tma.sh_a_x, tma.g_sh_a_x[(None, m_tile, k, rank)], tma.s_sh_a_x[(None, stage)], tma_bar_ptr=bar)
                cute.copy(tma.sh_wg, tma.g_sh_wg[(None, n_tile, k, rank)], tma.s_sh_wg[(None, stage)], tma_bar_ptr=bar)
                cute.copy(tma.sh_wu, tma.g_sh_wu[(None, n_tile, k, rank)], tma.s_sh_wu[(None, stage)], tma_bar_ptr=bar)
            elif ttype == int(TaskType.SHARED_FC2):
                cute.copy(tma.sh_a_h, tma.g_sh_a_h[(None, m_tile, k, rank)], tma.s_sh_a_h[(None, stage)], tma_bar_ptr=bar)
                cute.copy(tma.sh_wd, tma.g_sh_wd[(None, n_tile, k, rank)], tma.s_sh_wd[(None, stage)], tma_bar_ptr=bar)

    @cute.jit
    def _fill_stages_direct(self, ctx, tasks, index, rank, ttype, k_tiles, state, ab_pipeline,
                            row_peer, row_token, peer_bases, ring_x, sA_base, tidx, warp_idx,
                            m_tile, n_tile, ring_tile, expert, tma, row_begin=None):
        """local_direct: one GEMM task's k-tiles, by the whole producer warpgroup. Every stage
        takes 1 + 128 arrivals: warp 0 arms it with the TMA bytes (B only for FC1, A and B
        otherwise) and issues the TMA loads; each thread then either lands its share of FC1's
        A rows with cp.async (``gemm_sm90.cp_async_a_rows``, arrival when they land) or
        arrives at once."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        b_bytes = tile_n * tile_k * 2
        rows = gathered_rows_of(tidx)
        srcs = [Int64(0) for _ in rows]
        if ttype == int(TaskType.FC1):
            srcs = self._direct_row_addresses(ctx, tasks, index, rank, row_peer, row_token,
                                              peer_bases, ring_x, ring_tile, rows, row_begin)
        my_k_tiles = k_tiles
        if const_expr(self.warp0_tma_stages):
            if ttype != int(TaskType.FC1) and warp_idx != self.gemm.load_warp:
                my_k_tiles = 0  # the load warp fills and arrives for these stages alone
        for k in range(my_k_tiles):
            ab_pipeline.sync_object_empty.wait(state.index, state.phase)
            bar = ab_pipeline.producer_get_barrier(state)
            stage = state.index
            if warp_idx == self.gemm.load_warp:
                tx = b_bytes + tile_m * tile_k * 2
                if ttype == int(TaskType.FC1):
                    tx = b_bytes
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, tx)
                    if const_expr(self.warp0_tma_stages):
                        if ttype != int(TaskType.FC1):  # after the expect: the phase waits for the bytes
                            cute.arch.mbarrier_arrive(bar, arrive_count=PRODUCER_THREADS)
                # FC1's A rows come by cp.async below, not by TMA
                self._issue_tma_loads(tma, ttype, k, stage, bar, m_tile, n_tile, ring_tile,
                                      expert, rank, False)
            if ttype == int(TaskType.FC1):
                cp_async_a_rows(sA_base + stage * (tile_m * tile_k), srcs, rows, k, tidx)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
            else:
                if const_expr(not self.warp0_tma_stages):
                    cute.arch.mbarrier_arrive(bar)
            state.advance()

    def _direct_row_addresses(self, ctx, tasks, index, rank, row_peer, row_token, peer_bases,
                              ring_x, ring_tile, rows, row_begin=None):
        """Byte addresses of an FC1 task's A rows ``rows``: this rank's own x row for a local
        row (never copied into the ring), the ring row otherwise. Traced inline (a plain
        method: a list of DSL values cannot leave a ``cute.jit`` function)."""
        tile_m = self.tile_shape_mnk[0]
        row_bytes = Int64(cute.size(ring_x, mode=[1]) * 2)
        x_base = peer_bases[rank, ctx.rank_base + rank] + ctx.x_offset
        first = tasks[index, W_ROW_BEGIN] if row_begin is None else row_begin
        srcs = []
        for r in rows:
            in_ring = ring_x[ring_tile * tile_m + r, None, rank].iterator.toint()
            in_x = x_base + Int64(row_token[rank, first + r]) * row_bytes
            srcs.append(Int64(cutlass.select_(row_peer[rank, first + r] == ctx.rank_base + rank,
                                              in_x, in_ring)))
        return srcs

    @cute.jit
    def _k_tiles(self, ttype: Int32, t_a_x, t_a_h, s_t_a_h) -> Int32:
        """K-tiles of a GEMM task: H / 64 for the gate/up GEMMs, I (or Is) / 64 for down."""
        k_tiles = cute.size(t_a_x, mode=[1]) // TILE_K
        if ttype == int(TaskType.FC2):
            k_tiles = cute.size(t_a_h, mode=[1]) // TILE_K
        if const_expr(self.has_shared):
            if ttype == int(TaskType.SHARED_FC2):
                k_tiles = cute.size(s_t_a_h, mode=[1]) // TILE_K
        return k_tiles

    @cute.jit
    def _loads_of(self, run, noop, ttype: Int32, k_tiles: Int32) -> Int32:
        """Pipeline stages a task consumes: its k-tiles if it is a GEMM that runs, else 0."""
        loads = Int32(0)
        if run and not noop and self._is_gemm(ttype):
            loads = k_tiles
        return loads

    @cute.jit
    def _is_gemm(self, ttype: Int32):
        """A compute task that runs through the stage pipeline: FC1, FC2 and the shared
        expert's, whose types are below KSUM's (not a KSUM, nor a BARRIER run by a compute CTA
        when there is no comm CTA)."""
        return ttype < int(TaskType.KSUM)

    # ------------------------------------------------------------------ compute: consumers
    @cute.jit
    def _consumer_loop(self, ctx, tasks, queues, queue_len, queue_live_len, queue_blocks,
                       counter_offsets, counters, error, num_tiles, peer_bases, topk_weights,
                       topk_idx, slot_rows, ring_y, out, shared_y, timeline_buf, ab_pipeline,
                       tiled_mma, sA, sB, sC, tma_st_h, t_st_h, tma_st_y, t_st_y, s_tma_st_h,
                       s_t_st_h, s_tma_st_y, s_t_st_y, tidx, warp_idx, warpgroup_idx,
                       compute_cta, ticket_q, ticket_bars, ksum_stage):
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        consumer_tidx = tidx - 128
        tCrA, tCrB, acc, num_k_blocks, epi = self._consumer_parts(
            tiled_mma, sA, sB, sC, (warpgroup_idx - 1) * 128, consumer_tidx)
        tma_store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=store_pipeline_stages(self.epi_stages, self.one_epilogue_barrier),
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.gemm.num_mma_threads))
        barrier = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.EPILOGUE),
                                        num_threads=self.gemm.num_mma_threads)
        is_store_warp = warp_idx == 4

        loads = Int32(0)
        subtiles = Int32(0)
        live_prefix = self._live_prefix(ctx, queue_live_len, num_tiles, int(Role.COMPUTE))
        blk, q_base = Int32(0), Int32(0)  # ticket block cursor (rank_blocks)
        taken = Int32(0)  # dynamic_tickets: tickets read from the producer's ring
        q = compute_cta
        index, rank = Int32(-1), Int32(0)
        if const_expr(self.decoded_tickets):
            index, rank = self._ring_next(ticket_q, ticket_bars, taken)
            taken += 1
        else:
            if const_expr(self.dynamic_tickets):
                q = ticket_ring_read(ticket_q, ticket_bars, taken)
                taken += 1
            index, rank, blk, q_base = self._ticket(queues, queue_len, queue_blocks, live_prefix,
                                                    int(Role.COMPUTE), q, blk, q_base)
        # defer_signals: the counter of the FC1 / FC2 task whose publish is held back (-1:
        # none) and its type
        held, held_type = Int32(-1), Int32(-1)
        while index >= 0:
            run, noop, ttype = self._task_kind(ctx, tasks, num_tiles, ticket_q, taken, index, rank)
            k_tiles = self._k_tiles(ttype, t_st_y, t_st_h, s_t_st_h)
            t_start = self._now_if_recording()
            # with the recorder, a GEMM task's EPILOGUE and SIGNAL phases (timeline.TaskType)
            t_epilogue, t_signal = t_start, t_start
            gemm_runs = run and not noop and self._is_gemm(ttype)
            deferrable = False
            if const_expr(self.defer_signals):
                deferrable = gemm_runs and (ttype == int(TaskType.FC1) or ttype == int(TaskType.FC2))
                fc1_then_fc2 = held_type == int(TaskType.FC1) and ttype == int(TaskType.FC2)
                if held >= 0 and (not deferrable or fc1_then_fc2):
                    # this task may wait on the held one (an FC2 on FC1's h, a KSUM on all)
                    self._flush_signal(counters, held, is_store_warp, consumer_tidx)
                    held = Int32(-1)
            if gemm_runs:
                # defer_signals: the held publish goes out inside this mainloop, after its
                # first defer_flush_ktiles k-tiles (the tensor cores busy meanwhile), not after
                # the whole mainloop: other CTAs' FC2 tasks wait on a held FC1 counter
                flush = None
                if const_expr(self.defer_signals):
                    flush = (counters, held, is_store_warp, consumer_tidx)
                release = self._mainloop(ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads,
                                         k_tiles, num_k_blocks, ctx, timeline_buf, index, rank,
                                         consumer_tidx == 0, ttype, flush)
                cute.nvgpu.warpgroup.wait_group(0)
                t_epilogue = self._now_if_recording()
                ab_pipeline.consumer_release(release)
                if const_expr(self.defer_signals):
                    held = Int32(-1)  # published in the mainloop

                subtiles, t_signal = self._store_task(
                    epi, ttype, tasks, ticket_q, taken, index, rank, subtiles, barrier,
                    tma_store_pipeline, is_store_warp, 0, self.store_warp_signals, tma_st_h,
                    t_st_h, tma_st_y, t_st_y, s_tma_st_h, s_t_st_h, s_tma_st_y, s_t_st_y,
                    not deferrable)
            elif run and not noop:
                # a KSUM, or with no comm CTA the BARRIER (no rows: it only waits, and stores
                # its flag when it publishes)
                self._ksum(ctx, tasks, counter_offsets, counters, error, num_tiles, peer_bases,
                           topk_weights, topk_idx, slot_rows, ring_y, out, shared_y,
                           timeline_buf, index, rank, consumer_tidx, barrier, ksum_stage, ttype)
            if run:
                if const_expr(self.store_warp_signals):
                    if not self._is_gemm(ttype):  # KSUM: every warp's rows are written first
                        barrier.arrive_and_wait()
                else:
                    barrier.arrive_and_wait()
                if deferrable:  # published by a later task's _flush_signal
                    held, held_type = self._ring_words(ticket_q, taken - 1)[D_SIGNAL], ttype
                if consumer_tidx == 0:  # lane 0 of the store warp (warp 4)
                    self._publish_compute_task(ctx, tasks, counter_offsets, counters, ticket_q,
                                               taken, index, rank, ttype, t_start, timeline_buf,
                                               peer_bases, t_epilogue, t_signal, deferrable)
            loads += self._loads_of(run, noop, ttype, k_tiles)
            if const_expr(self.decoded_tickets):
                index, rank = self._ring_next(ticket_q, ticket_bars, taken)
                taken += 1
            else:
                q, taken = self._next_ticket(q, ticket_q, ticket_bars, taken)
                index, rank, blk, q_base = self._ticket(queues, queue_len, queue_blocks,
                                                        live_prefix, int(Role.COMPUTE), q, blk,
                                                        q_base)
        if const_expr(self.defer_signals):
            if held >= 0:
                self._flush_signal(counters, held, is_store_warp, consumer_tidx)
        tma_store_pipeline.producer_tail()

    @cute.jit
    def _pingpong_loop(self, ctx, tasks, counter_offsets, counters, error, num_tiles,
                       peer_bases, topk_weights, topk_idx, slot_rows, ring_y, out, shared_y,
                       timeline_buf, ab_pipeline, tiled_mma, sA, sB, sC, tma_st_h, t_st_h,
                       tma_st_y, t_st_y, s_tma_st_h, s_t_st_h, s_tma_st_y, s_t_st_y, tidx,
                       warp_idx, warpgroup_idx, ticket_q, ticket_bars, ksum_stage):
        """pingpong: consumer warpgroup ``wg`` runs this CTA's compute tasks ``wg``, ``wg + 2``,
        ... whole (mainloop, epilogue, signal); both read every task's words from the decoded
        ring (the stage count runs over every task). The warpgroups take turns at the
        mainloop in task order: a task's owner waits for its turn, issues its k-tile waits,
        then passes the turn if there is a next task, so the other's mainloop overlaps its
        epilogue. A task that runs no mainloop (KSUM, skipped, no-op) passes it at once."""
        wg = warpgroup_idx - 1  # 0 or 1
        wg_tidx = tidx % 128
        # each warpgroup is a whole single-warpgroup MMA (slice 0)
        tCrA, tCrB, acc, num_k_blocks, epi = self._consumer_parts(tiled_mma, sA, sB, sC, 0, wg_tidx)
        tma_store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=store_pipeline_stages(self.epi_stages, self.one_epilogue_barrier),
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128))
        barrier = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.EPILOGUE) + wg,
                                        num_threads=128)
        my_turn = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.MMA_ORDER) + wg,
                                        num_threads=self.gemm.num_mma_threads)
        their_turn = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.MMA_ORDER) + 1 - wg,
                                           num_threads=self.gemm.num_mma_threads)
        is_store_warp = warp_idx == 4 * warpgroup_idx  # the warpgroup's first warp
        epi_base = wg * self.epi_stages

        loads = Int32(0)  # k-tiles of every task so far, both warpgroups': the stage count
        subtiles = Int32(0)  # this warpgroup's epilogue subtiles so far
        taken = Int32(0)  # ring uses read: task position taken - 1 is the current one
        index, rank = self._ring_next(ticket_q, ticket_bars, taken)
        taken += 1
        while index >= 0:
            run, noop, ttype = self._task_kind(ctx, tasks, num_tiles, ticket_q, taken, index, rank)
            k_tiles = self._k_tiles(ttype, t_st_y, t_st_h, s_t_st_h)
            gemm_runs = run and not noop and self._is_gemm(ttype)
            if (taken - 1) % 2 == wg:
                t_start = self._now_if_recording()
                if taken > 1:
                    my_turn.arrive_and_wait()  # the previous task's owner has issued its waits
                if gemm_runs:
                    release = self._mainloop(ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads,
                                             k_tiles, num_k_blocks, ttype=ttype)
                    self._pass_turn(their_turn, ticket_q, ticket_bars, taken)
                    cute.nvgpu.warpgroup.wait_group(0)
                    ab_pipeline.consumer_release(release)
                    subtiles, _ = self._store_task(
                        epi, ttype, tasks, ticket_q, taken, index, rank, subtiles, barrier,
                        tma_store_pipeline, is_store_warp, epi_base, True, tma_st_h, t_st_h,
                        tma_st_y, t_st_y, s_tma_st_h, s_t_st_h, s_tma_st_y, s_t_st_y)
                else:
                    self._pass_turn(their_turn, ticket_q, ticket_bars, taken)
                    if run and not noop:
                        self._ksum(ctx, tasks, counter_offsets, counters, error, num_tiles,
                                   peer_bases, topk_weights, topk_idx, slot_rows, ring_y, out,
                                   shared_y, timeline_buf, index, rank, wg_tidx, barrier,
                                   ksum_stage, warps=4, first_warp=4 * wg)
                    if run:
                        barrier.arrive_and_wait()  # every warp's rows before the signal
                if run:
                    if wg_tidx == 0:  # lane 0 of the store warp
                        self._publish_compute_task(ctx, tasks, counter_offsets, counters,
                                                   ticket_q, taken, index, rank, ttype, t_start,
                                                   timeline_buf)
            loads += self._loads_of(run, noop, ttype, k_tiles)
            index, rank = self._ring_next(ticket_q, ticket_bars, taken)
            taken += 1
        tma_store_pipeline.producer_tail()

    @cute.jit
    def _store_task(self, epi, ttype: Int32, tasks, ticket_q, taken: Int32, index: Int32,
                    rank: Int32, subtiles: Int32, barrier, store_pipeline, is_store_warp,
                    buf_base, sync_store_warp: cutlass.Constexpr[bool], tma_st_h, t_st_h,
                    tma_st_y, t_st_y, s_tma_st_h, s_t_st_h, s_tma_st_y, s_t_st_y,
                    wait_stores=True):
        """A GEMM task's epilogue: its output tile (h of FC1, y of FC2, the shared expert's
        h / y) stored by TMA, then the store warp waits for the stores to land (and, with
        ``sync_store_warp``, syncs its lanes so that lane 0 may publish without a barrier).
        Returns the epilogue subtiles used so far and, with the recorder, the time before the
        store warp's wait (the start of its SIGNAL phase). ``wait_stores`` False (a task whose
        signal defer_signals holds back): the store warp does not wait here."""
        m_tile, n_tile, ring_tile = self._task_tile(tasks, ticket_q, taken, index)
        if ttype == int(TaskType.FC1):
            self._store_tile(epi, tma_st_h, t_st_h, ring_tile, n_tile, rank, True, subtiles,
                             barrier, store_pipeline, is_store_warp, buf_base)
        elif ttype == int(TaskType.FC2):
            self._store_tile(epi, tma_st_y, t_st_y, ring_tile, n_tile, rank, False, subtiles,
                             barrier, store_pipeline, is_store_warp, buf_base)
        if const_expr(self.has_shared):
            if ttype == int(TaskType.SHARED_FC1):
                self._store_tile(epi, s_tma_st_h, s_t_st_h, m_tile, n_tile, rank, True,
                                 subtiles, barrier, store_pipeline, is_store_warp, buf_base)
            elif ttype == int(TaskType.SHARED_FC2):
                self._store_tile(epi, s_tma_st_y, s_t_st_y, m_tile, n_tile, rank, False,
                                 subtiles, barrier, store_pipeline, is_store_warp, buf_base)
        t_signal = self._now_if_recording()  # the store warp's: its last store issued
        if is_store_warp and wait_stores:  # (defer_signals: not now, see _flush_signal)
            self._stores_landed(sync_store_warp)
        return subtiles + self._epi_subtiles(ttype), t_signal

    @cute.jit
    def _stores_landed(self, sync_store_warp: cutlass.Constexpr[bool]):
        """The store warp: its TMA stores have landed and are ordered before a generic release
        (and, with ``sync_store_warp``, its lanes synced so that lane 0 may publish)."""
        common.tma_stores_landed()
        if const_expr(sync_store_warp):
            cute.arch.sync_warp()  # lane 0 signals after the storing lane's wait

    @cute.jit
    def _flush_signal(self, counters, signal: Int32, is_store_warp, consumer_tidx: Int32):
        """defer_signals: publish the held-back task's counter ``signal`` (one rank) once the
        store warp has seen its stores land."""
        if is_store_warp:
            self._stores_landed(True)
        if consumer_tidx == 0:
            self._publish_fence()
            common.counter_publish(counters[0, None], signal, 1, self.scope)

    @cute.jit
    def _publish_compute_task(self, ctx, tasks, counter_offsets, counters, ticket_q, taken: Int32,
                              index: Int32, rank: Int32, ttype: Int32, t_start: Int64,
                              timeline_buf, peer_bases=None, t_epilogue: Int64 = None,
                              t_signal: Int64 = None, held=False):
        """One thread, after the task's writes are complete: release-publish its counter (from
        the decoded ring or the task row) and, with the recorder, its span, and for a GEMM
        task given ``t_epilogue`` (its mainloop's end) and ``t_signal`` (its last store issued)
        its EPILOGUE and SIGNAL phases. With no comm CTA a BARRIER's flag is stored here too,
        by the thread that waited for its FC2 tiles. ``held`` (defer_signals): the counter is
        published later (``_flush_signal``); only the span is recorded, ending with its stores
        issued."""
        t_end = t_start
        if held:
            if const_expr(t_signal is not None):
                t_end = t_signal
        else:
            self._publish_fence()
            if const_expr(self.num_comm_ctas == 0):
                if ttype == int(TaskType.BARRIER):
                    self._announce_done(ctx, peer_bases, rank)
            if const_expr(self.decoded_tickets):
                signal = self._ring_words(ticket_q, taken - 1)[D_SIGNAL]
                common.counter_publish(counters[rank, None], signal, 1, self.scope)
            else:
                self._signal_task(tasks, counter_offsets, counters, index, rank)
            if const_expr(self.timeline):
                t_end = common.timeline_now()
        if const_expr(self.timeline):
            self._record_compute_task(ctx, index, rank, ttype, t_start, t_end, timeline_buf,
                                      t_epilogue, t_signal)

    @cute.jit
    def _record_compute_task(self, ctx, index: Int32, rank: Int32, ttype: Int32, t_start: Int64,
                             t_end: Int64, timeline_buf, t_epilogue: Int64 = None,
                             t_signal: Int64 = None):
        """The recorder: a compute task's span and, for a GEMM task given ``t_epilogue`` and
        ``t_signal``, its EPILOGUE and SIGNAL phases (the SIGNAL ends with the task)."""
        slot = common.timeline_reserve(timeline_buf, 1)
        common.timeline_write(timeline_buf, slot, int(Role.COMPUTE), ttype, index,
                              ctx.rank_base + rank, t_start, t_end)
        if const_expr(t_epilogue is not None):
            if self._is_gemm(ttype):
                phases = common.timeline_reserve(timeline_buf, 2)
                common.timeline_write(timeline_buf, phases, int(Role.COMPUTE),
                                      int(TaskType.EPILOGUE), index, ctx.rank_base + rank,
                                      t_epilogue, t_signal)
                common.timeline_write(timeline_buf, phases + 1, int(Role.COMPUTE),
                                      int(TaskType.SIGNAL), index, ctx.rank_base + rank,
                                      t_signal, t_end)

    def _consumer_parts(self, tiled_mma, sA, sB, sC, mma_slice, copy_tidx):
        """A consumer thread's wgmma operand fragments, fp32 accumulator, k-blocks per stage and
        epilogue partitions (registers -> smem by stmatrix), for MMA thread slice
        ``mma_slice`` and epilogue thread ``copy_tidx``. Traced inline (a plain method: the
        tensors and the TileEpilogue go back to the caller)."""
        tile_m, tile_n, _ = self.tile_shape_mnk
        thr_mma = tiled_mma.get_slice(mma_slice)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((tile_m, tile_n)), Float32)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        tiled_copy_r2s = cute.make_tiled_copy_S(
            sm90_utils.sm90_get_smem_store_op(utils.LayoutEnum.ROW_MAJOR, elem_ty_d=BFloat16,
                                              elem_ty_acc=Float32),
            cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(copy_tidx)
        epi = TileEpilogue(tiled_copy_r2s, thr_copy_r2s.partition_D(sC),
                           tiled_copy_r2s.retile(acc),
                           cute.shape(thr_copy_r2s.partition_S(sC))[:3], sC)
        return tCrA, tCrB, acc, cute.size(tCrA, mode=[2]), epi

    @cute.jit
    def _mainloop(self, ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads: Int32, k_tiles: Int32,
                  num_k_blocks: cutlass.Constexpr[int], ctx=None, timeline_buf=None,
                  index: Int32 = 0, rank: Int32 = 0, leader=False, ttype: Int32 = None,
                  flush=None):
        """A GEMM task's wgmmas over its ``k_tiles`` stages, from stage use ``loads`` on: one
        batch stays in flight and a stage is released once the batch that read it retired.
        Returns the last stage's state; the caller releases it after ``wait_group(0)``. With
        the recorder on and ``ctx`` given, ``leader`` records the wait for the first stage
        (the producer still resolving the task or loading its first k-tile) as a STAGE_WAIT
        span of task ``index`` when it is over STAGE_WAIT_RECORD_MIN_NS. ``ttype``: the task's
        type, for ``fence_fc1_only``. ``flush`` (defer_signals): ``(counters, held,
        is_store_warp, consumer_tidx)``; counter ``held`` (if >= 0) is published once
        ``defer_flush_ktiles`` k-tiles' wgmmas are issued (or after a shorter mainloop)."""
        read = _pipeline_state(pipeline.PipelineUserType.Consumer, g_stages(self), loads)
        release = read.clone()
        acc.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.fence()
        t0 = self._now_if_recording()
        ab_pipeline.consumer_wait(read)
        if const_expr(ctx is not None):
            self._record_wait(ctx, timeline_buf, int(Role.COMPUTE), int(TaskType.STAGE_WAIT),
                              index, rank, t0, leader, STAGE_WAIT_RECORD_MIN_NS)
        self._stage_visible(ttype)
        self.gemm._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read.index, num_k_blocks)
        read.advance()
        flush_k = self.defer_flush_ktiles  # k-tiles issued before the held publish
        if const_expr(flush is not None):
            counters, held, is_store_warp, consumer_tidx = flush
            if const_expr(flush_k == 1):
                if held >= 0:
                    self._flush_signal(counters, held, is_store_warp, consumer_tidx)
        for k in range(1, k_tiles):
            ab_pipeline.consumer_wait(read)
            self._stage_visible(ttype)
            self.gemm._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read.index, num_k_blocks)
            cute.nvgpu.warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release)
            release.advance()
            read.advance()
            if const_expr(flush is not None and flush_k > 1):
                if k == flush_k - 1 and held >= 0:
                    self._flush_signal(counters, held, is_store_warp, consumer_tidx)
        if const_expr(flush is not None and flush_k > 1):
            if k_tiles < flush_k and held >= 0:  # a mainloop shorter than flush_k
                self._flush_signal(counters, held, is_store_warp, consumer_tidx)
        return release

    @cute.jit
    def _stage_visible(self, ttype: Int32):
        """After a stage's full wait: the proxy fence that gathered A stages need (every GEMM
        task's stages with local_direct, or with fence_fc1_only FC1's alone: their A rows
        arrive by cp.async, the other tasks' by TMA)."""
        if const_expr(self.fence_fc1_only):
            if ttype == int(TaskType.FC1):
                a_visible_to_wgmma(self.local_direct)
        else:
            a_visible_to_wgmma(self.local_direct)

    @cute.jit
    def _pass_turn(self, their_turn, ticket_q, ticket_bars, taken: Int32):
        """pingpong: hand the mainloop to the next task's owner, if there is a next task (its
        ring use is waited for, not released: the arrivals must match the waits)."""
        ring_wait_full(ticket_bars, taken)  # the next task's ring use
        if self._ring_words(ticket_q, taken)[D_INDEX] >= 0:
            their_turn.arrive()

    @cute.jit
    def _next_ticket(self, q: Int32, ticket_q, ticket_bars, taken: Int32):
        """A consumer's ticket after q and its count of ring uses: the producer's next ticket
        from the smem ring (dynamic_tickets, use ``taken``) or the static stride."""
        if const_expr(self.dynamic_tickets):
            q = ticket_ring_read(ticket_q, ticket_bars, taken)
            taken += 1
        else:
            q += self.num_compute_ctas
        return q, taken

    @cute.jit
    def _epi_subtiles(self, ttype: Int32) -> Int32:
        acc_n = self.tile_n // self.epi_tile[1]
        n = Int32(acc_n)
        if ttype == int(TaskType.FC1) or ttype == int(TaskType.SHARED_FC1):
            n = Int32(acc_n // 2)
        return n * (TILE_M // self.epi_tile[0])

    @cute.jit
    def _store_tile(self, epi, tma_atom, t_out, m_tile: Int32, n_tile: Int32, rank: Int32,
                    swiglu: cutlass.Constexpr[bool], subtiles: Int32, barrier, store_pipeline,
                    is_store_warp, buf_base=0):
        """The task's output tile of ``t_out`` (rows, columns, rank) through the GEMM's
        epilogue (``gemm_sm90.store_tile_epilogue``)."""
        tile_m, tile_n, _ = self.tile_shape_mnk
        out_tile_n = tile_n // 2 if const_expr(swiglu) else tile_n
        g_out = cute.local_tile(t_out, (tile_m, out_tile_n), (None, None, None))
        store_tile_epilogue(epi, tma_atom, g_out[(None, None, m_tile, n_tile, rank)], self.epi_tile,
                            self.epi_stages, tile_n, swiglu, buf_base, subtiles, barrier,
                            store_pipeline, is_store_warp, self.one_epilogue_barrier)

    # ------------------------------------------------------------------ compute: k-sum
    @cute.jit
    def _ksum(self, ctx, tasks, counter_offsets, counters, error, num_tiles, peer_bases,
              topk_weights, topk_idx, slot_rows, ring_y, out, shared_y, timeline_buf,
              index: Int32, rank: Int32, consumer_tidx: Int32, barrier, ksum_stage,
              ttype: Int32 = None, warps: cutlass.Constexpr[int] = 8, first_warp=0):
        """out[t] = bf16(fp32(shared[t]) + sum_k fp32(w[t,k]) * fp32(combine[t*K+k])),
        ascending k, product and sum rounded separately (the reference's order). A (t, k)
        whose expert id is out of range was routed nowhere: it contributes zero.
        With no comm CTA the BARRIER comes here too (``ttype``): it has no rows and waits for
        its FC2 tiles only (a branch of its own in the task loop made ptxas serialise the
        wgmmas, C7520; runs 104-105)."""
        if const_expr(self.num_comm_ctas == 0):
            # the BARRIER's range of FC2 counters is shared by all the task's threads: one
            # thread reading qwen3's 1024 of them one after another took ~200 us (run 106)
            barrier_task = ttype == int(TaskType.BARRIER)
            if barrier_task:
                self._wait_task_recorded(ctx, tasks, counter_offsets, counters, error,
                                         num_tiles, index, rank, timeline_buf,
                                         int(Role.COMPUTE), consumer_tidx == 0, None,
                                         consumer_tidx, warps * 32)
            elif consumer_tidx == 0:
                self._ksum_waits(ctx, tasks, counter_offsets, counters, error, num_tiles,
                                 peer_bases, timeline_buf, index, rank)
        elif consumer_tidx == 0:
            self._ksum_waits(ctx, tasks, counter_offsets, counters, error, num_tiles,
                             peer_bases, timeline_buf, index, rank)
        barrier.arrive_and_wait()
        lane = cute.arch.lane_idx()
        warp = consumer_tidx // 32  # among the ``warps`` that run this task
        combine_base = self._combine_base(ctx, peer_bases, rank)
        for t in cutlass.range(tasks[index, W_ROW_BEGIN] + warp, tasks[index, W_ROW_END], warps,
                               unroll=1):
            self._ksum_token(ctx, rank, t, combine_base, peer_bases, topk_weights, topk_idx,
                             slot_rows, ring_y, out, shared_y, lane, first_warp + warp,
                             ksum_stage, self.ksum_staged)

    @cute.jit
    def _ksum_waits(self, ctx, tasks, counter_offsets, counters, error, num_tiles, peer_bases,
                    timeline_buf, index: Int32, rank: Int32):
        """One thread: a KSUM's waits (BARRIER_DONE, the shared expert's tile), then every
        peer's BARRIER flag for this epoch."""
        self._wait_task_recorded(ctx, tasks, counter_offsets, counters, error, num_tiles,
                                 index, rank, timeline_buf, int(Role.COMPUTE), True)
        for p in cutlass.range(cute.size(peer_bases, mode=[1]), unroll=1):
            self._wait_flag(ctx, peer_bases, error, rank, p, 2 * ctx.epoch, index)

    @cute.jit
    def _combine_base(self, ctx, peer_bases, rank: Int32) -> Int64:
        """Address of ``rank``'s own combine buffer (the y rows its peers pushed to it)."""
        return peer_bases[rank, ctx.rank_base + rank] + ctx.combine_offset

    @cute.jit
    def _ksum_token(self, ctx, rank: Int32, t: Int32, combine_base: Int64, peer_bases,
                    topk_weights, topk_idx, slot_rows, ring_y, out, shared_y, lane: Int32,
                    warp: Int32, ksum_stage, staged: cutlass.Constexpr[bool]):
        """One token's output row by one warp (the KSUM tasks): the K weights and
        y-row addresses (0: routed nowhere, contributes 0; ``combine_base`` from
        ``_combine_base``, read once per caller), then the fixed-order sum, through smem
        (``staged``, stage slots of ``warp``) or with the loads in registers."""
        hidden = cute.size(out, mode=[2])
        h_vecs = hidden // VEC_ELEMS
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        row_bytes = Int64(hidden) * 2
        num_experts = cute.size(peer_bases, mode=[1]) * ctx.local_experts
        weights = cute.make_rmem_tensor((self.top_k,), Float32)
        srcs = cute.make_rmem_tensor((self.top_k,), Int64)
        for k in cutlass.range_constexpr(self.top_k):
            weights[k] = Float32(0.0)
            srcs[k] = Int64(0)
            expert = topk_idx[rank, t, k]
            if expert >= 0 and expert < num_experts:
                weights[k] = topk_weights[rank, t, k]
                srcs[k] = self._ksum_row(combine_base, slot_rows, ring_y, rank, t, k, row_bytes)
        out_row = out[rank, t, None]
        if const_expr(staged):
            shared_row = Int64(0)
            if const_expr(self.has_shared):
                shared_row = shared_y[t, None, rank].iterator.toint()
            self._ksum_token_staged(srcs, weights, shared_row, out_row, h_vecs, lane, warp,
                                    ksum_stage)
        else:
            # every load of a step is issued before any is summed (memory-level parallelism)
            unroll = k_sum_unroll(self.top_k, self.ksum_vectors)
            for v0 in cutlass.range(lane, h_vecs, 32 * unroll, unroll=1):
                ys = cute.make_rmem_tensor((VEC_ELEMS, unroll, self.top_k), BFloat16)
                base = cute.make_rmem_tensor((VEC_ELEMS, unroll), BFloat16)
                for u in cutlass.range_constexpr(unroll):
                    if v0 + 32 * u < h_vecs:
                        for k in cutlass.range_constexpr(self.top_k):
                            if srcs[k] != 0:
                                cute.copy(vec, cute.local_tile(bf16_row(srcs[k], hidden), (VEC_ELEMS,),
                                                               (v0 + 32 * u,)), ys[None, u, k])
                            else:
                                ys[None, u, k].fill(0.0)
                        if const_expr(self.has_shared):
                            cute.copy(vec, cute.local_tile(shared_y[t, None, rank], (VEC_ELEMS,),
                                                           (v0 + 32 * u,)), base[None, u])
                for u in cutlass.range_constexpr(unroll):
                    if v0 + 32 * u < h_vecs:
                        res = k_sum_vector(ys, base, weights, u, self.top_k, self.has_shared)
                        cute.copy(vec, res, cute.local_tile(out_row, (VEC_ELEMS,), (v0 + 32 * u,)))

    @cute.jit
    def _ksum_token_staged(self, srcs, weights, shared_row: Int64, out_row, h_vecs: Int32,
                           lane: Int32, warp: Int32, ksum_stage):
        """ksum_staged: one token's output row by one warp. Each step a lane lands up to
        ``ksum_stage_vectors`` 16-B vectors (its K rows' and the shared row's) in its own smem
        slots with cp.async, waits for its own copies, then sums them exactly as the register
        path does (``k_sum_vector``: same order, same bits)."""
        nk = self.top_k + (1 if const_expr(self.has_shared) else 0)
        steps = self.ksum_stage_vectors // nk
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        lane_base = (ksum_stage.toint() + warp * (self.ksum_stage_vectors * 32 * 16)
                     + lane * 16)  # slot j of this lane: lane_base + j * 512 bytes

        for v0 in cutlass.range(lane, h_vecs, 32 * steps, unroll=1):
            for u in cutlass.range_constexpr(steps):
                if v0 + 32 * u < h_vecs:
                    for k in cutlass.range_constexpr(self.top_k):
                        if srcs[k] != 0:
                            nvvm.cp_async_shared_global(_smem_vec(lane_base, u * nk + k),
                                                        _gmem_vec(srcs[k], v0 + 32 * u), 16, "cg")
                    if const_expr(self.has_shared):
                        nvvm.cp_async_shared_global(_smem_vec(lane_base, u * nk + self.top_k),
                                                    _gmem_vec(shared_row, v0 + 32 * u), 16, "cg")
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)  # this lane's own copies: no other lane reads them
            for u in cutlass.range_constexpr(steps):
                if v0 + 32 * u < h_vecs:
                    ys = cute.make_rmem_tensor((VEC_ELEMS, 1, self.top_k), BFloat16)
                    base = cute.make_rmem_tensor((VEC_ELEMS, 1), BFloat16)
                    for k in cutlass.range_constexpr(self.top_k):
                        if srcs[k] != 0:
                            cute.copy(vec, cute.make_tensor(_smem_vec(lane_base, u * nk + k),
                                                            cute.make_layout(VEC_ELEMS)), ys[None, 0, k])
                        else:
                            ys[None, 0, k].fill(0.0)
                    if const_expr(self.has_shared):
                        cute.copy(vec, cute.make_tensor(_smem_vec(lane_base, u * nk + self.top_k),
                                                        cute.make_layout(VEC_ELEMS)), base[None, 0])
                    res = k_sum_vector(ys, base, weights, 0, self.top_k, self.has_shared)
                    cute.copy(vec, res, cute.local_tile(out_row, (VEC_ELEMS,), (v0 + 32 * u,)))

    @cute.jit
    def _ksum_row(self, combine_base: Int64, slot_rows, ring_y, rank: Int32, t, k: int,
                  row_bytes: Int64) -> Int64:
        """Address of the y row of slot (t, k): the combine buffer, or with local_direct the
        ring row itself when the slot's expert is this rank's."""
        addr = combine_base + (Int64(t) * self.top_k + k) * row_bytes
        if const_expr(self.local_direct):
            row = slot_rows[rank, t * self.top_k + k]
            if row >= 0:
                addr = ring_y[row, None, rank].iterator.toint()
        return addr


def _smem_vec(lane_base, j: int):
    """ksum_staged: a lane's smem slot j (16 B; the 32 lanes' slots j are adjacent)."""
    return cute.make_ptr(BFloat16, lane_base + j * 512, cute.AddressSpace.smem, assumed_align=16)


def _gmem_vec(addr: Int64, v):
    """The 16-B vector v of the bf16 row at ``addr``."""
    return cute.make_ptr(BFloat16, addr + Int64(v) * 16, cute.AddressSpace.gmem, assumed_align=16)


def g_stages(mk: MegakernelSm90) -> int:
    return mk.gemm.ab_stages


@cute.jit
def _pipeline_state(kind: cutlass.Constexpr, stages: cutlass.Constexpr[int], count: Int32):
    """The pipeline state after ``count`` stages, built fresh (never carried through a
    run-time branch: see AGENTS.md)."""
    phase = (count // stages) % 2
    if const_expr(kind == pipeline.PipelineUserType.Producer):
        phase = phase ^ 1
    return pipeline.PipelineState(stages, count, count % stages, phase)


class _TmaLoads:
    """The compute producer's TMA atoms with their (global, smem) partitions, built once per
    CTA: routed x / h rows and gate / up / down weights, then the shared expert's (None
    without one)."""

    _NAMES = ("a_x", "a_h", "wg", "wu", "wd", "sh_a_x", "sh_a_h", "sh_wg", "sh_wu", "sh_wd")

    def __init__(self, *triples):
        for i, name in enumerate(self._NAMES):
            atom, g, s = triples[3 * i: 3 * i + 3]
            setattr(self, name, atom)
            setattr(self, f"g_{name}", g)
            setattr(self, f"s_{name}", s)


# ---------------------------------------------------------------------- ticket ring
# dynamic_tickets: TICKET_SLOTS compute tickets in smem (``ticket_q``), with TICKET_SLOTS full
# mbarriers then TICKET_SLOTS empty ones (``bars``). Lane 0 of the producer's warp 0 writes a
# slot and arrives on its full barrier; every reader warp reads it and its lane 0 arrives on
# the empty one. Use k of the ring is slot k % TICKET_SLOTS in phase (k // TICKET_SLOTS) & 1.
@cute.jit
def ticket_ring_init(bars, reader_warps: cutlass.Constexpr[int]):
    for s in cutlass.range_constexpr(TICKET_SLOTS):
        cute.arch.mbarrier_init(bars + s, 1)
        cute.arch.mbarrier_init(bars + TICKET_SLOTS + s, reader_warps)
    cute.arch.mbarrier_init_fence()


@cute.jit
def ring_wait_empty(bars, k: Int32):
    """The writer of ring use k: wait until every reader has given back the slot's last use."""
    cute.arch.mbarrier_wait(bars + TICKET_SLOTS + k % TICKET_SLOTS, ((k // TICKET_SLOTS) & 1) ^ 1)


@cute.jit
def ring_wait_full(bars, k: Int32):
    """A reader of ring use k: wait until the writer has published it."""
    cute.arch.mbarrier_wait(bars + k % TICKET_SLOTS, (k // TICKET_SLOTS) & 1)


@cute.jit
def ticket_ring_publish(ticket_q, bars, k: Int32, q: Int32):
    """One thread: wait until every reader is done with the slot's previous use, write q."""
    s = k % TICKET_SLOTS
    ring_wait_empty(bars, k)
    cute.make_tensor(ticket_q, cute.make_layout(TICKET_SLOTS))[s] = q
    cute.arch.mbarrier_arrive(bars + s)  # release: readers that see the phase see the write


@cute.jit
def ticket_ring_read(ticket_q, bars, k: Int32) -> Int32:
    """A whole warp: ticket use k."""
    s = k % TICKET_SLOTS
    ring_wait_full(bars, k)
    q = cute.make_tensor(ticket_q, cute.make_layout(TICKET_SLOTS))[s]
    cute.arch.sync_warp()
    if cute.arch.lane_idx() == 0:
        cute.arch.mbarrier_arrive(bars + TICKET_SLOTS + s)
    return q


# decoded_tickets: a slot holds DECODED_WORDS words (``_publish_task`` writes them), and a
# reader keeps its slot until it takes the next one: it reads the words while it runs the task.
@cute.jit
def task_ring_words(ticket_q, k: Int32, words: cutlass.Constexpr[int]):
    """The words of ring use k (``words`` per slot)."""
    return cute.make_tensor(ticket_q + (k % TICKET_SLOTS) * words, cute.make_layout(words))


@cute.jit
def task_ring_next(ticket_q, bars, k: Int32, words: cutlass.Constexpr[int]):
    """A whole reader warp: give back ring use k - 1, wait for use k; its (index, rank)."""
    if k > 0:
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(bars + TICKET_SLOTS + (k - 1) % TICKET_SLOTS)
    ring_wait_full(bars, k)
    slot = task_ring_words(ticket_q, k, words)
    return slot[D_INDEX], slot[D_RANK]


class _DirectA:
    """What the local_direct producer threads need besides the TMA partitions."""

    def __init__(self, row_peer, row_token, peer_bases, ring_x, sA_base, tidx, warp_idx):
        self.row_peer, self.row_token, self.peer_bases, self.ring_x = (
            row_peer, row_token, peer_bases, ring_x)
        self.sA_base, self.tidx, self.warp_idx = sA_base, tidx, warp_idx
        self.sync = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.PRODUCER),
                                          num_threads=128)


class _Context:
    """Per-launch run-time scalars, read once per thread. Carried through run-time loops as
    DSL values (the two ``__*_mlir_values__`` methods)."""

    _FIELDS = ("epoch", "rank_base", "tiles_per_minibatch", "x_offset", "combine_offset",
               "flags_offset", "deadline", "local_experts", "static_tiles", "silent_rank")
    _TYPES = (Int32, Int32, Int32, Int64, Int64, Int64, Int64, Int32, Int32, Int32)

    def __init__(self, scalars: cute.Tensor = None, now: Int64 = None, values=None):
        if values is None:
            words = [scalars[i] for i in range(SCALARS)]
            words[6] = now + words[6]  # timeout ns -> deadline
            values = [t(w) for t, w in zip(self._TYPES, words)]
        for name, v in zip(self._FIELDS, values):
            setattr(self, name, v)

    def __extract_mlir_values__(self):
        return [getattr(self, n).ir_value() for n in self._FIELDS]

    def __new_from_mlir_values__(self, values):
        return _Context(values=[t(v) for t, v in zip(self._TYPES, values)])

    def live_minibatches(self, tiles):
        return (tiles + self.tiles_per_minibatch - 1) // self.tiles_per_minibatch


# ---------------------------------------------------------------------- compile
SCALARS = 10


def compile_megakernel(num_ranks: int = 1, num_ctas: int = 132, num_comm_ctas: int = 16,
                       top_k: int = 8, has_shared: bool = False, scope: str = "gpu",
                       timeline: bool = False, copy: str = "vector", local_direct: bool = False,
                       rank_blocks: bool = False, dynamic_tickets: bool = False,
                       ksum_vectors: int = 8, copy_vectors: int = 0,
                       decoded_tickets: bool = False, store_warp_signals: bool = False,
                       ksum_staged: bool = False, pingpong: bool = False,
                       one_epilogue_barrier: bool = False, short_task_start: bool = False,
                       fence_fc1_only: bool = False, warp0_tma_stages: bool = False,
                       defer_signals: bool = False, release_only_publish: bool = False,
                       epi_n: int = 32, defer_flush_ktiles: int = 1,
                       strided_tickets: bool = False, arch: str = "sm_90a", options: str = ""):
    """Compile one static configuration on fake tensors (no GPU needed); every extent is a
    run-time value. The result takes torch tensors (TVM-FFI) in ``__call__``'s order."""
    mk = MegakernelSm90(num_ranks, num_ctas, num_comm_ctas, top_k, has_shared, scope, timeline, copy,
                        local_direct, rank_blocks, dynamic_tickets, ksum_vectors, copy_vectors,
                        decoded_tickets, store_warp_signals, ksum_staged, pingpong,
                        one_epilogue_barrier, short_task_start, fence_fc1_only,
                        warp0_tma_stages, defer_signals, release_only_publish, epi_n,
                        defer_flush_ktiles, strided_tickets)
    f = common.fake_strided_tensor
    kmaj = common.fake_kmajor_tensor
    sym = cute.sym_int32
    i32 = lambda *s: f(Int32, s, align_bytes=4)  # noqa: E731
    ranks, peers, cap, tiles = sym(), sym(), sym(divisibility=TILE_M), sym()
    ring, tokens = sym(divisibility=TILE_M), sym()
    hidden, inter = sym(divisibility=TILE_K), sym(divisibility=TILE_K)
    experts = sym()
    bf16 = BFloat16
    args = [
        i32(sym(), TASK_WORDS), i32(2, sym()), common.fake_vector(Int32, 2),
        i32(2, sym()), i32(2, sym()), common.fake_vector(Int32),
        i32(ranks, sym()), common.fake_vector(Int64, 1, align_bytes=8),
        common.fake_vector(Int32), i32(ranks, tiles), i32(ranks, cap), i32(ranks, cap),
        i32(ranks, cap), f(Int64, (ranks, peers), align_bytes=8),
        kmaj(bf16, (ring, hidden, ranks)), kmaj(bf16, (ring, inter, ranks)),
        kmaj(bf16, (ring, hidden, ranks)),
        kmaj(bf16, (inter, hidden, experts)), kmaj(bf16, (inter, hidden, experts)),
        kmaj(bf16, (hidden, inter, experts)),
    ]
    if has_shared:
        s_inter = sym(divisibility=TILE_K)
        args += [kmaj(bf16, (tokens, hidden, ranks)), kmaj(bf16, (s_inter, hidden, ranks)),
                 kmaj(bf16, (s_inter, hidden, ranks)), kmaj(bf16, (hidden, s_inter, ranks)),
                 kmaj(bf16, (tokens, s_inter, ranks)), kmaj(bf16, (tokens, hidden, ranks))]
    else:
        args += [None] * 6
    args += [f(Float32, (ranks, tokens, top_k), align_bytes=4),
             f(Int32, (ranks, tokens, top_k), align_bytes=4), i32(ranks, sym()),
             f(bf16, (ranks, tokens, hidden), align_bytes=16),
             common.fake_vector(Int64, align_bytes=8) if timeline else None,
             common.fake_vector(Int64, SCALARS, align_bytes=8), common.fake_stream()]
    return cute.compile(mk, *args, options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))
