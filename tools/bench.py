#!/usr/bin/env python
"""Benchmark the MoE layer forward: `python tools/bench.py --help` (same as `mok-cute bench`).

Writes a JSON result file (DESIGN §5 schema) and a PNG bar chart to benchmarks/results/.
See mok_cute/bench/harness.py for the protocol and the contenders.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mok_cute.bench.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
