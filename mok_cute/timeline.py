"""Per-SM timelines of a mok_cute layer call: host-side buffer, decoder and exporters.

The device side (``mok_cute/kernels/common.py``) appends one record per task into a bounded
int64 buffer when a kernel is compiled with ``MoKConfig(timeline=True)``. This module owns the
host side of that buffer:

* :class:`TimelineBuffer` allocates it with the agreed header;
* :func:`decode` turns a saved or live buffer into a :class:`Timeline`;
* :func:`to_chrome_trace` / :func:`write_chrome_trace` give a trace that opens in Perfetto;
* :func:`plot_swimlanes` draws a PNG with one lane per SM, comm SMs on top;
* :func:`summarize` / :func:`print_summary` give busy / wait / idle per role, bandwidths,
  GEMM rate and the communication time left exposed.

Buffer layout (int64 words)::

    buf[0]  capacity (records)
    buf[1]  records written: an atomic ticket, may exceed capacity (the excess is dropped)
    buf[2]  %globaltimer at kernel start (ns), written by CTA 0
    buf[3:8] reserved, 0
    buf[8 + 4*i : 12 + 4*i]  record i:
        word0  role (bits 0-7) | task_type (8-15) | rank (16-31) | sm_id (32-47) | cta_id (48-63)
        word1  task id
        word2  start ns (%globaltimer)
        word3  end ns (%globaltimer)

``mok-cute timeline`` (``mok_cute.bench.record_timeline``) records a call and writes these views.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from mok_cute.constants import TIMELINE_HEADER_WORDS as HEADER_WORDS
from mok_cute.figures import save_png
from mok_cute.constants import TIMELINE_RECORD_WORDS as RECORD_WORDS
from mok_cute.tasks import Role, TaskType
from mok_cute.tasks_backward import BackwardTaskType as BT

# Field widths of the packed word0 (shift, bits).
_PACK = {"role": (0, 8), "task_type": (8, 8), "rank": (16, 16), "sm_id": (32, 16), "cta_id": (48, 16)}


# The span types: the forward's (``TaskType``, its WAIT / STAGE_WAIT and phases included) and
# the backward megakernel's (``tasks_backward.BackwardTaskType``), one number space.
SPAN_TYPES = (*TaskType, *BT)
_SPAN_NAMES = {int(t): t.name for t in SPAN_TYPES}
assert len(_SPAN_NAMES) == len(SPAN_TYPES)
# Exposed-communication accounting: which task types move data between GPUs and which compute.
# The waits are neither: time a CTA spent spinning, inside or between its tasks. The
# backward's KSUM is neither role's alone (comm and compute CTAs take its tickets).
WAIT_TASK_TYPES = frozenset({TaskType.WAIT, TaskType.STAGE_WAIT})
COMM_TASK_TYPES = frozenset({TaskType.DISPATCH, TaskType.COMBINE, TaskType.BARRIER,
                             BT.REVERSE_COMBINE, BT.REPULL_X, BT.REVERSE_DISPATCH, BT.BARRIER})
GEMM_TASK_TYPES = frozenset({TaskType.FC1, TaskType.FC2, TaskType.SHARED_FC1, TaskType.SHARED_FC2,
                             BT.FC2_DGRAD, BT.FC1_DGRAD, BT.WGRAD_GATE_UP, BT.WGRAD_DOWN,
                             BT.SHARED_FC2_DGRAD, BT.SHARED_FC1_DGRAD, BT.SHARED_WGRAD_GATE_UP,
                             BT.SHARED_WGRAD_DOWN})
COMPUTE_TASK_TYPES = GEMM_TASK_TYPES | {TaskType.KSUM}
# the comm tasks that only a comm CTA runs (a BARRIER is a compute task at one rank)
ROW_MOVING_TYPES = frozenset({TaskType.DISPATCH, TaskType.COMBINE, BT.REVERSE_COMBINE, BT.REPULL_X,
                              BT.REVERSE_DISPATCH})
# Phases split a task's span: they are neither work of their own nor waits.
PHASE_TASK_TYPES = frozenset({TaskType.EPILOGUE, TaskType.SIGNAL})
# The pingpong GEMM's two consumer warpgroups each run their own tile, so one CTA records up to
# two GEMM tiles at a time.
MAX_TILES_IN_FLIGHT = 2


def is_wait(rec: np.ndarray) -> np.ndarray:
    """Records that are time spent spinning (``WAIT_TASK_TYPES``), not work."""
    return np.isin(rec["task_type"], [int(t) for t in WAIT_TASK_TYPES])


# A backward-megakernel launch's buffer at least: most of its tasks are weight-gradient tiles
# (dsv3_ep8_rank 53k tasks, a kimi rank of 8 ~65k), two records each.
BACKWARD_CAPACITY = 1 << 18

_COLUMNS = ("role", "task_type", "task_id", "rank", "sm_id", "cta_id", "start_ns", "end_ns")
RECORD_DTYPE = np.dtype(
    [
        ("role", np.int16),
        ("task_type", np.int16),
        ("task_id", np.int64),
        ("rank", np.int32),
        ("sm_id", np.int32),
        ("cta_id", np.int32),
        ("start_ns", np.int64),  # relative to the kernel start (buf[2])
        ("end_ns", np.int64),
    ]
)


def is_phase(rec: np.ndarray) -> np.ndarray:
    """Records that split another task's span (``PHASE_TASK_TYPES``)."""
    return np.isin(rec["task_type"], [int(t) for t in PHASE_TASK_TYPES])


