"""moe_forward on the kernel path (gather -> FC1 -> FC2 -> k-sum) against mok_cute.reference.

Every case runs on fresh random data, with the caching allocator poisoned with NaN first so
an unwritten output element shows up, and twice to check bitwise reproducibility. Against the
reference every token on its own (``per_token.assert_tokens_close``): one dropped or misrouted
(token, k) slot fails (tests/test_mutations.py).
"""

import pytest
import torch

import mok_cute as mok
from mok_cute import reference
from per_token import assert_tokens_close
from poison import poison_free_memory

pytestmark = pytest.mark.gpu


def _poison_allocator(nbytes: int = 1 << 30):
    """NaN in every free block the next torch.empty calls can reuse (``poison.py``)."""
    poison_free_memory(nbytes)


def _problem(T, H, I, E, K, shared_i=0, routing="uniform", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    if routing == "uniform":
        scores = torch.rand(T, E, device="cuda", generator=g)
        topk_idx = scores.topk(K, dim=1).indices
    elif routing == "one_expert":  # every token's first choice is expert E-1
        rest = torch.rand(T, E - 1, device="cuda", generator=g).topk(K - 1, dim=1).indices
        topk_idx = torch.cat([torch.full((T, 1), E - 1, device="cuda"), rest], dim=1)
    elif routing == "empty_expert":  # expert 0 never chosen
        topk_idx = torch.rand(T, E - 1, device="cuda", generator=g).topk(K, dim=1).indices + 1
    else:
        raise ValueError(routing)
    topk_idx = topk_idx.to(torch.int32)
    topk_w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), dim=1)
    w_gate = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16, generator=g) / H ** 0.5
    w_up = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16, generator=g) / H ** 0.5
    w_down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) / I ** 0.5
    shared = None
    if shared_i:
        shared = (torch.randn(shared_i, H, device="cuda", dtype=torch.bfloat16, generator=g) / H ** 0.5,
                  torch.randn(shared_i, H, device="cuda", dtype=torch.bfloat16, generator=g) / H ** 0.5,
                  torch.randn(H, shared_i, device="cuda", dtype=torch.bfloat16, generator=g) / shared_i ** 0.5)
    return x, topk_idx, topk_w, w_gate, w_up, w_down, shared


def _check(T, H, I, E, K, shared_i=0, routing="uniform", seed=0):
    args = _problem(T, H, I, E, K, shared_i, routing, seed)
    cfg = mok.MoKConfig(backend="kernel")
    _poison_allocator()
    with torch.no_grad():
        out = mok.moe_forward(*args[:6], shared=args[6], config=cfg)
        _poison_allocator()
        again = mok.moe_forward(*args[:6], shared=args[6], config=cfg)
        ref = reference.moe_forward(*args[:6], shared=args[6])
    torch.cuda.synchronize()
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "unwritten (NaN) output elements"
    worst = assert_tokens_close(out, ref, what=f"kernel path T={T} H={H} I={I} E={E} K={K}")
    assert torch.equal(out, again), "two runs differ: not bitwise reproducible"
    return worst


def test_kernel_path_is_taken():
    assert mok.forward_path().startswith("kernel:"), mok.forward_path()


# DESIGN §5 single-GPU shapes at reduced T (full H, I, E, K).
@pytest.mark.parametrize("name,T,H,I,E,K", [
    ("dsv3_ep8_rank", 512, 7168, 2048, 32, 8),
    ("qwen3_30b", 1024, 2048, 768, 128, 8),
    ("sonic_120b", 1024, 4096, 2048, 64, 4),
    ("mixtral", 512, 4096, 14336, 8, 2),
    ("gptoss_120b", 512, 2880, 2880, 128, 4),
])
def test_named_shapes_reduced_T(name, T, H, I, E, K):
    _check(T, H, I, E, K)


@pytest.mark.parametrize("T", [1, 77, 1000])
@pytest.mark.parametrize("shared_i", [0, 512])
def test_odd_token_counts(T, shared_i):
    _check(T, 1024, 512, 8, 4, shared_i=shared_i, seed=T)


@pytest.mark.parametrize("routing", ["empty_expert", "one_expert"])
def test_skewed_routing(routing):
    _check(600, 1024, 512, 16, 4, routing=routing, seed=3)


