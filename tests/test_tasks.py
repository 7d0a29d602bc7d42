"""CPU tests of the megakernel task list (mok_cute.tasks)."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from mok_cute import task_encoding as TE
from mok_cute import tasks as T
from mok_cute import tickets
from mok_cute.tasks import Role, TaskType

SMALL = dict(hidden=512, intermediate=192, num_tokens=300, top_k=2, tile_m=64, fc1_tile_n=128,
             fc2_tile_n=192)


def _build(counts, **kw):
    args = dict(SMALL, minibatch_tokens=128, ring_tokens=256, shared_intermediate=128)
    args.update(kw)
    return T.build_from_expert_counts(counts, **args)


CONFIGS = [
    dict(),
    dict(shared_intermediate=0),
    dict(finish=False),
    dict(dispatch_wait="minibatch"),
    dict(comm_task_rows=16),
    dict(minibatch_tokens=64, ring_tokens=64),  # ring = one minibatch: tightest legal ring
    dict(minibatch_tokens=192, ring_tokens=320),  # ring not a multiple of the minibatch
    dict(ring_tokens=4096),  # ring larger than every routed row: no reuse
    dict(dispatch_lookahead_tokens=0),
]
COUNTS = [
    [300, 0, 129, 64, 1, 77, 0, 250],  # empty experts, partial tiles
    [0, 0, 900, 0],  # one expert takes everything
    [5],
]


def _wait_tasks(tl, group, first, count):
    """Tasks that signal a counter in [first, first+count) of group."""
    m = (tl.signal_group == int(group)) & (tl.signal_index >= first) & (
        tl.signal_index < first + count)
    return set(np.flatnonzero(m).tolist())


# ------------------------------------------------------------------------------------------
# structure


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("counts", COUNTS)
def test_every_dependency_points_to_a_lower_index(counts, cfg):
    tl = _build(counts, **cfg)
    off, deps = tl.deps_csr()
    owner = np.repeat(np.arange(len(tl)), np.diff(off))
    assert deps.size > 0
    assert np.all(deps < owner)
    # the queues are the list restricted to one role, so each is increasing
    for r in Role:
        assert np.all(np.diff(tl.queue(r)) > 0)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_wait_targets_equal_the_number_of_signalling_tasks(cfg):
    tl = _build(COUNTS[0], **cfg)
    sig = tl.counter_offsets[tl.signal_group] + tl.signal_index
    signals = np.bincount(sig, minlength=int(tl.counter_offsets[-1]))
    nwaits = 0
    for i in range(len(tl)):
        for g, first, count, target in tl.waits[i]:
            if g < 0:
                continue
            base = tl.counter_offsets[g] + first
            assert np.all(signals[base:base + count] == target), (i, g, first, count, target)
            nwaits += 1
    assert nwaits > len(tl) // 2


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("counts", COUNTS)
def test_every_row_and_tile_is_covered_exactly_once(counts, cfg):
    tl = _build(counts, **cfg)
    p = tl.params
    nt = tl.num_m_tiles
    expected_tiles = T.tile_rows_from_expert_counts(counts, p.tile_m)
    assert nt == len(expected_tiles)
    assert tl.tile_rows.sum() == sum(counts)
    for ttype in (TaskType.DISPATCH, TaskType.COMBINE):
        idx = np.flatnonzero(tl.type == ttype)
        cover = np.zeros(nt * p.tile_m, dtype=np.int64)
        for i in idx:
            cover[tl.row_begin[i]:tl.row_end[i]] += 1
        assert np.all(cover == 1), ttype  # no padded row dropped or moved twice
        # payload bytes count only the real rows
        assert tl.bytes[idx].sum() == sum(counts) * p.hidden * 2
    for ttype, n in ((TaskType.FC1, tl.fc1_n_tiles), (TaskType.FC2, tl.fc2_n_tiles)):
        idx = np.flatnonzero(tl.type == ttype)
        pairs = set(zip(tl.m_tile_begin[idx].tolist(), tl.n_tile[idx].tolist()))
        assert pairs == {(j, k) for j in range(nt) for k in range(n)}
        assert len(idx) == nt * n
    # FLOPs of FC1 + FC2 over all N-tiles = 2*tile_m*(2I*H + H*I) per M-tile
    fl = tl.flops[(tl.type == TaskType.FC1) | (tl.type == TaskType.FC2)].sum()
    assert fl == nt * 2 * p.tile_m * 3 * p.intermediate * p.hidden
    shared = np.flatnonzero(tl.type == TaskType.SHARED_FC1)
    if p.shared_intermediate:
        assert tl.flops[shared].sum() == 2 * p.tile_m * -(-p.num_tokens // p.tile_m) * (
            2 * p.shared_intermediate) * p.hidden
    else:
        assert shared.size == 0
    assert (tl.type == TaskType.BARRIER).sum() == (1 if p.finish else 0)
    ksum = np.flatnonzero(tl.type == TaskType.KSUM)
    assert ksum.size == (-(-p.num_tokens // p.ksum_rows) if p.finish else 0)
    if p.finish:  # every local token is k-summed exactly once
        cover = np.zeros(p.num_tokens, dtype=np.int64)
        for i in ksum:
            cover[tl.row_begin[i]:tl.row_end[i]] += 1
            assert tl.m_tile_begin[i] == tl.row_begin[i] // p.tile_m
        assert np.all(cover == 1)


def test_dependencies_follow_the_dataflow():
    tl = _build(COUNTS[0], minibatch_tokens=128, ring_tokens=192)
    rt = tl.ring_tiles
    fc1 = {(t.m_tile_begin, t.n_tile): t.index for t in tl if t.type == TaskType.FC1}
    fc2 = {(t.m_tile_begin, t.n_tile): t.index for t in tl if t.type == TaskType.FC2}
    disp = {t.m_tile_begin: t.index for t in tl if t.type == TaskType.DISPATCH}
    comb = {t.m_tile_begin: t.index for t in tl if t.type == TaskType.COMBINE}
    n1, n2 = tl.fc1_n_tiles, tl.fc2_n_tiles
    for (j, n), i in fc2.items():
        want = {fc1[(j, k)] for k in range(n1)}  # FC2 needs the full h row
        if j >= rt:
            want.add(comb[j - rt])  # ring reuse of the y rows
        assert set(tl.deps(i).tolist()) == want
    for (j, n), i in fc1.items():
        want = {disp[j]}
        if j >= rt:
            want |= {fc2[(j - rt, k)] for k in range(n2)}
        assert set(tl.deps(i).tolist()) == want
    for j, i in disp.items():
        want = {fc1[(j - rt, k)] for k in range(n1)} if j >= rt else set()
        assert set(tl.deps(i).tolist()) == want
    for j, i in comb.items():
        assert set(tl.deps(i).tolist()) == {fc2[(j, k)] for k in range(n2)}
    barrier = int(np.flatnonzero(tl.type == TaskType.BARRIER)[0])
    assert set(tl.deps(barrier).tolist()) == set(comb.values())
    # minibatch-granular dispatch wait: every FC1 of a minibatch waits on all its dispatches
    tlm = _build(COUNTS[0], dispatch_wait="minibatch")
    for t in tlm:
        if t.type == TaskType.FC1:
            tiles = range(t.minibatch * tlm.tiles_per_minibatch,
                          min((t.minibatch + 1) * tlm.tiles_per_minibatch, tlm.num_m_tiles))
            d = {u.index for u in tlm if u.type == TaskType.DISPATCH and u.m_tile_begin in tiles}
            assert d <= set(t.deps)


def test_shared_expert_is_first_and_ksum_last_in_the_compute_queue():
    tl = _build(COUNTS[0])
    q = tl.queue(Role.COMPUTE)
    types = tl.type[q]
    n_shared = int(((types == TaskType.SHARED_FC1) | (types == TaskType.SHARED_FC2)).sum())
    assert set(types[:n_shared].tolist()) == {TaskType.SHARED_FC1, TaskType.SHARED_FC2}
    n_ksum = int((types == TaskType.KSUM).sum())
    assert np.all(types[-n_ksum:] == TaskType.KSUM)
    assert tl.type[tl.queue(Role.COMM)[-1]] == TaskType.BARRIER
    # minibatches appear in order in the compute queue
    mb = tl.minibatch[q]
    mb = mb[mb >= 0]
    assert np.all(np.diff(mb) >= 0)


@pytest.mark.parametrize("cfg", CONFIGS + [dict(comm_tasks=False, ring_tokens=4096),
                                     dict(fc1_lead=2, tile_order="n_major", ring_tokens=4096),
                                     dict(comm_tasks=False, fc1_lead=1, ring_tokens=4096,
                                          tile_order="n_major")])
@pytest.mark.parametrize("counts", COUNTS)
def test_ksum_tasks_close_the_compute_queue(counts, cfg):
    """The one-rank k-sum reuses the GEMM stage buffers (megakernel KSUM_STAGED) because no
    GEMM task follows a KSUM in the compute queue; a list where one does is told apart."""
    tl = _build(counts, **cfg)
    assert tl.ksum_closes_compute_queue()
    q = tl.queue(Role.COMPUTE)
    ksum = q[tl.type[q] == TaskType.KSUM]
    if ksum.size and ksum.size < q.size:
        gemm = q[tl.type[q] != TaskType.KSUM][-1]
        tl.type[[ksum[0], gemm]] = tl.type[[gemm, ksum[0]]]  # a GEMM moved behind a KSUM
        assert not tl.ksum_closes_compute_queue()


# ------------------------------------------------------------------------------------------
# errors


def test_ring_smaller_than_a_minibatch_is_an_error():
    with pytest.raises(ValueError, match="ring_tokens"):
        _build(COUNTS[0], minibatch_tokens=256, ring_tokens=192)


@pytest.mark.parametrize("kw, name", [
    (dict(ring_tokens=200), "ring_tokens"),
    (dict(minibatch_tokens=100), "minibatch_tokens"),
    (dict(comm_task_rows=48), "comm_task_rows"),
    (dict(dispatch_wait="expert"), "dispatch_wait"),
    (dict(hidden=0), "hidden"),
    (dict(rank=3, num_ranks=2), "rank"),
    (dict(fc1_tile_n=3), "fc1_tile_n"),
    (dict(ksum_rows=48), "ksum_rows"),
])
def test_bad_arguments_are_named(kw, name):
    with pytest.raises(ValueError, match=name):
        _build(COUNTS[0], **kw)


def test_bad_types_and_rows():
    with pytest.raises(TypeError, match="hidden"):
        _build(COUNTS[0], hidden=512.0)
    with pytest.raises(ValueError, match="tile_rows"):
        T.build_task_list([65], **dict(SMALL, minibatch_tokens=64, ring_tokens=64))
    with pytest.raises(ValueError, match="expert_counts"):
        T.tile_rows_from_expert_counts([3, -1], 64)
    with pytest.raises(ValueError, match="capacity"):
        T.build_static(100, **dict(SMALL, minibatch_tokens=64, ring_tokens=64))


# ------------------------------------------------------------------------------------------
# encoding


def test_encode_is_int32_and_round_trips():
    tl = _build(COUNTS[0], comm_task_rows=32)
    enc = TE.encode(tl)
    assert enc.dtype.is_floating_point is False and str(enc.dtype) == "torch.int32"
    assert tuple(enc.shape) == (len(tl), T.TASK_WORDS)
    rows = TE.decode(enc)
    for t, r in zip(tl, rows):
        assert r["type"] == t.type and r["role"] == t.role and r["minibatch"] == t.minibatch
        assert (r["m_tile_begin"], r["m_tile_end"], r["n_tile"]) == (
            t.m_tile_begin, t.m_tile_end, t.n_tile)
        assert (r["row_begin"], r["row_end"], r["ring_row_begin"]) == (
            t.row_begin, t.row_end, t.ring_row_begin)
        assert r["signal"] == t.signal
        assert tuple(r["waits"]) == t.waits
    # ring rows: routed tasks map padded rows into the ring, never across its end
    p = tl.params
    routed = tl.minibatch >= 0
    assert np.all(tl.ring_row_begin[routed] == tl.row_begin[routed] % p.ring_tokens)
    assert np.all(tl.ring_row_begin[routed] + (tl.row_end - tl.row_begin)[routed]
                  <= p.ring_tokens)


def test_build_is_deterministic():
    a = TE.encode(_build(COUNTS[0]))
    b = TE.encode(_build(list(COUNTS[0])))
    assert bool((a == b).all())
    s1 = TE.encode_device(T.build_static(1024, **dict(SMALL, minibatch_tokens=128,
                                                           ring_tokens=256)))
    s2 = TE.encode_device(T.build_static(1024, **dict(SMALL, minibatch_tokens=128,
                                                           ring_tokens=256)))
    for x, y in zip(s1, s2):
        if hasattr(x, "shape"):
            assert bool((x == y).all())
        else:
            assert x == y


# ------------------------------------------------------------------------------------------
# execution: a host model of the kernel protocol with random task durations


def _execute(tl, n_comm, n_comp, seed, num_tiles=None):
    """Run the list the way the megakernel does: CTAs of each role take tickets, walk the
    queue through the live-prefix table, skip dead tasks, spin on (clipped) waits, run for a
    random time and signal. Returns {index: (start, end)} of the tasks that ran (no-ops
    included). Fails on a deadlock."""
    rng = np.random.default_rng(seed)
    dev = TE.encode_device(tl)
    nt_static = tl.num_m_tiles
    if num_tiles is None:
        num_tiles = nt_static
    live = TE.live_minibatches(num_tiles, tl.tiles_per_minibatch)
    live_tile_end = min(live * tl.tiles_per_minibatch, nt_static)
    off = tl.counter_offsets
    counters = np.zeros(int(off[-1]), dtype=np.int64)
    ticket = [0, 0]
    qlen = dev.queue_len.tolist()
    live_len = [int(dev.queue_live_len[r, live]) for r in (0, 1)]
    tail = dev.queue_tail_begin.tolist()
    queues = dev.queues.tolist()

    def fetch(role):
        while True:
            q = ticket[role]
            ticket[role] += 1
            pos = q if q < live_len[role] else tail[role] + (q - live_len[role])
            if pos >= qlen[role]:
                return None
            i = queues[role][pos]
            if tl.minibatch[i] >= live:
                continue  # dead: skipped without signalling
            return i

    def satisfied(i):
        for g, first, count, target in tl.waits[i]:
            if g < 0:
                continue
            end = first + count
            if g in [int(x) for x in T._TILE_GROUPS]:
                end = min(end, live_tile_end)
            elif g in [int(x) for x in T._MINIBATCH_GROUPS]:
                end = min(end, live)
            if end > first and counters[off[g] + first: off[g] + end].min() < target:
                return False
        return True

    ctas = [[r, None] for r in [0] * n_comm + [1] * n_comp]
    running = []  # heap of (end, cta index, task)
    spans = {}
    now = 0.0
    for c in ctas:
        c[1] = fetch(c[0])
    while True:
        for k, c in enumerate(ctas):
            i = c[1]
            if i is not None and i not in spans and satisfied(i):
                dur = rng.exponential(1.0) + 0.01
                spans[i] = (now, now + dur)
                heapq.heappush(running, (now + dur, k, i))
        if not running:
            pending = [c[1] for c in ctas if c[1] is not None]
            assert not pending, f"deadlock: CTAs stuck on tasks {pending}"
            return spans, dict(live=live, live_tile_end=live_tile_end, num_tiles=num_tiles)
        now, k, i = heapq.heappop(running)
        counters[off[tl.signal_group[i]] + tl.signal_index[i]] += 1
        ctas[k][1] = fetch(ctas[k][0])


def _ring_lifetimes_are_disjoint(tl, spans):
    """Per ring tile slot and per buffer (x: DISPATCH->FC1, h: FC1->FC2, y: FC2->COMBINE),
    the lifetime [first write start, last read end] of successive occupants never overlaps."""
    rt = tl.ring_tiles
    writers = {"x": TaskType.DISPATCH, "h": TaskType.FC1, "y": TaskType.FC2}
    readers = {"x": TaskType.FC1, "h": TaskType.FC2, "y": TaskType.COMBINE}
    checked = 0
    for buf in "xhy":
        life = {}
        for i, (s, e) in spans.items():
            if tl.minibatch[i] < 0:
                continue
            j = int(tl.m_tile_begin[i])
            lo, hi = life.get(j, (np.inf, -np.inf))
            if tl.type[i] == writers[buf]:
                lo = min(lo, s)
            if tl.type[i] == readers[buf]:
                hi = max(hi, e)
            life[j] = (lo, hi)
        for j in sorted(life):
            if j - rt in life:
                prev_end = life[j - rt][1]
                assert prev_end <= life[j][0], (buf, j, life[j - rt], life[j])
                checked += 1
    return checked


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("counts", COUNTS[:2])
def test_random_execution_never_deadlocks_and_ring_rows_never_overlap(counts, cfg):
    tl = _build(counts, **cfg)
    wraps = tl.num_m_tiles > tl.ring_tiles
    for seed in range(3):
        spans, _ = _execute(tl, n_comm=1 + seed, n_comp=2 + 3 * seed, seed=seed)
        assert len(spans) == len(tl)
        for i, (s, e) in spans.items():  # every dependency finished before the task started
            for d in tl.deps(i):
                assert spans[int(d)][1] <= s
        checked = _ring_lifetimes_are_disjoint(tl, spans)
        assert (checked > 0) == wraps


def test_wrap_path_with_a_ring_much_smaller_than_the_routed_rows():
    counts = [1500, 700, 0, 333]
    tl = _build(counts, minibatch_tokens=128, ring_tokens=192)
    assert tl.num_m_tiles * tl.params.tile_m > 5 * tl.params.ring_tokens
    # each ring slot is reused many times
    slots = np.bincount(tl.ring_row_begin[tl.type == TaskType.DISPATCH] // tl.params.tile_m)
    assert slots.min() >= 5
    for seed in range(4):
        spans, _ = _execute(tl, n_comm=2, n_comp=7, seed=10 + seed)
        assert _ring_lifetimes_are_disjoint(tl, spans) == 3 * (tl.num_m_tiles - tl.ring_tiles)


def test_happens_before_is_structural_for_ring_reuse():
    """Independent of timing: the previous occupant's last readers are ancestors of the next
    occupant's writers in the dependency DAG."""
    tl = _build([700, 90, 300], minibatch_tokens=128, ring_tokens=192)
    off, deps = tl.deps_csr()
    anc = [0] * len(tl)  # ancestor bitsets
    for i in range(len(tl)):
        a = 0
        for d in deps[off[i]:off[i + 1]]:
            a |= anc[int(d)] | (1 << int(d))
        anc[i] = a
    by = {}
    for t in tl:
        if t.minibatch >= 0:
            by.setdefault((t.type, t.m_tile_begin), []).append(t.index)
    rt = tl.ring_tiles
    pairs = [(TaskType.FC1, TaskType.DISPATCH), (TaskType.FC2, TaskType.FC1),
             (TaskType.COMBINE, TaskType.FC2)]
    n = 0
    for j in range(rt, tl.num_m_tiles):
        for reader, writer in pairs:
            for r in by[(reader, j - rt)]:
                for w in by[(writer, j)]:
                    assert anc[w] >> r & 1, (reader.name, j - rt, writer.name, j)
                    n += 1
    assert n > 0


