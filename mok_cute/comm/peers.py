"""Symmetric peer buffers: the layout inside each rank's buffer and the table of peer bases.

Every rank of an expert-parallel group owns one *symmetric buffer*: the same size and the same
named sub-buffers ("fields") at the same byte offsets on every rank. A rank reaches a peer's
field at ``bases[peer] + field.offset``, so the megakernel needs only one Int64 table of base
addresses (``PeerTable.bases``) plus the static offsets of `SymmetricLayout`. Every backend
(`virtual`, `ipc`) produces a `PeerTable`; this module holds the one copy of the layout
arithmetic.

Default layout of the MoE layer (`moe_symmetric_layout`), per rank::

    x              [T_max, H]      bf16   this rank's tokens; peers pull (dispatch) from it
    combine        [T_max*K, H]    bf16   peers push expert output rows at slot token*K + k
    barrier_flags  [2R]            int32  unicast group barrier, see `BarrierSpec`

Each field starts at a multiple of ``align`` (128 bytes: one L2 line, and 16-byte vector and
TMA alignment are implied), and the buffer size is a multiple of ``align`` too, so buffers
laid back to back (the virtual backend) stay aligned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import torch

from ..config import describe
from ..constants import SLOT_ROW_BYTES

__all__ = [
    "BARRIER_FIELD",
    "Field",
    "SymmetricLayout",
    "moe_symmetric_layout",
    "BarrierSpec",
    "PeerTable",
]

BARRIER_FIELD = "barrier_flags"

_DTYPES = (
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Field:
    """One named sub-buffer at a fixed byte offset inside every rank's buffer."""

    name: str
    offset: int  # bytes from the start of the rank's buffer (a multiple of the layout's align)
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def end(self) -> int:
        """First byte past the field."""
        return self.offset + self.nbytes


