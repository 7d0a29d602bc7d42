"""How much accuracy each FP8 backward GEMM costs, predicted on the CPU before wiring it in:
the FP8 layer's gradients emulated in torch (the quantizers of ``mok_cute.fp8``, float64 GEMMs
of the dequantized operands) against autograd on the bf16 reference, as cosine per gradient,
for the backward as the kernels run it today (FP8 dgrads, bf16 weight gradients) and with the
weight gradients in FP8 too (``kernels/gemm_wgrad_fp8.py``: A = dG, dU, d_out per (column,
128-row group), B = x, w * h per (column, expert)).

    python tools/fp8_grad_accuracy.py [--tokens 512 --hidden 1024 --inter 512 --experts 8 --top-k 4]

The issue's bound is cosine >= 0.996 for every gradient. No GPU needed.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
from mok_cute import fp8, reference  # noqa: E402

GROUP = fp8.GROUP


def deq_rows(t):
    return fp8.dequantize_rows(*fp8.quantize_rows(t.bfloat16()), dtype=torch.float64)


def deq_blocks(w):
    return fp8.dequantize_blocks(*fp8.quantize_blocks(w), dtype=torch.float64)


def deq_cols(rows):
    """The column-quantized copy of a row buffer [R, C] (R padded to 128 with zeros, as the
    receive schedule pads each expert), dequantized back to [R, C]."""
    pad = (-rows.shape[0]) % GROUP
    padded = torch.cat([rows.bfloat16(), rows.new_zeros(pad, rows.shape[1]).bfloat16()])
    return fp8.dequantize_cols(*fp8.quantize_cols(padded), dtype=torch.float64)[:rows.shape[0]]


def deq_cols_expert(rows):
    """B's copy: one scale per column over the expert's rows, dequantized back to [R, C]."""
    r = rows.bfloat16()
    offsets = torch.tensor([0, r.shape[0]], dtype=torch.int32)
    return fp8.dequantize_cols_per_expert(*fp8.quantize_cols_per_expert(r, offsets), offsets,
                                          dtype=torch.float64).T


def bf16(t):
    return t.to(torch.bfloat16).double()


def emulated_grads(x, idx, w, wg, wu, wd, d_out, fp8_wgrad: bool):
    """d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down of the FP8 layer (float64)."""
    T, K = idx.shape
    E = wg.shape[0]
    d_x = torch.zeros(T, x.shape[1], dtype=torch.float64)
    d_topk = torch.zeros(T, K, dtype=torch.float64)
    grads_w = [torch.zeros(wg.shape, dtype=torch.float64), torch.zeros(wu.shape, dtype=torch.float64),
               torch.zeros(wd.shape, dtype=torch.float64)]
    xq = deq_rows(x)
    for e in range(E):
        token, k = (idx.long() == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        g = bf16(xq[token] @ deq_blocks(wg[e]).T)
        u = bf16(xq[token] @ deq_blocks(wu[e]).T)
        sig = torch.sigmoid(g)
        h = bf16(g * sig * u)
        weight = w[token, k].double().unsqueeze(1)
        dy = d_out[token].double()
        acc = deq_rows(dy) @ deq_blocks(wd[e])  # FC2's dgrad: [rows, I]
        d_topk[token, k] = (acc * h).sum(dim=1)
        dg = bf16(weight * acc * u * sig * (1 + g * (1 - sig)))
        du = bf16(weight * acc * g * sig)
        hw = bf16(weight * h)
        d_pre = deq_rows(torch.cat([dg, du], dim=1))
        d_x.index_add_(0, token, d_pre[:, :dg.shape[1]] @ deq_blocks(wg[e])
                       + d_pre[:, dg.shape[1]:] @ deq_blocks(wu[e]))
        x_rows = x[token].double()
        if fp8_wgrad:
            grads_w[0][e] = deq_cols(dg).T @ deq_cols_expert(x_rows)
            grads_w[1][e] = deq_cols(du).T @ deq_cols_expert(x_rows)
            grads_w[2][e] = deq_cols(dy).T @ deq_cols_expert(hw)
        else:
            grads_w[0][e] = dg.T @ x_rows
            grads_w[1][e] = du.T @ x_rows
            grads_w[2][e] = dy.T @ hw
    return [d_x, d_topk, *grads_w]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    gen = torch.Generator().manual_seed(a.seed)
    T, H, I, E, K = a.tokens, a.hidden, a.inter, a.experts, a.top_k
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).bfloat16()  # noqa: E731
    x = rnd(T, H)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.int()
    w = torch.softmax(torch.randn(T, K, generator=gen), dim=1)
    wg, wu, wd = rnd(E, I, H, scale=H ** -0.5), rnd(E, I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)
    d_out = rnd(T, H)
    leaves = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd)]
    out = reference.moe_forward(leaves[0], idx, leaves[1], *leaves[2:])
    out.backward(d_out)
    want = [t.grad.double() for t in leaves]
    names = ["d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"]
    print(f"T={T} H={H} I={I} E={E} K={K}: cosine against autograd on the bf16 reference")
    for label, fp8_wgrad in (("FP8 dgrads, bf16 wgrads (today)", False), ("FP8 dgrads and wgrads", True)):
        got = emulated_grads(x, idx, w, wg, wu, wd, d_out, fp8_wgrad)
        cos = {n: F.cosine_similarity(g.flatten(), r.flatten(), dim=0).item()
               for n, g, r in zip(names, got, want)}
        print(f"  {label:34s} " + "  ".join(f"{n} {c:.5f}" for n, c in cos.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
