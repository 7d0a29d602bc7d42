"""Host side of the backward megakernel (``kernels/megakernel/backward.py``): a rank's routed
dgrads (FC2's with the SwiGLU backward, then FC1's) and, when wanted, its weight gradients in
one persistent launch.

The task list is ``tasks_backward.build_backward_static`` for the schedule's capacity (every
M-tile present; the live count is read on the device, so routing never recompiles nor syncs)
and every expert's weight-gradient tiles (their waits resolved on the device from the expert
offsets), with only the kinds the launch runs queued; it is built once per (capacity, E, H, I,
grid, wait bound, raster, kinds) and kept on the device. The outputs are bitwise those of
``expert_backward.fc2_dgrad``, ``fc1_dgrad`` and ``wgrad`` (the same tiles, k order and
epilogues).

Over a group (``expert_grads_over_peers``, ``group_backward``'s bf16 path) the launch also
runs the comm tasks on CTAs of their own (``kernels/megakernel/backward_comm.py``): the d_out
rows, router weights and x rows pulled from their sources, each dx row and partial pushed into
its source's (token, k) slot, so the pulls hide under the first dgrads and the pushes under
the weight gradients. For one rank in its own process (``GroupTail``) the launch also runs
the group's two barriers and the k-sums of d_x and d_topk_weights on the comm CTAs
(``kernels/megakernel/backward_tail.py``), so a call is this one launch after the copies of
its own fields.

With ``shared`` (a ``SharedExpert``) the launch also runs the shared expert's backward over
this rank's tokens (``kernels/megakernel/backward_shared.py``): its FC2 dgrads lead the FC2
dgrads, its FC1 dgrads follow the routed ones, its weight gradients close the weight-gradient
tail, and the group tail's k-sums read its dx
rows as the launch writes them; the bits are ``expert_backward.shared_backward``'s.

Not yet: ranks of one process (virtual) keep the barriers and k-sums as launches of their own
(issue 32; docs/architecture.md has the build order).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import NamedTuple

import numpy as np
import torch

from mok_cute import jit
from mok_cute.config import check_tensor
from mok_cute.constants import (BACKWARD_COMM_ROWS, BACKWARD_COMM_SCALARS,
                                BACKWARD_KSUM_ROWS, BACKWARD_MAX_PARTIAL_COLS, BACKWARD_TILE_N,
                                SCALARS, TILE_K, TILE_M, fc2_dgrad_pingpong, fc2_dgrad_tile_n)
from mok_cute.errors import PendingErrors
from mok_cute.shared_state import BoundedCache, StreamOrder, capturing, retire_all


@dataclasses.dataclass
class DgradTables:
    """One task list on the device: the encoded tasks, the compute queue and its live
    prefixes, the counters (zeroed before every launch), the error word and its launches'
    pinned copies (read without a sync, as the forward's), the scalars."""

    tasks: torch.Tensor
    queue: torch.Tensor
    live_len: torch.Tensor
    counter_offsets: torch.Tensor
    counters: torch.Tensor
    error: torch.Tensor
    # int64: [timeout_ns, tiles per minibatch, tail begin, queue length, FC2_DGRAD count]
    scalars: torch.Tensor
    comm_queue: torch.Tensor  # int32: the comm tasks' list indices (a placeholder without)
    errors: PendingErrors = None
    calls: int = 0  # launches so far: the call number an error names
    order: StreamOrder = None  # its launches' counters: one launch at a time across streams

    def __post_init__(self):
        self.errors = PendingErrors(self.error, kernel="backward megakernel")
        self.order = StreamOrder()


def _retire(tables: DgradTables) -> None:
    """An evicted task list: its last launch waited for (its counters are freed after) and its
    pending errors raised."""
    tables.order.wait()
    tables.errors.check(block=True, last_call=tables.calls)


# task lists by size: each new capacity (the rows' tiles, which follow T) builds one (~0.5 s
# on the host, a few MiB on the device); a run with many batch sizes keeps the last 32
_TABLES = BoundedCache(32, pinned=lambda tables: tables.order.captured)
_LOCK = threading.Lock()


RASTER_M = 8  # M-tiles per raster group of the dgrad tasks (tasks_backward: L2 reuse of weights)


def tiles_per_minibatch(capacity_tiles: int) -> int:
    """One minibatch: every FC2 dgrad of the launch is queued before any FC1 dgrad. No comm
    task waits in this launch, so minibatches of the grid's size only interleaved a
    minibatch's FC1 dgrads with the next one's FC2 dgrads, twice the weights in flight at
    once; one minibatch measured 1.00-1.24 x their dgrads' speed (qwen3_30b most; H200,
    docs/measurements.md). The comm tasks of issue 32 will need minibatches again."""
    return max(1, capacity_tiles)


def dgrad_tables(capacity_tiles: int, hidden: int, inter: int, num_ctas: int,
                 timeout_ms: float, device, num_experts: int = 0,
                 comm: bool = False, tail_tokens: int = 0, top_k: int = 1,
                 shared: tuple[int, int, int] = (0, 0, 0), routed: bool = True) -> DgradTables:
    """The device tables of the backward task list (cached per size, wait bound and device;
    the counters are shared by the launches of one size: calls on one stream). ``num_experts``
    > 0: the weight gradients of that many experts are queued after the dgrads; 0: the
    dgrads alone. ``comm``: the rows' pulls and pushes are tasks too; ``tail_tokens`` > 0
    (with ``comm``): the group barrier and the k-sums of that many tokens, ``top_k`` slots
    each, too (the group tail). ``shared``: (T, Is, L) of the shared expert(s) whose backward
    the launch runs too (L ranks', or one's without a rank dimension: L = 0; their weight
    gradients with the routed ones'); (0, 0, 0): none. ``routed=False``: the shared expert's
    tasks alone are queued (``shared_expert_grads``)."""
    key = (capacity_tiles, num_experts, hidden, inter, num_ctas, timeout_ms, RASTER_M, comm,
           tail_tokens, top_k, tuple(shared), routed, str(device))
    with _LOCK:
        tables = _TABLES.get(key)
        if tables is None:
            tables = _build_tables(capacity_tiles, num_experts, hidden, inter, num_ctas,
                                   timeout_ms, device, comm, tail_tokens, top_k, shared, routed)
            evicted = _TABLES.put(key, tables)
        else:
            evicted = []
    retire_all(evicted, _retire)  # outside the lock: retiring waits on the device
    return tables


# Whether the launch runs FC2_DGRAD as pingpong 128 x 128 tiles at this H (as
# ``expert_backward.fc2_dgrad``'s launch does), else cooperative 128 x 256 (a module attribute:
# tools/megakernel_backward_probe.py swaps it to time the other form)
fc2_pingpong = fc2_dgrad_pingpong


def fc2_tile_n(hidden: int) -> int:
    """FC2_DGRAD's N-tile over I at this H (the row partials' column width)."""
    return fc2_dgrad_tile_n(fc2_pingpong(hidden))


def task_list(capacity_tiles: int, num_experts: int, hidden: int, inter: int,
              comm: bool = False, tail_tokens: int = 0, top_k: int = 1,
              shared: tuple[int, int, int] = (0, 0, 0), routed: bool = True):
    """The static backward list the launch walks, and the kinds it queues (weight gradients
    of ``num_experts`` experts after the dgrads; none when 0; with ``comm`` the rows' pulls,
    x's when the weight gradients run, and the pushes; with ``tail_tokens`` > 0 the BARRIER
    and the KSUMs of that many tokens; with ``shared`` = (T, Is, L) the shared experts' dgrads,
    and their weight gradients when the routed ones run; ``routed=False``: the shared
    experts' tasks alone, their weight gradients when ``num_experts`` > 0)."""
    from mok_cute import tasks_backward as tb

    per_mb = tiles_per_minibatch(capacity_tiles)
    tail = comm and tail_tokens > 0
    shared_tokens, shared_inter, shared_ranks = shared
    if tail and shared_inter and shared_tokens != tail_tokens:
        raise ValueError(f"the shared expert's {shared_tokens} tokens must be the group tail's "
                         f"{tail_tokens}")
    params = tb.BackwardListParams(
        hidden=hidden, intermediate=inter,
        num_tokens=tail_tokens if tail else shared_tokens if shared_inter else 0,
        shared_intermediate=shared_inter, shared_ranks=max(shared_ranks, 1),
        top_k=top_k if tail else 1,
        dgated_tile_n=fc2_tile_n(hidden), dx_tile_n=BACKWARD_TILE_N,
        minibatch_tokens=per_mb * TILE_M, raster_m=RASTER_M, comm_tasks=comm,
        comm_task_rows=BACKWARD_COMM_ROWS, ksum_rows=BACKWARD_KSUM_ROWS,
        x_resident=not (comm and num_experts))
    if not routed and not (shared_inter and not comm and not tail):
        raise ValueError("a launch without routed tasks runs a shared expert's, alone")
    kinds = (tb.BackwardTaskType.FC2_DGRAD, tb.BackwardTaskType.FC1_DGRAD) if routed else ()
    if comm:
        kinds += (tb.BackwardTaskType.REVERSE_COMBINE, tb.BackwardTaskType.REVERSE_DISPATCH)
        if num_experts:
            kinds += (tb.BackwardTaskType.REPULL_X,)
        if tail:
            kinds += (tb.BackwardTaskType.BARRIER, tb.BackwardTaskType.KSUM)
    if num_experts and routed:
        kinds += (tb.BackwardTaskType.WGRAD_DOWN, tb.BackwardTaskType.WGRAD_GATE_UP)
    if shared_inter:
        kinds += tb.SHARED_DGRADS
        if num_experts:
            kinds += (tb.BackwardTaskType.SHARED_WGRAD_GATE_UP,
                      tb.BackwardTaskType.SHARED_WGRAD_DOWN)
    # without weight gradients a list of one expert keeps it short
    return tb.build_backward_static(capacity_tiles, max(num_experts, 1), params), kinds


def compute_queue(tl, kinds):
    """The compute queue as the kernel reads it: (queue entries, live prefixes, tail begin,
    queue length). One entry past the queue: an empty walk (no live M-tile and no tail: a
    rank that received nothing) still decodes position ``tail begin``, a task it does not
    run (the kernel's registers are too tight for a clamp)."""
    from mok_cute import tasks_backward as tb

    qtab, live_len, tail_begin = tb.queue_tables(tl, kinds=kinds)
    queue = qtab[int(tb.Role.COMPUTE)]
    queue = queue[queue >= 0]
    entries = np.append(queue, queue[-1:]) if queue.size else np.array([-1])
    return entries, live_len[int(tb.Role.COMPUTE)], int(tail_begin[int(tb.Role.COMPUTE)]), queue.size


def fc2_head(tl, queue) -> int:
    """How many FC2_DGRAD tasks (the shared expert's among them) lead the compute queue (the
    scalar that ends the kernel's pingpong phase); none may come after them (one minibatch)."""
    from mok_cute import tasks_backward as tb

    fc2 = (tb.BackwardTaskType.FC2_DGRAD, tb.BackwardTaskType.SHARED_FC2_DGRAD)
    is_fc2 = [tl[int(i)].type in fc2 for i in queue]
    count = sum(is_fc2)
    if not all(is_fc2[:count]):
        raise AssertionError("FC2_DGRAD tasks must lead the backward megakernel's queue")
    return count


def ksum_head(tl, comm_queue) -> int:
    """The comm queue position of its first KSUM (its length without any): from there the
    KSUMs go by ticket (``backward_tail``), so none may come before a task of another kind."""
    from mok_cute import tasks_backward as tb

    is_ksum = [tl[int(i)].type == tb.BackwardTaskType.KSUM for i in comm_queue]
    begin = len(is_ksum) - sum(is_ksum)
    if any(is_ksum[:begin]):
        raise AssertionError("KSUM tasks must close the backward megakernel's comm queue")
    return begin


def _build_tables(capacity_tiles, num_experts, hidden, inter, num_ctas, timeout_ms,
                  device, comm=False, tail_tokens=0, top_k=1, shared=(0, 0, 0),
                  routed=True) -> DgradTables:
    from mok_cute import tasks_backward as tb

    tl, kinds = task_list(capacity_tiles, num_experts, hidden, inter, comm, tail_tokens, top_k,
                          shared, routed)
    per_mb = tiles_per_minibatch(capacity_tiles)
    queue, live_len, tail_begin, queue_len = compute_queue(tl, kinds)
    fc2_count = fc2_head(tl, queue[:queue_len])
    sizes = [tl.counter_sizes[g] for g in tb.BackwardCounter]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    as_i32 = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int32), device=device)  # noqa: E731
    comm_queue = tb.queue_tables(tl, kinds=kinds)[0][int(tb.Role.COMM)]
    comm_queue = comm_queue[comm_queue >= 0]
    ksum_begin = ksum_head(tl, comm_queue)
    return DgradTables(
        tasks=tb.encode_backward(tl).to(device),
        queue=as_i32(queue),
        live_len=as_i32(live_len),
        counter_offsets=as_i32(offsets),
        # the task counters, then the weight gradients' ticket counter, the KSUMs'
        counters=torch.zeros(int(offsets[-1]) + 2, dtype=torch.int32, device=device),
        error=torch.zeros(1, dtype=torch.int64, device=device),
        scalars=torch.tensor([int(timeout_ms * 1e6), per_mb, tail_begin, queue_len, fc2_count,
                              ksum_begin], dtype=torch.int64, device=device),
        comm_queue=as_i32(comm_queue if comm_queue.size else [-1]))


