"""The backward of the megakernel's training forward over a group of ranks: each rank's
gradients from its d_out and what its forward saved (``megakernel.SavedPreact``: g | u of its
experts' receive rows, its receive schedule and the plan that ran it), the comm through the
plan's symmetric buffers (``comm.ipc`` between processes, ``comm.virtual`` for ranks on one GPU).

Per call, on every rank of the group (each must run it, as a collective):

    own fields <- x, d_out, router weights           (the source side, for the peers to pull)
    one rank per process (IPC, L = 1; ``_one_launch``):
      one backward-megakernel launch (``megakernel_backward.expert_grads_over_peers`` with
      its ``GroupTail``): its comm CTAs announce the start and wait for every peer's
      (barrier 0); pull the d_out rows, router weights and x rows of this rank's receive
      rows while the compute CTAs run the shared expert's dgrads (local: its dx rows are
      the k-sums' base), then the routed dgrads as the rows arrive; push each dx row and
      its partials' sum into the source's (token, k) slot (``combine``, ``d_topk_partials``)
      as its tile's FC1 dgrads finish; store the done flag (barrier 1) and, once every
      peer's is in, run the k-sums of d_x and d_topk_weights, all under the weight gradients
      (the shared expert's last; when the routed ones are not wanted, or Is is not a whole
      number of 64-deep k-tiles, the shared expert's backward runs before the launch)
    several ranks in one process (virtual, L > 1: their launches run one after another, so a
    launch cannot wait for a later one's flags):
      barrier 0 (flag "started" of a new epoch), one launch per local rank with the comm
      tasks (and its shared expert's tasks) as above but no barrier or k-sum, barrier 1
      (flag "done": every push has landed), d_x = fixed-order k-sum of the pushed dx rows
      (+ the shared expert's dx), d_topk_weights from the pushed partials

The launches' FC2 dgrads use the virtual ranks' backward's tiles (the one-GPU launches'
128-wide FC2 dgrad tiles would sum d_topk's row partials in another order).

No host sync: the comm tasks read the receive schedule on the device. Rows are pulled again
rather than kept from the forward (the forward's ring belongs to the plan, whose next call may
be another layer's). Every expert rank computes dx and the partials of every row routed to it
whatever its own ``needs`` say: they are its peers' gradients.

An FP8 plan (``MoKConfig(precision="fp8")``): the copies are ``kernels.peer_rows`` launches
from address tables built on the device, around the one-GPU FP8 dgrads
(``expert_path_fp8.expert_dgrads``) on the pulled d_out rows, zero-padded to H' = whole 128
groups, and the weight gradients FP8 where ``expert_backward.fp8_weight_grads`` says so.

Numerics: a row's dgrads depend on that row alone, the k-sum runs in ascending k in fp32 and
rounds once, the weight gradients sum an expert's rows in schedule order: d_x and
d_topk_weights are bitwise those of the same tokens on one rank, and every gradient those of
the virtual ranks' backward (``virtual_backward``: the same tiles in one backward-megakernel
launch; its dgrads alone are bitwise the launch with the weight gradients,
tests/test_megakernel_backward.py); bitwise run to run.

Failures: a barrier wait that gives up (a dead or silent peer) records the plan's backward
error word; ``PeerTimeoutError`` (naming the waiting rank and the peer) is raised at the plan's
next call or by ``mok_cute.check_errors()``, and that call's gradients are incomplete (with
the launch's group tail its d_x and d_topk_weights are NaN: the k-sums of a failed launch, or
with a failed peer, write NaN).

Not yet the design's one launch (issue 32): the barriers and k-sums of several ranks in one
process, and an FP8 plan's copies, barriers, k-sums and shared expert, are launches of their
own.
"""

from __future__ import annotations

import torch

from mok_cute.config import ExpertPathOptions, MegakernelOptions, check_tensor
from mok_cute.constants import SAVED_ROWS_SHORT, SLOT_ROW_BYTES
from mok_cute.errors import error_word
from mok_cute.expert_backward import (MainGrads, Needs, _dgrads, _weight_grads, rank_views,
                                      row_partial_sums, shared_backward_ranks, shared_in_launch,
                                      wanted_shared_grads)
