"""Where the time of one moe_forward call goes: host time, and GPU time per stage.

    python tools/layer_profile.py --shapes dsv3_ep8_rank,qwen3_30b [--json out.json]

Stages are timed one at a time with CUDA events around back-to-back repeats, so each
number is that stage's GPU time; the whole call is timed the same way through the public
API (validation, schedule, kernels). A probe for tuning, not the benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute.benchmark import SINGLE_GPU_SHAPES  # noqa: E402


def save_probe_json(path, fields: dict, argv=None) -> None:
    """A probe's JSON (when ``path`` is set): the command that made it, the GPU, ``fields``."""
    if not path:
        return
    script = "tools/" + sys.argv[0].rsplit("/", 1)[-1]
    doc = {"command": " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)]),
           "gpu": torch.cuda.get_device_name(), **fields}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def probe_shapes(shapes: str, probe, path, argv=None, doc: dict | None = None) -> dict:
    """``probe(name)`` for each name of the comma list ``shapes``, appended to
    ``doc["shapes"]``; the JSON (``save_probe_json``) is saved after every shape, so a probe
    killed at its time limit keeps the shapes it finished."""
    doc = {"shapes": []} if doc is None else doc
    for name in shapes.split(","):
        if name:
            doc["shapes"].append(probe(name))
            save_probe_json(path, doc, argv)
    return doc


def layer_call(name: str, seed: int = 1):
    """A single-GPU shape's random problem on the GPU and ``forward(config)``: one
    ``mok_cute.moe_forward`` call of it (with its shared expert) under ``config``."""
    import mok_cute
    from mok_cute import benchmark as bm

    p = bm.make_problem(bm.resolve_shape(name), device="cuda", seed=seed)
    i = p.inputs

    def forward(config):
        return mok_cute.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up,
                                    p.w_down, shared=p.shared, config=config)
    return p, forward


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


def profile_shape(name, T, H, I, E, K, reps):
    import mok_cute as mok
    from mok_cute import ops, schedule
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
        layer = lambda: mok.moe_forward(x, topk_idx, topk_w, wg, wu, wd, config=cfg)  # noqa: E731
        rows["layer (api)"] = gpu_ms(layer, reps)
        rows["layer host time"] = host_ms(layer)
        direct = lambda: ops.moe_forward_kernel(x, topk_idx, topk_w, wg, wu, wd, None, cfg)  # noqa: E731
        rows["layer (ops, no api checks)"] = gpu_ms(direct, reps)
        rows["ops host time"] = host_ms(direct)
        build = lambda: schedule.build_receive_schedule(topk_idx.unsqueeze(0), 0, E, tile_m=128,  # noqa: E731
                                                        validate=False)
        rows["schedule"] = gpu_ms(build, reps)
        rows["schedule host time"] = host_ms(build)
        sched = build()
        rows["gather x"] = gpu_ms(lambda: token_ops.gather_rows(x, sched.row_token), reps)
        xr = token_ops.gather_rows(x, sched.row_token)
        rows["fc1"] = gpu_ms(lambda: ops.grouped_gemm(xr, wg, sched.tile_expert, sched.num_tiles,
                                                      "swiglu", w_up=wu), reps)
        h = ops.grouped_gemm(xr, wg, sched.tile_expert, sched.num_tiles, "swiglu", w_up=wu)
        rows["fc2"] = gpu_ms(lambda: ops.grouped_gemm(h, wd, sched.tile_expert, sched.num_tiles), reps)
        y = ops.grouped_gemm(h, wd, sched.tile_expert, sched.num_tiles)
        ros = schedule.row_of_slot(sched, T, K).to(torch.int32)
        rows["row_of_slot"] = gpu_ms(lambda: schedule.row_of_slot(sched, T, K).to(torch.int32), reps)
        rows["k-sum (gather)"] = gpu_ms(lambda: token_ops.weighted_ksum(y, topk_w, row_index=ros), reps)
    print(f"{name}: T={T} H={H} I={I} E={E} K={K}")
    for key, ms in rows.items():
        extra = f"{flops / ms / 1e9:7.1f} TFLOP/s" if key.startswith("layer (") else ""
        print(f"  {key:30s} {ms:8.3f} ms {extra}")
    return {"shape": name, "T": T, "H": H, "I": I, "E": E, "K": K, "ms": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="dsv3_ep8_rank")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = []
    for name in args.shapes.split(","):
        s = SINGLE_GPU_SHAPES[name]
        out.append(profile_shape(name, s.tokens, s.hidden, s.intermediate, s.experts, s.top_k,
                                 reps=args.reps))
    save_probe_json(args.json, {"profiles": out})


if __name__ == "__main__":
    main()
