"""The megakernel in FP8 (``MoKConfig(precision="fp8")``): e4m3 routed GEMMs
with 1 x 128 / 128 x 128 power-of-two scales promoted every 128-deep group, x and h rows as
packed rows (``fp8.packed_row_bytes``), the shared expert and the combine in bf16.

CI: the fp8 configurations compile (no spill where the plans use them), the packed rows'
torch form, the refusals. H200 (marked gpu): one rank bitwise the one-GPU FP8 expert path
(odd T, H and I not multiples of 128, K = 10, a hot and an empty expert, T = 1, the shared
expert); virtual ranks bitwise one GPU's FP8 layer on every rank's tokens (the rows a GEMM
row sees do not depend on the rank layout); bitwise across runs, comm splits, minibatch and
ring sizes; the packed-row quantizer bitwise its torch form; two processes sharing one GPU over
IPC bitwise the virtual ranks; training (the saving launch, then the one-GPU FP8 backward
kernels) bitwise the FP8 kernel backend at one rank and the one-GPU FP8 path on virtual ranks."""

import dataclasses

import pytest
import torch

import mok_cute
from mok_cute import fp8
from mok_cute.constants import MegakernelSpec
from test_megakernel import _problem  # the megakernel tests' random problems
from poison import poison_free_memory

FP8_SPECS = {
    "one_rank": MegakernelSpec(num_comm_ctas=0, tickets="strided", fp8=True),
    "one_rank_shared": MegakernelSpec(num_comm_ctas=0, tickets="strided", has_shared=True,
                                      fp8=True),
    "virtual_shared": MegakernelSpec(num_ranks=8, num_comm_ctas=12, has_shared=True,
                                     tickets="dynamic", fp8=True),
    "ipc_ring": MegakernelSpec(num_comm_ctas=12, scope="sys", tickets="static",
                               rows_in_place=False, fp8=True),
    "one_rank_save": MegakernelSpec(num_comm_ctas=0, tickets="strided", fp8=True,
                                    save_preact=True),
    "one_rank_timeline": MegakernelSpec(num_comm_ctas=0, tickets="strided", top_k=4, fp8=True,
                                        timeline=True),
    "virtual_shared_save": MegakernelSpec(num_ranks=8, num_comm_ctas=12, has_shared=True,
                                          tickets="dynamic", fp8=True, save_preact=True),
}
# the routed-only builds spill nothing; with the shared expert's bf16 mainloop beside the
# promoting one the registers are tight (docs/measurements.md, FP8 in the megakernel)
SPILL_BOUND = {"one_rank": 0, "ipc_ring": 0, "one_rank_save": 0, "one_rank_shared": 320,
               "virtual_shared": 320, "virtual_shared_save": 512, "one_rank_timeline": 32}


@pytest.mark.parametrize("name", list(FP8_SPECS))
def test_fp8_configurations_compile_with_promotion(name, tmp_path):
    from mok_cute import jit

    rep = jit.inspect_kernel("megakernel", "sm_90a", tmp_path,
                             **dataclasses.asdict(FP8_SPECS[name]))
    assert rep.spill_bytes <= SPILL_BOUND[name], rep.spill_bytes
    ptx = open(rep.ptx_path).read()
    assert "e4m3" in ptx  # the routed GEMMs' wgmmas take e4m3 operands
    assert "fma.rn.f32" in ptx  # the promotion


def test_packed_rows_round_trip():
    x = torch.randn(5, 384) * 3
    q, e = fp8.quantize_rows(x)
    packed = fp8.pack_rows(q, e)
    assert packed.shape == (5, fp8.packed_row_bytes(384)) == (5, 384 + 16)
    q2, e2 = fp8.unpack_rows(packed, 384)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(e2, e)
    assert fp8.packed_row_bytes(128 * 17) == 128 * 17 + 32


@pytest.mark.parametrize("fields, match", [
    ({"fp8": True, "defer_signals": True, "num_comm_ctas": 0}, "no defer_signals"),
])
def test_fp8_specs_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        MegakernelSpec(**fields)


def test_fp8_virtual_training_without_a_gpu_is_refused_by_name():
    if torch.cuda.is_available():
        pytest.skip("CPU path")
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2, 128, 128, dtype=torch.bfloat16)
    idx = torch.zeros(4, 1, dtype=torch.int64)
    tw = torch.ones(4, 1)
    with pytest.raises(ValueError, match="training runs on the FP8 kernels only"):
        mok_cute.moe_forward_virtual(x[None], idx[None], tw[None], w[None], w[None], w[None],
                                     config=mok_cute.MoKConfig(precision="fp8"))


