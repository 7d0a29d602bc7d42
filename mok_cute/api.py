"""Public entry points: argument checks, then the GPU kernel path or the PyTorch reference.

Path selection (`forward_path()` prints the outcome for a device):
- `config.backend == "reference"`                      -> reference
- `moe_forward(..., group=...)`                         -> reference (the real
  all_to_all_single exchange); with `config.backend == "megakernel"` the megakernel's IPC
  launch (opt-in until it has run on GPUs)
- `moe_forward_virtual` on a GPU that can run kernels   -> `mok_cute.megakernel` (one launch);
  inputs that require grad (or a torch.compile trace)   -> `mok_cute.autograd.moe_forward_virtual`
                                                           (the saving launch, then
                                                           `mok_cute.virtual_backward`: every
                                                           rank's routed experts in one
                                                           backward-megakernel launch)
- `moe_forward` with `config.backend == "megakernel"`   -> `mok_cute.megakernel` with R = 1
- inputs not on a CUDA device, `mok_cute.expert_path` not importable, or
  `mok_cute.expert_path.kernel_path_status(device)` says no -> reference ("auto") / error
- inputs that require grad                              -> `mok_cute.autograd.moe_forward`
                                                           (the training forward + backward kernels;
                                                           backend "megakernel": its forward at R = 1
                                                           and the backward megakernel's dgrads)
- otherwise                                             -> `mok_cute.expert_path.moe_forward_kernel`

Argument checks follow DESIGN §2 "Bad input": a TypeError or ValueError naming the argument,
what was expected and what was given. Checking that expert ids are in range reads two scalars
back from the device (one `aminmax` reduction): the only host synchronisation of the checks.
With `group=`, the ranks first agree on the call (`mok_cute.comm.agreement`, see
`moe_forward`): every rank takes the same path with the same sizes, or every rank raises.

`MoKConfig(fuse_wgrad_accumulation=True)`: a call that trains reads each trainable expert
weight's fp32 `main_grad` (`_main_grad_targets`, ValueError naming a bad one) and hands the
buffers to whichever path runs: the custom ops / `_GroupTrain` (the kernels add into them) or,
on the PyTorch reference, `autograd.reference_weights` (autograd's fp32 gradient added there).
"""

from __future__ import annotations

import copy
import contextlib
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import reference
from .config import (
    WEIGHT_NAMES,
    MoKConfig,
    check_bool,
    check_device,
    on_first_arg_device,
    PendingIdCheck,
    check_expert_ids,
    check_int,
    check_kernel_memory,
    check_moe_inputs,
    check_tensor,
    describe,
    id_span,
    ids_for_int32,
    resolve_config,
)

__all__ = ["moe_forward", "moe_forward_virtual", "MoELayer", "forward_path", "PathChoice", "choose_path"]

_EP_REASON = ("the megakernel's IPC launch has been checked against the reference on 2 GPUs "
              "only (no determinism or 4/8-GPU run yet), so it is opt-in "
              "(MoKConfig(backend='megakernel'))")


@dataclass(frozen=True)
class PathChoice:
    path: str  # "kernel" or "reference"
    reason: str


@torch._dynamo.assume_constant_result  # torch.compile traces the result, not the imports
def _kernel_status(device: torch.device) -> tuple[bool, str]:
    """Can `mok_cute.expert_path.moe_forward_kernel` run on `device`? (ok, reason)"""
    if not torch.cuda.is_available():
        why = "torch sees no CUDA device" if torch.version.cuda else f"torch {torch.__version__} is a CPU-only build"
        if device.type != "cuda":
            why = f"device {device} is not a CUDA device and {why}"
        return False, why
    if device.type != "cuda":
        return False, f"device {device} is not a CUDA device; the kernels run on CUDA tensors"
    try:
        from . import expert_path  # imported lazily: it pulls in the CuTe DSL
    except Exception as exc:  # noqa: BLE001 - any import failure means "no kernel path"
        return False, f"mok_cute.expert_path failed to import ({type(exc).__name__}: {exc})"
    try:
        ok, why = expert_path.kernel_path_status(device)
    except Exception as exc:  # noqa: BLE001
        return False, f"mok_cute.expert_path.kernel_path_status raised {type(exc).__name__}: {exc}"
    return bool(ok), str(why)


