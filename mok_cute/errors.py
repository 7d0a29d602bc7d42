"""Errors the kernels report through their error word (host side; no DSL import)."""

from __future__ import annotations

from mok_cute.constants import PEER_NEVER_STARTED


class PeerTimeoutError(RuntimeError):
    """A bounded wait inside a kernel passed its deadline: names the task and the peer."""

    def __init__(self, task_id: int, peer: int, code: int):
        self.task_id, self.peer, self.code = task_id, peer, code
        why = ("that peer never announced its start (its process died or never launched)"
               if code == PEER_NEVER_STARTED else "that peer stopped publishing its counters")
        super().__init__(f"task {task_id} timed out waiting for peer {peer} (error code {code}): {why}")


def decode_wait_error(word: int) -> tuple[int, int, int] | None:
    """(task_id, peer, code) from an error word written by ``kernels.common.wait_counter``;
    None if 0 (layout: ``mok_cute.constants``)."""
    word = int(word)
    if word == 0:
        return None
    return (word & 0xFFFFFFFF) - 1, (word >> 32) & 0xFFFF, (word >> 48) & 0xFFFF


def raise_on_wait_error(word: int) -> None:
    """Turn a non-zero error word into a PeerTimeoutError (host side, after the launch)."""
    decoded = decode_wait_error(word)
    if decoded is not None:
        raise PeerTimeoutError(*decoded)
