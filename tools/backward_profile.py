"""Where the time of the one-GPU backward goes: GPU time per stage beside cuBLAS doing each
GEMM's FLOPs densely (the ceiling a grouped GEMM of those rows can hope for).

    python tools/backward_profile.py --shapes dsv3_ep8_rank,mixtral,gptoss_120b [--fp8] [--json out.json]

Stages (``mok_cute.expert_backward``): the training and inference forwards and the bytes saved,
the d_out and x row gathers, FC2's dgrad with the dgated epilogue (pingpong and cooperative),
FC1's dgrad, the gate/up and down weight gradients, the k-sum of d_x, and the whole
``moe_backward``; with ``--fp8`` also the FP8 dgrads (row quantization included, the weights'
transposed copies quantized once) and the FP8 weight gradients (column quantization included,
and the gate/up GEMM alone). Each timed back to back (``layer_profile.gpu_ms``, L2 warm).
A probe for tuning, not the benchmark of record (``mok-cute bench --train``).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from tools.layer_profile import gpu_ms, probe_shapes  # noqa: E402


def print_kernel_table(fn, reps: int = 3):
    """GPU time per kernel of ``fn`` (torch.profiler, ``reps`` calls after a warm one)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per_kernel.setdefault(e.name[:70], []).append(e.device_time_total / 1e3)
    for name_, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"    {sum(times) / reps:8.3f} ms  x{len(times) // reps:<3d} {name_}")