def test_fp8_virtual_without_a_gpu_is_the_emulation_rank_by_rank():
    from mok_cute.expert_path_fp8 import reference_forward

    if torch.cuda.is_available():
        pytest.skip("CPU path")
    g = torch.Generator().manual_seed(0)
    R, T, H, I, E_loc, K = 2, 6, 128, 128, 2, 2
    xs = torch.randn(R, T, H, generator=g).to(torch.bfloat16)
    wg, wu = (torch.randn(R, E_loc, I, H, generator=g) / 12).to(torch.bfloat16), \
        (torch.randn(R, E_loc, I, H, generator=g) / 12).to(torch.bfloat16)
    wd = (torch.randn(R, E_loc, H, I, generator=g) / 12).to(torch.bfloat16)
    idx = torch.randint(0, R * E_loc, (R, T, K), generator=g)
    tw = torch.rand(R, T, K, generator=g)
    out = mok_cute.moe_forward_virtual(xs, idx, tw, wg, wu, wd,
                                       config=mok_cute.MoKConfig(precision="fp8"))
    flat = lambda w: w.reshape(-1, *w.shape[2:])  # noqa: E731
    for r in range(R):
        assert torch.equal(out[r], reference_forward(xs[r], idx[r], tw[r], flat(wg), flat(wu),
                                                     flat(wd)))


# ---------------------------------------------------------------------- H200
@pytest.fixture
def _own_plans():
    from mok_cute import megakernel

    megakernel.release_plans()
    yield
    megakernel.release_plans()


def _one_gpu_fp8(args, r):
    """Rank r's tokens through the one-GPU FP8 expert path over every rank's experts."""
    flat = lambda w: w.reshape(-1, *w.shape[2:])  # noqa: E731
    xs, idx, w, wg, wu, wd, sh = args
    shared = None if sh is None else tuple(t[r] for t in sh)
    return mok_cute.moe_forward(xs[r], idx[r], w[r], flat(wg), flat(wu), flat(wd), shared=shared,
                                config=mok_cute.MoKConfig(backend="kernel", precision="fp8"))


def _run_virtual(args, **cfg):
    poison_free_memory()
    cfg.setdefault("backend", "megakernel")  # never the emulation in its place
    config = mok_cute.MoKConfig(precision="fp8", timeout_ms=5000.0, **cfg)
    out = mok_cute.moe_forward_virtual(*args[:6], shared=args[6], config=config)
    torch.cuda.synchronize()
    return out


ONE_RANK_CASES = {
    # name: (T, H, I, E, K, Is, problem kwargs)
    "T300": (300, 512, 256, 8, 4, 0, {}),
    "H192_I320_shared_T77_K10": (77, 192, 320, 16, 10, 128, {}),
    "T1_K1_H2880": (1, 2880, 256, 4, 1, 0, {}),
    "hot_expert_K8": (1000, 512, 384, 16, 8, 0, {"skew": True}),  # E > K: one hot
    "empty_expert_shared": (260, 256, 128, 4, 2, 64, {"empty_expert": 3}),
}


