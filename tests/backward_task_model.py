"""A float64 CPU model of the backward megakernel (``mok_cute.tasks_backward``), for tests.

``run_backward_lists`` executes every rank's backward task list the way the kernel would, task
by task, on R virtual ranks: each task does its tile's arithmetic on buffers the earlier tasks
filled, and signals its counter. The order is any the waits allow: at each step one task whose
waits are met is drawn at random from every rank's pending tasks (not only queue heads), so a
dependency the list forgot shows up as a read of rows nobody has written yet (every buffer
keeps a written-mask at the granularity its producers write), and a circular wait as "nothing
can run". The group barrier passes once every rank has reached its own. Written apart from the
kernels and from ``mok_cute.reference``; the tests compare its gradients with autograd on the
reference in float64.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mok_cute import schedule as schedule_mod
from mok_cute.tasks_backward import (EXPERT_TILES, SHARED_DGRADS, TILE_COUNTERS,
                                     BackwardCounter as BC,
                                     BackwardListParams, BackwardTaskType as BT,
                                     build_backward_static, build_backward_task_list,
                                     expert_tile_ranges)


@dataclass
class Problem:
    """R ranks' inputs, leading R; global expert e lives on rank e // E_loc."""

    xs: torch.Tensor  # [R, T, H]
    idx: torch.Tensor  # [R, T, K] int64 global expert ids
    w: torch.Tensor  # [R, T, K]
    wg: torch.Tensor  # [R, E_loc, I, H]
    wu: torch.Tensor  # [R, E_loc, I, H]
    wd: torch.Tensor  # [R, E_loc, H, I]
    d_out: torch.Tensor  # [R, T, H]
    shared: tuple | None = None  # ([R, Is, H], [R, Is, H], [R, H, Is]) or None


def _silu_parts(g):
    sig = torch.sigmoid(g)
    return sig, g * sig


