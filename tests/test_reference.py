"""The PyTorch reference: numerics of each stage, the layer, the virtual EP form, autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mok_cute import reference as ref
from per_token import assert_tokens_close, naive_moe_forward, naive_moe_forward_virtual


def make_inputs(seed, T, H, I, E, K, Is=0, R=None, dtype=torch.bfloat16):
    """Random layer inputs; R=None -> one rank ([T, H], ...), else stacked [R, ...]."""
    gen = torch.Generator().manual_seed(seed)
    lead = () if R is None else (R,)
    E_loc = E if R is None else E // R

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x = randn(*lead, T, H)
    scores = torch.rand(*lead, T, E, generator=gen)
    topk_idx = scores.topk(K, dim=-1).indices
    topk_weights = torch.rand(*lead, T, K, generator=gen) + 0.05
    w_gate = randn(*lead, E_loc, I, H, scale=H**-0.5)
    w_up = randn(*lead, E_loc, I, H, scale=H**-0.5)
    w_down = randn(*lead, E_loc, H, I, scale=I**-0.5)
    shared = None
    if Is:
        shared = (randn(*lead, Is, H, scale=H**-0.5), randn(*lead, Is, H, scale=H**-0.5), randn(*lead, H, Is, scale=Is**-0.5))
    return x, topk_idx, topk_weights, w_gate, w_up, w_down, shared


def assert_bf16_close(got, want):
    # bf16 rounding of the hidden/expert rows may land on the other side of a tie when the
    # fp32 and float64 matmuls differ in their last bits: a few bf16 ulps at most.
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert (got.float() - want.float()).abs().mean() < 2e-3


# ------------------------------------------------------------------------------------------------
# Stages
# ------------------------------------------------------------------------------------------------


def test_weighted_k_sum_order_and_rounding_exact():
    """Against numpy float32 elementwise arithmetic: start from shared, ascending k, two roundings."""
    gen = torch.Generator().manual_seed(1)
    T, K, H = 64, 8, 96
    y = (torch.randn(T, K, H, generator=gen) * 3).bfloat16()
    w = torch.rand(T, K, generator=gen)
    s = torch.randn(T, H, generator=gen).bfloat16()

    got = ref.weighted_k_sum(y, w, s)
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)

    y32, w32 = y.float().numpy(), w.numpy()
    acc = s.float().numpy().copy()
    for k in range(K):
        acc = (acc + (w32[:, k : k + 1] * y32[:, k]).astype(np.float32)).astype(np.float32)
    want = torch.from_numpy(acc).bfloat16()
    assert torch.equal(got, want)

    # The order is observable: summing from the last k gives different bits somewhere.
    rev = s.float().numpy().copy()
    for k in reversed(range(K)):
        rev = (rev + (w32[:, k : k + 1] * y32[:, k]).astype(np.float32)).astype(np.float32)
    assert not np.array_equal(rev, acc)

    no_shared = ref.weighted_k_sum(y, w, None)
    acc0 = np.zeros((T, H), np.float32)
    for k in range(K):
        acc0 = (acc0 + (w32[:, k : k + 1] * y32[:, k]).astype(np.float32)).astype(np.float32)
    assert torch.equal(no_shared, torch.from_numpy(acc0).bfloat16())


def test_weighted_k_sum_bf16_weights_are_upcast():
    gen = torch.Generator().manual_seed(2)
    y = torch.randn(5, 3, 16, generator=gen).bfloat16()
    w = torch.rand(5, 3, generator=gen).bfloat16()
    assert torch.equal(ref.weighted_k_sum(y, w), ref.weighted_k_sum(y, w.float()))


def test_expert_mlp_matches_float64_and_rounds_h():
    gen = torch.Generator().manual_seed(3)
    N, H, I = 33, 64, 48
    v = torch.randn(N, H, generator=gen).bfloat16()
    wg = (torch.randn(I, H, generator=gen) / 8).bfloat16()
    wu = (torch.randn(I, H, generator=gen) / 8).bfloat16()
    wd = (torch.randn(H, I, generator=gen) / 7).bfloat16()

    h = ref.swiglu_hidden(v, wg, wu)
    y = ref.expert_mlp(v, wg, wu, wd)
    assert h.dtype == y.dtype == torch.bfloat16
    assert h.shape == (N, I) and y.shape == (N, H)

    h64 = F.silu(v.double() @ wg.double().t()) * (v.double() @ wu.double().t())
    assert_bf16_close(h, h64.to(torch.bfloat16))
    # y is computed from the bf16-rounded h, not from the exact one: exact given h.
    assert torch.equal(y, (h.float() @ wd.float().t()).to(torch.bfloat16))
    y_from_exact_h = (h64 @ wd.double().t()).to(torch.bfloat16)
    assert_bf16_close(y, y_from_exact_h)


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Is", [0, 24])
@pytest.mark.parametrize("T,H,I,E,K", [(19, 64, 32, 8, 2), (1, 32, 16, 4, 4), (40, 48, 40, 16, 6)])
def test_moe_forward_matches_naive(T, H, I, E, K, Is):
    args = make_inputs(10 * T + K, T, H, I, E, K, Is)
    out = ref.moe_forward(*args[:6], shared=args[6])
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    want = naive_moe_forward(*args)
    assert_bf16_close(out, want)
    assert_tokens_close(out, want, what="reference vs the per-token loop")


def test_routed_expert_outputs_batch_each_expert_in_slot_order():
    """Each slot's row is its expert run once on that expert's rows in (token, k) order (the
    batching the kernels reproduce bitwise), and it is the right expert's output: every slot
    against the per-token loop. (This test used to compare moe_forward with the composition of
    its own stages, which is how moe_forward is written: nothing was checked.)"""
    x, idx, w, wg, wu, wd, shared = make_inputs(4, 23, 32, 16, 6, 3, Is=8)
    y_slots = ref.routed_expert_outputs(x, idx, wg, wu, wd)
    assert y_slots.shape == (23, 3, 32) and y_slots.dtype == torch.bfloat16
    for e in range(6):
        t, k = torch.nonzero(idx == e, as_tuple=True)
        if t.numel():
            assert torch.equal(y_slots[t, k], ref.expert_mlp(x[t], wg[e], wu[e], wd[e]))
    for k in range(3):  # slot k of every token: the loop's expert idx[t, k] on x[t]
        want = torch.cat([naive_moe_forward(x[t:t + 1], idx[t:t + 1, k:k + 1],
                                            torch.ones(1, 1), wg, wu, wd) for t in range(23)])
        assert_tokens_close(y_slots[:, k], want, what=f"slot k={k}")
    assert_tokens_close(ref.moe_forward(x, idx, w, wg, wu, wd, shared),
                        naive_moe_forward(x, idx, w, wg, wu, wd, shared), what="moe_forward")


def test_repeated_expert_in_one_token():
    x, idx, w, wg, wu, wd, _ = make_inputs(5, 6, 32, 16, 4, 2)
    idx = torch.tensor([[1, 1], [0, 3], [2, 2], [3, 0], [1, 2], [3, 3]])
    out = ref.moe_forward(x, idx, w, wg, wu, wd)
    want = naive_moe_forward(x, idx, w, wg, wu, wd)
    assert_bf16_close(out, want)
    assert_tokens_close(out, want, what="repeated expert")
    y = ref.expert_mlp(x[0:1], wg[1], wu[1], wd[1])[0].float()
    want0 = (torch.zeros_like(y) + w[0, 0] * y + w[0, 1] * y).bfloat16()
    assert torch.equal(out[0], want0)


def test_zero_tokens_and_float32_inputs():
    x, idx, w, wg, wu, wd, shared = make_inputs(6, 0, 32, 16, 4, 2, Is=8)
    out = ref.moe_forward(x, idx, w, wg, wu, wd, shared)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    # The oracle accepts fp32 storage too (rounding steps unchanged): close to the bf16 run.
    x, idx, w, wg, wu, wd, _ = make_inputs(6, 9, 32, 16, 4, 2)
    out_bf16 = ref.moe_forward(x, idx, w, wg, wu, wd)
    out_fp32 = ref.moe_forward(x.float(), idx, w, wg.float(), wu.float(), wd.float())
    assert torch.equal(out_bf16, out_fp32)  # fp32 copies of bf16 values: identical arithmetic


def test_reference_checks_arguments():
    x, idx, w, wg, wu, wd, _ = make_inputs(7, 5, 32, 16, 4, 2)
    with pytest.raises(ValueError, match=r"topk_idx: expected global expert ids in \[0, 4\), got id \d+"):
        ref.moe_forward(x, idx + 3, w, wg, wu, wd)
    with pytest.raises(ValueError, match="w_down: expected shape"):
        ref.moe_forward(x, idx, w, wg, wu, wd.transpose(1, 2))
    with pytest.raises(TypeError, match="config: expected a mok_cute.MoKConfig"):
        ref.moe_forward(x, idx, w, wg, wu, wd, config={"tile_m": 64})
    # the oracle takes strided tensors of any contiguity, never sparse ones
    with pytest.raises(ValueError, match=r"x: expected a dense \(strided\) tensor, got layout torch.sparse_coo"):
        ref.moe_forward(x.to_sparse(), idx, w, wg, wu, wd)
    with pytest.raises(ValueError, match=r"w_gate: expected a dense \(strided\) tensor"):
        ref.moe_forward(x, idx, w, wg.to_sparse(), wu, wd)


def test_stages_check_their_arguments():
    """The stage functions are public (the kernels are tested against them): a mismatched
    argument is named, never a matmul error, never a silently dropped slot."""
    x, idx, w, wg, wu, wd, _ = make_inputs(8, 5, 32, 16, 4, 2)
    y = ref.routed_expert_outputs(x, idx, wg, wu, wd)
    with pytest.raises(ValueError, match=r"weights: expected shape \[5, 2\], got \[5, 3\]"):
        ref.weighted_k_sum(y, torch.rand(5, 3))  # a third weight was dropped silently
    with pytest.raises(ValueError, match=r"y_slots: expected shape \[T, K, H\], got \[5, 32\]"):
        ref.weighted_k_sum(y[:, 0], w)
    with pytest.raises(ValueError, match=r"shared_rows: expected shape \[5, 32\], got \[4, 32\]"):
        ref.weighted_k_sum(y, w, x[:4])
    with pytest.raises(ValueError, match=r"w_gate: expected shape \[I, 32\], got \[16, 8\]"):
        ref.expert_mlp(x, wg[0, :, :8], wu[0], wd[0])
    with pytest.raises(ValueError, match=r"w_up: expected shape \[16, 32\], got \[8, 32\]"):
        ref.swiglu_hidden(x, wg[0], wu[0, :8])
    with pytest.raises(ValueError, match=r"w_down: expected shape \[32, 16\], got \[16, 32\]"):
        ref.expert_mlp(x, wg[0], wu[0], wd[0].t())
    with pytest.raises(ValueError, match=r"w_up: expected shape \[4, 16, 32\], got \[3, 16, 32\]"):
        ref.routed_expert_outputs(x, idx, wg, wu[:3], wd)
    with pytest.raises(TypeError, match=r"topk_idx: expected dtype torch.int32 or torch.int64"):
        ref.routed_expert_outputs(x, idx.float(), wg, wu, wd)


# ------------------------------------------------------------------------------------------------
# Virtual EP
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("R,E_loc,Is", [(1, 4, 0), (3, 2, 16), (8, 1, 0)])
def test_virtual_equals_each_rank_with_gathered_weights(R, E_loc, Is):
    T, H, I, K = 13, 32, 24, min(3, R * E_loc)
    xs, idx, w, wg, wu, wd, shared = make_inputs(R, T, H, I, R * E_loc, K, Is=Is, R=R)
    outs = ref.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared)
    assert outs.shape == (R, T, H) and outs.dtype == torch.bfloat16
    g_gate, g_up, g_down = (t.reshape(R * E_loc, *t.shape[2:]) for t in (wg, wu, wd))
    for r in range(R):
        shared_r = None if shared is None else tuple(s[r] for s in shared)
        want = ref.moe_forward(xs[r], idx[r], w[r], g_gate, g_up, g_down, shared_r)
        assert torch.equal(outs[r], want)
        # and the global expert e really is w_*[e // E_loc, e % E_loc]
        e = int(idx[r, 0, 0])
        assert torch.equal(g_gate[e], wg[e // E_loc, e % E_loc])
    # every rank against the per-token loop, written apart from the reference
    assert_tokens_close(outs, naive_moe_forward_virtual(xs, idx, w, wg, wu, wd, shared),
                        what=f"virtual R={R}")


def test_virtual_checks_leading_dim():
    xs, idx, w, wg, wu, wd, _ = make_inputs(8, 4, 16, 8, 4, 2, R=2)
    with pytest.raises(ValueError, match=r"w_up: expected shape \[2, 2, 8, 16\]"):
        ref.moe_forward_virtual(xs, idx, w, wg, wu[:1], wd)
    with pytest.raises(ValueError, match=r"topk_idx: expected global expert ids in \[0, 4\)"):
        ref.moe_forward_virtual(xs, idx + 2, w, wg, wu, wd)


# ------------------------------------------------------------------------------------------------
# Autograd
# ------------------------------------------------------------------------------------------------


def test_backward_runs_with_finite_grads_of_right_shape():
    x, idx, w, wg, wu, wd, shared = make_inputs(9, 17, 32, 16, 6, 2, Is=8)
    idx[:, :] = torch.tensor([0, 2])  # experts 1, 3, 4, 5 unused: their grads must be zero
    idx[5] = torch.tensor([3, 0])
    leaves = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd, *shared)]
    xg, wg_, wgg, wug, wdg, *sh = leaves
    out = ref.moe_forward(xg, idx, wg_, wgg, wug, wdg, tuple(sh))
    gen = torch.Generator().manual_seed(0)
    out.float().mul(torch.randn(out.shape, generator=gen)).sum().backward()
    for leaf in leaves:
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype
        assert torch.isfinite(leaf.grad.float()).all()
    assert wg_.grad.dtype == torch.float32  # d_topk_weights in fp32
    used = torch.zeros(6, dtype=torch.bool)
    used[[0, 2, 3]] = True
    for grad in (wgg.grad, wug.grad, wdg.grad):
        assert (grad[~used] == 0).all()
        assert (grad[used].flatten(1) != 0).any(dim=1).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_slot_rows_gather_each_token_once_and_the_backward_repeats_bitwise(device):
    """The reference gathers each slot's x row from x repeated per slot (``_slot_rows``): the
    rows of ``x.index_select(0, order // K)``, whose backward added each token's K gradient
    rows by CUDA atomics in bf16 (d_x changed bits run to run on the group= reference path);
    the layer's d_x now repeats bitwise."""
    g = torch.Generator(device=device).manual_seed(4)
    T, K, H = 300, 8, 64
    x = torch.randn(T, H, device=device, generator=g).bfloat16().requires_grad_()
    order = torch.randperm(T * K, device=device, generator=g)[: T * K - 17]
    rows = ref._slot_rows(x, order, K)
    assert torch.equal(rows, x.index_select(0, order // K))
    d_rows = torch.randn(rows.shape, device=device, generator=g).bfloat16()
    first, = torch.autograd.grad(rows, x, d_rows)
    want = torch.zeros(T * K, H, device=device).index_copy(0, order, d_rows.float())
    assert torch.allclose(first.float(), want.view(T, K, H).sum(1), rtol=1e-2, atol=1e-2)
    idx = torch.rand(T, 16, device=device, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, device=device, generator=g)
    wg, wu = (torch.randn(16, 32, H, device=device, generator=g).bfloat16() * 0.1 for _ in range(2))
    wd = torch.randn(16, H, 32, device=device, generator=g).bfloat16() * 0.1
    d_out = torch.randn(T, H, device=device, generator=g).bfloat16()
    grads = [torch.autograd.grad(ref.moe_forward(x, idx, w, wg, wu, wd), x, d_out)[0]
             for _ in range(3)]
    assert all(torch.equal(grads[0], other) for other in grads[1:])


def test_gradcheck_exact_float64():
    """With the bf16 roundings disabled, gradients equal finite differences (float64)."""
    x, idx, w, wg, wu, wd, shared = make_inputs(11, 5, 6, 4, 3, 2, Is=3, dtype=torch.float64)
    w = w.double()
    inputs = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd, *shared)]

    def f(x, w, wg, wu, wd, sg, su, sd):
        return ref.moe_forward(x, idx, w, wg, wu, wd, (sg, su, sd))

    with ref._exact_numerics():
        assert f(*inputs).dtype == torch.float64
        assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)
    # outside the block the roundings are back
    assert f(*inputs).dtype == torch.bfloat16


