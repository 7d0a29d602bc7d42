"""``mok-cute timeline``: record one layer call with the in-kernel timeline on and export it.

    mok-cute timeline --shape dsv3_ep8_rank --out out/timeline [--mok-config backend=megakernel]
    mok-cute timeline --shape kimi_k2.7 --ranks 8                      (virtual ranks, one GPU)
    mok-cute timeline --shape qwen3_30b --backward                     (the backward megakernel)
    mok-cute timeline --from out/timeline/timeline_buffer.npy           (decode a saved buffer)
    mok-cute timeline --synthetic                                        (the views on made-up data)

Writes a Chrome trace (open in https://ui.perfetto.dev), a PNG swimlane chart and a summary
(``mok_cute.timeline``: decode, export, summary, plot). The recording runs a random problem of
a named shape (``mok_cute.bench.problems``), which is why this command lives in the bench.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mok_cute import timeline
from mok_cute.bench.common import apply_config_overrides, forward_path_of, parse_config_overrides
from mok_cute.bench.results import chart_dependency_missing
from mok_cute.config import MoKConfig
from mok_cute.shapes import resolve_shape


DEFAULT_CAPACITY = 1 << 16


def capacity_for(tl: timeline.Timeline) -> int:
    """0 when ``tl`` kept every record, else a capacity that holds them all (what was written,
    rounded up to a power of two)."""
    return 0 if not tl.dropped else 1 << max(tl.written - 1, 1).bit_length()


def recorded_with_room(record, capacity: int, warmup: int, fixed: bool = False):
    """(buffer, decoded timeline) of ``record(capacity, calls)`` run ``warmup`` + 1 times,
    and once more with room for every record when that dropped some (unless the capacity is
    ``fixed``; the kernel is compiled by then); (None, None) when nothing was published."""
    tb = record(capacity, warmup + 1)
    tl = None if tb is None else tb.decode()
    if tl is not None and not fixed and capacity_for(tl):
        tb = record(capacity_for(tl), 1)
        tl = tb.decode()
    return tb, tl


def record_on_gpu(args: argparse.Namespace) -> tuple[timeline.Timeline | None, str, dict[str, Any]]:
    """Run a layer with recording on; returns (timeline or None, reason if None, summary sizes)."""
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA GPU is visible, so no kernel ran and nothing was recorded", {}
    import mok_cute
    from mok_cute.api import choose_path
    from mok_cute.bench.problems import make_problem

    shape = resolve_shape(args.shape)
    problem = make_problem(shape, device="cuda", seed=args.seed, t_scale=args.t_scale, ranks=args.ranks)
    capacity = DEFAULT_CAPACITY if args.capacity is None else args.capacity
    config = apply_config_overrides(MoKConfig(timeline=True, timeline_capacity=capacity),
                                    parse_config_overrides(args.mok_config))
    device = problem.inputs.x.device
    if args.ranks > 1:
        choice = choose_path(device, config, virtual=True)
        path = f"{choice.path}: {choice.reason}"
    else:
        path = forward_path_of(device, config)
    inp = problem.inputs
    virtual = problem.virtual(args.ranks) if args.ranks > 1 else None

    def record(capacity: int, calls: int):
        timeline.set_last(None)
        config_now = dataclasses.replace(config, timeline_capacity=capacity)
        for _ in range(calls):
            if virtual is not None:
                v = virtual
                mok_cute.moe_forward_virtual(v.x, v.topk_idx, v.topk_weights, v.w_gate, v.w_up, v.w_down, shared=v.shared, config=config_now)
            else:
                mok_cute.moe_forward(
                    inp.x, inp.topk_idx, inp.topk_weights, problem.w_gate, problem.w_up, problem.w_down,
                    shared=problem.shared, config=config_now,
                )
        torch.cuda.synchronize()
        return timeline.last()

    tb, tl = recorded_with_room(record, capacity, args.warmup, args.capacity is not None)
    sizes = {
        "flops": problem.flops,
        "dispatch_bytes": problem.routed_rows * shape.hidden * 2,
        "combine_bytes": problem.routed_rows * shape.hidden * 2,
    }
    if tb is None:
        return None, f"moe_forward ran on path {path!r} but published no timeline buffer (mok_cute.timeline.set_last)", sizes
    tl.meta.update({"shape": shape.name, "tokens": problem.tokens, "ranks": args.ranks, "path": path, "gpu": torch.cuda.get_device_name()})
    if args.out:
        tb.save(Path(args.out) / "timeline_buffer.npy")
    return tl, "", sizes


def record_backward_on_gpu(args: argparse.Namespace) -> tuple[timeline.Timeline | None, str, dict[str, Any]]:
    """Run the one-GPU training backward with every GEMM in the backward megakernel's one
    launch (``moe_backward(dgrads="megakernel")``, the shape's shared expert in it too), its
    recorder on; returns as ``record_on_gpu``. The forward runs unrecorded."""
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA GPU is visible, so no kernel ran and nothing was recorded", {}
    from mok_cute.bench.problems import make_problem
    from mok_cute.expert_backward import moe_backward
    from mok_cute.expert_path import moe_forward_kernel

    shape = resolve_shape(args.shape)
    problem = make_problem(shape, device="cuda", seed=args.seed, t_scale=args.t_scale)
    inp = problem.inputs
    weights = (problem.w_gate, problem.w_up, problem.w_down)
    with torch.no_grad():
        _, saved = moe_forward_kernel(inp.x, inp.topk_idx, inp.topk_weights, *weights,
                                      problem.shared, MoKConfig(backend="kernel", check_ids=False),
                                      save=True)
    d_out = torch.randn_like(inp.x)

    def record(capacity: int, calls: int) -> timeline.TimelineBuffer:
        tb = timeline.TimelineBuffer(capacity, device=inp.x.device)
        for _ in range(calls):
            tb.reset()
            moe_backward(d_out, inp.x, inp.topk_idx, inp.topk_weights, *weights, problem.shared,
                         saved, dgrads="megakernel", timeline=tb)
        torch.cuda.synchronize()
        return tb

    # a backward runs more tasks than a forward (dsv3_ep8_rank: 53k, most of them weight-gradient tiles)
    capacity = timeline.BACKWARD_CAPACITY if args.capacity is None else args.capacity
    tb, tl = recorded_with_room(record, capacity, args.warmup, args.capacity is not None)
    tl.meta.update({"shape": shape.name, "tokens": problem.tokens, "ranks": 1,
                    "path": "backward megakernel (one launch)", "pass": "bwd",
                    "gpu": torch.cuda.get_device_name()})
    if args.out:
        tb.save(Path(args.out) / "timeline_buffer.npy")
    # the backward's GEMMs: two dgrads and two weight gradients a forward GEMM
    return tl, "", {"flops": 2 * problem.flops, "dispatch_bytes": None, "combine_bytes": None}


def main(argv: Sequence[str] | None = None) -> int:
    """``mok-cute timeline``: record one layer call and write the trace, PNG and summary."""
    parser = argparse.ArgumentParser(
        prog="mok-cute timeline",
        description="Record a MoE layer call with the in-kernel timeline on and write a Chrome trace "
        "(open in https://ui.perfetto.dev), a PNG swimlane chart and a summary.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--from", dest="from_file", metavar="FILE.npy", help="decode a saved buffer instead of running")
    source.add_argument("--synthetic", action="store_true", help="decode a made-up recording (a demo of the views, not a measurement)")
    parser.add_argument("--out", default="out/timeline", help="output directory (default: out/timeline)")
    parser.add_argument("--shape", default="dsv3_ep8_rank", help="named shape of mok_cute.shapes (default dsv3_ep8_rank)")
    parser.add_argument("--t-scale", type=float, default=1.0, help="scale the shape's token count")
    parser.add_argument("--ranks", type=int, default=1, help="emulate R ranks on one GPU (moe_forward_virtual)")
    parser.add_argument("--backward", action="store_true",
                        help="record the training backward's one backward-megakernel launch (one rank) "
                        "instead of the forward")
    parser.add_argument("--capacity", type=int, default=None,
                        help=f"timeline capacity in records (default {DEFAULT_CAPACITY}, {timeline.BACKWARD_CAPACITY} "
                        "with --backward, and a second recording with room for every record when that "
                        "one dropped some)")
    parser.add_argument("--warmup", type=int, default=1, help="calls before the recorded one (compile, caches)")
    parser.add_argument("--mok-config", action="append", default=[], metavar="KEY=VALUE",
                        help="a MoKConfig field, dotted for an options field (megakernel.tickets=static); repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flops", type=float, default=None, help="layer FLOPs for the summary (with --from)")
    parser.add_argument("--bytes", type=float, default=None, help="dispatch = combine bytes for the summary (with --from)")
    args = parser.parse_args(list(argv) if argv is not None else None)

    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=140)
    missing = chart_dependency_missing()  # the swimlane PNG
    if missing:
        console.print(f"[red]mok-cute timeline: {missing}[/red]")
        return 2
    sizes: dict[str, Any] = {"flops": args.flops, "dispatch_bytes": args.bytes, "combine_bytes": args.bytes}
    if args.from_file:
        try:
            tl = timeline.decode(np.load(args.from_file))
        except (OSError, ValueError, TypeError) as exc:
            console.print(f"[red]cannot decode {args.from_file}: {exc}[/red]")
            return 2
        title = f"recording from {args.from_file}"
    elif args.synthetic:
        if args.seed < 0:  # numpy's generator takes no negative seed
            console.print(f"[red]--seed: expected >= 0 with --synthetic, got {args.seed}[/red]")
            return 2
        tl = timeline.decode(timeline.synthetic_buffer(seed=args.seed))
        tl.meta["synthetic"] = True
        title = "SYNTHETIC timeline (made-up durations, not a measurement)"
    else:
        try:
            overrides = parse_config_overrides(args.mok_config)  # a typo is a usage error, before any compile
            if args.backward and (args.ranks != 1 or args.mok_config):
                raise ValueError("--backward records the one-rank backward megakernel: no --ranks, "
                                 "no --mok-config")
            for flag, value, least in (("--ranks", args.ranks, 1), ("--warmup", args.warmup, 0),
                                       ("--capacity", args.capacity, 1)):
                if value is not None and value < least:
                    raise ValueError(f"{flag}: expected >= {least}, got {value}")
            if not 0 < args.t_scale <= 1e6:
                raise ValueError(f"--t-scale: expected a positive factor, got {args.t_scale}")
            resolve_shape(args.shape)
            capacity = DEFAULT_CAPACITY if args.capacity is None else args.capacity
            # the values too, on record_on_gpu's config
            apply_config_overrides(MoKConfig(timeline=True, timeline_capacity=capacity), overrides)
        except ValueError as exc:
            console.print(f"[red]{exc}[/red]")
            return 2
        try:
            tl, reason, recorded_sizes = (record_backward_on_gpu if args.backward else record_on_gpu)(args)
        except Exception as exc:  # a failed launch must say what failed, not dump a trace only
            tl, reason, recorded_sizes = None, f"the recorded run failed: {type(exc).__name__}: {exc}", {}
        if tl is None:
            console.print(f"[red]No timeline recorded: {reason}.[/red]")
            console.print("Use --from FILE.npy to decode a saved buffer, or --synthetic for a demo of the views.")
            return 1
        sizes = {k: (sizes[k] if sizes[k] is not None else v) for k, v in recorded_sizes.items()}
        title = f"{tl.meta.get('shape')} T={tl.meta.get('tokens')} on {tl.meta.get('gpu')}"
        if args.backward:
            title += ", backward"
    summary = timeline.print_summary(tl, console=console, title=title, **sizes)
    paths = timeline.write_views(tl, args.out, summary, title)
    for what, p in paths.items():
        console.print(f"{what:8s} {p}")
    for problem in tl.check():
        console.print(f"[yellow]check: {problem}[/yellow]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