@pytest.mark.parametrize("K", [1, 10])
def test_top_k_extremes(K):
    _check(333, 512, 256, 16, K, seed=K)


def test_sizes_multiple_of_64_not_256():
    _check(257, 320, 448, 6, 3, shared_i=192, seed=11)


def test_timeline_records_every_tile_once():
    from mok_cute import timeline as tl_mod
    T, H, I, E, K = 700, 1024, 512, 8, 4
    args = _problem(T, H, I, E, K, shared_i=256, seed=5)
    with torch.no_grad():
        out = mok.moe_forward(*args[:6], shared=args[6], config=mok.MoKConfig(timeline=True))
        plain = mok.moe_forward(*args[:6], shared=args[6])
    torch.cuda.synchronize()
    assert torch.equal(out, plain), "recording changed the result"
    tl = tl_mod.last().decode()
    assert tl.dropped == 0
    rec = tl.records
    assert (rec["end_ns"] >= rec["start_ns"]).all()
    # FC1/FC2 tiles: (#M-tiles) x (#N-tiles); M-tiles bounded by the padded rows.
    for ttype in (tl_mod.TaskType.FC1, tl_mod.TaskType.FC2, tl_mod.TaskType.SHARED_FC1,
                  tl_mod.TaskType.SHARED_FC2):
        ids = rec["task_id"][rec["task_type"] == int(ttype)]
        assert len(ids) > 0 and len(ids) == len(set(ids.tolist())), f"{ttype.name} tiles not unique"
        assert sorted(ids.tolist()) == list(range(len(ids))), f"{ttype.name} tiles missing"
    # times are monotone per CTA, except the pingpong FC2's two tiles in flight (one per
    # consumer warpgroup): Timeline.check's rule (this test's own no-overlap rule predated the
    # pingpong FC2 and failed on it, run 67)
    assert tl.check() == []
    fc2 = rec[rec["task_type"] == int(tl_mod.TaskType.FC2)]
    assert any(_overlaps(fc2[fc2["cta_id"] == c]) for c in set(fc2["cta_id"].tolist())), \
        "no CTA ran two FC2 tiles at once: is the pingpong FC2 recorded?"