def profile(name: str, reps: int, wgrad_group_m: list[int], fp8_dgrads: bool = False,
            mk_raster: list[int] | None = None, kernel_table: bool = False) -> dict:
    import mok_cute
    from mok_cute import expert_backward as eb
    from mok_cute import expert_path
    from mok_cute.bench.problems import make_problem
    from mok_cute.kernels import token_ops
    from mok_cute.shapes import resolve_shape

    shape = resolve_shape(name)
    p = make_problem(shape, device="cuda", seed=1)
    i = p.inputs
    x, idx, w = i.x, i.topk_idx, i.topk_weights
    T, H = x.shape
    K = idx.shape[1]
    E, I = p.w_gate.shape[0], p.w_gate.shape[1]
    cfg = mok_cute.MoKConfig(backend="kernel", check_ids=False)
    options = cfg.expert_path
    with torch.no_grad():
        _, saved = expert_path.moe_forward_kernel(x, idx, w, p.w_gate, p.w_up, p.w_down, None,
                                                  cfg, save=True)
    ms, flops = {}, {}
    for save in (False, True):
        ms["forward (training: save)" if save else "forward (inference)"] = gpu_ms(
            lambda save=save: expert_path.moe_forward_kernel(x, idx, w, p.w_gate, p.w_up,
                                                             p.w_down, None, cfg, save=save), reps)
    saved_bytes = sum(t.numel() * t.element_size() for t in saved) / x.shape[0]
    print(f"  saved for the backward: {saved_bytes:.0f} B/token (preact {tuple(saved.preact.shape)})")
    torch.manual_seed(0)
    d_out = torch.randn_like(x)
    weights = w.to(torch.float32).contiguous().view(-1)
    row_token = saved.row_token(K)
    rows = row_token.shape[0]
    ms["gather d_out"] = gpu_ms(lambda: token_ops.gather_rows(d_out, row_token), reps)
    d_rows = token_ops.gather_rows(d_out, row_token)
    x_rows = token_ops.gather_rows(x, row_token)
    fc2 = lambda: eb.fc2_dgrad(d_rows, p.w_down, saved.preact, saved.row_slot, weights,  # noqa: E731
                               saved.tile_expert, saved.num_tiles, options)
    for pingpong in (True, False):
        variant = "pingpong 128" if pingpong else "cooperative 256"
        ms[f"fc2 dgrad (dgated, {variant})"] = gpu_ms(
            lambda pingpong=pingpong: eb.fc2_dgrad(d_rows, p.w_down, saved.preact, saved.row_slot,
                                                   weights, saved.tile_expert, saved.num_tiles,
                                                   options, pingpong=pingpong), reps)
    d_preact, hw, _ = fc2()
    fc1 = lambda: eb.fc1_dgrad(d_preact, p.w_gate, p.w_up, saved.tile_expert,  # noqa: E731
                               saved.num_tiles, options, idx.numel() / p.w_gate.shape[0])
    ms["fc1 dgrad"] = gpu_ms(fc1, reps)
    dx_rows = fc1()
    from mok_cute import megakernel_backward
    ms["dgrads: fc2 + fc1 launches"] = gpu_ms(lambda: (fc2(), fc1()), reps)
    default_raster = megakernel_backward.RASTER_M
    for raster in mk_raster or [default_raster]:
        megakernel_backward.RASTER_M = raster  # an A/B of the list's raster groups
        suffix = "" if raster == default_raster else f" raster_m={raster}"
        ms["dgrads: backward megakernel" + suffix] = gpu_ms(
            lambda: megakernel_backward.expert_dgrads(d_rows, p.w_gate, p.w_up, p.w_down,
                                                      saved.preact, saved.row_slot, weights,
                                                      saved.tile_expert, saved.num_tiles), reps)
    megakernel_backward.RASTER_M = default_raster
    if fp8_dgrads and H % 128 == 0 and I % 128 == 0:
        from mok_cute.kernels import gemm_fp8, quantize
        wdt, e_wdt = quantize.quantize_blocks(p.w_down, transposed=True)  # once per weight update
        wgt, e_wgt = quantize.quantize_blocks(p.w_gate, transposed=True)
        wut, e_wut = quantize.quantize_blocks(p.w_up, transposed=True)

        def fp8_fc2():
            return gemm_fp8.grouped_gemm_fp8_dgated(*quantize.quantize_rows(d_rows), wdt, e_wdt,
                                                    saved.preact, saved.row_slot, weights,
                                                    saved.tile_expert, saved.num_tiles)

        def fp8_fc1():
            return gemm_fp8.grouped_gemm_fp8_split_k(*quantize.quantize_rows(d_preact), wgt, e_wgt,
                                                     wut, e_wut, saved.tile_expert,
                                                     saved.num_tiles)
        ms["fp8 fc2 dgrad (quantize d_out rows + dgated)"] = gpu_ms(fp8_fc2, reps)
        ms["fp8 fc1 dgrad (quantize dG|dU + split K)"] = gpu_ms(fp8_fc1, reps)
        from mok_cute.kernels import gemm_wgrad_fp8

        # A (dG | dU, d_out rows) per (column, 128 rows), B (x rows, w * h) per (column, expert)
        offsets = saved.expert_offsets
        xq_ex = quantize.quantize_cols_per_expert(x_rows, offsets, E)

        def fp8_wgrad_gate_up(quantize_x=True):
            gq, eg = quantize.quantize_cols(d_preact)  # [2I, rows]: dG^T then dU^T
            xq, ex = quantize.quantize_cols_per_expert(x_rows, offsets, E) if quantize_x else xq_ex
            return gemm_wgrad_fp8.grouped_wgrad_fp8(gq[:I], eg[:I], xq, ex, offsets, E, gq[I:],
                                                    eg[I:])

        def fp8_wgrad_down():
            return gemm_wgrad_fp8.grouped_wgrad_fp8(*quantize.quantize_cols(d_rows),
                                                    *quantize.quantize_cols_per_expert(hw, offsets, E),
                                                    offsets, E)
        ms["fp8 wgrad gate+up (quantize dG|dU and x cols)"] = gpu_ms(fp8_wgrad_gate_up, reps)
        ms["fp8 wgrad gate+up (x cols kept)"] = gpu_ms(lambda: fp8_wgrad_gate_up(False), reps)
        ms["fp8 wgrad down (quantize d_out and h' cols)"] = gpu_ms(fp8_wgrad_down, reps)
        gq, eg = quantize.quantize_cols(d_preact)
        ms["fp8 wgrad gate+up GEMM alone"] = gpu_ms(
            lambda: gemm_wgrad_fp8.grouped_wgrad_fp8(gq[:I], eg[:I], *xq_ex, saved.expert_offsets,
                                                     E, gq[I:], eg[I:]), reps)
    for gm in wgrad_group_m:
        suffix = "" if gm == wgrad_group_m[0] else f" group_m={gm}"
        kernel_gu = eb._compiled("gemm_wgrad", x.device, gated=True, group_m=gm)
        kernel_d = eb._compiled("gemm_wgrad", x.device, gated=False, group_m=gm)
        c = torch.empty(E, I, H, dtype=torch.bfloat16, device=x.device)
        c2 = torch.empty_like(c)
        cd = torch.empty(E, H, I, dtype=torch.bfloat16, device=x.device)
        gu = lambda: kernel_gu(d_preact[:, :I].t().unsqueeze(2), d_preact[:, I:].t().unsqueeze(2),  # noqa: E731
                               x_rows.t().unsqueeze(2), c.permute(1, 2, 0), c2.permute(1, 2, 0),
                               saved.expert_offsets)
        dn = lambda: kernel_d(d_rows.t().unsqueeze(2), None, hw.t().unsqueeze(2),  # noqa: E731
                              cd.permute(1, 2, 0), None, saved.expert_offsets)
        ms["wgrad gate+up" + suffix] = gpu_ms(gu, reps)
        ms["wgrad down" + suffix] = gpu_ms(dn, reps)
    ones = torch.ones(T, K, dtype=torch.float32, device=x.device)
    ms["k-sum d_x"] = gpu_ms(lambda: token_ops.weighted_ksum(dx_rows, ones, None,
                                                             row_index=saved.row_of_slot), reps)
    ms["moe_backward"] = gpu_ms(lambda: eb.moe_backward(d_out, x, idx, w, p.w_gate, p.w_up,
                                                        p.w_down, None, saved), reps)
    ms["moe_backward (megakernel dgrads)"] = gpu_ms(
        lambda: eb.moe_backward(d_out, x, idx, w, p.w_gate, p.w_up, p.w_down, None, saved,
                                dgrads="megakernel"), reps)
    if kernel_table:
        for dgrads in ("kernels", "megakernel"):
            print(f"  kernels of one moe_backward (dgrads={dgrads!r}):")
            print_kernel_table(lambda dgrads=dgrads: eb.moe_backward(
                d_out, x, idx, w, p.w_gate, p.w_up, p.w_down, None, saved, dgrads=dgrads))
    # cuBLAS dense over the same rows (the capacity, padding included, as the kernels run)
    a = torch.randn(rows, H, dtype=torch.bfloat16, device=x.device)
    b_hi = torch.randn(H, I, dtype=torch.bfloat16, device=x.device)
    b_2ih = torch.randn(2 * I, H, dtype=torch.bfloat16, device=x.device)
    g2 = torch.randn(rows, 2 * I, dtype=torch.bfloat16, device=x.device)
    ms["cublas fc2 dgrad [M,H]x[H,I]"] = gpu_ms(lambda: a @ b_hi, reps)
    ms["cublas fc1 dgrad [M,2I]x[2I,H]"] = gpu_ms(lambda: g2 @ b_2ih, reps)
    ms["cublas wgrad gate+up [2I,M]x[M,H]"] = gpu_ms(lambda: g2.t() @ a, reps)
    ms["cublas wgrad down [H,M]x[M,I]"] = gpu_ms(lambda: a.t() @ g2[:, :I], reps)
    gemm = 2 * rows * H * I
    for key in ms:
        if key.startswith("forward"):
            flops[key] = 6 * T * K * H * I
        elif "fc2" in key or "down" in key:
            flops[key] = gemm
        elif "fc1" in key or "gate+up" in key:
            flops[key] = 2 * gemm
    flops["moe_backward"] = flops["moe_backward (megakernel dgrads)"] = 12 * T * K * H * I
    for key in ms:
        if key.startswith("dgrads"):
            flops[key] = 3 * gemm
    print(f"{name}: T={T} H={H} I={I} E={E} K={K} rows(capacity)={rows} (T*K={T * K})")
    for key, t in ms.items():
        rate = f"{flops[key] / t / 1e9:7.1f} TFLOP/s" if key in flops else ""
        print(f"  {key:40s} {t:8.3f} ms {rate}")
    return {"shape": name, "T": T, "H": H, "I": I, "E": E, "K": K, "rows": rows, "ms": ms,
            "saved_bytes_per_token": saved_bytes,
            "tflops": {k: flops[k] / ms[k] / 1e9 for k in flops}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="dsv3_ep8_rank,mixtral,gptoss_120b")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--wgrad-group-m", default="4", help="comma list; the first is the default")
    p.add_argument("--fp8", action="store_true",
                   help="also the FP8 dgrads (issue 33) where H and I are multiples of 128")
    p.add_argument("--mk-raster", default="",
                   help="comma list: time the backward megakernel's dgrads with these raster groups")
    p.add_argument("--kernel-table", action="store_true",
                   help="per-kernel GPU times of one moe_backward, two launches vs megakernel dgrads")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    gms = [int(v) for v in args.wgrad_group_m.split(",")]
    rasters = [int(v) for v in args.mk_raster.split(",") if v]
    probe_shapes(args.shapes, lambda n: profile(n, args.reps, gms, args.fp8, rasters,
                                                          args.kernel_table), args.json,
                 argv)


if __name__ == "__main__":
    main()
