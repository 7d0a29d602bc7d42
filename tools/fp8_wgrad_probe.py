"""One-off timing probe (CUDA events, interleaved rounds): the expert weight gradients in bf16
(``expert_backward.wgrad``) against FP8 (``gemm_wgrad_fp8``: A = dG, dU, d_out by
``quantize_cols``, B = x, w * h by ``fp8.quantize_cols_per_expert``, untimed), each
column-quantization pass timed on its own, with its bytes against the HBM ceiling, and x's
pass as the backward runs it (through the row index, x read in place) against the bf16 row
gather then the pass; the FP8 kernel checked against its float64 oracle on two experts first. Shapes: uniform routing of a
bench shape (E experts of T * K / E rows each); H and I multiples of 128.

    python tools/fp8_wgrad_probe.py [--shapes dsv3_ep8_rank,qwen3_30b] [--json out.json]
"""
import argparse
import json

import torch
import triton.testing as tt

from mok_cute.expert_backward import wgrad
from mok_cute import fp8
from mok_cute.kernels.gemm_wgrad_fp8 import grouped_wgrad_fp8, grouped_wgrad_fp8_ref
from mok_cute.kernels import token_ops
from mok_cute.kernels.quantize import quantize_cols, quantize_cols_per_expert
from mok_cute.shapes import resolve_shape, shape_names
from layer_profile import fp8_weight_grads_forced  # tools/ is on sys.path as a script

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--shapes", default="dsv3_ep8_rank,qwen3_30b,sonic_120b")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--json", default=None)
p.add_argument("--layer", action="store_true",
               help="also the whole FP8 backward (moe_backward, precision fp8) with FP8 against "
                    "bf16 weight gradients (expert_backward.fp8_weight_grads' thresholds), and "
                    "with the d_out and x rows gathered first against read in place by the FP8 "
                    "quantizers (expert_backward.routed_rows), and with FC2's dgrad forced to FP8 "
                    "too, beside bf16's")
args = p.parse_args()


def layer_runs(name):
    """The FP8 layer's backward with FP8 / bf16 weight gradients and the bf16 layer's, on one
    saved forward each (the bench problem of the shape)."""
    import mok_cute
    from mok_cute import expert_backward as eb
    from mok_cute import expert_path, expert_path_fp8
    from mok_cute.bench.problems import make_problem

    pb = make_problem(resolve_shape(name), device="cuda", seed=1)
    x, idx, w = pb.inputs.x, pb.inputs.topk_idx, pb.inputs.topk_weights
    ws = (pb.w_gate, pb.w_up, pb.w_down)
    cfg = mok_cute.MoKConfig(backend="kernel", check_ids=False)
    with torch.no_grad():
        _, s16 = expert_path.moe_forward_kernel(x, idx, w, *ws, None, cfg, save=True)
        _, s8 = expert_path_fp8.moe_forward_fp8(x, idx, w, *ws, None, cfg, save=True)
    d_out = torch.randn_like(x)

    def fp8_bwd(fp8_wgrads, in_place=True, fp8_fc2=None):
        """``fp8_fc2``: FC2's dgrad forced to FP8 (True) or left to its rule (None)."""
        def run():
            kept = eb.fp8_reads_only, eb.FP8_FC2_DGRAD_MIN_INTER
            if not in_place:  # the d_out and x rows gathered in bf16 first, as before
                eb.fp8_reads_only = lambda *a, **k: (False, False)
            if fp8_fc2:
                eb.FP8_FC2_DGRAD_MIN_INTER = 0
            try:
                with fp8_weight_grads_forced(fp8_wgrads):
                    return eb.moe_backward(d_out, x, idx, w, *ws, None, s8, precision="fp8")
            finally:
                eb.fp8_reads_only, eb.FP8_FC2_DGRAD_MIN_INTER = kept
        return run
    bf16 = eb.moe_backward(d_out, x, idx, w, *ws, None, s16)
    for label, got in (("fp8 wgrads", fp8_bwd(True)()), ("bf16 wgrads", fp8_bwd(False)())):
        cos = [torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(),
                                                     dim=0).item() for a, b in zip(got[2:5], bf16[2:5])]
        print(f"{name:14s} FP8 layer, {label}: cosine of dW_gate, dW_up, dW_down against the bf16 "
              f"layer's " + " ".join(f"{c:.5f}" for c in cos), flush=True)
    return {"layer bwd bf16": (lambda: eb.moe_backward(d_out, x, idx, w, *ws, None, s16), 0),
            "layer bwd fp8, fp8 wgrads": (fp8_bwd(True), 0),
            "layer bwd fp8, fp8 wgrads, rows gathered": (fp8_bwd(True, in_place=False), 0),
            "layer bwd fp8, bf16 wgrads": (fp8_bwd(False), 0),
            # every GEMM in FP8 (what the size thresholds keep in bf16 below I = 1024)
            "layer bwd fp8, all fp8": (fp8_bwd(True, fp8_fc2=True), 0)}


