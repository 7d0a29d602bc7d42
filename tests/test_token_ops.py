"""Token-row kernels (kernels/token_ops.py): references and argument checks on the CPU,
kernels against the references on the GPU (marked gpu)."""

import pytest
import torch

from mok_cute import reference
from mok_cute.kernels import token_ops
from per_token import assert_tokens_close

bf16 = torch.bfloat16


def _randn(gen, *shape, device="cpu", dtype=bf16):
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


# ------------------------------------------------------------------ references (CPU)
def test_gather_rows_ref_zero_rows_for_padding(gen):
    src = _randn(gen, 5, 16)
    index = torch.tensor([4, -1, 0, 0, -1, 2], dtype=torch.int32)
    out = token_ops.gather_rows_ref(src, index)
    assert out.shape == (6, 16) and out.dtype == bf16
    for i, j in enumerate(index.tolist()):
        assert torch.equal(out[i], src[j] if j >= 0 else torch.zeros(16, dtype=bf16))


@pytest.mark.parametrize("K,shared", [(1, False), (8, True), (10, False)])
def test_weighted_ksum_ref_is_the_package_reference(gen, K, shared):
    """The kernel's reference is bitwise the combine stage of mok_cute.reference."""
    T, H = 37, 64
    y = _randn(gen, T * K, H)
    w = torch.rand(T, K, generator=gen)
    s = _randn(gen, T, H) if shared else None
    mine = token_ops.weighted_ksum_ref(y, w, s)
    theirs = reference.weighted_k_sum(y.view(T, K, H), w, s)
    assert mine.dtype == bf16 and torch.equal(mine, theirs)


def test_weighted_ksum_ref_rounds_the_product_before_the_add():
    # 1 + 2**-24 * (1 + 2**-23): an FMA would keep the tail and round up to 1 + 2**-23
    # at the next add; a separately rounded product must round 1 + 2**-24 down to 1.
    y = torch.tensor([[1.0], [1.0]], dtype=bf16).repeat(1, 8)
    w = torch.tensor([[1.0, 2.0 ** -24]], dtype=torch.float32)
    out = token_ops.weighted_ksum_ref(y, w)
    assert torch.equal(out, torch.ones(1, 8, dtype=bf16))


# ------------------------------------------------------------------ argument checks (CPU)
def test_gather_rows_argument_errors(gen):
    src = _randn(gen, 4, 16)
    idx = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(TypeError, match="src must be bfloat16"):
        token_ops.gather_rows(src.float(), idx)
    with pytest.raises(ValueError, match="src: H must be a multiple of 8"):
        token_ops.gather_rows(_randn(gen, 4, 12), idx)
    with pytest.raises(ValueError, match="src must be contiguous"):
        token_ops.gather_rows(_randn(gen, 16, 4).t(), idx)
    with pytest.raises(TypeError, match="index must be int32 or int64"):
        token_ops.gather_rows(src, idx.float())
    with pytest.raises(ValueError, match="index must be 1-D"):
        token_ops.gather_rows(src, idx.view(3, 1))
    with pytest.raises(ValueError, match="src must be a CUDA tensor"):
        token_ops.gather_rows(src, idx)


def test_weighted_ksum_argument_errors(gen):
    y = _randn(gen, 6, 16)
    w = torch.rand(3, 2, generator=gen)
    with pytest.raises(TypeError, match="w must be float32"):
        token_ops.weighted_ksum(y, w.double())
    with pytest.raises(ValueError, match=r"w: K must be in \[1, 16\], got K=17"):
        token_ops.weighted_ksum(_randn(gen, 17, 16), torch.rand(1, 17))
    with pytest.raises(ValueError, match="y must have 6 rows"):
        token_ops.weighted_ksum(_randn(gen, 5, 16), w)
    with pytest.raises(ValueError, match="shared must have 16 columns"):
        token_ops.weighted_ksum(y, w, shared=_randn(gen, 3, 8))
    with pytest.raises(ValueError, match="y must be a CUDA tensor"):
        token_ops.weighted_ksum(y, w)