from mok_cute.expert_path_fp8 import padded

__all__ = ["moe_backward_group"]

_BF16 = 2


def _row_addresses(base: torch.Tensor, offset: int, index: torch.Tensor, row_bytes: int,
                   valid: torch.Tensor) -> torch.Tensor:
    """int64 addresses ``base + offset + index * row_bytes`` where ``valid``, else 0."""
    return torch.where(valid, base + offset + index * row_bytes, torch.zeros_like(base))


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """int64 address of each row of contiguous ``t`` [..., rows, cols] (flattened)."""
    row_bytes = t.shape[-1] * t.element_size()
    rows = t.numel() * t.element_size() // row_bytes
    return t.data_ptr() + torch.arange(rows, dtype=torch.int64, device=t.device) * row_bytes


def moe_backward_group(d_out, xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared, saved,
                       needs: Needs = Needs(),
                       options: ExpertPathOptions = ExpertPathOptions(), silent_rank: int = -1,
                       tokens_per_rank: float | None = None,
                       comm_sms: int = MegakernelOptions().backward_comm_sms,
                       main_grads: MainGrads | None = None, timeline=None,
                       group_timeout_s: float | None = None):
    """Every gradient of a saving megakernel launch (``megakernel.moe_forward(..., group=...,
    save=True)``, or ``moe_forward_virtual(save=True)``) for the L ranks of that launch (L = 1
    for a process of a group): d_out, xs [L, T, H] with the plan's T (padded rows included),
    topk_idx [L, T, K] int32 global ids, topk_weights [L, T, K], w_* [L, E_loc, ., .],
    shared None or three [L, ...] tensors, ``saved`` the launch's ``SavedPreact`` (``plan``
    set). Returns (d_xs, d_topk_weights [L, T, K] in topk_weights' dtype, d_w_gate, d_w_up,
    d_w_down, d_ws_gate, d_ws_up, d_ws_down), None where ``needs`` says no.
    ``tokens_per_rank``: the group's mean T before the plan's padding (default: the plan's T),
    what the FP8 weight gradients' rule counts rows by, as the virtual ranks' backward does
    (padding rows route nowhere), so both pick the same kernels. ``silent_rank`` (tests
    only): that rank stores no barrier flag, as if its process had died. ``main_grads``: a
    ``MainGrads`` of fp32 buffers shaped as the weights ([L, ...]): each weight gradient with
    one is added into it and returned as None. ``timeline``: a ``mok_cute.timeline.TimelineBuffer``
    that the bf16 backward-megakernel launch of local rank 0 records into (the FP8 backward's
    launches record nothing). ``group_timeout_s``: how long a first build's ranks wait for each
    other to arrive from their compiles (``MoKConfig.group_timeout_s``; None: its default)."""
    from mok_cute.comm.agreement import timeout_of, until_collective
    from mok_cute.kernels.peer_rows import peer_barrier
    from mok_cute.megakernel_backward import SharedGrads

    plan = getattr(saved, "plan", None)
    if plan is None or not plan.key.spec.save_preact:
        raise ValueError("saved: expected the SavedPreact of a saving megakernel launch "
                         "(moe_forward(..., save=True)), which names its plan")
    side, k = plan.side, plan.key
    fp8 = k.spec.fp8  # an FP8 training forward: the FP8 dgrads (and weight gradients)
    L, P = side.launch_ranks, side.num_peers
    T, H, K, I = k.tokens, k.hidden, k.top_k, k.intermediate
    E_loc = k.local_experts
    dev = plan.peer_bases.device
    # the routed rows an expert expects: P * T * K over P * E_loc, T before the padding
    routed_per_expert = (T if tokens_per_rank is None else tokens_per_rank) * K / E_loc
    # this build's first call on the plan: the ranks line up after compiling its kernels (a
    # rank failing before that makes every rank raise); the bf16 backward at one rank a
    # process has one launch, the FP8 one two barrier launches
    build = (fp8, needs.w_gate_up or needs.w_down, shared is not None,
             main_grads is not None, timeline is not None)
    align = _first_build_alignment(plan, build, launches=1 if L == 1 and not fp8 else 2)
    gate = until_collective(side.group if align is not None else None,
                            timeout_of(None) if group_timeout_s is None else group_timeout_s)

    # the plan's epoch, scalars and buffers: one call at a time, one stream's launches at a time
    with gate, plan.lock, plan.order.around(dev):
        for name, t, shape, dtype in (("d_out", d_out, (L, T, H), torch.bfloat16),
                                      ("xs", xs, (L, T, H), torch.bfloat16),
                                      ("topk_idx", topk_idx, (L, T, K), None),
                                      ("topk_weights", topk_weights, (L, T, K), None),
                                      ("w_gate", w_gate, (L, E_loc, I, H), torch.bfloat16)):
            check_tensor(name, t, shape=shape, dtype=dtype, device=dev, contiguous=False)
        plan.backward_errors.check(block=False, last_call=plan.backward_calls,
                                   rank_base=side.rank_base)  # an earlier call's, without a sync
        # this rank's fields for the peers to pull (then barrier 0 of a new epoch: in the
        # launch with one rank, a launch of its own with several)
        for fields, src in ((side.fields("x"), xs), (side.fields("d_out"), d_out)):
            for r in range(L):
                fields[r].copy_(src[r])
        weights32 = topk_weights.to(torch.float32).reshape(L, T * K)
        for r, field in enumerate(side.fields("router_weights")):
            field[:, 0].copy_(weights32[r])
        if L == 1 and not fp8:  # one process, one rank: the barriers and k-sums in the launch
            return _one_launch(plan, saved, d_out, xs, topk_idx, topk_weights, w_gate, w_up,
                               w_down, shared, needs, options, silent_rank, comm_sms, main_grads,
                               timeline, align, routed_per_expert)
        plan.begin_backward(silent_rank)
        peer_barrier(plan.peer_bases, plan.scalars, plan.backward_error, 0, side.scope,
                     before_launch=align)
        in_launch = None  # each rank's shared expert as tasks of its launch, else after
        if not fp8 and shared_in_launch(shared, "bf16", needs):
            in_launch = _shared_experts(d_out, xs, shared, saved)
        if fp8:
            dwg, dwu, dwd = _fp8_routed(plan, saved, w_gate, w_up, w_down, needs, options,
                                        routed_per_expert, main_grads)
        else:
            dwg, dwu, dwd, s = _routed(plan, saved, w_gate, w_up, w_down, needs, comm_sms,
                                       shared=in_launch, main_grads=main_grads,
                                       timeline=timeline, rows_per_expert=routed_per_expert)
        peer_barrier(plan.peer_bases, plan.scalars, plan.backward_error, 1, side.scope,
                     before_launch=align)
        _report_short_save(plan, saved)
        plan.backward_errors.record(plan.backward_calls)

        # the shared expert (local, unless the launches ran it), then the k-sums of what the
        # peers pushed
        if in_launch is not None:
            shared_dx = [g.dx for g in s]
            d_shared = wanted_shared_grads(SharedGrads(None, *(
                _stacked([g[i] for g in s]) for i in (1, 2, 3))), needs)
        else:
            shared_dx, d_shared = shared_backward_ranks(d_out, xs, shared, saved.shared_preact,
                                                        needs, options,
                                                        None if main_grads is None
                                                        else main_grads.shared)
        num_experts = P * E_loc
        routed = (topk_idx >= 0) & (topk_idx < num_experts)  # [L, T, K]: the slots given a row
        d_xs = d_topk = None
        if needs.x:
            from mok_cute.kernels import token_ops

            ones = torch.ones(T, K, dtype=torch.float32, device=dev)
            slots = torch.arange(T * K, dtype=torch.int32, device=dev)
            pushed = side.fields("combine")
            d_xs = torch.stack([token_ops.weighted_ksum(
                pushed[r], ones, shared_dx[r],
                row_index=torch.where(routed[r].reshape(-1), slots, -1)) for r in range(L)])
        if needs.topk_weights:
            pushed = side.fields("d_topk_partials")
            d_topk = torch.stack([torch.where(routed[r], pushed[r][:, 0].view(T, K), 0.0)
                                  for r in range(L)]).to(topk_weights.dtype)
        return (d_xs, d_topk, _stacked(dwg), _stacked(dwu), _stacked(dwd), *d_shared)


