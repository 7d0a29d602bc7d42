"""The megakernel (kernels/megakernel/, mok_cute/megakernel.py).

CI: compile-only sm_90a checks of every configuration the plans resolve to, and CPU models of
the ticket walk (no deadlock, every live task once). H200 (marked gpu): moe_forward_virtual on
the megakernel against the reference for R in {1, 2, 3, 4, 8, 16, 72} under uniform and skewed
routing, an empty expert, a rank that receives nothing, a ring smaller than the routed rows and
with / without the shared expert; bitwise identity across runs, across num_comm_sms, minibatch
and ring sizes and across every ``MegakernelOptions`` setting; a silent peer raises
PeerTimeoutError; out-of-range ids with check_ids=False contribute zero."""

import dataclasses
import re

import pytest
import torch

import mok_cute
from mok_cute import reference
from mok_cute.config import MegakernelOptions
from mok_cute.constants import MegakernelSpec
from mok_cute.errors import PeerTimeoutError
from per_token import assert_tokens_close
from poison import poison_free_memory, poison_megakernel_plans

# The configurations plans resolve to (mok_cute.megakernel.plan_for), with the shared expert
# and K = 8: one GPU (no comm CTA, rows in place, the stride through the ticket ring, the
# deferred publish), virtual ranks (dynamic tickets; rows in place, or every row copied when
# the ring wraps), one IPC rank (static tickets, system-scope flags).
SPECS = {
    "one_rank": MegakernelSpec(num_comm_ctas=0, has_shared=True, tickets="strided",
                               defer_signals=True),
    "virtual": MegakernelSpec(num_ranks=8, num_comm_ctas=12, has_shared=True, tickets="dynamic"),
    "virtual_ring": MegakernelSpec(num_ranks=8, num_comm_ctas=12, has_shared=True,
                                   tickets="dynamic", rows_in_place=False),
    "ipc": MegakernelSpec(num_comm_ctas=12, has_shared=True, scope="sys", tickets="static"),
    "ipc_ring": MegakernelSpec(num_comm_ctas=12, has_shared=True, scope="sys", tickets="static",
                               rows_in_place=False),
}


def _wgmma_pipelined(rep):
    """ptxas kept the wgmmas pipelined: no note that it serialised them (C7520 cost a build
    ~9 % per GEMM tile on the H200, runs 104-105) and no ignored setmaxnreg (C7508)."""
    serial = [w for w in rep.warnings if "serialized" in w or "C7508" in w]
    assert not serial, serial


def _compile(spec, tmp_path, **changes):
    from mok_cute.kernels import megakernel

    fields = dataclasses.asdict(dataclasses.replace(spec, **changes))
    return megakernel.compile_megakernel(options=f"--keep-ptx --dump-dir {tmp_path}",
                                         **fields).__ptx__


@pytest.mark.parametrize("name", list(SPECS))
def test_compiles_to_wgmma_tma_and_bounded_waits(name, tmp_path):
    ptx = _compile(SPECS[name], tmp_path)
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads and stores of the GEMM tiles
    assert "setmaxnreg" in ptx
    scope = SPECS[name].scope
    assert re.search(rf"red\.release\.{scope}\.global\.add\.s32", ptx)  # counter publish
    assert re.search(rf"ld\.acquire\.{scope}", ptx)  # counter wait
    assert "nanosleep" in ptx and "globaltimer" in ptx  # bounded spin waits
    assert "multimem" not in ptx  # never NVLink multicast
    # rows in place: FC1's local A rows come by cp.async from x, landing on the stage barrier
    gathered = "cp.async.mbarrier.arrive.noinc" in ptx
    assert gathered == SPECS[name].rows_in_place


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("timeline", [False, True])
def test_every_configuration_compiles_without_spills(name, timeline, tmp_path):
    """No spills, wgmmas pipelined, and setmaxnreg within the launch's register pool (an
    increase the pool cannot cover waits forever: the ticket ring's producer takes 48, its
    consumers 224)."""
    from mok_cute import jit

    spec = dataclasses.replace(SPECS[name], timeline=timeline)
    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **dataclasses.asdict(spec))
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)
    ptx = open(rep.ptx_path).read()
    dec = int(re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx).group(1))
    inc = int(re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx).group(1))
    assert (dec, inc) == ((48, 224) if spec.ticket_ring else (40, 232))
    assert 128 * dec + 256 * inc <= rep.registers * 384


@pytest.mark.parametrize("name", ["one_rank", "virtual"])
def test_training_forward_configuration_compiles_without_spills(name, tmp_path):
    """save_preact (FC1 tasks also storing g | u by row, ``row_epilogue``): no spills, wgmmas
    pipelined, the same register split."""
    from mok_cute import jit

    spec = dataclasses.replace(SPECS[name], save_preact=True)
    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **dataclasses.asdict(spec))
    assert rep.spill_bytes == 0 and rep.registers == 168
    _wgmma_pipelined(rep)


@pytest.mark.parametrize("top_k,has_shared", [(1, False), (2, True), (10, True)])
def test_ksum_lands_rows_in_smem_without_spills(top_k, has_shared, tmp_path):
    """The KSUM lanes copy their y vectors into the B stages with cp.async and sum them from
    smem (no y vector load into registers), for K = 1 to 10, without spills."""
    from mok_cute import jit

    spec = dataclasses.replace(SPECS["one_rank"], top_k=top_k, has_shared=has_shared)
    rep = jit.inspect_kernel("megakernel", outdir=tmp_path, **dataclasses.asdict(spec))
    assert rep.spill_bytes == 0
    _wgmma_pipelined(rep)
    ptx = open(rep.ptx_path).read()
    assert re.search(r"cp\.async\.cg\.shared\.global", ptx) and re.search(r"ld\.shared\.v4", ptx)


