"""Device state that layer calls share (a megakernel plan's rings, counters and symmetric
buffer; the backward megakernel's task tables and counters; cached e4m3 weights): kept in
order across CUDA streams, and bounded in number.

``StreamOrder``: a call that reuses the state on another stream than the previous call waits
for that call's work first (an event, no host sync), so two streams never run two launches on
one set of counters at once (the second's ``counters.zero_()`` would reset the first's waits).
One stream: nothing is waited for. While a CUDA graph is captured nothing is recorded or
waited for (an event from outside the capture cannot be waited on inside it; ordering the
replays is the caller's, as for any captured work).

``BoundedCache``: an LRU dict whose evicted values its caller retires (a plan's launches
waited for, its pending errors raised), for state keyed by the
number of tokens, which a run with variable batch sizes would otherwise grow without end.
State that a CUDA graph captured stays (its replays read it).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Hashable

import torch


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class StreamOrder:
    """The stream and event of the last launch on some shared state (module docstring), and
    ``captured``: whether a CUDA graph captured a launch on it (its replays read the state,
    so it must stay as it is)."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._event: torch.cuda.Event | None = None
        self.captured = False

    def enter(self, device: torch.device | str) -> None:
        """Before a launch on ``device``'s current stream: wait for the previous launch when
        it ran on another stream (nothing for a CPU device: tests' stand-ins)."""
        if torch.device(device).type != "cuda":
            return
        if capturing():
            self.captured = True
            return
        stream = torch.cuda.current_stream(device)
        if self._event is not None and self._stream != stream:
            stream.wait_event(self._event)

    def leave(self, device: torch.device | str) -> None:
        """After the launch: remember its stream and an event recorded there."""
        if torch.device(device).type != "cuda" or capturing():
            return
        stream = torch.cuda.current_stream(device)
        event = torch.cuda.Event()
        event.record(stream)
        self._stream, self._event = stream, event

    @contextlib.contextmanager
    def around(self, device: torch.device | str):
        """``enter`` before the block (its launches), ``leave`` after it."""
        self.enter(device)
        try:
            yield
        finally:
            self.leave(device)

    def wait(self) -> None:
        """Block the host until the last launch has finished (before the state is freed)."""
        if self._event is not None:
            self._event.synchronize()


def retire_all(evicted: list, retire: Callable[[Any], None]) -> None:
    """``retire`` every evicted value, even when one raises (its pending error): the first
    exception is raised after the others were retired too."""
    first = None
    for value in evicted:
        try:
            retire(value)
        except Exception as exc:  # noqa: BLE001  re-raised below
            first = first or exc
    if first is not None:
        raise first


class BoundedCache:
    """At most ``max_entries`` values, least recently used evicted first (``put`` returns them,
    for the caller to retire after releasing its lock), except values ``pinned(value)`` says
    to keep (state a captured CUDA graph's replays read: freeing it would have them read freed
    memory), which may take the cache past its bound; nothing is evicted while a graph is
    captured (retiring waits on the device, which breaks a capture). Not thread-safe: the
    caller holds its lock."""

    def __init__(self, max_entries: int, pinned: Callable[[Any], bool] | None = None):
        if max_entries < 1:
            raise ValueError(f"max_entries: expected >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._pinned = pinned or (lambda value: False)
        self._items: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

    def get(self, key: Hashable) -> Any:
        """The value (now the most recently used), or None."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> list:
        """Store ``value`` (the most recently used); returns the values evicted beyond the
        bound, oldest first."""
        self._items[key] = value
        self._items.move_to_end(key)
        if capturing():
            return []
        evictable = [k for k, v in self._items.items() if k != key and not self._pinned(v)]
        evicted = []
        while len(self._items) > self.max_entries and evictable:
            evicted.append(self._items.pop(evictable.pop(0)))
        return evicted

    def values(self) -> list:
        return list(self._items.values())

    def items(self) -> list:
        return list(self._items.items())

    def pop(self, key: Hashable) -> Any:
        """Remove ``key``'s value and return it (None if absent); the caller retires it."""
        return self._items.pop(key, None)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items
