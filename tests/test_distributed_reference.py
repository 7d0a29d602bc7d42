"""The reference's real expert-parallel path (`group=`) on CPU processes over gloo (loopback).

Each worker builds the same global random problem from one seed, runs its rank's share through
`all_to_all_single`, and checks it against `moe_forward_virtual` / per-rank `moe_forward`
computed in the same process. A failing assertion in a worker fails the test through
`torch.multiprocessing.spawn`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mok_cute as mok
from mok_cute import reference as ref

import gloo_group

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)


def _problem(R, T_per_rank, H, I, E_loc, K, Is, seed=0):
    gen = torch.Generator().manual_seed(seed)
    E = R * E_loc
    xs = [torch.randn(T, H, generator=gen).bfloat16() for T in T_per_rank]
    idx = [torch.rand(T, E, generator=gen).topk(K, dim=-1).indices for T in T_per_rank]
    wts = [torch.rand(T, K, generator=gen) + 0.05 for T in T_per_rank]
    w_gate = (torch.randn(R, E_loc, I, H, generator=gen) * H**-0.5).bfloat16()
    w_up = (torch.randn(R, E_loc, I, H, generator=gen) * H**-0.5).bfloat16()
    w_down = (torch.randn(R, E_loc, H, I, generator=gen) * I**-0.5).bfloat16()
    shared = None
    if Is:
        shared = (
            (torch.randn(R, Is, H, generator=gen) * H**-0.5).bfloat16(),
            (torch.randn(R, Is, H, generator=gen) * H**-0.5).bfloat16(),
            (torch.randn(R, H, Is, generator=gen) * Is**-0.5).bfloat16(),
        )
    return xs, idx, wts, w_gate, w_up, w_down, shared


def _check_equal_tokens(rank, R):
    """Forward bitwise equal to moe_forward_virtual; backward equal to the virtual grads."""
    T, H, I, E_loc, K, Is = 21, 32, 24, 2, 3, 16
    xs, idx, wts, wg, wu, wd, shared = _problem(R, [T] * R, H, I, E_loc, K, Is)
    gen = torch.Generator().manual_seed(99)
    cot = torch.randn(R, T, H, generator=gen)

    # Virtual run over the stacked problem (same process, same BLAS): forward + grads.
    v_leaves = [t.clone().requires_grad_() for t in (torch.stack(xs), torch.stack(wts), wg, wu, wd)]
    v_out = ref.moe_forward_virtual(v_leaves[0], torch.stack(idx), *v_leaves[1:], shared=shared)
    (v_out.float() * cot).sum().backward()

    # This rank's share, through the real exchange (via the public API: it routes group= to
    # the reference).
    my_shared = tuple(s[rank] for s in shared)
    leaves = [t.clone().requires_grad_() for t in (xs[rank], wts[rank], wg[rank], wu[rank], wd[rank])]
    x, w, g, u, d = leaves
    out = mok.moe_forward(x, idx[rank], w, g, u, d, shared=my_shared, group=dist.group.WORLD)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    assert torch.equal(out, v_out[rank].detach()), f"rank {rank}: forward differs from virtual"
    (out.float() * cot[rank]).sum().backward()

    assert torch.equal(x.grad, v_leaves[0].grad[rank]), f"rank {rank}: d_x differs"
    assert torch.equal(w.grad, v_leaves[1].grad[rank]), f"rank {rank}: d_topk_weights differs"
    # Weight grads sum contributions of every source rank; the accumulation order may differ.
    for name, got, leaf_index in (("w_gate", g, 2), ("w_up", u, 3), ("w_down", d, 4)):
        torch.testing.assert_close(got.grad.float(), v_leaves[leaf_index].grad[rank].float(), rtol=2e-2, atol=1e-3, msg=name)
        assert (got.grad != 0).any(), name


def _check_uneven_tokens(rank, R):
    """T differs per rank (rank 1 has no tokens, so some owners receive nothing from it);
    experts of the last rank get no rows at all. Each rank equals its one-rank forward with the
    gathered weights."""
    T_per_rank = [9, 0, 14, 5][:R]
    H, I, E_loc, K = 16, 8, 3, 2
    xs, idx, wts, wg, wu, wd, _ = _problem(R, T_per_rank, H, I, E_loc, K, 0, seed=5)
    idx = [torch.where(i >= (R - 1) * E_loc, i % E_loc, i) for i in idx]  # nothing for the last rank
    g_gate, g_up, g_down = (t.reshape(R * E_loc, *t.shape[2:]) for t in (wg, wu, wd))

    leaves = [t.clone().requires_grad_() for t in (xs[rank], wg[rank], wu[rank], wd[rank])]
    x, g, u, d = leaves
    out = ref.moe_forward(x, idx[rank], wts[rank], g, u, d, group=dist.group.WORLD)
    want = ref.moe_forward(xs[rank], idx[rank], wts[rank], g_gate, g_up, g_down)
    assert out.shape == (T_per_rank[rank], H)
    assert torch.equal(out, want), f"rank {rank}: forward differs"
    out.float().sum().backward()  # every rank joins the backward exchange, the empty ones too
    for leaf in leaves:
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape
    if rank == R - 1:
        assert all((t.grad == 0).all() for t in (g, u, d))

    # MoELayer over the group: this rank holds E_loc experts; router and shared expert are
    # replicated (same seed on every rank).
    torch.manual_seed(1234)
    layer = mok.MoELayer(H, I, R * E_loc, K, shared_intermediate=8, group=dist.group.WORLD)
    assert layer.num_local_experts == E_loc and layer.w_gate.shape == (E_loc, I, H)
    with torch.no_grad():
        for name, stacked in (("w_gate", wg), ("w_up", wu), ("w_down", wd)):
            getattr(layer, name).copy_(stacked[rank])
    x_layer = xs[rank].reshape(-1, H)
    out = layer(x_layer)
    routed_idx, routed_w = layer.route(x_layer)
    want = ref.moe_forward(x_layer, routed_idx, routed_w, g_gate, g_up, g_down, layer.shared)
    assert torch.equal(out, want), f"rank {rank}: MoELayer differs"


@pytest.mark.parametrize("world", [2, 4])
def test_ep_forward_backward_equals_virtual(world, tmp_path):
    gloo_group.spawn(_check_equal_tokens, world, tmp_path)


def test_ep_uneven_tokens_and_idle_ranks(tmp_path):
    gloo_group.spawn(_check_uneven_tokens, 4, tmp_path)


def _check_compiled(rank, R):
    """moe_forward(group=...) inside a torch.compile'd function runs eagerly (a graph break):
    out and every gradient bitwise the eager call's (Inductor compiling the reference's ops
    changed their bits before); fullgraph=True refuses it by name."""
    T, H, I, E_loc, K, Is = 11, 32, 16, 2, 2, 8
    xs, idx, wts, wg, wu, wd, shared = _problem(R, [T] * R, H, I, E_loc, K, Is, seed=3)
    my_shared = tuple(s[rank] for s in shared)

    def layer(x, w, g, u, d):
        return mok.moe_forward(x, idx[rank], w, g, u, d, shared=my_shared,
                               group=dist.group.WORLD) * 2

    results = []
    for fn in (layer, torch.compile(layer)):
        leaves = [t.clone().requires_grad_() for t in (xs[rank], wts[rank], wg[rank], wu[rank], wd[rank])]
        out = fn(*leaves)
        out.float().sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, eager, compiled in zip(("out", "x", "topk_weights", "w_gate", "w_up", "w_down"),
                                     *results):
        assert torch.equal(eager, compiled), f"rank {rank}: {name} differs under torch.compile"
    with pytest.raises(Exception, match="runs eagerly under torch.compile"):
        torch.compile(layer, fullgraph=True)(*(t.clone() for t in (xs[rank], wts[rank], wg[rank],
                                                                   wu[rank], wd[rank])))


def test_ep_under_torch_compile_runs_eagerly(tmp_path):
    gloo_group.spawn(_check_compiled, 2, tmp_path)
