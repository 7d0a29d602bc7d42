"""Token-row kernels of the one-GPU MoE path: row gather or scatter, and the fixed-order
weighted k-sum.

Both kernels are memory bound. They move rows of bf16 as 16-byte vectors (8 elements, one
``ld.global.v4.b32`` / ``st.global.v4.b32`` each), use one warp per row, a small block of rows
per CTA, and no atomics, so every output element is written by exactly one thread.

``GatherRows``
    ``dst[i, :] = src[index[i], :]`` for ``i`` in ``[0, num_rows)``. Rows whose index is
    outside ``[0, src_rows)`` (the schedule marks padding rows with ``-1``) are written as
    zeros. ``num_rows`` is the static capacity from shapes; the index is read on the device,
    so there is no host sync. Used to permute ``x`` into expert-sorted, tile-padded order.

``ScatterRows``
    ``dst[rows[t*K + k], :] = src[t, :]`` for every slot with a row (``rows[...]`` in
    ``[0, dst_rows)``). The same permutation as ``GatherRows`` given the inverse map (the
    schedule's row of each slot), but token-major: each source row is read once and written K
    times, where the gather reads it once per destination. When ``src`` does not fit in L2
    (dsv3_ep8_rank's x is 59 MB, sonic_120b's 268 MB) that is K - 1 fewer reads of every row
    from HBM. Rows that no slot names (the tile padding) are not written.

``WeightedKSum``
    ``out[t, :] = bf16(acc)`` with ``acc = fp32(shared[t, :])`` (or ``0``) and then, for
    ``k = 0 .. K-1`` in ascending order, ``acc = acc + fp32(w[t, k]) * fp32(y[t*K + k, :])``.
    The product and the sum are two separately rounded fp32 operations (``mul.rn.f32`` then
    ``add.rn.f32`` in inline PTX, which ptxas never contracts into an FMA), exactly what the
    PyTorch reference computes, so the result matches the reference bitwise and is
    deterministic run to run.

Constraints: bf16 rows, ``H % 8 == 0``, 16-byte aligned base pointers, contiguous row-major
tensors; ``K`` is a compile-time constant in ``[1, 16]``.

Each kernel has a tensor-free compile function built on placeholder pointers
(``compile_gather_rows``, ``compile_scatter_rows``, ``compile_weighted_ksum``; no GPU needed,
registered in ``mok_cute.jit.KERNELS``), a torch-tensor entry point (``gather_rows``,
``scatter_rows``, ``weighted_ksum``) that launches the cached compiled kernel on the current
stream, and a PyTorch reference beside it (``*_ref``).

Run on a GPU host::

    python3 -c "import torch, mok_cute.kernels.token_ops as t; \\
        y = torch.randn(8, 64, device='cuda', dtype=torch.bfloat16); \\
        w = torch.rand(2, 4, device='cuda'); print(t.weighted_ksum(y, w))"
"""

from __future__ import annotations

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from mok_cute import jit
from mok_cute.constants import MAX_TOP_K as MAX_K
from mok_cute.constants import VEC_ELEMS

VEC_BITS = 128  # 16 bytes of bf16: the widest global load/store a thread can issue