class _Rank:
    """One rank's buffers, written-masks and counters."""

    def __init__(self, r: int, prob: Problem, sched, tl, p: BackwardListParams):
        self.r, self.tl, self.p = r, tl, p
        T, K = prob.idx.shape[1:]
        H, I = prob.xs.shape[2], prob.wg.shape[2]
        self.num_tiles = int(sched.num_tiles[0])
        rows = self.num_tiles * p.tile_m
        self.row_peer = sched.row_peer[:rows].long()
        self.row_token = sched.row_token[:rows].long()
        self.row_k = sched.row_k[:rows].long()
        self.tile_expert = sched.tile_expert[:self.num_tiles].long()
        nd, nx = -(-I // p.dgated_tile_n), -(-H // p.dx_tile_n)
        z = dict(dtype=torch.float64)
        self.dy, self.dy_ok = torch.zeros(rows, H, **z), torch.zeros(rows, dtype=torch.bool)
        self.x, self.x_ok = torch.zeros(rows, H, **z), torch.zeros(rows, dtype=torch.bool)
        if p.x_resident:  # the training forward kept them
            valid = self.row_token >= 0
            self.x[valid] = prob.xs[self.row_peer[valid], self.row_token[valid]]
            self.x_ok[:] = True
        self.dpre, self.hw = torch.zeros(rows, 2 * I, **z), torch.zeros(rows, I, **z)
        self.part = torch.zeros(rows, nd, **z)
        self.dpre_ok = torch.zeros(rows, nd, dtype=torch.bool)
        self.dx, self.dx_ok = torch.zeros(rows, H, **z), torch.zeros(rows, nx, dtype=torch.bool)
        # source side
        self.dx_slot, self.part_slot = torch.zeros(T * K, H, **z), torch.zeros(T * K, **z)
        self.slot_writes = torch.zeros(T * K, dtype=torch.int64)
        self.slot_row = schedule_mod.row_of_slot(sched, T, K).long() if not p.comm_tasks else None
        if prob.shared is not None:
            Is = prob.shared[0].shape[1]
            self.sdpre, self.shw = torch.zeros(T, 2 * Is, **z), torch.zeros(T, Is, **z)
            ns = -(-Is // p.dgated_tile_n)
            st = -(-T // p.tile_m)
            self.sdpre_ok = torch.zeros(st, ns, dtype=torch.bool)
            self.sdx, self.sdx_ok = torch.zeros(T, H, **z), torch.zeros(st, nx, dtype=torch.bool)
        E_loc = prob.wg.shape[1]
        self.dwg, self.dwu = torch.zeros(E_loc, I, H, **z), torch.zeros(E_loc, I, H, **z)
        self.dwd = torch.zeros(E_loc, H, I, **z)
        self.grads_shared = None if prob.shared is None else [torch.zeros_like(s[r], **z)
                                                               for s in prob.shared]
        self.d_x, self.d_w = torch.zeros(T, H, **z), torch.zeros(T, K, **z)
        self.counters = {g: torch.zeros(n, dtype=torch.int64) for g, n in tl.counter_sizes.items()}
        self.pending = list(tl)
        self.expert_tiles = expert_tile_ranges(self.tile_expert.numpy(), E_loc)
        # a static list's run-time rules (mok_cute.tasks_backward): live minibatches, live tiles
        tpm = p.minibatch_tokens // p.tile_m
        self.live = -(-self.num_tiles // tpm)
        self.live_tile_end = min(self.live * tpm, tl.counter_sizes[BC.DGATED])

    def dead(self, t) -> bool:
        # the shared expert's dgrads (minibatch 0) run whatever the routing
        return self.tl.static and t.minibatch >= self.live and t.type not in SHARED_DGRADS

    def no_op(self, t) -> bool:
        return (self.tl.static and t.minibatch >= 0 and t.tile >= self.num_tiles
                and t.type not in SHARED_DGRADS)

    def ready(self, t) -> bool:
        for g, first, count, target in t.waits:
            if first == EXPERT_TILES:  # the task's expert's tiles, from the schedule
                first = int(self.expert_tiles[t.tile])
                count = int(self.expert_tiles[t.tile + 1]) - first
            elif self.tl.static and g in TILE_COUNTERS:
                count = max(min(first + count, self.live_tile_end) - first, 0)
            if not bool((self.counters[g][first:first + count] >= target).all()):
                return False
        return True


def run_backward_lists(prob: Problem, params: BackwardListParams, *, tile_m: int, seed: int = 0,
                       mutate=None, static: bool = False):
    """Every rank's backward list run to completion in a random order its waits allow.
    Returns (d_xs, d_ws, d_wg, d_wu, d_wd, shared grads or None), leading R. ``mutate(tl)``
    may edit each rank's list first (tests of the checks). ``static``: the lists a kernel gets
    (``build_backward_static`` on the schedule's capacity), run by the run-time rules: dead
    tasks skipped, no-op tasks only signal, per-tile waits clipped to the live tiles, each
    weight gradient's expert range from the schedule."""
    R, T, K = prob.idx.shape
    E_loc = prob.wg.shape[1]
    scheds = schedule_mod.build_receive_schedules(prob.idx.to(torch.int32), E_loc, tile_m)
    ranks = []
    for r in range(R):
        sched = scheds[r]
        n = int(sched.num_tiles[0])
        if static:
            tl = build_backward_static(sched.capacity // tile_m, E_loc, params)
        else:
            tl = build_backward_task_list(sched.tile_expert[:n].numpy(), E_loc, params)
        if mutate is not None:
            mutate(tl)
        ranks.append(_Rank(r, prob, sched, tl, params))
    rng = random.Random(seed)
    arrived = set()
    for rk in ranks:
        rk.pending = [t for t in rk.pending if not rk.dead(t)]
    while any(rk.pending for rk in ranks):
        runnable = [(rk, i) for rk in ranks for i, t in enumerate(rk.pending) if rk.ready(t)]
        if not runnable:
            stuck = [(rk.r, rk.pending[0]) for rk in ranks if rk.pending]
            raise RuntimeError(f"no task can run (circular or unsatisfiable wait): {stuck[:2]}")
        rk, i = rng.choice(runnable)
        task = rk.pending.pop(i)
        if not rk.no_op(task):
            _run(task, rk, ranks, prob)
        if task.type == BT.BARRIER:
            arrived.add(rk.r)
            if len(arrived) == R:  # the group barrier: every rank has pushed everything
                for other in ranks:
                    other.counters[BC.BARRIER_DONE][0] = 1
        else:
            rk.counters[task.signal[0]][task.signal[1]] += 1
    out = [torch.stack([getattr(rk, name) for rk in ranks])
           for name in ("d_x", "d_w", "dwg", "dwu", "dwd")]
    shared = None
    if prob.shared is not None:
        shared = [torch.stack([rk.grads_shared[i] for rk in ranks]) for i in range(3)]
    return (*out, shared)


def _require(ok: torch.Tensor, what: str, task) -> None:
    if not bool(ok.all()):
        raise AssertionError(f"{task.type.name} (tile {task.tile}, n {task.n_tile}) read {what} "
                             f"before it was written")


def _run(t, rk: _Rank, ranks: list, prob: Problem) -> None:
    p, r = rk.p, rk.r
    tm = p.tile_m
    I, H = prob.wg.shape[2], prob.xs.shape[2]
    if t.type in (BT.REVERSE_COMBINE, BT.REPULL_X, BT.REVERSE_DISPATCH):
        rows = torch.arange(t.tile * tm + t.n_tile * p.comm_task_rows,
                            t.tile * tm + (t.n_tile + 1) * p.comm_task_rows)
        rows = rows[rk.row_token[rows] >= 0]
        peer, tok, k = rk.row_peer[rows], rk.row_token[rows], rk.row_k[rows]
        if t.type == BT.REVERSE_COMBINE:
            rk.dy[rows] = prob.d_out[peer, tok]
            rk.dy_ok[rows] = True
        elif t.type == BT.REPULL_X:
            rk.x[rows] = prob.xs[peer, tok]
            rk.x_ok[rows] = True
        else:
            _require(rk.dx_ok[rows], "dx rows", t)
            _require(rk.dpre_ok[rows], "partials", t)
            K = prob.idx.shape[2]
            for row, pe, slot in zip(rows.tolist(), peer.tolist(), (tok * K + k).tolist()):
                dst = ranks[pe]
                dst.dx_slot[slot] = rk.dx[row]
                dst.part_slot[slot] = rk.part[row].sum()  # fixed order: N-tile 0 first
                dst.slot_writes[slot] += 1
        return
    if t.type in (BT.FC2_DGRAD, BT.FC1_DGRAD):
        rows = torch.arange(t.tile * tm, (t.tile + 1) * tm)
        valid = rk.row_token[rows] >= 0
        e = int(rk.tile_expert[t.tile])
        if t.type == BT.FC2_DGRAD:
            c0, c1 = t.n_tile * p.dgated_tile_n, min((t.n_tile + 1) * p.dgated_tile_n, I)
            if p.comm_tasks:
                _require(rk.dy_ok[rows[valid]], "d_out rows", t)
                dy = rk.dy[rows]
            else:  # in place: the rows of this rank's own d_out
                dy = torch.zeros(tm, H, dtype=torch.float64)
                dy[valid] = prob.d_out[r, rk.row_token[rows[valid]]]
                rk.dy[rows] = dy
            xr = prob.xs[rk.row_peer[rows].clamp_min(0), rk.row_token[rows].clamp_min(0)]
            g = xr @ prob.wg[r, e, c0:c1].t()  # the saved pre-activations
            u = xr @ prob.wu[r, e, c0:c1].t()
            acc = dy @ prob.wd[r, e][:, c0:c1]
            weight = prob.w[rk.row_peer[rows].clamp_min(0), rk.row_token[rows].clamp_min(0),
                            rk.row_k[rows].clamp_min(0)].unsqueeze(1)
            weight = torch.where(valid.unsqueeze(1), weight, torch.zeros_like(weight))
            sig, silu = _silu_parts(g)
            keep = valid.unsqueeze(1)
            rk.dpre[rows, c0:c1] = torch.where(keep, weight * acc * u * sig * (1 + g * (1 - sig)), 0.0)
            rk.dpre[rows, I + c0:I + c1] = torch.where(keep, weight * acc * silu, 0.0)
            rk.hw[rows, c0:c1] = torch.where(keep, weight * silu * u, 0.0)
            rk.part[rows, t.n_tile] = torch.where(valid, (acc * silu * u).sum(1), 0.0)
            rk.dpre_ok[rows, t.n_tile] = True
        else:
            _require(rk.dpre_ok[rows], "dG | dU", t)
            c0, c1 = t.n_tile * p.dx_tile_n, min((t.n_tile + 1) * p.dx_tile_n, H)
            rk.dx[rows, c0:c1] = (rk.dpre[rows, :I] @ prob.wg[r, e][:, c0:c1]
                                  + rk.dpre[rows, I:] @ prob.wu[r, e][:, c0:c1])
            rk.dx_ok[rows, t.n_tile] = True
        return
    if t.type in (BT.WGRAD_GATE_UP, BT.WGRAD_DOWN):
        e = t.tile
        rows = torch.arange(int(rk.expert_tiles[e]) * tm, int(rk.expert_tiles[e + 1]) * tm)
        _require(rk.dpre_ok[rows], "dG | dU and h'", t)
        if t.type == BT.WGRAD_GATE_UP:
            bm, bn = p.wgrad_gate_up_tile
            m0, m1, n0, n1 = t.m_block * bm, min((t.m_block + 1) * bm, I), t.n_tile * bn, \
                min((t.n_tile + 1) * bn, H)
            valid = rows[rk.row_token[rows] >= 0]
            _require(rk.x_ok[valid], "x rows", t)
            x = rk.x[rows, n0:n1]
            rk.dwg[e, m0:m1, n0:n1] = rk.dpre[rows, m0:m1].t() @ x
            rk.dwu[e, m0:m1, n0:n1] = rk.dpre[rows, I + m0:I + m1].t() @ x
        else:
            bm, bn = p.wgrad_down_tile
            m0, m1, n0, n1 = t.m_block * bm, min((t.m_block + 1) * bm, H), t.n_tile * bn, \
                min((t.n_tile + 1) * bn, I)
            if p.comm_tasks:
                _require(rk.dy_ok[rows[rk.row_token[rows] >= 0]], "d_out rows", t)
            rk.dwd[e, m0:m1, n0:n1] = rk.dy[rows, m0:m1].t() @ rk.hw[rows, n0:n1]
        return
    if t.type in (BT.SHARED_FC2_DGRAD, BT.SHARED_FC1_DGRAD, BT.SHARED_WGRAD_GATE_UP,
                  BT.SHARED_WGRAD_DOWN):
        sg, su, sd = (s[r] for s in prob.shared)
        Is, T = sg.shape[0], prob.xs.shape[1]
        if t.type == BT.SHARED_FC2_DGRAD:
            toks = torch.arange(t.tile * tm, min((t.tile + 1) * tm, T))
            c0, c1 = t.n_tile * p.dgated_tile_n, min((t.n_tile + 1) * p.dgated_tile_n, Is)
            x = prob.xs[r, toks]
            g, u = x @ sg[c0:c1].t(), x @ su[c0:c1].t()
            acc = prob.d_out[r, toks] @ sd[:, c0:c1]
            sig, silu = _silu_parts(g)
            rk.sdpre[toks, c0:c1] = acc * u * sig * (1 + g * (1 - sig))
            rk.sdpre[toks, Is + c0:Is + c1] = acc * silu
            rk.shw[toks, c0:c1] = silu * u
            rk.sdpre_ok[t.tile, t.n_tile] = True
        elif t.type == BT.SHARED_FC1_DGRAD:
            _require(rk.sdpre_ok[t.tile], "shared dG | dU", t)
            toks = torch.arange(t.tile * tm, min((t.tile + 1) * tm, T))
            c0, c1 = t.n_tile * p.dx_tile_n, min((t.n_tile + 1) * p.dx_tile_n, H)
            rk.sdx[toks, c0:c1] = rk.sdpre[toks, :Is] @ sg[:, c0:c1] + rk.sdpre[toks, Is:] @ su[:, c0:c1]
            rk.sdx_ok[t.tile, t.n_tile] = True
        elif t.type == BT.SHARED_WGRAD_GATE_UP:
            _require(rk.sdpre_ok, "shared dG | dU", t)
            bm, bn = p.wgrad_gate_up_tile
            m0, m1, n0, n1 = t.m_block * bm, min((t.m_block + 1) * bm, Is), t.n_tile * bn, \
                min((t.n_tile + 1) * bn, H)
            x = prob.xs[r, :, n0:n1]
            rk.grads_shared[0][m0:m1, n0:n1] = rk.sdpre[:, m0:m1].t() @ x
            rk.grads_shared[1][m0:m1, n0:n1] = rk.sdpre[:, Is + m0:Is + m1].t() @ x
        else:
            _require(rk.sdpre_ok, "shared h", t)
            bm, bn = p.wgrad_down_tile
            m0, m1, n0, n1 = t.m_block * bm, min((t.m_block + 1) * bm, H), t.n_tile * bn, \
                min((t.n_tile + 1) * bn, Is)
            rk.grads_shared[2][m0:m1, n0:n1] = prob.d_out[r, :, m0:m1].t() @ rk.shw[:, n0:n1]
        return
    if t.type == BT.BARRIER:
        return
    if t.type == BT.KSUM:
        T, K = prob.idx.shape[1:]
        toks = range(t.tile * tm + t.n_tile * p.ksum_rows,
                     min(t.tile * tm + (t.n_tile + 1) * p.ksum_rows, T))
        for tok in toks:
            acc = torch.zeros(H, dtype=torch.float64)
            for k in range(K):  # fixed order: k ascending, then the shared row
                slot = tok * K + k
                if p.comm_tasks:
                    if rk.slot_writes[slot] != 1:
                        raise AssertionError(f"KSUM: slot {slot} of rank {r} written "
                                             f"{int(rk.slot_writes[slot])} times")
                    acc += rk.dx_slot[slot]
                    rk.d_w[tok, k] = rk.part_slot[slot]
                else:
                    row = int(rk.slot_row[slot])
                    _require(rk.dx_ok[row], "dx row", t)
                    acc += rk.dx[row]
                    rk.d_w[tok, k] = rk.part[row].sum()
            if prob.shared is not None:
                _require(rk.sdx_ok[tok // tm], "shared dx", t)
                acc += rk.sdx[tok]
            rk.d_x[tok] = acc
        return
    raise AssertionError(f"unknown task type {t.type}")
