"""Kernel registry, compile cache, target arch, and PTX / cubin / SASS inspection.

Every CuTe DSL kernel module of the package exposes a tensor-free compile function,
built on placeholder tensors or pointers, with this signature::

    def compile_xxx(arch: str = "sm_90a", *, options: str = "", **static) -> compiled

and passes ``options=mok_cute.jit.compile_options(arch, options)`` to ``cute.compile``
(``inspect_kernel`` uses ``options`` to ask for the PTX, the cubin and the ptxas report).
It is registered below with one line in ``KERNELS``: module path, function name, default
static arguments and a description.

``compile_kernel(name, arch, **static)`` compiles once per ``(name, arch, static)`` and
caches the result in this process. ``inspect_kernel(name, arch, outdir, **static)`` compiles
a fresh copy with PTX/cubin kept and returns a ``PtxReport``: instruction mix, registers,
spills, shared memory, ptxas warnings (C7508 and others), launch facts, SASS when an
``nvdisasm`` >= 13.4 is found. ``diff_reports(a, b)`` lists what differs between two reports.

Nothing here imports ``cutlass`` at module import: ``CUTE_DSL_ARCH`` must be set before the
first ``import cutlass`` (``set_arch_env``), and the CLI does that first. ``cute.compile``
is not thread safe, so every compile here holds one process-wide lock.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

DEFAULT_ARCH = "sm_90a"
# What the package is compiled and inspected for offline; any sm_XY[a|f] reaches the DSL.
KNOWN_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
MIN_NVDISASM = (13, 4)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Where a kernel's tensor-free compile function lives, and its default static args."""

    module: str
    function: str
    static: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    description: str = ""

    def load(self) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), self.function)