# ------------------------------------------------------------------------------------------
# static capacity: the list the kernel gets, with run-time live tiles


@pytest.mark.parametrize("num_tiles", [0, 1, 2, 5, 6, 11, 16])
def test_static_list_with_fewer_live_tiles_runs_exactly_the_live_work(num_tiles):
    kw = dict(SMALL, minibatch_tokens=128, ring_tokens=256, shared_intermediate=128)
    static = T.build_static(16 * 64, **kw)
    assert static.num_m_tiles == 16
    actual = T.build_task_list(np.full(num_tiles, 64), **kw)
    run = tickets.simulate_live_run(static, num_tiles)

    def key(tl, i):
        return (int(tl.type[i]), int(tl.m_tile_begin[i]), int(tl.n_tile[i]))

    ran = run[Role.COMM]["ran"] + run[Role.COMPUTE]["ran"]
    assert sorted(key(static, i) for i in ran) == sorted(key(actual, i) for i in range(len(actual)))
    live = TE.live_minibatches(num_tiles, static.tiles_per_minibatch)
    for r in Role:
        f = run[r]["fetched"]
        assert len(set(f)) == len(f)  # a task is fetched at most once
        # every task of a live minibatch (and every shared / finish task) is fetched
        want = {int(i) for i in static.queue(r) if static.minibatch[i] < live}
        assert want <= set(f)
        # dead tasks fetched before the last live one are bounded by the dispatch lookahead
        look_tiles = static.params.dispatch_lookahead_tokens // static.params.tile_m
        assert len(run[r]["skipped"]) <= look_tiles * static.comm_chunks_per_tile
    # and the protocol (clipped waits, no-op signalling, dead skipping) never deadlocks
    spans, info = _execute(static, n_comm=2, n_comp=5, seed=num_tiles, num_tiles=num_tiles)
    assert info["live"] == live
    fetched = set(run[Role.COMM]["fetched"] + run[Role.COMPUTE]["fetched"])
    assert set(spans) == fetched - set(run[Role.COMM]["skipped"] + run[Role.COMPUTE]["skipped"])


