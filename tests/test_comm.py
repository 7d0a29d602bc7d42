"""mok_cute.comm on the CPU: layout arithmetic, PeerTable checks, the virtual backend (CPU
tensors: the addresses are host addresses, so writes through them are checked with ctypes),
the barrier word spec, IpcPeers argument checks and the SCM_RIGHTS descriptor exchange between
real processes (memfd descriptors standing in for CUDA's exported ones).

The CUDA side of `ipc` is in tests/test_comm_ipc_gpu.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from mok_cute import comm
from mok_cute.comm import (
    BARRIER_FIELD,
    BarrierSpec,
    IpcPeers,
    SymmetricLayout,
    VirtualPeers,
    moe_symmetric_layout,
)

import gloo_group

# ---------------------------------------------------------------------------------------------
# SymmetricLayout
# ---------------------------------------------------------------------------------------------


def test_layout_offsets_by_hand():
    layout = SymmetricLayout.build(
        [("flags", (3,), torch.int32), ("rows", (5, 7), torch.bfloat16), ("counter", (1,), torch.int64)]
    )
    # flags: 12 bytes at 0; rows: 70 bytes at the next 128; counter: 8 bytes at 256; total 384.
    assert [(f.name, f.offset, f.nbytes) for f in layout.fields] == [("flags", 0, 12), ("rows", 128, 70), ("counter", 256, 8)]
    assert layout.nbytes == 384 and layout.align == 128
    assert layout.offset("rows") == 128 and "rows" in layout and "nope" not in layout
    assert layout.names == ("flags", "rows", "counter")


@pytest.mark.parametrize("align", [16, 128, 4096])
def test_layout_alignment_random(align, gen):
    dtypes = [torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.uint8, torch.float8_e4m3fn]
    for trial in range(20):
        n = int(torch.randint(1, 8, (1,), generator=gen))
        fields = []
        for i in range(n):
            shape = tuple(int(s) for s in torch.randint(0, 50, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen))
            fields.append((f"f{i}", shape, dtypes[int(torch.randint(0, len(dtypes), (1,), generator=gen))]))
        layout = SymmetricLayout.build(fields, align=align)
        prev_end = 0
        for (name, shape, dtype), f in zip(fields, layout.fields):
            assert f.name == name and f.shape == shape and f.dtype == dtype
            assert f.offset % align == 0
            assert f.offset >= prev_end and f.offset - prev_end < align  # packed: the next aligned byte
            assert f.nbytes == torch.empty(shape, dtype=dtype).nbytes
            prev_end = f.end
        assert layout.nbytes % align == 0 and layout.nbytes >= max(prev_end, 1)
        assert layout.nbytes - prev_end < align or prev_end == 0


@pytest.mark.parametrize(
    "fields, align, exc, text",
    [
        ([("a", (4,), torch.int32)], 100, ValueError, "align"),
        ([("a", (4,), torch.int32)], 8, ValueError, "align"),
        ([("a", (4,), torch.int32)], 128.0, TypeError, "align"),
        ([], 128, ValueError, "fields"),
        ("abc", 128, TypeError, "fields"),
        ([("a", (4,), torch.int32), ("a", (2,), torch.int32)], 128, ValueError, "fields[1].name"),
        ([("1bad", (4,), torch.int32)], 128, ValueError, "fields[0].name"),
        ([("a", (4, -1), torch.int32)], 128, ValueError, "fields[0].shape"),
        ([("a", (4.0,), torch.int32)], 128, TypeError, "fields[0].shape"),
        ([("a", (4,), "int32")], 128, TypeError, "fields[0].dtype"),
        ([("a", (4,), torch.complex64)], 128, ValueError, "fields[0].dtype"),
        ([("a", (4,))], 128, TypeError, "fields[0]"),
    ],
)
def test_layout_errors_name_the_argument(fields, align, exc, text):
    with pytest.raises(exc, match=text.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        SymmetricLayout.build(fields, align=align)


def test_layout_unknown_field_lists_names():
    layout = SymmetricLayout.build([("a", (4,), torch.int32)])
    with pytest.raises(ValueError, match=r"name: expected one of the layout's fields \['a'\], got 'b'"):
        layout.field("b")


def test_layout_view_checks_buffer():
    layout = SymmetricLayout.build([("a", (4,), torch.int32)])
    with pytest.raises(TypeError, match="buffer"):
        layout.view(torch.zeros(128, dtype=torch.int32), "a")
    with pytest.raises(ValueError, match="buffer: expected at least 128 bytes"):
        layout.view(torch.zeros(64, dtype=torch.uint8), "a")


def test_moe_symmetric_layout():
    T, H, K, R = 100, 96, 6, 5
    layout = moe_symmetric_layout(T, H, K, R, extra_fields=[("done", (R,), torch.int32)])
    assert layout.names == ("x", "combine", BARRIER_FIELD, "done")
    x, combine, flags, done = layout.fields
    assert (x.shape, x.dtype, x.offset) == ((T, H), torch.bfloat16, 0)
    assert (combine.shape, combine.dtype) == ((T * K, H), torch.bfloat16)
    assert combine.offset == -(-T * H * 2 // 128) * 128
    assert (flags.shape, flags.dtype) == ((2 * R,), torch.int32)  # progress, sticky failed
    assert done.offset % 128 == 0 and done.offset >= flags.end
    with pytest.raises(ValueError, match="top_k"):
        moe_symmetric_layout(T, H, 0, R)
    with pytest.raises(TypeError, match="num_ranks"):
        moe_symmetric_layout(T, H, K, 2.0)


# ---------------------------------------------------------------------------------------------
# PeerTable.validate
# ---------------------------------------------------------------------------------------------


def _good_table(R=4, rank=1):
    peers = VirtualPeers(R, moe_symmetric_layout(8, 64, 2, R))
    return peers, peers.table(rank)


def test_peer_table_valid():
    _, table = _good_table()
    assert table.validate() is table
    assert table.backend == "virtual" and table.device == torch.device("cpu")


@pytest.mark.parametrize(
    "change, exc, text",
    [
        (lambda t: dict(num_ranks=0), ValueError, "PeerTable.num_ranks"),
        (lambda t: dict(rank=4), ValueError, "PeerTable.rank"),
        (lambda t: dict(rank=-1), ValueError, "PeerTable.rank"),
        (lambda t: dict(layout="x"), TypeError, "PeerTable.layout"),
        (lambda t: dict(nbytes=t.layout.nbytes - 128), ValueError, "PeerTable.nbytes"),
        (lambda t: dict(nbytes=t.layout.nbytes + 8), ValueError, "PeerTable.nbytes"),
        (lambda t: dict(bases=t.bases.to(torch.int32), addresses=t.addresses), ValueError, "PeerTable.bases"),
        (lambda t: dict(bases=t.bases[:3], addresses=t.addresses[:3]), ValueError, "PeerTable.bases"),
        (lambda t: dict(bases=t.bases.tolist()), TypeError, "PeerTable.bases"),
        (lambda t: dict(addresses=t.addresses[:3]), ValueError, "PeerTable.addresses"),
        (lambda t: dict(addresses=tuple(a + 128 for a in t.addresses)), ValueError, "PeerTable.bases"),
        (lambda t: dict(bases=t.bases + 8, addresses=()), ValueError, r"PeerTable.bases\[0\]: expected a non-zero multiple of 128"),
        (lambda t: dict(bases=torch.zeros(4, dtype=torch.int64), addresses=()), ValueError, r"PeerTable.bases\[0\]"),
        (lambda t: dict(bases=t.bases[[0, 0, 2, 3]].contiguous(), addresses=(), local=None), ValueError, "overlap"),
        (lambda t: dict(local=t.local[128:]), ValueError, "PeerTable.local"),
        (lambda t: dict(local=t.local.view(torch.int32)), TypeError, "PeerTable.local"),
    ],
)
def test_peer_table_errors_name_the_field(change, exc, text):
    _peers, table = _good_table()
    bad = dataclasses.replace(table, **change(table))
    with pytest.raises(exc, match=text):
        bad.validate()


def test_peer_table_address_and_view_errors():
    _, table = _good_table()
    with pytest.raises(ValueError, match="peer"):
        table.address(4, "x")
    with pytest.raises(ValueError, match="byte_offset"):
        table.address(0, "x", table.field("x").nbytes + 1)
    with pytest.raises(ValueError, match="name"):
        table.address(0, "nope")
    no_local = dataclasses.replace(table, local=None)
    with pytest.raises(ValueError, match="PeerTable.local"):
        no_local.view("x")


# ---------------------------------------------------------------------------------------------
# VirtualPeers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", [1, 2, 3, 8, 72])
def test_virtual_bases_are_slice_addresses(R):
    layout = moe_symmetric_layout(4, 32, 3, R)
    peers = VirtualPeers(R, layout)
    assert peers.nbytes == layout.nbytes
    for r in range(R):
        table = peers.table(r).validate()
        assert table.rank == r and table.num_ranks == R
        assert table.bases.dtype == torch.int64 and table.bases.tolist() == list(peers.addresses)
        assert peers.rank_buffer(r).data_ptr() == peers.addresses[r] == table.local.data_ptr()
        assert peers.addresses[r] % layout.align == 0
        assert peers.view(r, "combine").data_ptr() == table.address(r, "combine")
    assert all(b - a == layout.nbytes for a, b in zip(peers.addresses, peers.addresses[1:]))
    matrix = peers.bases_matrix()
    assert matrix.shape == (R, R) and matrix.dtype == torch.int64 and matrix.is_contiguous()
    for r, table in enumerate(peers.tables()):
        assert torch.equal(matrix[r], table.bases)


@pytest.mark.parametrize("R", [2, 72])
def test_virtual_views_write_where_expected(R, gen):
    layout = moe_symmetric_layout(3, 16, 2, R)
    peers = VirtualPeers(R, layout)
    combine = layout.field("combine")
    rank = R - 1
    pattern = torch.randn(combine.shape, generator=gen).bfloat16()
    peers.view(rank, "combine").copy_(pattern)
    raw = peers.buffer
    start = rank * layout.nbytes + combine.offset
    assert torch.equal(raw[start:start + combine.nbytes], pattern.view(torch.uint8).flatten())
    # Every other byte of the whole allocation is still zero.
    touched = torch.zeros_like(raw, dtype=torch.bool)
    touched[start:start + combine.nbytes] = True
    assert not raw[~touched].any()
    # The table's own view is the same memory.
    assert torch.equal(peers.table(rank).view("combine"), pattern)


def test_virtual_addresses_reach_the_memory():
    """Writing through a rank's table address (raw pointer) lands in the peer's view."""
    R = 4
    peers = VirtualPeers(R, moe_symmetric_layout(4, 8, 2, R))
    table = peers.table(0)
    value = ctypes.c_uint16(0x3F80)  # bf16 1.0
    for peer in range(R):
        row, col = peer % 4, 2 * peer
        ctypes.memmove(table.address(peer, "x", (row * 8 + col) * 2), ctypes.addressof(value), 2)
    for peer in range(R):
        x = peers.view(peer, "x")
        assert x[peer % 4, 2 * peer] == 1.0 and x.float().sum() == 1.0


def test_virtual_argument_errors():
    layout = moe_symmetric_layout(4, 8, 2, 2)
    with pytest.raises(ValueError, match="num_ranks"):
        VirtualPeers(73, layout)
    with pytest.raises(TypeError, match="num_ranks"):
        VirtualPeers(True, layout)
    with pytest.raises(TypeError, match="layout"):
        VirtualPeers(2, {"x": 1})
    peers = VirtualPeers(2, layout)
    with pytest.raises(ValueError, match="rank"):
        peers.table(2)
    with pytest.raises(TypeError, match="rank"):
        peers.view("0", "x")


def test_virtual_context_manager_and_zero():
    layout = moe_symmetric_layout(2, 8, 1, 2)
    with VirtualPeers(2, layout) as peers:
        peers.view(1, "x").fill_(3)
        assert peers.buffer.any()
        peers.zero_()
        assert not peers.buffer.any()
    assert peers.buffer is None


# ---------------------------------------------------------------------------------------------
# Barrier spec
# ---------------------------------------------------------------------------------------------


def test_barrier_flag_words():
    R = 5
    peers = VirtualPeers(R, moe_symmetric_layout(2, 8, 1, R))
    spec = peers.table(0).barrier()
    assert spec == BarrierSpec.from_layout(peers.layout, R)
    assert spec.offset == peers.layout.offset(BARRIER_FIELD)
    assert [spec.word_offset(s) for s in range(R)] == [spec.offset + 4 * s for s in range(R)]
    # Rank s stores epoch 7 into flag s of every rank, through rank s's table.
    for s in range(R):
        table = peers.table(s)
        for dst in range(R):
            word = ctypes.c_int32(7 + s)
            ctypes.memmove(spec.flag_address(table, dst, s), ctypes.addressof(word), 4)
    for dst in range(R):
        assert peers.view(dst, BARRIER_FIELD).tolist() == [7 + s for s in range(R)] + [0] * R
    with pytest.raises(ValueError, match="src_rank"):
        spec.word_offset(R)
    with pytest.raises(ValueError, match="dst_rank"):
        spec.flag_address(peers.table(0), -1, 0)


def test_barrier_spec_rejects_bad_field():
    layout = SymmetricLayout.build([("flags", (2,), torch.int64), ("few", (1,), torch.int32)])
    with pytest.raises(ValueError, match="field: expected 'flags' to be int32"):
        BarrierSpec.from_layout(layout, 2, "flags")
    with pytest.raises(ValueError, match="at least 2 elements"):
        BarrierSpec.from_layout(layout, 2, "few")


# ---------------------------------------------------------------------------------------------
# ipc: what runs without a GPU
# ---------------------------------------------------------------------------------------------


def test_import_without_cuda_python():
    """mok_cute.comm imports, and the virtual backend works, when cuda-python cannot be imported."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'cuda' or name.startswith('cuda.'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import mok_cute.comm as c\n"
        "p = c.VirtualPeers(2, c.moe_symmetric_layout(2, 8, 1, 2))\n"
        "p.table(1).validate()\n"
        "assert not [m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_ipc_argument_errors():
    layout = moe_symmetric_layout(2, 8, 1, 2)
    with pytest.raises(ValueError, match=r"handle_type: expected one of \('posix_fd', 'fabric', 'legacy'\), got str 'nvshmem'"):
        IpcPeers(None, layout, "nvshmem")
    with pytest.raises(ValueError, match="handle_type"):
        IpcPeers(None, layout, 8)
    with pytest.raises(TypeError, match="layout"):
        IpcPeers(None, [("x", (2,), torch.int32)])
    with pytest.raises(ValueError, match="timeout_s"):
        IpcPeers(None, layout, timeout_s=0)
    with pytest.raises(ValueError, match="socket_dir"):
        IpcPeers(None, layout, socket_dir="/nonexistent/mok_cute")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            IpcPeers(None, layout)


