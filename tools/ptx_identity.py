"""Proof that a refactor changed no kernel: normalised PTX of every default configuration.

    python tools/ptx_identity.py snapshot DIR          # this checkout's kernels -> DIR/*.ptx
    python tools/ptx_identity.py compare BASE [HEAD]   # BASE's snapshot vs HEAD's (default:
                                                       # the working tree), case by case

``compare`` checks BASE out into a temporary git worktree and runs *that commit's* copy of this
script there, so each side compiles its cases with its own API; the case names are the
contract between the two. Normalisation drops comments and renames the entry functions (their
names carry the Python module and class path) to KERNEL0, KERNEL1, ... in order of
appearance. A case whose PTX differs only in the numbering of its virtual registers, labels
or parameters (``renumbered``) passes as "same*". Needs no GPU: every case is compiled for
sm_90a on fake tensors.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def cases() -> dict:
    """name -> zero-argument function returning a compiled kernel (with ``__ptx__``).

    The megakernel cases carry the static configuration that ``mok_cute.megakernel.plan_for``
    resolves for: one rank on one GPU (K = 8 and K = 2, with a shared expert, with the
    recorder), virtual ranks (R = 8, rows in place or every row copied), and one IPC rank;
    the backward megakernel's and the quantizers' (added later: a BASE whose copy of this
    script lacks them reports them as new, not as a difference)."""
    from mok_cute.kernels import gemm_sm90, megakernel, schedule_build, token_ops
    try:  # added later than the first snapshots: absent from their commits' case lists
        from mok_cute.kernels import gemm_fp8, gemm_wgrad
    except ImportError:
        gemm_fp8 = gemm_wgrad = None
    try:
        from mok_cute.kernels import gemm_wgrad_fp8
    except ImportError:
        gemm_wgrad_fp8 = None
    from mok_cute.kernels import quantize
    from mok_cute.kernels.megakernel.backward import compile_backward_megakernel

    opt = "--keep-ptx"

    def fc(**kw):
        return lambda: gemm_sm90.compile_grouped_gemm(options=opt, **kw)

    one_rank = dict(num_ranks=1, num_ctas=132, num_comm_ctas=0, rows_in_place=True,
                    tickets="strided", defer_signals=True)
    virtual = dict(num_ranks=8, num_ctas=132, num_comm_ctas=12, rows_in_place=True,
                   tickets="dynamic")
    ipc = dict(num_ranks=1, num_ctas=132, num_comm_ctas=12, scope="sys", rows_in_place=True,
               tickets="static")

    def mk(base, **kw):
        merged = {**base, **kw}
        if "local_direct" in merged:  # the case names below are shared with older commits
            merged["rows_in_place"] = merged.pop("local_direct")
        return lambda: megakernel.compile_megakernel(options=opt, **merged)

    return {
        "fc1": fc(epilogue="swiglu", tile_n=256),
        "fc1_timeline": fc(epilogue="swiglu", tile_n=256, timeline=True, task_type=1),
        "fc2_cooperative": fc(epilogue="store", tile_n=256),
        "fc2_pingpong": fc(epilogue="store", tile_n=128, pingpong=True),
        "fc2_pingpong_timeline": fc(epilogue="store", tile_n=128, pingpong=True, timeline=True,
                                    task_type=2),
        "mk_one_rank_k8": mk(one_rank, top_k=8, has_shared=False),
        "mk_one_rank_k2_shared": mk(one_rank, top_k=2, has_shared=True),
        "mk_one_rank_timeline": mk(one_rank, top_k=4, has_shared=False, timeline=True),
        "mk_virtual_r8": mk(virtual, top_k=8, has_shared=True),
        "mk_virtual_r8_ring": mk(virtual, top_k=8, has_shared=True, local_direct=False),
        "mk_ipc": mk(ipc, top_k=8, has_shared=True),
        "mk_ipc_ring": mk(ipc, top_k=6, has_shared=True, local_direct=False),
        "gather_rows": lambda: token_ops.compile_gather_rows(options=opt),
        "scatter_rows": lambda: token_ops.compile_scatter_rows(K=8, options=opt),
        "weighted_ksum_k8_shared": lambda: token_ops.compile_weighted_ksum(K=8, has_shared=True,
                                                                            options=opt),
        "weighted_ksum_k4": lambda: token_ops.compile_weighted_ksum(K=4, has_shared=False,
                                                                     options=opt),
        "schedule_build": lambda: schedule_build.compile_schedule_build(num_experts=32,
                                                                        options=opt),
        **({} if gemm_wgrad is None else {
            "fc2_dgrad": fc(epilogue="dgated", tile_n=256, b_mn_major=True),
            "fc2_dgrad_pingpong": fc(epilogue="dgated", tile_n=128, pingpong=True,
                                     b_mn_major=True),
            "fc1_save_preact": fc(epilogue="swiglu", tile_n=256, save_preact=True),
            "fc1_dgrad": fc(epilogue="store", tile_n=256, b_mn_major=True, b_split_k=True),
            "wgrad_gated": lambda: gemm_wgrad.compile_wgrad_gemm(gated=True, options=opt),
            "wgrad_down": lambda: gemm_wgrad.compile_wgrad_gemm(gated=False, options=opt),
            "fp8_fc2": lambda: gemm_fp8.compile_grouped_gemm_fp8(options=opt, tile_n=128),
            "fp8_fc1": lambda: gemm_fp8.compile_grouped_gemm_fp8(options=opt, tile_n=128,
                                                                 epilogue="swiglu"),
            "fp8_fc1_dgrad": lambda: gemm_fp8.compile_grouped_gemm_fp8(options=opt, tile_n=128,
                                                                       b_split_k=True),
            "fp8_fc2_dgrad": lambda: gemm_fp8.compile_grouped_gemm_fp8(options=opt, tile_n=128,
                                                                       epilogue="dgated"),
            "fp8_fc1_save_preact": lambda: gemm_fp8.compile_grouped_gemm_fp8(
                options=opt, tile_n=128, epilogue="swiglu", save_preact=True),
        }),
        **({} if gemm_wgrad_fp8 is None else {
            "fp8_fc2_256": lambda: gemm_fp8.compile_grouped_gemm_fp8(options=opt, tile_n=256),
            "fp8_fc1_256": lambda: gemm_fp8.compile_grouped_gemm_fp8(options=opt, tile_n=256,
                                                                     epilogue="swiglu"),
            "fp8_fc1_256_quantize_h": lambda: gemm_fp8.compile_grouped_gemm_fp8(
                options=opt, tile_n=256, epilogue="swiglu", quantize_h=True),
            "mk_fp8_one_rank": mk(one_rank, top_k=8, has_shared=False, fp8=True,
                                  defer_signals=False),
            "mk_fp8_one_rank_save": mk(one_rank, top_k=8, has_shared=False, fp8=True,
                                       defer_signals=False, save_preact=True),
            "mk_fp8_virtual_r8_shared": mk(virtual, top_k=8, has_shared=True, fp8=True),
            "mk_fp8_ipc_ring": mk(ipc, top_k=6, has_shared=False, fp8=True, local_direct=False),
            "fp8_wgrad_gated": lambda: gemm_wgrad_fp8.compile_wgrad_gemm_fp8(gated=True, options=opt),
            "fp8_wgrad_down": lambda: gemm_wgrad_fp8.compile_wgrad_gemm_fp8(gated=False, options=opt),
        }),
        # the backward megakernel: one rank in place (both FC2 forms), over a group, with the
        # group tail (K = 10, a shared expert's dx rows), with the shared expert's tasks
        "mk_bwd_one_rank": lambda: compile_backward_megakernel(options=opt),
        "mk_bwd_one_rank_fc2_pingpong": lambda: compile_backward_megakernel(
            options=opt, fc2_pingpong=True),
        "mk_bwd_comm": lambda: compile_backward_megakernel(options=opt, num_ctas=116,
                                                           comm_ctas=16),
        "mk_bwd_group_tail": lambda: compile_backward_megakernel(
            options=opt, num_ctas=116, comm_ctas=16, ksum_top_k=10, ksum_shared=True),
        # with the shared expert's tasks (one rank pingpong; the group tail, cooperative)
        "mk_bwd_shared_fc2_pingpong": lambda: compile_backward_megakernel(
            options=opt, fc2_pingpong=True, shared=True),
        "mk_bwd_group_tail_shared": lambda: compile_backward_megakernel(
            options=opt, num_ctas=116, comm_ctas=16, ksum_top_k=10, ksum_shared=True,
            shared=True),
        # the weight gradients added into main_grad: by TMA reduce-add and by registers
        "wgrad_gated_main_grad_reduce": lambda: gemm_wgrad.compile_wgrad_gemm(
            gated=True, accumulate=True, main_grad_add="reduce", options=opt),
        "wgrad_gated_main_grad_load": lambda: gemm_wgrad.compile_wgrad_gemm(
            gated=True, accumulate=True, main_grad_add="load", options=opt),
        "wgrad_down_main_grad_load": lambda: gemm_wgrad.compile_wgrad_gemm(
            gated=False, accumulate=True, main_grad_add="load", options=opt),
        "fp8_wgrad_gated_main_grad": lambda: gemm_wgrad_fp8.compile_wgrad_gemm_fp8(
            gated=True, accumulate=True, options=opt),
        "mk_bwd_shared_fc2_pingpong_main_grad_reduce": lambda: compile_backward_megakernel(
            options=opt, fc2_pingpong=True, shared=True, accumulate_wgrads=True),
        "mk_bwd_shared_fc2_pingpong_main_grad_load": lambda: compile_backward_megakernel(
            options=opt, fc2_pingpong=True, shared=True, accumulate_wgrads=True,
            main_grad_add="load"),
        "mk_bwd_group_tail_shared_main_grad_load": lambda: compile_backward_megakernel(
            options=opt, num_ctas=116, comm_ctas=16, ksum_top_k=10, ksum_shared=True,
            shared=True, accumulate_wgrads=True, main_grad_add="load"),
        # the FP8 quantizers, each variant
        "quantize_rows": lambda: quantize.compile_quantize_rows(options=opt),
        "quantize_rows_scatter8": lambda: quantize.compile_quantize_rows(options=opt,
                                                                          scatter_k=8),
        "quantize_rows_gather": lambda: quantize.compile_quantize_rows(options=opt, gather=True),
        "quantize_cols": lambda: quantize.compile_quantize_cols(options=opt),
        "quantize_cols_gather": lambda: quantize.compile_quantize_cols(options=opt, gather=True),
        "quantize_cols_per_expert": lambda: quantize.compile_quantize_cols_per_expert(options=opt),
        "quantize_cols_per_expert_gather": lambda: quantize.compile_quantize_cols_per_expert(
            options=opt, gather=True),
        "quantize_blocks_both": lambda: quantize.compile_quantize_blocks(options=opt),
    }


_COMMENT = re.compile(r"//.*$", re.M)
_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)")


def normalise(ptx: str) -> str:
    """PTX without comments, blank lines or the Python-derived entry names."""
    names = list(dict.fromkeys(_ENTRY.findall(ptx)))
    for i, name in sorted(enumerate(names), key=lambda p: -len(p[1])):
        ptx = ptx.replace(name, f"KERNEL{i}")
    ptx = _COMMENT.sub("", ptx)
    return "\n".join(line.rstrip() for line in ptx.splitlines() if line.strip()) + "\n"


_REG_DECL = re.compile(r"(\.reg\s+\.\w+\s+%\w+)<\d+>;")
_PARAM_DECL = re.compile(r"^\s*\.param\s[^\n]*?(\w+_param_\d+)\b[^\n]*\n", re.M)
_RENAMED = re.compile(r"%(?:rd|rs|r|p|fd|f|h|hh)\d+\b|\$L__\w+|_param_\d+\b")


def renumbered(ptx: str) -> str:
    """``ptx`` without the declarations of parameters it never reads, its virtual registers,
    labels and parameters renamed in order of first appearance (and the register counts
    dropped): two kernels equal under it run the same instructions on the same operands,
    their numbering aside (a refactor that moves code into a method renumbers the values it
    traces; a parameter only another build reads shifts the others' numbers)."""
    names: dict[str, str] = {}

    def rename(m):
        kind = re.sub(r"\d+$", "", m.group(0)) if m.group(0).startswith("%") else m.group(0)[:3]
        return names.setdefault(m.group(0), f"{kind}#{sum(1 for v in names.values() if v.startswith(kind + '#'))}")

    # a parameter the kernel never reads (an argument of another build) is dropped first
    unread = [m for m in _PARAM_DECL.finditer(ptx)
              if len(re.findall(re.escape(m.group(1)) + r"\b", ptx)) == 1]
    for m in reversed(unread):
        ptx = ptx[:m.start()] + ptx[m.end():]
    return _RENAMED.sub(rename, _REG_DECL.sub(r"\1<N>;", ptx))


def snapshot(outdir: Path, only: list[str] | None) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    known = cases()
    unknown = sorted(set(only or ()) - set(known))
    if unknown:  # a comma-separated list or a misspelt name compared nothing and passed
        sys.exit(f"--cases: no such case {', '.join(unknown)} (names, space-separated: "
                 f"{' '.join(known)})")
    for name, build in known.items():
        if only and name not in only:
            continue
        (outdir / f"{name}.ptx").write_text(normalise(build().__ptx__))
        print(f"  {name}", flush=True)


def _run_snapshot(root: Path, outdir: Path, only: list[str] | None) -> None:
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, str(root / "tools" / "ptx_identity.py"), "snapshot", str(outdir)]
    subprocess.run(cmd + (["--cases", *only] if only else []), check=True, env=env, cwd=root)


