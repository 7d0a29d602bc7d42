"""The expert-parallel training passes (``mok-cute bench --ep --train``, issue 32): rows
``"pass": "bwd"`` and ``"train"`` beside the forward's, for the two layer contenders of
``mok_cute.bench.ep``:

  mok_cute      ``mok_cute.moe_forward(..., group=pg)`` under autograd: with
                ``--mok-config backend=megakernel`` the IPC megakernel's saving launch and
                ``mok_cute.group_backward`` (pulls, the backward megakernel, pushes, two device
                barriers); under the default backend the reference (all_to_all under autograd).
  nccl_torch    the forward baseline under autograd: ``torch.distributed.nn``'s differentiable
                ``all_to_all_single`` both ways and the ``torch._grouped_mm`` pipeline on the
                local experts (gate and up one packed [E_loc, 2I, H] parameter, the layout it runs
                fastest on), whose backward torch derives.

Correctness first: on the check inputs each contender's eight gradients (d_x, d_topk_weights,
this rank's expert weights, the shared expert's: summed over the ranks, as a data-parallel
all-reduce would) are compared with autograd on ``reference.moe_forward_virtual`` (relative
Frobenius error <= ``--tol`` each, its sums over the ranks); a contender that fails is not timed.
Rank 0 runs the reference on every rank's gathered inputs and weights and hands each rank its
own slice of each gradient, so no rank ever holds a contender's gradients of every rank (with
the reference's, dsv4_pro's would need ~165 GiB on rank 0). Timing as the forward's
(``ep_dist.timed_rounds``): every contender that passed is built first (its layer, and for
``bwd`` one forward's graph kept with ``retain_graph``: one graph per contender alive at once),
burnt in (``--warmup`` untimed calls of each pass), then timed in ``--rounds`` interleaved rounds
(the order of the (contender, pass) pairs reversed on odd rounds; ranks aligned, CUDA events,
median per rank, max over ranks = the round's ``ms_rounds`` entry; ``ms`` = the median over
rounds; ``gpu_clock`` per pair). The weight gradients are dropped (``EpLayer.reset``) after each
timed pass, so one contender's are alive at a time. ``bwd`` = the backward alone over the kept
graph, ``train`` = forward + backward. TFLOP/s per GPU counts 2x (bwd) and 3x (train) the
forward's FLOPs. Every rank runs every backward: the group backward is a collective.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from mok_cute.bench.common import GRAD_NAMES, TRAIN_PASSES, error_text, free_memory, sync

PASSES = {p: k for p, k in TRAIN_PASSES.items() if p != "fwd"}  # the forward's rows are ep.py's


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """``all_to_all_single`` that autograd differentiates (the reverse exchange in backward)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    return all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)