def test_check_cuda_names_call_rank_and_peer():
    drv = pytest.importorskip("cuda.bindings.driver")
    assert comm.check_cuda((drv.CUresult.CUDA_SUCCESS, 42), "cuDeviceGet") == 42
    assert comm.check_cuda((drv.CUresult.CUDA_SUCCESS, 1, 2), "x") == (1, 2)
    assert comm.check_cuda((drv.CUresult.CUDA_SUCCESS,), "cuInit") is None
    with pytest.raises(RuntimeError, match="cuMemImportFromShareableHandle failed on rank 0 for peer 3: CUDA_ERROR_INVALID_VALUE"):
        comm.check_cuda((drv.CUresult.CUDA_ERROR_INVALID_VALUE, None), "cuMemImportFromShareableHandle", rank=0, peer=3)
    rt = pytest.importorskip("cuda.bindings.runtime")
    with pytest.raises(RuntimeError, match="cudaIpcOpenMemHandle failed for peer 1: cudaErrorInvalidValue"):
        comm.check_cuda((rt.cudaError_t.cudaErrorInvalidValue, 0), "cudaIpcOpenMemHandle", peer=1)


def test_exchange_fds_refuses_strangers(monkeypatch):
    """The descriptor exchange's abstract socket is open to every local user: a connection
    counts only from the same user id and with the claimed rank's secret (issue 30)."""
    import socket
    from mok_cute.comm import ipc

    secrets_ = [bytes([r]) * ipc._SECRET_BYTES for r in range(3)]

    def greet(payload, close=False):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with a, b:
            a.sendall(payload)
            if close:
                a.close()
            return ipc._greeting_rank(b, {0, 2}, secrets_)

    hello = ipc._HELLO.pack
    assert greet(hello(ipc._FD_MAGIC, 2, secrets_[2])) == 2
    assert "without its secret" in greet(hello(ipc._FD_MAGIC, 2, secrets_[0]))
    assert "rank 1" in greet(hello(ipc._FD_MAGIC, 1, secrets_[1]))  # not a peer it waits for
    assert "magic" in greet(hello(0x1234, 0, secrets_[0]))
    assert "cut short" in greet(b"MOK", close=True)
    real_uid = os.getuid()
    monkeypatch.setattr(ipc.os, "getuid", lambda: real_uid + 1)
    assert "user" in greet(hello(ipc._FD_MAGIC, 0, secrets_[0]))


