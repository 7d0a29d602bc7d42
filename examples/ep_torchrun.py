"""An expert-parallel MoE layer across GPUs: one `mok_cute.MoELayer(..., group=...)` per rank.

    torchrun --nproc-per-node 8 examples/ep_torchrun.py --shape kimi_k2
    torchrun --nproc-per-node 8 examples/ep_torchrun.py --shape dsv4_pro --tokens 8192 --iters 20
    torchrun --nproc-per-node 2 examples/ep_torchrun.py --shape custom:512,1024,512,16,4,1
    torchrun --nproc-per-node 2 examples/ep_torchrun.py --device cpu --shape custom:16,64,32,8,2,1  # gloo
    torchrun --nproc-per-node 8 examples/ep_torchrun.py --shape kimi_k2 --backend megakernel --train 20
    torchrun --nproc-per-node 8 examples/ep_torchrun.py --shape glm --backend megakernel --precision fp8 --train 20
    torchrun --nproc-per-node 8 examples/ep_torchrun.py --shape kimi_k2 --backend megakernel --train 2 --timeline out/tl

Shapes are MoK's EP models (`mok_cute.shapes.EP_SHAPES`, a unique prefix is enough) with the
routed experts split evenly over the ranks and one shared expert of size I, or
`custom:T,H,I,E,K[,shared]` (T tokens per rank, E routed experts in all).

Every rank
1. builds the layer: router and shared expert drawn from one seed (the same on every rank), its
   own experts from a per-rank seed;
2. runs one forward pass on `--tokens` random tokens;
3. checks the layer against `mok_cute.reference.moe_forward_virtual` on `--check-tokens` tokens
   per rank: inputs, routing, expert weights and outputs are gathered to rank 0;
4. times the forward pass (median of `--iters` after `--warmup`, the ranks started together
   each iteration) and rank 0 prints every rank's time and the max;
5. with `--train N`: N SGD steps on a regression loss (each rank its own tokens and target);
   the replicated parameters' gradients (router, shared expert) are averaged over the ranks
   as data parallelism would, the experts' stay on their rank. Rank 0 prints the mean loss of
   the first and last step and the median step time. Under `--backend megakernel` the
   backward runs on the kernels too (`mok_cute.group_backward`). With `--timeline DIR` one more
   step runs with `MoKConfig(timeline=True)` and rank 0 writes the per-SM timelines of its
   forward and backward launches (trace, PNG, summary: `mok_cute.timeline`) under DIR.

It prints which path `moe_forward(group=...)` takes: under `--backend auto` the PyTorch
reference with a real all_to_all_single exchange; `--backend megakernel` runs the
expert-parallel megakernel over IPC (opt-in until its determinism and 8-GPU runs are checked). Exit status 1 when the
check fails. NVLink multicast stays off (the three variables below are set before torch loads).
"""

import os

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mok_cute  # noqa: E402
from mok_cute import reference  # noqa: E402
from mok_cute.bench import ep, ep_dist  # noqa: E402
from mok_cute.bench.common import rel_err  # noqa: E402
from mok_cute.bench.results import gpu_name  # noqa: E402
from mok_cute.shapes import EP_SHAPES, Shape, moe_flops  # noqa: E402


def build_layer(shape: Shape, d: ep_dist.Dist, seed: int, backend: str = "auto",
                precision: str = "bf16") -> mok_cute.MoELayer:
    torch.manual_seed(seed)  # router and shared expert: identical on every rank
    layer = mok_cute.MoELayer(
        shape.hidden, shape.intermediate, shape.experts, shape.top_k,
        shared_intermediate=shape.intermediate if shape.shared else 0, group=d.group, device=d.device,
        config=mok_cute.MoKConfig(backend=backend, precision=precision),
    )
    # The experts of each rank are its own: redraw them (nn.Linear's bound) from a per-rank seed,
    # one expert at a time so no big temporary is made.
    gen = torch.Generator(device=d.device).manual_seed(seed * 1_000_003 + d.rank + 1)
    with torch.no_grad():
        for w in (layer.w_gate, layer.w_up, layer.w_down):
            bound = 1.0 / math.sqrt(w.shape[-1])
            for e in range(w.shape[0]):
                w[e].uniform_(-bound, bound, generator=gen)
    return layer.eval()


