"""Test data for the FP8 quantizer tests: bf16 matrices over a wide exponent range, and the
bytes of an e4m3 tensor for bitwise comparisons."""

from __future__ import annotations

import torch

bf16 = torch.bfloat16


def as_bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def wide_bf16(gen, m: int, k: int, zero_groups: bool = True) -> torch.Tensor:
    """bf16 [m, k] with per-row scales 2**-20 .. 2**20, heavy-tailed elements (some far below
    the group's amax), and some all-zero 1 x 128 groups."""
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    x *= torch.pow(2.0, torch.randint(-20, 21, (m, 1), generator=gen).to(torch.float64))
    tail = torch.randint(0, 24, (m, k), generator=gen) * (torch.rand(m, k, generator=gen) < 0.2)
    x *= torch.pow(2.0, -tail.to(torch.float64))
    x = x.to(bf16)
    if zero_groups and k >= 128:
        g = k // 128
        for r in range(0, m, 5):
            c = int(torch.randint(0, g, (1,), generator=gen)) * 128
            x[r, c:c + 128] = 0
    return x