def _check_exchange_fds(rank, world, socket_dir):
    for where in (None, socket_dir):
        # A memfd stands in for CUDA's exported descriptor: the receiver must see the same file.
        fd = os.memfd_create(f"mok_cute-test-{rank}")
        os.write(fd, f"rank {rank} via {where}".encode())
        got = comm.exchange_fds(fd, 1000 + rank, None, f"test{os.getppid()}{where is None}",
                                timeout_s=30, socket_dir=where)
        os.close(fd)
        assert sorted(got) == [p for p in range(world) if p != rank]
        for p, (peer_fd, meta) in got.items():
            assert meta == 1000 + p
            assert os.pread(peer_fd, 64, 0) == f"rank {p} via {where}".encode()
            os.close(peer_fd)
    # One rank cannot listen (its socket_dir does not exist): every rank raises, naming it.
    fd = os.memfd_create("unused")
    bad_dir = "/nonexistent/mok_cute" if rank == 1 else socket_dir
    try:
        comm.exchange_fds(fd, 0, None, f"fail{os.getppid()}", timeout_s=30, socket_dir=bad_dir)
    except RuntimeError as e:
        assert "1 of" in str(e) and "rank 1 could not listen" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: exchange_fds did not raise when rank 1 could not listen")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# ipc plumbing end to end on host memory
