"""Pull dispatch (kernels/dispatch_sm90.py): PTX in CI; on the GPU, the ring of every virtual
rank equals the rows its receive schedule names, pulled from the owning ranks' buffers."""

import re

import pytest
import torch

from mok_cute import schedule as sched_mod
from mok_cute.comm import VirtualPeers, moe_symmetric_layout
from mok_cute.kernels import dispatch_sm90


def test_compiles_to_16_byte_copies_and_a_release_publish(tmp_path):
    ptx = dispatch_sm90.compile_pull_dispatch(options=f"--keep-ptx --dump-dir {tmp_path}").__ptx__
    assert re.search(r"ld\.global(\.\w+)*\.v4\.(b|u|s)32", ptx)
    assert re.search(r"st\.global(\.\w+)*\.v4\.(b|u|s)32", ptx)
    assert re.search(r"red\.release\.gpu\.global\.add\.s32", ptx)
    assert "bar.sync" in ptx and re.search(r"fence\.acq_rel\.gpu", ptx)


@pytest.mark.gpu
@pytest.mark.parametrize("R,T,E_loc,K", [(1, 300, 8, 4), (3, 77, 4, 2), (8, 200, 4, 8)])
def test_every_rank_pulls_exactly_its_scheduled_rows(R, T, E_loc, K):
    H = 1024
    gen = torch.Generator(device="cuda").manual_seed(R * 100 + T)
    peers = VirtualPeers(R, moe_symmetric_layout(T, H, K, R), device="cuda")
    xs = torch.stack([peers.view(r, "x") for r in range(R)])
    xs.copy_(torch.randn(R, T, H, device="cuda", generator=gen).to(torch.bfloat16))
    topk_all = torch.rand(R, T, R * E_loc, device="cuda", generator=gen).topk(K, dim=2).indices
    scheds = [sched_mod.build_receive_schedule(topk_all, r, E_loc, validate=False) for r in range(R)]
    cap = scheds[0].capacity
    row_peer = torch.stack([s.row_peer for s in scheds])
    row_token = torch.stack([s.row_token for s in scheds])
    num_tiles = torch.cat([s.num_tiles for s in scheds])
    ring = torch.full((R, cap, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    dispatched = torch.zeros(R, cap // 128, dtype=torch.int32, device="cuda")
    compiled = dispatch_sm90.compile_pull_dispatch()
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
