"""The ranks of an expert-parallel group agree on each ``moe_forward(group=...)`` call before
any of them launches (issue 30, item 3).

Every rank brings a `CallHeader`: T, H, I, E_loc, K, Is, the dtypes of x, the expert weights,
topk_weights and topk_idx, the device type, the path it would take, its `MoKConfig` (a CRC32
per field) and, where the ids were read before the exchange, their span; or the error its own
checks raised. The headers are exchanged and every rank runs the same comparison on the same
rows, so any disagreement raises the same error on every rank, naming the ranks and the field,
before anyone enters a collective or a launch. T may differ (it is a batch size): every rank
learns every rank's T (the megakernel sizes its buffers by the largest). A peer that never
arrives raises `AgreementTimeout` naming it after ``MoKConfig.group_timeout_s`` instead of
leaving the others in a collective forever. `agree_on_launch` is the second, optional exchange
of the IPC megakernel: its id check's verdict, read after the launch (no host sync before it).

Transport. Ranks on one host (the IPC megakernel's requirement, and the CPU tests) meet in a
small shared-memory file under /dev/shm, set up once per group on its first call: the group's
first rank creates it (mode 0600, a random name), one ``all_gather_object`` hands its name and
every rank's host identity around, every rank maps it, a second confirms, and the file is
unlinked (nothing is left behind after a crash; the mapping lives on). That setup is a
collective of the group, bounded by the group's own timeout; every later exchange is host
memory only: no collective, no GPU synchronisation. Ranks on several hosts (possible only on
the reference path, whose all_to_all crosses hosts) exchange through one ``all_gather`` of the
group instead, bounded by the group's timeout, not ``group_timeout_s``.

Shared-memory protocol, exchange n (counted per group, the same on every rank): a rank writes
its slot ``n % 2`` in one store of (n, a flag, the payload, a CRC32 over the three), then reads
every peer's slot ``n % 2`` until it holds n with a matching CRC: a read torn by a concurrent
write, or stale on a weakly ordered CPU (Python has no fences), fails the CRC and is read
again. Two slots per rank suffice: a peer writes n + 1 only after reading every slot n, and
n + 2 only after every rank wrote n + 1, i.e. finished reading n. A rank that gives up rewrites
its slot with the GAVE_UP flag, so a peer arriving late raises too instead of launching alone
(a peer that read the slot in the microseconds before the rewrite still proceeds: a deadline
cannot be agreed without another exchange). A waiting rank polls 200 times, yielding its CPU
between polls, then naps, up to 1 ms at a time, until the deadline.

Cost, two CPU processes calling back to back (``tests/test_agreement.py::test_exchange_cost``,
medians of 3000 calls): 2.7-4 µs an exchange, 6.6-10.5 µs an `agree_on_call` (packing the
header, the exchange, the comparison) on a 2-core machine idle to loaded (load average ~6);
a waiting rank yields its CPU on every poll, so a peer sharing it is not starved. A rank that
arrives first waits for the others, as it would in any collective. With no group
(one GPU) nothing is exchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import secrets
import struct
import threading
import time
import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["AgreementTimeout", "CallHeader", "GroupAgreement", "agreement_for", "agree_on_call",
           "agree_on_launch", "call_header", "ready_for_collective", "timeout_of",
           "until_collective"]

WHO = "moe_forward(group=...)"


class AgreementTimeout(TimeoutError):
    """A rank of the group did not reach the same exchange within ``MoKConfig.group_timeout_s``
    (its process died, hangs, or skipped a call), or a peer gave up waiting for this rank."""


# ------------------------------------------------------------------------------ the exchange

_SLOT_HEAD = struct.Struct("<qqI")  # exchange number, flag, CRC32 of (number, flag, payload)
PAYLOAD_BYTES = 488
_SLOT_USED = _SLOT_HEAD.size + PAYLOAD_BYTES  # 508
SLOT_BYTES = 512  # a rank's slot, cache-line aligned
ARRIVED, GAVE_UP = 1, 2
_SPINS = 200  # polls (each yields the CPU) before the first nap: ~0.2-1 ms
_MAX_NAP_S = 1e-3


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class GroupAgreement:
    """One group's exchange of fixed-size payloads (`exchange`); built by `agreement_for`, once
    per group (a collective: every rank of the group builds it in the same call)."""

    def __init__(self, group: Any, *, shared_memory: bool = True):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.exchanges = 0
        self._lock = threading.Lock()
        self._mm: mmap.mmap | None = None
        self.stretch = _Stretch()  # `until_collective`'s state
        if self.world > 1:
            self._mm = self._map_shared(shared_memory)
        self.transport = "shared memory" if self._mm is not None else "all_gather"

    # ---------------------------------------------------------------- setup (collective)
    def _map_shared(self, wanted: bool) -> mmap.mmap | None:
        from .ipc import _host_identity

        size = self.world * 2 * SLOT_BYTES
        path = None
        if self.rank == 0 and wanted:
            path = f"/dev/shm/mok_cute-agree-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, size)  # zeros: every slot at exchange 0
                finally:
                    os.close(fd)
            except OSError:
                path = None
        offers: list[Any] = [None] * self.world
        dist.all_gather_object(offers, (_host_identity(), path), group=self.group)
        path = offers[0][1]
        mm = None
        if path is not None and len({ident for ident, _ in offers}) == 1:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
            except OSError:
                mm = None
        mapped: list[Any] = [None] * self.world
        dist.all_gather_object(mapped, mm is not None, group=self.group)
        if self.rank == 0 and path is not None:
            os.unlink(path)
        if not all(mapped):
            if mm is not None:
                mm.close()
            return None
        return mm

    # ---------------------------------------------------------------- one exchange
    def exchange(self, payload: bytes, timeout_s: float) -> list[bytes]:
        """Every rank's payload (``PAYLOAD_BYTES`` at most, zero-padded), in rank order. Raises
        `AgreementTimeout` naming the peers that did not arrive within ``timeout_s``."""
        if len(payload) > PAYLOAD_BYTES:
            raise ValueError(f"payload: expected at most {PAYLOAD_BYTES} bytes, got {len(payload)}")
        payload = payload.ljust(PAYLOAD_BYTES, b"\0")
        with self._lock:
            self.exchanges += 1
            if self.world == 1:
                return [payload]
            if self._mm is None:
                return self._all_gather(payload)
            return self._meet(self.exchanges, payload, timeout_s)

    def _all_gather(self, payload: bytes) -> list[bytes]:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend(self.group) == "nccl" else torch.device("cpu"))
        mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        return [bytes(row.tolist()) for row in rows]

    def _offset(self, rank: int, n: int) -> int:
        return (2 * rank + n % 2) * SLOT_BYTES

    def _write(self, n: int, flag: int, payload: bytes) -> None:
        head = struct.pack("<qq", n, flag)
        crc = zlib.crc32(payload, zlib.crc32(head))
        off = self._offset(self.rank, n)
        self._mm[off:off + _SLOT_USED] = head + struct.pack("<I", crc) + payload

    def _read(self, peer: int, n: int) -> tuple[int, bytes] | None:
        off = self._offset(peer, n)
        raw = self._mm[off:off + _SLOT_USED]  # one copy: the checks below see one snapshot
        seq, flag, crc = _SLOT_HEAD.unpack_from(raw)
        if seq != n or zlib.crc32(raw[_SLOT_HEAD.size:], zlib.crc32(raw[:16])) != crc:
            return None
        return flag, raw[_SLOT_HEAD.size:]

    def _meet(self, n: int, payload: bytes, timeout_s: float) -> list[bytes]:
        start = time.monotonic()
        self._write(n, ARRIVED, payload)
        rows: list[bytes | None] = [None] * self.world
        rows[self.rank] = payload
        waiting = [p for p in range(self.world) if p != self.rank]
        met = False
        try:
            polls = 0
            while True:
                still = []
                for p in waiting:
                    got = self._read(p, n)
                    if got is None:
                        still.append(p)
                    elif got[0] == GAVE_UP:
                        raise AgreementTimeout(
                            f"{WHO}: rank {p} gave up waiting for its peers at exchange {n} of "
                            f"this group before rank {self.rank} arrived (after its "
                            f"group_timeout_s); this call is abandoned on every rank")
                    else:
                        rows[p] = got[1]
                waiting = still
                if not waiting:
                    met = True
                    return rows  # type: ignore[return-value]
                polls += 1
                if polls <= _SPINS:
                    os.sched_yield()  # a peer sharing this CPU runs now, not at the next tick
                    continue
                if time.monotonic() - start > timeout_s:
                    raise AgreementTimeout(self._absent(n, waiting, timeout_s))
                time.sleep(min(_MAX_NAP_S, 1e-5 * (polls - _SPINS)))
        finally:
            if not met:
                self._write(n, GAVE_UP, payload)

    def _absent(self, n: int, missing: list[int], timeout_s: float) -> str:
        lasts = []
        for p in missing:
            last = max(_SLOT_HEAD.unpack_from(self._mm, self._offset(p, m))[0] for m in (0, 1))
            lasts.append(f"rank {p} is at exchange {last}")
        return (f"{WHO}: {_ranks(missing)} did not reach exchange {n} of this group within "
                f"{timeout_s:g} s ({', '.join(lasts)}): a dead or hung process, or a rank that "
                f"skipped a call (MoKConfig.group_timeout_s)")


_AGREEMENTS: dict[Any, GroupAgreement] = {}
_AGREEMENTS_LOCK = threading.Lock()


def agreement_for(group: Any) -> GroupAgreement:
    """The group's `GroupAgreement`, set up on first use (a collective of the group)."""
    with _AGREEMENTS_LOCK:
        agreement = _AGREEMENTS.get(group)
        if agreement is None:
            agreement = _AGREEMENTS[group] = GroupAgreement(group)
    return agreement