def choose_path(
    device: torch.device | str | int | None = None,
    config: MoKConfig | None = None,
    *,
    distributed: bool = False,
    virtual: bool = False,
    needs_grad: bool = False,
) -> PathChoice:
    """Which path a call takes on `device` (default: the current CUDA device, else CPU).

    needs_grad: some input requires grad with grad mode on. The one-GPU expert path then
    trains on its backward kernels (``mok_cute.autograd``), and so does ``backend="megakernel"``
    on one GPU (its forward, the backward megakernel's dgrads), and so do virtual ranks (the
    megakernel's saving launch, then ``mok_cute.virtual_backward``: one backward-megakernel
    launch for every rank's routed experts).
    Raises RuntimeError / ValueError when `config.backend == "kernel"` and no kernel can run.
    """
    config = resolve_config(config)
    device = _resolve_device(device)
    if config.backend == "reference":
        return PathChoice("reference", "config.backend is 'reference'")
    if distributed:
        if config.backend == "megakernel":  # opt-in until EP determinism and 8 GPUs are checked
            ok, why = _kernel_status(device)
            if ok:
                train = ("; training: the saving launch, then mok_cute.group_backward"
                         if needs_grad else "")
                return PathChoice("megakernel", f"{why}; peers over IPC (opt-in: checked on 2 "
                                                f"GPUs only){train}")
            raise RuntimeError(f"config.backend is 'megakernel' but it cannot run on {device}: "
                               f"{why}")
        if config.backend == "kernel":
            raise ValueError(
                f"config.backend: expected 'auto', 'megakernel' or 'reference' for moe_forward "
                f"with group= ({_EP_REASON}), got 'kernel'")
        return PathChoice("reference", f"moe_forward with group= runs on the reference: {_EP_REASON}")
    ok, why = _kernel_status(device)
    if ok:
        if virtual or config.backend == "megakernel":
            return PathChoice("megakernel", why)
        return PathChoice("kernel", why)
    if config.backend in ("kernel", "megakernel"):
        raise RuntimeError(f"config.backend is {config.backend!r} but the kernel path cannot run on {device}: {why}")
    return PathChoice("reference", why)


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = check_device("device", device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def forward_path(device: torch.device | str | int | None = None, config: MoKConfig | None = None) -> str:
    """One line saying which path `moe_forward` takes on `device`, and why.

    Starts with "kernel:" or "reference:" (or "error:" when config.backend='kernel' cannot be
    honoured), followed by the reason and the path of the expert-parallel entry points.
    """
    config = resolve_config(config)
    dev = _resolve_device(device)
    try:
        choice = choose_path(dev, config)
        head = f"{choice.path}: {choice.reason}"
    except (RuntimeError, ValueError) as exc:
        head = f"error: {exc}"
    if head.startswith("kernel:"):
        head += ("; training (inputs that require grad): the backward kernels, autograd and "
                 "torch.compile through mok_cute::moe_forward_train")
    try:
        virtual = choose_path(dev, config, virtual=True).path
        if virtual == "megakernel":
            backward = ("the one-GPU FP8 backward kernels over every rank's routed rows"
                        if config.precision == "fp8" else
                        "every rank's routed experts in one backward-megakernel launch")
            virtual += f" (training: mok_cute::moe_forward_virtual_train, {backward})"
    except (RuntimeError, ValueError) as exc:
        virtual = f"error: {exc}"
    return (f"{head} [device {dev}; moe_forward_virtual: {virtual}; moe_forward(group=...): "
            f"reference, {_EP_REASON}]")


def _megakernel_fallback(dims, config: MoKConfig) -> bool:
    """True when the megakernel cannot take these sizes and ``backend="auto"`` should run the
    reference instead (with a warning); raises ValueError for an explicit kernel backend."""
    from .expert_path import unsupported_shape_reason

    why = unsupported_shape_reason(dims.hidden, dims.intermediate, dims.top_k,
                                   dims.shared_intermediate or None, config.tile_m)
    if not why:
        return False
    if config.backend != "auto":
        raise ValueError(f"config.backend={config.backend!r}: {why}")
    warnings.warn(f"mok_cute: running the PyTorch reference because {why}", stacklevel=3)
    return True


def _normalise_shared(shared: object) -> object:
    return tuple(shared) if isinstance(shared, list) else shared


def _on_input_device(fn):
    """``fn(x, ...)`` run with x's CUDA device current (``config.on_device``), so that every
    launch, stream and event of the call is on x's device whatever device is current. Under
    torch.compile this is decided at trace time: there the custom ops (the training calls and
    the expert path's compiled calls) do it at run time, and the group call, run eagerly,
    does it itself; the megakernel's inference call is not traced as such."""
    guarded = on_first_arg_device(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return (fn if torch.compiler.is_compiling() else guarded)(*args, **kwargs)
    return call


@_on_input_device
def moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: Sequence[torch.Tensor] | None = None,
    group: object = None,
    config: MoKConfig | None = None,
) -> torch.Tensor:
    """MoE layer forward on one GPU, or on one rank of the EP `group` -> out [T, H] bf16.

    x [T, H] bf16; topk_idx [T, K] int32/int64 global expert ids in [0, R * E_loc);
    topk_weights [T, K] fp32 or bf16; w_gate, w_up [E_loc, I, H] bf16; w_down [E_loc, H, I]
    bf16; shared None or (ws_gate [Is, H], ws_up [Is, H], ws_down [H, Is]) bf16. All on one
    device and contiguous; on CUDA, x and the weights 16-byte aligned (a view at an offset may
    not be: ValueError naming it). Numerics: see `mok_cute.reference`.

    With `group`, every rank of the group calls together, T == 0 included, and the ranks
    agree on the call before any of them launches (`mok_cute.comm.agreement`): H, I, E_loc,
    K, Is, the dtypes of x, the weights, topk_weights and topk_idx, the device type, the path
    (from each rank's device and install) and every MoKConfig field must be equal on every
    rank; T may differ (a rank with fewer tokens, or none, is padded to the group's largest T
    on the megakernel, with ids that match no expert). With ``check_ids`` the ids of every
    rank are checked too. Any mismatch, any rank's bad argument or bad id raises the same
    error on every rank, naming the rank(s); a rank that does not arrive within
    ``config.group_timeout_s`` raises ``mok_cute.comm.AgreementTimeout`` on its peers. The
    exchange is host memory only (ranks on one host: no collective, no GPU sync) and costs a
    few µs (measured in `mok_cute.comm.agreement`); with no group nothing is exchanged. The
    IPC megakernel with ``check_ids`` exchanges once more after its launch: its id check's
    verdict, read after the kernels are queued as on one GPU.

    ``config.fuse_wgrad_accumulation`` (Megatron's ``main_grad``): a call that trains reads
    ``main_grad`` of each expert weight that requires grad (w_gate, w_up, w_down and the
    shared expert's): an fp32 tensor of the weight's shape on its device, contiguous, else
    ValueError naming it. The backward adds the weight's fp32 gradient into it (the kernels
    their unrounded accumulators, the reference autograd's fp32 gradient) and leaves the
    weight's ``.grad`` alone; a weight with the attribute ``grad_added_to_main_grad``
    (Megatron's DDP) gets it set True by this call (at forward time) and a dummy gradient
    (uninitialised, zeros with ``zero_out_wgrad``), as Megatron's DDP hook expects
    (``autograd.dummy_mode``). A call that does not train reads nothing.
    """
    if group is not None:
        return _moe_forward_group(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                                  group, config)
    config = resolve_config(config)
    shared = _normalise_shared(shared)
    dims = check_moe_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared)
    needs_grad = _needs_grad(x, topk_weights, w_gate, w_up, w_down, shared)
    main_grads = _main_grad_targets(config, needs_grad, w_gate, w_up, w_down, shared)
    if dims.tokens == 0:
        return _no_tokens(x, topk_weights, (w_gate, w_up, w_down, *(shared or (None,) * 3)),
                          config, dims, needs_grad, main_grads)
    if config.precision == "fp8":
        return _moe_forward_fp8(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config,
                                dims, needs_grad, main_grads)
    choice = choose_path(x.device, config, needs_grad=needs_grad)
    if choice.path == "megakernel" and _megakernel_fallback(dims, config):
        choice = PathChoice("reference", "sizes the megakernel cannot take")
    # torch.compile traces the custom op, never the host code (its JIT cache, its locks):
    # a compiled call takes it even without grad (it saves g and u then, freed unused)
    if choice.path == "megakernel" and needs_grad:  # one GPU: the megakernel trains too
        from . import autograd

        return autograd.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                                    config, main_grads)
    if choice.path == "kernel" and (needs_grad or torch.compiler.is_compiling()):
        from .expert_path import unsupported_shape_reason

        why = unsupported_shape_reason(dims.hidden, dims.intermediate, dims.top_k,
                                       dims.shared_intermediate or None, config.tile_m)
        if why and config.backend == "kernel":
            raise ValueError(f"config.backend='kernel': {why}")
        if not why:
            from . import autograd

            return autograd.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                                        config, main_grads)
        warnings.warn(f"mok_cute: training on the PyTorch reference because {why}", stacklevel=2)
        choice = PathChoice("reference", why)
    if choice.path == "kernel":
        from . import expert_path

        return _checked_launch(lambda: expert_path.moe_forward_kernel(
            x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config), topk_idx, dims,
            config)
    if choice.path == "megakernel":
        return _megakernel_one_gpu(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                                   config, dims)
    return _reference_call(reference._forward, x, topk_idx, topk_weights, w_gate, w_up, w_down,
                           shared, None, main_grads=main_grads,
                           check_experts=dims.num_experts if config.check_ids else None)