def _report_short_save(plan, saved) -> None:
    """A forward that kept too few g | u rows (``MoKConfig.saved_rows_factor``, or what its
    ``saved_rows_pool`` had left): how many, in the backward's error word after its launches
    (where no wait's error is), so that the backward's error check raises ``SavedRowsError``
    (no host sync here). The backward itself ran whole on every rank: the group's collective
    stays intact."""
    missing = saved.missing
    if missing is None:
        return
    word = plan.backward_error
    # the count in the task field, at rank 0 of the launch (the check adds the process's rank)
    told = error_word(missing - 1, 0, 0, SAVED_ROWS_SHORT)
    word.copy_(torch.where((word == 0) & (missing > 0), told, word))


def _first_build_alignment(plan, build: tuple, launches: int):
    """What lines a group's ranks up before each of the ``launches`` launches of a backward
    build's first call on ``plan`` (None after it, and on one process's virtual ranks): a
    stream-ordered all_reduce over the group, behind `until_collective`'s gate. The first
    call compiles the build's kernels, one to two minutes a process; the launches' waits on
    peers give up after ``timeout_ms``, so a rank still compiling would fail its peers' first
    step. Every rank runs the same builds in the same order, so all of them take part."""
    from mok_cute.comm.agreement import ready_for_collective

    group = getattr(plan.side, "group", None)
    seen = getattr(plan, "aligned_builds", None)
    if group is None or seen is None or build in seen:
        return None
    done = []

    def align():
        import torch.distributed as dist

        done.append(None)
        ready_for_collective(group, last=len(done) == launches)
        dist.all_reduce(torch.zeros(1, device=plan.peer_bases.device), group=group)
        if len(done) == launches:  # a first call that failed before this aligns the next
            seen.add(build)
    return align