# One line per kernel. Entries whose module does not exist yet are reported as missing.
KERNELS: dict[str, KernelSpec] = {
    "gather_rows": KernelSpec(
        "mok_cute.kernels.token_ops", "compile_gather_rows", {},
        "rows of x into expert-sorted order, 16-byte vectors, index -1 -> zero row"),
    "scatter_rows": KernelSpec(
        "mok_cute.kernels.token_ops", "compile_scatter_rows", {"K": 8},
        "x rows into expert-sorted order token-major: each row read once, written to its K rows"),
    "weighted_ksum": KernelSpec(
        "mok_cute.kernels.token_ops", "compile_weighted_ksum", {"K": 8, "has_shared": True},
        "fixed-order fp32 k-sum plus shared expert, rounded once to bf16"),
    "schedule_build": KernelSpec(
        "mok_cute.kernels.schedule_build", "compile_schedule_build", {"num_experts": 32},
        "one-rank receive schedule: stable counting sort of the routed slots by expert, two launches"),
    "gemm_fc1": KernelSpec(
        "mok_cute.kernels.gemm_sm90", "compile_grouped_gemm",
        {"epilogue": "swiglu", "tile_n": 256, "max_ab_stages": None},
        "grouped GEMM FC1: gate+up, SwiGLU epilogue (TMA + wgmma, persistent)"),
    "gemm_fc2": KernelSpec(
        "mok_cute.kernels.gemm_sm90", "compile_grouped_gemm",
        {"epilogue": "store", "tile_n": 256, "max_ab_stages": None},
        "grouped GEMM FC2: down projection (TMA + wgmma, persistent)"),
    "gemm_fc2_dgrad": KernelSpec(
        "mok_cute.kernels.gemm_sm90", "compile_grouped_gemm",
        {"epilogue": "dgated", "tile_n": 256, "b_mn_major": True, "max_ab_stages": None},
        "FC2's dgrad with the SwiGLU backward in its epilogue: dG, dU, w*h, d_topk_weights partials"),
    "gemm_fc1_dgrad": KernelSpec(
        "mok_cute.kernels.gemm_sm90", "compile_grouped_gemm",
        {"epilogue": "store", "tile_n": 256, "b_mn_major": True, "b_split_k": True,
         "max_ab_stages": None},
        "FC1's dgrad: [dG | dU] @ [W_gate; W_up] in one accumulator (K = 2I)"),
    "gemm_wgrad": KernelSpec(
        "mok_cute.kernels.gemm_wgrad", "compile_wgrad_gemm",
        {"gated": True, "accumulate": False, "main_grad_add": "reduce"},
        "expert weight gradients: K = each expert's rows, MN-major operands, gate and up sharing x; "
        "accumulate=True adds them into fp32 (main_grad): main_grad_add='reduce' by TMA reduce-add, "
        "'load' through registers and plain stores"),
    "quantize_rows": KernelSpec(
        "mok_cute.kernels.quantize", "compile_quantize_rows", {"gather": False},
        "bf16 -> e4m3, 1x128 groups along K, power-of-two scales (fp8.quantize_rows, bitwise); "
        "gather=True reads x's rows through a row index (no gathered copy)"),
    "quantize_cols": KernelSpec(
        "mok_cute.kernels.quantize", "compile_quantize_cols", {"gather": False},
        "bf16 -> e4m3 transposed copy, groups of 128 along M (fp8.quantize_cols, bitwise); "
        "gather=True reads x's rows through a row index (no gathered copy)"),
    "quantize_cols_per_expert": KernelSpec(
        "mok_cute.kernels.quantize", "compile_quantize_cols_per_expert", {"gather": False},
        "bf16 -> e4m3 transposed copy, one scale per column and expert (fp8.quantize_cols_per_expert, "
        "bitwise): a weight gradient's B operand; gather=True reads x's rows through a row index "
        "(no gathered copy)"),
    "quantize_blocks": KernelSpec(
        "mok_cute.kernels.quantize", "compile_quantize_blocks", {"write_q": True, "write_qt": True},
        "weights -> e4m3 in 128x128 blocks and the exact transposed copy (fp8.quantize_blocks)"),
    "gemm_fp8_fc2": KernelSpec(
        "mok_cute.kernels.gemm_fp8", "compile_grouped_gemm_fp8", {"tile_n": 128},
        "FP8 grouped GEMM FC2 (e4m3, 1x128 / 128x128 pow2 scales), promoted every 128 K, store"),
    "gemm_fp8_fc1": KernelSpec(
        "mok_cute.kernels.gemm_fp8", "compile_grouped_gemm_fp8",
        {"tile_n": 128, "epilogue": "swiglu"},
        "FP8 grouped GEMM FC1: gate+up (e4m3, pow2 scales) promoted every 128 K, SwiGLU -> bf16 h"),
    "gemm_fp8_fc2_dgrad": KernelSpec(
        "mok_cute.kernels.gemm_fp8", "compile_grouped_gemm_fp8", {"tile_n": 128, "epilogue": "dgated"},
        "FP8 grouped GEMM FC2 dgrad: d_out rows . W_down (transposed e4m3 copy), promoted every "
        "128 K, the dgated epilogue (dG, dU, w*h, d_topk partials)"),
    "gemm_fp8_fc1_dgrad": KernelSpec(
        "mok_cute.kernels.gemm_fp8", "compile_grouped_gemm_fp8", {"tile_n": 128, "b_split_k": True},
        "FP8 grouped GEMM FC1 dgrad: [dG | dU] . [W_gate^T; W_up^T] (K = 2I, two B tensors), "
        "promoted every 128 K"),
    "gemm_wgrad_fp8": KernelSpec(
        "mok_cute.kernels.gemm_wgrad_fp8", "compile_wgrad_gemm_fp8", {"gated": True, "accumulate": False},
        "FP8 expert weight gradients: e4m3 column-quantized copies (K = each expert's rows), "
        "per-(column, 128-row) scales on both operands, promoted every group"),
    "megakernel": KernelSpec(
        "mok_cute.kernels.megakernel", "compile_megakernel", {"num_ranks": 1, "top_k": 8},
        "the MoE layer in one persistent launch: pull dispatch, FC1/FC2 GEMMs, push combine, "
        "k-sum (static fields: constants.MegakernelSpec)"),
    "megakernel_backward": KernelSpec(
        "mok_cute.kernels.megakernel.backward", "compile_backward_megakernel", {},
        "the backward megakernel: a rank's FC2 and FC1 dgrads, then its weight gradients, as "
        "tasks of one persistent launch (tasks_backward)"),
    "copy_rows_by_address": KernelSpec(
        "mok_cute.kernels.peer_rows", "compile_copy_rows_by_address", {},
        "rows to and from peers' symmetric buffers by address (0: zero row / skip), 16-byte "
        "vectors: the backward over a group's pulls and pushes"),
    "peer_barrier": KernelSpec(
        "mok_cute.kernels.peer_rows", "compile_peer_barrier", {"scope": "sys"},
        "the unicast group barrier over a plan's flags (release stores, bounded acquire waits)"),
}


