"""Where the fused k-sum's time goes (ops.KSUM_IN_FC2, gemm_sm90's ksum_top_k).

    python tools/ksum_fc2_probe.py --shapes dsv3_ep8_rank,sonic_120b [--rounds 4] [--json F]

The layer on the expert path, interleaved rounds of 10 calls each (CUDA events), against
the fused k-sum built in stages (``gemm_sm90.KSUM_STAGES``): 0 FC1 + FC2 with no k-sum at all
(the ceiling of what fusing can gain), 1 plus each tile's stores-landed wait and barrier,
2 plus the counting atomics, 3 the whole fused k-sum; and the whole of it deferred by one tile
(``ops.KSUM_IN_FC2_DEFERRED``: no wait for the stores to land). Stages 0-2 do not write
``out``: the two whole variants are checked bitwise against the k-sum kernel. A diagnostic,
not a benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute import ops  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
from mok_cute.kernels import gemm_sm90  # noqa: E402
from layer_profile import gpu_ms, layer_call, probe_shapes  # noqa: E402

# label: (KSUM_IN_FC2, KSUM_STAGES, KSUM_IN_FC2_DEFERRED)
VARIANTS = {"expert_kernels": (False, 3, False), "stage0_no_ksum": (True, 0, False),
            "stage1_store_wait": (True, 1, False), "stage2_counts": (True, 2, False),
            "stage3_fused": (True, 3, False), "fused_deferred": (True, 3, True)}
CHECKED = ("stage3_fused", "fused_deferred")


def probe(name: str, rounds: int) -> dict:
    _, forward = layer_call(name)
    config = MoKConfig(check_ids=False)
    with torch.no_grad():
        ops.KSUM_IN_FC2 = False
        base_out = forward(config).clone()
        results = {}
        for r in range(rounds):
            order = list(VARIANTS.items())
            for label, (fused, stages, deferred) in (order if r % 2 == 0 else order[::-1]):
                ops.KSUM_IN_FC2, ops.KSUM_IN_FC2_DEFERRED = fused, deferred
                gemm_sm90.KSUM_STAGES = stages  # part of the FC2 kernel's compile key
                if r == 0 and label in CHECKED:
                    out = forward(config)
                    torch.cuda.synchronize()
                    assert torch.equal(out, base_out), f"{name}: {label} changed the bits"
                results.setdefault(label, []).append(gpu_ms(lambda: forward(config)))
        ops.KSUM_IN_FC2 = ops.KSUM_IN_FC2_DEFERRED = False
        gemm_sm90.KSUM_STAGES = 3
    base = results["expert_kernels"]
    summary = {}
    for label, times in results.items():
        summary[label] = {"ms_median": statistics.median(times),
                          "paired_vs_expert": statistics.median(t / b for t, b in zip(times, base))}
        print(f"{name} {label}: {summary[label]['ms_median']:.3f} ms, paired "
              f"{summary[label]['paired_vs_expert']:.3f}", flush=True)
    return {"shape": name, "rounds": results, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3_ep8_rank,sonic_120b")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    probe_shapes(a.shapes, lambda s: probe(s, a.rounds), a.json, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
