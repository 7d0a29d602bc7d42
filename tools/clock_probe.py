"""SM clock and power while the expert path and the megakernel run, back to back.

    python tools/clock_probe.py --shapes mixtral,qwen3_30b [--seconds 2 --rounds 4] [--json F]

The fifteenth session's recordings put mixtral's megakernel GEMM tiles ~3 % slower than the
expert path's, FC2's (TMA-loaded, the same wgmmas, a 224-k-tile mainloop) as much as FC1's.
If that is the clock (the megakernel's spinning producer threads drawing power, say), it shows
here: each variant runs for ``--seconds`` while ``nvidia-smi`` samples the SM clock, the power
draw and the active clock-event reasons every 50 ms (``mok_cute.gpu_clock``); variants
alternate, odd rounds reversed. (Runs 113-115 dropped each run's first quarter of samples, the
clock settling; the sampler's windows keep them all.)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute import megakernel, ops  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
from mok_cute.gpu_clock import ClockSampler  # noqa: E402
from layer_profile import layer_call, probe_shapes  # noqa: E402


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


def probe(name: str, seconds: float, rounds: int, switches: list[str],
          expert_switches: tuple[str, ...] = (), with_megakernel: bool = True,
          expert_settings: tuple[tuple[str, int], ...] = ()) -> dict:
    """The expert path, the megakernel, and the megakernel with each boolean module switch of
    ``switches`` flipped (the others at their defaults); the expert path with each boolean
    ``mok_cute.ops`` switch of ``expert_switches`` flipped, and with each integer
    ``mok_cute.ops`` setting of ``expert_settings`` (name, value) set."""
    _, forward = layer_call(name)
    expert, mega = MoKConfig(check_ids=False), MoKConfig(check_ids=False, backend="megakernel")
    defaults = {(megakernel, s): getattr(megakernel, s) for s in switches}
    defaults.update({(ops, s): getattr(ops, s) for s in expert_switches})
    defaults.update({(ops, s): getattr(ops, s) for s, _ in expert_settings})
    booleans = {key: v for key, v in defaults.items() if isinstance(v, bool)}

    def call(config, flip=None, setting=None):
        def run():
            for (module, s), v in defaults.items():  # compiles are keyed by them: no recompile
                setattr(module, s, (not v) if (module, s) == flip else v)
            if setting is not None:
                setattr(ops, *setting)
            return forward(config)
        return run

    runs = {"expert_kernels": call(expert)}
    runs.update({f"expert_kernels_{s.lower()}_{not v}": call(expert, (m, s))
                 for (m, s), v in booleans.items() if m is ops})
    runs.update({f"expert_kernels_{s.lower()}_{v}": call(expert, setting=(s, v))
                 for s, v in expert_settings})
    if with_megakernel:
        runs["megakernel"] = call(mega)
        runs.update({f"megakernel_{s.lower()}_{not v}": call(mega, (m, s))
                     for (m, s), v in booleans.items() if m is megakernel})
    first = runs["expert_kernels"]().clone()
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
    for (module, s), v in defaults.items():
        setattr(module, s, v)
    megakernel.release_plans()
    torch.cuda.empty_cache()
    return {"shape": name, "rounds": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="mixtral,qwen3_30b")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--switch", default="", help="comma list of boolean megakernel switches: "
                    "each adds the megakernel with that switch flipped (e.g. WARP0_TMA_STAGES)")
    ap.add_argument("--expert-switch", default="", help="comma list of boolean mok_cute.ops "
                    "switches: each adds the expert path with it flipped (e.g. KSUM_IN_FC2)")
    ap.add_argument("--expert-setting", action="append", default=[], metavar="NAME=V1,V2",
                    help="an integer mok_cute.ops setting: adds the expert path with it set to "
                    "each value (e.g. FC1_GROUP_M=4,16); repeatable")
    ap.add_argument("--no-megakernel", action="store_true", help="the expert path variants only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    settings = tuple((name, int(v)) for name, values in (e.split("=", 1) for e in a.expert_setting)
                     for v in values.split(","))
    switches = [w for w in a.switch.split(",") if w]
    expert_switches = tuple(w for w in a.expert_switch.split(",") if w)
    probe_shapes(a.shapes, lambda s: probe(s, a.seconds, a.rounds, switches, expert_switches,
                                           not a.no_megakernel, settings), a.json, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