# ----------------------------------------------------------------------------------------
# Arch and environment
# ----------------------------------------------------------------------------------------

_ARCH_RE = re.compile(r"^sm_(\d{2,3})([af]?)$")


def normalize_arch(arch: str) -> str:
    """Return ``arch`` as the DSL spells it (``sm_90a``); raise ValueError on other forms."""
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'sm_90a', got {type(arch).__name__}")
    text = arch.strip().lower()
    if not text.startswith("sm_"):
        text = "sm_" + text.removeprefix("sm")
    if not _ARCH_RE.match(text):
        raise ValueError(f"arch must look like 'sm_90a' or 'sm_100a' (known: {', '.join(KNOWN_ARCHS)}), got {arch!r}")
    return text


def set_arch_env(arch: str = DEFAULT_ARCH) -> str:
    """Set ``CUTE_DSL_ARCH`` if unset, before ``cutlass`` is imported; return the value in force.

    The DSL reads it once at import. Every compile here also passes ``--gpu-arch``, so a
    different value only matters for trace-time arch checks of arch-specific instructions."""
    arch = normalize_arch(arch)
    if "CUTE_DSL_ARCH" not in os.environ and "cutlass" not in sys.modules:
        os.environ["CUTE_DSL_ARCH"] = arch
    return os.environ.get("CUTE_DSL_ARCH", "")


def compile_options(arch: str = DEFAULT_ARCH, extra: str = "") -> str:
    """The ``options=`` string for ``cute.compile``: the target arch plus ``extra``."""
    return f"--gpu-arch {normalize_arch(arch)} {extra}".strip()


def device_arch(device: Any = None) -> str:
    """The arch string for a CUDA device: (9, 0) -> sm_90a, (10, 0) -> sm_100a, ..."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


# ----------------------------------------------------------------------------------------
# Registry and compile cache
# ----------------------------------------------------------------------------------------

_COMPILE_LOCK = threading.RLock()
_CACHE: dict[tuple, Any] = {}


def get_spec(name: str) -> KernelSpec:
    if name not in KERNELS:
        raise ValueError(f"kernel name must be one of {sorted(KERNELS)}, got {name!r}")
    return KERNELS[name]


def kernel_status(name: str) -> str | None:
    """None when the kernel's compile function imports, otherwise why it does not.

    A module that does not exist yet gives a message starting with 'missing:'; any other
    import failure (a bug in an existing module) starts with 'import failed:'."""
    spec = get_spec(name)
    try:
        spec.load()
    except ModuleNotFoundError as exc:
        if exc.name and spec.module.startswith(exc.name):
            return f"missing: module {spec.module} does not exist yet"
        return f"import failed: {type(exc).__name__}: {exc}"
    except AttributeError:
        return f"import failed: {spec.module} has no function {spec.function}"
    except Exception as exc:  # report, never crash the listing
        return f"import failed: {type(exc).__name__}: {exc}"
    return None


def _static_args(spec: KernelSpec, static: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(spec.static)
    merged.update(static)
    return merged


def _cache_key(name: str, arch: str, static: Mapping[str, Any]) -> tuple:
    return (name, arch, tuple(sorted(static.items())))


def compile_kernel(name: str, arch: str = DEFAULT_ARCH, **static: Any) -> Any:
    """Compile kernel ``name`` for ``arch`` with ``static`` overriding its registered defaults,
    once per process: a second call with the same configuration returns the same object."""
    spec = get_spec(name)
    arch = normalize_arch(arch)
    merged = _static_args(spec, static)
    key = _cache_key(name, arch, merged)
    with _COMPILE_LOCK:
        if key not in _CACHE:
            set_arch_env(arch)
            _CACHE[key] = spec.load()(arch=arch, **merged)
        return _CACHE[key]


def clear_cache() -> None:
    with _COMPILE_LOCK:
        _CACHE.clear()


# ----------------------------------------------------------------------------------------
# PTX / ptxas / SASS analysis
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class KernelResources:
    """ptxas' resource report for one entry function."""

    name: str
    registers: int | None = None
    barriers: int | None = None
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    static_smem: int = 0


