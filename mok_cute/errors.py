"""Errors the kernels report through their error word (host side; no DSL import)."""

from __future__ import annotations

import sys

from mok_cute.constants import (ERROR_CODE_SHIFT, ERROR_PEER_SHIFT, ERROR_RANK_MASK,
                                ERROR_RANK_SHIFT, PEER_FAILED, PEER_NEVER_STARTED,
                                SAVED_ROWS_SHORT)


class PeerTimeoutError(RuntimeError):
    """A megakernel call could not complete: one of its bounded waits passed its deadline, or
    a peer reported that its own launch of the same call failed. Names the call (the plan's
    call number), the rank that waited, the task and the peer. The outputs of that call's
    incomplete rows are NaN."""

    def __init__(self, task_id: int, peer: int, code: int, rank: int | None = None,
                 call: int | None = None, kernel: str = "megakernel"):
        self.task_id, self.peer, self.code, self.rank, self.call = task_id, peer, code, rank, call
        self.kernel = kernel
        where = "" if call is None else f"{kernel} call {call}: "
        who = "" if rank is None else f"rank {rank}: "
        if code == PEER_FAILED:
            text = (f"task {task_id}: peer {peer} reported that its own launch of this call "
                    "failed (its error names the cause)")
        else:
            why = ("that peer never announced its start (its process died or never launched)"
                   if code == PEER_NEVER_STARTED else "that peer stopped publishing its counters")
            text = f"task {task_id} timed out waiting for peer {peer} (error code {code}): {why}"
        outcome = ("the rows it could not complete are NaN" if kernel == "megakernel" else
                   "the gradients of that call are incomplete: discard them")
        super().__init__(f"{where}{who}{text}; {outcome}")


class SavedRowsError(RuntimeError):
    """A training call over a group routed more rows to a rank than its forward kept g | u for
    (``MoKConfig.saved_rows_factor``, or what its ``saved_rows_pool`` had left): that rank's
    backward cannot have every gradient. Names the call, the rank, how many rows it received
    and how many it kept (or the pool's size). Nothing was dropped silently: discard the step
    (the gradients of that backward miss those rows) and raise the factor or the pool, or leave
    both None (the worst case)."""

    def __init__(self, missing: int, kept: int | None = None, rank: int | None = None,
                 call: int | None = None, kernel: str = "megakernel",
                 pool_bytes: int | None = None):
        self.missing, self.kept, self.rank, self.call = missing, kept, rank, call
        where = "" if call is None else f"{kernel} call {call}: "
        who = "a rank" if rank is None else f"rank {rank}"
        rows = "1 routed row" if missing == 1 else f"{missing} routed rows"
        if pool_bytes is not None:
            keeps = (f"the rows its SavedRowsPool of {pool_bytes} bytes had left for the g | u "
                     f"of its forward (MoKConfig.saved_rows_pool; the rows of earlier calls whose "
                     f"backward has not run are held)")
            fix = "a larger pool"
        else:
            keeps = (f"{'the rows' if kept is None else f'the {kept} rows'} whose g | u its "
                     f"forward keeps for the backward (MoKConfig.saved_rows_factor or "
                     f"saved_rows_pool)")
            fix = "raise saved_rows_factor or the pool"
        super().__init__(
            f"{where}{who} received {rows} more than {keeps}: the gradients of this call's "
            f"backward miss them, discard them; {fix}, or leave both None (every peer's T * K "
            f"rows)")


def error_word(task_id: int, peer: int, rank: int, code: int) -> int:
    """The error word ``kernels.common.wait_counter`` writes (layout: ``mok_cute.constants``)."""
    return ((task_id + 1) | (peer << ERROR_PEER_SHIFT) | (rank << ERROR_RANK_SHIFT)
            | (code << ERROR_CODE_SHIFT))


