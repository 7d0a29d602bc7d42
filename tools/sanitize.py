"""The kernels on tiny shapes, for compute-sanitizer (``tools/gpu_check.sh sanitize``).

Runs every case once in this process (each kernel compiles once), checks each output per token
against ``mok_cute.reference`` so that a case which silently did nothing fails too, and exits
non-zero on any mismatch. Run it under ``compute-sanitizer --tool memcheck|racecheck|synccheck``.

    python3 tools/sanitize.py [CASE ...]      (default: every case; --list names them)
"""

from __future__ import annotations

import argparse
import sys

import torch

import mok_cute
from mok_cute import reference

T, H, I, E_LOC, K, IS = 300, 512, 256, 4, 4, 256


def _inputs(R: int, shared: bool, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(torch.bfloat16)

    idx = torch.rand(R, T, R * E_LOC, device="cuda", generator=g).topk(K, dim=2).indices
    w = torch.softmax(torch.randn(R, T, K, device="cuda", generator=g), dim=2)
    sh = None
    if shared:
        sh = (rnd(R, IS, H, scale=H ** -0.5), rnd(R, IS, H, scale=H ** -0.5),
              rnd(R, H, IS, scale=IS ** -0.5))
    return (rnd(R, T, H), idx, w, rnd(R, E_LOC, I, H, scale=H ** -0.5),
            rnd(R, E_LOC, I, H, scale=H ** -0.5), rnd(R, E_LOC, H, I, scale=I ** -0.5), sh)


def _check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> bool:
    out, ref = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    err = ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-3 * ref.norm(dim=-1).mean()))
    worst = err.max().item() if err.numel() else 0.0
    ok = worst <= tol and not out.isnan().any()
    print(f"{name:28s} {'ok' if ok else 'MISMATCH'}  worst token rel err {worst:.2e}", flush=True)
    return ok


def _one_gpu(backend: str, shared: bool, seed: int):
    def case() -> bool:
        xs, idx, w, wg, wu, wd, sh = _inputs(1, shared, seed)
        sh1 = None if sh is None else tuple(t[0] for t in sh)
        cfg = mok_cute.MoKConfig(backend=backend)
        out = mok_cute.moe_forward(xs[0], idx[0], w[0], wg[0], wu[0], wd[0], shared=sh1, config=cfg)
        ref = reference.moe_forward(xs[0], idx[0], w[0], wg[0], wu[0], wd[0], shared=sh1)
        return _check(f"{backend} shared={shared}", out, ref)
    return case


def _virtual(R: int, shared: bool, seed: int, **sizes):
    def case() -> bool:
        xs, idx, w, wg, wu, wd, sh = _inputs(R, shared, seed)
        cfg = mok_cute.MoKConfig(**sizes)
        out = mok_cute.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared=sh, config=cfg)
        ref = reference.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared=sh)
        return _check(f"virtual R={R} shared={shared} {sizes or ''}", out, ref)
    return case


def _backward(shared: bool, seed: int, backend: str = "kernel"):
    def case() -> bool:
        xs, idx, w, wg, wu, wd, sh = _inputs(1, shared, seed)
        leaves = [t[0].detach().clone().requires_grad_() for t in (xs, w, wg, wu, wd)]
        sh_leaves = None if sh is None else [t[0].detach().clone().requires_grad_() for t in sh]
        x, ww, g, u, d = leaves
        out = mok_cute.moe_forward(x, idx[0], ww, g, u, d, shared=sh_leaves,
                                   config=mok_cute.MoKConfig(backend=backend))
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves + (sh_leaves or []), grad_out)
        ref_leaves = [t.detach().clone().requires_grad_() for t in leaves + (sh_leaves or [])]
        rx, rw, rg, ru, rd, *rsh = ref_leaves
        ref = reference.moe_forward(rx, idx[0], rw, rg, ru, rd, shared=tuple(rsh) if rsh else None)
        ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out)
        ok = _check(f"{backend} training fwd shared={shared}", out, ref)
        return _check_grads(grads, ref_grads, "d_x") and ok
    return case


def _backward_virtual(R: int, shared: bool, seed: int):
    """Virtual ranks' training step: the saving launch, then every rank's routed experts in one
    backward-megakernel launch (``mok_cute.virtual_backward``)."""
    def case() -> bool:
        xs, idx, w, wg, wu, wd, sh = _inputs(R, shared, seed)
        leaves = [t.detach().clone().requires_grad_() for t in (xs, w, wg, wu, wd, *(sh or ()))]
        out = mok_cute.moe_forward_virtual(leaves[0], idx, *leaves[1:5],
                                           shared=tuple(leaves[5:]) or None)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, grad_out)
        ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        ref = reference.moe_forward_virtual(ref_leaves[0], idx, *ref_leaves[1:5],
                                            shared=tuple(ref_leaves[5:]) or None)
        ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out)
        ok = _check(f"virtual R={R} training fwd shared={shared}", out, ref)
        return _check_grads(grads, ref_grads, "d_xs") and ok
    return case


