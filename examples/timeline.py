"""See where the SMs go in one MoE layer call: record its per-SM timeline and export it.

Run on a GPU host:

    python examples/timeline.py --out out/timeline_example

It runs `mok_cute.moe_forward` with `MoKConfig(timeline=True)`, which compiles the kernels
with the in-kernel recorder on, then writes

* `trace.json`: open it in https://ui.perfetto.dev (one process per rank, one thread per SM);
* `swimlanes.png`: SM on y, time on x, comm SMs on top, waits hatched grey;
* a terminal summary: busy / wait / idle per role, GEMM TFLOP/s, communication left exposed.

Without a GPU nothing can be recorded; `--synthetic` then shows the same views on a made-up
recording (clearly labelled, not a measurement).
"""

import argparse
import sys
from pathlib import Path

import torch

import mok_cute
from mok_cute import timeline
from mok_cute.shapes import moe_flops


def record(tokens: int, hidden: int, intermediate: int, experts: int, top_k: int) -> timeline.Timeline | None:
    """Run one layer with the recorder on and return its decoded timeline (None if none)."""
    device = "cuda"
    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    topk_idx = torch.rand(tokens, experts, device=device).topk(top_k, dim=1).indices.to(torch.int32)
    topk_weights = torch.softmax(torch.randn(tokens, top_k, device=device), dim=1)
    w_gate = (torch.randn(experts, intermediate, hidden, device=device) * hidden**-0.5).to(torch.bfloat16)
    w_up = (torch.randn(experts, intermediate, hidden, device=device) * hidden**-0.5).to(torch.bfloat16)
    w_down = (torch.randn(experts, hidden, intermediate, device=device) * intermediate**-0.5).to(torch.bfloat16)

    config = mok_cute.MoKConfig(timeline=True)
    print("path:", mok_cute.forward_path(device, config))
    timeline.set_last(None)
    for _ in range(2):  # the first call compiles; record the second
        mok_cute.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, config=config)
    torch.cuda.synchronize()
    buffer = timeline.last()  # the kernel path publishes the buffer of its last recorded call
    return None if buffer is None else buffer.decode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/timeline_example")
    parser.add_argument("--synthetic", action="store_true", help="without a recording, show the views on made-up data")
    args = parser.parse_args()
    out = Path(args.out)

    tokens, hidden, intermediate, experts, top_k = 4096, 4096, 2048, 32, 8
    tl = record(tokens, hidden, intermediate, experts, top_k) if torch.cuda.is_available() else None
    sizes = {}
    if tl is not None:
        title = f"T={tokens} H={hidden} I={intermediate} E={experts} K={top_k} on {torch.cuda.get_device_name()}"
        rows_bytes = tokens * top_k * hidden * 2  # bf16 rows moved by dispatch, and again by combine
        sizes = dict(flops=moe_flops(tokens, hidden, intermediate, top_k), dispatch_bytes=rows_bytes, combine_bytes=rows_bytes)
    elif args.synthetic:
        print("No recording (no GPU or no recorder on this path): showing a SYNTHETIC timeline instead.")
        tl = timeline.decode(timeline.synthetic_buffer(num_ranks=1, num_comm_sms=4, num_compute_sms=12))
        title = "SYNTHETIC timeline (made-up durations)"
    else:
        print("No timeline was recorded: this needs a CUDA GPU and the kernel path. Try --synthetic.")
        return 1

    print("trace:", timeline.write_chrome_trace(tl, out / "trace.json"))
    print("png:  ", timeline.plot_swimlanes(tl, out / "swimlanes.png", title=title))
    timeline.print_summary(tl, title=title, **sizes)
    for problem in tl.check():
        print("check:", problem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
