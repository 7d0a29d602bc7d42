"""One-off timing probe (CUDA events, interleaved): the FP8 grouped GEMMs (promoted) against
the bf16 expert-path GEMMs on dsv3's FC2 (E = 32 x 1024 rows, N = 7168, K = 2048) and FC1
(N = 2 x 2048 gate | up, K = 7168, SwiGLU), each FP8 kernel at its tile widths (128: one
partial beside the accumulator; 192: two full accumulators, FC2 only; 256: one N-half
promoted at a time). Prints TFLOP/s.

    python tools/fp8_gemm_probe.py [--json out.json]
"""
import argparse
import json

import torch
import triton.testing as tt

from mok_cute import fp8
from mok_cute.expert_path import grouped_gemm
from mok_cute.kernels.gemm_fp8 import grouped_gemm_fp8, grouped_gemm_fp8_swiglu

E, ROWS, H, I = 32, 1024, 7168, 2048
M = E * ROWS
p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--json", default=None)
args = p.parse_args()
torch.manual_seed(0)
tile_expert = torch.arange(M // 128, device="cuda", dtype=torch.int32) // (ROWS // 128)
tiles = torch.tensor([M // 128], device="cuda", dtype=torch.int32)
# FC2: [M, I] x [E, H, I]
h = torch.randn(M, I, device="cuda").to(torch.bfloat16)
wd = (torch.randn(E, H, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
qh, eh = fp8.quantize_rows(h)
qd, ed = fp8.quantize_blocks(wd)
# FC1: [M, H] x [E, I, H] twice
x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
wg = (torch.randn(E, I, H, device="cuda") * H ** -0.5).to(torch.bfloat16)
wu = (torch.randn(E, I, H, device="cuda") * H ** -0.5).to(torch.bfloat16)
qx, ex = fp8.quantize_rows(x)
qg, eg = fp8.quantize_blocks(wg)
qu, eu = fp8.quantize_blocks(wu)
flops = {"fc2": 2 * M * H * I, "fc1": 4 * M * H * I}
runs = {"fc2 bf16": lambda: grouped_gemm(h, wd, tile_expert, tiles),
        "fc1 bf16": lambda: grouped_gemm(x, wg, tile_expert, tiles, "swiglu", w_up=wu)}
for tile_n in (128, 192, 256):
    runs[f"fc2 fp8 {tile_n}"] = (lambda t=tile_n: grouped_gemm_fp8(qh, eh, qd, ed, tile_expert,
                                                                  tiles, tile_n=t))
for tile_n in (128, 256):
    runs[f"fc1 fp8 {tile_n}"] = (lambda t=tile_n: grouped_gemm_fp8_swiglu(
        qx, ex, qg, eg, qu, eu, tile_expert, tiles, tile_n=t))
for f in runs.values():
    f()
torch.cuda.synchronize()
res = {k: [] for k in runs}
for _ in range(3):
    for k, f in runs.items():
        res[k].append(tt.do_bench(f, warmup=5, rep=40))
out = {}
for k, v in res.items():
    ms = sorted(v)[1]
    out[k] = {"ms": ms, "tflops": flops[k[:3]] / ms / 1e9, "rounds": v}
    print(f"{k:12s} {ms:.3f} ms  {out[k]['tflops']:.0f} TFLOP/s  rounds {[round(x, 3) for x in v]}")
if args.json:
    with open(args.json, "w") as f:
        json.dump({"command": "python tools/fp8_gemm_probe.py", "gpu": torch.cuda.get_device_name(),
                   "results": out}, f, indent=1)
