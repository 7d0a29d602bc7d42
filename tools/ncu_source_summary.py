"""Read Nsight Compute's per-SASS-instruction counters (``ncu -i R --page source --csv
--print-source sass``, the SourceCounters section): where each kernel's instructions and warp
stall samples go, and how often each mbarrier wait fell to its retry loop.

    python tools/ncu_source_summary.py ncu_source_mixtral.csv [--top 12] [--kernel REGEX]

Per kernel it prints the warp instructions executed, the stall samples, the opcodes that
issue most, the PCs with the most stall samples (and their two main stall reasons), and every
mbarrier wait (``SYNCS.PHASECHK.TRANS64.TRYWAIT``) on the kernel's main path with how many warp
waits it made and how many of them went to ptxas's retry loop (TRYWAIT; NANOSLEEP.SYNCS;
PHASECHK; BRA) and how many times that loop ran. In the sixteenth session this showed the
megakernel's consumers falling to the retry loop in 82-85 % of k-tiles where the expert path's
GEMM did in 1.4 % (``docs/measurements.md``). The CSVs come from ``ncu --section SourceCounters`` reports exported with ``--page source
--print-source sass --csv`` on the GPU host (``gpu_check.sh ncu``).
"""

from __future__ import annotations

import argparse
import csv
import io
import re
from collections import defaultdict

KERNEL_HEADER = '"Kernel Name",'
BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-fA-F]+)")


def read_kernels(path: str) -> list[tuple[str, list[dict]]]:
    """[(kernel name, its SASS rows)] in the report's order: the CSV holds one block per
    profiled launch, each opening with a ``"Kernel Name","<name>"`` line and then a header row
    (two launches of one kernel, FC1's and FC2's GEMM, share a name)."""
    text = open(path).read()
    kernels = []
    for block in text.split(KERNEL_HEADER)[1:]:
        name_line, _, table = block.partition("\n")
        name = name_line.strip().strip(",").strip('"')
        kernels.append((name, list(csv.DictReader(io.StringIO(table)))))
    return kernels


def _num(text) -> float:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def summarize(rows: list[dict]) -> dict:
    """Instruction, stall and mbarrier-wait statistics of one kernel's SASS rows."""
    executed = [_num(r.get("Instructions Executed", 0)) for r in rows]
    stalls = [_num(r.get("Warp Stall Sampling (All Samples)", 0)) for r in rows]
    address = [int(r["Address"], 16) for r in rows]
    at = {a: i for i, a in enumerate(address)}
    base = address[0] if address else 0
    opcodes: dict[str, float] = defaultdict(float)
    for r, n in zip(rows, executed):
        opcodes[_opcode(r["Source"])] += n
    # retry loops: a TRYWAIT whose next instruction is a NANOSLEEP sits in a stub that ptxas
    # placed after the main code; the main path's wait branches there when its TRYWAIT fails
    stub_runs = {}
    for i, r in enumerate(rows[:-1]):
        if "TRYWAIT" in r["Source"] and "NANOSLEEP" in rows[i + 1]["Source"]:
            stub_runs[i] = executed[i]
    waits = []
    for i, r in enumerate(rows[:-1]):
        if "TRYWAIT" not in r["Source"] or i in stub_runs:
            continue
        # its predicated branch to the stub follows within a few rows (a BSSY may come first);
        # a warp waiting on the TRYWAIT's result is sampled on the rows up to that branch
        branch = next((j for j in range(i + 1, min(i + 4, len(rows)))
                       if rows[j]["Source"].lstrip().startswith("@!P")
                       and BRANCH.search(rows[j]["Source"])), None)
        m = BRANCH.search(rows[branch]["Source"]) if branch is not None else None
        target = at.get(int(m.group(1), 16)) if m else None
        retry_loop = None
        if target is not None:  # the stub's own TRYWAIT is within a few rows of its entry
            retry_loop = next((j for j in range(target, min(target + 4, len(rows)))
                               if j in stub_runs), None)
        entries = executed[target] if target is not None else 0.0
        waits.append({"pc": address[i] - base, "waits": executed[i],
                      "retry_entries": entries if retry_loop is not None else 0.0,
                      "retry_iterations": stub_runs.get(retry_loop, 0.0),
                      "stall_samples": sum(stalls[i:(branch if branch is not None else i) + 1])})
    reasons = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
    top = sorted(range(len(rows)), key=lambda i: -stalls[i])
    return {"instructions": sum(executed), "stall_samples": sum(stalls),
            "opcodes": dict(sorted(opcodes.items(), key=lambda kv: -kv[1])),
            "waits": waits,
            "top_stalls": [{"pc": address[i] - base, "samples": stalls[i],
                            "source": rows[i]["Source"].strip(),
                            "reasons": sorted(((k, _num(rows[i][k])) for k in reasons),
                                              key=lambda kv: -kv[1])[:2]} for i in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=12, help="PCs by stall samples, opcodes")
    ap.add_argument("--kernel", default=".", help="regex on the kernel name")
    a = ap.parse_args()
    for path in a.files:
        for name, rows in read_kernels(path):
            if not re.search(a.kernel, name):
                continue
            s = summarize(rows)
            total = s["stall_samples"] or 1.0
            print(f"== {path}: {name[:90]}")
            print(f"  {s['instructions'] / 1e6:.1f} M warp instructions, "
                  f"{s['stall_samples']:.0f} stall samples")
            print("  opcodes: " + ", ".join(f"{op} {n / 1e6:.1f}M" for op, n in
                                            list(s["opcodes"].items())[:a.top]))
            for w in s["waits"]:
                if w["waits"] >= 1e4:
                    share = w["retry_entries"] / w["waits"] * 100
                    print(f"  wait @{w['pc']:#x}: {w['waits'] / 1e6:.2f} M warp waits, "
                          f"{share:.1f} % to the retry loop, {w['retry_iterations'] / 1e6:.2f} M "
                          f"retries, {w['stall_samples'] / total * 100:.1f} % of the samples")
            for t in s["top_stalls"][:a.top]:
                print(f"  {t['pc']:#7x} {t['samples'] / total * 100:5.1f} %  "
                      f"{t['source'][:60]:60s} {t['reasons']}")


if __name__ == "__main__":
    main()
