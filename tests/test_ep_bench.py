"""The expert-parallel benchmark (`mok_cute.bench.ep`, `mok-cute bench --ep`) on CPU processes.

Ranks are gloo processes on 127.0.0.1 started with torch.multiprocessing.spawn; a failing
assertion in a worker fails the test. One spawn per world size runs every multi-rank scenario
(process start-up dominates on a 2-core machine). Shapes are tiny: T=16 tokens per rank, H=64,
I=32, 4 experts per rank, K=2, one shared expert.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mok_cute as mok
from mok_cute import cli, shapes
from mok_cute.bench import ep, ep_dist, ep_training, harness, results

import gloo_group
from per_token import assert_tokens_close

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)

T, H, I, E_LOC, K = 16, 64, 32, 4, 2


def _shape(world: int) -> shapes.Shape:
    return ep.resolve_ep_shape(f"custom:{T},{H},{I},{E_LOC * world},{K},1")


# --------------------------------------------------------------------------------------------
# Scenarios run inside every rank
# --------------------------------------------------------------------------------------------


def _baseline_equals_reference_and_group_path(d: ep_dist.Dist, out_dir: Path) -> None:
    """nccl_torch == reference.moe_forward_virtual (gathered) ~= moe_forward(group=...)."""
    shape = _shape(d.world)
    weights = ep.make_rank_weights(shape, d.world, d.rank, d.device, seed=5)
    routing = ep.make_routing(d.world, T, shape.experts, K, seed=6)
    inp = ep.make_rank_inputs(routing, H, d.rank, d.device, seed=7)
    base = ep.NcclTorchMoE(weights, d.group, grouped_mm=False)(inp)
    group_out = mok.moe_forward(inp.x, inp.topk_idx, inp.topk_weights, weights.w_gate, weights.w_up, weights.w_down,
                                shared=weights.shared, group=d.group)
    assert base.shape == group_out.shape == (T, H) and base.dtype == torch.bfloat16
    assert_tokens_close(base, group_out, what=f"rank {d.rank}: nccl_torch against the group path")
    ref = ep._reference_on_rank0(d, weights, inp)
    gathered_base, gathered_group = ep_dist.gather_stacked(d, base), ep_dist.gather_stacked(d, group_out)
    if d.rank == 0:
        assert ref.shape == (d.world, T, H)
        assert_tokens_close(gathered_base, ref, what="nccl_torch against the reference")
        # The group path runs the reference today: bitwise the virtual reference on one device.
        assert torch.equal(gathered_group, ref)


def _exact_bytes_and_max_timing(d: ep_dist.Dist, out_dir: Path) -> None:
    """Every token of every rank goes to rank 0's experts: exact byte counts per rank."""
    shape = _shape(d.world)
    R = d.world
    idx = (torch.arange(T)[:, None] + torch.arange(K)[None, :]) % E_LOC  # K distinct experts of rank 0
    routing = (idx.expand(R, T, K).contiguous(), torch.full((R, T, K), 1.0 / K))
    opts = ep.EpOptions(iters=3, warmup=1, rounds=2, check_tokens=8, seed=1)
    rows = ep.bench_ep_shape(shape, T, d, opts, routing=routing, log=lambda m: None)
    by = {r["contender"]: r for r in rows}
    assert list(by) == ep.ALL_CONTENDERS
    for r in rows:
        assert r["status"] == "ok", r
        assert r["ranks"] == R and "link_gbps" in r and "deepep_gbps" in r and isinstance(r["path"], str)
        assert len(r["ms_per_rank"]) == R
        if r["contender"] in ep.LAYER_CONTENDERS:  # interleaved rounds: max over ranks per round
            assert len(r["ms_rounds"]) == 2 and r["ms"] == statistics.median(r["ms_rounds"]), r
            assert max(r["ms_per_rank"]) <= r["ms"] * (1 + 1e-12), r  # per-rank medians over rounds
            assert r["gpu_clock"] is None and "gpu_clock_per_rank" not in r  # no SM clock on a CPU
        else:  # the exchanges: one round
            assert r["ms"] == max(r["ms_per_rank"]) and "ms_rounds" not in r
    row_bytes = H * 2
    all_rows = R * T * K * row_bytes
    disp, comb = by["nccl_dispatch"], by["nccl_combine"]
    assert disp["link_bytes_per_rank"] == [0] + [T * K * row_bytes] * (R - 1)  # rank 0 keeps its rows
    assert disp["deepep_bytes_per_rank"] == [all_rows] + [0] * (R - 1)  # rank 0 receives everything
    assert comb["link_bytes_per_rank"] == [(R - 1) * T * K * row_bytes] + [0] * (R - 1)
    assert comb["deepep_bytes_per_rank"] == [all_rows] + [0] * (R - 1)
    mean_link = (R - 1) * T * K * row_bytes / R
    assert disp["link_gbps"] == pytest.approx(mean_link / (disp["ms"] * 1e-3) / 1e9)
    assert disp["deepep_gbps"] == pytest.approx(all_rows / R / (disp["ms"] * 1e-3) / 1e9)
    # The layer rows: checked, timed, the mok_cute row says it is not the megakernel.
    for name in ep.LAYER_CONTENDERS:
        assert by[name]["rel_err"] <= 1e-2 and by[name]["tflops"] > 0
    assert by["mok_cute"]["path"].startswith("reference") and by["mok_cute"]["megakernel"] is False
    assert by["mok_cute"]["tflops"] == pytest.approx(6 * (T * K + T) * H * I / (by["mok_cute"]["ms"] * 1e-3) / 1e12)
    doc = {"gpu": "cpu", "date": "x", "command": "x", "versions": {}, "results": rows}
    import jsonschema

    jsonschema.validate(json.loads(json.dumps(doc)), results.RESULT_SCHEMA)

    # The max over ranks is the slowest rank's median: the last rank sleeps 30 ms per call.
    sleep_s = 0.03 if d.rank == R - 1 else 0.0
    ms, per_rank = ep_dist.timed_over_ranks(d, lambda: time.sleep(sleep_s), iters=3, warmup=0)
    assert ms == max(per_rank) == per_rank[-1] and ms >= 30.0 and per_rank[0] < 30.0