@dataclasses.dataclass
class PtxReport:
    """What one compiled kernel looks like, from its PTX, ptxas' report and (maybe) SASS.

    ``mix`` counts PTX instructions in the code (static counts: an unrolled loop counts each
    copy once, a runtime loop's body once). Global loads and stores are binned by access
    width in bits (``ld.global.128b`` is a 16-byte vector access)."""

    name: str
    arch: str
    static: dict[str, Any]
    mix: dict[str, int]
    kernels: list[KernelResources]
    warnings: list[str]
    launches: list[dict[str, Any]]
    ptxas_log: str
    ptx_path: str
    cubin_path: str | None
    sass_path: str | None
    sass_mix: dict[str, int] | None
    sass_note: str
    compile_seconds: float

    @property
    def registers(self) -> int | None:
        regs = [k.registers for k in self.kernels if k.registers is not None]
        return max(regs) if regs else None

    @property
    def spill_bytes(self) -> int | None:
        if not self.kernels:
            return None
        return sum(k.spill_stores + k.spill_loads for k in self.kernels)

    @property
    def static_smem(self) -> int | None:
        return max((k.static_smem for k in self.kernels), default=None)

    @property
    def dynamic_smem(self) -> int | None:
        sizes = [l["smem"] for l in self.launches if isinstance(l.get("smem"), int)]
        return max(sizes) if sizes else None

    @property
    def smem_bytes(self) -> int | None:
        """Static smem from ptxas plus the dynamic smem of the launch, when both are known."""
        if self.static_smem is None:
            return None
        return self.static_smem + (self.dynamic_smem or 0)

    def summary(self) -> dict[str, Any]:
        """The headline numbers, flat, for tables and diffs."""
        out: dict[str, Any] = {
            "registers": self.registers,
            "spill_bytes": self.spill_bytes,
            "smem_bytes": self.smem_bytes,
            "warnings": len(self.warnings),
        }
        out.update(self.mix)
        if self.sass_mix:
            out.update({f"sass:{k}": v for k, v in self.sass_mix.items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(registers=self.registers, spill_bytes=self.spill_bytes,
                    static_smem=self.static_smem, dynamic_smem=self.dynamic_smem,
                    smem_bytes=self.smem_bytes)
        return data


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_PRED_RE = re.compile(r"^@!?%?\w+\s+")
_TYPE_BITS_RE = re.compile(r"^(?:b|s|u|f|bf)(8|16|32|64|128)$")


def _access_bits(opcode: str) -> int | None:
    """Access width in bits of an ld/st opcode such as ``ld.global.nc.v4.b32`` (128)."""
    vec, bits = 1, None
    for part in opcode.split("."):
        if re.fullmatch(r"v(2|4|8)", part):
            vec = int(part[1:])
        m = _TYPE_BITS_RE.match(part)
        if m:
            bits = int(m.group(1))
    return vec * bits if bits else None


# (key, predicate on the opcode). Order is the display order.
_MIX_CLASSES: list[tuple[str, Callable[[str], bool]]] = [
    ("wgmma", lambda op: op.startswith("wgmma.mma_async")),
    ("wgmma.fence/commit/wait", lambda op: op.startswith("wgmma.") and not op.startswith("wgmma.mma_async")),
    ("tcgen05.mma", lambda op: op.startswith("tcgen05.mma")),
    ("tcgen05.other", lambda op: op.startswith("tcgen05.") and not op.startswith("tcgen05.mma")),
    ("tma.load", lambda op: op.startswith("cp.async.bulk.tensor") and re.search(r"\.shared(::\w+)?\.global", op) is not None),
    ("tma.store", lambda op: op.startswith("cp.async.bulk.tensor") and re.search(r"\.global\.shared", op) is not None),
    ("tma.reduce", lambda op: op.startswith("cp.reduce.async.bulk.tensor")),
    ("tma.prefetch", lambda op: op.startswith("cp.async.bulk.prefetch.tensor")),
    ("bulk_copy", lambda op: op.startswith("cp.async.bulk.") and ".tensor" not in op and "prefetch" not in op
     and not op.startswith(("cp.async.bulk.commit_group", "cp.async.bulk.wait_group"))),
    ("cp.async", lambda op: re.match(r"cp\.async\.(ca|cg)\.", op) is not None),
    ("setmaxnreg", lambda op: op.startswith("setmaxnreg")),
    ("mbarrier", lambda op: op.startswith("mbarrier.")),
    ("atom", lambda op: op.startswith("atom.")),
    ("red", lambda op: op.startswith("red.")),
    ("multimem", lambda op: op.startswith("multimem.")),
    ("fence", lambda op: op.startswith("fence.")),
    ("bar", lambda op: op.startswith(("bar.", "barrier."))),
    ("ldmatrix/stmatrix", lambda op: op.startswith(("ldmatrix.", "stmatrix."))),
    ("ld.shared", lambda op: op.startswith("ld.shared")),
    ("st.shared", lambda op: op.startswith("st.shared")),
    ("ld.local/st.local", lambda op: op.startswith(("ld.local", "st.local"))),
    ("fma.f32", lambda op: op.startswith("fma.") and op.endswith(".f32")),
]


def ptx_opcodes(ptx: str) -> list[str]:
    """The opcode of every instruction line of a PTX module (predicates removed)."""
    ops: list[str] = []
    for raw in ptx.splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line or line[0] in ".{}(" or line.endswith(":") or line.startswith(")"):
            continue
        line = _PRED_RE.sub("", line)
        op = line.split(None, 1)[0].rstrip(";")
        if op and op[0].isalpha():
            ops.append(op)
    return ops


def instruction_mix(ptx: str) -> dict[str, int]:
    """Counts of the instruction classes that matter for these kernels (zeros included)."""
    mix: dict[str, int] = {key: 0 for key, _ in _MIX_CLASSES}
    widths: dict[str, collections.Counter] = {"ld.global": collections.Counter(), "st.global": collections.Counter()}
    for op in ptx_opcodes(ptx):
        for key, pred in _MIX_CLASSES:
            if pred(op):
                mix[key] += 1
                break
        for kind in widths:
            if op.startswith(kind):
                widths[kind][_access_bits(op) or 0] += 1
    for kind, counter in widths.items():
        for bits in (128, 64, 32, 16, 8):
            mix[f"{kind}.{bits}b"] = counter.get(bits, 0)
        other = sum(v for b, v in counter.items() if b not in (128, 64, 32, 16, 8))
        if other:
            mix[f"{kind}.other"] = other
    return mix


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
# the same two lines as the DSL's spill remark wraps them: the name on the next line
_WRAPPED_RE = re.compile(r"(?:Compiling entry function|Function properties for)\s*$")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_WARN_RE = re.compile(r"(ptxas (?:warning|error)\s*:.*|ptxas info\s*:\s*\(C\d{4}\).*)")


def parse_ptxas_log(log: str) -> tuple[list[KernelResources], list[str]]:
    """Per-entry resources and the warnings from ptxas' verbose output."""
    log = _ANSI_RE.sub("", log)
    kernels: dict[str, KernelResources] = {}
    current: KernelResources | None = None
    warnings: list[str] = []
    lines = log.splitlines()
    for n, line in enumerate(lines):
        m = _ENTRY_RE.search(line) or _PROPS_RE.search(line)
        name = m.group(1) if m else None
        if name is None and _WRAPPED_RE.search(line) and n + 1 < len(lines) and lines[n + 1].split():
            name = lines[n + 1].split()[0].strip("'")
        if name is not None:
            current = kernels.setdefault(name, KernelResources(name))
        m = _SPILL_RE.search(line)
        if m and current is not None:
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = _USED_RE.search(line)
        if m and current is not None:
            current.registers = int(m.group(1))
            current.barriers = int(m.group(2)) if m.group(2) else 0
            current.static_smem = int(m.group(3)) if m.group(3) else 0
        m = _WARN_RE.search(line)
        if m:
            text = re.sub(r"\s+", " ", m.group(1)).strip()
            if text not in warnings:
                warnings.append(text)
    return list(kernels.values()), warnings


def find_nvdisasm() -> tuple[str | None, str]:
    """An nvdisasm >= 13.4 and its version, or (None, why not).

    Looked for in the ``nvidia-cuda-nvdisasm`` wheel (``nvidia/cu13/bin``), ``CUDA_HOME`` /
    ``CUDA_PATH``, then ``PATH``."""
    candidates: list[Path] = []
    for entry in sys.path:
        candidates += sorted(Path(entry).glob("nvidia/cu*/bin/nvdisasm")) if entry else []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvdisasm")
    on_path = shutil.which("nvdisasm")
    if on_path:
        candidates.append(Path(on_path))
    seen: list[str] = []
    for cand in candidates:
        if not cand.is_file() or str(cand) in seen:
            continue
        seen.append(str(cand))
        try:
            out = subprocess.run([str(cand), "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        m = re.search(r"release (\d+)\.(\d+)", out)
        if m and (int(m.group(1)), int(m.group(2))) >= MIN_NVDISASM:
            return str(cand), f"nvdisasm {m.group(1)}.{m.group(2)}"
    floor = ".".join(map(str, MIN_NVDISASM))
    if seen:
        return None, f"SASS skipped: nvdisasm found ({', '.join(seen)}) but none is >= {floor}"
    return None, f"SASS skipped: no nvdisasm >= {floor} (pip install 'mok-cute[sass]' or set CUDA_HOME)"


_SASS_LINE_RE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_SASS_KEYS = ("HGMMA", "QGMMA", "UTCHMMA", "UTCQMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "SYNCS",
              "LDG.128", "STG.128", "LDG", "STG", "LDL", "STL", "ATOMG", "REDG", "BAR", "MEMBAR")


def sass_mix(sass: str) -> dict[str, int]:
    """Counts of the SASS opcodes that tell how a kernel really runs (LDL/STL = spills)."""
    counts = collections.Counter()
    for m in _SASS_LINE_RE.finditer(sass):
        op = m.group(1)
        base = op.split(".", 1)[0]
        counts[base] += 1
        if base in ("LDG", "STG") and ".128" in op:
            counts[f"{base}.128"] += 1
    return {key: counts.get(key, 0) for key in _SASS_KEYS}


@contextlib.contextmanager
def _record_launches(records: list[dict[str, Any]]):
    """Record each traced launch's config (block, grid, dynamic smem, min blocks per SM,
    cooperative). Best effort over a private DSL hook: without it, launches stay empty."""
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        dsl = CuTeDSL._get_dsl()
        original = dsl._generate_kernel_attrs
    except Exception:
        yield
        return

    def plain(value: Any) -> Any:
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return str(value)

    def recording(config: Any) -> Any:
        with contextlib.suppress(Exception):
            records.append({
                "grid": plain(list(config.grid)),
                "block": plain(list(config.block)),
                "cluster": (plain(list(config.cluster))
                            if config.cluster is not None and any(c is not None for c in config.cluster)
                            else None),
                "smem": plain(config.smem),
                "min_blocks_per_mp": plain(config.min_blocks_per_mp),
                "cooperative": plain(config.cooperative),
            })
        return original(config)

    dsl._generate_kernel_attrs = recording
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del dsl._generate_kernel_attrs


_LAUNCH_STRUCT = r"!llvm.struct<\(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32\)>"
_SMEM_GEP_RE = re.compile(r"(%\d+) = llvm.getelementptr %\d+\[0, 2\] : \(!llvm.ptr\) -> !llvm.ptr, " + _LAUNCH_STRUCT)


def launch_smem_from_host_ir(ir_text: str) -> list[int | None]:
    """Dynamic smem bytes of each launch, read from the lowered host code (field 2 of the
    launch-config struct), where the DSL has resolved an automatically sized smem.
    Best effort: None for a launch whose size is not a constant there."""
    sizes: list[int | None] = []
    for gep in _SMEM_GEP_RE.finditer(ir_text):
        store = re.search(r"llvm.store (%\d+), " + re.escape(gep.group(1)) + r" : i64", ir_text[gep.end():])
        value = None
        if store:
            defs = list(re.finditer(re.escape(store.group(1)) + r" = llvm.mlir.constant\((\d+) : i64\)",
                                    ir_text[: gep.start()]))
            value = int(defs[-1].group(1)) if defs else None
        sizes.append(value)
    return sizes


MAX_TAG_CHARS = 200  # of an artifact's config tag (the name and ".ptxas.log" come on top)


def _config_tag(spec: KernelSpec, static: Mapping[str, Any]) -> str:
    changed = {k: v for k, v in static.items() if spec.static.get(k, object()) != v}
    if not changed:
        return ""
    text = re.sub(r"[^A-Za-z0-9_=+-]", "", "-".join(f"{k}{v}" for k, v in sorted(changed.items())))
    if len(text) > MAX_TAG_CHARS:  # file names stop at 255 bytes: keep a readable head and a digest
        text = text[:MAX_TAG_CHARS - 13] + "-" + hashlib.sha1(text.encode()).hexdigest()[:12]
    return "." + text


def inspect_kernel(name: str, arch: str = DEFAULT_ARCH, outdir: str | os.PathLike | None = None,
                   **static: Any) -> PtxReport:
    """Compile ``name`` for ``arch`` and write ``<outdir>/<name>.<arch>[.<config>].{ptx,cubin,sass,
    ptxas.log,json}``; return the report. Needs no GPU."""
    spec = get_spec(name)
    arch = normalize_arch(arch)
    merged = _static_args(spec, static)
    out = Path(outdir if outdir is not None else "ptx_out")
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{name}.{arch}{_config_tag(spec, merged)}"
    captured = io.StringIO()
    launches: list[dict[str, Any]] = []
    with _COMPILE_LOCK, tempfile.TemporaryDirectory(prefix="mok_dsl_dump_") as dump_dir:
        set_arch_env(arch)
        fn = spec.load()
        extra = f"--keep-ptx --keep-cubin --dump-dir {dump_dir} warnings{{ptx}} remarks{{ptx}}"
        start = time.perf_counter()
        with contextlib.redirect_stderr(captured), _record_launches(launches):
            try:
                compiled = fn(arch=arch, options=extra, **merged)
            except TypeError as exc:
                if "options" in str(exc):
                    raise TypeError(
                        f"{spec.module}.{spec.function} must accept options= and pass "
                        f"mok_cute.jit.compile_options(arch, options) to cute.compile") from exc
                raise
        seconds = time.perf_counter() - start
    ptx = getattr(compiled, "__ptx__", None)
    if not ptx:
        raise RuntimeError(f"{name}: the compiled object carries no PTX; does {spec.function} "
                           f"pass mok_cute.jit.compile_options(arch, options) to cute.compile?")
    if any(not isinstance(l.get("smem"), int) for l in launches):
        with contextlib.suppress(Exception):
            sizes = launch_smem_from_host_ir(str(compiled.ir_module))
            if len(sizes) == len(launches):
                for launch, size in zip(launches, sizes):
                    if not isinstance(launch.get("smem"), int) and size is not None:
                        launch["smem"], launch["smem_source"] = size, "auto (host IR)"
    log = _ANSI_RE.sub("", captured.getvalue())
    kernels, warnings = parse_ptxas_log(log)
    ptx_path = stem.with_name(stem.name + ".ptx")
    ptx_path.write_text(ptx)
    (stem.with_name(stem.name + ".ptxas.log")).write_text(log)
    cubin = getattr(compiled, "__cubin__", None)
    cubin_path = sass_path = None
    sass_counts = None
    if cubin:
        cubin_path = stem.with_name(stem.name + ".cubin")
        cubin_path.write_bytes(cubin)
        tool, note = find_nvdisasm()
        if tool:
            proc = subprocess.run([tool, "-c", str(cubin_path)], capture_output=True, text=True)
            if proc.returncode == 0:
                sass_path = stem.with_name(stem.name + ".sass")
                sass_path.write_text(proc.stdout)
                sass_counts = sass_mix(proc.stdout)
                note = f"SASS written with {note}"
            else:
                note = f"SASS skipped: {tool} failed: {proc.stderr.strip()[:200]}"
    else:
        note = "SASS skipped: no cubin in the compiled object"
    report = PtxReport(
        name=name, arch=arch, static=dict(merged), mix=instruction_mix(ptx), kernels=kernels,
        warnings=warnings, launches=launches, ptxas_log=log, ptx_path=str(ptx_path),
        cubin_path=str(cubin_path) if cubin_path else None,
        sass_path=str(sass_path) if sass_path else None, sass_mix=sass_counts, sass_note=note,
        compile_seconds=seconds,
    )
    stem.with_name(stem.name + ".json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
    return report


@dataclasses.dataclass(frozen=True)
class DiffRow:
    field: str
    a: Any
    b: Any

    @property
    def delta(self) -> Any:
        numbers = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.a, self.b))
        if numbers:
            return self.b - self.a
        return None


def diff_reports(a: PtxReport, b: PtxReport) -> list[DiffRow]:
    """Every headline number, instruction count or warning that differs between two reports,
    in display order (``static`` config first)."""
    rows: list[DiffRow] = []
    for key in sorted(set(a.static) | set(b.static)):
        if a.static.get(key) != b.static.get(key):
            rows.append(DiffRow(f"static:{key}", a.static.get(key), b.static.get(key)))
    if a.arch != b.arch:
        rows.append(DiffRow("arch", a.arch, b.arch))
    sa, sb = a.summary(), b.summary()
    for key in list(sa) + [k for k in sb if k not in sa]:
        if sa.get(key, 0) != sb.get(key, 0):
            rows.append(DiffRow(key, sa.get(key, 0), sb.get(key, 0)))
    # The same warning at another PTX line is the same warning.
    key = lambda w: re.sub(r"line \d+", "line N", w)  # noqa: E731
    keys_a, keys_b = {key(w) for w in a.warnings}, {key(w) for w in b.warnings}
    rows += [DiffRow("warning", w, None) for w in a.warnings if key(w) not in keys_b]
    rows += [DiffRow("warning", None, w) for w in b.warnings if key(w) not in keys_a]
    return rows