#
# `_HostDriver` / `_HostRuntime` stand in for cuda.bindings.driver / .runtime with the same call
# shapes and result tuples, backed by host memory: an allocation is a memfd, cuMemAddressReserve
# an inaccessible mmap range, cuMemMap an mmap(MAP_FIXED | MAP_SHARED) of the memfd, so ranks
# really share pages. Exported handles are what the real driver gives (a descriptor for
# posix_fd; 64 bytes of data for fabric and legacy, here naming /proc/<pid>/fd/<n>). This runs
# IpcPeers' own logic (collective steps, the descriptor exchange, the VA layout, bookkeeping and
# close) between real processes; what it cannot check is the CUDA driver itself: that is
# tests/test_comm_ipc_gpu.py.
# ---------------------------------------------------------------------------------------------

_PROT_NONE, _PROT_RW = 0, 3
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _mmap(libc, address, size, prot, flags, fd=-1):
    result = libc.mmap(address, size, prot, flags, fd, 0)
    if result in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return result


def _handle_bytes(fd, size):
    return struct.pack("<iiQ", os.getpid(), fd, size).ljust(64, b"\0")


def _open_handle_bytes(data):
    pid, fd, size = struct.unpack_from("<iiQ", data)
    return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR), size, pid


class _HostDriver:
    def __init__(self, fail_call=None):
        from cuda.bindings import driver

        self.real, self.libc, self.fail_call = driver, _libc(), fail_call
        self.allocs, self.maps, self.reserves, self.next_id = {}, {}, {}, 1

    def __getattr__(self, name):  # enums and struct types are the real ones
        return getattr(self.real, name)

    def _ok(self, call, *values):
        if call == self.fail_call:
            return (self.real.CUresult.CUDA_ERROR_INVALID_VALUE, *[None] * len(values))
        return (self.real.CUresult.CUDA_SUCCESS, *values)

    def _new_handle(self, fd):
        self.allocs[self.next_id] = fd
        self.next_id += 1
        return self.real.CUmemGenericAllocationHandle(self.next_id - 1)

    def cuInit(self, flags): return self._ok("cuInit")
    def cuDeviceGet(self, i): return self._ok("cuDeviceGet", self.real.CUdevice(i))
    def cuDevicePrimaryCtxRetain(self, dev): return self._ok("cuDevicePrimaryCtxRetain", self.real.CUcontext(0))
    def cuDevicePrimaryCtxRelease(self, dev): return self._ok("cuDevicePrimaryCtxRelease")
    def cuCtxPushCurrent(self, ctx): return self._ok("cuCtxPushCurrent")
    def cuCtxPopCurrent(self): return self._ok("cuCtxPopCurrent", self.real.CUcontext(0))
    def cuCtxSynchronize(self): return self._ok("cuCtxSynchronize")
    def cuDeviceGetAttribute(self, attr, dev): return self._ok("cuDeviceGetAttribute", 1)
    def cuMemGetAllocationGranularity(self, prop, flag): return self._ok("cuMemGetAllocationGranularity", 1 << 16)
    def cuGetErrorString(self, err): return (self.real.CUresult.CUDA_SUCCESS, b"host stand-in error")

    def cuMemCreate(self, size, prop, flags):
        fd = os.memfd_create("mok_cute-host-vmm")
        os.ftruncate(fd, size)
        return self._ok("cuMemCreate", self._new_handle(fd))

    def cuMemAddressReserve(self, size, align, address, flags):
        base = _mmap(self.libc, None, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE)
        self.reserves[base] = size
        return self._ok("cuMemAddressReserve", self.real.CUdeviceptr(base))

    def cuMemMap(self, address, size, offset, handle, flags):
        fd = self.allocs[int(handle)]
        assert any(b <= address and address + size <= b + n for b, n in self.reserves.items()), "map outside a reservation"
        _mmap(self.libc, address, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd)
        self.maps[address] = size
        return self._ok("cuMemMap")

    def cuMemSetAccess(self, address, size, descs, count):
        assert self.maps.get(address) == size and count == len(descs) == 1
        return self._ok("cuMemSetAccess")

    def cuMemsetD8(self, address, value, n):
        ctypes.memset(address, value, n)
        return self._ok("cuMemsetD8")

    def cuMemExportToShareableHandle(self, handle, handle_type, flags):
        fd = self.allocs[int(handle)]
        if handle_type == self.real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
            fabric = self.real.CUmemFabricHandle()
            ctypes.memmove(fabric.getPtr(), _handle_bytes(fd, os.fstat(fd).st_size), 64)
            return self._ok("cuMemExportToShareableHandle", fabric)
        return self._ok("cuMemExportToShareableHandle", os.dup(fd))

    def cuMemImportFromShareableHandle(self, os_handle, handle_type):
        if self.fail_call == "cuMemImportFromShareableHandle":  # a failed call leaves nothing behind
            return self._ok("cuMemImportFromShareableHandle", None)
        if handle_type == self.real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
            fd, _, _ = _open_handle_bytes(ctypes.string_at(os_handle, 64))
        else:
            fd = os.dup(os_handle)
        return self._ok("cuMemImportFromShareableHandle", self._new_handle(fd))

    def cuMemUnmap(self, address, size):
        assert self.maps.pop(address) == size
        _mmap(self.libc, address, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_FIXED | _MAP_NORESERVE)
        return self._ok("cuMemUnmap")

    def cuMemRelease(self, handle):
        os.close(self.allocs.pop(int(handle)))
        return self._ok("cuMemRelease")

    def cuMemAddressFree(self, address, size):
        assert self.reserves.pop(int(address)) == size
        self.libc.munmap(address, size)
        return self._ok("cuMemAddressFree")

    def _copy(self, call, dst, src, n):
        ctypes.memmove(int(dst), int(src), n)
        return self._ok(call)

    def cuMemcpyHtoD(self, dst, src, n): return self._copy("cuMemcpyHtoD", dst, src, n)
    def cuMemcpyDtoD(self, dst, src, n): return self._copy("cuMemcpyDtoD", dst, src, n)
    def cuMemcpyDtoH(self, dst, src, n): return self._copy("cuMemcpyDtoH", dst, src, n)

    def live(self):
        return len(self.allocs) + len(self.maps) + len(self.reserves)