def expert_dgrads(d_rows, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
                  num_tiles, timeout_ms: float = 10_000.0, check: bool = False):
    """Both dgrads of the routed experts in one launch: (d_preact [M, 2I] = dG | dU, hw [M, I]
    = w * h, row partials [M, ceil(I / fc2_tile_n(H))] fp32, dx rows [M, H]); the arguments as
    ``expert_backward.fc2_dgrad`` (d_rows [M, H] with M = the schedule's capacity; w_gate,
    w_up [E, I, H], w_down [E, H, I]). ``check``: synchronise and raise if a wait of the
    launch gave up (a kernel bug: at one rank every wait is on this launch's own tasks)."""
    return _launch(d_rows, None, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
                   num_tiles, None, timeout_ms, check)


def expert_grads(d_rows, x_rows, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
                 num_tiles, expert_offsets, timeout_ms: float = 10_000.0, check: bool = False,
                 shared: SharedExpert | None = None, main_grads=None, timeline=None,
                 rows_per_expert: float | None = None):
    """Every GEMM of the routed experts' backward in one launch: ``expert_dgrads``' four
    outputs, then dW_gate, dW_up [E, I, H] and dW_down [E, H, I] (``expert_backward.wgrad``'s
    bits). x_rows [M, H]: the x row of each schedule row (zeros on padding rows, as d_rows);
    expert_offsets int32 [E + 1]: each expert's first schedule row. ``shared``: the shared
    expert's backward in the launch too, its ``SharedGrads`` appended
    (``expert_backward.shared_backward``'s bits). ``main_grads``: an
    ``expert_backward.MainGrads`` (buffers of these weights' and the shared expert's shapes):
    the weight gradients are added into its buffers, None returned for them (``_launch``), in
    the way ``gemm_wgrad.main_grad_add`` picks for ``rows_per_expert`` (the routing's expected
    rows an expert; None: the schedule's capacity over the experts).
    ``timeline``: a ``mok_cute.timeline.TimelineBuffer`` that the recorder build fills with
    every task's span (``kernels/megakernel/backward_recorder.py``)."""
    if x_rows is None or x_rows.shape != d_rows.shape:
        raise ValueError(f"x_rows: expected the schedule's rows {tuple(d_rows.shape)}, got "
                         f"{None if x_rows is None else tuple(x_rows.shape)}")
    if expert_offsets.shape != (w_gate.shape[0] + 1,):
        raise ValueError(f"expert_offsets: expected ({w_gate.shape[0] + 1},) for "
                         f"{w_gate.shape[0]} experts, got {tuple(expert_offsets.shape)}")
    return _launch(d_rows, x_rows, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
                   num_tiles, expert_offsets, timeout_ms, check, shared=shared,
                   main_grads=main_grads, timeline=timeline, rows_per_expert=rows_per_expert)