def test_strided_tickets_take_no_compute_ticket_atomic(tmp_path):
    """"strided": compute tickets by the stride through the ring (no counter atomic per task);
    "dynamic": lane 0 takes the first and one per task ahead."""
    atom = r"atom\.global\.add\.u32"
    strided = _compile(SPECS["one_rank"], tmp_path)
    dynamic = _compile(SPECS["one_rank"], tmp_path, tickets="dynamic")
    assert len(re.findall(atom, dynamic)) >= len(re.findall(atom, strided)) + 2


def test_deferred_publish_adds_its_flush_sites(tmp_path):
    """defer_signals: one release publish more per flush site (before a task that may wait on
    the held one, after DEFER_FLUSH_KTILES k-tiles or a shorter mainloop, at the end)."""
    on = _compile(SPECS["one_rank"], tmp_path)
    off = _compile(SPECS["one_rank"], tmp_path, defer_signals=False)
    assert on.count("red.release") == off.count("red.release") + 4


def test_launches_cooperatively_without_a_cluster_attribute(launches):
    """Every CTA must be co-resident (cooperative launch: the no-deadlock argument), and no
    cluster attribute: a cluster of one cost the GEMM kernels up to 24 % (runs 76-78)."""
    from mok_cute.kernels import megakernel

    megakernel.compile_megakernel()
    assert len(launches) == 1
    assert launches[0].get("cooperative") is True
    assert launches[0].get("cluster") is None


def test_recorder_flag_off_emits_no_recorder_instruction(tmp_path):
    """Off: no %smid read and fewer %globaltimer reads (the waits' deadlines keep one per
    wait loop); on: the recorder's reads, tickets and stores are there."""
    off = _compile(SPECS["virtual"], tmp_path)
    on = _compile(SPECS["virtual"], tmp_path, timeline=True)
    assert "%smid" not in off and "%smid" in on
    assert on.count("%globaltimer") > off.count("%globaltimer")


@pytest.mark.parametrize("fields,match", [
    (dict(num_ctas=8, num_comm_ctas=8), "num_comm_ctas must be in"),
    (dict(num_ranks=4, num_comm_ctas=0), "num_comm_ctas=0 needs num_ranks=1"),
    (dict(top_k=17), "top_k must be in"),
    (dict(scope="node"), "scope must be"),
    (dict(tickets="random"), "tickets must be"),
    (dict(num_ranks=2, num_comm_ctas=2, defer_signals=True), "defer_signals needs one rank"),
    (dict(tickets="static", defer_signals=True), "defer_signals needs one rank"),
])
def test_bad_static_configurations_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        MegakernelSpec(**fields)


def test_options_resolve_the_measured_ticket_modes():
    options = MegakernelOptions()
    assert options.ticket_mode(1, ipc=False) == "strided"
    assert options.ticket_mode(8, ipc=False) == "dynamic"
    assert options.ticket_mode(1, ipc=True) == "static"
    assert MegakernelOptions(tickets="static").ticket_mode(8, ipc=False) == "static"
    with pytest.raises(ValueError, match="MegakernelOptions.tickets"):
        MegakernelOptions(tickets="sometimes")
    with pytest.raises(ValueError, match="MegakernelOptions.fc1_lead"):
        MegakernelOptions(fc1_lead=-1)


# ---------------------------------------------------------------------- CPU: the ticket walk
@pytest.mark.parametrize("R,num_tiles_seed", [(1, 0), (2, 1), (3, 2), (8, 3), (72, 4)])
@pytest.mark.parametrize("fc1_lead", [0, 1, 3])
@pytest.mark.parametrize("rank_blocks", [False, True])
def test_virtual_ticket_walk_runs_every_live_task_once(R, num_tiles_seed, fc1_lead, rank_blocks):
    """Model of the kernel's walk (tickets.walk_tickets) against one rank's walk
    (tickets.simulate_live_run):
    with R ranks of different tile counts, each rank's tasks that run (or signal as no-ops) are
    visited exactly once, in list order, and nothing dead runs."""
    import numpy as np

    from mok_cute import task_encoding, tasks, tickets
    from mok_cute.tasks import Role

    rng = np.random.default_rng(num_tiles_seed)
    capacity = 128 * 24
    tl = tasks.build_static(capacity, hidden=512, intermediate=256, num_tokens=200, top_k=4,
                            minibatch_tokens=512, ring_tokens=512 * (fc1_lead + 1),
                            shared_intermediate=128, num_ranks=R, fc1_lead=fc1_lead)
    assert tl.params.fc1_lead == fc1_lead
    dev = task_encoding.encode_device(tl)
    num_tiles = [int(t) for t in rng.integers(0, 25, size=R)]
    for role in (Role.COMM, Role.COMPUTE):
        walk = tickets.walk_tickets(dev, num_tiles, int(role), rank_blocks)
        for rank in range(R):
            expected = tickets.simulate_live_run(tl, num_tiles[rank])[role]
            ran = [i for r, i, st in walk if r == rank and st == "run"]
            noop = [i for r, i, st in walk if r == rank and st == "noop"]
            assert ran == expected["ran"]
            assert noop == expected["noop"]


