"""The `mok-cute` command line, run in-process (main(argv)) and once as a subprocess. No GPU needed."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mok_cute import cli, jit

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_info(capsys):
    rc, out = run(capsys, "info")
    assert rc == 0
    assert torch.__version__ in out
    assert "nvidia-cutlass-dsl" in out and "forward path" in out
    if not torch.cuda.is_available():
        assert "no GPU" in out
    if jit.find_nvdisasm()[0] is None:
        assert "mok-cute[sass]" in out  # brackets survive rich markup


def test_ptx_list(capsys):
    rc, out = run(capsys, "ptx", "--list")
    assert rc == 0
    for name in jit.KERNELS:
        assert name in out


def test_ptx_writes_files_summary_and_diff(capsys, tmp_path):
    rc, out = run(capsys, "ptx", "gather_rows", "--out", str(tmp_path), "--diff", "unroll=2", "--json")
    assert rc == 0, out
    assert "registers / thread" in out and "ld.global.128b" in out
    assert "diff of gather_rows" in out and "static:unroll" in out
    assert (tmp_path / "gather_rows.sm_90a.ptx").is_file()
    assert (tmp_path / "gather_rows.sm_90a.cubin").is_file()
    assert (tmp_path / "gather_rows.sm_90a.unroll2.ptx").is_file()
    report = json.loads(out[out.index('{\n "name"'):])
    assert report["name"] == "gather_rows" and report["spill_bytes"] == 0


def test_ptx_diff_across_arch(capsys, tmp_path):
    rc, out = run(capsys, "ptx", "weighted_ksum", "--out", str(tmp_path), "--set", "K=2",
                  "--diff", "arch=sm_100a")
    assert rc == 0, out
    assert (tmp_path / "weighted_ksum.sm_100a.K2.ptx").is_file()
    assert "B = sm_100a" in out


def test_ptx_bad_arguments(capsys):
    rc, out = run(capsys, "ptx", "no_such_kernel")
    assert rc == 2 and "unknown kernel" in out
    rc, out = run(capsys, "ptx", "weighted_ksum", "--set", "K=0")
    assert rc == 2 and "K must be an int in [1, 16]" in out
    rc, out = run(capsys, "ptx", "weighted_ksum", "--diff", "K")
    assert rc == 2 and "--diff expects KEY=VALUE" in out
    rc, out = run(capsys, "ptx", "gather_rows", "--arch", "hopper")
    assert rc == 2 and "arch must look like" in out


def test_ptx_reports_a_kernel_that_does_not_compile_for_an_arch(capsys, tmp_path):
    if "gemm_fc1" not in jit.KERNELS or jit.kernel_status("gemm_fc1") is not None:
        pytest.skip("gemm_fc1 is not available")
    rc, out = run(capsys, "ptx", "gemm_fc1", "--arch", "sm_100a", "--out", str(tmp_path))
    assert rc == 1  # a Hopper wgmma kernel has no sm_100a build: reported, not a traceback
    assert "gemm_fc1 does not compile for sm_100a" in out


def test_demo_on_cpu_checks_reference_and_prints_ptx_mix(capsys, tmp_path):
    rc, out = run(capsys, "demo", "--cpu", "-T", "96", "--hidden", "256", "--intermediate", "128",
                  "--experts", "4", "--topk", "2", "--out", str(tmp_path))
    assert rc == 0, out
    assert "rel err vs mok_cute.reference" in out and "FAIL" not in out
    assert "PTX instruction mix" in out and "ld.global.128b" in out
    assert "demo passed" in out
    assert (tmp_path / "weighted_ksum.sm_90a.ptx").is_file()


def test_demo_rejects_topk_above_experts(capsys):
    rc, out = run(capsys, "demo", "--cpu", "--experts", "2", "--topk", "3")
    assert rc == 2 and "--topk must be <= --experts" in out


@pytest.mark.parametrize("flag,value,least", [("--tokens", "-1", 0), ("--hidden", "0", 1),
                                              ("--intermediate", "-3", 1), ("--experts", "0", 1),
                                              ("--topk", "-2", 1)])
def test_demo_rejects_sizes_below_one_naming_the_flag(capsys, flag, value, least):
    rc, out = run(capsys, "demo", "--cpu", flag, value)
    assert rc == 2 and f"mok-cute demo: error: {flag} must be >= {least}, got {value}" in out


def test_demo_rejects_a_bad_arch_before_compiling(capsys):
    rc, out = run(capsys, "demo", "--cpu", "-T", "4", "--hidden", "64", "--intermediate", "64",
                  "--arch", "hopper")
    assert rc == 2 and "arch must look like" in out and "path:" not in out


def test_delegates_forward_argv_and_report_missing_modules(capsys, monkeypatch):
    seen = {}

    def fake_main(argv):
        seen["argv"] = argv
        return 3

    fake = types.ModuleType("mok_fake_tool")
    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "mok_fake_tool", fake)
    monkeypatch.setitem(cli._DELEGATES, "bench", ("mok_fake_tool", "fake"))
    rc, _ = run(capsys, "bench", "--shape", "mixtral", "-n", "3")
    assert rc == 3 and seen["argv"] == ["--shape", "mixtral", "-n", "3"]
    monkeypatch.setitem(cli._DELEGATES, "tune", ("mok_cute.not_written_yet.tune", "missing"))
    rc, out = run(capsys, "tune", "--profile", "gb300")
    assert rc == 2 and "mok_cute.not_written_yet.tune is not in this install" in out


def test_delegates_reach_the_bench_the_recorder_and_the_tuner(capsys, tmp_path):
    for command, expect in (("bench", "--mok-config"), ("timeline", "--synthetic"), ("tune", "--ranks")):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0 and expect in capsys.readouterr().out
    rc, out = run(capsys, "timeline", "--synthetic", "--out", str(tmp_path))
    assert rc == 0 and (tmp_path / "timeline.png").is_file()
    rc, out = run(capsys, "bench", "--list")
    assert rc == 0 and "mok_megakernel" in out and "kimi_k2.7" in out
    # `bench --ep --train` is the expert-parallel bench's training mode (it went to the one-GPU
    # training bench, whose parser refused --ep), `bench --train` the one-GPU training bench
    for argv, prog in ((["bench", "--ep", "--train", "--help"], "--ep"),
                       (["bench", "--train", "--help"], "mok-cute bench --train")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 0 and prog in capsys.readouterr().out, argv


def test_no_command_prints_help(capsys):
    rc, out = run(capsys)
    assert rc == 2 and "demo" in out and "ptx" in out


def test_module_entry_point_runs_in_a_fresh_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not torch.cuda.is_available():
        env.pop("CUTE_DSL_ARCH", None)  # the CLI must set it before cutlass is imported
    proc = subprocess.run([sys.executable, "-m", "mok_cute.cli", "info"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if not torch.cuda.is_available():
        assert "sm_90a" in proc.stdout


def test_tools_ptx_wrapper_lists_kernels():
    env = {**os.environ}
    if not torch.cuda.is_available():
        env.pop("CUTE_DSL_ARCH", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "ptx.py"), "--list"], capture_output=True,
                          text=True, env=env, cwd="/", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "gather_rows" in proc.stdout and "weighted_ksum" in proc.stdout
