"""The one-GPU expert path in FP8 (issue 33): the forward, and the backward's two dgrads.

    x --quantize 1x128--> scatter (e4m3 rows) --> FC1 (e4m3, promoted every 128 K, SwiGLU) --> h
      --quantize 1x128--> FC2 (e4m3, promoted) --> y rows --k-sum (+ the bf16 shared expert)--> out

A training forward (``save``) also keeps FC1's bf16 g | u by slot, as the bf16 path; its
backward (``expert_backward.moe_backward(precision="fp8")``) runs both dgrads here
(``expert_dgrads``: d_out rows and dG | dU quantized 1 x 128, W's exact transposed e4m3
copies) and the weight gradients and the shared expert in bf16.

DeepSeek's recipe on Hopper (TransformerEngine's ``Float8BlockScaling``): E4M3 data,
activations scaled per 1 x 128 along K, weights per 128 x 128 block, power-of-two scales
(``mok_cute.fp8``), each 128-deep K group's fp32 partial promoted into the accumulator
(``kernels/gemm_fp8.py``). g and u are rounded to bf16 before the SwiGLU as on the bf16 path;
the shared expert and the combine stay bf16. Weights are quantized once per version: a cache
keyed on the weight tensor (``Tensor._version`` bumps with every in-place update, so an
optimizer step re-quantizes on the next call; a freed tensor's entry goes with it).

``reference_forward`` is the same computation in torch: the quantizers of ``mok_cute.fp8``
(bitwise the kernels'), each GEMM in float64 on the dequantized operands rounded once to bf16.
It is the path a call takes without a GPU. It is the kernels' oracle stage by stage
(``reference_hidden`` for FC1, ``reference_output`` from the kernels' h for FC2 and the combine),
not end to end: FP8 wgmma accumulates each 128-deep group in reduced precision, so the kernels'
g, u differ from float64's by ~1e-3 relative, some h elements by a bf16 ulp, and h's
requantization turns a few of those into a whole e4m3 step (or a group's scale into its
neighbour): tokens then differ by 3e-3 typically, up to 3e-2 (H200, 2026-12-02).

Sizes: H and I multiples of 64 (ValueError otherwise); the FP8 kernels' K and N are H and I
rounded up to whole 128-wide groups (H', I'): the weights' quantizer reads them in place as if
zero-padded (once per version), x rows are zero-padded to H', and h carries I' columns (zero
past I), which is the quantization of a partial last group; a training forward keeps g | u at
the layer's own I. One GPU (no group, no megakernel).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mok_cute import fp8
from mok_cute.config import MoKConfig

GROUP = fp8.GROUP

__all__ = ["Fp8Weights", "quantized_weights", "transposed_weights", "forget_quantized_weights",
           "unsupported_reason", "padded", "pad_cols", "moe_forward_fp8", "fc1_rows",
           "expert_dgrads", "fc1_dgrad", "reference_hidden", "reference_output", "reference_forward"]


class Fp8Weights(NamedTuple):
    """The routed experts' weights in e4m3 with their 128 x 128 block exponents (H and I
    padded to whole blocks), as stored (``quantized_weights``) or as their exact transposed
    copies, which the dgrads read (``transposed_weights``: e4m3 wgmma takes K-major operands
    only; shapes then [E, H, I] for gate and up and [E, I, H] for down)."""

    gate: torch.Tensor  # [E, I, H] float8_e4m3fn
    e_gate: torch.Tensor  # [E, I/128, H/128] int8
    up: torch.Tensor
    e_up: torch.Tensor
    down: torch.Tensor  # [E, H, I]
    e_down: torch.Tensor  # [E, H/128, I/128]


SIZE_MULTIPLE = 64  # the bf16 kernels' (shared expert, weight gradients); FP8 pads to 128


def unsupported_reason(hidden: int, intermediate: int) -> str | None:
    """Why the FP8 path cannot take these sizes, or None."""
    if hidden % SIZE_MULTIPLE or intermediate % SIZE_MULTIPLE:
        return (f"config.precision='fp8' needs H and I multiples of {SIZE_MULTIPLE}, got "
                f"H={hidden}, I={intermediate}")
    return None


def padded(n: int) -> int:
    """``n`` rounded up to whole 128-wide scale groups: the FP8 kernels' K and N."""
    return -(-n // GROUP) * GROUP


def pad_cols(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t [..., n]`` with zero columns up to ``width`` (``t`` itself when already that wide).
    Zeros change no group's amax, so the padded quantization is the partial group's."""
    n = t.shape[-1]
    return t if n == width else F.pad(t, (0, width - n))


# (id of the weight's storage owner, its offset, shape, strides) -> _Copies: quantized once
# per weight version and address. The owner is the tensor a view was taken of, so a view made
# anew each call (a model's per-rank ``w.view(R, E_loc, ...)``) hits as the tensor itself does
# (a view shares its base's version counter); keyed by id, not by the tensor (a tensor's == is
# elementwise); the weakref's callback drops the entry when the owner is freed, before its id
# can be reused. A new address (a parameter's ``.data`` replaced) replaces the entry instead
# of adding one. A write that bumps no version is not seen, at a new address or the same one
# (through ``.data``, a collective writing into a parameter's buffer, as sharded data-parallel
# wrappers do each step): ``mok_cute.forget_quantized_weights()`` after it.
_CACHE: dict[tuple, "_Copies"] = {}


class _Copies(NamedTuple):
    owner: weakref.ref
    address: int  # the weight's data_ptr when quantized
    version: int
    copies: dict  # {transposed: (q, e)}
    made: object  # CUDA: (stream, event) after the quantization, for a hit on another stream


def _hand_over(entry: "_Copies") -> None:
    """Cached copies used on another stream than the one that made them: that stream waits for
    the quantization, and the copies' memory is not reused before that stream's work ends."""
    if entry.made is None:
        return
    stream, event = entry.made
    here = torch.cuda.current_stream(stream.device)
    if here != stream:
        here.wait_event(event)
        for pair in entry.copies.values():
            for t in pair:
                t.record_stream(here)


def _quantize_now(w: torch.Tensor, transposed: bool, both: bool) -> dict:
    """{transposed: (q, e)} of w zero-padded to whole 128 x 128 blocks (GPU kernel on CUDA, which
    reads w in place; ``mok_cute.fp8`` on the CPU: the same bits); ``both``: the two copies in
    one pass. w may carry leading dims past the expert's (virtual ranks): the copies then
    stack every expert, [E, N', K']."""
    if w.dim() > 3:  # virtual ranks' [R, E_loc, N, K]: the launch's experts stacked
        w = w.reshape(-1, *w.shape[-2:])
    if not w.is_cuda:
        src = F.pad(w, (0, padded(w.shape[-1]) - w.shape[-1], 0, padded(w.shape[-2]) - w.shape[-2]))
        return {transposed: fp8.quantize_blocks(src, transposed=transposed)}
    from mok_cute.kernels import quantize
    if both:
        q, e, qt, et = quantize.quantize_blocks(w, both=True)
        return {False: (q, e), True: (qt, et)}
    return {transposed: quantize.quantize_blocks(w, transposed=transposed)}


def _quantize_blocks(w: torch.Tensor, transposed: bool = False,
                     both: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, e) of w, or its transposed copy, w zero-padded to whole 128 x 128 blocks, from the
    cache while w's version is unchanged; ``both``: a training call will want the other copy
    too, so a miss quantizes the two in one pass over w. While a CUDA graph is captured the
    cache is bypassed: a replay runs the captured kernels, not this code, so the graph must
    quantize the weights as they are at each replay (an optimizer step between replays updates
    them in place, and a cached copy would go stale silently)."""
    if w.is_cuda and torch.cuda.is_current_stream_capturing():
        return _quantize_now(w, transposed, both=False)[transposed]
    owner = w if w._base is None else w._base
    key = (id(owner), w.storage_offset(), tuple(w.shape), tuple(w.stride()))
    entry = _CACHE.get(key)
    if (entry is None or entry.owner() is not owner or entry.address != w.data_ptr()
            or entry.version != w._version):
        entry = _Copies(weakref.ref(owner, lambda _, key=key: _CACHE.pop(key, None)),
                        w.data_ptr(), w._version, {}, None)
        _CACHE[key] = entry
    _hand_over(entry)
    if transposed not in entry.copies:
        entry.copies.update(_quantize_now(w, transposed, both and not entry.copies))
        if w.is_cuda:  # this stream's event now covers every copy of the entry
            stream = torch.cuda.current_stream(w.device)
            event = torch.cuda.Event()
            event.record(stream)
            entry = _CACHE[key] = entry._replace(made=(stream, event))
    return entry.copies[transposed]


def forget_quantized_weights() -> None:
    """Drop every cached e4m3 copy of the expert weights (``mok_cute.forget_quantized_weights``:
    after a weight write that bumps no version; a benchmark's stand-in for an optimizer step)."""
    _CACHE.clear()


def quantized_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      training: bool = False) -> Fp8Weights:
    """The three weight tensors in e4m3 blocks (GPU kernel on CUDA, ``mok_cute.fp8`` on the
    CPU: the same bits), each from the cache while its version is unchanged. ``training``:
    the transposed copies are made in the same pass (``transposed_weights`` then hits)."""
    return Fp8Weights(*_quantize_blocks(w_gate, both=training), *_quantize_blocks(w_up, both=training),
                      *_quantize_blocks(w_down, both=training))


def transposed_weights(w_gate: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor) -> Fp8Weights:
    """The exact transposed e4m3 copies for the dgrads, cached as ``quantized_weights``."""
    return Fp8Weights(*_quantize_blocks(w_gate, True), *_quantize_blocks(w_up, True),
                       *_quantize_blocks(w_down, True))


def moe_forward_fp8(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                    config: MoKConfig | None = None, save: bool = False):
    """The FP8 forward on the kernels (inputs checked by ``mok_cute.api``) -> out [T, H] bf16;
    with ``save`` (training) -> (out, ``expert_path.SavedForBackward``): the same bits, FC1's
    bf16 g | u kept by slot (the shared expert's as on the bf16 path). No host sync."""
    from mok_cute import expert_path
    from mok_cute.kernels import gemm_fp8, quantize, token_ops

    config = config or MoKConfig()
    why = unsupported_reason(x.shape[1], w_gate.shape[1])
    if why:
        raise ValueError(why)
    weights = quantized_weights(w_gate, w_up, w_down, training=save)
    h, sched, row_of_slot, preact, row_slot = fc1_rows(x, topk_idx, weights, save=save,
                                                       quantize_h=not save, inter=w_gate.shape[1])
    hq, eh = h if not save else quantize.quantize_rows(h)
    # y keeps H columns: W_down's padding rows (H up to 128) are computed and not stored
    y = torch.empty(hq.shape[0], x.shape[1], dtype=torch.bfloat16, device=x.device)
    gemm_fp8.grouped_gemm_fp8(hq, eh, weights.down, weights.e_down, sched.tile_expert,
                              sched.num_tiles, out=y, tile_n=FP8_TILE_N)
    shared_rows, shared_preact = expert_path.shared_forward(x, shared, config.expert_path,
                                                            save=save)
    out = token_ops.weighted_ksum(y, topk_weights, shared_rows, row_index=row_of_slot)
    if not save:
        return out
    return out, expert_path.SavedForBackward(preact, shared_preact, row_slot,
                                             row_of_slot, sched.tile_expert, sched.num_tiles,
                                             sched.expert_offsets)


# Both FP8 GEMMs on 128 x 256 tiles (one N-half promoted at a time): 2-14 % faster forwards than
# 128 x 128 (docs/measurements.md, 2026-12-02 ab-fp8-256)
FP8_TILE_N = 256


def fc1_rows(x: torch.Tensor, topk_idx: torch.Tensor, weights: Fp8Weights, save: bool = False,
             quantize_h: bool = False, inter: int | None = None):
    """The FP8 path's first stage -> (h [capacity, I'] bf16 in expert order, the schedule,
    each slot's padded row [T * K] int32 (-1: routed nowhere), and with ``save`` g | u
    [T * K, 2I] bf16 by slot at the layer's own ``inter`` (default I') and each padded row's
    slot (else None, None)); ``quantize_h``: h comes quantized by FC1's epilogue, (e4m3
    [capacity, I'], exponents), the bits of ``quantize.quantize_rows`` of the bf16 h. I' = I
    rounded up to 128 (h is zero there), x zero-padded to the weights' H'. No host sync."""
    from mok_cute import expert_path
    from mok_cute.kernels import gemm_fp8, quantize

    num_tokens, top_k = topk_idx.shape
    sched, row_of_slot = expert_path.expert_schedule(topk_idx, weights.gate.shape[0])
    # x quantized once per token straight into its K padded rows, exponents too (quantizing a
    # token equals quantizing each of its copies); padding rows keep whatever the buffers held
    # (no GEMM output row depends on another row, and none of theirs is read)
    xq, ex = quantize.quantize_scatter_rows(pad_cols(x, weights.gate.shape[2]), row_of_slot,
                                            sched.row_token.shape[0])
    preact, row_slot = (expert_path.preact_by_slot(sched, num_tokens, top_k,
                                                   inter or weights.gate.shape[1], x.device)
                        if save else (None, None))
    h = gemm_fp8.grouped_gemm_fp8_swiglu(xq, ex, weights.gate, weights.e_gate, weights.up,
                                         weights.e_up, sched.tile_expert, sched.num_tiles,
                                         preact_out=preact, preact_slot=row_slot,
                                         tile_n=FP8_TILE_N, quantize_h=quantize_h)
    return h, sched, row_of_slot, preact, row_slot


def expert_dgrads(d_rows_q, preact, row_slot, weights, tile_expert, num_tiles,
                  wt: Fp8Weights, want_dx: bool, hidden: int):
    """The routed experts' two dgrads in FP8 (the weight gradients: ``expert_backward``): d_out rows
    quantized 1 x 128 (``d_rows_q``: (e4m3 [M, H'], exponents), H' the weights' padded H; a
    padding row may hold anything: the dgated epilogue selects zeros there, row by row) and then
    dG | dU, FC2's dgrad with the dgated epilogue on W_down's transposed copy, FC1's dgrad with
    K split over W_gate's and W_up's. Returns (dG | dU [M, 2I'], w * h [M, I'], row partials, dx
    rows [M, hidden] or None), as the bf16 kernels of ``expert_backward`` (the I' - I padding
    columns zero); padding rows are zero out. No host sync."""
    from mok_cute.kernels import gemm_fp8

    d_preact, hw, partials = gemm_fp8.grouped_gemm_fp8_dgated(
        *d_rows_q, wt.down, wt.e_down, preact, row_slot, weights, tile_expert, num_tiles)
    dx_rows = fc1_dgrad(d_preact, tile_expert, num_tiles, wt, hidden) if want_dx else None
    return d_preact, hw, partials, dx_rows


def fc1_dgrad(d_preact, tile_expert, num_tiles, wt: Fp8Weights, hidden: int):
    """FC1's dgrad in FP8: dG | dU ([M, 2I'], bf16) quantized 1 x 128, K split over W_gate's
    and W_up's transposed copies -> dx rows [M, hidden] bf16."""
    from mok_cute.kernels import gemm_fp8, quantize

    dx_rows = torch.empty(d_preact.shape[0], hidden, dtype=torch.bfloat16,
                          device=d_preact.device)
    gemm_fp8.grouped_gemm_fp8_split_k(
        *quantize.quantize_rows(d_preact), wt.gate, wt.e_gate, wt.up, wt.e_up, tile_expert,
        num_tiles, out=dx_rows)
    return dx_rows


def _dequantized_rows(v: torch.Tensor) -> torch.Tensor:
    return fp8.dequantize_rows(*fp8.quantize_rows(v), dtype=torch.float64)


def _expert_slots(topk_idx: torch.Tensor, num_experts: int):
    """(expert, tokens, ks) of each expert that some slot routes to, in expert order."""
    ids = topk_idx.long()
    for e in range(num_experts):
        token, k = (ids == e).nonzero(as_tuple=True)
        if token.numel():
            yield e, token, k


def reference_hidden(x, topk_idx, weights: Fp8Weights) -> torch.Tensor:
    """FC1 of the emulation -> h [T, K, I'] bf16 per slot (I' = I padded to 128; zero where
    the id is outside [0, E)): g, u the float64 products of the dequantized operands, each
    rounded once to bf16, h = bf16(silu(g) u) in fp32."""
    T, K = topk_idx.shape
    E, I, H = weights.gate.shape  # padded to whole 128 blocks
    x_dq = _dequantized_rows(pad_cols(x, H))  # a token's row quantized = each of its copies
    h = torch.zeros(T, K, I, dtype=torch.bfloat16, device=x.device)
    for e, token, k in _expert_slots(topk_idx, E):
        wg = fp8.dequantize_blocks(weights.gate[e], weights.e_gate[e], dtype=torch.float64)
        wu = fp8.dequantize_blocks(weights.up[e], weights.e_up[e], dtype=torch.float64)
        g = (x_dq[token] @ wg.t()).to(torch.bfloat16).float()
        u = (x_dq[token] @ wu.t()).to(torch.bfloat16).float()
        h[token, k] = (F.silu(g) * u).to(torch.bfloat16)
    return h


def reference_output(hidden, x, topk_idx, topk_weights, weights: Fp8Weights,
                     shared=None) -> torch.Tensor:
    """FC2 and the combine of the emulation from h per slot ([T, K, I'] bf16) -> out [T, H]
    bf16: each h row quantized 1 x 128, times the dequantized W_down in float64, rounded to
    bf16, k-summed with the weights (an id outside [0, E) adds zero) and the bf16 shared
    expert as ``mok_cute.reference``."""
    from mok_cute import reference

    T, K = topk_idx.shape
    E = weights.down.shape[0]
    H = x.shape[1]
    y = torch.zeros(T, K, H, dtype=torch.bfloat16, device=x.device)
    for e, token, k in _expert_slots(topk_idx, E):
        wd = fp8.dequantize_blocks(weights.down[e], weights.e_down[e], dtype=torch.float64)
        y[token, k] = (_dequantized_rows(hidden[token, k]) @ wd[:H].t()).to(torch.bfloat16)
    w = reference._zero_unrouted_weights(topk_weights.float(), topk_idx, E)
    return reference.weighted_k_sum(y, w, reference._shared_rows(x, shared))


def reference_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None) -> torch.Tensor:
    """The FP8 forward in torch (module docstring) -> out [T, H] bf16."""
    why = unsupported_reason(x.shape[1], w_gate.shape[1])
    if why:
        raise ValueError(why)
    weights = quantized_weights(w_gate, w_up, w_down)
    return reference_output(reference_hidden(x, topk_idx, weights), x, topk_idx, topk_weights,
                            weights, shared)
