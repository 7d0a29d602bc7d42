"""Layer configuration (`MoKConfig`) and the argument checks shared by the public entry points.

Every check raises `TypeError` (wrong kind of object) or `ValueError` (right kind, wrong value)
with a message of the form ``"<argument>: expected <what>, got <what was given>"``, so a caller
can tell which argument to fix without reading the source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

__all__ = [
    "BACKENDS",
    "MoKConfig",
    "MoEDims",
    "check_bool",
    "check_int",
    "check_tensor",
    "check_aligned",
    "check_kernel_memory",
    "check_moe_inputs",
    "check_expert_ids",
    "id_span",
    "ids_for_int32",
    "PendingIdCheck",
    "describe",
    "ExpertPathOptions",
    "MegakernelOptions",
    "TICKET_MODES",
]

BACKENDS = ("auto", "kernel", "megakernel", "reference")
PRECISIONS = ("bf16", "fp8")
# How the megakernel's compute CTAs take their tasks (MegakernelOptions.tickets)
TICKET_MODES = ("static", "dynamic", "strided")


# ---------------------------------------------------------------------------------------------
# Generic helpers
# ---------------------------------------------------------------------------------------------

# The kernels read activations, weights and main_grad by TMA and 16-byte vectors: their base
# addresses must be 16-byte aligned (a contiguous view at an offset may not be)
KERNEL_ALIGN_BYTES = 16


def describe(value: object) -> str:
    """Short description of a value for error messages (tensors by shape/dtype/device)."""
    if isinstance(value, torch.Tensor):
        return (
            f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device}"
            f"{'' if value.is_contiguous() else ', non-contiguous'})"
        )
    if isinstance(value, (tuple, list)):  # its items described, not a tensor's values printed
        items = ", ".join(describe(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"{type(value).__name__} of {len(value)} ({items})"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def check_int(
    name: str,
    value: object,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
    allow_none: bool = False,
) -> None:
    """`value` must be an int (bool rejected) within [min_value, max_value]."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        expected = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name}: expected {expected}, got {describe(value)}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name}: expected an int >= {min_value}, got {value}")
    if max_value is not None and value > max_value:
        raise ValueError(f"{name}: expected an int <= {max_value}, got {value}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {describe(value)}")


def on_device(t: object):
    """A context that makes ``t``'s CUDA device the current one when it is not (kernels launch
    on the current device's stream: tensors on cuda:1 while cuda:0 is current would be read
    from the wrong device), else a no-op."""
    import contextlib

    if (isinstance(t, torch.Tensor) and t.is_cuda
            and t.device.index != torch.cuda.current_device()):
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def on_first_arg_device(fn):
    """``fn`` run with its first argument's CUDA device current (``on_device``), the argument
    given by position or by name."""
    import functools
    import inspect

    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with on_device(args[0] if args else kwargs.get(first)):
            return fn(*args, **kwargs)
    return call


def check_device(name: str, device: object) -> torch.device:
    """``device`` (a torch.device, a str such as "cuda:1", or a CUDA index) as a
    ``torch.device``; TypeError / ValueError naming ``name`` for anything else (torch's own
    parse errors name no argument)."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{name}: expected a torch.device, str, int or None, got {describe(device)}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{name}: expected a CUDA device index >= 0, got {device}")
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{name}: not a device: {device!r} ({exc})") from None


def _shape_text(shape: Sequence[object]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_tensor(
    name: str,
    t: object,
    *,
    shape: Sequence[object] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Check one tensor argument and return it.

    `shape` is a sequence whose entries are ints (must match), None (any extent) or strings
    (symbolic names, only used in the message: a string entry matches anything; pair it with
    an int when the extent is known). Example: ``shape=("T", 4096)``.
    `dtype` is one dtype or a sequence of accepted dtypes.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {describe(t)}")
    if t.layout != torch.strided:  # sparse / mkldnn: torch's errors later name no argument
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {t.layout} "
                         f"(call .to_dense())")
    if shape is not None:
        ok = t.dim() == len(shape) and all(
            not isinstance(want, int) or isinstance(want, bool) or got == want
            for got, want in zip(t.shape, shape)
        )
        if not ok:
            raise ValueError(
                f"{name}: expected shape {_shape_text(shape)}, got {_shape_text(tuple(t.shape))}"
            )
    if dtype is not None:
        accepted = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in accepted:
            want = " or ".join(str(d) for d in accepted)
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on device {device}, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())} "
            f"for shape {tuple(t.shape)} (call .contiguous())"
        )
    return t


def check_aligned(name: str, t: torch.Tensor, align: int = KERNEL_ALIGN_BYTES) -> torch.Tensor:
    """``t`` unless its data starts past an ``align``-byte boundary (an empty tensor passes):
    then ValueError naming it. The CUDA caller's check, before any kernel is queued: the
    kernels' own entry would refuse it by argument position, mid-call."""
    if t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name}: expected its data {align}-byte aligned on {t.device} (the "
                         f"kernels read it by TMA and {align}-byte vectors), got address "
                         f"0x{t.data_ptr():x}, {t.data_ptr() % align} bytes past a boundary "
                         f"(a view at an offset: pass a copy, e.g. .clone())")
    return t