def nccl_torch_train_forward(x, topk_idx, topk_weights, gate_up, down, shared, group,
                             grouped_mm: bool) -> torch.Tensor:
    """The nccl_torch baseline's forward, differentiable in x, the router weights, ``gate_up``
    [E_loc, 2I, H], ``down`` [E_loc, H, I] and ``shared`` (ws_gate_up [2Is, H], ws_down)."""
    from mok_cute.bench.ep_dist import plan_exchange
    from mok_cute.bench.torch_moe import shared_expert, swiglu_bf16, weighted_scatter_sum

    tokens, top_k = topk_idx.shape
    plan = plan_exchange(topk_idx, gate_up.shape[0], group)
    x_recv = _exchange(x.index_select(0, plan.order // top_k), plan.recv_splits, plan.send_splits,
                       group)
    _, perm = torch.sort(plan.local_ids, stable=True)
    xs = x_recv.index_select(0, perm)
    inter = gate_up.shape[1] // 2
    if grouped_mm:
        offs = torch.cumsum(plan.local_counts, 0).to(torch.int32)
        gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
        y_sorted = torch._grouped_mm(swiglu_bf16(gu[:, :inter], gu[:, inter:]),
                                     down.transpose(1, 2), offs=offs)
    else:
        pieces = [xs[:0].new_zeros(0, down.shape[1])]
        for e, xe in enumerate(torch.split(xs, plan.local_counts.tolist())):
            if xe.shape[0]:
                gu = F.linear(xe, gate_up[e])
                pieces.append(F.linear(swiglu_bf16(gu[:, :inter], gu[:, inter:]), down[e]))
        y_sorted = torch.cat(pieces)
    y = torch.zeros_like(y_sorted).index_copy(0, perm, y_sorted)  # out of place: autograd
    y_back = _exchange(y, plan.send_splits, plan.recv_splits, group)
    base = shared_expert(x, *shared) if shared is not None else None
    return weighted_scatter_sum(y_back, plan.order, top_k, topk_weights, tokens, base)


class EpLayer:
    """One contender's differentiable call on this rank's inputs: its leaves (requires_grad)
    and ``forward()``; ``grads()`` in ``GRAD_NAMES`` order (packed parameters split)."""

    def __init__(self, name: str, weights, inp, d, config, grouped_mm: bool):
        import mok_cute

        leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
        self.name = name
        x, w = leaf(inp.x), leaf(inp.topk_weights)
        idx = inp.topk_idx
        shared = weights.shared
        if name == "mok_cute":
            params = [leaf(t) for t in (weights.w_gate, weights.w_up, weights.w_down, *(shared or ()))]
            self.forward = lambda: mok_cute.moe_forward(
                x, idx, w, *params[:3], shared=tuple(params[3:]) or None, group=d.group,
                config=config)
        else:
            params = [leaf(torch.cat([weights.w_gate, weights.w_up], 1)), leaf(weights.w_down)]
            if shared is not None:
                params += [leaf(torch.cat([shared[0], shared[1]], 0)), leaf(shared[2])]
            sh = tuple(params[2:]) or None
            self.forward = lambda: nccl_torch_train_forward(x, idx, w, params[0], params[1], sh,
                                                            d.group, grouped_mm)
        self.leaves = [x, w, *params]

    def reset(self) -> None:
        for t in self.leaves:
            t.grad = None

    def grads(self) -> list[torch.Tensor | None]:
        g = [t.grad for t in self.leaves]
        if self.name == "mok_cute":
            return g + [None] * (len(GRAD_NAMES) - len(g))
        halves = lambda t, dim: (None, None) if t is None else t.chunk(2, dim)  # noqa: E731  gate | up
        out = [g[0], g[1], *halves(g[2], 1), g[3]]
        if len(g) > 4:
            out += [*halves(g[4], 0), g[5]]
        return out + [None] * (len(GRAD_NAMES) - len(out))


def reference_grads_on_rank0(d, weights, inp, d_out) -> dict[str, torch.Tensor] | None:
    """Autograd on ``reference.moe_forward_virtual`` over every rank's gathered inputs and
    weights; the shared expert's gradients summed over the ranks (one replicated parameter)."""
    from mok_cute import reference
    from mok_cute.bench.ep_dist import gather_stacked

    xs, idx, wts, d_outs = (gather_stacked(d, t) for t in (inp.x, inp.topk_idx, inp.topk_weights, d_out))
    wg, wu, wd = (gather_stacked(d, t) for t in (weights.w_gate, weights.w_up, weights.w_down))
    if d.rank != 0:
        return None
    leaves = [t.detach().requires_grad_() for t in (xs, wts, wg, wu, wd)]
    shared = None
    if weights.shared is not None:  # replicated: rank 0's copy stands for every rank's
        sh = [t.detach().clone().requires_grad_() for t in weights.shared]
        leaves += sh
        shared = tuple(s.unsqueeze(0).expand(d.world, *s.shape) for s in sh)
    out = reference.moe_forward_virtual(leaves[0], idx, leaves[1], *leaves[2:5], shared=shared)
    out.backward(d_outs)
    return {n: t.grad for n, t in zip(GRAD_NAMES, leaves)}


def reference_grads_by_rank(d, weights, inp, d_out) -> dict[str, torch.Tensor]:
    """``reference_grads_on_rank0``'s gradients, this rank's slice of each on every rank (x,
    the router weights, its experts' weights; the shared expert's summed ones whole): rank 0
    scatters them and keeps only its own."""
    import torch.distributed as dist

    from mok_cute.bench.ep_dist import raise_unless_all_ok

    mine = {"x": inp.x, "topk_weights": inp.topk_weights, "w_gate": weights.w_gate,
            "w_up": weights.w_up, "w_down": weights.w_down}
    if weights.shared is not None:
        mine.update(zip(("ws_gate", "ws_up", "ws_down"), weights.shared))
    full, failure = None, None
    try:  # the gathers fail on every rank together, rank 0's autograd (out of memory) alone
        full = reference_grads_on_rank0(d, weights, inp, d_out)
        if full is not None:
            full = {n: g.to(mine[n].dtype) for n, g in full.items()}
    except Exception as exc:
        failure = exc
    # before the scatters, which a failed rank 0 skips
    raise_unless_all_ok(d, failure, "compute the reference gradients")
    src = dist.get_global_rank(d.group, 0)
    out = {}
    for name, like in mine.items():
        t = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        if name.startswith("ws_"):  # replicated: the sum over the ranks, on every rank
            if d.rank == 0:
                t.copy_(full[name])
            dist.broadcast(t, src=src, group=d.group)
        else:
            parts = list(full[name].unbind(0)) if d.rank == 0 else None
            dist.scatter(t, scatter_list=parts, src=src, group=d.group)
        out[name] = t
        if d.rank == 0:
            del full[name]
    return out


def grad_error_over_ranks(d, got: torch.Tensor | None, ref: torch.Tensor,
                          replicated: bool = False) -> float:
    """``common.rel_err`` of the gradient whose slices the ranks hold (``got`` against ``ref``,
    this rank's): its squared sums added over the ranks; ``replicated`` (the shared expert's):
    each rank's ``got`` is its share, summed over the ranks first, as a data-parallel all-reduce
    would. inf where a rank has none, NaN where anything is not finite or a shape differs."""
    import torch.distributed as dist

    sums = torch.zeros(4, dtype=torch.float64, device=ref.device)  # diff^2, ref^2, missing, bad
    usable = got is not None and tuple(got.shape) == tuple(ref.shape)
    sums[2 if got is None else 3] = float(not usable)
    g = (got.detach().to(torch.float32, copy=True) if usable
         else torch.zeros(ref.shape, device=ref.device))
    if replicated:  # every rank takes part, whatever it holds
        dist.all_reduce(g, group=d.group)
    if not replicated or d.rank == 0:  # a replicated sum is whole on every rank: counted once
        r = ref.float()
        sums[0], sums[1] = (g - r).square().sum(), r.square().sum()
    sums[3] += float(not bool(torch.isfinite(g).all()))
    dist.all_reduce(sums, group=d.group)
    if sums[3] > 0:
        return float("nan")
    if sums[2] > 0:
        return float("inf")
    return float(sums[0].sqrt() / sums[1].sqrt().clamp_min(1e-30))


def bench_ep_train(base: dict[str, Any], d, opts, contenders: Sequence[str], weights, inputs, check,
                   grouped_mm: bool, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The bwd and train rows of one shape at one T (every rank calls it together)."""
    from mok_cute.bench.ep_dist import _agree_error, timed_rounds
    from mok_cute.bench.common import pass_runners

    rows = {(c, p): {**base, "contender": c, "pass": p, "flops": base["flops"] * k}
            for c in contenders for p, k in PASSES.items()}
    gen = torch.Generator(device=d.device).manual_seed(opts.seed * 7 + d.rank)
    d_check = torch.randn(check.x.shape, device=d.device, generator=gen).to(torch.bfloat16)
    d_out = torch.randn(inputs.x.shape, device=d.device, generator=gen).to(torch.bfloat16)
    error, ref = None, None
    try:
        ref = reference_grads_by_rank(d, weights, check, d_check)
    except Exception as exc:
        error = error_text(exc)
    error = _agree_error(d, error)
    passed = []
    for name in contenders:
        failure = error and f"reference check: {error}"
        errors: dict[str, float] = {}
        if not failure:
            try:
                layer = EpLayer(name, weights, check, d, opts.mok_config, grouped_mm)
                layer.forward().backward(d_check)
                sync(d.device)
                got = dict(zip(GRAD_NAMES, layer.grads()))
                del layer
                for n in GRAD_NAMES:
                    if n in ref:
                        errors[f"d_{n}"] = grad_error_over_ranks(
                            d, got.get(n), ref[n], replicated=n.startswith("ws_"))
            except Exception as exc:
                failure = error_text(exc)
            failure = _agree_error(d, failure)
        worst = max(errors.values(), default=0.0, key=lambda v: float("inf") if v != v else v)
        for p in PASSES:
            rows[(name, p)]["rel_err_grads"] = errors
            if failure:
                rows[(name, p)].update(status="error", error=failure)
            elif not worst <= opts.tol:
                rows[(name, p)].update(status="check_failed", error=(
                    f"worst gradient rel err {worst:.3g} > {opts.tol} vs autograd on "
                    f"mok_cute.reference.moe_forward_virtual"))
        if not failure and worst <= opts.tol:
            passed.append(name)
    del ref
    free_memory(d.device)

    # Every contender that passed built first (layers, and the bwd pass's kept graph on its first
    # call), then all timed in interleaved rounds (ep_dist.timed_rounds).
    layers: dict[str, EpLayer] = {}
    calls: dict[str, Callable[[], Any]] = {}
    pair_of: dict[str, tuple[str, str]] = {}
    for name in passed:
        error = None
        try:
            layer = EpLayer(name, weights, inputs, d, opts.mok_config, grouped_mm)
            runners = pass_runners(layer, d_out)  # bwd over one forward's kept graph; train: both
            layers[name] = layer
            for p in PASSES:
                calls[f"{name}/{p}"], pair_of[f"{name}/{p}"] = runners[p], (name, p)
        except Exception as exc:
            error = error_text(exc)
        error = _agree_error(d, error)
        if error:
            for p in PASSES:
                rows[(name, p)].update(status="error", error=error)
                calls.pop(f"{name}/{p}", None)
            layers.pop(name, None)

    def reset(label: str) -> None:  # one contender's weight gradients alive at a time
        layers[pair_of[label][0]].reset()

    for label, timed in timed_rounds(d, calls, opts.rounds, opts.iters, opts.warmup, after=reset).items():
        name, p = pair_of[label]
        row = rows[(name, p)]
        if "error" in timed:
            row.update(status="error", error=timed["error"])
        else:
            row.update(**timed, status="ok", tflops=row["flops"] / (timed["ms"] * 1e-3) / 1e12)
        log(f"{base['shape']} T={base['T']} {name} {p}: {row.get('status')}"
            + (f" {row['ms']:.3f} ms" if row.get("ms") else f" ({(row.get('error') or '')[:200]})"))
    calls.clear()
    layers.clear()
    free_memory(d.device)
    return list(rows.values())
