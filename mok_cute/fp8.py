"""FP8 numerics in one place: E4M3 data with power-of-two scales (issue 33, item 1).

PyTorch only (no DSL import): this module is the oracle of the quantizer kernels
(``mok_cute.kernels.quantize``), which match it bit for bit, and the CPU fallback.

Formats (``q`` is ``torch.float8_e4m3fn``, ``e`` is an ``int8`` exponent: the scale is ``2**e``,
a value is ``float(q) * 2**e``)
    rows    ``quantize_rows(x)``: ``x [M, K]`` in groups of 1 x 128 along K (activations and
            gradients: x before FC1, h, d_out rows) -> ``q [M, K]``, ``e [M, K/128]``.
    cols    ``quantize_cols(x)``: the column-quantized transposed copy that a weight gradient
            reads (x, h, d_out rows, dG, dU): groups of 128 along M -> ``qt [K, M]``,
            ``e [K, M/128]``; exactly ``quantize_rows(x.t())``.
    blocks  ``quantize_blocks(w)``: weights ``[N, K]`` or ``[E, N, K]`` in 128 x 128 blocks ->
            ``q`` like ``w``, ``e [..., N/128, K/128]``; ``transposed=True`` gives the exact
            transposed copy for dgrad (``q [..., K, N]``, ``e [..., K/128, N/128]``, the same
            scale per block), so ``dequantize(q^T) == dequantize(q)^T`` bit for bit.
    MXFP8   ``to_mxfp8`` / ``from_mxfp8``: four 1 x 32 E8M0 scales per 1 x 128 group.

Scale rule (integer exponent arithmetic, no float log2)
    ``amax`` is the largest ``|x|`` of the group, found as the integer maximum of the fp32 bit
    patterns with the sign cleared (for non-negative floats integer order is float order; a
    NaN's pattern is above inf's). With ``B = amax_bits >> 23`` (biased exponent) and
    ``m = amax_bits & 0x7FFFFF`` (mantissa), a normal ``amax = 2**(B-127) * (1 + m/2**23)`` and
    ``448 = 2**8 * 1.75``, so ``amax / 448 = 2**(B-135) * (1 + m/2**23) / 1.75`` with the last
    factor in ``[0.571, 1.143)``; its ceil-log2 is ``0`` when ``1 + m/2**23 <= 1.75``, else ``1``:

        e = max(B - 135 + (m > 0x600000), EXP_MIN)          # = ceil(log2(amax / 448))

    exactly (checked against an fp64 computation in the tests). ``EXP_MIN = -127`` (the E8M0
    range's floor): a subnormal amax (``B = 0``) gives ``<= -134`` before the clamp, so the clamp
    makes the formula exact for subnormals too, and an all-zero group gets ``e = -127`` and
    zeros. Finite fp32 input gives ``e <= 120``.
Data
    ``q = e4m3(x * 2**-e)``: ``2**-e`` is a normal fp32 for every finite group, so the fp32
    product is exact unless it falls below 2**-126, where e4m3 rounds to zero anyway;
    round-to-nearest-even (e4m3 subnormals included), signed zeros kept. With ``e`` chosen by
    ceil, ``|x * 2**-e| <= 448``, so the explicit saturation to +-448 (``clamp`` before the
    conversion; the kernels' ``cvt.rn.satfinite``) never binds for finite input: the result
    does not depend on how a torch build converts out-of-range values.
Non-finite input
    A group holding an inf or a NaN becomes ``e = EXP_NONFINITE (127)`` and every ``q`` of it is
    NaN (``0x7F``): the whole group is poisoned, so a NaN or an overflow surfaces in the GEMM
    instead of being flushed away (finite input never gives ``e > 120``).
Shapes
    The quantized extent must be a multiple of the group (K for rows, M for cols, N and K for
    blocks): anything else is refused with a ValueError naming the argument. Padding would
    hide a size the FP8 GEMMs cannot take (they promote every 128 of K) and give a partial
    group no other implementation agrees on; the expert rows a weight gradient reads are
    already padded to 128 per expert.
MXFP8
    ``to_mxfp8(q, e)``: the data as is and E8M0 bytes ``e + 127`` (uint8, viewable as
    ``torch.float8_e8m0fnu``) for each 1 x 32 sub-block: lossless. ``from_mxfp8(q, s)``:
    per 1 x 128 group ``e = max`` of the four sub-block exponents and each sub-block's data
    ``e4m3(q * 2**(e_i - e))``: exact when representable (equal exponents always; a shift
    that keeps the value inside e4m3), else round-to-nearest-even (e4m3 subnormals or zero).
    ``from_mxfp8(*to_mxfp8(q, e)) == (q, e)`` bitwise. A NaN scale byte (0xFF) or NaN data
    makes the group non-finite as above.
"""

