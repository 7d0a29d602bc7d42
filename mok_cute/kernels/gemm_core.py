"""The one GEMM core of mok_cute on Hopper (sm_90a): tiles, fragments, mainloop, epilogue.

Every matrix product of the package runs through this class: the grouped expert GEMM
(``gemm_sm90.GroupedGemmSm90``) and the megakernel's GEMM tasks (``megakernel``) inherit
it. A kernel built on it

- sets ``a_dtype`` / ``b_dtype`` / ``c_dtype`` and calls ``_setup_attributes`` (tiled MMA,
  stage count, swizzled smem layouts);
- fills ``ab_stages`` mbarrier stages from its producer warp(s) with TMA (or cp.async);
- in each consumer thread takes its fragments once (``consumer_parts``), then per output
  tile runs ``mainloop`` (wgmma over the tile's k-tiles, one batch in flight, each stage
  released once the batch that read it has retired) and ``tile_epilogue`` (accumulator ->
  ``epi_visit_subtile`` -> bf16 -> smem subtiles by stmatrix -> TMA stores by one warp).

The mainloop calls hook methods at fixed points (``mainloop_begin``, ``first_stage_wait``,
``stage_ready``, ``k_tile_issued``, ``mainloop_end``); a kernel overrides those it needs
(the pingpong GEMM's mainloop turns, the megakernel's proxy fence for gathered rows, its
deferred publish) and passes their run-time values as ``hook_args``. The defaults emit
nothing.

Pipeline states are rebuilt from a count of stage uses (``pipeline_state``) rather than
carried: a state mutated inside a ``@cute.jit`` helper's run-time loop cannot leave it.

Tiles: ``TILE_M`` x ``tile_n`` x ``TILE_K`` (128 x {64, 128, 256} x 64), bf16 operands,
K-major, fp32 accumulators. Cooperative: the two consumer warpgroups split each tile's rows
(64 each). Pingpong: each consumer warpgroup owns whole tiles (``tile_n <= 128``).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr

from mok_cute.constants import TILE_K, TILE_M
from mok_cute.kernels import common

EPI_N = 32  # columns of an epilogue subtile (64 measured level: docs/measurements.md)


class GemmCoreSm90:
    """Static GEMM configuration and the device code every GEMM of the package shares.

    :param tile_n: CTA tile width in N (64, 128 or 256).
    :param pingpong: the two consumer warpgroups alternate whole tiles (``tile_n <= 128``)
        instead of splitting each tile's rows.
    :param a_mn_major, b_mn_major: the operand's M (N) mode is contiguous in memory instead
        of its K mode (the backward's transposed operands); smem layouts, TMA boxes and the
        wgmma descriptors follow.
    :param epi_outputs: output tiles the epilogue stores per subtile (each through its own
        smem buffer and TMA atom).
    :param max_ab_stages: at most this many operand stages (None: as many as smem holds).
    """

    def __init__(self, tile_n: int = 256, pingpong: bool = False, a_mn_major: bool = False,
                 b_mn_major: bool = False, epi_outputs: int = 1, max_ab_stages: int | None = None):
        if tile_n not in (64, 128, 256):
            raise ValueError(f"tile_n must be 64, 128 or 256, got {tile_n}")
        if pingpong and tile_n > 128:
            raise ValueError(f"pingpong keeps a whole 128 x tile_n accumulator per warpgroup: "
                             f"tile_n must be <= 128, got {tile_n}")
        if max_ab_stages is not None and max_ab_stages < 2:
            raise ValueError(f"max_ab_stages must be >= 2 or None, got {max_ab_stages}")
        self.tile_shape_mnk = (TILE_M, tile_n, TILE_K)
        self.max_ab_stages = max_ab_stages
        self.pingpong = pingpong
        self.a_mn_major, self.b_mn_major = a_mn_major, b_mn_major
        self.epi_outputs = epi_outputs
        self.atom_layout_mnk = (1, 1, 1) if pingpong else (2, 1, 1)
        self.acc_dtype = Float32
        # one producer warpgroup and two consumer warpgroups
        self.num_mma_warpgroups = 2
        self.threads_per_warpgroup = 128
        self.threads_per_cta = (1 + self.num_mma_warpgroups) * self.threads_per_warpgroup
        self.num_mma_threads = self.num_mma_warpgroups * self.threads_per_warpgroup
        # threads that work on one tile, arrive on its stages and sync its epilogue
        self.threads_per_tile = self.threads_per_warpgroup if pingpong else self.num_mma_threads
        self.load_warp = 0
        self.producer_regs = 40
        self.consumer_regs = 232
        self.epi_tile = (64, EPI_N) if pingpong else (TILE_M, EPI_N)
        # several outputs per subtile: two stages of their buffers keep smem for 3 ab stages
        self.epi_stages = 4 if epi_outputs == 1 else 2
        # one buffer per output and stage; pingpong: each consumer warpgroup has its own
        self.epi_buffers = self.epi_stages * epi_outputs * (2 if pingpong else 1)
        self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")
        self.buffer_align_bytes = 1024
        # derived in _setup_attributes once the dtypes are known
        self.tiled_mma = None
        self.ab_stages = None
        self.a_smem_layout_staged = None
        self.b_smem_layout_staged = None
        self.epi_smem_layout_staged = None

    def fp32_epilogue(self) -> None:
        """For fp32 outputs (weight gradients added into main_grad): half the epilogue stages,
        so the epilogue buffers keep their bytes and the operand stages their count (4 or 8
        fp32 stages at the cost of operand stages were slower, docs/measurements.md)."""
        new = self.epi_stages // 2
        self.epi_buffers = self.epi_buffers // self.epi_stages * new
        self.epi_stages = new

    # ------------------------------------------------------------------ derived attributes
    def _setup_attributes(self):
        """The tiled MMA, the stage count (what smem holds beside the epilogue buffers) and
        the swizzled smem layouts, from ``a_dtype`` / ``b_dtype`` / ``c_dtype``."""
        major = cute.nvgpu.warpgroup.OperandMajorMode
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, major.MN if self.a_mn_major else major.K,
            major.MN if self.b_mn_major else major.K,
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_shape_mnk[1]),
        )
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        ab_bytes_per_stage = (tile_m + tile_n) * tile_k * self.a_dtype.width // 8
        epi_bytes = math.prod(self.epi_tile) * self.c_dtype.width // 8 * self.epi_buffers
        reserved = 1024  # mbarriers and alignment slack
        self.ab_stages = self.operand_stages(
            (self.smem_capacity - reserved - epi_bytes) // ab_bytes_per_stage)
        self.a_smem_layout_staged = self.staged_layout(
            self.a_dtype, (tile_m, tile_k), self.ab_stages, self.a_mn_major)
        self.b_smem_layout_staged = self.staged_layout(
            self.b_dtype, (tile_n, tile_k), self.ab_stages, self.b_mn_major)
        epi_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.c_dtype,
                                            self.epi_tile[1]),
            self.c_dtype)
        self.epi_smem_layout_staged = cute.tile_to_shape(
            epi_atom, cute.append(self.epi_tile, self.epi_buffers), order=(0, 1, 2))

    def make_ab_pipeline(self, storage, a_smem_layout_staged, b_smem_layout_staged,
                         a_tiles_per_stage: int = 1, producer_threads: int = 1,
                         consumer_warps: int | None = None, barriers=None):
        """The operand stages' pipeline, traced inside a kernel (the layouts: the kernel's
        arguments): each stage's full barrier expects the TMA bytes of ``a_tiles_per_stage`` A
        boxes and one B box and ``producer_threads`` arrivals; its empty barrier one arrive
        per consumer warp that reads it (``threads_per_tile // 32`` unless given). Its
        mbarriers: ``barriers`` (a smem MemRange of 2 x stages Int64), else
        ``storage.ab_full_empty``."""
        a_box = cute.slice_(a_smem_layout_staged, (None, None, 0))
        b_box = cute.slice_(b_smem_layout_staged, (None, None, 0))
        tma_bytes = (a_tiles_per_stage * cute.size_in_bytes(self.a_dtype, a_box)
                     + cute.size_in_bytes(self.b_dtype, b_box))
        if consumer_warps is None:
            consumer_warps = self.threads_per_tile // 32
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=(storage.ab_full_empty if barriers is None else barriers).data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producer_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
            tx_count=tma_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)

    def operand_smem(self, a_smem_layout_staged, b_smem_layout_staged, epi_smem_layout_staged,
                     **pipeline_kwargs):
        """Traced inline at the top of a kernel: the CTA's smem struct (``shared_storage``),
        the operand stages' pipeline (``make_ab_pipeline`` with ``pipeline_kwargs``) with its
        init arrive issued (the kernel issues ``pipeline_init_wait`` once its partitions are
        built), and the staged A, B and epilogue tensors: (storage, ab_pipeline, sA, sB, sC).
        A kernel with two A tiles a stage (the gated wgrad) splits ``storage.sA`` itself."""
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = self.make_ab_pipeline(storage, a_smem_layout_staged, b_smem_layout_staged,
                                            **pipeline_kwargs)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_layout_staged.outer,
                                   swizzle=epi_smem_layout_staged.inner)
        return storage, ab_pipeline, sA, sB, sC

    @staticmethod
    def prefetch_descriptors(*atoms) -> None:
        """The load warp's prefetch of its TMA descriptors (None entries skipped). Traced
        inline, under the kernel's ``if warp_idx == self.load_warp``."""
        for atom in atoms:
            if atom is not None:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

    def make_shared_storage(self, a_tiles_per_stage: int = 1, extra_fields=None):
        """The CTA's smem struct: the operand stages' full/empty mbarriers, ``extra_fields``
        (name -> struct member type, in order: the megakernel's comm and ticket words), the A
        stages (``a_tiles_per_stage`` tiles each: the gated wgrad keeps two), the B stages and
        the epilogue buffers."""

        def aligned(dtype, elements):
            return cute.struct.Align[cute.struct.MemRange[dtype, elements], self.buffer_align_bytes]

        # built from a dict: this module's annotations are strings (PEP 563), which
        # cute.struct does not evaluate
        fields = {
            "ab_full_empty": cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2],
            **(extra_fields or {}),
            "sA": aligned(self.a_dtype, a_tiles_per_stage * cute.cosize(self.a_smem_layout_staged)),
            "sB": aligned(self.b_dtype, cute.cosize(self.b_smem_layout_staged)),
            "sC": aligned(self.c_dtype, cute.cosize(self.epi_smem_layout_staged)),
        }
        storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        assert storage.size_in_bytes() <= self.smem_capacity, (
            f"{storage.size_in_bytes()} B of smem, {self.smem_capacity} B on the SM")
        return storage

    def operand_stages(self, fit: int) -> int:
        """The operand stages of a configuration whose smem holds ``fit``: ``max_ab_stages``
        caps them."""
        return fit if self.max_ab_stages is None else min(fit, self.max_ab_stages)

    @staticmethod
    def staged_layout(dtype, tile_mk, stages, mn_major: bool = False):
        """A swizzled smem layout of ``stages`` (rows, K) operand tiles: K contiguous (128B
        swizzle along K), or with ``mn_major`` the rows contiguous (swizzled along them)."""
        kind = utils.LayoutEnum.COL_MAJOR if mn_major else utils.LayoutEnum.ROW_MAJOR
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(kind, dtype, tile_mk[0] if mn_major else tile_mk[1]),
            dtype)
        return cute.tile_to_shape(atom, cute.append(tile_mk, stages),
                                  order=(1, 0, 2) if mn_major else (0, 1, 2))

    # ------------------------------------------------------------------ consumer side
    def consumer_parts(self, tiled_mma, sA, sB, sC, mma_slice, copy_tidx):
        """A consumer thread's wgmma operand fragments, fp32 accumulator, k-blocks per stage
        and epilogue partitions (registers -> smem by stmatrix), for MMA thread slice
        ``mma_slice`` and epilogue thread ``copy_tidx``. Traced inline (a plain method: the
        tensors and the TileEpilogue go back to the caller)."""
        tile_m, tile_n, _ = self.tile_shape_mnk
        thr_mma = tiled_mma.get_slice(mma_slice)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((tile_m, tile_n)), self.acc_dtype)
        # 16-bit outputs by stmatrix; fp32 ones (weight gradients added into main_grad) by
        # 8-byte stores (a thread's accumulator holds column pairs)
        if self.c_dtype.width == 16:
            store_op = sm90_utils.sm90_get_smem_store_op(utils.LayoutEnum.ROW_MAJOR,
                                                         elem_ty_d=self.c_dtype,
                                                         elem_ty_acc=self.acc_dtype)
            c_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.c_dtype)
        else:
            store_op = c_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype,
                                                    num_bits_per_copy=64)
        tiled_copy_r2s = cute.make_tiled_copy_S(store_op,
                                                cute.make_tiled_copy_C_atom(c_atom, tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(copy_tidx)
        epi = TileEpilogue(tiled_copy_r2s, thr_copy_r2s.partition_D(sC),
                           tiled_copy_r2s.retile(acc),
                           cute.shape(thr_copy_r2s.partition_S(sC))[:3], sC)
        return tCrA, tCrB, acc, cute.size(tCrA, mode=[2]), epi

    def epilogue_sync(self, warp_idx, warpgroup_idx):
        """A consumer thread's epilogue synchronisation, traced inline: the TMA store pipeline
        of the threads that share a tile (``threads_per_tile``), their named barrier
        (``NamedBarriers.EPILOGUE``; pingpong: one per warpgroup) and whether this thread's warp
        issues the tile's TMA stores (the first warp of the tile's threads)."""
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads_per_tile))
        if self.pingpong:
            barrier = pipeline.NamedBarrier(
                barrier_id=int(common.NamedBarriers.EPILOGUE) + warpgroup_idx - 1,
                num_threads=self.threads_per_tile)
            return store_pipeline, barrier, warp_idx == 4 * warpgroup_idx
        barrier = pipeline.NamedBarrier(barrier_id=int(common.NamedBarriers.EPILOGUE),
                                        num_threads=self.threads_per_tile)
        return store_pipeline, barrier, warp_idx == 4

    @cute.jit
    def mma_k_tile(self, tiled_mma, acc, tCrA, tCrB, stage, num_k_blocks: cutlass.Constexpr):
        """Issue the wgmmas of one K-tile (``num_k_blocks`` k16 blocks) from smem ``stage``
        and commit them as one group."""
        for kb in cutlass.range_constexpr(num_k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], acc)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def mainloop(self, ab_pipeline, tiled_mma, acc, tCrA, tCrB, loads: Int32, k_tiles: Int32,
                 num_k_blocks: cutlass.Constexpr[int], hook_args=None):
        """One output tile's wgmmas over its ``k_tiles`` stages, from stage use ``loads`` on:
        one batch stays in flight, and a stage is released once the batch that read it has
        retired. Written in CUTLASS's form (one k-tile before the loop, plain ``range``: the
        ``cutlass.range(unroll=1)`` form ran at half speed). Returns the last stage's state:
        the caller waits for the last batch (``warpgroup.wait_group(0)``) and releases it."""
        read = pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages, loads)
        release = read.clone()
        acc.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        self.mainloop_begin(hook_args)
        cute.nvgpu.warpgroup.fence()
        t0 = self.first_stage_wait(hook_args)
        ab_pipeline.consumer_wait(read)
        self.first_stage_ready(t0, hook_args)
        self.stage_ready(hook_args)
        self.mma_k_tile(tiled_mma, acc, tCrA, tCrB, read.index, num_k_blocks)
        read.advance()
        for k in range(1, k_tiles):
            ab_pipeline.consumer_wait(read)
            self.stage_ready(hook_args)
            self.mma_k_tile(tiled_mma, acc, tCrA, tCrB, read.index, num_k_blocks)
            cute.nvgpu.warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release)
            release.advance()
            read.advance()
            self.k_tile_issued(k, hook_args)
        self.mainloop_end(k_tiles, hook_args)
        return release

    # Mainloop hooks: no code by default; kernels override the ones they need.
    @cute.jit
    def mainloop_begin(self, hook_args):
        """Before the first stage wait (the pingpong GEMM waits for its turn here)."""
        pass

    @cute.jit
    def first_stage_wait(self, hook_args) -> Int64:
        """Just before the wait for the tile's first stage: a start time, if recorded."""
        return Int64(0)

    @cute.jit
    def first_stage_ready(self, t0: Int64, hook_args):
        """After the wait for the tile's first stage (started at ``t0``)."""
        pass

    @cute.jit
    def stage_ready(self, hook_args):
        """After every stage's full wait, before wgmma reads the stage."""
        pass

    @cute.jit
    def k_tile_issued(self, k: Int32, hook_args):
        """After k-tile ``k`` (>= 1) is issued and the stage before it released."""
        pass

    @cute.jit
    def mainloop_end(self, k_tiles: Int32, hook_args):
        """After the last k-tile is issued, before the caller's final wait."""
        pass


    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def tile_epilogue(self, epi: "TileEpilogue", atoms, g_tiles, kind: cutlass.Constexpr[str],
                      buf_base, subtiles_done, barrier, store_pipeline, is_store_warp,
                      visit_args=None, n_out: cutlass.Constexpr[int] = 0, alt=None,
                      use_alt=None):
        """One output tile: for each (tile rows / epi rows) x (output columns / EPI_N) subtile,
        ``epi_visit_subtile`` computes ``epi_outputs`` fp32 fragments from the accumulator
        (epilogue ``kind``), which go bf16 -> smem (stmatrix) -> global by TMA, output ``o``
        through ``atoms[o]`` into ``g_tiles[o]``, the tile's (tile rows, output columns) view
        of its tensor. The buffers rotate over ``epi_stages`` stages of one buffer per output,
        from ``buf_base``. A stage is written again only once the store warp has seen its last
        TMA stores read it: two barriers per subtile, the second one passing on the store
        warp's acquire (at most ``epi_stages - 1`` subtiles' stores unread) before anyone
        writes the next stage. ``n_out``: store only the first ``n_out`` outputs (0: all
        ``epi_outputs``; a kernel whose tasks store different numbers of outputs). ``alt``:
        other (atoms, g_tiles) of the same shapes, stored to instead where the run-time
        ``use_alt`` holds (a TMA atom cannot be chosen at run time, only its copy)."""
        n_out = n_out or self.epi_outputs
        epi_tile = self.epi_tile
        out_tile_n = self.tile_shape_mnk[1] // 2 if const_expr(kind == "swiglu") else self.tile_shape_mnk[1]
        parts = []
        for o in cutlass.range_constexpr(n_out):
            parts.append(cute.nvgpu.cpasync.tma_partition(
                atoms[o], 0, cute.make_layout(1), cute.group_modes(epi.sC, 0, 2),
                cute.zipped_divide(g_tiles[o], epi_tile)))
        alt_parts = []
        if const_expr(alt is not None):
            for o in cutlass.range_constexpr(n_out):
                alt_parts.append(cute.nvgpu.cpasync.tma_partition(
                    alt[0][o], 0, cute.make_layout(1), cute.group_modes(epi.sC, 0, 2),
                    cute.zipped_divide(alt[1][o], epi_tile)))
        outs = [cute.make_rmem_tensor(epi.frag_shape, Float32) for _ in range(n_out)]
        out_c = cute.make_rmem_tensor(epi.frag_shape, self.c_dtype)
        epi_m = self.tile_shape_mnk[0] // epi_tile[0]  # rows of a warpgroup's (pingpong) or the CTA's tile
        out_n = out_tile_n // epi_tile[1]
        for sm in cutlass.range_constexpr(epi_m):
            for sn in cutlass.range_constexpr(out_n):
                self.epi_visit_subtile(epi, kind, sm, sn, outs, visit_args)
                stage = (subtiles_done + sm * out_n + sn) % self.epi_stages
                for o in cutlass.range_constexpr(n_out):
                    out_c.store(outs[o].load().to(self.c_dtype))
                    cute.copy(epi.tiled_copy, out_c,
                              epi.tRS_sC[(None, None, None, buf_base + stage * n_out + o)])
                # stmatrix writes are generic-proxy; TMA reads through the async proxy
                cute.arch.fence_proxy("async.shared", space="cta")
                barrier.arrive_and_wait()
                if is_store_warp:
                    if const_expr(alt is not None):
                        if use_alt:
                            self._store_subtile(alt[0], alt_parts, buf_base + stage * n_out,
                                                sm, sn, n_out)
                        else:
                            self._store_subtile(atoms, parts, buf_base + stage * n_out, sm,
                                                sn, n_out)
                    else:
                        self._store_subtile(atoms, parts, buf_base + stage * n_out, sm, sn,
                                            n_out)
                    store_pipeline.producer_commit()
                    store_pipeline.producer_acquire()
                barrier.arrive_and_wait()

    def _store_subtile(self, atoms, parts, buf: Int32, sm: int, sn: int, n_out: int):
        """The store warp's TMA stores of subtile (sm, sn), output o from buffer ``buf + o``.
        Traced inline."""
        for o in range(n_out):
            bSG_sC, bSG_gC = parts[o]
            cute.copy(atoms[o], bSG_sC[(None, buf + o)], bSG_gC[(None, (sm, sn))])

    @cute.jit
    def epi_visit_subtile(self, epi: "TileEpilogue", kind: cutlass.Constexpr[str],
                          sm: cutlass.Constexpr[int], sn: cutlass.Constexpr[int], outs,
                          visit_args):
        """The fp32 values of subtile (sm, sn) of each output. "store": the accumulator.
        "swiglu": h = silu(g) * u from the gate and up halves of the accumulator (side by side
        in the tile), each rounded to bf16 first as a bf16 nn.Linear would (one numerics for
        inference and training). Kernels override it for their own epilogues."""
        frag_size = cute.size(outs[0])
        acc_n = self.tile_shape_mnk[1] // self.epi_tile[1]  # subtiles of the accumulator, row-major
        if const_expr(kind == "swiglu"):
            gate, up = self.swiglu_preact(epi, sm, sn)
            for v in cutlass.range_constexpr(frag_size):
                outs[0][v] = common.silu(gate[v]) * up[v]
        elif const_expr(kind == "add"):  # the accumulator plus an fp32 tile (AddendTile)
            first = (sm * acc_n + sn) * frag_size
            addend = visit_args.subtile(sm * acc_n + sn)
            for v in cutlass.range_constexpr(frag_size):
                outs[0][v] = epi.acc[first + v] + addend[v]
        else:
            first = (sm * acc_n + sn) * frag_size
            for v in cutlass.range_constexpr(frag_size):
                outs[0][v] = epi.acc[first + v]

    def swiglu_preact(self, epi: "TileEpilogue", sm: int, sn: int):
        """The gate and up values of subtile (sm, sn) (the accumulator's two halves, side by
        side in the tile), each rounded to bf16 as a bf16 nn.Linear would, in fp32 fragments.
        Traced inline."""
        frag_size = cute.size(epi.frag_shape)
        acc_n = self.tile_shape_mnk[1] // self.epi_tile[1]
        first = (sm * acc_n + sn) * frag_size
        gate = cute.make_rmem_tensor(epi.frag_shape, Float32)
        up = cute.make_rmem_tensor(epi.frag_shape, Float32)
        for v in range(frag_size):  # a plain method: unrolled as it is traced
            gate[v] = epi.acc[first + v]
            up[v] = epi.acc[first + acc_n // 2 * frag_size + v]
        gate.store(gate.load().to(cutlass.BFloat16).to(Float32))
        up.store(up.load().to(cutlass.BFloat16).to(Float32))
        return gate, up

    def epi_coords(self, epi: "TileEpilogue", tidx):
        """(row, column) of each of this thread's epilogue fragment elements inside a subtile
        (the register layout the stmatrix copy reads). Traced inline."""
        thr_copy = epi.tiled_copy.get_slice(tidx)
        return thr_copy.partition_S(cute.make_identity_tensor(self.epi_tile))


def smem_overlay(base, staged, offset_elems: int = 0, stage_stride=None, dtype=None):
    """``staged``'s swizzled boxes laid over ``base``'s smem from element ``offset_elems``: as
    ``staged`` lays them out, or with its stage mode ``stage_stride`` elements apart (a second
    tile form on a kernel's buffers); ``dtype``: its elements' type where it differs from
    ``base``'s (fp32 weight-gradient subtiles over bf16 buffers). Traced inline."""
    outer = staged.outer
    if stage_stride is not None:
        tile = cute.slice_(outer, (None, None, 0))
        outer = cute.make_layout(cute.append(tile.shape, cute.size(outer, mode=[2])),
                                 stride=cute.append(tile.stride, stage_stride))
    static_zero = isinstance(offset_elems, int) and offset_elems == 0
    ptr = base.iterator if static_zero else base.iterator + offset_elems
    return cute.make_tensor(cute.recast_ptr(ptr, staged.inner, dtype=dtype), outer)


def tma_tiles(atom, tensor, smem, box):
    """A TMA load's partitions: ``tensor``'s ``box`` tiles (box, tile coordinates...) and
    ``smem``'s stages (box, stage). Traced inline."""
    s_part, g_part = cute.nvgpu.cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
        cute.group_modes(cute.local_tile(tensor, box, (None, None, None)), 0, 2))
    return g_part, s_part


