"""The one-GPU benchmark of the MoE layer forward (``mok-cute bench``; from a checkout
``python -m mok_cute.cli bench``).

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
  mok_cute_fp8       mok_cute.moe_forward with precision="fp8" (weights quantized once, cached;
                     checked at rel err <= 0.08 against the bf16 reference)
  mok_megakernel_fp8, mok_cute_virtual_fp8  the megakernel at R = 1 / on --ep-ranks virtual
                     ranks with precision="fp8" (forward-only; checked as mok_cute_fp8)
  torch_scaled_grouped_mm  the FP8 baseline: the same pipeline on torch._scaled_grouped_mm, x and
                     h quantized per row, weights per output channel once (checked at 0.08)
  torch_grouped_mm   argsort permute, torch._grouped_mm (gate+up), SwiGLU, torch._grouped_mm
                     (down), weighted scatter-sum in fp32
  per_expert_loop    one F.linear chain per expert
  sonicmoe           SonicMoE 0.1.2.post1 (moe_general_routing_inputs, inference mode)
  sonicmoe_train     the same in training mode (stores the pre-activation)
  cublas_8192        bf16 8192^3 torch.matmul: the ceiling
  cublas_fp8_8192    e4m3 8192^3 torch._scaled_mm, two rows: per-tensor scales and DeepSeek's
                     blockwise 1x128 / 128x128 (cuBLAS's split accumulation): the FP8 ceilings

``--mok-config KEY=VALUE`` sets a ``MoKConfig`` field of the mok_cute contenders (default
``backend="kernel", check_ids=False``: ``common.BENCH_CONFIG``), dotted for a field of its
options objects: ``--mok-config megakernel.tickets=static expert_path.fc2_pingpong_max_k=0
check_ids=True``. The JSON records
the resulting config (``mok_config``) and each mok_cute row the one it ran (``config``).

Shapes (``mok_cute.shapes``): DESIGN §5's single-GPU table (E = local experts, T = tokens) and MoK's four EP shapes
(T = tokens per rank; the problem holds the work of --ep-ranks ranks, R*T tokens over all routed
experts, plus one shared expert of size I). ``custom:T,H,I,E,K[,shared]`` defines any other.

Output: a rich table, ``<out>/<date>_<gpu>_<tag>.json`` (DESIGN §5 schema plus extra keys) and
a PNG bar chart beside it.

Example (one H200: the expert path and the megakernel at R = 1 against the references):
    mok-cute bench --shapes single --contenders mok_cute,mok_megakernel,torch_grouped_mm,cublas_8192 \
        --rounds 3

``mok-cute bench --ep`` runs the expert-parallel bench instead (``mok_cute.bench.ep``),
``mok-cute bench --train`` the training bench (``mok_cute.bench.training``, dispatched by the CLI).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mok_cute.bench.common import (BENCH_CONFIG, apply_config_overrides, burn_in, check_iters, error_text,
                                   paired_ratio, forward_path_of,
                                   free_memory, parse_config_overrides, parse_contenders, rel_err,
                                   sync)
from mok_cute.bench.gpu_clock import ClockSampler
from mok_cute.bench.problems import Inputs, Problem, VirtualInputs, make_problem
from mok_cute.bench.results import chart_dependency_missing, config_record, gpu_name, save_results
from mok_cute.bench.torch_moe import (fuse_shared, pack_grouped_mm_weights, pack_scaled_grouped_mm_weights,
                                      per_expert_loop_moe, shared_expert, torch_grouped_mm_moe,
                                      torch_scaled_grouped_mm_moe)
from mok_cute.config import MoKConfig, check_device
from mok_cute.shapes import SHAPES, Shape, resolve_shapes


class SkipContender(Exception):
    """The contender cannot run here (not installed, no GPU, reference path): recorded, not timed."""


@dataclass
class BenchContext:
    device: torch.device
    out_dir: Path
    ep_ranks: int = 1
    # the mok_cute contenders' config (each may change a field: the recorder, the backend)
    mok_config: MoKConfig = field(default_factory=lambda: MoKConfig(backend="kernel"))
    quack_cache: Path | None = None


Runner = Callable[[Inputs], torch.Tensor]


def is_kernel_path(path: str) -> bool:
    """forward_path() starts with "kernel:" on the expert path, "megakernel:" under
    ``--mok-config backend=megakernel`` ("reference:" / "error:" when no kernel runs)."""
    return path.strip().lower().startswith(("kernel:", "megakernel:"))


def virtual_path_of(device: Any, config: MoKConfig) -> tuple[bool, str]:
    """Does moe_forward_virtual run the kernels? (yes, why) from mok_cute.api.choose_path."""
    from mok_cute.api import choose_path

    try:
        choice = choose_path(device, config, virtual=True)
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return choice.path in ("kernel", "megakernel"), f"{choice.path}: {choice.reason}"


def _mok_config(ctx: BenchContext, **changes: Any) -> MoKConfig:
    return dataclasses.replace(ctx.mok_config, **changes)


def _prepare_mok_cute(problem: Problem, ctx: BenchContext, timeline: bool = False) -> tuple[Runner, dict[str, Any]]:
    import mok_cute

    cfg = _mok_config(ctx, timeline=True) if timeline else _mok_config(ctx)
    path = forward_path_of(problem.inputs.x.device, cfg)
    if not is_kernel_path(path):
        raise SkipContender(f"mok_cute.forward_path() = {path!r}: not the kernel path, so not timed as mok_cute")
    wg, wu, wd, sh = problem.w_gate, problem.w_up, problem.w_down, problem.shared

    def run(inp: Inputs) -> torch.Tensor:
        return mok_cute.moe_forward(inp.x, inp.topk_idx, inp.topk_weights, wg, wu, wd, shared=sh, config=cfg)

    return run, {"path": path, "config": config_record(cfg)}


def _prepare_mok_cute_fp8(problem: Problem, ctx: BenchContext) -> tuple[Runner, dict[str, Any]]:
    """mok_cute with precision="fp8" (its weights quantized in the first call, then cached:
    the timed calls are the forward of a model between optimizer steps)."""
    import mok_cute

    cfg = _mok_config(ctx, precision="fp8")
    path = forward_path_of(problem.inputs.x.device, cfg)
    if not is_kernel_path(path):
        raise SkipContender(f"mok_cute.forward_path() = {path!r}: not the kernel path")
    wg, wu, wd, sh = problem.w_gate, problem.w_up, problem.w_down, problem.shared

    def run(inp: Inputs) -> torch.Tensor:
        with torch.no_grad():
            return mok_cute.moe_forward(inp.x, inp.topk_idx, inp.topk_weights, wg, wu, wd,
                                        shared=sh, config=cfg)

    return run, {"path": path, "config": config_record(cfg)}


def _prepare_mok_megakernel(problem: Problem, ctx: BenchContext,
                            precision: str = "bf16") -> tuple[Runner, dict[str, Any]]:
    import mok_cute
    from mok_cute.api import choose_path

    cfg = _mok_config(ctx, backend="megakernel", precision=precision)
    choice = choose_path(problem.inputs.x.device, cfg)
    wg, wu, wd, sh = problem.w_gate, problem.w_up, problem.w_down, problem.shared

    def run(inp: Inputs) -> torch.Tensor:
        with torch.no_grad():
            return mok_cute.moe_forward(inp.x, inp.topk_idx, inp.topk_weights, wg, wu, wd,
                                        shared=sh, config=cfg)

    return run, {"path": f"{choice.path}: {choice.reason}", "config": config_record(cfg)}


def _prepare_mok_cute_virtual(problem: Problem, ctx: BenchContext,
                              precision: str = "bf16") -> tuple[Runner, dict[str, Any]]:
    import mok_cute

    ranks = ctx.ep_ranks
    cfg = _mok_config(ctx, precision=precision)
    on_kernel, path = virtual_path_of(problem.inputs.x.device, cfg)
    if not on_kernel:
        raise SkipContender(f"moe_forward_virtual does not run the kernels ({path}), so not timed as mok_cute")
    template = problem.virtual(ranks)  # replicates the shared expert once, outside the timed region

    def run(inp: Inputs) -> torch.Tensor:
        v = VirtualInputs.split(problem, ranks, inp, shared_rep=template.shared)
        # the template's weight views, made once: fp8's weight cache holds them
        with torch.no_grad():
            out = mok_cute.moe_forward_virtual(v.x, v.topk_idx, v.topk_weights, template.w_gate,
                                               template.w_up, template.w_down, shared=v.shared,
                                               config=cfg)
        return out.reshape(-1, out.shape[-1])

    return run, {"path": path, "ranks": ranks, "config": config_record(cfg)}


def _prepare_torch_grouped_mm(problem: Problem, ctx: BenchContext) -> tuple[Runner, dict[str, Any]]:
    if not hasattr(torch, "_grouped_mm"):
        raise SkipContender(f"torch {torch.__version__} has no torch._grouped_mm")
    w_gate_up_t, w_down_t = pack_grouped_mm_weights(problem.w_gate, problem.w_up, problem.w_down)
    shared = fuse_shared(problem.shared)

    def run(inp: Inputs) -> torch.Tensor:
        return torch_grouped_mm_moe(inp.x, inp.topk_idx, inp.topk_weights, w_gate_up_t, w_down_t, shared)

    return run, {}


def _prepare_torch_scaled_grouped_mm(problem: Problem, ctx: BenchContext) -> tuple[Runner, dict[str, Any]]:
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise SkipContender(f"torch {torch.__version__} has no torch._scaled_grouped_mm")
    weights = pack_scaled_grouped_mm_weights(problem.w_gate, problem.w_up, problem.w_down)
    shared = fuse_shared(problem.shared)

    def run(inp: Inputs) -> torch.Tensor:
        return torch_scaled_grouped_mm_moe(inp.x, inp.topk_idx, inp.topk_weights, *weights, shared)

    return run, {}


def _prepare_per_expert_loop(problem: Problem, ctx: BenchContext) -> tuple[Runner, dict[str, Any]]:
    shared = fuse_shared(problem.shared)
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


def sonicmoe_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """SonicMoE's FC1 weight from ours: [E, 2I, H] with gate and up rows interleaved (row 2j =
    gate_j, row 2j+1 = up_j); :func:`sonicmoe_runner` passes its (2I, H, E) view."""
    e, i, h = w_gate.shape
    return torch.stack([w_gate, w_up], dim=2).reshape(e, 2 * i, h)


def sonicmoe_runner(moe_general_routing_inputs, activation, w1: torch.Tensor, w2: torch.Tensor,
                    shared: tuple[torch.Tensor, torch.Tensor] | None, train: bool) -> Callable[..., torch.Tensor]:
    """``run(x, topk_idx, topk_weights)``: SonicMoE's layer on mok_cute's inputs, ``w1`` from
    :func:`sonicmoe_gate_up`, ``w2`` = w_down [E, H, I] (both passed as E-last views, so the
    gradients of a training run land on them); ``shared`` = (ws_gate_up, ws_down) added with
    torch GEMMs (SonicMoE has no shared expert)."""
    num_experts = w1.shape[0]
    stream_id = torch.cuda.current_stream().cuda_stream
    token_index_cache: dict[tuple[int, int], torch.Tensor] = {}

    def run(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t, k = topk_idx.shape
        if (t, k) not in token_index_cache:  # routing-independent, built once per size
            token_index_cache[(t, k)] = torch.arange(t, device=x.device, dtype=torch.int32).repeat_interleave(k)
        out, _ = moe_general_routing_inputs(
            x, topk_weights.reshape(-1), token_index_cache[(t, k)], topk_idx.reshape(-1),
            w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, num_experts, stream_id, activation,
            is_inference_mode_enabled=not train,
        )
        if shared is not None:
            out = (out.float() + shared_expert(x, *shared).float()).to(torch.bfloat16)
        return out

    return run


def _prepare_sonicmoe(problem: Problem, ctx: BenchContext, train: bool = False) -> tuple[Runner, dict[str, Any]]:
    if ctx.device.type != "cuda":
        raise SkipContender("sonicmoe needs a CUDA GPU")
    moe_general_routing_inputs, ActivationType = _import_sonicmoe(ctx)
    shared = fuse_shared(problem.shared)
    layer = sonicmoe_runner(moe_general_routing_inputs, ActivationType.SWIGLU,
                            sonicmoe_gate_up(problem.w_gate, problem.w_up), problem.w_down, shared, train)

    def run(inp: Inputs) -> torch.Tensor:
        return layer(inp.x, inp.topk_idx, inp.topk_weights)

    info: dict[str, Any] = {"mode": "train" if train else "inference"}
    if shared is not None:
        info["shared_expert_via"] = "torch"
    return run, info


CONTENDERS: dict[str, Callable[[Problem, BenchContext], tuple[Runner, dict[str, Any]]]] = {
    "mok_cute": _prepare_mok_cute,
    "mok_cute_timeline": lambda p, c: _prepare_mok_cute(p, c, timeline=True),
    "mok_cute_virtual": _prepare_mok_cute_virtual,
    "mok_cute_fp8": _prepare_mok_cute_fp8,
    "mok_megakernel": _prepare_mok_megakernel,
    "mok_megakernel_fp8": lambda p, c: _prepare_mok_megakernel(p, c, precision="fp8"),
    "mok_cute_virtual_fp8": lambda p, c: _prepare_mok_cute_virtual(p, c, precision="fp8"),
    "torch_grouped_mm": _prepare_torch_grouped_mm,
    "torch_scaled_grouped_mm": _prepare_torch_scaled_grouped_mm,
    "per_expert_loop": _prepare_per_expert_loop,
    "sonicmoe": _prepare_sonicmoe,
    "sonicmoe_train": lambda p, c: _prepare_sonicmoe(p, c, train=True),
}
CEILINGS = ("cublas_8192", "cublas_fp8_8192")  # rows of their own, not layer contenders
ALL_CONTENDERS = [*CONTENDERS, *CEILINGS]
# a contender whose numerics differ from the bf16 reference by design: its check's bound
# (issue 33: FP8 output rel-L1 <= 0.08 against the bf16 layer)
CONTENDER_TOL = {"mok_cute_fp8": 0.08, "mok_megakernel_fp8": 0.08, "mok_cute_virtual_fp8": 0.08,
                 "torch_scaled_grouped_mm": 0.08}
DEFAULT_CONTENDERS = ["mok_cute", "torch_grouped_mm", "per_expert_loop", "sonicmoe", "cublas_8192"]
BASELINE = "torch_grouped_mm"


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


class Timer:
    """Median time of ``fn`` in ms after a warm-up: CUDA events (triton's do_bench when importable)
    on a GPU, the host clock on the CPU."""

    def __init__(self, device: torch.device, iters: int = 100, warmup: int = 25):
        check_iters(iters, warmup)
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


def reference_output(problem: Problem) -> torch.Tensor:
    from mok_cute import reference

    i = problem.inputs
    return reference.moe_forward(i.x, i.topk_idx, i.topk_weights, problem.w_gate, problem.w_up, problem.w_down, shared=problem.shared)


def sampled_tokens(problem: Problem, sample: int, seed: int) -> torch.Tensor:
    """``sample`` distinct random token indices of ``problem`` (all of them when it has fewer),
    on its device: the rows the checks at the timed T compare."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randperm(problem.tokens, generator=gen)[:sample].to(problem.inputs.x.device)


def timed_size_error(run: Runner, problem: Problem, sample: int = 256, seed: int = 0) -> float:
    """The relative error of ``run``'s output at the timed T, on ``sample`` random tokens'
    rows against the reference on those tokens alone (a token's row depends on its own x,
    ids and weights only): what the check at a small T cannot see (several minibatches, a
    ring that wraps, large-M schedules)."""
    from mok_cute import reference

    out = run(problem.inputs)
    i = problem.inputs
    rows = sampled_tokens(problem, sample, seed)
    want = reference.moe_forward(i.x[rows], i.topk_idx[rows], i.topk_weights[rows], problem.w_gate,
                                 problem.w_up, problem.w_down, shared=problem.shared)
    return rel_err(out[rows], want)


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


def bench_cublas_fp8(ctx: BenchContext, timer: Timer, n: int = 8192, tol: float = 0.08,
                     log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The FP8 ceilings: ``torch._scaled_mm`` on n^3 e4m3 with per-tensor scales and with
    blockwise 1 x 128 (A, fp32 [n, n/128] column-major) / 128 x 128 (B) scales, each checked
    against the bf16 product (rel err <= ``tol``). A recipe this torch or cuBLAS lacks is
    recorded with its error."""
    from mok_cute.bench.torch_moe import FP8_MAX

    rows = []
    for recipe in ("tensorwise", "blockwise"):
        entry: dict[str, Any] = {"shape": f"matmul_{n}", "contender": f"cublas_fp8_{recipe}_{n}",
                                 "pass": "fwd", "ms": None, "tflops": None}
        rows.append(entry)
        if ctx.device.type != "cuda":
            entry.update(status="skipped", error="cuBLAS ceiling needs a CUDA GPU")
            continue
        try:
            gen = torch.Generator(device=ctx.device).manual_seed(1234)
            a = torch.randn(n, n, device=ctx.device, generator=gen)
            b = torch.randn(n, n, device=ctx.device, generator=gen)  # used as [N, K]
            if recipe == "tensorwise":
                sa = (a.abs().max() / FP8_MAX).reshape(())
                sb = (b.abs().max() / FP8_MAX).reshape(())
                qa, qb = (a / sa).to(torch.float8_e4m3fn), (b / sb).to(torch.float8_e4m3fn)
            else:
                g = n // 128
                sa = a.view(n, g, 128).abs().amax(-1).clamp_min(1e-12) / FP8_MAX  # [M, K/128]
                qa = (a.view(n, g, 128) / sa[..., None]).view(n, n).to(torch.float8_e4m3fn)
                sa = sa.t().contiguous().t()  # column-major, as cuBLAS takes 1 x 128 scales
                sb = b.view(g, 128, g, 128).abs().amax((1, 3)).clamp_min(1e-12) / FP8_MAX  # [N/128, K/128]
                qb = (b.view(g, 128, g, 128) / sb[:, None, :, None]).view(n, n).to(torch.float8_e4m3fn)
                sb = sb.t()  # [K/128, N/128], the transpose of a row-major [N/128, K/128]
            run = functools.partial(torch._scaled_mm, qa, qb.t(), scale_a=sa, scale_b=sb,
                                    out_dtype=torch.bfloat16)
            entry["rel_err"] = rel_err(run(), a @ b.t())
            if not entry["rel_err"] <= tol:
                entry.update(status="check_failed", error=f"rel err {entry['rel_err']:.3g} > {tol}")
                continue
            ms = timer(run)
            entry.update(ms=ms, tflops=2.0 * n ** 3 / (ms * 1e-3) / 1e12, status="ok")
            del a, b, qa, qb, run
        except Exception as exc:
            entry.update(status="error", error=error_text(exc))
        free_memory(ctx.device)
        log(f"{entry['contender']}: {entry.get('status')} {entry.get('tflops')} {entry.get('error', '')[:150]}")
    return rows


def bench_cublas(ctx: BenchContext, timer: Timer, n: int = 8192, tol: float = 1e-2,
                 log: Callable[[str], None] = print, rounds: int = 1) -> dict[str, Any]:
    """The bf16 ceiling: cuBLAS's n^3 matmul, after a burn-in, the median of ``rounds`` timings
    with the clock recorded (the benches time it after their shapes: at the sustained clock
    their contenders ran at; timed first, on a cool GPU, it read 806 TFLOP/s where 655 is
    sustained, understating every "% cuBLAS")."""
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
        run = functools.partial(torch.matmul, a, b)  # bound now: a and b are deleted below
        burn_in([run], ctx.device)
        with ClockSampler(ctx.device) as sampler:
            with sampler.window("cublas"):
                times = [timer(run) for _ in range(rounds)]
        ms = float(statistics.median(times))
        entry.update(ms=ms, ms_rounds=times, tflops=2.0 * n**3 / (ms * 1e-3) / 1e12, status="ok")
        clock = sampler.stats("cublas")
        if clock is not None:
            entry["gpu_clock"] = clock
        del a, b, run
    except Exception as exc:
        entry.update(status="error", error=error_text(exc))
    free_memory(ctx.device)
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
    them): the GPU's clock drifts within a process (7 % between identical runs, run 24,
    docs/measurements.md), and a contender always timed last would carry that drift. Needs every
    contender's memory at once."""
    ranks = ctx.ep_ranks if shape.per_rank_tokens else 1
    base = {"shape": shape.name, "pass": "fwd"}
    try:
        problem = make_problem(shape, ctx.device, seed=seed, t_scale=t_scale, ranks=ranks)
        step = ctx.ep_ranks  # the check problem must split evenly over the virtual ranks
        check = problem.with_fresh_inputs(max(step, check_tokens // step * step), seed=seed + 1)
        ref = reference_output(check)
    except Exception as exc:
        err = error_text(exc)
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
            sync(ctx.device)
            entry["rel_err"] = rel_err(out, ref)
            del out
            bound = max(tol, CONTENDER_TOL.get(name, 0.0))
            if entry["rel_err"] <= bound:  # and at the timed T, on a sample of its tokens
                entry["timed_size_rel_err"] = timed_size_error(run, problem, seed=seed)
            if not entry["rel_err"] <= bound:
                entry.update(status="check_failed", error=f"rel err {entry['rel_err']:.3g} > {bound} vs mok_cute.reference (T={check.tokens})")
            elif not entry["timed_size_rel_err"] <= bound:
                entry.update(status="check_failed", error=f"rel err {entry['timed_size_rel_err']:.3g} > {bound} vs mok_cute.reference on 256 of the timed T={problem.tokens} tokens")
            elif rounds > 1:
                runners[name] = (run, entry)  # timed below, with the others
            else:
                ms = timer(functools.partial(run, problem.inputs))
                entry.update(ms=ms, tflops=problem.flops / (ms * 1e-3) / 1e12, status="ok")
        except SkipContender as exc:
            entry.update(status="skipped", error=str(exc))
        except Exception as exc:
            entry.update(status="error", error=error_text(exc))
        if name not in runners:
            run = None
            free_memory(ctx.device)
            finish(entry)
        results.append(entry)
    if runners:
        times: dict[str, list[float]] = {name: [] for name in runners}
        order = list(runners)
        # the SM clock and power while each contender ran: at the H200's power cap a
        # contender's clock is part of its result (mok_cute.bench.gpu_clock)
        sampler = ClockSampler(ctx.device) if ctx.device.type == "cuda" else None
        burn_in([functools.partial(run, problem.inputs) for run, entry in runners.values()
                 if "error" not in entry], ctx.device)
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
                        entry.update(status="error", error=error_text(exc))
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
    free_memory(ctx.device)
    return results


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
    if prog.endswith(os.path.join("mok_cute", "bench", "harness.py")):
        head = ["python", "-m", "mok_cute.bench.harness"]
    elif prog.endswith(".py"):
        relative = os.path.relpath(prog)
        head = ["python", prog if relative.startswith("..") else relative]
    else:
        head = [Path(prog).name]
    return shlex.join([*head, *process[1:]])


def write_results(
    results: list[dict[str, Any]], out_dir: Path, tag: str, device: torch.device, argv: Sequence[str],
    config: MoKConfig, extra: dict[str, Any] | None = None
) -> tuple[Path, Path]:
    gpu = gpu_name(device)
    return save_results(results, out_dir, tag, gpu, command_line(argv), argv, config, extra or {},
                        lambda date: f"MoE forward on {gpu}, {date} ({tag})")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--ep" in argv:  # expert parallelism across torchrun ranks: its own harness
        from mok_cute.bench import ep

        return ep.main(argv)
    if "--train" in argv:
        raise SystemExit("mok-cute bench --train: the training bench is mok_cute.bench.training.main")
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
    parser.add_argument("--rounds", type=int, default=3,
                        help="time all contenders of a shape this many times in alternating order "
                        "after a burn-in and report medians (clock drift; keeps every contender "
                        "alive at once; 1: each in turn, no clock record)")
    parser.add_argument("--out", default="benchmarks/results", help="output directory for JSON and PNG")
    parser.add_argument("--tag", default="fwd", help="file name tag")
    parser.add_argument("--check-tokens", type=int, default=512, help="tokens of the correctness check against mok_cute.reference")
    parser.add_argument("--tol", type=float, default=1e-2, help="relative error bound of the check")
    parser.add_argument("--ep-ranks", type=int, default=1, help="ranks R of the EP shapes (R*2048 tokens); R>1 adds mok_cute_virtual")
    parser.add_argument("--mok-config", action="append", default=[], metavar="KEY=VALUE",
                        help="a MoKConfig field of the mok_cute contenders (default backend=kernel check_ids=False), dotted for an "
                        "options field (megakernel.tickets=static, expert_path.fc2_pingpong_max_k=0); repeatable")
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
        mok_config = apply_config_overrides(BENCH_CONFIG, parse_config_overrides(args.mok_config))
        missing = chart_dependency_missing()  # before minutes of timing, not after
        if missing:
            raise ValueError(f"mok-cute bench: {missing}")
        device = check_device("--device", args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        timer = Timer(device, iters=args.iters, warmup=args.warmup)  # checks --iters, --warmup
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    out_dir = Path(args.out)
    ctx = BenchContext(
        device=device,
        out_dir=out_dir,
        ep_ranks=args.ep_ranks,
        mok_config=mok_config,
        quack_cache=Path(args.quack_cache) if args.quack_cache else out_dir / "quack_cache",
    )
    console.print(f"device {gpu_name(device)}; timing: {timer.method}; {args.warmup} warm-up + {args.iters} iterations")
    log = lambda msg: console.print(msg, markup=False, highlight=False)  # noqa: E731

    results: list[dict[str, Any]] = []
    layer_contenders = [c for c in contenders if c not in CEILINGS]
    for shape in shapes if layer_contenders else []:
        results.extend(
            bench_shape(shape, layer_contenders, ctx, timer, args.t_scale, args.check_tokens, args.tol, args.seed, log=log,
                        rounds=args.rounds)
        )
    # the ceilings after the shapes: at the clock the contenders ran at
    if "cublas_8192" in contenders:
        results.append(bench_cublas(ctx, timer, tol=args.tol, log=log, rounds=args.rounds))
    if "cublas_fp8_8192" in contenders:
        results.extend(bench_cublas_fp8(ctx, timer, log=log))
    add_ratios(results)
    extra = {"timing": timer.method, "iters": args.iters, "warmup": args.warmup, "t_scale": args.t_scale, "ep_ranks": args.ep_ranks, "rounds": args.rounds}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        extra["gpu_info"] = {"capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1)}
    json_path, png_path = write_results(results, out_dir, args.tag, device, argv, mok_config, extra)
    print_results(results, console, title=f"MoE forward, {gpu_name(device)}")
    console.print(f"json {json_path}\npng  {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
