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

Fused weight-gradient accumulation (``MoKConfig(fuse_wgrad_accumulation=True)``, Megatron's
``main_grad``): the forward ops take each weight's fp32 buffer (``MainGradTargets``, read and
checked by ``mok_cute.api``) as an extra input they do not use; the backward ops take them again,
add the weight gradients into them (``mutates_args``) and return an empty tensor for those
weights, which then get None (or Megatron's dummy, ``dummy_mode``). The buffers are kept on the
autograd context as attributes, not ``save_for_backward``: a buffer is added into by every
backward, so a second call in flight (pipeline micro-batches, a layer called twice in one
graph, ``retain_graph``) would trip autograd's version check on a saved one. Under
torch.compile, AOT autograd saves the buffer with that check all the same: there one backward
at a time may be pending per buffer: an earlier call's backward then raises torch's
"modified by an inplace operation" error (its gradient is not added) rather than adding
anything silently wrong. The backward ops return fixed 8-tuples: a
custom op that mutates an ``Optional[Tensor]`` argument and returns ``list[Tensor]`` fails
functionalization (torch 2.13). ``reference_weights``: the same accumulation on the PyTorch
reference (no GPU).

``MoKConfig(timeline=True)``: the ops take the recorder's size (0: off) as a plain int; the
backward's one backward-megakernel launch records into a buffer of at least
``timeline.BACKWARD_CAPACITY`` records, which ``timeline.last()`` then holds (a backward of
launches, FP8's or one with a frozen weight, records nothing).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from mok_cute.constants import TILE_M
from mok_cute.schedule import saved_preact_rows, schedule_capacity

_SAVED = 7  # tensors of expert_path.SavedForBackward
_VIRTUAL_SAVED = 9  # tensors of virtual_backward.VirtualSaved

def _on_first_device(fn):
    """``config.on_first_arg_device`` for a custom op's implementation (torch.compile calls
    the ops directly, not through ``mok_cute.api``), written here: torch.library infers the
    op's schema from the annotations evaluated in the wrapper's module, this one."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        from mok_cute.config import on_device

        with on_device(args[0]):
            return fn(*args, **kwargs)
    return call


# ------------------------------------------------------------------------- main_grad
# the custom ops' main_grad arguments, in expert_backward.MainGrads order
_MAIN_GRAD_ARGS = ("main_grad_w_gate", "main_grad_w_up", "main_grad_w_down", "main_grad_ws_gate",
                   "main_grad_ws_up", "main_grad_ws_down")
_NO_MAIN_GRADS = (None,) * 6
# what a weight whose gradient went into its main_grad gets as its gradient (dummy_mode)
NO_DUMMY, EMPTY_DUMMY, ZERO_DUMMY = 0, 1, 2
Grads8 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
               torch.Tensor, torch.Tensor]


class MainGradTargets(NamedTuple):
    """Where a training call's weight gradients go (``MoKConfig(fuse_wgrad_accumulation=True)``),
    in ``expert_backward.MainGrads`` order (w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    ``main_grads`` each weight's fp32 ``main_grad`` (None: a frozen weight, or no shared expert:
    its gradient as usual); ``dummies`` what autograd then gets for that weight (``dummy_mode``)."""

    main_grads: tuple
    dummies: tuple


def dummy_mode(weight: torch.Tensor) -> int:
    """Megatron's convention: a weight with the attribute ``grad_added_to_main_grad`` (its DDP
    sets it False before each step) expects the backward that added into ``main_grad`` to set
    it True and return a dummy gradient (zeros with ``zero_out_wgrad``, else uninitialised):
    its DDP's gradient-ready hook asserts ``param.grad is not None`` under
    ``overlap_grad_reduce``, adds ``param.grad`` into ``main_grad`` only where the flag is
    False (or ``zero_out_wgrad``), then drops it. Without the attribute: None, ``.grad`` stays
    None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return NO_DUMMY
    return ZERO_DUMMY if getattr(weight, "zero_out_wgrad", False) else EMPTY_DUMMY


def mark_added_to_main_grad(weights, targets: MainGradTargets | None) -> None:
    """Set ``grad_added_to_main_grad`` on the weights that will get a dummy gradient. Done by
    the training forward (eager host code, traceable by torch.compile) rather than in the
    backward, whose custom-op code a compiled graph does not run as Python."""
    if targets is None:
        return
    for weight, dummy in zip(weights, targets.dummies):
        if dummy != NO_DUMMY:
            weight.grad_added_to_main_grad = True


def _dummy(weight: torch.Tensor, dummy: int) -> torch.Tensor | None:
    return _dummy_of((weight.shape, weight.dtype, weight.device), dummy)


def _dummy_of(like: tuple, dummy: int) -> torch.Tensor | None:
    """``_dummy`` of a weight known by (shape, dtype, device)."""
    if dummy == NO_DUMMY:
        return None
    shape, dtype, device = like
    make = torch.zeros if dummy == ZERO_DUMMY else torch.empty
    return make(shape, dtype=dtype, device=device)


def _fused_grads(grads: list, weights, main_grads, dummies) -> list:
    """The six weight gradients of a backward with main grads: None or a dummy where the
    gradient went into the weight's main_grad."""
    if dummies is None:
        return grads
    return [g if mg is None else _dummy(w, d)
            for g, w, mg, d in zip(grads, weights, main_grads, dummies)]


def _main_grads_of(targets: MainGradTargets | None):
    """(the six main_grad arguments of a forward op, its dummy list or None)."""
    if targets is None:
        return _NO_MAIN_GRADS, None
    return tuple(targets.main_grads), [int(d) for d in targets.dummies]


def _main_grads_tuple(main_grads):
    """``expert_backward.MainGrads`` of the six op arguments, None when none is given."""
    if all(mg is None for mg in main_grads):
        return None
    from mok_cute.expert_backward import MainGrads

    return MainGrads(*main_grads)


class _IntoMainGrad(torch.autograd.Function):
    """The PyTorch reference's weight with fused accumulation: its fp32 copy (the values the
    reference computes with anyway: it upcasts every weight), whose fp32 gradient (unrounded) is
    added into ``main_grad``; the weight itself gets None or Megatron's dummy."""

    @staticmethod
    def forward(ctx, weight, main_grad, dummy):  # type: ignore[override]
        ctx.main_grad, ctx.dummy = main_grad, dummy  # not saved: see the module doc
        ctx.like = (weight.shape, weight.dtype, weight.device)
        return weight.float()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.main_grad.add_(grad.detach())  # create_graph: the buffer stays out of the graph
        return _dummy_of(ctx.like, ctx.dummy), None, None


class _NoTokens(torch.autograd.Function):
    """A call with no token: a zero scalar that depends on one trained input, so its backward
    gives that input a zero gradient (allocated only then), or, for a weight whose gradient
    goes into its main_grad (adding zeros changes nothing), None or Megatron's dummy."""

    @staticmethod
    def forward(ctx, t, fused: bool, dummy):  # type: ignore[override]
        ctx.like, ctx.fused, ctx.dummy = (t.shape, t.dtype, t.device), fused, dummy
        return torch.zeros((), dtype=torch.float32, device=t.device)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.fused:
            return _dummy_of(ctx.like, ctx.dummy), None, None
        shape, dtype, device = ctx.like
        return torch.zeros(shape, dtype=dtype, device=device), None, None


def no_tokens_anchor(x, topk_weights, weights, targets: MainGradTargets | None) -> torch.Tensor:
    """A zero scalar on which every trained input of a call with no token depends (``api``'s
    T = 0 calls): ``weights`` the six expert weights (None where absent), ``targets`` their
    main_grads (marked as the training forward marks them)."""
    mark_added_to_main_grad(weights, targets)
    main_grads = targets.main_grads if targets is not None else (None,) * 6
    dummies = targets.dummies if targets is not None else (NO_DUMMY,) * 6
    anchor = torch.zeros((), dtype=torch.float32, device=x.device)
    for t, mg, d in zip((x, topk_weights, *weights), (None, None, *main_grads),
                        (NO_DUMMY, NO_DUMMY, *dummies)):
        if t is not None and t.requires_grad:
            anchor = anchor + _NoTokens.apply(t, mg is not None, d)
    return anchor


def reference_weights(weights, targets: MainGradTargets | None) -> tuple:
    """``weights`` (w_gate, w_up, w_down, ws_gate, ws_up, ws_down; None where absent) for the
    PyTorch reference: those with a main_grad replaced by ``_IntoMainGrad`` (same forward bits;
    their gradient goes into the main_grad); marks the dummies (``mark_added_to_main_grad``)."""
    if targets is None:
        return tuple(weights)
    mark_added_to_main_grad(weights, targets)
    return tuple(w if mg is None else _IntoMainGrad.apply(w, mg, d)
                 for w, mg, d in zip(weights, targets.main_grads, targets.dummies))


def _check_memory(x_name: str, tensors, main_grads) -> None:
    """``config.check_kernel_memory`` of a training op's x and weights (``x_name`` first, then
    ``WEIGHT_NAMES``' order) and main_grads, on the op's real tensors."""
    from mok_cute.config import WEIGHT_NAMES, check_kernel_memory

    check_kernel_memory(zip((x_name, *WEIGHT_NAMES), tensors), zip(WEIGHT_NAMES, main_grads))


@torch.library.custom_op("mok_cute::moe_forward_train", mutates_args=())
@_on_first_device
def moe_forward_train(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      ws_gate: Optional[torch.Tensor], ws_up: Optional[torch.Tensor],
                      ws_down: Optional[torch.Tensor], check_ids: bool, fc2_pingpong_max_k: int,
                      fc1_group_m: int, fc2_group_m: int, precision: str,
                      backend: str, timeline_capacity: int,
                      main_grad_w_gate: Optional[torch.Tensor],
                      main_grad_w_up: Optional[torch.Tensor],
                      main_grad_w_down: Optional[torch.Tensor],
                      main_grad_ws_gate: Optional[torch.Tensor],
                      main_grad_ws_up: Optional[torch.Tensor],
                      main_grad_ws_down: Optional[torch.Tensor],
                      dummy_grads: Optional[list[int]]) -> list[torch.Tensor]:
    """[out, *SavedForBackward]: the training forward on the kernels (inputs checked by
    ``mok_cute.api``), bf16 or FP8 (``expert_path_fp8``) by ``precision``; ``backend``
    "megakernel": through the megakernel at one rank (default megakernel options; its
    saved rows are the expert path's, bitwise); ``timeline_capacity`` > 0: it records as an
    inference call would (``MoKConfig.timeline``: the bf16 expert path's GEMMs, the
    megakernel's launch). ``main_grad_*``, ``dummy_grads``: for the backward
    (``MainGradTargets``), their memory checked here (``check_kernel_memory``: under
    torch.compile the API could not)."""
    from mok_cute.config import ExpertPathOptions, MoKConfig, PendingIdCheck
    from mok_cute.expert_path import moe_forward_kernel
    from mok_cute.expert_path_fp8 import moe_forward_fp8

    _check_memory("x", (x, w_gate, w_up, w_down, ws_gate, ws_up, ws_down),
                  (main_grad_w_gate, main_grad_w_up, main_grad_w_down, main_grad_ws_gate,
                   main_grad_ws_up, main_grad_ws_down))
    shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
    recording = dict(timeline=timeline_capacity > 0, timeline_capacity=max(timeline_capacity, 1))
    config = MoKConfig(backend="kernel", precision=precision, expert_path=ExpertPathOptions(
        fc2_pingpong_max_k, fc1_group_m, fc2_group_m), **recording)
    pending = PendingIdCheck(topk_idx, w_gate.shape[0]) if check_ids else None
    if backend == "megakernel":
        from mok_cute import megakernel

        out, saved = megakernel.training_forward(
            x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
            MoKConfig(backend="megakernel", check_ids=False, precision=precision, **recording))
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
      fc2_pingpong_max_k, fc1_group_m, fc2_group_m, precision, backend, timeline_capacity,
      main_grad_w_gate, main_grad_w_up, main_grad_w_down, main_grad_ws_gate, main_grad_ws_up,
      main_grad_ws_down, dummy_grads):
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


