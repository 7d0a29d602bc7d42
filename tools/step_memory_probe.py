"""One training step's peak memory (``mok_cute.moe_forward``, backend="kernel", bf16) with the
backward as it is (each workspace dropped after its last reader, ``expert_backward``) against
the same backward with every routed workspace held to the step's end (the order before the
drops: the gathered d_out / x rows and the dgrads' outputs kept by a reference each).

    python tools/step_memory_probe.py [--shapes dsv3_ep8_rank,qwen3_30b] [--json out.json]

Peak: ``torch.cuda.max_memory_allocated`` over the second of two steps, above what was allocated
before it (weights, inputs, d_out). The bench records the first number per contender as
``step_peak_bytes`` (``mok-cute bench --train``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute.shapes import shape_names  # noqa: E402

HELD: list = []


def _holding(fn):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        HELD.append(out)
        return out
    return wrapped


def step_peak(problem, d_out) -> int:
    import mok_cute as mok

    leaves = [t.detach().requires_grad_(True) for t in (
        problem.inputs.x, problem.inputs.topk_weights, problem.w_gate, problem.w_up, problem.w_down)]
    x, w, wg, wu, wd = leaves
    config = mok.MoKConfig(check_ids=False)

    def step():
        mok.moe_forward(x, problem.inputs.topk_idx, w, wg, wu, wd, config=config).backward(d_out)
        torch.cuda.synchronize()
        HELD.clear()

    step()
    for t in leaves:
        t.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    return torch.cuda.max_memory_allocated() - base


def main(argv=None) -> int:
    from mok_cute import expert_backward as eb
    from mok_cute.bench.problems import make_problem
    from mok_cute.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="dsv3_ep8_rank,qwen3_30b,sonic_120b,mixtral,gptoss_120b")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results = {}
    for name in shape_names(args.shapes):
        problem = make_problem(SHAPES[name], torch.device("cuda"), seed=0)
        d_out = torch.randn_like(problem.inputs.x)
        dropped = step_peak(problem, d_out)
        kept = (eb.routed_rows, eb._dgrads)
        eb.routed_rows, eb._dgrads = _holding(kept[0]), _holding(kept[1])
        try:
            held = step_peak(problem, d_out)
        finally:
            eb.routed_rows, eb._dgrads = kept
        results[name] = {"step_peak_gb": dropped / 1e9, "all_held_gb": held / 1e9}
        print(f"{name:14s} step peak {dropped / 1e9:6.2f} GB, every workspace held "
              f"{held / 1e9:6.2f} GB", flush=True)
        del problem, d_out
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