# ------------------------------------------------------------------------------ the headers

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
_DEVICE_TYPES = ("cpu", "cuda")
_PATHS = ("reference", "kernel", "megakernel", "reference (training)", "megakernel (training)")
OK, REJECTED = 0, 1
IDS_UNREAD, IDS_READ = 0, 1


@dataclasses.dataclass(frozen=True)
class CallHeader:
    """What one rank brings to a ``moe_forward(group=...)`` call. ``ids_span``: (min, max) of
    its ids when they were read before the exchange (the reference path, ``check_ids``), else
    None (not read, or no ids)."""

    tokens: int
    hidden: int
    intermediate: int
    local_experts: int
    top_k: int
    shared_intermediate: int
    x_dtype: torch.dtype
    weight_dtype: torch.dtype
    routing_dtype: torch.dtype
    id_dtype: torch.dtype
    device_type: str
    path: str
    config: Any  # MoKConfig
    ids_span: tuple[int, int] | None = None


def timeout_of(config: Any) -> float:
    """``config.group_timeout_s``, or the default's when ``config`` is not a MoKConfig (the
    call's own check then raises, and that error is what the exchange carries)."""
    from ..config import MoKConfig, resolve_config

    return (config if isinstance(config, MoKConfig) else resolve_config(None)).group_timeout_s