from __future__ import annotations

import torch

from mok_cute.config import check_int, describe

__all__ = [
    "E4M3_MAX", "GROUP", "MX_BLOCK", "EXP_MIN", "EXP_NONFINITE", "E8M0_BIAS",
    "scale_exponent", "scale_exponent_from_bits", "pow2",
    "quantize_rows", "quantize_cols", "quantize_blocks", "packed_row_bytes", "pack_rows",
    "unpack_rows",
    "dequantize_rows", "dequantize_cols", "dequantize_blocks",
    "to_mxfp8", "from_mxfp8",
]

E4M3_MAX = 448.0
GROUP = 128  # 1 x 128 groups of activations and gradients; 128 x 128 weight blocks
MX_BLOCK = 32  # elements per E8M0 scale in MXFP8
EXP_MIN = -127  # all-zero and tiny groups; E8M0 byte 0
EXP_NONFINITE = 127  # a group with an inf or a NaN (all its data NaN)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_NAN_BITS = 0x7F
# 448 = 0 1000 0111 1100...: biased exponent 135, mantissa 0x600000
_B448 = 135
_M448 = 0x600000
_FP32_INF_BITS = 0x7F800000
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_DTYPE = torch.int8


# ------------------------------------------------------------------------ scale rule
def scale_exponent_from_bits(amax_bits: torch.Tensor) -> torch.Tensor:
    """``e = ceil(log2(amax / 448))`` from the fp32 bit pattern of ``amax >= 0`` (int32), in
    integers: ``max(B - 135 + (m > 0x600000), EXP_MIN)``, ``EXP_NONFINITE`` for inf / NaN
    patterns. Returns int32."""
    bits = amax_bits.to(torch.int32)
    e = (bits >> 23) - _B448 + ((bits & 0x7FFFFF) > _M448).to(torch.int32)
    e = e.clamp_min(EXP_MIN)
    return torch.where(bits >= _FP32_INF_BITS, torch.full_like(e, EXP_NONFINITE), e)


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The scale exponent of groups whose largest magnitude is ``amax`` (any float tensor,
    converted to fp32 exactly for bf16 / fp16; its sign is ignored). Returns int32."""
    bits = amax.to(torch.float32).contiguous().view(torch.int32) & 0x7FFFFFFF
    return scale_exponent_from_bits(bits)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0 ** e`` as fp32, exact for integer ``e`` in [-149, 127] (subnormals included),
    0 below, built from bits (no pow / exp2 rounding)."""
    e = e.to(torch.int32)
    normal = ((e.clamp(-126, 127) + 127) << 23).view(torch.float32)
    sub = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    out = torch.where(e >= -126, normal, sub)
    return torch.where(e < -149, torch.zeros_like(out), out)


