"""Host side of the megakernel: buffers, schedules, the task list and one launch per call.

    moe_forward_virtual (R ranks on one GPU)   -> Plan(_VirtualSide)  R ranks in one launch
    moe_forward (one GPU, group=None)          -> the same with R = 1
    moe_forward (group=..., one process/GPU)   -> Plan(_IpcSide)      this rank's launch; peers'
                                                  buffers mapped through comm.ipc

A training forward (``save=True``, issue 32) runs its own plan whose kernel's FC1 tasks also
store the bf16 g | u of every routed row (``SavedPreact``): at one rank by (token, k) slot, the
one-GPU path's layout and bits; one rank of a group by receive row, where its backward reads
them; virtual ranks in one pool by global slot (peer, token, k), R * T * K rows.

A plan is built once per (shapes, config, device) and reused: the symmetric peer buffers,
the ring buffers, the encoded task list and the compiled kernel. A call then copies x into
the symmetric buffers, builds the receive schedules on the device (no host sync), bumps the
epoch on the device, zeroes the counters and launches the kernel once.

Failures: a call whose launch could not complete (a wait timed out, or a peer reported its
own launch failed) has NaN in every output row it could not complete, never a plausible wrong
row (``kernels.megakernel.kernel``), and raises ``PeerTimeoutError`` naming the call, the rank
and the peer: from that call itself when it synchronises anyway (``check_ids=True``: the id
check's read is the same wait), otherwise from a later call of the same plan once the failed
launch has finished, or from ``mok_cute.check_errors()``. The kernel's error word is read back
without a sync: it is copied into one of a few pinned words after the launch; each call polls
the earlier copies without waiting (``Event.query``). Waiting for the previous launch at the
start of a call would idle the GPU for the host work of every call (about 1 ms on dsv3,
docs/measurements.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from typing import NamedTuple

import torch

from mok_cute import fp8, jit, task_encoding, tasks as tasks_mod
from mok_cute.expert_path_fp8 import pad_cols, padded  # fp8 plans: H', I' whole 128 groups
from mok_cute.config import MoKConfig, ids_for_int32
from mok_cute.constants import (KSUM_ROWS, SCALAR_INDEX, TASK_TILE_N, TICKETS, TILE_M,
                                MegakernelSpec)
from mok_cute.errors import PendingErrors
from mok_cute.shared_state import BoundedCache, StreamOrder, retire_all

DEFAULT_COMM_CTAS = 12
LOCAL_DIRECT_COMM_CTAS = 10  # the floor with several ranks copying only their remote rows


class SavedPreact(NamedTuple):
    """What a training forward through the megakernel keeps of FC1, per rank of the launch."""

    preact: torch.Tensor  # [rows, 2I] bf16, g then u: T * K by slot at one rank, by receive row
    # on one rank of a group, by global slot on virtual ranks (one pool: schedule.saved_preact_rows)
    row_slot: torch.Tensor  # [R, capacity] int32: each schedule row's preact row, -1 on padding
    shared_preact: torch.Tensor | None  # [R, T, 2Is] bf16 by token, or None
    schedules: object = None  # the launch's ReceiveSchedules (built for this call)
    plan: object = None  # the Plan that ran it: its peers, flags and epoch serve the backward
    # one rank of a group with MoKConfig.saved_rows_factor (preact's rows its budget, packed in
    # schedule order) or saved_rows_pool (preact the pool, this call's rows packed after the
    # earlier calls'): how many routed rows found no place (int64 0-d on the device)
    missing: torch.Tensor | None = None
    # with saved_rows_pool: the pool holds this call's rows while this empty tensor lives
    lease: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class PlanKey:
    """Everything a plan's buffers, task list and kernel depend on: the shapes, the resolved
    sizes and the kernel's static configuration."""

    tokens: int
    hidden: int
    intermediate: int
    local_experts: int
    shared_intermediate: int
    minibatch_tokens: int
    ring_tokens: int
    timeline_capacity: int
    device: int
    group: tuple | None  # (id(process group), handle type) for the IPC backend
    fc1_lead: int
    x_in_place: bool  # one rank with rows in place: the caller's x is read where it is
    local_only: bool  # ... and no row crosses a comm CTA: the list has no comm task
    spec: MegakernelSpec

    @property
    def num_ranks(self) -> int:
        return self.spec.num_ranks

    @property
    def top_k(self) -> int:
        return self.spec.top_k