def role_name(role: int) -> str:
    try:
        return Role(int(role)).name.lower()
    except ValueError:
        return f"role{int(role)}"


def task_name(task_type: int) -> str:
    return _SPAN_NAMES.get(int(task_type), f"TASK{int(task_type)}")


# --------------------------------------------------------------------------------------------
# Decoded timeline
# --------------------------------------------------------------------------------------------


@dataclass
class Timeline:
    """Decoded records of one recording.

    ``records`` is a numpy structured array of :data:`RECORD_DTYPE` in ticket (write) order, with
    times in ns relative to the kernel start ``t0_ns``. ``written`` is the device ticket count;
    ``dropped = max(0, written - capacity)`` records did not fit.
    """

    records: np.ndarray
    capacity: int
    written: int
    dropped: int
    t0_ns: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.records.shape[0])

    @property
    def span_ns(self) -> tuple[int, int]:
        """(start, end) of the recorded layer time: from the kernel start (or the earliest record,
        if a record starts before it) to the last record's end."""
        if len(self) == 0:
            return (0, 0)
        return (min(0, int(self.records["start_ns"].min())), int(self.records["end_ns"].max()))

    def lanes(self) -> list[tuple[int, int, str]]:
        """Distinct (rank, sm_id, role) lanes, comm lanes first, then compute, each sorted by
        (rank, sm_id). A lane's role is "comm", "compute" or "mixed"."""
        roles: dict[tuple[int, int], set[int]] = {}
        for rank, sm, role in zip(self.records["rank"], self.records["sm_id"], self.records["role"]):
            roles.setdefault((int(rank), int(sm)), set()).add(int(role))
        out = []
        for (rank, sm), rs in roles.items():
            out.append((rank, sm, role_name(next(iter(rs))) if len(rs) == 1 else "mixed"))
        order = {"comm": 0, "mixed": 1, "compute": 2}
        out.sort(key=lambda lane: (order.get(lane[2], 3), lane[0], lane[1]))
        return out

    def check(
        self,
        expected_task_ids: Iterable[tuple[int, int]] | None = None,
        unique_types: Iterable[int] = GEMM_TASK_TYPES,
    ) -> list[str]:
        """Sanity problems of a recording (empty list = none):

        * records were dropped;
        * a record ends before it starts;
        * a comm CTA records a compute task, or a compute CTA a dispatch / combine;
        * on one CTA, non-WAIT tasks overlap (times must be monotone per CTA), except GEMM tiles
          of the pingpong schedule: up to MAX_TILES_IN_FLIGHT of them, one per consumer
          warpgroup, and never over another kind of task;
        * a task of ``unique_types`` (default: the GEMM tiles) is recorded twice on one rank;
        * with ``expected_task_ids`` (pairs of (task_type, task_id)): an expected task recorded
          more than once per rank, or never.
        """
        problems: list[str] = []
        rec = self.records
        if self.dropped:
            problems.append(f"{self.dropped} records dropped (capacity {self.capacity})")
        bad = np.nonzero(rec["end_ns"] < rec["start_ns"])[0]
        for i in bad[:10]:
            problems.append(f"record {int(i)} ({task_name(rec['task_type'][i])}) ends before it starts")
        comm_runs_compute = (rec["role"] == Role.COMM) & np.isin(rec["task_type"], [int(t) for t in COMPUTE_TASK_TYPES])
        compute_runs_comm = (rec["role"] == Role.COMPUTE) & np.isin(rec["task_type"], [int(t) for t in ROW_MOVING_TYPES])
        for i in np.nonzero(comm_runs_compute | compute_runs_comm)[0][:10]:
            problems.append(
                f"rank {int(rec['rank'][i])} {role_name(rec['role'][i])} CTA {int(rec['cta_id'][i])} "
                f"ran {task_name(rec['task_type'][i])} task {int(rec['task_id'][i])}"
            )
        work = rec[~is_wait(rec) & ~is_phase(rec)]
        gemm = np.isin(work["task_type"], [int(t) for t in GEMM_TASK_TYPES])
        for key in sorted({(int(r), int(c)) for r, c in zip(work["rank"], work["cta_id"])}):
            on_cta = (work["rank"] == key[0]) & (work["cta_id"] == key[1])
            tiles, other = on_cta & gemm, on_cta & ~gemm
            if (_max_overlap(work[other]) > 1 or _max_overlap(work[tiles]) > MAX_TILES_IN_FLIGHT
                    or _intersection_measure(_union_of(work, tiles), _union_of(work, other)) > 0):
                problems.append(f"rank {key[0]} CTA {key[1]}: tasks overlap (times not monotone)")
        expected = None if expected_task_ids is None else {(int(t), int(i)) for t, i in expected_task_ids}
        unique = {int(t) for t in unique_types}
        for rank in sorted({int(r) for r in work["rank"]}):
            mine = work[work["rank"] == rank]
            seen: dict[tuple[int, int], int] = {}
            for t, i in zip(mine["task_type"].tolist(), mine["task_id"].tolist()):
                seen[(t, i)] = seen.get((t, i), 0) + 1
            must_be_once = (lambda k: k in expected) if expected is not None else (lambda k: k[0] in unique)
            twice = sorted(k for k, n in seen.items() if n > 1 and (must_be_once(k) or k[0] in unique))
            if twice:
                problems.append(f"rank {rank}: {len(twice)} tasks recorded more than once, e.g. {twice[:3]}")
            if expected is not None:
                missing = sorted(expected - set(seen))
                if missing:
                    problems.append(f"rank {rank}: {len(missing)} expected tasks never recorded, e.g. {missing[:3]}")
        return problems