def _quantize_groups(xg: torch.Tensor, reduce_dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 ``xg`` whose groups span ``reduce_dims``: the shared kernel of every
    format. Returns (q e4m3 shaped like xg, e int32 with reduce_dims kept as size 1)."""
    bits = xg.contiguous().view(torch.int32) & 0x7FFFFFFF
    amax_bits = bits.amax(dim=reduce_dims, keepdim=True)  # integer max: NaN above inf
    e = scale_exponent_from_bits(amax_bits)
    y = xg * pow2(-e)  # a normal fp32 power of two for every finite group: exact
    y = y.clamp(-E4M3_MAX, E4M3_MAX)  # explicit saturation; never binds for finite groups
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)  # byte ops below: any device has them
    q = torch.where((e == EXP_NONFINITE).expand_as(xg), E4M3_NAN_BITS, q)
    return q.view(torch.float8_e4m3fn), e


# ------------------------------------------------------------------------ argument checks
def _check_input(name: str, x: object, dims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {describe(x)}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name}: expected dtype bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(x.shape)}")
    return x


def _check_group(name: str, value: object) -> int:
    check_int(name, value, min_value=1)
    return value


def _check_multiple(name: str, x: torch.Tensor, dim: int, what: str, group: int) -> int:
    n = x.shape[dim]
    if n % group != 0:
        raise ValueError(f"{name}: expected {what} (dim {dim % x.dim()}) a multiple of {group}, "
                         f"got shape {tuple(x.shape)}")
    return n // group


def _check_quantized(name: str, q: object, dims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {describe(q)}")
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: expected dtype float8_e4m3fn, got {q.dtype}")
    if q.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(q.shape)}")
    return q


def _check_exponents(name: str, e: object, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(e, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {describe(e)}")
    if e.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"{name}: expected an integer dtype (int8), got {e.dtype}")
    if tuple(e.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(e.shape)}")
    return e


DEQUANTIZED_DTYPES = (torch.float32, torch.float64)


def _check_dequantized_dtype(dtype: object) -> None:
    if dtype not in DEQUANTIZED_DTYPES:
        raise TypeError(f"dtype: expected torch.float32 or torch.float64, got {describe(dtype)}")


# ------------------------------------------------------------------------ rows / cols
def quantize_rows(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16, fp16 or fp32) in 1 x ``group`` groups along K ->
    ``(q [M, K] float8_e4m3fn, e [M, K/group] int8)`` with ``x ~ q * 2**e`` per group.
    ``K % group != 0`` is refused (ValueError naming x)."""
    _check_input("x", x, (2,))
    group = _check_group("group", group)
    m, k = x.shape
    g = _check_multiple("x", x, 1, "K", group)
    q, e = _quantize_groups(x.to(torch.float32).reshape(m, g, group), (2,))
    return q.reshape(m, k), e.reshape(m, g).to(SCALE_DTYPE)


def packed_row_bytes(k: int) -> int:
    """Bytes of one packed row of ``k`` e4m3 values (``k % 128 == 0``): the data, then its
    ``k / 128`` exponents padded to 16 bytes, so a row (what the megakernel's rings hold and
    its comm copies) moves as whole 16-byte vectors and its data stays 16-byte aligned."""
    return k + (k // GROUP + 15) // 16 * 16  # also on a kernel's Int32 (k >= 0)


def pack_rows(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``quantize_rows``' ``(q [M, K], e [M, K/128])`` as packed rows: ``[M,
    packed_row_bytes(K)]`` uint8, the data bytes then the exponent bytes, zero padding."""
    m, k = q.shape
    out = torch.zeros(m, packed_row_bytes(k), dtype=torch.uint8, device=q.device)
    out[:, :k] = q.view(torch.uint8)
    out[:, k:k + k // GROUP] = e.view(torch.uint8)
    return out


def unpack_rows(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(q [M, K] float8_e4m3fn, e [M, K/128] int8)`` of packed rows (``pack_rows``)."""
    return (packed[:, :k].view(torch.float8_e4m3fn),
            packed[:, k:k + k // GROUP].view(SCALE_DTYPE))


def quantize_cols(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The column-quantized transposed copy a weight gradient reads: ``x [M, K]`` in groups of
    ``group`` rows (one column each) -> ``(qt [K, M] float8_e4m3fn, e [K, M/group] int8)``,
    bitwise ``quantize_rows(x.t())``. ``M % group != 0`` is refused (ValueError naming x):
    the expert-sorted rows are padded to 128 per expert, so no group spans two experts."""
    _check_input("x", x, (2,))
    group = _check_group("group", group)
    _check_multiple("x", x, 0, "M", group)
    return quantize_rows(x.t(), group)


def _expert_segments(offsets: object, rows: int) -> list[tuple[int, int]]:
    """Each expert's rows [lo, hi) from its first rows ``offsets [E + 1]`` (checked: 1-D,
    non-decreasing, within [0, rows])."""
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 2:
        raise ValueError(f"offsets: expected a 1-D tensor [E + 1], got {describe(offsets)}")
    bounds = [int(b) for b in offsets.tolist()]
    if bounds[0] < 0 or bounds[-1] > rows or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"offsets: expected non-decreasing rows within [0, {rows}], got {bounds}")
    return list(zip(bounds[:-1], bounds[1:]))


def quantize_cols_per_expert(x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed copy of a weight gradient's B operand (x rows, w * h rows) with one scale
    per column and expert: ``x [rows, N]`` and the experts' first rows ``offsets [E + 1]`` ->
    ``(qt [N, rows] float8_e4m3fn, e [E, N] int8)``, each expert's segment of a column one
    group (rows outside every segment: zeros). Coarser along the rows than ``quantize_cols``'
    128-row groups so that the weight gradient's promotion needs only A's row scales; e4m3's
    range (2^17.8) keeps the rows' spread within a column (docs/measurements.md)."""
    _check_input("x", x, (2,))
    rows, n = x.shape
    segments = _expert_segments(offsets, rows)
    qt = torch.zeros(n, rows, dtype=torch.float8_e4m3fn, device=x.device)
    e = torch.full((len(segments), n), -127, dtype=SCALE_DTYPE, device=x.device)
    for i, (lo, hi) in enumerate(segments):
        if hi > lo:
            q, ei = _quantize_groups(x[lo:hi].t().to(torch.float32).reshape(n, 1, hi - lo), (2,))
            qt[:, lo:hi] = q.reshape(n, hi - lo)
            e[i] = ei.reshape(n).to(SCALE_DTYPE)
    return qt, e


def dequantize_cols_per_expert(qt: torch.Tensor, e: torch.Tensor, offsets: torch.Tensor,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, rows]`` in ``dtype``: ``qt * 2**e[expert, column]`` of ``quantize_cols_per_expert``
    (rows outside every segment: zeros); exact in float64 (``DEQUANTIZED_DTYPES``)."""
    _check_dequantized_dtype(dtype)
    _check_quantized("qt", qt, (2,))
    n, rows = qt.shape
    segments = _expert_segments(offsets, rows)
    _check_exponents("e", e, (len(segments), n))
    out = torch.zeros(n, rows, dtype=dtype, device=qt.device)
    for i, (lo, hi) in enumerate(segments):
        if hi > lo:
            out[:, lo:hi] = qt[:, lo:hi].to(dtype) * pow2(e[i].to(torch.int32)).to(dtype)[:, None]
    return out


def dequantize_rows(q: torch.Tensor, e: torch.Tensor, group: int = GROUP,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * 2**e`` in ``dtype`` per 1 x ``group`` group (``q [M, K]``, ``e [M, K/group]``);
    exact in float64, and in fp32 except where a group near bf16's maximum (e = 120) holds
    values above fp32's (they become inf there: the oracles take float64)."""
    _check_quantized("q", q, (2,))
    _check_dequantized_dtype(dtype)
    group = _check_group("group", group)
    m, k = q.shape
    g = _check_multiple("q", q, 1, "K", group)
    _check_exponents("e", e, (m, g))
    scale = pow2(e.to(torch.int32)).to(dtype).reshape(m, g, 1)
    return (q.to(dtype).reshape(m, g, group) * scale).reshape(m, k)


def dequantize_cols(qt: torch.Tensor, e: torch.Tensor, group: int = GROUP,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[M, K]`` in ``dtype`` from a column-quantized transposed copy ``qt [K, M]``: the
    transpose of ``dequantize_rows(qt, e)``."""
    return dequantize_rows(qt, e, group, dtype).t()


# ------------------------------------------------------------------------ weight blocks
def quantize_blocks(w: torch.Tensor, block: int = GROUP,
                    transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``w [N, K]`` or ``[E, N, K]`` in ``block x block`` blocks ->
    ``(q like w float8_e4m3fn, e [..., N/block, K/block] int8)``. ``transposed=True`` returns
    the exact transposed copy for dgrad: ``q [..., K, N]`` (the same bytes, transposed) and
    ``e [..., K/block, N/block]``. N or K not a multiple of ``block``: ValueError naming w."""
    _check_input("w", w, (2, 3))
    block = _check_group("block", block)
    if not isinstance(transposed, bool):
        raise TypeError(f"transposed: expected a bool, got {describe(transposed)}")
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    b, n, k = w3.shape
    nb = _check_multiple("w", w, -2, "N", block)
    kb = _check_multiple("w", w, -1, "K", block)
    xg = w3.to(torch.float32).reshape(b, nb, block, kb, block)
    q, e = _quantize_groups(xg, (2, 4))
    q = q.reshape(b, n, k)
    e = e.reshape(b, nb, kb).to(SCALE_DTYPE)
    if transposed:
        q, e = q.transpose(1, 2).contiguous(), e.transpose(1, 2).contiguous()
    if w.dim() == 2:
        q, e = q[0], e[0]
    return q, e


def dequantize_blocks(q: torch.Tensor, e: torch.Tensor, block: int = GROUP,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * 2**e`` in ``dtype`` per ``block x block`` block (``q [..., R, C]``, ``e [...,
    R/block, C/block]``; either orientation of ``quantize_blocks``); exact as
    ``dequantize_rows``."""
    _check_quantized("q", q, (2, 3))
    _check_dequantized_dtype(dtype)
    block = _check_group("block", block)
    q3 = q if q.dim() == 3 else q.unsqueeze(0)
    b, r, c = q3.shape
    rb = _check_multiple("q", q, -2, "rows", block)
    cb = _check_multiple("q", q, -1, "columns", block)
    _check_exponents("e", e, tuple(q.shape[:-2]) + (rb, cb))
    scale = pow2(e.to(torch.int32)).to(dtype).reshape(b, rb, 1, cb, 1)
    out = (q3.to(dtype).reshape(b, rb, block, cb, block) * scale).reshape(b, r, c)
    return out if q.dim() == 3 else out[0]


# ------------------------------------------------------------------------ MXFP8
def to_mxfp8(q: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Power-of-two 1 x 128 (or 128 x 128 block) scales as MXFP8: ``(q, s)`` with ``q`` returned
    as is (no copy) and ``s [..., R, C/32]`` uint8 E8M0 bytes ``e + 127`` (view as
    ``torch.float8_e8m0fnu`` if wanted), one per 1 x 32 sub-block. Lossless. ``e``'s shape
    says the format: ``[..., R, C/g]`` row groups of g (a multiple of 32), or
    ``[..., R/128, C/128]`` blocks (R >= 128, so the two never coincide)."""
    _check_quantized("q", q, (2, 3))
    if not isinstance(e, torch.Tensor) or e.dim() != q.dim():
        raise ValueError(f"e: expected a {q.dim()}-D integer tensor like q, got {describe(e)}")
    r, c = q.shape[-2:]
    lead = tuple(q.shape[:-2])
    if tuple(e.shape[:-2]) == lead and e.shape[-2] == r and e.shape[-1] > 0 and c % e.shape[-1] == 0:
        group = c // e.shape[-1]
        if group % MX_BLOCK:
            raise ValueError(f"e: expected groups of a multiple of {MX_BLOCK} along the last dim "
                             f"of q, got {group} (q {tuple(q.shape)}, e {tuple(e.shape)})")
        rows = e
    elif r % GROUP == 0 and c % GROUP == 0 and tuple(e.shape) == lead + (r // GROUP, c // GROUP):
        group = GROUP
        rows = e.repeat_interleave(GROUP, dim=-2)
    else:
        raise ValueError(f"e: expected shape {lead + (r, c // GROUP)} (rows) or "
                         f"{lead + (r // GROUP, c // GROUP)} (blocks) for q {tuple(q.shape)}, "
                         f"got {tuple(e.shape)}")
    _check_exponents("e", e, tuple(e.shape))
    if e.numel() and (int(e.min()) < EXP_MIN or int(e.max()) > EXP_NONFINITE):
        raise ValueError(f"e: expected exponents in [{EXP_MIN}, {EXP_NONFINITE}], "
                         f"got [{int(e.min())}, {int(e.max())}]")
    s = (rows.to(torch.int32) + E8M0_BIAS).repeat_interleave(group // MX_BLOCK, dim=-1)
    return q, s.to(torch.uint8)


def from_mxfp8(q: torch.Tensor, s: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 ``q [M, K]`` e4m3 with E8M0 scales ``s [M, K/32]`` (uint8 or float8_e8m0fnu) ->
    this module's 1 x ``group`` format ``(q', e [M, K/group] int8)``, requantized once:
    ``e = max`` of the exponents of the group's sub-blocks that hold a non-zero value (a
    sub-block of zeros adds nothing, whatever its scale byte says; all zeros: ``EXP_MIN``),
    each sub-block's data ``e4m3(q * 2**(e_i - e))`` (exact when representable, else
    round-to-nearest-even); ``from_mxfp8(*to_mxfp8(q, e)) == (q, e)``, bitwise. A NaN scale
    (0xFF) or NaN data: the group becomes non-finite (all NaN, ``e = 127``)."""
    _check_quantized("q", q, (2,))
    group = _check_group("group", group)
    if group % MX_BLOCK:
        raise ValueError(f"group: expected a multiple of {MX_BLOCK}, got {group}")
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"s: expected a torch.Tensor, got {describe(s)}")
    if s.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"s: expected dtype uint8 or float8_e8m0fnu (E8M0 bytes), got {s.dtype}")
    m, k = q.shape
    g = _check_multiple("q", q, 1, "K", group)
    sub = group // MX_BLOCK
    if tuple(s.shape) != (m, k // MX_BLOCK):
        raise ValueError(f"s: expected shape {(m, k // MX_BLOCK)}, got {tuple(s.shape)}")
    sb = s.view(torch.uint8).to(torch.int32).reshape(m, g, sub)
    ei = sb - E8M0_BIAS
    data = q.to(torch.float32).reshape(m, g, sub, MX_BLOCK)
    # a zero sub-block's scale byte (127, say, from a producer's default) must not push the
    # group's exponent up and flush its other sub-blocks' data
    nonzero = (q.view(torch.uint8).reshape(m, g, sub, MX_BLOCK) & 0x7F).amax(dim=3) > 0
    e = torch.where(nonzero, ei, EXP_MIN).amax(dim=2, keepdim=True)
    shift = pow2(ei - e).unsqueeze(-1)  # 2**-d for a non-zero sub-block, d in [0, 254]: exact or 0
    y = (data * shift).clamp(-E4M3_MAX, E4M3_MAX)  # |y| <= |q| <= 448 there: never binds
    out = y.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (sb == E8M0_NAN).any(dim=2) | ((q.view(torch.uint8) & 0x7F) == E4M3_NAN_BITS).reshape(
        m, g, group).any(dim=2)
    out = torch.where(bad[:, :, None, None], E4M3_NAN_BITS, out)
    e = torch.where(bad, EXP_NONFINITE, e.squeeze(2))
    return out.reshape(m, k).view(torch.float8_e4m3fn), e.to(SCALE_DTYPE)