def test_static_list_size_for_a_realistic_capacity_builds_quickly():
    import time

    t0 = time.perf_counter()
    tl = T.build_static(1072 * 128, hidden=7168, intermediate=2048, num_tokens=2048, top_k=8,
                        minibatch_tokens=4096, ring_tokens=32768, shared_intermediate=2048)
    assert len(tl) > 40_000
    assert time.perf_counter() - t0 < 10.0
    enc = TE.encode(tl)
    assert enc.shape[0] == len(tl)


def test_task_types_are_the_timeline_enums():
    from mok_cute import timeline
    assert TaskType is timeline.TaskType and Role is timeline.Role


def test_build_for_a_receive_schedule_static_and_actual():
    torch = pytest.importorskip("torch")
    from mok_cute.schedule import build_receive_schedule

    g = torch.Generator().manual_seed(0)
    R, Tk, K, E_loc = 3, 50, 2, 4
    topk = torch.stack([torch.randperm(R * E_loc, generator=g)[:K] for _ in range(R * Tk)])
    sch = build_receive_schedule(topk.reshape(R, Tk, K), 1, E_loc, tile_m=64)
    kw = dict(hidden=256, intermediate=128, num_tokens=Tk, top_k=K, minibatch_tokens=128,
              ring_tokens=256, fc1_tile_n=128, fc2_tile_n=128)
    static = T.build_for_schedule(sch, static=True, **kw)
    actual = T.build_for_schedule(sch, static=False, **kw)
    assert static.num_m_tiles == sch.capacity // 64 and static.params.static
    assert actual.num_m_tiles == int(sch.num_tiles) < static.num_m_tiles
    assert actual.params.rank == 1 and actual.params.num_ranks == R
    assert actual.tile_rows.sum() == int(sch.expert_counts.sum())
    # the static list run with the device's num_tiles does exactly the actual list's work
    run = tickets.simulate_live_run(static, int(sch.num_tiles))
    ran = sorted((int(static.type[i]), int(static.m_tile_begin[i]), int(static.n_tile[i]))
                 for r in Role for i in run[r]["ran"])
    want = sorted((int(actual.type[i]), int(actual.m_tile_begin[i]), int(actual.n_tile[i]))
                  for i in range(len(actual)))
    assert ran == want
    with pytest.raises(ValueError, match="tile_m"):
        T.build_for_schedule(sch, tile_m=128, **kw)