def shared_expert_grads(shared: SharedExpert, wgrads: bool = True,
                        timeout_ms: float = 10_000.0, check: bool = False,
                        main_grads=None) -> SharedGrads:
    """The shared expert's backward alone in one launch (every rank's, for a ``SharedExpert``
    with a rank dimension): its ``SharedGrads``, the weight gradients with ``wgrads``; the
    bits of ``expert_backward.shared_backward`` (its launches, rank by rank). ``main_grads``:
    a ``MainGrads`` whose shared entries take the weight gradients (``_launch``)."""
    hidden = shared.d_out.shape[-1]
    tokens, inter, ranks = check_shared(shared, hidden, shared.d_out.device)
    ranked = [t if ranks else t.unsqueeze(0) for t in shared]
    d_rows, row_slot, tile_expert, num_tiles, offsets = _no_routed_rows(hidden,
                                                                       shared.d_out.device)
    preact = ranked[5].reshape(-1, 2 * inter)
    return _launch(d_rows, d_rows if wgrads else None, *ranked[2:5], preact, row_slot,
                   _shared_rows(tokens, max(ranks, 1), shared.d_out.device)[1], tile_expert,
                   num_tiles, offsets, timeout_ms, check, shared=shared, routed=False,
                   main_grads=main_grads)