@dsl_user_op
def _mul_then_add_rn(acc: Float32, w: Float32, y: Float32, *, loc=None, ip=None) -> Float32:
    """``acc + w * y`` as two separately rounded fp32 ops. Written in PTX with explicit
    ``.rn`` so neither NVVM nor ptxas fuses them into an FMA (the reference rounds the
    product before the add)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [
                Float32(acc).ir_value(loc=loc, ip=ip),
                Float32(w).ir_value(loc=loc, ip=ip),
                Float32(y).ir_value(loc=loc, ip=ip),
            ],
            "{\n.reg .f32 prod;\nmul.rn.f32 prod, $2, $3;\nadd.rn.f32 $0, $1, prod;\n}",
            "=f,f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def k_sum_unroll(K: int, vectors: int = 8) -> int:
    """Vector steps per lane loaded before any is summed: about ``vectors`` 16-B vectors in
    flight per lane (8: 128 B, without growing past ~100 registers)."""
    return max(1, vectors // K)


def k_sum_vector(ys: cute.Tensor, base: cute.Tensor, weights: cute.Tensor, u: int, K: int,
                 has_shared: bool) -> cute.Tensor:
    """One 8-element output vector of the fixed-order weighted k-sum, from registers:
    bf16(fp32(base[:, u]) + sum_k fp32(weights[k]) * fp32(ys[:, u, k])), ascending k, each
    product and sum rounded separately (the reference's order). Traced inline; shared by
    ``WeightedKSum`` and the megakernel's KSUM task so both give the same bits."""
    acc = cute.make_rmem_tensor((VEC_ELEMS,), Float32)
    if has_shared:
        acc.store(base[None, u].load().to(Float32))
    else:
        acc.fill(0.0)
    for k in range(K):
        k_sum_add(acc, weights[k], ys[None, u, k])
    res = cute.make_rmem_tensor((VEC_ELEMS,), BFloat16)
    res.store(acc.load().to(BFloat16))
    return res


def k_sum_add(acc: cute.Tensor, w: Float32, y: cute.Tensor) -> None:
    """One step of ``k_sum_vector``: ``acc += fp32(w) * fp32(y)`` for an 8-element fp32
    ``acc`` and bf16 ``y``, product and sum rounded separately (for callers that add the
    k terms one at a time)."""
    yk = cute.make_rmem_tensor((VEC_ELEMS,), Float32)
    yk.store(y.load().to(Float32))
    for e in range(VEC_ELEMS):
        acc[e] = _mul_then_add_rn(acc[e], w, yk[e])


def _row_vectors(ptr: cute.Pointer, h_vecs: Int32, num_rows: Int32) -> cute.Tensor:
    """View a row-major ``[num_rows, 8 * h_vecs]`` bf16 buffer as ``(8, h_vecs, num_rows)``.

    The row stride is a 64-bit ``8 * h_vecs`` marked divisible by 8, so every
    ``(None, v, row)`` slice is a 16-byte aligned vector the copy atom can move in one
    instruction, and buffers above 2**31 elements index correctly."""
    row_stride = cute.assume(Int64(h_vecs) * VEC_ELEMS, divby=VEC_ELEMS)
    return cute.make_tensor(
        ptr, cute.make_layout((VEC_ELEMS, h_vecs, num_rows), stride=(1, VEC_ELEMS, row_stride))
    )


def _vector_copy_atom() -> cute.CopyAtom:
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=VEC_BITS)


def _check_top_k(K: int) -> int:
    """The routing fan-out a token kernel is built for (``ScatterRows``, ``WeightedKSum``)."""
    if not isinstance(K, int) or not 1 <= K <= MAX_K:
        raise ValueError(f"K must be an int in [1, {MAX_K}], got {K!r}")
    return K


def _token_of_warp(num_warps: int):
    """(token, lane) of this thread in a one-warp-per-token kernel of ``num_warps`` warps per
    CTA (``ScatterRows``, ``WeightedKSum``). Traced inline."""
    bidx, _, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    return bidx * num_warps + warp, cute.arch.lane_idx()


