"""Numbers and static configurations the host code and the kernels share. Imports nothing
heavy (no DSL, no torch), so the host side (plans, task lists, the simulator, tests) uses them
without compiling anything."""

import dataclasses

TILE_M = 128  # GEMM tile height, and the padding granule of each expert's row segment
TILE_K = 64  # GEMM k-tile depth (bf16: one 128-byte swizzle row)
VEC_ELEMS = 8  # bf16 per 16-byte vector (row copies, the k-sum)
MAX_TOP_K = 16  # the k-sums unroll K at compile time

# Megakernel
TASK_TILE_N = 256  # output columns of an FC1 (half gate, half up) or FC2 task
BACKWARD_TILE_N = 256  # the backward megakernel's N-tile: FC2_DGRAD over I, FC1_DGRAD over H
# the backward megakernel's comm tasks (kernels/megakernel/backward_comm.py): rows per task, the
# dgated partial columns a row's sum takes (I <= 32768 at N-tile 128), int64 scalars (the
# symmetric fields' offsets, top_k)
BACKWARD_COMM_ROWS = 32
BACKWARD_MAX_PARTIAL_COLS = 256
BACKWARD_COMM_SCALARS = 6
BACKWARD_KSUM_ROWS = 32  # local tokens per KSUM task of the backward's group tail
# a (token, k) slot of the training fields router_weights / d_topk_partials: one fp32 value
# padded to a 16-byte row (comm.peers' layout)
SLOT_ROW_BYTES = 16
# FC2's dgrad (one-GPU launch and backward megakernel alike) runs as pingpong 128-wide tiles up to
# this K (= H), as cooperative 128 x 256 ones above it: pingpong / cooperative measured gptoss 0.91,
# mixtral 0.81, sonic 0.89, qwen3 1.01, dsv3 (K 7168) 1.03 (H200, docs/measurements.md, 2026-12-02)
FC2_DGRAD_PINGPONG_MAX_K = 6144
FC2_DGRAD_PINGPONG_TILE_N = 128


def fc2_dgrad_pingpong(hidden: int) -> bool:
    """Whether FC2's dgrad runs as pingpong 128-wide tiles at this H (= its K)."""
    return hidden <= FC2_DGRAD_PINGPONG_MAX_K


def fc2_dgrad_tile_n(pingpong: bool) -> int:
    """FC2's dgrad N-tile over I in that form (the row partials' column width)."""
    return FC2_DGRAD_PINGPONG_TILE_N if pingpong else BACKWARD_TILE_N


# The training FC1 launch (saving g | u) and both dgrad launches run on 3 operand stages, not the
# 4 that fit, where experts average at most this many routed rows (T * K / E). H100, bitwise, 3 / 4 stages
# time (docs/measurements.md, 2026-12-06): gptoss_120b (256 rows an expert) FC1 0.785, FC2's
# dgrad 0.846, FC1's 0.703; qwen3's sizes at 256 rows 0.815 / 0.843 / 0.913; at 1024 rows and
# more 3 stages cost FC1 2-15 % (the five shapes) and the dgrads up to 18 % (mixtral's FC2
# dgrad). The weight gradients (K = each expert's rows) want their 4 everywhere, FC2's forward
# launch is mixed (0.98-1.08), and the inference FC1 is 3-6 % slower on 3 (gptoss 1.063, qwen3's sizes
# at 256 rows 1.030, 2026-12-06 thirty-first session), as are the FP8 launches (up to 1.29). Why is not known.
FEW_ROWS_MAX = 256
FEW_ROWS_STAGES = 3


def few_rows_stage_cap(rows_per_expert: float | None) -> int | None:
    """The operand-stage cap (None: as many as fit) of the training FC1 and the dgrad launches for
    experts of ``rows_per_expert`` routed rows on average (None: unknown, as many as fit)."""
    if rows_per_expert is not None and rows_per_expert <= FEW_ROWS_MAX:
        return FEW_ROWS_STAGES
    return None

TICKETS = 2  # int32 words after rank 0's counters: the comm and compute ticket counters
KSUM_ROWS = 8  # local tokens per KSUM task (must divide TILE_M)
ERROR_SLOTS = 8  # launches whose error word may be in flight before a call waits for the oldest

# The megakernel's run-time scalars (int64 words of ``Plan.scalars``), in order.
SCALAR_FIELDS = ("epoch", "rank_base", "tiles_per_minibatch", "x_offset", "combine_offset",
                 "flags_offset", "timeout_ns", "local_experts", "static_tiles", "silent_rank")
SCALARS = len(SCALAR_FIELDS)
SCALAR_INDEX = {name: i for i, name in enumerate(SCALAR_FIELDS)}  # host-side writes and kernels' reads

