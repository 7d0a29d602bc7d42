"""Benchmark harness for the MoE layer forward (``mok-cute bench``, ``tools/bench.py``).

Protocol (DESIGN §5): every contender runs in one process and one run, on fresh random normal
data (never zeros). Before it is timed, each contender is checked against
``mok_cute.reference`` on a reduced-T problem with fresh inputs (relative Frobenius error
<= ``--tol``, default 1e-2); a failed check is recorded and not timed. Times are the median of
many iterations measured with CUDA events after a warm-up (``triton.testing.do_bench`` with
``return_mode="median"`` when triton is importable, which also flushes L2 between iterations;
otherwise an own event loop that does the same). Throughput is

    TFLOP/s = 6 * (T*K + T*[shared]) * H * I / time

with T the tokens of the whole problem. A contender that crashes (a compile failure, say) is
recorded with its error and the run goes on.

Contenders:
  mok_cute           mok_cute.moe_forward on the kernel path (a reference fallback is never timed)
  mok_cute_timeline  the same with MoKConfig(timeline=True): the recorder's overhead
  mok_cute_virtual   mok_cute.moe_forward_virtual with --ep-ranks ranks emulated on one GPU
                     (the megakernel, R ranks in one launch)
  mok_megakernel     mok_cute.moe_forward with backend="megakernel": the megakernel at R = 1
  torch_grouped_mm   argsort permute, torch._grouped_mm (gate+up), SwiGLU, torch._grouped_mm
                     (down), weighted scatter-sum in fp32
  per_expert_loop    one F.linear chain per expert
  sonicmoe           SonicMoE 0.1.2.post1 (moe_general_routing_inputs, inference mode)
  sonicmoe_train     the same in training mode (stores the pre-activation)
  cublas_8192        bf16 8192^3 torch.matmul: the ceiling

Shapes: DESIGN §5's single-GPU table (E = local experts, T = tokens) and MoK's four EP shapes
(T = tokens per rank; the problem holds the work of --ep-ranks ranks, R*T tokens over all routed
experts, plus one shared expert of size I). ``custom:T,H,I,E,K[,shared]`` defines any other.

Output: a rich table, ``<out>/<date>_<gpu>_<tag>.json`` (DESIGN §5 schema plus extra keys) and
a PNG bar chart beside it.

Example (one H200, issue 3's benchmark):
    mok-cute bench --shapes single --contenders mok_cute,torch_grouped_mm,sonicmoe,cublas_8192 --tag expert_kernels
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from mok_cute.figures import save_png
from mok_cute.gpu_clock import ClockSampler

# --------------------------------------------------------------------------------------------
# Shapes and the FLOP count
# --------------------------------------------------------------------------------------------


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


def resolve_shape(spec: str) -> Shape:
    """A named shape, or ``custom:T,H,I,E,K[,shared]``."""
    if spec in SHAPES:
        return SHAPES[spec]
    if spec.startswith("custom:"):
        try:
            vals = [int(v) for v in spec[len("custom:") :].split(",")]
        except ValueError:
            vals = []
        if len(vals) not in (5, 6) or min(vals[:5]) <= 0:
            raise ValueError(f"shape: expected custom:T,H,I,E,K[,shared] with positive integers, got {spec!r}")
        t, h, i, e, k = vals[:5]
        if k > e:
            raise ValueError(f"shape: top_k K={k} exceeds the expert count E={e} in {spec!r}")
        return Shape(spec, t, h, i, e, k, shared=bool(vals[5]) if len(vals) == 6 else False)
    raise ValueError(f"shape: expected one of {sorted(SHAPES)} or custom:T,H,I,E,K[,shared], got {spec!r}")


def resolve_shapes(spec: str) -> list[Shape]:
    names: list[str] = []
    for part in [p.strip() for p in re.split(r",(?![0-9])", spec) if p.strip()]:
        names.extend(SHAPE_GROUPS.get(part, [part]))
    return [resolve_shape(n) for n in names]


# --------------------------------------------------------------------------------------------
# Problems (random normal data, weights scaled by fan-in so activations stay O(1))
# --------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    x: torch.Tensor  # [T, H] bf16
    topk_idx: torch.Tensor  # [T, K] int32, global expert ids
    topk_weights: torch.Tensor  # [T, K] fp32


@dataclass
class Problem:
    shape: Shape
    inputs: Inputs
    w_gate: torch.Tensor  # [E, I, H]
    w_up: torch.Tensor  # [E, I, H]
    w_down: torch.Tensor  # [E, H, I]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    seed: int = 0

    @property
    def tokens(self) -> int:
        return int(self.inputs.x.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.w_gate.shape[0])

    @property
    def flops(self) -> float:
        return moe_flops(self.tokens, self.shape.hidden, self.shape.intermediate, self.shape.top_k, self.shared is not None)

    @property
    def routed_rows(self) -> int:
        return self.tokens * self.shape.top_k

    def with_fresh_inputs(self, tokens: int, seed: int) -> "Problem":
        """Same weights, new random tokens and routing."""
        gen = torch.Generator(device=self.w_gate.device).manual_seed(seed)
        inputs = random_inputs(tokens, self.shape.hidden, self.num_experts, self.shape.top_k, self.w_gate.device, gen)
        return replace(self, inputs=inputs, seed=seed)

    def virtual(self, ranks: int, inputs: Inputs | None = None) -> "VirtualInputs":
        return VirtualInputs.split(self, ranks, inputs)


@dataclass
class VirtualInputs:
    """A problem split over R emulated ranks (views, plus the shared expert replicated per rank)."""

    x: torch.Tensor  # [R, T/R, H]
    topk_idx: torch.Tensor  # [R, T/R, K] global ids
    topk_weights: torch.Tensor
    w_gate: torch.Tensor  # [R, E/R, I, H]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [R, E/R, H, I]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    @staticmethod
    def split(problem: Problem, ranks: int, inputs: Inputs | None = None, shared_rep=None) -> "VirtualInputs":
        inputs = inputs or problem.inputs
        t, e = inputs.x.shape[0], problem.num_experts
        if ranks <= 0 or t % ranks or e % ranks:
            raise ValueError(f"ranks: expected a divisor of both T={t} and E={e}, got {ranks}")
        if shared_rep is None and problem.shared is not None:
            shared_rep = tuple(w.unsqueeze(0).expand(ranks, *w.shape).contiguous() for w in problem.shared)
        return VirtualInputs(
            x=inputs.x.view(ranks, t // ranks, -1),
            topk_idx=inputs.topk_idx.view(ranks, t // ranks, -1),
            topk_weights=inputs.topk_weights.view(ranks, t // ranks, -1),
            w_gate=problem.w_gate.view(ranks, e // ranks, *problem.w_gate.shape[1:]),
            w_up=problem.w_up.view(ranks, e // ranks, *problem.w_up.shape[1:]),
            w_down=problem.w_down.view(ranks, e // ranks, *problem.w_down.shape[1:]),
            shared=shared_rep,
        )


def random_inputs(tokens: int, hidden: int, experts: int, top_k: int, device: Any, gen: torch.Generator) -> Inputs:
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    # K distinct experts per token, uniformly at random.
    topk_idx = torch.rand(tokens, experts, device=device, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    topk_weights = torch.softmax(torch.randn(tokens, top_k, device=device, generator=gen), dim=1)
    return Inputs(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous())


def _randn_weight(shape: Sequence[int], fan_in: int, device: Any, gen: torch.Generator) -> torch.Tensor:
    w = torch.empty(*shape, dtype=torch.bfloat16, device=device)
    # Fill expert by expert so the fp32 temporary stays small for big shapes.
    flat = w.view(-1, shape[-1]) if len(shape) > 1 else w.view(1, -1)
    rows = max(1, (1 << 26) // shape[-1])
    for start in range(0, flat.shape[0], rows):
        chunk = flat[start : start + rows]
        chunk.copy_(torch.randn(chunk.shape, device=device, generator=gen) * fan_in**-0.5)
    return w


def make_problem(
    shape: Shape,
    device: Any = "cuda",
    seed: int = 0,
    t_scale: float = 1.0,
    ranks: int = 1,
    tokens: int | None = None,
) -> Problem:
    """Random normal problem for ``shape``; ``tokens`` overrides the total token count."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    w_gate = _randn_weight((e, i, h), h, device, gen)
    w_up = _randn_weight((e, i, h), h, device, gen)
    w_down = _randn_weight((e, h, i), i, device, gen)
    shared = None
    if shape.shared:
        shared = (_randn_weight((i, h), h, device, gen), _randn_weight((i, h), h, device, gen), _randn_weight((h, i), i, device, gen))
    t = tokens if tokens is not None else shape.total_tokens(t_scale, ranks)
    inputs = random_inputs(t, h, e, shape.top_k, device, gen)
    return Problem(shape, inputs, w_gate, w_up, w_down, shared, seed)