def _one_launch(plan, saved, d_out, xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                needs: Needs, options: ExpertPathOptions, silent_rank: int, comm_sms: int,
                main_grads: MainGrads | None = None, timeline=None, before_launch=None,
                rows_per_expert: float | None = None):
    """The bf16 backward of one rank in its own process: the shared expert's backward (its dx
    rows are the k-sums' base), then one launch whose comm CTAs also pass the group's two
    barriers and run the k-sums of d_x and d_topk_weights (``megakernel_backward.GroupTail``).
    A wait of the launch that gives up records into the plan's backward error word."""
    from mok_cute.megakernel_backward import GroupTail

    k = plan.key
    T, H, K = k.tokens, k.hidden, k.top_k
    dev = plan.peer_bases.device
    in_launch = None  # the shared expert's backward as tasks of the launch, else before it
    shared_dx, d_shared = [None], (None, None, None)
    if shared_in_launch(shared, "bf16", needs):
        in_launch = _shared_experts(d_out, xs, shared, saved)
    else:
        shared_dx, d_shared = shared_backward_ranks(d_out, xs, shared, saved.shared_preact,
                                                    needs, options,
                                                    None if main_grads is None
                                                    else main_grads.shared)
    d_x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    d_topk = torch.empty(T, K, dtype=torch.float32, device=dev)
    tail = GroupTail(plan.scalars, plan.backward_error, topk_idx[0].to(torch.int32).contiguous(),
                     shared_dx[0], d_x, d_topk)
    plan.begin_backward(silent_rank)
    dwg, dwu, dwd, s = _routed(plan, saved, w_gate, w_up, w_down, needs, comm_sms, tail,
                               in_launch, main_grads, timeline, before_launch, rows_per_expert)
    _report_short_save(plan, saved)
    plan.backward_errors.record(plan.backward_calls)
    if s is not None:
        d_shared = tuple(None if g is None else g[None]
                         for g in wanted_shared_grads(s[0], needs))
    return (d_x[None] if needs.x else None,
            d_topk[None].to(topk_weights.dtype) if needs.topk_weights else None,
            _stacked(dwg), _stacked(dwu), _stacked(dwd), *d_shared)