class _HostRuntime:
    def __init__(self, fail_call=None):
        from cuda.bindings import runtime

        self.real, self.libc, self.fail_call = runtime, _libc(), fail_call
        self.mallocs, self.opened = {}, {}

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _ok(self, call, *values):
        if call == self.fail_call:
            return (self.real.cudaError_t.cudaErrorInvalidValue, *[None] * len(values))
        return (self.real.cudaError_t.cudaSuccess, *values)

    def cudaSetDevice(self, i): return self._ok("cudaSetDevice")
    def cudaDeviceSynchronize(self): return self._ok("cudaDeviceSynchronize")

    def cudaMalloc(self, n):
        fd = os.memfd_create("mok_cute-host-malloc")
        os.ftruncate(fd, n)
        p = _mmap(self.libc, None, n, _PROT_RW, _MAP_SHARED, fd)
        self.mallocs[p] = (fd, n)
        return self._ok("cudaMalloc", p)

    def cudaMemset(self, p, value, n):
        ctypes.memset(p, value, n)
        return self._ok("cudaMemset")

    def cudaIpcGetMemHandle(self, p):
        fd, n = self.mallocs[p]
        handle = self.real.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), _handle_bytes(fd, n), 64)
        return self._ok("cudaIpcGetMemHandle", handle)

    def cudaIpcOpenMemHandle(self, handle, flags):
        if self.fail_call == "cudaIpcOpenMemHandle":  # a failed call leaves nothing behind
            return self._ok("cudaIpcOpenMemHandle", None)
        fd, n, pid = _open_handle_bytes(ctypes.string_at(handle.getPtr(), 64))
        assert pid != os.getpid(), "CUDA refuses to open a process's own IPC handle"
        p = _mmap(self.libc, None, n, _PROT_RW, _MAP_SHARED, fd)
        os.close(fd)
        self.opened[p] = n
        return self._ok("cudaIpcOpenMemHandle", p)

    def cudaIpcCloseMemHandle(self, p):
        self.libc.munmap(p, self.opened.pop(p))
        return self._ok("cudaIpcCloseMemHandle")

    def cudaFree(self, p):
        fd, n = self.mallocs.pop(p)
        self.libc.munmap(p, n)
        os.close(fd)
        return self._ok("cudaFree")

    def live(self):
        return len(self.mallocs) + len(self.opened)