def _backward_group(R: int, seed: int):
    """The backward over a group's buffers (``mok_cute.group_backward``) on virtual ranks'
    buffers after the saving virtual launch, the last rank receiving nothing (its dgrad launch
    walks nothing: it read past its queue once)."""
    def case() -> bool:
        from mok_cute import megakernel
        from mok_cute.group_backward import moe_backward_group

        xs, _, w, wg, wu, wd, sh = _inputs(R, True, seed)
        g = torch.Generator(device="cuda").manual_seed(seed)
        idx = torch.rand(R, T, (R - 1) * E_LOC, device="cuda", generator=g).topk(K, dim=2).indices
        with torch.no_grad():
            _, saved = megakernel.moe_forward_virtual(xs, idx, w, wg, wu, wd, sh,
                                                      mok_cute.MoKConfig(), save=True)
        d_out = torch.randn_like(xs)
        grads = moe_backward_group(d_out, xs, idx, w, wg, wu, wd, sh, saved)
        leaves = [t.detach().clone().requires_grad_() for t in (xs, w, wg, wu, wd, *sh)]
        ref = reference.moe_forward_virtual(leaves[0], idx, *leaves[1:5], shared=tuple(leaves[5:]))
        ref_grads = torch.autograd.grad(ref, leaves, d_out)
        print(f"group backward R={R}, rank {R - 1} receiving nothing", flush=True)
        return _check_grads(grads, ref_grads, "d_xs")
    return case


def _backward_main_grad(backend: str, seed: int):
    """The training step with ``fuse_wgrad_accumulation``: every weight gradient added into a
    random fp32 ``main_grad`` (at these few rows an expert main_grad is read into registers:
    ``gemm_wgrad.main_grad_add``), the shared expert's too."""
    def case() -> bool:
        xs, idx, w, wg, wu, wd, sh = _inputs(1, True, seed)
        leaves = [t[0].detach().clone().requires_grad_() for t in (xs, w, wg, wu, wd, *sh)]
        g = torch.Generator(device="cuda").manual_seed(seed)
        starts = [torch.randn(t.shape, device="cuda", generator=g) for t in leaves[2:]]
        for t, s0 in zip(leaves[2:], starts):
            t.main_grad = s0.clone()
        cfg = mok_cute.MoKConfig(backend=backend, fuse_wgrad_accumulation=True)
        out = mok_cute.moe_forward(leaves[0], idx[0], *leaves[1:5], shared=tuple(leaves[5:]),
                                   config=cfg)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        ref = reference.moe_forward(ref_leaves[0], idx[0], *ref_leaves[1:5],
                                    shared=tuple(ref_leaves[5:]))
        ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out)
        grads = [leaves[0].grad, leaves[1].grad,
                 *(t.main_grad - s0 for t, s0 in zip(leaves[2:], starts))]
        print(f"{backend} training step, main_grad added into", flush=True)
        return _check_grads(grads, ref_grads, "d_x")
    return case


def _check_grads(grads, ref_grads, x_name: str) -> bool:
    """Each gradient against the reference's (relative L1 <= 1e-2, no NaN), one line each."""
    ok = True
    for name, a, b in zip((x_name, "d_w", "d_gate", "d_up", "d_down", "d_sgate", "d_sup",
                           "d_sdown"), grads, ref_grads):
        rel_l1 = ((a.float() - b.float()).abs().sum() / b.float().abs().sum()).item()
        good = rel_l1 <= 1e-2 and not a.isnan().any()
        print(f"  {name:8s} {'ok' if good else 'MISMATCH'}  rel-L1 {rel_l1:.2e}", flush=True)
        ok &= good
    return ok


CASES = {
    "expert_path": _one_gpu("kernel", False, 1),
    "expert_path_shared": _one_gpu("kernel", True, 2),
    "megakernel_r1": _one_gpu("megakernel", False, 3),
    "virtual_r2": _virtual(2, False, 4),
    "virtual_r4_shared": _virtual(4, True, 5),
    # ring and minibatch smaller than the routed rows: the ring wraps several times
    "virtual_r2_wrapping_ring": _virtual(2, False, 6, ring_tokens=256, minibatch_tokens=128),
    "backward": _backward(False, 7),
    "backward_shared": _backward(True, 8),
    # the megakernel's training forward at one rank and the backward megakernel
    "backward_megakernel_shared": _backward(True, 9, "megakernel"),
    # virtual ranks: the saving launch, one backward-megakernel launch for all ranks
    "backward_virtual_r2_shared": _backward_virtual(2, True, 10),
    # main_grad read and written by the weight-gradient launches and the backward megakernel
    "backward_main_grad": _backward_main_grad("kernel", 12),
    "backward_megakernel_main_grad": _backward_main_grad("megakernel", 13),
    # a group's backward on virtual buffers: row copies by address, barriers, per-rank launches
    "backward_group_r3_receiver_of_nothing": _backward_group(3, 11),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="cases to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    names = args.cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; --list names them")
    failed = [n for n in names if not CASES[n]()]
    torch.cuda.synchronize()
    print(f"{len(names) - len(failed)} of {len(names)} cases ok" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