def test_scatter_rows_ref_is_the_gather_given_the_inverse_map(gen):
    """Scattering x by each slot's row gives the gather by each row's token on every named
    row; rows no slot names keep what they held."""
    T, K, H, rows_total = 6, 3, 16, 24
    src = _randn(gen, T, H)
    perm = torch.randperm(rows_total, generator=gen)[: T * K].to(torch.int32)
    perm[4] = -1  # a slot routed nowhere
    index = torch.full((rows_total,), -1, dtype=torch.int32)  # row -> token, -1 = padding
    for slot, row in enumerate(perm.tolist()):
        if row >= 0:
            index[row] = slot // K
    fill = _randn(gen, rows_total, H)
    out = token_ops.scatter_rows_ref(src, perm, fill.clone())
    gathered = token_ops.gather_rows_ref(src, index)
    named = index >= 0
    assert torch.equal(out[named], gathered[named]) and torch.equal(out[~named], fill[~named])


def test_scatter_rows_argument_errors(gen):
    src, out = _randn(gen, 4, 16), _randn(gen, 10, 16)
    rows = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(TypeError, match="src must be bfloat16"):
        token_ops.scatter_rows(src.float(), rows, out)
    with pytest.raises(ValueError, match="out must have 16 columns"):
        token_ops.scatter_rows(src, rows, _randn(gen, 10, 24))
    with pytest.raises(TypeError, match="rows must be int32 or int64"):
        token_ops.scatter_rows(src, rows.float(), out)
    with pytest.raises(ValueError, match="rows must be 1-D"):
        token_ops.scatter_rows(src, rows.view(2, 4), out)
    with pytest.raises(ValueError, match="rows must hold K rows per source row"):
        token_ops.scatter_rows(src, rows[:7], out)
    with pytest.raises(ValueError, match=r"K = 17 rows per source row"):
        token_ops.scatter_rows(src, torch.zeros(4 * 17, dtype=torch.int32), out)
    with pytest.raises(ValueError, match="src must be a CUDA tensor"):
        token_ops.scatter_rows(src, rows, out)


