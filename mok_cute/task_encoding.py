"""The megakernel's task list as the int32 words it reads, and back.

``encode`` turns a ``mok_cute.tasks.TaskList`` into the task rows (word layout: ``TaskWord``
and the "Device encoding" section of ``mok_cute.tasks``' docstring), ``encode_device`` adds
the per-role queues, live-prefix and ticket-block tables the ticket walk reads,
``live_minibatches`` is the run-time rule the kernel applies to its ``num_tiles``, and
``decode`` reads task rows back (tests, debugging).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mok_cute.tasks import (MAX_WAITS, TASK_WORDS, CounterGroup, Role, TaskList, TaskType,
                            _as_numpy)

__all__ = [
    "DeviceTaskList",
    "encode",
    "encode_device",
    "decode",
    "live_minibatches",
]


def encode(task_list: TaskList):
    """int32 tensor ``[num_tasks, TASK_WORDS]`` (layout: ``mok_cute.tasks``' docstring)."""
    import torch

    tl = task_list
    n = len(tl)
    out = np.zeros((n, TASK_WORDS), dtype=np.int64)
    out[:, 0] = tl.type
    out[:, 1] = tl.role
    out[:, 2] = tl.minibatch
    out[:, 3] = tl.m_tile_begin
    out[:, 4] = tl.m_tile_end
    out[:, 5] = tl.n_tile
    out[:, 6] = tl.row_begin
    out[:, 7] = tl.row_end
    out[:, 8] = tl.ring_row_begin
    out[:, 9] = tl.signal_group
    out[:, 10] = tl.signal_index
    out[:, 11] = (tl.waits[:, :, 0] >= 0).sum(axis=1)
    out[:, 12:] = tl.waits.reshape(n, MAX_WAITS * 4)
    if n and (out.max() > np.iinfo(np.int32).max or out.min() < np.iinfo(np.int32).min):
        raise ValueError("task list does not fit the int32 encoding (rows or counts >= 2**31)")
    return torch.from_numpy(out.astype(np.int32))


class DeviceTaskList(NamedTuple):
    tasks: object  # int32 [N, TASK_WORDS]
    queues: object  # int32 [2, max queue length], list indices per Role, -1 padded
    queue_len: object  # int32 [2]
    queue_live_len: object  # int32 [2, num_minibatches + 1]
    # int32 [2, num_minibatches + 1]: queue position where ticket block b starts per role
    # (block b of the merged list begins at the first compute task of minibatch b); the last
    # column is the tail (``queue_tail_begin``). See `ticket_blocks`.
    queue_blocks: object
    counter_offsets: object  # int32 [len(CounterGroup) + 1]
    num_counters: int
    tiles_per_minibatch: int
    num_m_tiles: int
    num_minibatches: int

    @property
    def queue_tail_begin(self):
        """int32 [2]: the queue position where each role's tail (BARRIER, KSUM) begins."""
        return self.queue_blocks[:, -1]


def encode_device(task_list: TaskList, device=None) -> DeviceTaskList:
    """Everything the megakernel reads: the task rows, per-role queues and live-prefix table."""
    import torch

    tl = task_list
    nmb = tl.num_minibatches
    queues = [tl.queue(r) for r in (Role.COMM, Role.COMPUTE)]
    qmax = max((len(q) for q in queues), default=0)
    qtab = np.full((2, max(qmax, 1)), -1, dtype=np.int64)
    live_len = np.zeros((2, nmb + 1), dtype=np.int64)
    tail_begin = np.zeros(2, dtype=np.int64)
    for r, q in enumerate(queues):
        qtab[r, :len(q)] = q
        mb = tl.minibatch[q]
        routed = np.flatnonzero(mb >= 0)
        # head: shared-expert tasks before the first routed task; tail: BARRIER / KSUM after
        # the last one. Without routed tasks the whole queue counts as head.
        head_len = int(routed[0]) if routed.size else len(q)
        tail_begin[r] = int(routed[-1]) + 1 if routed.size else len(q)
        last_of_mb = np.full(nmb, -1, dtype=np.int64)
        if routed.size:
            np.maximum.at(last_of_mb, mb[routed], routed)
        for live in range(nmb + 1):
            last = int(last_of_mb[:live].max()) if live else -1
            live_len[r, live] = max(head_len, last + 1)
    blocks = ticket_blocks(tl, queues, tail_begin)
    t = lambda a: torch.as_tensor(a.astype(np.int32), device=device)  # noqa: E731
    return DeviceTaskList(
        tasks=encode(tl).to(device) if device is not None else encode(tl),
        queues=t(qtab), queue_len=t(np.array([len(q) for q in queues])),
        queue_live_len=t(live_len), queue_blocks=t(blocks),
        counter_offsets=t(tl.counter_offsets), num_counters=int(tl.counter_offsets[-1]),
        tiles_per_minibatch=tl.tiles_per_minibatch, num_m_tiles=tl.num_m_tiles,
        num_minibatches=nmb,
    )


def ticket_blocks(task_list: TaskList, queues: list, tail_begin: np.ndarray) -> np.ndarray:
    """Ticket blocks of R virtual ranks in one launch (``MegakernelSm90`` with
    ``rank_blocks``): the merged list is cut at the first compute task of every minibatch, and
    each role's CTAs walk block by block, every rank's share of a block before the next
    block, instead of alternating ranks task by task. Concurrent compute tiles then belong to
    one rank's minibatch and share its weights in L2, as at R = 1.

    Deadlock-free like the alternating walk: order tasks by (block, rank, list index). Both
    roles cut the list at the same indices, so that order agrees with each role's tickets; a
    wait on the same rank points to a lower list index, hence a lower or equal block; the
    only cross-rank waits are KSUM's on every peer's BARRIER flag, and the comm tail (BARRIER)
    never waits on the compute tail (KSUM). Returns int32-able [2, num_minibatches + 1]: the
    queue position each block starts at, per role; the last column is the tail."""
    nmb = task_list.num_minibatches
    compute = np.asarray(queues[1])
    mb_of_compute = task_list.minibatch[compute] if compute.size else np.zeros(0, np.int64)
    cuts = np.zeros(nmb, dtype=np.int64)  # list index where block b begins (block 0: 0)
    for b in range(1, nmb):
        first = compute[mb_of_compute == b]
        cuts[b] = int(first.min()) if first.size else cuts[b - 1]
    cuts = np.maximum.accumulate(cuts)
    out = np.zeros((2, nmb + 1), dtype=np.int64)
    for r, q in enumerate(queues):
        q = np.asarray(q)
        out[r, :nmb] = np.minimum(np.searchsorted(q, cuts), tail_begin[r])  # queues are in list order
        out[r, nmb] = tail_begin[r]
    return out


def decode(tasks) -> list[dict]:
    """Inverse of ``encode`` (for tests and debugging): one dict per row."""
    a = np.asarray(_as_numpy(tasks), dtype=np.int64)
    out = []
    for row in a:
        waits = [tuple(int(v) for v in row[12 + 4 * w: 16 + 4 * w]) for w in range(int(row[11]))]
        out.append(dict(
            type=TaskType(int(row[0])), role=Role(int(row[1])), minibatch=int(row[2]),
            m_tile_begin=int(row[3]), m_tile_end=int(row[4]), n_tile=int(row[5]),
            row_begin=int(row[6]), row_end=int(row[7]), ring_row_begin=int(row[8]),
            signal=(CounterGroup(int(row[9])), int(row[10])),
            waits=[(CounterGroup(g), f, c, t) for g, f, c, t in waits],
        ))
    return out


def live_minibatches(num_tiles: int, tiles_per_minibatch: int) -> int:
    """The run-time rule the kernel applies to the device's ``num_tiles``."""
    return -(-int(num_tiles) // int(tiles_per_minibatch))
