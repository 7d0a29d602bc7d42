"""EXPERIMENT probe (double_partial): the 128-wide FP8 GEMMs with two partials (group k + 1's
wgmmas issued before group k is promoted) against the product's one partial, as GEMMs on dsv3's
problem and as FP8 training steps (the dgrads are 128 wide), in interleaved rounds with the SM
clock. Every "double" output must be bitwise the product's.

    python tools/fp8_double_partial_probe.py [--train-shapes ...] [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute.bench.gpu_clock import ClockSampler  # noqa: E402
from layer_profile import gpu_ms, layer_call, save_probe_json  # noqa: E402

from mok_cute import fp8  # noqa: E402
from mok_cute.kernels import gemm_fp8  # noqa: E402

VARIANTS = {"product": {}, "double": {"double_partial": True}}


def switched(variant, fn):
    def run():
        gemm_fp8.EXPERIMENT_STATIC.clear()
        gemm_fp8.EXPERIMENT_STATIC.update(VARIANTS[variant])
        try:
            return fn()
        finally:
            gemm_fp8.EXPERIMENT_STATIC.clear()
    return run


def interleave(runs: dict, rounds: int, reps: int):
    times = {k: [] for k in runs}
    with ClockSampler() as clock:
        for r in range(rounds):
            for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                with clock.window(k):
                    times[k].append(gpu_ms(runs[k], reps))
        clocks = {k: (clock.stats(k) or {}).get("sm_mhz_median") for k in runs}
    return {k: statistics.median(v) for k, v in times.items()}, times, clocks


def same(a, b):
    if isinstance(a, (tuple, list)):
        return all(same(x, y) for x, y in zip(a, b))
    return bool(torch.equal(a, b))


def gemms(rounds: int) -> dict:
    E, ROWS, H, I = 32, 1024, 7168, 2048
    M = E * ROWS
    torch.manual_seed(0)
    te = torch.arange(M // 128, device="cuda", dtype=torch.int32) // (ROWS // 128)
    tiles = torch.tensor([M // 128], device="cuda", dtype=torch.int32)
    qh, eh = fp8.quantize_rows(torch.randn(M, I, device="cuda").to(torch.bfloat16))
    qd, ed = fp8.quantize_blocks((torch.randn(E, H, I, device="cuda") * I ** -0.5).to(torch.bfloat16))
    qx, ex = fp8.quantize_rows(torch.randn(M, H, device="cuda").to(torch.bfloat16))
    qg, eg = fp8.quantize_blocks((torch.randn(E, I, H, device="cuda") * H ** -0.5).to(torch.bfloat16))
    qu, eu = fp8.quantize_blocks((torch.randn(E, I, H, device="cuda") * H ** -0.5).to(torch.bfloat16))
    qdgu, edgu = fp8.quantize_rows(torch.randn(M, 2 * I, device="cuda").to(torch.bfloat16))
    qgt, egt = fp8.quantize_blocks((torch.randn(E, I, H, device="cuda") * H ** -0.5).to(torch.bfloat16),
                                   transposed=True)
    qut, eut = fp8.quantize_blocks((torch.randn(E, I, H, device="cuda") * H ** -0.5).to(torch.bfloat16),
                                   transposed=True)
    kernels = {
        "fc2 128": (2 * M * H * I, lambda: gemm_fp8.grouped_gemm_fp8(qh, eh, qd, ed, te, tiles,
                                                                     tile_n=128)),
        "fc2 256 (product)": (2 * M * H * I, lambda: gemm_fp8.grouped_gemm_fp8(qh, eh, qd, ed, te,
                                                                               tiles, tile_n=256)),
        "fc1 dgrad 128": (4 * M * H * I, lambda: gemm_fp8.grouped_gemm_fp8_split_k(
            qdgu, edgu, qgt, egt, qut, eut, te, tiles)),
        "fc1 128 h bf16": (4 * M * H * I, lambda: gemm_fp8.grouped_gemm_fp8_swiglu(
            qx, ex, qg, eg, qu, eu, te, tiles, tile_n=128)),
        "fc1 256 h e4m3 (product)": (4 * M * H * I, lambda: gemm_fp8.grouped_gemm_fp8_swiglu(
            qx, ex, qg, eg, qu, eu, te, tiles, tile_n=256, quantize_h=True)),
    }
    out = {}
    for name, (flops, fn) in kernels.items():
        runs = {v: switched(v, fn) for v in VARIANTS}
        res = {v: f() for v, f in runs.items()}
        torch.cuda.synchronize()
        bitwise = same(res["double"], res["product"])
        del res
        med, times, clocks = interleave(runs, rounds, 10)
        out[name] = {"bitwise": bitwise, "median_ms": med, "ms": times, "clock_mhz": clocks,
                     "tflops": {k: flops / v / 1e9 for k, v in med.items()}}
        print(f"{name:16s} bitwise {bitwise}  " + "  ".join(
            f"{k} {med[k]:.3f} ms {flops / med[k] / 1e9:.0f} TF/s @{clocks[k]}" for k in med),
            flush=True)
    return out


def layer(name: str, rounds: int, kind: str) -> dict:
    import mok_cute as mok

    p, forward = layer_call(name)
    train = kind == "train"
    cfg = mok.MoKConfig(backend="megakernel" if kind == "megakernel" else "kernel",
                        precision="fp8", check_ids=False)
    grads = None
    if train:
        leaves = [p.inputs.x, p.w_gate, p.w_up, p.w_down]
        leaves = [t.detach().requires_grad_() for t in leaves]
        d_out = torch.randn_like(p.inputs.x)

        def step():
            for t in leaves:
                t.grad = None
            out = mok.moe_forward(leaves[0], p.inputs.topk_idx, p.inputs.topk_weights, *leaves[1:],
                                  shared=p.shared, config=cfg)
            out.backward(d_out)
            return [t.grad.clone() for t in leaves]
        fn = step
    else:
        def fn():
            with torch.no_grad():
                return forward(cfg)
    runs = {v: switched(v, fn) for v in VARIANTS}
    res = {v: f() for v, f in runs.items()}
    bitwise = same(res["double"], res["product"])
    del res, grads
    med, times, clocks = interleave(runs, rounds, 5 if train else 10)
    print(f"{name} {kind}: bitwise {bitwise}  " + "  ".join(
        f"{k} {med[k]:.3f} ms @{clocks[k]}" for k in med) +
        f"  double/product {med['double'] / med['product']:.3f}", flush=True)
    return {"shape": name, "pass": kind, "bitwise": bitwise, "median_ms": med, "ms": times,
            "clock_mhz": clocks, "ratio": med["double"] / med["product"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="")
    ap.add_argument("--train-shapes", default="dsv3_ep8_rank,qwen3_30b,sonic_120b,mixtral,gptoss_120b")
    ap.add_argument("--megakernel-shapes", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-gemms", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    doc = {"gemms": None, "layers": []}
    if not args.skip_gemms:
        doc["gemms"] = gemms(args.rounds)
        save_probe_json(args.json, doc, argv)
    for kind, shapes in (("fwd", args.shapes), ("train", args.train_shapes),
                         ("megakernel", args.megakernel_shapes)):
        for name in filter(None, shapes.split(",")):
            doc["layers"].append(layer(name, args.rounds, kind))
            save_probe_json(args.json, doc, argv)


if __name__ == "__main__":
    main()
