"""The training paths as PyTorch custom ops: autograd, torch.compile, CUDA graphs.

One GPU:
    mok_cute::moe_forward_train   the forward (``expert_path.moe_forward_kernel(save=True)``,
                                  ``expert_path_fp8.moe_forward_fp8`` for precision "fp8", or
                                  ``megakernel.training_forward`` for backend "megakernel"):
                                  out and the tensors the backward needs
    mok_cute::moe_backward        every gradient (``expert_backward.moe_backward``; backend
                                  "megakernel": its routed dgrads in one backward-megakernel
                                  launch, ``megakernel_backward``)
Virtual ranks (``moe_forward_virtual``, R ranks on one GPU), custom ops too:
    mok_cute::moe_forward_virtual_train   ``megakernel.moe_forward_virtual(save=True)``: out
                                  [R, T, H] and ``virtual_backward.VirtualSaved``
    mok_cute::moe_backward_virtual        every gradient (``virtual_backward``: every rank's
                                  routed experts in one backward-megakernel launch)

Over a process group (``moe_forward(group=...)``, one process per GPU): a
``torch.autograd.Function`` (a process group cannot cross a custom op; the api runs the group
call eagerly under torch.compile, a graph break): ``megakernel.moe_forward(save=True)``, then
``group_backward``.

The custom ops have exact fake (meta) implementations, so ``torch.compile(fullgraph=True)`` traces a
model through them without a graph break; ``register_autograd`` ties them together, honouring
``needs_input_grad`` (frozen experts skip their weight gradients, a frozen input skips d_x).
Neither synchronises with the host except the id range check (``check_ids``), which a
CUDA-graph capture must turn off.
"""

from __future__ import annotations

from typing import Optional

import torch

from mok_cute.constants import TILE_M
from mok_cute.schedule import saved_preact_rows, schedule_capacity

_SAVED = 7  # tensors of expert_path.SavedForBackward
_VIRTUAL_SAVED = 9  # tensors of virtual_backward.VirtualSaved


@torch.library.custom_op("mok_cute::moe_forward_train", mutates_args=())
def moe_forward_train(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      ws_gate: Optional[torch.Tensor], ws_up: Optional[torch.Tensor],
                      ws_down: Optional[torch.Tensor], check_ids: bool, fc2_pingpong_max_k: int,
                      fc1_group_m: int, fc2_group_m: int, precision: str,
                      backend: str) -> list[torch.Tensor]:
    """[out, *SavedForBackward]: the training forward on the kernels (inputs checked by
    ``mok_cute.api``), bf16 or FP8 (``expert_path_fp8``) by ``precision``; ``backend``
    "megakernel": through the megakernel at one rank (default megakernel options; its
    saved rows are the expert path's, bitwise)."""
    from mok_cute.config import ExpertPathOptions, MoKConfig, PendingIdCheck
    from mok_cute.expert_path import moe_forward_kernel
    from mok_cute.expert_path_fp8 import moe_forward_fp8

    shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
    config = MoKConfig(backend="kernel", precision=precision, expert_path=ExpertPathOptions(
        fc2_pingpong_max_k, fc1_group_m, fc2_group_m))
    pending = PendingIdCheck(topk_idx, w_gate.shape[0]) if check_ids else None
    if backend == "megakernel":
        from mok_cute import megakernel

        out, saved = megakernel.training_forward(
            x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
            MoKConfig(backend="megakernel", check_ids=False, precision=precision))
    else:
        forward = moe_forward_fp8 if precision == "fp8" else moe_forward_kernel
        out, saved = forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config,
                             save=True)
    if pending is not None:
        pending.finish()
        if backend == "megakernel":
            megakernel.raise_pending_errors()  # the same sync point: no extra wait
    return [out, *saved]


