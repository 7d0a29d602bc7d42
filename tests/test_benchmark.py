"""The one-GPU bench (``mok_cute.bench``) and the shape catalogue (``mok_cute.shapes``): FLOP
formula, shapes, --mok-config, torch contenders against the reference, failure recording,
result JSON schema (with the MoKConfig timed) and bar chart (CPU); the full protocol on a GPU."""

import dataclasses
import json
import types

import pytest
import torch

import mok_cute
from mok_cute import shapes
from mok_cute.bench import common, harness, problems, results, torch_moe
from mok_cute.config import ExpertPathOptions, MegakernelOptions, MoKConfig
from per_token import assert_tokens_close


def _grouped_mm_runs_here(device: str) -> bool:
    try:
        a = torch.randn(16, 16, device=device).to(torch.bfloat16)
        b = torch.randn(2, 16, 16, device=device).to(torch.bfloat16)
        torch._grouped_mm(a, b, offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
        return True
    except Exception:
        return False


GROUPED_MM_ON_CPU = hasattr(torch, "_grouped_mm") and _grouped_mm_runs_here("cpu")


# --------------------------------------------------------------------------------------------
# formula and shapes
# --------------------------------------------------------------------------------------------


def test_flop_formula_is_moks():
    # 6 * (T*K + T*[shared]) * H * I
    assert shapes.moe_flops(4096, 7168, 2048, 8) == 6 * 4096 * 8 * 7168 * 2048 == 2_886_218_022_912
    assert shapes.moe_flops(2048, 7168, 2048, 8, shared=True) == 6 * (2048 * 8 + 2048) * 7168 * 2048
    assert shapes.moe_flops(1, 1, 1, 1) == 6


def test_named_shapes_are_designs_tables():
    single = {n: (s.tokens, s.hidden, s.intermediate, s.experts, s.top_k, s.shared) for n, s in shapes.SINGLE_GPU_SHAPES.items()}
    assert single == {
        "dsv3_ep8_rank": (4096, 7168, 2048, 32, 8, False),
        "qwen3_30b": (16384, 2048, 768, 128, 8, False),
        "sonic_120b": (32768, 4096, 2048, 64, 4, False),
        "mixtral": (8192, 4096, 14336, 8, 2, False),
        "gptoss_120b": (8192, 2880, 2880, 128, 4, False),
    }
    ep = {n: (s.tokens, s.hidden, s.intermediate, s.experts, s.top_k, s.shared) for n, s in shapes.EP_SHAPES.items()}
    assert ep == {
        "kimi_k2.7": (2048, 7168, 2048, 384, 8, True),
        "glm_5.2": (2048, 6144, 2048, 256, 8, True),
        "qwen3.5_397b": (2048, 4096, 1024, 512, 10, True),
        "dsv4_pro": (2048, 7168, 3072, 384, 6, True),
    }
    # EP shapes hold R ranks' tokens; single-GPU shapes scale only with --t-scale.
    assert shapes.EP_SHAPES["kimi_k2.7"].total_tokens(1.0, ranks=8) == 8 * 2048
    assert shapes.SINGLE_GPU_SHAPES["mixtral"].total_tokens(0.25, ranks=8) == 2048


def test_shape_specs_resolve_and_bad_ones_name_the_argument():
    assert [s.name for s in shapes.resolve_shapes("single")] == list(shapes.SINGLE_GPU_SHAPES)
    assert [s.name for s in shapes.resolve_shapes("ep")] == list(shapes.EP_SHAPES)
    resolved = shapes.resolve_shapes("mixtral,custom:64,32,16,4,2,1,qwen3_30b")
    assert [s.name for s in resolved] == ["mixtral", "custom:64,32,16,4,2,1", "qwen3_30b"]
    # the probes in tools/ take the names (a custom shape keeps its commas, groups expand)
    assert shapes.shape_names("custom:32768,2880,2880,128,4,ep") == [
        "custom:32768,2880,2880,128,4", *shapes.EP_SHAPES]
    custom = resolved[1]
    assert (custom.tokens, custom.hidden, custom.intermediate, custom.experts, custom.top_k, custom.shared) == (64, 32, 16, 4, 2, True)
    for bad in ("nope", "custom:1,2,3", "custom:8,8,8,2,3", "custom:a,b,c,d,e"):
        with pytest.raises(ValueError, match="shape"):
            shapes.resolve_shape(bad)


def test_config_overrides_parse_types():
    got = common.parse_config_overrides(["num_comm_sms=16,timeline=true", "timeout_ms=5.5", "backend=auto", "ring_tokens=None"])
    assert got == {"num_comm_sms": 16, "timeline": True, "timeout_ms": 5.5, "backend": "auto", "ring_tokens": None}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        common.parse_config_overrides(["num_comm_sms"])
    config = common.apply_config_overrides(MoKConfig(), got)
    assert (config.num_comm_sms, config.timeline, config.timeout_ms, config.ring_tokens) == (16, True, 5.5, None)


def test_config_overrides_set_the_options_objects_fields():
    """``--mok-config megakernel.tickets=static expert_path.fc2_pingpong_max_k=0 check_ids=False``:
    a dotted key sets a field of the options object, the other fields keep their defaults."""
    got = common.parse_config_overrides(["megakernel.tickets=static", "expert_path.fc2_pingpong_max_k=0",
                                         "check_ids=False", "megakernel.fc1_lead=2"])
    config = common.apply_config_overrides(MoKConfig(backend="kernel"), got)
    assert config.megakernel == MegakernelOptions(tickets="static", fc1_lead=2)
    assert config.expert_path == ExpertPathOptions(fc2_pingpong_max_k=0)
    assert config.check_ids is False and config.backend == "kernel"
    for bad, match in (("nope=1", "not a MoKConfig field"), ("megakernel.nope=1", "not a field of MegakernelOptions"),
                       ("megakernel=1", "options object"), ("check_ids.x=1", "has no fields")):
        with pytest.raises(ValueError, match=match):
            common.parse_config_overrides([bad])
    for bad in ("megakernel.tickets=sideways", "expert_path.fc1_group_m=x", "backend=gpu"):  # refused by the dataclasses
        with pytest.raises(ValueError):
            common.apply_config_overrides(MoKConfig(), common.parse_config_overrides([bad]))


# --------------------------------------------------------------------------------------------
# problems and the torch contenders against mok_cute.reference
# --------------------------------------------------------------------------------------------


def test_problem_is_random_normal_never_zeros_and_fresh_inputs_differ():
    p = problems.make_problem(shapes.resolve_shape("custom:64,32,16,8,2,1"), device="cpu", seed=1)
    for t in (p.inputs.x, p.w_gate, p.w_up, p.w_down, *p.shared):
        assert t.dtype == torch.bfloat16 and t.float().abs().min() >= 0 and t.float().std() > 0
        assert (t == 0).float().mean() < 0.01
    assert p.inputs.topk_idx.dtype == torch.int32
    assert all(len(set(row)) == 2 for row in p.inputs.topk_idx.tolist())  # K distinct experts
    torch.testing.assert_close(p.inputs.topk_weights.sum(1), torch.ones(64))
    q = p.with_fresh_inputs(32, seed=2)
    assert q.tokens == 32 and q.w_gate is p.w_gate and not torch.equal(q.inputs.x[:32], p.inputs.x[:32])
    assert p.flops == shapes.moe_flops(64, 32, 16, 2, shared=True)


@pytest.mark.skipif(not GROUPED_MM_ON_CPU, reason="torch._grouped_mm does not run on the CPU here; see the gpu test")
@pytest.mark.parametrize("spec", ["custom:96,64,32,8,2", "custom:80,128,64,16,4,1", "custom:1,64,32,4,4"])
def test_torch_grouped_mm_pipeline_matches_the_reference_on_cpu(spec):
    p = problems.make_problem(shapes.resolve_shape(spec), device="cpu", seed=3)
    i = p.inputs
    ref = mok_cute.reference.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down, shared=p.shared)
    gu, down = torch_moe.pack_grouped_mm_weights(p.w_gate, p.w_up, p.w_down)
    out = torch_moe.torch_grouped_mm_moe(i.x, i.topk_idx, i.topk_weights, gu, down, torch_moe.fuse_shared(p.shared))
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert_tokens_close(out, ref, what=f"torch_grouped_mm {spec}")


