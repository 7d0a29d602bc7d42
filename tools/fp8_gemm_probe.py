"""Timing probe (CUDA events, interleaved rounds, SM clock sampled): the FP8 grouped GEMMs
(promoted) against the bf16 expert-path GEMMs and cuBLAS's blockwise FP8 (``torch._scaled_mm``,
1 x 128 / 128 x 128 scales, the same FLOPs as one dense GEMM) on dsv3's FC2 (E = 32 x 1024
rows, N = 7168, K = 2048) and FC1 (N = 2 x 2048 gate | up, K = 7168, SwiGLU), each FP8 kernel
at its tile widths (128: two partials beside the accumulator, pipelined; 256: one N-half
promoted at a time). ``--rep-ms``: each
measurement's length (short ones run near the top clock; long ones at the H200's power cap).
Prints TFLOP/s.

    python tools/fp8_gemm_probe.py [--rep-ms 40] [--only REGEX] [--json out.json]

``--profile``: each selected variant runs once between ``cudaProfilerStart`` / ``Stop``, no
timing, for ``ncu --profile-from-start off --clock-control none ...`` (our FC1 against
cuBLAS's on the same FLOPs: ``--only "fc1 fp8 256|fc1 cublas" --profile``).
"""
import re
import argparse
import json

import torch
import triton.testing as tt

import sys

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute import fp8  # noqa: E402
from mok_cute.bench.gpu_clock import ClockSampler  # noqa: E402
from mok_cute.expert_path import grouped_gemm  # noqa: E402
from mok_cute.kernels.gemm_fp8 import grouped_gemm_fp8, grouped_gemm_fp8_swiglu  # noqa: E402

E, ROWS, H, I = 32, 1024, 7168, 2048
M = E * ROWS
p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--json", default=None)
p.add_argument("--rep-ms", type=int, default=40)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--only", default=None, help="a regex: the variants to run")
p.add_argument("--profile", action="store_true", help="each variant once, for ncu")
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
for tile_n in (128, 256):
    runs[f"fc2 fp8 {tile_n}"] = (lambda t=tile_n: grouped_gemm_fp8(qh, eh, qd, ed, tile_expert,
                                                                  tiles, tile_n=t))
for tile_n in (128, 256):
    runs[f"fc1 fp8 {tile_n}"] = (lambda t=tile_n: grouped_gemm_fp8_swiglu(
        qx, ex, qg, eg, qu, eu, tile_expert, tiles, tile_n=t))


def cublas_blockwise(a_q, e_a, w_q, e_w):
    """cuBLAS's blockwise FP8 on one dense GEMM of the grouped problem's FLOPs: A [M, K] with
    its 1 x 128 scales (fp32, column-major, as cuBLAS takes them), W [N, K] with 128 x 128."""
    sa = fp8.pow2(e_a.int()).float().t().contiguous().t()
    sb = fp8.pow2(e_w.int()).float().t()  # [K/128, N/128]
    return lambda: torch._scaled_mm(a_q, w_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


# the dense problems of the same FLOPs: A = all M rows, W = expert 0's weights (FC1: gate | up)
w1 = torch.cat([qg[0], qu[0]]), torch.cat([eg[0], eu[0]])
runs["fc1 cublas blockwise"] = cublas_blockwise(qx, ex, *w1)
runs["fc2 cublas blockwise"] = cublas_blockwise(qh, eh, qd[0], ed[0])
# sanity: cuBLAS's scales read as meant (first 256 rows against the dequantized operands)
ref = fp8.dequantize_rows(qh[:256], eh[:256]) @ fp8.dequantize_blocks(qd[0], ed[0]).t()
got = runs["fc2 cublas blockwise"]()[:256].float()
print(f"cublas blockwise fc2 rel-L1 {((got - ref).abs().sum() / ref.abs().sum()).item():.2e}")
if args.only:
    runs = {k: f for k, f in runs.items() if re.search(args.only, k)}
for f in runs.values():
    f()
torch.cuda.synchronize()
if args.profile:
    torch.cuda.cudart().cudaProfilerStart()
    for k, f in runs.items():
        torch.cuda.nvtx.range_push(k)
        f()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    sys.exit(0)
res = {k: [] for k in runs}
with ClockSampler() as clock:
    for r in range(args.rounds):
        for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            with clock.window(k):
                res[k].append(tt.do_bench(runs[k], warmup=5, rep=args.rep_ms))
    clocks = {k: (clock.stats(k) or {}).get("sm_mhz_median") for k in runs}
out = {}
for k, v in res.items():
    ms = sorted(v)[len(v) // 2]
    out[k] = {"ms": ms, "tflops": flops[k[:3]] / ms / 1e9, "rounds": v, "sm_mhz": clocks[k]}
    print(f"{k:22s} {ms:.3f} ms  {out[k]['tflops']:.0f} TFLOP/s  @{clocks[k]} MHz  "
          f"rounds {[round(x, 3) for x in v]}")
if args.json:
    with open(args.json, "w") as f:
        json.dump({"command": "python tools/fp8_gemm_probe.py " + " ".join(sys.argv[1:]),
                   "gpu": torch.cuda.get_device_name(), "results": out}, f, indent=1)
