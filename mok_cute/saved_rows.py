"""Where one rank of a group keeps the saved g | u rows of its training calls short of the worst
case (every peer's T * K rows, R x the average routing, since a rank cannot know before its launch
how many it will receive): a per-call budget (``MoKConfig.saved_rows_factor``: ``kept_saved_rows``
rows, ``packed_saved_slots``), which must cover that layer's own peak, or a ``SavedRowsPool``
(``MoKConfig(saved_rows_pool=pool)``): one device buffer shared by every call that names it (a
model's layers), sized for what all the calls of a step route to the rank together, hot layers
taking what cold ones leave.

A pool's call takes its rows on the device, no host sync: from the first whole row past what the
pool's earlier calls took (``used``, bytes), packed in schedule order (``packed_saved_slots``); a
row that finds no place is counted, never dropped silently (``SavedRowsError``, as for a budget).
The pool empties when a call takes rows while no earlier call's rows are held: each call's rows
are held as long as its lease lives (an empty tensor that the training call saves for its
backward beside its rows; autograd frees it once that backward has run, ``retain_graph`` keeps
it), so in a training loop every forward of a step finds the pool emptied by the previous step's
backward.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

# (no mok_cute imports: config checks MoKConfig.saved_rows_pool against this module's class)


def kept_saved_rows(num_peers: int, tokens: int, top_k: int, factor: float | None) -> int | None:
    """The g | u rows one rank of a group keeps with ``MoKConfig.saved_rows_factor`` =
    ``factor`` (a multiple of the average routing's T * K rows a rank, at most every peer's
    T * K); None without a factor (the schedule's capacity, by receive row)."""
    if factor is None:
        return None
    return max(1, min(num_peers * tokens * top_k, math.ceil(factor * tokens * top_k)))


def packed_saved_slots(valid: torch.Tensor, kept, first=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each schedule row's g | u row when a rank keeps ``kept`` rows from row ``first`` on (a
    ``SavedRowsPool``'s: int64 0-d device tensors): the routed rows packed in schedule order
    (padding rows skipped), -1 on padding and on a row past ``kept``, which the forward then
    does not save. Returns (row_slot int32 shaped as ``valid``, how many routed rows found no
    place: an int64 0-d tensor on the device, no host sync)."""
    row_slot, missing, _ = _packed(valid, kept, first)
    return row_slot, missing


def _packed(valid: torch.Tensor, kept, first=0):
    """``packed_saved_slots``, and how many rows it placed (an int64 0-d device tensor)."""
    order = torch.cumsum(valid.to(torch.int32), dim=-1, dtype=torch.int32) - 1
    row_slot = torch.where(valid & (order < kept), order + first, torch.full_like(order, -1))
    total = valid.sum(dtype=torch.int64)
    missing = (total - kept).clamp(min=0)
    return row_slot.to(torch.int32), missing, total - missing


class SavedRowsPool:
    """``nbytes`` of device memory (``device``: default the current CUDA device) for the saved
    g | u rows (2I bf16 a row) of the training calls over a group that name it. Every rank of
    the group gives its calls a pool of the same size (the calls' configurations are agreed)."""

    def __init__(self, nbytes: int, device: torch.device | str | int | None = None):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"SavedRowsPool: nbytes: expected an int >= 1, got {nbytes!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.nbytes = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.device = self.buffer.device
        self.used = torch.zeros((), dtype=torch.int64, device=self.device)  # bytes taken
        self._held = 0  # calls whose rows are held (their lease alive)
        self._lock = threading.RLock()  # a release may run from the garbage collector

    def __repr__(self) -> str:  # the same in every process: MoKConfig's agreement digests it
        return f"SavedRowsPool(nbytes={self.nbytes})"

    @property
    def held_calls(self) -> int:
        """How many calls' rows the pool holds now (their backward has not freed them)."""
        with self._lock:
            return self._held

    def rows(self, inter: int) -> int:
        """How many g | u rows of I = ``inter`` (4I bytes) the pool holds."""
        return self.nbytes // (4 * inter)

    def take(self, valid: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor, torch.Tensor]:
        """One call's rows: ``valid`` (bool, one entry a schedule row: routed, not padding) at
        I = ``inter`` -> (the pool as [rows, 2I] bf16; each schedule row's row in it, -1 on
        padding and where none was left; how many routed rows found no place, an int64 0-d
        device tensor; the lease: an empty tensor that holds this call's rows until it is
        freed, which the call keeps as long as its rows are needed). No host sync."""
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
            raise TypeError(f"valid: expected a bool tensor, got {type(valid).__name__}")
        if valid.device != self.device:
            raise ValueError(f"MoKConfig.saved_rows_pool: on {self.device}, the call's rows are "
                             f"on {valid.device}")
        row_bytes, rows = 4 * inter, self.rows(inter)
        if rows == 0:
            raise ValueError(f"MoKConfig.saved_rows_pool: {self.nbytes} bytes hold no g | u row "
                             f"of 2I = {2 * inter} bf16 ({row_bytes} bytes)")
        with self._lock:
            if self._held == 0:  # every earlier call's backward has run: its rows are free
                self.used.zero_()
            self._held += 1
        first = (self.used + row_bytes - 1) // row_bytes  # whole rows of this width
        left = (rows - first).clamp(min=0)
        row_slot, missing, placed = _packed(valid, left, first)
        self.used.copy_((first + placed) * row_bytes)
        preact = self.buffer[:rows * row_bytes].view(torch.bfloat16).view(rows, 2 * inter)
        # a tensor of its own (views of the rows do not keep one another's Python object)
        lease = torch.empty(0)
        weakref.finalize(lease, self._release)
        return preact, row_slot, missing, lease

    def _release(self) -> None:
        with self._lock:
            self._held -= 1


__all__ = ["SavedRowsPool", "kept_saved_rows", "packed_saved_slots"]