@torch.library.custom_op("mok_cute::moe_backward", mutates_args=_MAIN_GRAD_ARGS)
@_on_first_device
def moe_backward(d_out: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, ws_gate: Optional[torch.Tensor],
                 ws_up: Optional[torch.Tensor], ws_down: Optional[torch.Tensor],
                 saved: list[torch.Tensor], needs: list[bool], fc2_pingpong_max_k: int,
                 fc1_group_m: int, fc2_group_m: int, precision: str,
                 backend: str, timeline_capacity: int,
                 main_grad_w_gate: Optional[torch.Tensor],
                 main_grad_w_up: Optional[torch.Tensor],
                 main_grad_w_down: Optional[torch.Tensor],
                 main_grad_ws_gate: Optional[torch.Tensor],
                 main_grad_ws_up: Optional[torch.Tensor],
                 main_grad_ws_down: Optional[torch.Tensor]) -> Grads8:
    """(d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down); an
    empty tensor where ``needs`` (expert_backward.Needs order) says no, and for a weight whose
    fp32 gradient was added into its ``main_grad_*`` (mutated). ``timeline_capacity`` > 0:
    the backward-megakernel launch records (``_recorder``)."""
    from mok_cute.config import ExpertPathOptions
    from mok_cute.expert_backward import Needs, moe_backward as backward, records_backward
    from mok_cute.expert_path import SavedForBackward

    shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
    main_grads = (main_grad_w_gate, main_grad_w_up, main_grad_w_down, main_grad_ws_gate,
                  main_grad_ws_up, main_grad_ws_down)
    # FP8's dgrads run on the FP8 kernels (the backward megakernel is bf16)
    dgrads = "megakernel" if backend == "megakernel" and precision == "bf16" else "kernels"
    recorder = _recorder(timeline_capacity, records_backward(precision, dgrads, Needs(*needs)),
                         d_out.device)
    grads = backward(d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                     SavedForBackward(*saved), Needs(*needs),
                     ExpertPathOptions(fc2_pingpong_max_k, fc1_group_m, fc2_group_m), precision,
                     dgrads=dgrads, main_grads=_main_grads_tuple(main_grads), timeline=recorder)
    _publish(recorder)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@moe_backward.register_fake
