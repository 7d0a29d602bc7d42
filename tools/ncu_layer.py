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
``--backward``: one bf16 ``expert_backward.moe_backward`` of each shape instead (routed experts,
no shared expert), its dgrads and weight gradients as four grouped-GEMM launches (path
"expert_kernels") and as one backward-megakernel launch (path "megakernel"), checked bitwise;
no ``--mok-config`` with it.
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
    ap.add_argument("--backward", action="store_true",
                    help="one bf16 backward of each path instead of a forward call")
    a = ap.parse_args()
    if a.backward and a.mok_config:  # backward_call runs bf16 on its own options: say so
        raise SystemExit("--mok-config: --backward profiles the bf16 backward with the default "
                         "options and takes no config field")
    try:
        overrides = parse_config_overrides(a.mok_config)
        paths = {"expert_kernels": apply_config_overrides(MoKConfig(check_ids=False), overrides),
                 "megakernel": apply_config_overrides(MoKConfig(check_ids=False, backend="megakernel"),
                                                      overrides)}
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    for name in shape_names(a.shapes):
        call = backward_call(name) if a.backward else layer_call(name)[1]
        outs = {}
        for path, config in paths.items():
            for _ in range(a.warmup):
                outs[path] = call(config)
            torch.cuda.synchronize()
            megakernel.raise_pending_errors()
        assert all(torch.equal(m, k) for m, k in zip(_tensors(outs["megakernel"]),
                                                     _tensors(outs["expert_kernels"]))), \
            f"{name}: paths differ"
        for path, config in paths.items():
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda.nvtx.range_push(f"{name}/{path}")
            # a marker launch (spin_kernel) before each path's call: ncu_summary.by_path counts
            # the launches after it as this path's, its prep launches included
            torch.cuda._sleep(1)
            call(config)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.profiler.stop()
        print(f"{name}: profiled one call of each path", flush=True)


def _tensors(out):
    return [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]


def backward_call(name: str, seed: int = 1):
    """A shape's saved bf16 training forward (routed experts) and ``backward(config)``: its
    ``moe_backward`` with the dgrads by ``config.backend`` ("megakernel": the one launch)."""
    import mok_cute
    from mok_cute import expert_backward, expert_path
    from mok_cute.bench.problems import make_problem
    from mok_cute.shapes import resolve_shape

    p = make_problem(resolve_shape(name), device="cuda", seed=seed)
    i = p.inputs
    cfg = mok_cute.MoKConfig(backend="kernel", check_ids=False)
    with torch.no_grad():
        _, saved = expert_path.moe_forward_kernel(i.x, i.topk_idx, i.topk_weights, p.w_gate,
                                                  p.w_up, p.w_down, None, cfg, save=True)
    d_out = torch.randn_like(i.x)

    def backward(config):
        dgrads = "megakernel" if config.backend == "megakernel" else "kernels"
        return expert_backward.moe_backward(d_out, i.x, i.topk_idx, i.topk_weights, p.w_gate,
                                            p.w_up, p.w_down, None, saved, dgrads=dgrads)
    return backward


if __name__ == "__main__":
    main()