def _shared_experts(d_out, xs, shared, saved) -> list:
    """Each local rank's ``SharedExpert``: its shared expert's backward as tasks of its launch."""
    from mok_cute.megakernel_backward import SharedExpert

    return [SharedExpert(d_out[r].contiguous(), xs[r].contiguous(),
                         *(w[r].contiguous() for w in shared), saved.shared_preact[r])
            for r in range(xs.shape[0])]


def _stacked(grads: list):
    """Each local rank's weight gradient stacked [L, ...], or None where not wanted (or
    added into its main_grad buffer)."""
    return None if grads[0] is None else torch.stack(grads)


def _rank_main(main_grads: MainGrads | None, r: int) -> MainGrads | None:
    """Local rank ``r``'s views of ``main_grads``' [L, ...] buffers."""
    return None if main_grads is None else MainGrads(*rank_views(main_grads, r))


def _routed(plan, saved, w_gate, w_up, w_down, needs: Needs, comm_sms: int, tail=None,
            shared=None, main_grads: MainGrads | None = None, timeline=None,
            before_launch=None, rows_per_expert: float | None = None):
    """Each local rank's routed backward in one launch with its comm (bf16): the weight
    gradients (dW_gate, dW_up, dW_down per rank, None where ``needs`` says no), and with
    ``shared`` (a ``SharedExpert`` per local rank: its backward in the rank's launch too)
    their ``SharedGrads``, else None. The launch's own waits are on its own tasks (a peer's
    silence shows at barrier 1), or with ``tail`` (one rank) on the peers' flags too.
    ``timeline``: local rank 0's launch records into it."""
    from mok_cute import megakernel_backward

    side, k = plan.side, plan.key
    sched = saved.schedules
    dev = plan.peer_bases.device
    scalars = megakernel_backward.comm_scalars(side.layout, k.top_k, dev)
    # the router weight of each saved g | u row, pulled by the launches (the launch's ranks
    # share one pool, each row saved once)
    weights = torch.zeros(saved.preact.shape[0], dtype=torch.float32, device=dev)
    wgrads = needs.w_gate_up or needs.w_down
    dwg, dwu, dwd, grads = [], [], [], []
    for r in range(side.launch_ranks):
        peers = megakernel_backward.PeerRows(plan.peer_bases[r], sched.row_peer[r],
                                             sched.row_token[r], sched.row_k[r], scalars)
        out = megakernel_backward.expert_grads_over_peers(
            w_gate[r], w_up[r], w_down[r], saved.preact, saved.row_slot[r], weights,
            sched.tile_expert[r], sched.num_tiles[r:r + 1], sched.expert_offsets[r], peers,
            wgrads, comm_sms, tail=tail, shared=None if shared is None else shared[r],
            main_grads=_rank_main(main_grads, r), timeline=timeline if r == 0 else None,
            before_launch=before_launch if tail is not None else None,
            rows_per_expert=rows_per_expert)
        gate, up, down = out[6:9] if wgrads else (None, None, None)
        dwg.append(gate if needs.w_gate_up else None)
        dwu.append(up if needs.w_gate_up else None)
        dwd.append(down if needs.w_down else None)
        grads.append(out[-1])
    return dwg, dwu, dwd, grads if shared is not None else None


