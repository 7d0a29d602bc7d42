"""The backward megakernel in the simulator (mok_cute/sim/backward.py, issue 32), CPU only."""

from __future__ import annotations

import numpy as np
import pytest

from mok_cute.bench import calibrate
from mok_cute.sim import SimShape, get_profile
from mok_cute.sim.backward import (CALIBRATED, UNCALIBRATED, BackwardEfficiency,
                                   BackwardSimConfig, build_backward_graph, comm_rows_profile,
                                   simulate_backward, tune_backward)
from mok_cute.sim.model import Routing
from mok_cute.tasks import Role
from mok_cute.tasks_backward import BackwardTaskType as BT

SMALL = SimShape("small", tokens_per_rank=512, hidden=1024, intermediate=512, num_experts=16,
                 top_k=4, shared_intermediate=256)


@pytest.mark.parametrize("name", ["dsv3_ep8_rank", "mixtral"])
def test_one_rank_runs_near_its_tensor_core_bound(name):
    """At R = 1 (no comm tasks) the backward is GEMM work: the model as is runs its list
    between the FLOPs at the profile's full tensor rate and 1.25 times that, compute SMs nearly
    always busy (mixtral's FC2 dgrads too: the raster shares a W_down tile among 8 M-tiles),
    after the row gathers (d_out's and x's rows, real ones read, padded ones written)."""
    hw = get_profile("h200_hgx")
    shape = SimShape.named(name)
    res = simulate_backward(shape, 1, BackwardSimConfig(num_comm_sms=0), hw,
                            efficiency=UNCALIBRATED)
    ideal = res.flops_per_rank / hw.gpu_tensor_flops
    span = res.time_s - res.gather_s
    assert ideal <= span <= 1.25 * ideal, (span, ideal)
    assert res.compute_busy > 0.9
    assert not (res.graph.role == int(Role.COMM)).any()
    g = res.graph
    dgrads = np.isin(g.type, [int(BT.FC2_DGRAD), int(BT.FC1_DGRAD)])
    mma = hw.gemm_task_overhead_s + g.flops[dgrads] / hw.sm_tensor_flops
    assert (g.duration[dgrads] <= 1.05 * mma).mean() > 0.9  # compute-bound: weights in L2
    padded = res.graph.meta["layouts"][0].num_tiles * 128
    rows = shape.tokens_per_rank * shape.top_k + padded
    assert res.gather_s == pytest.approx(2 * rows * shape.hidden * 2 / hw.hbm_bytes_per_s)


def test_the_kinds_run_at_their_calibrated_speed():
    """Each GEMM task's duration is the model's over its kind's speed (H200: the fit's), comm
    tasks and the k-sum untouched; a profile without a backward timing runs the model as is."""
    hw = get_profile("h200_hgx")
    cfg = BackwardSimConfig(num_comm_sms=8, minibatch_tokens=256)
    base, _ = build_backward_graph(SMALL, 2, Routing(seed=3), cfg, hw, efficiency=UNCALIBRATED)
    cal, _ = build_backward_graph(SMALL, 2, Routing(seed=3), cfg, hw)
    eff = CALIBRATED["h200_hgx"]
    dgrad = np.isin(base.type, [int(t) for t in (BT.FC2_DGRAD, BT.FC1_DGRAD,
                                                  BT.SHARED_FC2_DGRAD, BT.SHARED_FC1_DGRAD)])
    gemm = base.flops > 0
    np.testing.assert_allclose(cal.duration[dgrad], base.duration[dgrad] / eff.dgrad)
    np.testing.assert_allclose(cal.duration[gemm & ~dgrad], base.duration[gemm & ~dgrad]
                               / eff.wgrad)
    np.testing.assert_array_equal(cal.duration[~gemm], base.duration[~gemm])
    assert gemm.any() and (gemm & ~dgrad).any() and (~gemm).any()
    b, _ = build_backward_graph(SMALL, 2, Routing(seed=3), cfg, get_profile("gb300_nvl72"))
    assert b.meta["efficiency"] == UNCALIBRATED
    with pytest.raises(ValueError, match="dgrad"):
        BackwardEfficiency(dgrad=0.0)


def test_a_comm_task_spends_the_per_row_latency_of_its_rows():
    """The profile's comm latency was fitted on 128-row tasks, per row: a 32-row backward comm
    task spends a quarter of it (the serial part whole); 128 rows, or a profile with no
    latency split, keep the profile."""
    hw = get_profile("h200_hgx")
    q = comm_rows_profile(hw, 32)
    assert q.comm_serial_s == hw.comm_serial_s
    assert q.comm_latency_s == pytest.approx(hw.comm_latency_s / 4)
    assert comm_rows_profile(hw, 128) is hw
    gb = get_profile("gb300_nvl72")
    assert comm_rows_profile(gb, 32) is gb
    g, _ = build_backward_graph(SMALL, 2, Routing(seed=3), BackwardSimConfig(num_comm_sms=8), hw)
    assert g.meta["hw"].comm_latency_s == pytest.approx(hw.comm_latency_s / 4)


@pytest.mark.parametrize("name", ["dsv3_ep8_rank", "sonic_120b"])
def test_calibrated_one_rank_backward_is_within_its_measurement(name):
    """Held out of the fit (made on the dgrads and the launch of a probe): the whole backward
    megakernel at R = 1 in the training bench of record, L2 flushed, gathers and k-sum
    included: the calibrated simulation lies within its four rounds; the model as is did not."""
    rounds = calibrate.backward_rounds("2026-12-03_h200_train_megakernel_r1.json", name,
                                       "mok_megakernel")
    shape = SimShape.named(name)
    assert min(rounds) <= calibrate.backward_sim_ms(shape)["total"] <= max(rounds), rounds
    assert calibrate.backward_sim_ms(shape, efficiency=UNCALIBRATED)["total"] < min(rounds)


def test_backward_speed_fit_recovers_known_speeds_and_matches_the_stored_one():
    """``calibrate._fit_speeds`` on times made with speeds 0.8 / 0.9 finds them (the dgrads
    alone scale exactly, the launch as dgrads + weight gradients); the stored H200 speeds are
    the committed fit's (benchmarks/sim/backward_calibration.json), rounded."""
    import json
    from pathlib import Path

    base = {s: dict(dgrads=d, launch=d + w) for s, d, w in (("a", 2.0, 2.0), ("b", 5.0, 9.0),
                                                               ("c", 9.0, 4.0))}
    measured = {s: dict(dgrads=(b["dgrads"] / 0.8,), launch=(b["dgrads"] / 0.8 + (
        b["launch"] - b["dgrads"]) / 0.9,)) for s, b in base.items()}
    dgrad, wgrad = calibrate._fit_speeds(measured, base, list(base))
    assert dgrad == pytest.approx(0.8) and wgrad == pytest.approx(0.9, rel=1e-3)
    record = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "sim"
                         / "backward_calibration.json").read_text())
    stored = CALIBRATED["h200_hgx"]
    assert (stored.dgrad, stored.wgrad) == pytest.approx(
        (record["fit"]["dgrad"], record["fit"]["wgrad"]), abs=6e-4)
    assert record["fit"]["train"] == list(calibrate.BACKWARD_FIT_SHAPES)


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
    assert out["num_comm_sms"] in (16, 28, 40) and out["minibatch_tokens"] == "one"
    assert out["predicted_us"] == min(r["predicted_us"] for r in out["table"]) > 0
    assert len(out["table"]) == 3
