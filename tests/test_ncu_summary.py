"""tools/ncu_summary.py on a small ``ncu --csv`` log written here (no GPU, no ncu)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


@pytest.fixture(scope="module")
def ncu_summary():
    spec = importlib.util.spec_from_file_location("ncu_summary", ROOT / "tools" / "ncu_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(launch, kernel, metric, value):
    return (f'"{launch}","1","python3","h","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0",'
            f'"9.0","Command line profiler metrics","{metric}","unit","{value}"')


def _log(tmp_path, rows):
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(["==PROF== Connected to process 1", HEADER, *rows,
                               "==PROF== Disconnected from process 1"]) + "\n")
    return str(path)


def test_sums_counters_and_averages_rates_per_kernel_name(ncu_summary, tmp_path):
    gemm = "kernel_cutlass_kernel_GroupedGemmSm90_x"
    mega = "kernel_cutlass_kernel_MegakernelSm90_y"
    path = _log(tmp_path, [
        _row(0, gemm, "dram__bytes_read.sum", "1,000,000"),  # ncu's thousands separators
        _row(0, gemm, "lts__t_sector_hit_rate.pct", "80"),
        _row(0, gemm, "gpu__time_duration.sum", "5000"),
        _row(1, gemm, "dram__bytes_read.sum", "500"),
        _row(1, gemm, "lts__t_sector_hit_rate.pct", "60"),
        _row(1, gemm, "gpu__time_duration.sum", "3000"),
        _row(2, "void at::vectorized_elementwise_kernel<4>", "dram__bytes_read.sum", "100"),
        _row(3, mega, "dram__bytes_read.sum", "2000000"),
        _row(3, mega, "lts__t_sector_hit_rate.pct", "n/a"),  # not a number: left out
    ])
    kernels = ncu_summary.summarize(ncu_summary.read_rows(path))
    assert kernels[gemm] == {"launches": 2, "dram__bytes_read.sum": 1_000_500,
                             "lts__t_sector_hit_rate.pct": 70, "gpu__time_duration.sum": 8000}
    assert kernels[mega] == {"launches": 1, "dram__bytes_read.sum": 2_000_000}
    paths = ncu_summary.by_path(ncu_summary.read_rows(path))
    # no marker launch: every kernel but the megakernel is the expert path's; rates are not
    # summed across kernels
    assert paths["expert_kernels"] == {"launches": 3, "dram__bytes_read.sum": 1_000_600,
                                       "gpu__time_duration.sum": 8000}
    assert paths["megakernel"] == {"launches": 1, "dram__bytes_read.sum": 2_000_000}


def test_marker_launches_give_each_path_its_own_prep_launches(ncu_summary, tmp_path):
    """ncu_layer.py launches a marker (torch.cuda._sleep) before each path's call: a launch
    counts for the path of the last marker before it, so the megakernel path's prep kernels,
    named as the expert path's, are not summed into the expert path (the markers left out)."""
    spin, prep = "cuda::<unnamed>::spin_kernel(long)", "void at::index_kernel<1>"  # as ncu names it
    gemm, mega = "kernel_cutlass_kernel_GroupedGemmSm90_x", "kernel_cutlass_kernel_MegakernelSm90_y"
    order = [spin, prep, gemm, gemm, spin, prep, mega, spin, prep, gemm, spin, mega]
    path = _log(tmp_path, [_row(i, k, "dram__bytes_read.sum", str(10 ** i))
                           for i, k in enumerate(order)])
    paths = ncu_summary.by_path(ncu_summary.read_rows(path))
    # launches 1-3 and 8-9 (two shapes' expert paths), 5-6 and 11 (their megakernel paths)
    assert paths["expert_kernels"] == {"launches": 5, "dram__bytes_read.sum": sum(
        10 ** i for i in (1, 2, 3, 8, 9))}
    assert paths["megakernel"] == {"launches": 3, "dram__bytes_read.sum": sum(
        10 ** i for i in (5, 6, 11))}
    assert ncu_summary.short_names([spin, prep])[spin] == "marker"


def test_short_names_tell_cute_kernels_of_one_class_apart(ncu_summary):
    fc1 = "kernel_cutlass_kernel_mok_cutekernelsgemm_fp8GroupedGemmFp8Sm90_object_at__CopyAtom_a"
    fc2 = "kernel_cutlass_kernel_mok_cutekernelsgemm_fp8GroupedGemmFp8Sm90_object_at__CopyAtom_b"
    mega = "kernel_cutlass_kernel_mok_cutekernelsmegakernelkernelMegakernelSm90_object_at__t"
    torch_kernel = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"
    assert ncu_summary.short_names([fc1, mega, fc2, torch_kernel]) == {
        fc1: "GroupedGemmFp8Sm90#1", mega: "MegakernelSm90", fc2: "GroupedGemmFp8Sm90#2",
        torch_kernel: "at::native::vectorized_elementwise_kernel"}