def _(d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, saved,
      needs, fc2_pingpong_max_k, fc1_group_m, fc2_group_m, precision, backend,
      timeline_capacity, main_grad_w_gate, main_grad_w_up, main_grad_w_down, main_grad_ws_gate,
      main_grad_ws_up, main_grad_ws_down):
    return _fake_grads(needs, x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                       (main_grad_w_gate, main_grad_w_up, main_grad_w_down, main_grad_ws_gate,
                        main_grad_ws_up, main_grad_ws_down))


def _fake_grads(needs, x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                main_grads=_NO_MAIN_GRADS):
    """A backward op's fake outputs: each gradient like its input where ``needs`` (the
    ``expert_backward.Needs`` order) wants it, else an empty tensor (also for a weight whose
    gradient goes into its main_grad)."""
    want_x, want_w, want_gu, want_down, want_sgu, want_sdown = needs
    shared = ws_gate is not None
    like = lambda t, want: torch.empty_like(t) if want else x.new_empty(0)  # noqa: E731
    gate, up, down, s_gate, s_up, s_down = (mg is None for mg in main_grads)
    return (like(x, want_x), like(topk_weights, want_w), like(w_gate, want_gu and gate),
            like(w_up, want_gu and up), like(w_down, want_down and down),
            like(ws_gate, shared and want_sgu and s_gate) if shared else x.new_empty(0),
            like(ws_up, shared and want_sgu and s_up) if shared else x.new_empty(0),
            like(ws_down, shared and want_sdown and s_down) if shared else x.new_empty(0))


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
     fc2_pingpong_max_k, fc1_group_m, fc2_group_m, precision, backend, timeline_capacity,
     *fused) = inputs
    ctx.options = (fc2_pingpong_max_k, fc1_group_m, fc2_group_m, precision, backend,
                   _backward_capacity(timeline_capacity))
    ctx.set_materialize_grads(False)  # no zero gradients for the saved outputs ([T*K, 2I] ...)
    _keep_main_grads(ctx, fused)
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
        return _as_passed(ctx, ())
    grads = torch.ops.mok_cute.moe_backward(
        d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, *shared, saved, needs,
        *ctx.options, *ctx.main_grads)
    d_x, d_w, *d_weights = _wanted(ctx, grads)
    d_weights = _fused_grads(d_weights, (w_gate, w_up, w_down, *shared), ctx.main_grads,
                             ctx.dummies)
    return _as_passed(ctx, (d_x, None, d_w, *d_weights))