def _checked_launch(launch, topk_idx, dims, config: MoKConfig, megakernel: bool = False):
    """``launch()`` (a kernel path's call) with the id check: the kernels never fault on bad
    ids, so the check's device read is waited for after they are enqueued (the error is the
    same, the stream never drains idle); a megakernel's error words are read at that same
    sync point, no extra wait."""
    pending = PendingIdCheck(topk_idx, dims.num_experts) if config.check_ids else None
    out = launch()
    if pending is not None:
        pending.finish()
        if megakernel:
            from . import megakernel as mk

            mk.raise_pending_errors()
    return out


def _megakernel_one_gpu(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config, dims):
    """``moe_forward`` without grad on the megakernel at one rank (bf16 or FP8)."""
    from . import megakernel

    return _checked_launch(lambda: megakernel.moe_forward(
        x, ids_for_int32(topk_idx, dims.num_experts), topk_weights, w_gate, w_up, w_down,
        shared, config), topk_idx, dims, config, megakernel=True)


def _no_tokens(x, topk_weights, weights: tuple, config: MoKConfig, dims, needs_grad: bool,
               main_grads, virtual: bool = False) -> torch.Tensor:
    """A call with no token (T = 0): the empty output, refused where a call with tokens
    would be for a backend that cannot run here or an FP8 training call without the FP8
    kernels (size checks of kernels that will not run are not made). When it trains, the
    output is part of the graph as a kernel call's is: every input that requires grad gets a
    zero gradient (``weights``: the six expert weights, None where absent; one with a
    main_grad gets None or Megatron's dummy, nothing added), so an empty batch's backward
    runs on every rank (a data-parallel reducer waits for each parameter's gradient)."""
    choice = choose_path(x.device, config, virtual=virtual, needs_grad=needs_grad)
    if config.precision == "fp8":
        _fp8_sizes(dims)
        if needs_grad and choice.path not in ("kernel", "megakernel"):
            raise _fp8_kernels_only(choice)
    lead = (dims.num_ranks,) if virtual else ()
    out = torch.empty(*lead, 0, dims.hidden, dtype=torch.bfloat16, device=x.device)
    if not needs_grad:
        return out
    from .autograd import no_tokens_anchor

    return out + no_tokens_anchor(x, topk_weights, weights, main_grads).to(torch.bfloat16)


