"""The one-GPU kernel path: torch tensors in, mok_cute kernels launched, torch tensors out.

    x --gather_rows--> x_sorted --FC1 (swiglu)--> h --FC2 (store)--> y --k-sum--> out
                                   shared expert: x --FC1--> hs --FC2--> s ---^

Every step runs on the stream of the current torch device with no host sync: the receive
schedule (torch ops) keeps counts in device memory and the GEMMs read the M-tile count and
tile -> expert table from there.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import torch

from mok_cute import jit
from mok_cute.config import MoKConfig, experimental_setting, experimental_switch

TILE_M = 128
# x into expert order token-major (token_ops.scatter_rows: each x row read once, written to
# its K rows) instead of the gather (each of the K rows reads its x row). Why: x does not fit
# in L2 on dsv3_ep8_rank (59 MB) or sonic_120b (268 MB), so the gather reads every row K times
# from HBM: 0.94 GB for dsv3 (0.24 ms measured, run 47), where the scatter moves 0.53 GB.
# Predicted: dsv3 -0.1 ms, sonic_120b -0.18 ms. Padding rows are left unwritten (their FC1 /
# FC2 rows are never read). Measured (run 64, 4 alternating rounds, best / median, gather ->
# scatter): dsv3 4.50 / 4.97 -> 4.38 / 4.77 ms, sonic 10.40 / 10.89 -> 9.99 / 10.79, qwen3
# 2.22 / 2.38 -> 2.21 / 2.26, mixtral (x fits in L2) level, gptoss 3.30 / 3.56 -> 3.45 / 3.51;
# bitwise equal everywhere, so on. MOK_SCATTER_X=0 puts the gather back.
SCATTER_X = experimental_switch("SCATTER_X", True)
# FC2 on the pingpong GEMM (128-wide tiles, the two consumer warpgroups alternating tiles so
# one's epilogue hides behind the other's mainloop), where FC2's K (the expert's intermediate
# size) is short enough for the epilogue to matter. Measured on the H200 (fifth session,
# tools/gemm_probe.py): qwen3 FC2 (K 768) 0.730 -> 0.667 ms, gptoss (K 2880) 0.962 -> 0.891,
# dsv3 (K 2048) level, mixtral (K 14336) 2.504 -> 2.763: slower, so the long-K shapes stay
# cooperative. MOK_FC2_PINGPONG=0 turns it off everywhere.
FC2_PINGPONG = experimental_switch("FC2_PINGPONG", True)
# The cooperative GEMMs (FC1 everywhere, FC2 with a long K) in clusters of two CTAs on M-tiles
# 2i and 2i + 1 that multicast the shared B tile (gemm_sm90's cluster_m). Why: B is 32 of
# FC1's 48 KB per k-tile, and cuBLAS's Hopper kernels use clusters. Measured in the tenth
# session, bitwise equal everywhere. Against plain kernels that still launched with a 1x1x1
# cluster attribute (run 75, 6 interleaved rounds of the GEMMs alone, median ratio cluster /
# plain), FC1 came out at: dsv3 (K 7168) 0.993, sonic_120b (K 4096) 0.986, mixtral
# (K 4096) 0.946, gptoss (K 2880) 1.027, qwen3 (K 2048) 1.022. Against the fixed plain
# launch (run 78): FC1 alone dsv3 3.055 against 3.013 ms. Layer without / with clusters
# where K >= GEMM_CLUSTER_MIN_K: dsv3 0.996, sonic 1.007, mixtral 0.979. No gain shown, so
# off. MOK_GEMM_CLUSTER_M: 0 = clusters where K >= GEMM_CLUSTER_MIN_K, 1 = never (default),
# 2 = always.
GEMM_CLUSTER_M = experimental_setting("GEMM_CLUSTER_M", 1, 0, 2)
GEMM_CLUSTER_MIN_K = 4096
# M-tiles per raster group of the expert path's FC1 and FC2 (common.grouped_raster): the
# CTAs running together share the B tiles of one group, so the group size sets how often an
# expert's weights stream from HBM again. 8 was the first choice, never swept until the
# twentieth session. MOK_FC1_GROUP_M / MOK_FC2_GROUP_M override them.
FC1_GROUP_M = experimental_setting("FC1_GROUP_M", 8, 1, 64)
FC2_GROUP_M = experimental_setting("FC2_GROUP_M", 8, 1, 64)
# One named barrier per epilogue subtile instead of two (gemm_sm90.store_tile_epilogue's
# one_barrier; the megakernel has its own megakernel.ONE_EPILOGUE_BARRIER, same env variable).
# Why: the recorded one-rank calls (run 96) put the megakernel's 128 x 256 FC2 tile 8 % behind
# the expert path's pingpong FC2 per FLOP (dsv3: 24.86 us per tile against 2 x 11.49), where
# the tensor cores wait out the cooperative epilogue: 8 subtiles, each two 256-thread
# barriers, the second behind the store warp's wait on an earlier store. Predicted: 0.1-0.15 us
# per subtile, up to 1 us of a 24 us FC2 tile (-1 to -1.5 % of the layer on dsv3), less on the
# FC1 tiles (4 subtiles). Written in the thirteenth session: MOK_ONE_EPILOGUE_BARRIER=1.
ONE_EPILOGUE_BARRIER = experimental_switch("ONE_EPILOGUE_BARRIER", False)
# Columns of a cooperative GEMM's epilogue subtile (gemm_sm90's epi_n): 64 stores a 128 x 256
# tile in 4 subtiles of 128 x 64 through two 16 KB buffers instead of 8 of 128 x 32 through
# four, half the proxy fences, barriers and TMA stores (the megakernel's
# megakernel.WIDE_EPILOGUE is the same change). Why: the cooperative epilogue is where the
# tensor cores wait (qwen3 in the megakernel: 1.41 us per FC2 tile, 1.82 per FC1 tile,
# sixteenth and seventeenth sessions), and its barriers alone were not the cost
# (ONE_EPILOGUE_BARRIER level). Measured (seventeenth session, run 130, 6 interleaved rounds,
# paired against 32, bitwise equal): qwen3 1.001, mixtral 1.002, dsv3 1.022, gptoss 1.004,
# sonic 1.012: level or slower, so 32. MOK_EPILOGUE_N=64.
EPILOGUE_N = experimental_setting("EPILOGUE_N", 32, 32, 64)
if EPILOGUE_N not in (32, 64):
    raise ValueError(f"MOK_EPILOGUE_N: expected 32 or 64, got {EPILOGUE_N}")


def gemm_cluster_m(k: int, pingpong: bool, recorded: bool) -> int:
    """CTAs per cluster for a grouped GEMM with reduction size ``k``: 2 for the cooperative
    kernel without the recorder where K is long enough (``GEMM_CLUSTER_M``), else 1."""
    if pingpong or recorded or GEMM_CLUSTER_M == 1:
        return 1
    return 2 if GEMM_CLUSTER_M == 2 or k >= GEMM_CLUSTER_MIN_K else 1


FC2_PINGPONG_MAX_K = 8192
# The weighted k-sum fused into the pingpong FC2's epilogue (gemm_sm90's ksum_top_k): the tile
# that brings a (token, N-tile) counter to K sums that token's K y rows, in the k-sum kernel's
# order and roundings, so out is the same bits. Why: the k-sum kernel runs alone after FC2
# with the tensor cores idle (dsv3 ~0.17 ms, sonic ~0.3 ms, of 5 and 11 ms), and a pingpong
# warpgroup's epilogue overlaps the other one's mainloop (dsv3 ~13 us against ~4 us of
# epilogue). Predicted: up to -3 % on dsv3 and sonic if the sums stay hidden; qwen3's 5 us
# FC2 mainloop may not hide them. Without the shared expert only (its rows would have to be
# ready first). Measured (nineteenth session, bitwise equal everywhere): slower on every
# shape, sustained dsv3 1.026, sonic 1.074, qwen3 1.094, gptoss 1.046 (run 152). Built in
# stages (gemm_sm90.KSUM_STAGES, tools/ksum_fc2_probe.py, runs 153-154) the counting costs
# little (no k-sum at all: dsv3 0.973-0.984, sonic 0.92-0.95; with the counts 0.98, 0.92-0.97)
# and the sums the rest: they hold the warpgroup past its next mainloop turn. Off.
# MOK_KSUM_IN_FC2=1.
KSUM_IN_FC2 = experimental_switch("KSUM_IN_FC2", False)
# With KSUM_IN_FC2: count and sum a tile's rows one tile later (gemm_sm90's ksum_deferred),
# when its stores have landed, instead of waiting for them in its own epilogue. Measured
# (run 154): dsv3 1.017, sonic 1.015, qwen3 1.090, gptoss 1.071 of the expert path. Off.
KSUM_IN_FC2_DEFERRED = experimental_switch("KSUM_IN_FC2_DEFERRED", False)


def fc2_pingpong(inter: int) -> bool:
    """Whether FC2 with intermediate size ``inter`` (its K) runs on the pingpong GEMM."""
    return FC2_PINGPONG and inter <= FC2_PINGPONG_MAX_K


def ksum_in_fc2(inter: int, has_shared: bool) -> bool:
    """Whether the k-sum runs in FC2's epilogue (``KSUM_IN_FC2``) for this layer."""
    return KSUM_IN_FC2 and fc2_pingpong(inter) and not has_shared


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