@pytest.mark.skipif(not GROUPED_MM_ON_CPU, reason="torch._grouped_mm does not run on the CPU here; see the gpu test")
def test_torch_grouped_mm_pipeline_with_an_empty_expert():
    p = problems.make_problem(shapes.resolve_shape("custom:64,64,32,8,2"), device="cpu", seed=4)
    idx = p.inputs.topk_idx.clone()
    idx[idx == 5] = 6  # expert 5 gets no rows (and tokens routed to 5 and 6 now hit 6 twice)
    i = p.inputs
    ref = mok_cute.reference.moe_forward(i.x, idx, i.topk_weights, p.w_gate, p.w_up, p.w_down)
    out = torch_moe.torch_grouped_mm_moe(i.x, idx, i.topk_weights, *torch_moe.pack_grouped_mm_weights(p.w_gate, p.w_up, p.w_down))
    assert_tokens_close(out, ref, what="torch_grouped_mm with an empty expert")


def test_aligned_group_rows_place_each_expert_at_a_multiple_of_16():
    ids = torch.tensor([0, 0, 0, 2, 2, 3] + [5] * 17)  # sorted; experts 1 and 4 empty
    dest, offs, capacity = torch_moe.aligned_group_rows(ids, 6)
    assert capacity == ids.numel() + 6 * 15
    assert offs.tolist() == [16, 16, 32, 48, 48, 80] and offs.dtype == torch.int32
    assert dest.tolist() == [0, 1, 2, 16, 17, 32] + list(range(48, 65))


def _scaled_grouped_mm_emulated(a, b, scale_a, scale_b, offs=None, out_dtype=None):
    """torch._scaled_grouped_mm's 2-D x 3-D rowwise contract in float64 (the CPU has no kernel)."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        rows = a[start:end].double() * scale_a[start:end, None].double()
        out[start:end] = rows @ (b[e].double() * scale_b[e][None, :].double())
        start = end
    return out.to(out_dtype)


@pytest.mark.parametrize("spec", ["custom:96,64,32,8,2", "custom:80,128,64,16,4,1", "custom:1,64,32,4,4"])
def test_torch_scaled_grouped_mm_pipeline_plumbing_on_cpu(spec, monkeypatch):
    """The FP8 baseline's permutation, 16-aligned groups, scales and combine, its GEMM
    emulated: within the FP8 bench bound (0.08) of the bf16 reference, and clearly FP8."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_emulated, raising=False)
    p = problems.make_problem(shapes.resolve_shape(spec), device="cpu", seed=3)
    i = p.inputs
    ref = mok_cute.reference.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down, shared=p.shared)
    weights = torch_moe.pack_scaled_grouped_mm_weights(p.w_gate, p.w_up, p.w_down)
    out = torch_moe.torch_scaled_grouped_mm_moe(i.x, i.topk_idx, i.topk_weights, *weights, torch_moe.fuse_shared(p.shared))
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert 5e-3 < err <= 0.08, err