def _fp8_routed(plan, saved, w_gate, w_up, w_down, needs: Needs, options: ExpertPathOptions,
                routed_per_expert: float, main_grads: MainGrads | None = None):
    """Each local rank's routed FP8 backward as launches of their own: pulls, the FP8 dgrads,
    pushes and the weight gradients (per rank)."""
    from mok_cute.kernels.peer_rows import copy_rows_by_address

    side, k = plan.side, plan.key
    L, H, K = side.launch_ranks, k.hidden, k.top_k
    sched = saved.schedules
    layout = side.layout
    dev = plan.peer_bases.device
    # pull this rank's receive rows: d_out, x (for dW_gate / dW_up), router weights
    cap = sched.row_peer.shape[1]
    peer = sched.row_peer.to(torch.int64)
    valid = peer >= 0
    base = torch.gather(plan.peer_bases, 1, peer.clamp(min=0))  # [L, cap]
    token = sched.row_token.to(torch.int64).clamp(min=0)
    slot = token * K + sched.row_k.to(torch.int64).clamp(min=0)
    # the FP8 dgrad's K is H zero-padded to whole 128 groups (the copies write H)
    width = padded(H)
    d_rows = (torch.zeros if width != H else torch.empty)(L, cap, width,
                                                          dtype=torch.bfloat16, device=dev)
    x_rows = (torch.empty(L, cap, H, dtype=torch.bfloat16, device=dev)
              if needs.w_gate_up else None)
    w_rows = torch.empty(L, cap, 4, dtype=torch.float32, device=dev)
    pulls = [(d_rows, "d_out", token, H * _BF16),
             (w_rows, "router_weights", slot, SLOT_ROW_BYTES)]
    if x_rows is not None:
        pulls.append((x_rows, "x", token, H * _BF16))
    for dst, field, index, row_bytes in pulls:
        src = _row_addresses(base, layout.offset(field), index, row_bytes, valid)
        copy_rows_by_address(src.reshape(-1), _rows_of(dst), row_bytes)

    # the router weight of each saved g | u row (the dgated epilogue reads both by row_slot;
    # the launch's ranks share one pool, each row saved once)
    rows = saved.preact.shape[0]
    row_slot = saved.row_slot.to(torch.int64).reshape(-1)
    weights = torch.zeros(rows + 1, dtype=torch.float32, device=dev)  # [rows]: a sink
    weights.scatter_(0, torch.where(row_slot >= 0, row_slot, rows),
                     torch.where(row_slot >= 0, w_rows[..., 0].reshape(-1), 0.0))
    weights = weights[:rows].contiguous()

    # per rank of the launch: the dgrads, the pushes of dx rows and partials home, then
    # the weight gradients, under which the peers' pushes land before barrier 1
    dwg, dwu, dwd = [], [], []
    combine, partial_field = layout.offset("combine"), layout.offset("d_topk_partials")
    for r in range(L):
        d_preact, hw, partials, dx_rows = _dgrads(
            d_rows[r], w_gate[r], w_up[r], w_down[r], saved.preact, saved.row_slot[r],
            weights, sched.tile_expert[r], sched.num_tiles[r:r + 1], True, options,
            fp8=True, dgrads="kernels")
        part = torch.zeros(cap, 4, dtype=torch.float32, device=dev)
        part[:, 0] = row_partial_sums(partials)
        copy_rows_by_address(_rows_of(dx_rows),
                             _row_addresses(base[r], combine, slot[r], H * _BF16, valid[r]),
                             H * _BF16)
        copy_rows_by_address(_rows_of(part),
                             _row_addresses(base[r], partial_field, slot[r], SLOT_ROW_BYTES,
                                            valid[r]), SLOT_ROW_BYTES)
        gate, up, down = _weight_grads(d_preact, hw, d_rows[r],
                                       None if x_rows is None else x_rows[r], w_gate[r],
                                       w_down[r], sched.expert_offsets[r], needs.w_gate_up,
                                       needs.w_down, fp8=True,
                                       rows_per_expert=routed_per_expert,
                                       main=None if main_grads is None
                                       else _rank_main(main_grads, r).routed)
        dwg.append(gate)
        dwu.append(up)
        dwd.append(down)
    return dwg, dwu, dwd

