"""PyTorch reference of the MoE layer: the oracle of every test and the fallback path.

Numerics (DESIGN §1; the kernels follow the same order):

    per routed row v (one (token, k) pair, expert e):
        g = bf16(v @ W_gate[e]^T)  fp32 matmul on upcast bf16 inputs, rounded as a bf16
        u = bf16(v @ W_up[e]^T)    nn.Linear would round it
        h = bf16(silu(g) * u)      silu(g) * u in fp32, rounded once
        y = bf16(h @ W_down[e]^T)  fp32 matmul, rounded once
    shared expert: the same function with (ws_gate, ws_up, ws_down) -> bf16 row s
    out[t] = bf16(acc), acc = fp32(s[t]) (or 0), then for k = 0..K-1 in ascending order:
             acc = acc + fp32(topk_weights[t, k]) * fp32(y[t, k])
             (the product is rounded to fp32, then the sum: two roundings, no FMA)

TF32: every matmul input is a bf16 value (x, weights, the rounded h), which TF32 represents
exactly, so the result does not depend on torch's fp32 matmul precision setting.

Batch invariance: every expert matmul runs on the rows of ONE source rank routed to that
expert, in ascending (token, k) order. So `moe_forward` on one rank, `moe_forward_virtual`
and the real expert-parallel path (`group=`) feed identical matrices to the same matmuls and
agree bitwise on one device.

Everything is differentiable through autograd (the bf16 roundings are plain casts, whose
gradient is the identity cast back), so the backward kernels can be checked against
`torch.autograd` on this module.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from .config import check_expert_ids, check_moe_inputs, check_tensor, id_span, resolve_config

__all__ = [
    "moe_forward",
    "moe_forward_virtual",
    "expert_mlp",
    "swiglu_hidden",
    "routed_expert_outputs",
    "weighted_k_sum",
]

# Private switch for tests: skip the bf16 roundings and compute in float64, so that
# torch.autograd.gradcheck can check the gradients of the exact (unrounded) function.
_EXACT_FLOAT64 = False


@contextlib.contextmanager
def _exact_numerics() -> Iterator[None]:
    """Within this block the reference computes in float64 with no bf16 rounding (tests only)."""
    global _EXACT_FLOAT64
    previous, _EXACT_FLOAT64 = _EXACT_FLOAT64, True
    try:
        yield
    finally:
        _EXACT_FLOAT64 = previous


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Upcast to the accumulation dtype (fp32; float64 under `_exact_numerics`)."""
    return t.to(_acc_dtype())


def _round(t: torch.Tensor) -> torch.Tensor:
    """Round to the storage dtype of activations (bf16; no-op under `_exact_numerics`)."""
    return t if _EXACT_FLOAT64 else t.to(torch.bfloat16)


def _act_dtype() -> torch.dtype:
    return torch.float64 if _EXACT_FLOAT64 else torch.bfloat16


def _acc_dtype() -> torch.dtype:
    return torch.float64 if _EXACT_FLOAT64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Stages (kernels are tested against these one by one)
# ---------------------------------------------------------------------------------------------


