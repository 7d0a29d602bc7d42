"""Host side of the backward megakernel (``kernels/megakernel/backward.py``), first stage: a
rank's routed dgrads (FC2's with the SwiGLU backward, then FC1's) in one persistent launch.

The task list is ``tasks_backward.build_backward_static`` for the schedule's capacity (every
M-tile present; the live count is read on the device, so routing never recompiles nor syncs),
with only the two dgrad kinds queued; it is built once per (capacity, H, I, grid, wait bound,
raster) and kept on the device. The outputs are bitwise those of ``expert_backward.fc2_dgrad`` and
``fc1_dgrad`` (the same tiles, k order and epilogues).

Not yet: the weight gradients, k-sum and shared expert as tasks of the launch, and the comm
tasks across ranks (issue 32; docs/architecture.md has the build order).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
import torch

from mok_cute import jit
from mok_cute.constants import BACKWARD_TILE_N, TILE_K, TILE_M


class DgradTables(NamedTuple):
    """One task list on the device: the encoded tasks, the compute queue and its live
    prefixes, the counters (zeroed before every launch), the error word, the scalars."""

    tasks: torch.Tensor
    queue: torch.Tensor
    live_len: torch.Tensor
    counter_offsets: torch.Tensor
    counters: torch.Tensor
    error: torch.Tensor
    scalars: torch.Tensor  # int64: [timeout_ns, tiles per minibatch]


_TABLES: dict[tuple, DgradTables] = {}
_LOCK = threading.Lock()


RASTER_M = 8  # M-tiles per raster group of the dgrad tasks (tasks_backward: L2 reuse of weights)


def tiles_per_minibatch(inter: int, num_ctas: int) -> int:
    """Whole raster groups of M-tiles whose FC2 dgrads fill the grid at least once (FC1's
    dgrads of a minibatch are queued after the next minibatch's FC2 dgrads)."""
    n_dgated = -(-inter // BACKWARD_TILE_N)
    groups = -(-num_ctas // (n_dgated * RASTER_M))
    return max(1, groups) * RASTER_M


def dgrad_tables(capacity_tiles: int, hidden: int, inter: int, num_ctas: int,
                 timeout_ms: float, device) -> DgradTables:
    """The device tables of the dgrad task list (cached per size, wait bound and device; the
    counters are shared by the launches of one size: calls on one stream)."""
    key = (capacity_tiles, hidden, inter, num_ctas, timeout_ms, RASTER_M, str(device))
    with _LOCK:
        tables = _TABLES.get(key)
        if tables is None:
            tables = _build_tables(capacity_tiles, hidden, inter, num_ctas, timeout_ms, device)
            _TABLES[key] = tables
    return tables


def _build_tables(capacity_tiles, hidden, inter, num_ctas, timeout_ms, device) -> DgradTables:
    from mok_cute import tasks_backward as tb

    per_mb = tiles_per_minibatch(inter, num_ctas)
    params = tb.BackwardListParams(
        hidden=hidden, intermediate=inter, num_tokens=0, top_k=1,
        dgated_tile_n=BACKWARD_TILE_N, dx_tile_n=BACKWARD_TILE_N,
        minibatch_tokens=per_mb * TILE_M, raster_m=RASTER_M, comm_tasks=False)
    # the weight gradients are not in this launch yet: a list of one expert keeps it short
    tl = tb.build_backward_static(capacity_tiles, 1, params)
    kinds = (tb.BackwardTaskType.FC2_DGRAD, tb.BackwardTaskType.FC1_DGRAD)
    qtab, live_len, _ = tb.queue_tables(tl, kinds=kinds)
    queue = qtab[int(tb.Role.COMPUTE)]
    queue = queue[queue >= 0]
    sizes = [tl.counter_sizes[g] for g in tb.BackwardCounter]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    as_i32 = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int32), device=device)  # noqa: E731
    return DgradTables(
        tasks=tb.encode_backward(tl).to(device),
        queue=as_i32(queue if queue.size else [-1]),
        live_len=as_i32(live_len[int(tb.Role.COMPUTE)]),
        counter_offsets=as_i32(offsets),
        counters=torch.zeros(max(int(offsets[-1]), 1), dtype=torch.int32, device=device),
        error=torch.zeros(1, dtype=torch.int64, device=device),
        scalars=torch.tensor([int(timeout_ms * 1e6), per_mb], dtype=torch.int64, device=device))


def expert_dgrads(d_rows, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
                  num_tiles, timeout_ms: float = 10_000.0, check: bool = False):
    """Both dgrads of the routed experts in one launch: (d_preact [M, 2I] = dG | dU, hw [M, I]
    = w * h, row partials [M, ceil(I / 256)] fp32, dx rows [M, H]); the arguments as
    ``expert_backward.fc2_dgrad`` (d_rows [M, H] with M = the schedule's capacity; w_gate,
    w_up [E, I, H], w_down [E, H, I]). ``check``: synchronise and raise if a wait of the
    launch gave up (a kernel bug: at one rank every wait is on this launch's own tasks)."""
    from mok_cute.expert_path import _num_sms, check_preact

    rows, hidden = d_rows.shape
    inter = w_gate.shape[1]
    if hidden % TILE_K or inter % TILE_K:
        raise ValueError(f"the backward megakernel needs H and I multiples of {TILE_K}, got "
                         f"H={hidden}, I={inter}")
    if rows % TILE_M or tile_expert.shape != (rows // TILE_M,):
        raise ValueError(f"d_rows: expected the schedule's capacity rows (a multiple of {TILE_M} "
                         f"with one tile_expert entry per {TILE_M}), got {rows} rows and "
                         f"tile_expert {tuple(tile_expert.shape)}")
    check_preact(preact, inter, row_slot, rows)
    device = d_rows.device
    partial_cols = -(-inter // BACKWARD_TILE_N)
    if rows == 0:  # no schedule row: nothing to launch
        return (d_rows.new_empty(0, 2 * inter), d_rows.new_empty(0, inter),
                torch.empty(0, partial_cols, dtype=torch.float32, device=device),
                d_rows.new_empty(0, hidden))
    num_ctas = _num_sms(device.index or 0)
    t = dgrad_tables(rows // TILE_M, hidden, inter, num_ctas, float(timeout_ms), device)
    t.counters.zero_()
    d_preact = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=device)
    hw = torch.empty(rows, inter, dtype=torch.bfloat16, device=device)
    partials = torch.empty(rows, partial_cols, dtype=torch.float32, device=device)
    dx_rows = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    kernel = jit.compile_kernel("megakernel_backward", jit.device_arch(device), num_ctas=num_ctas)
    kernel(t.tasks, t.queue, t.live_len, t.counter_offsets, t.counters, t.error, num_tiles,
           tile_expert, d_rows.unsqueeze(2), w_down.permute(2, 1, 0), d_preact.unsqueeze(2),
           w_gate.permute(2, 1, 0), w_up.permute(2, 1, 0), d_preact[:, :inter].unsqueeze(2),
           d_preact[:, inter:].unsqueeze(2), hw.unsqueeze(2), dx_rows.unsqueeze(2), preact,
           row_slot, weights, partials, t.scalars)
    if check:
        from mok_cute.errors import raise_on_wait_error

        word = int(t.error.item())
        t.error.zero_()
        raise_on_wait_error(word)
    return d_preact, hw, partials, dx_rows
