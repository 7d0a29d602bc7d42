"""Expert-parallel benchmark across real ranks (``mok-cute bench --ep``; issue 7, DESIGN §5).

Run under torchrun, one process per GPU (backend nccl on CUDA, gloo on CPU):

    torchrun --nproc-per-node 8 -m mok_cute.bench.ep --shapes ep --tokens 2048,8192
    torchrun --nproc-per-node 8 -m mok_cute.cli bench --ep --shapes kimi_k2 --skew 0.5

Without torchrun it runs as a group of one process. For every EP shape (MoK's four models:
routed experts split evenly over the ranks, one shared expert of size I, ``--tokens`` per rank)
it times, in one run:

  mok_cute      ``mok_cute.moe_forward(..., group=pg)``. The row's ``path`` says which path that
                call takes (``mok_cute.api.choose_path(distributed=True)``): under the default
                backend the PyTorch reference with a real ``all_to_all_single`` exchange, not the
                megakernel (``megakernel`` false, the chart says "[reference path]");
                ``--mok-config backend=megakernel`` runs the megakernel with peers over IPC.
  nccl_torch    the baseline: counts exchanged with ``all_to_all_single``, token rows sent to
                the expert owners with ``all_to_all_single``, the ``torch._grouped_mm`` pipeline
                of ``mok_cute.bench.torch_moe`` on the local experts (a per-expert loop on the CPU),
                rows sent back with ``all_to_all_single``, fp32 weighted k-sum + shared expert.
  nccl_dispatch / nccl_combine
                the two row exchanges of the baseline alone, for bandwidth in two metrics:
                ``link_gbps`` = bytes this rank sends to OTHER ranks / time (what crosses NVLink),
                ``deepep_gbps`` = DeepEP's metric: dispatch counts the bytes a rank receives,
                combine the bytes it sends back, both including its local share.
                A row is one routed (token, k) pair here, as in MoK's pull schedule (DeepEP
                sends a token once per destination rank, so its byte count can be smaller).
                Both are averaged over ranks and divided by the max-over-ranks time.

Routing is random (``torch.rand(...).topk``) from one CPU generator seeded identically on every
rank, so every rank knows the whole routing; ``--skew f`` sends exactly ``round(f*T)`` tokens of
each rank to expert ``--hot-expert`` (and no other token goes there). Expert weights are drawn
per rank; the shared expert is the same on every rank.

Correctness first: before timing, each layer contender runs on fresh inputs of
``--check-tokens`` tokens per rank; inputs, weights and outputs are gathered to rank 0 and
compared with ``mok_cute.reference.moe_forward_virtual`` (relative Frobenius error <= ``--tol``).
A failed check is recorded and not timed. Timing (``ep_dist.timed_rounds``): every layer
contender that passed is built first and burnt in (``--warmup`` untimed calls each: a fixed
count, so every rank calls the collectives equally often), then timed in ``--rounds``
interleaved rounds, the order reversed on odd rounds (the GPU clock drifts between contenders
timed one after another: two one-round runs of one command differed by 23 %). One round of a
contender: a warm-up, then per iteration the ranks are aligned (a one-element all_reduce and a
device sync) and the call is timed with CUDA events (host clock on the CPU); the median per
rank, then the max over ranks (all_reduce MAX) is that round's time, kept in ``ms_rounds``;
``ms`` is the median over rounds, ``ms_per_rank`` each rank's median over rounds of its
per-round medians. ``gpu_clock`` is rank 0's SM clock while the contender ran
(``mok_cute.bench.gpu_clock.ClockSampler``; ``gpu_clock_per_rank`` every rank's; None on the
CPU), ``paired_vs_torch`` the median over rounds of nccl_torch's time over the contender's in
the same round. TFLOP/s per GPU = 6 * (T*K + T) * H * I / ms with T the tokens per rank. The
two exchange rows are timed once each, after the layers.

Rank 0 writes ``<out>/<date>_<gpu>_<tag>.json`` (DESIGN §5 schema plus ``ranks``, ``link_gbps``,
``deepep_gbps``, ``path``, ``status`` and per-rank details) and a PNG bar chart of the layer rows.
NVLink multicast stays off: this module sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 when it is imported.
"""

from __future__ import annotations

import os

