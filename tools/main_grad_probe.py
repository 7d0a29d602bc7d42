"""The backward with its weight gradients added into fp32 main_grad buffers (``MainGrads``,
``MoKConfig(fuse_wgrad_accumulation=True)``) against what a trainer does without it: the bf16
gradients, then ``main_grad += grad`` per weight (one torch add each). Interleaved rounds,
CUDA events, SM clock and power sampled per variant; checked first: from zero buffers the
fused sums round to the unfused bf16 gradients bitwise.

    python tools/main_grad_probe.py [--shapes dsv3_ep8_rank,qwen3_30b] [--rounds 3] [--json out.json]
                                    [--modes reduce,load]

Variants per shape (one saved bf16 training forward each; the megakernel backend's backward
beside the kernels'; FP8 with ``--fp8``):
    bwd                    moe_backward, bf16 weight gradients returned
    bwd + add              the same, then main_grad.add_(grad) for the three expert weights
    bwd fused              moe_backward(main_grads=...)
    wgrad / wgrad fused    the weight-gradient launches alone (gemm_wgrad, accumulate=True)
With ``--virtual R`` (a custom shape's T is the total over the ranks, MoK's shapes' T a rank's;
qwen3.5_397b's fp32 main_grads do not fit an H100 beside it): R virtual ranks trained through
``moe_forward_virtual`` (backend "megakernel") under autograd, whole steps timed: "step" (bf16
gradients), "step + add" (then main_grad.add_ per weight), "step fused MODE" for each of
``--modes`` (default reduce,load), each mode first checked bitwise against the others.
With ``--modes``: "bwd fused MODE" (launches and, in bf16, the backward megakernel) and "wgrad
gate+up fused MODE" for each of the bf16 weight gradients' ways of adding into main_grad
(``gemm_wgrad.main_grad_add``: reduce, load) instead of
the product's rule by rows an expert (the rule's threshold: ``MAIN_GRAD_LOAD_MAX_ROWS``; shapes
at other rows an expert: ``custom:T,H,I,E,K``), each first checked bitwise against the others
from random buffers.
Bytes counted: the fused launch reads and writes each fp32 element once (8 B) where the bf16
launch writes 2 B and the add reads 2 + 4 and writes 4.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute.shapes import shape_names  # noqa: E402
from tools.layer_profile import gpu_ms  # noqa: E402


def forced(mode: str, fn):
    """``fn`` with every bf16 weight-gradient launch adding into main_grad by ``mode``."""
    from mok_cute.kernels import gemm_wgrad

    def run():
        keep = gemm_wgrad.MAIN_GRAD_LOAD_MAX_ROWS
        gemm_wgrad.MAIN_GRAD_LOAD_MAX_ROWS = 1 << 40 if mode == "load" else -1
        try:
            return fn()
        finally:
            gemm_wgrad.MAIN_GRAD_LOAD_MAX_ROWS = keep
    return run


def check_modes(name: str, modes, fused, bufs) -> None:
    """The modes' sums (``fused()`` adding into ``bufs``) from the same random buffers,
    bitwise equal."""
    start = [torch.randn(b.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
             for i, b in enumerate(bufs)]
    first = None
    for mode in modes:
        for b, s0 in zip(bufs, start):
            b.copy_(s0)
        forced(mode, fused)()
        if first is None:
            first = [b.clone() for b in bufs]
        elif not all(torch.equal(a, b) for a, b in zip(first, bufs)):
            raise SystemExit(f"{name}: main_grad by {mode} is not {modes[0]}'s bitwise")


def variants(name: str, fp8: bool, modes=()) -> dict:
    import mok_cute
    from mok_cute import expert_backward as eb
    from mok_cute import expert_path, expert_path_fp8
    from mok_cute.bench.problems import make_problem
    from mok_cute.shapes import resolve_shape

    pb = make_problem(resolve_shape(name), device="cuda", seed=1)
    x, idx, w = pb.inputs.x, pb.inputs.topk_idx, pb.inputs.topk_weights
    ws = (pb.w_gate, pb.w_up, pb.w_down)
    config = mok_cute.MoKConfig(backend="kernel", check_ids=False)
    forward = expert_path_fp8.moe_forward_fp8 if fp8 else expert_path.moe_forward_kernel
    with torch.no_grad():
        _, saved = forward(x, idx, w, *ws, None, config, save=True)
    d_out = torch.randn_like(x)
    precision = "fp8" if fp8 else "bf16"
    bufs = [torch.zeros(t.shape, device="cuda") for t in ws]

    def bwd(dgrads, main=None):
        return eb.moe_backward(d_out, x, idx, w, *ws, None, saved, precision=precision,
                               dgrads=dgrads, main_grads=main)

    def add(dgrads):
        def run():
            grads = bwd(dgrads)
            for b, g in zip(bufs, grads[2:5]):
                b.add_(g)
        return run

    # checked first: fused from zeros == the unfused bf16 gradients, bitwise
    backends = ("kernels",) if fp8 else ("kernels", "megakernel")
    for dgrads in backends:
        want = bwd(dgrads)[2:5]
        for b in bufs:
            b.zero_()
        got = bwd(dgrads, eb.MainGrads(*bufs))
        assert got[2:5] == (None, None, None)
        for label, b, g in zip(("dW_gate", "dW_up", "dW_down"), bufs, want):
            if not torch.equal(b.to(torch.bfloat16), g):
                raise SystemExit(f"{name} {dgrads}: fused {label} from zeros is not the bf16 "
                                 f"gradient bitwise")
    E, inter = ws[0].shape[0], ws[0].shape[1]
    K = idx.shape[1]
    rows = eb.routed_rows(x, saved.row_token(K), False)
    d_pre = torch.randn(rows.shape[0], 2 * inter, device="cuda").to(torch.bfloat16)
    gate_up = (d_pre[:, :inter], d_pre[:, inter:], rows, saved.expert_offsets, E, inter)
    out = {}
    if modes:  # the bf16 weight gradients' ways of adding, launches and backward megakernel
        for dgrads in backends:
            tag = "" if dgrads == "kernels" else " (megakernel)"
            fused = lambda d=dgrads: bwd(d, eb.MainGrads(*bufs))  # noqa: E731
            check_modes(name + tag, modes, fused, bufs)
            out[f"bwd{tag}"] = lambda d=dgrads: bwd(d)
            for mode in modes:
                out[f"bwd fused {mode}{tag}"] = forced(mode, fused)
        for mode in modes if not fp8 else ():
            out[f"wgrad gate+up fused {mode}"] = forced(
                mode, lambda: eb.wgrad(*gate_up, main_grads=bufs[:2]))
        return out, sum(t.numel() for t in ws)
    for dgrads in backends:
        tag = "" if dgrads == "kernels" else " (megakernel)"
        out[f"bwd{tag}"] = lambda d=dgrads: bwd(d)
        out[f"bwd + add{tag}"] = add(dgrads)
        out[f"bwd fused{tag}"] = lambda d=dgrads: bwd(d, eb.MainGrads(*bufs))
    if not fp8:
        out["wgrad gate+up"] = lambda: eb.wgrad(*gate_up)
        out["wgrad gate+up fused"] = lambda: eb.wgrad(*gate_up, main_grads=bufs[:2])
    return out, sum(t.numel() for t in ws)


def virtual_variants(name: str, ranks: int, modes) -> tuple[dict, int]:
    """Whole training steps on ``ranks`` virtual ranks (module docstring)."""
    import dataclasses

    import mok_cute as mok
    from mok_cute.bench.problems import VirtualInputs, make_problem
    from mok_cute.shapes import resolve_shape

    shape = resolve_shape(name)
    vi = VirtualInputs.split(make_problem(shape, device="cuda", seed=1, ranks=ranks), ranks)
    x = vi.x.detach().requires_grad_()
    w = vi.topk_weights.detach().requires_grad_()
    params = [torch.nn.Parameter(t.detach()) for t in (vi.w_gate, vi.w_up, vi.w_down,
                                                       *(vi.shared or ()))]
    for t in params:
        t.main_grad = torch.zeros(t.shape, device="cuda")
    bufs = [t.main_grad for t in params]
    d_out = torch.randn_like(vi.x)
    plain = mok.MoKConfig(backend="megakernel", check_ids=False)
    fused = dataclasses.replace(plain, fuse_wgrad_accumulation=True)
    ws, shared = params[:3], tuple(params[3:]) or None

    def step(config):
        for t in (x, w, *params):
            t.grad = None
        mok.moe_forward_virtual(x, vi.topk_idx, w, *ws, shared=shared, config=config).backward(d_out)

    def add():
        step(plain)
        for t in params:
            t.main_grad.add_(t.grad)

    for b in bufs:  # checked first: fused from zeros == the bf16 gradients, bitwise
        b.zero_()
    step(plain)
    want = [t.grad.clone() for t in params]
    step(fused)
    for i, (b, g) in enumerate(zip(bufs, want)):
        if not torch.equal(b.to(torch.bfloat16), g):
            raise SystemExit(f"{name} R={ranks}: fused weight {i} from zeros is not its bf16 gradient")
    check_modes(f"{name} R={ranks}", modes, lambda: step(fused), bufs)
    out = {"step": lambda: step(plain), "step + add": add}
    for mode in modes:
        out[f"step fused {mode}"] = forced(mode, lambda: step(fused))
    return out, sum(t.numel() for t in params)


def main(argv=None):
    from mok_cute.bench.common import burn_in
    from mok_cute.bench.gpu_clock import ClockSampler

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="dsv3_ep8_rank,qwen3_30b,sonic_120b,mixtral,gptoss_120b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--modes", default="", help="e.g. reduce,load: time the ways of adding apart")
    p.add_argument("--virtual", type=int, default=0, help="R: whole steps on R virtual ranks")
    args = p.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    results = {}
    for name in shape_names(args.shapes):
        if args.virtual:
            runs, elements = virtual_variants(name, args.virtual, modes or ("reduce", "load"))
        else:
            runs, elements = variants(name, args.fp8, modes)
        times = {k: [] for k in runs}
        order = list(runs)
        burn_in(list(runs.values()), torch.device("cuda"))  # the first round at the sustained clock
        with ClockSampler(torch.cuda.current_device()) as sampler:
            for r in range(args.rounds):  # alternating order: no variant always first
                for k in order if r % 2 == 0 else order[::-1]:
                    with sampler.window(k):
                        times[k].append(gpu_ms(runs[k], reps=args.reps))
        rows = {}
        for k, ts in times.items():
            ms = sorted(ts)[len(ts) // 2]
            rows[k] = {"ms": ms, "rounds": ts, "clock": sampler.stats(k)}
            print(f"{name:14s} {k:32s} {ms:8.3f} ms", flush=True)
        rows["weight elements"] = elements
        results[name] = rows
    if args.json:
        with open(args.json, "w") as f:
            from mok_cute.bench.results import source_record, versions

            json.dump({"command": "python tools/main_grad_probe.py " + " ".join(argv or sys.argv[1:]),
                       "gpu": torch.cuda.get_device_name(), "versions": versions(),
                       "source": source_record(), "results": results}, f)


if __name__ == "__main__":
    main()