class GatherRows:
    """``dst[i] = src[index[i]]`` (zero row for an index outside ``[0, src_rows)``).

    One warp per destination row; each lane moves ``unroll`` 16-byte vectors per step,
    all loads of a step issued before its stores so several are in flight."""

    def __init__(self, num_warps: int = 4, rows_per_warp: int = 2, unroll: int = 4):
        self.num_warps = num_warps
        self.rows_per_warp = rows_per_warp
        self.unroll = unroll
        self.num_threads = None
        self.rows_per_cta = None

    def _setup_attributes(self):
        self.num_threads = 32 * self.num_warps
        self.rows_per_cta = self.num_warps * self.rows_per_warp

    @cute.jit
    def __call__(
        self,
        src: cute.Pointer,
        index: cute.Pointer,
        dst: cute.Pointer,
        src_rows: Int32,
        num_rows: Int32,
        h_vecs: Int32,
        stream: cuda_driver.CUstream,
    ):
        self._setup_attributes()
        mSrc = _row_vectors(src, h_vecs, src_rows)
        mDst = _row_vectors(dst, h_vecs, num_rows)
        mIdx = cute.make_tensor(index, cute.make_layout(num_rows))
        grid_x = (num_rows + self.rows_per_cta - 1) // self.rows_per_cta
        self.kernel(mSrc, mIdx, mDst, src_rows, num_rows, h_vecs).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mSrc: cute.Tensor,
        mIdx: cute.Tensor,
        mDst: cute.Tensor,
        src_rows: Int32,
        num_rows: Int32,
        h_vecs: Int32,
    ):
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        atom = _vector_copy_atom()
        for r in cutlass.range_constexpr(self.rows_per_warp):
            row = bidx * self.rows_per_cta + r * self.num_warps + warp
            if row < num_rows:
                src_row = mIdx[row]
                valid = src_row >= 0 and src_row < src_rows
                step = 32 * self.unroll
                for v0 in cutlass.range(lane, h_vecs, step):
                    frag = cute.make_rmem_tensor((VEC_ELEMS, self.unroll), BFloat16)
                    if valid:
                        for u in cutlass.range_constexpr(self.unroll):
                            if v0 + 32 * u < h_vecs:
                                cute.copy(atom, mSrc[None, v0 + 32 * u, src_row], frag[None, u])
                    else:
                        frag.fill(0.0)
                    for u in cutlass.range_constexpr(self.unroll):
                        if v0 + 32 * u < h_vecs:
                            cute.copy(atom, frag[None, u], mDst[None, v0 + 32 * u, row])


class ScatterRows:
    """``dst[rows[t*K + k]] = src[t]`` for every slot with a row in ``[0, dst_rows)``.

    One warp per source row: each lane loads ``unroll`` 16-byte vectors of the row, then
    stores them to each of the row's K destinations, so the row is read once."""

    def __init__(self, K: int, num_warps: int = 4, unroll: int = 4):
        self.K = _check_top_k(K)
        self.num_warps = num_warps
        self.unroll = unroll
        self.num_threads = None

    def _setup_attributes(self):
        self.num_threads = 32 * self.num_warps

    @cute.jit
    def __call__(
        self,
        src: cute.Pointer,
        rows: cute.Pointer,
        dst: cute.Pointer,
        num_tokens: Int32,
        dst_rows: Int32,
        h_vecs: Int32,
        stream: cuda_driver.CUstream,
    ):
        self._setup_attributes()
        mSrc = _row_vectors(src, h_vecs, num_tokens)
        mDst = _row_vectors(dst, h_vecs, dst_rows)
        mRows = cute.make_tensor(rows, cute.make_layout(num_tokens * self.K))
        grid_x = (num_tokens + self.num_warps - 1) // self.num_warps
        self.kernel(mSrc, mRows, mDst, num_tokens, dst_rows, h_vecs).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mSrc: cute.Tensor,
        mRows: cute.Tensor,
        mDst: cute.Tensor,
        num_tokens: Int32,
        dst_rows: Int32,
        h_vecs: Int32,
    ):
        token, lane = _token_of_warp(self.num_warps)
        atom = _vector_copy_atom()
        if token < num_tokens:
            dst_row = cute.make_rmem_tensor((self.K,), Int32)
            for k in cutlass.range_constexpr(self.K):
                row = mRows[token * self.K + k]
                dst_row[k] = cutlass.select_(row >= 0 and row < dst_rows, row, Int32(-1))
            for v0 in cutlass.range(lane, h_vecs, 32 * self.unroll):
                frag = cute.make_rmem_tensor((VEC_ELEMS, self.unroll), BFloat16)
                for u in cutlass.range_constexpr(self.unroll):
                    if v0 + 32 * u < h_vecs:
                        cute.copy(atom, mSrc[None, v0 + 32 * u, token], frag[None, u])
                for k in cutlass.range_constexpr(self.K):
                    if dst_row[k] >= 0:
                        for u in cutlass.range_constexpr(self.unroll):
                            if v0 + 32 * u < h_vecs:
                                cute.copy(atom, frag[None, u], mDst[None, v0 + 32 * u, dst_row[k]])