# --------------------------------------------------------------------------------------------
# Contender implementations (pure torch ones are usable and tested on their own)
# --------------------------------------------------------------------------------------------


def _swiglu_bf16(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(torch.bfloat16)


def shared_expert(x: torch.Tensor, ws_gate_up: torch.Tensor, ws_down: torch.Tensor) -> torch.Tensor:
    """Shared expert in bf16 GEMMs: ``ws_gate_up`` is [2*Is, H] (gate rows, then up rows)."""
    gu = x @ ws_gate_up.t()
    i = ws_gate_up.shape[0] // 2
    return _swiglu_bf16(gu[:, :i], gu[:, i:]) @ ws_down.t()


def _weighted_scatter_sum(
    y: torch.Tensor, order: torch.Tensor, top_k: int, topk_weights: torch.Tensor, tokens: int, base: torch.Tensor | None
) -> torch.Tensor:
    """out[t] = bf16(base[t] + sum_k w[t,k] * y[row of (t,k)]) in fp32, rows in expert order."""
    token_of_row = order // top_k
    weight_of_row = topk_weights.reshape(-1).index_select(0, order).float()
    acc = base.float() if base is not None else torch.zeros(tokens, y.shape[1], dtype=torch.float32, device=y.device)
    acc.index_add_(0, token_of_row, y.float() * weight_of_row[:, None])
    return acc.to(torch.bfloat16)


def pack_grouped_mm_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights for :func:`torch_grouped_mm_moe`: gate and up concatenated to [E, 2I, H] and passed
    as its [E, H, 2I] transpose (column-major B, the layout _grouped_mm takes natively), and
    w_down [E, H, I] as its [E, I, H] transpose."""
    return torch.cat([w_gate, w_up], dim=1).transpose(1, 2), w_down.transpose(1, 2)


def torch_grouped_mm_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up_t: torch.Tensor,
    w_down_t: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The torch pipeline: argsort permute, grouped GEMM gate+up, SwiGLU, grouped GEMM down,
    weighted scatter-sum in fp32. ``shared`` = (ws_gate_up [2Is, H], ws_down [H, Is])."""
    tokens, top_k = topk_idx.shape
    experts, _, two_i = w_gate_up_t.shape
    sorted_ids, order = torch.sort(topk_idx.reshape(-1), stable=True)
    # Group ends from the sorted ids (torch.bincount on CUDA reads the max back: a host sync).
    offs = torch.searchsorted(sorted_ids, torch.arange(experts, device=x.device, dtype=sorted_ids.dtype), right=True).to(torch.int32)
    xs = x.index_select(0, order // top_k)
    gu = torch._grouped_mm(xs, w_gate_up_t, offs=offs)
    h = _swiglu_bf16(gu[:, : two_i // 2], gu[:, two_i // 2 :])
    y = torch._grouped_mm(h, w_down_t, offs=offs)
    base = shared_expert(x, *shared) if shared is not None else None
    return _weighted_scatter_sum(y, order, top_k, topk_weights, tokens, base)


def per_expert_loop_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One F.linear chain per expert over its sorted rows (one host sync for the counts)."""
    tokens, top_k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate.shape[0]).tolist()
    xs = x.index_select(0, order // top_k)
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            xe = xs[start : start + n]
            ys.append(F.linear(_swiglu_bf16(F.linear(xe, w_gate[e]), F.linear(xe, w_up[e])), w_down[e]))
            start += n
    y = torch.cat(ys) if ys else xs.new_zeros(0, w_down.shape[1])
    base = shared_expert(x, *shared) if shared is not None else None
    return _weighted_scatter_sum(y, order, top_k, topk_weights, tokens, base)


def _fused_shared(problem: Problem) -> tuple[torch.Tensor, torch.Tensor] | None:
    if problem.shared is None:
        return None
    ws_gate, ws_up, ws_down = problem.shared
    return torch.cat([ws_gate, ws_up], dim=0), ws_down


class SkipContender(Exception):
    """The contender cannot run here (not installed, no GPU, reference path): recorded, not timed."""


@dataclass
class BenchContext:
    device: torch.device
    out_dir: Path
    ep_ranks: int = 1
    mok_config: dict[str, Any] = field(default_factory=dict)
    quack_cache: Path | None = None


Runner = Callable[[Inputs], torch.Tensor]


def forward_path_of(mok_module: Any, device: Any = None, config: Any = None) -> str:
    """``mok_cute.forward_path(device, config)`` as a string ("unknown: ..." when it cannot be asked)."""
    fn = getattr(mok_module, "forward_path", None)
    if fn is None:
        return "unknown: mok_cute.forward_path does not exist"
    try:
        return str(fn(device, config))
    except TypeError:
        try:
            return str(fn())
        except Exception as exc:  # an odd signature must not stop the benchmark
            return f"unknown: forward_path() raised {type(exc).__name__}: {exc}"
    except Exception as exc:
        return f"unknown: forward_path() raised {type(exc).__name__}: {exc}"


def is_kernel_path(path: str) -> bool:
    """forward_path() starts with "kernel:" on the kernel path ("reference:" / "error:" otherwise)."""
    return path.strip().lower().startswith("kernel")


def virtual_path_of(mok_module: Any, device: Any, config: Any) -> tuple[bool, str]:
    """Does moe_forward_virtual run the kernels? (yes, why) from mok_cute.api.choose_path."""
    try:
        choice = mok_module.api.choose_path(device, config, virtual=True)
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return choice.path in ("kernel", "megakernel"), f"{choice.path}: {choice.reason}"


def parse_contenders(spec: str, allowed: Sequence[str]) -> list[str]:
    """``--contenders``: a comma list of names from ``allowed`` (ValueError naming the others)."""
    contenders = [c.strip() for c in spec.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in allowed]
    if unknown:
        raise ValueError(f"--contenders: expected names from {list(allowed)}, got {unknown}")
    return contenders


def parse_config_overrides(items: Sequence[str]) -> dict[str, Any]:
    """KEY=VALUE strings (also comma-separated) to MoKConfig keyword arguments."""
    out: dict[str, Any] = {}
    for item in items:
        for pair in [p for p in item.split(",") if p]:
            if "=" not in pair:
                raise ValueError(f"--mok-config: expected KEY=VALUE, got {pair!r}")
            key, raw = pair.split("=", 1)
            value: Any
            if raw in ("None", "none"):
                value = None
            elif raw in ("True", "true", "False", "false"):
                value = raw.lower() == "true"
            else:
                try:
                    value = int(raw)
                except ValueError:
                    try:
                        value = float(raw)
                    except ValueError:
                        value = raw
            out[key.strip()] = value
    return out


def _mok_config(ctx: BenchContext, **extra: Any):
    import mok_cute

    fields = {"backend": "kernel", **ctx.mok_config, **extra}
    return mok_cute.MoKConfig(**fields)


def _prepare_mok_cute(problem: Problem, ctx: BenchContext, timeline: bool = False) -> tuple[Runner, dict[str, Any]]:
    import mok_cute

    cfg = _mok_config(ctx, timeline=True) if timeline else _mok_config(ctx)
    path = forward_path_of(mok_cute, problem.inputs.x.device, cfg)
    if not is_kernel_path(path):
        raise SkipContender(f"mok_cute.forward_path() = {path!r}: not the kernel path, so not timed as mok_cute")
    wg, wu, wd, sh = problem.w_gate, problem.w_up, problem.w_down, problem.shared

    def run(inp: Inputs) -> torch.Tensor:
        return mok_cute.moe_forward(inp.x, inp.topk_idx, inp.topk_weights, wg, wu, wd, shared=sh, config=cfg)

    return run, {"path": path, "config": repr(cfg)}


def _prepare_mok_megakernel(problem: Problem, ctx: BenchContext) -> tuple[Runner, dict[str, Any]]:
    import dataclasses

    import mok_cute

    cfg = dataclasses.replace(_mok_config(ctx), backend="megakernel")
    choice = mok_cute.api.choose_path(problem.inputs.x.device, cfg)
    wg, wu, wd, sh = problem.w_gate, problem.w_up, problem.w_down, problem.shared

    def run(inp: Inputs) -> torch.Tensor:
        return mok_cute.moe_forward(inp.x, inp.topk_idx, inp.topk_weights, wg, wu, wd, shared=sh, config=cfg)

    return run, {"path": f"{choice.path}: {choice.reason}", "config": repr(cfg)}


def _prepare_mok_cute_virtual(problem: Problem, ctx: BenchContext) -> tuple[Runner, dict[str, Any]]:
    import mok_cute

    ranks = ctx.ep_ranks
    cfg = _mok_config(ctx)
    on_kernel, path = virtual_path_of(mok_cute, problem.inputs.x.device, cfg)
    if not on_kernel:
        raise SkipContender(f"moe_forward_virtual does not run the kernels ({path}), so not timed as mok_cute")
    template = problem.virtual(ranks)  # replicates the shared expert once, outside the timed region

    def run(inp: Inputs) -> torch.Tensor:
        v = VirtualInputs.split(problem, ranks, inp, shared_rep=template.shared)
        out = mok_cute.moe_forward_virtual(v.x, v.topk_idx, v.topk_weights, v.w_gate, v.w_up, v.w_down, shared=v.shared, config=cfg)
        return out.reshape(-1, out.shape[-1])

    return run, {"path": path, "ranks": ranks, "config": repr(cfg)}


def _prepare_torch_grouped_mm(problem: Problem, ctx: BenchContext) -> tuple[Runner, dict[str, Any]]:
    if not hasattr(torch, "_grouped_mm"):
        raise SkipContender(f"torch {torch.__version__} has no torch._grouped_mm")
    w_gate_up_t, w_down_t = pack_grouped_mm_weights(problem.w_gate, problem.w_up, problem.w_down)
    shared = _fused_shared(problem)

    def run(inp: Inputs) -> torch.Tensor:
        return torch_grouped_mm_moe(inp.x, inp.topk_idx, inp.topk_weights, w_gate_up_t, w_down_t, shared)

    return run, {}


def _prepare_per_expert_loop(problem: Problem, ctx: BenchContext) -> tuple[Runner, dict[str, Any]]:
    shared = _fused_shared(problem)
    wg, wu, wd = problem.w_gate, problem.w_up, problem.w_down

    def run(inp: Inputs) -> torch.Tensor:
        return per_expert_loop_moe(inp.x, inp.topk_idx, inp.topk_weights, wg, wu, wd, shared)

    return run, {}


def _import_sonicmoe(ctx: BenchContext):
    # quack reads these at import time: cache compiled kernels and autotuning results.
    os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")
    if ctx.quack_cache is not None and "QUACK_CACHE_DIR" not in os.environ:
        ctx.quack_cache.mkdir(parents=True, exist_ok=True)
        # Compiled kernels are big binaries: keep them out of git even under benchmarks/results/.
        (ctx.quack_cache / ".gitignore").write_text("*\n")
        os.environ["QUACK_CACHE_DIR"] = str(ctx.quack_cache)
    try:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_general_routing_inputs
    except Exception as exc:
        raise SkipContender(f"sonicmoe not importable: {type(exc).__name__}: {exc}") from exc
    return moe_general_routing_inputs, ActivationType


def _prepare_sonicmoe(problem: Problem, ctx: BenchContext, train: bool = False) -> tuple[Runner, dict[str, Any]]:
    if ctx.device.type != "cuda":
        raise SkipContender("sonicmoe needs a CUDA GPU")
    moe_general_routing_inputs, ActivationType = _import_sonicmoe(ctx)
    e, i, h = problem.w_gate.shape
    # SonicMoE wants w1 as (2I, H, E) with E outermost and gate/up rows interleaved
    # (row 2j = gate_j, row 2j+1 = up_j), and w2 as (H, I, E): permuted views of [E, 2I, H] / [E, H, I].
    w1 = torch.stack([problem.w_gate, problem.w_up], dim=2).reshape(e, 2 * i, h).permute(1, 2, 0)
    w2 = problem.w_down.permute(1, 2, 0)
    shared = _fused_shared(problem)
    stream_id = torch.cuda.current_stream().cuda_stream
    token_index_cache: dict[tuple[int, int], torch.Tensor] = {}

    def run(inp: Inputs) -> torch.Tensor:
        t, k = inp.topk_idx.shape
        if (t, k) not in token_index_cache:  # routing-independent, built once per size
            token_index_cache[(t, k)] = torch.arange(t, device=inp.x.device, dtype=torch.int32).repeat_interleave(k)
        out, _ = moe_general_routing_inputs(
            inp.x,
            inp.topk_weights.reshape(-1),
            token_index_cache[(t, k)],
            inp.topk_idx.reshape(-1),
            w1,
            None,
            w2,
            None,
            e,
            stream_id,
            ActivationType.SWIGLU,
            is_inference_mode_enabled=not train,
        )
        if shared is not None:  # SonicMoE has no shared expert: add it with torch GEMMs
            out = (out.float() + shared_expert(inp.x, *shared).float()).to(torch.bfloat16)
        return out

    info: dict[str, Any] = {"mode": "train" if train else "inference"}
    if shared is not None:
        info["shared_expert_via"] = "torch"
    return run, info


CONTENDERS: dict[str, Callable[[Problem, BenchContext], tuple[Runner, dict[str, Any]]]] = {
    "mok_cute": _prepare_mok_cute,
    "mok_cute_timeline": lambda p, c: _prepare_mok_cute(p, c, timeline=True),
    "mok_cute_virtual": _prepare_mok_cute_virtual,
    "mok_megakernel": _prepare_mok_megakernel,
    "torch_grouped_mm": _prepare_torch_grouped_mm,
    "per_expert_loop": _prepare_per_expert_loop,
    "sonicmoe": _prepare_sonicmoe,
    "sonicmoe_train": lambda p, c: _prepare_sonicmoe(p, c, train=True),
}
ALL_CONTENDERS = [*CONTENDERS, "cublas_8192"]
DEFAULT_CONTENDERS = ["mok_cute", "torch_grouped_mm", "per_expert_loop", "sonicmoe", "cublas_8192"]
BASELINE = "torch_grouped_mm"


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Median time of ``fn`` in ms after a warm-up: CUDA events (triton's do_bench when importable)
    on a GPU, the host clock on the CPU."""

    def __init__(self, device: torch.device, iters: int = 100, warmup: int = 25):
        if iters < 1 or warmup < 0:
            raise ValueError(f"iters/warmup: expected iters >= 1 and warmup >= 0, got {iters}/{warmup}")
        self.device, self.iters, self.warmup = device, iters, warmup
        self.method = "host clock (CPU)"
        self._do_bench = None
        if device.type == "cuda":
            try:
                from triton.testing import do_bench

                self._do_bench = do_bench
                self.method = "triton.testing.do_bench (CUDA events, L2 flushed, median)"
            except Exception:
                self.method = "CUDA events, L2 flushed, median"

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.device.type != "cuda":
            for _ in range(self.warmup):
                fn()
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = max(start.elapsed_time(end) / 3, 1e-3)
        if self._do_bench is not None:
            # do_bench takes its warm-up and repeat budgets in ms: aim at the requested counts.
            return float(
                self._do_bench(fn, warmup=max(1.0, self.warmup * estimate_ms), rep=max(1.0, self.iters * estimate_ms), return_mode="median")
            )
        flush = torch.empty(256 << 20, dtype=torch.int8, device=self.device)
        for _ in range(self.warmup):
            fn()
        pairs = []
        for _ in range(self.iters):
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            pairs.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (NaN if the shapes differ or anything is not finite)."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("nan")
    o, r = out.detach().float(), ref.detach().float()
    err = float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-30))
    return err if torch.isfinite(o).all() else float("nan")


def reference_output(problem: Problem) -> torch.Tensor:
    from mok_cute import reference

    i = problem.inputs
    return reference.moe_forward(i.x, i.topk_idx, i.topk_weights, problem.w_gate, problem.w_up, problem.w_down, shared=problem.shared)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _shape_keys(shape: Shape, problem: Problem, ranks: int) -> dict[str, Any]:
    return {
        "T": problem.tokens,
        "H": shape.hidden,
        "I": shape.intermediate,
        "E": shape.experts,
        "K": shape.top_k,
        "shared": shape.shared,
        "ranks": ranks if shape.per_rank_tokens else 1,
        "flops": problem.flops,
    }


def _error_text(exc: BaseException) -> str:
    tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
    return f"{type(exc).__name__}: {exc}".strip()[:2000] + " | " + "".join(tail).strip()[-1500:]


def _free(device: torch.device) -> None:
    from mok_cute import megakernel

    megakernel.release_plans()  # a plan holds rings sized for its shape
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_cublas(ctx: BenchContext, timer: Timer, n: int = 8192, tol: float = 1e-2, log: Callable[[str], None] = print) -> dict[str, Any]:
    entry: dict[str, Any] = {"shape": f"matmul_{n}", "contender": "cublas_8192", "pass": "fwd", "ms": None, "tflops": None}
    if ctx.device.type != "cuda":
        return {**entry, "status": "skipped", "error": "cuBLAS ceiling needs a CUDA GPU"}
    try:
        gen = torch.Generator(device=ctx.device).manual_seed(1234)
        a = torch.randn(512, 512, device=ctx.device, generator=gen).to(torch.bfloat16)
        b = torch.randn(512, 512, device=ctx.device, generator=gen).to(torch.bfloat16)
        entry["rel_err"] = rel_err(torch.matmul(a, b), a.float() @ b.float())
        if not entry["rel_err"] <= tol:
            return {**entry, "status": "check_failed", "error": f"rel err {entry['rel_err']:.3g} > {tol}"}
        a = torch.randn(n, n, device=ctx.device, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, n, device=ctx.device, generator=gen).to(torch.bfloat16)
        ms = timer(functools.partial(torch.matmul, a, b))  # bound now: a and b are deleted below
        entry.update(ms=ms, tflops=2.0 * n**3 / (ms * 1e-3) / 1e12, status="ok")
        del a, b
    except Exception as exc:
        entry.update(status="error", error=_error_text(exc))
    _free(ctx.device)
    log(f"cublas_8192: {entry.get('status')} {entry.get('tflops')}")
    return entry


def bench_shape(
    shape: Shape,
    contenders: Sequence[str],
    ctx: BenchContext,
    timer: Timer,
    t_scale: float = 1.0,
    check_tokens: int = 512,
    tol: float = 1e-2,
    seed: int = 0,
    log: Callable[[str], None] = print,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Check then time every contender on one shape; failures are recorded, never raised.

    ``rounds`` = 1: each contender is checked, timed and freed in turn. ``rounds`` > 1: every
    contender is checked and kept alive, then all are timed ``rounds`` times in alternating
    order (A B C, C B A, ...) and each reports the median of its rounds (``ms_rounds`` keeps
    them): the GPU's clock drifts within a process (7 % between identical runs, docs/gpu_runs.md
    run 24), and a contender always timed last would carry that drift. Needs every
    contender's memory at once."""
    ranks = ctx.ep_ranks if shape.per_rank_tokens else 1
    base = {"shape": shape.name, "pass": "fwd"}
    try:
        problem = make_problem(shape, ctx.device, seed=seed, t_scale=t_scale, ranks=ranks)
        step = ctx.ep_ranks  # the check problem must split evenly over the virtual ranks
        check = problem.with_fresh_inputs(max(step, check_tokens // step * step), seed=seed + 1)
        ref = reference_output(check)
    except Exception as exc:
        err = _error_text(exc)
        log(f"{shape.name}: setup failed: {err}")
        return [{**base, "contender": c, "ms": None, "tflops": None, "status": "error", "error": f"setup: {err}"} for c in contenders]
    keys = _shape_keys(shape, problem, ranks)
    results, runners = [], {}

    def finish(entry: dict[str, Any]) -> None:
        log(f"{shape.name} {entry['contender']}: {entry['status']}"
            + (f" {entry['tflops']:.1f} TFLOP/s" if entry["tflops"] else f" ({entry.get('error', '')[:200]})"))

    for name in contenders:
        entry: dict[str, Any] = {**base, "contender": name, "ms": None, "tflops": None, **keys}
        run = None
        try:
            if name == "mok_cute_virtual" and ctx.ep_ranks > 1:
                entry["ranks"] = ctx.ep_ranks
            run, info = CONTENDERS[name](problem, ctx)
            entry.update(info)
            out = run(check.inputs)
            _sync(ctx.device)
            entry["rel_err"] = rel_err(out, ref)
            del out
            if not entry["rel_err"] <= tol:
                entry.update(status="check_failed", error=f"rel err {entry['rel_err']:.3g} > {tol} vs mok_cute.reference (T={check.tokens})")
            elif rounds > 1:
                runners[name] = (run, entry)  # timed below, with the others
            else:
                ms = timer(functools.partial(run, problem.inputs))
                entry.update(ms=ms, tflops=problem.flops / (ms * 1e-3) / 1e12, status="ok")
        except SkipContender as exc:
            entry.update(status="skipped", error=str(exc))
        except Exception as exc:
            entry.update(status="error", error=_error_text(exc))
        if name not in runners:
            run = None
            _free(ctx.device)
            finish(entry)
        results.append(entry)
    if runners:
        times: dict[str, list[float]] = {name: [] for name in runners}
        order = list(runners)
        # the SM clock and power while each contender ran: at the H200's power cap a
        # contender's clock is part of its result (mok_cute.gpu_clock)
        sampler = ClockSampler(ctx.device) if ctx.device.type == "cuda" else None
        with sampler or contextlib.nullcontext():
            for r in range(rounds):
                for name in (order if r % 2 == 0 else order[::-1]):
                    run, entry = runners[name]
                    if "error" in entry:
                        continue
                    try:
                        with sampler.window(name) if sampler else contextlib.nullcontext():
                            times[name].append(timer(functools.partial(run, problem.inputs)))
                    except Exception as exc:
                        entry.update(status="error", error=_error_text(exc))
        for name, (_, entry) in runners.items():
            if "error" not in entry:
                ms = float(statistics.median(times[name]))
                entry.update(ms=ms, ms_rounds=times[name], tflops=problem.flops / (ms * 1e-3) / 1e12, status="ok")
                clock = sampler.stats(name) if sampler else None
                if clock is not None:
                    entry["gpu_clock"] = clock
            finish(entry)
        runners.clear()
    del problem, check, ref
    _free(ctx.device)
    return results


def paired_ratio(num: list[float] | None, den: list[float] | None) -> float | None:
    """The median over rounds of ``num[r] / den[r]``: two contenders timed in the same
    interleaved rounds (None unless both have the same number of rounds)."""
    if not num or not den or len(num) != len(den):
        return None
    return float(statistics.median(a / b for a, b in zip(num, den)))


def add_ratios(results: list[dict[str, Any]]) -> None:
    """``ratio_vs_torch`` (TFLOP/s over the torch pipeline's on the same shape),
    ``frac_cublas`` (over the cuBLAS 8192^3 rate of the same run) and, for mok_cute_timeline,
    ``timeline_overhead`` (its time over mok_cute's, minus 1: the recorder's cost).

    With rounds (``ms_rounds``), also the paired ratios: ``paired_vs_torch`` = the median over
    rounds of torch's time over the contender's in that round, ``paired_ms_over_mok_cute`` =
    the median of the contender's time over mok_cute's per round. Why: contenders of one round
    run back to back, while the clock drifts between rounds (up to 25 %, eleventh session), so
    a ratio of two medians can pair a fast round of one with a slow round of the other."""
    cublas = next((r["tflops"] for r in results if r["contender"] == "cublas_8192" and r.get("tflops")), None)
    torch_rate = {r["shape"]: r["tflops"] for r in results if r["contender"] == BASELINE and r.get("tflops")}
    mok_ms = {r["shape"]: r["ms"] for r in results if r["contender"] == "mok_cute" and r.get("ms")}
    rounds_of = {(r["shape"], r["contender"]): r["ms_rounds"] for r in results if r.get("ms_rounds")}

    for r in results:
        if r.get("ms_rounds"):
            mine = r["ms_rounds"]
            r["paired_vs_torch"] = paired_ratio(rounds_of.get((r["shape"], BASELINE)), mine)
            r["paired_ms_over_mok_cute"] = paired_ratio(mine, rounds_of.get((r["shape"], "mok_cute")))
        if r.get("tflops"):
            base = torch_rate.get(r["shape"])
            r["ratio_vs_torch"] = r["tflops"] / base if base else None
            r["frac_cublas"] = r["tflops"] / cublas if cublas else None
        if r["contender"] == "mok_cute_timeline" and r.get("ms") and r["shape"] in mok_ms:
            r["timeline_overhead"] = r["ms"] / mok_ms[r["shape"]] - 1.0


def versions() -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version()}
    for dist in ("torch", "triton", "nvidia-cutlass-dsl", "mok-cute", "sonic-moe", "quack-kernels", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    out["cuda"] = torch.version.cuda
    return out


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"


def gpu_slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = re.sub(r"^nvidia-", "", slug)
    return slug.split("-")[0] if slug.startswith("cpu") else slug


def result_path(out_dir: Path, gpu: str, tag: str, date: str) -> Path:
    stem = f"{date}_{gpu_slug(gpu)}_{re.sub(r'[^A-Za-z0-9_.-]+', '-', tag)}"
    path, n = out_dir / f"{stem}.json", 2
    while path.exists():  # one file per run: never overwrite an earlier run
        path, n = out_dir / f"{stem}_{n}.json", n + 1
    return path


# JSON schema of a result file: DESIGN §5 plus the extra keys this harness writes.
RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["gpu", "date", "command", "versions", "results"],
    "properties": {
        "gpu": {"type": "string"},
        "date": {"type": "string"},
        "command": {"type": "string"},
        "versions": {"type": "object"},
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["shape", "contender", "pass", "ms", "tflops"],
                "properties": {
                    "shape": {"type": "string"},
                    "contender": {"type": "string"},
                    "pass": {"enum": ["fwd", "bwd"]},
                    "ms": {"type": ["number", "null"], "exclusiveMinimum": 0},
                    "tflops": {"type": ["number", "null"], "exclusiveMinimum": 0},
                    "status": {"enum": ["ok", "check_failed", "skipped", "error"]},
                    "rel_err": {"type": ["number", "null"]},
                    "ratio_vs_torch": {"type": ["number", "null"]},
                    "frac_cublas": {"type": ["number", "null"]},
                    "path": {"type": "string"},
                    "error": {"type": "string"},
                },
            },
        },
    },
}


def plot_results(results: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> Path:
    """Grouped bar chart: TFLOP/s per shape and contender, the cuBLAS ceiling as a dashed line,
    each bar labelled with its ratio to the torch pipeline; failed or skipped contenders marked."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    layer = [r for r in results if r["contender"] != "cublas_8192"]
    shapes = list(dict.fromkeys(r["shape"] for r in layer))
    names = list(dict.fromkeys(r["contender"] for r in layer))
    cublas = next((r["tflops"] for r in results if r["contender"] == "cublas_8192" and r.get("tflops")), None)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(shapes) * max(1, len(names)) / 3 + 3), 5))
    width = 0.8 / max(1, len(names))
    cmap = matplotlib.colormaps["tab10"]
    top = max((r["tflops"] or 0 for r in results), default=0.0) or 1.0
    for j, name in enumerate(names):
        for s_i, shape in enumerate(shapes):
            r = next((r for r in layer if r["shape"] == shape and r["contender"] == name), None)
            if r is None:
                continue
            xpos = s_i + (j - (len(names) - 1) / 2) * width
            if r.get("tflops"):
                ax.bar(xpos, r["tflops"], width, color=cmap(j % 10), label=name if s_i == 0 else None)
                ratio = r.get("ratio_vs_torch")
                label = f"{ratio:.2f}x" if ratio else f"{r['tflops']:.0f}"
                ax.text(xpos, r["tflops"], label, ha="center", va="bottom", fontsize=7, rotation=90)
            else:
                ax.bar(xpos, top * 0.02, width, color="white", edgecolor=cmap(j % 10), hatch="xx", label=name if s_i == 0 else None)
                ax.text(xpos, top * 0.03, r.get("status", "failed"), ha="center", va="bottom", fontsize=7, rotation=90, color="red")
    if cublas:
        ax.axhline(cublas, color="black", linestyle="--", linewidth=1)
        ax.text(len(shapes) - 0.5, cublas, f"cuBLAS bf16 8192^3: {cublas:.0f}", ha="right", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=15)
    ax.set_ylabel("TFLOP/s  (6 (TK + T[shared]) H I / t)")
    ax.set_ylim(0, top * 1.18)
    ax.set_title(title or "MoE layer forward")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path


def print_results(results: list[dict[str, Any]], console: Any = None, title: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=title)
    paired = any(r.get("paired_ms_over_mok_cute") is not None for r in results)
    cols = ["shape", "contender", "status", "rel err", "ms", "TFLOP/s", "x torch", "% cuBLAS"]
    cols += ["/ mok_cute, paired"] if paired else []
    for col in cols + ["note"]:
        table.add_column(col, justify="left" if col in ("shape", "contender", "status", "note") else "right")

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in results:
        note = r.get("path", "") if r.get("status") == "ok" else r.get("error", "")
        style = {"ok": "", "skipped": "dim", "check_failed": "red", "error": "red"}.get(r.get("status", ""), "")
        table.add_row(
            r["shape"],
            r["contender"],
            r.get("status", ""),
            num(r.get("rel_err"), ".2e"),
            num(r.get("ms"), ".3f"),
            num(r.get("tflops"), ".1f"),
            num(r.get("ratio_vs_torch"), ".2f"),
            "-" if r.get("frac_cublas") is None else f"{100 * r['frac_cublas']:.0f}",
            *([num(r.get("paired_ms_over_mok_cute"), ".3f")] if paired else []),
            (note or "")[:70],
            style=style,
        )
    console.print(table)


def command_line(argv: Sequence[str]) -> str:
    """The command that ran this benchmark, as a user would type it again: the process's own
    command line when it ends with ``argv``, else ``mok-cute bench <argv>`` (a call from Python)."""
    argv = list(argv)
    process = list(sys.argv)
    if not process or process[len(process) - len(argv) :] != argv:
        return shlex.join(["mok-cute", "bench", *argv])
    prog = process[0] or "mok-cute"
    if prog.endswith(os.path.join("mok_cute", "benchmark.py")):
        head = ["python", "-m", "mok_cute.benchmark"]
    elif prog.endswith(".py"):
        relative = os.path.relpath(prog)
        head = ["python", prog if relative.startswith("..") else relative]
    else:
        head = [Path(prog).name]
    return shlex.join([*head, *process[1:]])


def switches() -> dict[str, bool | int]:
    """The experimental switches in force (``config.SWITCHES``), with every module that
    defines one imported first."""
    from mok_cute import config

    for module in ("megakernel", "ops", "schedule"):  # importing one registers its switches
        importlib.import_module(f"mok_cute.{module}")

    return dict(sorted(config.SWITCHES.items()))


def save_results(results: list[dict[str, Any]], out_dir: Path, tag: str, gpu: str, command: str,
                 argv: Sequence[str], extra: dict[str, Any], title: Callable[[str], str],
                 chart: list[dict[str, Any]] | None = None) -> tuple[Path, Path]:
    """The results JSON (DESIGN §5: GPU, date, command, versions, switches, ``extra``,
    results) and its bar chart (of ``chart``, default ``results``; ``title(date)``)."""
    now = time.localtime()
    doc = {
        "gpu": gpu,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", now),
        "command": command,
        "argv": list(argv),
        "versions": versions(),
        "switches": switches(),
        **extra,
        "results": results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = result_path(out_dir, gpu, tag, time.strftime("%Y-%m-%d", now))
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    png_path = plot_results(results if chart is None else chart, json_path.with_suffix(".png"),
                            title=title(doc["date"][:10]))
    return json_path, png_path


def write_results(
    results: list[dict[str, Any]], out_dir: Path, tag: str, device: torch.device, argv: Sequence[str], extra: dict[str, Any] | None = None
) -> tuple[Path, Path]:
    gpu = gpu_name(device)
    return save_results(results, out_dir, tag, gpu, command_line(argv), argv, extra or {},
                        lambda date: f"MoE forward on {gpu}, {date} ({tag})")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--ep" in argv:  # expert parallelism across torchrun ranks: its own harness
        from . import ep_bench

        return ep_bench.main(argv)
    parser = argparse.ArgumentParser(
        prog="mok-cute bench",
        description="Time the MoE layer forward of mok_cute against the torch._grouped_mm pipeline, a per-expert "
        "loop, SonicMoE and the cuBLAS ceiling, in one process (DESIGN §5).",
    )
    parser.add_argument("--shapes", default="single", help="comma list of shape names, groups single/ep/all, or custom:T,H,I,E,K[,shared] (default: single)")
    parser.add_argument(
        "--contenders",
        default=None,
        help=f"comma list of {ALL_CONTENDERS} (default: {','.join(DEFAULT_CONTENDERS)}, plus mok_cute_virtual when --ep-ranks > 1)",
    )
    parser.add_argument("--t-scale", type=float, default=1.0, help="scale every shape's token count (e.g. 0.25)")
    parser.add_argument("--iters", type=int, default=100, help="timed iterations (median)")
    parser.add_argument("--warmup", type=int, default=25, help="warm-up iterations")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time all contenders of a shape this many times in alternating order "
                        "and report medians (clock drift; keeps every contender alive at once)")
    parser.add_argument("--out", default="benchmarks/results", help="output directory for JSON and PNG")
    parser.add_argument("--tag", default="fwd", help="file name tag")
    parser.add_argument("--check-tokens", type=int, default=512, help="tokens of the correctness check against mok_cute.reference")
    parser.add_argument("--tol", type=float, default=1e-2, help="relative error bound of the check")
    parser.add_argument("--ep-ranks", type=int, default=1, help="ranks R of the EP shapes (R*2048 tokens); R>1 adds mok_cute_virtual")
    parser.add_argument("--mok-config", action="append", default=[], metavar="KEY=VALUE", help="MoKConfig field for the mok_cute contenders, repeatable")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu (smoke runs: host clock)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quack-cache", default=None, help="QUACK_CACHE_DIR for SonicMoE (default <out>/quack_cache unless set)")
    parser.add_argument("--list", action="store_true", help="list shapes and contenders, then exit")
    args = parser.parse_args(argv)

    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=180)
    if args.list:
        for name, s in SHAPES.items():
            console.print(f"{name:14s} T={s.tokens}{'/rank' if s.per_rank_tokens else ''} H={s.hidden} I={s.intermediate} E={s.experts} K={s.top_k}{' +shared' if s.shared else ''}")
        console.print("contenders: " + ", ".join(ALL_CONTENDERS))
        return 0
    try:
        shapes = resolve_shapes(args.shapes)
        if args.contenders is None:
            contenders = DEFAULT_CONTENDERS[:1] + ["mok_cute_virtual"] * (args.ep_ranks > 1) + DEFAULT_CONTENDERS[1:]
        else:
            contenders = parse_contenders(args.contenders, ALL_CONTENDERS)
        if args.ep_ranks < 1:
            raise ValueError(f"--ep-ranks: expected >= 1, got {args.ep_ranks}")
        if args.rounds < 1:
            raise ValueError(f"--rounds: expected >= 1, got {args.rounds}")
        if not 0 < args.t_scale <= 1e6:
            raise ValueError(f"--t-scale: expected a positive factor, got {args.t_scale}")
        mok_config = parse_config_overrides(args.mok_config)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_dir = Path(args.out)
    ctx = BenchContext(
        device=device,
        out_dir=out_dir,
        ep_ranks=args.ep_ranks,
        mok_config=mok_config,
        quack_cache=Path(args.quack_cache) if args.quack_cache else out_dir / "quack_cache",
    )
    timer = Timer(device, iters=args.iters, warmup=args.warmup)
    console.print(f"device {gpu_name(device)}; timing: {timer.method}; {args.warmup} warm-up + {args.iters} iterations")
    log = lambda msg: console.print(msg, markup=False, highlight=False)  # noqa: E731

    results: list[dict[str, Any]] = []
    if "cublas_8192" in contenders:
        results.append(bench_cublas(ctx, timer, tol=args.tol, log=log))
    layer_contenders = [c for c in contenders if c != "cublas_8192"]
    for shape in shapes if layer_contenders else []:
        results.extend(
            bench_shape(shape, layer_contenders, ctx, timer, args.t_scale, args.check_tokens, args.tol, args.seed, log=log,
                        rounds=args.rounds)
        )
    add_ratios(results)
    extra = {"timing": timer.method, "iters": args.iters, "warmup": args.warmup, "t_scale": args.t_scale, "ep_ranks": args.ep_ranks, "rounds": args.rounds}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        extra["gpu_info"] = {"capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1)}
    json_path, png_path = write_results(results, out_dir, args.tag, device, argv, extra)
    print_results(results, console, title=f"MoE forward, {gpu_name(device)}")
    console.print(f"json {json_path}\npng  {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
