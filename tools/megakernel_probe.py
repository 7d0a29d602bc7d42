"""Megakernel against the expert-kernel path at R = 1, and a sweep of its comm split
(plus, with ``--scatter``, the expert path with ``ops.SCATTER_X`` flipped, with
``--cluster``, with ``ops.GEMM_CLUSTER_M`` at 1 (no clusters), or at 2 where it is 1, and with
``--one-barrier``, with ``ops.ONE_EPILOGUE_BARRIER`` flipped).

    python tools/megakernel_probe.py --shapes dsv3_ep8_rank,sonic_120b --comm 6,8,12,8b \
        [--timeline 8 --out DIR] [--json out.json]

Each ``--comm`` entry is a number of comm CTAs; a trailing ``b`` selects the bulk-copy comm
variant (``cp.async.bulk`` through smem) instead of the vector one, a trailing ``l`` the
vector one with ``megakernel.LOCAL_DIRECT`` (local rows stay in the ring, no combine copy), a
trailing ``n`` (with ``l``) the same without the consumers' proxy fence on gathered A stages
(``gemm_sm90.FENCE_GATHERED_A = False``), an ``f`` FC1 of later minibatches queued before FC2
(``megakernel.FC1_LEAD``: the auto lead; ``f2`` a lead of 2 minibatches), an ``x`` (with
``l``) the caller's x read in place (``megakernel.X_IN_PLACE``), a ``w`` each minibatch's
GEMM tiles N-tile-major (``megakernel.N_MAJOR_TILES``), a ``c`` (with ``l``, one rank) the
list with its no-op DISPATCH / COMBINE tasks kept (``megakernel.LOCAL_ONLY_TASKS = False``,
as before the sixth session), a ``k`` dynamic compute tickets (``megakernel.DYNAMIC_TICKETS``),
a ``u`` 16 vectors in flight per KSUM lane instead of 8 (``megakernel.KSUM_VECTORS``), an
``e`` (with ``k``) the decoded task words through the ticket ring (``megakernel.DECODED_TICKETS``),
an ``s`` only the store warp waiting for a GEMM tile's stores (``megakernel.STORE_WARP_SIGNALS``),
an ``m`` the k-sum through smem (``megakernel.KSUM_STAGED``), an ``o`` the pingpong
consumer loop (``megakernel.PINGPONG``), an ``h`` KSUM tasks of 8 tokens (``megakernel.KSUM_ROWS``;
16 without it), a ``q`` one barrier per epilogue subtile (``megakernel.ONE_EPILOGUE_BARRIER``), a
``j`` (with ``e``) a task's first row and wait count in the decoded ring
(``megakernel.SHORT_TASK_START``), an ``i`` (with ``l``) the proxy fence on FC1's
gathered stages only (``megakernel.FENCE_FC1_ONLY``), a ``z`` (with ``l``) TMA-only stages
filled by the load warp alone (``megakernel.WARP0_TMA_STAGES``), a ``v`` (one rank) FC1 and
FC2 counters published by the CTA's next task (``megakernel.DEFER_SIGNALS``), an ``a`` a
compute task's publish without the fence before its release (``megakernel.RELEASE_ONLY_PUBLISH``),
a ``g`` the GEMM tasks' epilogue in 128 x 64 subtiles (``megakernel.WIDE_EPILOGUE``), a ``y``
(``r``) with ``v`` a held publish after the next mainloop's 4th (8th) k-tile
(``megakernel.DEFER_FLUSH_KTILES``), a ``t`` (with ``k``) compute tickets by the static
stride through the ticket ring (``megakernel.STRIDED_TICKETS``, the one-rank default since the
eighteenth session: ``0lxwfkuesmhjvrt``); e.g. ``2l``, ``2lf``, ``1lf3``, ``2lwf``. (Earlier
``t``, ``d``, ``g`` and ``p`` named variants measured slower and removed in the ninth session,
``y`` and ``r`` in the thirteenth, and ``p`` the FC2 halves removed in the seventeenth:
``docs/perf_notes.md``.) Every megakernel output
is compared bitwise with the expert-kernel path's on the same inputs. ``--timeline N`` also
records one call with N comm CTAs and saves the raw buffer (``mok-cute timeline --from``).
Times are CUDA-event means of back-to-back calls: a probe for tuning, not the benchmark of
record (that is ``mok-cute bench --contenders mok_cute,mok_megakernel,...``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
import mok_cute  # noqa: E402
from mok_cute import benchmark as bm, jit, megakernel, ops  # noqa: E402
from mok_cute.kernels import gemm_sm90  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
from layer_profile import gpu_ms, layer_call, probe_shapes, save_probe_json  # noqa: E402  (tools/ is on sys.path when run as a script)


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


def parse_spec(spec: str) -> dict:
    """``--comm`` / ``--timeline`` entry -> comm CTAs and the megakernel switches it names."""
    m = re.fullmatch(r"(\d+)([abceghijklmnoqrstuvwxyz]*)(?:f(\d*))?([abceghijklmnoqrstuvwxyz]*)", spec)
    if not m:
        raise SystemExit(f"--comm: cannot read {spec!r} (e.g. 2l, 2lf, 1lf3, 8b)")
    flags = m.group(2) + m.group(4)
    return dict(comm=int(m.group(1)), copy="bulk" if "b" in flags else "vector",
                local_direct="l" in flags, fence="n" not in flags, x_in_place="x" in flags,
                n_major="w" in flags, local_only_tasks="c" not in flags,
                dynamic_tickets="k" in flags, ksum_vectors=16 if "u" in flags else 8,
                decoded_tickets="e" in flags, store_warp_signals="s" in flags,
                ksum_staged="m" in flags, pingpong="o" in flags,
                ksum_rows=8 if "h" in flags else 16, one_epilogue_barrier="q" in flags,
                short_task_start="j" in flags, fence_fc1_only="i" in flags,
                warp0_tma_stages="z" in flags, defer_signals="v" in flags,
                release_only_publish="a" in flags, wide_epilogue="g" in flags,
                defer_flush_ktiles=8 if "r" in flags else 4 if "y" in flags else 1,
                strided_tickets="t" in flags,
                fc1_lead=m.group(3) is not None,
                fc1_lead_minibatches=int(m.group(3)) if m.group(3) else None)


# the megakernel module settings a spec sets, and the spec key that holds each
SPEC_SWITCHES = {"COMM_COPY": "copy", "LOCAL_DIRECT": "local_direct", "FC1_LEAD": "fc1_lead",
                 "FC1_LEAD_MINIBATCHES": "fc1_lead_minibatches", "X_IN_PLACE": "x_in_place",
                 "N_MAJOR_TILES": "n_major", "LOCAL_ONLY_TASKS": "local_only_tasks",
                 "DYNAMIC_TICKETS": "dynamic_tickets", "KSUM_VECTORS": "ksum_vectors",
                 "RANK_BLOCKS": "rank_blocks", "COMM_COPY_VECTORS": "comm_copy_vectors",
                 "DECODED_TICKETS": "decoded_tickets", "STORE_WARP_SIGNALS": "store_warp_signals",
                 "KSUM_STAGED": "ksum_staged", "PINGPONG": "pingpong", "KSUM_ROWS": "ksum_rows",
                 "ONE_EPILOGUE_BARRIER": "one_epilogue_barrier", "SHORT_TASK_START": "short_task_start",
                 "FENCE_FC1_ONLY": "fence_fc1_only", "WARP0_TMA_STAGES": "warp0_tma_stages",
                 "DEFER_SIGNALS": "defer_signals", "RELEASE_ONLY_PUBLISH": "release_only_publish",
                 "WIDE_EPILOGUE": "wide_epilogue", "DEFER_FLUSH_KTILES": "defer_flush_ktiles",
                 "STRIDED_TICKETS": "strided_tickets"}
SWITCHES = tuple(SPEC_SWITCHES)


def apply_spec(sp: dict) -> None:
    """Set every megakernel setting the spec holds (``--comm`` or ``--virtual-comm`` keys)."""
    for name, key in SPEC_SWITCHES.items():
        if key in sp:
            setattr(megakernel, name, sp[key])
    if "fence" in sp:
        set_gathered_a_fence(sp["fence"])


def restore(defaults: dict) -> None:
    """Put back the megakernel settings ``defaults`` (``SWITCHES``) and the proxy fence."""
    for n, v in defaults.items():
        setattr(megakernel, n, v)
    set_gathered_a_fence(True)


# the expert path's switches that probe variants flip
OPS_SWITCHES = ("SCATTER_X", "GEMM_CLUSTER_M", "ONE_EPILOGUE_BARRIER", "EPILOGUE_N")


def restore_ops(defaults: dict) -> None:
    """Put back the expert path's settings ``defaults`` (``OPS_SWITCHES``)."""
    for n, v in defaults.items():
        setattr(ops, n, v)