def swiglu_hidden(v: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """FC1 + SwiGLU of one expert: `bf16(silu(g) * u)` with the bf16 pre-activations
    `g = bf16(v @ w_gate^T)`, `u = bf16(v @ w_up^T)`, [N, I]: one numerics for inference and
    training (the training forward saves exactly these g and u)."""
    _check_expert(v, w_gate, w_up)
    return _swiglu_hidden(v, w_gate, w_up)


def _check_expert(v, w_gate, w_up, w_down=None) -> None:
    """One expert's operands (``swiglu_hidden``, ``expert_mlp``): v [N, H], w_gate and w_up
    [I, H], w_down [H, I]."""
    check_tensor("v", v, shape=("N", "H"), contiguous=False)
    check_tensor("w_gate", w_gate, shape=("I", v.shape[1]), contiguous=False)
    check_tensor("w_up", w_up, shape=w_gate.shape, contiguous=False)
    if w_down is not None:
        check_tensor("w_down", w_down, shape=(v.shape[1], w_gate.shape[0]), contiguous=False)


def _swiglu_hidden(v, w_gate, w_up):
    v32 = _acc(v)
    g = _acc(_round(v32 @ _acc(w_gate).t()))
    u = _acc(_round(v32 @ _acc(w_up).t()))
    return _round(F.silu(g) * u)


def expert_mlp(
    v: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """One expert (or the shared expert) on rows v [N, H] -> bf16 [N, H].

    w_gate, w_up: [I, H]; w_down: [H, I] (nn.Linear layout).
    """
    _check_expert(v, w_gate, w_up, w_down)
    return _expert_mlp(v, w_gate, w_up, w_down)


def _expert_mlp(v, w_gate, w_up, w_down):
    """``expert_mlp`` on operands its caller has checked (the per-expert loops: the checks
    cost ~3 us each)."""
    return _round(_acc(_swiglu_hidden(v, w_gate, w_up)) @ _acc(w_down).t())


def weighted_k_sum(
    y_slots: torch.Tensor, weights: torch.Tensor, shared_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The combine: `bf16(fp32(shared) + sum_k fp32(w[t,k]) * fp32(y[t,k]))`, ascending k.

    y_slots: [T, K, H] bf16 expert outputs per (token, k); weights: [T, K];
    shared_rows: [T, H] bf16 or None. Returns [T, H] bf16.
    """
    check_tensor("y_slots", y_slots, shape=("T", "K", "H"), contiguous=False)
    T, K, H = y_slots.shape
    check_tensor("weights", weights, shape=(T, K), contiguous=False)
    if shared_rows is not None:
        check_tensor("shared_rows", shared_rows, shape=(T, H), contiguous=False)
        acc = _acc(shared_rows)
    else:
        acc = torch.zeros(T, H, dtype=_acc_dtype(), device=y_slots.device)
    w = _acc(weights)
    for k in range(K):
        acc = acc + w[:, k : k + 1] * _acc(y_slots[:, k])
    return _round(acc)


def _slot_rows(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """x's row of each slot in ``order`` (slot s = token s // K): gathered from x repeated per
    slot, so each source row is read by one slot. ``x.index_select(0, order // K)`` reads each
    token K times, and its backward adds those K gradient rows by atomics in bf16, in an order
    that changes run to run (d_x not bitwise reproducible); here the K rows are summed by the
    repeat's backward, in a fixed order."""
    per_slot = x.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, x.shape[1])
    return per_slot.index_select(0, order)


def _inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inverse


def routed_expert_outputs(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Expert output of every (token, k) of one rank -> y_slots [T, K, H] bf16.

    `topk_idx` [T, K] holds ids in [0, E) where E = w_gate.shape[0] (the experts visible to
    this call); an id outside it matches no expert and gets a zero row. Each expert runs once
    on its rows in ascending (token, k) order.
    """
    check_tensor("x", x, shape=("T", "H"), contiguous=False)
    check_tensor("topk_idx", topk_idx, shape=(x.shape[0], "K"), dtype=(torch.int32, torch.int64),
                 contiguous=False)
    check_tensor("w_gate", w_gate, shape=("E", "I", x.shape[1]), contiguous=False)
    _, I, H = w_gate.shape
    check_tensor("w_up", w_up, shape=(w_gate.shape[0], I, H), contiguous=False)
    check_tensor("w_down", w_down, shape=(w_gate.shape[0], H, I), contiguous=False)
    T, K = topk_idx.shape
    H, E = x.shape[1], w_gate.shape[0]
    if T * K == 0:
        return torch.zeros(T, K, H, dtype=_act_dtype(), device=x.device)
    flat = _no_expert_last(topk_idx, E)
    order = torch.argsort(flat, stable=True)  # rows grouped by expert, (token, k) ascending
    counts = torch.bincount(flat, minlength=E + 1).tolist()  # [E]: ids matching no expert
    rows = _slot_rows(x, order[: T * K - counts[E]], K)
    segments = []
    for e, segment in enumerate(torch.split(rows, counts[:E])):
        if counts[e]:
            segments.append(_expert_mlp(segment, w_gate[e], w_up[e], w_down[e]))
    y_sorted = _with_zero_rows(segments, counts[E], H, x)
    return y_sorted.index_select(0, _inverse_permutation(order)).view(T, K, H)


def _no_expert_last(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Flat int64 ids with every id outside [0, num_experts) replaced by num_experts, so a
    stable sort puts the slots that match no expert last (``check_ids=False``: they add 0)."""
    flat = topk_idx.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    return torch.where(valid, flat, torch.full_like(flat, num_experts))


def _with_zero_rows(segments: list[torch.Tensor], zero_rows: int, H: int, like: torch.Tensor) -> torch.Tensor:
    """The expert outputs in order, then ``zero_rows`` zero rows for the slots of no expert."""
    if zero_rows:
        segments = segments + [torch.zeros(zero_rows, H, dtype=_act_dtype(), device=like.device)]
    return torch.cat(segments)


def _zero_unrouted_weights(topk_weights: torch.Tensor, topk_idx: torch.Tensor,
                           num_experts: int) -> torch.Tensor:
    """topk_weights with 0 where the id matches no expert, so such a slot adds exactly 0 to
    its token (its zero row times 0; even a NaN weight there is dropped)."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    return torch.where(valid, topk_weights, torch.zeros_like(topk_weights))


def _shared_rows(x: torch.Tensor, shared: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
    if shared is None:
        return None
    ws_gate, ws_up, ws_down = shared
    return expert_mlp(x, ws_gate, ws_up, ws_down)


# ---------------------------------------------------------------------------------------------
# Public entry points (same signatures as mok_cute.moe_forward / moe_forward_virtual)
# ---------------------------------------------------------------------------------------------


def moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: Sequence[torch.Tensor] | None = None,
    group: object = None,
    config: object = None,
) -> torch.Tensor:
    """Reference MoE layer on one GPU (group=None) or one rank of an EP group -> [T, H] bf16.

    With `group` (a torch.distributed ProcessGroup of size R) this rank owns the global experts
    [rank*E_loc, (rank+1)*E_loc): each routed (token, k) row of x is sent with
    `all_to_all_single` to the rank owning its expert, computed there, and sent back; every rank
    of the group must call this together (T may differ per rank), and the ranks first agree on
    the call (`mok_cute.comm.agreement`: H, I, E_loc, K, Is, dtypes, MoKConfig, id ranges; a
    mismatch raises the same error on every rank). Of `config` the reference honours
    ``check_ids`` (False: an out-of-range id matches no expert and adds 0) and
    ``group_timeout_s``; it has no tuning knobs.
    Accepts any floating dtype (the strict bf16 contract is enforced by `mok_cute.moe_forward`).
    """
    if group is None:
        config = resolve_config(config)
        dims = check_moe_inputs(
            x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
            strict_dtypes=False, contiguous=False,
        )
        if config.check_ids:
            check_expert_ids(topk_idx, dims.num_experts)
        return _forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, None)
    from .comm.agreement import agree_on_call, call_header, timeout_of

    num_ranks = _group_size(group)
    timeout_s = timeout_of(config)
    try:
        config = resolve_config(config)
        dims = check_moe_inputs(
            x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
            num_ranks=num_ranks, strict_dtypes=False, contiguous=False,
        )
        header = call_header(dims, x, topk_idx, topk_weights, w_gate, "reference", config,
                             id_span(topk_idx) if config.check_ids else None)
    except Exception as exc:  # every rank hears of it: nobody waits in all_to_all
        agree_on_call(group, exc, timeout_s)
        raise
    agree_on_call(group, header, timeout_s)
    return _forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group)


def moe_forward_virtual(
    xs: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: Sequence[torch.Tensor] | None = None,
    config: object = None,
) -> torch.Tensor:
    """R expert-parallel ranks emulated in one process -> [R, T, H] bf16.

    Every tensor has a leading R (DESIGN §2). Rank r's tokens route to global experts e whose
    weights are `w_*[e // E_loc, e % E_loc]`; rank r's shared expert is `shared[i][r]`.
    Equal to running `moe_forward` per rank with the gathered global expert weights.
    ``config.check_ids`` as in `moe_forward`.
    """
    config = resolve_config(config)
    dims = check_moe_inputs(
        xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
        stacked=True, strict_dtypes=False, contiguous=False, x_name="xs",
    )
    if config.check_ids:
        check_expert_ids(topk_idx, dims.num_experts)
    return _forward_virtual(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared)


# Unchecked bodies, called by the public functions here and by mok_cute.api after its checks.


def _forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group):
    if group is None:
        num_experts = w_gate.shape[0]
        y_slots = routed_expert_outputs(x, topk_idx, w_gate, w_up, w_down)
    else:
        num_experts = _group_size(group) * w_gate.shape[0]
        y_slots = _routed_expert_outputs_ep(x, topk_idx, w_gate, w_up, w_down, group)
    weights = _zero_unrouted_weights(topk_weights, topk_idx, num_experts)
    return weighted_k_sum(y_slots, weights, _shared_rows(x, shared))


def _forward_virtual(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared):
    R, E = w_gate.shape[0], w_gate.shape[0] * w_gate.shape[1]
    global_gate = w_gate.reshape(E, *w_gate.shape[2:])
    global_up = w_up.reshape(E, *w_up.shape[2:])
    global_down = w_down.reshape(E, *w_down.shape[2:])
    outs = []
    for r in range(R):
        y_slots = routed_expert_outputs(xs[r], topk_idx[r], global_gate, global_up, global_down)
        shared_r = None if shared is None else tuple(s[r] for s in shared)
        weights = _zero_unrouted_weights(topk_weights[r], topk_idx[r], E)
        outs.append(weighted_k_sum(y_slots, weights, _shared_rows(xs[r], shared_r)))
    return torch.stack(outs)


# ---------------------------------------------------------------------------------------------
# Real expert parallelism through torch.distributed
# ---------------------------------------------------------------------------------------------


def _group_size(group: object) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "group: expected a torch.distributed ProcessGroup (init_process_group has not been "
            f"called), got {type(group).__name__}"
        )
    try:
        return dist.get_world_size(group)
    except Exception as exc:  # a non-group object or a group this rank is not part of
        raise TypeError(
            f"group: expected a torch.distributed ProcessGroup containing this rank, got "
            f"{type(group).__name__} ({exc})"
        ) from exc


class _AllToAllRows(torch.autograd.Function):
    """`all_to_all_single` over dim 0 with uneven splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):  # type: ignore[override]
        import torch.distributed as dist

        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        import torch.distributed as dist

        grad_in = grad_out.new_empty((sum(ctx.in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad_out.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group
        )
        return grad_in, None, None, None


def _empty_rows_linked_to(H: int, *tensors: torch.Tensor) -> torch.Tensor:
    """A [0, H] activation tensor whose autograd graph depends on `tensors` (zero gradient)."""
    out = torch.zeros(0, H, dtype=_act_dtype(), device=tensors[0].device)
    for t in tensors:
        if t.requires_grad:
            out = out + t.sum().to(out.dtype) * 0
    return out


def _routed_expert_outputs_ep(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    group: object,
) -> torch.Tensor:
    """y_slots [T, K, H] for this rank's tokens, experts computed on their owner ranks.

    Send order: rows sorted by global expert id, i.e. by (owner rank, local expert, token, k).
    The owner receives peer 0's rows, then peer 1's, ...; within a peer they are grouped by
    local expert, so it runs one matmul per (peer, local expert) on exactly the rows that
    `routed_expert_outputs` would batch on the source rank (bitwise-equal results).
    Backward: every rank of the group must run backward through this call (collectives).
    """
    import torch.distributed as dist

    R = dist.get_world_size(group)
    T, K = topk_idx.shape
    H = x.shape[1]
    E_loc = w_gate.shape[0]

    flat = _no_expert_last(topk_idx, R * E_loc)  # slots of no expert last: sent nowhere
    order = torch.argsort(flat, stable=True)
    # [R * E_loc] by (owner, local expert)
    send_counts = torch.bincount(flat, minlength=R * E_loc + 1)[: R * E_loc]
    recv_counts = torch.empty_like(send_counts)  # [R * E_loc] by (peer, my local expert)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits = send_counts.view(R, E_loc).sum(1).tolist()
    recv_per_expert = recv_counts.view(R, E_loc).tolist()
    recv_splits = [sum(row) for row in recv_per_expert]
    unrouted = T * K - sum(send_splits)

    x_send = _slot_rows(x, order[: T * K - unrouted], K)
    x_recv = _AllToAllRows.apply(x_send, recv_splits, send_splits, group)

    segments = []
    offset = 0
    for peer in range(R):
        for e in range(E_loc):
            n = recv_per_expert[peer][e]
            if n:
                segments.append(_expert_mlp(x_recv[offset : offset + n], w_gate[e], w_up[e], w_down[e]))
                offset += n
    if segments:
        y_recv = torch.cat(segments)
    else:
        # No rows for my experts. Keep the (empty) result in the autograd graph of x and the
        # weights anyway, so this rank joins the backward exchange like its peers do.
        y_recv = _empty_rows_linked_to(H, x_recv, w_gate, w_up, w_down)

    y_sorted = _AllToAllRows.apply(y_recv, send_splits, recv_splits, group)
    if T * K == 0:
        return _empty_rows_linked_to(H, y_sorted).view(T, K, H)
    if unrouted:
        y_sorted = torch.cat([y_sorted, y_sorted.new_zeros(unrouted, H)])
    return y_sorted.index_select(0, _inverse_permutation(order)).view(T, K, H)
