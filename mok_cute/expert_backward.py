"""The one-GPU backward on mok_cute kernels: d_out in, every gradient out, no host sync.

    d_out --gather--> dY rows --FC2 dgrad (dgated epilogue)--> dG | dU, w*h, d_topk partials
                                                                  |       \\
    x --gather--> x rows ----------------------- dW_gate, dW_up <-+        dW_down <- dY rows
                                                 (wgrad, K = an expert's rows)
    dG | dU --FC1 dgrad (K = 2I)--> dx rows --k-sum (+ the shared expert's dx)--> d_x

- The FC2 dgrad multiplies the *unscaled* d_out rows by W_down and applies the router weight
  w in its epilogue, so d_topk_weights[t, k] = sum_i acc * h = <d_out[t], W_down h> needs no
  division by w (a zero or negative weight works).
- Padding rows: the gathers write zeros, and the dgated epilogue writes zeros where a row has
  no slot, whatever the saved pre-activations hold there; every weight-gradient tile then
  adds exact zeros for them.
- Deterministic: no atomics; each weight-gradient tile has one owner running its expert's rows
  in order; d_x and d_topk_weights sum in a fixed order in fp32.
- The shared expert is the same kernels with one expert over every token.
- FP8: rows whose every reader is an FP8 quantizer are not gathered (``routed_rows``): the
  quantizers read each padded row's x or d_out row through the row index (``row_index``).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from mok_cute import jit
from mok_cute.config import ExpertPathOptions
from mok_cute.constants import TILE_K, fc2_dgrad_pingpong, fc2_dgrad_tile_n, few_rows_stage_cap
from mok_cute.expert_path import SavedForBackward, _num_sms, check_preact, shared_tiles


class Needs(NamedTuple):
    """Which gradients the caller wants (autograd's needs_input_grad)."""

    x: bool = True
    topk_weights: bool = True
    w_gate_up: bool = True
    w_down: bool = True
    shared_gate_up: bool = True
    shared_down: bool = True


class MainGrads(NamedTuple):
    """fp32 buffers that the weight gradients are added into (``MoKConfig(
    fuse_wgrad_accumulation=True)``, Megatron's ``main_grad``), one per weight, each of its
    weight's shape, contiguous; None: that weight's gradient is returned as usual. The
    kernels add the unrounded fp32 accumulator of each weight-gradient tile into its buffer
    (one add an element, one owner a tile: deterministic; ``kernels.gemm_wgrad``); the
    backward then returns None for that weight."""

    w_gate: torch.Tensor | None = None
    w_up: torch.Tensor | None = None
    w_down: torch.Tensor | None = None
    ws_gate: torch.Tensor | None = None
    ws_up: torch.Tensor | None = None
    ws_down: torch.Tensor | None = None

    @property
    def routed(self) -> tuple:
        """The routed experts' buffers: (w_gate's, w_up's, w_down's)."""
        return tuple(self[:3])

    @property
    def shared(self) -> tuple:
        """The shared expert's buffers: (ws_gate's, ws_up's, ws_down's)."""
        return tuple(self[3:])


class IndexedRows(NamedTuple):
    """Rows ``source[index[r]]`` left in place (a zero row where ``index[r]`` is outside the
    source: -1 on padding rows): a reader that takes a row index (the FP8 quantizers'
    ``row_index``) reads them where they are; ``gather()`` writes the copy for the others.
    ``slots``: the inverse map when each source row has K rows (slot ``t * K + k``'s row, -1:
    none), for a reader that may go source row by source row and leave padding rows
    unwritten (``quantize.quantize_scatter_rows``)."""

    source: torch.Tensor  # [T, H]
    index: torch.Tensor  # int32 [rows]
    slots: torch.Tensor | None = None  # int32 [T * K]

    def gather(self) -> torch.Tensor:
        from mok_cute.kernels import token_ops

        return token_ops.gather_rows(self.source, self.index)


def in_place(rows) -> tuple:
    """``(source, row_index)`` for a reader that takes a row index: an ``IndexedRows``'s
    source and index, or rows already in order and None."""
    return (rows.source, rows.index) if isinstance(rows, IndexedRows) else (rows, None)


def materialized(rows):
    """Rows in order: an ``IndexedRows`` gathered, anything else as it is."""
    return rows.gather() if isinstance(rows, IndexedRows) else rows


def _compiled(name: str, device, **static):
    return jit.compile_kernel(name, jit.device_arch(device), num_sms=_num_sms(device.index or 0),
                              **static)


def fc2_dgrad(d_rows, w_down, preact, row_slot, weights, tile_expert, num_tiles,
              options: ExpertPathOptions, pingpong: bool | None = None,
              rows_per_expert: float | None = None):
    """FC2's dgrad with the SwiGLU backward in its epilogue (``gemm_sm90``'s "dgated").
    d_rows [M, H]; w_down [E, H, I]; preact [slots, 2I] (g | u by slot); row_slot [M] int32
    (-1: padding); weights fp32 [slots].
    Returns (d_preact [M, 2I] = dG | dU, hw [M, I] = w * h, row partials [M, N-tiles] fp32).
    ``pingpong``: the GEMM variant (None: by K, ``constants.fc2_dgrad_pingpong``; the row
    partials' bits follow the tile width). ``rows_per_expert``: the routing's expected rows per
    expert (T * K / E), which picks the operand stages (``constants.few_rows_stage_cap``; None:
    as many as fit; the same bits)."""
    rows, inter = d_rows.shape[0], w_down.shape[2]
    check_preact(preact, inter, row_slot, rows)
    if pingpong is None:
        pingpong = fc2_dgrad_pingpong(d_rows.shape[1])
    tile_n = fc2_dgrad_tile_n(pingpong)
    d_preact = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=d_rows.device)
    hw = torch.empty(rows, inter, dtype=torch.bfloat16, device=d_rows.device)
    partials = torch.empty(rows, -(-inter // tile_n), dtype=torch.float32, device=d_rows.device)
    kernel = _compiled("gemm_fc2_dgrad", d_rows.device, tile_n=tile_n, pingpong=pingpong,
                       group_m=options.fc1_group_m,
                       max_ab_stages=few_rows_stage_cap(rows_per_expert))
    kernel(d_rows.unsqueeze(2), w_down.permute(2, 1, 0), None,
           d_preact[:, :inter].unsqueeze(2), tile_expert, num_tiles, None,
           d_preact[:, inter:].unsqueeze(2), hw.unsqueeze(2), preact, row_slot, weights,
           partials)
    return d_preact, hw, partials


def row_partial_sums(partials):
    """Each row's sum of its dgated row partials [M, N-tiles] (fp32), in one fixed order
    whatever M: halving adds of the columns (padded with zeros to a power of two). torch's
    own row reduction may order a row's terms by the tensor's shape, and the virtual ranks'
    one launch and a group's rank (its own rows) must give d_topk_weights the same bits."""
    cols = partials.shape[1]
    width = 1 << max(cols - 1, 0).bit_length()
    if width != cols:
        partials = torch.nn.functional.pad(partials, (0, width - cols))
    while width > 1:
        width //= 2
        partials = partials[:, :width] + partials[:, width:]
    return partials[:, 0]


def slot_sums(partials, row_of_slot):
    """d_topk_weights in fp32, flat: each (token, k) slot's row sum (``row_partial_sums``)
    through ``row_of_slot`` (-1, a slot with no row: 0)."""
    per_row = torch.cat([row_partial_sums(partials), partials.new_zeros(1)])  # [-1] -> 0
    return per_row[row_of_slot.long()]


def fc1_dgrad(d_preact, w_gate, w_up, tile_expert, num_tiles, options: ExpertPathOptions,
              rows_per_expert: float | None = None):
    """dX rows [M, H] = dG @ W_gate + dU @ W_up in one accumulator (K = 2I).
    ``rows_per_expert``: as ``fc2_dgrad``'s."""
    rows, hidden = d_preact.shape[0], w_gate.shape[2]
    dx_rows = torch.empty(rows, hidden, dtype=torch.bfloat16, device=d_preact.device)
    kernel = _compiled("gemm_fc1_dgrad", d_preact.device, tile_n=256,
                       group_m=options.fc2_group_m,
                       max_ab_stages=few_rows_stage_cap(rows_per_expert))
    kernel(d_preact.unsqueeze(2), w_gate.permute(2, 1, 0), w_up.permute(2, 1, 0),
           dx_rows.unsqueeze(2), tile_expert, num_tiles, None, *(None,) * 6)
    return dx_rows


def wgrad(a, a2, b, offsets, num_experts: int, out_rows: int, main_grads=None,
          rows_per_expert: float | None = None):
    """Per expert e over its rows [offsets[e], offsets[e + 1]): C[e] = A_e^T B_e (and, with
    ``a2``, C2[e] = A2_e^T B_e from the same B tiles). a, a2 [rows, M]; b [rows, N] (strided
    views are fine: only the last mode must be contiguous). Returns C (and C2) [E, M, N].
    ``main_grads``: (C's, C2's) fp32 [E, M, N] buffers or None each: the launch adds C into
    them instead (``gemm_wgrad(accumulate=True)``) and returns None for each buffer given
    (``kernels.gemm_wgrad.wgrad_outputs``: zeros stand in for a missing one), in the way
    ``gemm_wgrad.main_grad_add`` picks for ``rows_per_expert`` (the routing's expected rows
    an expert; 0 or None: the rows' own count)."""
    from mok_cute.kernels.gemm_wgrad import wgrad_outputs

    n = b.shape[1]
    gated = a2 is not None
    shape = (num_experts, out_rows, n)
    outs, returned = wgrad_outputs((shape, shape)[:1 + gated], b.device,
                                   None if main_grads is None else main_grads[:1 + gated],
                                   "main_grads")
    from mok_cute.kernels.gemm_wgrad import main_grad_add

    accumulate = main_grads is not None
    kernel = _compiled("gemm_wgrad", b.device, gated=gated, accumulate=accumulate,
                       main_grad_add=main_grad_add(b.shape[0], num_experts, rows_per_expert)
                       if accumulate else "reduce")
    kernel(a.t().unsqueeze(2), None if a2 is None else a2.t().unsqueeze(2), b.t().unsqueeze(2),
           outs[0].permute(1, 2, 0), outs[1].permute(1, 2, 0) if gated else None, offsets)
    c = returned()
    return c if gated else c[0]


# The FP8 layer's weight gradients run in FP8 from this intermediate size on: below it their
# four column-quantization passes cost more than the FP8 GEMMs save (H200, same run: qwen3_30b,
# I = 768, backward 5.84 ms with them against 5.14 without; dsv3_ep8_rank, I = 2048, 8.96
# against 9.26; sonic_120b, I = 2048, 20.34 against 20.61; docs/measurements.md)
FP8_WGRAD_MIN_INTER = 1024
# ... and from this many rows per expert on (the weight gradient's K): with few rows the GEMM
# writes its bf16 [E, I, H] outputs more than it computes, and FP8 saves nothing there (virtual
# R = 8 at 256 tokens a rank, 64 rows an expert: FP8 weight gradients 9.6 ms where bf16's
# whole backward megakernel took 12.7; docs/measurements.md)
FP8_WGRAD_MIN_ROWS = 1024


# The FP8 layer's FC2 dgrad runs in FP8 from this intermediate size on (its N): below it the
# d_out rows' quantization and the dgated epilogue, which FP8 does not shrink, cost more than
# the FP8 GEMM saves (H200, same run: qwen3_30b, I = 768, 1.140 ms against bf16's 0.931;
# dsv3_ep8_rank, I = 2048, 1.398 against 1.507; docs/measurements.md). FC1's dgrad stays FP8.
FP8_FC2_DGRAD_MIN_INTER = 1024


def fp8_fc2_dgrad(hidden: int, inter: int) -> bool:
    """Whether the FP8 layer's FC2 dgrad runs in FP8 (else the bf16 launch, whose dG | dU
    FC1's FP8 dgrad then quantizes): always where H or I is padded to whole 128 groups (the
    FP8 path's row widths), else from ``FP8_FC2_DGRAD_MIN_INTER`` on. A shape's choice, the
    same on every path."""
    return hidden % 128 != 0 or inter % 128 != 0 or inter >= FP8_FC2_DGRAD_MIN_INTER


def fp8_weight_grads(hidden: int, inter: int, rows_per_expert: float) -> bool:
    """Whether the FP8 layer's weight gradients run in FP8 (``gemm_wgrad_fp8``): H and I
    whole 128 groups (no padded copies), I and the expected rows per expert large enough
    that the FP8 GEMMs save more than the column quantizations cost. A shape's choice, so
    the same on every path given the same sizes."""
    return (hidden % 128 == 0 and inter % 128 == 0 and inter >= FP8_WGRAD_MIN_INTER
            and rows_per_expert >= FP8_WGRAD_MIN_ROWS)


def _expert_backward(d_rows, x_rows, w_gate, w_up, w_down, preact, row_slot, weights,
                     tile_expert, num_tiles, offsets, want_dx: bool, want_gate_up: bool,
                     want_down: bool, want_partials: bool, options: ExpertPathOptions,
                     fp8: bool = False, dgrads: str = "kernels", fp8_transposed=None,
                     rows_per_expert: float = 0.0, main=None, timeline=None, reduce_dx=None):
    """One group of experts' backward (the routed experts, or the shared one): (dx rows,
    dW_gate, dW_up, dW_down, row partials), None where not wanted. ``fp8``: the two dgrads
    on the FP8 kernels (``expert_path_fp8.expert_dgrads``), the weight gradients too where
    ``fp8_weight_grads`` says so for ``rows_per_expert`` (the routing's expected rows per
    expert, T * K / E, which also picks the dgrads' stages: ``fc2_dgrad``).
    ``dgrads="megakernel"``: the two dgrads in one launch (``megakernel_backward``), and the
    weight gradients in it too when both kinds are wanted. ``fp8_transposed``: the FP8
    dgrads' transposed weights when the caller has them (else quantized from the cache).
    ``d_rows``, ``x_rows``: the padded rows in order, or ``IndexedRows`` that the
    FP8 quantizers read in place (``routed_rows``; gathered for any other reader); either may
    be a function that makes them, called when they are first read: the backward then holds
    the only reference and drops them after their last reader (``_owned``).
    ``main``: (dW_gate's, dW_up's, dW_down's) main_grad buffers or None each (``_WeightGrads``;
    None returned for each given). ``timeline``: the megakernel launch's recorder buffer.
    ``reduce_dx``: applied to the dx rows as soon as they exist (the caller's k-sum), its
    result returned in their place.
    Memory: each workspace is dropped after its last reader, in the order dgrads, reduce_dx
    (the dx rows), dW_down (the d_out rows and w * h), dW_gate | dW_up (x rows gathered only
    now, dG | dU): ~1 GB less at the peak on dsv3_ep8_rank than holding them all."""
    if not (want_dx or want_gate_up or want_down or want_partials):
        return None, None, None, None, None
    reduce_dx = reduce_dx or (lambda rows: rows)
    if dgrads == "megakernel" and want_gate_up and want_down and not fp8:
        # every GEMM of the backward in one launch
        from mok_cute import megakernel_backward
        _, _, partials, dx_rows, dwg, dwu, dwd = megakernel_backward.expert_grads(
            materialized(_owned(d_rows)), materialized(_owned(x_rows)), w_gate, w_up, w_down,
            preact, row_slot, weights, tile_expert, num_tiles, offsets,
            main_grads=None if _buffers(main, 0, 3) is None else MainGrads(*main),
            timeline=timeline, rows_per_expert=rows_per_expert)
        return reduce_dx(dx_rows) if want_dx else None, dwg, dwu, dwd, partials
    d_rows = _owned(d_rows)
    d_preact, hw, partials, dx_rows = _dgrads(d_rows, w_gate, w_up, w_down, preact, row_slot,
                                              weights, tile_expert, num_tiles, want_dx,
                                              options, fp8, dgrads, fp8_transposed,
                                              rows_per_expert or None)
    # the backward megakernel's dgrads make dx rows whether or not they are wanted
    dx = reduce_dx(dx_rows) if want_dx and dx_rows is not None else None
    del dx_rows
    wgrads = _WeightGrads(w_gate, w_down, offsets, fp8, rows_per_expert, main)
    dwd = wgrads.down(hw, d_rows) if want_down else None
    del hw, d_rows
    dwg, dwu = wgrads.gate_up(d_preact, _owned(x_rows)) if want_gate_up else (None, None)
    return dx, dwg, dwu, dwd, partials


def _owned(rows):
    """``rows``, made first where it is the function that makes them (``_expert_backward``)."""
    return rows() if callable(rows) else rows


def routed_rows(source, row_token, fp8_only: bool, row_of_slot=None):
    """A backward operand's padded rows (``source``'s rows by ``row_token``, zeros where it is
    -1): gathered in bf16, or, when ``fp8_only`` (every reader of them is an FP8 quantizer),
    ``IndexedRows`` that the quantizers read in place: no gathered copy written and read
    again (``row_of_slot``: their ``slots``)."""
    if fp8_only:
        return IndexedRows(source.contiguous(), row_token, row_of_slot)
    from mok_cute.kernels import token_ops

    return token_ops.gather_rows(source, row_token)


def fp8_reads_only(precision: str, hidden: int, inter: int, rows_per_expert: float,
                   needs: Needs) -> tuple[bool, bool]:
    """Whether FP8 quantizers are the only readers of (the d_out rows, the x rows): d_out's
    when FC2's dgrad and, if wanted, the down weight gradient run in FP8; x's when the gate
    / up weight gradients do."""
    if precision != "fp8":
        return False, False
    wgrads = fp8_weight_grads(hidden, inter, rows_per_expert)
    return fp8_fc2_dgrad(hidden, inter) and (wgrads or not needs.w_down), wgrads


def _dgrads(d_rows, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert, num_tiles,
            want_dx: bool, options: ExpertPathOptions, fp8: bool = False,
            dgrads: str = "kernels", fp8_transposed=None, rows_per_expert: float | None = None):
    """FC2's dgrad (its dgated epilogue) and FC1's: (d_preact = dG | dU, hw = w * h, row
    partials, dx rows or None). ``fp8``, ``dgrads`` as ``_expert_backward``;
    ``rows_per_expert`` as ``fc2_dgrad``."""
    dx_rows = None
    if fp8:
        from mok_cute import expert_path_fp8
        wt = fp8_transposed or expert_path_fp8.transposed_weights(w_gate, w_up, w_down)
        hidden = w_down.shape[1]
        if fp8_fc2_dgrad(hidden, w_gate.shape[1]):
            d_preact, hw, partials, dx_rows = expert_path_fp8.expert_dgrads(
                _quantized_rows(d_rows), preact, row_slot, weights, tile_expert, num_tiles, wt,
                want_dx, hidden)
        else:  # FC2's dgrad in bf16 (d_rows are H wide: no padding), FC1's in FP8
            d_preact, hw, partials = fc2_dgrad(materialized(d_rows), w_down, preact, row_slot,
                                               weights, tile_expert, num_tiles, options,
                                               rows_per_expert=rows_per_expert)
            if want_dx:
                dx_rows = expert_path_fp8.fc1_dgrad(d_preact, tile_expert, num_tiles, wt,
                                                    hidden)
    elif dgrads == "megakernel":
        from mok_cute import megakernel_backward
        d_preact, hw, partials, dx_rows = megakernel_backward.expert_dgrads(
            d_rows, w_gate, w_up, w_down, preact, row_slot, weights, tile_expert, num_tiles)
    else:
        d_preact, hw, partials = fc2_dgrad(d_rows, w_down, preact, row_slot, weights,
                                           tile_expert, num_tiles, options,
                                           rows_per_expert=rows_per_expert)
        if want_dx:
            dx_rows = fc1_dgrad(d_preact, w_gate, w_up, tile_expert, num_tiles, options,
                                rows_per_expert)
    return d_preact, hw, partials, dx_rows


def _quantized_rows(rows):
    """Rows quantized 1 x 128 for an FP8 GEMM's A: an ``IndexedRows`` in place, token by token
    into its K rows when it has ``slots`` (``quantize_scatter_rows``, the forward's x path:
    padding rows keep whatever the buffer held), else through its index; rows in order as they
    are."""
    from mok_cute.kernels import quantize

    if isinstance(rows, IndexedRows) and rows.slots is not None and len(rows.source):
        return quantize.quantize_scatter_rows(rows.source, rows.slots, rows.index.shape[0])
    src, index = in_place(rows)
    return quantize.quantize_rows(src, row_index=index)


class _WeightGrads(NamedTuple):
    """The grouped weight gradients from the dgrads' outputs, each on what it alone reads (so
    that a caller can drop the rest between them). FP8 pads I and H to whole 128 groups: they
    take the real columns. ``fp8``: on ``gemm_wgrad_fp8`` where ``fp8_weight_grads(H, I,
    rows_per_expert)``, bf16 otherwise. ``main``: (dW_gate's, dW_up's, dW_down's) main_grad
    buffers or None each: the gradients are added into them, None returned for each
    (``wgrad``)."""

    w_gate: torch.Tensor
    w_down: torch.Tensor
    offsets: torch.Tensor
    fp8: bool = False
    rows_per_expert: float = 0.0
    main: tuple | None = None

    @property
    def _on_fp8(self) -> bool:
        return self.fp8 and fp8_weight_grads(self.w_down.shape[1], self.w_gate.shape[1],
                                             self.rows_per_expert)

    def gate_up(self, d_preact, x_rows):
        """(dW_gate, dW_up) from dG | dU and the x rows (as ``_expert_backward``'s)."""
        num_experts, inter = self.w_gate.shape[0], self.w_gate.shape[1]
        main = _buffers(self.main, 0, 2)
        if self._on_fp8:
            return _gate_up_grads_fp8(d_preact, x_rows, self.offsets, num_experts, inter, main)
        half = d_preact.shape[1] // 2
        return wgrad(d_preact[:, :inter], d_preact[:, half:half + inter], materialized(x_rows),
                     self.offsets, num_experts, inter, main, self.rows_per_expert)

    def down(self, hw, d_rows):
        """dW_down from w * h and the d_out rows (as ``_expert_backward``'s)."""
        num_experts, inter, hidden = self.w_gate.shape[0], self.w_gate.shape[1], self.w_down.shape[1]
        main = _buffers(self.main, 2, 3)
        if self._on_fp8:
            return _down_grad_fp8(hw, d_rows, self.offsets, num_experts, main)
        return wgrad(materialized(d_rows)[:, :hidden], None, hw[:, :inter], self.offsets,
                     num_experts, hidden, main, self.rows_per_expert)


def _weight_grads(d_preact, hw, d_rows, x_rows, w_gate, w_down, offsets, want_gate_up: bool,
                  want_down: bool, fp8: bool = False, rows_per_expert: float = 0.0,
                  main=None):
    """(dW_gate, dW_up, dW_down) of ``_WeightGrads``, None where not wanted."""
    wgrads = _WeightGrads(w_gate, w_down, offsets, fp8, rows_per_expert, main)
    dwd = wgrads.down(hw, d_rows) if want_down else None
    dwg, dwu = wgrads.gate_up(d_preact, x_rows) if want_gate_up else (None, None)
    return dwg, dwu, dwd


def rank_views(buffers, r: int):
    """Rank ``r``'s views of main_grad buffers with a leading rank dimension (None each where
    absent), or None without buffers."""
    return None if buffers is None else tuple(None if b is None else b[r] for b in buffers)


def _buffers(main, begin: int, end: int):
    """``main[begin:end]``, the main_grad buffers of one launch's outputs, or None when it has
    none of them (that launch stores bf16)."""
    if main is None or all(b is None for b in main[begin:end]):
        return None
    return tuple(main[begin:end])


def _gate_up_grads_fp8(d_preact, x_rows, offsets, num_experts: int, inter: int, main=None):
    """(dW_gate, dW_up) on FP8 (``kernels.gemm_wgrad_fp8``): dG | dU column-quantized per 128
    rows, the x rows per column and expert (``quantize.quantize_cols_per_expert``; an
    ``IndexedRows`` quantized through its index, read in place); H and I whole 128 groups."""
    from mok_cute.kernels import gemm_wgrad_fp8, quantize

    gq, eg = quantize.quantize_cols(d_preact)  # [2I, rows]: dG^T, then dU^T
    x_src, x_index = in_place(x_rows)
    xq, ex = quantize.quantize_cols_per_expert(x_src, offsets, num_experts, row_index=x_index)
    return gemm_wgrad_fp8.grouped_wgrad_fp8(gq[:inter], eg[:inter], xq, ex, offsets,
                                            num_experts, gq[inter:], eg[inter:],
                                            main_grads=main)


def _down_grad_fp8(hw, d_rows, offsets, num_experts: int, main=None):
    """dW_down on FP8: the d_out rows column-quantized per 128 rows (an ``IndexedRows`` through
    its index), w * h per column and expert."""
    from mok_cute.kernels import gemm_wgrad_fp8, quantize

    hq, eh = quantize.quantize_cols_per_expert(hw, offsets, num_experts)
    d_src, d_index = in_place(d_rows)
    return gemm_wgrad_fp8.grouped_wgrad_fp8(*quantize.quantize_cols(d_src, row_index=d_index),
                                            hq, eh, offsets, num_experts, main_grads=main)


def shared_backward(d_out, x, shared, shared_preact, needs: Needs = Needs(),
                    options: ExpertPathOptions = ExpertPathOptions(), main=None):
    """The shared expert's backward, one expert over every token of ``x`` [T, H] (the one-GPU
    layer, or one virtual rank's tokens): (its dx rows [T, H] or None, (d_ws_gate, d_ws_up,
    d_ws_down) with None where ``needs`` says no). ``shared_preact`` [T, 2Is]: its g | u by
    token, as the training forward saved them; ``d_out`` [T, H] contiguous. ``main``: the
    three weights' main_grad buffers or None each (added into, None returned)."""
    num_tokens = x.shape[0]
    ws_gate, ws_up, ws_down = (w.unsqueeze(0) for w in shared)
    tiles, count = shared_tiles(num_tokens, x.device)
    rows_all = torch.arange(num_tokens, dtype=torch.int32, device=x.device)
    ones = torch.ones(num_tokens, dtype=torch.float32, device=x.device)
    # one expert over every token: K runs over all rows (TMA zero-fills past T)
    # [0, T rounded up] by a kernel: no host copy (no sync, CUDA-graph capture stays legal)
    offsets = torch.arange(2, dtype=torch.int32, device=x.device) * (-(-num_tokens // TILE_K) * TILE_K)
    if main is not None:  # one expert: the buffers with its expert dimension
        main = tuple(None if b is None else b.unsqueeze(0) for b in main)
    shared_dx, dsg, dsu, dsd, _ = _expert_backward(
        d_out, x, ws_gate, ws_up, ws_down, shared_preact, rows_all, ones, tiles, count, offsets,
        needs.x, needs.shared_gate_up, needs.shared_down, False, options,
        rows_per_expert=float(num_tokens), main=main)
    return shared_dx, tuple(None if g is None else g[0] for g in (dsg, dsu, dsd))


def shared_backward_ranks(d_out, xs, shared, shared_preact, needs: Needs = Needs(),
                          options: ExpertPathOptions = ExpertPathOptions(), main=None):
    """The shared expert's backward on each of R ranks' tokens (d_out, xs [R, T, H], shared
    and shared_preact with a leading R): (each rank's dx rows, None where not wanted;
    (d_ws_gate, d_ws_up, d_ws_down) [R, ...], None where not wanted). Every rank's in one
    backward-megakernel launch (``megakernel_backward.shared_expert_grads``) where Is is a
    whole number of 64-deep k-tiles, else ``shared_backward`` rank by rank; the same bits.
    ``main``: the three weights' [R, ...] main_grad buffers or None each (added into, None
    returned)."""
    R = xs.shape[0]
    if shared is None or not (needs.x or needs.shared_gate_up or needs.shared_down):
        return [None] * R, (None, None, None)
    if shared[0].shape[-2] % TILE_K == 0 and xs.shape[1] > 0:
        # every rank's in one backward-megakernel launch (the same tiles: the same bits)
        from mok_cute import megakernel_backward as mb
        s = mb.shared_expert_grads(mb.SharedExpert(
            d_out.contiguous(), xs.contiguous(), *(w.contiguous() for w in shared),
            shared_preact.contiguous()), wgrads=needs.shared_gate_up or needs.shared_down,
            main_grads=None if _buffers(main, 0, 3) is None else MainGrads(None, None, None, *main))
        return list(s.dx) if needs.x else [None] * R, wanted_shared_grads(s, needs)
    return shared_backward_rank_by_rank(d_out, xs, shared, shared_preact, needs, options, main)


def shared_backward_rank_by_rank(d_out, xs, shared, shared_preact, needs: Needs = Needs(),
                                 options: ExpertPathOptions = ExpertPathOptions(), main=None):
    """``shared_backward_ranks``' result from ``shared_backward``'s launches, rank by rank."""
    per_rank = [shared_backward(d_out[r], xs[r], tuple(w[r] for w in shared), shared_preact[r],
                                needs, options, rank_views(main, r)) for r in range(xs.shape[0])]
    grads = tuple(None if per_rank[0][1][i] is None
                  else torch.stack([g[i] for _, g in per_rank]) for i in range(3))
    return [dx for dx, _ in per_rank], grads


def wanted_shared_grads(grads, needs: Needs) -> tuple:
    """(dWs_gate, dWs_up, dWs_down) of a ``megakernel_backward.SharedGrads``, None where
    ``needs`` says no."""
    return (grads.w_gate if needs.shared_gate_up else None,
            grads.w_up if needs.shared_gate_up else None,
            grads.w_down if needs.shared_down else None)


def shared_in_launch(shared, precision: str, needs: Needs) -> bool:
    """Whether the backward megakernel's launch runs the shared expert's backward too: a bf16
    launch with the routed weight gradients (the shared expert's run with them), Is a whole
    number of 64-deep k-tiles (the launch's K split between its gate and up weights)."""
    return (shared is not None and precision == "bf16" and needs.w_gate_up and needs.w_down
            and shared[0].shape[-2] % TILE_K == 0)  # ws_gate [(L,) Is, H]


def records_backward(precision: str, dgrads: str, needs: Needs) -> bool:
    """Whether a backward runs as the one backward-megakernel launch that a timeline records
    (bf16, ``dgrads="megakernel"``, every routed weight gradient wanted: with one frozen,
    the dgrads and the wanted weight gradient are launches of their own)."""
    return (precision == "bf16" and dgrads == "megakernel" and needs.w_gate_up
            and needs.w_down)


def check_timeline(timeline, precision: str, dgrads: str, needs: Needs) -> None:
    """A ``timeline`` given to a backward that does not run as that one launch: ValueError."""
    if timeline is not None and not records_backward(precision, dgrads, needs):
        raise ValueError("timeline: only the one backward-megakernel launch records (bf16, "
                         "dgrads='megakernel', every weight gradient wanted)")


def moe_backward(d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                 saved: SavedForBackward, needs: Needs = Needs(),
                 options: ExpertPathOptions = ExpertPathOptions(), precision: str = "bf16",
                 dgrads: str = "kernels", main_grads: MainGrads | None = None, timeline=None):
    """Every gradient of ``expert_path.moe_forward_kernel(..., save=True)`` (or of
    ``expert_path_fp8.moe_forward_fp8(..., save=True)`` with ``precision="fp8"``: the routed
    experts' dgrads in FP8 and, where ``fp8_weight_grads`` says so, their weight gradients,
    everything else bf16) given d_out [T, H]:
    (d_x, d_topk_weights fp32, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down),
    None where ``needs`` says no (and for the shared expert's three without one).
    ``dgrads``: the routed experts' bf16 dgrads as two grouped-GEMM launches ("kernels") or
    one backward-megakernel launch ("megakernel"; the same bits), which also runs their
    weight gradients when all three are wanted, and then the shared expert's backward too
    (``shared_in_launch``). ``main_grads``: the weights' fp32 main_grad buffers (``MainGrads``);
    each weight gradient with one is added into it and returned as None. ``timeline``: a
    ``mok_cute.timeline.TimelineBuffer`` that the one backward-megakernel launch records into
    (``dgrads="megakernel"`` with every weight gradient wanted)."""
    if dgrads not in ("kernels", "megakernel"):
        raise ValueError(f"dgrads: expected 'kernels' or 'megakernel', got {dgrads!r}")
    if dgrads == "megakernel" and precision != "bf16":
        raise ValueError(f"dgrads='megakernel' runs bf16 dgrads, got precision={precision!r}")
    check_timeline(timeline, precision, dgrads, needs)
    if not isinstance(saved, SavedForBackward):
        raise TypeError(f"saved: expected the SavedForBackward of a training forward "
                        f"(save=True), got {type(saved).__name__}")
    if not isinstance(d_out, torch.Tensor) or d_out.shape != x.shape:
        raise ValueError(f"d_out: expected shape {list(x.shape)} (the output's), got "
                         f"{list(d_out.shape) if isinstance(d_out, torch.Tensor) else type(d_out).__name__}")
    if d_out.dtype != torch.bfloat16 or d_out.device != x.device:
        raise ValueError(f"d_out: expected bfloat16 on {x.device}, got {d_out.dtype} on {d_out.device}")
    from mok_cute.kernels import token_ops

    num_tokens, top_k = topk_idx.shape
    d_out = d_out.contiguous()
    weights = topk_weights.to(torch.float32).contiguous().view(-1)
    d_src = d_out
    if precision == "fp8":  # the FP8 dgrad's K: H zero-padded to whole 128 groups
        from mok_cute.expert_path_fp8 import pad_cols, padded
        d_src = pad_cols(d_out, padded(d_out.shape[1]))
    row_token = saved.row_token(top_k)
    rows_per_expert = num_tokens * top_k / w_gate.shape[0]
    d_fp8_only, x_fp8_only = fp8_reads_only(precision, x.shape[1], w_gate.shape[1],
                                            rows_per_expert, needs)
    # made when first read, held by the backward alone (dropped after their last reader)
    d_rows = partial(routed_rows, d_src, row_token, d_fp8_only, saved.row_of_slot)  # zeros on padding
    x_rows = partial(routed_rows, x, row_token, x_fp8_only) if needs.w_gate_up else None
    ones = torch.ones(num_tokens, top_k, dtype=torch.float32, device=x.device)
    k_sum = partial(token_ops.weighted_ksum, w=ones, row_index=saved.row_of_slot)
    if dgrads == "megakernel" and shared_in_launch(shared, precision, needs):
        # every GEMM of the backward, the shared expert's too, in one launch
        from mok_cute import megakernel_backward
        *_, partials, dx_rows, dwg, dwu, dwd, s = megakernel_backward.expert_grads(
            d_rows(), x_rows(), w_gate, w_up, w_down, saved.preact, saved.row_slot, weights,
            saved.tile_expert, saved.num_tiles, saved.expert_offsets,
            shared=megakernel_backward.SharedExpert(
                d_out, x.contiguous(), *(w.contiguous() for w in shared), saved.shared_preact),
            main_grads=main_grads, timeline=timeline, rows_per_expert=rows_per_expert)
        d_shared = wanted_shared_grads(s, needs)
        d_x = k_sum(dx_rows, shared=s.dx) if needs.x else None
    else:
        # the shared expert's first: the k-sum then runs as soon as the routed dx rows exist
        shared_dx, d_shared = None, (None, None, None)
        if shared is not None:
            shared_dx, d_shared = shared_backward(d_out, x, shared, saved.shared_preact, needs,
                                                  options,
                                                  None if main_grads is None else main_grads.shared)
        d_x, dwg, dwu, dwd, partials = _expert_backward(
            d_rows, x_rows, w_gate, w_up, w_down, saved.preact, saved.row_slot, weights,
            saved.tile_expert, saved.num_tiles, saved.expert_offsets, needs.x, needs.w_gate_up,
            needs.w_down, needs.topk_weights, options, fp8=precision == "fp8", dgrads=dgrads,
            rows_per_expert=rows_per_expert,
            main=None if main_grads is None else main_grads.routed, timeline=timeline,
            reduce_dx=partial(k_sum, shared=shared_dx))
    d_topk = None
    if needs.topk_weights:
        d_topk = slot_sums(partials, saved.row_of_slot).view(num_tokens, top_k)
        d_topk = d_topk.to(topk_weights.dtype)
    return (d_x, d_topk, dwg if needs.w_gate_up else None, dwu if needs.w_gate_up else None,
            dwd, *d_shared)