def _failed_check_is_recorded_not_timed(d: ep_dist.Dist, out_dir: Path) -> None:
    shape = _shape(d.world)
    original = ep.NcclTorchMoE.experts
    ep.NcclTorchMoE.experts = lambda self, rows, plan: torch.zeros_like(original(self, rows, plan))
    try:
        rows = ep.bench_ep_shape(shape, T, d, ep.EpOptions(iters=2, warmup=0, check_tokens=8), contenders=["nccl_torch"], log=lambda m: None)
    finally:
        ep.NcclTorchMoE.experts = original
    (row,) = rows
    assert row["status"] == "check_failed" and row["ms"] is None and row["rel_err"] > 1e-2, row


def _cli_hook_end_to_end(d: ep_dist.Dist, out_dir: Path) -> None:
    """`mok-cute bench --ep` runs the EP harness across the ranks."""
    argv = ["bench", "--ep", "--shapes", f"custom:{T},{H},{I},{E_LOC * d.world},{K},1", "--iters", "2", "--warmup", "1",
            "--check-tokens", "8", "--skew", "0.5", "--rounds", "2", "--out", str(out_dir / "results"), "--tag", "test",
            "--mok-config", "megakernel.tickets=static"]
    assert cli.main(argv) == 0


def _training_passes_checked_and_timed(d: ep_dist.Dist, out_dir: Path) -> None:
    """--train: bwd and train rows of both layer contenders, their eight gradients checked
    against autograd on the reference (the baseline's packed gate | up split back), timed with
    2x / 3x the forward's FLOPs; a baseline with a wrong gradient is recorded, not timed."""
    shape = _shape(d.world)
    opts = ep.EpOptions(iters=2, warmup=1, rounds=2, check_tokens=8, seed=2, train=True)
    rows = ep.bench_ep_shape(shape, T, d, opts, contenders=ep.LAYER_CONTENDERS, log=lambda m: None)
    ep.add_ratios(rows)
    for r in rows:  # every pass of both contenders timed in two interleaved rounds
        assert r["status"] == "ok" and len(r["ms_rounds"]) == 2, r
        assert r["ms"] == statistics.median(r["ms_rounds"]) and len(r["ms_per_rank"]) == d.world, r
        assert r["gpu_clock"] is None, r  # no SM clock on a CPU
        # paired with the baseline's rounds of the same pass: theirs over mine, round by round
        theirs = next(b["ms_rounds"] for b in rows if b["contender"] == ep.BASELINE and b["pass"] == r["pass"])
        assert r["paired_vs_torch"] == pytest.approx(statistics.median(t / m for t, m in zip(theirs, r["ms_rounds"])))
        if r["contender"] == ep.BASELINE:
            assert r["paired_vs_torch"] == pytest.approx(1.0) and r["ratio_vs_torch"] == pytest.approx(1.0)
    assert {r["pass"] for r in rows if r["contender"] == "mok_cute" and "paired_vs_torch" in r} == {"fwd", "bwd", "train"}
    train_rows = [r for r in rows if r.get("pass") != "fwd"]
    assert sorted((r["contender"], r["pass"]) for r in train_rows) == sorted(
        (c, p) for c in ep.LAYER_CONTENDERS for p in ("bwd", "train"))
    for r in train_rows:
        assert r["status"] == "ok", r
        assert set(r["rel_err_grads"]) == {f"d_{n}" for n in ep_training.GRAD_NAMES}, r
        assert max(r["rel_err_grads"].values()) <= 1e-2, r
        factor = ep_training.PASSES[r["pass"]]
        assert r["tflops"] == pytest.approx(factor * 6 * (T * K + T) * H * I / (r["ms"] * 1e-3) / 1e12)
    # a wrong gradient fails the check: the baseline's down projection scaled in backward only
    original = ep_training.nccl_torch_train_forward

    def wrong(x, idx, w, gate_up, down, shared, group, grouped_mm):
        scaled = down + (down * 0.5 - (down * 0.5).detach())  # forward unchanged, gradient x 1.5
        return original(x, idx, w, gate_up, scaled, shared, group, grouped_mm)

    ep_training.nccl_torch_train_forward = wrong
    try:
        rows = ep.bench_ep_shape(shape, T, d, opts, contenders=["nccl_torch"], log=lambda m: None)
    finally:
        ep_training.nccl_torch_train_forward = original
    bad = [r for r in rows if r.get("pass") != "fwd"]
    assert all(r["status"] == "check_failed" and r["ms"] is None for r in bad), bad
    assert all(r["rel_err_grads"]["d_w_down"] > 0.1 for r in bad), bad


