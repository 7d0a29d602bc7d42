"""Discrete-event execution of a task graph (model.Graph) on a hardware profile.

Execution follows the megakernel protocol exactly:

- each rank has ``num_comm_sms`` comm SMs and ``num_sms - num_comm_sms`` compute SMs;
- an SM that becomes free takes the next ticket of its role's queue on its rank and holds the
  task until it is done, and once that queue is exhausted the next ticket of the rank's tail
  queue (``Graph.tail_queues``: tasks any free SM takes, the backward's k-sums); if the task's counters are not complete yet, the SM spins (a WAIT span
  in the records) and starts the task the moment the last counter completes;
- a compute task runs for its modelled duration;
- a comm task runs its serial overhead (``hw.comm_serial_s``), then a flow of its payload bytes
  through the fabric. The rest of the per-task cost (``hw.comm_latency_s``, per-row latency
  that a copy overlaps with its transfers) is spent during the flow: the task's per-SM rate is
  capped at ``bytes / (bytes / sm_copy_bytes_per_s + latency)``, so an isolated task takes
  ``serial + latency + bytes / sm_copy_bytes_per_s``, while under contention the link share,
  not a pause, sets its time.

Fabric: every GPU has one egress and one ingress port (``link_bytes_per_s`` each). Active
flows are grouped in classes whose members share the same per-member rate: pull dispatches of
one receiver, combines of one rank, pushes of one (sender, receiver) pair. A member's use of
each port per byte moved is its class row (pull: fraction of its rows from each source peer on
that peer's egress, the non-local fraction on its own ingress). Rates are the weighted max-min
fair allocation (progressive filling) under the port capacities, each member capped at the
per-SM copy rate. A member whose own cap (above) is below its class's rate moves at its cap,
and the port capacity it leaves is filled again by the others (iterated water-filling; exact
when no class is both capped and port-bound, otherwise within a few %). Rates are recomputed whenever a flow starts or ends (events at the same
instant are batched); between those instants every member progresses linearly.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

from ..tasks import Role
from .hardware import HardwareProfile
from .model import Graph

__all__ = ["SimRecords", "run_graph", "max_min_rates"]

_INF = math.inf


@dataclasses.dataclass
class SimRecords:
    take: np.ndarray  # [N] time the SM took the ticket (s)
    start: np.ndarray  # [N] time its counters were complete and work began (s)
    end: np.ndarray  # [N] (s)
    sm: np.ndarray  # [N] SM id on its rank (comm SMs first)
    waited_for: np.ndarray  # [N] global id of the task whose signal ended the wait, -1 if none
    rate_updates: int = 0


def max_min_rates(A: np.ndarray, cap: float, capacity: np.ndarray,
                  pair_src: np.ndarray | None = None, pair_dst: np.ndarray | None = None,
                  pair_n: np.ndarray | None = None, num_ranks: int = 0, rtol: float = 5e-3):
    """Per-member rates under weighted max-min fairness (progressive filling).

    Two families of classes share the ports. Spread classes: ``A[c, p]`` = bytes on port ``p``
    per byte moved, summed over class ``c``'s members. Pair classes (push from ``pair_src`` to
    ``pair_dst`` with ``pair_n`` members): one unit on egress ``src`` and on ingress
    ``num_ranks + dst`` per member (nothing when ``src == dst``: a local copy). All members of
    a class move at the same rate ``<= cap``; port loads stay ``<= capacity``. Raise every
    unfrozen class together; when a port saturates, freeze the classes that use it. Ports
    saturating within ``rtol`` of the lowest level are frozen in the same step (at that level),
    so rates may be up to ``rtol`` below the exact allocation; loads never exceed capacity.
    Returns ``x`` (spread) or ``(x, x_pair)`` when pair classes are given."""
    k, P = A.shape
    x = np.full(k, float(cap))
    uses = A > 1e-15
    frozen = ~uses.any(axis=1)  # classes touching no port only hit the per-SM cap
    denom = A[~frozen].sum(axis=0) if k else np.zeros(P)
    have_pairs = pair_src is not None and pair_src.size > 0
    if have_pairs:
        xp = np.full(pair_src.size, float(cap))
        frozen_p = pair_src == pair_dst
        eg = pair_src
        ing = num_ranks + pair_dst
        w = pair_n.astype(np.float64)
        wl = np.where(frozen_p, 0.0, w)
        denom = denom + np.bincount(eg, wl, P) + np.bincount(ing, wl, P)
    used = np.zeros(P)
    live = denom > 1e-12
    while live.any():
        lam_p = np.full(P, _INF)
        lam_p[live] = (capacity[live] - used[live]) / denom[live]
        lam = float(lam_p.min())
        if lam >= cap:
            break
        lam = max(lam, 0.0)
        bott = lam_p <= lam * (1.0 + rtol) + 1e-300
        hit = ~frozen & uses[:, bott].any(axis=1) if k else np.zeros(0, dtype=bool)
        add = np.zeros(P)
        if hit.any():
            x[hit] = lam
            frozen |= hit
            add += A[hit].sum(axis=0)
        if have_pairs:
            hit_p = ~frozen_p & (bott[eg] | bott[ing])
            if hit_p.any():
                xp[hit_p] = lam
                frozen_p |= hit_p
                wh = w[hit_p]
                add += np.bincount(eg[hit_p], wh, P) + np.bincount(ing[hit_p], wh, P)
        used += lam * add
        denom -= add
        live = (denom > 1e-9 * np.maximum(add.max(initial=0.0), 1.0)) & ~bott & (denom > 1e-12)
    return (x, xp) if pair_src is not None else x


def run_graph(g: Graph, hw: HardwareProfile) -> SimRecords:
    N = len(g)
    R_sim = 1 if g.symmetric else g.num_ranks
    n_comm, n_comp = g.num_comm_sms, g.num_compute_sms
    nports = g.comm_coef.shape[1] if g.comm_coef.size else (2 if g.symmetric else 2 * g.num_ranks)
    capacity = np.full(nports, hw.link_bytes_per_s)
    cap = hw.sm_copy_bytes_per_s
    lat = hw.comm_latency_s

    dur = g.duration.tolist()
    role = g.role.tolist()
    rank = g.rank.tolist()
    cbytes = g.comm_bytes.tolist()
    ccls = g.comm_class.tolist()
    crow = g.comm_row.tolist()
    signal = g.signal.tolist()
    woff = g.wait_off.tolist()
    widx = g.wait_idx.tolist()
    nsig = g.num_signallers.tolist()
    ncnt = len(nsig)
    count = [0] * ncnt
    reach = [0.0] * ncnt
    last_sig = [-1] * ncnt
    waiters: dict[int, list[int]] = {}

    nan = math.nan
    take = [nan] * N
    start = [nan] * N
    end = [nan] * N
    smid = [-1] * N
    waited = [-1] * N

    queues = [[list(map(int, q)) for q in g.queues[r]] for r in range(R_sim)]
    ticket = [[0, 0] for _ in range(R_sim)]
    tails = [list(map(int, g.tail_queues[r])) if g.tail_queues else [] for r in range(R_sim)]
    tail_ticket = [0] * R_sim
    heap: list = []
    seq = 0

    # fluid state: one member slot per comm SM of the group
    nslots = R_sim * n_comm
    slot_task = np.full(nslots, -1, dtype=np.int64)
    slot_rem = np.zeros(nslots)
    slot_cls = np.zeros(nslots, dtype=np.int64)
    slot_rate = np.zeros(nslots)
    slot_cap = np.full(nslots, float(cap))  # per-task rate cap (latency spread over the flow)
    active = np.zeros(nslots, dtype=bool)
    ncls = max(g.num_classes, 1)
    n_spread = g.num_spread_classes
    R = g.num_ranks
    A = np.zeros((max(n_spread, 1), nports))
    members = np.zeros(ncls, dtype=np.int64)
    coef = g.comm_coef
    state = dict(t_last=0.0, t_next=_INF, dirty=False, updates=0)

    EV_COMPUTE_END, EV_FLOW_START, EV_COMM_END = 0, 1, 2

    def push(t, kind, task):
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, task))
        seq += 1

    def try_start(t, now):
        """The SM holding t checks its counters; start now or register as a waiter."""
        ready = take[t]
        lastc = -1
        for c in widx[woff[t]:woff[t + 1]]:
            if count[c] < nsig[c]:
                waiters.setdefault(c, []).append(t)
                return
            if reach[c] > ready:
                ready = reach[c]
                lastc = c
        if lastc >= 0:
            waited[t] = last_sig[lastc]
        s = now if now > ready else ready
        start[t] = s
        if role[t] == Role.COMPUTE:
            push(s + dur[t], EV_COMPUTE_END, t)
        elif cbytes[t] > 0.0:
            push(s + dur[t], EV_FLOW_START, t)
        else:
            push(s + dur[t], EV_COMM_END, t)

    def take_next(r, ro, sm, now):
        q = queues[r][ro]
        k = ticket[r][ro]
        if k < len(q):
            ticket[r][ro] = k + 1
            t = q[k]
        elif tail_ticket[r] < len(tails[r]):  # the role's queue is done: the tail's tickets
            t = tails[r][tail_ticket[r]]
            tail_ticket[r] += 1
        else:
            return
        take[t] = now
        smid[t] = sm
        try_start(t, now)

    def finish(t, now):
        end[t] = now
        c = signal[t]
        count[c] += 1
        if now > reach[c]:
            reach[c] = now
        if count[c] == nsig[c]:
            last_sig[c] = t
            for w in waiters.pop(c, ()):
                try_start(w, now)
        r = rank[t] if not g.symmetric else 0
        # the SM's role, not the task's (a tail task runs on either kind)
        take_next(r, Role.COMM if smid[t] < n_comm else Role.COMPUTE, smid[t], now)

    def advance(now):
        dt = now - state["t_last"]
        if dt > 0.0 and active.any():
            slot_rem[active] -= slot_rate[active] * dt
        state["t_last"] = now

    def solve(Aeff, mem, capv):
        """Per-class rates for the classes with members in ``mem``."""
        act = np.flatnonzero(mem[:n_spread] > 0)
        actp = np.flatnonzero(mem[n_spread:] > 0)
        rate_cls = np.zeros(ncls)
        if actp.size:
            x, xp = max_min_rates(Aeff[act], cap, capv, actp // R, actp % R,
                                  mem[n_spread + actp], R)
            rate_cls[n_spread + actp] = xp
        elif act.size:
            x = max_min_rates(Aeff[act], cap, capv)
        else:
            return rate_cls
        rate_cls[act] = x
        return rate_cls

    def capped_rates(idx, cls_i, r):
        """Members whose own cap is below their class's rate move at the cap; the port
        capacity they leave goes to the others (re-solved without them, until no new member
        is capped)."""
        scap = slot_cap[idx]
        fixed = scap < r
        if not fixed.any():
            return r
        r = np.where(fixed, scap, r)
        for _ in range(8):
            if fixed.all() or not (r[~fixed] < cap * (1.0 - 1e-9)).any():
                break  # nobody left who is port-bound: the freed capacity changes nothing
            A2 = A.copy()
            mem2 = members - np.bincount(cls_i[fixed], minlength=ncls)
            capv = capacity.copy()
            f_cls, f_cap = cls_i[fixed], scap[fixed]
            sp = f_cls < n_spread
            if sp.any():
                rows = coef[np.asarray([crow[int(t)] for t in slot_task[idx[fixed][sp]]])]
                capv -= (f_cap[sp, None] * rows).sum(axis=0)
                np.add.at(A2, f_cls[sp], -rows)
            if (~sp).any():
                pc = f_cls[~sp] - n_spread
                src, dst = pc // R, pc % R
                far = src != dst
                np.subtract.at(capv, src[far], f_cap[~sp][far])
                np.subtract.at(capv, R + dst[far], f_cap[~sp][far])
            A2[:n_spread][mem2[:n_spread] <= 0] = 0.0
            np.maximum(capv, 0.0, out=capv)
            r_un = solve(A2, mem2, capv)[cls_i]
            new = ~fixed & (scap < r_un)
            fixed |= new
            r = np.where(fixed, scap, r_un)
            if not new.any():
                break
        return r

    def recompute(now):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            state["t_next"] = _INF
            return
        rate_cls = solve(A, members, capacity)
        cls_i = slot_cls[idx]
        r = rate_cls[cls_i]
        if lat > 0.0:
            r = capped_rates(idx, cls_i, r)
        slot_rate[:] = 0.0
        slot_rate[idx] = r
        with np.errstate(divide="ignore"):
            tt = np.where(r > 0, slot_rem[idx] / r, _INF)
        state["t_next"] = now + max(float(tt.min()), 0.0)
        state["updates"] += 1

    # t = 0: every SM takes its first ticket
    for r in range(R_sim):
        for sm in range(n_comm):
            take_next(r, Role.COMM, sm, 0.0)
        for sm in range(n_comp):
            take_next(r, Role.COMPUTE, n_comm + sm, 0.0)

    while True:
        th = heap[0][0] if heap else _INF
        tf = state["t_next"]
        if th == _INF and tf == _INF:
            break
        if tf <= th:
            now = tf
            advance(now)
            idx = np.flatnonzero(active)
            done = idx[slot_rem[idx] <= slot_rate[idx] * 1e-12 + 1e-6]
            if done.size == 0:  # numerical: finish the closest one
                done = idx[[int(np.argmin(slot_rem[idx] / np.maximum(slot_rate[idx], 1e-30)))]]
            for s in done.tolist():
                t = int(slot_task[s])
                cl = int(slot_cls[s])
                members[cl] -= 1
                if cl < n_spread:
                    A[cl] -= coef[crow[t]]
                    if members[cl] == 0:
                        A[cl] = 0.0
                active[s] = False
                slot_task[s] = -1
                slot_rate[s] = 0.0
                state["dirty"] = True
                finish(t, now)
        else:
            now = th
        while heap and heap[0][0] <= now:
            _, _, kind, t = heapq.heappop(heap)
            if kind == EV_COMPUTE_END or kind == EV_COMM_END:
                finish(t, now)
            else:  # EV_FLOW_START
                advance(now)
                r = rank[t] if not g.symmetric else 0
                s = r * n_comm + smid[t]
                slot_task[s] = t
                slot_rem[s] = cbytes[t]
                slot_cap[s] = hw.comm_flow_cap(cbytes[t])
                cl = ccls[t]
                slot_cls[s] = cl
                active[s] = True
                if cl < n_spread:
                    A[cl] += coef[crow[t]]
                members[cl] += 1
                state["dirty"] = True
        if state["dirty"]:
            advance(now)
            recompute(now)
            state["dirty"] = False

    undone = [i for i in range(N) if end[i] != end[i]]
    if undone:
        stuck = sorted({(rank[i], role[i]) for i in undone})[:6]
        raise RuntimeError(
            f"simulation deadlocked: {len(undone)} of {N} tasks never ran (first (rank, role) "
            f"queues stuck: {stuck}); the task graph or queue orders form a cycle")
    return SimRecords(take=np.asarray(take), start=np.asarray(start), end=np.asarray(end),
                      sm=np.asarray(smid), waited_for=np.asarray(waited),
                      rate_updates=state["updates"])
