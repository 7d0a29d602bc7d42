"""`mok-cute`: the command line of mok_cute.

    mok-cute info                     versions, GPU, which path moe_forward takes
    mok-cute demo                     a small MoE layer checked against the reference
    mok-cute ptx NAME [--arch ...]    PTX / cubin / SASS of one kernel, instruction mix, diff
    mok-cute bench ...                -> mok_cute.bench.harness.main (--ep: mok_cute.bench.ep)
    mok-cute timeline ...             -> mok_cute.bench.record_timeline.main
    mok-cute tune ...                 -> mok_cute.sim.tune.main

The three delegates are imported only when asked for: the bench is not part of the runtime
library (its charts need the ``bench`` extra, matplotlib).

Also runs as `python3 -m mok_cute.cli ...` (the GPU host runs the package from PYTHONPATH,
without the console script).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from typing import Any, Sequence

# Subcommands that hand their arguments to another module's main(argv).
_DELEGATES = {
    "bench": ("mok_cute.bench.harness", "time the MoE layer against its references (DESIGN §5); --ep across ranks, --train forward and backward"),
    "timeline": ("mok_cute.bench.record_timeline", "record a layer's per-SM timeline and export it"),
    "tune": ("mok_cute.sim.tune", "pick num_comm_sms / minibatch / ring size with the simulator"),
}

# The rows of the instruction-mix table, in order.
_MIX_ROWS = ["wgmma", "tma.load", "tma.store", "setmaxnreg", "ld.global.128b", "st.global.128b",
             "mbarrier", "atom", "red", "fence", "bar", "fma.f32"]


def _console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=max(100, _terminal_width()))


def _e(value: Any) -> str:
    """Text for rich markup: brackets in values (``mok-cute[sass]``) are not style tags."""
    from rich.markup import escape

    return escape(str(value))


def _short(warning: str, keep: int = 48) -> str:
    """A ptxas warning with the mangled kernel name cut short."""
    import re

    return re.sub(r"in function '([^']{%d})[^']+'" % keep, r"in function '\1...'", warning)


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 120


def _prepare_arch_env(arch: str | None) -> None:
    """CUTE_DSL_ARCH must be set before cutlass is imported; without a GPU the DSL would
    otherwise target sm_100a. Leave a value the user set alone."""
    from mok_cute import jit

    if "CUTE_DSL_ARCH" in os.environ:
        return
    if arch is not None:
        jit.set_arch_env(arch)
        return
    import torch

    if not torch.cuda.is_available():
        jit.set_arch_env(jit.DEFAULT_ARCH)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------------------- info
def cmd_info(args: argparse.Namespace) -> int:
    import torch
    from rich.table import Table

    import mok_cute
    from mok_cute import jit

    _prepare_arch_env(None)
    table = Table(title="mok-cute info", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("mok_cute", f"{getattr(mok_cute, '__version__', '?')} ({os.path.dirname(mok_cute.__file__)})")
    table.add_row("python", platform.python_version())
    table.add_row("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'})")
    try:
        import cutlass

        dsl = f"{cutlass.__version__} (import ok)"
    except Exception as exc:  # noqa: BLE001 - report, do not crash
        dsl = f"{_version('nvidia-cutlass-dsl')} (import failed: {type(exc).__name__}: {exc})"
    table.add_row("nvidia-cutlass-dsl", _e(dsl))
    table.add_row("cuda-bindings", _version("cuda-bindings"))
    table.add_row("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "(unset: the DSL picks)"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            table.add_row(f"GPU {i}", f"{props.name}, compute capability {props.major}.{props.minor}, "
                                      f"{props.multi_processor_count} SMs, arch {jit.device_arch(i)}")
    else:
        table.add_row("GPU", "no GPU (torch.cuda.is_available() is False)")
    table.add_row("forward path", _e(mok_cute.forward_path()))
    tool, note = jit.find_nvdisasm()
    table.add_row("nvdisasm", _e(f"{tool} ({note})" if tool else note))
    table.add_row("registered kernels", ", ".join(jit.KERNELS))
    _console().print(table)
    return 0


# ---------------------------------------------------------------------------------- demo
def _demo_inputs(T: int, H: int, I: int, E: int, K: int, shared: bool, seed: int, device: str):
    import torch

    for flag, value, least in (("--tokens", T, 0), ("--hidden", H, 1), ("--intermediate", I, 1),
                               ("--experts", E, 1), ("--topk", K, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if K > E:
        raise ValueError(f"--topk must be <= --experts, got K={K} > E={E}")
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, fan_in: int):
        return (torch.randn(*shape, generator=g) / fan_in ** 0.5).to(torch.bfloat16).to(device)

    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    topk_idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).to(device)
    topk_weights = torch.softmax(torch.randn(T, K, generator=g), dim=1).to(device)
    w_gate, w_up, w_down = w(E, I, H, fan_in=H), w(E, I, H, fan_in=H), w(E, H, I, fan_in=I)
    shared_w = (w(I, H, fan_in=H), w(I, H, fan_in=H), w(H, I, fan_in=I)) if shared else None
    return x, topk_idx, topk_weights, w_gate, w_up, w_down, shared_w


def _rel_err(out, ref) -> float:
    diff = (out.float() - ref.float()).norm().item()
    return diff / max(ref.float().norm().item(), 1e-30)


def _ptx_rows(reports: list[tuple[str, Any]]) -> Any:
    """A rich table: one column per kernel, one row per headline number / instruction class."""
    from rich.table import Table

    table = Table(title="PTX instruction mix (static counts) and ptxas resources")
    keys = ("registers", "spill_bytes", "smem_bytes", "ptxas warnings", *_MIX_ROWS)
    # row names stay whole however many kernels share the terminal's width
    table.add_column("", style="bold", no_wrap=True, min_width=max(map(len, keys)))
    for name, _ in reports:
        table.add_column(name, justify="right")

    def cell(rep: Any, key: str) -> str:
        if isinstance(rep, str):
            return "-"
        value = getattr(rep, key, None) if key in ("registers", "spill_bytes", "smem_bytes") else rep.mix.get(key, 0)
        return "?" if value is None else str(value)

    table.add_row("arch", *[("-" if isinstance(r, str) else r.arch) for _, r in reports])
    for key in ("registers", "spill_bytes", "smem_bytes"):
        table.add_row(key, *[cell(r, key) for _, r in reports])
    for key in _MIX_ROWS:
        table.add_row(key, *[cell(r, key) for _, r in reports])
    table.add_row("ptxas warnings", *[("-" if isinstance(r, str) else str(len(r.warnings))) for _, r in reports])
    return table


def cmd_demo(args: argparse.Namespace) -> int:
    import torch
    from rich.table import Table

    from mok_cute import jit

    arch = jit.normalize_arch(args.arch)  # a usage error, not one failed compile per kernel
    _prepare_arch_env(None)
    import mok_cute as mok

    con = _console()
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if on_gpu else "cpu"
    T, H, I, E, K = args.tokens, args.hidden, args.intermediate, args.experts, args.topk
    con.print(f"[bold]mok-cute demo[/]: MoE layer T={T} H={H} I={I} E={E} K={K} "
              f"shared expert={'yes' if not args.no_shared else 'no'}, seed {args.seed}, device {device}")
    con.print(f"path: {_e(mok.forward_path(device))}")
    inputs = _demo_inputs(T, H, I, E, K, not args.no_shared, args.seed, device)
    x, topk_idx, topk_weights, w_gate, w_up, w_down, shared = inputs

    t0 = time.perf_counter()
    out1 = mok.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=shared)
    if on_gpu:
        torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    out2 = mok.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=shared)
    ref = mok.reference.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=shared)
    if on_gpu:
        torch.cuda.synchronize()
    rel = _rel_err(out1, ref)
    finite = bool(torch.isfinite(out1.float()).all())
    bitwise = torch.equal(out1, out2)
    checks = [
        ("finite output", finite, f"{tuple(out1.shape)} {out1.dtype}"),
        ("rel err vs mok_cute.reference <= 1e-2", finite and rel <= 1e-2, f"{rel:.3e}"),
        ("two runs bitwise identical", bitwise, "torch.equal(run1, run2)"),
    ]
    table = Table(title="moe_forward against the reference")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for name, ok, detail in checks:
        table.add_row(name, "[green]pass[/]" if ok else "[red]FAIL[/]", detail)
    table.add_row("path taken", "", _e(mok.forward_path(device).split(":", 1)[0]))
    table.add_row("first call (incl. compile)", "", f"{t_first * 1e3:.1f} ms")
    con.print(table)
    ok_all = all(ok for _, ok, _ in checks)

    if not on_gpu or args.ptx:
        ok_all &= _demo_compile(con, arch, args.out)
    con.print("[bold green]demo passed[/]" if ok_all else "[bold red]demo FAILED[/]")
    return 0 if ok_all else 1


def _demo_compile(con: Any, arch: str, outdir: str | None) -> bool:
    """Compile every registered kernel offline and print the instruction-mix table."""
    from mok_cute import jit

    outdir = outdir or tempfile.mkdtemp(prefix="mok_cute_ptx_")
    con.print(f"compiling every registered kernel for {arch} (no GPU needed); files in {outdir}")
    reports: list[tuple[str, Any]] = []
    ok = True
    for name in jit.KERNELS:
        status = jit.kernel_status(name)
        if status is not None:
            con.print(f"  {name}: [yellow]{_e(status)}[/]")
            ok &= status.startswith("missing")
            continue
        try:
            reports.append((name, jit.inspect_kernel(name, arch, outdir)))
        except Exception as exc:  # noqa: BLE001 - report every kernel, fail at the end
            con.print(f"  {name}: [red]compile failed: {type(exc).__name__}: {_e(str(exc).strip()[:400])}[/]")
            reports.append((name, "failed"))
            ok = False
    if reports:
        con.print(_ptx_rows(reports))
        for name, rep in reports:
            if not isinstance(rep, str):
                for w in rep.warnings:
                    con.print(f"  [yellow]{name}: {_e(_short(w))}[/]")
    return ok


# ---------------------------------------------------------------------------------- ptx
def _parse_assignments(items: Sequence[str], flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = {"true": True, "false": False}.get(raw.lower(), raw)
        out[key.strip()] = value
    return out


def _print_report(con: Any, rep: Any, show_all: bool) -> None:
    from rich.table import Table

    head = Table(title=f"{rep.name} for {rep.arch}", show_header=False)
    head.add_column("what", style="bold")
    head.add_column("value")
    head.add_row("static config", _e(", ".join(f"{k}={v!r}" for k, v in rep.static.items()) or "(none)"))
    head.add_row("registers / thread", str(rep.registers))
    head.add_row("spill bytes (stores+loads)", str(rep.spill_bytes))
    dyn = rep.dynamic_smem
    head.add_row("smem bytes", f"{rep.smem_bytes} (static {rep.static_smem}, dynamic {dyn if dyn is not None else '?'})")
    for i, launch in enumerate(rep.launches):
        head.add_row(f"launch {i}", _e(", ".join(f"{k}={v}" for k, v in launch.items() if v is not None)))
    head.add_row("compile time", f"{rep.compile_seconds:.2f} s")
    head.add_row("files", _e("\n".join(p for p in (rep.ptx_path, rep.cubin_path, rep.sass_path) if p)))
    head.add_row("SASS", _e(rep.sass_note))
    con.print(head)
    mix = Table(title="instruction mix (static PTX counts)")
    mix.add_column("class")
    mix.add_column("count", justify="right")
    for key, value in rep.mix.items():
        if value or show_all or key in _MIX_ROWS[:4]:
            mix.add_row(key, str(value))
    if rep.sass_mix:
        for key, value in rep.sass_mix.items():
            if value or show_all:
                mix.add_row(f"SASS {key}", str(value))
    con.print(mix)
    if rep.warnings:
        for w in rep.warnings:
            con.print(f"[yellow]ptxas: {_e(_short(w))}[/]")
    else:
        con.print("ptxas: no warnings")


def _inspect_or_report(con: Any, name: str, arch: str, outdir: str, static: dict[str, Any]) -> Any:
    """inspect_kernel, or None after printing why the compile failed (bad static arguments
    stay ValueError / TypeError for main to report)."""
    from mok_cute import jit

    try:
        return jit.inspect_kernel(name, arch, outdir, **static)
    except (ValueError, TypeError):
        raise
    except Exception as exc:  # noqa: BLE001 - a DSL compile error is the answer, not a crash
        con.print(f"[red]{_e(name)} does not compile for {arch} with {_e(static or 'the registered defaults')}:[/]")
        con.print(_e(str(exc).strip()))
        return None


def cmd_ptx(args: argparse.Namespace) -> int:
    from rich.table import Table

    from mok_cute import jit

    con = _console()
    arch = jit.normalize_arch(args.arch)
    _prepare_arch_env(arch)
    if args.list or not args.name:
        table = Table(title="registered kernels (mok_cute.jit.KERNELS)")
        for col in ("name", "compile function", "default static", "status", "description"):
            table.add_column(col, overflow="fold")
        for name, spec in jit.KERNELS.items():
            status = jit.kernel_status(name)
            table.add_row(name, _e(f"{spec.module}:{spec.function}"),
                          _e(", ".join(f"{k}={v!r}" for k, v in spec.static.items())),
                          "[green]ok[/]" if status is None else f"[yellow]{_e(status)}[/]", _e(spec.description))
        con.print(table)
        return 0 if args.list else 2
    if args.name not in jit.KERNELS:
        con.print(f"[red]unknown kernel {_e(repr(args.name))}; registered: {', '.join(jit.KERNELS)}[/]")
        return 2
    base = _parse_assignments(args.set or [], "--set")
    rep = _inspect_or_report(con, args.name, arch, args.out, base)
    if rep is None:
        return 1
    _print_report(con, rep, args.all)
    if args.diff:
        other = _parse_assignments(args.diff, "--diff")
        other_arch = jit.normalize_arch(str(other.pop("arch", arch)))
        rep_b = _inspect_or_report(con, args.name, other_arch, args.out, {**base, **other})
        if rep_b is None:
            return 1
        rows = jit.diff_reports(rep, rep_b)
        con.print(_e(f"diff of {args.name}: A = {arch} {base or '(registered defaults)'}, "
                     f"B = {other_arch} with {other}"))
        table = Table(title="A -> B")
        for col in ("field", "A", "B", "B - A"):
            table.add_column(col, justify="right" if col != "field" else "left")
        for row in rows:
            delta = row.delta
            table.add_row(_e(row.field), _e(_short(str(row.a))), _e(_short(str(row.b))),
                          "" if delta is None else f"{delta:+d}")
        if not rows:
            table.add_row("(no difference)", "", "", "")
        con.print(table)
    if args.json:
        import json

        print(json.dumps(rep.to_dict(), indent=1, default=str))
    return 0


# ---------------------------------------------------------------------------------- delegates
def _delegate(command: str, argv: list[str]) -> int:
    module_name, _ = _DELEGATES[command]
    # the one-GPU training bench; `bench --ep [--train]` goes to the harness, which hands
    # both to the expert-parallel bench
    if command == "bench" and "--train" in argv and "--ep" not in argv:
        module_name = "mok_cute.bench.training"
    _prepare_arch_env(None)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"mok-cute {command}: {module_name} is not in this install, so `{command}` "
                  f"is unavailable.", file=sys.stderr)
            return 2
        raise
    rc = module.main(argv)
    return int(rc) if isinstance(rc, int) else 0


# ---------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from mok_cute.jit import DEFAULT_ARCH, KNOWN_ARCHS

    parser = argparse.ArgumentParser(prog="mok-cute", description="mok_cute: MoE layer kernels in the CuTe DSL")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="versions, GPU, which path moe_forward takes")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("demo", help="run a small MoE layer and check it against the reference")
    p.add_argument("-T", "--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--no-shared", action="store_true", help="no shared expert")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    p.add_argument("--ptx", action="store_true", help="also compile the kernels offline on a GPU host")
    p.add_argument("--arch", default=DEFAULT_ARCH, help=f"arch of the offline compile (default {DEFAULT_ARCH})")
    p.add_argument("--out", default=None, help="where PTX/cubin go (default: a temporary directory)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("ptx", help="PTX/cubin/SASS of a kernel: instruction mix, registers, spills, smem, warnings")
    p.add_argument("name", nargs="?", help="registered kernel name (see --list)")
    p.add_argument("--list", action="store_true", help="list the registered kernels")
    p.add_argument("--arch", default=DEFAULT_ARCH, help=f"{' | '.join(KNOWN_ARCHS)} (default {DEFAULT_ARCH})")
    p.add_argument("--out", default="ptx_out", help="output directory (default ./ptx_out)")
    p.add_argument("--set", nargs="+", metavar="KEY=VAL", help="static arguments of the first config")
    p.add_argument("--diff", nargs="+", metavar="KEY=VAL",
                   help="compile a second config with these changes (arch=sm_100a allowed) and print the diff")
    p.add_argument("--all", action="store_true", help="show zero counts too")
    p.add_argument("--json", action="store_true", help="also print the report as JSON")
    p.set_defaults(func=cmd_ptx)

    for name, (module, text) in _DELEGATES.items():
        p = sub.add_parser(name, help=f"{text}; arguments go to {module}.main", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATES:
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except (ValueError, TypeError) as exc:
        print(f"mok-cute {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