def _check_host_ipc(rank, world):
    import contextlib

    from mok_cute.comm import ipc

    # This process has no GPU: route the device-facing pieces of IpcPeers to host memory.
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = lambda index: contextlib.nullcontext()
    ipc._bytes_tensor = lambda address, n, index: torch.frombuffer((ctypes.c_uint8 * n).from_address(address), dtype=torch.uint8)

    layout = moe_symmetric_layout(6, 32, 2, world)
    for handle_type in comm.HANDLE_TYPES:
        drv, rt = _HostDriver(), _HostRuntime()
        ipc._driver, ipc._runtime = (lambda: drv), (lambda: rt)
        with IpcPeers(None, layout, handle_type, timeout_s=30) as peers:
            table = peers.table
            assert table.backend == f"ipc:{handle_type}" and table.rank == rank
            if handle_type != "legacy":  # one reserved range, rank r at base + r * stride
                assert peers.stride % (1 << 16) == 0 and peers.stride >= layout.nbytes
                assert all(b - a == peers.stride for a, b in zip(table.addresses, table.addresses[1:]))
            assert not table.local.any(), f"{handle_type}: rank {rank}'s fresh buffer is not zero"
            dist.barrier()  # every rank has looked at its fresh buffer before anyone writes
            peer, src = (rank + 1) % world, (rank - 1) % world
            x = torch.arange(6 * 32, dtype=torch.float32).reshape(6, 32).add(1000 * rank).bfloat16()
            peers.write_peer(peer, "x", x)
            peers.write_peer(peer, BARRIER_FIELD, torch.tensor([5 + rank], dtype=torch.int32), byte_offset=4 * rank)
            dist.barrier()
            want = torch.arange(6 * 32, dtype=torch.float32).reshape(6, 32).add(1000 * src).bfloat16()
            assert torch.equal(table.view("x"), want), f"{handle_type}: rank {rank} x"
            assert torch.equal(peers.read_peer(rank, "x"), want)
            flags = table.view(BARRIER_FIELD).tolist()
            assert flags[src] == 5 + src and sum(flags) == 5 + src, flags
            table.view("combine").fill_(rank + 1)
            dist.barrier()
            assert torch.equal(peers.read_peer(peer, "combine"), torch.full((12, 32), peer + 1, dtype=torch.bfloat16))
            dist.barrier()
        assert drv.live() == 0 and rt.live() == 0, f"{handle_type}: leaked {drv.live()} + {rt.live()} resources"

    # A failure on one rank in one step: every rank raises, naming it, and releases everything.
    for handle_type, fail_call in (("posix_fd", "cuMemImportFromShareableHandle"), ("legacy", "cudaIpcOpenMemHandle")):
        drv = _HostDriver(fail_call if rank == 1 else None)
        rt = _HostRuntime(fail_call if rank == 1 else None)
        ipc._driver, ipc._runtime = (lambda: drv), (lambda: rt)
        try:
            IpcPeers(None, layout, handle_type, timeout_s=30)
        except RuntimeError as e:
            text = str(e)
            assert f"failed on 1 of {world} ranks" in text and f"{fail_call} failed on rank 1 for peer 0" in text, text
        else:
            raise AssertionError(f"rank {rank}: no error although rank 1's {fail_call} failed")
        assert drv.live() == 0 and rt.live() == 0, f"{handle_type}: leaked after a failed setup"


