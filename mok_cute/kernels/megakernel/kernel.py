"""The MoK megakernel for Hopper (sm_90a): one persistent launch per MoE layer call.

    comm CTAs     DISPATCH (pull x rows from their owner's symmetric buffer into the ring)
                  COMBINE  (push y rows to the source rank's combine buffer, slot token*K+k)
                  BARRIER  (after this rank's last combine: a unicast flag to every peer)
    compute CTAs  SHARED_FC1 / FC1  (gate+up GEMM, SwiGLU epilogue -> h)
                  SHARED_FC2 / FC2  (down GEMM, store epilogue -> y)
                  KSUM     (out[t] = bf16(shared[t] + sum_k w[t,k] * combine[t*K+k]), fixed k order)

The work is the ordered task list of ``mok_cute.tasks``; this kernel is its executor. CTA
``b < num_comm_ctas`` walks the COMM queue (``comm_tasks``), the others the COMPUTE queue
(``gemm_tasks``, ``ksum_tasks``), both through ``scheduler``. With ``num_comm_ctas = 0`` (one
rank reading its own rows in place) every CTA computes and runs the BARRIER as a compute
task. With ``R`` virtual ranks in one launch (``comm.virtual``) every rank's list is built
from the same static capacity, so their positions line up and every wait still points to a
lower ticket. With the IPC backend ``R = 1`` and the peers are other processes' launches.

Why it cannot deadlock: every CTA is resident (cooperative launch, one CTA per SM), each
takes its tickets in increasing order, and every wait points to a lower ticket. The lowest
unfinished ticket therefore waits on nothing unfinished and its CTA is running it. The only
cross-rank waits are KSUM's (every peer's BARRIER flag), which are lower tickets too.

Ordering: a reader of rows another CTA wrote acquires the counter, and a TMA reader then
issues ``fence.proxy.async.global``; a TMA writer waits for its stores, fences the async
proxy, then publishes with release.

Failures: every wait is bounded, from when it began (``MoKConfig.timeout_ms``). The first
wait that gives up writes (task, waiting rank, peer) into the error word and ends every other
wait; the tasks still run (on whatever rows arrived) and publish, so the launch ends promptly.
Nothing built from them reaches the output: a BARRIER whose launch has an error tells its
peers so through its sticky word, and a KSUM whose launch has an error, or whose peer's says so,
writes NaN rows. The host raises ``PeerTimeoutError`` (``mok_cute.megakernel``).

Cross-rank flags (the symmetric ``barrier_flags[2R]`` of every rank, ``constants``; flag ``s``
is written only by rank ``s``, two values per call so that it only grows): at launch start
rank ``s`` stores ``flag_started`` into every peer's flag ``s`` ("my x is ready and my previous
call is over"), and its BARRIER stores ``flag_done`` ("my combines into you are done"), after
this epoch into its sticky failed word ``R + s`` when its launch had an error. DISPATCH from
peer p and COMBINE into peer p wait for flag p >= flag_started; KSUM waits for every flag >=
flag_done, then reads the sticky words (a later call's flag satisfies the wait as well, and only
the sticky word still says that the call failed). No counter that a peer writes ever needs a
reset, and no NVLink multicast is used.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from mok_cute import fp8, jit
from mok_cute.constants import SCALARS, TASK_TILE_N, TILE_K, TILE_M, MegakernelSpec
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import GemmCoreSm90
from mok_cute.kernels.fp8_mainloop import PromotingMainloop
from mok_cute.kernels.row_epilogue import RowEpilogueMixin
from mok_cute.kernels.megakernel.comm_tasks import COMM_THREADS, CommTasks, Routing
from mok_cute.kernels.megakernel.fp8_tasks import Fp8Operands, Fp8Tasks
from mok_cute.kernels.megakernel.gemm_tasks import (PRODUCER_THREADS, DirectRows, GemmTasks,
                                                   SavedRows, TmaOperands, TmaStores)
from mok_cute.kernels.megakernel.ksum_tasks import KsumTasks
from mok_cute.kernels.megakernel.scheduler import (DECODED_WORDS, TICKET_SLOTS, Context,
                                                  SchedulerMixin, TaskTables, ticket_ring_init)
from mok_cute.tasks import TASK_WORDS


class MegakernelSm90(SchedulerMixin, CommTasks, GemmTasks, Fp8Tasks, KsumTasks, RowEpilogueMixin,
                     PromotingMainloop, GemmCoreSm90):
    """One persistent launch: dispatch, expert GEMMs, combine, barrier and k-sum.

    :param spec: the static configuration (``constants.MegakernelSpec``).
    """

    def __init__(self, spec: MegakernelSpec):
        GemmCoreSm90.__init__(self, TASK_TILE_N, pingpong=False)
        self.spec = spec
        self.save_preact = spec.save_preact  # the FC1 tasks' epilogue (row_epilogue)
        self.num_ranks = spec.num_ranks
        self.num_compute_ctas = spec.num_ctas - spec.num_comm_ctas
        # setmaxnreg moves registers within the CTA's launch allocation (168 x 384 threads =
        # 40 x 128 + 232 x 256): an increase that the pool cannot cover waits forever. The
        # ticket ring's state spills the rows-in-place producer at 40, so with the ring the
        # producer gets 48 and the consumers 224.
        if spec.ticket_ring:
            self.producer_regs, self.consumer_regs = 48, 224
        assert self.producer_regs * 128 + self.consumer_regs * 256 <= 168 * 384
        self.half_mma = None
        if spec.fp8:  # e4m3 k-tiles: 128 deep, the same 128 bytes a row as bf16's 64
            self.tile_shape_mnk = (TILE_M, TASK_TILE_N, fp8.GROUP)

    def _setup_attributes(self):
        super()._setup_attributes()
        self.bf16_mma = None
        if self.spec.fp8:
            self.half_mma = self.make_half_mma()
            if self.spec.has_shared:  # the shared expert's bf16 wgmmas
                major = cute.nvgpu.warpgroup.OperandMajorMode.K
                self.bf16_mma = sm90_utils.make_trivial_tiled_mma(
                    BFloat16, BFloat16, major, major, self.acc_dtype, self.atom_layout_mnk,
                    tiler_mn=(64, self.tile_shape_mnk[1]))

    def bf16_stage_views(self, storage):
        """fp8 with a shared expert: the A and B stages as bf16 (rows, 64) tiles, the same
        bytes a stage as the e4m3 (rows, 128) tiles. Traced inline."""
        tile_m, tile_n, _ = self.tile_shape_mnk
        views = []
        for field, rows in ((storage.sA, tile_m), (storage.sB, tile_n)):
            staged = self.staged_layout(BFloat16, (rows, TILE_K), self.ab_stages)
            ptr = cute.recast_ptr(field.data_ptr(), staged.inner, dtype=BFloat16)
            views.append(cute.make_tensor(ptr, staged.outer))
        return tuple(views)

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
                 preact: Optional[cute.Tensor], row_slot: Optional[cute.Tensor],
                 shared_preact: Optional[cute.Tensor], shared_rows: Optional[cute.Tensor],
                 h_exps: Optional[cute.Tensor], e_gate: Optional[cute.Tensor],
                 e_up: Optional[cute.Tensor], e_down: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        """Shapes (R ranks, P peers, E = R * E_loc experts, C ring rows, T tokens):
        tasks int32 (N, TASK_WORDS); queues int32 (2, Q); queue_len int32 (2,);
        queue_live_len int32 (2, MB + 1); queue_blocks int32 (2, MB + 1); counter_offsets
        int32 (G + 1,); counters int32 (R, num_counters + TICKETS), zero at launch; error
        int64 (1,); num_tiles int32 (R,); tile_expert int32 (R, tiles); row_peer / row_token /
        row_k int32 (R, capacity); peer_bases int64 (R, P); ring_x / ring_y bf16 (C, H, R);
        ring_h bf16 (C, I, R); w_gate / w_up (I, H, E); w_down (H, I, E); shared: x_all
        (T, H, R) (a view of the symmetric x), ws_gate / ws_up (Is, H, R), ws_down (H, Is, R),
        shared_h (T, Is, R), shared_y (T, H, R); topk_weights fp32 (R, T, K); topk_idx int32
        (R, T, K) (a (token, k) whose id is out of range contributes zero); slot_rows int32
        (R, T * K): the ring row of rank r's own slot (token, k) when its expert is r's, else
        -1 (read only with rows in place); out bf16 (R, T, H); scalars int64 (SCALARS,):
        ``constants.SCALAR_FIELDS`` (the silent rank is a test hook: that virtual rank never
        announces its start, like a peer whose process died; -1 in normal use). save_preact
        (else None): preact bf16 (rows, 2I, R), row_slot int32 (R, capacity) (each schedule
        row's preact row, -1: padding); shared: shared_preact bf16 (T, 2Is, R), shared_rows
        int32 (T,) (0 .. T - 1). fp8 (else None): ring_x, ring_h and the three weights are
        int8 views of e4m3 data (H', I': H, I rounded up to 128), ring_x's and ring_h's rows
        packed (``fp8.packed_row_bytes``: a row's exponents follow its data), h_exps int8
        (C, I'/128, R) the view of ring_h's exponents, e_gate / e_up (E, I'/128, H'/128) and
        e_down (E, H'/128, I'/128) the weights' block exponents."""
        self.a_dtype = self.b_dtype = self.c_dtype = BFloat16
        fp8_ring_x, fp8_ring_h = None, None  # fp8: the int8 views, for rows' addresses
        if const_expr(self.spec.fp8):
            fp8_ring_x, fp8_ring_h = ring_x, ring_h
            self.a_dtype = self.b_dtype = cutlass.Float8E4M3FN
            ring_x = cute.recast_tensor(ring_x, cutlass.Float8E4M3FN)
            ring_h = cute.recast_tensor(ring_h, cutlass.Float8E4M3FN)
            w_gate = cute.recast_tensor(w_gate, cutlass.Float8E4M3FN)
            w_up = cute.recast_tensor(w_up, cutlass.Float8E4M3FN)
            w_down = cute.recast_tensor(w_down, cutlass.Float8E4M3FN)
        self._setup_attributes()
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        a_box = cute.slice_(self.a_smem_layout_staged, (None, None, 0))
        half_box = (tile_n // 2, tile_k)
        half_layout = cute.slice_(self.staged_layout(self.b_dtype, half_box, 1), (None, None, 0))
        full_layout = cute.slice_(self.b_smem_layout_staged, (None, None, 0))
        epi_layout = cute.slice_(self.epi_smem_layout_staged, (None, None, 0))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        s2g = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        mk = cute.nvgpu.cpasync.make_tiled_tma_atom
        # Routed FC1: A = ring x, B = gate / up halves, C = ring h. FC2: A = ring h, B = down.
        tma_a_x, t_a_x = mk(g2s, ring_x, a_box, (tile_m, tile_k))
        tma_a_h, t_a_h = mk(g2s, ring_h, a_box, (tile_m, tile_k))
        tma_wg, t_wg = mk(g2s, w_gate, half_layout, half_box)
        tma_wu, t_wu = mk(g2s, w_up, half_layout, half_box)
        tma_wd, t_wd = mk(g2s, w_down, full_layout, (tile_n, tile_k))
        tma_st_h, t_st_h = None, None  # fp8: h leaves as e4m3 by generic stores
        if const_expr(not self.spec.fp8):
            tma_st_h, t_st_h = mk(s2g, ring_h, epi_layout, self.epi_tile)
        tma_st_y, t_st_y = mk(s2g, ring_y, epi_layout, self.epi_tile)
        shared_atoms = (None,) * 14
        if const_expr(self.spec.has_shared):
            # fp8: the shared expert stays bf16, its boxes over the same stage bytes
            sh_a_box, sh_half_box, sh_half_layout, sh_full_layout = (a_box, half_box,
                                                                     half_layout, full_layout)
            if const_expr(self.spec.fp8):
                sh_half_box = (tile_n // 2, TILE_K)
                sh_a_box, sh_half_layout, sh_full_layout = (
                    cute.slice_(self.staged_layout(BFloat16, box, 1), (None, None, 0))
                    for box in ((tile_m, TILE_K), sh_half_box, (tile_n, TILE_K)))
            s_a_x = mk(g2s, x_all, sh_a_box, (tile_m, TILE_K))
            s_a_h = mk(g2s, shared_h, sh_a_box, (tile_m, TILE_K))
            s_wg = mk(g2s, ws_gate, sh_half_layout, sh_half_box)
            s_wu = mk(g2s, ws_up, sh_half_layout, sh_half_box)
            s_wd = mk(g2s, ws_down, sh_full_layout, (tile_n, TILE_K))
            s_st_h = mk(s2g, shared_h, epi_layout, self.epi_tile)
            s_st_y = mk(s2g, shared_y, epi_layout, self.epi_tile)
            shared_atoms = (*s_a_x, *s_a_h, *s_wg, *s_wu, *s_wd, *s_st_h, *s_st_y)

        ticket_words = TICKET_SLOTS * (DECODED_WORDS if const_expr(self.spec.ticket_ring) else 1)

        self.shared_storage = self.make_shared_storage(extra_fields={
            "row_src": cute.struct.MemRange[cutlass.Int64, TILE_M],
            "row_dst": cute.struct.MemRange[cutlass.Int64, TILE_M],
            "comm_words": cute.struct.MemRange[Int32, 4],
            "ticket_q": cute.struct.MemRange[Int32, ticket_words],  # the ticket ring
            "ticket_full_empty": cute.struct.MemRange[cutlass.Int64, 2 * TICKET_SLOTS],
        })
        self.kernel(
            tasks, queues, queue_len, queue_live_len, queue_blocks, counter_offsets,
            counters, error, num_tiles, tile_expert, row_peer, row_token, row_k, peer_bases,
            ring_x, ring_y, topk_weights, topk_idx, slot_rows, out, shared_y, timeline_buf,
            scalars, preact, row_slot, shared_preact, shared_rows,
            fp8_ring_x, fp8_ring_h, h_exps, e_gate, e_up, e_down,
            tma_a_x, t_a_x, tma_a_h, t_a_h, tma_wg, t_wg, tma_wu, t_wu, tma_wd, t_wd,
            tma_st_h, t_st_h, tma_st_y, t_st_y, *shared_atoms,
            self.tiled_mma, self.a_smem_layout_staged, self.b_smem_layout_staged,
            self.epi_smem_layout_staged, self.half_mma, self.bf16_mma,
        ).launch(grid=[self.spec.num_ctas, 1, 1], block=[self.threads_per_cta, 1, 1],
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
               preact: Optional[cute.Tensor], row_slot: Optional[cute.Tensor],
               shared_preact: Optional[cute.Tensor], shared_rows: Optional[cute.Tensor],
               fp8_ring_x: Optional[cute.Tensor], fp8_ring_h: Optional[cute.Tensor],
               h_exps: Optional[cute.Tensor],
               e_gate: Optional[cute.Tensor], e_up: Optional[cute.Tensor],
               e_down: Optional[cute.Tensor],
               tma_a_x: cute.CopyAtom, t_a_x: cute.Tensor, tma_a_h: cute.CopyAtom, t_a_h: cute.Tensor,
               tma_wg: cute.CopyAtom, t_wg: cute.Tensor, tma_wu: cute.CopyAtom, t_wu: cute.Tensor,
               tma_wd: cute.CopyAtom, t_wd: cute.Tensor,
               tma_st_h: Optional[cute.CopyAtom], t_st_h: Optional[cute.Tensor], tma_st_y: cute.CopyAtom, t_st_y: cute.Tensor,
               s_tma_a_x: Optional[cute.CopyAtom], s_t_a_x: Optional[cute.Tensor],
               s_tma_a_h: Optional[cute.CopyAtom], s_t_a_h: Optional[cute.Tensor],
               s_tma_wg: Optional[cute.CopyAtom], s_t_wg: Optional[cute.Tensor],
               s_tma_wu: Optional[cute.CopyAtom], s_t_wu: Optional[cute.Tensor],
               s_tma_wd: Optional[cute.CopyAtom], s_t_wd: Optional[cute.Tensor],
               s_tma_st_h: Optional[cute.CopyAtom], s_t_st_h: Optional[cute.Tensor],
               s_tma_st_y: Optional[cute.CopyAtom], s_t_st_y: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma, a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout,
               half_mma: Optional[cute.TiledMma], bf16_mma: Optional[cute.TiledMma]):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        ctx = Context(scalars)
        tt = TaskTables(tasks, queues, queue_len, queue_live_len, queue_blocks, counter_offsets,
                        counters, error, num_tiles)
        routing = Routing(tile_expert, row_peer, row_token, row_k, slot_rows, peer_bases,
                          topk_weights, topk_idx)

        if const_expr(self.spec.timeline):
            if tidx == 0 and bidx == 0:
                common.timeline_mark_start(timeline_buf, common.timeline_now())

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # rows in place: FC1's A rows arrive by cp.async from the 128 producer threads
        ab_pipeline = self.make_ab_pipeline(
            storage, a_smem_layout_staged, b_smem_layout_staged,
            producer_threads=1 + (PRODUCER_THREADS if self.spec.rows_in_place else 0))
        # the ticket ring's slots and its full / empty mbarriers
        ticket_q, ticket_bars = storage.ticket_q.data_ptr(), storage.ticket_full_empty.data_ptr()
        if const_expr(self.spec.ticket_ring):
            if tidx == 0:
                # readers: the consumer warps and the producer warps (all four with rows in
                # place, else warp 0 alone), warp 0 the writer too
                ticket_ring_init(ticket_bars, self.num_mma_threads // 32
                                 + (4 if const_expr(self.spec.rows_in_place) else 1))
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        # x rows as the comm copies and the producer gathers them: bf16, or fp8's packed rows
        x_rows = ring_x
        fp8_ops = None
        if const_expr(self.spec.fp8):
            x_rows = fp8_ring_x
            fp8_ops = Fp8Operands(fp8_ring_x, fp8_ring_h, h_exps, e_gate, e_up, e_down)
        if bidx < self.spec.num_comm_ctas:
            self._announce_start(ctx, peer_bases, tidx)
            if tidx < COMM_THREADS:
                self.comm_loop(ctx, tt, routing, x_rows, ring_y, timeline_buf, storage, tidx)
        else:
            sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
            sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
            sC = storage.sC.get_tensor(epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner)
            bf16_stages = (sA, sB)  # the shared expert's bf16 stages (fp8: over the same bytes)
            if const_expr(self.spec.fp8 and self.spec.has_shared):
                bf16_stages = self.bf16_stage_views(storage)
            warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
            compute_cta = bidx - self.spec.num_comm_ctas
            ops = TmaOperands(tma_a_x, t_a_x, tma_a_h, t_a_h, tma_wg, t_wg, tma_wu, t_wu, tma_wd,
                              t_wd, s_tma_a_x, s_t_a_x, s_tma_a_h, s_t_a_h, s_tma_wg, s_t_wg,
                              s_tma_wu, s_t_wu, s_tma_wd, s_t_wd)
            if warpgroup_idx == 0:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if const_expr(self.spec.rows_in_place):
                    # all four producer warps: they gather FC1's local A rows themselves
                    # the A rows land as 16-byte chunks at bf16 offsets (fp8: the same bytes)
                    sA_base = storage.sA.data_ptr()
                    if const_expr(self.spec.fp8):
                        sA_base = cute.recast_ptr(sA_base, dtype=BFloat16)
                    self.producer_loop(ctx, tt, routing, ab_pipeline, ops, sA, sB, x_rows,
                                       compute_cta, ticket_q, ticket_bars, timeline_buf,
                                       DirectRows(sA_base, tidx, warp_idx), bf16_stages)
                elif warp_idx == self.load_warp:
                    for atom in (tma_a_x, tma_a_h, tma_wg, tma_wu, tma_wd):
                        cute.nvgpu.cpasync.prefetch_descriptor(atom)
                    self.producer_loop(ctx, tt, routing, ab_pipeline, ops, sA, sB, x_rows,
                                       compute_cta, ticket_q, ticket_bars, timeline_buf, None,
                                       bf16_stages)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                stores = TmaStores(tma_st_h, t_st_h, tma_st_y, t_st_y, s_tma_st_h, s_t_st_h,
                                   s_tma_st_y, s_t_st_y)
                self.consumer_loop(ctx, tt, routing, ring_y, out, shared_y, timeline_buf,
                                   ab_pipeline, tiled_mma, sA, sB, sC, stores, tidx, warp_idx,
                                   warpgroup_idx, compute_cta, ticket_q, ticket_bars,
                                   storage.sB.data_ptr(),
                                   SavedRows(preact, row_slot, shared_preact, shared_rows),
                                   fp8_ops, half_mma, bf16_stages, bf16_mma)


# ---------------------------------------------------------------------- compile
def compile_megakernel(arch: str = "sm_90a", options: str = "", **spec_fields):
    """Compile one static configuration (``MegakernelSpec(**spec_fields)``) on fake tensors
    (no GPU needed); every extent is a run-time value. The result takes torch tensors
    (TVM-FFI) in ``__call__``'s order."""
    spec = MegakernelSpec(**spec_fields)
    mk = MegakernelSm90(spec)
    f = common.fake_strided_tensor
    kmaj = common.fake_kmajor_tensor
    sym = cute.sym_int32
    i32 = lambda *s: f(Int32, s, align_bytes=4)  # noqa: E731
    ranks, peers, cap, tiles = sym(), sym(), sym(divisibility=TILE_M), sym()
    ring, tokens = sym(divisibility=TILE_M), sym()
    hidden, inter = sym(divisibility=TILE_K), sym(divisibility=TILE_K)
    experts = sym()
    bf16 = BFloat16
    top_k = spec.top_k
    args = [
        i32(sym(), TASK_WORDS), i32(2, sym()), common.fake_vector(Int32, 2),
        i32(2, sym()), i32(2, sym()), common.fake_vector(Int32),
        i32(ranks, sym()), common.fake_vector(Int64, 1, align_bytes=8),
        common.fake_vector(Int32), i32(ranks, tiles), i32(ranks, cap), i32(ranks, cap),
        i32(ranks, cap), f(Int64, (ranks, peers), align_bytes=8),
    ]
    fp8_args = [None] * 4
    if spec.fp8:  # e4m3 data as int8 views, H' and I' multiples of 128, packed ring rows
        i8 = cutlass.Int8
        hidden_p, inter_p = sym(divisibility=fp8.GROUP), sym(divisibility=fp8.GROUP)
        args += [kmaj(i8, (ring, hidden_p, ranks)), kmaj(i8, (ring, inter_p, ranks)),
                 kmaj(bf16, (ring, hidden, ranks)),
                 kmaj(i8, (inter_p, hidden_p, experts)), kmaj(i8, (inter_p, hidden_p, experts)),
                 kmaj(i8, (hidden_p, inter_p, experts))]
        exps = lambda *shape, mode=-1: f(i8, shape, contiguous_mode=mode, align_bytes=1)  # noqa: E731
        fp8_args = [exps(ring, sym(), ranks, mode=1), exps(experts, sym(), sym()),
                    exps(experts, sym(), sym()), exps(experts, sym(), sym())]
    else:
        args += [kmaj(bf16, (ring, hidden, ranks)), kmaj(bf16, (ring, inter, ranks)),
                 kmaj(bf16, (ring, hidden, ranks)),
                 kmaj(bf16, (inter, hidden, experts)), kmaj(bf16, (inter, hidden, experts)),
                 kmaj(bf16, (hidden, inter, experts))]
    if spec.has_shared:
        s_inter = sym(divisibility=TILE_K)
        args += [kmaj(bf16, (tokens, hidden, ranks)), kmaj(bf16, (s_inter, hidden, ranks)),
                 kmaj(bf16, (s_inter, hidden, ranks)), kmaj(bf16, (hidden, s_inter, ranks)),
                 kmaj(bf16, (tokens, s_inter, ranks)), kmaj(bf16, (tokens, hidden, ranks))]
    else:
        args += [None] * 6
    args += [f(Float32, (ranks, tokens, top_k), align_bytes=4),
             f(Int32, (ranks, tokens, top_k), align_bytes=4), i32(ranks, sym()),
             f(bf16, (ranks, tokens, hidden), align_bytes=16),
             common.fake_vector(Int64, align_bytes=8) if spec.timeline else None,
             common.fake_vector(Int64, SCALARS, align_bytes=8)]
    if spec.save_preact:  # g | u rows (their count and I on the host), the row maps
        args += [kmaj(bf16, (sym(), sym(divisibility=16), ranks)), i32(ranks, cap)]
        args += ([kmaj(bf16, (tokens, sym(divisibility=16), ranks)), common.fake_vector(Int32)]
                 if spec.has_shared else [None, None])
    else:
        args += [None] * 4
    args += fp8_args
    args.append(common.fake_stream())
    return cute.compile(mk, *args, options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))