def test_scatter_rows_hands_the_kernel_addresses_and_extents(gen):
    from mok_cute import jit

    src, rows, out = _randn(gen, 12, 64), torch.zeros(24, dtype=torch.int32), torch.empty(40, 64, dtype=bf16)
    compiled = jit.compile_kernel("scatter_rows", "sm_90a", K=2)
    u64, i32 = _marshalled(compiled, token_ops._row_copy_args(src, rows, out))
    assert u64[:3] == [src.data_ptr(), rows.data_ptr(), out.data_ptr()]
    assert i32[3:6] == [12, 40, 64 // 8]


def test_kernel_config_errors():
    with pytest.raises(ValueError, match="K must be an int in"):
        token_ops.ScatterRows(K=0)
    with pytest.raises(ValueError, match="K must be an int in"):
        token_ops.WeightedKSum(K=0, has_shared=False)
    with pytest.raises(ValueError, match="K must be an int in"):
        token_ops.WeightedKSum(K=17, has_shared=False)


# ------------------------------------------------------------------ launch arguments (CPU)
def _marshalled(compiled, args):
    """The values the compiled kernel's launcher receives, read back as (u64, i32) pairs."""
    import ctypes

    import cuda.bindings.driver as cuda_driver

    exe, _ = compiled.generate_execution_args(*args, cuda_driver.CUstream(0))

    def read(p, ctype):
        return ctypes.cast(p, ctypes.POINTER(ctype)).contents.value

    return [read(p, ctypes.c_uint64) for p in exe], [read(p, ctypes.c_int32) for p in exe]


def test_gather_rows_hands_the_kernel_addresses_and_extents(gen):
    """Without a GPU: the compiled launcher gets the tensors' addresses, the row counts and H/8."""
    from mok_cute import jit

    src, index, out = _randn(gen, 12, 64), torch.zeros(5, dtype=torch.int32), torch.empty(5, 64, dtype=bf16)
    compiled = jit.compile_kernel("gather_rows", "sm_90a")
    u64, i32 = _marshalled(compiled, token_ops._row_copy_args(src, index, out))
    assert u64[:3] == [src.data_ptr(), index.data_ptr(), out.data_ptr()]
    assert i32[3:6] == [12, 5, 64 // 8]


def test_weighted_ksum_hands_the_kernel_addresses_and_extents(gen):
    from mok_cute import jit

    y, w, s = _randn(gen, 21, 32), torch.rand(7, 3, generator=gen), _randn(gen, 7, 32)
    out = torch.empty(7, 32, dtype=bf16)
    compiled = jit.compile_kernel("weighted_ksum", "sm_90a", K=3, has_shared=True)
    u64, i32 = _marshalled(compiled, token_ops._weighted_ksum_args(y, w, s, out))
    assert u64[:4] == [y.data_ptr(), w.data_ptr(), s.data_ptr(), out.data_ptr()]
    assert i32[5:8] == [7, 21, 32 // 8]


def test_weighted_ksum_gather_hands_the_kernel_the_row_index(gen):
    from mok_cute import jit

    y, w = _randn(gen, 50, 32), torch.rand(7, 3, generator=gen)
    index = torch.randint(0, 50, (21,), dtype=torch.int32, generator=gen)
    out = torch.empty(7, 32, dtype=bf16)
    compiled = jit.compile_kernel("weighted_ksum", "sm_90a", K=3, has_shared=False, gather=True)
    u64, i32 = _marshalled(compiled, token_ops._weighted_ksum_args(y, w, None, out, index))
    assert u64[:2] == [y.data_ptr(), w.data_ptr()] and u64[3:5] == [out.data_ptr(), index.data_ptr()]
    assert i32[5:8] == [7, 50, 32 // 8]


# ------------------------------------------------------------------ kernels (GPU)
def _poisoned(shape, device):
    return torch.full(shape, float("nan"), dtype=bf16, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 77, 1000])
@pytest.mark.parametrize("H", [8, 1024, 2056, 7168])
def test_gather_rows_matches_reference(gen, num_rows, H):
    dev = "cuda"
    src_rows = max(3, num_rows // 2)
    src = _randn(gen, src_rows, H, device=dev)
    index = torch.randint(-1, src_rows, (num_rows,), generator=gen, dtype=torch.int32)
    if num_rows > 1:
        index[0] = -1  # at least one padding row
    index = index.to(dev)
    out = _poisoned((num_rows, H), dev)
    token_ops.gather_rows(src, index, out=out)
    ref = token_ops.gather_rows_ref(src, index)
    assert torch.equal(out, ref)  # a copy is exact, padding rows are zeros, no NaN left
    again = token_ops.gather_rows(src, index.long())  # int64 index, fresh output
    assert torch.equal(again, out)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K", [(1, 1), (77, 3), (1000, 8), (300, 10)])
@pytest.mark.parametrize("H", [8, 576, 7168])
def test_scatter_rows_matches_reference(gen, T, K, H):
    """Every named row gets its token's row bitwise; padding rows, and rows only an
    out-of-range slot names, keep the poison; int64 rows give the same bits."""
    dev = "cuda"
    rows_total = T * K + 130
    src = _randn(gen, T, H, device=dev)
    rows = torch.randperm(rows_total, generator=gen)[: T * K].to(torch.int32)
    rows[::7] = -1  # routed nowhere
    if T * K > 3:
        rows[1] = rows_total + 5  # out of range: skipped
    rows = rows.to(dev)
    out = _poisoned((rows_total, H), dev)
    token_ops.scatter_rows(src, rows, out)
    ref = token_ops.scatter_rows_ref(src, rows, _poisoned((rows_total, H), dev))
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
    again = token_ops.scatter_rows(src, rows.long(), _poisoned((rows_total, H), dev))
    assert torch.equal(again.nan_to_num(), out.nan_to_num())


@pytest.mark.gpu
def test_gather_rows_out_of_range_index_gives_zero_row(gen):
    src = _randn(gen, 4, 64, device="cuda")
    index = torch.tensor([3, 4, 1 << 30, -7, 0], dtype=torch.int32, device="cuda")
    out = token_ops.gather_rows(src, index)
    assert torch.equal(out, token_ops.gather_rows_ref(src, index))
    assert torch.equal(out[1:4], torch.zeros(3, 64, dtype=bf16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 77, 1000])
@pytest.mark.parametrize("K", [1, 8, 10])
@pytest.mark.parametrize("shared", [False, True])
def test_weighted_ksum_matches_reference_and_is_deterministic(gen, T, K, shared):
    dev, H = "cuda", 2056  # 2056 = 8 * 257: the vector loop has a ragged last step
    y = _randn(gen, T * K, H, device=dev)
    w = torch.rand(T, K, generator=gen).to(dev)
    s = _randn(gen, T, H, device=dev) if shared else None
    out1 = _poisoned((T, H), dev)
    token_ops.weighted_ksum(y, w, s, out=out1)
    out2 = _poisoned((T, H), dev)
    token_ops.weighted_ksum(y, w, s, out=out2)
    ref = token_ops.weighted_ksum_ref(y, w, s)
    assert torch.isfinite(out1.float()).all()
    assert_tokens_close(out1, ref, what=f"weighted_ksum T={T} K={K} shared={shared}")
    assert torch.equal(out1, out2)


@pytest.mark.gpu
@pytest.mark.parametrize("K,shared", [(1, False), (4, True), (8, True), (10, False), (16, True)])
def test_weighted_ksum_is_bitwise_equal_to_reference(gen, K, shared):
    """mul.rn then add.rn in ascending k: the same roundings as the PyTorch reference."""
    dev, T, H = "cuda", 333, 1024
    y = _randn(gen, T * K, H, device=dev)
    w = torch.softmax(torch.randn(T, K, generator=gen), dim=1).to(dev)
    s = _randn(gen, T, H, device=dev) if shared else None
    out = token_ops.weighted_ksum(y, w, s)
    assert torch.equal(out, token_ops.weighted_ksum_ref(y, w, s))
    assert torch.equal(out, token_ops.weighted_ksum_ref(y.cpu(), w.cpu(), None if s is None else s.cpu()).to(dev))


@pytest.mark.gpu
def test_weighted_ksum_bf16_weights_are_upcast_exactly(gen):
    y = _randn(gen, 20, 64, device="cuda")
    w = torch.rand(5, 4, generator=gen).to(bf16).to("cuda")
    assert torch.equal(token_ops.weighted_ksum(y, w), token_ops.weighted_ksum_ref(y, w.float()))


@pytest.mark.gpu
def test_misaligned_tensor_is_rejected(gen):
    flat = _randn(gen, 4 * 64 + 4, device="cuda")
    misaligned = flat[4:].view(4, 64)  # contiguous, but 8 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="src must be 16-byte aligned"):
        token_ops.gather_rows(misaligned, torch.zeros(2, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
def test_empty_inputs_launch_nothing():
    src = torch.zeros(4, 64, dtype=bf16, device="cuda")
    assert token_ops.gather_rows(src, torch.zeros(0, dtype=torch.int32, device="cuda")).shape == (0, 64)
    out = token_ops.weighted_ksum(torch.zeros(0, 64, dtype=bf16, device="cuda"),
                                  torch.zeros(0, 4, device="cuda"))
    assert out.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K", [(1, 1), (77, 8), (1000, 10)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_weighted_ksum_gather_matches_reference(gen, T, K, with_shared):
    """Rows read through row_index give the k-sum of the permuted rows, bitwise."""
    dev, H = "cuda", 1032
    y = _randn(gen, T * K + 300, H, device=dev)
    index = torch.randperm(y.shape[0], generator=gen)[: T * K].to(torch.int32).to(dev)
    w = torch.rand(T, K, generator=gen).to(dev)
    shared = _randn(gen, T, H, device=dev) if with_shared else None
    out = _poisoned((T, H), dev)
    token_ops.weighted_ksum(y, w, shared, out=out, row_index=index)
    expected = token_ops.weighted_ksum_ref(y[index.long()], w, shared)
    assert torch.equal(out, expected)