def call_header(dims: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w_gate: torch.Tensor, path: str, config: Any,
                ids_span: tuple[int, int] | None = None) -> CallHeader:
    """The header of a checked call (``dims``: `config.check_moe_inputs`'s result)."""
    return CallHeader(dims.tokens, dims.hidden, dims.intermediate, dims.local_experts, dims.top_k,
                      dims.shared_intermediate, x.dtype, w_gate.dtype, topk_weights.dtype,
                      topk_idx.dtype, x.device.type, path, config, ids_span)


# (field, how a message names it): every rank must bring the same value
_AGREED = (
    ("hidden", "H (x.shape[1])"),
    ("intermediate", "I (w_gate.shape[1])"),
    ("local_experts", "E_loc (w_gate.shape[0])"),
    ("top_k", "K (topk_idx.shape[1])"),
    ("shared_intermediate", "Is (the shared expert's intermediate size, 0 without one)"),
    ("x_dtype", "x.dtype"),
    ("weight_dtype", "the expert weights' dtype"),
    ("routing_dtype", "topk_weights.dtype"),
    ("id_dtype", "topk_idx.dtype"),
    ("device_type", "the device type"),
    ("path", "the path (each rank picks it from its own device and install, and trains when an "
             "input requires grad: mok_cute.forward_path())"),
)


_LOCAL_EXPERTS = [f for f, _ in _AGREED].index("local_experts")


def _code(value: object, table: Sequence[object]) -> int:
    return table.index(value) if value in table else -1 - zlib.crc32(str(value).encode())


def _shown(code: int, table: Sequence[object]) -> str:
    return str(table[code]) if 0 <= code < len(table) else f"another value (code {code})"


_TABLES = {"x_dtype": _DTYPES, "weight_dtype": _DTYPES, "routing_dtype": _DTYPES,
           "id_dtype": _DTYPES, "device_type": _DEVICE_TYPES, "path": _PATHS}