def _fp8_kernels_only(choice: PathChoice) -> ValueError:
    """The refusal of an FP8 training call that would not run on the FP8 kernels."""
    return ValueError(f"config.precision='fp8': training runs on the FP8 kernels only (this call "
                      f"would take the {choice.path} path: {choice.reason}); call under "
                      f"torch.no_grad() for the emulation, or train in bf16")


def _moe_forward_fp8(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config, dims,
                     needs_grad: bool, main_grads=None) -> torch.Tensor:
    """``moe_forward`` with ``config.precision == "fp8"``: the FP8 kernels on a GPU, their torch
    emulation without one (``mok_cute.expert_path_fp8``)."""
    from . import expert_path_fp8

    _fp8_sizes(dims)
    choice = choose_path(x.device, config)
    if choice.path == "megakernel":  # backend="megakernel": sizes it cannot take raise here
        _megakernel_fallback(dims, config)
        if needs_grad or torch.compiler.is_compiling():  # the saving launch, FP8 backward kernels
            from . import autograd

            return autograd.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                                        config, main_grads)
        return _megakernel_one_gpu(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                                   config, dims)
    if needs_grad or torch.compiler.is_compiling():
        if choice.path != "kernel":
            raise _fp8_kernels_only(choice)
        from .expert_path import unsupported_shape_reason

        why = unsupported_shape_reason(dims.hidden, dims.intermediate, dims.top_k,
                                       dims.shared_intermediate or None, config.tile_m)
        if why:
            raise ValueError(f"config.precision='fp8': {why}")
        from . import autograd

        return autograd.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                                    config, main_grads)
    if choice.path == "kernel":
        return _checked_launch(lambda: expert_path_fp8.moe_forward_fp8(
            x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config), topk_idx, dims,
            config)
    if config.check_ids:
        check_expert_ids(topk_idx, dims.num_experts)
    return expert_path_fp8.reference_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down,
                                             shared)


def _fp8_sizes(dims) -> None:
    from .expert_path_fp8 import unsupported_reason

    why = unsupported_reason(dims.hidden, dims.intermediate)
    if why:
        raise ValueError(why)


def _fp8_reference_virtual(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared):
    """``moe_forward_virtual`` in FP8 without a GPU: each rank's tokens through the torch
    emulation of the FP8 layer (``expert_path_fp8.reference_forward``) over every rank's
    experts, as the megakernel routes them."""
    from .expert_path_fp8 import reference_forward

    flat = lambda w: w.reshape(-1, *w.shape[2:])  # noqa: E731
    outs = [reference_forward(xs[r], topk_idx[r], topk_weights[r], flat(w_gate), flat(w_up),
                              flat(w_down), None if shared is None else tuple(t[r] for t in shared))
            for r in range(xs.shape[0])]
    return torch.stack(outs)


def _needs_grad(x, topk_weights, w_gate, w_up, w_down, shared) -> bool:
    return torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, topk_weights, w_gate, w_up, w_down, *(shared or ())))


