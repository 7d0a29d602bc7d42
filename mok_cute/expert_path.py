"""The one-GPU expert path: torch tensors in, mok_cute kernels launched, torch tensors out.

    x --scatter_rows--> x_sorted --FC1 (swiglu)--> h --FC2 (store)--> y --k-sum--> out
                                   shared expert: x --FC1--> hs --FC2--> s ---^

Every step runs on the stream of the current torch device with no host sync: the receive
schedule (built on the GPU) keeps counts in device memory and the GEMMs read the M-tile count
and tile -> expert table from there. ``MoKConfig.expert_path`` (``ExpertPathOptions``) says
which GEMM kernel runs FC2 and how tiles are rasterised.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import NamedTuple

import torch

from mok_cute import jit
from mok_cute.config import ExpertPathOptions, MoKConfig, describe
from mok_cute.constants import MAX_TOP_K, TILE_M, few_rows_stage_cap


# ---------------------------------------------------------------------- availability
@functools.lru_cache(maxsize=None)
def _dsl_import_error() -> str | None:
    try:
        importlib.import_module("cutlass.cute")  # imports cutlass too
    except Exception as exc:  # pragma: no cover - depends on the install
        return f"nvidia-cutlass-dsl not importable: {exc}"
    return None


def kernel_path_status(device=None) -> tuple[bool, str]:
    """(available, reason): whether moe_forward can run on mok_cute kernels on ``device``."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return False, f"tensors are on {dev.type}, kernels need a CUDA device"
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) != (9, 0):
        return False, f"compute capability {major}.{minor}: kernels are built for sm_90a (Hopper)"
    err = _dsl_import_error()
    if err:
        return False, err
    return True, f"mok_cute sm_90a kernels on {torch.cuda.get_device_name(dev)}"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, tile_expert: torch.Tensor,
                 num_m_tiles: torch.Tensor, epilogue: str = "store", tile_n: int | None = None,
                 group_m: int = 8, out: torch.Tensor | None = None,
                 timeline: torch.Tensor | None = None, task_type: int | None = None,
                 w_up: torch.Tensor | None = None, pingpong: bool = False,
                 preact_out: torch.Tensor | None = None,
                 preact_slot: torch.Tensor | None = None,
                 max_ab_stages: int | None = None) -> torch.Tensor:
    """C = epilogue(A @ W[expert(m)]^T) over 128-row M-tiles; see kernels/gemm_sm90.py.

    a: [M, K] bf16; w: [E, N, K] bf16; tile_expert: [>= ceil(M/128)] int32;
    num_m_tiles: [1] int32 (device). "store" returns [M, N]; "swiglu" takes w = W_gate and
    w_up = W_up (both [E, I, K]) and returns h = silu(g) * u, [M, I], with g, u the bf16
    pre-activations, which ``preact_out`` ([slots, 2I]: g then u) receives when given (a
    training forward), row ``preact_slot[r]`` ([M] int32, -1: padding, not stored) for row r.
    Rows past num_m_tiles*128 are untouched.
    timeline: int64 recorder buffer (``mok_cute.timeline.TimelineBuffer.tensor``) to record
    one span per tile with ``task_type``; None compiles the variant without the recorder.
    max_ab_stages: at most this many operand stages (None: as many as fit; the same bits).
    """
    from mok_cute.kernels import gemm_sm90
    m, k = a.shape
    e, n, k_w = w.shape
    if k_w != k:
        raise ValueError(f"w: expected K={k} (from a), got {k_w}")
    if (epilogue == "swiglu") != (w_up is not None):
        raise ValueError(f"w_up: expected a tensor exactly for the swiglu epilogue, got "
                         f"{type(w_up).__name__} with epilogue={epilogue!r}")
    if w_up is not None and w_up.shape != w.shape:
        raise ValueError(f"w_up: expected shape {tuple(w.shape)} like w, got {tuple(w_up.shape)}")
    tile_n = tile_n or gemm_sm90.choose_tile_n(n, epilogue)
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    compiled = jit.compile_kernel(
        "gemm_fc1" if epilogue == "swiglu" else "gemm_fc2", jit.device_arch(a.device),
        tile_n=tile_n, group_m=group_m, num_sms=_num_sms(a.device.index or 0),
        timeline=timeline is not None, task_type=task_type if timeline is not None else None,
        pingpong=pingpong, save_preact=preact_out is not None, max_ab_stages=max_ab_stages)
    extra = (None,) * 6
    if preact_out is not None:
        check_preact(preact_out, n, preact_slot, m, "preact_slot")
        extra = (None, None, preact_out, preact_slot, None, None)
    compiled(a.unsqueeze(2), w.permute(1, 2, 0),
             None if w_up is None else w_up.permute(1, 2, 0),
             out.unsqueeze(2), tile_expert, num_m_tiles, timeline, *extra)
    return out