def probe_shape(name: str, comms: list[str], timeline: str | None, out_dir: str,
                rounds: int = 1, scatter: bool = False, minibatches: tuple = (None,),
                cluster: bool = False, one_barrier: bool = False,
                wide_epilogue: bool = False) -> dict:
    """The expert path, optionally with ``ops.SCATTER_X`` flipped, then every ``--comm`` spec of
    the megakernel; with ``rounds`` > 1 all variants are timed again in turn, odd rounds in
    reverse order (the clock drifts within a process) and each row keeps every round's time and their minimum."""
    p, forward = layer_call(name)
    i, flops = p.inputs, layer_flops(p)
    base = MoKConfig(check_ids=False)
    expert = forward(base).clone()
    defaults = {n: getattr(megakernel, n) for n in SWITCHES}
    ops_defaults = {n: getattr(ops, n) for n in OPS_SWITCHES}
    variants = {"expert_kernels": (lambda: None, base)}
    rows = {"expert_kernels": {"variant": "expert_kernels"}}

    def expert_variant(setting: str, value, suffix: str) -> None:
        """The expert path with ``ops.<setting> = value``, as variant expert_kernels_<suffix>
        (each variant's value bound here: lambdas sharing one local read its last value, so
        ``--cluster --one-barrier`` set GEMM_CLUSTER_M to a bool)."""
        key = f"expert_kernels_{suffix}"
        variants[key] = (lambda: setattr(ops, setting, value), base)
        rows[key] = {"variant": key}

    if scatter:  # x put in expert order by the token-major scatter (on since run 64) or by
        # the gather
        on = ops_defaults["SCATTER_X"]
        expert_variant("SCATTER_X", not on, "gather_x" if on else "scatter_x")
    if cluster:  # the expert path without GEMM clusters (or with them everywhere, if off)
        flipped = 2 if ops_defaults["GEMM_CLUSTER_M"] == 1 else 1
        expert_variant("GEMM_CLUSTER_M", flipped, f"cluster{flipped}")
    if one_barrier:  # the expert path's GEMM epilogues with one barrier per subtile (or two)
        one = not ops_defaults["ONE_EPILOGUE_BARRIER"]
        expert_variant("ONE_EPILOGUE_BARRIER", one, ("one" if one else "two") + "_epilogue_barriers")
    if wide_epilogue:  # the expert path's cooperative epilogues in 64-column subtiles (or 32)
        n = 32 if ops_defaults["EPILOGUE_N"] == 64 else 64
        expert_variant("EPILOGUE_N", n, f"epilogue_n{n}")
    for spec in comms:
        sp = parse_spec(spec)
        for mb in minibatches:  # None: the plan's default minibatch (8 tiles)
            key = spec if mb is None else f"{spec}@{mb}"
            cfg = MoKConfig(check_ids=False, num_comm_sms=sp["comm"], backend="megakernel",
                            minibatch_tokens=mb)
            variants[key] = (lambda sp=sp: apply_spec(sp), cfg)
            rows[key] = {"spec": key, "comm_ctas": sp["comm"]}
    try:
        for r in range(rounds):
            # odd rounds in reverse: the clock drops as the GPU heats within a process, and the
            # first variant of every round would otherwise always get the coolest slot (run 57)
            order = list(variants.items())
            for key, (setup, cfg) in (order if r % 2 == 0 else order[::-1]):
                setup()
                run = lambda cfg=cfg: forward(cfg)  # noqa: E731
                row = rows[key]
                if r == 0:  # first call (compile), correctness, what the plan became
                    t0 = time.time()
                    out = run().clone()
                    torch.cuda.synchronize()
                    megakernel.raise_pending_errors()
                    row["first_call_s"] = time.time() - t0
                    row["bitwise_equal_expert_path"] = bool(torch.equal(out, expert))
                    if cfg.backend == "megakernel":
                        plan = megakernel.plan_for(  # the cached plan of this call
                            i.x.unsqueeze(0), p.w_gate.unsqueeze(0), p.w_down.unsqueeze(0),
                            None if p.shared is None else tuple(w.unsqueeze(0) for w in p.shared),
                            i.topk_idx.unsqueeze(0), cfg)
                        k = plan.key
                        row["variant"] = (f"megakernel_{k.copy}" + ("_local_direct" if k.local_direct else "")
                                          + ("" if gemm_sm90.FENCE_GATHERED_A else "_nofence")
                                          + (f"_fc1_lead{k.fc1_lead}" if k.fc1_lead else "")
                                          + ("_x_in_place" if k.x_in_place else "")
                                          + ("_n_major" if k.tile_order == "n_major" else "")
                                          + ("_no_comm_tasks" if k.local_only else "")
                                          + ("_dynamic_tickets" if k.dynamic_tickets else "")
                                          + ("_decoded" if k.decoded_tickets else "")
                                          + ("_store_warp_signals" if k.store_warp_signals else "")
                                          + ("_ksum_staged" if k.ksum_staged else "")
                                          + ("_pingpong" if k.pingpong else "")
                                          + (f"_ksum_rows{k.ksum_rows}" if k.ksum_rows != 16 else "")
                                          + ("_one_epilogue_barrier" if k.one_epilogue_barrier else "")
                                          + ("_short_task_start" if k.short_task_start else "")
                                          + ("_fence_fc1_only" if k.fence_fc1_only else "")
                                          + ("_warp0_tma_stages" if k.warp0_tma_stages else "")
                                          + ("_defer_signals" if k.defer_signals else "")
                                          + ("_release_only_publish" if k.release_only_publish
                                             else "")
                                          + ("_wide_epilogue" if k.wide_epilogue else "")
                                          + (f"_flush_after{k.defer_flush_ktiles}"
                                             if k.defer_flush_ktiles != 1 else "")
                                          + ("_strided_tickets" if k.strided_tickets else ""))
                    row["ms_rounds"] = []
                row["ms_rounds"].append(gpu_ms(run))
                megakernel.raise_pending_errors()
                restore_ops(ops_defaults)
    finally:
        restore_ops(ops_defaults)
        restore(defaults)
    rows = list(rows.values())
    first_spec = next((r for r in rows if "spec" in r), None)
    for row in rows:
        row["ms"] = min(row["ms_rounds"])
        row["ms_median"] = sorted(row["ms_rounds"])[len(row["ms_rounds"]) // 2]
        row["tflops"] = flops / row["ms"] / 1e9
        row["paired_vs_expert_path"] = bm.paired_ratio(row["ms_rounds"], rows[0]["ms_rounds"])
        if first_spec is not None:
            row["paired_vs_first_spec"] = bm.paired_ratio(row["ms_rounds"], first_spec["ms_rounds"])
        # one short line per variant: the ratios are what a probe is read for
        print(f"{name}: {row.get('spec', row['variant'])} ms {row['ms']:.3f} median "
              f"{row['ms_median']:.3f} bitwise {row['bitwise_equal_expert_path']} paired/expert "
              f"{row['paired_vs_expert_path']:.3f} paired/first "
              f"{row.get('paired_vs_first_spec', float('nan')):.3f}", flush=True)
    if timeline:
        spec = parse_spec(timeline)
        apply_spec(spec)
        try:
            cfg = MoKConfig(check_ids=False, num_comm_sms=spec["comm"], timeline=True,
                            timeline_capacity=1 << 18, backend="megakernel")
            forward(cfg)
            torch.cuda.synchronize()
            plan = next(pl for k, pl in megakernel._PLANS.items() if k.timeline)
        finally:
            restore(defaults)
        path = plan.timeline.save(os.path.join(out_dir, f"{name}_megakernel_timeline.npy"))
        print(f"{name}: timeline of one call with {timeline} -> {path}", flush=True)
    megakernel.release_plans()
    torch.cuda.empty_cache()
    return {"shape": name, "flops": flops, "rounds": rounds, "results": rows}


def parse_virtual_spec(spec: str) -> dict:
    """``--virtual-comm`` entry: comm CTAs, then ``a`` = tickets alternate ranks task by task
    (RANK_BLOCKS off), ``k`` = dynamic compute tickets (DYNAMIC_TICKETS), ``u`` = 16 vectors
    in flight per KSUM lane (KSUM_VECTORS), ``e`` = decoded task words through the ticket ring
    (DECODED_TICKETS, with ``k``), ``s`` = only the store warp waits for a tile's stores
    (STORE_WARP_SIGNALS), ``o`` = the pingpong consumer loop (PINGPONG), ``m`` = the k-sum
    through smem (KSUM_STAGED), ``h`` = 8-token KSUM tasks (KSUM_ROWS; 16 without), then ``vN`` = the comm CTAs' flat row copy with N
    vectors in flight per lane (COMM_COPY_VECTORS; 0, a warp per row, without it)."""
    m = re.fullmatch(r"(\d+)([akuemosh]*)(?:v(\d+))?", spec)
    if not m:
        raise SystemExit(f"--virtual-comm: cannot read {spec!r} (e.g. 12, 12k, 12a, 10kuv16)")
    return dict(comm=int(m.group(1)), rank_blocks="a" not in m.group(2),
                dynamic_tickets="k" in m.group(2), ksum_vectors=16 if "u" in m.group(2) else 8,
                decoded_tickets="e" in m.group(2), store_warp_signals="s" in m.group(2),
                pingpong="o" in m.group(2), ksum_staged="m" in m.group(2),
                ksum_rows=8 if "h" in m.group(2) else 16, comm_copy_vectors=int(m.group(3) or 0))


def probe_virtual(name: str, ranks: int, comms: list[str], rounds: int = 3) -> dict:
    """moe_forward_virtual at R = ``ranks`` against the megakernel at R = 1 on the same
    problem (both with static and with dynamic compute tickets), for each ``--virtual-comm``
    spec; alternating rounds (the clock drifts within a process); every output compared
    bitwise with the first variant at the same R."""
    p = bm.make_problem(bm.resolve_shape(name), device="cuda", seed=1, ranks=ranks)
    i, flops = p.inputs, layer_flops(p)
    v = p.virtual(ranks)
    one = MoKConfig(check_ids=False, backend="megakernel")
    run_one = lambda: mok_cute.moe_forward(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up,  # noqa: E731
                                           p.w_down, shared=p.shared, config=one)
    def suffix(sp):
        return (("" if sp["ksum_vectors"] == 8 else f"_ksum{sp['ksum_vectors']}")
                + ("_decoded" if sp["decoded_tickets"] else "")
                + ("_store_warp_signals" if sp["store_warp_signals"] else "")
                + ("_pingpong" if sp["pingpong"] else "")
                + ("_ksum_staged" if sp["ksum_staged"] else "")
                + ("_ksum_rows8" if sp["ksum_rows"] == 8 else ""))

    # R = 1 with static tickets, then with dynamic tickets and each KSUM setting the specs use
    # (8 vectors always: the earlier probes' r1_dynamic)
    base = dict(rank_blocks=True, dynamic_tickets=False, ksum_vectors=8, comm_copy_vectors=0,
                decoded_tickets=False, store_warp_signals=False, pingpong=False,
                ksum_staged=False, ksum_rows=16)
    variants = {"r1": (run_one, base)}
    for sp in [dict(base, dynamic_tickets=True)] + [parse_virtual_spec(s) for s in comms]:
        sw = dict(base, dynamic_tickets=True, ksum_vectors=sp["ksum_vectors"],
                  decoded_tickets=sp["decoded_tickets"],
                  store_warp_signals=sp["store_warp_signals"], pingpong=sp["pingpong"],
                  ksum_staged=sp["ksum_staged"], ksum_rows=sp["ksum_rows"])
        variants.setdefault("r1_dynamic" + suffix(sw), (run_one, sw))
    for spec in comms:
        sp = parse_virtual_spec(spec)
        cfg = MoKConfig(check_ids=False, backend="megakernel", num_comm_sms=sp["comm"])
        run = lambda cfg=cfg: mok_cute.moe_forward_virtual(  # noqa: E731
            v.x, v.topk_idx, v.topk_weights, v.w_gate, v.w_up, v.w_down, shared=v.shared, config=cfg)
        key = (f"r{ranks}_comm{sp['comm']}" + ("" if sp["rank_blocks"] else "_alternating")
               + ("_dynamic" if sp["dynamic_tickets"] else "") + suffix(sp)
               + (f"_copy{sp['comm_copy_vectors']}" if sp["comm_copy_vectors"] else ""))
        variants[key] = (run, sp)
    times = {k: [] for k in variants}
    outs = {}
    defaults = {n: getattr(megakernel, n) for n in SWITCHES}
    try:
        for r in range(rounds):
            for key in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                run, sw = variants[key]
                apply_spec(sw)
                if key not in outs:
                    outs[key] = run().clone()
                    torch.cuda.synchronize()
                    megakernel.raise_pending_errors()
                times[key].append(gpu_ms(run, 3))
        megakernel.raise_pending_errors()
    finally:
        restore(defaults)
    rows = []
    first_r = next(k for k in outs if k.startswith(f"r{ranks}_"))
    for key, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        row = {"variant": key, "ms": ms, "ms_rounds": ts, "tflops": flops / ms / 1e9}
        ref = "r1" if key.startswith("r1_") else first_r
        if key != ref:
            row["bitwise_equal_" + ref] = bool(torch.equal(outs[key], outs[ref]))
        rows.append(row)
        print(f"{name} R={ranks}: {row}", flush=True)
    megakernel.release_plans()
    torch.cuda.empty_cache()
    return {"shape": name, "ranks": ranks, "flops": flops, "results": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3_ep8_rank,sonic_120b")
    ap.add_argument("--comm", default="6,8,12,16", help="comm CTA counts; suffix b = bulk copies")
    ap.add_argument("--timeline", default=None, metavar="SPEC",
                    help="a --comm spec: record one call of it (mok-cute timeline --from)")
    ap.add_argument("--minibatch-tokens", default="",
                    help="comma list: time every --comm spec with each minibatch size too "
                         "(rows SPEC@N; e.g. 512,1024)")
    ap.add_argument("--scatter", action="store_true",
                    help="add the expert path with ops.SCATTER_X flipped (scatter <-> gather of x)")
    ap.add_argument("--cluster", action="store_true",
                    help="add the expert path with ops.GEMM_CLUSTER_M = 1 (no clusters; 2 if that is the default)")
    ap.add_argument("--one-barrier", action="store_true",
                    help="add the expert path with ops.ONE_EPILOGUE_BARRIER flipped")
    ap.add_argument("--wide-epilogue", action="store_true",
                    help="add the expert path with ops.EPILOGUE_N flipped (64-column epilogue "
                         "subtiles, or 32)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant this many times in turn; report the minimum")
    ap.add_argument("--virtual", default=None, metavar="SHAPES",
                    help="EP shapes: moe_forward_virtual at --ranks against R = 1, one variant "
                         "per --virtual-comm spec")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--virtual-comm", default="12,12k",
                    help="comm CTAs, then a = alternating ticket walk (RANK_BLOCKS off), "
                         "k = dynamic compute tickets (DYNAMIC_TICKETS), u = 16 KSUM vectors "
                         "in flight per lane (KSUM_VECTORS), e = decoded task words "
                         "(DECODED_TICKETS), s = store warp signals (STORE_WARP_SIGNALS), then vN = N vectors in flight per "
                         "lane in the comm CTAs' flat row copy (COMM_COPY_VECTORS)")
    ap.add_argument("--virtual-rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    comms = [c for c in a.comm.split(",") if c]
    minibatches = tuple(int(m) for m in a.minibatch_tokens.split(",") if m) or (None,)
    doc = probe_shapes(a.shapes, lambda s: probe_shape(
        s, comms, a.timeline, a.out, a.rounds, a.scatter, minibatches, a.cluster,
        a.one_barrier, a.wide_epilogue), a.json, argv)
    if a.virtual:
        doc["virtual"] = [probe_virtual(s, a.ranks, a.virtual_comm.split(","), a.virtual_rounds)
                          for s in a.virtual.split(",")]
    save_probe_json(a.json, doc, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