class WeightedKSum:
    """``out[t] = bf16(fp32(shared[t]) + sum_k fp32(w[t,k]) * fp32(y[t*K+k]))``, ascending k.

    One warp per token. Each lane loads the ``K * unroll`` source vectors of one step
    before accumulating them in fixed k order."""

    def __init__(self, K: int, has_shared: bool, num_warps: int = 4, gather: bool = False):
        self.K = _check_top_k(K)
        self.has_shared = bool(has_shared)
        # gather: y rows are read through an index (row of slot t*K+k), so the expert
        # outputs can stay in expert-sorted order and no permuted copy is made.
        self.gather = bool(gather)
        self.num_warps = num_warps
        self.unroll = None
        self.num_threads = None

    def _setup_attributes(self):
        self.num_threads = 32 * self.num_warps
        self.unroll = k_sum_unroll(self.K)

    @cute.jit
    def __call__(
        self,
        y: cute.Pointer,
        w: cute.Pointer,
        shared: cute.Pointer,
        out: cute.Pointer,
        row_index: cute.Pointer,
        num_tokens: Int32,
        y_rows: Int32,
        h_vecs: Int32,
        stream: cuda_driver.CUstream,
    ):
        self._setup_attributes()
        mY = _row_vectors(y, h_vecs, y_rows)
        mIdx = cute.make_tensor(row_index, cute.make_layout(num_tokens * self.K))
        mOut = _row_vectors(out, h_vecs, num_tokens)
        mShared = _row_vectors(shared, h_vecs, num_tokens)
        mW = cute.make_tensor(w, cute.make_layout((self.K, num_tokens), stride=(1, self.K)))
        grid_x = (num_tokens + self.num_warps - 1) // self.num_warps
        self.kernel(mY, mW, mShared, mOut, mIdx, num_tokens, h_vecs).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mY: cute.Tensor,
        mW: cute.Tensor,
        mShared: cute.Tensor,
        mOut: cute.Tensor,
        mIdx: cute.Tensor,
        num_tokens: Int32,
        h_vecs: Int32,
    ):
        token, lane = _token_of_warp(self.num_warps)
        atom = _vector_copy_atom()
        if token < num_tokens:
            weights = cute.make_rmem_tensor((self.K,), Float32)
            y_row = cute.make_rmem_tensor((self.K,), Int32)
            for k in cutlass.range_constexpr(self.K):
                weights[k] = mW[k, token]
                if const_expr(self.gather):
                    y_row[k] = mIdx[token * self.K + k]
                    # a slot routed nowhere adds zero whatever its weight (NaN, inf), as in
                    # the reference, which zeroes both its row and its weight
                    weights[k] = cutlass.select_(y_row[k] >= 0, weights[k], Float32(0.0))
                else:
                    y_row[k] = token * self.K + k
            step = 32 * self.unroll
            for v0 in cutlass.range(lane, h_vecs, step):
                ys = cute.make_rmem_tensor((VEC_ELEMS, self.unroll, self.K), BFloat16)
                base = cute.make_rmem_tensor((VEC_ELEMS, self.unroll), BFloat16)
                for u in cutlass.range_constexpr(self.unroll):
                    if v0 + 32 * u < h_vecs:
                        for k in cutlass.range_constexpr(self.K):
                            if const_expr(self.gather):
                                # a slot with no expert row (index -1) contributes zero
                                if y_row[k] >= 0:
                                    cute.copy(atom, mY[None, v0 + 32 * u, y_row[k]], ys[None, u, k])
                                else:
                                    ys[None, u, k].fill(0.0)
                            else:
                                cute.copy(atom, mY[None, v0 + 32 * u, y_row[k]], ys[None, u, k])
                        if const_expr(self.has_shared):
                            cute.copy(atom, mShared[None, v0 + 32 * u, token], base[None, u])
                for u in cutlass.range_constexpr(self.unroll):
                    if v0 + 32 * u < h_vecs:
                        res = k_sum_vector(ys, base, weights, u, self.K, self.has_shared)
                        cute.copy(atom, res, mOut[None, v0 + 32 * u, token])


