"""What the H200's power cap leaves for a whole layer: the expert path against its own GEMMs
and against cuBLAS doing the same FLOPs with no routing at all, each run sustained.

    python tools/cap_ceiling_probe.py --shapes dsv3_ep8_rank,sonic_120b [--seconds 2 --rounds 3] [--json F]

The bench runs every contender warm, at the 700 W cap (fifteenth session), where a kernel's
speed is its work per joule. Issue 3 asks for 1.10 x SonicMoE, which runs level with the
expert path (run 149). Whether any layer built on these GEMMs can get there shows in one
sustained comparison. Each variant runs back to back for ``--seconds`` under the SM clock and
power sampler; variants alternate, odd rounds reversed:
- ``layer``: ``moe_forward`` on the expert path (``check_ids=False``);
- ``gemms``: its FC1 + FC2 alone (``expert_path.expert_mlp`` on one call's scattered rows and
  schedule): no schedule build, scatter or k-sum;
- ``cublas_pair``: ``torch.mm`` doing the layer's FLOPs as two dense GEMMs, all T*K rows
  against one expert's gate+up weights, then the down weights (no SwiGLU): the best-known
  GEMMs with nothing of routing left;
- ``ours_dense_pair``: ``cublas_pair``'s two dense GEMMs on this package's kernels (one
  expert holding all the rows, store epilogues, FC2 pingpong where the layer's is): whether
  the gap to cuBLAS is the kernels or the routing;
- ``cublas_8192``: the 8192^3 bf16 GEMM, the bench's ceiling (its own TFLOP/s);
- ``sonicmoe`` (only when named in ``--variants``): SonicMoE's forward on the same inputs, as
  the bench runs it, for the same comparison sustained (its first call on a shape compiles
  and autotunes for minutes: warm ``--quack-cache`` first, ``gpu_check.sh sonic``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute import expert_path  # noqa: E402
from mok_cute.bench.gpu_clock import ClockSampler  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
from mok_cute.constants import TILE_M  # noqa: E402
from clock_probe import sampled_run  # noqa: E402
from layer_profile import layer_call, probe_shapes  # noqa: E402


def variants(name: str, only: tuple[str, ...] = (), quack_cache: str | None = None) -> tuple[dict, dict]:
    """{label: callable} and {label: FLOPs per call} for one shape (``only``: these labels)."""
    p, forward = layer_call(name)
    i, s = p.inputs, p.shape
    tokens, k = i.topk_idx.shape
    rows = tokens * k
    config = MoKConfig(check_ids=False)
    options = config.expert_path
    sched, _, x_rows = expert_path.expert_rows(i.x, i.topk_idx, p.w_gate.shape[0])
    gen = torch.Generator(device="cuda").manual_seed(2)
    dense = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    # the layer leaves its padding rows as allocated: give them random values (operands that
    # toggle, as garbage does), not whatever zeros the allocator may hand out here
    x_rows = torch.where((sched.row_token < 0).unsqueeze(1), dense(*x_rows.shape), x_rows)
    x_all, h_all = dense(rows, s.hidden), dense(rows, s.intermediate)
    w_gate_up, w_down = dense(2 * s.intermediate, s.hidden), dense(s.hidden, s.intermediate)
    a8192, b8192 = dense(8192, 8192), dense(8192, 8192)
    one_expert = torch.zeros(-(-rows // TILE_M), dtype=torch.int32, device="cuda")
    dense_tiles = torch.tensor([rows // TILE_M], dtype=torch.int32, device="cuda")
    fc2_pingpong = options.fc2_pingpong(s.intermediate)
    runs = {
        "layer": lambda: forward(config),
        "gemms": lambda: expert_path.expert_mlp(x_rows, p.w_gate, p.w_up, p.w_down, sched.tile_expert,
                                                sched.num_tiles, options),
        "cublas_pair": lambda: (torch.mm(x_all, w_gate_up.t()), torch.mm(h_all, w_down.t())),
        "ours_dense_pair": lambda: (
            expert_path.grouped_gemm(x_all, w_gate_up.unsqueeze(0), one_expert, dense_tiles,
                                     group_m=options.fc1_group_m),
            expert_path.grouped_gemm(h_all, w_down.unsqueeze(0), one_expert, dense_tiles,
                                     group_m=options.fc2_group_m, pingpong=fc2_pingpong,
                                     tile_n=128 if fc2_pingpong else None)),
        "cublas_8192": lambda: torch.mm(a8192, b8192),
    }
    runs = {k: v for k, v in runs.items() if not only or k in only}
    if "sonicmoe" in only:
        from mok_cute.bench import harness

        ctx = harness.BenchContext(device=torch.device("cuda"), out_dir=Path("."),
                                   quack_cache=Path(quack_cache) if quack_cache else None)
        sonic_run, _ = harness.CONTENDERS["sonicmoe"](p, ctx)
        runs["sonicmoe"] = lambda: sonic_run(i)
    flops = {label: p.flops for label in runs}
    flops["cublas_8192"] = 2.0 * 8192 ** 3
    return runs, flops


def probe(name: str, seconds: float, rounds: int, only: tuple[str, ...] = (),
          quack_cache: str | None = None) -> dict:
    with torch.no_grad():
        runs, flops = variants(name, only, quack_cache)
        for fn in runs.values():  # compile and warm every variant once
            fn()
        torch.cuda.synchronize()
        rows = {k: [] for k in runs}
        with ClockSampler(torch.cuda.current_device()) as sampler:
            for r in range(rounds):
                order = list(runs.items())
                for label, fn in (order if r % 2 == 0 else order[::-1]):
                    row = sampled_run(fn, seconds, sampler, f"{label}#{r}")
                    row["tflops"] = flops[label] / row["ms_per_call"] / 1e9
                    rows[label].append(row)
                    print(f"{name} round {r} {label}: {row['ms_per_call']:.3f} ms, "
                          f"{row['tflops']:.1f} TFLOP/s, SM {row.get('sm_mhz_median')} MHz, "
                          f"{row.get('power_w_mean')} W", flush=True)
    # round 0 starts on a cool GPU: the summary is of the later rounds
    later = {k: v[1:] or v for k, v in rows.items()}
    summary = {k: {"ms_median": statistics.median(x["ms_per_call"] for x in v),
                   "tflops_median": statistics.median(x["tflops"] for x in v)}
               for k, v in later.items()}
    for k, v in summary.items():
        print(f"{name} {k}: {v['ms_median']:.3f} ms, {v['tflops_median']:.1f} TFLOP/s "
              f"(rounds 1..{rounds - 1})", flush=True)
    del runs
    torch.cuda.empty_cache()
    return {"shape": name, "rounds": rows, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3_ep8_rank,sonic_120b")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="", help="comma list of labels (default: all)")
    ap.add_argument("--quack-cache", default=None, help="QUACK_CACHE_DIR for the sonicmoe variant")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    only = tuple(v for v in a.variants.split(",") if v)
    probe_shapes(a.shapes, lambda s: probe(s, a.seconds, a.rounds, only, a.quack_cache), a.json, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