def _as_int64_array(buf: Any) -> np.ndarray:
    if hasattr(buf, "detach") and hasattr(buf, "cpu"):  # torch.Tensor, without importing torch here
        buf = buf.detach().cpu().numpy()
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"buf: expected a torch.Tensor or numpy.ndarray of int64, got {type(buf).__name__}")
    if buf.dtype not in (np.int64, np.uint64):
        raise TypeError(f"buf: expected dtype int64, got {buf.dtype}")
    if buf.ndim != 1:
        raise ValueError(f"buf: expected a 1-D buffer, got shape {tuple(buf.shape)}")
    return buf.view(np.int64)


def decode(buf: Any) -> Timeline:
    """Decode a timeline buffer (torch tensor on any device, or numpy array).

    Only the first ``min(written, capacity)`` record slots are read; records past the capacity were
    never written and are reported as ``dropped``. A header that claims more records than the
    buffer holds raises ValueError instead of reading out of range.
    """
    arr = _as_int64_array(buf)
    if arr.size < HEADER_WORDS:
        raise ValueError(f"buf: expected at least the {HEADER_WORDS}-word header, got {arr.size} words")
    capacity, written, t0 = int(arr[0]), int(arr[1]), int(arr[2])
    if capacity < 0:
        raise ValueError(f"buf: header capacity must be >= 0, got {capacity}")
    if written < 0:
        raise ValueError(f"buf: header record count must be >= 0, got {written}")
    slots = (arr.size - HEADER_WORDS) // RECORD_WORDS
    if capacity > slots:
        raise ValueError(
            f"buf: header says capacity={capacity} records but the buffer holds only {slots} "
            f"({arr.size} words); was it truncated or is it not a timeline buffer?"
        )
    n = min(written, capacity)
    raw = arr[HEADER_WORDS : HEADER_WORDS + n * RECORD_WORDS].reshape(n, RECORD_WORDS)
    word0 = raw[:, 0].view(np.uint64)
    rec = np.zeros(n, dtype=RECORD_DTYPE)
    for name, (shift, bits) in _PACK.items():
        rec[name] = ((word0 >> np.uint64(shift)) & np.uint64((1 << bits) - 1)).astype(rec.dtype[name])
    rec["task_id"] = raw[:, 1]
    rec["start_ns"] = raw[:, 2] - t0
    rec["end_ns"] = raw[:, 3] - t0
    return Timeline(records=rec, capacity=capacity, written=written, dropped=max(0, written - capacity), t0_ns=t0)


def encode_records(
    records: Sequence[Sequence[int]] | np.ndarray,
    capacity: int | None = None,
    t0_ns: int = 1_000_000_000,
    written: int | None = None,
) -> np.ndarray:
    """Build a buffer exactly as the device recorder would: the inverse of :func:`decode`.

    ``records`` holds (role, task_type, task_id, rank, sm_id, cta_id, start_ns, end_ns) with times
    relative to ``t0_ns``, in ticket order. Records past ``capacity`` are counted in the header
    but not stored, as on the device. ``written`` overrides the ticket count.
    """
    if isinstance(records, np.ndarray) and records.dtype.names is not None:
        rec = np.stack([records[n].astype(np.int64) for n in _COLUMNS], axis=1) if len(records) else np.zeros((0, 8), np.int64)
    else:
        rec = np.asarray(records, dtype=np.int64)
    if rec.size == 0:
        rec = rec.reshape(0, 8)
    if rec.ndim != 2 or rec.shape[1] != 8:
        raise ValueError(f"records: expected rows of 8 integers, got shape {rec.shape}")
    capacity = rec.shape[0] if capacity is None else int(capacity)
    if capacity < 0:
        raise ValueError(f"capacity: expected >= 0, got {capacity}")
    written = rec.shape[0] if written is None else int(written)
    buf = np.zeros(HEADER_WORDS + RECORD_WORDS * capacity, dtype=np.int64)
    buf[0], buf[1], buf[2] = capacity, written, t0_ns
    stored = rec[: min(capacity, rec.shape[0])]
    word0 = np.zeros(stored.shape[0], dtype=np.uint64)
    for name, (shift, bits) in _PACK.items():
        values = stored[:, _COLUMNS.index(name)]
        if np.any((values < 0) | (values >= (1 << bits))):
            raise ValueError(f"records: field {name} must fit in {bits} bits, got values {values.min()}..{values.max()}")
        word0 |= values.astype(np.uint64) << np.uint64(shift)
    body = buf[HEADER_WORDS : HEADER_WORDS + RECORD_WORDS * stored.shape[0]].reshape(-1, RECORD_WORDS)
    body[:, 0] = word0.view(np.int64)
    body[:, 1] = stored[:, _COLUMNS.index("task_id")]
    body[:, 2] = stored[:, _COLUMNS.index("start_ns")] + t0_ns
    body[:, 3] = stored[:, _COLUMNS.index("end_ns")] + t0_ns
    return buf


# --------------------------------------------------------------------------------------------
# Device buffer and the "last recording" hand-off from the GPU path
# --------------------------------------------------------------------------------------------


