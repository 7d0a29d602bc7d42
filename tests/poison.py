"""Poison the CUDA caching allocator's free memory before a launch under test.

A kernel that skips a write leaves what the memory held before. The tests compare outputs
(and run twice for determinism), so that memory must not hold a plausible value: NaN bytes
everywhere the next ``torch.empty`` can land. Filling one large NaN tensor and freeing it is
not enough: allocations up to 1 MiB come from the allocator's small pool (2 MiB segments,
never carved out of a large block), and a repeat run's same-sized buffers land first in the
blocks the previous run just freed, still holding its correct values.

`poison_free_memory` reads the allocator's snapshot after a device-wide synchronize and writes
0xFF bytes (NaN in bf16, fp32 and e4m3; -1 in an int) over every block of every cached segment
that no tensor holds, by address (``cuMemsetD8``): allocating a free block's size to fill it
would not reach it (the pool follows the requested size, not the block's, and a request splits
other blocks or maps a new segment). Then one fresh large NaN block, freed, for allocations the
cache cannot serve yet.
"""

from __future__ import annotations

import torch


def poison_free_memory(fresh_bytes: int = 1 << 28, device: int | None = None) -> int:
    """NaN-fill every free byte the allocator has cached on ``device`` (default: the current
    one) and a fresh block of ``fresh_bytes``; returns the bytes poisoned."""
    from mok_cute.comm.ipc import _driver, check_cuda

    driver = _driver()
    device = torch.cuda.current_device() if device is None else device
    fresh = torch.full((fresh_bytes,), 0xFF, dtype=torch.uint8, device=device)
    del fresh
    torch.cuda.synchronize(device)  # every stream idle: no free block is still being read
    poisoned = 0
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] != device:
            continue
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                check_cuda(driver.cuMemsetD8(address, 0xFF, block["size"]), "cuMemsetD8")
                poisoned += block["size"]
            address += block["size"]
    torch.cuda.synchronize(device)
    return poisoned


PLAN_BUFFERS = ("ring_x", "ring_h", "ring_y", "shared_h", "shared_y")


def poison_megakernel_plans() -> None:
    """NaN-fill what a cached megakernel plan keeps between calls and every call rewrites: its
    rings, the shared expert's rows and the combine field of its symmetric buffer (not the
    barrier flags and counters, whose values are the protocol). A repeat call on the plan then
    cannot read the previous call's rows in place of its own."""
    from mok_cute import megakernel

    for plan in megakernel._all_plans():
        for name in PLAN_BUFFERS:
            buffer = getattr(plan, name, None)
            if buffer is not None:
                buffer.view(torch.uint8).fill_(0xFF)
        for field in plan.side.fields("combine"):
            field.view(torch.uint8).fill_(0xFF)