def _as_passed(ctx, grads: tuple) -> tuple:
    """A forward op's input gradients, None-padded to its arguments (the main_grad ones and
    the rest that take none). The ops have no defaulted arguments: torch versions differ in
    whether the dispatcher hands autograd a trailing argument left at its default (2.11's
    ADInplaceOrView kernel indexed past the end: every training call failed on the H200)."""
    return (*grads, *(None,) * (len(ctx.needs_input_grad) - len(grads)))


def _keep_main_grads(ctx, fused) -> None:
    """A forward op's six main_grad arguments and its dummy list on the context, not saved
    (module doc); the op called with buffers but no dummy list: no dummies."""
    ctx.main_grads, ctx.dummies = tuple(fused[:6]), fused[6]
    if ctx.dummies is None and any(mg is not None for mg in ctx.main_grads):
        ctx.dummies = [NO_DUMMY] * 6


moe_forward_train.register_autograd(_backward, setup_context=_setup_context)


def moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config,
                main_grads: MainGradTargets | None = None):
    """The differentiable one-GPU forward on the kernels -> out [T, H] (``api.moe_forward``
    takes this path when an input requires grad): the expert path, or with
    ``config.backend == "megakernel"`` the megakernel at one rank. ``main_grads``: the fp32
    buffers its weight gradients go into (checked by ``api``), None: returned as usual."""
    ws = tuple(shared) if shared is not None else (None, None, None)
    options = config.expert_path
    mark_added_to_main_grad((w_gate, w_up, w_down, *ws), main_grads)
    buffers, dummies = _main_grads_of(main_grads)
    outs = torch.ops.mok_cute.moe_forward_train(
        x, topk_idx, topk_weights, w_gate, w_up, w_down, *ws, config.check_ids,
        options.fc2_pingpong_max_k, options.fc1_group_m, options.fc2_group_m, config.precision,
        "megakernel" if config.backend == "megakernel" else "kernel",
        _forward_capacity(config), *buffers, dummies)
    return outs[0]


