"""Where the recorder's cost comes from: the expert path with ``MoKConfig(timeline=True)``
against without, timed four ways in alternating rounds (the H200's clock drifts in a process):

    python tools/recorder_probe.py --shapes qwen3_30b,dsv3_ep8_rank [--json out.json]

- ``events``: back-to-back calls between two CUDA events (GPU time, host gaps included);
- ``graph``: the call replayed from a CUDA graph (no host work in the timed region);
- ``host``: host time of one call (launch cost);
- ``alloc_only``: timeline off, plus the per-call ``TimelineBuffer`` the recorded call makes.
If ``graph`` shows no gap but ``events`` does, the cost is on the host; if both do, it is on
the GPU. A probe for issue 5, not the benchmark of record (``mok-cute bench``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute.config import MoKConfig  # noqa: E402
from mok_cute.timeline import TimelineBuffer  # noqa: E402
from layer_profile import gpu_ms, host_ms, layer_call, save_probe_json  # noqa: E402
from schedule_probe import graph_ms  # noqa: E402


def probe(name: str, rounds: int) -> dict:
    p, forward = layer_call(name)
    i = p.inputs
    off, on = MoKConfig(check_ids=False), MoKConfig(check_ids=False, timeline=True)
    run_off = lambda: forward(off)  # noqa: E731
    run_on = lambda: forward(on)  # noqa: E731

    def run_alloc():
        TimelineBuffer(on.timeline_capacity, device=i.x.device)
        return run_off()

    variants = {"off": run_off, "on": run_on, "alloc_only": run_alloc}
    assert torch.equal(run_off(), run_on()), "the recorder changed the output"
    times = {f"{v}_{how}": [] for v in variants for how in ("events", "graph", "host")}
    for r in range(rounds):
        for v in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            fn = variants[v]
            times[f"{v}_events"].append(gpu_ms(fn, 10))
            times[f"{v}_graph"].append(graph_ms(fn, 10))
            times[f"{v}_host"].append(host_ms(fn, 5))
    med = {k: sorted(t)[len(t) // 2] for k, t in times.items()}
    row = {"shape": name, "median_ms": med, "rounds_ms": times,
           "overhead_events": med["on_events"] / med["off_events"] - 1,
           "overhead_graph": med["on_graph"] / med["off_graph"] - 1}
    print(json.dumps({k: v for k, v in row.items() if k != "rounds_ms"}), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3_30b,dsv3_ep8_rank")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    save_probe_json(a.json, {"shapes": [probe(s, a.rounds) for s in a.shapes.split(",")]}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
