"""Paths and configurations of the layer, each sustained at the power cap with its SM clock.

    python tools/clock_probe.py --shapes mixtral,qwen3_30b [--seconds 2 --rounds 4] [--json F]
    python tools/clock_probe.py --shapes dsv3_ep8_rank \\
        --variant static:backend=megakernel,megakernel.tickets=static \\
        --variant comm2:backend=megakernel,num_comm_sms=2

The H200 runs these layers at its 700 W cap, where a variant's speed is its work per joule
(AGENTS.md): a short timing starts cool and fast, so each variant here runs back to back for
``--seconds`` while ``nvidia-smi`` samples the SM clock, the power draw and the active
clock-event reasons every 50 ms (``mok_cute.bench.gpu_clock``). Variants alternate, odd rounds
reversed. The variants are the expert path and the megakernel at R = 1 (both with
``check_ids=False``), plus each ``--variant NAME:KEY=VALUE,...``: a ``MoKConfig`` with those
fields set (``--mok-config`` syntax, dotted for the options objects). Every variant's output
is compared bitwise with the expert path's first. ``--base KEY=VALUE,...`` sets fields on every
variant, the defaults included (``--base precision=fp8``: the FP8 expert path and megakernel).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute import megakernel  # noqa: E402
from mok_cute.bench.common import apply_config_overrides, parse_config_overrides  # noqa: E402
from mok_cute.bench.gpu_clock import ClockSampler  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
from layer_profile import layer_call, probe_shapes  # noqa: E402  (tools/ is on sys.path as a script)

BASE = MoKConfig(check_ids=False)  # no host read per call: a sustained loop keeps the GPU busy
DEFAULT_VARIANTS = {"expert_kernels": BASE, "megakernel": MoKConfig(check_ids=False, backend="megakernel")}


def parse_variant(spec: str, base: MoKConfig = BASE) -> tuple[str, MoKConfig]:
    """``NAME:KEY=VALUE,...`` -> (NAME, ``base`` with those fields set)."""
    name, sep, fields = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"--variant: expected NAME:KEY=VALUE[,KEY=VALUE...], got {spec!r}")
    try:
        return name, apply_config_overrides(base, parse_config_overrides([fields]))
    except ValueError as exc:
        raise SystemExit(f"--variant {name}: {exc}") from exc


def sampled_run(fn, seconds: float, sampler: ClockSampler, window: str) -> dict:
    """Run ``fn`` back to back for ``seconds`` inside ``sampler``'s window ``window``: its time
    per call and the clock statistics of that window."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    with sampler.window(window):
        start.record()
        while time.time() - t0 < seconds:
            for _ in range(4):
                fn()
            calls += 4
            torch.cuda.synchronize()  # keep the host within a few calls of the GPU
        end.record()
        torch.cuda.synchronize()
    return {"ms_per_call": start.elapsed_time(end) / calls, **(sampler.stats(window) or {})}


def probe(name: str, seconds: float, rounds: int, variants: dict[str, MoKConfig],
          base: MoKConfig = BASE) -> dict:
    _, forward = layer_call(name)
    runs = {label: (lambda config=config: forward(config)) for label, config in variants.items()}
    first = forward(base).clone()
    rows = {k: [] for k in runs}
    for k, fn in runs.items():  # compile, and the bitwise check every probe makes
        out = fn()
        torch.cuda.synchronize()
        megakernel.raise_pending_errors()
        assert torch.equal(out, first), f"{name}: {k} differs from the expert path"
    with ClockSampler(torch.cuda.current_device()) as sampler:
        for r in range(rounds):
            order = list(runs.items())
            for k, fn in (order if r % 2 == 0 else order[::-1]):
                rows[k].append(sampled_run(fn, seconds, sampler, f"{k}#{r}"))
                s = rows[k][-1]
                print(f"{name} round {r} {k}: {s['ms_per_call']:.3f} ms, SM "
                      f"{s.get('sm_mhz_median')} MHz (min {s.get('sm_mhz_min')}), "
                      f"{s.get('power_w_mean')} W, {s.get('temp_c_max')} C, "
                      f"{s.get('clock_event_reasons')}", flush=True)
    megakernel.release_plans()
    torch.cuda.empty_cache()
    return {"shape": name, "configs": {k: repr(v) for k, v in variants.items()}, "rounds": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="mixtral,qwen3_30b")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="one more variant: MoKConfig(check_ids=False) with these fields set, e.g. "
                    "static:backend=megakernel,megakernel.tickets=static; repeatable")
    ap.add_argument("--base", default="", metavar="KEY=VALUE,...",
                    help="fields set on every variant and on the expert path compared against")
    ap.add_argument("--no-megakernel", action="store_true", help="leave the megakernel default out")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    base = parse_variant(f"base:{a.base}")[1] if a.base else BASE
    defaults = {k: apply_config_overrides(v, parse_config_overrides([a.base])) if a.base else v
                for k, v in DEFAULT_VARIANTS.items()}
    variants = {k: v for k, v in defaults.items() if not (a.no_megakernel and k == "megakernel")}
    variants.update(parse_variant(spec, base) for spec in a.variant)
    probe_shapes(a.shapes, lambda s: probe(s, a.seconds, a.rounds, variants, base), a.json, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
