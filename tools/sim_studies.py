#!/usr/bin/env python
"""Run the simulator studies (mok_cute.bench.sim_studies) and write their JSON + PNG into benchmarks/sim/.

    python tools/sim_studies.py a            # pull vs push dispatch (R=8 H200, R=72 GB300)
    python tools/sim_studies.py b            # num_comm_sms x minibatch sweep, MoK's shapes
    python tools/sim_studies.py c            # predicted TFLOP/s on GB300 vs MoK's numbers
    python tools/sim_studies.py calibrate [--results benchmarks/results]
                                             # GEMM fit, comm copy-rate fit from the
                                             # megakernel's records, R = 1 held-out check
    python tools/sim_studies.py calibrate-backward   # the backward megakernel: per-kind speed
                                             # fitted at R = 1, its other timings held out
    python tools/sim_studies.py swimlane     # one simulated timeline PNG
    python tools/sim_studies.py all

Everything here is simulated on the CPU (mok_cute.sim), never measured. docs/measurements.md
quotes the calibration, (a) and (c).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from mok_cute.bench import sim_studies as studies


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", choices=["a", "b", "c", "calibrate", "calibrate-backward",
                                      "swimlane", "all"])
    ap.add_argument("--out", default="benchmarks/sim", help="output folder")
    ap.add_argument("--results", default="benchmarks/results",
                    help="benchmark JSON folder for 'calibrate' (falls back to the anchors)")
    ap.add_argument("--workers", type=int, default=None, help="processes (default: 2)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python tools/sim_studies.py " + " ".join(shlex.quote(a) for a in (
        argv if argv is not None else sys.argv[1:]))
    todo = ["calibrate", "calibrate-backward", "a", "b", "c", "swimlane"] \
        if args.study == "all" else [args.study]
    for st in todo:
        t0 = time.perf_counter()
        if st == "a":
            data = studies.study_pull_push(workers=args.workers)
            studies.write_json(data, out / "study_a_pull_push.json", command)
            studies.plot_pull_push(data, out / "study_a_pull_push.png")
        elif st == "b":
            data = studies.study_sweep(workers=args.workers)
            studies.write_json(data, out / "study_b_sweep.json", command)
            studies.plot_sweep(data, out / "study_b_sweep.png")
        elif st == "c":
            data = studies.study_mok(workers=args.workers)
            studies.write_json(data, out / "study_c_mok.json", command)
            studies.plot_mok(data, out / "study_c_mok.png")
        elif st == "calibrate":
            res = Path(args.results)
            data = studies.study_calibration(res if res.is_dir() else None)
            studies.write_json(data, out / "calibration.json", command)
            for f in data["folds"]:
                print(f["report"])
            print(f"mean |held-out error| = {100 * data['mean_abs_held_out_error']:.1f}% "
                  f"(source: {data['source']})")
            for run, c in data["comm"].items():
                print(f"comm {run}: {c['sm_copy_gbps']:.1f} GB/s per comm SM, overhead "
                      f"{c['comm_task_overhead_us']:.1f} us ({c['fit_note']})")
            mk = data["megakernel_r1"]
            for r in mk["rows"]:
                print(f"  megakernel R=1 {r['shape']:14s} comm {r['num_comm_sms']:2d}: measured "
                      f"{r['measured_ms']:6.2f} ms, simulated {r['predicted_ms']:6.2f} "
                      f"({100 * r['error']:+.1f}%), + per-call offset "
                      f"{r['predicted_plus_offset_ms']:6.2f} "
                      f"({100 * r['error_plus_offset']:+.1f}%)")
            for t in mk["tuner"]:
                print(f"  {t['call']} -> {t['picked']} in {t['wall_s']:.1f} s; within 5% of the "
                      f"measured best: {t['within_5pct']}")
        elif st == "calibrate-backward":
            data = studies.study_backward_calibration()
            studies.write_json(data, out / "backward_calibration.json", command)
            print(data["report"])
            for name in ("uncalibrated", "calibrated"):
                for p in data[name]["points"]:
                    m = p["measured"][0]
                    print(f"  {name:12s} {p['label']:48s} measured {m:7.3f} ms, simulated "
                          f"{p['predicted']:7.3f} ({100 * (p['predicted'] / m - 1):+5.1f}%)")
                for p in data[name]["splits"]:
                    print(f"  {name:12s} {p['shape']} {p['comm_sms']} comm SMs over 16: measured "
                          f"{p['measured_over_16']:.3f}, simulated {p['predicted_over_16']:.3f}")
        elif st == "swimlane":
            from mok_cute import sim

            cfg = sim.SimConfig(num_comm_sms=16, minibatch_tokens=4096, ring_tokens=32768)
            r = sim.simulate("kimi_k2.7", 8, cfg, "h200_hgx", sim.Routing("skew", 0.25))
            r.write_png(out / "swimlane_kimi_h200x8_skew0.25.png", rank=0)
        print(f"study {st}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