# NVLink multicast stays off on shared hosts (ep_dist sets it when imported, before any group)
from mok_cute.bench.ep_dist import NVLS_OFF  # noqa: E402

import argparse  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mok_cute.bench.common import (apply_config_overrides, check_iters, error_text, forward_path_of,  # noqa: E402
                                   free_memory, paired_ratio, parse_config_overrides, parse_contenders,
                                   rel_err, sync)
from mok_cute.bench.ep_dist import (Dist, ExchangePlan, _agree_error, all_values, broadcast_float,  # noqa: E402
                                    exchange, gather_stacked, plan_exchange, session, timed_over_ranks,
                                    timed_rounds)
from mok_cute.bench.problems import Inputs, randn_weight  # noqa: E402
from mok_cute.bench.results import chart_dependency_missing, config_record, gpu_name, save_results  # noqa: E402
from mok_cute.bench.torch_moe import pack_grouped_mm_weights, shared_expert, swiglu_bf16, weighted_scatter_sum  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
from mok_cute.shapes import EP_SHAPES, Shape, moe_flops, resolve_ep_shape, resolve_ep_shapes  # noqa: E402

LAYER_CONTENDERS = ["mok_cute", "nccl_torch"]
COMM_CONTENDERS = ["nccl_dispatch", "nccl_combine"]
ALL_CONTENDERS = LAYER_CONTENDERS + COMM_CONTENDERS
BASELINE = "nccl_torch"
ELEM_BYTES = 2  # bf16 token rows


# --------------------------------------------------------------------------------------------
# Shapes, routing and the per-rank problem
# --------------------------------------------------------------------------------------------


def resolve_split_shape(spec: str, ranks: int) -> Shape:
    """``resolve_ep_shape``, checked to split its routed experts evenly over ``ranks``."""
    shape = resolve_ep_shape(spec)
    if shape.experts % ranks:
        raise ValueError(f"--shape: {shape.experts} routed experts do not split over {ranks} ranks")
    return shape


def make_routing(
    ranks: int, tokens: int, experts: int, top_k: int, seed: int, skew: float | None = None, hot_expert: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of every rank -> (topk_idx [R, T, K] int64, topk_weights [R, T, K] fp32), on the CPU.

    Depends only on the arguments, so every rank computes the same tensors. Uniform: K distinct
    experts per token at random. With ``skew`` = f: on each rank exactly round(f*T) tokens (a random
    subset) route one of their K slots to ``hot_expert`` and no other token does.
    """
    if top_k > experts:
        raise ValueError(f"top_k: expected <= experts ({experts}), got {top_k}")
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(ranks, tokens, experts, generator=gen)
    if skew is not None:
        if not 0.0 <= skew <= 1.0:
            raise ValueError(f"skew: expected a fraction in [0, 1], got {skew}")
        if not 0 <= hot_expert < experts:
            raise ValueError(f"hot_expert: expected an expert id in [0, {experts}), got {hot_expert}")
        if top_k >= experts:
            raise ValueError(f"skew: needs top_k < experts so the other tokens can avoid the hot expert, got K={top_k}, E={experts}")
        hot_tokens = round(skew * tokens)
        scores[:, :, hot_expert] = -1.0  # never picked ...
        for r in range(ranks):
            chosen = torch.randperm(tokens, generator=gen)[:hot_tokens]
            scores[r, chosen, hot_expert] = 2.0  # ... except by the chosen tokens, always
    topk_idx = scores.topk(top_k, dim=-1).indices
    topk_weights = torch.softmax(torch.randn(ranks, tokens, top_k, generator=gen), dim=-1)
    return topk_idx.contiguous(), topk_weights.contiguous()


def exchange_rows(topk_idx_all: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """rows[src, dst]: routed (token, k) rows rank ``src`` sends to rank ``dst`` in the dispatch."""
    ranks = topk_idx_all.shape[0]
    owner = topk_idx_all.reshape(ranks, -1).long() // num_local_experts
    return torch.stack([torch.bincount(owner[r], minlength=ranks) for r in range(ranks)])


@dataclass
class RankWeights:
    w_gate: torch.Tensor  # [E_loc, I, H]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [E_loc, H, I]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # the same on every rank


def make_rank_weights(shape: Shape, ranks: int, rank: int, device: torch.device, seed: int) -> RankWeights:
    """This rank's experts (drawn from a per-rank seed) and the shared expert (one seed for all)."""
    if shape.experts % ranks:
        raise ValueError(f"ranks: expected a divisor of the {shape.experts} routed experts of {shape.name}, got {ranks}")
    e_loc, h, i = shape.experts // ranks, shape.hidden, shape.intermediate
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 7919 * (rank + 1))
    w_gate = randn_weight((e_loc, i, h), h, device, gen)
    w_up = randn_weight((e_loc, i, h), h, device, gen)
    w_down = randn_weight((e_loc, h, i), i, device, gen)
    shared = None
    if shape.shared:
        sgen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 17)
        shared = (randn_weight((i, h), h, device, sgen), randn_weight((i, h), h, device, sgen), randn_weight((h, i), i, device, sgen))
    return RankWeights(w_gate, w_up, w_down, shared)