class TimelineBuffer:
    """The device buffer the in-kernel recorder writes into (int64, header + capacity records)."""

    def __init__(self, capacity: int = 1 << 16, device: Any = "cuda"):
        import torch

        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0:
            raise ValueError(f"capacity: expected a positive int (records), got {capacity!r}")
        self.capacity = int(capacity)
        self.tensor = torch.zeros(HEADER_WORDS + RECORD_WORDS * self.capacity, dtype=torch.int64, device=device)
        # a fill kernel, not ``tensor[0] = n``: that is a pageable host-to-device copy, which
        # blocks the host until the stream drains (it cost a recorded layer call 4-16 %)
        self.tensor[:1].fill_(self.capacity)

    @property
    def device(self):
        return self.tensor.device

    def reset(self) -> None:
        """Zero the header counters before the next recorded launch (records are overwritten)."""
        self.tensor[1:HEADER_WORDS].zero_()

    def decode(self) -> Timeline:
        return decode(self.tensor)

    def save(self, path: str | os.PathLike) -> Path:
        """Save the raw buffer as .npy, for ``mok-cute timeline --from``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, self.tensor.detach().cpu().numpy())
        return path


_LAST: TimelineBuffer | None = None


def set_last(tb: TimelineBuffer | None) -> None:
    """Publish the buffer of the last recorded call (the GPU path calls this after a launch)."""
    global _LAST
    if tb is not None and not isinstance(tb, TimelineBuffer):
        raise TypeError(f"tb: expected a TimelineBuffer or None, got {type(tb).__name__}")
    _LAST = tb


def last() -> TimelineBuffer | None:
    """The buffer of the last recorded call, or None if nothing was recorded."""
    return _LAST


# --------------------------------------------------------------------------------------------
# Interval arithmetic (integer ns, exact)
# --------------------------------------------------------------------------------------------


def _union(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Merge intervals into a sorted disjoint list, shape (n, 2). Empty intervals are dropped."""
    keep = ends > starts
    if not np.any(keep):
        return np.zeros((0, 2), dtype=np.int64)
    s, e = starts[keep].astype(np.int64), ends[keep].astype(np.int64)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    merged = []
    cur_s, cur_e = int(s[0]), int(e[0])
    for a, b in zip(s[1:].tolist(), e[1:].tolist()):
        if a <= cur_e:
            cur_e = max(cur_e, b)
        else:
            merged.append((cur_s, cur_e))
            cur_s, cur_e = a, b
    merged.append((cur_s, cur_e))
    return np.asarray(merged, dtype=np.int64)


def _measure(intervals: np.ndarray) -> int:
    return int((intervals[:, 1] - intervals[:, 0]).sum()) if len(intervals) else 0