@pytest.mark.parametrize("shared", [False, True])
def test_training_check_at_the_timed_size_catches_a_swapped_token(shared):
    """``training.timed_size_errors``: a layer that is the reference passes at ~0; the same
    layer with two tokens' rows swapped in the output and in d_x (what a misrouted row at a
    large T would do) fails by far, row by row (the sample of 256 of T = 300 holds at least
    one of them)."""
    from mok_cute import reference
    from mok_cute.bench import training

    problem = problems.make_problem(shapes.Shape("t", 300, 64, 32, 6, 3, shared), "cpu", seed=3)
    i = problem.inputs
    d_out = torch.randn(i.x.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    def layer(swap: bool):
        x = i.x.detach().clone().requires_grad_()
        w = i.topk_weights.detach().clone().requires_grad_()
        perm = torch.arange(300)
        if swap:
            perm[[7, 211]] = perm[[211, 7]]

        def forward():
            return reference.moe_forward(x, i.topk_idx, w, problem.w_gate, problem.w_up,
                                         problem.w_down, shared=problem.shared)[perm]

        def reset():
            x.grad = w.grad = None

        return types.SimpleNamespace(
            forward=forward, reset=reset, zero_main_grads=lambda: None,
            grads=lambda: {"x": None if x.grad is None else x.grad[perm], "topk_weights": w.grad})

    ok = training.timed_size_errors(layer(False), problem, d_out)
    assert set(ok) == {"out", "d_x", "d_topk_weights"} and max(ok.values()) < 1e-6, ok
    bad = training.timed_size_errors(layer(True), problem, d_out)
    assert bad["out"] > 0.3 and bad["d_x"] > 0.3, bad  # bf16's bound: 3 x 1e-2


def test_per_expert_loop_matches_the_reference_on_cpu():
    p = problems.make_problem(shapes.resolve_shape("custom:96,64,32,8,3,1"), device="cpu", seed=5)
    i = p.inputs
    ref = mok_cute.reference.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down, shared=p.shared)
    out = torch_moe.per_expert_loop_moe(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down, torch_moe.fuse_shared(p.shared))
    assert_tokens_close(out, ref, what="per_expert_loop")


def test_virtual_split_is_the_same_work_as_the_whole_problem():
    """mok_cute_virtual times R ranks of the problem the single-GPU contenders run: the
    reference agrees bitwise between the split and the whole."""
    shape = shapes.resolve_shape("custom:32,64,32,8,2,1")
    p = problems.make_problem(shape, device="cpu", seed=6)
    v = p.virtual(4)
    assert v.x.shape == (4, 8, 64) and v.w_gate.shape == (4, 2, 32, 64) and v.shared[0].shape == (4, 32, 64)
    i = p.inputs
    whole = mok_cute.reference.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down, shared=p.shared)
    split = mok_cute.reference.moe_forward_virtual(v.x, v.topk_idx, v.topk_weights, v.w_gate, v.w_up, v.w_down, shared=v.shared)
    assert torch.equal(split.reshape(32, 64), whole)
    with pytest.raises(ValueError, match="ranks"):
        p.virtual(3)


# --------------------------------------------------------------------------------------------
# the protocol: check, record failures, time
# --------------------------------------------------------------------------------------------


def _ctx(tmp_path, **kw):
    return harness.BenchContext(device=torch.device("cpu"), out_dir=tmp_path, **kw)


def test_bench_shape_records_crashes_and_failed_checks_and_times_the_rest(tmp_path, monkeypatch):
    def crashing(problem, ctx):
        raise RuntimeError("compile failed: no kernel image")

    def wrong(problem, ctx):
        good, _ = harness._prepare_per_expert_loop(problem, ctx)
        return (lambda inp: good(inp) * 1.1), {}

    monkeypatch.setitem(harness.CONTENDERS, "crashes", crashing)
    monkeypatch.setitem(harness.CONTENDERS, "wrong", wrong)
    shape = shapes.resolve_shape("custom:64,64,32,8,2")
    timer = harness.Timer(torch.device("cpu"), iters=2, warmup=1)
    results = harness.bench_shape(shape, ["crashes", "wrong", "per_expert_loop", "mok_cute"], _ctx(tmp_path), timer, check_tokens=32, log=lambda m: None)
    by = {r["contender"]: r for r in results}
    assert by["crashes"]["status"] == "error" and "compile failed" in by["crashes"]["error"] and by["crashes"]["ms"] is None
    assert by["wrong"]["status"] == "check_failed" and by["wrong"]["ms"] is None and by["wrong"]["rel_err"] > 0.05
    ok = by["per_expert_loop"]
    assert ok["status"] == "ok" and ok["rel_err"] <= 1e-2 and ok["ms"] > 0
    assert ok["tflops"] == pytest.approx(shapes.moe_flops(64, 64, 32, 2) / (ok["ms"] * 1e-3) / 1e12)
    assert (ok["T"], ok["H"], ok["I"], ok["E"], ok["K"]) == (64, 64, 32, 8, 2)
    if not torch.cuda.is_available():  # the reference fallback is never timed as mok_cute
        assert by["mok_cute"]["status"] == "skipped" and by["mok_cute"]["ms"] is None
        assert "not the kernel path" in by["mok_cute"]["error"]


