#!/usr/bin/env python3
"""PTX / cubin / SASS of a mok_cute kernel: `python3 tools/ptx.py NAME [--arch sm_100a] [--diff K=4]`.

The same as `mok-cute ptx ...`; runs from a checkout without installing (the GPU host runs
the package from PYTHONPATH). `python3 tools/ptx.py --list` lists the kernels.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mok_cute.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["ptx", *sys.argv[1:]]))
