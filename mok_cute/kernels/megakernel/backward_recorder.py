"""The backward megakernel's timeline recorder (the ``timeline`` build of
``BackwardMegakernelSm90``): the same int64 buffer and records as the forward's
(``mok_cute.timeline`` decodes both), the backward's task types (``BackwardTaskType``).

What is recorded, each span by one thread, task id = the task's list index:

* every task that runs: FC2_DGRAD / FC1_DGRAD (and the shared expert's) from the start of its
  mainloop (stage waits included) to its last output store issued, with its EPILOGUE phase
  (from the mainloop's last wgmma); each weight-gradient tile (both warpgroups' blocks of one
  ticket) likewise; REVERSE_COMBINE / REPULL_X / REVERSE_DISPATCH, BARRIER and KSUM tasks,
  role COMM on a comm CTA and COMPUTE on a compute CTA (KSUMs by ticket run on both);
* the load warp's (and a comm task's) waits on other tasks' counters longer than
  ``WAIT_RECORD_MIN_NS``, as WAIT spans.

The pingpong FC2_DGRAD phase runs two tiles at a time on a CTA (one a consumer warpgroup);
its spans start once the warpgroup's turn has come, so they overlap only by the epilogue of
one under the other's mainloop. With the recorder off nothing here emits an instruction.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from mok_cute.kernels import common
from mok_cute.kernels.megakernel.scheduler import WAIT_RECORD_MIN_NS
from mok_cute.tasks import Role, TaskType

COMPUTE, COMM = int(Role.COMPUTE), int(Role.COMM)
START, EPILOGUE = 0, 1  # a recording thread's two smem marks
MARKS_PER_WARPGROUP = 2


class Recorder(NamedTuple):
    """What a consumer warpgroup (or a comm CTA) records its tasks with (``rec_stamp``,
    ``rec_task``)."""

    buf: cute.Tensor  # the timeline buffer
    marks: object  # int64 smem [MARKS_PER_WARPGROUP] of the recording thread (None: off)
    leader: object  # the recording thread


class BackwardRecorderMixin:
    """The recorder's device helpers; the host class sets the static ``self.timeline``."""

    @cute.jit
    def rec_start(self, buf: cute.Tensor, tidx: Int32):
        """The launch's start time: the first CTA's thread 0 to get here stamps it."""
        if const_expr(self.timeline):
            if tidx == 0:
                common.timeline_mark_start(buf, common.timeline_now())

    @cute.jit
    def rec_stamp(self, rec: "Recorder", which: int):
        """The recording thread stamps mark ``which`` (START or EPILOGUE) of its task in smem:
        held in registers through the dgated epilogue, the times made ptxas spill."""
        if const_expr(self.timeline):
            if rec.leader:
                rec.marks[which] = common.timeline_now()

    @cute.jit
    def rec_task(self, rec: "Recorder", role: cutlass.Constexpr[int], ttype, index,
                 epilogue: cutlass.Constexpr[bool] = True):
        """Task ``index``'s span from its START mark to now, written by the recording thread;
        a GEMM task's (``epilogue``) with its EPILOGUE phase from its EPILOGUE mark (the
        mainloop's end) to now. A comm task's start goes through the mark too: a time held
        through its row copies made ptxas spill."""
        if const_expr(self.timeline):
            t1 = common.timeline_now()
            if rec.leader:
                slot = common.timeline_reserve(rec.buf, 1 + int(epilogue))
                common.timeline_write(rec.buf, slot, role, ttype, index, Int32(0),
                                      rec.marks[START], t1)
                if const_expr(epilogue):
                    common.timeline_write(rec.buf, slot + 1, role, int(TaskType.EPILOGUE),
                                          index, Int32(0), rec.marks[EPILOGUE], t1)

    @cute.jit
    def wait_task_recorded(self, tasks: cute.Tensor, index: Int32, expert_offsets: cute.Tensor,
                           counter_offsets: cute.Tensor, counters: cute.Tensor,
                           error: cute.Tensor, timeout_ns: Int64, buf: cute.Tensor,
                           role: cutlass.Constexpr[int], leader,
                           lane_strided: cutlass.Constexpr[bool] = False):
        """``_wait_task``; with the recorder on, a wait longer than ``WAIT_RECORD_MIN_NS``
        also becomes a WAIT span written by ``leader``."""
        t0 = Int64(0)
        if const_expr(self.timeline):
            t0 = common.timeline_now()
        self._wait_task(tasks, index, expert_offsets, counter_offsets, counters, error,
                        timeout_ns, lane_strided)
        if const_expr(self.timeline):
            t1 = common.timeline_now()
            if leader and t1 - t0 > WAIT_RECORD_MIN_NS:
                slot = common.timeline_reserve(buf, 1)
                common.timeline_write(buf, slot, role, int(TaskType.WAIT), index, Int32(0),
                                      t0, t1)


__all__ = ["BackwardRecorderMixin", "COMM", "COMPUTE", "EPILOGUE", "MARKS_PER_WARPGROUP",
           "Recorder", "START"]
