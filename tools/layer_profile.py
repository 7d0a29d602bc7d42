"""Where the time of one moe_forward call goes: host time, and GPU time per stage.

    python tools/layer_profile.py --shapes dsv3_ep8_rank,qwen3_30b [--fp8] [--json out.json]

Stages are timed one at a time with CUDA events around back-to-back repeats, so each number is
that stage's GPU time, or its host time where the GPU work is tiny (a back-to-back loop then
measures the host; AGENTS.md). The whole call is timed the same way through the public API
(validation, schedule, kernels) and without its checks (``expert_path.moe_forward_kernel``).
The stages are the expert path's (``mok_cute.expert_path``), with its default options: the
schedule, x scattered into expert order, FC1, FC2, the slot -> row map, the k-sum. A probe for
tuning, not the benchmark of record (``mok-cute bench``).

Also the helpers the other probes share (``layer_call``, ``gpu_ms``, ``probe_shapes``, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute.shapes import SINGLE_GPU_SHAPES, shape_names  # noqa: E402


def save_probe_json(path, fields: dict, argv=None) -> None:
    """A probe's JSON (when ``path`` is set): the command that made it, the GPU, ``fields``."""
    if not path:
        return
    script = "tools/" + sys.argv[0].rsplit("/", 1)[-1]
    doc = {"command": " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)]),
           "gpu": torch.cuda.get_device_name(), **fields}
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))  # compact, as mok_cute.bench.results


def probe_shapes(shapes: str, probe, path, argv=None, doc: dict | None = None) -> dict:
    """``probe(name)`` for each name of the comma list ``shapes``, appended to
    ``doc["shapes"]``; the JSON (``save_probe_json``) is saved after every shape, so a probe
    killed at its time limit keeps the shapes it finished."""
    doc = {"shapes": []} if doc is None else doc
    for name in shape_names(shapes):  # no empty names: shape_names drops them
        doc["shapes"].append(probe(name))
        save_probe_json(path, doc, argv)
    return doc


def layer_call(name: str, seed: int = 1):
    """A shape's random problem on the GPU and ``forward(config)``: one
    ``mok_cute.moe_forward`` call of it (with its shared expert) under ``config``."""
    import mok_cute
    from mok_cute.bench.problems import make_problem
    from mok_cute.shapes import resolve_shape

    p = make_problem(resolve_shape(name), device="cuda", seed=seed)
    i = p.inputs

    def forward(config):
        return mok_cute.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up,
                                    p.w_down, shared=p.shared, config=config)
    return p, forward


@contextlib.contextmanager
def fp8_weight_grads_forced(on: bool | None):
    """Inside: ``expert_backward.fp8_weight_grads``' I and row thresholds set so that it says
    ``on`` wherever H and I are whole 128 groups (None: its own rule); restored after."""
    from mok_cute import expert_backward as eb

    kept = eb.FP8_WGRAD_MIN_INTER, eb.FP8_WGRAD_MIN_ROWS
    if on is not None:
        eb.FP8_WGRAD_MIN_INTER = eb.FP8_WGRAD_MIN_ROWS = 0 if on else 1 << 30
    try:
        yield
    finally:
        eb.FP8_WGRAD_MIN_INTER, eb.FP8_WGRAD_MIN_ROWS = kept


def gpu_ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def host_ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best * 1e3


