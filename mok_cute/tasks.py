"""The megakernel's ordered task list, built on the host.

One layer call on one rank is one ordered list of tasks. Communication CTAs (the first
``num_comm_sms`` CTAs) take the COMM tasks in list order, compute CTAs take the COMPUTE tasks
in list order, each through an atomic ticket on its role's queue. A task waits only on tasks
with a lower index in the list. That is the deadlock-freedom argument: let ``t`` be the
lowest-index unfinished task; its dependencies are finished, and every task of its role with a
lower queue position also has a lower list index, so is finished, so some CTA of that role is
free to take ``t`` (every CTA is co-resident). ``t`` therefore finishes, and by induction all do.

Task types (``TaskType``, the same values as ``mok_cute.timeline.TaskType``)::

    SHARED_FC1 (s, n)  compute  shared expert gate/up tile: local tokens [s*tile_m, ...), N-tile n
    SHARED_FC2 (s, n)  compute  shared expert down tile
    DISPATCH   (j, c)  comm     pull the rows of receive-schedule M-tile j (chunk c) into the ring
    FC1        (j, n)  compute  gate/up GEMM + SwiGLU of M-tile j, N-tile n over the interleaved
                                [2I] gate/up output (n covers h columns [n*fc1_tile_n/2, ...))
    FC2        (j, n)  compute  down GEMM of M-tile j, N-tile n over [H]
    COMBINE    (j, c)  comm     push the y rows of M-tile j (chunk c) to their source ranks
    BARRIER            comm     group barrier after this rank's last combine (unicast flags)
    KSUM       (s, c)  compute  fixed-order weighted k-sum (+ shared row) of local tokens
                                [s*tile_m + c*ksum_rows, ...) (ksum_rows divides tile_m, so
                                the k-sum uses every compute SM, not one per 128 tokens)

Rows. M-tile ``j`` covers padded receive-schedule rows ``[j*tile_m, (j+1)*tile_m)`` (the
schedule pads every expert segment to ``tile_m``, so a tile belongs to one expert). Minibatch
``m`` is the contiguous tile range ``[m*tpm, (m+1)*tpm)`` with ``tpm = minibatch_tokens //
tile_m``. Schedule row ``p`` lives in ring row ``p % ring_tokens``; the ring holds the x rows
(dispatch), h rows (FC1 output) and y rows (FC2 output) at the same ring row.
``ring_tokens`` must be a multiple of ``tile_m`` (a tile is never split by the wrap) and at
least ``minibatch_tokens`` (otherwise FC1 of a minibatch would wait on FC2 of the same
minibatch, which comes later in the compute order: ValueError naming ``ring_tokens``). A ring
smaller than the routed rows is fine: it wraps, nothing is dropped.

Dependencies, per M-tile (``Rt = ring_tokens // tile_m`` tiles; "previous occupant" of the
ring rows of tile j is tile ``j - Rt``; waiting on it transitively covers every earlier one)::

    DISPATCH(j)  <- FC1 of tile j-Rt, all n            (last reader of the x rows it overwrites)
    FC1(j, n)    <- DISPATCH of tile j (or of its whole minibatch, dispatch_wait="minibatch")
                 <- FC2 of tile j-Rt, all n            (last reader of the h rows it overwrites)
    FC2(j, n)    <- FC1 of tile j, all n               (the down projection needs the full h row)
                 <- COMBINE of tile j-Rt               (last reader of the y rows it overwrites)
    COMBINE(j)   <- FC2 of tile j, all n
    SHARED_FC2(s, n) <- SHARED_FC1 of tile s, all n
    BARRIER      <- every COMBINE (without comm tasks: every FC2 tile)
    KSUM(s, c)   <- BARRIER (all peers have combined into us), SHARED_FC2 of tile s, all n

Order. The compute queue is: all shared-expert tiles (so the shared expert overlaps the first
dispatch), then per minibatch its FC1 tiles (tile-major, N-tiles inner, so a tile can start as
soon as its rows land; ``tile_order="n_major"``: N-tile-major, so concurrent tiles share a
weight tile) then its FC2 tiles (with ``fc1_lead=L``: FC1 of minibatch m + L before FC2 of
m), then the KSUM tiles. Without comm tasks (one rank reading its own rows in place) the
comm queue is the BARRIER alone, or empty with ``barrier_in_compute``: the BARRIER is then a
compute task between the last FC2 and the first KSUM, and the launch needs no comm CTA. The
comm queue is sorted by an
estimated ready time measured in cumulative compute FLOPs along the compute queue: COMBINE(j)
at the end of FC2(j); DISPATCH(j) at the later of "its ring rows are free" (end of FC1(j-Rt))
and "``dispatch_lookahead_tokens`` ahead of compute" (start of FC1 of tile j - lookahead); the
BARRIER last. The two queues are then merged into one list such that every wait points to a
lower index (a merge that fails raises; it cannot fail for valid parameters).

Counters and waits (what the device consumes). Every task, when it finishes, adds 1 to exactly
one int32 counter (release), its "signal". A wait is ``(group, first, count, target)``: spin
(acquire) until ``counter[group][i] >= target`` for every ``i`` in ``[first, first+count)``.
Each target equals the number of tasks that signal that counter, so a wait is exactly "all
those tasks are done". Counter groups (``CounterGroup``), each an array laid out back to back
(``counter_offsets``)::

    DISPATCHED[tile]      dispatch chunks done per M-tile      (dispatch_wait="tile")
    DISPATCHED_MB[mb]     dispatch chunks done per minibatch   (dispatch_wait="minibatch")
    FC1_DONE[tile]        FC1 N-tiles done per M-tile
    FC2_DONE[tile]        FC2 N-tiles done per M-tile
    COMBINED[tile]        combine chunks done per M-tile
    SHARED_FC1_DONE[s]    SHARED_FC1_DONE[s], SHARED_FC2_DONE[s]: shared-expert tiles
    SHARED_FC2_DONE[s]
    BARRIER_DONE[1]       1 once this rank's barrier has seen every peer's flag
    KSUM_DONE[1]          KSUM tiles done

Counters must be zero at launch (cleared by the host or by the previous launch's tail).

Static capacity and no-op tasks. The real token counts live on the device and the kernel must
not recompile, so the list the kernel gets is built from the schedule's *static capacity*
(``capacity // tile_m`` M-tiles, every tile full; see ``build_static``), never from the
device counts. At run time the kernel reads ``num_tiles`` (device scalar) and derives

    live      = ceil(num_tiles / tpm)              minibatches holding at least one real tile
    live_tile_end = min(live * tpm, num_static_tiles)

- a task whose ``minibatch >= live`` is dead: the CTA skips it without running or signalling;
- a task of a live minibatch whose M-tile is ``>= num_tiles`` is a no-op but still signals, so
  every static target stays exact;
- a wait on a per-tile group is clipped to tiles ``< live_tile_end``, on DISPATCHED_MB to
  minibatches ``< live`` (only BARRIER's range wait over all tiles is ever clipped: every other
  wait points at the task's own tile or an earlier one, which is live);
- so the CTAs do not even fetch the dead tail, each role's queue is walked through
  ``queue_live_len[role, live]``: ticket ``q`` maps to queue position ``q`` while
  ``q < queue_live_len[role, live]`` and to ``queue_tail_begin[role] + (q - live_len)``
  after it; positions ``>= queue_len[role]`` end the CTA's loop. The head of the compute queue
  (shared expert) is in every prefix; the tail (BARRIER, KSUM) follows it. Only the dead
  dispatches interleaved before the last live combine are fetched and skipped (at most
  ``dispatch_lookahead_tokens / tile_m`` tiles' worth).

The simulator builds lists from the actual counts (``build_from_expert_counts``), which is the
same list with the dead and no-op tasks left out.

Device encoding (``encode`` in ``mok_cute.task_encoding``, which holds the host-side
encoding): int32 ``[num_tasks, TASK_WORDS]``, row ``i`` = task ``i``::

    0 type      1 role        2 minibatch (-1: shared expert / finish)
    3 m_tile_begin            4 m_tile_end (exclusive; shared and KSUM: local token tiles)
    5 n_tile (FC N-tile, comm chunk index, KSUM chunk index, else 0)
    6 row_begin 7 row_end     padded schedule rows (shared / KSUM: local token rows)
    8 ring_row_begin          row_begin % ring_tokens (routed tasks), else -1
    9 signal_group            10 signal_index (within the group)
    11 num_waits              12 + 4*w .. 15 + 4*w: wait w = (group, first, count, target),
                              unused slots are (-1, 0, 0, 0); MAX_WAITS = 3

``task_encoding.encode_device`` adds the per-role queues and the tables described above.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np


__all__ = [
    "Role",
    "TaskType",
    "TaskWord",
    "CounterGroup",
    "Task",
    "TaskList",
    "TaskListParams",
    "MAX_WAITS",
    "TASK_WORDS",
    "build_task_list",
    "build_static",
    "build_from_expert_counts",
    "build_for_schedule",
    "tile_rows_from_expert_counts",
]


class Role(enum.IntEnum):
    COMM = 0
    COMPUTE = 1


class TaskType(enum.IntEnum):
    """Task types of the list, and the span types the timeline recorder writes."""

    DISPATCH = 0
    FC1 = 1
    FC2 = 2
    COMBINE = 3
    SHARED_FC1 = 4
    SHARED_FC2 = 5
    KSUM = 6
    BARRIER = 7
    WAIT = 8  # a wait on a task's counters (recorder on; task id: the waiting task)
    # a GEMM task's consumers waiting for its first stage: the producer was still resolving the
    # task or loading its first k-tile (megakernel, recorder on; task id: the task)
    STAGE_WAIT = 9
    # a GEMM task's phases, inside its span (megakernel, recorder on; task id: the task):
    # EPILOGUE from its mainloop's last wgmma to its last output store issued, SIGNAL the
    # store warp's wait for those stores to land, its fence and the publish
    EPILOGUE = 10
    SIGNAL = 11


class TaskWord(enum.IntEnum):
    """Word offsets of a task row of the device encoding (``task_encoding.encode``)."""

    TYPE = 0
    ROLE = 1
    MINIBATCH = 2
    M_TILE = 3
    M_TILE_END = 4
    N_TILE = 5
    ROW_BEGIN = 6
    ROW_END = 7
    RING_ROW = 8
    SIGNAL_GROUP = 9
    SIGNAL_INDEX = 10
    NUM_WAITS = 11
    WAITS = 12  # wait w: words WAITS + 4 w .. + 3 = (group, first, count, target)


class CounterGroup(enum.IntEnum):
    DISPATCHED = 0
    DISPATCHED_MB = 1
    FC1_DONE = 2
    FC2_DONE = 3
    COMBINED = 4
    SHARED_FC1_DONE = 5
    SHARED_FC2_DONE = 6
    BARRIER_DONE = 7
    KSUM_DONE = 8


# How a wait on each group is clipped at run time ("tile": to live_tile_end, "minibatch": to live).
_TILE_GROUPS = (CounterGroup.DISPATCHED, CounterGroup.FC1_DONE, CounterGroup.FC2_DONE,
                CounterGroup.COMBINED)
_MINIBATCH_GROUPS = (CounterGroup.DISPATCHED_MB,)

MAX_WAITS = 3
TASK_WORDS = TaskWord.WAITS + 4 * MAX_WAITS

_ROLE_OF = {
    TaskType.DISPATCH: Role.COMM, TaskType.COMBINE: Role.COMM, TaskType.BARRIER: Role.COMM,
    TaskType.FC1: Role.COMPUTE, TaskType.FC2: Role.COMPUTE, TaskType.SHARED_FC1: Role.COMPUTE,
    TaskType.SHARED_FC2: Role.COMPUTE, TaskType.KSUM: Role.COMPUTE,
}

_BF16 = 2  # bytes per element of x, h, y, weights


@dataclasses.dataclass(frozen=True)
class Task:
    """One task, as a readable record (``TaskList[i]``)."""

    index: int
    type: TaskType
    role: Role
    minibatch: int
    m_tile_begin: int
    m_tile_end: int
    n_tile: int
    row_begin: int
    row_end: int
    ring_row_begin: int
    bytes: int  # comm: payload bytes moved; compute: operand + result bytes of the tile
    flops: int  # executed MMA FLOPs (full tile_m rows; padding rows included)
    signal: tuple[CounterGroup, int]
    waits: tuple[tuple[CounterGroup, int, int, int], ...]
    deps: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TaskListParams:
    hidden: int
    intermediate: int
    num_tokens: int
    top_k: int
    tile_m: int
    fc1_tile_n: int
    fc2_tile_n: int
    minibatch_tokens: int
    ring_tokens: int
    shared_intermediate: int
    rank: int
    num_ranks: int
    dispatch_wait: str
    comm_task_rows: int
    dispatch_lookahead_tokens: int
    finish: bool
    ksum_rows: int
    static: bool
    fc1_lead: int = 0
    comm_tasks: bool = True  # False: one rank reading its own rows in place, no DISPATCH/COMBINE
    barrier_in_compute: bool = False  # the BARRIER in the compute queue (needs comm_tasks=False)
    tile_order: str = "m_major"  # or "n_major": a minibatch's GEMM tiles N-tile by N-tile


@dataclasses.dataclass
class TaskList:
    """The ordered task list of one rank: struct of arrays, index = list position."""

    params: TaskListParams
    tile_rows: np.ndarray  # [num_m_tiles] real (unpadded) rows per M-tile
    type: np.ndarray
    role: np.ndarray
    minibatch: np.ndarray
    m_tile_begin: np.ndarray
    m_tile_end: np.ndarray
    n_tile: np.ndarray
    row_begin: np.ndarray
    row_end: np.ndarray
    ring_row_begin: np.ndarray
    bytes: np.ndarray
    flops: np.ndarray
    signal_group: np.ndarray
    signal_index: np.ndarray
    waits: np.ndarray  # [N, MAX_WAITS, 4] (group, first, count, target); group -1 = unused
    counter_sizes: np.ndarray  # [len(CounterGroup)]
    _deps: tuple[np.ndarray, np.ndarray] | None = dataclasses.field(default=None, repr=False)

    # ---- sizes -------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.type.shape[0])

    @property
    def num_m_tiles(self) -> int:
        return int(self.tile_rows.shape[0])

    @property
    def tiles_per_minibatch(self) -> int:
        return self.params.minibatch_tokens // self.params.tile_m

    @property
    def num_minibatches(self) -> int:
        return -(-self.num_m_tiles // self.tiles_per_minibatch)

    @property
    def ring_tiles(self) -> int:
        return self.params.ring_tokens // self.params.tile_m

    @property
    def fc1_n_tiles(self) -> int:
        return -(-2 * self.params.intermediate // self.params.fc1_tile_n)

    @property
    def fc2_n_tiles(self) -> int:
        return -(-self.params.hidden // self.params.fc2_tile_n)

    @property
    def comm_chunks_per_tile(self) -> int:
        return self.params.tile_m // self.params.comm_task_rows

    @property
    def counter_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counter_sizes)]).astype(np.int64)

    def queue(self, role: Role | int) -> np.ndarray:
        """List indices of the tasks of one role, in the order its CTAs take them."""
        return np.flatnonzero(self.role == int(role))

    def ksum_closes_compute_queue(self) -> bool:
        """Whether every compute task after the first KSUM is a KSUM. The megakernel's
        ksum_staged relies on it to reuse the GEMM stage buffers in the k-sum: both ticket
        walks hand out every rank's KSUM tail after all live GEMM positions, so a CTA whose
        tickets reached the KSUMs never loads another GEMM stage."""
        kinds = self.type[self.queue(Role.COMPUTE)]
        first = np.flatnonzero(kinds == int(TaskType.KSUM))
        return bool(first.size == 0 or (kinds[first[0]:] == int(TaskType.KSUM)).all())

    # ---- dependencies ------------------------------------------------------------------
    def deps_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """Dependencies as CSR ``(offsets [N+1], indices)``: the tasks that signal a counter
        in one of the task's waits (unclipped, i.e. as if every tile were live)."""
        if self._deps is None:
            self._deps = _deps_from_waits(self)
        return self._deps

    def deps(self, i: int) -> np.ndarray:
        off, idx = self.deps_csr()
        return idx[off[i]:off[i + 1]]

    # ---- records -----------------------------------------------------------------------
    def __getitem__(self, i: int) -> Task:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"task index {i} out of range for {n} tasks")
        i %= n
        waits = tuple(
            (CounterGroup(int(g)), int(f), int(c), int(t))
            for g, f, c, t in self.waits[i] if g >= 0
        )
        return Task(
            index=i, type=TaskType(int(self.type[i])), role=Role(int(self.role[i])),
            minibatch=int(self.minibatch[i]), m_tile_begin=int(self.m_tile_begin[i]),
            m_tile_end=int(self.m_tile_end[i]), n_tile=int(self.n_tile[i]),
            row_begin=int(self.row_begin[i]), row_end=int(self.row_end[i]),
            ring_row_begin=int(self.ring_row_begin[i]), bytes=int(self.bytes[i]),
            flops=int(self.flops[i]),
            signal=(CounterGroup(int(self.signal_group[i])), int(self.signal_index[i])),
            waits=waits, deps=tuple(int(d) for d in self.deps(i)),
        )

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