def test_gradcheck_exact_float64_virtual():
    xs, idx, w, wg, wu, wd, _ = make_inputs(12, 3, 4, 3, 4, 2, R=2, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (xs, w.double(), wg, wu, wd)]

    def f(xs, w, wg, wu, wd):
        return ref.moe_forward_virtual(xs, idx, w, wg, wu, wd)

    with ref._exact_numerics():
        assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


def test_bf16_gradients_track_exact_gradients():
    """The rounding casts pass gradients straight through: bf16-path grads ~ float64 grads."""
    x, idx, w, wg, wu, wd, _ = make_inputs(13, 24, 32, 16, 4, 2)
    gen = torch.Generator().manual_seed(1)
    cot = torch.randn(24, 32, generator=gen)

    def grads(dtype, exact):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, wg, wu, wd)] + [w.detach().clone().to(torch.float64 if exact else torch.float32).requires_grad_()]
        xx, gg, uu, dd, ww = leaves
        if exact:
            with ref._exact_numerics():
                out = ref.moe_forward(xx, idx, ww, gg, uu, dd)
        else:
            out = ref.moe_forward(xx, idx, ww, gg, uu, dd)
        (out.double() * cot.double()).sum().backward()
        return [leaf.grad.double() for leaf in leaves]

    for got, want in zip(grads(torch.bfloat16, False), grads(torch.float64, True)):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())
