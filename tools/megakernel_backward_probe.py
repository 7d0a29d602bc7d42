"""The backward megakernel (one launch: the dgrads, then the weight gradients) against the
grouped-GEMM launches (two dgrads, two weight gradients), its dgrads alone, and inside the
whole one-GPU backward, in interleaved rounds (the H200 heats up under its 700 W cap, so
back-to-back stages favour whichever runs first).

    python tools/megakernel_backward_probe.py --shapes qwen3_30b,dsv3_ep8_rank,gptoss_120b \
        [--rounds 3] [--fc2-forms] [--fc2-stages 3] [--json out.json]

A probe for the megakernel's development (issue 32), not the benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute.shapes import shape_names  # noqa: E402
from tools.layer_profile import gpu_ms  # noqa: E402


def probe(name: str, rounds: int, reps: int, sweep: bool = False,
          fc2_forms: bool = False, fc2_stages: int | None = None) -> dict:
    import mok_cute
    from mok_cute.bench.common import paired_ratio
    from mok_cute import expert_backward as eb
    from mok_cute import expert_path
    from mok_cute import megakernel_backward as mb
    from mok_cute.bench.problems import make_problem
    from mok_cute.kernels import token_ops
    from mok_cute.shapes import resolve_shape

    p = make_problem(resolve_shape(name), device="cuda", seed=1)
    x, idx, w = p.inputs.x, p.inputs.topk_idx, p.inputs.topk_weights
    cfg = mok_cute.MoKConfig(backend="kernel", check_ids=False)
    with torch.no_grad():
        _, s = expert_path.moe_forward_kernel(x, idx, w, p.w_gate, p.w_up, p.w_down, None, cfg,
                                              save=True)
    d_out = torch.randn_like(x)
    weights = w.float().contiguous().view(-1)
    d_rows = token_ops.gather_rows(d_out, s.row_token(idx.shape[1]))
    x_rows = token_ops.gather_rows(x, s.row_token(idx.shape[1]))
    num_experts = p.w_gate.shape[0]

    def wgrads(d_preact, hw):
        inter = p.w_gate.shape[1]
        eb.wgrad(d_preact[:, :inter], d_preact[:, inter:], x_rows, s.expert_offsets,
                 num_experts, inter)
        eb.wgrad(d_rows, None, hw, s.expert_offsets, num_experts, p.w_down.shape[1])

    def megakernel():
        return mb.expert_dgrads(d_rows, p.w_gate, p.w_up, p.w_down, s.preact, s.row_slot,
                                weights, s.tile_expert, s.num_tiles)

    def two_launches(with_wgrads=False):
        d_preact, hw, _ = eb.fc2_dgrad(d_rows, p.w_down, s.preact, s.row_slot, weights,
                                       s.tile_expert, s.num_tiles, cfg.expert_path)
        eb.fc1_dgrad(d_preact, p.w_gate, p.w_up, s.tile_expert, s.num_tiles, cfg.expert_path,
                     idx.numel() / num_experts)  # the stages the one-GPU backward picks
        if with_wgrads:
            wgrads(d_preact, hw)

    def megakernel_then_wgrads():
        d_preact, hw, _, _ = megakernel()
        wgrads(d_preact, hw)

    def one_launch():
        return mb.expert_grads(d_rows, x_rows, p.w_gate, p.w_up, p.w_down, s.preact,
                               s.row_slot, weights, s.tile_expert, s.num_tiles, s.expert_offsets)

    def backward(dgrads):
        return lambda: eb.moe_backward(d_out, x, idx, w, p.w_gate, p.w_up, p.w_down, None, s,
                                       dgrads=dgrads)

    variants = {"dgrads: two launches": two_launches, "dgrads: megakernel": megakernel,
                "GEMMs: four launches": lambda: two_launches(True),
                "GEMMs: megakernel dgrads + wgrads": megakernel_then_wgrads,
                "GEMMs: megakernel, one launch": one_launch,
                "moe_backward": backward("kernels"),
                "moe_backward (megakernel)": backward("megakernel")}
    if sweep:  # the dgrads' list in minibatches of the grid's size (the form before one minibatch)
        n_dgated = -(-p.w_gate.shape[1] // 256)
        grid_mb = -(-expert_path._num_sms(0) // (n_dgated * mb.RASTER_M)) * mb.RASTER_M
        print(f"{name} grid-sized minibatch: {grid_mb} M-tiles", flush=True)
        live_rows = int(s.num_tiles.item()) * 128
        base = [t[:live_rows].clone() for t in megakernel()]
        for label, per_mb in (("grid-sized minibatches", grid_mb),
                              ("minibatches of 4 x the grid", 4 * grid_mb)):
            run = patched(megakernel, per_mb)
            same = all(torch.equal(a, b[:live_rows]) for a, b in zip(base, run()))
            print(f"{name} dgrads [{label}] bitwise one minibatch's (live rows): {same}", flush=True)
            variants[f"dgrads: megakernel [{label}]"] = run
        variants["moe_backward (megakernel) [grid-sized minibatches]"] = patched(
            backward("megakernel"), grid_mb)
    if fc2_forms:  # the other FC2_DGRAD form at this H; bits checked (row partials summed)
        other = not mb.fc2_pingpong(x.shape[1])
        form = "pingpong" if other else "cooperative"
        live_rows = int(s.num_tiles.item()) * 128
        base = [t[:live_rows] for t in megakernel()]
        run = patched(megakernel, fc2_pingpong=other)
        got = [t[:live_rows] for t in run()]
        same = all(torch.equal(got[i], base[i]) for i in (0, 1, 3)) and torch.equal(
            eb.row_partial_sums(got[2]), eb.row_partial_sums(base[2]))
        print(f"{name} dgrads [{form} FC2] bitwise the default form's (live rows): {same}", flush=True)
        variants[f"dgrads: megakernel [{form} FC2]"] = run
        variants[f"moe_backward (megakernel) [{form} FC2]"] = patched(backward("megakernel"),
                                                                      fc2_pingpong=other)
    if fc2_stages is not None:  # the pingpong FC2_DGRAD ring on other than its 4 stages
        live_rows = int(s.num_tiles.item()) * 128
        base = [t[:live_rows].clone() for t in megakernel()]
        run = patched(megakernel, fc2_stages=fc2_stages)
        same = all(torch.equal(a[:live_rows], b) for a, b in zip(run(), base))
        label = f"FC2 ring {fc2_stages} stages"
        print(f"{name} dgrads [{label}] bitwise the default's (live rows): {same}"
              + ("" if mb.fc2_pingpong(x.shape[1]) else " (cooperative FC2 here: no change)"),
              flush=True)
        variants[f"dgrads: megakernel [{label}]"] = run
        variants[f"GEMMs: megakernel, one launch [{label}]"] = patched(one_launch,
                                                                        fc2_stages=fc2_stages)
        variants[f"moe_backward (megakernel) [{label}]"] = patched(backward("megakernel"),
                                                                   fc2_stages=fc2_stages)
    ms = {label: [] for label in variants}
    for r in range(rounds):  # every other round in reverse: the heat of a round's end spreads
        for label, fn in (variants.items() if r % 2 == 0 else reversed(variants.items())):
            ms[label].append(gpu_ms(fn, reps))
    median = {label: sorted(v)[len(v) // 2] for label, v in ms.items()}
    for label, v in ms.items():
        print(f"{name} {label:34s} " + " ".join(f"{t:7.3f}" for t in v)
              + f"  median {median[label]:7.3f} ms", flush=True)
    # speed ratios paired per round, as the bench's: what the clock under the power cap does
    # to a whole round cancels (it still moves within one: use more reps for small effects)
    one = ms["GEMMs: megakernel, one launch"]
    ratios = {"dgrads": paired_ratio(ms["dgrads: two launches"], ms["dgrads: megakernel"]),
              "gemms": paired_ratio(ms["GEMMs: four launches"], one),
              "wgrads_in_launch": paired_ratio(ms["GEMMs: megakernel dgrads + wgrads"], one),
              "backward": paired_ratio(ms["moe_backward"], ms["moe_backward (megakernel)"])}
    print(f"{name} megakernel speed / launches: dgrads {ratios['dgrads']:.3f}, all GEMMs "
          f"{ratios['gemms']:.3f} (vs its dgrads + wgrad launches {ratios['wgrads_in_launch']:.3f}), "
          f"whole backward {ratios['backward']:.3f}", flush=True)
    if fc2_stages is not None:
        label = f"FC2 ring {fc2_stages} stages"
        ratios["fc2_stages"] = {  # default time / variant time: > 1, the variant is faster
            part: paired_ratio(ms[default], ms[f"{default} [{label}]"])
            for part, default in (("dgrads", "dgrads: megakernel"),
                                  ("one_launch", "GEMMs: megakernel, one launch"),
                                  ("backward", "moe_backward (megakernel)"))}
        print(f"{name} speed of the {label} over the default 4: {ratios['fc2_stages']}", flush=True)
    return {"shape": name, "ms_rounds": ms, "ms_median": median, "speed_ratio": ratios}


def patched(fn, per_mb=None, fc2_pingpong=None, fc2_stages=None):
    """``fn`` with the backward megakernel's list in minibatches of ``per_mb`` M-tiles, its
    FC2_DGRAD form forced and / or its pingpong FC2 ring on ``fc2_stages`` stages (its own
    table cache; with ``fc2_stages`` its own compiled kernels too)."""
    from mok_cute import jit, megakernel_backward as mb
    from mok_cute.kernels.megakernel import backward as mk_backward, backward_fc2

    tables, kernels = mb.BoundedCache(32), {}

    def run():
        saved = mb._TABLES, mb.tiles_per_minibatch, mb.fc2_pingpong
        saved_stages, saved_kernels = backward_fc2.FC2_STAGES, jit._CACHE
        mb._TABLES = tables
        if per_mb is not None:
            mb.tiles_per_minibatch = lambda capacity_tiles: per_mb
        if fc2_pingpong is not None:
            mb.fc2_pingpong = lambda hidden: fc2_pingpong
        if fc2_stages is not None:  # read when the kernel is traced: a cache of its own
            backward_fc2.FC2_STAGES = mk_backward.FC2_STAGES = fc2_stages
            jit._CACHE = kernels
        try:
            return fn()
        finally:
            mb._TABLES, mb.tiles_per_minibatch, mb.fc2_pingpong = saved
            backward_fc2.FC2_STAGES = mk_backward.FC2_STAGES = saved_stages
            jit._CACHE = saved_kernels
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3_30b,dsv3_ep8_rank,gptoss_120b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true",
                   help="also the dgrads' list in minibatches of the grid's size and of 4 x that "
                        "(bitwise check on the live rows)")
    p.add_argument("--fc2-forms", action="store_true",
                   help="also the megakernel with the other FC2_DGRAD form at each shape's H "
                        "(pingpong 128 x 128 or cooperative 128 x 256; bitwise check)")
    p.add_argument("--fc2-stages", type=int, default=None,
                   help="also the megakernel with its pingpong FC2_DGRAD ring on this many "
                        "32 KB stages (2-4; the default 4; bitwise check)")
    args = p.parse_args(argv)
    rows = [probe(n, args.rounds, args.reps, args.sweep, args.fc2_forms, args.fc2_stages)
            for n in shape_names(args.shapes)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python tools/megakernel_backward_probe.py "
                       + " ".join(sys.argv[1:] if argv is None else argv),
                       "gpu": torch.cuda.get_device_name(), "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
