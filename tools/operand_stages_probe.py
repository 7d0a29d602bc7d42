"""The one-GPU path's GEMM launches (forward FC1 and FC2, FC2 and FC1 dgrads, weight
gradients) on fewer operand stages than fit (the megakernels' rings have 3 where these launches
have 4), and the FC1 dgrad's raster group, in interleaved rounds with a bitwise check of every
variant against the first.

    python tools/operand_stages_probe.py --shapes dsv3_ep8_rank,gptoss_120b \
        [--variants fit:8,3:8,3:2] [--rounds 6] [--reps 10] [--fp8] [--json out.json]

    python tools/operand_stages_probe.py --shapes gptoss_120b --variants fit:8,3:8 \
        --kernels "fc2 dgrad,fc1 dgrad"

A variant is STAGES:GROUP_M. STAGES "fit" is as many stages as smem holds, even where the
one-GPU backward picks 3 for FC1's dgrad (4 for the bf16 FC1 dgrad, weight gradients and
forward FC1, 5-6 for the pingpong ones and the FP8 dgrads, 3 for the cooperative FC2 dgrad);
GROUP_M is the FC1 dgrad's M-tiles per raster group (``ExpertPathOptions.fc2_group_m``). The
stage cap is patched into ``GemmCoreSm90.operand_stages`` for this process: a probe for issue
32 (docs/measurements.md), not the benchmark of record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from tools.layer_profile import gpu_ms  # noqa: E402

KERNELS = ("fwd fc1", "fwd fc2", "fc2 dgrad", "fc1 dgrad", "wgrad gate+up", "wgrad down")
_STAGE_CAP = [None]  # the cap of the kernels compiled next (None: as many as fit)


def _patch_stage_cap() -> None:
    """Cap every GEMM class's operand stages (``GemmCoreSm90.operand_stages``) at
    ``_STAGE_CAP[0]`` as well, for the kernels this process compiles next."""
    from mok_cute.kernels.gemm_core import GemmCoreSm90

    own = GemmCoreSm90.operand_stages

    def capped(self, fit: int) -> int:
        stages, cap = own(self, fit), _STAGE_CAP[0]
        return stages if cap is None else min(stages, cap)

    GemmCoreSm90.operand_stages = capped


FP8_KERNELS = ("fp8 fwd fc1", "fp8 fwd fc2", "fp8 fc2 dgrad", "fp8 fc1 dgrad")


def fp8_kernels(p, x, s, d_rows, weights) -> dict:
    """The FP8 path's four GEMM launches on this problem (their operands quantized once, outside
    the timed calls), each a zero-argument call returning its output; compiled on first call."""
    from mok_cute import expert_path_fp8 as ep8
    from mok_cute.kernels import gemm_fp8, quantize

    fw = ep8.quantized_weights(p.w_gate, p.w_up, p.w_down, training=True)
    wt = ep8.transposed_weights(p.w_gate, p.w_up, p.w_down)
    rows, h_pad = d_rows.shape[0], fw.gate.shape[2]
    xq = quantize.quantize_scatter_rows(ep8.pad_cols(x, h_pad), s.row_of_slot, rows)
    preact = torch.empty_like(s.preact)

    def fwd_fc1():
        return gemm_fp8.grouped_gemm_fp8_swiglu(
            *xq, fw.gate, fw.e_gate, fw.up, fw.e_up, s.tile_expert, s.num_tiles,
            tile_n=ep8.FP8_TILE_N, preact_out=preact, preact_slot=s.row_slot)

    hq = quantize.quantize_rows(fwd_fc1())
    y = torch.empty(rows, x.shape[1], dtype=torch.bfloat16, device=x.device)
    dq = quantize.quantize_rows(ep8.pad_cols(d_rows, h_pad))

    def fc2_dgrad():
        return gemm_fp8.grouped_gemm_fp8_dgated(*dq, wt.down, wt.e_down, s.preact, s.row_slot,
                                                weights, s.tile_expert, s.num_tiles)[0]

    d_preact_q = quantize.quantize_rows(fc2_dgrad())
    return {
        "fp8 fwd fc1": fwd_fc1,
        "fp8 fwd fc2": lambda: gemm_fp8.grouped_gemm_fp8(
            *hq, fw.down, fw.e_down, s.tile_expert, s.num_tiles, out=y, tile_n=ep8.FP8_TILE_N),
        "fp8 fc2 dgrad": fc2_dgrad,
        "fp8 fc1 dgrad": lambda: gemm_fp8.grouped_gemm_fp8_split_k(
            *d_preact_q, wt.gate, wt.e_gate, wt.up, wt.e_up, s.tile_expert, s.num_tiles)}


def probe(name: str, variants: list[tuple[int | None, int]], rounds: int, reps: int,
          fp8: bool = False, only: tuple[str, ...] | None = None) -> dict:
    import mok_cute
    from mok_cute import expert_backward as eb
    from mok_cute import expert_path, jit
    from mok_cute.bench.common import paired_ratio
    from mok_cute.bench.problems import make_problem
    from mok_cute.kernels import token_ops
    from mok_cute.shapes import resolve_shape

    kernels = tuple(k for k in KERNELS + (FP8_KERNELS if fp8 else ()) if only is None or k in only)
    p = make_problem(resolve_shape(name), device="cuda", seed=1)
    x, idx, w = p.inputs.x, p.inputs.topk_idx, p.inputs.topk_weights
    E, I, H = p.w_gate.shape[0], p.w_gate.shape[1], x.shape[1]
    if fp8:
        from mok_cute.expert_path_fp8 import unsupported_reason
        fp8 = not unsupported_reason(H, I)  # else this shape runs without the FP8 launches
    cfg = mok_cute.MoKConfig(backend="kernel", check_ids=False)
    with torch.no_grad():
        _, s = expert_path.moe_forward_kernel(x, idx, w, p.w_gate, p.w_up, p.w_down, None, cfg,
                                              save=True)
    torch.manual_seed(0)
    row_token = s.row_token(idx.shape[1])
    d_rows = token_ops.gather_rows(torch.randn_like(x), row_token)
    x_rows = token_ops.gather_rows(x, row_token)
    topk_w = w.float().contiguous().view(-1)
    d_preact, hw, _ = eb.fc2_dgrad(d_rows, p.w_down, s.preact, s.row_slot, topk_w,
                                   s.tile_expert, s.num_tiles, cfg.expert_path)
    h_rows = torch.empty(x_rows.shape[0], I, dtype=torch.bfloat16, device="cuda")
    preact = torch.empty_like(s.preact)
    dw_gate = torch.empty(E, I, H, dtype=torch.bfloat16, device="cuda")
    dw_up, dw_down = torch.empty_like(dw_gate), torch.empty(E, H, I, dtype=torch.bfloat16,
                                                            device="cuda")
    product_cache = jit._CACHE
    # the FP8 launches' operands once, by kernels compiled without a cap
    _STAGE_CAP[0], jit._CACHE = None, {}
    fp8_calls = fp8_kernels(p, x, s, d_rows, topk_w) if fp8 else {}
    runs = {}
    for stages, group_m in variants:
        _STAGE_CAP[0] = stages
        cache = jit._CACHE = {}  # this variant's kernels, compiled under its cap
        options = dataclasses.replace(cfg.expert_path, fc2_group_m=group_m)
        gate_up = down = None  # compiled only where their kernels are probed
        if "wgrad gate+up" in kernels:
            gate_up = eb._compiled("gemm_wgrad", x.device, gated=True, group_m=8)
        if "wgrad down" in kernels:
            down = eb._compiled("gemm_wgrad", x.device, gated=False, group_m=8)
        pingpong = options.fc2_pingpong(I)
        launches = {
            **fp8_calls,
            "fwd fc1": lambda options=options: expert_path.grouped_gemm(
                x_rows, p.w_gate, s.tile_expert, s.num_tiles, "swiglu", w_up=p.w_up,
                group_m=options.fc1_group_m, out=h_rows, preact_out=preact,
                preact_slot=s.row_slot),
            "fwd fc2": lambda options=options, pingpong=pingpong: expert_path.grouped_gemm(
                h_rows, p.w_down, s.tile_expert, s.num_tiles, "store",
                group_m=options.fc2_group_m, pingpong=pingpong,
                tile_n=128 if pingpong else None),
            "fc2 dgrad": lambda options=options: eb.fc2_dgrad(
                d_rows, p.w_down, s.preact, s.row_slot, topk_w, s.tile_expert, s.num_tiles,
                options)[0],
            "fc1 dgrad": lambda options=options: eb.fc1_dgrad(
                d_preact, p.w_gate, p.w_up, s.tile_expert, s.num_tiles, options),
            "wgrad gate+up": lambda k=gate_up: k(
                d_preact[:, :I].t().unsqueeze(2), d_preact[:, I:].t().unsqueeze(2),
                x_rows.t().unsqueeze(2), dw_gate.permute(1, 2, 0), dw_up.permute(1, 2, 0),
                s.expert_offsets),
            "wgrad down": lambda k=down: k(d_rows.t().unsqueeze(2), None, hw.t().unsqueeze(2),
                                           dw_down.permute(1, 2, 0), None, s.expert_offsets)}
        launches = {k: f for k, f in launches.items() if k in kernels}
        # each launch runs with this variant's kernels, compiled now under its cap
        runs[(stages, group_m)] = {
            k: (lambda f=f, cache=cache: (setattr(jit, "_CACHE", cache), f())[1])
            for k, f in launches.items()}
        for f in runs[(stages, group_m)].values():
            f()
    _STAGE_CAP[0], jit._CACHE = None, product_cache  # what runs next is the product's
    live = s.row_slot >= 0  # the routed rows (padding rows' outputs are not compared)

    def outputs(fns):  # the probed kernels' outputs
        if "fc1 dgrad" in fns:
            yield fns["fc1 dgrad"]()[live]
        if "wgrad gate+up" in fns:
            fns["wgrad gate+up"]()
            yield from (dw_gate, dw_up)
        if "wgrad down" in fns:
            fns["wgrad down"]()
            yield dw_down
        for k in ("fwd fc1", "fwd fc2", "fc2 dgrad", *FP8_KERNELS):
            if k in fns:
                yield fns[k]()[live]

    first = variants[0]
    label = {v: f"stages {v[0] or 'fit'}, fc1 group_m {v[1]}" for v in variants}
    want = [t.clone() for t in outputs(runs[first])]  # only the first's kept (memory)
    bitwise = {label[v]: all(torch.equal(a, b) for a, b in zip(outputs(runs[v]), want))
               for v in variants}
    del want
    print(f"{name} bitwise the first variant's: {bitwise}", flush=True)
    ms = {(v, k): [] for v in variants for k in kernels}
    for r in range(rounds):  # every other round in reverse (the clock under the power cap)
        for v in (variants if r % 2 == 0 else variants[::-1]):
            for k in kernels:
                ms[(v, k)].append(gpu_ms(runs[v][k], reps))
    jit._CACHE = product_cache
    rows = []
    for v in variants:
        for k in kernels:
            ratio = paired_ratio(ms[(v, k)], ms[(first, k)])
            rows.append(dict(variant=label[v], kernel=k, ms_rounds=ms[(v, k)],
                             time_over_first=ratio))
            print(f"{name} {k:14s} {label[v]:28s} median {statistics.median(ms[(v, k)]):7.3f} ms,"
                  f" paired time / first {ratio:.3f}", flush=True)
    return dict(shape=name, bitwise=bitwise, rows=rows)


def _variant(text: str) -> tuple[int | None, int]:
    stages, group_m = text.split(":")
    if stages != "fit" and not stages.isdigit():
        raise ValueError(f"--variants: STAGES is fit or N, got {stages!r}")
    return (None if stages == "fit" else int(stages)), int(group_m)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="dsv3_ep8_rank,qwen3_30b,gptoss_120b")
    p.add_argument("--variants", default="fit:8,3:8",
                   help="comma-separated STAGES:GROUP_M, the first the baseline")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--fp8", action="store_true",
                   help="also the FP8 path's forward FC1 / FC2 and dgrad launches")
    p.add_argument("--kernels", default=None,
                   help=f"comma-separated subset of {', '.join(KERNELS + FP8_KERNELS)} (default: "
                        "all; fewer compile faster)")
    args = p.parse_args(argv)
    variants = [_variant(v) for v in args.variants.split(",")]
    only = None if args.kernels is None else tuple(k.strip() for k in args.kernels.split(","))
    if only is not None and not set(only) <= set(KERNELS + FP8_KERNELS):
        p.error(f"--kernels: unknown {sorted(set(only) - set(KERNELS + FP8_KERNELS))}")
    _patch_stage_cap()
    from mok_cute.shapes import resolve_shapes

    out = []
    for shape in resolve_shapes(args.shapes):
        out.append(probe(shape.name, variants, args.rounds, args.reps, args.fp8, only))
        if args.json:  # after each shape: a run cut off at its limit keeps the shapes it did
            with open(args.json, "w") as f:
                json.dump(dict(command="python tools/operand_stages_probe.py "
                               + " ".join(sys.argv[1:] if argv is None else argv),
                               gpu=torch.cuda.get_device_name(), shapes=out), f,
                          separators=(",", ":"))


if __name__ == "__main__":
    main()
