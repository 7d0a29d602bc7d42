"""One-off timing probe (CUDA events, interleaved): the FP8 grouped GEMM (promoted) against the
bf16 expert-path GEMM on dsv3's FC2 (E = 32 x 1024 rows, N = 7168, K = 2048). Prints TFLOP/s."""
import torch
import triton.testing as tt

from mok_cute import fp8
from mok_cute.expert_path import grouped_gemm
from mok_cute.kernels.gemm_fp8 import grouped_gemm_fp8

E, ROWS, N, K = 32, 1024, 7168, 2048
M = E * ROWS
torch.manual_seed(0)
a = torch.randn(M, K, device="cuda").to(torch.bfloat16)
w = (torch.randn(E, N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
tile_expert = torch.arange(M // 128, device="cuda", dtype=torch.int32) // (ROWS // 128)
tiles = torch.tensor([M // 128], device="cuda", dtype=torch.int32)
qa, ea = fp8.quantize_rows(a)
qw, ew = fp8.quantize_blocks(w)
flops = 2 * M * N * K
runs = {"bf16": lambda: grouped_gemm(a, w, tile_expert, tiles),
        "fp8_192": lambda: grouped_gemm_fp8(qa, ea, qw, ew, tile_expert, tiles, tile_n=192),
        "fp8_128": lambda: grouped_gemm_fp8(qa, ea, qw, ew, tile_expert, tiles, tile_n=128)}
for f in runs.values():
    f()
torch.cuda.synchronize()
res = {k: [] for k in runs}
for _ in range(3):
    for k, f in runs.items():
        res[k].append(tt.do_bench(f, warmup=5, rep=40))
for k, v in res.items():
    ms = sorted(v)[1]
    print(f"{k:8s} {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  rounds {[round(x, 3) for x in v]}")