# ------------------------------------------------------------------------- timeline
def _forward_capacity(config) -> int:
    """The forward ops' timeline argument: ``MoKConfig.timeline_capacity``, 0 with the
    recorder off."""
    return config.timeline_capacity if config.timeline else 0


def _backward_capacity(forward_capacity: int) -> int:
    """The backward's recorder size for a forward recorded with ``forward_capacity`` records
    (0: off): at least ``timeline.BACKWARD_CAPACITY``, a backward runs many more tasks."""
    if not forward_capacity:
        return 0
    from mok_cute.timeline import BACKWARD_CAPACITY

    return max(forward_capacity, BACKWARD_CAPACITY)


def _recorder(capacity: int, records: bool, device):
    """A ``TimelineBuffer`` for a backward whose launch ``records`` (``expert_backward
    .records_backward``) when ``capacity`` > 0, else None: a backward of launches records
    nothing and leaves ``timeline.last()`` as it was."""
    if not (capacity and records):
        return None
    from mok_cute.timeline import TimelineBuffer

    return TimelineBuffer(capacity, device=device)


def _publish(recorder) -> None:
    """``timeline.last()`` is the backward's recording, when it made one."""
    if recorder is not None:
        from mok_cute.timeline import set_last

        set_last(recorder)


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
@_on_first_device
def moe_forward_virtual_train(xs: torch.Tensor, topk_idx: torch.Tensor,
                              topk_weights: torch.Tensor, w_gate: torch.Tensor,
                              w_up: torch.Tensor, w_down: torch.Tensor,
                              ws_gate: Optional[torch.Tensor], ws_up: Optional[torch.Tensor],
                              ws_down: Optional[torch.Tensor], check_ids: bool,
                              launch: list[int], timeout_ms: float,
                              expert_path: list[int],
                              main_grad_w_gate: Optional[torch.Tensor],
                              main_grad_w_up: Optional[torch.Tensor],
                              main_grad_w_down: Optional[torch.Tensor],
                              main_grad_ws_gate: Optional[torch.Tensor],
                              main_grad_ws_up: Optional[torch.Tensor],
                              main_grad_ws_down: Optional[torch.Tensor],
                              dummy_grads: Optional[list[int]]) -> list[torch.Tensor]:
    """[out, *VirtualSaved]: the training forward of R virtual ranks through the megakernel
    (inputs checked by ``mok_cute.api``; ``launch``: ``_launch_fields``; ``expert_path``: the
    ExpertPathOptions the backward's shared expert runs with, unused here; ``main_grad_*``
    ([R, ...] as their weights), ``dummy_grads``: for the backward, ``MainGradTargets``; the
    memory checked as ``moe_forward_train``'s)."""
    from mok_cute import megakernel
    from mok_cute.config import PendingIdCheck
    from mok_cute.virtual_backward import VirtualSaved

    _check_memory("xs", (xs, w_gate, w_up, w_down, ws_gate, ws_up, ws_down),
                  (main_grad_w_gate, main_grad_w_up, main_grad_w_down, main_grad_ws_gate,
                   main_grad_ws_up, main_grad_ws_down))
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
      launch, timeout_ms, expert_path, main_grad_w_gate, main_grad_w_up,
      main_grad_w_down, main_grad_ws_gate, main_grad_ws_up,
      main_grad_ws_down, dummy_grads):
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