# ----------------------------------------------------------------------------------------
# Tensor-free compile functions (registered in mok_cute.jit.KERNELS)
# ----------------------------------------------------------------------------------------


def _placeholder_ptr(dtype, align: int) -> cute.Pointer:
    # Compilation only needs the pointer's type (dtype, address space, alignment).
    return cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def _compile_row_copy(op, arch: str, options: str):
    """Compile a (src, index, dst, three extents, stream) row-copy op on placeholders."""
    return cute.compile(
        op,
        _placeholder_ptr(BFloat16, 16),
        _placeholder_ptr(Int32, 4),
        _placeholder_ptr(BFloat16, 16),
        Int32(1),
        Int32(1),
        Int32(1),
        cute.runtime.make_fake_stream(),
        options=jit.compile_options(arch, options),
    )


def compile_gather_rows(arch: str = "sm_90a", *, options: str = "", num_warps: int = 4,
                        rows_per_warp: int = 2, unroll: int = 4):
    """Compile ``GatherRows`` for ``arch`` without a GPU or tensors."""
    return _compile_row_copy(GatherRows(num_warps=num_warps, rows_per_warp=rows_per_warp,
                                        unroll=unroll), arch, options)


def compile_scatter_rows(arch: str = "sm_90a", *, options: str = "", K: int = 8,
                         num_warps: int = 4, unroll: int = 4):
    """Compile ``ScatterRows`` for ``arch`` and a static ``K`` without a GPU or tensors."""
    return _compile_row_copy(ScatterRows(K=K, num_warps=num_warps, unroll=unroll), arch, options)


def compile_weighted_ksum(arch: str = "sm_90a", *, options: str = "", K: int = 8,
                          has_shared: bool = False, num_warps: int = 4, gather: bool = False):
    """Compile ``WeightedKSum`` for ``arch`` and a static ``K`` without a GPU or tensors."""
    op = WeightedKSum(K=K, has_shared=has_shared, num_warps=num_warps, gather=gather)
    return cute.compile(
        op,
        _placeholder_ptr(BFloat16, 16),
        _placeholder_ptr(Float32, 4),
        _placeholder_ptr(BFloat16, 16),
        _placeholder_ptr(BFloat16, 16),
        _placeholder_ptr(Int32, 4),
        Int32(1),
        Int32(1),
        Int32(1),
        cute.runtime.make_fake_stream(),
        options=jit.compile_options(arch, options),
    )


# ----------------------------------------------------------------------------------------
# Torch entry points and references
# ----------------------------------------------------------------------------------------