def _main_grad_of(name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight.main_grad``, checked: an fp32 tensor of the weight's shape on its device,
    contiguous; else ValueError naming it (its address: ``_main_grad_targets``). A
    Megatron-FSDP parameter (``__fsdp_param__``) is refused: its buffer comes from
    ``get_main_grad()`` in the backward, which a ``main_grad`` read in the forward would miss."""
    if hasattr(weight, "__fsdp_param__"):
        raise ValueError(f"{name}: a Megatron-FSDP parameter (__fsdp_param__) gets its main_grad "
                         f"from get_main_grad() in the backward, which MoKConfig("
                         f"fuse_wgrad_accumulation=True) does not support: leave it False for "
                         f"such weights (their gradients then arrive as .grad)")
    main_grad = getattr(weight, "main_grad", None)
    if (isinstance(main_grad, torch.Tensor) and main_grad.dtype == torch.float32
            and main_grad.shape == weight.shape and main_grad.device == weight.device
            and main_grad.is_contiguous()):
        return main_grad
    got = ("no main_grad attribute" if not hasattr(weight, "main_grad")
           else describe(main_grad))
    raise ValueError(f"{name}.main_grad: expected a contiguous float32 tensor of shape "
                     f"{list(weight.shape)} on {weight.device} (MoKConfig("
                     f"fuse_wgrad_accumulation=True) adds the weight's gradient into it), "
                     f"got {got}")


def _main_grad_targets(config: MoKConfig, needs_grad: bool, w_gate, w_up, w_down, shared):
    """``autograd.MainGradTargets`` of a call with ``config.fuse_wgrad_accumulation`` that
    trains: the ``main_grad`` of every expert weight that requires grad (a frozen weight's is
    not read), checked; None when the flag is off, the call does not train or every expert
    weight is frozen. On CUDA each 16-byte aligned, and no two sharing memory (one weight
    passed twice, or views that overlap: the kernels' adds into them would race), checked
    here, before anything runs: a buffer refused only in its backward launch would leave the
    others added into (``config.check_kernel_memory``)."""
    if not (config.fuse_wgrad_accumulation and needs_grad):
        return None
    from .autograd import MainGradTargets, NO_DUMMY, dummy_mode

    weights = (w_gate, w_up, w_down, *(shared if shared is not None else (None,) * 3))
    buffers = tuple(_main_grad_of(name, w) if w is not None and w.requires_grad else None
                    for name, w in zip(WEIGHT_NAMES, weights))
    if all(b is None for b in buffers):
        return None
    if not torch.compiler.is_compiling():
        check_kernel_memory((), zip(WEIGHT_NAMES, buffers))
    return MainGradTargets(buffers, tuple(NO_DUMMY if b is None else dummy_mode(w)
                                          for w, b in zip(weights, buffers)))


def _eager(fn, reason: str):
    """``fn`` run eagerly under torch.compile (a graph break), with ``reason`` in the error
    that ``fullgraph=True`` raises (torch versions without ``reason=``: without it)."""
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:
        return torch.compiler.disable(fn)


def _reference_call(forward, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, *rest,
                    main_grads=None, check_experts: int | None = None):
    """``forward`` (``reference._forward`` or ``_forward_virtual``) with fused weight-gradient
    accumulation: each weight with a main_grad enters as ``autograd.reference_weights``' fp32
    copy, whose gradient goes into the main_grad (the same forward bits). ``check_experts``:
    the id check first, against that many experts. Autocast off (bf16 in, bf16 out: the
    reference rounds where the kernels do)."""
    if check_experts is not None:
        check_expert_ids(topk_idx, check_experts)
    if main_grads is not None:
        from .autograd import reference_weights

        weights = reference_weights((w_gate, w_up, w_down, *(shared or (None,) * 3)),
                                    main_grads)
        w_gate, w_up, w_down = weights[:3]
        shared = None if shared is None else weights[3:]
    with _no_autocast(x.device.type):
        return forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, *rest)


# its routing is data-dependent, and Inductor fusing its ops changed its bits
_reference_call = _eager(_reference_call, (
    "the PyTorch reference (no kernel for this device or these sizes) runs eagerly under "
    "torch.compile: its routing is data-dependent and compiling it changes its rounding "
    "(use fullgraph=False)"))


def _eager_under_compile(fn):
    """``fn`` run eagerly under torch.compile, its device guard included (the trace skips
    it)."""
    return _eager(on_first_arg_device(fn), (
        "moe_forward(group=...) runs eagerly under torch.compile: its host-side agreement and "
        "the process group cannot enter a graph (use fullgraph=False)"))


@_eager_under_compile
def _moe_forward_group(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group,
                       config) -> torch.Tensor:
    """`moe_forward` on one rank of ``group``: this rank's checks, the agreement, then the
    reference (all_to_all) or the IPC megakernel. A check that fails here is exchanged too, so
    the peers raise instead of waiting in a collective. Under torch.compile it runs eagerly
    (a graph break; ``fullgraph=True`` refuses it): the host-side agreement and the process
    group cannot enter a graph, and Inductor compiling the reference's ops changed its bits."""
    from .comm.agreement import agree_on_call, call_header, timeout_of

    num_ranks = reference._group_size(group)  # no group: nothing to agree over
    timeout_s = timeout_of(config)
    try:
        config = resolve_config(config)
        shared = _normalise_shared(shared)
        dims = check_moe_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                                num_ranks=num_ranks)
        needs_grad = _needs_grad(x, topk_weights, w_gate, w_up, w_down, shared)
        main_grads = _main_grad_targets(config, needs_grad, w_gate, w_up, w_down, shared)
        choice = choose_path(x.device, config, distributed=True, needs_grad=needs_grad)
        if config.precision == "fp8":
            if choice.path != "megakernel":
                raise ValueError("config.precision='fp8': moe_forward(group=...) runs FP8 on the "
                                 "IPC megakernel only (backend='megakernel')")
            _fp8_sizes(dims)
        if choice.path == "megakernel" and _megakernel_fallback(dims, config):
            choice = PathChoice("reference", "sizes the megakernel cannot take")
        # the reference reads the ids before its collectives; the megakernel after its launch
        span = id_span(topk_idx) if config.check_ids and choice.path == "reference" else None
        # a rank that trains runs a backward its peers must join (and another megakernel plan)
        path = f"{choice.path} (training)" if needs_grad else choice.path
        header = call_header(dims, x, topk_idx, topk_weights, w_gate, path, config, span)
    except Exception as exc:
        agree_on_call(group, exc, timeout_s)  # raises exc, after telling the peers
        raise
    tokens = agree_on_call(group, header, timeout_s)
    if choice.path == "reference":
        return _reference_call(reference._forward, x, topk_idx, topk_weights, w_gate, w_up,
                               w_down, shared, group, main_grads=main_grads)
    return _megakernel_group(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group,
                             config, dims, max(tokens), needs_grad, sum(tokens) / len(tokens),
                             main_grads)


def _pad_rows(t: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_full((rows, *t.shape[1:]), fill)
    out[: t.shape[0]] = t
    return out


def _megakernel_group(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, group, config,
                      dims, max_tokens: int, needs_grad: bool = False,
                      mean_tokens: float | None = None, main_grads=None) -> torch.Tensor:
    """This rank's IPC megakernel launch, sized by the group's largest T rounded up to a plan
    size (`megakernel.plan_tokens`): every rank pads x with zero rows, its ids with -1 (no
    expert) and its weights with 0, and returns its first T rows. With ``check_ids`` the id
    check is read after the launch and its verdict exchanged (`agree_on_launch`), so a bad id
    anywhere raises on every rank. ``needs_grad``: the saving launch under autograd
    (`mok_cute.autograd.moe_forward_group`); every rank must then run the backward too, which
    sizes its choices by ``mean_tokens`` (the ranks' mean T, before the padding).
    ``main_grads``: ``_main_grad_targets``, for the backward."""
    from . import megakernel
    from .comm.agreement import agree_on_launch, timeout_of, until_collective
    from .sim.tune import tuned_config

    T, E = dims.tokens, dims.num_experts
    if max_tokens == 0:  # no rank has a token: no launch, and no backward to join
        out = torch.empty(0, dims.hidden, dtype=torch.bfloat16, device=x.device)
        if not needs_grad:
            return out
        from .autograd import no_tokens_anchor

        weights = (w_gate, w_up, w_down, *(shared or (None,) * 3))
        return out + no_tokens_anchor(x, topk_weights, weights, main_grads).to(torch.bfloat16)
    launch_tokens = megakernel.plan_tokens(max_tokens)  # a bounded set of plans
    check_ids, pending = config.check_ids, None  # the same on every rank (agreed)
    try:
        # a rank failing from here to the launch's first collective makes every rank raise
        with until_collective(group, timeout_of(config)):
            pending = PendingIdCheck(topk_idx, E) if check_ids else None
            if dims.num_ranks > 1:  # GPUs over NVLink: the simulator's picks, on every rank
                config = tuned_config(config, dims.num_ranks, launch_tokens, dims.hidden,
                                      dims.intermediate, E, dims.top_k, dims.shared_intermediate)
            ids = _pad_rows(ids_for_int32(topk_idx, E), launch_tokens, -1)
            args = (_pad_rows(x, launch_tokens, 0.0), ids,
                    _pad_rows(topk_weights, launch_tokens, 0.0), w_gate, w_up, w_down, shared,
                    config)
            if needs_grad:
                from . import autograd

                out = autograd.moe_forward_group(*args, group, mean_tokens, main_grads)[:T]
            else:
                out = megakernel.moe_forward(*args, group=group)[:T]
        outcome = pending.span() if pending is not None else None
    except Exception as exc:
        if not check_ids:
            raise
        outcome = exc
    if check_ids:
        agree_on_launch(group, outcome, E, config.group_timeout_s)
        megakernel.raise_pending_errors()  # the same sync point: no extra wait
    return out


@_on_input_device
def moe_forward_virtual(
    xs: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: Sequence[torch.Tensor] | None = None,
    config: MoKConfig | None = None,
) -> torch.Tensor:
    """R expert-parallel ranks emulated on one device -> outs [R, T, H] bf16.

    Same tensors as `moe_forward` with a leading R on each (xs [R, T, H], topk_idx [R, T, K],
    w_gate [R, E_loc, I, H], ..., shared tensors [R, ...]); ids are global, in [0, R * E_loc).
    Inputs that require grad train on the kernels (`mok_cute.autograd.moe_forward_virtual`:
    the megakernel's saving launch, then `mok_cute.virtual_backward`), as does a call traced
    by torch.compile (through the custom op, even without grad). With
    ``config.fuse_wgrad_accumulation`` each trainable weight's ``main_grad`` is [R, ...] like
    the weight (as `moe_forward`).
    """
    config = resolve_config(config)
    shared = _normalise_shared(shared)
    dims = check_moe_inputs(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared, stacked=True, x_name="xs")
    needs_grad = _needs_grad(xs, topk_weights, w_gate, w_up, w_down, shared)
    main_grads = _main_grad_targets(config, needs_grad, w_gate, w_up, w_down, shared)
    if dims.tokens == 0:
        return _no_tokens(xs, topk_weights, (w_gate, w_up, w_down, *(shared or (None,) * 3)),
                          config, dims, needs_grad, main_grads, virtual=True)
    choice = choose_path(xs.device, config, virtual=True, needs_grad=needs_grad)
    if config.precision == "fp8":
        _fp8_sizes(dims)
        if choice.path != "megakernel":  # no GPU: the emulation, rank by rank
            if needs_grad or torch.compiler.is_compiling():
                raise _fp8_kernels_only(choice)
            if config.check_ids:
                check_expert_ids(topk_idx, dims.num_experts)
            return _fp8_reference_virtual(xs, topk_idx, topk_weights, w_gate, w_up, w_down,
                                          shared)
    if choice.path == "megakernel" and _megakernel_fallback(dims, config):
        choice = PathChoice("reference", "sizes the megakernel cannot take")
    if choice.path == "megakernel" and (needs_grad or torch.compiler.is_compiling()):
        from . import autograd

        return autograd.moe_forward_virtual(xs, topk_idx, topk_weights, w_gate, w_up, w_down,
                                            shared, config, main_grads)
    if choice.path == "megakernel":
        from . import megakernel

        return _checked_launch(lambda: megakernel.moe_forward_virtual(
            xs, ids_for_int32(topk_idx, dims.num_experts), topk_weights, w_gate, w_up, w_down,
            shared, config), topk_idx, dims, config, megakernel=True)
    return _reference_call(reference._forward_virtual, xs, topk_idx, topk_weights, w_gate, w_up,
                           w_down, shared, main_grads=main_grads,
                           check_experts=dims.num_experts if config.check_ids else None)


def forget_quantized_weights() -> None:
    """Drop every cached e4m3 copy of the expert weights (``MoKConfig(precision="fp8")``).
    The FP8 path quantizes a weight once per version: an optimizer step (an in-place update)
    is seen, a write through ``w.data`` (or by a kernel of your own) is not; call this after
    one, before the next FP8 call."""
    from .expert_path_fp8 import forget_quantized_weights as forget

    forget()


def _autocast_to_bf16(device_type: str) -> bool:
    """Whether the call runs in a bf16 autocast region of ``device_type``: ``MoELayer`` then
    takes activations of any float dtype in bf16, as an autocast linear layer does."""
    try:
        return (torch.is_autocast_enabled(device_type)
                and torch.get_autocast_dtype(device_type) == torch.bfloat16)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False


def _no_autocast(device_type: str):
    """Autocast off for ``device_type`` (a no-op context for types autocast does not know)."""
    if device_type in ("cuda", "cpu"):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class MoELayer(nn.Module):
    """A MoE layer: softmax top-k router + `num_experts` SwiGLU experts (+ optional shared expert).

    Routing: `probs = softmax(x @ router.weight^T)` over all experts in fp32, `topk_idx, w =
    topk(probs, top_k)`; with `renormalize=True` (default, Mixtral/Qwen3 style) the k weights
    are divided by their sum, otherwise they are the raw softmax probabilities (DeepSeek-V2
    style). Ties go to torch.topk.

    Parameters (bf16 unless noted): `router.weight` [num_experts, hidden] fp32;
    `w_gate`, `w_up` [E_loc, intermediate, hidden]; `w_down` [E_loc, hidden, intermediate];
    with shared_intermediate > 0, `ws_gate`, `ws_up` [Is, hidden], `ws_down` [hidden, Is].
    With `group` of size R, this rank holds E_loc = num_experts // R experts (global ids
    [rank*E_loc, (rank+1)*E_loc)); the router and shared expert are replicated, so initialise
    them identically on every rank (same seed, or broadcast).

    `dtype`: the parameters' dtype, torch.bfloat16 or None (bf16 experts, fp32 router); the
    experts must be bf16 (the kernels'), and the router is computed in fp32 whatever its storage,
    so `layer.to(torch.bfloat16)` keeps working.

    forward(x [..., hidden] bf16; any float dtype inside a bf16 autocast region, taken as
    bf16) -> [..., hidden] bf16; with `return_aux_loss=True` also the
    load-balancing loss E * sum_e f_e * P_e (Switch Transformer; f_e the fraction of this call's
    routed (token, k) slots on expert e, P_e its mean router probability; 1.0 when balanced),
    differentiable through P: scale it and add it to the training loss. Over a `group` it covers
    this rank's tokens.

    With ``MoKConfig(fuse_wgrad_accumulation=True)`` each expert parameter needs an fp32
    ``main_grad`` of its shape (Megatron's DDP wrapper adds one; see `moe_forward`); the
    router's gradient is autograd's as usual.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        shared_intermediate: int = 0,
        group: object = None,
        config: MoKConfig | None = None,
        *,
        renormalize: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_int("hidden", hidden, min_value=1)
        check_int("intermediate", intermediate, min_value=1)
        check_int("num_experts", num_experts, min_value=1)
        check_int("top_k", top_k, min_value=1, max_value=num_experts)
        check_int("shared_intermediate", shared_intermediate, min_value=0)
        check_bool("renormalize", renormalize)
        if device is not None:
            check_device("device", device)
        if dtype is not None and dtype != torch.bfloat16:
            raise ValueError(f"dtype: expected torch.bfloat16 (the expert kernels' dtype) or None, got {dtype}")
        self.config = resolve_config(config)
        num_ranks = 1 if group is None else reference._group_size(group)
        if num_experts % num_ranks:
            raise ValueError(
                f"num_experts: expected a multiple of the group size {num_ranks}, got {num_experts}"
            )
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k = num_experts, top_k
        self.shared_intermediate = shared_intermediate
        self.group, self.num_ranks = group, num_ranks
        self.num_local_experts = num_experts // num_ranks
        self.renormalize = renormalize

        bf16 = dict(dtype=torch.bfloat16, device=device)
        E_loc, I, H = self.num_local_experts, intermediate, hidden
        self.router = nn.Linear(H, num_experts, bias=False, device=device, dtype=dtype or torch.float32)
        self.w_gate = nn.Parameter(torch.empty(E_loc, I, H, **bf16))
        self.w_up = nn.Parameter(torch.empty(E_loc, I, H, **bf16))
        self.w_down = nn.Parameter(torch.empty(E_loc, H, I, **bf16))
        if shared_intermediate:
            Is = shared_intermediate
            self.ws_gate = nn.Parameter(torch.empty(Is, H, **bf16))
            self.ws_up = nn.Parameter(torch.empty(Is, H, **bf16))
            self.ws_down = nn.Parameter(torch.empty(H, Is, **bf16))
        else:
            self.ws_gate = self.ws_up = self.ws_down = None
        self.reset_parameters()

    def __deepcopy__(self, memo):
        """A deep copy (an EMA or reference model) that shares the process group: a group
        cannot be copied (nor pickled), and the copy's calls belong to the same ranks."""
        if self.group is not None:
            memo[id(self.group)] = self.group
        copy_ = type(self).__new__(type(self))
        memo[id(self)] = copy_
        for name, value in self.__dict__.items():
            copy_.__dict__[name] = copy.deepcopy(value, memo)
        return copy_

    def reset_parameters(self) -> None:
        """nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for every projection."""
        self.router.reset_parameters()
        with torch.no_grad():
            for w in (self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down):
                if w is not None:
                    bound = 1.0 / math.sqrt(w.shape[-1])
                    w.uniform_(-bound, bound)

    @property
    def shared(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if self.ws_gate is None:
            return None
        return (self.ws_gate, self.ws_up, self.ws_down)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_idx [T, top_k] int64, topk_weights [T, top_k] fp32)."""
        self._check_input(x)
        idx, weights, _ = self._route(x)
        return idx, weights

    def _check_input(self, x: object) -> None:
        """x of ``forward`` / ``route``: a dense tensor [..., hidden] (its dtype is checked
        where it matters: ``moe_forward`` for the experts; the router takes any float)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor [..., {self.hidden}], got {describe(x)}")
        check_tensor("x", x, contiguous=False)
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            raise ValueError(f"x: expected shape [..., {self.hidden}], got {list(x.shape)}")

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # fp32 whatever the router's storage dtype (a bf16 router after .to(torch.bfloat16))
        probs = F.softmax(F.linear(x.float(), self.router.weight.float()), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return idx, weights, probs

    def load_balancing_loss(self, topk_idx: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """E * sum_e f_e * P_e of one call's routing (see the class doc); no host sync, so
        the ids are not range-checked (``route`` gives ids in [0, num_experts))."""
        check_tensor("probs", probs, shape=("T", self.num_experts),
                     dtype=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
                     contiguous=False)
        check_tensor("topk_idx", topk_idx, shape=(probs.shape[0], "K"),
                     dtype=(torch.int32, torch.int64), device=probs.device, contiguous=False)
        slots = torch.zeros(self.num_experts, dtype=torch.float32, device=probs.device)
        slots.scatter_add_(0, topk_idx.reshape(-1), torch.ones(topk_idx.numel(), device=probs.device))
        fraction = slots / max(1, topk_idx.numel())
        mean_probs = probs.sum(dim=0) / max(1, probs.shape[0])  # T = 0: a zero loss, not NaN
        return self.num_experts * (fraction * mean_probs).sum()

    def forward(self, x: torch.Tensor, return_aux_loss: bool = False):
        check_bool("return_aux_loss", return_aux_loss)
        self._check_input(x)
        if x.dtype != torch.bfloat16 and _autocast_to_bf16(x.device.type):
            x = x.to(torch.bfloat16)  # as an autocast linear casts its input (differentiable)
        # the layer's own numerics (the fp32 router, the reference's fp32 sums) whatever
        # autocast region the call is in: the kernels' custom ops ignore autocast anyway
        with _no_autocast(x.device.type):
            x2d = x.reshape(-1, self.hidden).contiguous()
            topk_idx, topk_weights, probs = self._route(x2d)
            out = moe_forward(
                x2d, topk_idx, topk_weights, self.w_gate, self.w_up, self.w_down,
                shared=self.shared, group=self.group, config=self.config,
            ).reshape(x.shape)
            if return_aux_loss:
                return out, self.load_balancing_loss(topk_idx, probs)
        return out

    def extra_repr(self) -> str:
        text = (
            f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, local_experts={self.num_local_experts}, renormalize={self.renormalize}"
        )
        if self.shared_intermediate:
            text += f", shared_intermediate={self.shared_intermediate}"
        return text