_SCENARIOS = {"exchange_fds": _check_exchange_fds, "host_ipc": _check_host_ipc}


def _process_worker(rank, world, tmp):
    """Run every multi-process scenario in one set of processes (one spawn: ~4 s on 2 cores),
    each rank writing a result per scenario for the tests below to read."""
    import json
    import traceback

    results = {}
    try:
        for name, check in _SCENARIOS.items():  # host_ipc last: it patches torch.cuda in this process
            try:
                check(rank, world, tmp) if name == "exchange_fds" else check(rank, world)
                results[name] = "ok"
            except BaseException:
                results[name] = traceback.format_exc()
            dist.barrier()
    finally:
        with open(os.path.join(tmp, f"result-{rank}.json"), "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def process_results(tmp_path_factory):
    import json

    if not (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")):
        pytest.skip("needs Linux memfd and /proc")
    world, tmp = 3, str(tmp_path_factory.mktemp("comm_processes"))
    gloo_group.spawn(_process_worker, world, tmp, tmp)
    by_rank = []
    for r in range(world):
        with open(os.path.join(tmp, f"result-{r}.json")) as f:
            by_rank.append(json.load(f))
    return {name: [res.get(name, "did not run") for res in by_rank] for name in _SCENARIOS}


def _assert_all_ranks_ok(results):
    failures = [f"rank {r}:\n{text}" for r, text in enumerate(results) if text != "ok"]
    assert not failures, "\n".join(failures)


def test_exchange_fds_between_processes(process_results):
    _assert_all_ranks_ok(process_results["exchange_fds"])


def test_ipc_plumbing_on_host_memory(process_results):
    _assert_all_ranks_ok(process_results["host_ipc"])
