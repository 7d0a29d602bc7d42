"""The FP8 forward's variants as whole layers, in interleaved rounds, against the bf16 layer.

    python tools/fp8_forward_ab.py --shapes dsv3_ep8_rank,qwen3_30b --rounds 3 [--json F]

Each variant is ``expert_path_fp8.moe_forward_fp8``'s sequence (x quantized into expert order,
FC1, h in e4m3, FC2, the k-sum) with its choices varied: how h becomes e4m3 (``epilogue``: in FC1's
epilogue, the product's; ``separate``: FC1 stores bf16 h, ``quantize.quantize_rows`` after) and
FC2's tile width (256, the product's, or 128). Weights are quantized once (cached), as in a steady inference loop. Every variant's output
is compared bitwise with the first's. Rounds alternate the order; the SM clock is sampled per
variant (``mok_cute.bench.gpu_clock``). A probe for choosing the product's forward, not the bench
of record.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute.bench.gpu_clock import ClockSampler  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
from layer_profile import gpu_ms, layer_call, probe_shapes  # noqa: E402

H_MODES = ("epilogue", "separate")
FC2_WIDTHS = (256, 128)


def fp8_forward(p, h_mode: str, fc2_tile_n: int):
    """One FP8 layer call with these choices -> out [T, H] bf16 (the shared expert included)."""
    from mok_cute import expert_path, expert_path_fp8 as ep8
    from mok_cute.kernels import gemm_fp8, quantize, token_ops

    i = p.inputs
    w = ep8.quantized_weights(p.w_gate, p.w_up, p.w_down)
    sched, row_of_slot = expert_path.expert_schedule(i.topk_idx, w.gate.shape[0])
    xq, ex = quantize.quantize_scatter_rows(ep8.pad_cols(i.x, w.gate.shape[2]), row_of_slot,
                                            sched.row_token.shape[0])
    fc1 = (xq, ex, w.gate, w.e_gate, w.up, w.e_up, sched.tile_expert, sched.num_tiles)
    if h_mode == "separate":
        hq, eh = quantize.quantize_rows(gemm_fp8.grouped_gemm_fp8_swiglu(*fc1, tile_n=256))
    else:
        hq, eh = gemm_fp8.grouped_gemm_fp8_swiglu(*fc1, tile_n=256, quantize_h=True)
    y = torch.empty(hq.shape[0], i.x.shape[1], dtype=torch.bfloat16, device=i.x.device)
    gemm_fp8.grouped_gemm_fp8(hq, eh, w.down, w.e_down, sched.tile_expert, sched.num_tiles,
                              out=y, tile_n=fc2_tile_n)
    shared_rows, _ = expert_path.shared_forward(i.x, p.shared, MoKConfig().expert_path)
    return token_ops.weighted_ksum(y, i.topk_weights, shared_rows, row_index=row_of_slot)


def probe(name: str, rounds: int, reps: int) -> dict:
    import mok_cute as mok

    p, forward = layer_call(name)
    variants = {"bf16": lambda: forward(mok.MoKConfig(backend="kernel", check_ids=False)),
                "fp8 (product)": lambda: forward(mok.MoKConfig(backend="kernel", precision="fp8",
                                                               check_ids=False))}
    for h_mode in H_MODES:
        for width in FC2_WIDTHS:
            variants[f"fp8 h={h_mode} fc2={width}"] = (
                lambda h_mode=h_mode, width=width: fp8_forward(p, h_mode, width))
    with torch.no_grad():
        outs = {k: f() for k, f in variants.items()}
        first = outs["fp8 (product)"]
        bitwise = {k: bool(torch.equal(v, first)) for k, v in outs.items() if k != "bf16"}
        times = {k: [] for k in variants}
        with ClockSampler() as clock:
            for r in range(rounds):
                order = list(variants) if r % 2 == 0 else list(variants)[::-1]
                for k in order:
                    with clock.window(k):
                        times[k].append(gpu_ms(variants[k], reps))
        clocks = {k: clock.stats(k) for k in variants}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{name}: bitwise vs fp8 (product): {bitwise}")
    for k, ms in med.items():
        mhz = (clocks[k] or {}).get("sm_mhz_median")
        print(f"  {k:30s} {ms:8.3f} ms  {ms / med['bf16']:.3f} x bf16  clock {mhz}")
    return {"shape": name, "rounds": rounds, "reps": reps, "median_ms": med, "ms": times,
            "ratio_to_bf16": {k: v / med["bf16"] for k, v in med.items()},
            "bitwise_vs_product": bitwise, "clock": clocks}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3_ep8_rank,qwen3_30b,sonic_120b,mixtral,gptoss_120b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    probe_shapes(args.shapes, lambda n: probe(n, args.rounds, args.reps), args.json, argv)


if __name__ == "__main__":
    main()