def check_kernel_memory(tensors, main_grads=()) -> None:
    """The memory the kernels read and add into, checked before any is queued: each of
    ``tensors`` ((name, tensor or None) pairs) 16-byte aligned where on CUDA
    (``check_aligned``); ``main_grads`` ((weight name, its main_grad or None) pairs) aligned
    too and disjoint: two weights adding into shared memory would race. ValueError naming the
    tensor. It reads data pointers, which torch.compile does not trace: ``mok_cute.api``
    skips it while compiling and the custom ops (``autograd``) check their real tensors."""
    for name, t in tensors:
        if t is not None and t.is_cuda:
            check_aligned(name, t)
    named = [(f"{n}.main_grad", b) for n, b in main_grads if b is not None and b.numel()]
    for i, (name, b) in enumerate(named):
        if b.is_cuda:
            check_aligned(name, b)
        lo, hi = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
        for other, o in named[:i]:
            if lo < o.data_ptr() + o.numel() * o.element_size() and o.data_ptr() < hi:
                raise ValueError(f"{name}: shares memory with {other} (each weight adds its "
                                 f"gradient into a buffer of its own)")


# ---------------------------------------------------------------------------------------------
# Implementation options (defaults: the measured winners, docs/measurements.md)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertPathOptions:
    """How the one-GPU expert path (``mok_cute.expert_path``) runs its GEMMs.

    fc2_pingpong_max_k  FC2 runs on the pingpong GEMM (the two consumer warpgroups alternate
                        128-wide tiles, one's epilogue under the other's mainloop) when its K,
                        the intermediate size, is at most this; above it on the cooperative
                        128 x 256 GEMM (long K leaves little epilogue to hide). 0: never.
    fc1_group_m         M-tiles per raster group of FC1 / FC2: the CTAs running together share
    fc2_group_m         one group's weight tiles in L2.
    """

    fc2_pingpong_max_k: int = 8192
    fc1_group_m: int = 8
    fc2_group_m: int = 8

    def __post_init__(self) -> None:
        check_int("ExpertPathOptions.fc2_pingpong_max_k", self.fc2_pingpong_max_k, min_value=0)
        check_int("ExpertPathOptions.fc1_group_m", self.fc1_group_m, min_value=1, max_value=64)
        check_int("ExpertPathOptions.fc2_group_m", self.fc2_group_m, min_value=1, max_value=64)

    def fc2_pingpong(self, intermediate: int) -> bool:
        """Whether FC2 with this intermediate size (its K) runs on the pingpong GEMM."""
        return intermediate <= self.fc2_pingpong_max_k