def test_main_prints_and_writes_json(ncu_summary, tmp_path, capsys, monkeypatch):
    path = _log(tmp_path, [_row(0, "kernel_MegakernelSm90", "smsp__inst_executed.sum", "42")])
    out = tmp_path / "summary.json"
    monkeypatch.setattr("sys.argv", ["ncu_summary.py", path, "--json", str(out)])
    ncu_summary.main()
    printed = capsys.readouterr().out
    assert "  kernel_MegakernelSm90: launches=1, smsp__inst_executed.sum=42" in printed
    assert "[megakernel] launches=1, smsp__inst_executed.sum=42" in printed
    monkeypatch.setattr("sys.argv", ["ncu_summary.py", path, "--per-launch"])
    ncu_summary.main()
    assert "  #0 kernel_MegakernelSm90: smsp__inst_executed.sum=42" in capsys.readouterr().out
    assert json.loads(out.read_text())[path]["paths"]["megakernel"]["smsp__inst_executed.sum"] == 42


# ------------------------------------------------- tools/ncu_source_summary.py (SourceCounters)
SOURCE_HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
                 '"stall_long_sb","stall_barrier"')


@pytest.fixture(scope="module")
def ncu_source_summary():
    path = ROOT / "tools" / "ncu_source_summary.py"
    spec = importlib.util.spec_from_file_location("ncu_source_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sass(rows):
    return [f'"{a:#x}","{src}","{stall}","{n}","{stall}","0"' for a, src, n, stall in rows]


def test_source_summary_counts_waits_that_fall_to_the_retry_loop(ncu_source_summary, tmp_path):
    """A main-path TRYWAIT whose predicated branch (after a BSSY) enters a stub that ptxas
    placed later: the stub's first instruction counts the entries, its TRYWAIT the retries.
    A second block of the same kernel name (FC2's launch of the GEMM) stays separate."""
    main = _sass([(0x100, "MOV R3, UR21", 100, 0),
                  (0x110, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR22], R3", 100, 5),
                  (0x120, "BSSY B4, 0x200", 100, 0),
                  (0x130, "@!P0  BRA 0x300", 100, 40),
                  (0x140, "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR16], R24", 100, 30),
                  (0x300, "MOV R3, R2", 60, 0),  # the stub: 60 of 100 waits came here
                  (0x310, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R3", 540, 0),
                  (0x320, "@!P0  NANOSLEEP.SYNCS 0x989680", 540, 0),
                  (0x330, "@!P0  SYNCS.PHASECHK.TRANS64 P0, [R3+URZ], R3", 540, 0),
                  (0x340, "@!P0  BRA 0x310", 540, 0),
                  (0x350, "BRA 0x140", 60, 0)])
    other = _sass([(0x100, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR22], R3", 7, 1),
                   (0x110, "@!P0  BRA 0x900", 7, 1)])
    log = tmp_path / "source.csv"
    log.write_text("\n".join(['"Kernel Name","kernel_Megakernel",', SOURCE_HEADER, *main,
                              '"Kernel Name","kernel_GroupedGemm",', SOURCE_HEADER, *other,
                              '"Kernel Name","kernel_GroupedGemm",', SOURCE_HEADER, *other]) + "\n")
    kernels = ncu_source_summary.read_kernels(str(log))
    assert [name for name, _ in kernels] == ["kernel_Megakernel", "kernel_GroupedGemm",
                                             "kernel_GroupedGemm"]
    s = ncu_source_summary.summarize(kernels[0][1])
    assert s["instructions"] == 100 * 5 + 60 * 2 + 540 * 4
    assert s["stall_samples"] == 75
    assert s["opcodes"]["SYNCS"] == 100 + 540 * 2 and s["opcodes"]["NANOSLEEP"] == 540
    (wait,) = s["waits"]  # the stub's own TRYWAIT is not a wait of its own
    assert wait == {"pc": 0x10, "waits": 100, "retry_entries": 60, "retry_iterations": 540,
                    "stall_samples": 5 + 40}  # the TRYWAIT's and its branch's
    assert s["top_stalls"][0]["pc"] == 0x30 and s["top_stalls"][0]["samples"] == 40
    assert s["top_stalls"][0]["reasons"][0] == ("stall_long_sb", 40)
    # a branch to an address outside the listing: no retry loop found, nothing counted
    (w,) = ncu_source_summary.summarize(kernels[1][1])["waits"]
    assert w["retry_entries"] == 0 and w["retry_iterations"] == 0
