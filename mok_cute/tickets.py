"""The host model of the megakernel's ticket walk (one definition, used by the tests and
the debugging tools): which task each ticket names, on which virtual rank, and whether the
kernel runs it, makes it a no-op or skips it. The device code is
``kernels/megakernel/scheduler.py``; the task list and its queues are ``mok_cute.tasks``."""

from __future__ import annotations

from mok_cute import task_encoding
from mok_cute.tasks import Role, TaskWord

__all__ = ["ticket_position", "walk_tickets", "simulate_live_run"]


def ticket_position(device_tasks, role: int, R: int, live_prefix: int, rank_blocks: bool,
                    q: int, cursor: tuple[int, int]) -> tuple[int, int, tuple[int, int]]:
    """Python model of the kernel's ``SchedulerMixin._ticket``: ticket ``q`` of ``role`` -> (queue position,
    or one past the queue when exhausted; rank; the updated (block, first ticket of the block)
    cursor, which only moves forward as one CTA's tickets do).

    Alternating (``rank_blocks`` False): position q // R of rank q % R, positions past the
    live prefix jumping to the tail. Blocks: ``queue_blocks`` cut each queue into one block
    per minibatch (clipped to the live prefix) and the tail; R * size tickets per block, every
    rank's share in turn (``task_encoding.ticket_blocks``)."""
    qlen = int(device_tasks.queue_len[role])
    blocks = device_tasks.queue_blocks[role].tolist()
    tail = blocks[-1]
    if not rank_blocks:
        pos = q // R
        if pos >= live_prefix:
            pos = tail + (pos - live_prefix)
        return pos, q % R, cursor

    def block(b):
        if b < len(blocks) - 1:
            return blocks[b], max(min(blocks[b + 1], live_prefix) - blocks[b], 0)
        return tail, qlen - tail

    b, q_base = cursor
    start, size = block(b)
    while b < len(blocks) and q >= q_base + R * size:
        q_base += R * size
        b += 1
        start, size = block(b)
    if b >= len(blocks):
        return qlen, 0, (b, q_base)
    off = q - q_base
    return start + off % size, off // size, (b, q_base)


def walk_tickets(device_tasks, num_tiles: list[int], role: int,
                 rank_blocks: bool = False) -> list[tuple[int, int, str]]:
    """Python model of how the kernel's CTAs of one role walk their tickets with
    ``len(num_tiles)`` virtual ranks (``SchedulerMixin._live_prefix``, ``_ticket``,
    ``_task_state``; the mapping is ``ticket_position``). Returns, in ticket order,
    (rank, list index, "run" | "noop" | "skip") for every ticket that names a task."""
    R = len(num_tiles)
    tpm = device_tasks.tiles_per_minibatch
    tasks_np = device_tasks.tasks.cpu().numpy()
    queues = device_tasks.queues.cpu().numpy()
    qlen = int(device_tasks.queue_len[role])
    live_len = device_tasks.queue_live_len.cpu().numpy()
    live_of = [-(-int(t) // tpm) for t in num_tiles]
    live_prefix = max(int(live_len[role, live]) for live in live_of)
    out, q, cursor = [], 0, (0, 0)
    while True:
        pos, rank, cursor = ticket_position(device_tasks, role, R, live_prefix, rank_blocks, q, cursor)
        if pos >= qlen:
            break
        index = int(queues[role, pos])
        minibatch = int(tasks_np[index, TaskWord.MINIBATCH])
        m_tile = int(tasks_np[index, TaskWord.M_TILE])
        if minibatch >= live_of[rank]:
            state = "skip"
        elif minibatch >= 0 and m_tile >= num_tiles[rank]:
            state = "noop"
        else:
            state = "run"
        out.append((rank, index, state))
        q += 1
    return out


def simulate_live_run(task_list, num_tiles: int) -> dict:
    """What one rank's CTAs do with a static list and ``num_tiles`` real tiles (the walk of
    ``walk_tickets`` with one rank): per role, the list indices fetched, run, made no-ops and
    skipped."""
    dev = task_encoding.encode_device(task_list)
    live = task_encoding.live_minibatches(num_tiles, task_list.tiles_per_minibatch)
    if live > task_list.num_minibatches:
        raise ValueError(f"num_tiles must be <= {task_list.num_m_tiles} (static tiles), "
                         f"got {num_tiles}")
    out = {}
    for role in (Role.COMM, Role.COMPUTE):
        walk = walk_tickets(dev, [num_tiles], int(role))
        out[role] = dict(fetched=[i for _, i, _ in walk],
                         ran=[i for _, i, st in walk if st == "run"],
                         noop=[i for _, i, st in walk if st == "noop"],
                         skipped=[i for _, i, st in walk if st == "skip"])
    return out