def _round_failure_drops_the_contender(d: ep_dist.Dist, out_dir: Path) -> None:
    """A contender failing in round 2 (on every rank at the same call: a rank failing alone
    would leave the others in its collective) is recorded as an error agreed across ranks and
    never called again; the other contender keeps all its rounds."""
    shape = _shape(d.world)
    original = ep.NcclTorchMoE.__call__
    calls = [0]
    # the check (1 call), the burn-in (warmup: 1), round 1 (warmup 1 + iters 2): round 2's first is the 6th
    failing_call = 6

    def counted(self, inp):
        calls[0] += 1
        if calls[0] >= failing_call:
            raise RuntimeError(f"injected failure on rank {d.rank}")
        return original(self, inp)

    ep.NcclTorchMoE.__call__ = counted
    try:
        rows = ep.bench_ep_shape(shape, T, d, ep.EpOptions(iters=2, warmup=1, rounds=3, check_tokens=8),
                                 contenders=ep.LAYER_CONTENDERS, log=lambda m: None)
    finally:
        ep.NcclTorchMoE.__call__ = original
    by = {r["contender"]: r for r in rows}
    assert calls[0] == failing_call  # dropped from round 3
    bad = by[ep.BASELINE]
    assert bad["status"] == "error" and bad["ms"] is None and "ms_rounds" not in bad, bad
    assert bad["error"].startswith("round 2 of 3: rank 0: RuntimeError: injected failure on rank 0"), bad["error"]
    good = by["mok_cute"]
    assert good["status"] == "ok" and len(good["ms_rounds"]) == 3 and good["ms"] == statistics.median(good["ms_rounds"])
    ep.add_ratios(rows)
    assert "paired_vs_torch" not in good and "ratio_vs_torch" not in good


