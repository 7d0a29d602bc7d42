"""Check and time the GPU build of the one-rank schedule against the torch build.

    python tools/schedule_probe.py --shapes dsv3_ep8_rank,sonic_120b [--json out.json]

Per shape, in one process:
  1. the two builds are bitwise equal (every ReceiveSchedule field), int32 and int64 ids;
  2. each build's GPU time (CUDA-graph replay: launch gaps of a warm queue, no host time),
     its time back to back with events, and its host time; also all 8 ranks' schedules of
     kimi_k2.7 at EP 8 (what one virtual R = 8 call builds);
  3. the layer with ``schedule.GPU_BUILD`` off and on, expert path and megakernel, timed in
     alternating rounds (the H200's clock drifts within a process), outputs bitwise equal.
A probe (it decided GPU_BUILD's default), not the benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from layer_profile import gpu_ms, host_ms, save_probe_json  # noqa: E402  (tools/ is on sys.path as a script)
from mok_cute import benchmark as bm  # noqa: E402
from mok_cute.benchmark import SINGLE_GPU_SHAPES  # noqa: E402

FIELDS = ("row_token", "row_k", "row_peer", "expert_counts", "expert_offsets", "tile_expert",
          "num_tiles", "slot_rows")


def graph_ms(fn, reps=20):
    """GPU time of ``fn`` replayed from a CUDA graph (no host work in the timed region)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return gpu_ms(graph.replay, reps)


def equal_builds(ids, E, rank=0):
    """Fields where the GPU build of rank ``rank`` differs from the torch build (ids [R, T, K])."""
    from mok_cute import schedule
    from mok_cute.kernels import schedule_build

    R, T, K = ids.shape
    want = schedule.build_receive_schedule(ids, rank, E, 128, validate=False, gpu_build=False)
    got = schedule_build.build_schedule(ids, rank, E, 128, poison=-77)
    bad = [f for f in FIELDS[:-1] if not torch.equal(getattr(want, f), getattr(got, f))]
    if not torch.equal(schedule.row_of_slot(want, T, K, rank), got.slot_rows):
        bad.append("slot_rows")
    return bad


def time_builds(row, ids, E):
    """Every rank's schedule (as the virtual launch builds them), torch against the kernels."""
    from mok_cute import schedule
    from mok_cute.kernels import schedule_build

    R = ids.shape[0]
    torch_build = lambda: [schedule.build_receive_schedule(ids, r, E, 128, validate=False, gpu_build=False)  # noqa: E731
                           for r in range(R)]
    gpu_build = lambda: [schedule_build.build_schedule(ids, r, E, 128) for r in range(R)]  # noqa: E731
    batched = lambda: schedule_build.build_schedules(ids, E, 128)  # noqa: E731  (all R: one launch pair)
    for label, fn in (("torch", torch_build), ("gpu", gpu_build), ("gpu_batched", batched)):
        row[f"{label}_build_events_ms"] = gpu_ms(fn, 20)
        row[f"{label}_build_host_ms"] = host_ms(fn)
        try:
            row[f"{label}_build_graph_ms"] = graph_ms(fn)
        except Exception as exc:  # noqa: BLE001  (record, keep going)
            row[f"{label}_build_graph_ms"] = f"capture failed: {exc!r}"[:200]


def build_flag_rounds(fn, rounds, iters):
    """Time ``fn`` with ``schedule.GPU_BUILD`` off and on in alternating rounds (the H200's
    clock drifts within a process); medians, every round, and whether the outputs agree."""
    from mok_cute import megakernel, schedule

    outs, times = {}, {False: [], True: []}
    default = schedule.GPU_BUILD
    try:
        for r in range(rounds):
            for flag in ((False, True) if r % 2 == 0 else (True, False)):
                schedule.GPU_BUILD = flag
                outs.setdefault(flag, fn())
                times[flag].append(gpu_ms(fn, iters))
    finally:
        schedule.GPU_BUILD = default
        megakernel.release_plans()
    return dict(torch_build_ms=statistics.median(times[False]),
                gpu_build_ms=statistics.median(times[True]),
                ms_rounds={"torch_build": times[False], "gpu_build": times[True]},
                bitwise_equal=bool(torch.equal(outs[False], outs[True])))


def layer_rounds(name, rounds, iters):
    """The layer (expert path and megakernel), GPU_BUILD off and on, alternating."""
    import mok_cute as mok

    p = bm.make_problem(bm.resolve_shape(name), device="cuda", seed=0)
    i = p.inputs
    results = {}
    for backend in ("kernel", "megakernel"):
        cfg = mok.MoKConfig(check_ids=False, backend=backend)
        results[backend] = build_flag_rounds(
            lambda: mok.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up,
                                    p.w_down, shared=p.shared, config=cfg), rounds, iters)
    return results


def virtual_rounds(name, R, rounds, iters):
    """moe_forward_virtual on R ranks (the megakernel), GPU_BUILD off and on, alternating."""
    import mok_cute as mok

    v = bm.make_problem(bm.resolve_shape(name), device="cuda", seed=0, ranks=R).virtual(R)
    cfg = mok.MoKConfig(check_ids=False, backend="megakernel")
    return build_flag_rounds(
        lambda: mok.moe_forward_virtual(v.x, v.topk_idx, v.topk_weights, v.w_gate, v.w_up,
                                        v.w_down, shared=v.shared, config=cfg), rounds, iters)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="dsv3_ep8_rank,sonic_120b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-layer", action="store_true", help="builds only, no layer timing")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    rows = []
    for name in args.shapes.split(","):
        s = SINGLE_GPU_SHAPES[name]
        T, E, K = s.tokens, s.experts, s.top_k
        ids64 = torch.rand(T, E, device="cuda").topk(K, dim=1).indices[None]
        row = dict(shape=name, R=1, T=T, E=E, K=K)
        row["mismatch_int64"] = equal_builds(ids64, E)
        row["mismatch_int32"] = equal_builds(ids64.to(torch.int32), E)
        skew = torch.where(torch.rand(1, T, K, device="cuda") < 0.5, torch.zeros_like(ids64), ids64)
        row["mismatch_skewed"] = equal_builds(skew, E)
        time_builds(row, ids64, E)
        if not args.no_layer:
            row["layer"] = layer_rounds(name, args.rounds, args.iters)
        rows.append(row)
        print(json.dumps(row), flush=True)
    # kimi_k2.7 on 8 (virtual) ranks: 384 experts, 48 per rank, 2048 tokens per rank
    R, T, K, E_loc = 8, 2048, 8, 48
    ids = torch.rand(R, T, R * E_loc, device="cuda").topk(K, dim=-1).indices
    row = dict(shape="kimi_k2.7", R=R, T=T, E=E_loc, K=K)
    row["mismatch_rank3"] = equal_builds(ids, E_loc, rank=3)
    time_builds(row, ids, E_loc)
    if not args.no_layer:
        row["virtual_layer"] = virtual_rounds("kimi_k2.7", R, args.rounds, 3)
    rows.append(row)
    print(json.dumps(row), flush=True)
    save_probe_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