# Error word of a bounded wait (int64, kept positive): 0 = no error, else
# (task_id + 1) | peer << 32 | rank << 44 | code << 56, with ``rank`` the (virtual) rank that
# waited and ``peer`` the one it waited for. The highest code wins (atomic max), so the root
# cause outranks the waits that gave up behind it.
ERROR_PEER_SHIFT, ERROR_RANK_SHIFT, ERROR_CODE_SHIFT = 32, 44, 56
ERROR_RANK_MASK = (1 << 12) - 1
PEER_FAILED = 1  # the peer's launch of this call (or of a later one) had an error
WAIT_TIMEOUT = 2  # a wait passed its deadline (the peer had started this launch)
PEER_NEVER_STARTED = 3  # ... and the peer never announced its start
SAVED_ROWS_SHORT = 4  # host-written: a rank received more rows than its forward kept g | u
# for (MoKConfig.saved_rows_factor or saved_rows_pool); the word's low 32 bits hold how many more

# Cross-rank flags: every rank's symmetric ``barrier_flags`` holds 2R int32 words, written only
# by their rank s. Word s is s's progress in call ``epoch`` (``FLAG_STEPS`` values per call, so
# it only grows): started, then "my pushes into you are done". Word R + s is the last epoch in
# which s's launch failed. It is sticky: s's next call overwrites the progress word, and a
# slower peer still in the failed call, whose waits that next call's flags satisfy, reads the
# failure here (``kernels.common.store_flag`` / ``peer_failed``).
FLAG_STEPS = 2


def flag_started(epoch):
    return FLAG_STEPS * epoch - 1


def flag_done(epoch):
    return FLAG_STEPS * epoch


# Timeline recorder buffer: int64 buf[8 + 4 * capacity]; buf[0] capacity, buf[1] ticket
# counter (may pass capacity: the excess is the dropped count), buf[2] start ns (first writer
# wins). Record i = buf[8 + 4i : 8 + 4i + 4]: word0 role | type << 8 | rank << 16 | sm << 32
# | cta << 48, word1 task id, word2/3 ns.
TIMELINE_HEADER_WORDS = 8
TIMELINE_RECORD_WORDS = 4


@dataclasses.dataclass(frozen=True)
class MegakernelSpec:
    """The static configuration of one compiled megakernel (``kernels.megakernel``), resolved
    by the host plan (``mok_cute.megakernel.plan_for``) from the shapes and ``MoKConfig``.

    num_ranks       virtual ranks in the launch (1: one GPU, or this process's IPC rank)
    num_ctas        the grid (every CTA resident: a cooperative launch)
    num_comm_ctas   CTAs 0 .. num_comm_ctas - 1 walk the comm queue; 0 at one rank whose list
                    has no comm task (the BARRIER is then a compute task)
    top_k           K (the k-sum is unrolled over it)
    has_shared      the shared expert's tasks are in the list
    scope           "gpu" (virtual ranks) or "sys" (peers on other GPUs): flags and counters
    timeline        record one span per task (``mok_cute.timeline``)
    rows_in_place   a rank's own rows are read where they are (never copied; the ring holds
                    every routed row)
    tickets         "static", "dynamic" or "strided" (``MegakernelOptions.tickets``)
    defer_signals   one rank, no comm task, the ticket ring: a GEMM task's publish waits until
                    the CTA's next task needs it out of the way
    save_preact     a training forward: FC1 (and the shared expert's FC1) also stores each
                    routed row's bf16 g | u into the row the host's row map names
                    (``row_epilogue``), the same bits as the one-GPU training forward
    fp8             the routed experts' GEMMs in e4m3 with 1 x 128 / 128 x 128 power-of-two
                    scales (``precision="fp8"``): x and h rows travel and sit in the rings as
                    packed rows (``fp8.packed_row_bytes``: the e4m3 data, then the row's
                    exponents), FC1 writes h quantized (and with save_preact g | u in bf16);
                    the shared expert stays bf16. No deferred publishes
    """

    num_ranks: int = 1
    num_ctas: int = 132
    num_comm_ctas: int = 0
    top_k: int = 8
    has_shared: bool = False
    scope: str = "gpu"
    timeline: bool = False
    rows_in_place: bool = True
    tickets: str = "strided"
    defer_signals: bool = False
    save_preact: bool = False
    fp8: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.num_comm_ctas < self.num_ctas:
            raise ValueError(f"num_comm_ctas must be in [0, num_ctas={self.num_ctas}), "
                             f"got {self.num_comm_ctas}")
        if self.num_comm_ctas == 0 and self.num_ranks != 1:
            raise ValueError(f"num_comm_ctas=0 needs num_ranks=1, got num_ranks={self.num_ranks}")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [1, {MAX_TOP_K}], got {self.top_k}")
        if self.scope not in ("gpu", "sys"):
            raise ValueError(f"scope must be 'gpu' or 'sys', got {self.scope!r}")
        if self.tickets not in ("static", "dynamic", "strided"):
            raise ValueError(f"tickets must be 'static', 'dynamic' or 'strided', got {self.tickets!r}")
        if self.defer_signals and not (self.num_ranks == 1 and self.ticket_ring):
            raise ValueError("defer_signals needs one rank and the ticket ring")
        if self.fp8 and self.defer_signals:
            raise ValueError("fp8 plans publish without deferral: no defer_signals")

    @property
    def ticket_ring(self) -> bool:
        """Compute tickets go through the smem ring of decoded task words."""
        return self.tickets != "static"

    @property
    def rank_blocks(self) -> bool:
        """Virtual ranks walk the list block by block (a minibatch each), rank by rank."""
        return self.num_ranks > 1