def compare(base: str, head: str | None, only: list[str] | None) -> int:
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="ptx_identity_") as tmp:
        tmp = Path(tmp)
        sides = {}
        for label, ref in (("base", base), ("head", head)):
            if ref is None:
                root = repo
            else:
                root = tmp / f"tree_{label}"
                subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(root),
                                ref], check=True, capture_output=True)
            print(f"{label}: {ref or 'working tree'}", flush=True)
            try:
                _run_snapshot(root, tmp / label, only)
            finally:
                if ref is not None:
                    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force",
                                    str(root)], check=False, capture_output=True)
            sides[label] = {p.stem: p.read_text() for p in (tmp / label).glob("*.ptx")}
        failed = renamed = 0
        for name in sorted(set(sides["base"]) | set(sides["head"])):
            a, b = sides["base"].get(name), sides["head"].get(name)
            if a is None:  # a case added since BASE (its copy of this script lists fewer)
                print(f"new      {name}: not in base's case list")
            elif b is None:
                print(f"MISSING  {name}: only in base")
                failed += 1
            elif a == b:
                print(f"same     {name} ({a.count(chr(10))} lines)")
            elif renumbered(a) == renumbered(b):
                print(f"same*    {name} ({a.count(chr(10))} lines; registers, labels or "
                      "parameters renumbered)")
                renamed += 1
            else:
                diff = list(difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="",
                                                 n=0))
                print(f"DIFFERS  {name}: {len(diff)} diff lines; first ones:")
                print("\n".join("    " + d for d in diff[2:12]))
                failed += 1
        if not sides["base"] and not sides["head"]:
            print("no case compiled on either side: nothing compared")
            return 1
        print(f"{failed} case(s) differ" if failed else
              f"instruction-identical ({renamed} case(s) renumbered)" if renamed else
              "byte-identical")
        return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("outdir", type=Path)
    s.add_argument("--cases", nargs="*")
    c = sub.add_parser("compare")
    c.add_argument("base")
    c.add_argument("head", nargs="?")
    c.add_argument("--cases", nargs="*")
    args = p.parse_args(argv)
    if args.cmd == "snapshot":
        snapshot(args.outdir, args.cases)
        return 0
    return compare(args.base, args.head, args.cases)


if __name__ == "__main__":
    sys.exit(main())
