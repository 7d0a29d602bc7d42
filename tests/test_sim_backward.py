"""The backward megakernel in the simulator (mok_cute/sim/backward.py, issue 32), CPU only."""

from __future__ import annotations

import numpy as np
import pytest

from mok_cute.sim import SimShape, get_profile
from mok_cute.sim.backward import (BackwardSimConfig, build_backward_graph, simulate_backward,
                                   tune_backward)
from mok_cute.sim.model import Routing
from mok_cute.tasks import Role
from mok_cute.tasks_backward import BackwardTaskType as BT

SMALL = SimShape("small", tokens_per_rank=512, hidden=1024, intermediate=512, num_experts=16,
                 top_k=4, shared_intermediate=256)


@pytest.mark.parametrize("name", ["dsv3_ep8_rank", "mixtral"])
def test_one_rank_runs_near_its_tensor_core_bound(name):
    """At R = 1 (no comm tasks) the backward is GEMM work: its simulated time is between the
    FLOPs at the profile's full tensor rate and 1.25 times that, compute SMs nearly always busy."""
    hw = get_profile("h200_hgx")
    res = simulate_backward(name, 1, BackwardSimConfig(num_comm_sms=0), hw)
    ideal = res.flops_per_rank / hw.gpu_tensor_flops
    assert ideal <= res.time_s <= 1.25 * ideal, (res.time_s, ideal)
    assert res.compute_busy > 0.9
    assert not (res.graph.role == int(Role.COMM)).any()


@pytest.mark.parametrize("x_resident", [True, False])
def test_ranks_pull_and_push_exactly_their_remote_rows(x_resident):
    """R = 4: the pulls move every remote d_out row once (and every remote x row once more
    when the forward could not keep them), the pushes every remote dx row once; no rank's
    k-sum starts before every rank has passed its barrier."""
    hw = get_profile("h200_hgx")
    R = 4
    cfg = BackwardSimConfig(num_comm_sms=8, minibatch_tokens=256, x_resident=x_resident)
    g, lists = build_backward_graph(SMALL, R, Routing(seed=3), cfg, hw)
    remote_rows = sum(int(lay.chunk_peer_rows.sum() - lay.chunk_peer_rows[:, lay.rank].sum())
                      for lay in g.meta["layouts"])
    row_bytes = SMALL.hidden * 2
    by_type = {t: g.comm_bytes[g.type == int(t)].sum() for t in (BT.REVERSE_COMBINE,
                                                                  BT.REPULL_X, BT.REVERSE_DISPATCH)}
    assert by_type[BT.REVERSE_COMBINE] == remote_rows * row_bytes
    assert by_type[BT.REVERSE_DISPATCH] == remote_rows * row_bytes
    assert by_type[BT.REPULL_X] == (0 if x_resident else remote_rows * row_bytes)
    from mok_cute.sim.engine import run_graph
    rec = run_graph(g, hw)
    last_barrier = rec.end[g.type == int(BT.BARRIER)].max()
    assert rec.start[g.type == int(BT.KSUM)].min() >= last_barrier
    assert np.isfinite(rec.end).all()


def test_over_a_group_the_ksums_go_to_whichever_sm_is_free():
    """The group tail's KSUM tickets: no KSUM in a comm queue, each taken once from the rank's
    tail queue by an SM past its own queue, compute SMs among them (their weight gradients
    end before the comm SMs' pushes), none before the group barrier."""
    from mok_cute.sim.engine import run_graph

    hw = get_profile("h200_hgx")
    cfg = BackwardSimConfig(num_comm_sms=8, minibatch_tokens=256)
    g, _ = build_backward_graph(SMALL, 2, Routing(seed=3), cfg, hw)
    ksums = np.flatnonzero(g.type == int(BT.KSUM))
    assert sorted(np.concatenate(g.tail_queues).tolist()) == ksums.tolist()
    assert not any((g.type[q[int(Role.COMM)]] == int(BT.KSUM)).any() for q in g.queues)
    rec = run_graph(g, hw)
    assert np.isfinite(rec.end).all()
    assert (rec.sm[ksums] >= g.num_comm_sms).any()
    assert rec.start[ksums].min() >= rec.end[g.type == int(BT.BARRIER)].max()
    for r, per_role in enumerate(g.queues):  # an SM takes a KSUM only past its own queue
        mine = ksums[g.rank[ksums] == r]
        for role in (Role.COMM, Role.COMPUTE):
            own = per_role[int(role)]
            on_role = mine[(rec.sm[mine] >= g.num_comm_sms) == (role == Role.COMPUTE)]
            if on_role.size and own.size:
                assert rec.take[on_role].min() >= rec.take[own].max()


def test_tune_backward_returns_its_fastest_point():
    best, rows = tune_backward(SMALL, 2, comm_sms=(4, 16), minibatch_tokens=(256, 512))
    assert len(rows) == 4
    assert rows[0][0] == best and rows[0][1] == min(t for _, t in rows)
    assert all(c.num_comm_sms in (4, 16) for c, _ in rows)


def test_tune_cli_backward_prints_json(capsys):
    """`mok-cute tune --backward --json` (a custom shape, 2 ranks, the quick grid): the pick,
    its prediction and every point, the pick the fastest of them."""
    import json

    from mok_cute.sim import tune

    rc = tune.main(["--backward", "--shape", "custom:256,512,256,8,2", "--ranks", "2",
                    "--quick", "--json", "--table"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pass"] == "bwd" and out["ranks"] == 2
    assert out["num_comm_sms"] in (16, 28, 40) and out["minibatch_tokens"] == 2048
    assert out["predicted_us"] == min(r["predicted_us"] for r in out["table"]) > 0
    assert len(out["table"]) == 3
