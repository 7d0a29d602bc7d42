"""The process-group side of the expert-parallel benchmarks (``mok_cute.bench.ep`` and its
training passes, ``mok_cute.bench.ep_training``): the group (torchrun's, or one process),
gathers and broadcasts to rank 0, the all_to_all exchange plan of the NCCL baseline, and the
timing over ranks (ranks aligned per iteration, median per rank, max over ranks; several
contenders in interleaved rounds, ``timed_rounds``)."""

from __future__ import annotations

import os

# NVLink multicast stays off on shared hosts: set before NCCL or symmetric memory initialise.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NVLS_OFF)

import contextlib
import datetime
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from mok_cute.bench.common import check_iters, error_text, sync


# --------------------------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------------------------


@dataclass
class Dist:
    group: Any
    rank: int
    world: int
    device: torch.device
    backend: str
    owns_group: bool  # this module initialised the process group and tears it down


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str | None = None, timeout_s: float = 600.0) -> Dist:
    """The default group: the existing one, torchrun's (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*),
    or a group of one process on 127.0.0.1. nccl on CUDA, gloo on the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if use_cuda:
        if not torch.cuda.is_available():
            raise ValueError(f"device: expected cpu on a machine without CUDA, got {device!r}")
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            kwargs: dict[str, Any] = {"device_id": dev} if use_cuda else {}
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout)
        owns = True
    group = dist.group.WORLD
    return Dist(group, dist.get_rank(group), dist.get_world_size(group), dev, dist.get_backend(group), owns)


@contextlib.contextmanager
def session(device: str | None = None, timeout_s: float = 600.0):
    """``init_distributed`` for a ``with`` block, and the group's teardown after it when this
    module made the group (the scripts run under torchrun use it)."""
    d = init_distributed(device, timeout_s)
    try:
        yield d
    finally:
        if d.owns_group:
            dist.destroy_process_group()


def leave(code: int) -> None:
    """End a torchrun script after its ``session``: flush and exit without the interpreter's
    C++ teardown, where a gloo rank aborts now and then ("terminate called without an active
    exception", SIGABRT) after all its work is done (about one run in ten on a loaded 2-core
    machine, with or without a barrier before the group's teardown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _align(d: Dist) -> None:
    """Start the ranks together: a one-element all_reduce, then wait for it on this device."""
    t = torch.ones(1, device=d.device)
    dist.all_reduce(t, group=d.group)
    sync(d.device)


def all_max(d: Dist, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.group)
    return float(t.item())


def all_values(d: Dist, value: float) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=d.device)
    out = [torch.empty_like(t) for _ in range(d.world)]
    dist.all_gather(out, t, group=d.group)
    return [float(v.item()) for v in out]


def raise_unless_all_ok(d: Dist, failure: BaseException | None, what: str) -> None:
    """Every rank learns whether rank 0's step ``what`` failed (``failure``: this rank's
    exception, None if it went through) before the next collective, which a failed rank
    would not reach: the failed rank raises its own exception, the others a RuntimeError."""
    t = torch.tensor([int(failure is None)], dtype=torch.int32, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=d.group)
    if failure is not None:
        raise failure
    if not bool(t.item()):
        raise RuntimeError(f"rank 0 could not {what}")


def gather_stacked(d: Dist, t: torch.Tensor) -> torch.Tensor | None:
    """[R, *t.shape] on rank 0 (None elsewhere); every rank's ``t`` has the same shape. The
    ranks first agree that rank 0 could allocate the result: if it could not (out of memory:
    the reference checks gather every rank's weights), every rank raises here, so the ranks'
    collectives stay in step (rank 0 skipping the gather for its error handling's collective
    left the others in the gather: a hang until the group's timeout)."""
    t = t.contiguous()
    if d.world == 1:
        return t.unsqueeze(0)
    dst = dist.get_global_rank(d.group, 0)
    out, failure = None, None
    if d.rank == 0:
        try:
            out = torch.empty((d.world, *t.shape), dtype=t.dtype, device=t.device)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            failure = exc
    raise_unless_all_ok(d, failure, f"allocate the gathered {[d.world, *t.shape]} {t.dtype} "
                                    f"tensor")
    if d.rank == 0:
        dist.gather(t, gather_list=list(out.unbind(0)), dst=dst, group=d.group)
        return out
    dist.gather(t, gather_list=None, dst=dst, group=d.group)
    return None