def test_fc1_lead_queues_the_next_minibatchs_fc1_before_this_ones_fc2():
    """fc1_lead=1: compute order FC1(0) FC1(1) FC2(0) FC1(2) FC2(1) ... FC2(last); every wait
    still points to a lower index. A ring of one minibatch falls back to fc1_lead=0."""
    import numpy as np

    kw = dict(hidden=512, intermediate=256, num_tokens=300, top_k=4, minibatch_tokens=256)
    tl = T.build_static(128 * 8, ring_tokens=512, fc1_lead=1, **kw)
    q = tl.queue(T.Role.COMPUTE)
    gemm = [(int(tl.type[i]), int(tl.minibatch[i])) for i in q
            if tl.type[i] in (T.TaskType.FC1, T.TaskType.FC2)]
    runs = [x for i, x in enumerate(gemm) if i == 0 or x != gemm[i - 1]]
    FC1, FC2 = int(T.TaskType.FC1), int(T.TaskType.FC2)
    assert runs == [(FC1, 0), (FC1, 1), (FC2, 0), (FC1, 2), (FC2, 1), (FC1, 3), (FC2, 2), (FC2, 3)]
    offsets, deps = tl.deps_csr()
    assert all((deps[offsets[i]:offsets[i + 1]] < i).all() for i in range(len(tl)))
    same = T.build_static(128 * 8, ring_tokens=256, fc1_lead=1, **kw)
    assert same.params.fc1_lead == 0
    assert np.array_equal(same.type, T.build_static(128 * 8, ring_tokens=256, **kw).type)
    # a lead of 2 minibatches needs a ring of 3; a ring of 2 shrinks it to 1
    assert T.build_static(128 * 8, ring_tokens=512, fc1_lead=2, **kw).params.fc1_lead == 1
    tl = T.build_static(128 * 8, ring_tokens=768, fc1_lead=2, **kw)
    gemm = [(int(tl.type[i]), int(tl.minibatch[i])) for i in tl.queue(T.Role.COMPUTE)
            if tl.type[i] in (T.TaskType.FC1, T.TaskType.FC2)]
    runs = [x for i, x in enumerate(gemm) if i == 0 or x != gemm[i - 1]]
    assert runs == [(FC1, 0), (FC1, 1), (FC1, 2), (FC2, 0), (FC1, 3), (FC2, 1), (FC2, 2), (FC2, 3)]
    offsets, deps = tl.deps_csr()
    assert all((deps[offsets[i]:offsets[i + 1]] < i).all() for i in range(len(tl)))


