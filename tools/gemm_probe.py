"""Time the grouped GEMM alone (FC1 swiglu / FC2 store) against torch._grouped_mm and a
dense cuBLAS GEMM of the same FLOPs, for variants of tile_n, group_m and the pingpong kernel.

    python tools/gemm_probe.py --shapes dsv3_ep8_rank,qwen3_30b [--variants 256:8,128p:8] [--json out.json]

Every expert gets the same number of rows (T*K/E, padded to 128-row tiles). A variant is
``tile_n:group_m``, with ``p`` after tile_n for the pingpong kernel (two consumer warpgroups
on alternate 128-wide tiles) and ``t`` after group_m for the recorder on
(``MoKConfig(timeline=True)``'s per-tile records). A probe for tuning
``ExpertPathOptions``, not the benchmark of record (``mok-cute bench``).
"""

from __future__ import annotations

import argparse

import torch

from layer_profile import save_probe_json  # tools/ is on sys.path when run as a script (it adds the checkout)
from mok_cute.shapes import shape_names  # after layer_profile, which puts the checkout on sys.path


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
        best = f" (best {r['best_ms']:.3f})" if "best_ms" in r else ""
        print(f"{r['shape']:14s} {r['stage']} {r['impl']:32s} {r['ms']:8.3f} ms{best} "
              f"{r['tflops']:7.1f} TFLOP/s", flush=True)


def parse_variant(var: str) -> tuple[int, int, bool, bool]:
    """``tile_n[p]:group_m[t]`` -> (tile_n, group_m, pingpong, recorder)."""
    try:
        tn_s, gm_s = var.split(":")
        return int(tn_s.rstrip("p")), int(gm_s.rstrip("t")), tn_s.endswith("p"), gm_s.endswith("t")
    except ValueError:
        raise SystemExit(f"--variants: expected tile_n[p]:group_m[t], got {var!r}") from None


def main(argv=None):
    from mok_cute import expert_path
    from mok_cute.shapes import SINGLE_GPU_SHAPES
    from mok_cute.tasks import TaskType
    from mok_cute.timeline import TimelineBuffer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="dsv3_ep8_rank")
    p.add_argument("--variants", default="256:8,256:16,128:8,128p:8",
                   help="comma list of tile_n[p]:group_m[t] (p: pingpong, t: with the recorder)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every variant this many times in turn (odd rounds reversed); "
                        "rows report the median round and the best")
    p.add_argument("--iters", type=int, default=20, help="timed calls per round (median)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    variants = [parse_variant(v) for v in args.variants.split(",") if v]
    dev = "cuda"
    rows = []
    for name in shape_names(args.shapes):
        s = SINGLE_GPU_SHAPES[name]
        T, H, I, E, K = s.tokens, s.hidden, s.intermediate, s.experts, s.top_k
        per_expert = T * K // E
        tiles = [(per_expert + 127) // 128] * E
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
        for stage, a, w, w_up, epi, task in (("fc1", x, wg, wu, "swiglu", TaskType.FC1),
                                             ("fc2", h, w2, None, "store", TaskType.FC2)):
            n = w.shape[1] * (2 if epi == "swiglu" else 1)
            flops = 2 * M * n * a.shape[1]
            timed = []  # (row, run) of every variant that built
            for tn, gm, pp, rec in variants:
                recorder = TimelineBuffer(1 << 16, device=dev) if rec else None

                def run(tn=tn, gm=gm, pp=pp, recorder=recorder):
                    if recorder is not None:  # as a recorded layer call: a fresh header each call
                        recorder.reset()
                    return expert_path.grouped_gemm(a, w, tile_expert, num_tiles, epi, tile_n=tn,
                                                    group_m=gm, w_up=w_up, pingpong=pp, task_type=int(task),
                                                    timeline=None if recorder is None else recorder.tensor)
                impl = f"mok tile_n={tn} group_m={gm}{' pingpong' if pp else ''}{' recorder' if rec else ''}"
                try:
                    run()
                    timed.append((dict(shape=name, stage=stage, impl=impl, ms_rounds=[]), run))
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
    save_probe_json(args.json, {"rows": rows}, argv)


if __name__ == "__main__":
    main()