def check_preact_rows(rows: int, inter: int, name: str = "preact") -> None:
    """Saved pre-activations of ``rows`` rows of [g | u] at I = ``inter`` fit the 32-bit row
    offsets (in 32-byte units) that the epilogues saving and reading them compute: else a
    ValueError naming ``name``, before anything is written (past 2**31 units, 64 GiB, a row's
    offset would wrap)."""
    if rows * (inter // 8) >= 2 ** 31:
        raise ValueError(f"{name}: {rows} saved rows x I = {inter} exceed the kernels' 32-bit "
                         f"row offsets (rows * I / 8 must stay below 2**31; rows = T * K, or "
                         f"R * T * K over R ranks; fewer tokens a call)")


def check_preact(preact: torch.Tensor, inter: int, row_slot: torch.Tensor, rows: int,
                 slot_name: str = "row_slot") -> None:
    """The saved pre-activations as the kernels address them: contiguous bf16 [slots, 2I] with
    I % 8 == 0, each row's offset in 32-byte units below 2**31 (up to 64 GiB); and the int32
    [rows] row -> slot map (-1: padding) the kernels read them through."""
    if (preact.dtype != torch.bfloat16 or preact.dim() != 2 or preact.shape[1] != 2 * inter
            or inter % 8 or not preact.is_contiguous()):
        raise ValueError(f"preact: expected a contiguous bf16 [slots, {2 * inter}] tensor (I % 8 "
                         f"== 0), got {preact.dtype} {tuple(preact.shape)}")
    check_preact_rows(preact.shape[0], inter)
    if (not isinstance(row_slot, torch.Tensor) or row_slot.shape != (rows,)
            or row_slot.dtype != torch.int32):
        raise ValueError(f"{slot_name}: expected an int32 [{rows}] row -> slot map, got "
                         f"{describe(row_slot)}")


def expert_mlp(x_rows: torch.Tensor, w_gate, w_up, w_down, tile_expert, num_m_tiles,
               options: ExpertPathOptions, timeline: torch.Tensor | None = None,
               shared: bool = False, preact_out: torch.Tensor | None = None,
               preact_slot: torch.Tensor | None = None, rows_per_expert: float | None = None):
    """FC1 (gate+up, SwiGLU) then FC2 over tile-padded rows grouped by expert (a training
    forward passes ``preact_out`` and ``preact_slot`` to keep the pre-activations).
    ``rows_per_expert`` (T * K / E) picks the training FC1's operand stages
    (``constants.few_rows_stage_cap``; None: as many as fit); the inference FC1 keeps as many
    as fit (3-6 % slower on 3 where the training FC1 gains 15-20 %, docs/measurements.md)."""
    from mok_cute.tasks import TaskType
    fc1, fc2 = (TaskType.SHARED_FC1, TaskType.SHARED_FC2) if shared else (TaskType.FC1, TaskType.FC2)
    h = grouped_gemm(x_rows, w_gate, tile_expert, num_m_tiles, "swiglu", w_up=w_up,
                     group_m=options.fc1_group_m, timeline=timeline, task_type=int(fc1),
                     preact_out=preact_out, preact_slot=preact_slot,
                     max_ab_stages=few_rows_stage_cap(rows_per_expert)
                     if preact_out is not None else None)
    pingpong = options.fc2_pingpong(w_down.shape[2])
    return grouped_gemm(h, w_down, tile_expert, num_m_tiles, "store",
                        group_m=options.fc2_group_m, timeline=timeline, task_type=int(fc2),
                        pingpong=pingpong, tile_n=128 if pingpong else None)


# ---------------------------------------------------------------------- the layer

def unsupported_shape_reason(hidden: int, inter: int, top_k: int, shared_inter: int | None,
                             tile_m: int = TILE_M) -> str:
    """Why the kernels cannot take these sizes ("" when they can)."""
    if tile_m != TILE_M:
        return f"config.tile_m: the sm_90a GEMMs use {TILE_M}-row tiles, got {tile_m}"
    if hidden % 64:
        return f"x: hidden size must be a multiple of 64 for the kernels, got {hidden}"
    if inter % 64:
        return f"w_gate: intermediate size must be a multiple of 64 for the kernels, got {inter}"
    if shared_inter is not None and shared_inter % 64:
        return f"shared: intermediate size must be a multiple of 64 for the kernels, got {shared_inter}"
    if top_k > MAX_TOP_K:
        return f"topk_idx: K must be <= {MAX_TOP_K} for the kernels, got {top_k}"
    return ""


def expert_rows(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int):
    """One GPU's receive schedule of ``topk_idx`` [T, K], the padded row of each (token, k)
    slot (the scatter's destinations and the k-sum's sources), and x's rows in expert order,
    tile-padded. x is scattered token-major (each x row read once, written to its K rows;
    padding rows left as allocated: no GEMM output row depends on another row) rather than
    gathered (each of the K rows reads its x row): x does not fit in L2 on dsv3 or sonic."""
    from mok_cute.kernels import token_ops

    sched, row_of_slot = expert_schedule(topk_idx, num_experts)
    x_rows = torch.empty((sched.row_token.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    token_ops.scatter_rows(x, row_of_slot, x_rows)
    return sched, row_of_slot, x_rows


def expert_schedule(topk_idx: torch.Tensor, num_experts: int):
    """One GPU's receive schedule of ``topk_idx`` [T, K] and the padded row of each slot."""
    from mok_cute import schedule as sched_mod

    num_tokens, top_k = topk_idx.shape
    # api.py checks the ids (its device read is waited for after these launches) or the
    # caller vouches for them (check_ids=False): the schedule skips its own host read
    sched = sched_mod.build_receive_schedule(topk_idx.unsqueeze(0), 0, num_experts,
                                             tile_m=TILE_M, validate=False)
    return sched, sched_mod.row_of_slot(sched, num_tokens, top_k)


class SavedForBackward(NamedTuple):
    """What a training forward keeps for the backward (4 K I bytes per token, the
    pre-activations of its K slots, plus the schedule; h is recomputed in the backward's
    epilogue, each row's token from its slot)."""

    preact: torch.Tensor  # [T * K, 2I] bf16: g then u of each (token, k) slot, by slot
    shared_preact: torch.Tensor  # [T, 2Is] bf16, or [0, 0] without a shared expert
    row_slot: torch.Tensor  # [capacity] int32: the row's slot t * K + k, -1 on padding rows
    row_of_slot: torch.Tensor  # [T * K] int32: the padded row of each slot, -1 if routed nowhere
    tile_expert: torch.Tensor  # [capacity / 128] int32
    num_tiles: torch.Tensor  # [1] int32
    expert_offsets: torch.Tensor  # [E + 1] int32: each expert's first padded row

    def row_token(self, top_k: int) -> torch.Tensor:
        """Each padded row's token, -1 on padding rows (the schedule's ``row_token``): its
        slot // K, recomputed rather than saved (4 bytes a row less)."""
        return torch.div(self.row_slot, top_k, rounding_mode="floor")


def preact_by_slot(sched, num_tokens: int, top_k: int, inter: int, device):
    """What a training forward's FC1 stores g | u into: ([T * K, 2I] bf16 by slot, each padded
    row's slot [capacity] int32, -1: padding)."""
    from mok_cute import schedule as sched_mod

    return (torch.empty(num_tokens * top_k, 2 * inter, dtype=torch.bfloat16, device=device),
            sched_mod.slot_of_rows(sched, top_k))


def shared_tiles(num_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert as one expert over every token: (tile -> expert, tile count)."""
    n_tiles = (num_tokens + TILE_M - 1) // TILE_M
    return (torch.zeros(max(n_tiles, 1), dtype=torch.int32, device=device),
            torch.full((1,), n_tiles, dtype=torch.int32, device=device))


def shared_forward(x, shared, options: ExpertPathOptions, timeline=None, save: bool = False):
    """The shared expert (bf16 on every path) as one expert over every token -> (its rows
    [T, H] or None, its g | u [T, 2Is] with ``save``, else [0, 0])."""
    shared_preact = x.new_empty(0, 0)
    if shared is None:
        return None, shared_preact
    num_tokens = x.shape[0]
    ws_gate, ws_up, ws_down = shared
    token_rows = None
    if save:
        shared_preact = torch.empty(num_tokens, 2 * ws_gate.shape[0], dtype=torch.bfloat16,
                                    device=x.device)
        token_rows = torch.arange(num_tokens, dtype=torch.int32, device=x.device)
    rows = expert_mlp(x, ws_gate.unsqueeze(0), ws_up.unsqueeze(0), ws_down.unsqueeze(0),
                      *shared_tiles(num_tokens, x.device), options, timeline, shared=True,
                      preact_out=shared_preact if save else None, preact_slot=token_rows)
    return rows, shared_preact


def moe_forward_kernel(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                       config: MoKConfig | None = None, save: bool = False):
    """One-GPU MoE forward on mok_cute kernels (inputs validated by api.py) -> out [T, H];
    with ``save`` (training) -> (out, SavedForBackward): the same bits, and the bf16
    pre-activations kept for the backward."""
    from mok_cute.kernels import token_ops

    config = config or MoKConfig()
    unsupported = unsupported_shape_reason(x.shape[1], w_gate.shape[1], topk_idx.shape[1],
                                           None if shared is None else shared[0].shape[0],
                                           config.tile_m)
    if unsupported:
        if config.backend == "kernel" or save:
            raise ValueError(f"config.backend='kernel': {unsupported}")
        warnings.warn(f"mok_cute: running the PyTorch reference because {unsupported}",
                      stacklevel=3)
        from mok_cute import reference  # unchecked: api.py checked the inputs and ids
        return reference._forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, None)
    recorder = None
    if config.timeline:
        from mok_cute.timeline import TimelineBuffer
        recorder = TimelineBuffer(config.timeline_capacity, device=x.device)
    timeline = recorder.tensor if recorder is not None else None
    num_tokens, top_k = topk_idx.shape
    inter = w_gate.shape[1]
    options = config.expert_path
    sched, row_of_slot, x_rows = expert_rows(x, topk_idx, w_gate.shape[0])
    preact, row_slot = preact_by_slot(sched, num_tokens, top_k, inter, x.device) if save \
        else (None, None)
    y = expert_mlp(x_rows, w_gate, w_up, w_down, sched.tile_expert, sched.num_tiles, options,
                   timeline, preact_out=preact, preact_slot=row_slot,
                   rows_per_expert=num_tokens * top_k / w_gate.shape[0])

    shared_rows, shared_preact = shared_forward(x, shared, options, timeline, save)

    # the k-sum reads each (token, k) expert row where FC2 left it: no permuted copy of y
    out = token_ops.weighted_ksum(y, topk_weights, shared_rows, row_index=row_of_slot)
    if recorder is not None:
        from mok_cute.timeline import set_last
        set_last(recorder)
    if not save:
        return out
    return out, SavedForBackward(preact, shared_preact, row_slot, row_of_slot, sched.tile_expert,
                                 sched.num_tiles, sched.expert_offsets)