def _config_digests(config: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(field names, CRC32 of each field's repr) of a MoKConfig: the repr of a frozen dataclass
    is the same in every process, where ``hash`` is salted per process."""
    names = tuple(f.name for f in dataclasses.fields(config))
    return names, tuple(zlib.crc32(repr(getattr(config, name)).encode()) for name in names)


_HEAD = struct.Struct("<qqqqq")  # status, ids state, tokens, ids min, ids max
_MESSAGE_BYTES = 200
_MAX_AGREED = (PAYLOAD_BYTES - _HEAD.size - _MESSAGE_BYTES) // 8


_NO_MESSAGE = bytes(_MESSAGE_BYTES)
_AGREED_CACHE: dict[tuple, tuple[Any, tuple[str, ...], bytes]] = {}


def _agreed_bytes(header: CallHeader) -> tuple[tuple[str, ...], bytes]:
    """(MoKConfig field names, the packed fields every rank must agree on), cached per shape,
    dtypes, path and config object: a layer calls with a handful of them."""
    key = (id(header.config), header.hidden, header.intermediate, header.local_experts,
           header.top_k, header.shared_intermediate, header.x_dtype, header.weight_dtype,
           header.routing_dtype, header.id_dtype, header.device_type, header.path)
    entry = _AGREED_CACHE.get(key)
    if entry is None or entry[0] is not header.config:
        if len(_AGREED_CACHE) > 256:
            _AGREED_CACHE.clear()
        names, crcs = _config_digests(header.config)
        values = [getattr(header, f) if f not in _TABLES else _code(getattr(header, f), _TABLES[f])
                  for f, _ in _AGREED] + list(crcs)
        if len(values) > _MAX_AGREED:
            raise RuntimeError(f"agreement header: {len(values)} fields, room for {_MAX_AGREED}")
        entry = _AGREED_CACHE[key] = (header.config, names,
                                      struct.pack(f"<{len(values)}q", *values))
    return entry[1], entry[2]


def _payload(status: int, tokens: int = 0, span: tuple[int, int] | None = None,
             agreed: bytes = b"", message: str = "") -> bytes:
    lo, hi = span if span is not None else (0, 0)
    head = _HEAD.pack(status, IDS_READ if span is not None else IDS_UNREAD, tokens, lo, hi)
    text = message.encode("utf-8", "replace")[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    return head + (text if message else _NO_MESSAGE) + agreed


class _Row:
    """One rank's decoded payload."""

    def __init__(self, raw: bytes):
        self.status, self.ids_state, self.tokens, self.lo, self.hi = _HEAD.unpack_from(raw)
        end = _HEAD.size + _MESSAGE_BYTES
        self.message = raw[_HEAD.size:end].rstrip(b"\0").decode("utf-8", "replace")
        self.agreed = raw[end:]


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _raise_rejections(rows: list[_Row], own_error: BaseException | None, what: str) -> None:
    rejected = [r for r, row in enumerate(rows) if row.status == REJECTED]
    if not rejected:
        return
    if own_error is not None:
        raise own_error
    detail = "; ".join(f"rank {r}: {rows[r].message}" for r in rejected)
    raise RuntimeError(f"{WHO}: {_ranks(rejected)} {what} ({detail}); every rank of the group "
                       f"raises")


def _disagreement(label: str, values: list[int], table: Sequence[object] | None) -> str:
    groups: dict[int, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))  # the odd ones first
    if table is None and label.startswith("MoKConfig."):
        parts = [f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} one value" if i == 0 else
                 f"{_ranks(rs)} another" for i, (_, rs) in enumerate(ordered)]
        return (f"{WHO}: the ranks disagree on {label}: {'; '.join(parts)} (every rank must pass "
                f"the same MoKConfig)")
    shown = (lambda v: _shown(v, table)) if table is not None else str
    parts = [f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} {shown(v)}" for v, rs in ordered]
    return f"{WHO}: the ranks disagree on {label}: {'; '.join(parts)}"


def _ids_error(rows: list[_Row], num_experts: int, name: str = "topk_idx") -> None:
    bad = [(r, row) for r, row in enumerate(rows)
           if row.ids_state == IDS_READ and (row.lo < 0 or row.hi >= num_experts)]
    if bad:
        detail = "; ".join(f"id {row.lo if row.lo < 0 else row.hi} on rank {r} (its ids span "
                           f"[{row.lo}, {row.hi}])" for r, row in bad)
        raise ValueError(f"{name}: expected global expert ids in [0, {num_experts}), got {detail}")


