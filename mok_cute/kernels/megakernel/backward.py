"""The backward megakernel for Hopper (sm_90a): one persistent launch runs a rank's routed
dgrads and weight gradients as tasks of the backward task list (``mok_cute.tasks_backward``).

    FC2_DGRAD (j, n)  dY rows of M-tile j @ W_down[e] (K = H), the dgated epilogue
                      (``row_epilogue``): dG | dU, w * h and the rows' partials of N-tile n
    FC1_DGRAD (j, n)  [dG | dU] rows of M-tile j @ [W_gate; W_up][e] (K = 2I: the gate
                      weights' k-tiles, then the up weights'): dx rows, H N-tile n;
                      waits until every FC2_DGRAD N-tile of M-tile j has published

Both kinds are 128 x 256 x 64 cooperative tiles on one GEMM core configuration (A K-major,
B MN-major: the weights as stored, read transposed), so one stage ring and one tiled MMA
serve both; FC1_DGRAD's store epilogue uses the first of dgated's three output buffers. Up to
H = ``constants.FC2_DGRAD_PINGPONG_MAX_K`` (``fc2_pingpong``) FC2_DGRAD runs instead as the
one-GPU launch does there, pingpong 128 x 128 tiles on a ring of its own (``backward_fc2``),
a phase before the cooperative tasks.
The weight gradients (WGRAD_DOWN, WGRAD_GATE_UP: ``backward_wgrad``) run ``gemm_wgrad``'s
tiles on the same stages, after a CTA's dgrads; each waits until every FC2_DGRAD of its
expert's M-tiles has published (the range read from the schedule's expert offsets).
The tiles, their k order and their epilogues are those of ``expert_backward``'s two dgrad
launches, so the outputs are bitwise the same. The host queues one minibatch (every FC2_DGRAD
before any FC1_DGRAD: interleaving them put twice the weights in flight and measured slower),
so what the one launch adds is that the first FC1_DGRAD tiles start while the last FC2_DGRAD
tiles still run (no launch boundary).

Walk (``backward_walk``): every CTA takes the dgrads' compute-queue positions
``b, b + grid, ...`` inside the live prefix (``queue_live_len`` of the live minibatch count;
static tickets: every warp resolves its own), a dgrad whose M-tile is past ``num_tiles``
skipped (nothing waits on it).
Then the weight gradients by tickets from one counter (``backward_wgrad``: the load warp's
lane 0 takes them and hands them to the consumer warps through a smem ring), so the tiles
running at any time are consecutive positions of the tail, as in a ``gemm_wgrad`` launch,
however far apart the CTAs finished their dgrads (measured 1.01-1.06 x the static walk's
speed on four of the five shapes, 0.97 x on qwen3_30b; docs/measurements.md). Deadlock-free:
every CTA is resident, takes its dgrad positions in increasing order, every dgrad wait points
to a lower position, and the weight gradients wait on dgrads only.

Ordering: FC2_DGRAD's store warp waits for its TMA stores to land, fences the async proxy
and publishes ``DGATED[j]`` with release; FC1_DGRAD's producer acquires it and fences the
async proxy before its TMA loads read dG | dU. The store warp is an MMA warp, so the wait and
the publish move to after the CTA's next mainloop (where the stores have long landed) when no
held publish can be what that mainloop waits for, directly or through another CTA (the defer
rule): the next task waits on nothing or on the comm CTAs' pulls (PULLED: a pull waits on
nothing, and each comm CTA's walk has every pull before every push), or this task's counter
is one that no dgrad waits on (DX_DONE, SHARED_DX: FC1_DGRAD's, read by the pushes and the
k-sums). A held DGATED is thus released after a mainloop that cannot block, and a held DX_DONE
after one whose DGATED waits are all released in turn. The wider rule "unless the next task
waits on this task's group" deadlocked with the shared expert (FC2_DGRAD holding DGATED before
a SHARED_FC1_DGRAD while another CTA's SHARED_FC2_DGRAD held SHARED_DGATED before an
FC1_DGRAD: found by a simulation of the static walk). The consumers take each dgrad's decoded
words from the load warp, which decodes one task ahead, through a smem ring
(``backward_walk``'s ``_publish_dgrad``), not from global memory between tasks. Waits are
bounded (``timeout_ns``); the first that gives up writes the error word, which the host
raises (``mok_cute.errors``).

Over a group (``comm_ctas`` > 0) CTAs after the compute ones run the comm tasks
(``backward_comm``): REVERSE_COMBINE / REPULL_X pull the rows FC2_DGRAD and the gate / up
weight gradients wait on, REVERSE_DISPATCH pushes a tile's dx rows and partial sums once its
FC1_DGRAD tiles have published; the dgated partials are fenced by a barrier of their threads
before the publish (a comm CTA reads them).

With the group tail (``ksum_top_k``, one rank per process: ``backward_tail``) the comm CTAs also
pass the group's barriers, and the k-sums go by ticket to whichever CTA is free, the compute
CTAs' consumer warps once their weight-gradient tickets run out.

The shared expert's backward runs as tasks of the launch too (``shared``: ``backward_shared``),
and the ``timeline`` build records every task's span (``backward_recorder``).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from mok_cute import jit
from mok_cute.constants import (BACKWARD_COMM_SCALARS, BACKWARD_TILE_N,
                                FC2_DGRAD_PINGPONG_TILE_N, SCALARS, TILE_K, TILE_M)
from mok_cute.kernels import common
from mok_cute.kernels.gemm_core import GemmCoreSm90, pipeline_state, tma_tiles
from mok_cute.kernels.gemm_wgrad import adds_by_load
from mok_cute.kernels.megakernel.backward_comm import BackwardCommMixin, PeerRows
from mok_cute.kernels.megakernel.backward_fc2 import (FC2_STAGES, Fc2PingpongForm,
                                                      Fc2PingpongTasksMixin)
from mok_cute.kernels.megakernel.backward_recorder import (COMPUTE, EPILOGUE,
                                                            MARKS_PER_WARPGROUP, START,
                                                            BackwardRecorderMixin, Recorder)
from mok_cute.kernels.megakernel.backward_shared import (SHARED_FC1_DGRAD, SHARED_FC2_DGRAD,
                                                         SharedOperands, SharedTasksMixin)
from mok_cute.kernels.megakernel.backward_tail import BackwardTailMixin, GroupTail
from mok_cute.kernels.megakernel.backward_walk import BackwardWalkMixin
from mok_cute.kernels.megakernel.backward_wgrad import WgradForm, WgradTasksMixin
from mok_cute.kernels.megakernel.scheduler import (D_SIGNAL, DECODED_WORDS, TICKET_SLOTS,
                                                   Context, ring_words, ticket_ring_init)
from mok_cute.kernels.row_epilogue import RowEpilogueMixin
from mok_cute.tasks_backward import (BACKWARD_TASK_WORDS, BackwardCounter, BackwardTaskType,
                                     BackwardWord)

# scalars int64: the wait bound, the minibatch size in M-tiles (the live prefix), the queue
# position where the tail (weight gradients, by ticket) begins, the queue's length, its
# FC2_DGRAD count (the pingpong phase's end), the comm queue position where the KSUMs (by
# ticket) begin
BACKWARD_SCALARS = 6


class BackwardMegakernelSm90(BackwardWalkMixin, Fc2PingpongTasksMixin, WgradTasksMixin,
                             BackwardCommMixin, BackwardTailMixin, SharedTasksMixin,
                             BackwardRecorderMixin, RowEpilogueMixin, GemmCoreSm90):
    """One launch of a rank's routed dgrads and weight gradients (module docstring).

    :param num_ctas: compute CTAs (the walk's stride); with ``comm_ctas`` one per SM.
    :param fc2_pingpong: FC2_DGRAD as pingpong 128 x 128 tiles (``backward_fc2``), else as
        the cooperative 128 x 256 tiles of FC1_DGRAD.
    :param comm_ctas: CTAs after the compute ones that run the comm tasks (``backward_comm``:
        the rows pulled from and pushed to the group's symmetric buffers); 0: the rows are
        in place before the launch, read after it.
    :param ksum_top_k: > 0 (with ``comm_ctas``): the group tail (``backward_tail``: the
        group's barriers and the k-sums of d_x and d_topk over this many slots a token, on
        the comm CTAs); 0: the barriers and k-sums are the caller's.
    :param ksum_shared: the k-sum adds a shared expert's dx row to each token.
    :param shared: the shared expert's backward as tasks of the launch
        (``backward_shared``); with the group tail its k-sums wait for its dx rows.
    :param accumulate_wgrads: the weight gradients (the shared expert's too) are added into
        fp32 outputs (the weights' ``main_grad``) instead of stored in bf16.
    :param main_grad_add: how ``accumulate_wgrads`` adds: "reduce" (TMA reduce-add) or "load"
        (main_grad read into registers, plain TMA stores), as ``gemm_wgrad``'s.
    :param timeline: the recorder build (``backward_recorder``): every task's span into the
        ``timeline_buf`` argument.

    The load warp, which decodes each dgrad one task ahead, hands its words to the consumer
    warps through a smem ring (the forward's ticket ring, ``scheduler``; ``backward_walk``):
    the consumers do not decode it again from global memory (queue, task row, counter
    offsets: dependent loads) between two tasks.
    """

    def __init__(self, num_ctas: int = 132, fc2_pingpong: bool = False, comm_ctas: int = 0,
                 ksum_top_k: int = 0, ksum_shared: bool = False, shared: bool = False,
                 accumulate_wgrads: bool = False, timeline: bool = False,
                 main_grad_add: str = "reduce"):
        GemmCoreSm90.__init__(self, BACKWARD_TILE_N, pingpong=False, b_mn_major=True,
                              epi_outputs=3)
        self.save_preact = False  # row_epilogue: only the dgated visit runs here
        self.num_ctas = num_ctas
        self.fc2_pingpong = fc2_pingpong
        self.comm_ctas = comm_ctas
        self.ksum_top_k = ksum_top_k if comm_ctas > 0 else 0
        self.ksum_shared = ksum_shared and self.ksum_top_k > 0
        self.shared = shared
        self.accumulate_wgrads = accumulate_wgrads
        self.wgrad_adds_by_load = adds_by_load(accumulate_wgrads, main_grad_add)
        self.timeline = timeline
        # the register split stays 40 / 232: the dgated epilogue spills at 216 and below
        # (ptxas, swept offline)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, tasks: cute.Tensor, queue: cute.Tensor, queue_live_len: cute.Tensor,
                 counter_offsets: cute.Tensor, counters: cute.Tensor, error: cute.Tensor,
                 num_tiles: cute.Tensor, tile_expert: cute.Tensor, d_rows: cute.Tensor,
                 w_down: cute.Tensor, d_preact: cute.Tensor, w_gate: cute.Tensor,
                 w_up: cute.Tensor, d_gate: cute.Tensor, d_up: cute.Tensor, hw: cute.Tensor,
                 dx_rows: cute.Tensor, preact: cute.Tensor, row_slot: cute.Tensor,
                 weights: cute.Tensor, partials: cute.Tensor, scalars: cute.Tensor,
                 expert_offsets: cute.Tensor, dg_rows_t: cute.Tensor, du_rows_t: cute.Tensor,
                 x_rows_t: cute.Tensor, dy_rows_t: cute.Tensor, hw_rows_t: cute.Tensor,
                 dw_gate: cute.Tensor, dw_up: cute.Tensor, dw_down: cute.Tensor,
                 comm_queue: cute.Tensor, row_peer: cute.Tensor, row_token: cute.Tensor,
                 row_k: cute.Tensor, peer_bases: cute.Tensor, comm_scalars: cute.Tensor,
                 d_rows_plain: cute.Tensor, x_rows_plain: cute.Tensor,
                 dx_rows_plain: cute.Tensor, group_scalars: cute.Tensor,
                 topk_idx: cute.Tensor, shared_dx: cute.Tensor, d_x: cute.Tensor,
                 d_topk: cute.Tensor, s_d_rows: cute.Tensor, s_w_down: cute.Tensor,
                 s_d_preact: cute.Tensor, s_w_gate: cute.Tensor, s_w_up: cute.Tensor,
                 s_d_gate: cute.Tensor, s_d_up: cute.Tensor, s_hw: cute.Tensor,
                 s_dx_rows: cute.Tensor, s_dg_t: cute.Tensor, s_du_t: cute.Tensor,
                 s_x_t: cute.Tensor, s_dy_t: cute.Tensor, s_hw_t: cute.Tensor,
                 s_dw_gate: cute.Tensor, s_dw_up: cute.Tensor, s_dw_down: cute.Tensor,
                 s_preact: cute.Tensor, s_rows: cute.Tensor, s_ones: cute.Tensor,
                 timeline_buf: cute.Tensor, stream: cuda.CUstream):
        """Shapes (M schedule rows, E experts): tasks int32 (N, BACKWARD_TASK_WORDS); queue
        int32 (Q,) the compute queue's list indices; queue_live_len int32 (MB + 1,);
        counter_offsets int32 (groups + 1,); counters int32 (num_counters,), zero at launch;
        error int64 (1,); num_tiles int32 (1,); tile_expert int32 (tiles,); d_rows (M, H, 1)
        and d_preact (M, 2I, 1) K-major; w_down (I, H, E), w_gate / w_up (H, I, E) with
        their first mode contiguous; outputs d_gate / d_up (the two halves of d_preact), hw
        (M, I, 1), dx_rows (M, H, 1); preact (slots, 2I) the saved g | u by slot; row_slot
        int32 (M,); weights fp32 (slots,); partials fp32 (M, ceil(I / 256)); scalars int64
        (BACKWARD_SCALARS,). The weight gradients': expert_offsets int32 (E + 1,) each
        expert's first schedule row; the operands (cols, M, 1) with cols contiguous (dG, dU,
        hw: I; x and dY rows: H); dw_gate / dw_up (I, H, E) and dw_down (H, I, E), N
        contiguous. The comm tasks' (``comm_ctas`` > 0; else placeholders): comm_queue int32
        (Qc,), row_peer / row_token / row_k int32 (M,), peer_bases int64 (P,), comm_scalars
        int64 (BACKWARD_COMM_SCALARS,), the dY, x and dx rows (M, H) as plain tensors. The
        group tail's (``ksum_top_k`` > 0; else placeholders): the plan's int64 scalars
        (``constants.SCALAR_FIELDS``), topk_idx int32 (T, K), shared_dx and the output d_x bf16
        (T, H), the output d_topk fp32 (T, K). The shared experts' (``shared``; else
        placeholders; L ranks, T tokens each, T_pad = T rounded up to whole tiles), each as
        its routed counterpart: d_out rows (T, H, L), Ws_down (Is, H, L), dG | dU
        (L T_pad, 2Is, 1), Ws_gate / Ws_up (H, Is, L), the outputs dG, dU, h
        (L T_pad, Is, 1) and dx rows (L T_pad, H, 1); the weight gradients' (cols, T, L)
        operands and (rows, cols, L) outputs; the saved g | u (L T, 2Is), each padded row's
        slot int32 (L T_pad,) (-1 past T) and ones fp32 (L T,). timeline_buf int64: the
        recorder's buffer (``mok_cute.timeline.TimelineBuffer``; unread without ``timeline``)."""
        self.a_dtype = self.b_dtype = self.c_dtype = BFloat16
        self._setup_attributes()
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        a_box = cute.slice_(self.a_smem_layout_staged, (None, None, 0))
        b_box = cute.slice_(self.b_smem_layout_staged, (None, None, 0))
        epi_box = cute.slice_(self.epi_smem_layout_staged, (None, None, 0))
        self.fc2 = Fc2PingpongForm()
        self.fc2.check_fits(self.a_smem_layout_staged, self.b_smem_layout_staged)
        # FC2_DGRAD's W_down box and dgated store boxes: the pingpong form's, or the cooperative
        fc2_n, fc2_b_box, fc2_epi_box, fc2_epi_tile = tile_n, b_box, epi_box, self.epi_tile
        if const_expr(self.fc2_pingpong):
            fc2_n, fc2_epi_tile = FC2_DGRAD_PINGPONG_TILE_N, self.fc2.epi_tile
            fc2_b_box = cute.slice_(self.fc2.b_smem_layout_staged, (None, None, 0))
            fc2_epi_box = cute.slice_(self.fc2.epi_smem_layout_staged, (None, None, 0))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        s2g = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        mk = cute.nvgpu.cpasync.make_tiled_tma_atom
        loads = (*mk(g2s, d_rows, a_box, (tile_m, tile_k)),
                 *mk(g2s, w_down, fc2_b_box, (fc2_n, tile_k)),
                 *mk(g2s, d_preact, a_box, (tile_m, tile_k)),
                 *mk(g2s, w_gate, b_box, (tile_n, tile_k)),
                 *mk(g2s, w_up, b_box, (tile_n, tile_k)))
        stores = (*mk(s2g, d_gate, fc2_epi_box, fc2_epi_tile),
                  *mk(s2g, d_up, fc2_epi_box, fc2_epi_tile),
                  *mk(s2g, hw, fc2_epi_box, fc2_epi_tile), *mk(s2g, dx_rows, epi_box, self.epi_tile))
        self.wgrad = WgradForm(self.ab_stages, self.accumulate_wgrads, self.wgrad_adds_by_load)
        w_box, w_epi = self.wgrad_box(), cute.slice_(self.wgrad.epi_smem_layout_staged, (None, None, 0))
        w_loads = []
        for t in (dg_rows_t, du_rows_t, x_rows_t, dy_rows_t, hw_rows_t):
            w_loads.extend(mk(g2s, t, w_box, (self.wgrad.tile_shape_mnk[1], tile_k)))
        w_s2g = s2g
        if const_expr(self.accumulate_wgrads and not self.wgrad.adds_by_load):
            w_s2g = cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD)
        w_stores = []
        for t in (dw_gate, dw_up, dw_down):
            w_stores.extend(mk(w_s2g, t, w_epi, self.wgrad.epi_tile))
        # main_grad as the kernel reads it into registers ("load")
        main_grads = (dw_gate, dw_up, dw_down) if const_expr(self.wgrad.adds_by_load) else None
        extra = {}
        if const_expr(self.fc2_pingpong):  # the pingpong ring's full / empty mbarriers
            extra["fc2_full_empty"] = cute.struct.MemRange[Int64, 2 * FC2_STAGES]
        # the tail's ticket ring: slots, full / empty mbarriers
        extra["tail_q"] = cute.struct.MemRange[Int32, TICKET_SLOTS * DECODED_WORDS]
        extra["tail_full_empty"] = cute.struct.MemRange[Int64, 2 * TICKET_SLOTS]
        extra["ksum_ticket"] = cute.struct.MemRange[Int32, 1]  # the group tail's KSUM ticket
        # the dgrads' ring of decoded tasks (the load warp's to the consumers)
        extra["dgrad_q"] = cute.struct.MemRange[Int32, TICKET_SLOTS * DECODED_WORDS]
        extra["dgrad_full_empty"] = cute.struct.MemRange[Int64, 2 * TICKET_SLOTS]
        if const_expr(self.timeline):  # each consumer warpgroup's recording thread's marks
            extra["rec_marks"] = cute.struct.MemRange[Int64, 2 * MARKS_PER_WARPGROUP]
        self.shared_storage = self.make_shared_storage(extra_fields=extra)
        peer_rows = PeerRows(comm_queue, row_peer, row_token, row_k, peer_bases, comm_scalars,
                             d_rows_plain, x_rows_plain, dx_rows_plain)
        tail = GroupTail(group_scalars, topk_idx, shared_dx, d_x, d_topk)
        shared = None
        if const_expr(self.shared):
            a_tile, w_tile = (tile_m, tile_k), (self.wgrad.tile_shape_mnk[1], tile_k)
            shared = self.shared_operands(
                (s_d_rows, s_w_down, s_d_preact, s_w_gate, s_w_up, s_d_gate, s_d_up, s_hw,
                 s_dx_rows, s_dg_t, s_du_t, s_x_t, s_dy_t, s_hw_t, s_dw_gate, s_dw_up,
                 s_dw_down, s_preact, s_rows, s_ones),
                ((a_box, a_tile), (fc2_b_box, (fc2_n, tile_k)), (a_box, a_tile),
                 (b_box, (tile_n, tile_k)), (b_box, (tile_n, tile_k)),
                 *(((fc2_epi_box, fc2_epi_tile),) * 3), (epi_box, self.epi_tile),
                 *(((w_box, w_tile),) * 5), *(((w_epi, self.wgrad.epi_tile),) * 3)),
                w_store_op=w_s2g)
        self.kernel(tasks, queue, queue_live_len, counter_offsets, counters, error, num_tiles,
                    tile_expert, preact, row_slot, weights, partials, scalars, expert_offsets,
                    peer_rows, tail, shared, timeline_buf, *loads, *stores, *w_loads, *w_stores,
                    main_grads,
                    self.tiled_mma, self.a_smem_layout_staged, self.b_smem_layout_staged,
                    self.epi_smem_layout_staged, *self.wgrad_kernel_args(),
                    *self.fc2.kernel_args(),
                    ).launch(grid=[self.num_ctas + self.comm_ctas, 1, 1],
                             block=[self.threads_per_cta, 1, 1],
                             min_blocks_per_mp=1, cooperative=True, stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tasks: cute.Tensor, queue: cute.Tensor, queue_live_len: cute.Tensor,
               counter_offsets: cute.Tensor, counters: cute.Tensor, error: cute.Tensor,
               num_tiles: cute.Tensor, tile_expert: cute.Tensor, preact: cute.Tensor,
               row_slot: cute.Tensor, weights: cute.Tensor, partials: cute.Tensor,
               scalars: cute.Tensor, expert_offsets: cute.Tensor, peer_rows: PeerRows,
               tail: GroupTail, shared, timeline_buf: cute.Tensor, tma_dy: cute.CopyAtom,
               t_dy: cute.Tensor, tma_wd: cute.CopyAtom, t_wd: cute.Tensor,
               tma_dp: cute.CopyAtom, t_dp: cute.Tensor, tma_wg: cute.CopyAtom, t_wg: cute.Tensor,
               tma_wu: cute.CopyAtom, t_wu: cute.Tensor,
               tma_dg: cute.CopyAtom, t_dg: cute.Tensor, tma_du: cute.CopyAtom, t_du: cute.Tensor,
               tma_hw: cute.CopyAtom, t_hw: cute.Tensor, tma_dx: cute.CopyAtom, t_dx: cute.Tensor,
               tma_wdg: cute.CopyAtom, t_wdg: cute.Tensor, tma_wdu: cute.CopyAtom,
               t_wdu: cute.Tensor, tma_wx: cute.CopyAtom, t_wx: cute.Tensor,
               tma_wdy: cute.CopyAtom, t_wdy: cute.Tensor, tma_whw: cute.CopyAtom,
               t_whw: cute.Tensor, tma_cg: cute.CopyAtom, t_cg: cute.Tensor,
               tma_cu: cute.CopyAtom, t_cu: cute.Tensor, tma_cd: cute.CopyAtom, t_cd: cute.Tensor,
               main_grads, tiled_mma: cute.TiledMma, a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout, w_tiled_mma: cute.TiledMma,
               w_box_staged: cute.ComposedLayout, w_epi_staged: cute.ComposedLayout,
               f_tiled_mma: cute.TiledMma, f_a_staged: cute.ComposedLayout,
               f_b_staged: cute.ComposedLayout, f_epi_staged: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)
        self.rec_start(timeline_buf, tidx)
        if warp_idx == self.load_warp:
            self.prefetch_descriptors(tma_dy, tma_wd, tma_dp, tma_wg, tma_wu, tma_wdg, tma_wdu,
                                      tma_wx, tma_wdy, tma_whw)
        storage, ab_pipeline, sA, sB, sC = self.operand_smem(
            a_smem_layout_staged, b_smem_layout_staged, epi_smem_layout_staged)
        w_layouts = (w_tiled_mma, w_box_staged, w_epi_staged)
        f_layouts = (f_tiled_mma, f_a_staged, f_b_staged, f_epi_staged)
        fc2_ring = None
        if const_expr(self.fc2_pingpong):
            fc2_ring = self.fc2_pipeline(storage, f_layouts)
        tail_ring = (storage.tail_q.data_ptr(), storage.tail_full_empty.data_ptr())
        if tidx == 0:  # its readers: the eight consumer warps
            ticket_ring_init(tail_ring[1], self.num_mma_threads // 32)
        task_ring = (storage.dgrad_q.data_ptr(), storage.dgrad_full_empty.data_ptr())
        if tidx == 0:  # its readers: the eight consumer warps
            ticket_ring_init(task_ring[1], self.num_mma_threads // 32)
        walk_tables = (tasks, queue, queue_live_len, num_tiles, scalars)
        # the pingpong phase: the queue's FC2_DGRAD prefix, within the live prefix (its tasks
        # decoded from the queue alone: the walk's values are loaded after it, fewer registers
        # live through its epilogues)
        fc2_end = cutlass.min(Int32(scalars[4]), self._live_len(queue_live_len, num_tiles, scalars))
        fc2_walk = (tasks, queue, num_tiles)
        first = Int32(cute.arch.block_idx()[0])
        # the group tail's KSUMs by ticket: the idle B and A stages, the ticket's smem word
        # (the comm queue position of the first KSUM is read where the tickets begin: nothing
        # held through the mainloops)
        rec_marks = None
        if const_expr(self.timeline):
            rec_marks = storage.rec_marks.data_ptr()
        ksum_args = ((storage.sB.data_ptr(), storage.sA.data_ptr()),
                     cute.make_tensor(storage.ksum_ticket.data_ptr(), cute.make_layout(1)))
        compute_args = (walk_tables, fc2_end, fc2_walk, first, tile_expert, expert_offsets,
                        counter_offsets, counters, error, scalars, preact, row_slot, weights,
                        partials, fc2_ring, ab_pipeline, tiled_mma, sA, sB, sC, f_layouts,
                        w_layouts, tail_ring, task_ring, tidx, warp_idx, warpgroup_idx,
                        (tma_dy, t_dy, tma_wd, t_wd, tma_dp, t_dp, tma_wg, t_wg, tma_wu, t_wu),
                        (tma_dg, t_dg, tma_du, t_du, tma_hw, t_hw, tma_dx, t_dx),
                        (tma_wdg, t_wdg, tma_wdu, t_wdu, tma_wx, t_wx, tma_wdy, t_wdy, tma_whw,
                         t_whw),
                        (tma_cg, t_cg, tma_cu, t_cu, tma_cd, t_cd,
                         *(main_grads if const_expr(main_grads is not None) else ())),
                        peer_rows, tail,
                        ksum_args, shared, timeline_buf, rec_marks)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        if const_expr(self.comm_ctas > 0):
            if first >= self.num_ctas:
                self.backward_comm_loop(tasks, counter_offsets, counters, error, num_tiles,
                                        Int64(scalars[0]), expert_offsets, peer_rows, row_slot,
                                        weights, partials, tail,
                                        (*ksum_args, Int32(scalars[5])), tidx,
                                        self._recorder(timeline_buf, rec_marks, 1, tidx == 0))
            else:
                self.compute_roles(*compute_args)
        else:
            self.compute_roles(*compute_args)

    @cute.jit
    def compute_roles(self, walk_tables, fc2_end: Int32, fc2_walk, first: Int32,
                      tile_expert: cute.Tensor, expert_offsets: cute.Tensor,
                      counter_offsets: cute.Tensor, counters: cute.Tensor, error: cute.Tensor,
                      scalars: cute.Tensor, preact: cute.Tensor, row_slot: cute.Tensor,
                      weights: cute.Tensor, partials: cute.Tensor, fc2_ring, ab_pipeline,
                      tiled_mma, sA, sB, sC, f_layouts, w_layouts, tail_ring, task_ring,
                      tidx: Int32, warp_idx: Int32, warpgroup_idx: Int32, loads, stores,
                      w_loads, w_stores,
                      peer_rows: PeerRows, tail: GroupTail, ksum_args, shared,
                      timeline_buf: cute.Tensor, rec_marks):
        """A compute CTA: the load warp and the two consumer warpgroups (with the group
        tail, the consumer warps then take KSUM tickets: ``backward_tail``); ``shared``:
        the shared expert's ``SharedOperands`` (None: no shared task); ``rec_marks``: the
        recorder's smem marks, ``MARKS_PER_WARPGROUP`` a consumer warpgroup (None: off);
        ``task_ring``: the dgrads' ring of decoded tasks."""
        tma_dy, t_dy, tma_wd, t_wd, tma_dp, t_dp, tma_wg, t_wg, tma_wu, t_wu = loads
        tma_dg, t_dg, tma_du, t_du, tma_hw, t_hw, tma_dx, t_dx = stores
        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == self.load_warp:
                if const_expr(self.fc2_pingpong):
                    first = self.fc2_producer(fc2_walk, fc2_end, tile_expert, expert_offsets,
                                              counter_offsets, counters, error,
                                              Int64(scalars[0]), fc2_ring, sA, f_layouts,
                                              (tma_dy, t_dy, tma_wd, t_wd), shared, timeline_buf)
                self.producer_loop(self._walk(*walk_tables), first, tile_expert, expert_offsets,
                                   counter_offsets, counters, error, Int64(scalars[0]),
                                   ab_pipeline, sA, sB,
                                   loads, w_loads, w_layouts, tail_ring, task_ring, shared,
                                   timeline_buf)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if const_expr(self.fc2_pingpong):
                first = self.fc2_consumers(fc2_walk, fc2_end, counter_offsets, counters, preact,
                                           row_slot, weights, partials, fc2_ring, sA, sC,
                                           f_layouts, (tma_dg, t_dg, tma_du, t_du, tma_hw, t_hw),
                                           t_dy, tidx, warp_idx, warpgroup_idx, shared,
                                           self._recorder(
                                               timeline_buf, rec_marks, warpgroup_idx,
                                               tidx % self.threads_per_warpgroup == 0))
                self.switch_forms()
            self.consumer_loop(self._walk(*walk_tables), first, counters,
                               preact, row_slot, weights, partials, ab_pipeline,
                               tiled_mma, sA, sB, sC,
                               stores, w_stores, w_layouts,
                               t_dy, t_dp, tidx, warp_idx, warpgroup_idx, tail_ring,
                               task_ring, shared,
                               self._recorder(timeline_buf, rec_marks, 1,
                                              tidx == self.threads_per_warpgroup))
            if const_expr(self.ksum_top_k > 0):
                stage, ticket = ksum_args
                sync = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.TAIL_KSUM),
                                             num_threads=self.num_mma_threads)
                self.tail_ksum_tickets(Context(tail.scalars), walk_tables[0], counter_offsets,
                                       counters, error, Int64(scalars[0]), peer_rows, tail,
                                       stage, ticket, Int32(scalars[5]),
                                       tidx - self.threads_per_warpgroup, self.num_mma_threads,
                                       sync, self._recorder(timeline_buf, rec_marks, 1,
                                                            tidx == self.threads_per_warpgroup))

    def _recorder(self, timeline_buf, rec_marks, warpgroup_idx, leader) -> Recorder:
        """Consumer warpgroup ``warpgroup_idx``'s ``Recorder``, thread ``leader`` recording.
        Traced inline."""
        marks = None
        if const_expr(self.timeline):
            marks = cute.make_tensor(rec_marks + (warpgroup_idx - 1) * MARKS_PER_WARPGROUP,
                                     cute.make_layout(MARKS_PER_WARPGROUP))
        return Recorder(timeline_buf, marks, leader)

    @cute.jit
    def _k_tiles(self, ttype: Int32, t_dy: cute.Tensor, t_dp: cute.Tensor,
                 shared: SharedOperands) -> Int32:
        """K-tiles of a task: H / 64 for FC2_DGRAD, 2I / 64 for FC1_DGRAD (2Is / 64 for the
        shared expert's)."""
        k_tiles = cute.size(t_dy, mode=[1]) // TILE_K
        if ttype == int(BackwardTaskType.FC1_DGRAD):
            k_tiles = cute.size(t_dp, mode=[1]) // TILE_K
        if const_expr(self.shared):
            if ttype == SHARED_FC1_DGRAD:
                k_tiles = cute.size(shared.loads[5], mode=[1]) // TILE_K
        return k_tiles

    # ------------------------------------------------------------------ producer
    @cute.jit
    def producer_loop(self, walk, first: Int32, tile_expert: cute.Tensor, expert_offsets: cute.Tensor,
                      counter_offsets: cute.Tensor, counters: cute.Tensor, error: cute.Tensor,
                      timeout_ns: Int64, ab_pipeline, sA, sB, ops, wgrad_ops, w_layouts,
                      tail_ring, task_ring, shared: SharedOperands, timeline_buf: cute.Tensor):
        """The load warp from walk position ``first``: per dgrad its waits (each lane spins on
        its own copy), then its k-tiles' A and B boxes by TMA; then the weight gradients by
        tickets (``wgrad_producer_tickets``). Its lane 0 also publishes each position's
        decoded words into ``task_ring`` as use k (its k-th position), the next one's once
        this one's loads are out."""
        tma_dy, t_dy, tma_wd, t_wd, tma_dp, t_dp, tma_wg, t_wg, tma_wu, t_wu = ops
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        fc2_parts = None
        if const_expr(not self.fc2_pingpong):
            fc2_parts = self._fc2_load_parts(sA, sB, ops[:4])
        fc1_parts = self._fc1_load_parts(sA, sB, ops[4:])
        s_fc2_parts = s_fc1_parts = None
        if const_expr(self.shared):
            if const_expr(not self.fc2_pingpong):
                s_fc2_parts = self._fc2_load_parts(sA, sB, shared.loads[:4])
            s_fc1_parts = self._fc1_load_parts(sA, sB, shared.loads[4:])
        tasks, _, live_len, _, _, _ = walk
        loads = Int32(0)
        pos = first
        run, ttype, m_tile, n_tile, _, _, _, index = self._task(walk, pos, counter_offsets)
        base = self._ring_base(first)
        self._publish_dgrad(task_ring, self._ring_use(pos, base), tasks, counter_offsets, run,
                            ttype, m_tile, n_tile, index)
        while pos < live_len:  # the dgrads
            nxt = pos + self.num_ctas
            n_run, n_type, n_m, n_n, _, _, _, n_index = self._task(walk, nxt, counter_offsets)
            if run:
                self.wait_task_recorded(tasks, index, expert_offsets, counter_offsets, counters,
                                        error, timeout_ns, timeline_buf, COMPUTE,
                                        cute.arch.lane_idx() == 0)
                # dG | dU were written by other CTAs' TMA stores; TMA reads them next
                cute.arch.fence_proxy("async.global")
                expert = Int32(0)
                m_a, a_batch = m_tile, 0  # the A box's tile and batch
                if const_expr(self.shared):
                    a_batch = Int32(0)
                    if self.is_shared_task(ttype):
                        # the rank's weights; d_out by (token tile, rank), dG | dU (rows
                        # padded per rank) by the task's tile
                        s_tile, expert = self.shared_tile(m_tile, shared)
                        if ttype == SHARED_FC2_DGRAD:
                            m_a, a_batch = s_tile, expert
                    else:
                        expert = tile_expert[m_tile]
                else:
                    expert = tile_expert[m_tile]
                k_tiles = self._k_tiles(ttype, t_dy, t_dp, shared)
                state = pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages, loads)
                for k in range(k_tiles):
                    ab_pipeline.producer_acquire(state)
                    bar = ab_pipeline.producer_get_barrier(state)
                    stage = state.index
                    if const_expr(self.fc2_pingpong):  # FC2_DGRAD ran in its own phase
                        if const_expr(self.shared):
                            if ttype == SHARED_FC1_DGRAD:
                                self._load_fc1_dgrad(k, m_tile, n_tile, expert, stage, bar,
                                                     s_fc1_parts)
                            else:
                                self._load_fc1_dgrad(k, m_tile, n_tile, expert, stage, bar,
                                                     fc1_parts)
                        else:
                            self._load_fc1_dgrad(k, m_tile, n_tile, expert, stage, bar, fc1_parts)
                    else:
                        if ttype == int(BackwardTaskType.FC2_DGRAD):
                            self._load_fc2_dgrad(k, m_tile, n_tile, expert, stage, bar, fc2_parts)
                        else:
                            if const_expr(self.shared):
                                if ttype == SHARED_FC2_DGRAD:
                                    self._load_fc2_dgrad(k, m_a, n_tile, expert, stage, bar,
                                                         s_fc2_parts, a_batch)
                                elif ttype == SHARED_FC1_DGRAD:
                                    self._load_fc1_dgrad(k, m_tile, n_tile, expert, stage, bar,
                                                         s_fc1_parts)
                                else:
                                    self._load_fc1_dgrad(k, m_tile, n_tile, expert, stage, bar,
                                                         fc1_parts)
                            else:
                                self._load_fc1_dgrad(k, m_tile, n_tile, expert, stage, bar,
                                                     fc1_parts)
                    ab_pipeline.producer_commit(state)
                    state.advance()
                loads += k_tiles
            # the next task's words once this one's loads are out (its decode's loads waited
            # under them); its consumers read them after this task's epilogue. Deadlock-free:
            # use k waits for the consumers to give back use k - 4, which they do when they
            # take use k - 3, whose loads went out before
            self._publish_dgrad(task_ring, self._ring_use(nxt, base), tasks, counter_offsets,
                                n_run, n_type, n_m, n_n, n_index)
            run, ttype, m_tile, n_tile, index = n_run, n_type, n_m, n_n, n_index
            pos = nxt
        # the weight gradients (the tail), by tickets
        w_parts = self.wgrad_load_parts(sA, sB, wgrad_ops, w_layouts)
        s_w_parts = None
        if const_expr(self.shared):
            s_w_parts = self.wgrad_load_parts(sA, sB, shared.w_loads, w_layouts)
        loads = self.wgrad_producer_tickets(walk, tail_ring, expert_offsets, counter_offsets,
                                            counters, error, timeout_ns, ab_pipeline, loads,
                                            wgrad_ops, w_parts, shared, s_w_parts, timeline_buf)
        ab_pipeline.producer_tail(pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.ab_stages, loads))

    def _fc2_load_parts(self, sA, sB, ops):
        """FC2_DGRAD's (cooperative) TMA partitions: (atom, global, smem) of the dY rows, then
        of W_down; ``ops`` their (atom, tensor) pairs. Traced inline."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        tma_dy, t_dy, tma_wd, t_wd = ops
        g_dy, s_dy = tma_tiles(tma_dy, t_dy, sA, (tile_m, tile_k))
        g_wd, s_wd = tma_tiles(tma_wd, t_wd, sB, (tile_n, tile_k))
        return (tma_dy, g_dy, s_dy, tma_wd, g_wd, s_wd)

    def _fc1_load_parts(self, sA, sB, ops):
        """FC1_DGRAD's TMA partitions: (atom, global, smem) of dG | dU, W_gate, W_up, and the
        gate weights' k-tiles (where the up weights' begin); ``ops`` their (atom, tensor)
        pairs. Traced inline."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        tma_dp, t_dp, tma_wg, t_wg, tma_wu, t_wu = ops
        g_dp, s_dp = tma_tiles(tma_dp, t_dp, sA, (tile_m, tile_k))
        g_wg, s_wg = tma_tiles(tma_wg, t_wg, sB, (tile_n, tile_k))
        g_wu, s_wu = tma_tiles(tma_wu, t_wu, sB, (tile_n, tile_k))
        return (tma_dp, g_dp, s_dp, tma_wg, g_wg, s_wg, tma_wu, g_wu, s_wu,
                cute.size(t_wg, mode=[1]) // TILE_K)

    @cute.jit
    def _load_fc2_dgrad(self, k: Int32, m_tile: Int32, n_tile: Int32, expert: Int32,
                        stage: Int32, bar, parts, a_batch=0):
        """FC2_DGRAD's k-tile ``k`` into ``stage``: the dY rows (of batch ``a_batch``: the
        shared expert's rank), then W_down."""
        tma_dy, g_dy, s_dy, tma_wd, g_wd, s_wd = parts
        cute.copy(tma_dy, g_dy[(None, m_tile, k, a_batch)], s_dy[(None, stage)], tma_bar_ptr=bar)
        cute.copy(tma_wd, g_wd[(None, n_tile, k, expert)], s_wd[(None, stage)], tma_bar_ptr=bar)

    @cute.jit
    def _load_fc1_dgrad(self, k: Int32, m_tile: Int32, n_tile: Int32, expert: Int32,
                        stage: Int32, bar, parts):
        """FC1_DGRAD's k-tile ``k`` into ``stage``: dG | dU rows, then the gate weights'
        k-tiles, then the up weights'."""
        tma_dp, g_dp, s_dp, tma_wg, g_wg, s_wg, tma_wu, g_wu, s_wu, k_split = parts
        cute.copy(tma_dp, g_dp[(None, m_tile, k, 0)], s_dp[(None, stage)], tma_bar_ptr=bar)
        if k < k_split:
            cute.copy(tma_wg, g_wg[(None, n_tile, k, expert)], s_wg[(None, stage)], tma_bar_ptr=bar)
        else:
            cute.copy(tma_wu, g_wu[(None, n_tile, k - k_split, expert)], s_wu[(None, stage)],
                      tma_bar_ptr=bar)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consumer_loop(self, walk, first: Int32, counters: cute.Tensor, preact: cute.Tensor,
                      row_slot: cute.Tensor, weights: cute.Tensor, partials: cute.Tensor,
                      ab_pipeline, tiled_mma, sA, sB, sC, stores, wgrad_stores, w_layouts, t_dy,
                      t_dp, tidx: Int32, warp_idx: Int32, warpgroup_idx: Int32, tail_ring,
                      task_ring, shared: SharedOperands, recorder: Recorder):
        """Both consumer warpgroups from walk position ``first``: per task the mainloop, the
        epilogue's TMA stores, and for a dgrad, once they have landed, the task's counter,
        published by thread 0 of the store warp (nothing waits on a weight gradient: the
        launch's end orders them). ``recorder``: the first consumer warpgroup's, which
        records the tasks. ``task_ring``: each dgrad's words, read from the load warp's ring
        (``_dgrad_words``)."""
        tma_dg, t_dg, tma_du, t_du, tma_hw, t_hw, tma_dx, t_dx = stores
        tile = (TILE_M, self.tile_shape_mnk[1])
        views = [cute.local_tile(t, tile, (None, None, None)) for t in (t_dg, t_du, t_hw, t_dx)]
        s_views = None  # the shared expert's outputs: dG, dU, h, dx rows
        if const_expr(self.shared):
            s_views = [cute.local_tile(shared.stores[2 * o + 1], tile, (None, None, None))
                       for o in range(4)]
        consumer_tidx = tidx - self.threads_per_warpgroup
        tCrA, tCrB, acc, num_k_blocks, epi = self.consumer_parts(
            tiled_mma, sA, sB, sC, (warpgroup_idx - 1) * self.threads_per_warpgroup,
            consumer_tidx)
        coords = self.epi_coords(epi, consumer_tidx)
        store_pipeline, barrier, is_store_warp = self.epilogue_sync(warp_idx, warpgroup_idx)
        subtiles_per_task = (TILE_M // self.epi_tile[0]) * (self.tile_shape_mnk[1] // self.epi_tile[1])
        tasks, _, live_len, _, _, _ = walk
        loads, subtiles = Int32(0), Int32(0)
        held = Int32(-1)  # the counter whose publish waits for the next mainloop (-1: none)
        pos = first
        base = self._ring_base(first)
        while pos < live_len:  # the dgrads
            run, ttype, m_tile, n_tile, index = self._dgrad_words(
                task_ring, self._ring_use(pos, base))
            if run:
                k_tiles = self._k_tiles(ttype, t_dy, t_dp, shared)
                self.rec_stamp(recorder, START)
                release = self.mainloop(ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads, k_tiles,
                                        num_k_blocks)
                cute.nvgpu.warpgroup.wait_group(0)
                self.rec_stamp(recorder, EPILOGUE)
                ab_pipeline.consumer_release(release)
                loads += k_tiles
                if held >= 0:  # the previous task's stores landed during this mainloop
                    common.publish_stored(counters, held, is_store_warp, consumer_tidx == 0)
                    held = Int32(-1)
                dx_store = (epi, tma_dx, views[3], m_tile, n_tile, subtiles, barrier,
                            store_pipeline, is_store_warp)
                s_dx = None  # the shared expert's dx rows: where its FC1_DGRAD stores
                if const_expr(self.shared):
                    s_dx = (shared.stores[6], s_views[3][(None, None, m_tile, n_tile, 0)],
                            ttype == SHARED_FC1_DGRAD)
                if const_expr(self.fc2_pingpong):  # FC2_DGRAD ran in its own phase
                    self._store_dx(dx_store, s_dx)
                else:
                    dgated = ttype == int(BackwardTaskType.FC2_DGRAD)
                    if const_expr(self.shared):
                        dgated = dgated or ttype == SHARED_FC2_DGRAD
                    if dgated:
                        rows, visit_args = self.row_visit_args(
                            epi, "dgated", coords, m_tile, n_tile,
                            *self.dgated_rows(ttype, preact, row_slot, weights, shared),
                            consumer_tidx)
                        alt, use_alt = None, None  # the shared expert's dG, dU, h
                        if const_expr(self.shared):
                            alt = ((shared.stores[0], shared.stores[2], shared.stores[4]),
                                   tuple(v[(None, None, m_tile, n_tile, 0)] for v in s_views[:3]))
                            use_alt = ttype == SHARED_FC2_DGRAD
                        self.tile_epilogue(epi, (tma_dg, tma_du, tma_hw),
                                           tuple(v[(None, None, m_tile, n_tile, 0)] for v in views[:3]),
                                           "dgated", 0, subtiles, barrier, store_pipeline,
                                           is_store_warp, visit_args, alt=alt, use_alt=use_alt)
                        if const_expr(self.shared):  # no router weight: no row partials
                            if ttype == int(BackwardTaskType.FC2_DGRAD):
                                self._store_row_sums(rows, partials, m_tile, n_tile,
                                                     consumer_tidx)
                        else:
                            self._store_row_sums(rows, partials, m_tile, n_tile, consumer_tidx)
                        if const_expr(self.comm_ctas > 0):
                            # every thread's partials before the leader's publish: a comm
                            # CTA's REVERSE_DISPATCH reads them (the launches' readers come
                            # after the launch)
                            barrier.arrive_and_wait()
                    else:
                        self._store_dx(dx_store, s_dx)
                if const_expr(self.timeline):  # the type loaded again: one register less held
                    self.rec_task(recorder, COMPUTE, tasks[index, int(BackwardWord.TYPE)], index)
                subtiles += subtiles_per_task
                # The store warp is an MMA warp: waiting here for the stores to land would
                # hold the next mainloop, so the publish goes out after that mainloop when no
                # held publish can be what that mainloop waits for, directly or through another
                # CTA (docstring: the defer rule); otherwise now. At one rank this takes
                # FC1_DGRAD's wait for its stores off the path between tasks.
                nxt = pos + self.num_ctas
                defer = False
                if nxt < live_len:
                    n_run, n_waits, n_group, group = self._next_dgrad_words(
                        task_ring, self._ring_use(nxt, base))
                    defer = n_run and (n_waits == 0 or n_group == int(BackwardCounter.PULLED)
                                       or group == int(BackwardCounter.DX_DONE)
                                       or group == int(BackwardCounter.SHARED_DX))
                signal = ring_words(task_ring[0], self._ring_use(pos, base))[D_SIGNAL]
                if defer:
                    held = signal
                else:
                    common.publish_stored(counters, signal, is_store_warp, consumer_tidx == 0)
            pos += self.num_ctas
        if held >= 0:
            common.publish_stored(counters, held, is_store_warp, consumer_tidx == 0)
        # the weight gradients (the tail), on the other tile form
        self.switch_forms()  # a CTA learns whether it runs any only from its tickets
        w_parts = self.wgrad_consumer_parts(sA, sB, sC, w_layouts, tidx, warp_idx,
                                            warpgroup_idx)
        self.wgrad_consumer_tickets(walk, tail_ring, ab_pipeline, w_layouts[0], w_parts, loads,
                                    wgrad_stores, warpgroup_idx, shared, recorder)
        # the last TMA stores of either form have read their buffers before the CTA exits
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _store_dx(self, args, shared_dx):
        """FC1_DGRAD's epilogue: the dx rows tile through the first output buffer; into the
        shared expert's dx rows instead where ``shared_dx`` (atom, its tile, run-time flag)
        says so."""
        epi, tma_dx, view, m_tile, n_tile, subtiles, barrier, store_pipeline, is_store_warp = args
        if const_expr(shared_dx is not None):
            s_atom, s_tile, use_alt = shared_dx
            self.tile_epilogue(epi, (tma_dx,), (view[(None, None, m_tile, n_tile, 0)],), "store",
                               0, subtiles, barrier, store_pipeline, is_store_warp, None, 1,
                               alt=((s_atom,), (s_tile,)), use_alt=use_alt)
        else:
            self.tile_epilogue(epi, (tma_dx,), (view[(None, None, m_tile, n_tile, 0)],), "store",
                               0, subtiles, barrier, store_pipeline, is_store_warp, None, 1)


# ---------------------------------------------------------------------- compile
def compile_backward_megakernel(arch: str = "sm_90a", options: str = "", num_ctas: int = 132,
                                fc2_pingpong: bool = False, comm_ctas: int = 0,
                                ksum_top_k: int = 0, ksum_shared: bool = False,
                                shared: bool = False, accumulate_wgrads: bool = False,
                                timeline: bool = False, main_grad_add: str = "reduce"):
    """Compile on fake tensors (no GPU needed); every extent is a run-time value. The result
    takes torch tensors (TVM-FFI) in ``__call__``'s order."""
    kernel = BackwardMegakernelSm90(num_ctas, fc2_pingpong, comm_ctas, ksum_top_k, ksum_shared,
                                    shared, accumulate_wgrads, timeline, main_grad_add)
    return cute.compile(kernel, *fake_arguments(accumulate_wgrads),
                        options=jit.compile_options(arch, f"--enable-tvm-ffi {options}"))


def fake_arguments(accumulate_wgrads: bool = False) -> list:
    """``__call__``'s arguments as fake tensors (every extent a run-time value, with the
    divisibility and the stride-1 mode the launch's tensors must have), then the stream; the
    weight gradients fp32 with ``accumulate_wgrads``."""
    f, kmaj, sym = common.fake_strided_tensor, common.fake_kmajor_tensor, cute.sym_int32
    i32 = lambda *s: f(Int32, s, align_bytes=4)  # noqa: E731
    rows, slots, experts, tokens = sym(divisibility=TILE_M), sym(), sym(), sym()
    hidden, inter = sym(divisibility=TILE_K), sym(divisibility=TILE_K)
    bf16 = BFloat16
    dw = Float32 if accumulate_wgrads else bf16  # the weight gradients
    # the weights as stored ([E, I, H], [E, H, I]) seen as (N, K, E): N contiguous
    w_nk = lambda n, k: f(bf16, (n, k, experts), contiguous_mode=0)  # noqa: E731
    args = [i32(sym(), BACKWARD_TASK_WORDS), common.fake_vector(Int32),
            common.fake_vector(Int32), common.fake_vector(Int32), common.fake_vector(Int32),
            common.fake_vector(Int64, 1, align_bytes=8), common.fake_vector(Int32, 1),
            common.fake_vector(Int32),
            kmaj(bf16, (rows, hidden, 1)), w_nk(inter, hidden),
            kmaj(bf16, (rows, sym(divisibility=TILE_K), 1)), w_nk(hidden, inter),
            w_nk(hidden, inter), *(kmaj(bf16, (rows, inter, 1)) for _ in range(3)),
            kmaj(bf16, (rows, hidden, 1)),
            kmaj(bf16, (slots, sym(divisibility=16))), common.fake_vector(Int32),
            common.fake_vector(Float32), f(Float32, (rows, sym()), align_bytes=4),
            common.fake_vector(Int64, BACKWARD_SCALARS, align_bytes=8),
            # the weight gradients: expert offsets, (cols, rows, 1) operands, (M, N, E) outputs
            common.fake_vector(Int32),
            *(f(bf16, (inter, rows, 1), contiguous_mode=0) for _ in range(2)),
            *(f(bf16, (hidden, rows, 1), contiguous_mode=0) for _ in range(2)),
            f(bf16, (inter, rows, 1), contiguous_mode=0),
            *(kmaj(dw, (inter, hidden, experts)) for _ in range(2)),
            kmaj(dw, (hidden, inter, experts)),
            # the comm tasks': queue, row_peer / row_token / row_k, peer bases, scalars, rows
            common.fake_vector(Int32), *(common.fake_vector(Int32) for _ in range(3)),
            common.fake_vector(Int64, align_bytes=8),
            common.fake_vector(Int64, BACKWARD_COMM_SCALARS, align_bytes=8),
            *(kmaj(bf16, (rows, hidden)) for _ in range(3)),
            # the group tail's: the plan's scalars, topk_idx, shared_dx, d_x, d_topk
            common.fake_vector(Int64, SCALARS, align_bytes=8), i32(tokens, sym()),
            *(kmaj(bf16, (tokens, hidden)) for _ in range(2)),
            f(Float32, (tokens, sym()), align_bytes=4),
            *_shared_fakes(hidden, dw), common.fake_vector(Int64, align_bytes=8),
            common.fake_stream()]
    return args


def _shared_fakes(hidden, dw=BFloat16) -> list:
    """The shared expert's fake arguments (``__call__``'s ``s_*``), with extents of their own:
    T tokens and L ranks (the caller's d_out and x, the weights, the weight gradients' views),
    L T_pad rows (the launch's buffers, each rank's rows padded to whole tiles), Is; its
    saved g | u, rows and ones of the routed ones' types (the dgated epilogue picks either
    at run time)."""
    f, kmaj, bf16, sym = common.fake_strided_tensor, common.fake_kmajor_tensor, BFloat16, cute.sym_int32
    tokens, ranks, padded, inter = sym(), sym(), sym(divisibility=TILE_M), sym(divisibility=TILE_K)
    mn = lambda rows, cols: f(bf16, (rows, cols, ranks), contiguous_mode=0)  # noqa: E731
    return [kmaj(bf16, (tokens, hidden, ranks)), mn(inter, hidden),
            kmaj(bf16, (padded, sym(divisibility=TILE_K), 1)), mn(hidden, inter),
            mn(hidden, inter), *(kmaj(bf16, (padded, inter, 1)) for _ in range(3)),
            kmaj(bf16, (padded, hidden, 1)), mn(inter, tokens), mn(inter, tokens),
            mn(hidden, tokens), mn(hidden, tokens), mn(inter, tokens),
            *(kmaj(dw, (inter, hidden, ranks)) for _ in range(2)),
            kmaj(dw, (hidden, inter, ranks)),
            kmaj(bf16, (sym(), sym(divisibility=16))), common.fake_vector(Int32),
            common.fake_vector(Float32)]


__all__ = ["BackwardMegakernelSm90", "compile_backward_megakernel", "fake_arguments",
           "BACKWARD_SCALARS"]
