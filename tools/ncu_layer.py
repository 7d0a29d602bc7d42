"""Hardware counters of one layer call on each path, for Nsight Compute.

    ncu --profile-from-start off --clock-control none --metrics M1,M2,... --csv \\
        python tools/ncu_layer.py --shapes mixtral,qwen3_30b

Each shape's expert path and megakernel are compiled and warmed up outside the profiled range
(and checked bitwise against each other), then one call of each runs between
``cudaProfilerStart`` and ``cudaProfilerStop``, inside NVTX ranges named ``<shape>/<path>``,
so ``ncu --profile-from-start off`` collects exactly those launches (the expert path's six,
the megakernel path's prep launches and its megakernel), each path's after a marker launch
(``torch.cuda._sleep``: ``ncu_summary.by_path`` tells the paths apart by it; the paths in
``ncu_summary.PATHS``'s order). Why: both paths run these layers at the H200's 700 W cap (fifteenth
session), where what a path costs is energy, i.e. the bytes it moves (DRAM, L2) and the
instructions it issues; ncu counts those, and the recorder and the clock probe cannot.
Run it under ``ncu --profile-from-start off`` on the GPU host (``gpu_check.sh ncu`` does, with
the counters summed per shape and path by ``tools/ncu_summary.py`` and the per-SASS counters read
by ``tools/ncu_source_summary.py``).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute import megakernel  # noqa: E402
from mok_cute.bench.common import apply_config_overrides, parse_config_overrides  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
from mok_cute.shapes import shape_names  # noqa: E402
from layer_profile import layer_call  # noqa: E402  (tools/ is on sys.path when run as a script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="mixtral,qwen3_30b")
    ap.add_argument("--warmup", type=int, default=3, help="unprofiled calls of each path first")
    ap.add_argument("--mok-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a MoKConfig field of both paths, dotted for an options field, e.g. "
                    "megakernel.rows_in_place=False; repeatable")
    a = ap.parse_args()
    try:
        overrides = parse_config_overrides(a.mok_config)
        paths = {"expert_kernels": apply_config_overrides(MoKConfig(check_ids=False), overrides),
                 "megakernel": apply_config_overrides(MoKConfig(check_ids=False, backend="megakernel"),
                                                      overrides)}
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    for name in shape_names(a.shapes):
        _, forward = layer_call(name)
        outs = {}
        for path, config in paths.items():
            for _ in range(a.warmup):
                outs[path] = forward(config)
            torch.cuda.synchronize()
            megakernel.raise_pending_errors()
        assert torch.equal(outs["megakernel"], outs["expert_kernels"]), f"{name}: paths differ"
        for path, config in paths.items():
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda.nvtx.range_push(f"{name}/{path}")
            # a marker launch (spin_kernel) before each path's call: ncu_summary.by_path counts
            # the launches after it as this path's, its prep launches included
            torch.cuda._sleep(1)
            forward(config)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.profiler.stop()
        print(f"{name}: profiled one call of each path", flush=True)


if __name__ == "__main__":
    main()
