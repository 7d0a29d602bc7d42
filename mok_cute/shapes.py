"""The named MoE layer shapes (DESIGN §5) and MoK's FLOP formula.

One catalogue for the bench, the simulator, the tuner's command line and the tests. It imports
nothing from the package (nor torch), so anything may import it without pulling in the rest.

Single-GPU shapes (``E`` = local experts): one GPU's whole problem of ``tokens`` tokens.
EP shapes: MoK's four models at 2048 tokens per rank, ``experts`` routed experts of the whole
group and one shared expert of size ``intermediate``; a problem of R ranks holds R * 2048
tokens. ``custom:T,H,I,E,K[,shared]`` names any other shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Shape", "SINGLE_GPU_SHAPES", "EP_SHAPES", "SHAPES", "SHAPE_GROUPS", "moe_flops",
           "resolve_shape", "resolve_shapes", "resolve_ep_shape", "resolve_ep_shapes"]


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int  # tokens of the problem; per rank when per_rank_tokens
    hidden: int
    intermediate: int
    experts: int  # experts of the problem (single-GPU: local experts; EP: all routed experts)
    top_k: int
    shared: bool = False  # one shared expert of size `intermediate`
    per_rank_tokens: bool = False  # EP shapes: `tokens` is per rank, the problem holds R ranks' tokens

    def total_tokens(self, t_scale: float = 1.0, ranks: int = 1) -> int:
        per = max(1, round(self.tokens * t_scale))
        return per * ranks if self.per_rank_tokens else per


SINGLE_GPU_SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("dsv3_ep8_rank", 4096, 7168, 2048, 32, 8),
        Shape("qwen3_30b", 16384, 2048, 768, 128, 8),
        Shape("sonic_120b", 32768, 4096, 2048, 64, 4),
        Shape("mixtral", 8192, 4096, 14336, 8, 2),
        Shape("gptoss_120b", 8192, 2880, 2880, 128, 4),
    )
}

# MoK's four models at 2048 tokens per rank, each with one shared expert of size I.
EP_SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("kimi_k2.7", 2048, 7168, 2048, 384, 8, shared=True, per_rank_tokens=True),
        Shape("glm_5.2", 2048, 6144, 2048, 256, 8, shared=True, per_rank_tokens=True),
        Shape("qwen3.5_397b", 2048, 4096, 1024, 512, 10, shared=True, per_rank_tokens=True),
        Shape("dsv4_pro", 2048, 7168, 3072, 384, 6, shared=True, per_rank_tokens=True),
    )
}
SHAPES: dict[str, Shape] = {**SINGLE_GPU_SHAPES, **EP_SHAPES}
SHAPE_GROUPS = {"single": list(SINGLE_GPU_SHAPES), "ep": list(EP_SHAPES), "all": list(SHAPES)}


def moe_flops(tokens: int, hidden: int, intermediate: int, top_k: int, shared: bool = False) -> float:
    """Forward FLOPs of one layer call, MoK's formula: 6 * (T*K + T*[shared]) * H * I
    (three GEMMs of 2*H*I per routed row; the shared expert counts as one more row per token)."""
    return 6.0 * (tokens * top_k + tokens * int(bool(shared))) * hidden * intermediate


def _custom(spec: str) -> Shape:
    try:
        vals = [int(v) for v in spec[len("custom:"):].split(",")]
    except ValueError:
        vals = []
    if len(vals) not in (5, 6) or min(vals[:5]) <= 0:
        raise ValueError(f"shape: expected custom:T,H,I,E,K[,shared] with positive integers, got {spec!r}")
    t, h, i, e, k = vals[:5]
    if k > e:
        raise ValueError(f"shape: top_k K={k} exceeds the expert count E={e} in {spec!r}")
    return Shape(spec, t, h, i, e, k, shared=bool(vals[5]) if len(vals) == 6 else False)


def resolve_shape(spec: str) -> Shape:
    """A named shape, or ``custom:T,H,I,E,K[,shared]``."""
    if spec in SHAPES:
        return SHAPES[spec]
    if spec.startswith("custom:"):
        return _custom(spec)
    raise ValueError(f"shape: expected one of {sorted(SHAPES)} or custom:T,H,I,E,K[,shared], got {spec!r}")


def _split(spec: str) -> list[str]:
    # a comma ends a name unless a digit follows: custom:T,H,I,E,K holds commas of its own
    return [p.strip() for p in re.split(r",(?![0-9])", spec) if p.strip()]


def shape_names(spec: str) -> list[str]:
    """A comma list of shape names, groups (single, ep, all) and custom shapes -> the names,
    groups expanded (a custom shape keeps its commas)."""
    names: list[str] = []
    for part in _split(spec):
        names.extend(SHAPE_GROUPS.get(part, [part]))
    return names


def resolve_shapes(spec: str) -> list[Shape]:
    """A comma list of shape names, groups (single, ep, all) and custom shapes."""
    return [resolve_shape(n) for n in shape_names(spec)]


def resolve_ep_shape(spec: str) -> Shape:
    """An EP shape name, a unique prefix of one ("kimi_k2"), or ``custom:T,H,I,E,K[,shared]``
    (T per rank, E routed experts of the whole group)."""
    spec = spec.strip()
    if spec in EP_SHAPES:
        return EP_SHAPES[spec]
    if spec.startswith("custom:"):
        return _custom(spec)
    matches = [n for n in EP_SHAPES if n.startswith(spec)]
    if len(matches) == 1:
        return EP_SHAPES[matches[0]]
    raise ValueError(f"shapes: expected one of {sorted(EP_SHAPES)} (or a unique prefix, or "
                     f"custom:T,H,I,E,K[,shared]), got {spec!r}")


def resolve_ep_shapes(spec: str) -> list[Shape]:
    """A comma list of EP shapes (``resolve_ep_shape``), ``ep`` for all four."""
    out: list[Shape] = []
    for part in _split(spec):
        out.extend(EP_SHAPES.values() if part == "ep" else [resolve_ep_shape(part)])
    return out