@dataclass(frozen=True)
class MegakernelOptions:
    """How the megakernel runs a call (every choice gives the same bits).

    rows_in_place  rows a rank routes to its own experts are never copied: FC1 reads them from
                   x and the k-sum reads their y where FC2 wrote it. Needs a ring that holds
                   every routed row; with a smaller ring every row is copied.
    tickets        how compute CTAs take their tasks: "static" (CTA c runs tickets c, c + n,
                   ...; each warp resolves its task), "dynamic" (the producer warp takes the
                   next ticket from a counter and hands the decoded task to the other warps
                   through an smem ring) or "strided" (the static stride through that ring).
                   None: one rank "strided", virtual ranks "dynamic", an IPC rank "static".
    fc1_lead       minibatches whose FC1 tiles are queued before the FC2 tiles of the first;
                   None: the fewest whose FC1 tiles fill every compute CTA.
    backward_comm_sms  SMs of the training backward over a group (``group=``) that pull its
                   rows and push its gradients home while the others run its GEMMs, and with
                   one rank per process then pass the group's barrier and run its k-sums (16:
                   the fastest of 8-32 with 8 ranks' buffers on one H200; ``mok-cute tune
                   --backward`` simulates the split over NVLink).
    """

    rows_in_place: bool = True
    tickets: str | None = None
    fc1_lead: int | None = None
    backward_comm_sms: int = 16

    def __post_init__(self) -> None:
        check_bool("MegakernelOptions.rows_in_place", self.rows_in_place)
        if self.tickets is not None and self.tickets not in TICKET_MODES:
            raise ValueError(f"MegakernelOptions.tickets: expected None or one of {TICKET_MODES}, "
                             f"got {self.tickets!r}")
        check_int("MegakernelOptions.fc1_lead", self.fc1_lead, min_value=0, allow_none=True)
        check_int("MegakernelOptions.backward_comm_sms", self.backward_comm_sms, min_value=1,
                  max_value=64)

    def ticket_mode(self, num_ranks: int, ipc: bool) -> str:
        """The ticket mode of a launch with ``num_ranks`` ranks (virtual), or of one IPC rank."""
        if self.tickets is not None:
            return self.tickets
        if ipc:
            return "static"
        return "strided" if num_ranks == 1 else "dynamic"


