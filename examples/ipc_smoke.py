"""Smoke test of the `ipc` peer-memory backend: every rank maps every other rank's symmetric
buffer, pulls from it, pushes into it, and checks what it got.

    torchrun --nproc-per-node 2 examples/ipc_smoke.py                       # POSIX-FD VMM handles
    torchrun --nproc-per-node 2 examples/ipc_smoke.py --handle-type legacy  # cudaIpc* handles
    torchrun --nproc-per-node 8 examples/ipc_smoke.py --handle-type fabric  # needs an IMEX channel

Rank r uses GPU ``LOCAL_RANK % device_count`` (so 2 processes on a 1-GPU host share it). Per
rank it prints the bases table and one line per check; the exit status is non-zero if any
check failed on any rank.

1. pull:    every rank fills its own ``x`` with torch, then reads each peer's ``x`` through the
            mapping of that peer's buffer;
2. push:    every rank writes one row block into each peer's ``combine`` (block index = its
            rank), then checks that its own ``combine`` holds every peer's block;
3. flags:   every rank stores ``1`` into its word of each peer's ``barrier_flags`` (the unicast
            barrier's words, see `mok_cute.comm.BarrierSpec`), then checks its own flags.
"""

import os

# NVLink multicast stays off (shared hosts): set before torch, NCCL or NVSHMEM load.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mok_cute.comm import BARRIER_FIELD, HANDLE_TYPES, IpcPeers, moe_symmetric_layout  # noqa: E402


def pattern(rank: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """bf16 values distinct per (rank, salt): ranks sit 256 apart, wider than the bf16 spacing
    at these magnitudes, and rounding is deterministic, so writer and reader agree."""
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n) % 251) + 256 * rank + 4096 * salt).reshape(shape).to(torch.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handle-type", choices=HANDLE_TYPES, default="posix_fd")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="torch.distributed backend for the handle exchange (nccl needs one GPU per rank)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = moe_symmetric_layout(args.tokens, args.hidden, args.top_k, world)
    x_shape = layout.field("x").shape
    combine_rows, hidden = layout.field("combine").shape
    block = combine_rows // world  # rows of `combine` each peer writes into

    results: list[tuple[str, bool]] = []
    with IpcPeers(None, layout, args.handle_type, device=device) as peers:
        table = peers.table
        print(f"rank {rank}: cuda:{device} {table.backend}, {peers.nbytes} bytes per rank, "
              f"bases {[hex(a) for a in table.addresses]}", flush=True)

        table.view("x").copy_(pattern(rank, x_shape, 1).cuda())
        torch.cuda.synchronize()
        dist.barrier()
        for p in range(world):
            results.append((f"pull x from rank {p}", torch.equal(peers.read_peer(p, "x"), pattern(p, x_shape, 1))))

        mine = pattern(rank, (block, hidden), 2).cuda()
        for p in range(world):
            peers.write_peer(p, "combine", mine, byte_offset=rank * block * hidden * 2)
            peers.write_peer(p, BARRIER_FIELD, torch.ones(1, dtype=torch.int32), byte_offset=4 * rank)
        dist.barrier()
        combine = table.view("combine").cpu()
        for p in range(world):
            got = combine[p * block:(p + 1) * block]
            results.append((f"push combine block from rank {p}", torch.equal(got, pattern(p, (block, hidden), 2))))
        flags = table.view(BARRIER_FIELD).cpu().tolist()
        results.append((f"barrier flags {flags}", flags == [1] * world))
        dist.barrier()  # no rank unmaps while a peer may still touch its buffer

    for what, ok in results:
        print(f"rank {rank}: {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    failures = torch.tensor([sum(not ok for _, ok in results)])
    if args.backend == "nccl":
        failures = failures.cuda()
    dist.all_reduce(failures)
    total = int(failures.item())
    dist.destroy_process_group()
    if rank == 0:
        print(f"ipc smoke ({args.handle_type}, {world} ranks): {'PASS' if total == 0 else f'FAIL ({total} checks)'}")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