@functools.lru_cache(maxsize=None)
def _persistent_grid(device_index: int, cluster_m: int) -> int:
    """CTAs of a persistent GEMM: one per SM, or with clusters of ``cluster_m`` CTAs as many
    whole clusters as can be co-resident (a cluster needs its SMs in one GPC; a cluster that
    did not fit would run after the others, a second wave)."""
    if cluster_m == 1:
        return _num_sms(device_index)
    from cutlass.utils import HardwareInfo

    torch.cuda.synchronize(device_index)  # the occupancy query needs the device's context current
    return cluster_m * HardwareInfo(device_index).get_max_active_clusters(cluster_m)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, tile_expert: torch.Tensor,
                 num_m_tiles: torch.Tensor, epilogue: str = "store", tile_n: int | None = None,
                 group_m: int = 8, out: torch.Tensor | None = None,
                 timeline: torch.Tensor | None = None, task_type: int | None = None,
                 w_up: torch.Tensor | None = None, pingpong: bool = False,
                 ksum: tuple | None = None) -> torch.Tensor:
    """C = epilogue(A @ W[expert(m)]^T) over 128-row M-tiles; see kernels/gemm_sm90.py.

    a: [M, K] bf16; w: [E, N, K] bf16; tile_expert: [>= ceil(M/128)] int32;
    num_m_tiles: [1] int32 (device). "store" returns [M, N]; "swiglu" takes w = W_gate and
    w_up = W_up (both [E, I, K]) and returns silu(A Wg^T) * (A Wu^T), [M, I].
    Rows past num_m_tiles*128 are untouched.
    timeline: int64 recorder buffer (``mok_cute.timeline.TimelineBuffer.tensor``) to record
    one span per tile with ``task_type``; None compiles the variant without the recorder.
    ksum: (row_token, slot_rows, fp32 weights [T*K], zeroed counters [T * N-tiles], out [T, N],
    K) to fuse the weighted k-sum into the pingpong store epilogue (``KSUM_IN_FC2``).
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
    cluster_m = gemm_cluster_m(k, pingpong, timeline is not None)
    compiled = jit.compile_kernel(
        "gemm_fc1" if epilogue == "swiglu" else "gemm_fc2", jit.device_arch(a.device),
        tile_n=tile_n, group_m=group_m, num_sms=_persistent_grid(a.device.index or 0, cluster_m),
        timeline=timeline is not None, task_type=task_type if timeline is not None else None,
        pingpong=pingpong, cluster_m=cluster_m, one_epilogue_barrier=ONE_EPILOGUE_BARRIER,
        epi_n=32 if pingpong else EPILOGUE_N, ksum_top_k=0 if ksum is None else ksum[5],
        ksum_stages=gemm_sm90.KSUM_STAGES if ksum is not None else 3,
        ksum_deferred=ksum is not None and KSUM_IN_FC2_DEFERRED)
    compiled(a.unsqueeze(2), w.permute(1, 2, 0),
             None if w_up is None else w_up.permute(1, 2, 0),
             out.unsqueeze(2), tile_expert, num_m_tiles, timeline,
             *((None,) * 5 if ksum is None else ksum[:5]))
    return out


def expert_mlp(x_rows: torch.Tensor, w_gate, w_up, w_down, tile_expert, num_m_tiles,
               timeline: torch.Tensor | None = None, shared: bool = False,
               ksum: tuple | None = None):
    """FC1 (gate+up, SwiGLU) then FC2 over tile-padded rows grouped by expert (``ksum``:
    ``grouped_gemm``'s, for FC2)."""
    from mok_cute.timeline import TaskType
    fc1, fc2 = (TaskType.SHARED_FC1, TaskType.SHARED_FC2) if shared else (TaskType.FC1, TaskType.FC2)
    h = grouped_gemm(x_rows, w_gate, tile_expert, num_m_tiles, "swiglu", w_up=w_up,
                     group_m=FC1_GROUP_M, timeline=timeline, task_type=int(fc1))
    pingpong = fc2_pingpong(w_down.shape[2])
    return grouped_gemm(h, w_down, tile_expert, num_m_tiles, "store", group_m=FC2_GROUP_M,
                        timeline=timeline,
                        task_type=int(fc2), pingpong=pingpong, tile_n=128 if pingpong else None,
                        ksum=ksum)


# ---------------------------------------------------------------------- the layer
MAX_TOP_K = 16  # WeightedKSum unrolls K at compile time


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
    tile-padded (``SCATTER_X``: scattered, padding rows left as allocated; else gathered)."""
    from mok_cute import schedule as sched_mod
    from mok_cute.kernels import token_ops

    num_tokens, top_k = topk_idx.shape
    # api.py checks the ids (its device read is waited for after these launches) or the
    # caller vouches for them (check_ids=False): the schedule skips its own host read
    sched = sched_mod.build_receive_schedule(topk_idx.unsqueeze(0), 0, num_experts,
                                             tile_m=TILE_M, validate=False)
    row_of_slot = sched_mod.row_of_slot(sched, num_tokens, top_k)
    if SCATTER_X:
        x_rows = torch.empty((sched.row_token.shape[0], x.shape[1]), dtype=x.dtype,
                             device=x.device)
        token_ops.scatter_rows(x, row_of_slot, x_rows)
    else:
        x_rows = token_ops.gather_rows(x, sched.row_token)
    return sched, row_of_slot, x_rows


def moe_forward_kernel(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                       config: MoKConfig | None = None) -> torch.Tensor:
    """One-GPU MoE forward on mok_cute kernels. Inputs are already validated by api.py."""
    from mok_cute.kernels import token_ops

    config = config or MoKConfig()
    unsupported = unsupported_shape_reason(x.shape[1], w_gate.shape[1], topk_idx.shape[1],
                                           None if shared is None else shared[0].shape[0],
                                           config.tile_m)
    if unsupported:
        if config.backend == "kernel":
            raise ValueError(f"config.backend='kernel': {unsupported}")
        warnings.warn(f"mok_cute: running the PyTorch reference because {unsupported}",
                      stacklevel=3)
        from mok_cute import reference
        return reference.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared)
    recorder = None
    if config.timeline:
        from mok_cute.timeline import TimelineBuffer
        recorder = TimelineBuffer(config.timeline_capacity, device=x.device)
    timeline = recorder.tensor if recorder is not None else None
    num_tokens, top_k = topk_idx.shape
    sched, row_of_slot, x_rows = expert_rows(x, topk_idx, w_gate.shape[0])
    fused_ksum = None
    if ksum_in_fc2(w_down.shape[2], shared is not None):
        hidden = x.shape[1]
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=x.device)
        n_tiles = -(-hidden // token_ops.LAST_ARRIVER_TILE_N)
        counters = torch.zeros(num_tokens * n_tiles, dtype=torch.int32, device=x.device)
        weights = topk_weights.to(torch.float32).contiguous().view(-1)
        fused_ksum = (sched.row_token, row_of_slot, weights, counters, out, top_k)
    y = expert_mlp(x_rows, w_gate, w_up, w_down, sched.tile_expert, sched.num_tiles, timeline,
                   ksum=fused_ksum)

    shared_rows = None
    if shared is not None:
        ws_gate, ws_up, ws_down = shared
        n_tiles = (num_tokens + TILE_M - 1) // TILE_M
        zeros = torch.zeros(n_tiles, dtype=torch.int32, device=x.device)
        count = torch.full((1,), n_tiles, dtype=torch.int32, device=x.device)
        shared_rows = expert_mlp(x, ws_gate.unsqueeze(0), ws_up.unsqueeze(0),
                                 ws_down.unsqueeze(0), zeros, count, timeline, shared=True)

    # the k-sum reads each (token, k) expert row where FC2 left it: no permuted copy of y
    # (with fused_ksum FC2's last arriving tiles have written out already)
    if fused_ksum is None:
        out = token_ops.weighted_ksum(y, topk_weights, shared_rows, row_index=row_of_slot)
    if recorder is not None:
        from mok_cute.timeline import set_last
        set_last(recorder)
    return out