torch.manual_seed(0)
out = {}
for name in shape_names(args.shapes):
    s = resolve_shape(name)
    E, H, I = s.experts, s.hidden, s.intermediate
    if H % 128 or I % 128:
        print(f"{name:14s} skipped: H = {H}, I = {I} not multiples of 128", flush=True)
        continue
    rows = s.tokens * s.top_k
    per = rows // E
    offsets = torch.arange(E + 1, device="cuda", dtype=torch.int32) * per
    bf = lambda *shape: torch.randn(*shape, device="cuda").to(torch.bfloat16)  # noqa: E731
    dg, du, x, dy, hw = bf(rows, I), bf(rows, I), bf(rows, H), bf(rows, H), bf(rows, I)
    q = {k: quantize_cols(v) for k, v in dict(dg=dg, du=du, dy=dy).items()}
    q.update({k: fp8.quantize_cols_per_expert(v, offsets) for k, v in dict(x=x, hw=hw).items()})
    sub, per2 = offsets[:3].clone(), 2 * per
    qd, qh = quantize_cols(dy[:per2]), fp8.quantize_cols_per_expert(hw[:per2], sub)
    got = grouped_wgrad_fp8(qd[0], qd[1], qh[0], qh[1], sub, 2)
    want = grouped_wgrad_fp8_ref(qd[0], qd[1], qh[0], qh[1], sub).double()
    err = ((got.double() - want).abs().sum() / want.abs().sum()).item()
    print(f"{name:14s} fp8 wgrad down on 2 experts against its float64 oracle: rel-L1 {err:.2e}",
          flush=True)
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
    # x's pass in the backward: each token's row on K schedule rows, in a random order
    x_src = bf(s.tokens, H)
    row_index = (torch.randperm(rows, device="cuda") // s.top_k).to(torch.int32)
    gathered = quantize_cols_per_expert(token_ops.gather_rows(x_src, row_index), offsets, E)
    direct = quantize_cols_per_expert(x_src, offsets, E, row_index=row_index)
    assert all(torch.equal(a.view(torch.int8), b.view(torch.int8))
               for a, b in zip(gathered, direct)), "x's pass through the row index"
    x_bytes = rows * H * 2 + rows * H + E * H  # x rows read once, e4m3 and exponents written
    runs["x cols: gather rows, then per expert"] = (
        lambda: quantize_cols_per_expert(token_ops.gather_rows(x_src, row_index), offsets, E),
        -x_bytes)
    runs["x cols: per expert through the row index"] = (
        lambda: quantize_cols_per_expert(x_src, offsets, E, row_index=row_index), -x_bytes)
    if args.layer:
        runs.update(layer_runs(name))
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
        elif work == 0:
            print(f"{name:14s} {k:36s} {ms:.3f} ms")
        else:
            row["gb_per_s"] = -work / ms / 1e6
            print(f"{name:14s} {k:36s} {ms:.3f} ms  {row['gb_per_s']:.0f} GB/s")
        shape_out[k] = row
    out[name] = shape_out
if args.json:
    with open(args.json, "w") as f:
        json.dump({"command": "python tools/fp8_wgrad_probe.py --shapes " + args.shapes
                   + (" --layer" if args.layer else ""),
                   "gpu": torch.cuda.get_device_name(), "results": out}, f, indent=1)