def broadcast_float(d: Dist, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=d.device)
    dist.broadcast(t, src=dist.get_global_rank(d.group, 0), group=d.group)
    return float(t.item())



# --------------------------------------------------------------------------------------------
# The exchange plan of the NCCL baseline
# --------------------------------------------------------------------------------------------


@dataclass
class ExchangePlan:
    """One rank's side of the all_to_all exchange of routed rows."""

    order: torch.Tensor  # [T*K] this rank's (token, k) rows sorted by global expert id
    send_splits: list[int]  # rows sent to each rank (dispatch)
    recv_splits: list[int]  # rows received from each rank
    local_counts: torch.Tensor  # [E_loc] received rows per local expert (device)
    local_ids: torch.Tensor  # [sum(recv_splits)] local expert of each received row, peer-major order


def plan_exchange(topk_idx: torch.Tensor, num_local_experts: int, group: Any) -> ExchangePlan:
    """Counts per (owner rank, local expert) exchanged with all_to_all_single; the splits are read
    back to the host (the one sync of the baseline, as in every all_to_all MoE)."""
    ranks = dist.get_world_size(group)
    flat = topk_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    send_counts = torch.bincount(flat, minlength=ranks * num_local_experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits = send_counts.view(ranks, num_local_experts).sum(1).tolist()
    recv_2d = recv_counts.view(ranks, num_local_experts)
    recv_splits = recv_2d.sum(1).tolist()
    local_ids = torch.repeat_interleave(
        torch.arange(num_local_experts, device=flat.device).repeat(ranks), recv_counts, output_size=sum(recv_splits)
    )
    return ExchangePlan(order, send_splits, recv_splits, recv_2d.sum(0), local_ids)


def exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_per_rank(d: Dist, fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """Median ms of ``fn`` on this rank. Every rank runs the same number of iterations (a
    collective inside ``fn`` must match), each started together with the others."""
    check_iters(iters, warmup)
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if d.device.type == "cuda":
        flush = torch.empty(256 << 20, dtype=torch.int8, device=d.device)  # L2 flush between iterations
        pairs = []
        for _ in range(iters):
            flush.zero_()
            _align(d)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            pairs.append((s, e))
        torch.cuda.synchronize(d.device)
        times = [s.elapsed_time(e) for s, e in pairs]
    else:
        for _ in range(iters):
            _align(d)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timed_over_ranks(d: Dist, fn: Callable[[], Any], iters: int, warmup: int) -> tuple[float, list[float]]:
    """(max over ranks of the per-rank median via all_reduce MAX, every rank's median)."""
    mine = time_per_rank(d, fn, iters, warmup)
    return all_max(d, mine), all_values(d, mine)


def clock_sampler(device: torch.device) -> Any:
    """A ``mok_cute.bench.gpu_clock.ClockSampler`` of this rank's GPU on CUDA; None elsewhere
    (a CPU rank has no SM clock, and nvidia-smi would sample a GPU that is not its device)."""
    if device.type != "cuda":
        return None
    from mok_cute.bench.gpu_clock import ClockSampler

    return ClockSampler(device)


def timed_rounds(
    d: Dist,
    calls: dict[str, Callable[[], Any]],
    rounds: int,
    iters: int,
    warmup: int,
    burn: int | None = None,
    after: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Time every call of ``calls`` (label -> call) in ``rounds`` interleaved rounds, the order
    of ``calls`` reversed on odd rounds; every rank calls this together with the same labels.

    First a burn-in: ``burn`` (default ``warmup``) untimed calls of each, in order. A fixed
    count, not ``common.burn_in``'s fixed time: a time-based loop could call a collective a
    different number of times on each rank. Then per round and call ``timed_over_ranks``
    (``warmup`` untimed calls, then ``iters`` aligned, timed ones), inside a
    ``ClockSampler`` window of its label on CUDA. ``after(label)`` runs after each burn-in and
    each timed call, untimed (the training passes drop their weight gradients there).

    Every failure is agreed across ranks (``_agree_error``) right after the call that failed; a
    call that fails in the burn-in or in any round is dropped from the later rounds on every
    rank. Returns per label either ``{"error": text}`` or

      ms_rounds           per round, the max over ranks of the per-rank medians
      ms                  the median of ``ms_rounds``
      ms_per_rank         per rank, the median over rounds of its per-round medians (max of
                          these <= ``ms``: not always equal to it with several rounds)
      gpu_clock           rank 0's SM clock stats in the label's windows (None off CUDA or
                          without nvidia-smi: ``ClockSampler.stats``)
      gpu_clock_per_rank  every rank's, where any rank recorded samples
    """
    if rounds < 1:
        raise ValueError(f"rounds: expected >= 1, got {rounds}")
    burn = warmup if burn is None else burn
    out: dict[str, dict[str, Any]] = {label: {} for label in calls}
    order = list(calls)
    active = set(order)

    def fail(label: str, error: str | None, when: str) -> None:
        error = _agree_error(d, error)
        if error:
            out[label]["error"] = f"{when}: {error}"
            active.discard(label)

    for label in order:
        error = None
        try:
            for _ in range(burn):
                calls[label]()
            if after is not None:
                after(label)
            sync(d.device)
        except Exception as exc:
            error = error_text(exc)
        fail(label, error, f"burn-in ({burn} calls)")
    ms_rounds: dict[str, list[float]] = {label: [] for label in order}
    per_rank_rounds: dict[str, list[list[float]]] = {label: [] for label in order}
    sampler = clock_sampler(d.device)
    with sampler if sampler is not None else contextlib.nullcontext():
        for r in range(rounds):
            for label in order if r % 2 == 0 else order[::-1]:
                if label not in active:
                    continue
                error = None
                try:
                    with sampler.window(label) if sampler is not None else contextlib.nullcontext():
                        ms, per_rank = timed_over_ranks(d, calls[label], iters, warmup)
                    ms_rounds[label].append(ms)
                    per_rank_rounds[label].append(per_rank)
                    if after is not None:
                        after(label)
                except Exception as exc:
                    error = error_text(exc)
                fail(label, error, f"round {r + 1} of {rounds}")
    timed = [label for label in order if label in active]
    clocks = {label: sampler.stats(label) if sampler is not None else None for label in timed}
    every: list[Any] = [None] * d.world  # every rank's clock stats, one collective for all labels
    dist.all_gather_object(every, clocks, group=d.group)
    for label in timed:
        per_rank_clock = [rank_clocks.get(label) for rank_clocks in every]
        out[label] = {
            "ms": float(statistics.median(ms_rounds[label])),
            "ms_rounds": ms_rounds[label],
            "ms_per_rank": [float(statistics.median(col)) for col in zip(*per_rank_rounds[label])],
            "gpu_clock": per_rank_clock[0],
        }
        if any(c is not None for c in per_rank_clock):
            out[label]["gpu_clock_per_rank"] = per_rank_clock
    return out




def _agree_error(d: Dist, error: str | None) -> str | None:
    """Every rank learns whether any rank failed (and the first rank's message)."""
    flags: list[Any] = [None] * d.world
    dist.all_gather_object(flags, error, group=d.group)
    failed = [(r, e) for r, e in enumerate(flags) if e]
    return None if not failed else f"rank {failed[0][0]}: {failed[0][1]}"
