"""The backward over a group's buffers (``group_backward``: pulls, per-rank dgrads, pushes,
weight gradients, two barriers, k-sums) against the virtual ranks' backward
(``virtual_backward``: no comm, one backward-megakernel launch for every rank) on the same
saved forward, R virtual ranks on one GPU, in interleaved rounds. What it shows: the cost of
the group form's copies, barriers and per-rank launches where no NVLink is crossed (on real
ranks the copies cross NVLink and the ranks run side by side).

    python tools/group_backward_probe.py --shapes glm_5.2,qwen3.5_397b [--ranks 8]
        [--tokens 2048] [--rounds 3] [--precision bf16,fp8] [--kernel-table] [--json out.json]
        [--comm-ctas 8,32]   (bf16: the group backward on these comm splits too)
        [--one-rank]         (rank 0 alone: one launch with the group tail against launches)

With a shared expert, the backwards also run with its backward before the launch (its tasks
alone in a launch of their own: ``shared_before``; and, the form before both, its one-GPU
launches rank by rank: ``shared_rank_by_rank``) beside the default, its tasks inside the launch.

A probe for issue 32's development, not the benchmark of record.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute.shapes import shape_names  # noqa: E402
from tools.layer_profile import fp8_weight_grads_forced, gpu_ms, save_probe_json  # noqa: E402


def _problem(name: str, ranks: int, tokens: int):
    """A shape's problem split into ``ranks`` virtual ranks of ``tokens`` tokens: (xs, idx, w,
    w_gate, w_up, w_down [R, ...], the shared expert's weights repeated per rank or None,
    d_out)."""
    from mok_cute.bench.problems import make_problem
    from mok_cute.shapes import resolve_shape

    p = make_problem(resolve_shape(name), device="cuda", seed=1, tokens=ranks * tokens)
    per_rank = lambda a: a.view(ranks, a.shape[0] // ranks, *a.shape[1:])  # noqa: E731
    xs, idx, w = (per_rank(t) for t in (p.inputs.x, p.inputs.topk_idx, p.inputs.topk_weights))
    wg, wu, wd = (per_rank(t) for t in (p.w_gate, p.w_up, p.w_down))
    shared = tuple(t.unsqueeze(0).expand(ranks, *t.shape).contiguous()
                   for t in p.shared) if p.shared else None
    return xs, idx, w, wg, wu, wd, shared, torch.randn_like(xs)


@contextlib.contextmanager
def shared_before():
    """The shared expert's backward as launches of its own before the backward megakernel's
    (the form before its tasks joined the launch): ``shared_in_launch`` says no."""
    from mok_cute import expert_backward, virtual_backward

    saved = expert_backward.shared_in_launch, virtual_backward.shared_in_launch
    expert_backward.shared_in_launch = virtual_backward.shared_in_launch = lambda *a: False
    try:
        yield
    finally:
        expert_backward.shared_in_launch, virtual_backward.shared_in_launch = saved


@contextlib.contextmanager
def shared_rank_by_rank():
    """Every rank's shared expert on ``expert_backward.shared_backward``'s launches, rank by
    rank, where ``shared_backward_ranks`` would run them as one launch of their own."""
    from mok_cute import megakernel_backward as mb
    from mok_cute.expert_backward import shared_backward_rank_by_rank

    def rank_by_rank(shared, wgrads=True, timeout_ms=0.0, check=False, main_grads=None):
        dx, dw = shared_backward_rank_by_rank(shared.d_out, shared.x, shared[2:5],
                                              shared.preact)
        return mb.SharedGrads(torch.stack(dx), *dw)

    saved = mb.shared_expert_grads
    mb.shared_expert_grads = rank_by_rank
    try:
        yield
    finally:
        mb.shared_expert_grads = saved


def reference(fn, _cache={}):
    """``fn()``'s gradients copied to host memory, once per ``fn``: the bitwise checks then hold
    one set of gradients on the GPU at a time (glm_5.2's are 19 GB in bf16)."""
    if fn not in _cache:
        _cache.clear()
        _cache[fn] = [None if t is None else t.cpu() for t in fn()]
    return _cache[fn]


def _same(ref, fn) -> bool:
    """``fn()``'s gradients bitwise ``ref``'s (host copies), one tensor on the host at a time."""
    return all((a is None) == (b is None) and (a is None or torch.equal(a, b.cpu()))
               for a, b in zip(ref, fn()))


def probe(name: str, ranks: int, tokens: int, rounds: int, reps: int,
          precisions=("bf16",), kernel_table: bool = False, with_group: bool = True,
          comm_splits=()) -> dict:
    import mok_cute
    from mok_cute import megakernel
    from mok_cute.group_backward import moe_backward_group
    from mok_cute.virtual_backward import VirtualSaved, moe_backward_virtual

    xs, idx, w, wg, wu, wd, shared, d_out = _problem(name, ranks, tokens)
    variants, same = {}, {}
    saved_of = {}
    for precision in precisions:
        # "fp8_wgrad": the FP8 backward with its weight gradients in FP8 whatever the sizes
        layer = precision.split("_")[0]
        if layer not in saved_of:
            with torch.no_grad():
                saved_of[layer] = megakernel.moe_forward_virtual(
                    xs, idx, w, wg, wu, wd, shared,
                    mok_cute.MoKConfig(check_ids=False, precision=layer), save=True)[1]
        saved = saved_of[layer]
        virtual_saved = VirtualSaved.from_forward(saved)

        def sized(fn, forced=True if precision == "fp8_wgrad" else None):
            def run():
                with fp8_weight_grads_forced(forced):
                    return fn()
            return run

        virtual = sized(lambda s=virtual_saved, layer=layer: moe_backward_virtual(
            d_out, xs, w, wg, wu, wd, shared, s, precision=layer))
        group = sized(lambda s=saved: moe_backward_group(d_out, xs, idx, w, wg, wu, wd, shared, s))

        group_forms = {f"group {precision}": group}
        if precision == "bf16":  # the comm in the launch on other splits; as launches
            for c in comm_splits:
                group_forms[f"group bf16 c{c}"] = lambda s=saved, c=c: moe_backward_group(
                    d_out, xs, idx, w, wg, wu, wd, shared, s, comm_sms=c)
        if shared is not None:  # its backward before the launch: alone, or rank by rank
            def virtual_before(rank_by_rank=False, virtual=virtual):  # this precision's
                with shared_before(), (shared_rank_by_rank() if rank_by_rank
                                       else contextlib.nullcontext()):
                    return virtual()
            before = {f"virtual {precision} shared rank by rank":
                      lambda f=virtual_before: f(True)}
            if precision == "bf16":  # (the FP8 backward's shared expert is never in its launch)
                before["virtual bf16 shared before"] = virtual_before
            for label, fn in before.items():
                same[label] = _same(reference(virtual), fn)
                variants[label] = fn
        for label, fn in group_forms.items() if with_group else ():
            same[label] = _same(reference(virtual), fn)
            torch.cuda.synchronize()
            mok_cute.check_errors()
            variants[label] = fn
        variants[f"virtual {precision}"] = virtual
        if kernel_table:
            from tools.backward_profile import print_kernel_table
            print(f"--- {name} R={ranks} T={tokens}/rank: the virtual backward's kernels, {precision}")
            print_kernel_table(virtual)
    ms = {label: [] for label in variants}
    for r in range(rounds):
        for label in (variants if r % 2 == 0 else list(variants)[::-1]):
            ms[label].append(gpu_ms(variants[label], reps))
    median = {label: sorted(v)[len(v) // 2] for label, v in ms.items()}
    for label, v in ms.items():
        print(f"{name} R={ranks} T={tokens}/rank {label:18s} " + " ".join(f"{t:8.3f}" for t in v)
              + f"  median {median[label]:8.3f} ms", flush=True)
    ratios = {}
    forms = ("virtual", "group") if with_group else ("virtual",)
    for precision in precisions if with_group else ():
        ratios[f"group / virtual {precision}"] = (median[f"group {precision}"]
                                                  / median[f"virtual {precision}"])
    for label in median:  # the other comm forms against the default one
        if label.startswith("group bf16 "):
            ratios[f"{label} / group bf16"] = median[label] / median["group bf16"]
    for precision in precisions:
        for form in ("shared before", "shared rank by rank"):
            if f"virtual {precision} {form}" in median:
                ratios[f"virtual {precision} / {form}"] = (
                    median[f"virtual {precision}"] / median[f"virtual {precision} {form}"])
    if "bf16" in precisions:
        for label in forms:
            for other in precisions:
                if other != "bf16" and f"{label} {other}" in median:
                    ratios[f"{label} {other} / bf16"] = (median[f"{label} {other}"]
                                                         / median[f"{label} bf16"])
    print(f"{name} R={ranks} T={tokens}/rank: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
          + f"; gradients bitwise equal (group, virtual): {same}", flush=True)
    return {"shape": name, "ranks": ranks, "tokens_per_rank": tokens, "ms_rounds": ms,
            "ms_median": median, "ratios": ratios, "bitwise_equal": same}


def one_rank_probe(name: str, ranks: int, tokens: int, rounds: int, reps: int,
                   comm_splits=(16,), timeline_dir: str | None = None) -> dict:
    """Rank 0's bf16 backward alone over R virtual ranks' buffers, its peers' pushes and flags
    already in place (a whole group call filled the pushes; each call sets the peers' flags
    to its epoch's "done" by hand): one launch with the group tail (``GroupTail``: the
    barriers and the k-sums on the comm CTAs, under the weight gradients) against the same
    launch without it between the two barrier launches, then the k-sum and d_topk launches
    (the path of several ranks in one process). The shared expert's dx rows are made once,
    outside both. Also the launch alone (no barrier, no k-sum) on the first split: what the
    tail adds to it. ``timeline_dir``: then the one launch on the first split once more with
    its recorder on (``backward_recorder``), its trace, PNG and summary written there."""
    import mok_cute
    from mok_cute import megakernel, megakernel_backward as mb
    from mok_cute.constants import flag_done
    from mok_cute.expert_backward import shared_backward_ranks
    from mok_cute.group_backward import moe_backward_group
    from mok_cute.kernels import token_ops
    from mok_cute.kernels.peer_rows import peer_barrier

    xs, idx, w, wg, wu, wd, shared, d_out = _problem(name, ranks, tokens)
    with torch.no_grad():
        saved = megakernel.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared,
                                               mok_cute.MoKConfig(check_ids=False),
                                               save=True)[1]
    plan, sched = saved.plan, saved.schedules
    whole = moe_backward_group(d_out, xs, idx, w, wg, wu, wd, shared, saved)  # the pushes
    torch.cuda.synchronize()
    T, K, H = xs.shape[1], idx.shape[2], xs.shape[2]
    dev = xs.device
    shared_dx = shared_backward_ranks(d_out, xs, shared, saved.shared_preact)[0][0]
    peers = mb.PeerRows(plan.peer_bases[0], sched.row_peer[0], sched.row_token[0],
                        sched.row_k[0], mb.comm_scalars(plan.side.layout, K, dev))
    weights = torch.zeros(saved.preact.shape[0], dtype=torch.float32, device=dev)
    flags = plan.side.fields("barrier_flags")[0]
    epoch = [int(plan.scalars[0].item())]
    idx0 = idx[0].to(torch.int32).contiguous()
    routed = (idx0 >= 0) & (idx0 < ranks * wg.shape[1])
    args = (wg[0], wu[0], wd[0], saved.preact, saved.row_slot[0], weights, sched.tile_expert[0],
            sched.num_tiles[0:1], sched.expert_offsets[0], peers, True)

    def next_call():
        plan.begin_backward()
        epoch[0] += 1
        flags[1:ranks].fill_(flag_done(epoch[0]))  # the peers: started and done

    def with_tail(comm_ctas, timeline=None):
        next_call()
        d_x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        d_topk = torch.empty(T, K, dtype=torch.float32, device=dev)
        out = mb.expert_grads_over_peers(*args, comm_ctas, tail=mb.GroupTail(
            plan.scalars, plan.backward_error, idx0, shared_dx, d_x, d_topk), timeline=timeline)
        return (d_x, d_topk, *out[6:])

    def as_launches(comm_ctas):
        next_call()
        bases = plan.peer_bases[0:1]
        peer_barrier(bases, plan.scalars, plan.backward_error, 0, plan.side.scope)
        out = mb.expert_grads_over_peers(*args, comm_ctas)
        peer_barrier(bases, plan.scalars, plan.backward_error, 1, plan.side.scope)
        slots = torch.arange(T * K, dtype=torch.int32, device=dev)
        d_x = token_ops.weighted_ksum(plan.side.fields("combine")[0],
                                      torch.ones(T, K, dtype=torch.float32, device=dev),
                                      shared_dx, row_index=torch.where(routed.reshape(-1),
                                                                       slots, -1))
        d_topk = torch.where(routed, plan.side.fields("d_topk_partials")[0][:, 0].view(T, K),
                             0.0)
        return (d_x, d_topk, *out[6:])

    def shared_inside(comm_ctas):  # the shared expert's tasks in the launch
        next_call()
        d_x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        d_topk = torch.empty(T, K, dtype=torch.float32, device=dev)
        one = mb.SharedExpert(d_out[0], xs[0], *(t[0] for t in shared), saved.shared_preact[0])
        out = mb.expert_grads_over_peers(*args, comm_ctas, tail=mb.GroupTail(
            plan.scalars, plan.backward_error, idx0, None, d_x, d_topk), shared=one)
        return (d_x, d_topk, *out[6:9])

    def shared_then_launch(comm_ctas):  # its launches, then the launch without it
        nonlocal shared_dx
        shared_dx = shared_backward_ranks(d_out[:1], xs[:1], tuple(t[:1] for t in shared),
                                          saved.shared_preact[:1])[0][0]
        return with_tail(comm_ctas)

    variants = {}
    for c in comm_splits:
        variants[f"one launch c{c}"] = lambda c=c: with_tail(c)
        variants[f"launches c{c}"] = lambda c=c: as_launches(c)
        if shared is not None:
            variants[f"shared inside c{c}"] = lambda c=c: shared_inside(c)
            variants[f"shared then c{c}"] = lambda c=c: shared_then_launch(c)
    variants["launch alone"] = lambda: mb.expert_grads_over_peers(*args, comm_splits[0])
    got = {label: fn() for label, fn in variants.items() if label != "launch alone"}
    torch.cuda.synchronize()
    plan.check_device_error()
    want = [whole[0][0], whole[1][0].float(), whole[2][0], whole[3][0], whole[4][0]]
    same = {label: all(torch.equal(a, b) for a, b in zip(g, want)) for label, g in got.items()}
    ms = {label: [] for label in variants}
    for r in range(rounds):
        for label in (variants if r % 2 == 0 else list(variants)[::-1]):
            ms[label].append(gpu_ms(variants[label], reps))
    torch.cuda.synchronize()
    plan.check_device_error()
    median = {label: sorted(v)[len(v) // 2] for label, v in ms.items()}
    for label, v in ms.items():
        print(f"{name} rank 0 of R={ranks} T={tokens}/rank {label:16s} "
              + " ".join(f"{t:8.3f}" for t in v) + f"  median {median[label]:8.3f} ms",
              flush=True)
    ratios = {f"one launch / launches c{c}": median[f"one launch c{c}"]
              / median[f"launches c{c}"] for c in comm_splits}
    for c in comm_splits if shared is not None else ():
        ratios[f"shared inside / shared then c{c}"] = (median[f"shared inside c{c}"]
                                                       / median[f"shared then c{c}"])
    print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
          + f"; bitwise the whole group call's rank 0: {same}", flush=True)
    row = {"shape": name, "ranks": ranks, "tokens_per_rank": tokens, "ms_rounds": ms,
           "ms_median": median, "ratios": ratios, "bitwise_equal_to_group_call": same}
    if timeline_dir:
        row["timeline"] = _record_one_launch(with_tail, comm_splits[0], want, dev,
                                             f"{timeline_dir}/{name}_rank0_of_{ranks}_t{tokens}",
                                             f"{name} rank 0 of {ranks} virtual, T={tokens}/rank, "
                                             f"backward, {comm_splits[0]} comm CTAs")
        plan.check_device_error()
    return row


def _record_one_launch(with_tail, comm_ctas: int, want, dev, outdir: str, title: str) -> dict:
    """The one launch with its recorder on (compiled by a first call), checked bitwise
    against the group call; its views written to ``outdir``."""
    from mok_cute import timeline as tlm
    from mok_cute.bench.record_timeline import recorded_with_room

    got = []

    def record(capacity: int, calls: int):
        tb = tlm.TimelineBuffer(capacity, device=dev)
        for _ in range(calls):
            tb.reset()
            got[:] = with_tail(comm_ctas, timeline=tb)
        torch.cuda.synchronize()
        return tb

    # the first call compiles; once more with room for every record, if it dropped some
    _, tl = recorded_with_room(record, tlm.BACKWARD_CAPACITY, warmup=1)
    tl.meta.update({"pass": "bwd", "title": title, "gpu": torch.cuda.get_device_name()})
    summary = tlm.print_summary(tl, title=title)
    paths = tlm.write_views(tl, outdir, summary, title)
    problems = tl.check()
    print(f"timeline: {len(tl)} records, {paths}, check: {problems or 'clean'}", flush=True)
    return {"dir": outdir, "records": len(tl), "check": problems,
            "bitwise_equal_to_group_call": all(torch.equal(a, b) for a, b in zip(got, want)),
            "summary": {k: summary[k] for k in ("span_ns", "roles", "exposed_comm_pct",
                                               "task_counts", "task_us")}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="glm_5.2,qwen3.5_397b")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", default="2048", help="tokens per rank (a comma list)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--precision", default="bf16",
                   help="a comma list of bf16, fp8 and fp8_wgrad (FP8 weight gradients forced)")
    p.add_argument("--virtual-only", action="store_true",
                   help="time the virtual backward only (the group form holds R ranks' rows)")
    p.add_argument("--kernel-table", action="store_true",
                   help="also the virtual backward's GPU time per kernel")
    p.add_argument("--comm-ctas", default="",
                   help="bf16: also the group backward with these comm CTAs (a comma list)")
    p.add_argument("--one-rank", action="store_true",
                   help="rank 0's backward alone, one launch with the group tail against the "
                        "launch between barrier and k-sum launches (one_rank_probe)")
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="with --one-rank: record the one launch on the first split once more "
                        "(its recorder on) and write its trace, PNG and summary under DIR")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from mok_cute import megakernel
    from mok_cute.expert_path_fp8 import forget_quantized_weights

    rows = []
    for n in shape_names(args.shapes):
        for tokens in map(int, str(args.tokens).split(",")):
            if args.one_rank:
                rows.append(one_rank_probe(n, args.ranks, tokens, args.rounds, args.reps,
                                           tuple(int(c) for c in (args.comm_ctas or "16").split(",")),
                                           args.timeline))
                save_probe_json(args.json, {"shapes": rows}, argv)
                megakernel.release_plans()
                torch.cuda.empty_cache()
                continue
            rows.append(probe(n, args.ranks, tokens, args.rounds, args.reps,
                              tuple(args.precision.split(",")), args.kernel_table,
                              not args.virtual_only,
                              tuple(int(c) for c in args.comm_ctas.split(",") if c)))
            save_probe_json(args.json, {"shapes": rows}, argv)  # kept if a later shape fails
            megakernel.release_plans()  # the shape's plans and e4m3 weight copies
            forget_quantized_weights()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