def check_against_reference(layer: mok_cute.MoELayer, d: ep_dist.Dist, tokens: int, seed: int) -> tuple[float, bool]:
    """(relative error, bitwise equal) of the gathered outputs against moe_forward_virtual."""
    gen = torch.Generator(device=d.device).manual_seed(seed * 7919 + d.rank)
    x = torch.randn(tokens, layer.hidden, device=d.device, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        topk_idx, topk_weights = layer.route(x)  # what layer(x) routes by (deterministic)
        out = layer(x)
    stacked = [ep_dist.gather_stacked(d, t.detach()) for t in (x, topk_idx, topk_weights, out, layer.w_gate, layer.w_up, layer.w_down)]
    rel, same = 0.0, 0.0
    if d.rank == 0:
        xs, idx, wts, outs, wg, wu, wd = stacked
        shared = None
        if layer.shared is not None:  # replicated: rank 0's copy stands for every rank's
            shared = tuple(s.detach().unsqueeze(0).expand(d.world, *s.shape) for s in layer.shared)
        with torch.no_grad():
            ref = reference.moe_forward_virtual(xs, idx, wts, wg, wu, wd, shared=shared)
        rel, same = rel_err(outs, ref), float(torch.equal(outs, ref))
    return ep_dist.broadcast_float(d, rel), bool(ep_dist.broadcast_float(d, same))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="kimi_k2", help=f"one of {list(EP_SHAPES)} (a unique prefix is enough) or custom:T,H,I,E,K[,shared]")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the shape's, 2048 for MoK's)")
    parser.add_argument("--check-tokens", type=int, default=128, help="tokens per rank of the reference check")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tol", type=float, default=None,
                        help="bound on the check's relative L2 error against the bf16 reference (default 1e-2, FP8 0.1)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp8"],
                        help="MoKConfig.precision: fp8 runs on --backend megakernel only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cuda (default when available; nccl) or cpu (gloo)")
    parser.add_argument("--backend", default="auto", choices=["auto", "megakernel", "reference"],
                        help="MoKConfig.backend: megakernel = the IPC megakernel (one launch per rank)")
    parser.add_argument("--train", type=int, default=0, metavar="STEPS", help="then train STEPS SGD steps")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--timeline", default=None, metavar="DIR",
                        help="after --train: one step recorded (MoKConfig.timeline), rank 0's timelines under DIR")
    args = parser.parse_args()
    if args.precision == "fp8" and args.backend != "megakernel":
        parser.error("--precision fp8 runs over a group on the IPC megakernel: add --backend megakernel")
    if args.tol is None:
        args.tol = 0.1 if args.precision == "fp8" else 1e-2

    with ep_dist.session(args.device) as d:
        shape = ep.resolve_split_shape(args.shape, d.world)
        tokens = args.tokens or shape.tokens
        layer = build_layer(shape, d, args.seed, args.backend, args.precision)
        choice = mok_cute.api.choose_path(d.device, layer.config, distributed=True)
        if d.rank == 0:
            print(f"{d.world} ranks ({d.backend}, {gpu_name(d.device)}); {shape.name}: T={tokens}/rank H={shape.hidden} "
                  f"I={shape.intermediate} E={shape.experts} ({layer.num_local_experts}/rank) K={shape.top_k}"
                  f"{' +shared' if shape.shared else ''}")
            print(f"moe_forward(group=...) path: {choice.path}: {choice.reason}")

        gen = torch.Generator(device=d.device).manual_seed(args.seed * 104729 + d.rank)
        x = torch.randn(tokens, shape.hidden, device=d.device, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            out = layer(x)
        assert out.shape == x.shape and out.dtype == torch.bfloat16

        rel, bitwise = check_against_reference(layer, d, args.check_tokens, args.seed + 1)
        ok = rel <= args.tol
        if d.rank == 0:
            print(f"check vs reference.moe_forward_virtual (T={args.check_tokens}/rank, gathered to rank 0): "
                  f"rel err {rel:.3e} {'<=' if ok else '>'} {args.tol}, bitwise equal: {bitwise} -> {'PASS' if ok else 'FAIL'}")

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return layer(x)

        per_rank = ep_dist.all_values(d, ep_dist.time_per_rank(d, forward, args.iters, args.warmup))
        if d.rank == 0:
            flops = moe_flops(tokens, shape.hidden, shape.intermediate, shape.top_k, shape.shared)
            for r, ms in enumerate(per_rank):
                print(f"rank {r}: forward {ms:.3f} ms (median of {args.iters})")
            worst = max(per_rank)
            print(f"max over ranks: {worst:.3f} ms, {flops / (worst * 1e-3) / 1e12:.1f} TFLOP/s per GPU "
                  f"(6 (T K + T) H I / t, path {choice.path})")
        if args.train:
            ok = train(layer, d, x, args) and ok
            if args.timeline:
                record_step(layer, d, x, args.timeline)
        dist.barrier(group=d.group)
        return 0 if ok else 1


def train(layer: mok_cute.MoELayer, d: ep_dist.Dist, x: torch.Tensor, args) -> bool:
    """``args.train`` SGD steps; True when the mean loss went down."""
    import statistics
    import time

    layer.train()
    opt = torch.optim.SGD(layer.parameters(), lr=args.lr)
    replicated = [p for name, p in layer.named_parameters() if name.startswith(("router", "ws_"))]
    gen = torch.Generator(device=d.device).manual_seed(args.seed * 31 + d.rank)
    target = torch.randn(x.shape, device=d.device, generator=gen).to(torch.bfloat16)
    losses, times = [], []
    for _ in range(args.train):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = (layer(x).float() - target.float()).square().mean()
        loss.backward()
        for p in replicated:  # data parallel over the group for what every rank holds
            if p.grad is not None:
                dist.all_reduce(p.grad, group=d.group)
                p.grad /= d.world
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=d.group)
        losses.append(float(mean) / d.world)  # the host read also ends the step
        times.append((time.perf_counter() - t0) * 1e3)
    went_down = losses[-1] < losses[0]
    if d.rank == 0:
        print(f"train: {args.train} steps, mean loss {losses[0]:.5f} -> {losses[-1]:.5f} "
              f"({'down' if went_down else 'NOT down'}), median step {statistics.median(times):.1f} ms "
              f"(host clock)")
    return went_down


def record_step(layer: mok_cute.MoELayer, d: ep_dist.Dist, x: torch.Tensor, outdir: str) -> None:
    """One training step with the in-kernel recorder on; rank 0 writes its forward's and its
    backward's timelines (each launch's own buffer: ``mok_cute.timeline.last()``)."""
    from mok_cute import timeline

    layer.config = dataclasses.replace(layer.config, timeline=True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    forward = timeline.last()
    out.float().square().mean().backward()
    backward = timeline.last()
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)
    dist.barrier(group=d.group)
    if d.rank == 0:
        for name, buf in (("forward", forward), ("backward", backward)):
            if buf is None or (name == "backward" and buf is forward):
                print(f"timeline: no {name} recording on this path")
                continue
            tl = buf.decode()
            title = f"rank 0 of {d.world}, {name}"
            paths = timeline.write_views(tl, f"{outdir}/{name}", timeline.summarize(tl), title)
            print(f"timeline: {name}: {len(tl)} records -> {paths['png']}; check: {tl.check() or 'clean'}")


if __name__ == "__main__":
    ep_dist.leave(main())  # exit without the C++ teardown, where gloo ranks sometimes abort