# ------------------------------------------------------------------------------------------
# argument checks


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_multiple(name: str, value: int, of_name: str, of: int) -> None:
    if value % of:
        raise ValueError(f"{name} must be a multiple of {of_name}={of}, got {value}")


def tile_rows_from_expert_counts(expert_counts, tile_m: int = 128) -> np.ndarray:
    """Real rows of each M-tile of a receive schedule whose expert segments hold
    ``expert_counts`` real rows each, padded to ``tile_m`` (schedule order)."""
    tile_m = _check_int("tile_m", tile_m, 1)
    counts = np.asarray(_as_numpy(expert_counts), dtype=np.int64).reshape(-1)
    if counts.size and counts.min() < 0:
        raise ValueError(f"expert_counts must be >= 0, got min {int(counts.min())}")
    tiles_per_expert = -(-counts // tile_m)
    total = int(tiles_per_expert.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    expert_of_tile = np.repeat(np.arange(counts.size), tiles_per_expert)
    first_tile = np.cumsum(tiles_per_expert) - tiles_per_expert
    within = np.arange(total) - first_tile[expert_of_tile]
    return np.minimum(tile_m, counts[expert_of_tile] - within * tile_m)


def _as_numpy(x):
    if hasattr(x, "detach"):  # torch tensor, possibly on a device (host sync)
        return x.detach().cpu().numpy()
    return x


# ------------------------------------------------------------------------------------------
# builders


TILE_ORDERS = ("m_major", "n_major")


def build_task_list(
    tile_rows: Sequence[int] | np.ndarray,
    *,
    hidden: int,
    intermediate: int,
    num_tokens: int,
    top_k: int,
    minibatch_tokens: int,
    ring_tokens: int,
    tile_m: int = 128,
    fc1_tile_n: int = 256,
    fc2_tile_n: int = 256,
    shared_intermediate: int = 0,
    rank: int = 0,
    num_ranks: int = 1,
    dispatch_wait: str = "tile",
    comm_task_rows: int | None = None,
    dispatch_lookahead_tokens: int | None = None,
    finish: bool = True,
    ksum_rows: int | None = None,
    static: bool = False,
    fc1_lead: int = 0,
    comm_tasks: bool = True,
    tile_order: str = "m_major",
    barrier_in_compute: bool = False,
) -> TaskList:
    """Build one rank's ordered task list.

    ``tile_rows[j]`` is the number of real rows of receive-schedule M-tile ``j`` (1..tile_m;
    ``tile_m`` everywhere for the static-capacity list). ``num_tokens``/``top_k`` are the
    local tokens and routing fan-out (shared expert and k-sum work). ``shared_intermediate``
    0 means no shared expert. ``comm_task_rows`` (default ``tile_m``) splits each dispatch /
    combine of an M-tile into ``tile_m // comm_task_rows`` chunks. ``finish`` adds the BARRIER
    and KSUM tasks; each KSUM covers ``ksum_rows`` local tokens (default ``tile_m // 8``, must
    divide ``tile_m``). ``fc1_lead`` = 1 queues FC1 of minibatch m + 1 before FC2 of
    minibatch m, so the CTAs that take FC2 tickets find their M-tiles' FC1 tiles done instead
    of waiting on the wave just issued; ``fc1_lead`` = L > 1 queues FC1 of m + L before FC2 of
    m. It needs a ring of L + 1 minibatches (FC1 of m + L must not wait on FC2 of m) and
    shrinks to what the ring holds. ``comm_tasks=False`` is one rank that reads its own rows
    in place (the megakernel's ``local_direct`` with no peer): no DISPATCH or COMBINE tasks,
    FC1 waits on nothing routed, BARRIER waits on every FC2 tile. It needs a ring that never
    wraps (the k-sum reads y from it at the end). ``tile_order`` orders each minibatch's FC1
    and FC2 tiles: "m_major" (M-tile by M-tile, N-tiles inner: a tile's FC1 ends early) or
    "n_major" (N-tile by N-tile, the minibatch's M-tiles inner: concurrent tiles share one
    weight tile in L2, which matters once a minibatch has more tiles than there are CTAs).
    ``barrier_in_compute`` (with ``comm_tasks=False`` only) queues the BARRIER as a compute
    task after the last FC2 and before the first KSUM, so no comm CTA is needed: its ticket
    comes after every FC2 ticket and it waits only on those.
    """
    hidden = _check_int("hidden", hidden, 1)
    intermediate = _check_int("intermediate", intermediate, 1)
    num_tokens = _check_int("num_tokens", num_tokens, 0)
    top_k = _check_int("top_k", top_k, 1)
    tile_m = _check_int("tile_m", tile_m, 1)
    fc1_tile_n = _check_int("fc1_tile_n", fc1_tile_n, 2)
    _check_multiple("fc1_tile_n", fc1_tile_n, "2 (gate/up interleave)", 2)
    fc2_tile_n = _check_int("fc2_tile_n", fc2_tile_n, 1)
    minibatch_tokens = _check_int("minibatch_tokens", minibatch_tokens, 1)
    _check_multiple("minibatch_tokens", minibatch_tokens, "tile_m", tile_m)
    ring_tokens = _check_int("ring_tokens", ring_tokens, 1)
    _check_multiple("ring_tokens", ring_tokens, "tile_m", tile_m)
    if ring_tokens < minibatch_tokens:
        raise ValueError(
            f"ring_tokens must be >= minibatch_tokens={minibatch_tokens} (one minibatch must fit "
            f"in the ring, else FC1 of a minibatch would wait on its own FC2), got {ring_tokens}")
    shared_intermediate = _check_int("shared_intermediate", shared_intermediate, 0)
    num_ranks = _check_int("num_ranks", num_ranks, 1)
    rank = _check_int("rank", rank, 0)
    if rank >= num_ranks:
        raise ValueError(f"rank must be < num_ranks={num_ranks}, got {rank}")
    if dispatch_wait not in ("tile", "minibatch"):
        raise ValueError(f"dispatch_wait must be 'tile' or 'minibatch', got {dispatch_wait!r}")
    comm_task_rows = tile_m if comm_task_rows is None else _check_int(
        "comm_task_rows", comm_task_rows, 1)
    if tile_m % comm_task_rows:
        raise ValueError(f"comm_task_rows must divide tile_m={tile_m}, got {comm_task_rows}")
    if dispatch_lookahead_tokens is None:
        dispatch_lookahead_tokens = min(ring_tokens, 2 * minibatch_tokens)
    dispatch_lookahead_tokens = _check_int(
        "dispatch_lookahead_tokens", dispatch_lookahead_tokens, 0)
    _check_multiple("dispatch_lookahead_tokens", dispatch_lookahead_tokens, "tile_m", tile_m)

    fc1_lead = _check_int("fc1_lead", fc1_lead, 0)
    if tile_order not in TILE_ORDERS:
        raise ValueError(f"tile_order must be one of {TILE_ORDERS}, got {tile_order!r}")
    # FC1 of m + lead must not wait on FC2 of m, which then comes after it: the ring holds
    # lead + 1 minibatches, or the lead shrinks to what it holds
    fc1_lead = min(fc1_lead, ring_tokens // minibatch_tokens - 1)
    ksum_rows = max(1, tile_m // 8) if ksum_rows is None else _check_int("ksum_rows", ksum_rows, 1)
    if tile_m % ksum_rows:
        raise ValueError(f"ksum_rows must divide tile_m={tile_m}, got {ksum_rows}")

    if barrier_in_compute and comm_tasks:
        raise ValueError("barrier_in_compute needs comm_tasks=False (with comm tasks the "
                         "BARRIER waits on the comm CTAs' combines)")
    rows = np.asarray(_as_numpy(tile_rows), dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() > tile_m):
        raise ValueError(
            f"tile_rows must be in [0, tile_m={tile_m}], got range [{rows.min()}, {rows.max()}]")
    if not comm_tasks and ring_tokens < rows.size * tile_m:
        raise ValueError(
            f"ring_tokens must hold every routed row ({rows.size * tile_m}) without comm "
            f"tasks (comm_tasks=False: the k-sum reads y from the ring), got {ring_tokens}")

    params = TaskListParams(
        hidden=hidden, intermediate=intermediate, num_tokens=num_tokens, top_k=top_k,
        tile_m=tile_m, fc1_tile_n=fc1_tile_n, fc2_tile_n=fc2_tile_n,
        minibatch_tokens=minibatch_tokens, ring_tokens=ring_tokens,
        shared_intermediate=shared_intermediate, rank=rank, num_ranks=num_ranks,
        dispatch_wait=dispatch_wait, comm_task_rows=comm_task_rows,
        dispatch_lookahead_tokens=dispatch_lookahead_tokens, finish=bool(finish),
        ksum_rows=ksum_rows, static=bool(static), fc1_lead=fc1_lead, comm_tasks=bool(comm_tasks),
        tile_order=tile_order, barrier_in_compute=bool(barrier_in_compute),
    )
    return _Builder(params, rows).build()


def build_static(capacity: int, **kwargs) -> TaskList:
    """The list the device consumes: ``capacity // tile_m`` full M-tiles (``capacity`` is the
    schedule's static row bound, a multiple of ``tile_m``); see the module docstring for how
    tiles past the device's ``num_tiles`` become no-ops or are skipped."""
    tile_m = kwargs.get("tile_m", 128)
    capacity = _check_int("capacity", capacity, 0)
    _check_multiple("capacity", capacity, "tile_m", tile_m)
    rows = np.full(capacity // tile_m, tile_m, dtype=np.int64)
    return build_task_list(rows, static=True, **kwargs)


def build_from_expert_counts(expert_counts, **kwargs) -> TaskList:
    """The list for actual per-expert real row counts (what the simulator executes)."""
    tile_m = kwargs.get("tile_m", 128)
    return build_task_list(tile_rows_from_expert_counts(expert_counts, tile_m), **kwargs)


def build_for_schedule(schedule, *, static: bool = True, **kwargs) -> TaskList:
    """Build from a ``mok_cute.schedule.ReceiveSchedule``: its static capacity (``static=True``,
    no host sync) or its actual ``expert_counts`` (``static=False``, syncs with the device)."""
    kwargs.setdefault("tile_m", int(schedule.tile_m))
    kwargs.setdefault("rank", int(schedule.rank))
    kwargs.setdefault("num_ranks", int(schedule.num_ranks))
    if int(schedule.tile_m) != kwargs["tile_m"]:
        raise ValueError(f"tile_m must equal schedule.tile_m={schedule.tile_m}, "
                         f"got {kwargs['tile_m']}")
    if static:
        return build_static(int(schedule.capacity), **kwargs)
    return build_from_expert_counts(schedule.expert_counts, **kwargs)


class _Builder:
    """Generates the tasks of each kind, orders the two queues and merges them."""

    def __init__(self, p: TaskListParams, tile_rows: np.ndarray):
        self.p = p
        self.rows = tile_rows
        self.nt = int(tile_rows.size)
        self.tpm = p.minibatch_tokens // p.tile_m
        self.rt = p.ring_tokens // p.tile_m
        self.nmb = -(-self.nt // self.tpm)
        self.n1 = -(-2 * p.intermediate // p.fc1_tile_n)
        self.n2 = -(-p.hidden // p.fc2_tile_n)
        self.cs = p.tile_m // p.comm_task_rows
        self.shared = p.shared_intermediate > 0
        self.st = -(-p.num_tokens // p.tile_m)
        self.sn1 = -(-2 * p.shared_intermediate // p.fc1_tile_n) if self.shared else 0
        self.counter_sizes = np.zeros(len(CounterGroup), dtype=np.int64)
        cg = CounterGroup
        self.counter_sizes[cg.DISPATCHED] = self.nt if p.dispatch_wait == "tile" else 0
        self.counter_sizes[cg.DISPATCHED_MB] = self.nmb if p.dispatch_wait == "minibatch" else 0
        self.counter_sizes[cg.FC1_DONE] = self.nt
        self.counter_sizes[cg.FC2_DONE] = self.nt
        self.counter_sizes[cg.COMBINED] = self.nt
        self.counter_sizes[cg.SHARED_FC1_DONE] = self.st if self.shared else 0
        self.counter_sizes[cg.SHARED_FC2_DONE] = self.st if self.shared else 0
        self.counter_sizes[cg.BARRIER_DONE] = 1 if p.finish else 0
        self.counter_sizes[cg.KSUM_DONE] = 1 if p.finish else 0

    # Each block is a dict of equal-length arrays (one entry per task) in queue order.
    def _block(self, ttype, m_tile, n_tile, row_begin, row_end, bytes_, flops, sig_group,
               sig_index, waits, minibatch):
        n = len(m_tile)
        return dict(
            type=np.full(n, int(ttype)), role=np.full(n, int(_ROLE_OF[ttype])),
            minibatch=np.asarray(minibatch, dtype=np.int64) * np.ones(n, dtype=np.int64),
            m_tile_begin=np.asarray(m_tile, dtype=np.int64),
            m_tile_end=np.asarray(m_tile, dtype=np.int64) + (1 if n else 0),
            n_tile=np.asarray(n_tile, dtype=np.int64), row_begin=np.asarray(row_begin),
            row_end=np.asarray(row_end), bytes=np.asarray(bytes_, dtype=np.int64),
            flops=np.asarray(flops, dtype=np.int64),
            signal_group=np.full(n, int(sig_group)), signal_index=np.asarray(sig_index),
            waits=waits,
        )

    @staticmethod
    def _waits(n, *specs):
        """specs: (group, first[array or int], count, target, mask[array or None])."""
        w = np.zeros((n, MAX_WAITS, 4), dtype=np.int64)
        w[:, :, 0] = -1
        slot = np.zeros(n, dtype=np.int64)
        for group, first, count, target, mask in specs:
            m = np.ones(n, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
            idx = np.flatnonzero(m)
            s = slot[idx]
            w[idx, s, 0] = int(group)
            w[idx, s, 1] = (np.broadcast_to(first, (n,)))[idx]
            w[idx, s, 2] = (np.broadcast_to(count, (n,)))[idx]
            w[idx, s, 3] = (np.broadcast_to(target, (n,)))[idx]
            slot[idx] += 1
        return w

    def _gemm_tiles(self, m_tiles, n_count, tile_n, n_total, k_dim, out_per_col,
                    n_major=False):
        """Task grids for a GEMM with N=n_total, K=k_dim: M-tile-major (N inner) or, with
        ``n_major``, N-tile-major (the given M-tiles inner)."""
        p = self.p
        m_tiles = np.asarray(m_tiles, dtype=np.int64)
        if n_major:
            mt = np.tile(m_tiles, n_count)
            nt = np.repeat(np.arange(n_count, dtype=np.int64), len(m_tiles))
        else:
            mt = np.repeat(m_tiles, n_count)
            nt = np.tile(np.arange(n_count, dtype=np.int64), len(m_tiles))
        width = np.minimum(tile_n, n_total - nt * tile_n)
        flops = 2 * p.tile_m * width * k_dim
        bytes_ = _BF16 * (p.tile_m * k_dim + width * k_dim + p.tile_m * width * out_per_col)
        return mt, nt, flops, bytes_

    def build(self) -> TaskList:
        p, cg = self.p, CounterGroup
        tm, nt, tpm, rt, n1, n2, cs = p.tile_m, self.nt, self.tpm, self.rt, self.n1, self.n2, self.cs
        compute_blocks = []

        # --- shared expert (head of the compute queue) ---
        if self.shared:
            s_tiles = np.arange(self.st)
            s_rows_end = np.minimum((s_tiles + 1) * tm, p.num_tokens)
            mt, ntl, fl, by = self._gemm_tiles(s_tiles, self.sn1, p.fc1_tile_n,
                                               2 * p.shared_intermediate, p.hidden, 0.5)
            compute_blocks.append(self._block(
                TaskType.SHARED_FC1, mt, ntl, mt * tm, s_rows_end[mt], by, fl,
                cg.SHARED_FC1_DONE, mt, self._waits(len(mt)), -1))
            mt, ntl, fl, by = self._gemm_tiles(s_tiles, n2, p.fc2_tile_n, p.hidden,
                                               p.shared_intermediate, 1)
            compute_blocks.append(self._block(
                TaskType.SHARED_FC2, mt, ntl, mt * tm, s_rows_end[mt], by, fl,
                cg.SHARED_FC2_DONE, mt, self._waits(len(mt), (cg.SHARED_FC1_DONE, mt, 1,
                                                              self.sn1, None)), -1))

        # --- routed minibatches: FC1 then FC2 of each (fc1_lead: FC1 of m + 1 before FC2 of m)
        tiles_in_mb = np.minimum(tpm, nt - np.arange(self.nmb) * tpm)
        fc1_blocks, fc2_blocks = [], []
        for mb in range(self.nmb):
            tiles = np.arange(mb * tpm, mb * tpm + tiles_in_mb[mb])
            # FC1
            n_major = p.tile_order == "n_major"
            mt, ntl, fl, by = self._gemm_tiles(tiles, n1, p.fc1_tile_n, 2 * p.intermediate,
                                               p.hidden, 0.5, n_major)
            specs = [(cg.FC2_DONE, mt - rt, 1, n2, mt >= rt)]
            if p.comm_tasks and p.dispatch_wait == "tile":
                specs.insert(0, (cg.DISPATCHED, mt, 1, cs, None))
            elif p.comm_tasks:
                specs.insert(0, (cg.DISPATCHED_MB, mb, 1, cs * int(tiles_in_mb[mb]), None))
            waits = self._waits(len(mt), *specs)
            fc1_blocks.append(self._block(
                TaskType.FC1, mt, ntl, mt * tm, mt * tm + tm, by, fl, cg.FC1_DONE, mt, waits, mb))
            # FC2
            mt, ntl, fl, by = self._gemm_tiles(tiles, n2, p.fc2_tile_n, p.hidden,
                                               p.intermediate, 1, n_major)
            waits = self._waits(len(mt), (cg.FC1_DONE, mt, 1, n1, None),
                                (cg.COMBINED, mt - rt, 1, cs, (mt >= rt) & p.comm_tasks))
            fc2_blocks.append(self._block(
                TaskType.FC2, mt, ntl, mt * tm, mt * tm + tm, by, fl, cg.FC2_DONE, mt, waits, mb))
        lead = p.fc1_lead
        for mb in range(self.nmb + lead):
            if mb < self.nmb:
                compute_blocks.append(fc1_blocks[mb])
            if mb >= lead:
                compute_blocks.append(fc2_blocks[mb - lead])

        # --- finish: (BARRIER,) KSUM (tail of the compute queue) ---
        if p.finish and p.barrier_in_compute:
            compute_blocks.append(self._barrier(Role.COMPUTE))
        if p.finish:
            per_tile = tm // p.ksum_rows
            rb = np.arange(0, p.num_tokens, p.ksum_rows, dtype=np.int64)
            re = np.minimum(rb + p.ksum_rows, p.num_tokens)
            k_tiles = rb // tm
            k_chunk = (rb % tm) // p.ksum_rows
            # read K combined rows + the shared row, write the output row (bf16 each)
            by = (re - rb) * p.hidden * _BF16 * (p.top_k + (1 if self.shared else 0) + 1)
            specs = [(cg.BARRIER_DONE, 0, 1, 1, None)]
            if self.shared:
                specs.append((cg.SHARED_FC2_DONE, k_tiles, 1, n2, None))
            blk = self._block(
                TaskType.KSUM, k_tiles, k_chunk, rb, re, by, np.zeros_like(k_tiles),
                cg.KSUM_DONE, np.zeros_like(k_tiles), self._waits(len(k_tiles), *specs), -1)
            assert per_tile >= 1
            compute_blocks.append(blk)

        compute = _concat_blocks(compute_blocks)
        ncomp = len(compute["type"])
        # Estimated time along the compute queue, in FLOPs (KSUM: its bytes as a small cost).
        cost = compute["flops"].astype(np.float64) + (compute["type"] == TaskType.KSUM)
        cum_end = np.cumsum(cost)
        cum_start = cum_end - cost
        # lookups: first / last compute-queue position of FC1 and FC2 per M-tile
        fc1_first, fc1_last = self._first_last(compute, TaskType.FC1)
        _, fc2_last = self._first_last(compute, TaskType.FC2)

        # --- comm: dispatch and combine chunks, sorted by estimated ready time ---
        j = np.repeat(np.arange(nt, dtype=np.int64), cs)
        c = np.tile(np.arange(cs, dtype=np.int64), nt)
        rb = j * tm + c * p.comm_task_rows
        re = rb + p.comm_task_rows
        real = np.clip(self.rows[j] - c * p.comm_task_rows, 0, p.comm_task_rows)
        payload = real * p.hidden * _BF16
        mbj = j // tpm
        look_t = p.dispatch_lookahead_tokens // tm
        neg = -np.inf
        ring_ready = np.where(j >= rt, cum_end[fc1_last[np.maximum(j - rt, 0)]] if nt else 0, neg)
        look_key = np.where(j >= look_t, cum_start[fc1_first[np.maximum(j - look_t, 0)]]
                            if nt else 0, neg)
        d_key = np.maximum(ring_ready, look_key)
        d_sig_group = cg.DISPATCHED if p.dispatch_wait == "tile" else cg.DISPATCHED_MB
        d_sig_index = j if p.dispatch_wait == "tile" else mbj
        disp = self._block(TaskType.DISPATCH, j, c, rb, re, payload, np.zeros_like(j),
                           d_sig_group, d_sig_index,
                           self._waits(len(j), (cg.FC1_DONE, j - rt, 1, n1, j >= rt)), mbj)
        comb = self._block(TaskType.COMBINE, j, c, rb, re, payload, np.zeros_like(j),
                           cg.COMBINED, j, self._waits(len(j), (cg.FC2_DONE, j, 1, n2, None)), mbj)
        c_key = cum_end[fc2_last[j]] if nt else np.zeros(0)
        comm = _concat_blocks([disp, comb] if p.comm_tasks else [])
        key = np.concatenate([d_key, c_key])
        kind = np.concatenate([np.zeros(len(j)), np.ones(len(j))])
        jj = np.concatenate([j, j])
        cc = np.concatenate([c, c])
        if not p.comm_tasks:
            key = kind = jj = cc = np.zeros(0)
        order = np.lexsort((cc, jj, kind, key))
        comm = {k: v[order] for k, v in comm.items()}
        comm_key = key[order]
        if p.finish and not p.barrier_in_compute:
            comm = _concat_blocks([comm, self._barrier(Role.COMM)])
            comm_key = np.concatenate([comm_key, [np.inf]])

        comp_key = cum_start
        merged = self._merge(compute, comp_key, comm, comm_key)
        ring_row = np.where(merged["minibatch"] >= 0, merged["row_begin"] % p.ring_tokens, -1)
        assert ncomp + len(comm["type"]) == len(merged["type"])
        return TaskList(
            params=p, tile_rows=self.rows.copy(), type=merged["type"].astype(np.int8),
            role=merged["role"].astype(np.int8), minibatch=merged["minibatch"],
            m_tile_begin=merged["m_tile_begin"], m_tile_end=merged["m_tile_end"],
            n_tile=merged["n_tile"], row_begin=merged["row_begin"].astype(np.int64),
            row_end=merged["row_end"].astype(np.int64), ring_row_begin=ring_row.astype(np.int64),
            bytes=merged["bytes"], flops=merged["flops"],
            signal_group=merged["signal_group"].astype(np.int64),
            signal_index=merged["signal_index"].astype(np.int64), waits=merged["waits"],
            counter_sizes=self.counter_sizes.copy(),
        )

    def _barrier(self, role: Role):
        """The BARRIER task: waits for every COMBINE (without comm tasks: every FC2 tile),
        signals BARRIER_DONE; ``role`` is the queue it goes in."""
        cg, nt = CounterGroup, self.nt
        zero = np.zeros(1, dtype=np.int64)
        barrier = self._block(
            TaskType.BARRIER, zero, zero, zero, zero, np.zeros(1), np.zeros(1), cg.BARRIER_DONE,
            zero, self._waits(1, (cg.COMBINED, 0, nt, self.cs, np.array([nt > 0]))
                              if self.p.comm_tasks
                              else (cg.FC2_DONE, 0, nt, self.n2, np.array([nt > 0]))), -1)
        barrier["m_tile_end"][:] = nt
        barrier["role"][:] = int(role)
        return barrier

    def _first_last(self, compute, ttype):
        first = np.zeros(self.nt, dtype=np.int64)
        last = np.zeros(self.nt, dtype=np.int64)
        pos = np.flatnonzero(compute["type"] == ttype)
        if pos.size:
            tiles = compute["m_tile_begin"][pos]
            # positions are increasing; first occurrence via reversed assignment
            first[tiles[::-1]] = pos[::-1]
            last[tiles] = pos
        return first, last

    def _merge(self, compute, comp_key, comm, comm_key):
        """Interleave the two queues so that every wait points to a lower index. Among the
        two ready queue heads, the one with the smaller estimated time goes first."""
        offsets = np.concatenate([[0], np.cumsum(self.counter_sizes)]).astype(np.int64)
        emitted = [0] * int(offsets[-1])
        queues = (compute, comm)
        keys = [k.tolist() for k in (comp_key, comm_key)]
        lens = (len(compute["type"]), len(comm["type"]))
        sig = [(offsets[q["signal_group"]] + q["signal_index"]).tolist() for q in queues]
        # per task: list of (first absolute counter, count, target)
        waits = []
        for q in queues:
            w = q["waits"]
            g = w[:, :, 0]
            absf = np.where(g >= 0, offsets[np.maximum(g, 0)] + w[:, :, 1], -1)
            rows = []
            for a, cnt, tgt in zip(absf.tolist(), w[:, :, 2].tolist(), w[:, :, 3].tolist()):
                rows.append([(a[s], cnt[s], tgt[s]) for s in range(MAX_WAITS)
                             if a[s] >= 0 and cnt[s] > 0])
            waits.append(rows)
        heads = [0, 0]
        order_q, order_i = [], []

        def ready(qi, i):
            for base, cnt, tgt in waits[qi][i]:
                if cnt == 1:
                    if emitted[base] < tgt:
                        return False
                elif min(emitted[base:base + cnt]) < tgt:
                    return False
            return True

        total = lens[0] + lens[1]
        while len(order_q) < total:
            h0, h1 = heads
            r0 = h0 < lens[0] and ready(0, h0)
            r1 = h1 < lens[1] and ready(1, h1)
            if r0 and r1:
                qi = 0 if keys[0][h0] <= keys[1][h1] else 1
            elif r0 or r1:
                qi = 0 if r0 else 1
            else:
                h = [(qi, heads[qi]) for qi in (0, 1) if heads[qi] < lens[qi]]
                raise RuntimeError(f"task list merge is stuck at queue heads {h}: the per-role "
                                   "orders and the dependencies form a cycle")
            i = heads[qi]
            emitted[sig[qi][i]] += 1
            order_q.append(qi)
            order_i.append(i)
            heads[qi] += 1
        order_q = np.asarray(order_q, dtype=np.int64)
        order_i = np.asarray(order_i, dtype=np.int64)
        out = {}
        for k in compute:
            a, b = compute[k], comm[k]
            shape = (total,) + a.shape[1:]
            arr = np.empty(shape, dtype=np.result_type(a.dtype, b.dtype))
            m0, m1 = order_q == 0, order_q == 1
            arr[m0] = a[order_i[m0]]
            arr[m1] = b[order_i[m1]]
            out[k] = arr
        return out


def _concat_blocks(blocks):
    keys = ["type", "role", "minibatch", "m_tile_begin", "m_tile_end", "n_tile", "row_begin",
            "row_end", "bytes", "flops", "signal_group", "signal_index", "waits"]
    if not blocks:
        out = {k: np.zeros(0, dtype=np.int64) for k in keys}
        out["waits"] = np.zeros((0, MAX_WAITS, 4), dtype=np.int64)
        return out
    return {k: np.concatenate([np.asarray(b[k]) for b in blocks]).astype(np.int64)
            for k in keys}


def _deps_from_waits(tl: TaskList) -> tuple[np.ndarray, np.ndarray]:
    offsets = tl.counter_offsets
    sig = offsets[tl.signal_group] + tl.signal_index
    by_counter = np.argsort(sig, kind="stable")
    sig_sorted = sig[by_counter]
    ncount = int(offsets[-1])
    start = np.searchsorted(sig_sorted, np.arange(ncount + 1))
    n = len(tl)
    dep_lists = []
    w = tl.waits
    for slot in range(MAX_WAITS):
        g = w[:, slot, 0]
        valid = (g >= 0) & (w[:, slot, 2] > 0)
        idx = np.flatnonzero(valid)
        if not idx.size:
            continue
        base = offsets[g[idx]] + w[idx, slot, 1]
        lo = start[base]
        hi = start[base + w[idx, slot, 2]]
        lens = hi - lo
        owners = np.repeat(idx, lens)
        within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        flat = by_counter[np.repeat(lo, lens) + within]
        dep_lists.append((owners, flat.astype(np.int64)))
    if dep_lists:
        owners = np.concatenate([o for o, _ in dep_lists])
        deps = np.concatenate([d for _, d in dep_lists])
        order = np.lexsort((deps, owners))
        owners, deps = owners[order], deps[order]
    else:
        owners = deps = np.zeros(0, dtype=np.int64)
    off = np.zeros(n + 1, dtype=np.int64)
    np.add.at(off, owners + 1, 1)
    return np.cumsum(off), deps