@pytest.mark.gpu
@pytest.mark.usefixtures("_own_plans")
@pytest.mark.parametrize("name", list(ONE_RANK_CASES))
def test_one_rank_fp8_megakernel_is_bitwise_the_fp8_expert_path(name):
    T, H, I, E, K, Is, pkw = ONE_RANK_CASES[name]
    args = _problem(1, T, H, I, E, K, Is, seed=11, **pkw)
    x, idx, w, wg, wu, wd = (a[0] for a in args[:6])
    shared = None if args[6] is None else tuple(t[0] for t in args[6])
    torch.full((2, T, H), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison
    mega = mok_cute.moe_forward(x, idx, w, wg, wu, wd, shared=shared,
                                config=mok_cute.MoKConfig(backend="megakernel", precision="fp8"))
    again = mok_cute.moe_forward(x, idx, w, wg, wu, wd, shared=shared,
                                 config=mok_cute.MoKConfig(backend="megakernel", precision="fp8"))
    want = _one_gpu_fp8(args, 0)
    assert not torch.isnan(mega.float()).any()
    rows = (mega != want).any(dim=1).nonzero().flatten().tolist()
    assert not rows, f"{len(rows)} tokens differ from the FP8 expert path, first {rows[:8]}"
    assert torch.equal(mega, again)


VIRTUAL_CASES = {
    # name: (R, T, H, I, E_loc, K, Is, problem kwargs, config kwargs)
    "R2_shared_skew": (2, 160, 512, 256, 4, 4, 256, {"skew": True}, {}),
    "R3_H192_I320": (3, 100, 192, 320, 4, 2, 0, {"empty_expert": 5}, {}),
    "R8_ring_wrap": (8, 128, 512, 256, 2, 4, 0, {}, {"ring_tokens": 256, "minibatch_tokens": 128}),
    "R16_K10_shared": (16, 32, 256, 128, 2, 10, 64, {}, {}),
}


@pytest.mark.gpu
@pytest.mark.usefixtures("_own_plans")
@pytest.mark.parametrize("name", list(VIRTUAL_CASES))
def test_virtual_fp8_megakernel_is_bitwise_one_gpu_per_rank(name):
    R, T, H, I, E_loc, K, Is, pkw, ckw = VIRTUAL_CASES[name]
    args = _problem(R, T, H, I, E_loc, K, Is, seed=5, **pkw)
    out = _run_virtual(args, **ckw)
    assert not torch.isnan(out.float()).any()
    for r in range(R):
        want = _one_gpu_fp8(args, r)
        rows = (out[r] != want).any(dim=1).nonzero().flatten().tolist()
        assert not rows, f"rank {r}: {len(rows)} tokens differ, first {rows[:8]}"
    assert torch.equal(_run_virtual(args, **ckw), out)


@pytest.mark.gpu
@pytest.mark.usefixtures("_own_plans")
def test_fp8_bits_do_not_depend_on_the_comm_split_minibatch_or_ring():
    args = _problem(4, 256, 512, 256, 4, 4, 128, seed=3, skew=True)
    base = _run_virtual(args)
    for cfg in ({"num_comm_sms": 2}, {"num_comm_sms": 16}, {"minibatch_tokens": 128},
                {"ring_tokens": 256, "minibatch_tokens": 128, "num_comm_sms": 3}):
        assert torch.equal(_run_virtual(args, **cfg), base), cfg


@pytest.mark.gpu
def test_packed_row_quantizer_is_bitwise_its_torch_form():
    from mok_cute.kernels import quantize

    x = (torch.randn(300, 640, device="cuda") * 4).to(torch.bfloat16)
    x[7] = 0  # an all-zero group
    buf = torch.full((300, fp8.packed_row_bytes(640) + 32), 0xAB, dtype=torch.uint8, device="cuda")
    out = quantize.quantize_packed_rows(x, buf[:, 16:16 + fp8.packed_row_bytes(640)])
    want = fp8.pack_rows(*fp8.quantize_rows(x))
    assert torch.equal(out[:, :645], want[:, :645])  # data and exponents; padding untouched
    assert (buf[:, :16] == 0xAB).all() and (buf[:, 16 + fp8.packed_row_bytes(640):] == 0xAB).all()


# ---------------------------------------------------------------------- training (H200)
TRAIN_CASES = ["T77_shared", "gptoss_reduced", "K10_zero_weights", "dsv3_reduced", "empty_experts"]


@pytest.mark.gpu
@pytest.mark.usefixtures("_own_plans")
@pytest.mark.parametrize("name", TRAIN_CASES)
def test_fp8_megakernel_trains_like_the_fp8_kernel_backend(name):
    """``MoKConfig(backend="megakernel", precision="fp8")`` with inputs that require grad: the
    FP8 megakernel's saving launch (g | u by slot from the promoted accumulator, h quantized)
    and the FP8 backward kernels. The output and every gradient bitwise those of
    ``backend="kernel"`` in FP8, and bitwise on a repeat."""
    from test_backward import CASES, NAMES, _assert_repeats_bitwise, _grads, _problem

    T, H, I, E, K, Is, routing, zero_w = CASES[name]
    leaves, idx = _problem(T, H, I, E, K, Is, seed=T + K, routing=routing, zero_weights=zero_w)
    gen = torch.Generator(device="cuda").manual_seed(T)
    d_out = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    config = mok_cute.MoKConfig(backend="megakernel", precision="fp8")
    out, got = _grads("kernel", leaves, idx, d_out, config)
    out_k, want = _grads("kernel", leaves, idx, d_out,
                         mok_cute.MoKConfig(backend="kernel", precision="fp8"))
    assert torch.equal(out, out_k), f"{name}: the FP8 megakernel's training forward differs"
    for label, a, b in zip(NAMES, got, want):
        if a is None and b is None:
            continue
        assert torch.equal(a, b), f"{name}: {label}"
    _assert_repeats_bitwise(leaves, idx, d_out, out, got, config)


@pytest.mark.gpu
@pytest.mark.usefixtures("_own_plans")
@pytest.mark.parametrize("R,Is,routing", [(2, 0, "skew"), (3, 64, "empty_expert"),
                                          (8, 128, "uniform")])
def test_virtual_fp8_training_equals_one_gpu_with_the_same_tokens(R, Is, routing):
    """R virtual ranks training in FP8 (the saving launch by global slot, the FP8 backward
    kernels over the ranks' concatenated schedules) against the one-GPU FP8 expert path
    holding all R * T tokens and R * E_loc experts (the same shared expert on every rank):
    out, d_xs and d_topk_weights bit for bit, the weight gradients close; bitwise on a
    repeat."""
    from test_backward import NAMES, _close
    from test_virtual_training import _grads, _problem

    T, H, I, E_loc, K = 96, 256, 192, 4, 4
    leaves, idx = _problem(R, T, H, I, E_loc, K, Is, seed=R, routing=routing, same_shared=True)
    d_out = torch.randn(R, T, H, device="cuda").to(torch.bfloat16)
    config = mok_cute.MoKConfig(precision="fp8", timeout_ms=5000.0)
    out, got = _grads("kernel", leaves, idx, d_out, config)

    flat = lambda t: t.detach().reshape(-1, *t.shape[2:]).clone().requires_grad_(True)  # noqa: E731
    x, w, wg, wu, wd = (flat(t) for t in leaves[:5])
    sh = tuple(t.detach()[0].clone().requires_grad_(True) for t in leaves[5:]) or None
    one = mok_cute.moe_forward(x, idx.reshape(R * T, K), w, wg, wu, wd, shared=sh,
                               config=mok_cute.MoKConfig(backend="kernel", precision="fp8"))
    one.backward(d_out.reshape(R * T, H))
    assert torch.equal(out.reshape(R * T, H), one.detach())
    assert torch.equal(got[0].reshape(R * T, H), x.grad), "d_xs"
    assert torch.equal(got[1].reshape(R * T, K), w.grad), "d_topk_weights"
    for label, a, b in zip(NAMES[2:5], got[2:5], (wg.grad, wu.grad, wd.grad)):
        # FP8 against FP8 (other column groups): whole-tensor only, per-row bounds unmeasured
        _close(a.reshape(b.shape), b, f"R={R}: {label}", rows=False)
    out2, again = _grads("kernel", leaves, idx, d_out, config)
    assert torch.equal(out, out2)
    for label, a, b in zip(NAMES, got, again):
        if a is not None:
            assert torch.equal(a, b), f"R={R}: {label} not bitwise reproducible"


def _ipc_forward_rank(rank, world, seed, out_dir, precision):
    """One process of a group of two sharing one GPU: the forward-only IPC megakernel
    (``moe_forward(group=...)`` under no_grad; FP8: packed e4m3 x rows pulled from the peer,
    h rows in the ring) gives this rank's rows of the virtual ranks' output, bitwise, twice
    (the second call reuses the plan and its epoch). T = 150, K = 10, skewed routing."""
    import os

    torch.cuda.set_device(0)  # both ranks on one GPU
    args = _problem(2, 150, 320, 192, 8, 10, 64, seed=seed, skew=True)  # H', I' padded; E = 16
    config = mok_cute.MoKConfig(precision=precision, backend="megakernel", timeout_ms=60000.0)
    with torch.no_grad():
        want = mok_cute.moe_forward_virtual(*args[:6], shared=args[6], config=config)[rank]
        xs, idx, w, wg, wu, wd, sh = args
        for call in range(2):
            poison_free_memory()
            out = mok_cute.moe_forward(xs[rank], idx[rank], w[rank], wg[rank], wu[rank], wd[rank],
                                       shared=tuple(t[rank] for t in sh), config=config,
                                       group=torch.distributed.group.WORLD)
            torch.cuda.synchronize()
            mok_cute.check_errors()
            rows = (out != want).any(dim=1).nonzero().flatten().tolist()
            assert not rows, f"rank {rank}, call {call}: {len(rows)} tokens differ, first {rows[:8]}"
    open(os.path.join(out_dir, f"ok{rank}"), "w").close()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_forward_over_ipc_on_one_gpu_gives_the_virtual_bits(precision):
    import os
    import tempfile

    import gloo_group

    with tempfile.TemporaryDirectory() as tmp:
        gloo_group.spawn(_ipc_forward_rank, 2, tmp, 13, tmp, precision)
        assert {"ok0", "ok1"} <= set(os.listdir(tmp))
