"""EXPERIMENT probe (lead 6, ``kernels.common.EXPERIMENT_PDL``): the one-GPU path's launches
with programmatic dependent launch (each kernel's prologue under the previous launch's tail,
its first global access after ``griddepcontrol.wait``) against the product's plain launches,
as the layer's forward and training step (forward + backward) in bf16 and FP8, in interleaved
rounds with the SM clock. Every PDL output and gradient must be bitwise the product's.

    python tools/pdl_probe.py [--shapes single] [--precisions bf16,fp8] [--rounds 4] [--json F]

Each variant compiles its own kernels (``mok_cute.jit``'s cache swapped per variant: the
switch is read when a kernel is traced, not part of the cache key).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute import jit  # noqa: E402
from mok_cute.bench.gpu_clock import ClockSampler  # noqa: E402
from mok_cute.kernels import common  # noqa: E402
from mok_cute.shapes import shape_names  # noqa: E402
from layer_profile import gpu_ms, layer_call, save_probe_json  # noqa: E402

CACHES = {"plain": {}, "pdl": {}}


def variant(name: str, fn):
    def run():
        kept, common.EXPERIMENT_PDL["on"] = jit._CACHE, name == "pdl"
        jit._CACHE = CACHES[name]
        try:
            return fn()
        finally:
            jit._CACHE, common.EXPERIMENT_PDL["on"] = kept, False
    return run


def same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return all(same(x, y) for x, y in zip(a, b))
    return bool(torch.equal(a, b))


def shape(name: str, precision: str, rounds: int, reps: int) -> dict:
    import mok_cute as mok

    p, forward = layer_call(name)
    cfg = mok.MoKConfig(backend="kernel", precision=precision, check_ids=False)
    i = p.inputs
    leaves = [t.detach().requires_grad_() for t in (i.x, p.w_gate, p.w_up, p.w_down)]
    d_out = torch.randn_like(i.x)

    def infer():
        with torch.no_grad():
            return forward(cfg)

    def step():
        out = mok.moe_forward(leaves[0], i.topk_idx, i.topk_weights, *leaves[1:],
                              shared=p.shared, config=cfg)
        return (out.detach(), *torch.autograd.grad(out, leaves, d_out))
    runs = {f"{v} {kind}": variant(v, fn) for kind, fn in (("fwd", infer), ("train", step))
            for v in ("plain", "pdl")}
    got = {k: f() for k, f in runs.items()}
    bitwise = {kind: same(got[f"plain {kind}"], got[f"pdl {kind}"]) for kind in ("fwd", "train")}
    bitwise["pdl train repeat"] = same(runs["pdl train"](), got["pdl train"])
    del got
    times = {k: [] for k in runs}
    with ClockSampler() as clock:
        for r in range(rounds):
            for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                with clock.window(k):
                    times[k].append(gpu_ms(runs[k], reps))
        clocks = {k: (clock.stats(k) or {}).get("sm_mhz_median") for k in runs}
    ratio = {kind: statistics.median(a / b for a, b in zip(times[f"pdl {kind}"],
                                                           times[f"plain {kind}"]))
             for kind in ("fwd", "train")}
    print(f"{name} {precision}: bitwise {bitwise}  " + "  ".join(
        f"{k} {statistics.median(v):.3f} ms @{clocks[k]}" for k, v in times.items())
        + f"  pdl/plain fwd {ratio['fwd']:.3f} train {ratio['train']:.3f}", flush=True)
    return {"shape": name, "precision": precision, "bitwise": bitwise, "ms": times,
            "clock_mhz": clocks, "pdl_over_plain": ratio}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="single")
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    doc = {"shapes": []}
    for name in shape_names(args.shapes):
        for precision in args.precisions.split(","):
            doc["shapes"].append(shape(name, precision, args.rounds, args.reps))
            save_probe_json(args.json, doc, argv)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