def test_rounds_time_every_contender_in_alternating_order_and_report_medians(tmp_path, monkeypatch):
    """rounds > 1: contenders are checked first, then timed A B, B A, A B; each reports the
    median of its rounds; a failed check is never timed."""
    calls = []

    def traced(label):
        def prepare(problem, ctx):
            good, _ = harness._prepare_per_expert_loop(problem, ctx)
            return (lambda inp: calls.append(label) or good(inp)), {}
        return prepare

    def wrong(problem, ctx):
        good, _ = harness._prepare_per_expert_loop(problem, ctx)
        return (lambda inp: good(inp) * 1.1), {}

    monkeypatch.setitem(harness.CONTENDERS, "a", traced("a"))
    monkeypatch.setitem(harness.CONTENDERS, "b", traced("b"))
    monkeypatch.setitem(harness.CONTENDERS, "wrong", wrong)
    shape = shapes.resolve_shape("custom:64,64,32,8,2")
    timer = harness.Timer(torch.device("cpu"), iters=1, warmup=0)
    results = harness.bench_shape(shape, ["a", "wrong", "b"], _ctx(tmp_path), timer, check_tokens=32,
                             log=lambda m: None, rounds=3)
    by = {r["contender"]: r for r in results}
    assert [r["contender"] for r in results] == ["a", "wrong", "b"]
    assert by["wrong"]["status"] == "check_failed" and "ms_rounds" not in by["wrong"]
    for name in ("a", "b"):
        r = by[name]
        assert r["status"] == "ok" and len(r["ms_rounds"]) == 3
        assert r["ms"] == pytest.approx(sorted(r["ms_rounds"])[1])
    # the checks before any timing: each at the check's T, then once at the timed T (a sample
    # of its tokens against the reference)
    assert calls[:4] == ["a", "a", "b", "b"]
    assert by["a"]["timed_size_rel_err"] < 1e-2
    timed = calls[4:]  # rounds a b | b a | a b: consecutive runs of one label merge at the turns
    runs = [c for i, c in enumerate(timed) if i == 0 or c != timed[i - 1]]
    assert runs == ["a", "b", "a", "b"]


def test_ratios_are_against_torch_and_cublas_of_the_same_run():
    results = [
        {"shape": "matmul_8192", "contender": "cublas_8192", "tflops": 600.0},
        {"shape": "a", "contender": "torch_grouped_mm", "tflops": 100.0},
        {"shape": "a", "contender": "mok_cute", "tflops": 150.0},
        {"shape": "b", "contender": "mok_cute", "tflops": 300.0},
        {"shape": "b", "contender": "sonicmoe", "tflops": None},
        {"shape": "a", "contender": "mok_cute_timeline", "tflops": 120.0, "ms": 2.5},
    ]
    results[2]["ms"] = 2.0
    harness.add_ratios(results)
    assert results[2]["ratio_vs_torch"] == 1.5 and results[2]["frac_cublas"] == 0.25
    assert results[3]["ratio_vs_torch"] is None and results[3]["frac_cublas"] == 0.5
    assert "ratio_vs_torch" not in results[4]
    assert results[5]["timeline_overhead"] == 0.25


def test_paired_ratios_pair_the_rounds():
    """Round 2 ran slow for both: the ratio of medians (3.0 / 2.0 = 1.5) misses the per-round
    pairing, whose median is 2.0 for the megakernel over mok_cute; torch over mok_cute is
    paired the same way. Without rounds, or with unequal counts, there is none."""
    results = [
        {"shape": "a", "contender": "torch_grouped_mm", "tflops": 1.0, "ms": 8.0, "ms_rounds": [8.0, 40.0, 8.0]},
        {"shape": "a", "contender": "mok_cute", "tflops": 4.0, "ms": 2.0, "ms_rounds": [1.0, 10.0, 2.0]},
        {"shape": "a", "contender": "mok_megakernel", "tflops": 2.0, "ms": 3.0, "ms_rounds": [2.0, 30.0, 3.0]},
        {"shape": "a", "contender": "sonicmoe", "tflops": 2.0, "ms": 3.0, "ms_rounds": [2.0, 3.0]},
        {"shape": "b", "contender": "mok_cute", "tflops": 2.0, "ms": 3.0},
    ]
    harness.add_ratios(results)
    mok, mega, sonic, single = results[1], results[2], results[3], results[4]
    assert mega["paired_ms_over_mok_cute"] == 2.0 and mok["paired_ms_over_mok_cute"] == 1.0
    assert mok["paired_vs_torch"] == 4.0 and mega["paired_vs_torch"] == 4.0 / 1.5
    assert sonic["paired_ms_over_mok_cute"] is None and sonic["paired_vs_torch"] is None
    assert "paired_vs_torch" not in single


def test_timer_on_cpu_returns_the_median():
    calls = []
    timer = harness.Timer(torch.device("cpu"), iters=5, warmup=2)
    assert timer(lambda: calls.append(1)) > 0 and len(calls) == 7
    with pytest.raises(ValueError, match="iters"):
        harness.Timer(torch.device("cpu"), iters=0)


