"""Poison the CUDA caching allocator's free memory before a launch under test.

A kernel that skips a write leaves what the memory held before. The tests compare outputs
(and run twice for determinism), so that memory must not hold a plausible value: NaN bytes
everywhere the next ``torch.empty`` can land. Filling one large NaN tensor and freeing it is
not enough: allocations up to 1 MiB come from the allocator's small pool (2 MiB segments,
never carved out of a large block), and a repeat run's same-sized buffers land first in the
blocks the previous run just freed, still holding its correct values.

`poison_free_memory` reads the allocator's snapshot, allocates every free block of every
cached segment (best fit: a request of a free block's exact size takes that block or one as
large), fills it with 0xFF bytes (NaN in bf16, fp32 and e4m3; -1 in an int) and frees it, then
adds one fresh large NaN block for allocations the cache cannot serve yet.
"""

from __future__ import annotations

import torch


def poison_free_memory(fresh_bytes: int = 1 << 28, device: int | None = None) -> int:
    """NaN-fill the allocator's free blocks on ``device`` (default: the current one) and a fresh
    block of ``fresh_bytes``; returns the bytes poisoned."""
    device = torch.cuda.current_device() if device is None else device
    torch.cuda.synchronize(device)
    sizes = [block["size"] for segment in torch.cuda.memory_snapshot()
             if segment["device"] == device
             for block in segment["blocks"] if block["state"] == "inactive"]
    held = []
    for size in sorted(sizes):
        held.append(torch.empty(size, dtype=torch.uint8, device=device))
        held[-1].fill_(0xFF)
    held.append(torch.full((fresh_bytes,), 0xFF, dtype=torch.uint8, device=device))
    poisoned = sum(t.numel() for t in held)
    del held
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