def decode_wait_error(word: int) -> tuple[int, int, int, int] | None:
    """(task_id, peer, rank, code) of an error word; None if 0."""
    word = int(word)
    if word == 0:
        return None
    return ((word & 0xFFFFFFFF) - 1, (word >> ERROR_PEER_SHIFT) & ERROR_RANK_MASK,
            (word >> ERROR_RANK_SHIFT) & ERROR_RANK_MASK, word >> ERROR_CODE_SHIFT)


def raise_on_wait_error(word: int, call: int | None = None, rank_base: int = 0,
                        kernel: str = "megakernel") -> None:
    """Turn a non-zero error word into a PeerTimeoutError (host side, after the launch).
    ``rank_base``: the group rank of the launch's rank 0 (an IPC process's rank)."""
    decoded = decode_wait_error(word)
    if decoded is not None:
        task_id, peer, rank, code = decoded
        if code == SAVED_ROWS_SHORT:  # the task field holds the count (``error_word``)
            raise SavedRowsError(task_id + 1, rank=rank + rank_base, call=call, kernel=kernel)
        raise PeerTimeoutError(task_id, peer, code, rank + rank_base, call, kernel)


class PendingErrors:
    """The error word of a kernel's launches, read without a host sync: after each launch it is
    copied into one of ``slots`` pinned words (``record``); a later call reads the copies whose
    launch has finished (``check``), waiting only for the oldest when every word is in use."""

    def __init__(self, device_word, slots: int | None = None, kernel: str = "megakernel"):
        import collections

        import torch

        from mok_cute.constants import ERROR_SLOTS

        self.device_word = device_word  # int64 (1,) on the device, written by the kernel
        self.kernel = kernel  # what an error names
        self._words = [torch.zeros(1, dtype=torch.int64, pin_memory=True)
                       for _ in range(slots or ERROR_SLOTS)]
        self._next = 0
        self._pending = collections.deque()  # (event, pinned word, call) per launch

    def record(self, call: int) -> None:
        """After launch ``call`` on the current stream of the word's device: its word's copy
        and an event there. Nothing while a CUDA graph is captured (a replay records nothing on
        the host: ``check_device`` reads its word; a copy or event captured here would be
        queried outside the graph)."""
        import torch

        from mok_cute.shared_state import capturing

        if capturing():
            return
        word = self._words[self._next]
        self._next = (self._next + 1) % len(self._words)
        word.copy_(self.device_word, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device_word.device))
        self._pending.append((event, word, call))

    def check(self, block: bool, last_call: int, rank_base: int = 0) -> None:
        """Raise PeerTimeoutError for the first finished launch whose word is set (all of them
        with ``block``; otherwise only those done, and the oldest when every word is in use).
        A word reported from the last launch is cleared on the device (not reported twice).
        Nothing while a CUDA graph is captured: querying an event there breaks the capture."""
        from mok_cute.shared_state import capturing

        if capturing():
            return
        pending = self._pending
        while pending:
            event, word, call = pending[0]
            if not (block or len(pending) >= len(self._words) or event.query()):
                break
            event.synchronize()
            pending.popleft()
            if word[0] != 0 and call == last_call:
                self.device_word.zero_()
            raise_on_wait_error(int(word[0]), call, rank_base, self.kernel)

    def check_device(self, call: int, rank_base: int = 0) -> None:
        """Read the device word now (synchronises; covers CUDA-graph replays, which record
        nothing on the host); a set word is cleared and raised as launch ``call``'s."""
        word = int(self.device_word.item())
        if word:
            self.device_word.zero_()
            raise_on_wait_error(word, call, rank_base, self.kernel)


def check_errors() -> None:
    """Raise ``PeerTimeoutError`` for the first megakernel call that could not complete and
    has not been reported yet (its rows that could not complete hold NaN). Calls with
    ``MoKConfig(check_ids=False)`` and CUDA-graph replays never synchronise, so they report a
    failure only at a later call of the same plan or here. Synchronises with the device; does
    nothing when no megakernel has run in this process."""
    for name in ("mok_cute.megakernel", "mok_cute.megakernel_backward"):
        module = sys.modules.get(name)
        if module is not None:
            module.check_errors()