@moe_forward_train.register_fake
def _(x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, check_ids,
      fc2_pingpong_max_k, fc1_group_m, fc2_group_m, precision, backend):
    num_tokens, top_k = topk_idx.shape  # the megakernel at one rank: the same schedule
    experts, inter = w_gate.shape[0], w_gate.shape[1]  # g | u at I in both precisions
    rows = schedule_capacity(1, num_tokens, top_k, experts, TILE_M)
    i32 = dict(dtype=torch.int32, device=x.device)
    shared_preact = (x.new_empty(0, 0) if ws_gate is None
                     else x.new_empty(num_tokens, 2 * ws_gate.shape[0]))
    return [x.new_empty(num_tokens, x.shape[1]), x.new_empty(num_tokens * top_k, 2 * inter),
            shared_preact,
            torch.empty(rows, **i32), torch.empty(num_tokens * top_k, **i32),
            torch.empty(rows // TILE_M, **i32), torch.empty(1, **i32),
            torch.empty(experts + 1, **i32)]


@torch.library.custom_op("mok_cute::moe_backward", mutates_args=())
def moe_backward(d_out: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, ws_gate: Optional[torch.Tensor],
                 ws_up: Optional[torch.Tensor], ws_down: Optional[torch.Tensor],
                 saved: list[torch.Tensor], needs: list[bool], fc2_pingpong_max_k: int,
                 fc1_group_m: int, fc2_group_m: int, precision: str,
                 backend: str) -> list[torch.Tensor]:
    """[d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down]; an
    empty tensor where ``needs`` (expert_backward.Needs order) says no."""
    from mok_cute.config import ExpertPathOptions
    from mok_cute.expert_backward import Needs, moe_backward as backward
    from mok_cute.expert_path import SavedForBackward

    shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
    grads = backward(d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                     SavedForBackward(*saved), Needs(*needs),
                     ExpertPathOptions(fc2_pingpong_max_k, fc1_group_m, fc2_group_m), precision,
                     # FP8's dgrads run on the FP8 kernels (the backward megakernel is bf16)
                     dgrads="megakernel" if backend == "megakernel" and precision == "bf16"
                     else "kernels")
    return [x.new_empty(0) if g is None else g for g in grads]


@moe_backward.register_fake
def _(d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, saved,
      needs, fc2_pingpong_max_k, fc1_group_m, fc2_group_m, precision, backend):
    return _fake_grads(needs, x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)


def _fake_grads(needs, x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    """A backward op's fake outputs: each gradient like its input where ``needs`` (the
    ``expert_backward.Needs`` order) wants it, else an empty tensor."""
    want_x, want_w, want_gu, want_down, want_sgu, want_sdown = needs
    shared = ws_gate is not None
    like = lambda t, want: torch.empty_like(t) if want else x.new_empty(0)  # noqa: E731
    return [like(x, want_x), like(topk_weights, want_w), like(w_gate, want_gu),
            like(w_up, want_gu), like(w_down, want_down),
            like(ws_gate, shared and want_sgu) if shared else x.new_empty(0),
            like(ws_up, shared and want_sgu) if shared else x.new_empty(0),
            like(ws_down, shared and want_sdown) if shared else x.new_empty(0)]


def _needs(ctx) -> list[bool]:
    """``expert_backward.Needs`` from a forward op's needs_input_grad (its inputs: x, ids,
    topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, ...)."""
    need = ctx.needs_input_grad
    return [need[0], need[2], need[3] or need[4], need[5],
            ctx.has_shared and (need[6] or need[7]), ctx.has_shared and need[8]]


def _wanted(ctx, grads) -> list:
    """The backward op's eight gradients, None where autograd asked for none."""
    need = ctx.needs_input_grad
    wanted = (need[0], need[2], need[3], need[4], need[5], need[6], need[7], need[8])
    return [g if w else None for g, w in zip(grads, wanted)]


def _setup_context(ctx, inputs, output):
    (x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, _check_ids,
     fc2_pingpong_max_k, fc1_group_m, fc2_group_m, precision, backend) = inputs
    ctx.options = (fc2_pingpong_max_k, fc1_group_m, fc2_group_m, precision, backend)
    ctx.has_shared = ws_gate is not None
    shared = (ws_gate, ws_up, ws_down) if ctx.has_shared else ()
    ctx.save_for_backward(x, topk_idx, topk_weights, w_gate, w_up, w_down, *shared,
                          *output[1:1 + _SAVED])


def _backward(ctx, grads):
    d_out = grads[0]
    x, topk_idx, topk_weights, w_gate, w_up, w_down, *rest = ctx.saved_tensors
    shared = tuple(rest[:3]) if ctx.has_shared else (None, None, None)
    saved = list(rest[3:] if ctx.has_shared else rest)
    needs = _needs(ctx)
    if not any(needs) or d_out is None:
        return (None,) * 15
    grads = torch.ops.mok_cute.moe_backward(
        d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, *shared, saved, needs,
        *ctx.options)
    d_x, d_w, *d_weights = _wanted(ctx, grads)
    return (d_x, None, d_w, *d_weights, None, None, None, None, None, None)


moe_forward_train.register_autograd(_backward, setup_context=_setup_context)


def moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config):
    """The differentiable one-GPU forward on the kernels -> out [T, H] (``api.moe_forward``
    takes this path when an input requires grad): the expert path, or with
    ``config.backend == "megakernel"`` the megakernel at one rank."""
    ws = tuple(shared) if shared is not None else (None, None, None)
    options = config.expert_path
    outs = torch.ops.mok_cute.moe_forward_train(
        x, topk_idx, topk_weights, w_gate, w_up, w_down, *ws, config.check_ids,
        options.fc2_pingpong_max_k, options.fc1_group_m, options.fc2_group_m, config.precision,
        "megakernel" if config.backend == "megakernel" else "kernel")
    return outs[0]


# ------------------------------------------------------------------------- virtual ranks
def _launch_fields(config) -> list[int]:
    """The megakernel's sizes and options of ``config`` as the custom op's int list (-1:
    None): tile_m, num_comm_sms, minibatch_tokens, ring_tokens, timeline, timeline_capacity,
    rows_in_place, tickets (index into TICKET_MODES), fc1_lead, fp8 (precision)."""
    from mok_cute.config import TICKET_MODES

    none = lambda v: -1 if v is None else int(v)  # noqa: E731
    m = config.megakernel
    return [config.tile_m, none(config.num_comm_sms), none(config.minibatch_tokens),
            none(config.ring_tokens), int(config.timeline), config.timeline_capacity,
            int(m.rows_in_place), -1 if m.tickets is None else TICKET_MODES.index(m.tickets),
            none(m.fc1_lead), int(config.precision == "fp8")]


def _launch_config(fields: list[int], timeout_ms: float):
    """The MoKConfig of ``_launch_fields`` (ids already checked by the op)."""
    from mok_cute.config import TICKET_MODES, MegakernelOptions, MoKConfig

    (tile_m, comm, minibatch, ring, timeline, capacity, in_place, tickets, lead, fp8) = fields
    some = lambda v: None if v < 0 else v  # noqa: E731
    return MoKConfig(tile_m=tile_m, num_comm_sms=some(comm), minibatch_tokens=some(minibatch),
                     ring_tokens=some(ring), timeline=bool(timeline), timeline_capacity=capacity,
                     timeout_ms=timeout_ms, backend="megakernel", check_ids=False,
                     precision="fp8" if fp8 else "bf16",
                     megakernel=MegakernelOptions(bool(in_place), None if tickets < 0
                                                  else TICKET_MODES[tickets], some(lead)))


@torch.library.custom_op("mok_cute::moe_forward_virtual_train", mutates_args=())
def moe_forward_virtual_train(xs: torch.Tensor, topk_idx: torch.Tensor,
                              topk_weights: torch.Tensor, w_gate: torch.Tensor,
                              w_up: torch.Tensor, w_down: torch.Tensor,
                              ws_gate: Optional[torch.Tensor], ws_up: Optional[torch.Tensor],
                              ws_down: Optional[torch.Tensor], check_ids: bool,
                              launch: list[int], timeout_ms: float,
                              expert_path: list[int]) -> list[torch.Tensor]:
    """[out, *VirtualSaved]: the training forward of R virtual ranks through the megakernel
    (inputs checked by ``mok_cute.api``; ``launch``: ``_launch_fields``; ``expert_path``: the
    ExpertPathOptions the backward's shared expert runs with, unused here)."""
    from mok_cute import megakernel
    from mok_cute.config import PendingIdCheck
    from mok_cute.virtual_backward import VirtualSaved

    shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
    num_experts = w_gate.shape[0] * w_gate.shape[1]
    pending = PendingIdCheck(topk_idx, num_experts) if check_ids else None
    out, saved = megakernel.moe_forward_virtual(xs, topk_idx, topk_weights, w_gate, w_up,
                                                w_down, shared,
                                                _launch_config(launch, timeout_ms), save=True)
    if pending is not None:
        pending.finish()
        megakernel.raise_pending_errors()  # the same sync point: no extra wait
    return [out, *VirtualSaved.from_forward(saved)]


@moe_forward_virtual_train.register_fake
def _(xs, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, check_ids,
      launch, timeout_ms, expert_path):
    R, T, K = topk_idx.shape
    experts, inter = w_gate.shape[1], w_gate.shape[2]
    cap = schedule_capacity(R, T, K, experts, TILE_M)
    rows = saved_preact_rows(R, R, T, K, experts, TILE_M)  # one pool for the R ranks
    i32 = dict(dtype=torch.int32, device=xs.device)
    shared_preact = (xs.new_empty(0) if ws_gate is None
                     else xs.new_empty(R, T, 2 * ws_gate.shape[1]))
    return [xs.new_empty(R, T, xs.shape[2]), xs.new_empty(rows, 2 * inter), shared_preact,
            *(torch.empty(R, cap, **i32) for _ in range(4)),
            torch.empty(R, cap // TILE_M, **i32), torch.empty(R, **i32),
            torch.empty(R, experts + 1, **i32)]


@torch.library.custom_op("mok_cute::moe_backward_virtual", mutates_args=())
def moe_backward_virtual(d_out: torch.Tensor, xs: torch.Tensor, topk_weights: torch.Tensor,
                         w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                         ws_gate: Optional[torch.Tensor], ws_up: Optional[torch.Tensor],
                         ws_down: Optional[torch.Tensor], saved: list[torch.Tensor],
                         needs: list[bool], expert_path: list[int],
                         precision: str) -> list[torch.Tensor]:
    """[d_xs, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down] of
    R virtual ranks (``virtual_backward.moe_backward_virtual``); an empty tensor where
    ``needs`` (expert_backward.Needs order) says no."""
    from mok_cute.config import ExpertPathOptions
    from mok_cute.expert_backward import Needs
    from mok_cute.virtual_backward import VirtualSaved, moe_backward_virtual as backward

    shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
    grads = backward(d_out, xs, topk_weights, w_gate, w_up, w_down, shared,
                     VirtualSaved(*saved), Needs(*needs), ExpertPathOptions(*expert_path),
                     precision)
    return [xs.new_empty(0) if g is None else g for g in grads]


@moe_backward_virtual.register_fake
def _(d_out, xs, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, saved, needs,
      expert_path, precision):
    return _fake_grads(needs, xs, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)


def _setup_context_virtual(ctx, inputs, output):
    (xs, _topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, _check_ids,
     launch, _timeout_ms, expert_path) = inputs
    ctx.expert_path = list(expert_path)
    ctx.precision = "fp8" if launch[-1] else "bf16"  # _launch_fields' last
    ctx.has_shared = ws_gate is not None
    shared = (ws_gate, ws_up, ws_down) if ctx.has_shared else ()
    ctx.save_for_backward(xs, topk_weights, w_gate, w_up, w_down, *shared,
                          *output[1:1 + _VIRTUAL_SAVED])


def _backward_virtual(ctx, grads):
    d_out = grads[0]
    xs, topk_weights, w_gate, w_up, w_down, *rest = ctx.saved_tensors
    shared = tuple(rest[:3]) if ctx.has_shared else (None, None, None)
    saved = list(rest[3:] if ctx.has_shared else rest)
    needs = _needs(ctx)
    if not any(needs) or d_out is None:
        return (None,) * 13
    grads = torch.ops.mok_cute.moe_backward_virtual(
        d_out, xs, topk_weights, w_gate, w_up, w_down, *shared, saved, needs, ctx.expert_path,
        ctx.precision)
    d_x, d_w, *d_weights = _wanted(ctx, grads)
    return (d_x, None, d_w, *d_weights, None, None, None, None)


moe_forward_virtual_train.register_autograd(_backward_virtual,
                                            setup_context=_setup_context_virtual)


def moe_forward_virtual(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config):
    """The differentiable forward of R virtual ranks on the megakernel -> out [R, T, H]
    (``api.moe_forward_virtual`` takes this path when an input requires grad): the saving
    launch, then ``virtual_backward`` (one backward-megakernel launch for all ranks' routed
    experts). Custom ops, not a ``torch.autograd.Function``: torch.compile traces them whole."""
    ws = tuple(shared) if shared is not None else (None, None, None)
    options = config.expert_path
    outs = torch.ops.mok_cute.moe_forward_virtual_train(
        xs, topk_idx, topk_weights, w_gate, w_up, w_down, *ws, config.check_ids,
        _launch_fields(config), float(config.timeout_ms),
        [options.fc2_pingpong_max_k, options.fc1_group_m, options.fc2_group_m])
    return outs[0]


# ------------------------------------------------------------------------- a process group
class _GroupTrain(torch.autograd.Function):
    """This rank's saving megakernel launch over ``group`` (bf16 or FP8, by the config); its
    backward is ``group_backward.moe_backward_group`` (a collective: every rank runs it; the
    plan's precision picks its dgrads)."""

    @staticmethod
    def forward(ctx, x, ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                config, group, mean_tokens):
        from mok_cute import megakernel

        shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
        out, saved = megakernel.moe_forward(x, ids, topk_weights, w_gate, w_up, w_down, shared,
                                            config, group=group, save=True)
        ctx.has_shared = shared is not None
        ctx.options = config.expert_path
        ctx.comm_sms = config.megakernel.backward_comm_sms
        ctx.mean_tokens = mean_tokens
        # SavedPreact: its tensors, this call's schedules and the plan; kept for every backward
        # of the graph (retain_graph runs it again) and freed with it
        ctx.saved = saved
        ctx.save_for_backward(x, ids, topk_weights, w_gate, w_up, w_down, *(shared or ()))
        return out

    @staticmethod
    def backward(ctx, d_out):
        from mok_cute.group_backward import moe_backward_group
        from mok_cute.expert_backward import Needs

        x, ids, topk_weights, w_gate, w_up, w_down, *shared = ctx.saved_tensors
        saved = ctx.saved
        one = lambda t: None if t is None else t.unsqueeze(0)  # noqa: E731  the launch's rank
        stacked = saved._replace(row_slot=one(saved.row_slot),
                                 shared_preact=one(saved.shared_preact))
        needs = Needs(*_needs(ctx))
        grads = moe_backward_group(
            one(d_out.contiguous()), one(x), one(ids), one(topk_weights), one(w_gate),
            one(w_up), one(w_down), tuple(one(w) for w in shared) if shared else None, stacked,
            needs, ctx.options, tokens_per_rank=ctx.mean_tokens, comm_sms=ctx.comm_sms)
        d_x, d_w, *d_weights = _wanted(ctx, [None if t is None else t[0] for t in grads])
        return (d_x, None, d_w, *d_weights, None, None, None)


def moe_forward_group(x, ids, topk_weights, w_gate, w_up, w_down, shared, config, group,
                      mean_tokens: float | None = None):
    """The differentiable forward of this rank of ``group`` on the IPC megakernel -> out
    [T, H] (inputs padded to the plan's T by ``api``; ids int32). ``mean_tokens``: the
    ranks' mean T before that padding (the backward's ``tokens_per_rank``; None: the plan's)."""
    ws = tuple(shared) if shared is not None else (None, None, None)
    return _GroupTrain.apply(x, ids, topk_weights, w_gate, w_up, w_down, *ws, config, group,
                             mean_tokens)