def profile_fp8(rows, x, topk_idx, topk_w, wg, wu, wd, sched, ros, reps):
    """The FP8 forward's stages (``expert_path_fp8``) beside the bf16 ones: x quantized and
    scattered, FC1, h quantized, FC2, the k-sum; weights already quantized (cached)."""
    import mok_cute as mok
    from mok_cute import expert_path_fp8
    from mok_cute.kernels import gemm_fp8, quantize, token_ops

    cfg = mok.MoKConfig(backend="kernel", precision="fp8", check_ids=False)
    rows["fp8 layer (api)"] = gpu_ms(lambda: mok.moe_forward(x, topk_idx, topk_w, wg, wu, wd,
                                                             config=cfg), reps)
    q = expert_path_fp8.quantized_weights(wg, wu, wd)
    x_in = expert_path_fp8.pad_cols(x, q.gate.shape[2])
    rows["fp8 quantize x"] = gpu_ms(lambda: quantize.quantize_rows(x_in), reps)
    capacity = sched.row_token.shape[0]
    rows["fp8 quantize x into expert order (fused)"] = gpu_ms(
        lambda: quantize.quantize_scatter_rows(x_in, ros, capacity), reps)

    def unfused():  # the path before the fusion: quantize, scatter e4m3 rows, gather exponents
        xq, ex = quantize.quantize_rows(x_in)
        xq_rows = torch.empty(capacity, x_in.shape[1], dtype=torch.float8_e4m3fn,
                              device=x.device)
        token_ops.scatter_rows(xq.view(torch.bfloat16), ros, xq_rows.view(torch.bfloat16))
        return xq_rows, ex[sched.row_token.long().clamp_min(0)]
    rows["fp8 quantize + scatter + gather exponents (unfused)"] = gpu_ms(unfused, reps)
    xq, ex = quantize.quantize_scatter_rows(x_in, ros, capacity)
    fc1 = lambda: gemm_fp8.grouped_gemm_fp8_swiglu(xq, ex, q.gate, q.e_gate, q.up, q.e_up,  # noqa: E731
                                                   sched.tile_expert, sched.num_tiles)
    rows["fp8 fc1"] = gpu_ms(fc1, reps)
    h = fc1()
    rows["fp8 quantize h"] = gpu_ms(lambda: quantize.quantize_rows(h), reps)
    for_fc1 = (xq, ex, q.gate, q.e_gate, q.up, q.e_up, sched.tile_expert, sched.num_tiles)
    rows["fp8 fc1 (256 wide)"] = gpu_ms(
        lambda: gemm_fp8.grouped_gemm_fp8_swiglu(*for_fc1, tile_n=256), reps)
    rows["fp8 fc1 (256 wide, h quantized in its epilogue)"] = gpu_ms(
        lambda: gemm_fp8.grouped_gemm_fp8_swiglu(*for_fc1, tile_n=256, quantize_h=True), reps)
    hq, eh = quantize.quantize_rows(h)
    y = torch.empty(h.shape[0], x.shape[1], dtype=torch.bfloat16, device=x.device)
    rows["fp8 fc2"] = gpu_ms(lambda: gemm_fp8.grouped_gemm_fp8(
        hq, eh, q.down, q.e_down, sched.tile_expert, sched.num_tiles, out=y), reps)
    rows["fp8 fc2 (256 wide)"] = gpu_ms(lambda: gemm_fp8.grouped_gemm_fp8(
        hq, eh, q.down, q.e_down, sched.tile_expert, sched.num_tiles, out=y, tile_n=256), reps)
    rows["fp8 k-sum"] = gpu_ms(lambda: token_ops.weighted_ksum(y, topk_w, row_index=ros), reps)
    def requantize():  # as after an optimizer step, training: both copies in one pass
        expert_path_fp8.forget_quantized_weights()
        return expert_path_fp8.quantized_weights(wg, wu, wd, training=True)
    rows["fp8 weights quantized (training: both copies)"] = gpu_ms(requantize, reps)


