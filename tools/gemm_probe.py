"""Time the grouped GEMM alone (FC1 swiglu / FC2 store) against torch._grouped_mm and a
dense cuBLAS GEMM of the same FLOPs, for variants of tile_n and group_m.

    python tools/gemm_probe.py --shapes dsv3_ep8_rank,qwen3_30b [--json out.json]

A probe for tuning, not the benchmark of record (that is tools/bench.py).
"""

from __future__ import annotations

import argparse

import torch

from layer_profile import save_probe_json  # tools/ is on sys.path when run as a script

SHAPES = {  # T, H, I, E, K
    "dsv3_ep8_rank": (4096, 7168, 2048, 32, 8),
    "qwen3_30b": (16384, 2048, 768, 128, 8),
    "sonic_120b": (32768, 4096, 2048, 64, 4),
    "mixtral": (8192, 4096, 14336, 8, 2),
    "gptoss_120b": (8192, 2880, 2880, 128, 4),
}


def bench_ms(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def _print_row(r):
    if "error" in r:
        print(f"{r['shape']:14s} {r['stage']} {r['impl']:32s} ERROR {r['error']}", flush=True)
    else:
        bits = f" bitwise={r['bitwise_equal_plain']}" if "bitwise_equal_plain" in r else ""
        best = f" (best {r['best_ms']:.3f})" if "best_ms" in r else ""
        print(f"{r['shape']:14s} {r['stage']} {r['impl']:32s} {r['ms']:8.3f} ms{best} "
              f"{r['tflops']:7.1f} TFLOP/s{bits}", flush=True)


def main(argv=None):
    from mok_cute import jit, ops
    from mok_cute.kernels import gemm_sm90
    from mok_cute.timeline import TimelineBuffer

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="dsv3_ep8_rank")
    p.add_argument("--variants", default="256:8,256:16,128:8,128p:8",
                   help="tile_n:group_m; 'p' after tile_n = pingpong ('po': with "
                        "gemm_sm90.FIRST_MMA_OVERWRITES), 't' after group_m = with the recorder "
                        "(MoKConfig(timeline=True)'s per-tile records), 'c' after tile_n = "
                        "clusters of two CTAs multicasting B (ops.GEMM_CLUSTER_M = 2; its output "
                        "is compared bitwise with the plain kernel's)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every variant this many times in turn (odd rounds reversed); "
                        "rows report the median round and the best")
    p.add_argument("--iters", type=int, default=20, help="timed calls per round (median)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = "cuda"
    rows = []
    grids = {f"cluster_{c}": ops._persistent_grid(0, c) for c in (1, 2)}  # CTAs of the grid
    print("persistent grid (CTAs):", grids, flush=True)
    for name in args.shapes.split(","):
        T, H, I, E, K = SHAPES[name]
        per_expert = T * K // E
        counts = [per_expert] * E
        tiles = [(c + 127) // 128 for c in counts]
        tile_expert = torch.tensor([e for e, t in enumerate(tiles) for _ in range(t)],
                                   dtype=torch.int32, device=dev)
        num_tiles = torch.tensor([sum(tiles)], dtype=torch.int32, device=dev)
        M = sum(tiles) * 128
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        wg = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) / H ** 0.5
        wu = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) / H ** 0.5
        w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) / I ** 0.5
        h = torch.randn(M, I, device=dev, dtype=torch.bfloat16)
        offs = torch.cumsum(torch.tensor([t * 128 for t in tiles], device=dev), 0).to(torch.int32)
        for stage, a, w, w_up, epi in (("fc1", x, wg, wu, "swiglu"), ("fc2", h, w2, None, "store")):
            n = w.shape[1] * (2 if epi == "swiglu" else 1)
            flops = 2 * M * n * a.shape[1]
            plain = {}  # (tile_n, group_m) -> the plain kernel's output, for the cluster rows
            timed = []  # (row, run) of every variant that built
            for var in args.variants.split(","):
                tn_s, gm_s = var.split(":")
                pp, rec, over = "p" in tn_s, gm_s.endswith("t"), tn_s.endswith("po")
                cl = 2 if "c" in tn_s else 1
                tn, gm = int(tn_s.rstrip("poc")), int(gm_s.rstrip("t"))
                recorder = TimelineBuffer(1 << 16, device=dev) if rec else None

                def run(tn=tn, gm=gm, pp=pp, recorder=recorder, cl=cl, over=over):
                    if gemm_sm90.FIRST_MMA_OVERWRITES != over:  # read when a kernel is built:
                        gemm_sm90.FIRST_MMA_OVERWRITES = over  # the cache key does not hold it
                        jit.clear_cache()
                    if recorder is not None:  # as a recorded layer call: a fresh header each call
                        recorder.reset()
                    before, ops.GEMM_CLUSTER_M = ops.GEMM_CLUSTER_M, cl
                    try:
                        return ops.grouped_gemm(a, w, tile_expert, num_tiles, epi, tile_n=tn,
                                                group_m=gm, w_up=w_up, pingpong=pp,
                                                task_type=int(stage == "fc2") + 1,
                                                timeline=None if recorder is None else recorder.tensor)
                    finally:
                        ops.GEMM_CLUSTER_M = before
                impl = (f"mok tile_n={tn} group_m={gm}{' pingpong' if pp else ''}"
                        f"{' overwrite' if over else ''}{' recorder' if rec else ''}"
                        f"{' cluster 2' if cl > 1 else ''}")
                try:
                    out = run()
                    if cl == 1 and not pp:
                        plain[(tn, gm)] = out
                    row = dict(shape=name, stage=stage, impl=impl, ms_rounds=[])
                    if cl > 1 and (tn, gm) in plain:
                        row["bitwise_equal_plain"] = bool(torch.equal(out, plain[(tn, gm)]))
                    timed.append((row, run))
                except Exception as exc:  # record and continue with the other variants
                    rows.append(dict(shape=name, stage=stage, impl=impl, error=repr(exc)[:300]))
                    _print_row(rows[-1])
            # every variant timed once per round, odd rounds in reverse: the clock falls as the
            # GPU heats, so a fixed order would hand the first variant the fastest slot
            for r in range(args.rounds):
                for row, run in (timed if r % 2 == 0 else timed[::-1]):
                    row["ms_rounds"].append(bench_ms(run, iters=args.iters))
            for row, _ in timed:
                row["ms"] = sorted(row["ms_rounds"])[len(row["ms_rounds"]) // 2]
                row["best_ms"] = min(row["ms_rounds"])
                row["tflops"] = flops / row["ms"] / 1e9
                rows.append(row)
                _print_row(row)
            try:
                wt = (torch.cat([w, w_up], 1) if w_up is not None else w).transpose(1, 2)
                ms = bench_ms(lambda: torch._grouped_mm(a, wt, offs=offs))
                rows.append(dict(shape=name, stage=stage, impl="torch._grouped_mm", ms=ms,
                                 tflops=flops / ms / 1e9))
            except Exception as exc:
                rows.append(dict(shape=name, stage=stage, impl="torch._grouped_mm", error=repr(exc)[:300]))
            _print_row(rows[-1])
            dense_b = torch.cat([w[0], w_up[0]]) if w_up is not None else w[0]
            ms = bench_ms(lambda: a @ dense_b.T)
            rows.append(dict(shape=name, stage=stage, impl="cublas dense (one weight)", ms=ms,
                             tflops=flops / ms / 1e9))
            _print_row(rows[-1])
    save_probe_json(args.json, {"grid_ctas": grids, "rows": rows}, argv)


if __name__ == "__main__":
    main()
