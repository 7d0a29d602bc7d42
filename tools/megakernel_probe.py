"""Megakernel against the expert-kernel path at R = 1, and a sweep of its comm split
(plus the expert path with FC1 gathering its rows itself, ``ops.GATHER_IN_FC1``).

    python tools/megakernel_probe.py --shapes dsv3_ep8_rank,sonic_120b --comm 6,8,12,8b \
        [--timeline 8 --out DIR] [--json out.json]

Each ``--comm`` entry is a number of comm CTAs; a trailing ``b`` selects the bulk-copy comm
variant (``cp.async.bulk`` through smem) instead of the vector one, a trailing ``l`` the
vector one with ``megakernel.LOCAL_DIRECT`` (local rows stay in the ring, no combine copy), a
trailing ``n`` (with ``l``) the same without the consumers' proxy fence on gathered A stages
(``gemm_sm90.FENCE_GATHERED_A = False``), an ``f`` FC1 of the next minibatch queued before FC2
(``megakernel.FC1_LEAD = 1``), an ``x`` (with ``l``) the caller's x read in place
(``megakernel.X_IN_PLACE``); e.g. ``2l``, ``2lf``, ``2lfx``. Every megakernel output
is compared bitwise with the expert-kernel path's on the same inputs. ``--timeline N`` also
records one call with N comm CTAs and saves the raw buffer (``mok-cute timeline --from``).
Times are CUDA-event means of back-to-back calls: a probe for tuning, not the benchmark of
record (that is ``mok-cute bench --contenders mok_cute,mok_megakernel,...``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
import mok_cute  # noqa: E402
from mok_cute import benchmark as bm, jit, megakernel, ops  # noqa: E402
from mok_cute.kernels import gemm_sm90  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
from layer_profile import gpu_ms, save_probe_json  # noqa: E402  (tools/ is on sys.path when run as a script)


def layer_flops(p) -> float:
    T, K = p.inputs.topk_idx.shape
    _, I, H = p.w_gate.shape
    shared = p.shared[0].shape[0] if p.shared is not None else 0
    return 6.0 * (T * K * I + T * shared) * H


def set_gathered_a_fence(on: bool) -> None:
    """gemm_sm90.FENCE_GATHERED_A is read when a kernel is traced: drop compiled kernels (and
    megakernel plans, which hold theirs) when it changes."""
    if gemm_sm90.FENCE_GATHERED_A != on:
        gemm_sm90.FENCE_GATHERED_A = on
        jit.clear_cache()
        megakernel.release_plans()


def probe_shape(name: str, comms: list[str], timeline: int | None, out_dir: str) -> dict:
    p = bm.make_problem(bm.resolve_shape(name), device="cuda", seed=1)
    i, flops = p.inputs, layer_flops(p)
    args = (i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down)
    base = MoKConfig(check_ids=False)
    expert = mok_cute.moe_forward(*args, shared=p.shared, config=base).clone()
    rows = [{"variant": "expert_kernels", "ms": gpu_ms(lambda: mok_cute.moe_forward(
        *args, shared=p.shared, config=base))}]
    # the expert path with FC1 gathering x itself (ops.GATHER_IN_FC1, experimental), with and
    # without the consumers' proxy fence on the gathered stages
    ops.GATHER_IN_FC1 = True
    try:
        for fence in (True, False):
            set_gathered_a_fence(fence)
            gathered = mok_cute.moe_forward(*args, shared=p.shared, config=base).clone()
            rows.append({"variant": "expert_kernels_gather_in_fc1" + ("" if fence else "_nofence"),
                         "ms": gpu_ms(lambda: mok_cute.moe_forward(*args, shared=p.shared, config=base)),
                         "bitwise_equal_expert_path": bool(torch.equal(gathered, expert))})
    finally:
        ops.GATHER_IN_FC1 = False
        set_gathered_a_fence(True)
    defaults = (megakernel.COMM_COPY, megakernel.LOCAL_DIRECT, megakernel.FC1_LEAD,
                megakernel.X_IN_PLACE)
    for spec in comms:
        megakernel.COMM_COPY = "bulk" if "b" in spec else "vector"
        megakernel.LOCAL_DIRECT = "l" in spec
        megakernel.FC1_LEAD = int("f" in spec)
        megakernel.X_IN_PLACE = "x" in spec
        set_gathered_a_fence("n" not in spec)
        cfg = MoKConfig(check_ids=False, num_comm_sms=int(spec.rstrip("blnfx")), backend="megakernel")
        run = lambda: mok_cute.moe_forward(*args, shared=p.shared, config=cfg)  # noqa: E731
        t0 = time.time()
        out = run().clone()
        torch.cuda.synchronize()
        megakernel.raise_pending_errors()
        variant = (f"megakernel_{megakernel.COMM_COPY}" + ("_local_direct" if megakernel.LOCAL_DIRECT else "")
                   + ("" if gemm_sm90.FENCE_GATHERED_A else "_nofence")
                   + ("_fc1_lead" if megakernel.FC1_LEAD else "")
                   + ("_x_in_place" if megakernel.X_IN_PLACE else ""))
        rows.append({"variant": variant, "comm_ctas": cfg.num_comm_sms,
                     "first_call_s": time.time() - t0, "ms": gpu_ms(run),
                     "bitwise_equal_expert_path": bool(torch.equal(out, expert))})
        megakernel.raise_pending_errors()
    (megakernel.COMM_COPY, megakernel.LOCAL_DIRECT, megakernel.FC1_LEAD,
     megakernel.X_IN_PLACE) = defaults
    set_gathered_a_fence(True)
    for r in rows:
        r["tflops"] = flops / r["ms"] / 1e9
        print(f"{name}: {r}", flush=True)
    if timeline:
        megakernel.LOCAL_DIRECT = "l" in timeline
        megakernel.FC1_LEAD = int("f" in timeline)
        cfg = MoKConfig(check_ids=False, num_comm_sms=int(timeline.rstrip("lf")), timeline=True,
                        timeline_capacity=1 << 18, backend="megakernel")
        mok_cute.moe_forward(*args, shared=p.shared, config=cfg)
        torch.cuda.synchronize()
        plan = next(pl for k, pl in megakernel._PLANS.items() if k.timeline)
        megakernel.LOCAL_DIRECT, megakernel.FC1_LEAD = defaults[1], defaults[2]
        path = plan.timeline.save(os.path.join(out_dir, f"{name}_megakernel_timeline.npy"))
        print(f"{name}: timeline of one call with {timeline} comm CTAs -> {path}", flush=True)
    megakernel.release_plans()
    torch.cuda.empty_cache()
    return {"shape": name, "flops": flops, "results": rows}


def probe_virtual(name: str, ranks: int, comms: list[str], rounds: int = 3) -> dict:
    """moe_forward_virtual at R = ``ranks`` against the megakernel at R = 1 on the same
    problem, with the ticket walk alternating ranks task by task or block by block
    (``megakernel.RANK_BLOCKS``), for each comm CTA count; alternating rounds (the clock
    drifts within a process); every R output compared bitwise across the variants."""
    p = bm.make_problem(bm.resolve_shape(name), device="cuda", seed=1, ranks=ranks)
    i, flops = p.inputs, layer_flops(p)
    v = p.virtual(ranks)
    one = MoKConfig(check_ids=False, backend="megakernel")
    run_one = lambda: mok_cute.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up,  # noqa: E731
                                           p.w_down, shared=p.shared, config=one)
    variants = {"r1": (run_one, None)}
    for spec in comms:
        for blocks in (False, True):
            cfg = MoKConfig(check_ids=False, backend="megakernel", num_comm_sms=int(spec))
            run = lambda cfg=cfg: mok_cute.moe_forward_virtual(  # noqa: E731
                v.x, v.topk_idx, v.topk_weights, v.w_gate, v.w_up, v.w_down, shared=v.shared, config=cfg)
            variants[f"r{ranks}_comm{spec}" + ("_blocks" if blocks else "")] = (run, blocks)
    times = {k: [] for k in variants}
    outs = {}
    default = megakernel.RANK_BLOCKS
    try:
        for r in range(rounds):
            for key in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                run, blocks = variants[key]
                megakernel.RANK_BLOCKS = bool(blocks)
                if key not in outs:
                    outs[key] = run().clone()
                    torch.cuda.synchronize()
                    megakernel.raise_pending_errors()
                times[key].append(gpu_ms(run, 3))
        megakernel.raise_pending_errors()
    finally:
        megakernel.RANK_BLOCKS = default
    rows = []
    first_r = next(k for k in outs if k != "r1")
    for key, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        row = {"variant": key, "ms": ms, "ms_rounds": ts, "tflops": flops / ms / 1e9}
        if key != "r1":
            row["bitwise_equal_" + first_r] = bool(torch.equal(outs[key], outs[first_r]))
        rows.append(row)
        print(f"{name} R={ranks}: {row}", flush=True)
    megakernel.release_plans()
    torch.cuda.empty_cache()
    return {"shape": name, "ranks": ranks, "flops": flops, "results": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3_ep8_rank,sonic_120b")
    ap.add_argument("--comm", default="6,8,12,16", help="comm CTA counts; suffix b = bulk copies")
    ap.add_argument("--timeline", default=None, metavar="COMM_CTAS",
                    help="comm CTAs of the recorded call; a trailing l: with LOCAL_DIRECT")
    ap.add_argument("--virtual", default=None, metavar="SHAPES",
                    help="EP shapes: moe_forward_virtual at --ranks against R = 1, ticket walk "
                         "alternating or in blocks (megakernel.RANK_BLOCKS), comm CTAs --virtual-comm")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--virtual-comm", default="12,24")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    doc = {"shapes": [probe_shape(s, a.comm.split(","), a.timeline, a.out)
                      for s in a.shapes.split(",") if s]}
    if a.virtual:
        doc["virtual"] = [probe_virtual(s, a.ranks, a.virtual_comm.split(","))
                          for s in a.virtual.split(",")]
    save_probe_json(a.json, doc, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