# ---------------------------------------------------------------------------------------------
# MoKConfig
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoKConfig:
    """Static configuration of one MoE layer call.

    tile_m            GEMM tile height; also the padding granule of each expert's row segment
                      in the receive schedule.
    num_comm_sms      SMs given to communication in the megakernel; None -> tuned or heuristic.
                      0 only where no row crosses a comm CTA (one rank, rows read in place):
                      the compute CTAs then run the barrier too.
    minibatch_tokens  tokens per dispatch minibatch; None -> tuned or heuristic.
    ring_tokens       rows of the reusable ring buffers; None -> tuned or heuristic.
    timeline          compile-time flag: the in-kernel timeline recorder is on (the
                      megakernel's launches; under autograd the bf16 backward's one launch
                      records too, at one GPU, on virtual ranks and over a group, into at
                      least ``timeline.BACKWARD_CAPACITY`` records);
                      ``mok_cute.timeline.last()`` holds the last recorded call's buffer.
    timeline_capacity records in the timeline buffer.
    timeout_ms        spin-wait timeout in the megakernel, after which it raises.
    backend           "auto": GPU kernels when available, else the PyTorch reference;
                      "kernel": GPU kernels, error if they cannot run;
                      "megakernel": the one-launch megakernel, also for one GPU (where
                      "auto" / "kernel" take the expert-kernel path, faster there today);
                      "reference": always the PyTorch reference.
                      moe_forward_virtual runs the megakernel under "auto", "kernel" and
                      "megakernel".
    check_ids         range-check the expert ids (raises ValueError naming topk_idx; an
                      int64 id >= 2**31 is out of range like any other, never truncated). On
                      the CUDA kernel and megakernel paths this is the call's one
                      device->host read, waited for after the kernels are enqueued; with a
                      group every rank raises the same error, naming the ranks with bad ids.
                      False skips it (no host sync, e.g. for CUDA-graph capture); the caller
                      then guarantees ids in range. An out-of-range id on any path (expert
                      kernels, megakernel, reference) matches no expert: that (token, k)
                      contributes zero, as if its weight were 0. It never faults.
    group_timeout_s   moe_forward(group=...): how long a rank waits for its peers to reach
                      the same call (the agreement before the launch; the id check's verdict
                      after an IPC megakernel launch) before raising
                      ``mok_cute.comm.AgreementTimeout`` naming them. Not ``timeout_ms``: that
                      bounds the kernel's waits once every rank has launched (microseconds
                      apart), while ranks reach a call as far apart as their host work
                      differs (data loading, a first call's kernel compiles: minutes).
    precision         "bf16"; or "fp8": the routed experts' GEMMs in E4M3 with 1 x 128 /
                      128 x 128 power-of-two scales and promoted accumulation
                      (``mok_cute.expert_path_fp8``; the shared expert and the combine stay
                      bf16), forward and backward: the one-GPU expert path, the megakernel
                      at one rank, on virtual ranks and over a group (``group=``: the IPC
                      megakernel only, ValueError otherwise); H and I multiples of 64. Without
                      a GPU its torch emulation runs the forward (training: ValueError).
    fuse_wgrad_accumulation  training: add each expert weight's fp32 gradient into that
                      weight's ``main_grad`` (an fp32 tensor of the weight's shape, contiguous,
                      on its device: Megatron's convention, set by its DDP wrapper) instead of
                      returning a gradient in the weight's dtype; the weight's ``.grad`` then
                      stays None, or gets Megatron's dummy where the weight has the attribute
                      ``grad_added_to_main_grad`` (set True by the call; zeros with
                      ``zero_out_wgrad``, ``autograd.dummy_mode``). Checked when a call
                      trains (ValueError naming the weight); ignored otherwise. Every path
                      honours it: the kernels add their unrounded fp32 accumulators, the
                      PyTorch reference its fp32 gradient.
    saved_rows_factor training over a group (``moe_forward(group=...)``): the g | u rows a
                      rank keeps from its forward for its backward, as a multiple of the
                      average routing's T * K rows a rank (so 1.0 holds exactly a uniform
                      routing's; T as the group's plan pads it: the largest rank's T, rounded
                      up to one of eight steps a doubling). None keeps the worst case: every
                      peer's T * K rows (R x the average), since a rank cannot know before its
                      launch how many it will receive. A call that routes more rows to a rank than it keeps never drops
                      them silently: with ``check_ids`` every rank raises after the forward's
                      launch (``mok_cute.SavedRowsError`` on that rank, RuntimeError naming it on
                      the others); without, the backward completes and that rank's
                      ``mok_cute.check_errors()`` (or its next backward) raises SavedRowsError:
                      discard that step's gradients. One GPU and virtual ranks keep exactly
                      their routed rows and ignore it.
    saved_rows_pool   training over a group: a ``mok_cute.SavedRowsPool`` (device memory of
                      this rank, the same size on every rank) that keeps the g | u rows of
                      every call naming it (a model's layers), each call's packed after what
                      the calls before it took, until its backward has run; the pool empties
                      when a call finds no earlier call's rows held. Sized for what a step
                      routes to the rank, not each layer's worst case. A call that finds too
                      few rows left raises as ``saved_rows_factor`` says. Not with
                      ``saved_rows_factor``; one GPU and virtual ranks ignore it.
    expert_path       ExpertPathOptions: how the one-GPU expert path runs its GEMMs.
    megakernel        MegakernelOptions: how the megakernel runs.
    """

    tile_m: int = 128
    num_comm_sms: int | None = None
    minibatch_tokens: int | None = None
    ring_tokens: int | None = None
    timeline: bool = False
    timeline_capacity: int = 1 << 16
    timeout_ms: float = 10_000.0
    backend: str = "auto"
    check_ids: bool = True
    group_timeout_s: float = 300.0
    precision: str = "bf16"
    fuse_wgrad_accumulation: bool = False
    saved_rows_factor: float | None = None
    saved_rows_pool: object = None
    expert_path: ExpertPathOptions = ExpertPathOptions()
    megakernel: MegakernelOptions = MegakernelOptions()

    def __post_init__(self) -> None:
        check_int("MoKConfig.tile_m", self.tile_m, min_value=1)
        check_int("MoKConfig.num_comm_sms", self.num_comm_sms, min_value=0, allow_none=True)
        check_int(
            "MoKConfig.minibatch_tokens", self.minibatch_tokens, min_value=1, allow_none=True
        )
        check_int("MoKConfig.ring_tokens", self.ring_tokens, min_value=1, allow_none=True)
        for name in ("minibatch_tokens", "ring_tokens"):  # whole M-tiles of the schedule
            value = getattr(self, name)
            if value is not None and value % self.tile_m:
                raise ValueError(f"MoKConfig.{name}: expected a multiple of tile_m={self.tile_m}, "
                                 f"got {value}")
        check_bool("MoKConfig.timeline", self.timeline)
        check_bool("MoKConfig.check_ids", self.check_ids)
        check_bool("MoKConfig.fuse_wgrad_accumulation", self.fuse_wgrad_accumulation)
        check_int("MoKConfig.timeline_capacity", self.timeline_capacity, min_value=1)
        for name in ("timeout_ms", "group_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                unit = "milliseconds" if name == "timeout_ms" else "seconds"
                raise TypeError(f"MoKConfig.{name}: expected a float ({unit}), got {describe(value)}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"MoKConfig.{name}: expected a finite number > 0, got {value}")
        if self.saved_rows_factor is not None:
            value = self.saved_rows_factor
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"MoKConfig.saved_rows_factor: expected None or a float, got "
                                f"{describe(value)}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"MoKConfig.saved_rows_factor: expected a finite number > 0, "
                                 f"got {value}")
        if self.saved_rows_pool is not None:
            from mok_cute.saved_rows import SavedRowsPool

            if not isinstance(self.saved_rows_pool, SavedRowsPool):
                raise TypeError(f"MoKConfig.saved_rows_pool: expected None or a "
                                f"mok_cute.SavedRowsPool, got {describe(self.saved_rows_pool)}")
            if self.saved_rows_factor is not None:
                raise ValueError("MoKConfig.saved_rows_pool: a pool or saved_rows_factor, not "
                                 "both (each says where a call keeps its g | u rows)")
        if not isinstance(self.backend, str):
            raise TypeError(
                f"MoKConfig.backend: expected one of {BACKENDS}, got {describe(self.backend)}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"MoKConfig.backend: expected one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise ValueError(f"MoKConfig.precision: expected one of {PRECISIONS}, got "
                             f"{describe(self.precision)}")
        for name, kind in (("expert_path", ExpertPathOptions), ("megakernel", MegakernelOptions)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"MoKConfig.{name}: expected a mok_cute.{kind.__name__}, got "
                                f"{describe(getattr(self, name))}")


_DEFAULT_CONFIG = MoKConfig()


def resolve_config(config: object) -> MoKConfig:
    """`None` -> defaults (one shared frozen instance); otherwise `config` must be a MoKConfig."""
    if config is None:
        return _DEFAULT_CONFIG
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a mok_cute.MoKConfig or None, got {describe(config)}")
    return config


# ---------------------------------------------------------------------------------------------
# MoE layer arguments (DESIGN §1-§2)
# ---------------------------------------------------------------------------------------------


class MoEDims(NamedTuple):
    """Extents of one (possibly stacked) layer call."""

    num_ranks: int  # R (leading dim of the virtual call; group size for a real EP call; else 1)
    tokens: int  # T
    hidden: int  # H
    top_k: int  # K
    local_experts: int  # E_loc
    intermediate: int  # I
    shared_intermediate: int  # Is (0 without a shared expert)

    @property
    def num_experts(self) -> int:
        return self.num_ranks * self.local_experts


_INDEX_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# The expert weights' names in error messages, in the order the layer takes them (the shared
# expert's as items of ``shared``; expert_backward.MainGrads' order too)
WEIGHT_NAMES = ("w_gate", "w_up", "w_down", "shared[0] (ws_gate)", "shared[1] (ws_up)",
                "shared[2] (ws_down)")


def check_moe_inputs(
    x: object,
    topk_idx: object,
    topk_weights: object,
    w_gate: object,
    w_up: object,
    w_down: object,
    shared: object = None,
    *,
    num_ranks: int = 1,
    stacked: bool = False,
    strict_dtypes: bool = True,
    contiguous: bool = True,
    x_name: str = "x",
) -> MoEDims:
    """Validate the arguments of one layer call and return its extents.

    stacked=False: the shapes of DESIGN §1 (`x [T,H]`, `w_gate [E_loc,I,H]`, ...), with
    `num_ranks` = EP group size (global expert ids are in [0, num_ranks * E_loc)).
    stacked=True: the `moe_forward_virtual` shapes, every tensor with a leading R
    (R is read from `x`; `num_ranks` is ignored).
    strict_dtypes=True: the contract dtypes (bf16 activations and weights; int32/int64 ids;
    fp32 or bf16 routing weights) and, on CUDA, activations and weights 16-byte aligned
    (``check_aligned``). False (the reference oracle): any floating dtype, any address.
    Expert ids are not range-checked here (that needs a device read): see `check_expert_ids`.
    """
    act_dtypes = (torch.bfloat16,) if strict_dtypes else _FLOAT_DTYPES
    route_dtypes = (torch.float32, torch.bfloat16) if strict_dtypes else _FLOAT_DTYPES
    lead = 1 if stacked else 0

    x = check_tensor(x_name, x, dtype=act_dtypes, contiguous=contiguous)
    if x.dim() != 2 + lead:
        want = "[R, T, H]" if stacked else "[T, H]"
        raise ValueError(f"{x_name}: expected a {2 + lead}-D tensor {want}, got shape {_shape_text(tuple(x.shape))}")
    device = x.device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{x_name}: expected a CUDA or CPU tensor (kernels or the reference), "
                         f"got one on {device}")
    R = x.shape[0] if stacked else num_ranks
    if stacked and R < 1:
        raise ValueError(f"{x_name}: expected R >= 1 ranks on dim 0, got shape {_shape_text(tuple(x.shape))}")
    T, H = x.shape[lead], x.shape[lead + 1]
    if H < 1:
        raise ValueError(f"{x_name}: expected hidden size H >= 1, got shape {_shape_text(tuple(x.shape))}")
    pre_n: tuple[object, ...] = (R,) if stacked else ()

    topk_idx = check_tensor("topk_idx", topk_idx, dtype=_INDEX_DTYPES, device=device, contiguous=contiguous)
    if topk_idx.dim() != 2 + lead or tuple(topk_idx.shape[: 1 + lead]) != tuple(x.shape[: 1 + lead]):
        raise ValueError(
            f"topk_idx: expected shape {_shape_text(pre_n + (T, 'K'))} (same leading dims as {x_name}), "
            f"got {_shape_text(tuple(topk_idx.shape))}"
        )
    K = topk_idx.shape[lead + 1]
    if K < 1:
        raise ValueError(f"topk_idx: expected top-k K >= 1 columns, got shape {_shape_text(tuple(topk_idx.shape))}")

    check_tensor(
        "topk_weights",
        topk_weights,
        shape=pre_n + (T, K),
        dtype=route_dtypes,
        device=device,
        contiguous=contiguous,
    )

    w_gate = check_tensor("w_gate", w_gate, dtype=act_dtypes, device=device, contiguous=contiguous)
    if w_gate.dim() != 3 + lead or (stacked and w_gate.shape[0] != R) or w_gate.shape[-1] != H:
        raise ValueError(
            f"w_gate: expected shape {_shape_text(pre_n + ('E_loc', 'I', H))}, "
            f"got {_shape_text(tuple(w_gate.shape))}"
        )
    E_loc, I = w_gate.shape[lead], w_gate.shape[lead + 1]
    if E_loc < 1 or I < 1:
        raise ValueError(
            f"w_gate: expected E_loc >= 1 experts and I >= 1, got shape {_shape_text(tuple(w_gate.shape))}"
        )
    check_tensor("w_up", w_up, shape=pre_n + (E_loc, I, H), dtype=act_dtypes, device=device, contiguous=contiguous)
    check_tensor(
        "w_down", w_down, shape=pre_n + (E_loc, H, I), dtype=act_dtypes, device=device, contiguous=contiguous
    )

    E = R * E_loc
    if K > E:
        raise ValueError(
            f"topk_idx: expected top-k K <= number of experts E = {E} "
            f"({R} rank(s) x {E_loc} local experts), got K = {K}"
        )

    Is = 0
    if shared is not None:
        if not isinstance(shared, (tuple, list)) or len(shared) != 3:
            raise TypeError(
                "shared: expected None or a 3-tuple (ws_gate, ws_up, ws_down), "
                f"got {describe(shared)}"
            )
        ws_gate, ws_up, ws_down = shared
        ws_gate = check_tensor(WEIGHT_NAMES[3], ws_gate, dtype=act_dtypes, device=device, contiguous=contiguous)
        if ws_gate.dim() != 2 + lead or (stacked and ws_gate.shape[0] != R) or ws_gate.shape[-1] != H:
            raise ValueError(
                f"{WEIGHT_NAMES[3]}: expected shape {_shape_text(pre_n + ('Is', H))}, "
                f"got {_shape_text(tuple(ws_gate.shape))}"
            )
        Is = ws_gate.shape[lead]
        if Is < 1:
            raise ValueError(f"{WEIGHT_NAMES[3]}: expected Is >= 1 rows, got shape {_shape_text(tuple(ws_gate.shape))}")
        check_tensor(
            WEIGHT_NAMES[4], ws_up, shape=pre_n + (Is, H), dtype=act_dtypes, device=device, contiguous=contiguous
        )
        check_tensor(
            WEIGHT_NAMES[5], ws_down, shape=pre_n + (H, Is), dtype=act_dtypes, device=device, contiguous=contiguous
        )
    if strict_dtypes and device.type == "cuda" and not torch.compiler.is_compiling():
        check_kernel_memory(zip((x_name, *WEIGHT_NAMES), (x, w_gate, w_up, w_down,
                                                          *(shared or ()))))

    return MoEDims(R, T, H, K, E_loc, I, Is)


class PendingIdCheck:
    """An expert-id range check whose device->host read is waited for later.

    The constructor enqueues the `aminmax` and (on CUDA) a non-blocking copy into pinned
    memory; the caller then launches its kernels (which never fault on bad ids) and calls
    ``finish``, which waits for the copy and raises the same ValueError as `check_expert_ids`
    (``span`` returns the ids' (min, max) instead). The wait then overlaps the host work of
    this call with the GPU work already queued, instead of draining the stream before any of
    it is enqueued. CPU ids are read at once.
    """

    def __init__(self, topk_idx: torch.Tensor, num_experts: int, name: str = "topk_idx"):
        self.num_experts, self.name = num_experts, name
        self._host = self._done = None
        if topk_idx.numel() == 0:
            return
        lo_hi = torch.stack(torch.aminmax(topk_idx)).to(torch.int64)
        if not lo_hi.is_cuda:
            self._host = lo_hi
            return
        self._host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        self._host.copy_(lo_hi, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(lo_hi.device))  # the copy's stream

    def span(self) -> tuple[int, int] | None:
        """(min, max) of the ids, None when there are none (waits for the copy)."""
        if self._host is None:
            return None
        if self._done is not None:
            self._done.synchronize()
        lo, hi = self._host.tolist()
        return lo, hi

    def finish(self) -> None:
        span = self.span()
        if span is not None:
            _raise_if_out_of_range(*span, self.num_experts, self.name)


def _raise_if_out_of_range(lo: int, hi: int, num_experts: int, name: str) -> None:
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{name}: expected global expert ids in [0, {num_experts}), got id {bad} "
            f"(ids span [{lo}, {hi}])"
        )


def id_span(topk_idx: torch.Tensor) -> tuple[int, int] | None:
    """(min, max) of the ids, None when there are none. On CUDA this reads two scalars back to
    the host: one synchronisation, done with a single `aminmax` reduction."""
    if topk_idx.numel() == 0:
        return None
    lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()
    return lo, hi


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int, name: str = "topk_idx") -> None:
    """Every id must be in [0, num_experts) (int64 ids are compared as int64: 2**32 + 1 is out
    of range, never wrapped onto expert 1). On CUDA one device->host read (`id_span`), the
    only host sync of the argument checks."""
    span = id_span(topk_idx)
    if span is not None:
        _raise_if_out_of_range(*span, num_experts, name)


def ids_for_int32(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 ids for a kernel that takes them so: int64 ids outside [0, num_experts) are first
    clamped to -1 or num_experts, which match no expert (narrowing 2**32 + 1 would land on
    expert 1). On the device, no host sync; int32 ids are returned as they are."""
    if topk_idx.dtype == torch.int32:
        return topk_idx
    return topk_idx.clamp(-1, num_experts).to(torch.int32)