@torch.library.custom_op("mok_cute::moe_backward_virtual", mutates_args=_MAIN_GRAD_ARGS)
@_on_first_device
def moe_backward_virtual(d_out: torch.Tensor, xs: torch.Tensor, topk_weights: torch.Tensor,
                         w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                         ws_gate: Optional[torch.Tensor], ws_up: Optional[torch.Tensor],
                         ws_down: Optional[torch.Tensor], saved: list[torch.Tensor],
                         needs: list[bool], expert_path: list[int],
                         precision: str, timeline_capacity: int,
                         main_grad_w_gate: Optional[torch.Tensor],
                         main_grad_w_up: Optional[torch.Tensor],
                         main_grad_w_down: Optional[torch.Tensor],
                         main_grad_ws_gate: Optional[torch.Tensor],
                         main_grad_ws_up: Optional[torch.Tensor],
                         main_grad_ws_down: Optional[torch.Tensor]) -> Grads8:
    """(d_xs, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down) of
    R virtual ranks (``virtual_backward.moe_backward_virtual``); an empty tensor where
    ``needs`` (expert_backward.Needs order) says no, and for a weight whose fp32 gradient was
    added into its ``main_grad_*`` ([R, ...] as the weight; mutated). ``timeline_capacity`` >
    0: the backward-megakernel launch records (``_recorder``)."""
    from mok_cute.config import ExpertPathOptions
    from mok_cute.expert_backward import Needs, records_backward
    from mok_cute.virtual_backward import VirtualSaved, moe_backward_virtual as backward

    shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
    main_grads = (main_grad_w_gate, main_grad_w_up, main_grad_w_down, main_grad_ws_gate,
                  main_grad_ws_up, main_grad_ws_down)
    recorder = _recorder(timeline_capacity,
                         records_backward(precision, "megakernel", Needs(*needs)), d_out.device)
    grads = backward(d_out, xs, topk_weights, w_gate, w_up, w_down, shared,
                     VirtualSaved(*saved), Needs(*needs), ExpertPathOptions(*expert_path),
                     precision, main_grads=_main_grads_tuple(main_grads), timeline=recorder)
    _publish(recorder)
    return tuple(xs.new_empty(0) if g is None else g for g in grads)