_NO_ROUTED: dict[tuple, tuple] = {}


def _no_routed_rows(hidden: int, device) -> tuple:
    """A launch without routed tasks: a schedule of one padding tile and no live one (d_rows,
    row_slot -1, tile_expert, num_tiles 0, expert offsets), never read (cached)."""
    key = (hidden, str(device))
    if key not in _NO_ROUTED:
        i32 = dict(dtype=torch.int32, device=device)
        _NO_ROUTED[key] = (torch.zeros(TILE_M, hidden, dtype=torch.bfloat16, device=device),
                           torch.full((TILE_M,), -1, **i32), torch.zeros(1, **i32),
                           torch.zeros(1, **i32), torch.zeros(2, **i32))
    return _NO_ROUTED[key]


class PeerRows(NamedTuple):
    """One rank's view of the group for the comm tasks: every peer's symmetric buffer, the
    source (peer, token, k) of each of its receive-schedule rows, the fields' byte offsets."""

    peer_bases: torch.Tensor  # int64 [P]
    row_peer: torch.Tensor  # int32 [M]: -1 on padding rows
    row_token: torch.Tensor  # int32 [M]
    row_k: torch.Tensor  # int32 [M]
    scalars: torch.Tensor  # int64 [BACKWARD_COMM_SCALARS]: d_out, x, router weights,
    #                        combine, d_topk partials offsets, top_k


class GroupTail(NamedTuple):
    """The group tail of one rank's launch (one process of a group, ``group_backward``): the
    group's barriers and the k-sums in the launch (``kernels/megakernel/backward_tail.py``)."""

    scalars: torch.Tensor  # int64 [SCALARS]: the plan's run-time words (epoch, flags, ...)
    error: torch.Tensor  # int64 [1]: the plan's backward error word (the launch's waits too)
    topk_idx: torch.Tensor  # int32 [T, K] global expert ids
    shared_dx: torch.Tensor | None  # bf16 [T, H]: the shared expert's dx rows, or None
    d_x: torch.Tensor  # bf16 [T, H], written
    d_topk: torch.Tensor  # fp32 [T, K], written


class SharedExpert(NamedTuple):
    """The shared expert's backward as tasks of the launch: one expert over a rank's T tokens
    (weight 1), or L of them with a leading rank dimension on every tensor (a virtual ranks'
    launch: rank r's expert over rank r's tokens). The launch returns their dx rows and, with
    the routed weight gradients, their own (``SharedGrads``)."""

    d_out: torch.Tensor  # bf16 [(L,) T, H] contiguous: d_out of the rank's tokens
    x: torch.Tensor  # bf16 [(L,) T, H] contiguous: its tokens (its gate / up weight gradients)
    w_gate: torch.Tensor  # bf16 [(L,) Is, H] contiguous
    w_up: torch.Tensor  # bf16 [(L,) Is, H] contiguous
    w_down: torch.Tensor  # bf16 [(L,) H, Is] contiguous
    preact: torch.Tensor  # bf16 [(L,) T, 2Is] contiguous: its g | u by token (the forward's)


class SharedGrads(NamedTuple):
    """What the launch computes of a ``SharedExpert`` (with its rank dimension if it had one):
    dx rows [(L,) T, H], and dWs_gate, dWs_up [(L,) Is, H], dWs_down [(L,) H, Is] (None
    without the routed weight gradients)."""

    dx: torch.Tensor
    w_gate: torch.Tensor | None
    w_up: torch.Tensor | None
    w_down: torch.Tensor | None


