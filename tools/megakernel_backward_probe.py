"""The backward megakernel (one launch: the dgrads, then the weight gradients) against the
grouped-GEMM launches (two dgrads, two weight gradients), its dgrads alone, and inside the
whole one-GPU backward, in interleaved rounds (the H200 heats up under its 700 W cap, so
back-to-back stages favour whichever runs first).

    python tools/megakernel_backward_probe.py --shapes qwen3_30b,dsv3_ep8_rank,gptoss_120b \
        [--rounds 3] [--fc2-forms] [--consumer-words] [--json out.json]

A probe for the megakernel's development (issue 32), not the benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from tools.layer_profile import gpu_ms  # noqa: E402


def probe(name: str, rounds: int, reps: int, sweep: bool = False, fc2_forms: bool = False,
          consumer_words: bool = False) -> dict:
    import mok_cute
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
        eb.fc1_dgrad(d_preact, p.w_gate, p.w_up, s.tile_expert, s.num_tiles, cfg.expert_path)
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
    if consumer_words:  # TEMPORARY A/B: the dgrads' words from the load warp's smem ring
        live_rows = int(s.num_tiles.item()) * 128

        def live(out):  # the rows' outputs on the live rows, the weight gradients whole
            return [t[:live_rows] for t in out[:4]] + list(out[4:])

        run = patched(one_launch, consumer_words=True)
        same = all(torch.equal(a, b) for a, b in zip(live(one_launch()), live(run())))
        print(f"{name} one launch [consumer words from smem] bitwise the default's (live rows): "
              f"{same}", flush=True)
        variants["dgrads: megakernel [consumer words from smem]"] = patched(megakernel,
                                                                            consumer_words=True)
        variants["GEMMs: megakernel, one launch [consumer words from smem]"] = run
        variants["moe_backward (megakernel) [consumer words from smem]"] = patched(
            backward("megakernel"), consumer_words=True)
        for tag, kw in ((" [defer by group]", dict(defer_by_group=True)),
                        (" [smem words + defer by group]",
                         dict(consumer_words=True, defer_by_group=True))):
            run = patched(one_launch, **kw)
            same = all(torch.equal(a, b) for a, b in zip(live(one_launch()), live(run())))
            print(f"{name} one launch{tag} bitwise the default's (live rows): {same}", flush=True)
            variants["dgrads: megakernel" + tag] = patched(megakernel, **kw)
            variants["GEMMs: megakernel, one launch" + tag] = run
            variants["moe_backward (megakernel)" + tag] = patched(backward("megakernel"), **kw)
    ms = {label: [] for label in variants}
    for r in range(rounds):  # every other round in reverse: the heat of a round's end spreads
        for label, fn in (variants.items() if r % 2 == 0 else reversed(variants.items())):
            ms[label].append(gpu_ms(fn, reps))
    median = {label: sorted(v)[len(v) // 2] for label, v in ms.items()}
    for label, v in ms.items():
        print(f"{name} {label:34s} " + " ".join(f"{t:7.3f}" for t in v)
              + f"  median {median[label]:7.3f} ms", flush=True)
    one = median["GEMMs: megakernel, one launch"]
    ratios = {"dgrads": median["dgrads: two launches"] / median["dgrads: megakernel"],
              "gemms": median["GEMMs: four launches"] / one,
              "wgrads_in_launch": median["GEMMs: megakernel dgrads + wgrads"] / one,
              "backward": median["moe_backward"] / median["moe_backward (megakernel)"]}
    print(f"{name} megakernel speed / launches: dgrads {ratios['dgrads']:.3f}, all GEMMs "
          f"{ratios['gemms']:.3f} (vs its dgrads + wgrad launches {ratios['wgrads_in_launch']:.3f}), "
          f"whole backward {ratios['backward']:.3f}", flush=True)
    if consumer_words:
        tag = " [consumer words from smem]"
        ratios["consumer_words"] = {
            "dgrads": median["dgrads: megakernel"] / median["dgrads: megakernel" + tag],
            "one_launch": one / median["GEMMs: megakernel, one launch" + tag],
            "backward": (median["moe_backward (megakernel)"]
                         / median["moe_backward (megakernel)" + tag])}
        for key, tag in (("defer_by_group", " [defer by group]"),
                         ("both", " [smem words + defer by group]")):
            ratios[key] = {
                "dgrads": median["dgrads: megakernel"] / median["dgrads: megakernel" + tag],
                "one_launch": one / median["GEMMs: megakernel, one launch" + tag],
                "backward": (median["moe_backward (megakernel)"]
                             / median["moe_backward (megakernel)" + tag])}
        for key in ("consumer_words", "defer_by_group", "both"):
            cw = ratios[key]
            print(f"{name} {key}, speed / default: dgrads {cw['dgrads']:.3f}, one "
                  f"launch {cw['one_launch']:.3f}, whole backward {cw['backward']:.3f}", flush=True)
    return {"shape": name, "ms_rounds": ms, "ms_median": median, "speed_ratio": ratios}


def patched(fn, per_mb=None, fc2_pingpong=None, consumer_words=None, defer_by_group=None):
    """``fn`` with the backward megakernel's list in minibatches of ``per_mb`` M-tiles and / or
    its FC2_DGRAD form forced (its own table cache) and / or its consumers' task words from
    the load warp's smem ring (``consumer_words``, TEMPORARY)."""
    from mok_cute import megakernel_backward as mb

    tables = mb.BoundedCache(32)

    def run():
        saved = (mb._TABLES, mb.tiles_per_minibatch, mb.fc2_pingpong, mb.consumer_words_from_smem,
                 mb.defer_by_group)
        mb._TABLES = tables
        if per_mb is not None:
            mb.tiles_per_minibatch = lambda capacity_tiles: per_mb
        if fc2_pingpong is not None:
            mb.fc2_pingpong = lambda hidden: fc2_pingpong
        if consumer_words is not None:
            mb.consumer_words_from_smem = consumer_words
        if defer_by_group is not None:
            mb.defer_by_group = defer_by_group
        try:
            return fn()
        finally:
            (mb._TABLES, mb.tiles_per_minibatch, mb.fc2_pingpong,
             mb.consumer_words_from_smem, mb.defer_by_group) = saved
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
    p.add_argument("--consumer-words", action="store_true",
                   help="TEMPORARY A/B: also the megakernel whose consumer warps read each dgrad's "
                        "decoded words from the load warp's smem ring (bitwise check)")
    args = p.parse_args(argv)
    rows = [probe(n, args.rounds, args.reps, args.sweep, args.fc2_forms, args.consumer_words)
            for n in args.shapes.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python tools/megakernel_backward_probe.py "
                       + " ".join(sys.argv[1:] if argv is None else argv),
                       "gpu": torch.cuda.get_device_name(), "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
