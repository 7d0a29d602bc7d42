"""The backward megakernel's task queues (mok_cute/megakernel_backward.py over
tasks_backward.py's list), on the CPU: the group tail queues the barrier then the k-sums on the
comm CTAs; the dgrad queue holds each dgrad once in list order, every FC2 dgrad before any FC1
dgrad, the pingpong phase as its head; the weight-gradient tail holds each expert tile once;
the kernel's walk runs each live task once; the publish-defer rule cannot deadlock the walk;
an empty walk decodes a task inside the tables."""

from __future__ import annotations

import pytest


def test_the_group_tails_list_queues_the_barrier_then_the_ksums_on_the_comm_ctas():
    """With the group tail the launch's comm queue ends in the BARRIER (after every push and
    every x re-pull) and one KSUM per 32 of the rank's tokens; the compute queue is the one
    without it; without the tail neither kind is queued."""
    from mok_cute import megakernel_backward as mb
    from mok_cute import tasks_backward as tb

    BT, BC = tb.BackwardTaskType, tb.BackwardCounter
    tl, kinds = mb.task_list(6, 4, 256, 128, comm=True, tail_tokens=300, top_k=4)
    tl.check()
    assert BT.BARRIER in kinds and BT.KSUM in kinds
    qtab = tb.queue_tables(tl, kinds=kinds)[0]
    comm = [tl[int(i)] for i in qtab[int(tb.Role.COMM)] if i >= 0]
    ksums = -(-300 // 128) * (128 // 32)
    assert [t.type for t in comm[-ksums - 1:]] == [BT.BARRIER] + [BT.KSUM] * ksums
    assert sorted((t.tile, t.n_tile) for t in comm if t.type == BT.KSUM) == [
        (s, c) for s in range(3) for c in range(4)]
    barrier = comm[-ksums - 1]
    assert sorted(barrier.waits) == [(BC.X_PULLED, 0, 6, 4), (BC.PUSHED, 0, 6, 4)]
    bare, bare_kinds = mb.task_list(6, 4, 256, 128, comm=True)
    assert BT.BARRIER not in bare_kinds and BT.KSUM not in bare_kinds
    compute = lambda t, k: [(x.type, x.tile, x.n_tile, x.m_block)  # noqa: E731
                            for x in (t[int(i)] for i in tb.queue_tables(t, kinds=k)[0][1] if i >= 0)]
    assert compute(tl, kinds) == compute(bare, bare_kinds)


@pytest.mark.parametrize("capacity_tiles,hidden,inter", [(40, 7168, 2048), (7, 576, 192),
                                                         (1, 512, 2880)])
def test_dgrad_queue_holds_each_dgrad_once_in_list_order(capacity_tiles, hidden, inter):
    from mok_cute import tasks_backward as tb

    per_mb = 8  # the list's minibatches (the launch itself queues one: test below)
    params = tb.BackwardListParams(hidden=hidden, intermediate=inter, num_tokens=0, top_k=1,
                                   dgated_tile_n=256, dx_tile_n=256,
                                   minibatch_tokens=per_mb * 128, comm_tasks=False)
    tl = tb.build_backward_static(capacity_tiles, 1, params)
    tl.check()
    kinds = (tb.BackwardTaskType.FC2_DGRAD, tb.BackwardTaskType.FC1_DGRAD)
    qtab, live_len, _ = tb.queue_tables(tl, kinds=kinds)
    queue = qtab[int(tb.Role.COMPUTE)]
    queue = queue[queue >= 0]
    assert list(queue) == sorted(queue)
    # raster order inside a minibatch's block: groups of 8 M-tiles, N-tiles outer
    fc2 = [(tl[int(i)].tile, tl[int(i)].n_tile) for i in queue
           if tl[int(i)].type == tb.BackwardTaskType.FC2_DGRAD and tl[int(i)].minibatch == 0]
    n_dgated = -(-inter // 256)
    first = [(j, n) for n in range(n_dgated) for j in range(min(8, capacity_tiles))]
    assert fc2[:len(first)] == first
    n_dx = -(-hidden // 256)
    types = [tl[int(i)].type for i in queue]
    assert types.count(tb.BackwardTaskType.FC2_DGRAD) == capacity_tiles * n_dgated
    assert types.count(tb.BackwardTaskType.FC1_DGRAD) == capacity_tiles * n_dx
    # live prefix of m minibatches: every dgrad of their tiles; past them only the next
    # minibatch's FC2 dgrads (queued ahead of FC1's), which the kernel skips as dead
    row = live_len[int(tb.Role.COMPUTE)]
    for live in range(len(row)):
        prefix = [tl[int(i)] for i in queue[:row[live]]]
        live_tiles = set(range(min(live * per_mb, capacity_tiles)))
        for kind in kinds:
            assert {(t.tile, t.n_tile) for t in prefix if t.type == kind and t.tile in live_tiles} \
                == {(t.tile, t.n_tile) for t in tl if t.type == kind and t.tile in live_tiles}
        assert all(t.type == kinds[0] and t.minibatch == live for t in prefix
                   if t.tile not in live_tiles)
    with pytest.raises(ValueError, match="waits on"):
        tb.queue_tables(tl, kinds=(tb.BackwardTaskType.FC1_DGRAD,))


@pytest.mark.parametrize("capacity_tiles,experts,hidden,inter", [(40, 8, 7168, 2048),
                                                                 (7, 3, 576, 192),
                                                                 (2, 1, 2880, 2880)])
def test_weight_gradient_tail_holds_each_expert_tile_once(capacity_tiles, experts, hidden, inter):
    from mok_cute import megakernel_backward as mb
    from mok_cute import tasks_backward as tb

    tl, kinds = mb.task_list(capacity_tiles, experts, hidden, inter)
    tl.check()
    qtab, live_len, tail_begin = tb.queue_tables(tl, kinds=kinds)
    queue = qtab[int(tb.Role.COMPUTE)]
    queue = queue[queue >= 0]
    tail = [tl[int(i)] for i in queue[tail_begin[int(tb.Role.COMPUTE)]:]]
    head = [tl[int(i)] for i in queue[:tail_begin[int(tb.Role.COMPUTE)]]]
    wgrad_kinds = (tb.BackwardTaskType.WGRAD_DOWN, tb.BackwardTaskType.WGRAD_GATE_UP)
    assert all(t.type not in wgrad_kinds for t in head)
    # the whole live prefix is dgrads: a CTA runs its dgrads, then its weight gradients
    assert live_len[int(tb.Role.COMPUTE)][-1] == len(head)
    want = {(tb.BackwardTaskType.WGRAD_DOWN, e, m, n) for e in range(experts)
            for m in range(-(-hidden // 256)) for n in range(-(-inter // 128))}
    want |= {(tb.BackwardTaskType.WGRAD_GATE_UP, e, m, n) for e in range(experts)
             for m in range(-(-inter // 128)) for n in range(-(-hidden // 128))}
    got = [(t.type, t.tile, t.m_block, t.n_tile) for t in tail]
    assert len(got) == len(set(got)) and set(got) == want
    assert [t.tile for t in tail] == sorted(t.tile for t in tail)  # expert by expert
    for t in tail:  # each waits on its expert's dgrads, resolved on the device
        assert t.waits == ((tb.BackwardCounter.DGATED, tb.EXPERT_TILES, tb.EXPERT_TILES,
                            -(-inter // mb.fc2_tile_n(hidden))),)


@pytest.mark.parametrize("capacity_tiles,experts", [(40, 8), (7, 3), (13, 2)])
def test_the_kernels_walk_runs_each_live_task_once_dgrads_first(capacity_tiles, experts):
    """The kernel's walk over the host's tables, for every live tile count: the dgrads by
    static positions (``BackwardMegakernelSm90._index`` inside the live prefix), the weight
    gradients by tickets (positions ``tail_begin + t``, t = 0, 1, ... from one counter). Each
    dgrad of a live M-tile and every weight-gradient tile run once, nothing of a dead
    minibatch runs, every dgrad wait's signallers sit at lower positions, and the weight
    gradients wait on dgrads only (the deadlock-freedom premise: CTAs take their dgrad
    positions in increasing order, and nothing a dgrad waits on is taken by ticket)."""
    from mok_cute import megakernel_backward as mb
    from mok_cute import tasks_backward as tb

    hidden, inter = 576, 320
    tl, kinds = mb.task_list(capacity_tiles, experts, hidden, inter)
    qtab, live_len, tail_begin = tb.queue_tables(tl, kinds=kinds)
    queue = qtab[int(tb.Role.COMPUTE)]
    queue = list(queue[queue >= 0])
    per_mb = mb.tiles_per_minibatch(capacity_tiles)
    tail = int(tail_begin[int(tb.Role.COMPUTE)])
    wgrad = (tb.BackwardTaskType.WGRAD_DOWN, tb.BackwardTaskType.WGRAD_GATE_UP)
    dgrad = (tb.BackwardTaskType.FC2_DGRAD, tb.BackwardTaskType.FC1_DGRAD)
    assert all(tl[int(i)].type in wgrad for i in queue[tail:])
    for num_tiles in range(capacity_tiles + 1):
        live = -(-num_tiles // per_mb)
        prefix = int(live_len[int(tb.Role.COMPUTE)][min(live, live_len.shape[1] - 1)])
        walk = queue[:prefix]
        tickets = queue[tail:]
        run = [i for i in walk if tl[int(i)].tile < num_tiles] + tickets
        want = [t.index for t in tl if t.type in kinds
                and (t.type in wgrad or t.tile < num_tiles)]
        assert sorted(run) == sorted(want) and len(set(run)) == len(run), num_tiles
        assert all(tl[int(i)].type in dgrad for i in walk)
        position = {int(i): p for p, i in enumerate(walk)}
        for i in run:
            for group, first, count, _ in tl[int(i)].waits:
                signallers = [j for j in run if tl[int(j)].signal[0] == group and (
                    first == tb.EXPERT_TILES or first <= tl[int(j)].signal[1] < first + count)]
                assert all(tl[int(j)].type in dgrad for j in signallers)
                if tl[int(i)].type in dgrad:
                    assert all(position[int(j)] < position[int(i)] for j in signallers)


@pytest.mark.parametrize("form", [{}, {"comm": True}, {"comm": True, "tail_tokens": 256, "top_k": 4},
                                  {"shared": (256, 576, 128)}])
def test_the_defer_rules_premises_hold_in_every_list_form(form):
    """The consumers' defer rule (kernels/megakernel/backward.py's docstring: a dgrad's publish
    waits past the CTA's next mainloop when the next task waits on nothing or on PULLED, or the
    counter is FC1_DGRAD's) reads the next task's first wait only, and counts on pulls that wait
    on nothing and come before every push in the comm queue (a comm CTA's walk is a strided
    subset of it): no dgrad has a second wait, no pull a wait, no push precedes a pull."""
    from mok_cute import megakernel_backward as mb
    from mok_cute import tasks_backward as tb

    BT = tb.BackwardTaskType
    dgrads = {BT.FC2_DGRAD, BT.FC1_DGRAD, BT.SHARED_FC2_DGRAD, BT.SHARED_FC1_DGRAD}
    tl, kinds = mb.task_list(40, 8, 576, 320, **form)
    assert BT.FC1_DGRAD in {t.type for t in tl}
    assert all(len(t.waits) <= 1 for t in tl if t.type in dgrads)
    assert all(not t.waits for t in tl if t.type == BT.REVERSE_COMBINE)
    comm = tb.queue_tables(tl, kinds=kinds)[0][int(tb.Role.COMM)]
    types = [tl[int(i)].type for i in comm if i >= 0]
    pulls = [p for p, t in enumerate(types) if t == BT.REVERSE_COMBINE]
    pushes = [p for p, t in enumerate(types) if t == BT.REVERSE_DISPATCH]
    assert bool(pulls) == bool(pushes) == bool(form.get("comm"))
    assert not pushes or max(pulls) < min(pushes)


def _stuck_ctas(cap, experts, hidden, inter, shared, num_ctas, defer_rule):
    """The compute CTAs' static dgrad walk at one rank played on the host: each CTA takes its
    positions in order, a task runs once its waits hold, and its publish goes out at once or,
    where ``defer_rule(task, next_task)`` says so, after its next task's waits held (its
    mainloop). Returns the CTAs left waiting (a deadlock) once nothing can move."""
    from mok_cute import megakernel_backward as mb
    from mok_cute import tasks_backward as tb

    tl, kinds = mb.task_list(cap, experts, hidden, inter, shared=shared)
    queue, live, _, qlen = mb.compute_queue(tl, kinds)
    live_len = int(live[-1])
    count = {g: [0] * tl.counter_sizes.get(g, 1) for g in tb.BackwardCounter}
    task = lambda q: tl[int(queue[q])]  # noqa: E731
    ready = lambda t: all(count[g][i] >= n for g, f, c, n in t.waits  # noqa: E731
                          for i in range(f, f + c))

    def publish(t):
        count[t.signal[0]][t.signal[1]] += 1

    start = 0
    if mb.fc2_pingpong(hidden):  # the pingpong phase publishes as it goes (no waits)
        start = min(mb.fc2_head(tl, queue[:qlen]), live_len)
        for q in range(start):
            publish(task(q))
    pos = [c + max(0, -(-(start - c) // num_ctas)) * num_ctas for c in range(num_ctas)]
    held = [None] * num_ctas
    moved = True
    while moved:
        moved = False
        for c in range(num_ctas):
            while pos[c] < live_len and ready(task(pos[c])):
                if held[c] is not None:
                    publish(held[c])
                    held[c] = None
                nxt = pos[c] + num_ctas
                if nxt < live_len and defer_rule(task(pos[c]), task(nxt)):
                    held[c] = task(pos[c])
                else:
                    publish(task(pos[c]))
                pos[c], moved = nxt, True
            if pos[c] >= live_len and held[c] is not None:
                publish(held[c])
                held[c], moved = None, True
    return [c for c in range(num_ctas) if pos[c] < live_len]


def test_the_defer_rule_cannot_deadlock_the_walk_and_the_wider_one_did():
    """The kernel's defer rule (backward.py's docstring) on the host walk over shapes with and
    without the shared expert, both FC2_DGRAD forms and grids smaller than the list: no CTA
    stuck. The wider rule it replaced ("unless the next task waits on this task's group")
    leaves CTAs stuck on a dsv3-sized shape with the shared expert (found by a review's
    simulation; no GPU test reaches it: their shared-expert shapes have H <= 576)."""
    from mok_cute.schedule import schedule_capacity
    from mok_cute.tasks_backward import BackwardCounter as BC

    def rule(t, nxt):  # the kernel's, at one rank (no PULLED waits)
        return not nxt.waits or nxt.waits[0][0] == BC.PULLED or t.signal[0] in (BC.DX_DONE,
                                                                                  BC.SHARED_DX)

    def wider(t, nxt):
        return not nxt.waits or nxt.waits[0][0] != t.signal[0]

    for hidden, inter, shared_inter in [(7168, 2048, 2048), (2048, 768, 768), (576, 320, 192)]:
        for experts, tokens, top_k in [(4, 1, 1), (4, 256, 2), (8, 384, 4), (2, 128, 1)]:
            cap = schedule_capacity(1, tokens, top_k, experts, 128) // 128
            for shared in [(0, 0, 0), (tokens, shared_inter, 0)]:
                for num_ctas in [132, 100, 16]:
                    assert not _stuck_ctas(cap, experts, hidden, inter, shared, num_ctas, rule), (
                        hidden, experts, tokens, top_k, shared, num_ctas)
    assert _stuck_ctas(4, 4, 7168, 2048, (1, 2048, 0), 132, wider)


@pytest.mark.parametrize("experts", [0, 3])
def test_an_empty_walk_decodes_a_task_inside_the_tables(experts):
    """A rank that received nothing (num_tiles = 0) walks nothing, but each CTA still decodes
    the task at its first position (``_task`` clamps it into the walk): that read stays inside
    the queue tensor and names a real task (it ran off the queue on the H200: an illegal
    address in the group backward of such a rank)."""
    from mok_cute import megakernel_backward as mb

    queue, live_len, tail, queue_len = mb.compute_queue(*mb.task_list(7, experts, 576, 320))
    tasks = len(mb.task_list(7, experts, 576, 320)[0])
    prefix = int(live_len[0])
    walk_len = prefix + queue_len - tail
    pos = max(min(0, walk_len - 1), 0)
    at = pos if pos < prefix else tail + pos - prefix
    assert (walk_len == 0) == (experts == 0)
    assert at < len(queue) and 0 <= int(queue[at]) < tasks


def test_the_launch_queues_every_fc2_dgrad_before_any_fc1_dgrad():
    """One minibatch (``tiles_per_minibatch``): the FC1 dgrads never share the grid with
    FC2 dgrads of later M-tiles, whatever the capacity."""
    from mok_cute import megakernel_backward as mb
    from mok_cute import tasks_backward as tb

    for capacity_tiles, experts in ((40, 0), (1100, 0), (7, 3)):
        tl, kinds = mb.task_list(capacity_tiles, experts, 2048, 768)
        queue, live_len, tail, queue_len = mb.compute_queue(tl, kinds)
        types = [tl[int(i)].type for i in queue[:tail]]
        fc1 = types.index(tb.BackwardTaskType.FC1_DGRAD)
        assert set(types[:fc1]) == {tb.BackwardTaskType.FC2_DGRAD}
        assert set(types[fc1:]) == {tb.BackwardTaskType.FC1_DGRAD}
        assert list(live_len) == [0, tail]  # no live tile, or every dgrad


@pytest.mark.parametrize("hidden,pingpong", [(576, True), (6144, True), (7168, False)])
def test_the_pingpong_phase_is_the_queues_fc2_dgrad_head(hidden, pingpong):
    """Up to FC2_DGRAD_PINGPONG_MAX_K the launch runs FC2_DGRAD as 128-wide pingpong tiles
    (the one-GPU launch's form there): its list has 128-wide FC2 N-tiles, FC1_DGRAD waits for
    all of them, and the scalar that ends the pingpong phase counts the queue's FC2_DGRAD head."""
    from mok_cute import megakernel_backward as mb
    from mok_cute import tasks_backward as tb

    inter, capacity_tiles, experts = 320, 7, 3
    assert mb.fc2_pingpong(hidden) == pingpong
    n_fc2 = -(-inter // (128 if pingpong else 256))
    tl, kinds = mb.task_list(capacity_tiles, experts, hidden, inter)
    fc2 = [t for t in tl if t.type == tb.BackwardTaskType.FC2_DGRAD]
    assert len(fc2) == capacity_tiles * n_fc2
    for t in tl:
        if t.type == tb.BackwardTaskType.FC1_DGRAD:
            assert t.waits == ((tb.BackwardCounter.DGATED, t.tile, 1, n_fc2),)
    queue, _, _, queue_len = mb.compute_queue(tl, kinds)
    count = mb.fc2_head(tl, queue[:queue_len])
    assert count == len(fc2)
    assert all(tl[int(i)].type == tb.BackwardTaskType.FC2_DGRAD for i in queue[:count])
    with pytest.raises(AssertionError, match="must lead"):
        mb.fc2_head(tl, queue[::-1])