def _rank0_out_of_memory_is_an_error_on_every_rank(d, out_dir: Path) -> None:
    """Rank 0 failing to allocate a gathered reference tensor (the weights of every rank: out
    of memory on large shapes) fails the gather on every rank, so the ranks' next collective
    is the same one (an error agreed on), not a hang; the gather works again afterwards."""
    t = torch.full((3, 4), float(d.rank))
    original = torch.empty
    if d.rank == 0:
        def empty(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        torch.empty = empty
    try:
        with pytest.raises((torch.OutOfMemoryError, RuntimeError),
                           match="out of memory|rank 0 could not allocate"):
            ep_dist.gather_stacked(d, t)
    finally:
        torch.empty = original
    error = ep_dist._agree_error(d, "gather failed")
    assert error.startswith("rank 0: gather failed")
    got = ep_dist.gather_stacked(d, t)
    if d.rank == 0:
        assert [float(g[0, 0]) for g in got] == list(map(float, range(d.world)))


def _rank0_reference_failure_is_an_error_on_every_rank(d, out_dir: Path) -> None:
    """Rank 0's reference gradients failing after the gathers (out of memory in its autograd)
    fail ``reference_grads_by_rank`` on every rank before the scatters, so the ranks agree on
    the error instead of the others waiting in a scatter that rank 0 never joins."""
    shape = _shape(d.world)
    weights = ep.make_rank_weights(shape, d.world, d.rank, d.device, 3)
    routing = ep.make_routing(d.world, 8, shape.experts, shape.top_k, 4)
    inp = ep.make_rank_inputs(routing, shape.hidden, d.rank, d.device, 5)
    d_out = torch.randn(inp.x.shape).to(torch.bfloat16)
    original = ep_training.reference_grads_on_rank0

    def failing(*args):
        full = original(*args)
        if d.rank == 0:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return full

    ep_training.reference_grads_on_rank0 = failing
    try:
        with pytest.raises((torch.OutOfMemoryError, RuntimeError),
                           match="out of memory|rank 0 could not compute"):
            ep_training.reference_grads_by_rank(d, weights, inp, d_out)
    finally:
        ep_training.reference_grads_on_rank0 = original
    assert ep_dist._agree_error(d, "reference failed").startswith("rank 0: reference failed")


SCENARIOS = {
    "gather_oom": _rank0_out_of_memory_is_an_error_on_every_rank,
    "reference_oom": _rank0_reference_failure_is_an_error_on_every_rank,
    "baseline": _baseline_equals_reference_and_group_path,
    "train": _training_passes_checked_and_timed,
    "bytes": _exact_bytes_and_max_timing,
    "failed_check": _failed_check_is_recorded_not_timed,
    "round_failure": _round_failure_drops_the_contender,
    "cli": _cli_hook_end_to_end,
}


def _run_scenarios(rank: int, world: int, out_dir: str, scenarios: list[str]) -> None:
    d = ep_dist.init_distributed("cpu")
    assert not d.owns_group and (d.rank, d.world, d.backend) == (rank, world, "gloo")
    for name in scenarios:
        SCENARIOS[name](d, Path(out_dir))


def _spawn(world: int, scenarios: list[str], tmp_path: Path) -> None:
    gloo_group.spawn(_run_scenarios, world, tmp_path, str(tmp_path), scenarios)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_two_ranks_baseline_bytes_timing_failed_check_and_cli(tmp_path):
    _spawn(2, list(SCENARIOS), tmp_path)
    (json_path,) = (tmp_path / "results").glob("*.json")
    doc = json.loads(json_path.read_text())
    import jsonschema

    jsonschema.validate(doc, results.RESULT_SCHEMA)
    assert doc["ranks"] == 2 and doc["skew"] == 0.5 and doc["nvls_env"]["NCCL_NVLS_ENABLE"] == "0"
    assert doc["command"].startswith("mok-cute bench --ep")
    assert doc["mok_config"]["megakernel"]["tickets"] == "static" and "switches" not in doc
    assert [r["contender"] for r in doc["results"]] == ep.ALL_CONTENDERS
    assert all(r["status"] == "ok" for r in doc["results"]), doc["results"]
    assert doc["rounds"] == 2 and doc["iters"] == 2 and doc["warmup"] == 1
    layer = [r for r in doc["results"] if r["contender"] in ep.LAYER_CONTENDERS]
    assert all(len(r["ms_rounds"]) == 2 and r["ms"] == statistics.median(r["ms_rounds"]) for r in layer), layer
    assert all(r["paired_vs_torch"] > 0 for r in layer), layer
    assert json_path.with_suffix(".png").stat().st_size > 0


def test_three_ranks_baseline_and_bytes(tmp_path):
    _spawn(3, ["baseline", "bytes"], tmp_path)


@pytest.mark.parametrize("skew", [0.0, 0.25, 0.5, 1.0])
def test_skew_routes_exactly_the_requested_fraction_to_the_hot_expert(skew):
    R, tokens, E, k, hot = 3, 40, 12, 3, 5
    idx, wts = ep.make_routing(R, tokens, E, k, seed=2, skew=skew, hot_expert=hot)
    assert idx.shape == wts.shape == (R, tokens, k)
    for r in range(R):
        assert int((idx[r] == hot).any(dim=1).sum()) == round(skew * tokens)
        assert all(len(set(row.tolist())) == k for row in idx[r])  # K distinct experts per token
    assert torch.allclose(wts.sum(-1), torch.ones(R, tokens))
    again = ep.make_routing(R, tokens, E, k, seed=2, skew=skew, hot_expert=hot)
    assert torch.equal(idx, again[0]) and torch.equal(wts, again[1])  # the same on every rank


def test_uniform_routing_and_exchange_rows():
    idx, _ = ep.make_routing(2, 64, 8, 2, seed=0)
    rows = ep.exchange_rows(idx, num_local_experts=4)
    assert rows.sum(1).tolist() == [64 * 2, 64 * 2]
    assert int((idx[0] < 4).sum()) == int(rows[0, 0])


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="skew"):
        ep.make_routing(1, 4, 4, 2, seed=0, skew=1.5)
    with pytest.raises(ValueError, match="hot_expert"):
        ep.make_routing(1, 4, 4, 2, seed=0, skew=0.5, hot_expert=9)
    with pytest.raises(ValueError, match="shapes"):
        ep.resolve_ep_shape("nonsense")
    with pytest.raises(ValueError, match="ranks"):
        ep.make_rank_weights(_shape(1), 3, 0, torch.device("cpu"), seed=0)
    assert ep.main(["--contenders", "nope"]) == 2


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_rounds_below_one_are_refused_naming_the_option(rounds, capsys):
    assert ep.main(["--rounds", rounds, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--rounds" in err and f"got {rounds}" in err, err
    assert not dist.is_initialized()  # refused before any process group


@pytest.mark.parametrize("argv,message", [(["--iters", "0"], "--iters / --warmup"),
                                          (["--warmup", "-1"], "--iters / --warmup"),
                                          (["--tokens", "64,abc"], "--tokens: expected positive integers")])
def test_timing_and_token_options_are_refused_before_the_session(argv, message, capsys):
    assert ep.main([*argv, "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()


def test_named_shapes_and_prefixes():
    assert ep.resolve_ep_shape("kimi_k2").name == "kimi_k2.7"
    assert [s.name for s in ep.resolve_ep_shapes("ep")] == list(shapes.EP_SHAPES)
    s = ep.resolve_ep_shape("kimi_k2.7")
    assert (s.tokens, s.hidden, s.intermediate, s.experts, s.top_k, s.shared) == (2048, 7168, 2048, 384, 8, True)


def test_bench_hook_reaches_the_ep_main(monkeypatch):
    seen = []
    monkeypatch.setattr(ep, "main", lambda argv: seen.append(list(argv)) or 7)
    assert harness.main(["--ep", "--shapes", "kimi_k2"]) == 7
    assert seen == [["--ep", "--shapes", "kimi_k2"]]


def test_import_turns_nvlink_multicast_off():
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"


def test_single_process_run_without_torchrun(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--shapes", f"custom:{T},{H},{I},{E_LOC},{K},0", "--iters", "2", "--warmup", "0", "--check-tokens", "8",
            "--device", "cpu", "--out", str(tmp_path)]
    assert ep.main(argv) == 0
    assert not dist.is_initialized()  # the group it made is gone
    (json_path,) = tmp_path.glob("*.json")
    doc = json.loads(json_path.read_text())
    assert doc["ranks"] == 1 and all(r["status"] == "ok" for r in doc["results"])
    assert doc["command"] == "mok-cute bench --ep " + " ".join(argv)


@pytest.mark.gpu
def test_grouped_mm_baseline_matches_the_reference_on_one_gpu(tmp_path, monkeypatch):
    """One rank on the GPU: the torch._grouped_mm baseline and the mok_cute group path pass the check."""
    argv = ["--shapes", "custom:256,512,256,16,4,1", "--iters", "3", "--warmup", "1", "--check-tokens", "64",
            "--device", "cuda", "--out", str(tmp_path)]
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert ep.main(argv) == 0
    (json_path,) = tmp_path.glob("*.json")
    rows = json.loads(json_path.read_text())["results"]
    assert all(r["status"] == "ok" for r in rows), rows
    assert next(r for r in rows if r["contender"] == "nccl_torch")["path"].startswith("nccl all_to_all_single dispatch + torch._grouped_mm")


def test_example_script_under_torchrun_on_cpu(tmp_path):
    """examples/ep_torchrun.py: 2 gloo ranks, MoELayer(group=...), the check passes, times printed,
    then 4 training steps lower the loss; the recorded step (--timeline) says that the reference
    path records nothing, and writes nothing."""
    proc = _torchrun(2, "examples/ep_torchrun.py", "--device", "cpu",
                     "--shape", f"custom:{T},{H},{I},{2 * E_LOC},{K},1", "--iters", "2", "--warmup", "1",
                     "--check-tokens", "16", "--train", "4", "--lr", "0.5",
                     "--timeline", str(tmp_path / "tl"), timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "-> PASS" in proc.stdout and "rank 1: forward" in proc.stdout and "max over ranks" in proc.stdout
    assert "train: 4 steps" in proc.stdout and "(down)" in proc.stdout, proc.stdout[-2000:]
    assert "timeline: no forward recording on this path" in proc.stdout
    assert "timeline: no backward recording on this path" in proc.stdout
    assert not (tmp_path / "tl").exists()


def _torchrun(nproc: int, script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``script`` (relative to the checkout) under torchrun on 127.0.0.1. The port comes from
    ``free_port``, which another process may take before torchrun binds it (tests run beside
    each other): a run that failed on a port already in use runs again on a new one."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    for _ in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(ep_dist.free_port()), str(root / script), *args]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or "address already in use" not in (proc.stdout + proc.stderr).lower():
            break
    return proc


def _torchrun_ep_check(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return _torchrun(nproc, "tools/ep_check.py", *args, timeout=600)


def test_ep_checks_run_under_torchrun_on_cpu():
    """tools/ep_check.py's plumbing on 2 gloo ranks with the reference backend: every check
    (reference, repeat, comm split, emulated) is reported for both routings and passes."""
    proc = _torchrun_ep_check(2, "--device", "cpu", "--backend", "reference",
                              "--shape", f"custom:{T},{H},{I},{2 * E_LOC},{K},1")
    # a rank's own dying words come first in stderr, torchrun's summary last
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[:3000] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if " PASS " in ln or " FAIL " in ln]
    assert len(lines) == 8 and all(" PASS " in ln for ln in lines), proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more GPUs")
def test_ep_megakernel_checks_on_every_gpu():
    """Issue 7 on real GPUs: the IPC megakernel against the reference, bitwise across runs and
    comm splits, and bitwise equal to its emulation on one GPU, uniform and skewed routing."""
    n = min(torch.cuda.device_count(), 8)
    proc = _torchrun_ep_check(n, "--backend", "megakernel")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