@pytest.mark.parametrize("comm_tasks", [True, False])
def test_n_major_order_runs_a_minibatchs_m_tiles_inside_each_n_tile(comm_tasks):
    """tile_order="n_major": within a minibatch, FC1 and FC2 tiles go N-tile by N-tile with the
    minibatch's M-tiles inner; the set of tasks and every wait are those of "m_major", and
    every wait still points to a lower index."""
    kw = dict(hidden=512, intermediate=384, num_tokens=300, top_k=4, minibatch_tokens=256,
              ring_tokens=1024, fc1_lead=1, comm_tasks=comm_tasks)
    tl = T.build_static(128 * 8, tile_order="n_major", **kw)
    base = T.build_static(128 * 8, **kw)
    for ttype, n_count in ((T.TaskType.FC1, 3), (T.TaskType.FC2, 2)):
        got = [(int(tl.m_tile_begin[i]), int(tl.n_tile[i])) for i in tl.queue(T.Role.COMPUTE)
               if tl.type[i] == ttype and tl.minibatch[i] == 1]
        assert got == [(m, n) for n in range(n_count) for m in (2, 3)]

    def tasks_of(t):
        return sorted((int(t.type[i]), int(t.m_tile_begin[i]), int(t.n_tile[i]),
                       tuple(map(tuple, t.waits[i].tolist()))) for i in range(len(t)))

    assert tasks_of(tl) == tasks_of(base)
    offsets, deps = tl.deps_csr()
    assert all((deps[offsets[i]:offsets[i + 1]] < i).all() for i in range(len(tl)))
    with pytest.raises(ValueError, match="tile_order"):
        T.build_static(128 * 8, tile_order="zigzag", **kw)


