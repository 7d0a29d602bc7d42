"""The backward over a group's buffers (``group_backward``: pulls, per-rank dgrads, pushes,
weight gradients, two barriers, k-sums) against the virtual ranks' backward
(``virtual_backward``: no comm, one backward-megakernel launch for every rank) on the same
saved forward, R virtual ranks on one GPU, in interleaved rounds. What it shows: the cost of
the group form's copies, barriers and per-rank launches where no NVLink is crossed (on real
ranks the copies cross NVLink and the ranks run side by side).

    python tools/group_backward_probe.py --shapes glm_5.2,qwen3.5_397b [--ranks 8]
        [--tokens 2048] [--rounds 3] [--json out.json]

A probe for issue 32's development, not the benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from tools.layer_profile import gpu_ms  # noqa: E402


def probe(name: str, ranks: int, tokens: int, rounds: int, reps: int) -> dict:
    import mok_cute
    from mok_cute import megakernel
    from mok_cute.bench.problems import make_problem
    from mok_cute.group_backward import moe_backward_group
    from mok_cute.shapes import resolve_shape
    from mok_cute.virtual_backward import VirtualSaved, moe_backward_virtual

    shape = resolve_shape(name)
    p = make_problem(shape, device="cuda", seed=1, tokens=ranks * tokens)
    per_rank = lambda a: a.view(ranks, a.shape[0] // ranks, *a.shape[1:])  # noqa: E731
    xs, idx, w = (per_rank(t) for t in (p.inputs.x, p.inputs.topk_idx, p.inputs.topk_weights))
    wg, wu, wd = (per_rank(t) for t in (p.w_gate, p.w_up, p.w_down))
    shared = tuple(t.unsqueeze(0).expand(ranks, *t.shape).contiguous()
                   for t in p.shared) if p.shared else None
    config = mok_cute.MoKConfig(check_ids=False)
    with torch.no_grad():
        _, saved = megakernel.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared, config,
                                                  save=True)
    d_out = torch.randn_like(xs)
    virtual_saved = VirtualSaved.from_forward(saved)

    def virtual():
        return moe_backward_virtual(d_out, xs, w, wg, wu, wd, shared, virtual_saved)

    def group():
        return moe_backward_group(d_out, xs, idx, w, wg, wu, wd, shared, saved)

    same = all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(virtual(), group()))
    torch.cuda.synchronize()
    mok_cute.check_errors()
    variants = {"virtual backward": virtual, "group backward": group}
    ms = {label: [] for label in variants}
    for r in range(rounds):
        for label in (variants if r % 2 == 0 else list(variants)[::-1]):
            ms[label].append(gpu_ms(variants[label], reps))
    median = {label: sorted(v)[len(v) // 2] for label, v in ms.items()}
    for label, v in ms.items():
        print(f"{name} R={ranks} {label:18s} " + " ".join(f"{t:8.3f}" for t in v)
              + f"  median {median[label]:8.3f} ms", flush=True)
    ratio = median["group backward"] / median["virtual backward"]
    print(f"{name} R={ranks}: group / virtual {ratio:.3f}, gradients bitwise equal: {same}",
          flush=True)
    return {"shape": name, "ranks": ranks, "tokens_per_rank": tokens, "ms_rounds": ms,
            "ms_median": median, "group_over_virtual": ratio, "bitwise_equal": same}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="glm_5.2,qwen3.5_397b")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    for n in args.shapes.split(","):
        rows.append(probe(n, args.ranks, args.tokens, args.rounds, args.reps))
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python tools/group_backward_probe.py "
                       + " ".join(sys.argv[1:] if argv is None else argv),
                       "gpu": torch.cuda.get_device_name(), "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