@moe_backward_virtual.register_fake
def _(d_out, xs, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, saved, needs,
      expert_path, precision, timeline_capacity, main_grad_w_gate, main_grad_w_up,
      main_grad_w_down, main_grad_ws_gate, main_grad_ws_up, main_grad_ws_down):
    return _fake_grads(needs, xs, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                       (main_grad_w_gate, main_grad_w_up, main_grad_w_down, main_grad_ws_gate,
                        main_grad_ws_up, main_grad_ws_down))


def _setup_context_virtual(ctx, inputs, output):
    (xs, _topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, _check_ids,
     launch, _timeout_ms, expert_path, *fused) = inputs
    ctx.expert_path = list(expert_path)
    ctx.set_materialize_grads(False)  # no zero gradients for the saved outputs
    _keep_main_grads(ctx, fused)
    ctx.precision = "fp8" if launch[-1] else "bf16"  # _launch_fields' last
    ctx.timeline_capacity = _backward_capacity(launch[5] if launch[4] else 0)
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
        return _as_passed(ctx, ())
    grads = torch.ops.mok_cute.moe_backward_virtual(
        d_out, xs, topk_weights, w_gate, w_up, w_down, *shared, saved, needs, ctx.expert_path,
        ctx.precision, ctx.timeline_capacity, *ctx.main_grads)
    d_x, d_w, *d_weights = _wanted(ctx, grads)
    d_weights = _fused_grads(d_weights, (w_gate, w_up, w_down, *shared), ctx.main_grads,
                             ctx.dummies)
    return _as_passed(ctx, (d_x, None, d_w, *d_weights))


moe_forward_virtual_train.register_autograd(_backward_virtual,
                                            setup_context=_setup_context_virtual)


def moe_forward_virtual(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared, config,
                        main_grads: MainGradTargets | None = None):
    """The differentiable forward of R virtual ranks on the megakernel -> out [R, T, H]
    (``api.moe_forward_virtual`` takes this path when an input requires grad): the saving
    launch, then ``virtual_backward`` (one backward-megakernel launch for all ranks' routed
    experts). Custom ops, not a ``torch.autograd.Function``: torch.compile traces them whole.
    ``main_grads``: as ``moe_forward``'s, each [R, ...] like its weight."""
    ws = tuple(shared) if shared is not None else (None, None, None)
    options = config.expert_path
    mark_added_to_main_grad((w_gate, w_up, w_down, *ws), main_grads)
    buffers, dummies = _main_grads_of(main_grads)
    outs = torch.ops.mok_cute.moe_forward_virtual_train(
        xs, topk_idx, topk_weights, w_gate, w_up, w_down, *ws, config.check_ids,
        _launch_fields(config), float(config.timeout_ms),
        [options.fc2_pingpong_max_k, options.fc1_group_m, options.fc2_group_m], *buffers,
        dummies)
    return outs[0]


