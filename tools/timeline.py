#!/usr/bin/env python
"""Record a layer call's per-SM timeline and export it: `python tools/timeline.py --help`
(same as `mok-cute timeline`).

Writes a Chrome trace (open in https://ui.perfetto.dev), a PNG swimlane chart and a summary.
`--from FILE.npy` decodes a saved buffer; `--synthetic` shows the views on a made-up recording.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mok_cute.bench.record_timeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