def test_result_files_are_never_overwritten(tmp_path):
    first = results.result_path(tmp_path, "NVIDIA H200", "fwd", "2026-11-29")
    assert first.name == "2026-11-29_h200_fwd.json"
    first.write_text("{}")
    assert results.result_path(tmp_path, "NVIDIA H200", "fwd", "2026-11-29").name == "2026-11-29_h200_fwd_2.json"


# DESIGN §5 schema, written out here independently of results.RESULT_SCHEMA.
DESIGN_SCHEMA = {
    "type": "object",
    "required": ["gpu", "date", "command", "versions", "results"],
    "properties": {
        "gpu": {"type": "string"},
        "date": {"type": "string"},
        "command": {"type": "string"},
        "versions": {"type": "object"},
        "results": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["shape", "contender", "pass", "ms", "tflops"],
                "properties": {"pass": {"enum": ["fwd", "bwd"]}, "shape": {"type": "string"}, "contender": {"type": "string"}},
            },
        },
    },
}


def test_main_on_cpu_writes_schema_valid_json_and_a_png(tmp_path, capsys):
    import jsonschema
    import matplotlib.image

    argv = ["--shapes", "custom:64,64,32,8,2,1", "--contenders", "torch_grouped_mm,per_expert_loop,sonicmoe,cublas_8192,cublas_fp8_8192,mok_cute",
            "--iters", "2", "--warmup", "1", "--check-tokens", "32", "--out", str(tmp_path), "--tag", "cpu-smoke", "--device", "cpu",
            "--mok-config", "megakernel.tickets=static", "--mok-config", "check_ids=False"]
    assert harness.main(argv) == 0
    files = sorted(tmp_path.glob("*_cpu-smoke.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    jsonschema.validate(doc, DESIGN_SCHEMA)
    jsonschema.validate(doc, results.RESULT_SCHEMA)
    assert "--shapes custom:64,64,32,8,2,1" in doc["command"] and doc["argv"] == argv
    assert doc["versions"]["torch"] and doc["versions"]["python"]
    # which code was timed: the MoKConfig of the mok_cute contenders, options nested
    assert "switches" not in doc
    assert doc["mok_config"] == dataclasses.asdict(MoKConfig(backend="kernel", check_ids=False,
                                                             megakernel=MegakernelOptions(tickets="static")))
    assert doc["mok_config"]["expert_path"]["fc2_pingpong_max_k"] == ExpertPathOptions().fc2_pingpong_max_k
    by = {r["contender"]: r for r in doc["results"]}
    assert by["per_expert_loop"]["status"] == "ok"
    if GROUPED_MM_ON_CPU:
        assert by["torch_grouped_mm"]["status"] == "ok" and by["per_expert_loop"]["ratio_vs_torch"] > 0
    assert by["cublas_8192"]["status"] == "skipped"  # no CUDA here: recorded, not run
    for recipe in ("tensorwise", "blockwise"):  # the FP8 ceiling: one row per scaling recipe
        assert by[f"cublas_fp8_{recipe}_8192"]["status"] == "skipped"
    assert by["sonicmoe"]["status"] == "skipped"
    img = matplotlib.image.imread(files[0].with_suffix(".png"))
    assert img.shape[0] > 300 and img.shape[1] > 500
    assert "per_expert_loop" in capsys.readouterr().out


def test_main_rejects_unknown_contenders_shapes_and_config_fields(tmp_path):
    assert harness.main(["--contenders", "magic", "--out", str(tmp_path)]) == 2
    assert harness.main(["--shapes", "nope", "--out", str(tmp_path)]) == 2
    assert harness.main(["--mok-config", "megakernel.pingpong=True", "--out", str(tmp_path)]) == 2
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("argv,message", [(["--iters", "0"], "iters/warmup: expected iters >= 1"),
                                          (["--warmup", "-1"], "iters/warmup: expected iters >= 1"),
                                          (["--device", "gpu0"], "--device: not a device: 'gpu0'")])
def test_main_refuses_bad_timing_and_device_options(tmp_path, capsys, argv, message):
    assert harness.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().out
    assert not list(tmp_path.glob("*.json"))


def test_bar_chart_from_a_synthetic_result_list(tmp_path):
    import matplotlib.image

    rows = [{"shape": "matmul_8192", "contender": "cublas_8192", "pass": "fwd", "ms": 1.5, "tflops": 723.0, "status": "ok"}]
    for shape, base in (("dsv3_ep8_rank", 411.0), ("sonic_120b", 390.0), ("qwen3_30b", 236.0)):
        rows += [
            {"shape": shape, "contender": "torch_grouped_mm", "pass": "fwd", "ms": 1.0, "tflops": base, "status": "ok"},
            {"shape": shape, "contender": "sonicmoe", "pass": "fwd", "ms": 0.7, "tflops": base * 1.4, "status": "ok"},
            {"shape": shape, "contender": "mok_cute", "pass": "fwd", "ms": None, "tflops": None, "status": "error"},
        ]
    harness.add_ratios(rows)
    path = results.plot_results(rows, tmp_path / "bars.png", title="synthetic")
    img = matplotlib.image.imread(path)
    assert img.shape[:2] == (550, round(max(7.0, 1.6 * 3 * 3 / 3 + 3) * 110))
    assert img[..., :3].std() > 0.05  # bars drawn, not a blank canvas


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_torch_grouped_mm_pipeline_matches_the_reference_on_gpu():
    p = problems.make_problem(shapes.resolve_shape("custom:1000,512,256,16,4,1"), device="cuda", seed=7)
    i = p.inputs
    ref = mok_cute.reference.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down, shared=p.shared)
    out = torch_moe.torch_grouped_mm_moe(i.x, i.topk_idx, i.topk_weights, *torch_moe.pack_grouped_mm_weights(p.w_gate, p.w_up, p.w_down), torch_moe.fuse_shared(p.shared))
    assert_tokens_close(out, ref, what="torch_grouped_mm on the GPU")


@pytest.mark.gpu
def test_torch_scaled_grouped_mm_pipeline_matches_the_reference_on_gpu():
    p = problems.make_problem(shapes.resolve_shape("custom:1000,512,256,16,4,1"), device="cuda", seed=7)
    i = p.inputs
    ref = mok_cute.reference.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down, shared=p.shared)
    weights = torch_moe.pack_scaled_grouped_mm_weights(p.w_gate, p.w_up, p.w_down)
    out = torch_moe.torch_scaled_grouped_mm_moe(i.x, i.topk_idx, i.topk_weights, *weights, torch_moe.fuse_shared(p.shared))
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert 5e-3 < err <= 0.08, err


