"""Expert-parallel correctness checks, one process per GPU under torchrun (issue 7):

    torchrun --nproc-per-node N tools/ep_check.py [--shape custom:256,1024,512,16,4,1]
        [--backend megakernel|reference] [--comm 2,8,16]

For uniform routing and for skewed routing (one expert takes 50 % of every rank's tokens),
every rank calls ``moe_forward(group=...)`` on its own tokens and experts, and:

1. reference  the outputs, gathered to rank 0, against ``reference.moe_forward_virtual``
              (every token's relative error <= --tol: tests/per_token.py);
2. repeat     a second call gives the same bits;
3. comm split ``MoKConfig(num_comm_sms=n)`` for every n of --comm gives the same bits;
4. emulated   rank 0 runs ``mok_cute.moe_forward_virtual`` (the same R ranks, virtual, on its
              own GPU) on the gathered inputs and gets the same bits as the real EP run.

One line per check and routing; exit status 1 if any check fails. NVLink multicast stays
off (set below before torch loads). ``--device cpu`` runs the plumbing on gloo with the
reference backend (checks 3 and 4 then compare the reference with itself).
"""

from __future__ import annotations

import os

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, __file__.rsplit("/tools/", 1)[0])  # run from a checkout
sys.path.insert(0, __file__.rsplit("/tools/", 1)[0] + "/tests")  # the tests' per-token check
import mok_cute  # noqa: E402
from mok_cute import reference  # noqa: E402
from mok_cute.bench import ep, ep_dist  # noqa: E402
from mok_cute.bench.results import gpu_name  # noqa: E402
from mok_cute.shapes import Shape  # noqa: E402
from per_token import TOKEN_TOL, worst_token_error  # noqa: E402

ROUTINGS = {"uniform": None, "skew": 0.5}  # skew: the fraction of tokens on the hot expert


def run_routing(d: ep_dist.Dist, shape: Shape, tokens: int, skew: float | None, config: mok_cute.MoKConfig,
                comm: list[int], tol: float, seed: int) -> dict[str, tuple[bool, str]]:
    """The four checks for one routing; rank 0's verdicts, broadcast to every rank."""
    routing = ep.make_routing(d.world, tokens, shape.experts, shape.top_k, seed, skew=skew)
    weights = ep.make_rank_weights(shape, d.world, d.rank, d.device, seed)
    inp = ep.make_rank_inputs(routing, shape.hidden, d.rank, d.device, seed)

    def forward(cfg: mok_cute.MoKConfig) -> torch.Tensor:
        torch.full_like(inp.x, float("nan"))  # poison the allocator's next block of this size
        with torch.no_grad():
            return mok_cute.moe_forward(inp.x, inp.topk_idx, inp.topk_weights, weights.w_gate, weights.w_up,
                                        weights.w_down, shared=weights.shared, group=d.group, config=cfg)

    first = forward(config)
    same_repeat = torch.equal(forward(config), first)
    same_comm = {n: torch.equal(forward(dataclasses.replace(config, num_comm_sms=n)), first) for n in comm}

    xs, idx, wts, outs = (ep_dist.gather_stacked(d, t) for t in (inp.x, inp.topk_idx, inp.topk_weights, first))
    wg, wu, wd = (ep_dist.gather_stacked(d, t) for t in (weights.w_gate, weights.w_up, weights.w_down))
    verdict = [0.0, 0.0]  # worst token's relative error, emulated bitwise equal
    if d.rank == 0:
        shared = None
        if weights.shared is not None:  # replicated: rank 0's copy stands for every rank's
            shared = tuple(s.unsqueeze(0).expand(d.world, *s.shape).contiguous() for s in weights.shared)
        with torch.no_grad():
            ref = reference.moe_forward_virtual(xs, idx, wts, wg, wu, wd, shared=shared)
            emulated = mok_cute.moe_forward_virtual(xs, idx, wts, wg, wu, wd, shared=shared, config=config)
        verdict = [worst_token_error(outs, ref), float(torch.equal(emulated, outs))]
    rel = ep_dist.broadcast_float(d, verdict[0])
    emulated_equal = bool(ep_dist.broadcast_float(d, verdict[1]))
    repeat_all = ep_dist.all_max(d, float(not same_repeat)) == 0.0
    comm_all = {n: ep_dist.all_max(d, float(not ok)) == 0.0 for n, ok in same_comm.items()}
    return {
        "reference": (rel <= tol, f"worst token's relative error {rel:.3e} (tol {tol})"),
        "repeat": (repeat_all, "bitwise equal on every rank"),
        "comm split": (all(comm_all.values()), ", ".join(f"{n}: {'same' if ok else 'DIFFERENT'}"
                                                          for n, ok in comm_all.items())),
        "emulated": (emulated_equal, "moe_forward_virtual on rank 0 vs the gathered EP outputs"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="custom:256,1024,512,16,4,1",
                        help="an EP shape of mok_cute.shapes (T per rank) or custom:T,H,I,E,K[,shared]")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the shape's)")
    parser.add_argument("--backend", default="megakernel", choices=["megakernel", "reference"])
    parser.add_argument("--comm", default="2,8,16", help="comm CTA counts that must give the same bits")
    parser.add_argument("--tol", type=float, default=TOKEN_TOL,
                        help="per-token relative error bound (tests/per_token.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu (gloo)")
    args = parser.parse_args()

    with ep_dist.session(args.device) as d:
        shape = ep.resolve_split_shape(args.shape, d.world)
        tokens = args.tokens or shape.tokens
        config = mok_cute.MoKConfig(backend=args.backend, timeout_ms=10_000.0)
        comm = [int(n) for n in args.comm.split(",") if n]
        if d.rank == 0:
            print(f"{d.world} ranks ({d.backend}, {gpu_name(d.device)}); {shape.name}: T={tokens}/rank "
                  f"H={shape.hidden} I={shape.intermediate} E={shape.experts} K={shape.top_k}; "
                  f"backend={args.backend}")
        failed = 0
        for name, skew in ROUTINGS.items():
            for check, (ok, detail) in run_routing(d, shape, tokens, skew, config, comm, args.tol, args.seed).items():
                failed += not ok
                if d.rank == 0:
                    print(f"{name:8s} {check:11s} {'PASS' if ok else 'FAIL'}  {detail}", flush=True)
        dist.barrier(group=d.group)
        return 1 if failed else 0


if __name__ == "__main__":
    ep_dist.leave(main())  # every rank has passed main's last barrier and torn its group down