def _check_rows(name: str, t, rows: int | None = None, cols: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, H], got shape {tuple(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got shape {tuple(t.shape)}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns (H), got shape {tuple(t.shape)}")
    if t.shape[1] % VEC_ELEMS != 0:
        raise ValueError(f"{name}: H must be a multiple of {VEC_ELEMS}, got H={t.shape[1]}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {t.stride()}")


def _check_device(name: str, t, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor for the kernel path, got {t.device}")
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must be 16-byte aligned, got address 0x{t.data_ptr():x}")


def _ptr(t: torch.Tensor, dtype, align: int) -> cute.Pointer:
    return cute.runtime.make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _stream(device: torch.device):
    return cuda_driver.CUstream(torch.cuda.current_stream(device).cuda_stream)


def gather_rows_ref(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of ``gather_rows``: out-of-range indices (``-1``) give zero rows."""
    index = index.long()
    valid = (index >= 0) & (index < src.shape[0])
    out = src.new_zeros((index.shape[0], src.shape[1]))
    out[valid] = src[index[valid]]
    return out


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = src[index[i]]`` on the GPU; a zero row where ``index[i]`` is outside
    ``[0, src.shape[0])``. ``index`` is int32 (int64 is converted on the device), and its
    length is the number of output rows. No host sync."""
    _check_rows("src", src)
    _check_index("index", index, "num_rows")
    device = src.device
    _check_device("src", src, device)
    if index.device != device:
        raise ValueError(f"index must be on {device} like src, got {index.device}")
    index = index.to(torch.int32).contiguous()
    num_rows, hidden = index.shape[0], src.shape[1]
    if out is None:
        out = torch.empty((num_rows, hidden), dtype=src.dtype, device=device)
    else:
        _check_rows("out", out, rows=num_rows, cols=hidden)
        _check_device("out", out, device)
    if num_rows == 0 or hidden == 0:
        return out
    compiled = jit.compile_kernel("gather_rows", arch=jit.device_arch(device))
    compiled(*_row_copy_args(src, index, out), _stream(device))
    return out


def _check_index(name: str, t, extent: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D [{extent}], got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")


def _row_copy_args(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> tuple:
    """``GatherRows`` / ``ScatterRows.__call__`` arguments (all but the stream) for checked
    tensors: the three pointers, then src rows, out rows, H / 8."""
    return (
        _ptr(src, BFloat16, 16),
        _ptr(index, Int32, 4),
        _ptr(out, BFloat16, 16),
        Int32(src.shape[0]),
        Int32(out.shape[0]),
        Int32(src.shape[1] // VEC_ELEMS),
    )


def scatter_rows_ref(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of ``scatter_rows``: ``out[rows[t*K+k]] = src[t]`` for rows in range;
    ``out``'s other rows are kept. Returns ``out``."""
    K = rows.shape[0] // max(1, src.shape[0])
    rows = rows.long()
    valid = (rows >= 0) & (rows < out.shape[0])
    token = torch.arange(rows.shape[0], device=rows.device) // max(1, K)
    out[rows[valid]] = src[token[valid]]
    return out


def scatter_rows(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[rows[t*K + k]] = src[t]`` on the GPU for every slot whose row is in
    ``[0, out.shape[0])`` (``-1``: routed nowhere); other rows of ``out`` are not written.
    ``rows`` is int32 or int64 of length ``T * K`` (the schedule's row of each slot: rows are
    distinct, so every element is written by one thread). No host sync. Returns ``out``."""
    _check_rows("src", src)
    _check_rows("out", out, cols=src.shape[1])
    _check_index("rows", rows, "T * K")
    num_tokens = src.shape[0]
    if (rows.shape[0] % num_tokens if num_tokens else rows.shape[0]):
        raise ValueError(f"rows must hold K rows per source row (a multiple of "
                         f"src.shape[0]={num_tokens}), got {rows.shape[0]}")
    if num_tokens == 0:
        return out
    K = rows.shape[0] // num_tokens
    if not 1 <= K <= MAX_K:
        raise ValueError(f"rows: K = {K} rows per source row, must be in [1, {MAX_K}]")
    device = src.device
    _check_device("src", src, device)
    _check_device("out", out, device)
    if rows.device != device:
        raise ValueError(f"rows must be on {device} like src, got {rows.device}")
    rows = rows.to(torch.int32).contiguous()
    if out.shape[0] == 0 or src.shape[1] == 0:
        return out
    compiled = jit.compile_kernel("scatter_rows", arch=jit.device_arch(device), K=K)
    compiled(*_row_copy_args(src, rows, out), _stream(device))
    return out


def weighted_ksum_ref(y: torch.Tensor, w: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of ``weighted_ksum``: fp32, ascending k, product rounded before the add."""
    num_tokens, k_slots = w.shape
    rows = y.view(num_tokens, k_slots, y.shape[1]).float()
    w32 = w.float()
    if shared is not None:
        acc = shared.float()
    else:
        acc = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
    for k in range(k_slots):
        acc = acc + w32[:, k : k + 1] * rows[:, k]
    return acc.to(torch.bfloat16)


def weighted_ksum(
    y: torch.Tensor,
    w: torch.Tensor,
    shared: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = bf16(fp32(shared[t]) + sum_{k ascending} fp32(w[t,k]) * fp32(y[r(t,k)]))``.

    ``r(t,k) = t*K+k``, or ``row_index[t*K+k]`` when ``row_index`` (int32 ``[T*K]`` or
    ``[T, K]``) is given: then ``y`` may have any number of rows (e.g. expert outputs in
    expert-sorted order) and is read through the index, with no permuted copy. An index
    of -1 (a slot the schedule gave no row) contributes zero.

    ``y`` is ``[T*K, H]`` bf16, ``w`` is ``[T, K]`` fp32 (bf16 is upcast exactly), ``shared``
    an optional ``[T, H]`` bf16; returns ``[T, H]`` bf16. Bitwise equal to
    ``weighted_ksum_ref`` and deterministic run to run."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [T, K], got shape {tuple(w.shape)}")
    if w.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"w must be float32 (or bfloat16), got {w.dtype}")
    num_tokens, k_slots = w.shape
    if not 1 <= k_slots <= MAX_K:
        raise ValueError(f"w: K must be in [1, {MAX_K}], got K={k_slots}")
    if row_index is None:
        _check_rows("y", y, rows=num_tokens * k_slots)
    else:
        _check_rows("y", y)
        if not isinstance(row_index, torch.Tensor) or row_index.dtype != torch.int32:
            raise TypeError(f"row_index must be an int32 torch.Tensor, got "
                            f"{getattr(row_index, 'dtype', type(row_index).__name__)}")
        if row_index.numel() != num_tokens * k_slots or not row_index.is_contiguous():
            raise ValueError(f"row_index must be contiguous with T*K = {num_tokens * k_slots} "
                             f"elements, got shape {tuple(row_index.shape)}")
        if row_index.device != y.device:
            raise ValueError(f"row_index must be on {y.device} like y, got {row_index.device}")
    hidden = y.shape[1]
    if shared is not None:
        _check_rows("shared", shared, rows=num_tokens, cols=hidden)
    device = y.device
    _check_device("y", y, device)
    if w.device != device:
        raise ValueError(f"w must be on {device} like y, got {w.device}")
    if shared is not None:
        _check_device("shared", shared, device)
    w32 = w.to(torch.float32).contiguous()
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    else:
        _check_rows("out", out, rows=num_tokens, cols=hidden)
        _check_device("out", out, device)
    if num_tokens == 0 or hidden == 0:
        return out
    compiled = jit.compile_kernel(
        "weighted_ksum", arch=jit.device_arch(device), K=k_slots, has_shared=shared is not None,
        gather=row_index is not None,
    )
    compiled(*_weighted_ksum_args(y, w32, shared, out, row_index), _stream(device))
    return out


def _weighted_ksum_args(y: torch.Tensor, w32: torch.Tensor, shared: torch.Tensor | None,
                        out: torch.Tensor, row_index: torch.Tensor | None = None) -> tuple:
    """``WeightedKSum.__call__`` arguments (all but the stream) for checked tensors."""
    return (
        _ptr(y, BFloat16, 16),
        _ptr(w32, Float32, 4),
        _ptr(shared if shared is not None else out, BFloat16, 16),  # unread when has_shared=False
        _ptr(out, BFloat16, 16),
        _ptr(row_index if row_index is not None else w32, Int32, 4),  # unread without gather
        Int32(w32.shape[0]),
        Int32(y.shape[0]),
        Int32(y.shape[1] // VEC_ELEMS),
    )