def _assert_waits_lower_and_live_run_once(tl):
    """Every wait points to a lower list index; a live run of 5 tiles runs each task once."""
    offsets, deps = tl.deps_csr()
    assert all((deps[offsets[i]:offsets[i + 1]] < i).all() for i in range(len(tl)))
    run = tickets.simulate_live_run(tl, 5)
    ran = [i for r in T.Role for i in run[r]["ran"]]
    assert len(ran) == len(set(ran))


@pytest.mark.parametrize("shared", [0, 256])
def test_without_comm_tasks_only_the_barrier_is_comm_and_fc2_feeds_it(shared):
    """comm_tasks=False (one rank reading its own rows in place): no DISPATCH or COMBINE, FC1
    waits on nothing routed, the BARRIER waits on every FC2 tile, the compute queue is the same
    as with comm tasks, every wait points lower and a live run still runs every task once."""
    kw = dict(hidden=512, intermediate=256, num_tokens=300, top_k=4, minibatch_tokens=256,
              shared_intermediate=shared)
    tl = T.build_static(128 * 8, ring_tokens=1024, comm_tasks=False, **kw)
    with_comm = T.build_static(128 * 8, ring_tokens=1024, **kw)
    comm = tl.queue(T.Role.COMM)
    assert [int(tl.type[i]) for i in comm] == [int(T.TaskType.BARRIER)]
    barrier = tl[int(comm[0])]
    assert barrier.waits == ((T.CounterGroup.FC2_DONE, 0, 8, 2),)
    fc1 = [tl[int(i)] for i in tl.queue(T.Role.COMPUTE) if tl.type[i] == T.TaskType.FC1]
    assert fc1 and all(t.waits == () for t in fc1)
    same_compute = [(int(t.type[i]), int(t.m_tile_begin[i]), int(t.n_tile[i]))
                    for t in (tl, with_comm) for i in t.queue(T.Role.COMPUTE)]
    half = len(same_compute) // 2
    assert same_compute[:half] == same_compute[half:]
    _assert_waits_lower_and_live_run_once(tl)
    with pytest.raises(ValueError, match="ring_tokens"):
        T.build_static(128 * 8, ring_tokens=512, comm_tasks=False, **kw)


