"""Train a small decoder language model with mok_cute MoE layers on the Python standard
library's source text (bytes, vocabulary 256), once per run of

    mok_cute   MoELayer on the kernels (forward and backward: mok_cute.autograd)
    mok_cute   the same again (the losses must be bitwise identical)
    reference  MoELayer on mok_cute.reference (torch autograd)
    mok_cute_fp8  with --fp8: MoKConfig(precision="fp8"), twice (bitwise identical too)

with the same seed, data order and initial weights. Prints each run's median step time,
writes the loss curves (PNG and JSON) to --out and exits non-zero when two runs of one
precision differ, when mok_cute's loss leaves the reference's by more than bf16 noise (2 % of
the last 50 steps' mean) or FP8's leaves bf16's by more than 3 %.

    python examples/train_tiny_moe.py --steps 300 [--fp8] --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch
import torch.nn as nn
import torch.nn.functional as F

import mok_cute as mok


def stdlib_text(limit_bytes: int) -> torch.Tensor:
    """The stdlib's .py files in sorted order, as bytes: text every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit_bytes]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, moe: nn.Module):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.moe = moe

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        # explicit causal attention: deterministic backward (SDPA's flash backward is not)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(att.transpose(1, 2).reshape(b, s, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.moe(self.norm2(x).to(torch.bfloat16)).float()


class TinyMoELM(nn.Module):
    def __init__(self, backend: str, dim: int, layers: int, heads: int, experts: int, top_k: int,
                 intermediate: int, seq: int, precision: str = "bf16"):
        super().__init__()
        config = mok.MoKConfig(backend=backend, precision=precision, check_ids=False)
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(
            Block(dim, heads, mok.MoELayer(dim, intermediate, experts, top_k, shared_intermediate=intermediate,
                                           config=config))
            for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(backend: str, data: torch.Tensor, args, precision: str = "bf16") -> tuple[list[float], float]:
    torch.manual_seed(args.seed)
    model = TinyMoELM(backend, args.dim, args.layers, args.heads, args.experts, args.top_k,
                      args.intermediate, args.seq, precision).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    losses, times = [], []
    for step in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s: s + args.seq + 1] for s in starts.tolist()]).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256).float(), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"  {backend:9s} {precision} step {step:4d} loss {losses[-1]:.4f}", flush=True)
    return losses, statistics.median(times[5:] or times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-mb", type=float, default=8.0)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--fp8", action="store_true", help="also train with precision='fp8' (twice)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("train_tiny_moe needs a CUDA GPU (the reference alone would not compare anything)")
        return 2
    torch.use_deterministic_algorithms(True, warn_only=True)  # the reference's index_add_ may warn
    torch.utils.deterministic.fill_uninitialized_memory = False  # step times without NaN fills
    data = stdlib_text(int(args.data_mb * 2**20))
    print(f"data: {data.numel() / 2**20:.1f} MiB of stdlib source; tokens per MoE call: {args.batch * args.seq}")
    runs = {}
    plan = [("mok_cute", "kernel", "bf16"), ("mok_cute_again", "kernel", "bf16"),
            ("reference", "reference", "bf16")]
    if args.fp8:
        plan += [("mok_cute_fp8", "kernel", "fp8"), ("mok_cute_fp8_again", "kernel", "fp8")]
    for name, backend, precision in plan:
        runs[name] = train(backend, data, args, precision)
        print(f"{name}: median step {runs[name][1]:.2f} ms, final loss {runs[name][0][-1]:.4f}")
    tail = slice(-50, None)
    last = {name: statistics.fmean(run[0][tail]) for name, run in runs.items()}
    bitwise = runs["mok_cute"][0] == runs["mok_cute_again"][0]
    gap = abs(last["mok_cute"] - last["reference"])
    close = gap <= 0.02 * last["reference"]
    print(f"two mok_cute runs bitwise identical: {bitwise}; mean loss of the last 50 steps, "
          f"mok_cute vs reference: {last['mok_cute']:.4f} vs {last['reference']:.4f} (gap {gap:.4f})")
    fp8_gap = None
    if args.fp8:
        fp8_bitwise = runs["mok_cute_fp8"][0] == runs["mok_cute_fp8_again"][0]
        fp8_gap = abs(last["mok_cute_fp8"] - last["mok_cute"])
        bitwise = bitwise and fp8_bitwise
        close = close and fp8_gap <= 0.03 * last["mok_cute"]
        print(f"two FP8 runs bitwise identical: {fp8_bitwise}; mean loss of the last 50 steps, "
              f"fp8 vs bf16: {last['mok_cute_fp8']:.4f} vs {last['mok_cute']:.4f} (gap {fp8_gap:.4f})")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(["python", "examples/train_tiny_moe.py", *(argv or sys.argv[1:])]),
              "gpu": torch.cuda.get_device_name(), "args": vars(args), "bitwise_repeat": bitwise,
              "last50_gap": gap, "last50_gap_fp8_vs_bf16": fp8_gap, "runs": {k: {"losses": v[0], "median_step_ms": v[1]} for k, v in runs.items()}}
    (out / "train_tiny_moe.json").write_text(json.dumps(record, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, style in (("reference", "-"), ("mok_cute", "--"), ("mok_cute_fp8", ":")):
            if name not in runs:
                continue
            ax.plot(runs[name][0], style, label=f"{name} ({runs[name][1]:.1f} ms/step)", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.set_title(f"tiny MoE LM on stdlib source, {torch.cuda.get_device_name()}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "train_tiny_moe.png", dpi=110)
    except ImportError:
        print("matplotlib missing: no PNG (pip install -e '.[bench]')")
    return 0 if bitwise and close else 1


if __name__ == "__main__":
    sys.exit(main())