def profile_shape(name, T, H, I, E, K, reps, fp8=False):
    import mok_cute as mok
    from mok_cute import expert_path, schedule
    from mok_cute.constants import TILE_M
    from mok_cute.kernels import token_ops

    dev = "cuda"
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    topk_idx = torch.rand(T, E, device=dev).topk(K, dim=1).indices.to(torch.int32)
    topk_w = torch.softmax(torch.randn(T, K, device=dev), dim=1)
    wg = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) / H ** 0.5
    wu = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) / H ** 0.5
    wd = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) / I ** 0.5
    flops = 6 * T * K * H * I
    rows = {}
    with torch.no_grad():
        cfg = mok.MoKConfig(backend="kernel")
        options = cfg.expert_path
        layer = lambda: mok.moe_forward(x, topk_idx, topk_w, wg, wu, wd, config=cfg)  # noqa: E731
        rows["layer (api)"] = gpu_ms(layer, reps)
        rows["layer host time"] = host_ms(layer)
        direct = lambda: expert_path.moe_forward_kernel(x, topk_idx, topk_w, wg, wu, wd, None, cfg)  # noqa: E731
        rows["layer (expert_path, no api checks)"] = gpu_ms(direct, reps)
        rows["expert_path host time"] = host_ms(direct)
        build = lambda: schedule.build_receive_schedule(topk_idx.unsqueeze(0), 0, E, tile_m=TILE_M,  # noqa: E731
                                                        validate=False)
        rows["schedule"] = gpu_ms(build, reps)
        rows["schedule host time"] = host_ms(build)
        sched = build()
        ros = schedule.row_of_slot(sched, T, K)
        rows["row_of_slot"] = gpu_ms(lambda: schedule.row_of_slot(sched, T, K), reps)
        xr = torch.empty((sched.row_token.shape[0], H), dtype=x.dtype, device=dev)
        rows["scatter x"] = gpu_ms(lambda: token_ops.scatter_rows(x, ros, xr), reps)
        fc1 = lambda: expert_path.grouped_gemm(xr, wg, sched.tile_expert, sched.num_tiles,  # noqa: E731
                                               "swiglu", w_up=wu, group_m=options.fc1_group_m)
        rows["fc1"] = gpu_ms(fc1, reps)
        h = fc1()
        pingpong = options.fc2_pingpong(I)  # as expert_path.expert_mlp runs FC2
        fc2 = lambda: expert_path.grouped_gemm(h, wd, sched.tile_expert, sched.num_tiles,  # noqa: E731
                                               group_m=options.fc2_group_m, pingpong=pingpong,
                                               tile_n=128 if pingpong else None)
        rows["fc2" + (" (pingpong)" if pingpong else "")] = gpu_ms(fc2, reps)
        y = fc2()
        rows["k-sum"] = gpu_ms(lambda: token_ops.weighted_ksum(y, topk_w, row_index=ros), reps)
        if fp8:
            profile_fp8(rows, x, topk_idx, topk_w, wg, wu, wd, sched, ros, reps)
    gemm_flops = {"fc1": 2 * flops // 3, "fc2": flops // 3}
    print(f"{name}: T={T} H={H} I={I} E={E} K={K}")
    for key, ms in rows.items():
        extra = ""
        if key.startswith("layer (") or key.startswith("fp8 layer ("):
            extra = f"{flops / ms / 1e9:7.1f} TFLOP/s"
        elif key.split(" (")[0].removeprefix("fp8 ") in gemm_flops:
            extra = f"{gemm_flops[key.split(' (')[0].removeprefix('fp8 ')] / ms / 1e9:7.1f} TFLOP/s"
        print(f"  {key:36s} {ms:8.3f} ms {extra}")
    return {"shape": name, "T": T, "H": H, "I": I, "E": E, "K": K, "ms": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="dsv3_ep8_rank")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--fp8", action="store_true", help="also the FP8 forward's stages")
    args = p.parse_args(argv)
    out = []
    for name in shape_names(args.shapes):
        s = SINGLE_GPU_SHAPES[name]
        out.append(profile_shape(name, s.tokens, s.hidden, s.intermediate, s.experts, s.top_k,
                                 reps=args.reps, fp8=args.fp8))
    save_probe_json(args.json, {"profiles": out})


if __name__ == "__main__":
    main()