def default_num_comm_ctas(num_peers: int, hidden: int, top_k: int, num_sms: int,
                          rows_in_place: bool = False, intermediate: int = 0,
                          shared_intermediate: int = 0) -> int:
    """With one peer and rows in place no row crosses a comm CTA: 0 (the compute CTAs run the
    barrier). Otherwise the best point of the H200 sweeps with every row copied (12, on dsv3
    and sonic_120b), or with rows in place on several ranks 10, raised to the split where the
    comm CTAs' copy time matches the compute CTAs' GEMM time (``comm_compute_balance``) when
    that needs more: shapes with little compute per routed row (small ``intermediate``)
    starve FC1 otherwise (docs/measurements.md, the R = 8 sweep). EP groups over NVLink take
    the simulator's pick (``sim.tune.tuned_config``, resolved before the plan)."""
    if rows_in_place and num_peers == 1:
        return 0
    base = max(2, min(num_sms // 4, LOCAL_DIRECT_COMM_CTAS if rows_in_place else DEFAULT_COMM_CTAS))
    if not intermediate:
        return base
    balance = comm_compute_balance(num_peers, hidden, intermediate, top_k, shared_intermediate,
                                   num_sms, rows_in_place)
    return min(num_sms // 4, max(base, balance))


COMM_CTA_GBPS = 22.0  # row bytes one comm CTA copies per second, GB (qwen3.5 R = 8, run 58)
COMPUTE_CTA_TFLOPS = 5.6  # one compute CTA's share of a ~740 TFLOP/s grouped GEMM


def comm_compute_balance(num_peers: int, hidden: int, intermediate: int, top_k: int,
                         shared_intermediate: int, num_sms: int, local_direct: bool) -> int:
    """Comm CTAs c at which copying a routed row (dispatch + combine, remote rows only with
    local_direct) on c CTAs takes as long as its GEMMs (and its share of the shared expert's)
    on num_sms - c: c = num_sms * b / (1 + b), b = copy time / compute time per CTA. The
    hidden size cancels: b grows as the intermediate size shrinks."""
    remote = (num_peers - 1) / num_peers if local_direct else 1.0
    copy_us = 2 * 2 * hidden * remote / (COMM_CTA_GBPS * 1e3)
    compute_us = 6 * hidden * (intermediate + shared_intermediate / top_k) / (COMPUTE_CTA_TFLOPS * 1e6)
    b = copy_us / compute_us
    return math.ceil(num_sms * b / (1 + b))


def fc1_lead_minibatches(compute_ctas: int, tiles_per_minibatch: int, fc1_n_tiles: int) -> int:
    """The default FC1 lead L (``MegakernelOptions.fc1_lead``): the fewest minibatches whose
    FC1 tiles fill every compute CTA, so the CTAs taking a minibatch's FC2 tickets find its
    FC1 tiles already done."""
    per_minibatch = max(1, tiles_per_minibatch * fc1_n_tiles)
    return -(-compute_ctas // per_minibatch)


def plan_tokens(tokens: int) -> int:
    """The T an EP group's plan is built for: the group's largest T rounded up to one of eight
    steps per doubling (at least 128 rows), so variable-length batches reuse a bounded set of
    plans (each holds IPC-mapped buffers and took a collective to build) at most 12.5 % of
    padding rows, which route nowhere. Powers of two and their multiples of T / 8 stay."""
    if tokens <= 0:
        return 0
    step = max(TILE_M, 1 << max(0, tokens.bit_length() - 4))
    return -(-tokens // step) * step


def resolve_sizes(config: MoKConfig, capacity: int, tokens: int) -> tuple[int, int]:
    """(minibatch_tokens, ring_tokens): None picks defaults (minibatch of 8 tiles; a ring that
    holds every row, so nothing wraps); explicit values are whole tiles (``MoKConfig``
    checks) and the ring must hold a minibatch."""
    tile = config.tile_m
    minibatch = config.minibatch_tokens or min(capacity, 8 * tile)
    ring = config.ring_tokens or capacity
    if ring < minibatch:
        raise ValueError(f"MoKConfig.ring_tokens must be >= minibatch_tokens={minibatch}, got {ring}")
    return min(minibatch, capacity), min(ring, capacity)


X_FP8_FIELD = "x_fp8"  # fp8 plans: each rank's x as packed e4m3 rows, what DISPATCH pulls


def _fp8_fields(k: PlanKey) -> list:
    """The symmetric buffer's extra fields of a plan: fp8's packed x rows."""
    if not k.spec.fp8:
        return []
    return [(X_FP8_FIELD, (k.tokens, fp8.packed_row_bytes(padded(k.hidden))), torch.uint8)]


class _VirtualSide:
    """R virtual ranks in one launch (``comm.virtual``): one allocation, the [R, R] table."""

    scope = "gpu"

    def __init__(self, k: PlanKey, dev: torch.device):
        from mok_cute.comm import VirtualPeers, moe_symmetric_layout

        self.peers = VirtualPeers(k.num_ranks, moe_symmetric_layout(
            k.tokens, k.hidden, k.top_k, k.num_ranks, training=k.spec.save_preact,
            extra_fields=_fp8_fields(k)), device=dev)
        self.layout = self.peers.layout
        self.launch_ranks = self.num_peers = k.num_ranks
        self.rank_base = 0
        self.peer_bases = self.peers.bases_matrix()
        self.own_base = self.peers.addresses[0]  # rank 0's symmetric buffer (host copy of the table)
        bf16 = self.peers.buffer.view(torch.bfloat16)
        # x of every rank as one (R, T, H) view of the symmetric buffer
        self.x = bf16.as_strided((k.num_ranks, k.tokens, k.hidden),
                                 (self.peers.nbytes // 2, k.hidden, 1), self.layout.offset("x") // 2)
        self.x_fp8 = None  # fp8: every rank's packed x rows, (R, T, packed row bytes) uint8
        if k.spec.fp8:
            width = fp8.packed_row_bytes(padded(k.hidden))
            self.x_fp8 = self.peers.buffer.view(torch.uint8).as_strided(
                (k.num_ranks, k.tokens, width), (self.peers.nbytes, width, 1),
                self.layout.offset(X_FP8_FIELD))
        self.local_experts = k.local_experts

    def fields(self, name: str) -> list[torch.Tensor]:
        """Field ``name`` of each rank of the launch's own buffer."""
        return [self.peers.view(r, name) for r in range(self.launch_ranks)]

    def schedules(self, ids: torch.Tensor):
        """Every virtual rank's receive schedule, stacked (the GPU build: one pair of launches
        for all R)."""
        from mok_cute.schedule import build_receive_schedules

        return build_receive_schedules(ids, self.local_experts, TILE_M, validate=False)


class _IpcSide:
    """One rank of a process group (``comm.ipc``): this process's launch covers its own rank;
    the peers' buffers are mapped into it and their flags are read at system scope."""

    scope = "sys"

    def __init__(self, k: PlanKey, dev: torch.device, group, handle_type: str):
        import torch.distributed as dist

        from mok_cute.comm import IpcPeers, moe_symmetric_layout
        from mok_cute.comm.agreement import ready_for_collective

        ready_for_collective(group)  # the buffers' setup is a collective of the group
        self.group = group
        self.num_peers = dist.get_world_size(group)
        self.peers = IpcPeers(group, moe_symmetric_layout(k.tokens, k.hidden, k.top_k,
                                                          self.num_peers,
                                                          training=k.spec.save_preact,
                                                          extra_fields=_fp8_fields(k)),
                              handle_type, device=dev)
        if handle_type != "legacy":
            # unmapped and released once the plan is gone (released from the cache and no
            # saved forward holds it): an imported VMM handle keeps each peer's memory alive
            # for that peer, so this needs no collective; a legacy cudaIpc buffer must outlive
            # its importers, so it stays until the process ends
            weakref.finalize(self, self.peers.close)
        self.layout = self.peers.layout
        self.launch_ranks = 1
        self.rank_base = self.peers.rank
        self.peer_bases = self.peers.table.bases.unsqueeze(0).contiguous()
        self.own_base = self.peers.table.addresses[self.rank_base]
        self.x = self.peers.view("x").unsqueeze(0)
        self.x_fp8 = self.peers.view(X_FP8_FIELD).unsqueeze(0) if k.spec.fp8 else None
        self.local_experts = k.local_experts

    def fields(self, name: str) -> list[torch.Tensor]:
        """Field ``name`` of this rank's own buffer (one rank in the launch)."""
        return [self.peers.view(name)]

    def schedules(self, ids: torch.Tensor):
        """All-gather the routing (an NCCL collective on the stream: no host sync), then this
        rank's receive schedule (stacked, one rank)."""
        import torch.distributed as dist

        from mok_cute.comm.agreement import ready_for_collective
        from mok_cute.schedule import build_receive_schedules

        ready_for_collective(self.group, last=True)  # a rank that failed before: all raise
        gathered = [torch.empty_like(ids[0]) for _ in range(self.num_peers)]
        dist.all_gather(gathered, ids[0].contiguous(), group=self.group)
        return build_receive_schedules(torch.stack(gathered), self.local_experts, TILE_M,
                                       first_rank=self.rank_base, count=1, validate=False)


class Plan:
    """Everything one shape needs: peer buffers (virtual or IPC), rings, the encoded task list
    and the compiled kernel. ``R`` below is the number of ranks in this launch."""

    def __init__(self, key: PlanKey, side):
        from mok_cute.schedule import schedule_capacity

        self.key = k = key
        self.side = side
        self.order = StreamOrder()  # the plan's buffers: one launch at a time across streams
        self.aligned_builds: set = set()  # group_backward: the backward builds run so far
        dev = torch.device("cuda", k.device)
        self.capacity = schedule_capacity(side.num_peers, k.tokens, k.top_k, k.local_experts, TILE_M)
        layout = side.layout
        self.x_all = side.x
        self.own_base = side.own_base
        self.x_offset = layout.offset(X_FP8_FIELD if k.spec.fp8 else "x")
        self._x_offset = self.x_offset  # as held in the scalar x_offset
        self.task_list = tasks_mod.build_static(
            self.capacity, hidden=k.hidden, intermediate=k.intermediate, num_tokens=k.tokens,
            top_k=k.top_k, minibatch_tokens=k.minibatch_tokens, ring_tokens=k.ring_tokens,
            shared_intermediate=k.shared_intermediate, num_ranks=side.num_peers,
            fc1_tile_n=TASK_TILE_N, fc2_tile_n=TASK_TILE_N, fc1_lead=k.fc1_lead,
            ksum_rows=KSUM_ROWS, comm_tasks=not k.local_only, tile_order="n_major",
            barrier_in_compute=k.spec.num_comm_ctas == 0)
        if not self.task_list.ksum_closes_compute_queue():
            # every rank's list has this one's structure, so one check covers the launch
            raise RuntimeError("the k-sum reuses the GEMM stage buffers: every compute task "
                               "after the first KSUM must be a KSUM")
        self.device_tasks = task_encoding.encode_device(self.task_list, device=dev)
        R, C = side.launch_ranks, k.ring_tokens
        if k.spec.fp8:  # x and h rows packed: e4m3 data, then the row's exponents
            self.hidden_p, self.inter_p = padded(k.hidden), padded(k.intermediate)
            self.ring_x = torch.empty(R, C, fp8.packed_row_bytes(self.hidden_p), dtype=torch.uint8,
                                      device=dev)
            self.ring_h = torch.empty(R, C, fp8.packed_row_bytes(self.inter_p), dtype=torch.uint8,
                                      device=dev)
        else:
            self.ring_x = torch.empty(R, C, k.hidden, dtype=torch.bfloat16, device=dev)
            self.ring_h = torch.empty(R, C, k.intermediate, dtype=torch.bfloat16, device=dev)
        self.ring_y = torch.empty(R, C, k.hidden, dtype=torch.bfloat16, device=dev)
        self.shared_h = self.shared_y = None
        if k.shared_intermediate:
            self.shared_h = torch.empty(R, k.tokens, k.shared_intermediate, dtype=torch.bfloat16, device=dev)
            self.shared_y = torch.empty(R, k.tokens, k.hidden, dtype=torch.bfloat16, device=dev)
        self.peer_bases = side.peer_bases
        # per-rank task counters, then (row 0 only) the comm / compute ticket counters
        self.counters = torch.zeros(R, self.device_tasks.num_counters + TICKETS, dtype=torch.int32,
                                    device=dev)
        self.error = torch.zeros(1, dtype=torch.int64, device=dev)
        self.errors = PendingErrors(self.error)  # each launch's word, read without a sync
        self.calls = 0  # launches so far: the call number an error names
        # the backward over the group's barriers (group_backward): their own word
        self.backward_error = torch.zeros(1, dtype=torch.int64, device=dev)
        self.backward_errors = PendingErrors(self.backward_error,
                                             kernel="backward over the group")
        self.backward_calls = 0
        self.timeline_buf = None
        if k.spec.timeline:
            from mok_cute.timeline import TimelineBuffer
            self.timeline = TimelineBuffer(k.timeline_capacity, device=dev)
            self.timeline_buf = self.timeline.tensor
        # epoch (bumped on the device each call), first rank, tiles per minibatch, offsets,
        # timeout, local experts, static M-tiles, silent rank (test hook, see run())
        self.scalars = torch.tensor(
            [0, side.rank_base, k.minibatch_tokens // TILE_M, self.x_offset,
             layout.offset("combine"), layout.offset("barrier_flags"), 0, k.local_experts,
             self.capacity // TILE_M, -1], dtype=torch.int64, device=dev)
        self._waits = (0, -1)  # (timeout ns, silent rank) as held in the scalars
        self.kernel = jit.compile_kernel("megakernel", jit.device_arch(dev),
                                         **dataclasses.asdict(k.spec))
        self._no_slot_rows = torch.full((R, 1), -1, dtype=torch.int32, device=dev)
        if k.spec.save_preact:
            # the shared expert's rows are its tokens; several ranks keep g | u by receive row
            # (at one rank by slot: the one-GPU layout)
            self._token_rows = torch.arange(k.tokens, dtype=torch.int32, device=dev)
            self._receive_rows = torch.arange(self.capacity, dtype=torch.int32, device=dev)
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ one call
    def run(self, xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared, timeout_ms: float,
            out: torch.Tensor | None = None, silent_rank: int = -1, fp8_weights=None,
            saved_rows_factor: float | None = None, saved_rows_pool=None):
        """xs (R, T, H) bf16, topk_idx (R, T, K) global ids, topk_weights (R, T, K),
        w_* (R, E_loc, ., .), shared: None or (gate, up, down) with a leading R (R = the ranks
        of this launch: all virtual ranks, or 1 for this process's rank of a group) -> out
        (R, T, H), and with a saving plan (``spec.save_preact``) (out, ``SavedPreact``).
        ``silent_rank`` (tests only): that rank never announces its start, so every wait on
        it times out, as if its process had died. An fp8 plan takes the routed experts' weights
        as ``fp8_weights`` (``expert_path_fp8.Fp8Weights``, the launch's E experts stacked)
        instead of w_*. ``saved_rows_factor``, ``saved_rows_pool``: ``MoKConfig``'s (a saving
        plan of one rank of a group)."""
        k = self.key
        self.errors.check(block=False, last_call=self.calls)
        self.order.enter(xs.device)  # a launch of this plan on another stream finishes first
        R = self.side.launch_ranks
        # With no peer to read it, the caller's x is read in place (FC1's local rows, the
        # shared expert) instead of being copied into the symmetric buffer first.
        in_place = k.x_in_place and xs.is_contiguous() and xs.data_ptr() % 16 == 0  # TMA base
        x_own = xs if in_place else self.x_all
        if not in_place and (not k.spec.fp8 or shared is not None):  # fp8: the shared expert's
            self.x_all.copy_(xs)
        # the kernel finds this rank's x rows at peer_bases[rank][rank] + x_offset
        x_offset = xs.data_ptr() - self.own_base if in_place else self.x_offset
        if k.spec.fp8:
            x_offset = self._quantize_x(xs)
        # rewritten only when it changes; once a graph captured the plan, in every call (a
        # replay must not read what a later eager call wrote, nor that call what a replay did)
        if x_offset != self._x_offset or self.order.captured:
            self._x_offset = x_offset
            self.scalars[SCALAR_INDEX["x_offset"]].fill_(x_offset)
        ids = ids_for_int32(topk_idx, self.side.num_peers * k.local_experts)  # never truncated
        scheds = self.side.schedules(ids)  # stacked: [R, ...] per field, no copies
        slot_rows = self._no_slot_rows
        if k.spec.rows_in_place:
            slot_rows = scheds.slot_rows
            if slot_rows is None:  # the torch build at R > 1 leaves it to row_of_slot
                from mok_cute.schedule import row_of_slot

                slot_rows = torch.stack([row_of_slot(scheds[r], k.tokens, k.top_k, scheds.first_rank + r)
                                         for r in range(len(scheds))])
        num_tiles = scheds.num_tiles
        self.scalars[SCALAR_INDEX["epoch"]].add_(1)
        self.calls += 1
        self._set_waits((int(timeout_ms * 1e6), silent_rank))
        self.counters.zero_()
        self.error.zero_()
        if self.timeline_buf is not None:
            self.timeline.reset()
        if out is None:
            out = torch.empty(R, k.tokens, k.hidden, dtype=torch.bfloat16, device=xs.device)
        E = R * k.local_experts
        kmajor = lambda t: t.permute(1, 2, 0)  # (L, rows, K) -> (rows, K, L)  # noqa: E731
        flat = lambda w: w.reshape(E, *w.shape[2:])  # noqa: E731
        rings = (kmajor(self.ring_x), kmajor(self.ring_h), kmajor(self.ring_y))
        weights = (kmajor(flat(w_gate)), kmajor(flat(w_up)), kmajor(flat(w_down)))
        fp8_args = (None,) * 4
        if k.spec.fp8:  # int8 views of the e4m3 data; the rings' rows packed
            hp, ip = self.hidden_p, self.inter_p
            i8 = lambda t: t.view(torch.int8)  # noqa: E731
            rings = (kmajor(i8(self.ring_x[..., :hp])), kmajor(i8(self.ring_h[..., :ip])),
                     rings[2])
            fw = fp8_weights
            weights = (kmajor(i8(fw.gate)), kmajor(i8(fw.up)), kmajor(i8(fw.down)))
            fp8_args = (kmajor(i8(self.ring_h[..., ip:ip + ip // fp8.GROUP])), fw.e_gate,
                        fw.e_up, fw.e_down)
        s_args = [None] * 6
        if shared is not None:
            s_args = [kmajor(x_own), kmajor(shared[0]), kmajor(shared[1]), kmajor(shared[2]),
                      kmajor(self.shared_h), kmajor(self.shared_y)]
        saved, saved_args = None, (None,) * 4
        if k.spec.save_preact:
            saved = self._saved_preact(scheds, shared is not None, saved_rows_factor,
                                       saved_rows_pool)._replace(schedules=scheds, plan=self)
            # every rank of the launch writes into the one pool (rank stride 0)
            saved_args = (kmajor(saved.preact.unsqueeze(0).expand(R, -1, -1)), saved.row_slot,
                          None if shared is None else kmajor(saved.shared_preact),
                          None if shared is None else self._token_rows)
        d = self.device_tasks
        self.kernel(
            d.tasks, d.queues, d.queue_len, d.queue_live_len, d.queue_blocks,
            d.counter_offsets, self.counters, self.error, num_tiles, scheds.tile_expert,
            scheds.row_peer, scheds.row_token, scheds.row_k, self.peer_bases, *rings, *weights,
            *s_args, topk_weights.to(torch.float32), ids, slot_rows, out, self.timeline_buf,
            self.scalars, *saved_args, *fp8_args)
        if self.timeline_buf is not None:
            from mok_cute.timeline import set_last
            set_last(self.timeline)  # what `mok-cute timeline` decodes after the call
        self.order.leave(xs.device)
        self.errors.record(self.calls)
        return out if saved is None else (out, saved)

    def _quantize_x(self, xs: torch.Tensor) -> int:
        """fp8: every rank's x rows quantized 1 x 128 into packed rows (x zero-padded to H')
        in the symmetric field, where DISPATCH and rows in place read them -> the x offset the
        kernel adds to a rank's symmetric base."""
        from mok_cute.kernels import quantize

        R, T, H = xs.shape
        rows = pad_cols(xs.reshape(R * T, H), self.hidden_p)
        if R == 1:
            quantize.quantize_packed_rows(rows, self.side.x_fp8[0])
        else:  # the ranks' fields are a buffer apart: one strided copy from a staging buffer
            staging = quantize.quantize_packed_rows(
                rows, torch.empty(R * T, self.ring_x.shape[2], dtype=torch.uint8,
                                  device=xs.device))
            self.side.x_fp8.copy_(staging.view(R, T, -1))
        return self.x_offset

    def _set_waits(self, waits: tuple[int, int]) -> None:
        """The wait bound (ns) and the silent rank (test hook) the kernels read: rewritten
        only when they change, so a call launches nothing for them (in every call once a
        graph captured the plan)."""
        if waits != self._waits or self.order.captured:
            self._waits = waits
            self.scalars[SCALAR_INDEX["timeout_ns"]].fill_(waits[0])
            self.scalars[SCALAR_INDEX["silent_rank"]].fill_(waits[1])

    def begin_backward(self, silent_rank: int = -1) -> None:
        """A backward over the group (``group_backward``) starts: a new epoch for its barriers
        (the forward's flags: they only grow), its call number and error word, and the silent
        rank (test hook: that rank stores no flag) under the last forward's wait bound."""
        self.scalars[SCALAR_INDEX["epoch"]].add_(1)
        self.backward_calls += 1
        self.backward_error.zero_()
        self._set_waits((self._waits[0], silent_rank))

    def _saved_preact(self, scheds, has_shared: bool, saved_rows_factor: float | None = None,
                      saved_rows_pool=None) -> SavedPreact:
        """The buffers a saving launch's FC1 tasks write and each schedule row's place in
        them (on the device, no host sync). One rank of a group keeps its rows in
        ``saved_rows_pool`` (a ``SavedRowsPool``) or packed under its budget, if given."""
        from mok_cute.expert_path import check_preact_rows
        from mok_cute.saved_rows import kept_saved_rows, packed_saved_slots
        from mok_cute.schedule import saved_preact_rows

        k, R = self.key, self.side.launch_ranks
        dev = scheds.row_token.device
        valid = scheds.row_token >= 0
        group_rank = self.side.num_peers > 1 and R == 1
        pool = saved_rows_pool if group_rank else None
        kept = (kept_saved_rows(self.side.num_peers, k.tokens, k.top_k, saved_rows_factor)
                if group_rank else None)
        rows = (pool.rows(k.intermediate) if pool is not None else
                kept or saved_preact_rows(R, self.side.num_peers, k.tokens, k.top_k,
                                          k.local_experts, TILE_M))
        # refused before the launch: its save epilogue would write past the buffer's start
        check_preact_rows(rows, k.intermediate)
        if has_shared:
            check_preact_rows(R * k.tokens, k.shared_intermediate, "shared_preact")
        missing, preact, lease = None, None, None
        if pool is not None:  # packed after the pool's earlier calls' rows, overflow told
            preact, row_slot, missing, lease = pool.take(valid, k.intermediate)
        elif kept is not None:  # one rank of a group keeping a row budget: packed, overflow told
            row_slot, missing = packed_saved_slots(valid, kept)
        else:
            if self.side.num_peers == 1:  # by (token, k) slot: the one-GPU path's layout
                index = scheds.row_token * k.top_k + scheds.row_k
            elif group_rank:  # one rank of a group: by receive row (the worst case's rows)
                index = self._receive_rows.expand(R, -1)
            else:  # virtual ranks: by global slot (peer, token, k), each saved once
                index = (scheds.row_peer * k.tokens + scheds.row_token) * k.top_k + scheds.row_k
            row_slot = torch.where(valid, index, torch.full_like(index, -1)).to(torch.int32)
        shared_preact = (torch.empty(R, k.tokens, 2 * k.shared_intermediate, dtype=torch.bfloat16,
                                     device=dev) if has_shared else None)
        if preact is None:
            preact = torch.empty(rows, 2 * k.intermediate, dtype=torch.bfloat16, device=dev)
        return SavedPreact(preact, row_slot.contiguous(), shared_preact, missing=missing,
                           lease=lease)

    def raise_pending_errors(self) -> None:
        """Wait for every launch's error-word copy; raise PeerTimeoutError for the first
        launch that could not complete."""
        self.errors.check(block=True, last_call=self.calls)
        self.backward_errors.check(block=True, last_call=self.backward_calls,
                                   rank_base=self.side.rank_base)

    def check_device_error(self) -> None:
        """Read the error word of the plan's last launch on the device (synchronises): it also
        covers CUDA-graph replays, which leave no host-side record."""
        self.errors.check_device(self.calls)
        self.backward_errors.check_device(self.backward_calls, rank_base=self.side.rank_base)


def _retire(plan: Plan) -> None:
    """An evicted plan: its launches waited for (its buffers are freed after) and its pending
    errors raised (a failure of its last calls still surfaces)."""
    with plan.lock:
        plan.order.wait()
        plan.raise_pending_errors()


# One process's own plans (one GPU, virtual ranks) are keyed by the exact T, and each holds GBs
# of rings: the last MAX_LOCAL_PLANS are kept, a run with variable batch sizes builds the others
# again (a new plan: its buffers and task list, no compile). A group's plans (IPC-mapped
# buffers, built by a collective) are keyed by T rounded (``plan_tokens``: 8 a doubling) and
# cost a collective to build: the last MAX_GROUP_PLANS. Every rank of a group makes the same
# calls with the same agreed keys, so all evict the same plan at the same call (a peer's
# mapping of an evicted VMM buffer keeps its memory until the peer unmaps it). A plan that a
# CUDA graph captured is kept whatever the bound.
MAX_LOCAL_PLANS = 4
MAX_GROUP_PLANS = 8
_PLANS = BoundedCache(MAX_GROUP_PLANS, pinned=lambda plan: plan.order.captured)
_LOCAL_PLANS = BoundedCache(MAX_LOCAL_PLANS, pinned=lambda plan: plan.order.captured)
_PLANS_LOCK = threading.Lock()


def cached_plans() -> dict[PlanKey, Plan]:
    """Every cached plan by its key (a group's and this process's own)."""
    with _PLANS_LOCK:
        return {**dict(_PLANS.items()), **dict(_LOCAL_PLANS.items())}


def _all_plans() -> list[Plan]:
    return list(cached_plans().values())


def release_plans() -> None:
    """Drop every cached plan (its rings, counters and symmetric buffers go with it once no
    call holds them): benchmarks call it between shapes."""
    with _PLANS_LOCK:
        _PLANS.clear()
        _LOCAL_PLANS.clear()


def plan_for(xs, w_gate, w_down, shared, topk_idx, config: MoKConfig, group=None,
             handle_type: str = "posix_fd", save: bool = False) -> Plan:
    """The cached plan for these shapes: R virtual ranks (``group=None``, xs [R, T, H]) or this
    process's rank of ``group`` (xs [1, T, H], peers over IPC). ``config``'s sizes that are
    None take the heuristics here; an EP group's caller resolves them with the simulator
    first (``sim.tune.tuned_config``). ``save``: a training forward's plan (its own kernel,
    FC1 storing g | u)."""
    from mok_cute.schedule import schedule_capacity

    R, T, H = xs.shape
    E_loc, I = w_gate.shape[1], w_gate.shape[2]
    K = topk_idx.shape[-1]
    if H % 64 or I % 64:
        raise ValueError(f"the megakernel needs hidden and intermediate sizes that are multiples "
                         f"of 64, got H={H}, I={I}")
    Is = shared[0].shape[-2] if shared is not None else 0
    if Is % 64:
        raise ValueError(f"shared expert intermediate size must be a multiple of 64, got {Is}")
    device = xs.device.index if xs.device.index is not None else torch.cuda.current_device()
    num_sms = _num_sms(device)
    options = config.megakernel
    peers = R
    if group is not None:
        import torch.distributed as dist

        peers = dist.get_world_size(group)
    capacity = schedule_capacity(peers, T, K, E_loc, TILE_M)
    minibatch, ring = resolve_sizes(config, capacity, T)
    rows_in_place = options.rows_in_place and ring >= capacity
    local_only = rows_in_place and peers == 1  # one GPU: no row crosses a comm CTA
    num_comm = config.num_comm_sms
    if num_comm is None:
        num_comm = default_num_comm_ctas(peers, H, K, num_sms, rows_in_place, I, Is)
    if num_comm >= num_sms:
        raise ValueError(f"MoKConfig.num_comm_sms must be < the SM count {num_sms}, got {num_comm}")
    if num_comm == 0 and not local_only:
        raise ValueError(
            "MoKConfig.num_comm_sms=0 needs one rank reading its own rows in place (no comm "
            "task: one GPU, no group, a ring that holds every routed row); this call has "
            f"{peers} rank(s), rows in place {rows_in_place}")
    fc1_lead = options.fc1_lead
    if fc1_lead is None:
        fc1_lead = fc1_lead_minibatches(num_sms - num_comm, minibatch // TILE_M,
                                        -(-2 * I // TASK_TILE_N))
    tickets = options.ticket_mode(R, ipc=group is not None)
    use_fp8 = config.precision == "fp8"
    spec = MegakernelSpec(
        num_ranks=R, num_ctas=num_sms, num_comm_ctas=num_comm, top_k=K, has_shared=bool(Is),
        scope="gpu" if group is None else "sys", timeline=config.timeline,
        rows_in_place=rows_in_place, tickets=tickets,
        # fp8's mainloop has no publish hook (its stages are released as it promotes)
        defer_signals=local_only and R == 1 and tickets != "static" and not use_fp8,
        save_preact=save, fp8=use_fp8)
    key = PlanKey(T, H, I, E_loc, Is, minibatch, ring, config.timeline_capacity, device,
                  None if group is None else (id(group), handle_type), fc1_lead,
                  x_in_place=local_only, local_only=local_only, spec=spec)
    plans = _PLANS if group is not None else _LOCAL_PLANS
    evicted = []
    with _PLANS_LOCK:
        plan = plans.get(key)
        if plan is None:
            dev = torch.device("cuda", device)
            side = _VirtualSide(key, dev) if group is None else _IpcSide(key, dev, group, handle_type)
            plan = Plan(key, side)
            evicted = plans.put(key, plan)  # may evict the least recently used: retired
            # outside the lock
    retire_all(evicted, _retire)
    return plan


def moe_forward_virtual(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                        config: MoKConfig | None = None, save: bool = False):
    """The megakernel on R virtual ranks (inputs already validated by ``mok_cute.api``) ->
    out [R, T, H]; ``save`` (a training forward): (out, ``SavedPreact``), the same out."""
    config = config or MoKConfig()
    plan = plan_for(xs, w_gate, w_down, shared, topk_idx, config, save=save)
    weights = fp8_weights_of(plan, w_gate, w_up, w_down, training=save)
    with plan.lock:
        return plan.run(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                        config.timeout_ms, fp8_weights=weights)


def fp8_weights_of(plan: Plan, w_gate, w_up, w_down, training: bool = False):
    """An fp8 plan's routed weights in e4m3 blocks (``expert_path_fp8.quantized_weights``:
    cached per weight tensor and version; the caller's tensors, so the cache hits), the
    experts of every rank of the launch stacked; ``training``: the backward's transposed
    copies made in the same pass. None for a bf16 plan."""
    if not plan.key.spec.fp8:
        return None
    from mok_cute.expert_path_fp8 import quantized_weights

    return quantized_weights(w_gate, w_up, w_down, training=training)


def moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                config: MoKConfig | None = None, group=None,
                handle_type: str = "posix_fd", save: bool = False):
    """One GPU (``group=None``): the megakernel with one rank. With ``group``: this process's
    rank of an expert-parallel group, peers reached through IPC-mapped symmetric buffers
    (every rank of the group calls together, with the same T). The IPC launch has run on 2
    H200s, not yet on 4 or 8. ``save`` (a training forward): (out, this rank's
    ``SavedPreact``)."""
    config = config or MoKConfig()
    sh = None if shared is None else tuple(w.unsqueeze(0) for w in shared)
    args = (x.unsqueeze(0), topk_idx.unsqueeze(0), topk_weights.unsqueeze(0),
            w_gate.unsqueeze(0), w_up.unsqueeze(0), w_down.unsqueeze(0))
    from mok_cute.comm.agreement import timeout_of, until_collective

    plan = None
    try:  # with a group: a rank failing before the routing's all_gather makes every rank raise
        with until_collective(group, timeout_of(config)):
            # fp8: the caller's (E, I, H) weights are quantized (and cached) as they are
            plan = plan_for(args[0], args[3], args[5], sh, args[1], config, group, handle_type,
                            save=save)
            weights = fp8_weights_of(plan, w_gate, w_up, w_down, training=save)
            with plan.lock:
                result = plan.run(*args, sh, config.timeout_ms, fp8_weights=weights,
                                  saved_rows_factor=config.saved_rows_factor,
                                  saved_rows_pool=config.saved_rows_pool)
            if save and config.check_ids:
                _raise_short_save(result[1], plan, config.saved_rows_pool)
    except Exception:
        if group is not None and plan is not None and plan.calls == 0:
            # built by this call, which raised on every rank: a rank whose build failed has
            # none, so none keeps it (the next call builds it on every rank, collectively)
            _drop_plan(plan)
        raise
    if not save:
        return result[0]
    out, saved = result
    return out[0], saved._replace(row_slot=saved.row_slot[0], shared_preact=None
                                  if saved.shared_preact is None else saved.shared_preact[0])


def _raise_short_save(saved: SavedPreact, plan: Plan, pool=None) -> None:
    """SavedRowsError when this rank received more rows than its forward kept g | u for
    (``MoKConfig.saved_rows_factor``, or what its ``saved_rows_pool`` had left). Reads the
    count: only where the call synchronises anyway (``check_ids``: api reads the id check
    right after the launch, and exchanges this error so that every rank raises)."""
    if saved.missing is not None:
        missing = int(saved.missing)
        if missing:
            from mok_cute.errors import SavedRowsError

            raise SavedRowsError(missing, None if pool is not None else saved.preact.shape[0],
                                 rank=plan.side.rank_base, call=plan.calls,
                                 pool_bytes=None if pool is None else pool.nbytes)


def _drop_plan(plan: Plan) -> None:
    with _PLANS_LOCK:
        if _PLANS.get(plan.key) is plan:
            _PLANS.pop(plan.key)


def training_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                     config: MoKConfig | None = None):
    """One GPU's training forward through the megakernel (one rank, inputs validated by
    ``mok_cute.api``) -> (out, ``expert_path.SavedForBackward``): at one rank the megakernel
    saves g | u by (token, k) slot over the same receive schedule as the expert path, so the
    one-GPU backward (``expert_backward.moe_backward``) takes it as it is."""
    from mok_cute.expert_path import SavedForBackward
    from mok_cute.schedule import row_of_slot

    out, saved = moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config,
                             save=True)
    sched = saved.schedules[0]
    num_tokens, top_k = topk_idx.shape
    return out, SavedForBackward(
        saved.preact, x.new_empty(0, 0) if saved.shared_preact is None else saved.shared_preact,
        saved.row_slot, row_of_slot(sched, num_tokens, top_k), sched.tile_expert,
        sched.num_tiles, sched.expert_offsets)


def raise_pending_errors() -> None:
    """Wait for every plan's launches in flight; raise PeerTimeoutError for the first that
    could not complete."""
    for plan in _all_plans():
        plan.raise_pending_errors()


def check_errors() -> None:
    """``mok_cute.check_errors``: every plan's launches in flight, then the error word of its
    last launch on the device (CUDA-graph replays included); synchronises."""
    for plan in _all_plans():
        with plan.lock:
            plan.raise_pending_errors()
            plan.check_device_error()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