def agree_on_call(group: Any, header: CallHeader | BaseException, timeout_s: float) -> list[int]:
    """Exchange this rank's header (or the error its own checks raised) with every rank of
    ``group``; return every rank's T. Raises on every rank alike: this rank's own error where it
    had one, RuntimeError naming the ranks that rejected their call, ValueError naming the
    field and the ranks that disagree (shapes, dtypes, device type, path, each MoKConfig field),
    or ValueError naming the ranks whose ids are out of range; AgreementTimeout naming an
    absent peer."""
    agreement = agreement_for(group)
    if isinstance(header, BaseException):
        payload = _payload(REJECTED, message=_error_text(header))
        own_error: BaseException | None = header
        agreed_names: tuple[str, ...] = ()
    else:
        agreed_names, agreed = _agreed_bytes(header)
        payload = _payload(OK, header.tokens, header.ids_span, agreed)
        own_error = None
    rows = [_Row(raw) for raw in agreement.exchange(payload, timeout_s)]
    _raise_rejections(rows, own_error, "rejected the call")
    if any(row.agreed != rows[0].agreed for row in rows):
        labels = [label for _, label in _AGREED] + [f"MoKConfig.{n}" for n in agreed_names]
        tables = [_TABLES.get(f) for f, _ in _AGREED] + [None] * len(agreed_names)
        count = len(rows[0].agreed) // 8
        columns = list(zip(*(struct.unpack(f"<{count}q", row.agreed) for row in rows)))
        for label, table, values in zip(labels, tables, columns):
            if len(set(values)) > 1:
                raise ValueError(_disagreement(label, list(values), table))
        raise ValueError(f"{WHO}: the ranks' headers differ (another version of mok_cute?)")
    local_experts = struct.unpack_from("<q", rows[0].agreed, 8 * _LOCAL_EXPERTS)[0]
    _ids_error(rows, len(rows) * local_experts)
    return [row.tokens for row in rows]


def agree_on_launch(group: Any, outcome: tuple[int, int] | None | BaseException,
                    num_experts: int, timeout_s: float) -> None:
    """After a launch whose id check is read late (the IPC megakernel with ``check_ids``):
    exchange the check's span (None: no ids), or the error this rank's launch raised. Raises on
    every rank alike: this rank's own error, RuntimeError naming the ranks whose launch failed,
    or ValueError naming the ranks whose ids are out of range."""
    if isinstance(outcome, BaseException):
        payload, own_error = _payload(REJECTED, message=_error_text(outcome)), outcome
    else:
        payload, own_error = _payload(OK, span=outcome), None
    rows = [_Row(raw) for raw in agreement_for(group).exchange(payload, timeout_s)]
    _raise_rejections(rows, own_error, "failed to launch this call")
    _ids_error(rows, num_experts)


# ------------------------------------------------------------------------------ before a collective

@dataclasses.dataclass
class _Stretch:
    depth: int = 0  # nested `until_collective` blocks of this group
    open: bool = False  # a failure must still be told: the peers have not passed the last gate
    timeout_s: float = 0.0


@contextlib.contextmanager
def until_collective(group: Any, timeout_s: float):
    """The stretch of a call between its agreement and the last collective that follows (the
    IPC megakernel's buffer setup and all_gather of the routing, the group backward's first-
    build all_reduces). A rank that raised there used to leave its peers in that collective
    until NCCL's watchdog; here the exception is exchanged instead, so every rank raises (this
    one its own error, the peers a RuntimeError naming it). `ready_for_collective` is the gate
    before each collective. Nested stretches of one group are one (the outermost tells);
    ``group`` None (one GPU, virtual ranks): nothing."""
    if group is None:  # one GPU or virtual ranks: no peer to tell
        yield
        return
    agreement = agreement_for(group)
    stretch = agreement.stretch
    if agreement.world == 1:
        yield
        return
    outermost = stretch.depth == 0
    if outermost:
        stretch.open, stretch.timeout_s = True, timeout_s
    stretch.depth += 1
    try:
        yield
    except Exception as exc:  # not KeyboardInterrupt: no wait on peers then
        if outermost and stretch.open:
            stretch.open = False
            rows = [_Row(raw) for raw in agreement.exchange(
                _payload(REJECTED, message=_error_text(exc)), timeout_s)]
            _raise_rejections(rows, exc, "failed before a collective")
        raise
    finally:
        stretch.depth -= 1
        if outermost:
            stretch.open = False


def ready_for_collective(group: Any, last: bool = False) -> None:
    """The gate before a collective inside `until_collective`: every rank says it got here, or
    raises the error of a rank that failed on the way (RuntimeError naming it, on every
    rank), or `AgreementTimeout` naming a rank that never came. ``last``: the stretch's last
    collective (a failure after it reaches the peers through the launch's own waits). Outside
    a stretch nothing is exchanged: every rank of a group calls through the same entry points,
    so all of them exchange or none does."""
    agreement = _AGREEMENTS.get(group)  # none yet: no stretch either
    if agreement is None or not agreement.stretch.open:
        return
    stretch = agreement.stretch
    stretch.open = not last
    try:
        rows = [_Row(raw) for raw in agreement.exchange(_payload(OK), stretch.timeout_s)]
        _raise_rejections(rows, None, "failed before a collective")
    except BaseException:
        stretch.open = False  # told: the peers raise too
        raise
