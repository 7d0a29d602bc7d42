"""The PyTorch MoE pipelines the benches time mok_cute against (and the EP baseline's local
experts). Plain torch, usable and tested on their own."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_bf16(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(torch.bfloat16)


def fuse_shared(shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ws_gate, ws_up, ws_down) -> (ws_gate_up [2Is, H], ws_down), as :func:`shared_expert` takes it."""
    if shared is None:
        return None
    ws_gate, ws_up, ws_down = shared
    return torch.cat([ws_gate, ws_up], dim=0), ws_down


def shared_expert(x: torch.Tensor, ws_gate_up: torch.Tensor, ws_down: torch.Tensor) -> torch.Tensor:
    """Shared expert in bf16 GEMMs: ``ws_gate_up`` is [2*Is, H] (gate rows, then up rows)."""
    gu = x @ ws_gate_up.t()
    i = ws_gate_up.shape[0] // 2
    return swiglu_bf16(gu[:, :i], gu[:, i:]) @ ws_down.t()


def weighted_scatter_sum(
    y: torch.Tensor, order: torch.Tensor, top_k: int, topk_weights: torch.Tensor, tokens: int, base: torch.Tensor | None
) -> torch.Tensor:
    """out[t] = bf16(base[t] + sum_k w[t,k] * y[row of (t,k)]) in fp32, rows in expert order."""
    token_of_row = order // top_k
    weight_of_row = topk_weights.reshape(-1).index_select(0, order).float()
    acc = base.float() if base is not None else torch.zeros(tokens, y.shape[1], dtype=torch.float32, device=y.device)
    acc.index_add_(0, token_of_row, y.float() * weight_of_row[:, None])
    return acc.to(torch.bfloat16)