def _run_ctas(tl, num_tiles, ctas_per_role, rank_blocks, seed, dynamic=False, defer=False):
    """CTAs of both roles take tickets (``tickets.ticket_position``) as the kernel does (comm:
    the next ticket of a shared counter; compute CTA c: tickets c, c + n, c + 2n, ... (the
    "static" and "strided" modes); with ``dynamic`` the next of a shared counter too, each CTA holding the ticket
    after the one it runs, as the producer's lane 0 takes it ahead) and
    finish a task once its dependencies have (a dead task's waits are clipped away in the
    kernel: it counts as done; KSUM also needs every rank's BARRIER). With ``defer``
    (``MegakernelSpec.defer_signals``, one rank) a compute CTA holds back the publish of a live FC1 / FC2 task:
    at its next task's start it publishes when that task may wait on it (an FC2 after an FC1,
    anything but a live FC1 / FC2), else once that task runs, and when it runs out of tasks.
    Returns the tasks left when nothing can move."""
    import numpy as np

    from mok_cute import task_encoding, tickets
    from mok_cute.tasks import Role, TaskType

    R = len(num_tiles)
    dev = task_encoding.encode_device(tl)
    rng = np.random.default_rng(seed)
    tpm = tl.tiles_per_minibatch
    live_of = [task_encoding.live_minibatches(t, tpm) for t in num_tiles]
    live_len = dev.queue_live_len.numpy()
    barrier_of = [int(i) for i in range(len(tl)) if tl.type[i] == int(TaskType.BARRIER)]
    done = set()

    fc1, fc2 = int(TaskType.FC1), int(TaskType.FC2)

    def deferrable(rank, i):  # a live FC1 / FC2 tile with rows: the kernel's gemm_runs
        return (defer and tl.type[i] in (fc1, fc2) and tl.minibatch[i] < live_of[rank]
                and tl.m_tile_begin[i] < num_tiles[rank])

    def ready(rank, i):
        if tl.minibatch[i] >= live_of[rank]:
            return True  # dead: skipped
        if not all((rank, int(d)) in done or tl.minibatch[d] >= live_of[rank] for d in tl.deps(i)):
            return False
        if tl.type[i] == int(TaskType.KSUM):
            return all((p, b) in done for p in range(R) for b in barrier_of)
        return True

    roles = []
    for role in (int(Role.COMM), int(Role.COMPUTE)):
        prefix = max(int(live_len[role, live]) for live in live_of)
        n = ctas_per_role[role]
        roles.append(dict(role=role, next=0, prefix=prefix, qlen=int(dev.queue_len[role]),
                          ctas=[dict(task=None, cursor=(0, 0), out=False, q=c - n, ahead=None,
                                     held=None) for c in range(n)]))
    while True:
        moved = False
        for rs in roles:
            for c in rng.permutation(len(rs["ctas"])):
                cta = rs["ctas"][c]
                if cta["out"]:
                    continue
                if cta["task"] is None:
                    if rs["role"] == int(Role.COMM):
                        q = rs["next"]
                        rs["next"] += 1
                    elif dynamic:
                        if cta["ahead"] is None:
                            cta["ahead"] = rs["next"]
                            rs["next"] += 1
                        q, cta["ahead"] = cta["ahead"], rs["next"]
                        rs["next"] += 1
                    else:
                        cta["q"] += len(rs["ctas"])
                        q = cta["q"]
                    pos, rank, cta["cursor"] = tickets.ticket_position(
                        dev, rs["role"], R, rs["prefix"], rank_blocks, q, cta["cursor"])
                    moved = True
                    if pos >= rs["qlen"]:
                        cta["out"] = True
                    else:
                        cta["task"] = (rank, int(dev.queues[rs["role"], pos]))
                    held = cta["held"]
                    if held is not None and (cta["out"] or not deferrable(*cta["task"]) or (
                            tl.type[held[1]] == fc1 and tl.type[cta["task"][1]] == fc2)):
                        done.add(held)  # published at the next task's start (or the end)
                        cta["held"] = None
                elif ready(*cta["task"]):
                    if cta["held"] is not None:  # published after the next task's mainloop
                        done.add(cta["held"])
                        cta["held"] = None
                    if deferrable(*cta["task"]):
                        cta["held"] = cta["task"]
                    else:
                        done.add(cta["task"])
                    cta["task"] = None
                    moved = True
        if not moved:
            return [c["task"] for rs in roles for c in rs["ctas"] if c["task"] is not None]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("rank_blocks", [False, True])
@pytest.mark.parametrize("R,ctas,tile_order", [(2, (1, 1), "m_major"), (3, (2, 3), "n_major"),
                                               (8, (2, 5), "m_major"), (8, (12, 40), "n_major")])
def test_virtual_ranks_finish_with_few_ctas(dynamic, rank_blocks, R, ctas, tile_order):
    """Both ticket walks, with static or dynamic compute tickets, finish every task with as
    few as one CTA per role, uniform and ragged tile counts (dead and no-op tasks), in random
    CTA orders: no deadlock."""
    import numpy as np

    from mok_cute import tasks

    tl = tasks.build_static(128 * 12, hidden=512, intermediate=256, num_tokens=200, top_k=4,
                            minibatch_tokens=256, ring_tokens=128 * 12, shared_intermediate=128,
                            num_ranks=R, fc1_lead=1, tile_order=tile_order)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        num_tiles = [12] * R if seed == 0 else [int(t) for t in rng.integers(0, 13, size=R)]
        assert _run_ctas(tl, num_tiles, ctas, rank_blocks, seed, dynamic) == [], num_tiles


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fc1_lead", [0, 3])
@pytest.mark.parametrize("ctas", [(1, 1), (1, 5), (2, 40), (0, 1), (0, 5), (0, 40)])
@pytest.mark.parametrize("tile_order", ["m_major", "n_major"])
def test_one_rank_without_comm_tasks_finishes_with_few_ctas(dynamic, fc1_lead, ctas, tile_order):
    """The one-rank list without comm tasks (rows in place, no peer): the comm CTAs only run
    the barrier (with no comm CTA a compute CTA runs it: barrier_in_compute), the compute CTAs
    take their static-stride (or dynamic) tickets; every task finishes."""
    import numpy as np

    from mok_cute import tasks

    tl = tasks.build_static(128 * 12, hidden=512, intermediate=256, num_tokens=200, top_k=4,
                            minibatch_tokens=256, ring_tokens=128 * 12, shared_intermediate=128,
                            fc1_lead=fc1_lead, comm_tasks=False, tile_order=tile_order,
                            barrier_in_compute=ctas[0] == 0)
    assert tl.params.fc1_lead == fc1_lead
    for seed in range(3):
        num_tiles = [12] if seed == 0 else [int(np.random.default_rng(seed).integers(0, 13))]
        assert _run_ctas(tl, num_tiles, ctas, False, seed, dynamic) == [], num_tiles


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fc1_lead", [0, 1, 3])
@pytest.mark.parametrize("ctas", [(0, 1), (0, 2), (0, 5), (0, 40), (1, 3), (2, 40)])
@pytest.mark.parametrize("tile_order", ["m_major", "n_major"])
def test_one_rank_with_deferred_signals_finishes(dynamic, fc1_lead, ctas, tile_order):
    """The deferred publish (one rank's default): every compute CTA holds back its last live
    FC1 / FC2 publish until its next task needs it out of the way; with one CTA or many, with
    the BARRIER on a compute or a comm CTA, ragged tile counts (dead and no-op tasks) and
    random CTA orders, every task still finishes: no CTA waits on a signal it holds, and no
    cycle of CTAs does. With dynamic tickets and with the stride (the one-rank default)."""
    import numpy as np

    from mok_cute import tasks

    tl = tasks.build_static(128 * 12, hidden=512, intermediate=256, num_tokens=200, top_k=4,
                            minibatch_tokens=256, ring_tokens=128 * 12, shared_intermediate=128,
                            fc1_lead=fc1_lead, comm_tasks=False, tile_order=tile_order,
                            barrier_in_compute=ctas[0] == 0)
    for seed in range(6):
        num_tiles = [12] if seed == 0 else [int(np.random.default_rng(seed).integers(0, 13))]
        assert _run_ctas(tl, num_tiles, ctas, False, seed, dynamic, defer=True) == [], num_tiles