@pytest.mark.gpu
def test_full_protocol_on_the_gpu(tmp_path):
    """Every contender on a reduced shape, one process: cuBLAS and the torch pipeline must time;
    the others are recorded whatever happens to them (mok_cute is timed only on the kernel path)."""
    # SonicMoE autotunes for minutes on a new shape: it has its own call (gpu_check.sh sonic)
    contenders = [c for c in harness.ALL_CONTENDERS if not c.startswith("sonicmoe")]
    argv = ["--shapes", "dsv3_ep8_rank", "--t-scale", "0.125", "--iters", "5", "--warmup", "2",
            "--out", str(tmp_path), "--tag", "gpu-test", "--contenders", ",".join(contenders)]
    assert harness.main(argv) == 0
    doc = json.loads(next(tmp_path.glob("*_gpu-test.json")).read_text())
    by = {r["contender"]: r for r in doc["results"]}
    fp8_ceilings = {"cublas_fp8_tensorwise_8192", "cublas_fp8_blockwise_8192"}
    assert set(by) == set(contenders) - {"cublas_fp8_8192"} | fp8_ceilings
    assert by["cublas_8192"]["status"] == "ok" and by["cublas_8192"]["tflops"] > 100
    assert by["cublas_fp8_tensorwise_8192"]["status"] == "ok"  # the blockwise one: if cuBLAS has it
    assert by["torch_grouped_mm"]["status"] == "ok" and by["torch_grouped_mm"]["rel_err"] <= 1e-2
    for r in doc["results"]:
        assert r["status"] in ("ok", "check_failed", "skipped", "error")
        assert (r["status"] == "ok") == (r["ms"] is not None)
    if by["mok_cute"]["status"] == "ok":
        assert by["mok_cute"]["path"].startswith("kernel")


# --------------------------------------------------------------------------------------------
# the training bench (mok_cute.bench.training)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["custom:70,64,32,24,4,1",
                                  "custom:40,256,256,12,10,1"])  # K > the checked experts
