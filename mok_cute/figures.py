"""Saving the package's matplotlib figures (bench charts, timeline swimlanes, simulator studies).

Committed result PNGs must keep the tracked repository small (it travels to the GPU host
beside a 58 MiB DSL bundle), so every figure is written as a 256-colour palette PNG: the
charts are flat colours and text, so the palette loses nothing visible and the files are
about a third of the RGBA ones.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any


def save_png(fig: Any, path: str | os.PathLike, dpi: int) -> Path:
    """Write ``fig`` to ``path`` as a palette PNG (no dithering, median-cut palette)."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    buf.seek(0)
    with Image.open(buf) as im:
        palette = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                             dither=Image.Dither.NONE)
    path = Path(path)
    palette.save(path, optimize=True)
    return path