# ------------------------------------------------------------------------- a process group
class _GroupTrain(torch.autograd.Function):
    """This rank's saving megakernel launch over ``group`` (bf16 or FP8, by the config); its
    backward is ``group_backward.moe_backward_group`` (a collective: every rank runs it; the
    plan's precision picks its dgrads)."""

    @staticmethod
    def forward(ctx, x, ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                config, group, mean_tokens, main_grads):
        from mok_cute import megakernel

        shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
        out, saved = megakernel.moe_forward(x, ids, topk_weights, w_gate, w_up, w_down, shared,
                                            config, group=group, save=True)
        ctx.has_shared = shared is not None
        ctx.options = config.expert_path
        ctx.comm_sms = config.megakernel.backward_comm_sms
        ctx.mean_tokens = mean_tokens
        ctx.group_timeout_s = config.group_timeout_s  # the first backward's wait for its peers
        # MoKConfig.timeline: the backward's launch records too (mok_cute.timeline.last());
        # FP8's backward is launches, which record nothing
        ctx.timeline_capacity = (_backward_capacity(_forward_capacity(config))
                                 if config.precision == "bf16" else 0)
        # kept, not saved (the module doc): every backward adds into them
        ctx.main_grads, ctx.dummies = _main_grads_of(main_grads)
        # SavedPreact: its g | u rows (the bulk: up to every peer's T * K rows of 2I) and a
        # SavedRowsPool's lease on them saved as tensors, which autograd frees once the
        # backward has run (unless retain_graph), where the context lives on with the graph;
        # this call's schedules and plan on the context
        ctx.saved = saved._replace(preact=None, row_slot=None, shared_preact=None, lease=None)
        ctx.save_for_backward(x, ids, topk_weights, w_gate, w_up, w_down, *(shared or ()),
                              saved.preact, saved.row_slot, saved.shared_preact, saved.lease)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # kernels: no graph of the gradients
    def backward(ctx, d_out):
        from mok_cute.group_backward import moe_backward_group
        from mok_cute.expert_backward import Needs

        (x, ids, topk_weights, w_gate, w_up, w_down, *shared, preact, row_slot, shared_preact,
         lease) = ctx.saved_tensors
        saved = ctx.saved._replace(preact=preact, row_slot=row_slot, shared_preact=shared_preact,
                                   lease=lease)
        one = lambda t: None if t is None else t.unsqueeze(0)  # noqa: E731  the launch's rank
        stacked = saved._replace(row_slot=one(saved.row_slot),
                                 shared_preact=one(saved.shared_preact))
        needs = Needs(*_needs(ctx))
        main_grads = _main_grads_tuple(ctx.main_grads)  # [1, ...]: the launch's rank too
        recorder = _recorder(ctx.timeline_capacity, True, d_out.device)
        grads = moe_backward_group(
            one(d_out.contiguous()), one(x), one(ids), one(topk_weights), one(w_gate),
            one(w_up), one(w_down), tuple(one(w) for w in shared) if shared else None, stacked,
            needs, ctx.options, tokens_per_rank=ctx.mean_tokens, comm_sms=ctx.comm_sms,
            main_grads=None if main_grads is None else main_grads._replace(
                **{k: one(v) for k, v in main_grads._asdict().items()}), timeline=recorder,
            group_timeout_s=ctx.group_timeout_s)
        _publish(recorder)
        d_x, d_w, *d_weights = _wanted(ctx, [None if t is None else t[0] for t in grads])
        d_weights = _fused_grads(d_weights, (w_gate, w_up, w_down, *(shared or (None,) * 3)),
                                 ctx.main_grads, ctx.dummies)
        return (d_x, None, d_w, *d_weights, None, None, None, None)


def moe_forward_group(x, ids, topk_weights, w_gate, w_up, w_down, shared, config, group,
                      mean_tokens: float | None = None,
                      main_grads: MainGradTargets | None = None):
    """The differentiable forward of this rank of ``group`` on the IPC megakernel -> out
    [T, H] (inputs padded to the plan's T by ``api``; ids int32). ``mean_tokens``: the
    ranks' mean T before that padding (the backward's ``tokens_per_rank``; None: the plan's).
    ``main_grads``: as ``moe_forward``'s."""
    ws = tuple(shared) if shared is not None else (None, None, None)
    mark_added_to_main_grad((w_gate, w_up, w_down, *ws), main_grads)
    return _GroupTrain.apply(x, ids, topk_weights, w_gate, w_up, w_down, *ws, config, group,
                             mean_tokens, main_grads)