@cute.jit
def pipeline_state(kind: cutlass.Constexpr, stages: cutlass.Constexpr[int], count: Int32):
    """The pipeline state after ``count`` stage uses, built fresh (never carried through a
    run-time branch or out of a helper's loop: AGENTS.md)."""
    phase = (count // stages) % 2
    if const_expr(kind == pipeline.PipelineUserType.Producer):
        phase = phase ^ 1
    return pipeline.PipelineState(stages, count, count % stages, phase)


# ---------------------------------------------------------------------- the tile epilogue
class TileEpilogue:
    """A consumer thread's epilogue partitions, built once per CTA: the register -> smem
    (stmatrix) copy, its smem destination, the accumulator as that copy sees it, the
    per-subtile fragment shape, and the staged epilogue smem."""

    def __init__(self, tiled_copy, tRS_sC, acc, frag_shape, sC):
        self.tiled_copy, self.tRS_sC, self.acc, self.frag_shape, self.sC = (
            tiled_copy, tRS_sC, acc, frag_shape, sC)


class AddendTile:
    """The fp32 tile an epilogue ``"add"``s its accumulator to (a weight's main_grad), read
    from global memory in the epilogue's fragment order ``depth`` subtiles ahead of the
    subtile being stored, so each load's latency hides under the stores before it (4 ahead
    against 2: level to 2 % slower at 256 rows an expert, 2-3 % faster at 1024,
    docs/measurements.md). The sums go out by plain TMA stores: one read and one write per
    element, no L2 reduction. Built per output tile from ``main`` = (the tile's (rows,
    columns) view of the tensor, the same view of its coordinates, the tensor's shape);
    elements past the shape read 0. ``alt``: another such triple, read instead where the
    run-time ``use_alt`` holds (the backward megakernel's shared-expert tiles, whose stores
    take ``tile_epilogue``'s ``alt``). Traced inline."""

    def __init__(self, gemm: GemmCoreSm90, epi: TileEpilogue, main, copy_tidx, depth: int = 4,
                 alt=None, use_alt=None):
        self.epi, self.depth, self.use_alt = epi, depth, use_alt
        self.thr_copy = epi.tiled_copy.get_slice(copy_tidx)
        # (64, 32, M subtiles, N subtiles) views of each source's tile and of its coordinates
        self.sources = [(cute.flat_divide(g, gemm.epi_tile), cute.flat_divide(c, gemm.epi_tile),
                         bounds) for g, c, bounds in ([main] if alt is None else [main, alt])]
        self.per_row = gemm.tile_shape_mnk[1] // gemm.epi_tile[1]
        self.count = gemm.tile_shape_mnk[0] // gemm.epi_tile[0] * self.per_row
        self.frags = []

    def subtile(self, idx: int) -> cute.Tensor:
        """Subtile ``idx``'s fragment (row-major subtile order), its loads and those of the
        next ``depth`` subtiles issued."""
        while len(self.frags) < min(idx + 1 + self.depth, self.count):
            k = len(self.frags)
            where = (None, None, k // self.per_row, k % self.per_row)
            parts = [(self.thr_copy.partition_D(g[where]), self.thr_copy.partition_D(c[where]),
                      bounds) for g, c, bounds in self.sources]
            frag = cute.make_rmem_tensor(self.epi.frag_shape, Float32)
            if const_expr(len(parts) == 1):
                self.load(frag, *parts[0])
            else:
                self.load_either(frag, parts[0], parts[1], self.use_alt)
            self.frags.append(frag)
        return self.frags[idx]

    @cute.jit
    def load_either(self, frag: cute.Tensor, main, alt, use_alt):
        """``load`` from ``alt``'s (partition, coordinates, bounds) where ``use_alt``, else
        from ``main``'s."""
        if use_alt:
            self.load(frag, *alt)
        else:
            self.load(frag, *main)

    @cute.jit
    def load(self, frag: cute.Tensor, g_part: cute.Tensor, c_part: cute.Tensor, bounds):
        """``frag`` (an epilogue fragment) from its global subtile ``g_part``, one 8-byte load
        per column pair; pairs whose coordinate (``c_part``) lies outside ``bounds`` read 0."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
        frag.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(frag, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(frag, mode=[2])):
                if cute.elem_less(c_part[(0, i, j)], bounds):
                    cute.copy(atom, g_part[(None, i, j)], frag[(None, i, j)])
