"""The `ipc` peer-memory backend: one process per GPU (torchrun), peer buffers mapped by IPC.

Each rank allocates its symmetric buffer and maps every peer's buffer into its own address
space, so the megakernel reaches peer memory with plain loads and stores through the Int64
table of bases (`PeerTable`). Handle types (``handle_type``):

``"posix_fd"`` (default)
    cuda-python VMM: ``cuMemCreate`` with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``,
    exported with ``cuMemExportToShareableHandle``. A file descriptor only means something
    inside its process, so it crosses to the peers as ``SCM_RIGHTS`` ancillary data over Unix
    domain sockets (`exchange_fds`); ``torch.distributed`` carries the rendezvous. Every rank
    must be on one host.
``"fabric"``
    VMM with ``CU_MEM_HANDLE_TYPE_FABRIC``: a 64-byte handle that is plain data, gathered over
    ``torch.distributed``, valid across the trays of a multi-node NVLink domain (GB200/GB300
    NVL72). Needs an IMEX channel (``/dev/nvidia-caps-imex-channels/channelN``).
``"legacy"``
    ``cudaMalloc`` + ``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle`` (``cuda.bindings.runtime``),
    handles gathered over ``torch.distributed``; one host only. The fallback where VMM export
    is not available.

Why SCM_RIGHTS and not pidfd_getfd(2): pidfd_getfd needs ptrace access to the exporting process
(``PTRACE_MODE_ATTACH_REALCREDS``), which Yama's default ``ptrace_scope=1`` refuses between
sibling torchrun workers, and sandboxes (gVisor) may not implement it; it also needs Linux >=
5.6. Passing descriptors over a Unix socket needs no privilege and works everywhere Unix
sockets do. The sockets live in the abstract namespace by default (no files to clean up, no
stale paths after a crash); ``socket_dir`` selects filesystem sockets instead, for ranks that
share a filesystem but not a network namespace.

VMM layout in each process: one virtual range of ``R * stride`` bytes is reserved and rank
``r``'s buffer (its own, or a peer's imported allocation) is mapped at ``base + r * stride``;
``stride`` is ``layout.nbytes`` rounded up to the largest recommended allocation granularity of
the group. Each mapping is given read/write access for this process's device, the one that
reads and writes it (access is per process and per mapping, so a peer device needs no grant
here: its own process grants it on its own mapping).

Every CUDA call's status is checked: a failure raises RuntimeError naming the call, this rank
and the peer concerned. Setup steps are collective: when any rank fails a step, every rank
raises an error that lists which ranks failed and why, instead of leaving the others waiting.

cuda-python is imported inside the functions that use it, so ``import mok_cute.comm`` works on
a machine without CUDA. NVLink multicast is never used (no ``cuMulticastCreate``).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import secrets
import socket
import struct
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..config import describe
from .peers import PeerTable, SymmetricLayout

__all__ = ["HANDLE_TYPES", "IPC_HANDLE_BYTES", "IpcPeers", "check_cuda", "exchange_fds", "fabric_support"]

HANDLE_TYPES = ("posix_fd", "fabric", "legacy")
IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE: the size of cudaIpcMemHandle_t and of CUmemFabricHandle


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _runtime() -> Any:
    from cuda.bindings import runtime

    return runtime


# ---------------------------------------------------------------------------------------------
# Status checks
# ---------------------------------------------------------------------------------------------


def _error_description(err: Any) -> str:
    """cuGetErrorString / cudaGetErrorString of ``err``, or "" when the library is not there."""
    try:
        if type(err).__name__ == "CUresult":
            status, text = _driver().cuGetErrorString(err)
        else:
            status, text = _runtime().cudaGetErrorString(err)
        if int(status) != 0:
            return ""
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # no driver on this machine: the enum name alone still says what failed
        return ""


def check_cuda(result: Any, call: str, *, rank: int | None = None, peer: int | None = None) -> Any:
    """Check a cuda-python result tuple ``(status, *values)``; return the value(s).

    A status other than success raises RuntimeError naming ``call``, ``rank`` and ``peer``."""
    if not isinstance(result, tuple):
        result = (result,)
    status, values = result[0], result[1:]
    if int(status) != 0:
        where = []
        if rank is not None:
            where.append(f"on rank {rank}")
        if peer is not None:
            where.append(f"for peer {peer}")
        name = getattr(status, "name", str(status))
        desc = _error_description(status)
        raise RuntimeError(f"{call} failed{' ' + ' '.join(where) if where else ''}: {name}{': ' + desc if desc else ''}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


# ---------------------------------------------------------------------------------------------
# File-descriptor exchange (SCM_RIGHTS over Unix domain sockets)
# ---------------------------------------------------------------------------------------------

_FD_MAGIC = 0x4D4F4B46  # "MOKF"
_SECRET_BYTES = 16
# magic, rank of the connecting process, that rank's secret for this exchange
_HELLO = struct.Struct(f"<Ii{_SECRET_BYTES}s")
# magic, rank of the sender, sender's metadata (allocation size), sender's secret
_OFFER = struct.Struct(f"<IiQ{_SECRET_BYTES}s")


def _recv_exact(sock: socket.socket, n: int, first: bytes = b"") -> bytes:
    data = bytearray(first)
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def _socket_address(token: str, rank: int, socket_dir: str | None) -> str:
    if socket_dir is None:
        return f"\0mok_cute-{token}-{rank}"  # abstract namespace: no file, gone with the socket
    return os.path.join(socket_dir, f"mok_cute-{token}-{rank}.sock")


def _peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _greeting_rank(conn: socket.socket, waiting: set[int], rank_secrets: list[bytes]) -> int | str:
    """The peer rank an accepted connection comes from, or why it is refused: the abstract
    socket is open to every local user, so a connection counts only from the same user id and
    with the connecting rank's secret, which only the group's ranks have (all-gathered over
    ``torch.distributed``)."""
    uid = _peer_uid(conn)
    if uid != os.getuid():  # before reading anything from it
        return f"a process of user {uid} connected"
    try:
        magic, who, secret = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
    except (OSError, ConnectionError) as e:
        return f"a greeting was cut short ({e})"
    if magic != _FD_MAGIC or who not in waiting:
        return f"unexpected greeting (magic {magic:#x}, rank {who})"
    if not secrets.compare_digest(secret, rank_secrets[who]):
        return f"a connection claimed rank {who} without its secret"
    return who


def _gather_listen(error: BaseException | None, secret: bytes, group: Any) -> list[bytes]:
    """Collective: every rank learns which ranks could not listen (all raise if any could not)
    and every rank's secret for this exchange."""
    world = dist.get_world_size(group)
    items: list[Any] = [None] * world
    dist.all_gather_object(items, (None if error is None else f"{type(error).__name__}: {error}", secret),
                           group=group)
    failed = [(r, text) for r, (text, _) in enumerate(items) if text is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {t}" for r, t in failed)
        raise RuntimeError(f"exchange_fds (listen) failed on {len(failed)} of {world} ranks: {detail}") from error
    return [secret for _, secret in items]


def exchange_fds(
    fd: int,
    meta: int,
    group: Any,
    token: str,
    *,
    timeout_s: float = 120.0,
    socket_dir: str | None = None,
) -> dict[int, tuple[int, int]]:
    """Collective over ``group`` (all ranks on one host): send ``fd`` and the integer ``meta`` to
    every other rank and receive theirs. Returns ``{peer: (fd, meta)}``; the caller owns (and
    must close) the received descriptors. ``token`` must be the same on every rank and unique
    per exchange (it names the sockets).

    Protocol, per rank: listen on its socket; agree that every rank listens (a collective, which
    also turns a failed bind anywhere into an error everywhere); connect to every peer and say
    who it is; accept one connection per peer and answer it with ``fd`` (SCM_RIGHTS); read each
    peer's answer. Connects complete against the listen backlog without waiting for the accept,
    so no rank waits on a rank that waits on it. Every blocking step has ``timeout_s``.

    Who may connect: the listen collective also all-gathers a random secret per rank; a
    connection from another user id, or without the claimed rank's secret, is refused (closed
    unanswered: no descriptor leaves) and the rank keeps waiting for its peers. The answering
    side is checked the same way (its user id and its secret in the answer).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [p for p in range(world) if p != rank]
    received: dict[int, tuple[int, int]] = {}
    outgoing: dict[int, socket.socket] = {}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = _socket_address(token, rank, socket_dir)
    try:
        bind_error: BaseException | None = None
        try:
            server.bind(address)
            # room for strangers' connections beside the peers'
            server.listen(max(1, 2 * len(peers)))
            server.settimeout(timeout_s)
        except OSError as e:
            bind_error = RuntimeError(f"rank {rank} could not listen on {address!r}: {e}")
        my_secret = secrets.token_bytes(_SECRET_BYTES)
        rank_secrets = _gather_listen(bind_error, my_secret, group)

        for p in peers:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            outgoing[p] = conn
            conn.settimeout(timeout_s)
            peer_address = _socket_address(token, p, socket_dir)
            try:
                conn.connect(peer_address)
                conn.sendall(_HELLO.pack(_FD_MAGIC, rank, my_secret))
            except OSError as e:
                raise RuntimeError(f"exchange_fds: rank {rank} could not connect to peer {p} at {peer_address!r}: {e}") from e

        waiting = set(peers)
        while waiting:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                raise RuntimeError(
                    f"exchange_fds: rank {rank}: peers {sorted(waiting)} did not connect within {timeout_s} s"
                ) from None
            with conn:
                conn.settimeout(timeout_s)
                who = _greeting_rank(conn, waiting, rank_secrets)
                if isinstance(who, str):  # a stranger: refused, keep waiting for the peers
                    warnings.warn(f"exchange_fds: rank {rank} refused a connection: {who}", stacklevel=2)
                    continue
                try:
                    socket.send_fds(conn, [_OFFER.pack(_FD_MAGIC, rank, meta, my_secret)], [fd])
                except OSError as e:
                    raise RuntimeError(f"exchange_fds: rank {rank} could not send its descriptor to peer {who}: {e}") from e
                waiting.discard(who)

        for p, conn in outgoing.items():
            try:
                msg, fds, _flags, _addr = socket.recv_fds(conn, _OFFER.size, 1)
            except socket.timeout:
                raise RuntimeError(f"exchange_fds: rank {rank}: peer {p} sent no descriptor within {timeout_s} s") from None
            except OSError as e:
                raise RuntimeError(f"exchange_fds: rank {rank}: receiving peer {p}'s descriptor failed: {e}") from e
            if len(fds) != 1:
                for extra in fds:
                    os.close(extra)
                raise RuntimeError(f"exchange_fds: rank {rank}: peer {p} sent {len(fds)} descriptors, expected 1")
            received[p] = (fds[0], -1)
            try:
                msg = _recv_exact(conn, _OFFER.size, msg)
            except (OSError, ConnectionError) as e:
                raise RuntimeError(f"exchange_fds: rank {rank}: peer {p}'s message was cut short: {e}") from e
            magic, sender, peer_meta, secret = _OFFER.unpack(msg)
            uid, secret_ok = _peer_uid(conn), secrets.compare_digest(secret, rank_secrets[p])
            if uid != os.getuid() or not secret_ok:
                raise RuntimeError(
                    f"exchange_fds: rank {rank}: the answer on peer {p}'s socket did not come from peer {p} "
                    f"(user {uid}, secret {'matches' if secret_ok else 'wrong'})"
                )
            if magic != _FD_MAGIC or sender != p:
                raise RuntimeError(
                    f"exchange_fds: rank {rank}: the answer on peer {p}'s socket came from rank {sender} "
                    f"(magic {magic:#x})"
                )
            received[p] = (fds[0], peer_meta)
    except BaseException:
        for peer_fd, _ in received.values():
            os.close(peer_fd)
        raise
    finally:
        for conn in outgoing.values():
            conn.close()
        server.close()
        if socket_dir is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)
    return received


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _host_identity() -> tuple[str, str]:
    """(hostname, boot id): two ranks with equal identities run under one kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id


def _check_one_host(identities: list[tuple[str, str]], handle_type: str) -> None:
    hosts: dict[tuple[str, str], list[int]] = {}
    for r, ident in enumerate(identities):
        hosts.setdefault(ident, []).append(r)
    if len(hosts) > 1:
        where = "; ".join(f"{h[0]}: ranks {rs}" for h, rs in hosts.items())
        raise ValueError(
            f"handle_type: {handle_type!r} needs every rank on one host, got {len(hosts)} hosts ({where}); "
            f"use handle_type='fabric' across the trays of one NVLink domain"
        )


def _device_attribute(device: Any, *names: str) -> int:
    drv = _driver()
    for name in names:  # the attribute's spelling moved between CUDA releases
        attr = getattr(drv.CUdevice_attribute, name, None)
        if attr is not None:
            return int(check_cuda(drv.cuDeviceGetAttribute(attr, device), f"cuDeviceGetAttribute({name})"))
    raise RuntimeError(f"cuda-python has none of the device attributes {names}")


def fabric_support(device_index: int = 0) -> tuple[bool, str]:
    """Whether FABRIC handles can be created here, and why not. Needs a CUDA driver."""
    drv = _driver()
    check_cuda(drv.cuInit(0), "cuInit")
    dev = check_cuda(drv.cuDeviceGet(device_index), "cuDeviceGet")
    if not _device_attribute(dev, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"):
        return False, f"device {device_index} does not support CU_MEM_HANDLE_TYPE_FABRIC"
    channels = "/dev/nvidia-caps-imex-channels"
    if not os.path.isdir(channels) or not os.listdir(channels):
        return False, f"no IMEX channel under {channels} (FABRIC handles need one)"
    return True, ""


class _CudaBytes:
    """A raw device range as ``__cuda_array_interface__``, for `torch.as_tensor`."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 2, "strides": None,
        }


def _bytes_tensor(address: int, nbytes: int, device_index: int) -> torch.Tensor:
    """uint8 [nbytes] torch tensor over device memory at ``address`` (no copy, not owning)."""
    t = torch.as_tensor(_CudaBytes(address, nbytes), device=torch.device("cuda", device_index))
    if t.data_ptr() != address:
        raise RuntimeError(f"torch.as_tensor copied the buffer at {address:#x} instead of viewing it")
    return t


def _resolve_device(device: object) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    elif isinstance(device, (str, torch.device)):
        d = torch.device(device)
        if d.type != "cuda":
            raise ValueError(f"device: expected a CUDA device, got {describe(device)}")
        index = d.index if d.index is not None else torch.cuda.current_device()
    else:
        raise TypeError(f"device: expected a CUDA device (int, str or torch.device) or None, got {describe(device)}")
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device: expected a device index in [0, {torch.cuda.device_count()}), got {index}")
    return index


# ---------------------------------------------------------------------------------------------
# IpcPeers
# ---------------------------------------------------------------------------------------------


class IpcPeers:
    """Symmetric buffers of every rank of ``group``, mapped into this process (module docstring).

    ``IpcPeers(group, layout, handle_type="posix_fd")`` is collective over ``group`` (None: the
    default group). ``table`` is this rank's `PeerTable` (bases on this rank's device, ``local``
    over its own buffer, zeroed). Use it as a context manager, or call `close` (local, not
    collective); tensors from ``table.view`` are invalid after `close`. Close only when the peers
    are done writing into this rank's buffer (e.g. after a group barrier).
    """

    def __init__(
        self,
        group: Any,
        layout: SymmetricLayout,
        handle_type: str = "posix_fd",
        *,
        device: torch.device | str | int | None = None,
        timeout_s: float = 120.0,
        socket_dir: str | None = None,
    ):
        if not isinstance(handle_type, str) or handle_type not in HANDLE_TYPES:
            raise ValueError(f"handle_type: expected one of {HANDLE_TYPES}, got {describe(handle_type)}")
        if not isinstance(layout, SymmetricLayout):
            raise TypeError(f"layout: expected a SymmetricLayout, got {describe(layout)}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number > 0, got {describe(timeout_s)}")
        if socket_dir is not None and not os.path.isdir(socket_dir):
            raise ValueError(f"socket_dir: expected an existing directory or None, got {describe(socket_dir)}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("group: torch.distributed is not initialized (call torch.distributed.init_process_group first)")
        if not torch.cuda.is_available():
            raise RuntimeError("IpcPeers needs a CUDA device (torch.cuda.is_available() is False)")

        self.group = group
        self.layout = layout
        self.handle_type = handle_type
        self.timeout_s = float(timeout_s)
        self.socket_dir = socket_dir
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device_index = _resolve_device(device)
        self.stride = 0  # bytes between consecutive ranks' buffers in this process's VA (VMM)
        self._nbytes = 0
        self._table: PeerTable | None = None
        self._closed = False
        # Everything to undo in close(), in creation order.
        self._ctx: Any = None
        self._cu_device: Any = None
        self._reserve: tuple[int, int] | None = None  # (base, size) of the VA reservation
        self._handles: list[tuple[Any, int]] = []  # (CUmemGenericAllocationHandle, owner rank)
        self._mapped: list[tuple[int, int, int]] = []  # (address, size, owner rank)
        self._fds: list[int] = []  # descriptors still open (own export, received ones)
        self._legacy_own = 0  # cudaMalloc'd pointer
        self._legacy_opened: list[tuple[int, int]] = []  # (pointer, owner rank)

        try:
            with torch.cuda.device(self.device_index):  # collectives on an NCCL group use it
                addresses = self._setup_legacy() if handle_type == "legacy" else self._setup_vmm()
                local = _bytes_tensor(addresses[self.rank], self.nbytes, self.device_index)
                self._table = PeerTable(
                    num_ranks=self.num_ranks, rank=self.rank,
                    bases=torch.tensor(addresses, dtype=torch.int64, device=local.device),
                    nbytes=self.nbytes, layout=layout, addresses=tuple(addresses), local=local,
                    backend=f"ipc:{handle_type}",
                ).validate()
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()
            raise

    # -- public ---------------------------------------------------------------------------

    @property
    def table(self) -> PeerTable:
        if self._table is None:
            raise RuntimeError("IpcPeers: closed (or not set up)")
        return self._table

    @property
    def nbytes(self) -> int:
        """Bytes of each rank's buffer (layout.nbytes rounded up to the allocation granularity)."""
        return self._nbytes

    def view(self, name: str) -> torch.Tensor:
        return self.table.view(name)

    def write_peer(self, peer: int, name: str, src: torch.Tensor, byte_offset: int = 0) -> None:
        """Host-side, synchronous: copy contiguous ``src`` (CPU or CUDA) into field ``name`` of
        ``peer``'s buffer at ``byte_offset``, through this process's mapping. For tests and tools."""
        nbytes = self._copy_extent(name, src, byte_offset, "src")
        dst = self.table.address(peer, name, byte_offset)
        drv = _driver()
        with self._current():
            if src.is_cuda:
                torch.cuda.current_stream(src.device).synchronize()
                check_cuda(drv.cuMemcpyDtoD(dst, src.data_ptr(), nbytes), "cuMemcpyDtoD", rank=self.rank, peer=peer)
            else:
                check_cuda(drv.cuMemcpyHtoD(dst, src.data_ptr(), nbytes), "cuMemcpyHtoD", rank=self.rank, peer=peer)
            check_cuda(drv.cuCtxSynchronize(), "cuCtxSynchronize", rank=self.rank, peer=peer)

    def read_peer(self, peer: int, name: str) -> torch.Tensor:
        """Host-side, synchronous: a CPU copy of field ``name`` of ``peer``'s buffer."""
        f = self.layout.field(name)
        out = torch.empty(f.shape, dtype=f.dtype)
        src = self.table.address(peer, name)
        drv = _driver()
        with self._current():
            check_cuda(drv.cuCtxSynchronize(), "cuCtxSynchronize", rank=self.rank, peer=peer)
            check_cuda(drv.cuMemcpyDtoH(out.data_ptr(), src, f.nbytes), "cuMemcpyDtoH", rank=self.rank, peer=peer)
        return out

    def close(self) -> None:
        """Unmap and release everything this process holds; idempotent, local (not collective).
        Raises RuntimeError listing every call that failed, after trying them all."""
        if self._closed:
            return
        self._closed = True
        self._table = None
        errors: list[str] = []

        def attempt(call: str, fn: Callable[..., Any], *args: Any, peer: int | None = None) -> None:
            try:
                check_cuda(fn(*args), call, rank=self.rank, peer=peer)
            except Exception as e:  # keep releasing the rest
                errors.append(str(e))

        if self._ctx is not None:
            drv = _driver()
            attempt("cuCtxPushCurrent", drv.cuCtxPushCurrent, self._ctx)
            attempt("cuCtxSynchronize", drv.cuCtxSynchronize)  # no kernel may still use a mapping
            for address, size, owner in reversed(self._mapped):
                attempt("cuMemUnmap", drv.cuMemUnmap, address, size, peer=owner)
            for handle, owner in reversed(self._handles):
                attempt("cuMemRelease", drv.cuMemRelease, handle, peer=owner)
            if self._reserve is not None:
                attempt("cuMemAddressFree", drv.cuMemAddressFree, *self._reserve)
            if self._legacy_opened or self._legacy_own:
                rt = _runtime()
                for pointer, owner in reversed(self._legacy_opened):
                    attempt("cudaIpcCloseMemHandle", rt.cudaIpcCloseMemHandle, pointer, peer=owner)
                if self._legacy_own:
                    attempt("cudaFree", rt.cudaFree, self._legacy_own)
            attempt("cuCtxPopCurrent", drv.cuCtxPopCurrent)
            attempt("cuDevicePrimaryCtxRelease", drv.cuDevicePrimaryCtxRelease, self._cu_device)
        self._mapped, self._handles, self._reserve = [], [], None
        self._legacy_opened, self._legacy_own, self._ctx = [], 0, None
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        if errors:
            raise RuntimeError("IpcPeers.close: " + "; ".join(errors))

    def __enter__(self) -> IpcPeers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"nbytes={getattr(self, '_nbytes', 0)}"
        return f"IpcPeers(rank={self.rank}/{self.num_ranks}, handle_type={self.handle_type!r}, device={self.device_index}, {state})"

    # -- setup ----------------------------------------------------------------------------

    def _copy_extent(self, name: str, src: object, byte_offset: int, arg: str) -> int:
        if not isinstance(src, torch.Tensor) or not src.is_contiguous():
            raise TypeError(f"{arg}: expected a contiguous torch.Tensor, got {describe(src)}")
        f = self.layout.field(name)
        nbytes = src.numel() * src.element_size()
        if isinstance(byte_offset, bool) or not isinstance(byte_offset, int) or byte_offset < 0 or byte_offset + nbytes > f.nbytes:
            raise ValueError(
                f"{arg}: {nbytes} bytes at byte_offset {byte_offset!r} do not fit field {name!r} ({f.nbytes} bytes)"
            )
        return nbytes

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """Make this device's primary context (the one torch uses) current for driver calls."""
        drv = _driver()
        check_cuda(drv.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent", rank=self.rank)
        try:
            yield
        finally:
            check_cuda(drv.cuCtxPopCurrent(), "cuCtxPopCurrent", rank=self.rank)

    def _retain_context(self) -> None:
        drv = _driver()
        check_cuda(drv.cuInit(0), "cuInit", rank=self.rank)
        self._cu_device = check_cuda(drv.cuDeviceGet(self.device_index), "cuDeviceGet", rank=self.rank)
        self._ctx = check_cuda(drv.cuDevicePrimaryCtxRetain(self._cu_device), "cuDevicePrimaryCtxRetain", rank=self.rank)

    def _step(self, phase: str, fn: Callable[[], Any]) -> list[Any]:
        """Run ``fn`` here, then gather every rank's (error, result): all raise if any failed."""
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as e:
            error = e
        gathered: list[Any] = [None] * self.num_ranks
        text = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(gathered, (text, result), group=self.group)
        failed = [(r, t) for r, (t, _) in enumerate(gathered) if t is not None]
        if failed:
            detail = "; ".join(f"rank {r}: {t}" for r, t in failed)
            raise RuntimeError(
                f"IpcPeers({self.handle_type!r}): {phase} failed on {len(failed)} of {self.num_ranks} ranks: {detail}"
            ) from error
        return [res for _, res in gathered]

    def _setup_vmm(self) -> list[int]:
        drv = _driver()
        fabric = self.handle_type == "fabric"
        cu_handle_type = (
            drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC if fabric
            else drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        location = drv.CUmemLocation()
        location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        location.id = self.device_index
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = location
        prop.requestedHandleTypes = cu_handle_type
        access = drv.CUmemAccessDesc()
        access.location = location  # this process's device reads and writes every mapping
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

        def query() -> tuple[tuple[str, str], int, str]:
            self._retain_context()
            if not _device_attribute(self._cu_device, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                                     "CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED"):
                raise RuntimeError(f"device {self.device_index} does not support CUDA virtual memory management "
                                   "(use handle_type='legacy')")
            attr = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED" if fabric else \
                "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
            if not _device_attribute(self._cu_device, attr):
                raise RuntimeError(f"device {self.device_index} does not support {self.handle_type!r} handles ({attr} = 0)")
            granularity = check_cuda(
                drv.cuMemGetAllocationGranularity(prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity", rank=self.rank,
            )
            return _host_identity(), int(granularity), secrets.token_hex(8)

        infos = self._step("device query", query)
        if not fabric:
            _check_one_host([ident for ident, _, _ in infos], self.handle_type)
        granularity = max(g for _, g, _ in infos)
        self.stride = self._nbytes = math.ceil(self.layout.nbytes / granularity) * granularity
        token = infos[0][2]  # rank 0's: names this exchange's sockets
        R, stride = self.num_ranks, self.stride

        def map_at(owner: int, handle: Any) -> int:
            address = self._reserve[0] + owner * stride  # type: ignore[index]
            check_cuda(drv.cuMemMap(address, stride, 0, handle, 0), "cuMemMap", rank=self.rank, peer=owner)
            self._mapped.append((address, stride, owner))
            try:
                check_cuda(drv.cuMemSetAccess(address, stride, [access], 1), "cuMemSetAccess", rank=self.rank, peer=owner)
            except RuntimeError as e:
                if owner == self.rank:
                    raise
                raise RuntimeError(f"{e} (can device {self.device_index} reach peer {owner}'s GPU over NVLink/P2P?)") from e
            return address

        def allocate_and_export() -> bytes | None:
            with self._current():
                handle = check_cuda(drv.cuMemCreate(stride, prop, 0), "cuMemCreate", rank=self.rank)
                self._handles.append((handle, self.rank))
                base = int(check_cuda(drv.cuMemAddressReserve(R * stride, granularity, 0, 0), "cuMemAddressReserve", rank=self.rank))
                self._reserve = (base, R * stride)
                own = map_at(self.rank, handle)
                # Zero it (the barrier flags must start at 0) before any peer can write into it:
                # the collective that ends this step orders the two.
                check_cuda(drv.cuMemsetD8(own, 0, stride), "cuMemsetD8", rank=self.rank)
                check_cuda(drv.cuCtxSynchronize(), "cuCtxSynchronize", rank=self.rank)
                try:
                    shareable = check_cuda(drv.cuMemExportToShareableHandle(handle, cu_handle_type, 0),
                                           "cuMemExportToShareableHandle", rank=self.rank)
                except RuntimeError as e:
                    if fabric:
                        raise RuntimeError(f"{e} (FABRIC export needs an IMEX channel, "
                                           "/dev/nvidia-caps-imex-channels/channelN, granted to this process)") from e
                    raise
            if fabric:
                data = bytes(shareable.data)
                if len(data) != IPC_HANDLE_BYTES:
                    raise RuntimeError(f"cuMemExportToShareableHandle returned a {len(data)}-byte fabric handle, expected {IPC_HANDLE_BYTES}")
                return data
            self._fds.append(int(shareable))
            return None

        exported = self._step("allocate and export", allocate_and_export)

        if fabric:
            sources: dict[int, Any] = {p: exported[p] for p in range(R) if p != self.rank}
        else:
            own_fd = self._fds[-1]

            received: dict[int, tuple[int, int]] = {}

            def exchange() -> None:
                received.update(exchange_fds(own_fd, stride, self.group, token, timeout_s=self.timeout_s,
                                             socket_dir=self.socket_dir))
                self._fds.extend(fd for fd, _ in received.values())  # close() releases them on any failure
                for p, (_, peer_stride) in received.items():
                    if peer_stride != stride:
                        raise RuntimeError(f"peer {p} allocated {peer_stride} bytes, expected {stride}")

            # exchange_fds is itself collective; _step then agrees on its outcome.
            self._step("descriptor exchange", exchange)
            self._fds.remove(own_fd)
            os.close(own_fd)  # the peers hold their own references now
            sources = {p: fd for p, (fd, _) in received.items()}

        def import_and_map() -> None:
            with self._current():
                for p in sorted(sources):
                    if fabric:
                        fabric_handle = drv.CUmemFabricHandle()
                        ctypes.memmove(fabric_handle.getPtr(), sources[p], IPC_HANDLE_BYTES)
                        os_handle: Any = fabric_handle.getPtr()  # the struct's address; the handle object stays alive here
                    else:
                        os_handle = sources[p]
                    handle = check_cuda(drv.cuMemImportFromShareableHandle(os_handle, cu_handle_type),
                                        "cuMemImportFromShareableHandle", rank=self.rank, peer=p)
                    self._handles.append((handle, p))
                    if not fabric:  # the imported handle keeps the allocation alive
                        self._fds.remove(sources[p])
                        os.close(sources[p])
                    map_at(p, handle)

        self._step("import and map", import_and_map)
        base = self._reserve[0]  # type: ignore[index]
        return [base + r * stride for r in range(R)]

    def _setup_legacy(self) -> list[int]:
        rt = _runtime()
        nbytes = self._nbytes = self.stride = self.layout.nbytes

        def allocate_and_export() -> tuple[tuple[str, str], bytes]:
            self._retain_context()
            with self._current():
                check_cuda(rt.cudaSetDevice(self.device_index), "cudaSetDevice", rank=self.rank)
                self._legacy_own = int(check_cuda(rt.cudaMalloc(nbytes), "cudaMalloc", rank=self.rank))
                check_cuda(rt.cudaMemset(self._legacy_own, 0, nbytes), "cudaMemset", rank=self.rank)
                check_cuda(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize", rank=self.rank)
                handle = check_cuda(rt.cudaIpcGetMemHandle(self._legacy_own), "cudaIpcGetMemHandle", rank=self.rank)
            return _host_identity(), ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)

        exported = self._step("allocate and export", allocate_and_export)
        _check_one_host([ident for ident, _ in exported], self.handle_type)

        addresses = [0] * self.num_ranks
        addresses[self.rank] = self._legacy_own

        def open_handles() -> None:
            with self._current():
                for p in range(self.num_ranks):
                    if p == self.rank:
                        continue  # a process cannot open its own handle
                    handle = rt.cudaIpcMemHandle_t()
                    ctypes.memmove(handle.getPtr(), exported[p][1], IPC_HANDLE_BYTES)
                    pointer = int(check_cuda(rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess),
                                             "cudaIpcOpenMemHandle", rank=self.rank, peer=p))
                    self._legacy_opened.append((pointer, p))
                    addresses[p] = pointer

        self._step("open handles", open_handles)
        return addresses
