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

from mok_cute import fp8
from mok_cute.expert_backward import wgrad
from mok_cute.kernels.gemm_wgrad_fp8 import grouped_wgrad_fp8, grouped_wgrad_fp8_ref
from mok_cute.kernels.quantize import quantize_cols
from mok_cute.shapes import resolve_shape

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--shapes", default="dsv3_ep8_rank,qwen3_30b,sonic_120b")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--json", default=None)
p.add_argument("--b-blocks", action="store_true",
               help="TEMPORARY experiment: also B (x, w*h) quantized in 128 x 128 blocks (one FFMA "
                    "an element in the promotion); its error against the per-column form")
args = p.parse_args()


def rel_l1(got, want):
    return ((got.double() - want).abs().sum() / want.abs().sum()).item()


def b_blocks_accuracy(name, q, qb, offsets, num_experts, dy, hw):
    """The down projection's weight gradient of the first two experts: the kernel on B in
    blocks against the float64 oracle of its own dequantized operands (the kernel is right),
    then both FP8 forms and bf16 against float64 of the bf16 operands, on hw as drawn and on
    hw with outlier columns (each column scaled by exp(1.5 N(0, 1)))."""
    per = int(offsets[1])
    sub = offsets[:3].clone()
    rows = 2 * per
    res = {}
    for label, h in (("uniform columns", hw[:rows]),
                     ("outlier columns", (hw[:rows].float() * torch.exp(
                         1.5 * torch.randn(hw.shape[1], device=hw.device))).bfloat16())):
        d = dy[:rows]
        exact = torch.stack([d[:per].double().T @ h[:per].double(),
                             d[per:].double().T @ h[per:].double()])
        qd, qh, qhb = quantize_cols(d), quantize_cols(h), fp8.quantize_blocks(h.t())
        col = grouped_wgrad_fp8(qd[0], qd[1], qh[0], qh[1], sub, 2)
        blk = grouped_wgrad_fp8(qd[0], qd[1], qhb[0], qhb[1], sub, 2, b_blocks=True)
        own = rel_l1(blk, grouped_wgrad_fp8_ref(qd[0], qd[1], qhb[0], qhb[1], sub).double())
        res[label] = {"kernel_vs_own_oracle": own,
                      "bf16": rel_l1(wgrad(d, None, h, sub, 2, d.shape[1]), exact),
                      "fp8_per_column": rel_l1(col, exact), "fp8_b_blocks": rel_l1(blk, exact)}
        print(f"{name:14s} down wgrad rel-L1 vs float64, {label}: " + ", ".join(
            f"{k} {v:.2e}" for k, v in res[label].items()), flush=True)
    return res


torch.manual_seed(0)
out = {}
accuracy = {}
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
    if args.b_blocks:
        qb = {k: fp8.quantize_blocks(v.t()) for k, v in dict(x=x, hw=hw).items()}
        runs["fp8 wgrad gate+up [B blocks]"] = (
            lambda: grouped_wgrad_fp8(q["dg"][0], q["dg"][1], qb["x"][0], qb["x"][1], offsets, E,
                                      q["du"][0], q["du"][1], b_blocks=True), gate_flops)
        runs["fp8 wgrad down [B blocks]"] = (
            lambda: grouped_wgrad_fp8(q["dy"][0], q["dy"][1], qb["hw"][0], qb["hw"][1], offsets,
                                      E, b_blocks=True), gate_flops // 2)
        accuracy[name] = b_blocks_accuracy(name, q, qb, offsets, E, dy, hw)
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
        json.dump({"command": "python tools/fp8_wgrad_probe.py --shapes " + args.shapes
                   + (" --b-blocks" if args.b_blocks else ""),
                   "gpu": torch.cuda.get_device_name(), "results": out, "accuracy": accuracy},
                  f, indent=1)