def _overlaps(rec) -> bool:
    spans = sorted(zip(rec["start_ns"].tolist(), rec["end_ns"].tolist()))
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_check_ids_off_runs_without_host_sync_and_never_faults():
    x, idx, w, wg, wu, wd, _ = _problem(300, 512, 256, 8, 4, seed=21)
    cfg = mok.MoKConfig(backend="kernel", check_ids=False)
    with torch.no_grad():
        checked = mok.moe_forward(x, idx, w, wg, wu, wd, config=mok.MoKConfig(backend="kernel"))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            unchecked = mok.moe_forward(x, idx, w, wg, wu, wd, config=cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(checked, unchecked)
        # an out-of-range id (caller broke the contract) matches no expert: that slot adds 0
        bad = idx.clone()
        bad[5, 1] = 1000
        out = mok.moe_forward(x, bad, w, wg, wu, wd, config=cfg)
        torch.cuda.synchronize()
        w_zeroed = w.clone()
        w_zeroed[5, 1] = 0.0
        expected = mok.moe_forward(x, idx, w_zeroed, wg, wu, wd, config=mok.MoKConfig(backend="kernel"))
        assert torch.equal(out, expected)


def test_out_of_range_id_raises_on_the_kernel_path():
    x, idx, w, wg, wu, wd, _ = _problem(64, 256, 128, 8, 2, seed=4)
    bad = idx.clone()
    bad[3, 0] = 8  # E = 8: one past the last expert
    with pytest.raises(ValueError, match="topk_idx"):
        mok.moe_forward(x, bad, w, wg, wu, wd, config=mok.MoKConfig(backend="kernel"))
    bad[3, 0] = -1
    with pytest.raises(ValueError, match="topk_idx"):
        mok.moe_forward(x, bad, w, wg, wu, wd, config=mok.MoKConfig(backend="kernel"))


@pytest.mark.parametrize("timeline", [False, True])
def test_cuda_graph_capture_replays_bitwise(timeline):
    """With check_ids=False the kernel path has no host sync, so a training step can
    capture it in a CUDA graph (after a warm-up call has compiled every kernel). Recording
    too: its buffer's header is set by a fill kernel, not a host copy that would block."""
    x, idx, w, wg, wu, wd, shared = _problem(500, 1024, 512, 8, 4, shared_i=256, seed=8)
    cfg = mok.MoKConfig(backend="kernel", check_ids=False, timeline=timeline)
    with torch.no_grad():
        eager = mok.moe_forward(x, idx, w, wg, wu, wd, shared=shared, config=cfg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mok.moe_forward(x, idx, w, wg, wu, wd, shared=shared, config=cfg)
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        # new inputs in the same buffers: the replay computes the new layer
        x.copy_(torch.randn_like(x))
        idx.copy_(torch.rand(500, 8, device="cuda").topk(4, dim=1).indices.to(torch.int32))
        graph.replay()
        fresh = mok.moe_forward(x, idx, w, wg, wu, wd, shared=shared, config=cfg)
        torch.cuda.synchronize()
        assert torch.equal(captured, fresh)


def test_megakernel_cuda_graph_capture_replays_bitwise():
    """The megakernel at one rank captured (check_ids=False): nothing of its error bookkeeping
    runs while capturing (an event query there breaks the capture), and once captured its
    x-offset scalar is written in every call, so a replay after an eager call of the same plan
    at another x address reads the captured x, and the next eager call its own."""
    x, idx, w, wg, wu, wd, shared = _problem(300, 1024, 512, 8, 4, shared_i=256, seed=9)
    cfg = mok.MoKConfig(backend="megakernel", check_ids=False)
    with torch.no_grad():
        eager = mok.moe_forward(x, idx, w, wg, wu, wd, shared=shared, config=cfg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mok.moe_forward(x, idx, w, wg, wu, wd, shared=shared, config=cfg)
        other = torch.randn_like(x)
        other_out = mok.moe_forward(other, idx, w, wg, wu, wd, shared=shared, config=cfg)
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        assert not torch.equal(other_out, eager)
        # and an eager call after the replay, at the address it saw before, reads its own x
        assert torch.equal(mok.moe_forward(other, idx, w, wg, wu, wd, shared=shared, config=cfg),
                           other_out)
    mok.check_errors()


@pytest.mark.parametrize("backend", ["kernel", "megakernel"])
def test_tensors_on_another_device_than_the_current_one(backend):
    """Tensors on cuda:1 while cuda:0 is current: the call (forward and backward, through the
    api and the custom ops) runs on cuda:1's stream, bitwise the call made with cuda:1 current
    (it launched on the current device's stream: reads from the wrong device)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with torch.cuda.device(1):
        x, idx, w, wg, wu, wd, shared = _problem(200, 512, 256, 8, 4, shared_i=128, seed=12)
    cfg = mok.MoKConfig(backend=backend, check_ids=False)
    leaves = [t.requires_grad_() for t in (x, w, wg, wu, wd, *shared)]

    def step():
        for t in leaves:
            t.grad = None
        out = mok.moe_forward(x, idx, w, wg, wu, wd, shared=shared, config=cfg)
        out.float().square().sum().backward()
        return [out.detach(), *(t.grad.clone() for t in leaves)]

    with torch.cuda.device(1):
        want = step()
    with torch.cuda.device(0):
        got = step()
    torch.cuda.synchronize(1)
    for a, b in zip(got, want):
        assert a.device.index == 1 and torch.equal(a, b)


def test_megakernel_calls_on_two_streams_take_turns():
    """Two calls of one shape (one plan: its counters and rings) queued on two streams without
    a host sync between them: the second waits for the first (an event), both bitwise the
    calls on one stream."""
    a = _problem(300, 1024, 512, 8, 4, seed=10)
    b = _problem(300, 1024, 512, 8, 4, seed=11)
    cfg = mok.MoKConfig(backend="megakernel", check_ids=False)
    with torch.no_grad():
        want = [mok.moe_forward(*p[:6], config=cfg) for p in (a, b)]
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        for p in (a, b):
            for t in p[:6]:
                t.record_stream(s1)
                t.record_stream(s2)
        with torch.cuda.stream(s1):
            out_a = mok.moe_forward(*a[:6], config=cfg)
        with torch.cuda.stream(s2):
            out_b = mok.moe_forward(*b[:6], config=cfg)
        torch.cuda.synchronize()
    assert torch.equal(out_a, want[0]) and torch.equal(out_b, want[1])


def test_megakernel_plans_of_many_batch_sizes_stay_bounded():
    """One GPU's megakernel plans are keyed by T: a run with varying T keeps the last
    MAX_LOCAL_PLANS (an evicted plan's launches waited for), each call still right; a plan a
    CUDA graph captured is kept past the bound, so the graph still replays right."""
    from mok_cute import megakernel

    megakernel.release_plans()
    cfg = mok.MoKConfig(backend="megakernel", check_ids=False)
    with torch.no_grad():
        g = _problem(48, 512, 256, 8, 2, seed=1)
        eager = mok.moe_forward(*g[:6], config=cfg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mok.moe_forward(*g[:6], config=cfg)
        for T in (64, 96, 128, 160, 192, 64):
            x, idx, w, wg, wu, wd, _ = _problem(T, 512, 256, 8, 2, seed=T)
            out = mok.moe_forward(x, idx, w, wg, wu, wd, config=cfg)
            want = reference.moe_forward(x, idx, w, wg, wu, wd)
            assert_tokens_close(out, want, what=f"T={T}")
            assert len(megakernel._LOCAL_PLANS) <= megakernel.MAX_LOCAL_PLANS + 1
        assert any(p.order.captured for p in megakernel.cached_plans().values())
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    megakernel.release_plans()


EDGE_CASES = [  # T, H, I, E, K, routing, shared expert's I
    (512, 7168, 2048, 32, 8, "uniform", 0),      # dsv3_ep8_rank at reduced T
    (1024, 4096, 2048, 64, 4, "uniform", 0),     # sonic_120b at reduced T
    (1, 1024, 512, 8, 4, "uniform", 0),
    (77, 1024, 512, 8, 4, "uniform", 0),         # T not a multiple of the tile
    (600, 1024, 512, 16, 4, "one_expert", 0),    # skewed: every token's first choice one expert
    (600, 1024, 512, 16, 4, "empty_expert", 0),
    (333, 512, 256, 16, 1, "uniform", 0),
    (333, 512, 256, 16, 10, "uniform", 0),
    (257, 320, 448, 6, 3, "uniform", 0),         # H = 320: a last N-tile of 64 columns
    (300, 1024, 512, 8, 4, "uniform", 256),      # the shared expert
]


@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_shapes_write_every_element_and_repeat_bitwise(case):
    """x is scattered into expert order token-major, so the padding rows keep what the
    allocator left there (poisoned with NaN here); their FC1 / FC2 rows are never read. Twice:
    no NaN in the output, bitwise equal, and against the reference."""
    T, H, I, E, K, routing, shared_i = case
    args = _problem(T, H, I, E, K, shared_i, routing, seed=T + K)
    cfg = mok.MoKConfig(backend="kernel")
    runs = []
    with torch.no_grad():
        for _ in range(2):
            _poison_allocator()
            runs.append(mok.moe_forward(*args[:6], shared=args[6], config=cfg))
        ref = reference.moe_forward(*args[:6], shared=args[6])
    torch.cuda.synchronize()
    for out in runs:
        assert not out.isnan().any(), "unwritten (NaN) output elements"
    assert torch.equal(runs[0], runs[1]), "not bitwise reproducible"
    assert_tokens_close(runs[0], ref, what=f"kernel path {case}")


@pytest.mark.gpu
def test_poisoning_reaches_the_small_pool_and_a_repeat_runs_freed_blocks():
    """``poison.poison_free_memory``: a small buffer (the small pool) and a block just freed by
    a "first run" read as NaN when allocated again, where one big NaN tensor reached neither."""
    first = torch.randn(300, 512, device="cuda").to(torch.bfloat16)  # 300 KiB: small pool
    del first
    poison_free_memory()
    again = torch.empty(300, 512, dtype=torch.bfloat16, device="cuda")
    assert again.isnan().all()
    big = torch.randn(1 << 22, device="cuda")
    del big
    poison_free_memory()
    assert torch.empty(1 << 22, device="cuda").isnan().all()