def make_rank_inputs(
    routing: tuple[torch.Tensor, torch.Tensor], hidden: int, rank: int, device: torch.device, seed: int
) -> Inputs:
    """This rank's tokens (a per-rank seed) and its slice of the shared routing."""
    tokens = routing[0].shape[1]
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 104729 * (rank + 1) + 3)
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    return Inputs(x.contiguous(), routing[0][rank].to(device).contiguous(), routing[1][rank].to(device).contiguous())


# --------------------------------------------------------------------------------------------
# The NCCL + torch baseline
# --------------------------------------------------------------------------------------------


class NcclTorchMoE:
    """all_to_all dispatch -> local experts -> all_to_all combine -> fp32 weighted k-sum + shared.

    The local experts run the ``torch._grouped_mm`` pipeline of ``mok_cute.bench.torch_moe`` (argsort
    permute, grouped GEMM gate+up, SwiGLU, grouped GEMM down) on CUDA, a per-expert F.linear
    loop elsewhere (``grouped_mm=False``)."""

    def __init__(self, weights: RankWeights, group: Any, grouped_mm: bool):
        self.group, self.grouped_mm = group, grouped_mm
        self.num_local_experts = weights.w_gate.shape[0]
        self.hidden = weights.w_down.shape[1]
        self.w_gate, self.w_up, self.w_down = weights.w_gate, weights.w_up, weights.w_down
        if grouped_mm:
            self.w_gate_up_t, self.w_down_t = pack_grouped_mm_weights(weights.w_gate, weights.w_up, weights.w_down)
        self.shared = None
        if weights.shared is not None:
            ws_gate, ws_up, ws_down = weights.shared
            self.shared = (torch.cat([ws_gate, ws_up], dim=0), ws_down)

    @property
    def path(self) -> str:
        local = "torch._grouped_mm pipeline" if self.grouped_mm else "per-expert F.linear loop"
        return f"{dist.get_backend(self.group)} all_to_all_single dispatch + {local} + all_to_all_single combine + fp32 k-sum"

    def experts(self, rows: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
        """Expert outputs of the received rows, in the order received."""
        n = rows.shape[0]
        if n == 0:
            return rows.new_empty((0, self.hidden))
        sorted_ids, perm = torch.sort(plan.local_ids, stable=True)
        xs = rows.index_select(0, perm)
        if self.grouped_mm:
            offs = torch.cumsum(plan.local_counts, 0).to(torch.int32)
            gu = torch._grouped_mm(xs, self.w_gate_up_t, offs=offs)
            i = gu.shape[1] // 2
            y_sorted = torch._grouped_mm(swiglu_bf16(gu[:, :i], gu[:, i:]), self.w_down_t, offs=offs)
        else:
            pieces = []
            for e, xe in enumerate(torch.split(xs, plan.local_counts.tolist())):
                if xe.shape[0]:
                    h = swiglu_bf16(F.linear(xe, self.w_gate[e]), F.linear(xe, self.w_up[e]))
                    pieces.append(F.linear(h, self.w_down[e]))
            y_sorted = torch.cat(pieces)
        y = torch.empty_like(y_sorted)
        y.index_copy_(0, perm, y_sorted)
        return y

    def __call__(self, inp: Inputs) -> torch.Tensor:
        tokens, top_k = inp.topk_idx.shape
        plan = plan_exchange(inp.topk_idx, self.num_local_experts, self.group)
        x_send = inp.x.index_select(0, plan.order // top_k)
        x_recv = exchange(x_send, plan.recv_splits, plan.send_splits, self.group)
        y_recv = self.experts(x_recv, plan)
        y_back = exchange(y_recv, plan.send_splits, plan.recv_splits, self.group)
        base = shared_expert(inp.x, *self.shared) if self.shared is not None else None
        return weighted_scatter_sum(y_back, plan.order, top_k, inp.topk_weights, tokens, base)


# --------------------------------------------------------------------------------------------
# One shape
# --------------------------------------------------------------------------------------------


@dataclass
class EpOptions:
    iters: int = 30
    warmup: int = 5
    rounds: int = 3  # interleaved timing rounds of the layer contenders (ep_dist.timed_rounds)
    check_tokens: int = 256
    tol: float = 1e-2
    seed: int = 0
    skew: float | None = None
    hot_expert: int = 0
    mok_config: MoKConfig = MoKConfig()
    grouped_mm: bool | None = None  # None: on CUDA only
    train: bool = False  # also the bwd and train passes (mok_cute.bench.ep_training)


def _mok_runner(weights: RankWeights, d: Dist, opts: EpOptions) -> tuple[Callable[[Inputs], torch.Tensor], dict[str, Any]]:
    import mok_cute

    cfg = opts.mok_config
    info: dict[str, Any] = {"forward_path": forward_path_of(d.device, cfg), "config": config_record(cfg)}
    try:
        choice = mok_cute.api.choose_path(d.device, cfg, distributed=True)
        info["path"] = f"{choice.path}: {choice.reason}"
    except Exception as exc:  # backend="kernel" with group=: the call would raise the same
        info["path"] = f"error: {type(exc).__name__}: {exc}"
    # The megakernel reports a path other than "reference:"; never label the reference as it.
    info["megakernel"] = not info["path"].startswith(("reference", "error"))

    def run(inp: Inputs) -> torch.Tensor:
        return mok_cute.moe_forward(
            inp.x, inp.topk_idx, inp.topk_weights, weights.w_gate, weights.w_up, weights.w_down,
            shared=weights.shared, group=d.group, config=cfg,
        )

    return run, info


def _reference_on_rank0(d: Dist, weights: RankWeights, check: Inputs) -> torch.Tensor | None:
    """moe_forward_virtual on the stacked inputs and weights of every rank, gathered to rank 0."""
    from mok_cute import reference

    xs, idx, wts = (gather_stacked(d, t) for t in (check.x, check.topk_idx, check.topk_weights))
    wg, wu, wd = (gather_stacked(d, t) for t in (weights.w_gate, weights.w_up, weights.w_down))
    if d.rank != 0:
        return None
    shared = None
    if weights.shared is not None:  # replicated: rank 0's copy stands for every rank's
        shared = tuple(s.unsqueeze(0).expand(d.world, *s.shape) for s in weights.shared)
    out = reference.moe_forward_virtual(xs, idx, wts, wg, wu, wd, shared=shared)
    del wg, wu, wd
    return out


def bench_ep_shape(
    shape: Shape,
    tokens: int,
    d: Dist,
    opts: EpOptions,
    contenders: Sequence[str] = ALL_CONTENDERS,
    weights: RankWeights | None = None,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Check, then time, every contender on one shape at ``tokens`` per rank; every rank calls
    this together and gets the same rows. ``routing`` ([R, T, K] ids, weights) overrides the
    random routing of the timed problem (tests build exact byte counts with it)."""
    ranks = d.world
    base: dict[str, Any] = {
        "shape": shape.name, "pass": "fwd", "ms": None, "tflops": None, "ranks": ranks,
        "T": tokens, "tokens_per_rank": tokens, "H": shape.hidden, "I": shape.intermediate,
        "E": shape.experts, "K": shape.top_k, "shared": shape.shared, "skew": opts.skew,
        "flops": moe_flops(tokens, shape.hidden, shape.intermediate, shape.top_k, shape.shared),
        "link_gbps": None, "deepep_gbps": None,
    }
    rows = {c: {**base, "contender": c} for c in contenders}
    grouped_mm = d.device.type == "cuda" if opts.grouped_mm is None else opts.grouped_mm
    error = None
    try:
        if weights is None:
            weights = make_rank_weights(shape, ranks, d.rank, d.device, opts.seed)
        if routing is None:
            routing = make_routing(ranks, tokens, shape.experts, shape.top_k, opts.seed + 1, opts.skew, opts.hot_expert)
        if tuple(routing[0].shape) != (ranks, tokens, shape.top_k):
            raise ValueError(f"routing: expected topk_idx of shape {[ranks, tokens, shape.top_k]}, got {list(routing[0].shape)}")
        inputs = make_rank_inputs(routing, shape.hidden, d.rank, d.device, opts.seed + 2)
        check_routing = make_routing(ranks, max(1, opts.check_tokens), shape.experts, shape.top_k, opts.seed + 3, opts.skew, opts.hot_expert)
        check = make_rank_inputs(check_routing, shape.hidden, d.rank, d.device, opts.seed + 4)
    except Exception as exc:
        error = error_text(exc)
    error = _agree_error(d, error)
    if error:
        log(f"{shape.name} T={tokens}: setup failed: {error[:300]}")
        return [{**r, "status": "error", "error": f"setup: {error}", "path": ""} for r in rows.values()]

    # 1. Every layer contender on the check inputs.
    runners: dict[str, Callable[[Inputs], torch.Tensor]] = {}
    outs: dict[str, torch.Tensor] = {}
    for name in [c for c in contenders if c in LAYER_CONTENDERS]:
        error = None
        try:
            if name == "mok_cute":
                run, info = _mok_runner(weights, d, opts)
            else:
                baseline = NcclTorchMoE(weights, d.group, grouped_mm)
                run, info = baseline, {"path": baseline.path}
            rows[name].update(info)
            outs[name] = run(check)
            sync(d.device)
            runners[name] = run
        except Exception as exc:
            error = error_text(exc)
        error = _agree_error(d, error)
        if error:
            rows[name].update(status="error", error=error)
            runners.pop(name, None)
            outs.pop(name, None)

    # 2. Against the reference on rank 0; the verdict goes to every rank.
    if outs:
        error = None
        ref = None
        try:
            ref = _reference_on_rank0(d, weights, check)
        except Exception as exc:
            error = error_text(exc)
        error = _agree_error(d, error)
        for name in list(outs):
            if error:
                rows[name].update(status="error", error=f"reference check: {error}")
                runners.pop(name)
                continue
            gathered = gather_stacked(d, outs[name])
            err = rel_err(gathered, ref) if d.rank == 0 else 0.0
            err = broadcast_float(d, err)
            rows[name]["rel_err"] = err
            if not err <= opts.tol:
                rows[name].update(status="check_failed", error=f"rel err {err:.3g} > {opts.tol} vs mok_cute.reference.moe_forward_virtual (T={check.x.shape[0]} per rank)")
                runners.pop(name)
        del ref, outs
        free_memory(d.device)

    # 3. Time the layer contenders that passed: all built (above), a burn-in, then interleaved
    # rounds (ep_dist.timed_rounds; a contender failing in any round is dropped on every rank).
    calls = {name: (lambda run=run: run(inputs)) for name, run in runners.items()}
    for name, timed in timed_rounds(d, calls, opts.rounds, opts.iters, opts.warmup).items():
        if "error" in timed:
            rows[name].update(status="error", error=timed["error"])
        else:
            rows[name].update(**timed, tflops=base["flops"] / (timed["ms"] * 1e-3) / 1e12, status="ok")
    calls.clear()
    runners.clear()
    free_memory(d.device)

    # 4. The training passes (bwd, train) of the layer contenders.
    train_rows: list[dict[str, Any]] = []
    if opts.train:
        from mok_cute.bench.ep_training import bench_ep_train

        train_rows = bench_ep_train(base, d, opts, [c for c in contenders if c in LAYER_CONTENDERS],
                                    weights, inputs, check, grouped_mm, log)

    # 5. The two exchanges alone, with the splits of the timed routing.
    comm = [c for c in contenders if c in COMM_CONTENDERS]
    if comm:
        _bench_exchanges(shape, tokens, d, opts, inputs, weights, routing, {c: rows[c] for c in comm})

    results = [rows[c] for c in contenders]
    for r in results:
        r.setdefault("path", "")
        log(
            f"{shape.name} T={tokens} {r['contender']}: {r.get('status')}"
            + (f" {r['ms']:.3f} ms" if r.get("ms") else f" ({(r.get('error') or '')[:200]})")
            + (f" {r['tflops']:.1f} TFLOP/s" if r.get("tflops") else "")
            + (f" link {r['link_gbps']:.1f} GB/s, DeepEP {r['deepep_gbps']:.1f} GB/s" if r.get("link_gbps") is not None else "")
        )
    for r in train_rows:
        r.setdefault("path", rows[r["contender"]].get("path", ""))
        r.setdefault("megakernel", rows[r["contender"]].get("megakernel", False))
    return results + train_rows


def _bench_exchanges(shape, tokens, d: Dist, opts: EpOptions, inputs: Inputs, weights: RankWeights, routing, rows: dict[str, dict[str, Any]]) -> None:
    """nccl_dispatch / nccl_combine rows: bytes from the splits actually exchanged."""
    error = None
    try:
        e_loc = weights.w_gate.shape[0]
        plan = plan_exchange(inputs.topk_idx, e_loc, d.group)
        x_send = inputs.x.index_select(0, plan.order // shape.top_k)
        x_recv = exchange(x_send, plan.recv_splits, plan.send_splits, d.group)
        y_recv = torch.empty_like(x_recv)  # combine moves rows of the same size back
        row_bytes = shape.hidden * ELEM_BYTES
        me = d.rank
        # dispatch: this rank sends send_splits, receives recv_splits; combine: the reverse.
        sent_remote = sum(n for p, n in enumerate(plan.send_splits) if p != me) * row_bytes
        recv_all = sum(plan.recv_splits) * row_bytes
        back_remote = sum(n for p, n in enumerate(plan.recv_splits) if p != me) * row_bytes
        path = f"{d.backend} all_to_all_single of bf16 rows [{shape.hidden}]"
        fns = {
            "nccl_dispatch": (lambda: exchange(x_send, plan.recv_splits, plan.send_splits, d.group), sent_remote, recv_all),
            "nccl_combine": (lambda: exchange(y_recv, plan.send_splits, plan.recv_splits, d.group), back_remote, recv_all),
        }
    except Exception as exc:
        error = error_text(exc)
    error = _agree_error(d, error)
    if error:
        for r in rows.values():
            r.update(status="error", error=error, path="")
        return
    for name, row in rows.items():
        fn, link_bytes, deepep_bytes = fns[name]
        error = None
        try:
            ms, per_rank = timed_over_ranks(d, fn, opts.iters, opts.warmup)
            link_all = all_values(d, float(link_bytes))
            deepep_all = all_values(d, float(deepep_bytes))
        except Exception as exc:
            error = error_text(exc)
        error = _agree_error(d, error)
        if error:
            row.update(status="error", error=error, path=path)
            continue
        seconds = ms * 1e-3
        row.pop("flops", None)  # an exchange does no math
        row.update(
            status="ok", path=path, ms=ms, ms_per_rank=per_rank,
            link_bytes_per_rank=[int(b) for b in link_all], deepep_bytes_per_rank=[int(b) for b in deepep_all],
            link_gbps=statistics.fmean(link_all) / seconds / 1e9, deepep_gbps=statistics.fmean(deepep_all) / seconds / 1e9,
            check="rows and splits are those of nccl_torch, whose output is checked against the reference",
        )


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def add_ratios(results: list[dict[str, Any]]) -> None:
    """``ratio_vs_torch``: TFLOP/s over the nccl_torch baseline's on the same shape, T and pass
    (a ratio of two medians over rounds). ``paired_vs_torch``, for rows timed in rounds
    (``ms_rounds``): the median over rounds of the baseline's time over this row's in the same
    round (``paired_ratio``): the two ran back to back within a round, while the clock
    drifts between rounds."""
    key = lambda r: (r["shape"], r["T"], r.get("pass", "fwd"))  # noqa: E731
    base = {key(r): r["tflops"] for r in results if r["contender"] == BASELINE and r.get("tflops")}
    base_rounds = {key(r): r["ms_rounds"] for r in results if r["contender"] == BASELINE and r.get("ms_rounds")}
    for r in results:
        if r.get("tflops") and key(r) in base:
            r["ratio_vs_torch"] = r["tflops"] / base[key(r)]
        if r.get("ms_rounds") and key(r) in base_rounds:
            paired = paired_ratio(base_rounds[key(r)], r["ms_rounds"])
            if paired is not None:
                r["paired_vs_torch"] = paired


def chart_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Layer rows relabelled for the bar chart: shape@T, and mok_cute marked when it is not
    the megakernel."""
    out = []
    for r in results:
        if r["contender"] not in LAYER_CONTENDERS:
            continue
        name = r["contender"]
        if name == "mok_cute" and not r.get("megakernel", False):
            name = "mok_cute [reference path]"
        if r.get("pass", "fwd") != "fwd":
            name = f"{name} {r['pass']}"
        out.append({**r, "shape": f"{r['shape']}@{r['T']}", "contender": name})
    return out


def command_line(argv: Sequence[str], d: Dist) -> str:
    argv = list(argv)
    if "LOCAL_WORLD_SIZE" in os.environ:  # under torchrun
        head = ["torchrun", "--nproc-per-node", os.environ["LOCAL_WORLD_SIZE"]]
        nodes = d.world // max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
        if nodes > 1:
            head += ["--nnodes", str(nodes)]
        return shlex.join([*head, "-m", "mok_cute.bench.ep", *[a for a in argv if a != "--ep"]])
    return shlex.join(["mok-cute", "bench", *(argv if "--ep" in argv else ["--ep", *argv])])


def write_results(results: list[dict[str, Any]], out_dir: Path, tag: str, d: Dist, argv: Sequence[str],
                  config: MoKConfig, extra: dict[str, Any]) -> tuple[Path, Path]:
    gpu = gpu_name(d.device)
    return save_results(
        results, out_dir, tag, gpu, command_line(argv, d), argv, config, extra,
        lambda date: f"EP MoE layer, {d.world} x {gpu}, {date} ({tag}); TFLOP/s per GPU",
        chart=chart_rows(results))


def print_results(results: list[dict[str, Any]], console: Any, title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in ("shape", "T/rank", "contender", "pass", "status", "rel err", "ms (max)", "TFLOP/s/GPU", "x nccl_torch", "paired x", "link GB/s", "DeepEP GB/s", "path / error"):
        table.add_column(col)

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in results:
        note = r.get("path", "") if r.get("status") == "ok" else r.get("error", "")
        table.add_row(
            r["shape"], str(r["T"]), r["contender"], r.get("pass", "fwd"), r.get("status", ""), num(r.get("rel_err"), ".2e"), num(r.get("ms"), ".3f"),
            num(r.get("tflops"), ".1f"), num(r.get("ratio_vs_torch"), ".2f"), num(r.get("paired_vs_torch"), ".2f"), num(r.get("link_gbps"), ".1f"),
            num(r.get("deepep_gbps"), ".1f"), (note or "")[:60],
            style={"ok": "", "skipped": "dim"}.get(r.get("status", ""), "red"),
        )
    console.print(table)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok-cute bench --ep",
        description="Expert-parallel MoE layer across torchrun ranks: mok_cute.moe_forward(group=...) against "
        "all_to_all_single + torch._grouped_mm, plus dispatch/combine bandwidth (issue 7, DESIGN §5).",
    )
    p.add_argument("--ep", action="store_true", help="accepted for `mok-cute bench --ep` (this is always the EP benchmark)")
    p.add_argument("--shapes", default="ep", help=f"comma list of {list(EP_SHAPES)} (or unique prefixes), 'ep' for all, or custom:T,H,I,E,K[,shared]")
    p.add_argument("--tokens", default=None, help="tokens per rank, comma list (default: the shape's, 2048 for MoK's); e.g. 2048,8192")
    p.add_argument("--contenders", default=",".join(ALL_CONTENDERS), help=f"comma list of {ALL_CONTENDERS}")
    p.add_argument("--skew", type=float, default=None, help="fraction of each rank's tokens sent to --hot-expert (no other token goes there)")
    p.add_argument("--hot-expert", type=int, default=0)
    p.add_argument("--train", action="store_true", help="also the training passes (bwd, train) of the layer contenders, "
                   "their gradients checked against autograd on the reference first")
    p.add_argument("--iters", type=int, default=30, help="timed iterations per rank (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each timed round, and the burn-in's "
                   "calls per contender before the first")
    p.add_argument("--rounds", type=int, default=3, help="time the layer contenders this many times in alternating "
                   "order (reversed on odd rounds) after a burn-in; ms = the median over rounds (clock drift; keeps "
                   "every contender alive at once)")
    p.add_argument("--check-tokens", type=int, default=256, help="tokens per rank of the check against the reference")
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mok-config", action="append", default=[], metavar="KEY=VALUE", help="a MoKConfig field for mok_cute, dotted for an options field (megakernel.tickets=static); "
                   "repeatable")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (gloo, host clock)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="file name tag (default ep<R>)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="process group timeout: a stuck collective becomes an error")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from rich.console import Console

    try:
        shapes = resolve_ep_shapes(args.shapes)
        tokens_list = None
        if args.tokens:
            tokens_list = [int(t) if t.strip().isdigit() else 0 for t in args.tokens.split(",")]
            if min(tokens_list) < 1:
                raise ValueError(f"--tokens: expected positive integers, got {args.tokens!r}")
        contenders = parse_contenders(args.contenders, ALL_CONTENDERS)
        if args.check_tokens < 1:
            raise ValueError(f"--check-tokens: expected >= 1, got {args.check_tokens}")
        if args.rounds < 1:
            raise ValueError(f"--rounds: expected >= 1, got {args.rounds}")
        check_iters(args.iters, args.warmup, "--iters / --warmup")  # before the session
        mok_config = apply_config_overrides(MoKConfig(), parse_config_overrides(args.mok_config))
        missing = chart_dependency_missing()  # before minutes of timing, not after
        if missing:
            raise ValueError(missing)
    except ValueError as exc:
        print(f"mok-cute bench --ep: {exc}", file=sys.stderr)
        return 2
    with session(args.device, args.timeout_s) as d:
        console = Console(width=200) if d.rank == 0 else None
        log = (lambda msg: console.print(msg, markup=False, highlight=False)) if console else (lambda msg: None)  # noqa: E731
        bad = [s.name for s in shapes if s.experts % d.world]
        if bad:
            if d.rank == 0:
                print(f"mok-cute bench --ep: --shapes: the routed experts of {bad} do not split over {d.world} ranks", file=sys.stderr)
            return 2
        opts = EpOptions(
            iters=args.iters, warmup=args.warmup, rounds=args.rounds, check_tokens=args.check_tokens, tol=args.tol, seed=args.seed,
            skew=args.skew, hot_expert=args.hot_expert, mok_config=mok_config, train=args.train,
        )
        log(f"{d.world} ranks, backend {d.backend}, device {gpu_name(d.device)}; NVLS off: {NVLS_OFF}")
        results: list[dict[str, Any]] = []
        for shape in shapes:
            weights = None
            try:
                weights = make_rank_weights(shape, d.world, d.rank, d.device, opts.seed)
            except Exception:  # recorded by bench_ep_shape, which retries and agrees across ranks
                weights = None
            for tokens in tokens_list or [shape.tokens]:
                results.extend(bench_ep_shape(shape, tokens, d, opts, contenders, weights=weights, log=log))
            del weights
            free_memory(d.device)
        add_ratios(results)
        if d.rank == 0:
            extra = {
                "ranks": d.world, "backend": d.backend, "nvls_env": dict(NVLS_OFF),
                "timing": "layer rows: a burn-in of --warmup calls per contender, then --rounds interleaved rounds (order "
                "reversed on odd rounds); per round and iteration: ranks aligned, CUDA events (host clock on CPU); median per "
                "rank, max over ranks = the round's ms (ms_rounds); ms = median over rounds. Exchange rows: one round",
                "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds, "skew": args.skew, "hot_expert": args.hot_expert,
                "bytes": "link = rows sent to other ranks; deepep = dispatch: rows received incl. local, combine: rows sent back incl. local; "
                "one row per routed (token, k), bf16 [H]; GB/s = mean bytes over ranks / max-over-ranks time",
            }
            json_path, png_path = write_results(results, Path(args.out), args.tag or f"ep{d.world}", d, argv, mok_config, extra)
            print_results(results, console, f"EP MoE layer, {d.world} ranks, {gpu_name(d.device)}")
            console.print(f"json {json_path}\npng  {png_path}")
        dist.barrier(group=d.group)
        return 0


if __name__ == "__main__":
    sys.exit(main())
