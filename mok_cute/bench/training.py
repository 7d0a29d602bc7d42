"""The one-GPU training benchmark of the MoE layer (``mok-cute bench --train``).

Same protocol as the forward bench (``mok_cute.bench.harness``, DESIGN §5): one process, fresh
random normal data, every contender checked before it is timed, interleaved rounds with the
SM clock sampled. Each contender is a differentiable layer call; per shape it reports three
passes:

  fwd    the training forward (grad enabled: activations saved)     6 TKHI / t
  bwd    ``out.backward(d_out)`` on a retained graph (grads reset)  12 TKHI / t
  train  forward + backward, one step                               18 TKHI / t

(TK -> TK + T with the shared expert.) The check: on ``--check-tokens`` tokens, the output and
every gradient against autograd on ``mok_cute.reference`` (relative L1 <= ``--tol``; the routed
weight gradients on ``CHECKED_EXPERTS`` experts spread over E); then one step at the timed T, its
output, d_x and d_topk_weights rows of 256 random tokens against the reference on those tokens,
each row within ``ROW_TOL_FACTOR`` x that tolerance (``timed_size_errors``); a failed check is
recorded and not timed. Memory: every layer's weights are the problem's own tensors (no copies), and only one
contender's weight gradients are alive at a time, so the MoK shapes fit (kimi's weights are
34 GB). ``saved_bytes_per_token`` is the memory the forward keeps for
the backward (``memory_allocated`` after the forward, minus before, minus the output) over T;
``step_peak_bytes`` one training step's peak above what was alive before it (saved activations,
the backward's workspaces and the gradients it returns).

Contenders:
  mok_cute          mok_cute.moe_forward, backend="kernel" (the custom ops of mok_cute.autograd)
  mok_megakernel    mok_cute.moe_forward, backend="megakernel": the megakernel's forward at one
                    rank, the backward megakernel (every routed GEMM of the backward in one launch)
  mok_virtual       mok_cute.moe_forward_virtual over VIRTUAL_RANKS (8) ranks emulated on one GPU,
                    the same total tokens and experts (each rank T / 8 tokens, E / 8 experts and a
                    replica of the shared expert, whose gradients are summed over the replicas)
  mok_cute_fp8      the same with precision="fp8" (FP8 forward, FP8 dgrads, bf16 weight
                    gradients; checked at relative L1 <= 0.1); its train pass quantizes the
                    weights as after an optimizer step, fwd and bwd reuse the cached copies
  mok_virtual_fp8   mok_virtual with precision="fp8" (the FP8 megakernel's saving launch, the
                    FP8 backward kernels over the ranks' concatenated schedules)
  mok_cute_main_grad  mok_cute with fuse_wgrad_accumulation=True: its weights carry fp32
                    main_grad buffers (twice the expert weights' bytes) that the backward adds
                    into (never zeroed between timed calls, as over micro-batches); checked on
                    the main_grad sums
  cublas_8192       (a row of its own) bf16 8192^3 torch.matmul: the ceiling
  torch_grouped_mm  the torch pipeline of mok_cute.bench.torch_moe under autograd, gate and up
                    one packed [E, 2I, H] parameter (the layout it runs fastest on)
  torch_scaled_grouped_mm  the FP8 baseline: the same pipeline with its two GEMMs on
                    torch._scaled_grouped_mm (rowwise scales; FP8 forward and d_x, bf16 weight
                    gradients: mok_cute_fp8's recipe), weights quantized in every call
  sonicmoe          SonicMoE 0.1.2.post1 in training mode (gate/up interleaved [E, 2I, H]
                    parameter); ``--sonic-tuning fixed`` (default) gives each QuACK autotuner one
                    config (128x192 tiles, 2x1 cluster, ping-pong where valid, else its first
                    valid one): full tuning of one shape's forward and backward takes over 10 min
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from mok_cute.api import MoKConfig, forget_quantized_weights, moe_forward, moe_forward_virtual
from mok_cute.bench.common import (BENCH_CONFIG, GRAD_NAMES, TRAIN_PASSES, apply_config_overrides, burn_in,
                                   error_text, free_memory, paired_ratio, parse_config_overrides,
                                   parse_contenders, pass_runners)
from mok_cute.bench.gpu_clock import ClockSampler
from mok_cute.bench.harness import (Timer, bench_cublas, command_line, sampled_tokens,
                                    sonicmoe_gate_up, sonicmoe_runner)
from mok_cute.bench.problems import Problem, make_problem
from mok_cute.bench.results import gpu_name, save_results
from mok_cute.bench.torch_moe import (QuantizedWeights, fuse_shared, torch_grouped_mm_moe,
                                      torch_scaled_grouped_mm_train)
from mok_cute.shapes import resolve_shapes

CONTENDERS = ("mok_cute", "mok_cute_fp8", "mok_cute_main_grad", "mok_megakernel", "mok_virtual",
              "mok_virtual_fp8", "torch_grouped_mm", "torch_scaled_grouped_mm", "sonicmoe")
MOK = ("mok_cute", "mok_cute_fp8", "mok_cute_main_grad", "mok_megakernel", "mok_virtual",
       "mok_virtual_fp8")
VIRTUAL_RANKS = 8
# the FP8 gradient bound, cosine >= 0.996
CONTENDER_TOL = {"mok_cute_fp8": 0.1, "mok_virtual_fp8": 0.1, "torch_scaled_grouped_mm": 0.1}
DEFAULT_CONTENDERS = ("mok_cute", "torch_grouped_mm")
PASSES = TRAIN_PASSES


class Layer:
    """A contender's differentiable call on one problem: ``leaves`` (requires_grad) and
    ``forward()``; ``grads()`` maps its leaves' gradients to the reference's names."""

    def __init__(self, name: str, problem: Problem, config: MoKConfig):
        self.name = name
        self.new_weights = None  # FP8 contenders: what an optimizer step's new weights redo
        i = problem.inputs
        x = i.x.detach().clone().requires_grad_()
        w = i.topk_weights.detach().clone().requires_grad_()
        idx = i.topk_idx
        self.main_grad_params = []  # mok_cute_main_grad: the weights whose main_grad it adds into
        if name in ("mok_virtual", "mok_virtual_fp8"):
            if name == "mok_virtual_fp8":
                config = dataclasses.replace(config, precision="fp8")
                self.new_weights = forget_quantized_weights
            params, self.forward = _virtual_forward(problem, x, idx, w, config)
        elif name in MOK:
            if name == "mok_cute_fp8":
                config = dataclasses.replace(config, precision="fp8")
                self.new_weights = forget_quantized_weights
            if name == "mok_megakernel":
                config = dataclasses.replace(config, backend="megakernel")
            params = [problem.w_gate, problem.w_up, problem.w_down, *(problem.shared or ())]
            params = [p.detach().requires_grad_() for p in params]  # the problem's storage
            if name == "mok_cute_main_grad":  # Megatron's fp32 main_grad, fused accumulation
                config = dataclasses.replace(config, fuse_wgrad_accumulation=True)
                for p in params:
                    p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                self.main_grad_params = params
            shared = tuple(params[3:]) or None
            self.forward = lambda: moe_forward(x, idx, w, *params[:3], shared=shared, config=config)
        elif name == "sonicmoe":
            self.forward = _sonicmoe_forward(problem, x, idx, w)
            params = self.forward.params
        else:
            # gate and up as one [E, 2I, H] leaf, used through its [E, H, 2I] transpose
            gate_up = torch.cat([problem.w_gate, problem.w_up], dim=1).requires_grad_()
            down = problem.w_down.detach().clone().requires_grad_()
            fused = fuse_shared(problem.shared)
            params = [gate_up, down] + ([t.detach().clone().requires_grad_() for t in fused] if fused else [])
            shared = tuple(params[2:]) or None
            if name == "torch_scaled_grouped_mm":  # e4m3 weights cached as mok_cute's
                cache = QuantizedWeights()
                self.new_weights = cache.clear
                self.forward = lambda: torch_scaled_grouped_mm_train(x, idx, w, gate_up, down,
                                                                     shared, cache)
            else:
                self.forward = lambda: torch_grouped_mm_moe(x, idx, w, gate_up.transpose(1, 2),
                                                            down.transpose(1, 2), shared=shared)
        self.leaves = [x, w, *params]
        self.intermediate = problem.shape.intermediate

    def reset(self) -> None:
        """Gradients dropped between timed calls (main_grad buffers keep accumulating, as over
        a step's micro-batches: zeroing them is no part of a backward)."""
        for t in self.leaves:
            t.grad = None

    def zero_main_grads(self) -> None:
        for p in self.main_grad_params:
            p.main_grad.zero_()

    def grads(self) -> dict[str, torch.Tensor]:
        g = [t.grad for t in self.leaves]
        if self.main_grad_params:  # the weights' gradients are their main_grad sums
            g = g[:2] + [p.main_grad for p in self.main_grad_params]
        if self.name in ("mok_virtual", "mok_virtual_fp8"):  # the shared expert's replicas'
            # gradients, summed
            g = g[:5] + [None if t is None else t.sum(0) for t in g[5:]]
        if self.name in MOK:
            return dict(zip(GRAD_NAMES, g))
        i = self.intermediate
        if self.name == "sonicmoe":  # gate and up rows interleaved
            out = {"x": g[0], "topk_weights": g[1], "w_gate": g[2][:, 0::2], "w_up": g[2][:, 1::2], "w_down": g[3]}
        else:
            out = {"x": g[0], "topk_weights": g[1], "w_gate": g[2][:, :i], "w_up": g[2][:, i:], "w_down": g[3]}
        if len(g) > 4:
            out.update(ws_gate=g[4][:i], ws_up=g[4][i:], ws_down=g[5])
        return out


def _virtual_forward(problem: Problem, x, idx, w, config: MoKConfig):
    """(parameters, forward) of ``mok_virtual``: the layer's tokens and experts over
    ``VIRTUAL_RANKS`` emulated ranks (views of one x / weight leaf each; the shared expert one
    leaf per rank)."""
    r = VIRTUAL_RANKS
    t, e = x.shape[0], problem.w_gate.shape[0]
    if t % r or e % r:
        raise ValueError(f"mok_virtual splits T={t} tokens and E={e} experts over {r} ranks")
    experts = [p.detach().requires_grad_() for p in (problem.w_gate, problem.w_up, problem.w_down)]
    shared = [p.detach().unsqueeze(0).repeat(r, *(1,) * p.dim()).requires_grad_()
              for p in (problem.shared or ())]

    def forward() -> torch.Tensor:
        per_rank = lambda a: a.view(r, a.shape[0] // r, *a.shape[1:])  # noqa: E731
        out = moe_forward_virtual(per_rank(x), per_rank(idx), per_rank(w),
                                  *(per_rank(p) for p in experts), shared=tuple(shared) or None,
                                  config=config)
        return out.reshape(t, -1)

    return experts + shared, forward


def _sonicmoe_forward(problem: Problem, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_general_routing_inputs

    w1 = sonicmoe_gate_up(problem.w_gate, problem.w_up).requires_grad_()
    w2 = problem.w_down.detach().clone().requires_grad_()
    fused = fuse_shared(problem.shared)
    shared = [t.detach().clone().requires_grad_() for t in fused] if fused else []
    layer = sonicmoe_runner(moe_general_routing_inputs, ActivationType.SWIGLU, w1, w2, tuple(shared) or None,
                            train=True)

    def forward() -> torch.Tensor:
        return layer(x, idx, w)

    forward.params = [w1, w2, *shared]
    return forward


def fix_sonicmoe_tuning(quack_cache: Path) -> None:
    """One config per QuACK autotuner (see the module doc) and its cache under ``quack_cache``."""
    os.environ.setdefault("QUACK_CACHE_DIR", str(quack_cache))  # before quack is imported
    from quack import autotuner

    prune = autotuner.Autotuner.prune_configs
    want = {"tile_m": 128, "tile_n": 192, "cluster_m": 2, "pingpong": True}

    def one_config(self, kwargs):
        configs = prune(self, kwargs)
        match = [c for c in configs if all(getattr(c.kwargs["config"], k, None) == v for k, v in want.items())]
        return (match or configs)[:1]

    autotuner.Autotuner.prune_configs = one_config


CHECKED_EXPERTS = 8  # the routed weight gradients are compared on this many experts, spread over E


def checked(name: str, grad: torch.Tensor) -> torch.Tensor:
    """What the check compares of a gradient: a routed expert weight's on ``CHECKED_EXPERTS``
    experts spread over E (memory: the MoK shapes' weights take 13-51 GB, and the check must not
    hold a second copy of their gradients), anything else whole."""
    if name not in ("w_gate", "w_up", "w_down"):
        return grad
    step = max(1, grad.shape[0] // CHECKED_EXPERTS)
    return grad[::step][:CHECKED_EXPERTS]


def _pack_bf16_exact(t: torch.Tensor):
    """Saved-tensor hook: a large fp32 tensor whose values are all bf16 values (an upcast
    weight, the reference's rounded g and u) kept as bf16; lossless, so the reference's
    gradients keep their bits."""
    if t.dtype == torch.float32 and t.numel() >= 1 << 16:
        half = t.to(torch.bfloat16)
        if torch.equal(half.float(), t):
            return ("bf16", half)
    return t


def _unpack_bf16_exact(packed):
    return packed[1].float() if isinstance(packed, tuple) else packed


def reference_grads(problem: Problem, d_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Autograd on the reference: out, d_x, d_topk_weights and the shared expert's gradients
    with every expert; the routed weight gradients of the checked experts (``checked``) from a
    second run through their slots alone (an expert's weight gradient depends on its own rows
    only), so no weight-sized gradient is ever held (51 GB at dsv4_pro's size)."""
    from mok_cute import reference
    from mok_cute.config import MoKConfig

    i = problem.inputs
    leaves = [t.detach().requires_grad_() for t in  # the problem's storage: nothing copied
              (i.x, i.topk_weights, *(problem.shared or ()))]
    # autograd keeps the reference's fp32 upcast of every expert's weights (102 GB at
    # dsv4_pro's size): what is saved exactly representable in bf16 is kept as bf16
    with torch.autograd.graph.saved_tensors_hooks(_pack_bf16_exact, _unpack_bf16_exact):
        out = reference.moe_forward(leaves[0], i.topk_idx, leaves[1], problem.w_gate,
                                    problem.w_up, problem.w_down,
                                    shared=tuple(leaves[2:]) or None)
    out.backward(d_out)
    names = ("x", "topk_weights", "ws_gate", "ws_up", "ws_down")
    grads = {n: t.grad for n, t in zip(names, leaves)}
    experts = problem.w_gate.shape[0]
    picked = checked("w_gate", torch.arange(experts, device=i.topk_idx.device))  # its experts
    renumber = torch.full((experts + 1,), -1, dtype=torch.int64, device=picked.device)
    renumber[picked] = torch.arange(len(picked), device=picked.device)
    ids = renumber[torch.where((i.topk_idx >= 0) & (i.topk_idx < experts), i.topk_idx.long(), experts)]
    # at least K experts (the layer's contract); those past the checked ones get no row
    extra = max(0, i.topk_idx.shape[1] - len(picked))
    weights = [torch.cat([w.detach()[picked], w.new_zeros(extra, *w.shape[1:])]).requires_grad_()
               for w in (problem.w_gate, problem.w_up, problem.w_down)]
    reference.moe_forward(i.x, ids, i.topk_weights, *weights,
                          config=MoKConfig(check_ids=False)).backward(d_out)
    grads.update({n: w.grad[:len(picked)] for n, w in zip(("w_gate", "w_up", "w_down"), weights)})
    return out.detach(), {n: grads[n] for n in GRAD_NAMES if n in grads}


def rel_l1(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().sum() / want.abs().sum().clamp_min(1e-30)).item()


def check(layer: Layer, ref_out: torch.Tensor, ref_grads: dict[str, torch.Tensor], d_out: torch.Tensor) -> dict[str, float]:
    """The output's and every gradient's relative L1 error against the reference."""
    layer.reset()
    layer.zero_main_grads()
    out = layer.forward()
    out.backward(d_out)
    errors = {"out": rel_l1(out.detach(), ref_out)}
    # a gradient the contender does not compute (None) is named, not compared
    errors.update({f"d_{n}": rel_l1(checked(n, g), ref_grads[n]) if g is not None else float("nan")
                   for n, g in layer.grads().items()})
    layer.reset()
    return errors


def timed_size_errors(layer: Layer, problem: Problem, d_out: torch.Tensor, sample: int = 256,
                      seed: int = 0) -> dict[str, float]:
    """One training step at the timed T: the output's, d_x's and d_topk_weights' rows of
    ``sample`` random tokens against autograd on the reference on those tokens alone (each of
    these rows depends on its own token's x, ids, weights and d_out only), as the worst row's
    relative L1 error (``worst_row_error``; nan for a gradient the contender does not compute):
    what the check at a small T cannot see (several minibatches, a wrapping ring, large-M
    schedules), row by row, so that one misrouted token shows."""
    from mok_cute import reference

    layer.reset()
    layer.zero_main_grads()
    out = layer.forward()
    out.backward(d_out)
    got = layer.grads()
    i = problem.inputs
    rows = sampled_tokens(problem, sample, seed)
    x = i.x[rows].detach().requires_grad_()
    w = i.topk_weights[rows].detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(_pack_bf16_exact, _unpack_bf16_exact):
        want = reference.moe_forward(x, i.topk_idx[rows], w, problem.w_gate, problem.w_up,
                                     problem.w_down, shared=problem.shared)
    want.backward(d_out[rows])
    errors = {"out": worst_row_error(out.detach()[rows], want.detach())}
    for name, ref in (("x", x.grad), ("topk_weights", w.grad)):
        g = got.get(name)
        errors[f"d_{name}"] = float("nan") if g is None else worst_row_error(g[rows], ref)
    layer.reset()
    return errors


ROW_TOL_FACTOR = 3.0  # a row's error bound over the contender's whole-tensor tolerance


def worst_row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest over rows of a row's L1 error over the larger of its own L1 norm and the
    rows' mean (a row whose terms cancel is held to the rows' scale, not its own)."""
    got, want = got.double().flatten(1), want.double().flatten(1)
    norms = want.abs().sum(1)
    scale = torch.maximum(norms, norms.mean().clamp_min(1e-30))
    return float(((got - want).abs().sum(1) / scale).max())


def saved_bytes(layer: Layer) -> int:
    """What the forward keeps alive for the backward (the output excluded); measured after
    one forward, so that per-model state (the FP8 weight copies, cached per weight version)
    is not counted per token."""
    layer.reset()
    layer.forward()  # freed on return: the per-model state stays
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = layer.forward()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del out
    return int(kept)


def step_peak_bytes(layer: Layer, d_out: torch.Tensor) -> int:
    """One training step's peak memory above what was alive before it (the weights, inputs,
    d_out, main_grad buffers): the saved activations, the backward's workspaces and the
    gradients it returns; after a warm step, so per-model state (FP8 weight copies, plans) is
    not counted."""
    step = pass_runners(layer, d_out)["train"]
    step()
    layer.reset()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    layer.reset()
    return int(peak)


def bench_shape(shape, contenders: Sequence[str], config: MoKConfig, timer: Timer, args, log) -> list[dict[str, Any]]:
    device = torch.device("cuda")
    problem = make_problem(shape, device, seed=args.seed, t_scale=args.t_scale)
    small = problem.with_fresh_inputs(args.check_tokens, seed=args.seed + 1)
    gen = torch.Generator(device=device).manual_seed(args.seed + 2)
    d_small = torch.randn(small.inputs.x.shape, device=device, generator=gen).to(torch.bfloat16)
    d_out = torch.randn(problem.inputs.x.shape, device=device, generator=gen).to(torch.bfloat16)
    ref_out, ref_grads = reference_grads(small, d_small)
    keys = {"T": problem.tokens, "H": shape.hidden, "I": shape.intermediate, "E": shape.experts, "K": shape.top_k,
            "shared": shape.shared, "flops_fwd": problem.flops}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    runners: dict[str, dict[str, Callable[[], Any]]] = {}
    layers: dict[str, Layer] = {}
    for name in contenders:
        base = {"shape": shape.name, "contender": name, **keys, "ms": None, "tflops": None}
        try:
            errors = check(Layer(name, small, config), ref_out, ref_grads, d_small)
            worst = max(v for v in errors.values() if v == v)
            missing = [n for n, v in errors.items() if v != v]
            tol = CONTENDER_TOL.get(name, args.tol)
            status = "ok" if worst <= tol else "check_failed"
            layer = Layer(name, problem, config) if status == "ok" else None
            extra = {"rel_l1": {n: v for n, v in errors.items() if v == v}, "status": status}
            if missing:
                extra["gradients_not_computed"] = missing
            if layer is not None:  # and at the timed T, on a sample of its tokens
                timed = timed_size_errors(layer, problem, d_out, seed=args.seed)
                extra["timed_size_rel_l1"] = {n: v for n, v in timed.items() if v == v}
                worst_timed = max((v for v in timed.values() if v == v), default=0.0)
                if not worst_timed <= ROW_TOL_FACTOR * tol:
                    extra["status"] = "check_failed"
                    extra["error"] = (f"worst row's relative L1 {worst_timed:.3g} > "
                                      f"{ROW_TOL_FACTOR * tol:.3g} vs autograd on mok_cute.reference "
                                      f"on 256 of the timed T={problem.tokens} tokens")
                    layer = None
            if layer is not None:
                extra["saved_bytes_per_token"] = saved_bytes(layer) / problem.tokens
                extra["step_peak_bytes"] = step_peak_bytes(layer, d_out)
                runners[name] = pass_runners(layer, d_out)
                layers[name] = layer
            elif "error" not in extra:
                extra["error"] = f"worst relative L1 {worst:.3g} > {tol} vs autograd on mok_cute.reference"
        except Exception as exc:
            extra = {"status": "error", "error": error_text(exc)}
        for p in PASSES:
            rows[(name, p)] = {**base, "pass": p, **extra}
        log(f"{shape.name} {name}: {extra['status']} {extra.get('error', '')[:200]}")
    times: dict[tuple[str, str], list[float]] = {key: [] for key in rows}
    order = list(runners)

    def all_passes(name: str) -> Callable[[], None]:
        def run() -> None:
            for fn in runners[name].values():
                fn()
            layers[name].reset()  # one contender's weight gradients alive at a time
        return run

    burn_in([all_passes(name) for name in order], device)
    with ClockSampler(device) as sampler:
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                for p, fn in runners[name].items():
                    try:
                        with sampler.window(f"{name}/{p}"):
                            times[(name, p)].append(timer(fn))
                    except Exception as exc:
                        rows[(name, p)].update(status="error", error=error_text(exc))
                    layers[name].reset()  # one contender's weight gradients alive at a time
        for (name, p), row in rows.items():
            if row["status"] == "ok" and times[(name, p)]:
                ms = float(statistics.median(times[(name, p)]))
                row.update(ms=ms, ms_rounds=times[(name, p)],
                           tflops=PASSES[p] * problem.flops / (ms * 1e-3) / 1e12, gpu_clock=sampler.stats(f"{name}/{p}"))
    # paired ratios per pass, round by round: the other's time over this contender's (vs), or
    # this contender's over mok_cute's (over)
    for (name, p), mine in rows.items():
        for key, other in (("paired_vs_torch", "torch_grouped_mm"), ("paired_vs_sonicmoe", "sonicmoe"),
                           ("paired_vs_torch_fp8", "torch_scaled_grouped_mm"),
                           ("paired_ms_over_mok_cute", "mok_cute")):
            theirs = rows.get((other, p), {}).get("ms_rounds")
            over = key == "paired_ms_over_mok_cute"
            if over and name == other:
                continue
            ratio = paired_ratio(mine.get("ms_rounds"), theirs) if over else \
                paired_ratio(theirs, mine.get("ms_rounds"))
            if ratio is not None:
                mine[key] = ratio
    runners.clear()
    layers.clear()
    del problem, small
    free_memory(device)
    return list(rows.values())


def print_table(results: list[dict[str, Any]], console) -> None:
    from rich.table import Table

    table = Table(title="MoE layer training (one GPU)")
    for col in ("shape", "contender", "pass", "ms", "TFLOP/s", "x torch", "x sonic", "saved B/token", "step peak GB",
                "MHz", "status"):
        table.add_column(col)
    for r in results:
        clock = (r.get("gpu_clock") or {}).get("sm_mhz_median")
        table.add_row(r["shape"], r["contender"], r["pass"], f"{r['ms']:.3f}" if r.get("ms") else "-",
                      f"{r['tflops']:.1f}" if r.get("tflops") else "-",
                      f"{r['paired_vs_torch']:.2f}" if r.get("paired_vs_torch") else "-",
                      f"{r['paired_vs_sonicmoe']:.2f}" if r.get("paired_vs_sonicmoe") else "-",
                      f"{r['saved_bytes_per_token']:.0f}" if r.get("saved_bytes_per_token") is not None else "-",
                      f"{r['step_peak_bytes'] / 1e9:.2f}" if r.get("step_peak_bytes") is not None else "-",
                      f"{clock:.0f}" if clock else "-", r.get("status", "?"))
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    argv = [a for a in raw if a != "--train"]
    parser = argparse.ArgumentParser(prog="mok-cute bench --train", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="single", help="comma list of shape names, groups, or custom:T,H,I,E,K[,shared]")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help=f"comma list of {CONTENDERS}")
    parser.add_argument("--sonic-tuning", choices=("fixed", "full"), default="fixed",
                        help="SonicMoE's QuACK autotuning: one config per tuner (fixed) or all (full)")
    parser.add_argument("--t-scale", type=float, default=1.0)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check-tokens", type=int, default=512)
    parser.add_argument("--tol", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mok-config", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="train")
    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console(width=180)
    try:
        shapes = resolve_shapes(args.shapes)
        contenders = parse_contenders(args.contenders, CONTENDERS)
        config = apply_config_overrides(BENCH_CONFIG, parse_config_overrides(args.mok_config))
        if args.rounds < 1:
            raise ValueError(f"--rounds: expected >= 1, got {args.rounds}")
        timer = Timer(torch.device("cuda"), iters=args.iters, warmup=args.warmup)  # checks them
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    if not torch.cuda.is_available():
        console.print("[red]mok-cute bench --train needs a CUDA GPU[/red]")
        return 2
    if "sonicmoe" in contenders:
        os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")
        if args.sonic_tuning == "fixed":
            fix_sonicmoe_tuning(Path(args.out) / "quack_cache")
    log = lambda msg: console.print(msg, markup=False, highlight=False)  # noqa: E731
    results: list[dict[str, Any]] = []
    for shape in shapes:
        try:
            results.extend(bench_shape(shape, contenders, config, timer, args, log))
        except Exception as exc:  # setup (memory, say): recorded, the run goes on
            results.append({"shape": shape.name, "contender": "setup", "pass": "-", "ms": None, "tflops": None,
                            "status": "error", "error": error_text(exc)})
            free_memory(torch.device("cuda"))
    # the ceiling, cuBLAS bf16 8192^3, in the same run after the shapes (their clock)
    ceiling = bench_cublas(SimpleNamespace(device=torch.device("cuda")), timer, tol=args.tol,
                           log=log, rounds=args.rounds)
    results.append(ceiling)
    device = torch.device("cuda")
    gpu = gpu_name(device)
    chart = [{**r, "contender": f"{r['contender']} {r['pass']}", "ratio_vs_torch": r.get("paired_vs_torch")}
             for r in results if r["pass"] in ("bwd", "train")] + [ceiling]
    extra = {"timing": timer.method, "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
             "t_scale": args.t_scale, "sonic_tuning": args.sonic_tuning if "sonicmoe" in contenders else None,
             "passes": {p: f"{6 * m:.0f} TKHI / t" for p, m in PASSES.items()}}
    json_path, png_path = save_results(results, Path(args.out), args.tag, gpu, command_line(raw),
                                       raw, config, extra, lambda date: f"MoE training on {gpu}, {date}", chart=chart)
    print_table(results, console)
    console.print(f"json {json_path}\npng  {png_path}")
    return 0 if all(r.get("status") == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