@pytest.mark.parametrize("fc1_lead", [0, 1, 3])
def test_virtual_ranks_wait_only_on_lower_tickets(fc1_lead):
    """Why R virtual ranks in one launch cannot deadlock: every wait points to a lower list
    index of the same rank, every role queue is in list order, and KSUM (the only task that
    waits on other ranks, through their BARRIER flags) comes after BARRIER in every list."""
    import numpy as np

    from mok_cute import tasks
    from mok_cute.tasks import Role, TaskType

    tl = tasks.build_static(128 * 16, hidden=512, intermediate=256, num_tokens=300, top_k=4,
                            minibatch_tokens=256, ring_tokens=256 * max(2, fc1_lead + 1),
                            shared_intermediate=128, num_ranks=8, fc1_lead=fc1_lead)
    offsets, deps = tl.deps_csr()
    for i in range(len(tl)):
        assert (deps[offsets[i]:offsets[i + 1]] < i).all()
    for role in (Role.COMM, Role.COMPUTE):
        q = tl.queue(role)
        assert (np.diff(q) > 0).all()
    barrier = np.flatnonzero(tl.type == int(TaskType.BARRIER))
    ksum = np.flatnonzero(tl.type == int(TaskType.KSUM))
    assert barrier.size == 1 and ksum.size and barrier[0] < ksum.min()


# ---------------------------------------------------------------------- H200
@pytest.fixture(autouse=True)
def _own_plans():
    """Every test starts with no cached megakernel plan, so what it asserts about
    ``megakernel.cached_plans()`` (an option taken, the recorder's plan) is about its own
    calls; it keeps every plan it makes (no eviction within a test)."""
    from mok_cute import megakernel

    megakernel.release_plans()
    bound = megakernel._LOCAL_PLANS.max_entries
    megakernel._LOCAL_PLANS.max_entries = 64
    yield
    megakernel._LOCAL_PLANS.max_entries = bound
    megakernel.release_plans()


def _problem(R, T, H, I, E_loc, K, Is=0, seed=0, skew=False, empty_expert=None,
             silent_receiver=None):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(torch.bfloat16)

    E = R * E_loc
    scores = torch.rand(R, T, E, device="cuda", generator=g)
    if skew:  # expert 0 takes about half of all tokens
        scores[..., 0] += 2.0 * (torch.rand(R, T, device="cuda", generator=g) < 0.5)
    if empty_expert is not None:
        scores[..., empty_expert] = -1.0
    if silent_receiver is not None:  # no token routes to that rank's experts
        scores[..., silent_receiver * E_loc:(silent_receiver + 1) * E_loc] = -1.0
    idx = scores.topk(K, dim=2).indices.to(torch.int32)
    w = torch.softmax(torch.randn(R, T, K, device="cuda", generator=g), dim=2)
    xs = rnd(R, T, H)
    wg, wu = rnd(R, E_loc, I, H, scale=H ** -0.5), rnd(R, E_loc, I, H, scale=H ** -0.5)
    wd = rnd(R, E_loc, H, I, scale=I ** -0.5)
    sh = None
    if Is:
        sh = (rnd(R, Is, H, scale=H ** -0.5), rnd(R, Is, H, scale=H ** -0.5),
              rnd(R, H, Is, scale=Is ** -0.5))
    return xs, idx, w, wg, wu, wd, sh


def _run(args, **cfg):
    """Poison the allocator's free blocks and the cached plans' buffers, then run on the
    megakernel."""
    poison_free_memory()
    poison_megakernel_plans()
    cfg.setdefault("backend", "megakernel")  # never the reference in its place
    config = mok_cute.MoKConfig(timeout_ms=5000.0, **cfg)
    out = mok_cute.moe_forward_virtual(*args[:6], shared=args[6], config=config)
    torch.cuda.synchronize()
    return out