def pack_grouped_mm_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights for :func:`torch_grouped_mm_moe`: gate and up concatenated to [E, 2I, H] and passed
    as its [E, H, 2I] transpose (column-major B, the layout _grouped_mm takes natively), and
    w_down [E, H, I] as its [E, I, H] transpose."""
    return torch.cat([w_gate, w_up], dim=1).transpose(1, 2), w_down.transpose(1, 2)


def torch_grouped_mm_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up_t: torch.Tensor,
    w_down_t: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The torch pipeline: argsort permute, grouped GEMM gate+up, SwiGLU, grouped GEMM down,
    weighted scatter-sum in fp32. ``shared`` = (ws_gate_up [2Is, H], ws_down [H, Is])."""
    tokens, top_k = topk_idx.shape
    experts, _, two_i = w_gate_up_t.shape
    sorted_ids, order = torch.sort(topk_idx.reshape(-1), stable=True)
    # Group ends from the sorted ids (torch.bincount on CUDA reads the max back: a host sync).
    offs = torch.searchsorted(sorted_ids, torch.arange(experts, device=x.device, dtype=sorted_ids.dtype), right=True).to(torch.int32)
    xs = x.index_select(0, order // top_k)
    gu = torch._grouped_mm(xs, w_gate_up_t, offs=offs)
    h = swiglu_bf16(gu[:, : two_i // 2], gu[:, two_i // 2 :])
    y = torch._grouped_mm(h, w_down_t, offs=offs)
    base = shared_expert(x, *shared) if shared is not None else None
    return weighted_scatter_sum(y, order, top_k, topk_weights, tokens, base)


def per_expert_loop_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One F.linear chain per expert over its sorted rows (one host sync for the counts)."""
    tokens, top_k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate.shape[0]).tolist()
    xs = x.index_select(0, order // top_k)
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            xe = xs[start : start + n]
            ys.append(F.linear(swiglu_bf16(F.linear(xe, w_gate[e]), F.linear(xe, w_up[e])), w_down[e]))
            start += n
    y = torch.cat(ys) if ys else xs.new_zeros(0, w_down.shape[1])
    base = shared_expert(x, *shared) if shared is not None else None
    return weighted_scatter_sum(y, order, top_k, topk_weights, tokens, base)


# ---------------------------------------------------------------------- FP8: torch's rowwise pipeline
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALED_GROUP_ALIGN = 16  # torch._scaled_grouped_mm: every group's rows a multiple of 16


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one fp32 scale per row (over the last dim): ``t ~= q * scale[..., None]``, the
    recipe ``torch._scaled_grouped_mm``'s rowwise mode takes (scales are not powers of two)."""
    amax = t.abs().amax(dim=-1).float().clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (t.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def pack_scaled_grouped_mm_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor):
    """Weights for :func:`torch_scaled_grouped_mm_moe`, quantized once (per output channel):
    (gate|up e4m3 as [E, H, 2I] column-major, its scales [E, 2I], down as [E, I, H]
    column-major, its scales [E, H])."""
    gu, s_gu = quantize_rowwise(torch.cat([w_gate, w_up], dim=1))
    d, s_d = quantize_rowwise(w_down)
    return gu.transpose(1, 2), s_gu, d.transpose(1, 2), s_d


def aligned_group_rows(sorted_ids: torch.Tensor, experts: int, align: int = SCALED_GROUP_ALIGN):
    """Rows in expert order -> (each row's row in a layout whose groups start at multiples of
    ``align``, the groups' end offsets there [E] int32, the layout's static row count
    rows + E * (align - 1)). No host sync."""
    rows = sorted_ids.shape[0]
    arange = torch.arange(experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, arange, right=True)
    starts = torch.searchsorted(sorted_ids, arange, right=False)
    padded = (ends - starts + align - 1) // align * align
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    rank = torch.arange(rows, device=sorted_ids.device) - starts[sorted_ids]
    dest = padded_starts[sorted_ids] + rank
    return dest, padded_ends.to(torch.int32), rows + experts * (align - 1)


def torch_scaled_grouped_mm_moe(x, topk_idx, topk_weights, w_gu_q, s_gu, w_d_q, s_d,
                                shared: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The torch FP8 pipeline (the FP8 bench's baseline): argsort permute into 16-aligned
    groups, x and h quantized per row (fp32 scales), ``torch._scaled_grouped_mm`` for gate+up
    and down (split accumulation: ``use_fast_accum=False``), SwiGLU in fp32, the bf16 shared
    expert, the weighted scatter-sum in fp32. Weights from :func:`pack_scaled_grouped_mm_weights`."""
    tokens, top_k = topk_idx.shape
    experts, _, two_i = w_gu_q.shape
    sorted_ids, order = torch.sort(topk_idx.reshape(-1), stable=True)
    dest, offs, capacity = aligned_group_rows(sorted_ids, experts)
    xq, sx = quantize_rowwise(x)
    xs = torch.zeros(capacity, x.shape[1], dtype=torch.float8_e4m3fn, device=x.device)
    xs.view(torch.uint8).index_copy_(0, dest, xq.view(torch.uint8).index_select(0, order // top_k))
    s_xs = torch.ones(capacity, dtype=torch.float32, device=x.device)
    s_xs.index_copy_(0, dest, sx.index_select(0, order // top_k))
    gu = torch._scaled_grouped_mm(xs, w_gu_q, s_xs, s_gu, offs=offs, out_dtype=torch.bfloat16)
    h = swiglu_bf16(gu[:, : two_i // 2], gu[:, two_i // 2:])
    hq, sh = quantize_rowwise(h)
    y = torch._scaled_grouped_mm(hq, w_d_q, sh, s_d, offs=offs, out_dtype=torch.bfloat16)
    base = shared_expert(x, *shared) if shared is not None else None
    return weighted_scatter_sum(y.index_select(0, dest), order, top_k, topk_weights, tokens, base)


class QuantizedWeights:
    """The torch FP8 baseline's weights in e4m3, per output channel (the forward's) and per
    input channel (dgrad's), quantized once per weight version, as mok_cute's FP8 path caches
    its own (an optimizer step, or ``clear()``, makes the next call quantize again): a training
    step pays for one quantization of each weight on both sides."""

    def __init__(self) -> None:
        self._entries: dict = {}

    def clear(self) -> None:
        self._entries.clear()

    def get(self, w: torch.Tensor, transposed: bool):
        entry = self._entries.get((id(w), transposed))
        if entry is None or entry[0] is not w or entry[1] != w._version:  # the tensor itself
            entry = (w, w._version, quantize_rowwise(w.transpose(1, 2).contiguous()
                                                     if transposed else w))
            self._entries[(id(w), transposed)] = entry
        return entry[2]


class ScaledGroupedLinear(torch.autograd.Function):
    """``out [M, N] = a [M, K] · w[e]ᵀ`` per group of rows (``offs``, 16-aligned), bf16 in and
    out, on torch's rowwise FP8 recipe: a quantized per row, w per output channel, on
    ``torch._scaled_grouped_mm``. Backward: d_a in FP8 the same way (the gradient per row, w
    per input channel over N), d_w in bf16 (``torch._grouped_mm`` with the group's rows as K):
    the recipe of mok_cute's FP8 backward, so the two train the same GEMMs in FP8. The
    weights' e4m3 copies come from ``weights`` (`QuantizedWeights`)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                weights: QuantizedWeights) -> torch.Tensor:
        aq, sa = quantize_rowwise(a)
        wq, sw = weights.get(w, transposed=False)
        ctx.weights = weights
        ctx.save_for_backward(a, w, offs)
        return torch._scaled_grouped_mm(aq, wq.transpose(1, 2), sa, sw, offs=offs,
                                        out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        d_a = d_w = None
        if ctx.needs_input_grad[0]:
            gq, sg = quantize_rowwise(grad)
            wtq, swt = ctx.weights.get(w, transposed=True)  # [E, K, N], per K
            d_a = torch._scaled_grouped_mm(gq, wtq.transpose(1, 2), sg, swt, offs=offs,
                                           out_dtype=torch.bfloat16)
        if ctx.needs_input_grad[1]:
            d_w = torch._grouped_mm(grad.t(), a, offs=offs)  # [E, N, K]
        return d_a, d_w, None, None


def torch_scaled_grouped_mm_train(x, topk_idx, topk_weights, w_gate_up, w_down,
                                  shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                                  weights: QuantizedWeights | None = None):
    """The torch FP8 training pipeline (the training bench's FP8 baseline): the inference
    pipeline's permutation into 16-aligned groups and combine, differentiable, its two GEMMs
    :class:`ScaledGroupedLinear`; ``w_gate_up [E, 2I, H]`` and ``w_down [E, H, I]`` bf16
    parameters, the shared expert bf16. ``weights``: their e4m3 copies, kept across calls
    (None: quantized in this call)."""
    weights = QuantizedWeights() if weights is None else weights
    tokens, top_k = topk_idx.shape
    experts, two_i, _ = w_gate_up.shape
    sorted_ids, order = torch.sort(topk_idx.reshape(-1), stable=True)
    dest, offs, capacity = aligned_group_rows(sorted_ids, experts)
    xs = x.new_zeros(capacity, x.shape[1]).index_copy(0, dest, x.index_select(0, order // top_k))
    gu = ScaledGroupedLinear.apply(xs, w_gate_up, offs, weights)
    h = swiglu_bf16(gu[:, : two_i // 2], gu[:, two_i // 2:])
    y = ScaledGroupedLinear.apply(h, w_down, offs, weights)
    base = shared_expert(x, *shared) if shared is not None else None
    return weighted_scatter_sum(y.index_select(0, dest), order, top_k, topk_weights, tokens, base)
