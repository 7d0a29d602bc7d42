"""One-off timing probe (CUDA events, interleaved rounds): the expert weight gradients in bf16
(``expert_backward.wgrad``) against FP8 (``gemm_wgrad_fp8`` on ``quantize_cols`` copies), each
column-quantization pass timed on its own, with its bytes against the HBM ceiling. Shapes:
uniform routing of a bench shape (E experts of T * K / E rows each); H and I multiples of 128.

    python tools/fp8_wgrad_probe.py [--shapes dsv3_ep8_rank,qwen3_30b] [--json out.json]
"""
import argparse
import json

import torch
import triton.testing as tt

from mok_cute.expert_backward import wgrad
from mok_cute.kernels.gemm_wgrad_fp8 import grouped_wgrad_fp8
from mok_cute.kernels.quantize import quantize_cols
from mok_cute.shapes import resolve_shape

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--shapes", default="dsv3_ep8_rank,qwen3_30b,sonic_120b")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--json", default=None)
args = p.parse_args()


torch.manual_seed(0)
out = {}
for name in args.shapes.split(","):
    s = resolve_shape(name)
    E, H, I = s.experts, s.hidden, s.intermediate
    rows = s.tokens * s.top_k
    per = rows // E
    offsets = torch.arange(E + 1, device="cuda", dtype=torch.int32) * per
    bf = lambda *shape: torch.randn(*shape, device="cuda").to(torch.bfloat16)  # noqa: E731
    dg, du, x, dy, hw = bf(rows, I), bf(rows, I), bf(rows, H), bf(rows, H), bf(rows, I)
    q = {k: quantize_cols(v) for k, v in dict(dg=dg, du=du, x=x, dy=dy, hw=hw).items()}
    gate_flops = 2 * 2 * rows * I * H
    runs = {
        "bf16 wgrad gate+up": (lambda: wgrad(dg, du, x, offsets, E, I), gate_flops),
        "bf16 wgrad down": (lambda: wgrad(dy, None, hw, offsets, E, H), gate_flops // 2),
        "fp8 wgrad gate+up": (lambda: grouped_wgrad_fp8(q["dg"][0], q["dg"][1], q["x"][0],
                                                        q["x"][1], offsets, E, q["du"][0],
                                                        q["du"][1]), gate_flops),
        "fp8 wgrad down": (lambda: grouped_wgrad_fp8(q["dy"][0], q["dy"][1], q["hw"][0],
                                                     q["hw"][1], offsets, E), gate_flops // 2),
    }
    for k, v in dict(dg=dg, x=x).items():  # dU, dy and hw are the same shapes as dG, x
        # bytes: bf16 in, e4m3 out, the exponents
        runs[f"quantize_cols {k} [{v.shape[0]}, {v.shape[1]}]"] = (
            lambda v=v: quantize_cols(v), -(v.numel() * 3 + v.numel() // 128))
    for f, _ in runs.values():
        f()
    torch.cuda.synchronize()
    res = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, (f, _) in runs.items():
            res[k].append(tt.do_bench(f, warmup=5, rep=40))
    shape_out = {}
    for k, v in res.items():
        ms = sorted(v)[len(v) // 2]
        work = runs[k][1]
        row = {"ms": ms, "rounds": v}
        if work > 0:
            row["tflops"] = work / ms / 1e9
            print(f"{name:14s} {k:36s} {ms:.3f} ms  {row['tflops']:.0f} TFLOP/s")
        else:
            row["gb_per_s"] = -work / ms / 1e6
            print(f"{name:14s} {k:36s} {ms:.3f} ms  {row['gb_per_s']:.0f} GB/s")
        shape_out[k] = row
    out[name] = shape_out
if args.json:
    with open(args.json, "w") as f:
        json.dump({"command": "python tools/fp8_wgrad_probe.py --shapes " + args.shapes,
                   "gpu": torch.cuda.get_device_name(), "results": out}, f, indent=1)