def _intersection_measure(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the intersection of two disjoint sorted interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if hi > lo:
            total += int(hi - lo)
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return total


def _union_of(rec: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return _union(rec["start_ns"][mask], rec["end_ns"][mask])


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def _max_overlap(rec: np.ndarray) -> int:
    """The most records of ``rec`` running at one time (a record ending as another starts does
    not overlap it)."""
    if rec.shape[0] == 0:
        return 0
    times = np.concatenate([rec["start_ns"], rec["end_ns"]])
    steps = np.concatenate([np.ones(rec.shape[0], np.int64), -np.ones(rec.shape[0], np.int64)])
    order = np.lexsort((steps, times))  # at equal times the end (-1) comes first
    return int(np.cumsum(steps[order]).max())


def _add_task_rates(work: np.ndarray, union_ns: int, overlaps: list[float],
                    periods: dict[str, list[float]]) -> None:
    """One compute CTA's non-WAIT records (``work``, their union ``union_ns`` long): append its
    task overlap (summed spans over the union) and, per GEMM type, its median gap between the
    ends of back-to-back tasks of that type (us), for ``summarize``'s task_overlap and
    task_period_us."""
    if union_ns:
        overlaps.append(float((work["end_ns"] - work["start_ns"]).sum()) / union_ns)
    gemm = work[np.isin(work["task_type"], [int(t) for t in GEMM_TASK_TYPES])]
    gemm = gemm[np.argsort(gemm["end_ns"], kind="stable")]
    same = gemm["task_type"][1:] == gemm["task_type"][:-1]  # back-to-back tasks of a type
    gaps = np.diff(gemm["end_ns"])
    for t in np.unique(gemm["task_type"][1:][same]):
        sel = same & (gemm["task_type"][1:] == t)
        periods.setdefault(task_name(t), []).append(float(np.median(gaps[sel])) / 1e3)


def _add_task_gaps(work: np.ndarray, phases: np.ndarray, gaps: dict[str, list[int]],
                   epilogues: dict[str, list[int]]) -> None:
    """One compute CTA's non-WAIT tasks (``work``) and phases: append, per GEMM type, each
    task's gap from its end to the next start of a task of this CTA that starts after it
    (ns; a per-task cost outside the tasks' spans: a ticket, a drain, waits), and
    each EPILOGUE phase's duration under its task's type (the phase lies inside the span of
    the task with its id), for ``summarize``'s task_gap_us and task_epilogue_us."""
    gemm = work[np.isin(work["task_type"], [int(t) for t in GEMM_TASK_TYPES])]
    starts = np.sort(work["start_ns"])
    for r in gemm:
        nxt = np.searchsorted(starts, r["end_ns"], side="left")
        if nxt < starts.shape[0]:
            gaps.setdefault(task_name(r["task_type"]), []).append(int(starts[nxt] - r["end_ns"]))
    for ph in phases[phases["task_type"] == int(TaskType.EPILOGUE)]:
        owner = gemm[(gemm["task_id"] == ph["task_id"]) & (gemm["start_ns"] <= ph["start_ns"])
                     & (gemm["end_ns"] >= ph["end_ns"])]
        if owner.shape[0]:
            epilogues.setdefault(task_name(owner["task_type"][0]), []).append(
                int(ph["end_ns"] - ph["start_ns"]))


def summarize(
    tl: Timeline,
    flops: float | None = None,
    dispatch_bytes: float | None = None,
    combine_bytes: float | None = None,
) -> dict[str, Any]:
    """Where the time of one recorded layer call went.

    Over the layer span ``S`` (:attr:`Timeline.span_ns`), for each CTA (lane = rank, cta, role):
    ``wait`` = union of its WAIT and STAGE_WAIT spans, ``busy`` = union of its other tasks minus the waits,
    ``idle = S - busy - wait``. Per role, the percentages are of ``lanes * S``.

    ``dispatch_gbps`` / ``combine_gbps`` = bytes over the union of the DISPATCH / COMBINE spans;
    ``gemm_tflops`` = ``flops`` over the union of the GEMM spans (FC1, FC2, shared FC1/FC2) and
    ``layer_tflops`` = ``flops`` over ``S``. ``exposed_comm`` is the time when a comm task
    (dispatch, combine, barrier) runs and no compute task (GEMM, k-sum, gather) runs, as % of ``S``.
    ``task_us``: per task type, one task's mean / p50 / p90 / max duration in us.
    ``task_overlap``: per compute CTA, the summed spans of its non-WAIT tasks over their union
    (1.0: one task at a time; up to 2 when two warpgroups run tiles at once), the mean over
    CTAs. ``task_period_us``: per GEMM type, the median over CTAs of one CTA's median gap
    between the ends of two of its GEMM tasks of that type with no other GEMM task ending
    between them: a CTA's rate of tiles, which a span cannot show once tasks overlap.
    ``task_gap_us``: per GEMM type, the mean / p50 / p90 time (us) from a task's end to the
    next task start on its CTA that comes after it (what a tile costs outside the spans of the
    tasks: a ticket, a drain, and recorded waits between the two tasks too; where two
    warpgroups' tiles overlap, the other's next start). ``task_epilogue_us``: per
    GEMM type, the mean of its tasks' EPILOGUE phases (us).
    """
    rec = tl.records
    span_start, span_end = tl.span_ns
    span = span_end - span_start
    tt = rec["task_type"]
    waiting = is_wait(rec)
    phase = is_phase(rec)

    roles: dict[str, dict[str, Any]] = {}
    overlaps, periods, gaps, epilogues = [], {}, {}, {}
    lane_keys = sorted({(int(r), int(k), int(c)) for r, k, c in zip(rec["role"], rec["rank"], rec["cta_id"])})
    for role, rank, cta in lane_keys:
        mine = (rec["role"] == role) & (rec["rank"] == rank) & (rec["cta_id"] == cta)
        waits = _union_of(rec, mine & waiting)
        work = _union_of(rec, mine & ~waiting)
        wait_ns = _measure(waits)
        busy_ns = _measure(work) - _intersection_measure(work, waits)
        entry = roles.setdefault(role_name(role), {"lanes": 0, "busy_ns": 0, "wait_ns": 0, "idle_ns": 0})
        entry["lanes"] += 1
        entry["busy_ns"] += busy_ns
        entry["wait_ns"] += wait_ns
        entry["idle_ns"] += span - busy_ns - wait_ns
        if role == Role.COMPUTE:
            tasks = rec[mine & ~waiting & ~phase]
            _add_task_rates(tasks, _measure(work), overlaps, periods)
            _add_task_gaps(tasks, rec[mine & phase], gaps, epilogues)
    for entry in roles.values():
        total = entry["lanes"] * span
        for what in ("busy", "wait", "idle"):
            entry[f"{what}_pct"] = 100.0 * entry[f"{what}_ns"] / total if total else 0.0

    def _types(types: Iterable[TaskType]) -> np.ndarray:
        return np.isin(tt, [int(t) for t in types])

    def _rate(amount: float | None, types: Iterable[TaskType], scale: float) -> float | None:
        t_ns = _measure(_union_of(rec, _types(types)))
        if amount is None or t_ns == 0:
            return None
        return float(amount) / t_ns / scale

    comm_u = _union_of(rec, _types(COMM_TASK_TYPES))
    compute_u = _union_of(rec, _types(COMPUTE_TASK_TYPES))
    exposed_ns = _measure(comm_u) - _intersection_measure(comm_u, compute_u)
    counts = {task_name(t): int(n) for t, n in zip(*np.unique(tt, return_counts=True))}
    # how long one task of each type ran: a task that got slower (memory-starved, say) shows
    # here even when the CTAs are never idle
    durations_us = (rec["end_ns"] - rec["start_ns"]) / 1e3
    task_us = {}
    for t in np.unique(tt):
        d = durations_us[tt == t]
        task_us[task_name(t)] = {"mean": float(d.mean()), "p50": float(np.percentile(d, 50)),
                                 "p90": float(np.percentile(d, 90)), "max": float(d.max())}
    return {
        "records": len(tl),
        "dropped": tl.dropped,
        "span_ns": span,
        "roles": roles,
        # bytes / ns = GB/s; flop / ns / 1e3 = TFLOP/s
        "dispatch_gbps": _rate(dispatch_bytes, [TaskType.DISPATCH], 1.0),
        "combine_gbps": _rate(combine_bytes, [TaskType.COMBINE], 1.0),
        "gemm_tflops": _rate(flops, GEMM_TASK_TYPES, 1e3),
        "layer_tflops": (float(flops) / span / 1e3) if flops is not None and span > 0 else None,
        "exposed_comm_ns": exposed_ns,
        "exposed_comm_pct": 100.0 * exposed_ns / span if span else 0.0,
        "task_counts": counts,
        "task_us": task_us,
        "task_overlap": float(np.mean(overlaps)) if overlaps else None,
        "task_period_us": {name: float(np.median(v)) for name, v in sorted(periods.items())},
        "task_gap_us": {name: {"mean": float(np.mean(v)) / 1e3,
                               "p50": float(np.percentile(v, 50)) / 1e3,
                               "p90": float(np.percentile(v, 90)) / 1e3}
                        for name, v in sorted(gaps.items())},
        "task_epilogue_us": {name: float(np.mean(v)) / 1e3
                             for name, v in sorted(epilogues.items())},
    }


def print_summary(
    tl_or_summary: Timeline | dict[str, Any],
    console: Any = None,
    title: str = "mok_cute timeline",
    **summarize_kwargs: Any,
) -> dict[str, Any]:
    """Print :func:`summarize`'s numbers as rich tables; returns the summary dict."""
    from rich.console import Console
    from rich.table import Table

    summary = tl_or_summary if isinstance(tl_or_summary, dict) else summarize(tl_or_summary, **summarize_kwargs)
    console = console or Console()
    roles = Table(title=f"{title}: {summary['span_ns'] / 1e3:.1f} us, {summary['records']} records")
    for col in ("role", "CTAs", "busy %", "wait %", "idle %"):
        roles.add_column(col, justify="left" if col == "role" else "right")
    for name, entry in summary["roles"].items():
        roles.add_row(name, str(entry["lanes"]), f"{entry['busy_pct']:.1f}", f"{entry['wait_pct']:.1f}", f"{entry['idle_pct']:.1f}")
    console.print(roles)

    def fmt(value: float | None, unit: str) -> str:
        return "n/a (no such tasks or no size given)" if value is None else f"{value:.1f} {unit}"

    metrics = Table(show_header=False)
    metrics.add_column("metric")
    metrics.add_column("value", justify="right")
    metrics.add_row("dispatch", fmt(summary["dispatch_gbps"], "GB/s"))
    metrics.add_row("combine", fmt(summary["combine_gbps"], "GB/s"))
    metrics.add_row("GEMM (over GEMM task time)", fmt(summary["gemm_tflops"], "TFLOP/s"))
    metrics.add_row("layer (over the whole span)", fmt(summary["layer_tflops"], "TFLOP/s"))
    metrics.add_row(
        "communication left exposed",
        f"{summary['exposed_comm_pct']:.1f} % ({summary['exposed_comm_ns'] / 1e3:.1f} us)",
    )
    metrics.add_row("tasks", ", ".join(f"{k} {v}" for k, v in summary["task_counts"].items()) or "none")
    if summary.get("task_overlap") is not None:
        periods = ", ".join(f"{k} {v:.2f} us" for k, v in summary["task_period_us"].items())
        metrics.add_row("tasks at once per compute CTA", f"{summary['task_overlap']:.2f}")
        metrics.add_row("a CTA's GEMM tile every", periods or "n/a")
    if summary["dropped"]:
        metrics.add_row("[red]dropped records[/red]", f"[red]{summary['dropped']} (raise timeline_capacity)[/red]")
    console.print(metrics)
    if summary.get("task_us"):
        per_task = Table(title="one task's time (us); its epilogue phase, and the gap after it "
                               "to its CTA's next task (means)")
        for col in ("task", "count", "mean", "p50", "p90", "max", "epilogue", "gap after"):
            per_task.add_column(col, justify="left" if col == "task" else "right")
        gaps, epilogues = summary.get("task_gap_us", {}), summary.get("task_epilogue_us", {})
        for name, t in summary["task_us"].items():
            per_task.add_row(name, str(summary["task_counts"].get(name, "")),
                             *(f"{t[k]:.1f}" for k in ("mean", "p50", "p90", "max")),
                             f"{epilogues[name]:.2f}" if name in epilogues else "",
                             f"{gaps[name]['mean']:.2f}" if name in gaps else "")
        console.print(per_task)
    return summary


# --------------------------------------------------------------------------------------------
# Chrome trace
# --------------------------------------------------------------------------------------------


def to_chrome_trace(tl: Timeline) -> dict[str, Any]:
    """Trace-event JSON (opens in Perfetto / chrome://tracing): one process per rank, one thread
    per SM, one complete ('X') event per record named by its task type; times in microseconds
    from the kernel start (shifted so no timestamp is negative)."""
    rec = tl.records
    shift = -min(0, tl.span_ns[0])
    events: list[dict[str, Any]] = []
    lanes = tl.lanes()
    for rank in sorted({lane[0] for lane in lanes}):
        events.append({"name": "process_name", "ph": "M", "ts": 0, "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for index, (rank, sm, role) in enumerate(lanes):
        events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": sm, "args": {"name": f"SM {sm} ({role})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": sm, "args": {"sort_index": index}})
    for i in range(len(rec)):
        start, end = int(rec["start_ns"][i]), int(rec["end_ns"][i])
        task_type = int(rec["task_type"][i])
        args = {"task_id": int(rec["task_id"][i]), "cta": int(rec["cta_id"][i]), "role": role_name(rec["role"][i])}
        if task_type in WAIT_TASK_TYPES:
            args = {"waited_for_task": args.pop("task_id"), **args}
        if end < start:
            args["error"] = "end before start"
        events.append(
            {
                "name": task_name(task_type),
                "cat": role_name(rec["role"][i]),
                "ph": "X",
                "ts": (start + shift) / 1e3,
                "dur": max(0, end - start) / 1e3,
                "pid": int(rec["rank"][i]),
                "tid": int(rec["sm_id"][i]),
                "args": args,
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "source": "mok_cute.timeline",
            "records": len(tl),
            "capacity": tl.capacity,
            "dropped": tl.dropped,
            "t0_ns": tl.t0_ns,
            **{k: v for k, v in tl.meta.items() if isinstance(v, (str, int, float, bool))},
        },
    }


def write_chrome_trace(tl: Timeline, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_chrome_trace(tl), f)
    return path


# --------------------------------------------------------------------------------------------
# PNG swimlanes
# --------------------------------------------------------------------------------------------

_WAIT_STYLE = {"facecolor": "#d0d0d0", "edgecolor": "#606060", "hatch": "////", "linewidth": 0.0}


def _task_colors() -> dict[int, Any]:
    import matplotlib

    # a recording holds the forward's types or the backward's: each family its own colours
    cmap = matplotlib.colormaps["tab20"]
    colors = {}
    for family in (TaskType, BT):
        drawn = [t for t in family if t not in WAIT_TASK_TYPES]
        colors.update({int(t): cmap((2 * i) % 20 + (2 * i) // 20) for i, t in enumerate(drawn)})
    return colors


def plot_swimlanes(tl: Timeline, path: str | os.PathLike, title: str | None = None) -> Path:
    """PNG: one lane per (rank, SM), time in us on x, comm SMs grouped on top, one colour per task
    type, WAIT spans hatched grey on top of the task they interrupt."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = tl.records
    lanes = tl.lanes()
    multi_rank = len({lane[0] for lane in lanes}) > 1
    row = {(rank, sm): y for y, (rank, sm, _) in enumerate(lanes)}
    height = min(40.0, max(3.0, 1.2 + 0.16 * len(lanes)))
    fig, ax = plt.subplots(figsize=(13, height))
    colors = _task_colors()
    shift = -min(0, tl.span_ns[0])
    start_us = (rec["start_ns"] + shift) / 1e3
    dur_us = np.maximum(rec["end_ns"] - rec["start_ns"], 0) / 1e3
    ys = np.asarray([row[(int(r), int(s))] for r, s in zip(rec["rank"], rec["sm_id"])], dtype=np.int64)
    present = []
    # Tasks first, waits last so a wait nested inside a task is drawn over it; a task's phases
    # are left to the summary and the trace (they would hide the task's own colour).
    tasks_drawn = [t for t in SPAN_TYPES if t not in WAIT_TASK_TYPES | PHASE_TASK_TYPES]
    for t in tasks_drawn + sorted(WAIT_TASK_TYPES):
        mask = rec["task_type"] == int(t)
        if not np.any(mask):
            continue
        present.append(t)
        style = _WAIT_STYLE if t in WAIT_TASK_TYPES else {"facecolor": colors[int(t)], "linewidth": 0.0}
        for y in np.unique(ys[mask]):
            sel = mask & (ys == y)
            ax.broken_barh(list(zip(start_us[sel], dur_us[sel])), (y - 0.42, 0.84), **style)
    unknown = ~np.isin(rec["task_type"], [int(t) for t in SPAN_TYPES])  # phases are known, undrawn
    if np.any(unknown):
        present_unknown = True
        for y in np.unique(ys[unknown]):
            sel = unknown & (ys == y)
            ax.broken_barh(list(zip(start_us[sel], dur_us[sel])), (y - 0.42, 0.84), facecolor="black")
    else:
        present_unknown = False

    n_comm = sum(1 for lane in lanes if lane[2] == "comm")
    if 0 < n_comm < len(lanes):
        ax.axhline(n_comm - 0.5, color="black", linewidth=1.0)
    labels = [(f"r{rank} " if multi_rank else "") + f"SM {sm}" + (" C" if role == "comm" else "") for rank, sm, role in lanes]
    step = max(1, len(lanes) // 60)
    ax.set_yticks(range(0, len(lanes), step))
    ax.set_yticklabels(labels[::step], fontsize=7)
    ax.set_ylim(len(lanes) - 0.5 if lanes else 0.5, -0.5)
    span_us = (tl.span_ns[1] - tl.span_ns[0]) / 1e3
    ax.set_xlim(0, span_us * 1.01 if span_us > 0 else 1.0)
    ax.set_xlabel("time since kernel start (us)")
    ax.set_ylabel(f"SM ({n_comm} comm lanes on top, marked C)" if n_comm else "SM")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=colors[int(t)], label=t.name) for t in present if t not in WAIT_TASK_TYPES]
    waits = [t.name for t in present if t in WAIT_TASK_TYPES]
    if waits:
        handles.append(Patch(label=" / ".join(waits), **{k: v for k, v in _WAIT_STYLE.items() if k != "linewidth"}))
    if present_unknown:
        handles.append(Patch(facecolor="black", label="unknown type"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    heading = title or "mok_cute timeline"
    heading += f"  ({len(tl)} records, {span_us:.1f} us"
    heading += f", {tl.dropped} DROPPED)" if tl.dropped else ")"
    ax.set_title(heading, color="red" if tl.dropped else "black")
    if len(tl) == 0:
        ax.text(0.5, 0.5, "no records", transform=ax.transAxes, ha="center", va="center")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Synthetic recordings (demos and tests; never presented as measurements)
# --------------------------------------------------------------------------------------------


def synthetic_buffer(
    num_ranks: int = 1,
    num_comm_sms: int = 4,
    num_compute_sms: int = 12,
    minibatches: int = 4,
    fc1_tiles_per_minibatch: int = 24,
    fc2_tiles_per_minibatch: int = 24,
    capacity: int | None = None,
    seed: int = 0,
) -> np.ndarray:
    """A made-up megakernel recording with the device layout: comm CTAs dispatch minibatches then
    combine finished FC2 tiles, compute CTAs wait for their minibatch, run FC1 then FC2 tiles,
    everyone meets at a barrier, and compute CTAs do the k-sum. Durations are invented (with
    jitter); use it to look at the exporters, not as a measurement."""
    rng = np.random.default_rng(seed)
    rows: list[tuple[int, ...]] = []
    dispatch_ns, fc1_ns, fc2_ns, combine_ns, ksum_ns, barrier_ns = 9_000, 3_000, 2_500, 1_200, 2_000, 800
    for rank in range(num_ranks):
        task = 0
        comm_free = np.zeros(num_comm_sms, dtype=np.int64)
        dispatch_done = []
        for mb in range(minibatches):
            sm = int(np.argmin(comm_free))
            start = int(comm_free[sm])
            end = start + int(dispatch_ns * rng.uniform(0.8, 1.2))
            rows.append((Role.COMM, TaskType.DISPATCH, task, rank, sm, sm, start, end))
            comm_free[sm] = end
            dispatch_done.append(end)
            task += 1
        compute_free = np.zeros(num_compute_sms, dtype=np.int64)
        fc2_done: list[tuple[int, int]] = []
        for mb in range(minibatches):
            fc1_ends = []
            for kind, tiles, dur, ready in (
                (TaskType.FC1, fc1_tiles_per_minibatch, fc1_ns, dispatch_done[mb]),
                (TaskType.FC2, fc2_tiles_per_minibatch, fc2_ns, None),
            ):
                if ready is None:
                    ready = max(fc1_ends) if fc1_ends else 0
                    wait_for = task - 1
                else:
                    wait_for = mb
                for _ in range(tiles):
                    j = int(np.argmin(compute_free))
                    sm = num_comm_sms + j
                    start = int(compute_free[j])
                    if start < ready:
                        rows.append((Role.COMPUTE, TaskType.WAIT, wait_for, rank, sm, sm, start, ready))
                        start = ready
                    end = start + int(dur * rng.uniform(0.85, 1.15))
                    rows.append((Role.COMPUTE, kind, task, rank, sm, sm, start, end))
                    compute_free[j] = end
                    (fc1_ends.append(end) if kind == TaskType.FC1 else fc2_done.append((end, task)))
                    task += 1
        for ready, fc2_task in sorted(fc2_done):
            sm = int(np.argmin(comm_free))
            start = int(comm_free[sm])
            if start < ready:
                rows.append((Role.COMM, TaskType.WAIT, fc2_task, rank, sm, sm, start, ready))
                start = ready
            end = start + int(combine_ns * rng.uniform(0.8, 1.2))
            rows.append((Role.COMM, TaskType.COMBINE, task, rank, sm, sm, start, end))
            comm_free[sm] = end
            task += 1
        barrier_start = int(max(comm_free.max(), compute_free.max()))
        for sm in range(num_comm_sms):
            rows.append((Role.COMM, TaskType.BARRIER, task, rank, sm, sm, barrier_start, barrier_start + barrier_ns))
        task += 1
        for j in range(num_compute_sms):
            sm = num_comm_sms + j
            start = barrier_start + barrier_ns
            rows.append((Role.COMPUTE, TaskType.KSUM, task + j, rank, sm, sm, start, start + int(ksum_ns * rng.uniform(0.9, 1.1))))
    rows.sort(key=lambda r: r[6])  # ticket order follows start time, roughly as on the device
    return encode_records(np.asarray(rows, dtype=np.int64), capacity=capacity)


# --------------------------------------------------------------------------------------------
# The three views of a recording as files (``mok-cute timeline``: mok_cute.bench.record_timeline)
# --------------------------------------------------------------------------------------------


def write_views(tl: Timeline, outdir: str | os.PathLike, summary: dict[str, Any], title: str) -> dict[str, Path]:
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = {
        "trace": write_chrome_trace(tl, outdir / "timeline_trace.json"),
        "png": plot_swimlanes(tl, outdir / "timeline.png", title=title),
        "summary": outdir / "timeline_summary.json",
    }
    with open(paths["summary"], "w") as f:
        json.dump({"title": title, **tl.meta, **summary}, f, indent=1)
    return paths
