"""Comm kernels (kernels/comm_sm90.py): PTX in CI. On the GPU: the ring of every virtual rank
equals the rows its receive schedule names, pulled from the owning ranks' buffers; and
dispatch -> expert GEMMs -> push combine -> k-sum reproduces moe_forward_virtual's reference."""

import re

import pytest
import torch

from mok_cute import schedule as sched_mod
from mok_cute.comm import VirtualPeers, moe_symmetric_layout
from mok_cute.kernels import comm_sm90


@pytest.mark.parametrize("compile_fn", [comm_sm90.compile_pull_dispatch,
                                        comm_sm90.compile_push_combine])
@pytest.mark.parametrize("scope", ["gpu", "sys"])
def test_compiles_to_16_byte_copies_and_a_release_publish(compile_fn, scope, tmp_path):
    ptx = compile_fn(scope=scope, options=f"--keep-ptx --dump-dir {tmp_path}").__ptx__
    assert re.search(r"ld\.global(\.\w+)*\.v4\.(b|u|s)32", ptx)
    assert re.search(r"st\.global(\.\w+)*\.v4\.(b|u|s)32", ptx)
    assert re.search(rf"red\.release\.{scope}\.global\.add\.s32", ptx)
    assert "bar.sync" in ptx and re.search(rf"fence\.acq_rel\.{scope}", ptx)


@pytest.mark.gpu
@pytest.mark.parametrize("R,T,E_loc,K", [(1, 300, 8, 4), (3, 77, 4, 2), (8, 200, 4, 8)])
def test_every_rank_pulls_exactly_its_scheduled_rows(R, T, E_loc, K):
    H = 1024
    gen = torch.Generator(device="cuda").manual_seed(R * 100 + T)
    peers = VirtualPeers(R, moe_symmetric_layout(T, H, K, R), device="cuda")
    xs = torch.randn(R, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    for r in range(R):  # torch.stack of the views would copy: write each rank's own buffer
        peers.view(r, "x").copy_(xs[r])
    topk_all = torch.rand(R, T, R * E_loc, device="cuda", generator=gen).topk(K, dim=2).indices
    scheds = [sched_mod.build_receive_schedule(topk_all, r, E_loc, validate=False) for r in range(R)]
    cap = scheds[0].capacity
    row_peer = torch.stack([s.row_peer for s in scheds])
    row_token = torch.stack([s.row_token for s in scheds])
    num_tiles = torch.cat([s.num_tiles for s in scheds])
    ring = torch.full((R, cap, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    dispatched = torch.zeros(R, cap // 128, dtype=torch.int32, device="cuda")
    compiled = comm_sm90.compile_pull_dispatch()
    compiled(peers.bases_matrix(), row_peer, row_token, ring, num_tiles, dispatched,
             peers.layout.offset("x"))
    torch.cuda.synchronize()
    for r, s in enumerate(scheds):
        live = int(s.num_tiles.item()) * 128
        valid = s.row_peer[:live] >= 0
        expected = torch.zeros(live, H, device="cuda", dtype=torch.bfloat16)
        expected[valid] = xs[s.row_peer[:live][valid].long(), s.row_token[:live][valid].long()]
        assert torch.equal(ring[r, :live], expected), f"rank {r}: ring differs"
        assert torch.isnan(ring[r, live:].float()).all(), f"rank {r}: rows past the live tiles written"
        counts = dispatched[r].tolist()
        assert counts[: live // 128] == [1] * (live // 128) and not any(counts[live // 128:])


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 8])
def test_dispatch_gemms_combine_ksum_reproduce_the_virtual_reference(R):
    """The EP protocol on one GPU, stage by stage: pull dispatch, each rank's expert MLP on
    its ring, push combine into the source ranks' combine buffers, fixed-order k-sum."""
    from mok_cute import ops, reference
    from mok_cute.kernels import token_ops

    T, H, I, E_loc, K = 160, 512, 256, 4, 4
    gen = torch.Generator(device="cuda").manual_seed(7 + R)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    peers = VirtualPeers(R, moe_symmetric_layout(T, H, K, R), device="cuda")
    xs = rnd(R, T, H)
    for r in range(R):
        peers.view(r, "x").copy_(xs[r])
    topk_all = torch.rand(R, T, R * E_loc, device="cuda", generator=gen).topk(K, dim=2).indices
    topk_w = torch.softmax(torch.randn(R, T, K, device="cuda", generator=gen), dim=2)
    wg, wu = rnd(R, E_loc, I, H, scale=H ** -0.5), rnd(R, E_loc, I, H, scale=H ** -0.5)
    wd = rnd(R, E_loc, H, I, scale=I ** -0.5)
    scheds = [sched_mod.build_receive_schedule(topk_all, r, E_loc, validate=False) for r in range(R)]
    cap = scheds[0].capacity
    stack = lambda name: torch.stack([getattr(s, name) for s in scheds])  # noqa: E731
    num_tiles = torch.cat([s.num_tiles for s in scheds])
    bases = peers.bases_matrix()

    ring_x = torch.empty(R, cap, H, device="cuda", dtype=torch.bfloat16)
    dispatched = torch.zeros(R, cap // 128, dtype=torch.int32, device="cuda")
    comm_sm90.compile_pull_dispatch()(bases, stack("row_peer"), stack("row_token"), ring_x,
                                      num_tiles, dispatched, peers.layout.offset("x"))
    ring_y = torch.stack([ops.expert_mlp(ring_x[r], wg[r], wu[r], wd[r], scheds[r].tile_expert,
                                         scheds[r].num_tiles) for r in range(R)])
    combined = torch.zeros_like(dispatched)
    comm_sm90.compile_push_combine()(bases, stack("row_peer"), stack("row_token"), stack("row_k"),
                                     ring_y, num_tiles, combined, peers.layout.offset("combine"), K)
    outs = torch.stack([token_ops.weighted_ksum(peers.view(r, "combine")[: T * K], topk_w[r])
                        for r in range(R)])
    ref = reference.moe_forward_virtual(xs.clone(), topk_all.to(torch.int32), topk_w, wg, wu, wd)
    torch.cuda.synchronize()
    rel = ((outs.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-2, f"relative error {rel:.3e}"
    assert (dispatched == combined).all()