def test_reference_gradients_of_the_checked_experts_equal_full_autograd(spec):
    """The bench's reference keeps no weight-sized gradient: the checked experts' weight
    gradients from a run through their slots alone equal full autograd's bit for bit, and the
    other gradients are full autograd's (its saved fp32 upcasts kept as bf16: lossless)."""
    from mok_cute import reference
    from mok_cute.bench import training

    p = problems.make_problem(shapes.resolve_shape(spec), device="cpu", seed=3)
    d_out = torch.randn(p.inputs.x.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ref_out, got = training.reference_grads(p, d_out)
    i = p.inputs
    leaves = [t.detach().clone().requires_grad_() for t in
              (i.x, i.topk_weights, p.w_gate, p.w_up, p.w_down, *p.shared)]
    out = reference.moe_forward(leaves[0], i.topk_idx, leaves[1], *leaves[2:5], shared=tuple(leaves[5:]))
    out.backward(d_out)
    assert torch.equal(out, ref_out)
    assert set(got) == set(training.GRAD_NAMES)
    for name, t in zip(training.GRAD_NAMES, leaves):
        want = training.checked(name, t.grad)
        assert got[name].shape == want.shape and torch.equal(got[name], want), name


@pytest.mark.skipif(not GROUPED_MM_ON_CPU, reason="torch._grouped_mm does not run on the CPU here; see the gpu test")
def test_training_bench_checks_the_torch_pipelines_gradients_on_cpu():
    """The torch contender's gradients, mapped back from its packed gate+up parameter, against
    autograd on the reference; a wrong mapping (gate and up swapped) fails the check."""
    from mok_cute.bench import training

    p = problems.make_problem(shapes.resolve_shape("custom:80,128,64,8,4,1"), device="cpu", seed=5)
    d_out = torch.randn(p.inputs.x.shape).to(torch.bfloat16)
    ref_out, ref_grads = training.reference_grads(p, d_out)
    layer = training.Layer("torch_grouped_mm", p, MoKConfig())
    errors = training.check(layer, ref_out, ref_grads, d_out)
    assert set(errors) == {"out", "d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down", "d_ws_gate",
                           "d_ws_up", "d_ws_down"}
    assert max(errors.values()) <= 1e-2, errors
    swapped = dict(ref_grads, w_gate=ref_grads["w_up"], w_up=ref_grads["w_gate"])
    assert training.check(layer, ref_out, swapped, d_out)["d_w_gate"] > 0.1


@pytest.mark.skipif(not GROUPED_MM_ON_CPU, reason="torch._grouped_mm does not run on the CPU here; see the gpu test")
@pytest.mark.parametrize("spec", ["custom:80,128,64,8,4,1", "custom:33,64,32,4,4"])
def test_training_bench_torch_fp8_baseline_gradients_on_cpu(spec, monkeypatch):
    """The torch FP8 training baseline (its scaled GEMMs emulated): every gradient within the
    FP8 bound of autograd on the reference and clearly FP8 where FP8 runs (d_x through both
    FP8 dgrads), the weight gradients' routing right (gate and up swapped fails)."""
    from mok_cute.bench import training

    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_emulated, raising=False)
    p = problems.make_problem(shapes.resolve_shape(spec), device="cpu", seed=5)
    d_out = torch.randn(p.inputs.x.shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ref_out, ref_grads = training.reference_grads(p, d_out)
    layer = training.Layer("torch_scaled_grouped_mm", p, MoKConfig())
    errors = training.check(layer, ref_out, ref_grads, d_out)
    routed = {"out", "d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"}
    assert routed <= set(errors)
    assert max(errors.values()) <= training.CONTENDER_TOL["torch_scaled_grouped_mm"], errors
    assert errors["d_x"] > 5e-3, errors
    swapped = dict(ref_grads, w_gate=ref_grads["w_up"], w_up=ref_grads["w_gate"])
    assert training.check(layer, ref_out, swapped, d_out)["d_w_gate"] > 0.1


def test_training_bench_rejects_bad_arguments_naming_them(capsys):
    from mok_cute.bench import training

    assert training.main(["--train", "--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().out
    assert training.main(["--train", "--iters", "0"]) == 2  # before the GPU check
    assert "iters/warmup: expected iters >= 1" in capsys.readouterr().out
    assert training.main(["--train", "--contenders", "nope"]) == 2


@pytest.mark.gpu
def test_training_bench_on_the_gpu(tmp_path):
    """Both contenders on a reduced shape with a shared expert: checked, timed in every pass,
    the saved activations measured; the JSON names the command."""
    argv = ["--train", "--shapes", "custom:384,512,256,8,4,1", "--iters", "3", "--warmup", "1",
            "--rounds", "2", "--out", str(tmp_path), "--tag", "gpu-test", "--mok-config", "check_ids=False"]
    from mok_cute import cli

    assert cli.main(["bench", *argv]) == 0
    doc = json.loads(next(tmp_path.glob("*_gpu-test.json")).read_text())
    rows = {(r["contender"], r["pass"]): r for r in doc["results"] if r["contender"] != "cublas_8192"}
    ceiling = [r for r in doc["results"] if r["contender"] == "cublas_8192"]
    assert len(ceiling) == 1 and ceiling[0]["tflops"] > 100
    assert set(rows) == {(c, p) for c in ("mok_cute", "torch_grouped_mm") for p in ("fwd", "bwd", "train")}
    for r in rows.values():
        assert r["status"] == "ok" and r["ms"] > 0 and len(r["ms_rounds"]) == 2
        assert max(r["rel_l1"].values()) <= 1e-2 and r["saved_bytes_per_token"] > 0
        assert set(r["timed_size_rel_l1"]) == {"out", "d_x", "d_topk_weights"}
        assert max(r["timed_size_rel_l1"].values()) <= 3e-2  # the worst of 256 rows
        # a step holds its saved activations and more (workspaces, the gradients)
        assert r["step_peak_bytes"] > r["saved_bytes_per_token"] * 384
    assert rows[("mok_cute", "train")]["paired_vs_torch"] > 0
    assert "--train" in doc["command"]


@pytest.mark.gpu
def test_training_bench_main_grad_contender_on_the_gpu(tmp_path):
    """mok_cute_main_grad beside mok_cute: checked on its main_grad sums (within the bf16
    check), timed in every pass."""
    argv = ["--train", "--shapes", "custom:384,512,256,8,4,1", "--iters", "3", "--warmup", "1",
            "--rounds", "2", "--out", str(tmp_path), "--tag", "gpu-mg", "--mok-config",
            "check_ids=False", "--contenders", "mok_cute,mok_cute_main_grad"]
    from mok_cute import cli

    assert cli.main(["bench", *argv]) == 0
    doc = json.loads(next(tmp_path.glob("*_gpu-mg.json")).read_text())
    rows = {(r["contender"], r["pass"]): r for r in doc["results"] if r["contender"] != "cublas_8192"}
    for p in ("fwd", "bwd", "train"):
        r = rows[("mok_cute_main_grad", p)]
        assert r["status"] == "ok" and r["ms"] > 0 and max(r["rel_l1"].values()) <= 1e-2


@pytest.mark.gpu
def test_training_bench_fp8_contenders_on_the_gpu(tmp_path):
    """mok_cute_fp8 and the torch FP8 baseline (torch._scaled_grouped_mm) in training: both
    checked within the FP8 bound and timed in every pass, paired against each other."""
    argv = ["--train", "--shapes", "custom:384,512,256,8,4", "--iters", "3", "--warmup", "1",
            "--rounds", "2", "--out", str(tmp_path), "--tag", "gpu-fp8", "--mok-config", "check_ids=False",
            "--contenders", "mok_cute_fp8,torch_scaled_grouped_mm"]
    from mok_cute import cli

    assert cli.main(["bench", *argv]) == 0
    doc = json.loads(next(tmp_path.glob("*_gpu-fp8.json")).read_text())
    rows = {(r["contender"], r["pass"]): r for r in doc["results"] if r["contender"] != "cublas_8192"}
    assert set(rows) == {(c, p) for c in ("mok_cute_fp8", "torch_scaled_grouped_mm")
                         for p in ("fwd", "bwd", "train")}
    for r in rows.values():
        assert r["status"] == "ok" and r["ms"] > 0, r
        assert 1e-3 < max(r["rel_l1"].values()) <= 0.1, r["rel_l1"]
    assert rows[("mok_cute_fp8", "train")]["paired_vs_torch_fp8"] > 0


def test_sonicmoe_runner_passes_its_layout(monkeypatch):
    """The one SonicMoE call both benches use (no SonicMoE here: a stand-in records what it
    gets): gate/up rows interleaved, E-last weight views, flat routing with token indices,
    the inference flag, and the shared expert added with torch GEMMs."""
    p = problems.make_problem(shapes.resolve_shape("custom:6,32,16,4,2,1"), device="cpu", seed=6)
    calls = []

    def fake_moe(x, scores, token_idx, expert_idx, w1, b1, w2, b2, num_experts, stream, act, is_inference_mode_enabled):
        calls.append(dict(scores=scores, token_idx=token_idx, expert_idx=expert_idx, w1=w1, w2=w2, E=num_experts,
                          act=act, inference=is_inference_mode_enabled))
        return torch.zeros_like(x), None

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: type("S", (), {"cuda_stream": 7})())
    shared = torch_moe.fuse_shared(p.shared)
    w1 = harness.sonicmoe_gate_up(p.w_gate, p.w_up)
    run = harness.sonicmoe_runner(fake_moe, "swiglu", w1, p.w_down, shared, train=False)
    i = p.inputs
    out = run(i.x, i.topk_idx, i.topk_weights)
    c = calls[0]
    assert c["w1"].shape == (32, 32, 4) and torch.equal(c["w1"][0::2].permute(2, 0, 1), p.w_gate)
    assert torch.equal(c["w1"][1::2].permute(2, 0, 1), p.w_up)
    assert torch.equal(c["w2"].permute(2, 0, 1), p.w_down) and c["E"] == 4 and c["inference"]
    assert c["token_idx"].tolist() == [t for t in range(6) for _ in range(2)]
    assert torch.equal(c["expert_idx"], i.topk_idx.reshape(-1)) and torch.equal(c["scores"], i.topk_weights.reshape(-1))
    assert torch.equal(out, torch_moe.shared_expert(i.x, *shared).float().to(torch.bfloat16))


def test_torch_fp8_baseline_quantizes_each_weight_once_per_version():
    """The training bench's torch FP8 baseline keeps its e4m3 weights as mok_cute keeps its
    own: one quantization per weight version and orientation; ``clear()`` (a new step's
    weights) and an in-place update make the next call quantize again."""
    from mok_cute.bench import torch_moe

    calls = []
    quantize = torch_moe.quantize_rowwise

    def counted(t):
        calls.append(tuple(t.shape))
        return quantize(t)

    torch_moe.quantize_rowwise = counted
    try:
        cache = torch_moe.QuantizedWeights()
        w = torch.randn(2, 8, 4)
        first = cache.get(w, transposed=False)
        assert cache.get(w, transposed=False) is first and calls == [(2, 8, 4)]
        cache.get(w, transposed=True)
        assert calls == [(2, 8, 4), (2, 4, 8)]
        with torch.no_grad():
            w.add_(1.0)  # an optimizer step: a new version
        cache.get(w, transposed=False)
        cache.clear()
        cache.get(w, transposed=False)
        assert len(calls) == 4
    finally:
        torch_moe.quantize_rowwise = quantize


def test_result_files_say_which_code_ran():
    from mok_cute.bench.results import source_record

    record = source_record()
    assert len(record["package_sha256"]) == 16
    assert record == source_record()  # a hash of the sources, not of the time


def test_a_contender_wrong_only_at_the_timed_size_is_not_timed(tmp_path, monkeypatch):
    """Right at the check's T, wrong at the timed T (one token's row, as a ring that wraps
    might): the sample of the timed T's tokens catches it and the contender is not timed."""
    def wrong_when_large(problem, ctx):
        good, _ = harness._prepare_per_expert_loop(problem, ctx)

        def run(inp):
            out = good(inp)
            if inp.x.shape[0] > 32:
                out = out.clone()
                out[:] = 0.0
            return out
        return run, {}

    monkeypatch.setitem(harness.CONTENDERS, "large_wrong", wrong_when_large)
    shape = shapes.resolve_shape("custom:64,64,32,8,2")
    timer = harness.Timer(torch.device("cpu"), iters=1, warmup=0)
    (row,) = harness.bench_shape(shape, ["large_wrong"], _ctx(tmp_path), timer, check_tokens=32,
                                 log=lambda m: None, rounds=2)
    assert row["rel_err"] < 1e-2 and row["status"] == "check_failed"
    assert "of the timed T=64" in row["error"] and row["ms"] is None
