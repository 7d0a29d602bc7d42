"""What the one-GPU bench, the EP bench and the probes in tools/ share: the ``--contenders``
and ``--mok-config`` arguments, device sync and memory release between contenders, the error
text a failed contender is recorded with, and the relative error of a check."""

from __future__ import annotations

import ast
import dataclasses
import gc
import statistics
import time
import traceback
from typing import Any, Callable, Sequence

import torch

from mok_cute.config import MoKConfig


def parse_contenders(spec: str, allowed: Sequence[str]) -> list[str]:
    """``--contenders``: a comma list of names from ``allowed`` (ValueError naming the others)."""
    contenders = [c.strip() for c in spec.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in allowed]
    if unknown:
        raise ValueError(f"--contenders: expected names from {list(allowed)}, got {unknown}")
    return contenders


def _option_fields(kind: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(kind)}


def _value(raw: str) -> Any:
    """A Python literal (16, 5.5, None, True, 'x'); true / false / none in any case; else the
    text itself (backend=megakernel)."""
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        return raw.strip()


def parse_config_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``--mok-config`` items (``KEY=VALUE``, also comma-separated) to {key: value}. A key is a
    field of ``MoKConfig`` or, dotted, a field of one of its options objects:
    ``megakernel.tickets=static expert_path.fc2_pingpong_max_k=0 check_ids=False``."""
    top = _option_fields(MoKConfig)
    defaults = MoKConfig()
    out: dict[str, Any] = {}
    for item in items:
        for pair in [p for p in item.split(",") if p]:
            if "=" not in pair:
                raise ValueError(f"--mok-config: expected KEY=VALUE, got {pair!r}")
            key, raw = (s.strip() for s in pair.split("=", 1))
            name, _, sub = key.partition(".")
            if name not in top:
                raise ValueError(f"--mok-config: {key!r} is not a MoKConfig field; fields: {sorted(top)}")
            options = getattr(defaults, name)
            options = options if dataclasses.is_dataclass(options) else None
            if sub and options is None:
                raise ValueError(f"--mok-config: MoKConfig.{name} has no fields, got {key!r}")
            if options is not None:
                if not sub:
                    raise ValueError(f"--mok-config: MoKConfig.{name} is an options object: set its "
                                     f"fields, e.g. {name}.{next(iter(_option_fields(type(options))))}=...")
                if sub not in _option_fields(type(options)):
                    raise ValueError(f"--mok-config: {key!r} is not a field of {type(options).__name__}; "
                                     f"fields: {sorted(_option_fields(type(options)))}")
            out[key] = _value(raw)
    return out


def apply_config_overrides(config: MoKConfig, overrides: dict[str, Any]) -> MoKConfig:
    """``config`` with ``overrides`` (``parse_config_overrides``) set; ValueError when a value
    is refused (the dataclasses check their fields)."""
    plain = {k: v for k, v in overrides.items() if "." not in k}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if "." in key:
            name, sub = key.split(".", 1)
            nested.setdefault(name, {})[sub] = value
    try:
        for name, fields in nested.items():
            plain[name] = dataclasses.replace(getattr(config, name), **fields)
        return dataclasses.replace(config, **plain)
    except TypeError as exc:  # a wrong kind of value: the same message, as a usage error
        raise ValueError(f"--mok-config: {exc}") from exc


def forward_path_of(device: Any = None, config: MoKConfig | None = None) -> str:
    """``mok_cute.forward_path(device, config)`` ("unknown: ..." when it raises)."""
    import mok_cute

    try:
        return str(mok_cute.forward_path(device, config))
    except Exception as exc:  # the bench records the answer; it must not stop on it
        return f"unknown: forward_path() raised {type(exc).__name__}: {exc}"


def check_iters(iters: int, warmup: int, name: str = "iters/warmup") -> None:
    """The timing loops' counts (``harness.Timer``, ``ep_dist.time_per_rank``, and the CLIs
    before any work): iters >= 1, warmup >= 0; ``name``: how the message names them."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"{name}: expected iters >= 1 and warmup >= 0, got {iters}/{warmup}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Release what the last contender held: the megakernel's cached plans (rings sized for
    their shape), garbage, and the CUDA cache."""
    from mok_cute import megakernel

    megakernel.release_plans()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(exc: BaseException) -> str:
    """What a failed contender is recorded with: the exception and the end of its traceback."""
    tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
    return f"{type(exc).__name__}: {exc}".strip()[:2000] + " | " + "".join(tail).strip()[-1500:]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (NaN if the shapes differ or anything is not finite)."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("nan")
    o, r = out.detach().float(), ref.detach().float()
    err = float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-30))
    return err if torch.isfinite(o).all() else float("nan")


# The mok_cute contenders' config unless --mok-config says otherwise: the expert path, and no id
# check (the bench checks every contender against the reference before timing it; the check's
# device read would put a host wait in mok_cute's timed calls that no other contender has).
BENCH_CONFIG = MoKConfig(backend="kernel", check_ids=False)

# the training benches' gradients (the reference's leaves, in moe_forward's argument order) and
# passes (FLOPs over the forward's)
GRAD_NAMES = ("x", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
TRAIN_PASSES = {"fwd": 1.0, "bwd": 2.0, "train": 3.0}


def pass_runners(layer: Any, d_out: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The training benches' three passes over a layer (``forward()``, ``reset()``, and
    ``new_weights()`` where it caches quantized weights): fwd; bwd, the backward over one
    forward's graph (built on first use, then kept); train, forward and backward (FP8: the
    weights quantized again, as after an optimizer step; fwd and bwd reuse them, on every FP8
    contender alike)."""
    graph: dict[str, torch.Tensor] = {}

    def fwd() -> None:
        layer.forward()

    def bwd() -> None:
        layer.reset()
        if "out" not in graph:
            graph["out"] = layer.forward()
        graph["out"].backward(d_out, retain_graph=True)

    def train() -> None:
        layer.reset()
        new_weights = getattr(layer, "new_weights", None)
        if new_weights is not None:  # new weights each step: quantized again
            new_weights()
        layer.forward().backward(d_out)

    return {"fwd": fwd, "bwd": bwd, "train": train}


BURN_IN_S = 3.0  # long enough for the H200 to reach its power cap's sustained clock


def burn_in(calls: Sequence[Callable[[], Any]], device: torch.device,
            seconds: float = BURN_IN_S) -> None:
    """Run ``calls`` in turn, untimed, for ``seconds``: the first timed round then starts on a
    GPU at its sustained clock and temperature, not the cool one the checks and compiles left
    (the first contender's first round ran ~1.3 % fast, up to 9 %, over the committed JSON)."""
    calls = list(calls)
    if device.type != "cuda":
        return
    start = time.perf_counter()
    while calls and time.perf_counter() - start < seconds:
        for call in list(calls):
            try:
                call()
            except Exception:  # out of memory, say: the timed rounds record it
                calls.remove(call)
        torch.cuda.synchronize(device)


def paired_ratio(num: list[float] | None, den: list[float] | None) -> float | None:
    """The median over rounds of ``num[r] / den[r]``: two contenders timed in the same
    interleaved rounds (None unless both have the same number of rounds)."""
    if not num or not den or len(num) != len(den):
        return None
    return float(statistics.median(a / b for a, b in zip(num, den)))