CASES = {
    # name: (R, T, H, I, E_loc, K, Is, problem kwargs, config kwargs)
    "R1": (1, 300, 512, 256, 8, 4, 0, {}, {}),
    "R1_shared_T77_K10": (1, 77, 256, 128, 16, 10, 128, {}, {}),
    "R1_T1_K1_H576": (1, 1, 576, 256, 4, 1, 0, {}, {}),  # a partial last k-sum step
    "R1_hot_expert_K8": (1, 1000, 512, 320, 16, 8, 0, {"skew": True}, {}),  # E > K: one hot
    "R2_shared_skew": (2, 160, 512, 256, 4, 4, 256, {"skew": True}, {}),
    "R3_empty_expert": (3, 100, 512, 320, 4, 2, 0, {"empty_expert": 5}, {}),
    "R4_silent_receiver": (4, 96, 256, 192, 4, 2, 64, {"silent_receiver": 2}, {}),
    "R8_ring_wrap": (8, 128, 512, 256, 2, 4, 0, {}, {"ring_tokens": 256, "minibatch_tokens": 128}),
    "R4_T1_K10_shared": (4, 1, 256, 128, 4, 10, 64, {}, {}),
    "R16": (16, 32, 256, 128, 2, 2, 0, {}, {}),
    "R72_shared": (72, 16, 256, 128, 1, 2, 64, {}, {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_virtual_megakernel_matches_the_reference(name):
    R, T, H, I, E_loc, K, Is, pkw, ckw = CASES[name]
    args = _problem(R, T, H, I, E_loc, K, Is, **pkw)
    out = _run(args, **ckw)
    assert mok_cute.api.choose_path(args[0].device, mok_cute.MoKConfig(), virtual=True).path == "megakernel"
    ref = reference.moe_forward_virtual(*args[:6], shared=args[6])
    assert not torch.isnan(out.float()).any()
    assert_tokens_close(out, ref, what=f"megakernel {name}")
    again = _run(args, **ckw)
    assert torch.equal(out, again), "not bitwise reproducible across two runs"


@pytest.mark.gpu
def test_bitwise_identical_across_comm_sms_minibatch_and_ring():
    args = _problem(4, 256, 512, 256, 4, 4, 128, seed=3, skew=True)
    base = _run(args)
    for cfg in ({"num_comm_sms": 2}, {"num_comm_sms": 8}, {"num_comm_sms": 16},
                {"num_comm_sms": 32}, {"minibatch_tokens": 128}, {"minibatch_tokens": 512},
                {"ring_tokens": 512, "minibatch_tokens": 256},
                {"ring_tokens": 256, "minibatch_tokens": 128, "num_comm_sms": 3}):
        assert torch.equal(_run(args, **cfg), base), f"output changed with {cfg}"



# (R, ring rows, shared intermediate): one rank, with the shared expert, several ranks, a
# wrapping ring (every row copied, FC1 waiting on DISPATCHED), an odd rank count
OPTION_CASES = [(1, None, 0), (1, None, 128), (4, None, 0), (8, 256, 128), (3, None, 0)]


def _options_keep_the_bits(args, R, ring, variants, few_sms=(), monkeypatch=None):
    """The same problem under each ``MegakernelOptions`` of ``variants`` (and, for those in
    ``few_sms``, on 8 SMs, where a small ring wraps): every output bitwise equal to the
    defaults', a recorded call too, and the defaults against the reference."""
    from mok_cute import megakernel

    sizes = {} if ring is None else {"ring_tokens": ring, "minibatch_tokens": 128}
    base = _run(args, **sizes)
    assert not torch.isnan(base.float()).any()
    assert_tokens_close(base, reference.moe_forward_virtual(*args[:6], shared=args[6]),
                        what=f"megakernel R={R} ring={ring}")
    assert torch.equal(_run(args, timeline=True, **sizes), base)
    for options in variants:
        assert torch.equal(_run(args, megakernel=options, **sizes), base), options
    if few_sms:
        monkeypatch.setattr(megakernel, "_num_sms", lambda device: 8)
        for options in few_sms:
            out = _run(args, megakernel=options, num_comm_sms=2 if R > 1 else 0, **sizes)
            assert torch.equal(out, base), options


@pytest.mark.gpu
@pytest.mark.parametrize("R,ring,shared", OPTION_CASES)
def test_ticket_modes_give_the_same_bits(R, ring, shared, monkeypatch):
    """Which CTA takes which task (the stride, the counter, the stride through the ring, rank
    blocks at R > 1) never changes a bit: skewed routing, the shared expert, a wrapping ring,
    132 and 8 SMs."""
    args = _problem(R, 300, 512, 256, 4, 4, shared, seed=37, skew=True)
    modes = [MegakernelOptions(tickets=t) for t in ("static", "dynamic", "strided")]
    _options_keep_the_bits(args, R, ring, modes, modes, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("R,shared", [(1, 0), (1, 128), (4, 128)])
def test_rows_copied_or_in_place_give_the_same_bits(R, shared):
    """Rows in place (a rank's own rows never copied: FC1 reads them from x, the k-sum their
    y from the ring) against every row copied by the comm CTAs."""
    from mok_cute import megakernel

    args = _problem(R, 200, 512, 256, 4, 4, shared, seed=17, skew=True)
    _options_keep_the_bits(args, R, None, [MegakernelOptions(rows_in_place=False)])
    assert any(k.spec.rows_in_place for k in megakernel.cached_plans())
    assert any(not k.spec.rows_in_place for k in megakernel.cached_plans())


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 4])
def test_fc1_lead_gives_the_same_bits(R):
    """The FC1 lead only reorders the compute queue, never a bit (none, a lead shorter than
    the list, the default)."""
    from mok_cute import megakernel

    args = _problem(R, 300, 512, 256, 4, 4, 128, seed=23, skew=True)
    base = _run(args, minibatch_tokens=128, megakernel=MegakernelOptions(fc1_lead=0))
    for lead in (2, None):
        out = _run(args, minibatch_tokens=128, megakernel=MegakernelOptions(fc1_lead=lead))
        assert torch.equal(out, base)
    assert {k.fc1_lead for k in megakernel.cached_plans()} >= {0, 2}


@pytest.mark.gpu
@pytest.mark.parametrize("K,shared,I", [(4, 0, 256), (4, 128, 768), (1, 0, 512), (8, 128, 256)])
def test_deferred_publish_is_recorded_in_order(K, shared, I):
    """One rank's deferred publish (flushed after 8 k-tiles, or after a shorter mainloop: I =
    256 gives FC2 4 k-tiles): the same bits on a recorded call, a CTA's spans still follow one
    another, against the reference."""
    from mok_cute import megakernel

    args = _problem(1, 300, 512, I, max(4, K), K, shared, seed=107, skew=True)
    _options_keep_the_bits(args, 1, None, [MegakernelOptions(tickets="static")])
    plan = next(p for k, p in megakernel.cached_plans().items()
                if k.spec.timeline and k.spec.defer_signals)
    assert plan.timeline.decode().check() == []


@pytest.mark.gpu
@pytest.mark.parametrize("shared_inter", [0, 128])
def test_x_read_in_place_gives_the_same_bits(shared_inter):
    """At one rank FC1's local rows and the shared expert read the caller's x where it lies
    (no copy into the symmetric buffer); x changes between calls, at a new address."""
    from mok_cute import megakernel

    args = _problem(1, 300, 512, 256, 4, 4, shared_inter, seed=31)
    copied = _run(args, megakernel=MegakernelOptions(rows_in_place=False))  # x copied
    assert torch.equal(_run(args), copied)
    assert any(k.x_in_place for k in megakernel.cached_plans())
    other = list(args)
    other[0] = args[0].flip(1).contiguous()  # new x at a new address: the offset is rewritten
    want = _run(tuple(other), megakernel=MegakernelOptions(rows_in_place=False))
    assert torch.equal(_run(tuple(other)), want)
    assert torch.equal(_run(args), copied)  # and back


@pytest.mark.gpu
@pytest.mark.parametrize("T,shared", [(300, 0), (77, 128), (1000, 0)])
def test_zero_comm_ctas_give_the_same_bits(T, shared, monkeypatch):
    """num_comm_sms=0 at one rank: the BARRIER runs on a compute CTA and every SM computes.
    Bitwise equal to one comm CTA (also on 8 SMs), recorded with the BARRIER on a compute
    lane, against the reference; elsewhere 0 is refused by name."""
    from mok_cute import megakernel
    from mok_cute.tasks import Role, TaskType

    args = _problem(1, T, 512, 256, 8, 4, shared, seed=19, skew=True)
    base = _run(args, num_comm_sms=1)
    outs = [_run(args, num_comm_sms=0), _run(args, num_comm_sms=0)]
    assert any(k.spec.num_comm_ctas == 0 and k.local_only for k in megakernel.cached_plans())
    recorded = _run(args, num_comm_sms=0, timeline=True)
    plan = next(p for k, p in megakernel.cached_plans().items() if k.spec.timeline and k.spec.num_comm_ctas == 0)
    rec = plan.timeline.decode().records
    barrier = rec[rec["task_type"] == int(TaskType.BARRIER)]
    assert len(barrier) == 1 and int(barrier["role"][0]) == int(Role.COMPUTE)
    monkeypatch.setattr(megakernel, "_num_sms", lambda device: 8)
    outs += [recorded, _run(args, num_comm_sms=0)]
    for out in outs:
        assert torch.equal(out, base)
    assert_tokens_close(base, reference.moe_forward_virtual(*args[:6], shared=args[6]),
                        what=f"megakernel num_comm_sms=0 T={T}")
    with pytest.raises(ValueError, match="num_comm_sms=0"):
        _run(_problem(2, 64, 256, 128, 2, 2, seed=9), num_comm_sms=0)


@pytest.mark.gpu
def test_one_gpu_megakernel_equals_the_expert_kernel_path_bitwise():
    args = _problem(1, 500, 512, 384, 8, 4, 128, seed=5)
    x, idx, w, wg, wu, wd = (a[0] for a in args[:6])
    shared = tuple(t[0] for t in args[6])
    mega = mok_cute.moe_forward(x, idx, w, wg, wu, wd, shared=shared,
                                config=mok_cute.MoKConfig(backend="megakernel"))
    experts = mok_cute.moe_forward(x, idx, w, wg, wu, wd, shared=shared,
                                   config=mok_cute.MoKConfig(backend="kernel"))
    assert torch.equal(mega, experts)


@pytest.mark.gpu
@pytest.mark.parametrize("K,Is,skew", [(4, 128, False), (8, 0, True)])
def test_training_forward_at_one_rank_saves_the_one_gpu_bits(K, Is, skew):
    """Issue 32, item 1, at one rank: a saving launch gives the inference launch's out, and
    the one-GPU training forward's g | u by (token, k) slot and the shared expert's by token,
    bit for bit (every slot written: the buffers come from a poisoned allocator)."""
    from mok_cute import expert_path, megakernel

    args = _problem(1, 300, 512, 320, 8, K, Is, seed=7, skew=skew)
    x, idx, w, wg, wu, wd = (a[0] for a in args[:6])
    shared = None if args[6] is None else tuple(t[0] for t in args[6])
    config = mok_cute.MoKConfig(backend="megakernel", timeout_ms=5000.0)
    inference = megakernel.moe_forward(x, idx, w, wg, wu, wd, shared, config)
    poison_free_memory()
    out, saved = megakernel.moe_forward(x, idx, w, wg, wu, wd, shared, config, save=True)
    _, want = expert_path.moe_forward_kernel(x, idx, w, wg, wu, wd, shared,
                                             mok_cute.MoKConfig(backend="kernel"), save=True)
    torch.cuda.synchronize()
    assert torch.equal(out, inference)
    assert saved.preact.shape == want.preact.shape == (300 * K, 2 * 320)
    assert torch.equal(saved.preact, want.preact)
    if Is:
        assert torch.equal(saved.shared_preact, want.shared_preact)
    else:
        assert saved.shared_preact is None
    valid = saved.row_slot >= 0
    assert int(valid.sum()) == 300 * K and torch.equal(torch.sort(saved.row_slot[valid]).values,
                                                       torch.arange(300 * K, device="cuda",
                                                                    dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("R,K,Is,kw", [(2, 4, 128, {"skew": True}), (3, 2, 0, {"empty_expert": 5}),
                                       (4, 2, 64, {"silent_receiver": 2})])
def test_training_forward_on_virtual_ranks_saves_by_global_slot(R, K, Is, kw):
    """Issue 32, item 1, on virtual ranks: the launch keeps g | u in one pool by global slot
    (peer, token, k), and
    the row of (peer p, token t, k) holds the bits of the one-GPU training forward of p's
    tokens at slot t * K + k; the launch's out is the inference launch's."""
    from mok_cute import expert_path, megakernel
    from mok_cute.schedule import build_receive_schedules

    T, H, I, E_loc = 96, 256, 192, 4
    xs, idx, w, wg, wu, wd, sh = _problem(R, T, H, I, E_loc, K, Is, seed=R, **kw)
    config = mok_cute.MoKConfig(timeout_ms=5000.0)
    inference = megakernel.moe_forward_virtual(xs, idx, w, wg, wu, wd, sh, config)
    poison_free_memory()
    out, saved = megakernel.moe_forward_virtual(xs, idx, w, wg, wu, wd, sh, config, save=True)
    torch.cuda.synchronize()
    assert torch.equal(out, inference)
    flat = lambda t: t.reshape(R * E_loc, *t.shape[2:])  # noqa: E731  every rank's experts
    wants = [expert_path.moe_forward_kernel(
        xs[p], idx[p], w[p], flat(wg), flat(wu), flat(wd), None if sh is None else
        tuple(t[p] for t in sh), mok_cute.MoKConfig(backend="kernel"), save=True)[1]
        for p in range(R)]
    scheds = build_receive_schedules(idx, E_loc, 128, validate=False)
    assert saved.preact.shape == (R * T * K, 2 * I)
    for r in range(R):
        rows = (scheds.row_token[r] >= 0).nonzero().flatten()
        peer, token, k = (t[r][rows].long() for t in (scheds.row_peer, scheds.row_token,
                                                      scheds.row_k))
        slot = (peer * T + token) * K + k  # one pool by global slot
        assert torch.equal(saved.row_slot[r][rows].long(), slot)
        assert bool((saved.row_slot[r][scheds.row_token[r] < 0] == -1).all())
        for p in range(R):
            mine = peer == p
            assert torch.equal(saved.preact[slot[mine]],
                               wants[p].preact[token[mine] * K + k[mine]]), (r, p)
        if sh is not None:
            assert torch.equal(saved.shared_preact[r], wants[r].shared_preact), r


@pytest.mark.gpu
def test_a_silent_peer_raises_peer_timeout_naming_it():
    from mok_cute import megakernel

    xs, idx, w, wg, wu, wd, sh = _problem(4, 64, 256, 128, 2, 2, seed=9)
    config = mok_cute.MoKConfig(timeout_ms=50.0)
    plan = megakernel.plan_for(xs, wg, wd, sh, idx, config)
    plan.run(xs, idx, w, wg, wu, wd, sh, config.timeout_ms, silent_rank=2)
    with pytest.raises(PeerTimeoutError, match="peer 2"):
        plan.raise_pending_errors()
    # the plan is usable again afterwards
    out = plan.run(xs, idx, w, wg, wu, wd, sh, 5000.0)
    plan.raise_pending_errors()
    assert_tokens_close(out, reference.moe_forward_virtual(xs, idx, w, wg, wu, wd),
                        what="megakernel after a timeout")


@pytest.mark.gpu
def test_out_of_range_ids_contribute_zero_without_the_check():
    xs, idx, w, wg, wu, wd, sh = _problem(2, 64, 256, 128, 4, 4, seed=11)
    bad = idx.clone()
    bad[0, 3, 1] = 1000
    bad[1, 7, 0] = -5
    out = _run((xs, bad, w, wg, wu, wd, sh), check_ids=False)
    w_zeroed = w.clone()
    w_zeroed[0, 3, 1] = 0.0
    w_zeroed[1, 7, 0] = 0.0
    ref = reference.moe_forward_virtual(xs, idx, w_zeroed, wg, wu, wd)
    assert_tokens_close(out, ref, what="megakernel with out-of-range ids")
    with pytest.raises(ValueError, match="topk_idx"):
        _run((xs, bad, w, wg, wu, wd, sh))


@pytest.mark.gpu
def test_recorded_megakernel_timeline_is_sane():
    """Every task that runs is recorded once; comm CTAs record only comm tasks; each CTA's
    task spans follow one another (WAIT spans, written by the waiting thread, may overlap
    the work of the CTA's other warps); a STAGE_WAIT span (a GEMM task's consumers waiting
    for its first stage) lies inside its own GEMM task's span on the same CTA, and so do a
    GEMM task's EPILOGUE and SIGNAL phases, one of each, the SIGNAL starting where the
    EPILOGUE ends and ending with the task."""
    import numpy as np

    from mok_cute import megakernel, tickets
    from mok_cute.tasks import Role, TaskType
    from mok_cute.timeline import GEMM_TASK_TYPES, is_phase, is_wait

    xs, idx, w, wg, wu, wd, sh = _problem(2, 256, 512, 256, 4, 4, 128, seed=13, skew=True)
    config = mok_cute.MoKConfig(timeline=True, num_comm_sms=4)
    mok_cute.moe_forward_virtual(xs, idx, w, wg, wu, wd, shared=sh, config=config)
    torch.cuda.synchronize()
    plan = next(p for k, p in megakernel.cached_plans().items() if k.spec.timeline)
    tl = plan.timeline.decode()
    assert tl.dropped == 0
    rec = tl.records
    work = rec[~is_wait(rec) & ~is_phase(rec)]
    expected = set()
    for rank, sched in enumerate(plan.side.schedules(idx.to(torch.int32))):
        live = tickets.simulate_live_run(plan.task_list, int(sched.num_tiles.item()))
        for role in (Role.COMM, Role.COMPUTE):
            expected |= {(rank, i) for i in live[role]["ran"] + live[role]["noop"]}
    got = list(zip(work["rank"].tolist(), work["task_id"].tolist()))
    assert len(got) == len(set(got)), "a task was recorded twice"
    assert set(got) == expected
    comm = work["cta_id"] < config.num_comm_sms
    assert np.isin(work["task_type"][comm], [int(TaskType.DISPATCH), int(TaskType.COMBINE),
                                             int(TaskType.BARRIER)]).all()
    assert (work["role"][comm] == int(Role.COMM)).all() and (work["role"][~comm] == int(Role.COMPUTE)).all()
    for cta in np.unique(work["cta_id"]):
        spans = work[work["cta_id"] == cta]
        spans = spans[np.argsort(spans["start_ns"], kind="stable")]
        assert (spans["start_ns"] <= spans["end_ns"]).all()
        assert (spans["end_ns"][:-1] <= spans["start_ns"][1:]).all(), f"CTA {cta}: spans overlap"
    gemm = work[np.isin(work["task_type"], [int(t) for t in GEMM_TASK_TYPES])]
    task_span = {(int(r), int(c), int(i)): (int(s), int(e)) for r, c, i, s, e in zip(
        gemm["rank"], gemm["cta_id"], gemm["task_id"], gemm["start_ns"], gemm["end_ns"])}
    stage_waits = rec[rec["task_type"] == int(TaskType.STAGE_WAIT)]
    for r, c, i, s, e in zip(stage_waits["rank"], stage_waits["cta_id"], stage_waits["task_id"],
                             stage_waits["start_ns"], stage_waits["end_ns"]):
        start, end = task_span[(int(r), int(c), int(i))]
        assert start <= s <= e <= end, "a STAGE_WAIT outside its task's span"
    phases = {}
    for t, r, c, i, s, e in zip(rec["task_type"], rec["rank"], rec["cta_id"], rec["task_id"],
                                rec["start_ns"], rec["end_ns"]):
        if t in (int(TaskType.EPILOGUE), int(TaskType.SIGNAL)):
            assert (int(t), int(r), int(c), int(i)) not in phases, "a phase recorded twice"
            phases[(int(t), int(r), int(c), int(i))] = (int(s), int(e))
    assert len(phases) == 2 * len(task_span), "a GEMM task without its two phases"
    for (r, c, i), (start, end) in task_span.items():
        e0, e1 = phases[(int(TaskType.EPILOGUE), r, c, i)]
        s0, s1 = phases[(int(TaskType.SIGNAL), r, c, i)]
        assert start <= e0 <= e1 == s0 <= s1 == end, "phases not inside their task, in order"


# ---------------------------------------------------------------------- CPU: the comm split
def test_comm_split_heuristics():
    """No comm CTA where no row crosses one (one rank, rows in place: measured faster than 1,
    run 107); 12 with every row copied (runs 13-17); at virtual R = 8 the floor with rows in
    place, 10 (better than 12, run 63), or the comm / compute balance where compute per copied
    row is small (qwen3.5: 16, the best of 12-24 measured, runs 59-60)."""
    from mok_cute import megakernel

    H, K = 7168, 8
    assert megakernel.default_num_comm_ctas(1, H, K, 132, rows_in_place=True) == 0
    assert megakernel.default_num_comm_ctas(1, H, K, 132, rows_in_place=False) == \
        megakernel.DEFAULT_COMM_CTAS
    assert megakernel.default_num_comm_ctas(8, 6144, 8, 132, True, 2048, 2048) == \
        megakernel.LOCAL_DIRECT_COMM_CTAS
    assert megakernel.default_num_comm_ctas(8, 4096, 10, 132, True, 1024, 1024) == 16
    assert megakernel.default_num_comm_ctas(8, 512, 2, 132, True, 64, 0) == 132 // 4  # capped


def test_ep_group_sizes_come_from_the_tuner_and_fit_the_plan():
    """On the IPC path the None fields come from the tuner (resolved before the plan), set
    ones are kept, and the result passes the plan's own size checks."""
    from mok_cute import megakernel
    from mok_cute.config import MoKConfig
    from mok_cute.schedule import schedule_capacity
    from mok_cute.sim import tune

    T, H, I, E, K = 2048, 6144, 2048, 256, 8  # glm_5.2 per rank, on 2 GPUs
    tuned = tune.tuned_config(MoKConfig(), 2, T, H, I, E, K, I)
    assert tuned.num_comm_sms in tune.COMM_SMS_GRID
    assert tuned.minibatch_tokens in tune.MINIBATCH_GRID
    assert tuned.ring_tokens % tuned.minibatch_tokens == 0
    assert tuned == tune.tuned_config(MoKConfig(), 2, T, H, I, E, K, I)  # deterministic
    cap = schedule_capacity(2, T, K, E // 2, 128)
    minibatch, ring = megakernel.resolve_sizes(tuned, cap, T)
    assert 0 < minibatch <= ring <= cap
    kept = tune.tuned_config(MoKConfig(num_comm_sms=7), 2, T, H, I, E, K, I)
    assert kept.num_comm_sms == 7 and kept.minibatch_tokens is not None
