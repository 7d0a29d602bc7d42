"""The `virtual` peer-memory backend: R ranks in one process, on one device.

Every rank's symmetric buffer is a slice of one allocation: rank ``r`` owns bytes
``[r * nbytes, (r + 1) * nbytes)`` after an aligned start. One megakernel launch hosts every
rank's CTAs (``rank = f(blockIdx)``), which makes co-residency of all ranks a property of the
launch, so the whole protocol (dispatch pulls, combine pushes, the unicast barrier) runs and is
tested on one GPU, up to R = 72.

Works for CPU tensors too (the addresses are then host addresses), which is how the layout
and table arithmetic is tested without a GPU.
"""

from __future__ import annotations

import torch

from ..config import describe
from .peers import PeerTable, SymmetricLayout

__all__ = ["VirtualPeers", "MAX_VIRTUAL_RANKS"]

MAX_VIRTUAL_RANKS = 72  # one GB300 NVL72 domain; the design's upper bound for the emulation


class VirtualPeers:
    """One allocation of ``num_ranks * layout.nbytes`` bytes; rank r's buffer is slice r.

    ``table(rank)`` is the `PeerTable` that rank sees: the same ``bases`` for every rank (one
    address space). ``bases_matrix()`` stacks the R tables into the [R, R] int64 tensor that a
    single virtual launch indexes by ``(rank, peer)``.
    """

    def __init__(self, num_ranks: int, layout: SymmetricLayout, device: torch.device | str | int | None = None):
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int):
            raise TypeError(f"num_ranks: expected an int, got {describe(num_ranks)}")
        if not 1 <= num_ranks <= MAX_VIRTUAL_RANKS:
            raise ValueError(f"num_ranks: expected an int in [1, {MAX_VIRTUAL_RANKS}], got {num_ranks}")
        if not isinstance(layout, SymmetricLayout):
            raise TypeError(f"layout: expected a SymmetricLayout, got {describe(layout)}")
        self.num_ranks = num_ranks
        self.layout = layout
        self.nbytes = layout.nbytes  # a multiple of layout.align, so every slice stays aligned
        # Over-allocate by one alignment unit and start at the first aligned byte: the CPU
        # allocator only promises 64 bytes, and the layout promises `align` on every base.
        align = layout.align
        self._storage = torch.zeros(num_ranks * self.nbytes + align, dtype=torch.uint8, device=device)
        start = (-self._storage.data_ptr()) % align
        self.buffer = self._storage[start:start + num_ranks * self.nbytes]
        base = self.buffer.data_ptr()
        self.addresses = tuple(base + r * self.nbytes for r in range(num_ranks))
        self.bases = torch.tensor(self.addresses, dtype=torch.int64, device=self.buffer.device)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def _check_rank(self, rank: object, name: str = "rank") -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{name}: expected an int, got {describe(rank)}")
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"{name}: expected an int in [0, {self.num_ranks}), got {rank}")
        return rank

    def rank_buffer(self, rank: int) -> torch.Tensor:
        """uint8 [nbytes] view of rank ``rank``'s whole buffer."""
        r = self._check_rank(rank)
        return self.buffer[r * self.nbytes:(r + 1) * self.nbytes]

    def view(self, rank: int, name: str) -> torch.Tensor:
        """Field ``name`` of rank ``rank``'s buffer, with the field's shape and dtype."""
        return self.layout.view(self.rank_buffer(rank), name)

    def table(self, rank: int) -> PeerTable:
        r = self._check_rank(rank)
        return PeerTable(
            num_ranks=self.num_ranks, rank=r, bases=self.bases, nbytes=self.nbytes, layout=self.layout,
            addresses=self.addresses, local=self.rank_buffer(r), backend="virtual",
        )

    def tables(self) -> list[PeerTable]:
        return [self.table(r) for r in range(self.num_ranks)]

    def bases_matrix(self) -> torch.Tensor:
        """int64 [R, R] on the device: row ``rank`` is that rank's ``bases`` (all rows equal here,
        since every virtual rank shares one address space; a kernel indexes ``[rank, peer]``)."""
        return self.bases.unsqueeze(0).expand(self.num_ranks, self.num_ranks).contiguous()

    def zero_(self) -> VirtualPeers:
        self.buffer.zero_()
        return self

    def close(self) -> None:
        """Drop the allocation (views already taken keep it alive, as torch views do)."""
        self._storage = self.buffer = None  # type: ignore[assignment]

    def __enter__(self) -> VirtualPeers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VirtualPeers(num_ranks={self.num_ranks}, nbytes={self.nbytes}, device={self.bases.device})"