def check_shared(shared: SharedExpert, hidden: int, device) -> tuple[int, int, int]:
    """A ``SharedExpert``'s shapes as the launch reads them: (T, Is, L), L = 0 without a rank
    dimension."""
    if not isinstance(shared, SharedExpert):
        raise TypeError(f"shared: expected a SharedExpert, got {type(shared).__name__}")
    ranked = shared.d_out.dim() == 3
    lead = tuple(shared.d_out.shape[:1]) if ranked else ()
    tokens, inter = shared.d_out.shape[-2], shared.w_gate.shape[-2]
    if tokens == 0 or (ranked and lead[0] == 0):
        raise ValueError("shared.d_out: the shared expert's tasks need at least one token and "
                         "one rank (a TMA box over nothing)")
    if inter % TILE_K:
        raise ValueError(f"shared.w_gate: the backward megakernel needs Is a multiple of "
                         f"{TILE_K}, got Is={inter}")
    for name, shape in (("d_out", (tokens, hidden)), ("x", (tokens, hidden)),
                        ("w_gate", (inter, hidden)), ("w_up", (inter, hidden)),
                        ("w_down", (hidden, inter)), ("preact", (tokens, 2 * inter))):
        check_tensor(f"shared.{name}", getattr(shared, name), shape=lead + shape,
                     dtype=torch.bfloat16, device=device)
    return tokens, inter, lead[0] if ranked else 0


def _main_grad_add(rows: int, num_experts: int, shared_dims: tuple, routed: bool,
                   rows_per_expert: float | None = None) -> str:
    """How the launch adds its weight gradients into main_grad, by ``gemm_wgrad``'s rule on
    the routed experts' rows (``rows_per_expert`` where the caller knows the routing's; the
    shared expert's T tokens where only its tasks run)."""
    from mok_cute.kernels.gemm_wgrad import main_grad_add

    if not routed:
        return main_grad_add(shared_dims[0], 1)
    return main_grad_add(rows, num_experts, rows_per_expert)


def comm_scalars(layout, top_k: int, device) -> torch.Tensor:
    """``PeerRows.scalars`` of a symmetric layout (``comm.peers.SymmetricLayout``)."""
    offsets = [layout.offset(f) for f in ("d_out", "x", "router_weights", "combine",
                                          "d_topk_partials")]
    return torch.tensor([*offsets, top_k], dtype=torch.int64, device=device)


def expert_grads_over_peers(w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
                            num_tiles, expert_offsets, peers: PeerRows, wgrads: bool = True,
                            comm_ctas: int = 16, timeout_ms: float = 10_000.0,
                            check: bool = False, tail: GroupTail | None = None,
                            shared: SharedExpert | None = None, main_grads=None,
                            timeline=None, before_launch=None,
                            rows_per_expert: float | None = None):
    """A rank's routed backward over a group in one launch, its comm included: pulls the
    d_out rows, router weights (into ``weights`` fp32 [slots] at each row's ``row_slot``) and,
    with ``wgrads``, x rows of its receive rows from their sources; the dgrads; pushes each
    dx row into its source's ``combine`` slot and its partials' sum into ``d_topk_partials``;
    then the weight gradients; the comm on ``comm_ctas`` CTAs, the GEMMs on the SMs' rest.
    The peers' fields must be in place (the group's barrier 0) and the pushes are read after
    the group's barrier 1 (``group_backward``), unless ``tail`` puts both barriers and the
    k-sums of d_x and d_topk_weights into the launch (one rank per process; its waits then
    record into ``tail.error``). Returns ``expert_grads``' outputs (dW only with ``wgrads``),
    bitwise theirs on the same rows; ``shared``: the shared expert's backward in the launch
    too (its ``SharedGrads`` appended; with ``tail`` the k-sums add its dx rows);
    ``main_grads``, ``timeline``, ``rows_per_expert`` as ``expert_grads``'; ``before_launch``:
    called between the kernel's compile and its launch (``group_backward`` lines the ranks up
    there)."""
    rows = row_slot.shape[0]
    hidden = w_gate.shape[2]
    for name, t in (("row_peer", peers.row_peer), ("row_token", peers.row_token),
                    ("row_k", peers.row_k)):
        if t.shape != (rows,) or t.dtype != torch.int32:
            raise ValueError(f"peers.{name}: expected int32 ({rows},), got {t.dtype} "
                             f"{tuple(t.shape)}")
    device = w_gate.device
    d_rows = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    x_rows = torch.empty_like(d_rows) if wgrads else None
    if tail is not None:
        tokens, top_k = tail.topk_idx.shape
        for name, t, shape, dtype in (
                ("tail.topk_idx", tail.topk_idx, (tokens, top_k), torch.int32),
                ("tail.d_x", tail.d_x, (tokens, hidden), torch.bfloat16),
                ("tail.d_topk", tail.d_topk, (tokens, top_k), torch.float32),
                ("tail.shared_dx", tail.shared_dx, (tokens, hidden), torch.bfloat16)):
            if t is not None:
                check_tensor(name, t, shape=shape, dtype=dtype, device=device)
    return _launch(d_rows, x_rows, w_gate, w_up, w_down, preact, row_slot, weights,
                   tile_expert, num_tiles, expert_offsets if wgrads else None, timeout_ms,
                   check, peers, comm_ctas, tail, shared, main_grads=main_grads,
                   timeline=timeline, before_launch=before_launch,
                   rows_per_expert=rows_per_expert)


