"""The `ipc` backend on a real GPU: two processes on ONE GPU (gloo group over a file store;
NCCL refuses two ranks on one device) map each other's symmetric buffers, write through the
mapped addresses and read back. Also the virtual backend's addresses as device pointers.

Run on a GPU host:  python -m pytest -q tests/test_comm_ipc_gpu.py
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from mok_cute import comm
from mok_cute.comm import BARRIER_FIELD, IpcPeers, VirtualPeers, moe_symmetric_layout

import gloo_group

pytestmark = pytest.mark.gpu

# NVLink multicast stays off on shared hosts (issue 7); nothing here uses it, this is a guard.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

T, H, K = 48, 256, 4  # a small symmetric buffer: x [48, 256], combine [192, 256] bf16


def _pattern(rank: int, shape, salt: int) -> torch.Tensor:
    """bf16 values distinct per (rank, salt): ranks sit 256 apart, wider than the bf16 spacing
    at these magnitudes, and rounding is deterministic, so writer and reader agree."""
    n = torch.tensor(shape).prod().item()
    return ((torch.arange(n) % 251) + 256 * rank + 4096 * salt).reshape(shape).to(torch.bfloat16)


def _ipc_worker(rank, world, handle_type):
    torch.cuda.set_device(0)  # both ranks on one GPU
    layout = moe_symmetric_layout(T, H, K, world)
    with IpcPeers(None, layout, handle_type, device=0, timeout_s=60) as peers:
        table = peers.table
        assert table.backend == f"ipc:{handle_type}" and table.rank == rank and table.num_ranks == world
        assert table.bases.device == torch.device("cuda", 0) and table.bases.dtype == torch.int64
        assert table.bases.tolist() == list(table.addresses)
        assert len(set(table.addresses)) == world
        table.validate()
        # Fresh buffers are zero (the barrier flags rely on it).
        assert not table.local.any().item()
        dist.barrier()  # every rank has looked at its fresh buffer before anyone writes

        peer = (rank + 1) % world
        x_shape, c_shape = layout.field("x").shape, layout.field("combine").shape
        # 1. Push into the peer's buffer through our mapping: x from a CUDA tensor (DtoD),
        #    combine from a CPU tensor (HtoD), and our barrier flag word in the peer's flags.
        peers.write_peer(peer, "x", _pattern(rank, x_shape, 1).cuda())
        peers.write_peer(peer, "combine", _pattern(rank, c_shape, 2))
        peers.write_peer(peer, BARRIER_FIELD, torch.tensor([7 + rank], dtype=torch.int32), byte_offset=4 * rank)
        dist.barrier()
        src = (rank - 1) % world  # who wrote into our buffer
        x_torch = table.view("x").cpu()  # our own buffer, read by torch through the view
        x_driver = peers.read_peer(rank, "x")  # the same bytes, read by the driver
        assert torch.equal(x_torch, _pattern(src, x_shape, 1)), f"rank {rank}: x from rank {src} differs"
        assert torch.equal(x_driver, x_torch)
        assert torch.equal(table.view("combine").cpu(), _pattern(src, c_shape, 2))
        flags = table.view(BARRIER_FIELD).cpu().tolist()
        assert flags[src] == 7 + src and all(f == 0 for q, f in enumerate(flags) if q != src), flags
        dist.barrier()

        # 2. Pull: write our own buffer with a torch kernel, the peer reads it through its mapping.
        table.view("x").copy_(_pattern(rank, x_shape, 3).cuda())
        torch.cuda.synchronize()
        dist.barrier()
        assert torch.equal(peers.read_peer(peer, "x"), _pattern(peer, x_shape, 3)), f"rank {rank}: pull from {peer}"
        dist.barrier()  # nobody closes while a peer may still read its buffer
    assert peers._table is None and repr(peers).endswith("closed)")
    peers.close()  # idempotent


def _spawn(handle_type, world=2):
    with tempfile.TemporaryDirectory() as tmp:
        gloo_group.spawn(_ipc_worker, world, tmp, handle_type)


@pytest.mark.parametrize("handle_type", ["posix_fd", "legacy"])
def test_ipc_two_processes_one_gpu(handle_type):
    _spawn(handle_type)


def test_ipc_fabric_two_processes_one_gpu():
    ok, why = comm.fabric_support(0)
    if not ok:
        pytest.skip(f"FABRIC handles unavailable: {why}")
    _spawn("fabric")


def test_ipc_bad_handle_type_before_any_cuda_call():
    with pytest.raises(ValueError, match="handle_type: expected one of"):
        IpcPeers(None, moe_symmetric_layout(T, H, K, 2), "cuda_ipc")


def test_virtual_addresses_are_device_pointers():
    """On CUDA the virtual tables' bases are device pointers: the driver reads what torch wrote."""
    drv = pytest.importorskip("cuda.bindings.driver")
    R = 8
    layout = moe_symmetric_layout(T, H, K, R)
    peers = VirtualPeers(R, layout, device="cuda")
    assert peers.bases.is_cuda and peers.bases_matrix().is_cuda
    for r in range(R):
        peers.view(r, "x").copy_(_pattern(r, layout.field("x").shape, 0))
    torch.cuda.synchronize()
    table = peers.table(3).validate()
    for r in range(R):
        out = torch.empty(layout.field("x").shape, dtype=torch.bfloat16)
        comm.check_cuda(drv.cuMemcpyDtoH(out.data_ptr(), table.address(r, "x"), out.nbytes), "cuMemcpyDtoH", peer=r)
        assert torch.equal(out, _pattern(r, out.shape, 0)), f"rank {r}"