@pytest.mark.parametrize("counts", COUNTS[:2])
@pytest.mark.parametrize("shared", [0, 128])
def test_barrier_in_compute_sits_between_the_last_fc2_and_the_first_ksum(counts, shared):
    """barrier_in_compute (the megakernel with no comm CTA): the comm queue is empty, the
    BARRIER is a compute task after every FC2 and before every KSUM, waiting on every FC2 tile;
    the rest of the compute queue is the usual one, KSUM still closes it, and compute CTAs
    alone run the list to the end without a deadlock."""
    kw = dict(comm_tasks=False, ring_tokens=4096, shared_intermediate=shared)
    tl = _build(counts, barrier_in_compute=True, **kw)
    usual = _build(counts, **kw)
    assert tl.queue(Role.COMM).size == 0
    q = tl.queue(Role.COMPUTE)
    kinds = tl.type[q].tolist()
    at = kinds.index(int(TaskType.BARRIER))
    assert kinds.count(int(TaskType.BARRIER)) == 1
    assert int(TaskType.FC2) not in kinds[at + 1:]
    assert set(kinds[at + 1:]) == {int(TaskType.KSUM)}
    assert tl[int(q[at])].waits == ((T.CounterGroup.FC2_DONE, 0, tl.num_m_tiles, tl.fc2_n_tiles),)
    assert kinds[:at] + kinds[at + 1:] == usual.type[usual.queue(Role.COMPUTE)].tolist()
    assert tl.ksum_closes_compute_queue()
    _assert_waits_lower_and_live_run_once(tl)
    for seed in range(3):
        spans, _ = _execute(tl, n_comm=0, n_comp=1 + 3 * seed, seed=seed)
        assert len(spans) == len(tl)
    with pytest.raises(ValueError, match="barrier_in_compute needs comm_tasks=False"):
        _build(counts, barrier_in_compute=True, ring_tokens=4096)
