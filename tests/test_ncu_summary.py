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
    paths = ncu_summary.by_path(kernels)
    # every kernel but the megakernel is the expert path's; rates are not summed across kernels
    assert paths["expert_kernels"] == {"launches": 3, "dram__bytes_read.sum": 1_000_600,
                                       "gpu__time_duration.sum": 8000}
    assert paths["megakernel"] == {"launches": 1, "dram__bytes_read.sum": 2_000_000}


def test_main_prints_and_writes_json(ncu_summary, tmp_path, capsys, monkeypatch):
    path = _log(tmp_path, [_row(0, "kernel_MegakernelSm90", "smsp__inst_executed.sum", "42")])
    out = tmp_path / "summary.json"
    monkeypatch.setattr("sys.argv", ["ncu_summary.py", path, "--json", str(out)])
    ncu_summary.main()
    assert "[megakernel] launches=1, smsp__inst_executed.sum=42" in capsys.readouterr().out
    assert json.loads(out.read_text())[path]["paths"]["megakernel"]["smsp__inst_executed.sum"] == 42