@dataclasses.dataclass(frozen=True)
class SymmetricLayout:
    """Named fields at fixed, aligned byte offsets; identical on every rank.

    Build it with `SymmetricLayout.build`; ``nbytes`` is the size of one rank's buffer (a
    multiple of ``align``).
    """

    fields: tuple[Field, ...]
    nbytes: int
    align: int

    @classmethod
    def build(
        cls,
        fields: Iterable[tuple[str, Sequence[int], torch.dtype]],
        align: int = 128,
    ) -> SymmetricLayout:
        """Lay ``(name, shape, dtype)`` fields out in the given order, each at the next multiple
        of ``align`` bytes. ``align`` is a power of two >= 16 (16-byte vector copies)."""
        if not _is_int(align):
            raise TypeError(f"align: expected an int, got {describe(align)}")
        if align < 16 or align & (align - 1):
            raise ValueError(f"align: expected a power of two >= 16, got {align}")
        if isinstance(fields, (str, bytes)) or not isinstance(fields, Iterable):
            raise TypeError(
                f"fields: expected a sequence of (name, shape, dtype) tuples, got {describe(fields)}"
            )
        laid_out: list[Field] = []
        seen: set[str] = set()
        offset = 0
        for i, entry in enumerate(fields):
            if not isinstance(entry, (tuple, list)) or len(entry) != 3:
                raise TypeError(f"fields[{i}]: expected a (name, shape, dtype) tuple, got {describe(entry)}")
            name, shape, dtype = entry
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"fields[{i}].name: expected an identifier string, got {describe(name)}")
            if name in seen:
                raise ValueError(f"fields[{i}].name: duplicate field name {name!r}")
            seen.add(name)
            if _is_int(shape):
                shape = (shape,)
            if not isinstance(shape, (tuple, list, torch.Size)) or not all(_is_int(s) for s in shape):
                raise TypeError(f"fields[{i}].shape ({name}): expected a tuple of ints, got {describe(shape)}")
            if any(s < 0 for s in shape):
                raise ValueError(f"fields[{i}].shape ({name}): expected extents >= 0, got {tuple(shape)}")
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"fields[{i}].dtype ({name}): expected a torch.dtype, got {describe(dtype)}")
            if dtype not in _DTYPES:
                raise ValueError(
                    f"fields[{i}].dtype ({name}): expected one of {', '.join(str(d) for d in _DTYPES)}, got {dtype}"
                )
            field = Field(name=name, offset=_round_up(offset, align), shape=tuple(int(s) for s in shape), dtype=dtype)
            laid_out.append(field)
            offset = field.end
        if not laid_out:
            raise ValueError("fields: expected at least one field, got none")
        return cls(fields=tuple(laid_out), nbytes=max(_round_up(offset, align), align), align=align)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def __contains__(self, name: object) -> bool:
        return any(f.name == name for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise ValueError(f"name: expected one of the layout's fields {list(self.names)}, got {name!r}")

    def offset(self, name: str) -> int:
        return self.field(name).offset

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """The field ``name`` inside ``buffer``, a uint8 tensor holding one rank's buffer
        (at least ``nbytes`` bytes, starting at the rank's base)."""
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise TypeError(f"buffer: expected a 1-D uint8 tensor, got {describe(buffer)}")
        if buffer.numel() < self.nbytes:
            raise ValueError(f"buffer: expected at least {self.nbytes} bytes, got {buffer.numel()}")
        f = self.field(name)
        return buffer[f.offset:f.end].view(f.dtype).view(f.shape)

    def describe(self) -> str:
        """One line per field: name, byte range, shape, dtype."""
        lines = [f"SymmetricLayout: {self.nbytes} bytes per rank, align {self.align}"]
        for f in self.fields:
            lines.append(f"  {f.name:<16} [{f.offset:>12}, {f.end:>12})  {list(f.shape)} {f.dtype}")
        return "\n".join(lines)


def moe_symmetric_layout(
    max_tokens: int,
    hidden: int,
    top_k: int,
    num_ranks: int,
    *,
    extra_fields: Iterable[tuple[str, Sequence[int], torch.dtype]] = (),
    align: int = 128,
    training: bool = False,
) -> SymmetricLayout:
    """The MoE layer's symmetric buffer (module docstring): ``x``, ``combine`` and
    ``barrier_flags``, then ``extra_fields`` (e.g. counters the kernel publishes to peers).
    ``training`` adds what the backward over the group (``mok_cute.group_backward``) reads of
    the source ranks and pushes back to them: ``d_out`` [T, H] bf16, ``router_weights`` and
    ``d_topk_partials`` [T * K, 4] fp32 (one value per slot, padded to a 16-byte row); its dx
    rows land in ``combine``."""
    for name, value in (("max_tokens", max_tokens), ("hidden", hidden), ("top_k", top_k), ("num_ranks", num_ranks)):
        if not _is_int(value):
            raise TypeError(f"{name}: expected an int, got {describe(value)}")
        if value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value}")
    fields = [
        ("x", (max_tokens, hidden), torch.bfloat16),
        ("combine", (max_tokens * top_k, hidden), torch.bfloat16),
        (BARRIER_FIELD, (2 * num_ranks,), torch.int32),
    ]
    if training:
        fields += [("d_out", (max_tokens, hidden), torch.bfloat16),
                   ("router_weights", (max_tokens * top_k, SLOT_ROW_BYTES // 4), torch.float32),
                   ("d_topk_partials", (max_tokens * top_k, SLOT_ROW_BYTES // 4), torch.float32)]
    fields.extend(extra_fields)
    return SymmetricLayout.build(fields, align=align)


@dataclasses.dataclass(frozen=True)
class BarrierSpec:
    """Host-side description of the unicast group barrier (no NVLink multicast).

    Each rank's buffer holds ``num_ranks`` int32 flags at byte ``offset`` (the MoE layout adds
    ``num_ranks`` sticky failed epochs after them, ``constants``); flag ``s`` of rank ``p`` is
    written only by rank ``s``. Barrier number ``epoch`` (int32, >= 1, increasing by one
    per barrier; the buffers start zeroed and are never reset, so no reset can race a fast peer's
    next write):

    1. rank ``s`` makes its earlier writes visible (release fence, system scope), then for every
       rank ``p`` (itself included) stores ``epoch`` with release semantics, system scope, to
       ``flag_address(table, p, s)``;
    2. rank ``s`` spins, acquire loads, system scope, on its own flags ``q = 0..R-1`` until each
       is ``>= epoch`` (``>=``, not ``==``: a peer that has passed this barrier may already have
       written ``epoch + 1``), with a timeout that names ``q``.

    The device side is the megakernel's; this class only says which words to use.
    """

    field: str
    offset: int  # byte offset of flag 0 in every rank's buffer
    num_ranks: int

    @classmethod
    def from_layout(cls, layout: SymmetricLayout, num_ranks: int, field: str = BARRIER_FIELD) -> BarrierSpec:
        if not isinstance(layout, SymmetricLayout):
            raise TypeError(f"layout: expected a SymmetricLayout, got {describe(layout)}")
        if not _is_int(num_ranks) or num_ranks < 1:
            raise ValueError(f"num_ranks: expected an int >= 1, got {describe(num_ranks)}")
        f = layout.field(field)
        if f.dtype != torch.int32 or f.numel < num_ranks:
            raise ValueError(
                f"field: expected {field!r} to be int32 with at least {num_ranks} elements, "
                f"got {f.dtype} {list(f.shape)}"
            )
        return cls(field=field, offset=f.offset, num_ranks=num_ranks)

    def word_offset(self, src_rank: int) -> int:
        """Byte offset, in every rank's buffer, of the flag that ``src_rank`` writes."""
        if not _is_int(src_rank) or not 0 <= src_rank < self.num_ranks:
            raise ValueError(f"src_rank: expected an int in [0, {self.num_ranks}), got {describe(src_rank)}")
        return self.offset + 4 * src_rank

    def flag_address(self, table: PeerTable, dst_rank: int, src_rank: int) -> int:
        """Address (in the table's address space) of the flag ``src_rank`` writes on ``dst_rank``."""
        if not _is_int(dst_rank) or not 0 <= dst_rank < table.num_ranks:
            raise ValueError(f"dst_rank: expected an int in [0, {table.num_ranks}), got {describe(dst_rank)}")
        return table.addresses[dst_rank] + self.word_offset(src_rank)


@dataclasses.dataclass
class PeerTable:
    """What the megakernel needs to reach every rank's symmetric buffer.

    num_ranks  group size R
    rank       this rank
    bases      int64 [R] on the local device: base address of rank r's buffer as mapped in this
               process (the kernel reads it as an Int64 table)
    nbytes     size of each rank's buffer (>= layout.nbytes; backends may round it up)
    layout     the fields inside each buffer
    addresses  host copy of ``bases`` (filled from ``bases`` when not given)
    local      uint8 [nbytes] tensor over this rank's own buffer (for `view`), or None
    backend    which backend made it ("virtual", "ipc:posix_fd", ...)
    """

    num_ranks: int
    rank: int
    bases: torch.Tensor
    nbytes: int
    layout: SymmetricLayout
    addresses: tuple[int, ...] = ()
    local: torch.Tensor | None = None
    backend: str = ""

    def __post_init__(self) -> None:
        if not self.addresses and isinstance(self.bases, torch.Tensor) and self.bases.dim() == 1:
            self.addresses = tuple(int(a) for a in self.bases.tolist())
        else:
            self.addresses = tuple(self.addresses)

    @property
    def device(self) -> torch.device:
        return self.bases.device

    def validate(self) -> PeerTable:
        """Check every field; raise TypeError/ValueError naming the first bad one. Returns self."""
        if not _is_int(self.num_ranks) or self.num_ranks < 1:
            raise ValueError(f"PeerTable.num_ranks: expected an int >= 1, got {describe(self.num_ranks)}")
        R = self.num_ranks
        if not _is_int(self.rank) or not 0 <= self.rank < R:
            raise ValueError(f"PeerTable.rank: expected an int in [0, {R}), got {describe(self.rank)}")
        if not isinstance(self.layout, SymmetricLayout):
            raise TypeError(f"PeerTable.layout: expected a SymmetricLayout, got {describe(self.layout)}")
        align = self.layout.align
        if not _is_int(self.nbytes) or self.nbytes < self.layout.nbytes or self.nbytes % align:
            raise ValueError(
                f"PeerTable.nbytes: expected an int >= layout.nbytes ({self.layout.nbytes}) and a "
                f"multiple of {align}, got {describe(self.nbytes)}"
            )
        b = self.bases
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"PeerTable.bases: expected a torch.Tensor, got {describe(b)}")
        if b.dtype != torch.int64 or tuple(b.shape) != (R,) or not b.is_contiguous():
            raise ValueError(f"PeerTable.bases: expected a contiguous int64 tensor of shape [{R}], got {describe(b)}")
        if len(self.addresses) != R:
            raise ValueError(f"PeerTable.addresses: expected {R} addresses, got {len(self.addresses)}")
        on_device = tuple(int(a) for a in b.tolist())
        if on_device != self.addresses:
            raise ValueError(f"PeerTable.bases: expected the values of addresses {self.addresses}, got {on_device}")
        for r, a in enumerate(self.addresses):
            if a <= 0 or a % align:
                raise ValueError(f"PeerTable.bases[{r}]: expected a non-zero multiple of {align}, got {a:#x}")
        spans = sorted((a, r) for r, a in enumerate(self.addresses))
        for (a0, r0), (a1, r1) in zip(spans, spans[1:]):
            if a1 < a0 + self.nbytes:
                raise ValueError(
                    f"PeerTable.bases: the buffers of ranks {r0} ({a0:#x}) and {r1} ({a1:#x}) overlap "
                    f"(each is {self.nbytes} bytes)"
                )
        if self.local is not None:
            loc = self.local
            if not isinstance(loc, torch.Tensor) or loc.dtype != torch.uint8 or loc.dim() != 1:
                raise TypeError(f"PeerTable.local: expected a 1-D uint8 tensor, got {describe(loc)}")
            if loc.numel() < self.layout.nbytes:
                raise ValueError(f"PeerTable.local: expected at least {self.layout.nbytes} bytes, got {loc.numel()}")
            if loc.data_ptr() != self.addresses[self.rank]:
                raise ValueError(
                    f"PeerTable.local: expected to start at bases[{self.rank}] = {self.addresses[self.rank]:#x}, "
                    f"got {loc.data_ptr():#x}"
                )
            if loc.device != b.device:
                raise ValueError(f"PeerTable.local: expected device {b.device} (that of bases), got {loc.device}")
        return self

    def field(self, name: str) -> Field:
        return self.layout.field(name)

    def address(self, peer: int, name: str, byte_offset: int = 0) -> int:
        """Address of byte ``byte_offset`` of field ``name`` in ``peer``'s buffer."""
        if not _is_int(peer) or not 0 <= peer < self.num_ranks:
            raise ValueError(f"peer: expected an int in [0, {self.num_ranks}), got {describe(peer)}")
        f = self.layout.field(name)
        if not _is_int(byte_offset) or not 0 <= byte_offset <= f.nbytes:
            raise ValueError(f"byte_offset: expected an int in [0, {f.nbytes}] for field {name!r}, got {describe(byte_offset)}")
        return self.addresses[peer] + f.offset + byte_offset

    def view(self, name: str) -> torch.Tensor:
        """Torch view (shape and dtype of the field) of field ``name`` in this rank's own buffer."""
        if self.local is None:
            raise ValueError(f"PeerTable.local: this table ({self.backend or 'no backend'}) has no local buffer tensor")
        return self.layout.view(self.local, name)

    def barrier(self, field: str = BARRIER_FIELD) -> BarrierSpec:
        return BarrierSpec.from_layout(self.layout, self.num_ranks, field)