def _launch(d_rows, x_rows, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert,
            num_tiles, expert_offsets, timeout_ms, check, peers: PeerRows | None = None,
            comm_ctas: int = 0, tail: GroupTail | None = None,
            shared: SharedExpert | None = None, routed: bool = True, main_grads=None,
            timeline=None, before_launch=None, rows_per_expert: float | None = None):
    """One backward-megakernel launch; the weight gradients when ``x_rows`` is given; the
    comm tasks with ``peers`` (which then fill d_rows and x_rows); the group tail with
    ``tail``; the shared expert's backward with ``shared`` (its ``SharedGrads`` appended to
    the outputs; with the tail, its dx rows are what the k-sums add, ``tail.shared_dx``
    unused). ``routed=False``: the shared expert's tasks alone (the routed tensors stand in
    for the kernel's arguments, never read); returns its ``SharedGrads``. ``main_grads`` (an
    ``expert_backward.MainGrads``, with the weight gradients): the build that adds every
    weight gradient of the launch into fp32 (``accumulate_wgrads``), into the buffer given
    for a weight (None returned for it), else into zeros returned in bf16 (the bits of the
    bf16 build: both round the fp32 accumulator to nearest). ``timeline``: a
    ``TimelineBuffer`` on this device that the recorder build fills (``expert_grads``)."""
    from mok_cute.expert_path import _num_sms, check_preact

    rows, hidden = d_rows.shape
    num_experts, inter = w_gate.shape[0], w_gate.shape[1]
    if hidden % TILE_K or inter % TILE_K:
        raise ValueError(f"the backward megakernel needs H and I multiples of {TILE_K}, got "
                         f"H={hidden}, I={inter}")
    if rows % TILE_M or tile_expert.shape != (rows // TILE_M,):
        raise ValueError(f"d_rows: expected the schedule's capacity rows (a multiple of {TILE_M} "
                         f"with one tile_expert entry per {TILE_M}), got {rows} rows and "
                         f"tile_expert {tuple(tile_expert.shape)}")
    check_preact(preact, inter, row_slot, rows)
    device = d_rows.device
    if timeline is not None:
        from mok_cute.timeline import TimelineBuffer

        if not isinstance(timeline, TimelineBuffer) or timeline.device != device:
            raise TypeError(f"timeline: expected a mok_cute.timeline.TimelineBuffer on {device}, "
                            f"got {type(timeline).__name__}"
                            + (f" on {timeline.device}" if isinstance(timeline, TimelineBuffer)
                               else ""))
    wgrads = x_rows is not None
    comm = peers is not None
    partial_cols = -(-inter // fc2_tile_n(hidden))
    if rows == 0 and (tail is not None or shared is not None):
        raise ValueError("the group tail and the shared expert need a launch: the schedule "
                         "has no row (capacity 0)")
    shared_dims = (0, 0, 0) if shared is None else check_shared(shared, hidden, device)
    if rows == 0:  # no schedule row: nothing to launch (no expert has rows: zero gradients)
        # (a main_grad buffer gets nothing added: None returned for it)
        buffers = main_grads.routed if main_grads is not None else (None,) * 3
        dw = tuple(torch.zeros_like(w) if b is None else None
                   for w, b in zip((w_gate, w_up, w_down), buffers)) if wgrads else ()
        pulled = (d_rows, x_rows) if comm else ()
        return (*pulled, d_rows.new_empty(0, 2 * inter), d_rows.new_empty(0, inter),
                torch.empty(0, partial_cols, dtype=torch.float32, device=device),
                d_rows.new_empty(0, hidden), *dw)
    if comm and partial_cols > BACKWARD_MAX_PARTIAL_COLS:
        raise ValueError(f"the backward over a group sums at most {BACKWARD_MAX_PARTIAL_COLS} "
                         f"dgated partials a row, got I={inter}")
    num_comm = comm_ctas if comm else 0
    num_ctas = _num_sms(device.index or 0) - num_comm
    if comm and not 1 <= num_comm < num_ctas:
        raise ValueError(f"comm_ctas: expected 1 to half the SMs, got {comm_ctas}")
    tail_tokens, top_k = tail.topk_idx.shape if tail is not None else (0, 1)
    t = dgrad_tables(rows // TILE_M, hidden, inter, num_ctas, float(timeout_ms), device,
                     num_experts if wgrads else 0, comm, tail_tokens, top_k, shared_dims,
                     routed)
    error = t.error if tail is None else tail.error
    if tail is None:  # an earlier launch whose wait gave up raises here (wrong gradients)
        t.errors.check(block=False, last_call=t.calls)
    t.order.enter(device)  # a launch of these tables on another stream finishes first
    t.counters.zero_()
    d_preact = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=device)
    hw = torch.empty(rows, inter, dtype=torch.bfloat16, device=device)
    partials = torch.empty(rows, partial_cols, dtype=torch.float32, device=device)
    dx_rows = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    # the weight gradients' operands, (cols, rows, 1) with cols contiguous
    dg_t, du_t, dy_t, hw_t = (a.t().unsqueeze(2) for a in
                              (d_preact[:, :inter], d_preact[:, inter:], d_rows, hw))
    from mok_cute.kernels.gemm_wgrad import wgrad_outputs

    accumulate = wgrads and main_grads is not None
    routed_buffers = main_grads.routed if accumulate and routed else None
    dw, dw_returned = (), lambda: ()
    if wgrads and routed:  # every tile of every expert is stored (zeros for an expert without rows)
        dw, dw_returned = wgrad_outputs([w.shape for w in (w_gate, w_up, w_down)], device,
                                        routed_buffers, "main_grads")
        w_args = (expert_offsets, dg_t, du_t, x_rows.t().unsqueeze(2), dy_t, hw_t,
                  *(w.permute(1, 2, 0) for w in dw))
    else:  # no routed weight-gradient task runs: the dgrads' own tensors stand in (fp32 ones
        # of the same shapes for the accumulating build)
        stand_in = ((lambda w: torch.empty(w.shape, dtype=torch.float32, device=device))
                    if accumulate else (lambda w: w))
        w_args = (expert_offsets if wgrads else tile_expert, dg_t, du_t, dy_t, dy_t, hw_t,
                  *(stand_in(w).permute(1, 2, 0) for w in (w_gate, w_up, w_down)))
    if comm:
        c_args = (t.comm_queue, peers.row_peer, peers.row_token, peers.row_k, peers.peer_bases,
                  peers.scalars, d_rows, d_rows if x_rows is None else x_rows, dx_rows)
    else:  # no comm task runs: tensors of the right kinds stand in
        c_args = (t.comm_queue, tile_expert, tile_expert, tile_expert, t.error, _placeholder(device),
                  d_rows, d_rows, dx_rows)
    s_args, s_grads, s_returned = _shared_args(shared, shared_dims, wgrads, device,
                                               main_grads.shared if accumulate else None)
    if s_args is None:  # no shared task runs: the routed tensors of the same kinds stand in
        s_args = (d_rows.unsqueeze(2), w_down[0].t().unsqueeze(2), d_preact.unsqueeze(2),
                  *(w[0].t().unsqueeze(2) for w in (w_gate, w_up)),
                  d_preact[:, :inter].unsqueeze(2), d_preact[:, inter:].unsqueeze(2),
                  hw.unsqueeze(2), dx_rows.unsqueeze(2), *w_args[1:6],
                  *(w.permute(2, 0, 1)[0].unsqueeze(2) for w in w_args[6:9]), preact, row_slot,
                  weights)
    if tail is not None:
        ksum_shared = shared is not None or tail.shared_dx is not None
        shared_dx = s_grads.dx if shared is not None else tail.shared_dx
        g_args = (tail.scalars, tail.topk_idx, shared_dx if ksum_shared else tail.d_x,
                  tail.d_x, tail.d_topk)
    else:  # no group tail: tensors of the right kinds stand in
        ksum_shared = False
        g_args = _tail_placeholders(device, hidden)
    kernel = jit.compile_kernel("megakernel_backward", jit.device_arch(device), num_ctas=num_ctas,
                                fc2_pingpong=fc2_pingpong(hidden), comm_ctas=num_comm,
                                ksum_top_k=top_k if tail is not None else 0,
                                ksum_shared=ksum_shared, shared=shared is not None,
                                accumulate_wgrads=accumulate, timeline=timeline is not None,
                                main_grad_add=_main_grad_add(rows, num_experts, shared_dims,
                                                             routed, rows_per_expert)
                                if accumulate else "reduce")
    if before_launch is not None:
        before_launch()
    kernel(t.tasks, t.queue, t.live_len, t.counter_offsets, t.counters, error, num_tiles,
           tile_expert, d_rows.unsqueeze(2), w_down.permute(2, 1, 0), d_preact.unsqueeze(2),
           w_gate.permute(2, 1, 0), w_up.permute(2, 1, 0), d_preact[:, :inter].unsqueeze(2),
           d_preact[:, inter:].unsqueeze(2), hw.unsqueeze(2), dx_rows.unsqueeze(2), preact,
           row_slot, weights, partials, t.scalars, *w_args, *c_args, *g_args, *s_args,
           t.error if timeline is None else timeline.tensor)  # the error word: never read
    t.order.leave(device)
    if tail is None:  # with the tail the caller records the plan's word
        t.calls += 1
        t.errors.record(t.calls)
        if check:
            t.errors.check(block=True, last_call=t.calls)
    s_grads = s_returned()
    dw = dw_returned()
    if not routed:
        return s_grads
    s_out = () if shared is None else (s_grads,)
    if comm:
        return (d_rows, x_rows, d_preact, hw, partials, dx_rows, *dw, *s_out)
    return (d_preact, hw, partials, dx_rows, *dw, *s_out)


def _shared_args(shared: SharedExpert | None, dims: tuple[int, int, int], wgrads: bool,
                 device, buffers=None):
    """The kernel's ``s_*`` arguments of a shared expert's tasks, the ``SharedGrads`` they
    fill (their weight gradients with ``wgrads``) and a function giving the ``SharedGrads`` to
    return once the launch is queued, or (None, None, a function giving None) without one.
    ``buffers``: (dWs_gate, dWs_up, dWs_down) main_grad buffers or None each, shaped as the
    shared weights (the accumulating build: ``gemm_wgrad.wgrad_outputs``). The launch's
    buffers pad each rank's rows to whole tiles (``kernels/megakernel/backward_shared.py``)."""
    if shared is None:
        return None, None, lambda: None
    from mok_cute.expert_path import check_preact_rows

    tokens, inter, ranks = dims
    ranked = ranks > 0
    L = max(ranks, 1)
    check_preact_rows(L * tokens, inter, "shared.preact")  # read by rank r's slot r T + t
    ops = [t if ranked else t.unsqueeze(0) for t in shared]  # [L, ...]
    d_out, x, w_gate, w_up, w_down, preact = ops
    hidden = d_out.shape[2]
    padded = -(-tokens // TILE_M) * TILE_M
    bf16 = dict(dtype=torch.bfloat16, device=device)
    d_preact = torch.empty(L, padded, 2 * inter, **bf16)
    hw = torch.empty(L, padded, inter, **bf16)
    dx = torch.empty(L, padded, hidden, **bf16)
    flat = lambda t: t.view(L * padded, t.shape[2]).unsqueeze(2)  # noqa: E731
    dg, du = d_preact[..., :inter], d_preact[..., inter:]
    # the weight gradients' operands (cols, T, L) and outputs (rows, cols, L)
    by_rank = lambda t: t[:, :tokens].permute(2, 1, 0)  # noqa: E731
    dw, dw_returned = (None, None, None), lambda: (None, None, None)
    outs = (w_gate, w_up, w_down)  # no weight-gradient task runs: stand-ins never written
    if wgrads:
        from mok_cute.kernels.gemm_wgrad import wgrad_outputs

        if buffers is not None and not ranked:
            buffers = tuple(None if b is None else b.unsqueeze(0) for b in buffers)
        dw, dw_returned = wgrad_outputs([w.shape for w in outs], device, buffers,
                                        "main_grads.ws")
        outs = dw
    rows, ones = _shared_rows(tokens, L, device)
    d_preact_rows = flat(d_preact)
    args = (d_out.permute(1, 2, 0), w_down.permute(2, 1, 0), d_preact_rows,
            w_gate.permute(2, 1, 0), w_up.permute(2, 1, 0),
            d_preact_rows[:, :inter], d_preact_rows[:, inter:], flat(hw), flat(dx),
            by_rank(dg), by_rank(du), x.permute(2, 1, 0), d_out.permute(2, 1, 0), by_rank(hw),
            *(w.permute(1, 2, 0) for w in outs), preact.reshape(L * tokens, 2 * inter), rows,
            ones)
    def unranked(grads):
        return grads if ranked else SharedGrads(*(None if g is None else g[0] for g in grads))

    return (args, unranked(SharedGrads(dx[:, :tokens], *dw)),
            lambda: unranked(SharedGrads(dx[:, :tokens], *dw_returned())))


_SHARED_ROWS = BoundedCache(32)  # by (T, ranks, device): a few bytes a token each


def _shared_rows(tokens: int, ranks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared experts' padded row -> slot map (rank r's row r T_pad + t: slot r T + t,
    -1 past T) and unit weights, what their dgated epilogue reads in place of the routed
    rows' slots and router weights (cached per T and L)."""
    key = (tokens, ranks, str(device))
    with _LOCK:  # calls from several threads
        cached = _SHARED_ROWS.get(key)
    if cached is None or capturing():  # a graph's own copy (the cache may free this one)
        padded = -(-tokens // TILE_M) * TILE_M
        t = torch.arange(padded, device=device)
        slots = torch.arange(ranks, device=device)[:, None] * tokens + t
        rows = torch.where(t < tokens, slots, -1).to(torch.int32).reshape(-1)
        cached = (rows, torch.ones(ranks * tokens, dtype=torch.float32, device=device))
        if not capturing():
            with _LOCK:
                _SHARED_ROWS.put(key, cached)
    elif torch.device(device).type == "cuda":
        # an eviction frees them while this call's launch may still read them on another
        # stream than the one they were made on: the allocator waits for this stream first
        stream = torch.cuda.current_stream(device)
        for t in cached:
            t.record_stream(stream)
    return cached


_PLACEHOLDERS: dict[str, torch.Tensor] = {}


def _placeholder(device) -> torch.Tensor:
    """The comm scalars of a launch without comm tasks (never read)."""
    key = str(device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(BACKWARD_COMM_SCALARS, dtype=torch.int64, device=device)
    return _PLACEHOLDERS[key]


_TAIL_PLACEHOLDERS: dict[tuple, tuple] = {}


def _tail_placeholders(device, hidden: int) -> tuple:
    """The group tail's arguments of a launch without it (never read): scalars, topk_idx,
    shared_dx, d_x, d_topk."""
    key = (str(device), hidden)
    if key not in _TAIL_PLACEHOLDERS:
        row = torch.zeros(1, hidden, dtype=torch.bfloat16, device=device)
        _TAIL_PLACEHOLDERS[key] = (torch.zeros(SCALARS, dtype=torch.int64, device=device),
                                   torch.zeros(1, 1, dtype=torch.int32, device=device), row, row,
                                   torch.zeros(1, 1, dtype=torch.float32, device=device))
    return _TAIL_PLACEHOLDERS[key]


def check_errors() -> None:
    """``mok_cute.check_errors``' part for the backward megakernel: every launch's error word
    (synchronises), then each table's word on the device (CUDA-graph replays)."""
    with _LOCK:
        tables = list(_TABLES.values())
    for t in tables:
        t.errors.check(block=True, last_call=t.calls)
        t.errors.check_device(t.calls)
