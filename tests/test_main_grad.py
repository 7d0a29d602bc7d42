"""Fused weight-gradient accumulation: ``MoKConfig(fuse_wgrad_accumulation=True)`` adds each
expert weight's fp32 gradient into its ``main_grad`` (Megatron's convention).

CPU: the config field (checked, serialised, agreed over a group); every bad main_grad refused
naming its weight; a frozen weight's or a call's without grad not read; the PyTorch reference
(the fallback without a GPU, one GPU and virtual ranks) adding its fp32 gradient (main_grad
from zeros, rounded to bf16, is the unfused gradient bitwise; from any start, start + it;
calls accumulate, also two calls in flight), the weight's ``.grad`` None or Megatron's dummy
with ``grad_added_to_main_grad``; over a gloo group of two processes (the reference's
all_to_all path) the same, and a rank's bad main_grad raised on every rank; the custom ops'
plumbing end to end through ``mok_cute.moe_forward`` / ``moe_forward_virtual`` with their
kernels replaced by torch emulations (eager and torch.compile(fullgraph=True,
backend="aot_eager"): the same bits, the buffers mutated by the backward op; two calls in
flight: eager adds both, compiled raises torch's in-place error), ``_GroupTrain`` handing the
group backward [1, ...] views, the ops' schemas (the backward ops mutate the buffers and
return fixed tuples), fakes and opcheck.

H200 (marked gpu; written, not yet run): for backend "kernel" and "megakernel", bf16 and FP8,
main_grad from zeros rounded to bf16 is the unfused weight gradient bitwise (the unfused
kernels round the same fp32 accumulator once); from a random start, start + gradient within a
bf16 half-ulp of the gradient plus the fp32 add's rounding; two backwards accumulate; repeats
are bitwise; every other gradient is the unfused run's; torch.compile(fullgraph=True) gives
eager's bits; FP8 weight gradients on gemm_wgrad_fp8; virtual ranks with [R, E_loc, ...]
buffers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mok_cute as mok
from mok_cute import api, reference
from mok_cute.config import MoKConfig
from poison import poison_free_memory

NAMES = ["w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"]
FUSED = MoKConfig(fuse_wgrad_accumulation=True)


# ---------------------------------------------------------------------- the config (CPU)
def test_config_field_is_checked_serialised_and_agreed():
    from mok_cute.bench.common import apply_config_overrides, parse_config_overrides
    from mok_cute.comm.agreement import _config_digests

    assert MoKConfig().fuse_wgrad_accumulation is False
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="MoKConfig.fuse_wgrad_accumulation: expected a bool"):
            MoKConfig(fuse_wgrad_accumulation=bad)
    assert dataclasses.asdict(FUSED)["fuse_wgrad_accumulation"] is True  # bench JSON
    overrides = parse_config_overrides(["fuse_wgrad_accumulation=true"])
    assert apply_config_overrides(MoKConfig(), overrides) == FUSED
    # every rank of a group must pass the same value: its own field in the agreement
    names, plain = _config_digests(MoKConfig())
    _, fused = _config_digests(FUSED)
    differ = [n for n, a, b in zip(names, plain, fused) if a != b]
    assert differ == ["fuse_wgrad_accumulation"]


# ---------------------------------------------------------------------- problems (CPU)
def _cpu_problem(gen, T=24, H=32, I=16, E=4, K=2, Is=8, R=None, params=True):
    """[x, topk_weights, w_gate, w_up, w_down, (ws_gate, ws_up, ws_down)], ids; with R a
    leading rank dim (moe_forward_virtual). Weights as nn.Parameter (as a model holds them)."""
    lead = () if R is None else (R,)
    E_loc = E if R is None else E // R

    def bf(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(torch.bfloat16)

    x = bf(*lead, T, H)
    idx = torch.rand(*lead, T, E, generator=gen).topk(K, dim=-1).indices
    w = torch.softmax(torch.randn(*lead, T, K, generator=gen), dim=-1)
    weights = [bf(*lead, E_loc, I, H, scale=H ** -0.5), bf(*lead, E_loc, I, H, scale=H ** -0.5),
               bf(*lead, E_loc, H, I, scale=I ** -0.5)]
    if Is:
        weights += [bf(*lead, Is, H, scale=H ** -0.5), bf(*lead, Is, H, scale=H ** -0.5),
                    bf(*lead, H, Is, scale=Is ** -0.5)]
    weights = [torch.nn.Parameter(t) if params else t.requires_grad_() for t in weights]
    return [x.requires_grad_(), w.requires_grad_(), *weights], idx


def _call(leaves, idx, config, virtual=False):
    x, w, wg, wu, wd, *sh = leaves
    fn = mok.moe_forward_virtual if virtual else mok.moe_forward
    return fn(x, idx, w, wg, wu, wd, shared=tuple(sh) or None, config=config)


def _step(leaves, idx, d_out, config, virtual=False):
    """One forward + backward: (out, every leaf's .grad cloned or None)."""
    for t in leaves:
        t.grad = None
    out = _call(leaves, idx, config, virtual)
    out.backward(d_out)
    return out.detach(), [None if t.grad is None else t.grad.clone() for t in leaves]


def _give_main_grads(leaves, start=None, gen=None):
    """An fp32 main_grad on every weight (zeros, or random with ``gen``); returns them."""
    out = []
    for t in leaves[2:]:
        t.main_grad = (torch.zeros(t.shape) if gen is None
                       else torch.randn(t.shape, generator=gen))
        out.append(t.main_grad.clone())
    return out


# ---------------------------------------------------------------------- bad main_grads (CPU)
BAD = {  # name: (weight index among leaves, make the bad main_grad from the weight, got text)
    "missing": (2, None, "no main_grad attribute"),
    "float16": (2, lambda t: torch.zeros(t.shape, dtype=torch.float16), "dtype=torch.float16"),
    "bf16": (4, lambda t: torch.zeros(t.shape, dtype=torch.bfloat16), "dtype=torch.bfloat16"),
    "shape": (3, lambda t: torch.zeros(t.shape[0], t.shape[1] + 1, t.shape[2]), r"shape=\(4, 17, 32\)"),
    "transposed": (4, lambda t: torch.zeros(t.shape[0], t.shape[2], t.shape[1]).transpose(1, 2),
                   "non-contiguous"),
    "device": (2, lambda t: torch.zeros(t.shape, device="meta"), "device=meta"),
    "not_a_tensor": (2, lambda t: t.detach().float().numpy(), "ndarray"),
    "None": (2, lambda t: None, "NoneType None"),
    "shared": (7, lambda t: torch.zeros(t.shape, dtype=torch.float64), "dtype=torch.float64"),
}
WEIGHT_TEXT = {2: r"w_gate", 3: r"w_up", 4: r"w_down", 7: r"shared\[2\] \(ws_down\)"}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_main_grad_is_refused_naming_the_weight(case, gen):
    leaves, idx = _cpu_problem(gen)
    _give_main_grads(leaves)
    i, make, got = BAD[case]
    if make is None:
        del leaves[i].main_grad
    else:
        leaves[i].main_grad = make(leaves[i])
    shape = list(leaves[i].shape)
    pattern = (rf"{WEIGHT_TEXT[i]}\.main_grad: expected a contiguous float32 tensor of shape "
               rf"\[{', '.join(map(str, shape))}\] on cpu \(MoKConfig\(fuse_wgrad_accumulation="
               rf"True\) adds the weight's gradient into it\), got .*{got}")
    with pytest.raises(ValueError, match=pattern):
        _call(leaves, idx, FUSED)


def test_main_grads_sharing_memory_are_refused_and_views_of_one_buffer_taken(gen):
    """Two weights' main_grads in the same memory (one tensor given twice, or overlapping
    views) are refused by name: the adds into them would race. Disjoint views of one flat
    buffer (Megatron's grad buffer) are taken and get the same sums as separate buffers."""
    leaves, idx = _cpu_problem(gen)
    _give_main_grads(leaves)
    leaves[3].main_grad = leaves[2].main_grad
    with pytest.raises(ValueError, match=r"w_up\.main_grad: shares memory with w_gate\.main_grad"):
        _call(leaves, idx, FUSED)
    sizes = [t.numel() for t in leaves[2:]]
    flat = torch.zeros(sum(sizes) + 1)
    views, at = [], 0
    for t, n in zip(leaves[2:], sizes):
        views.append(flat[at:at + n].view(t.shape))
        at += n
    overlapping = flat[1:1 + sizes[2]].view(leaves[4].shape)  # w_down's view, one element in
    for t, v in zip(leaves[2:], views):
        t.main_grad = v
    leaves[4].main_grad = overlapping
    with pytest.raises(ValueError, match=r"w_down\.main_grad: shares memory with w_gate"):
        _call(leaves, idx, FUSED)
    leaves[4].main_grad = views[2]
    _call(leaves, idx, FUSED)
    got = [t.main_grad.clone() for t in leaves[2:]]
    _give_main_grads(leaves)
    _call(leaves, idx, FUSED)
    for name, a, t in zip(NAMES, got, leaves[2:]):
        assert torch.equal(a, t.main_grad), name


def test_megatron_fsdp_parameters_are_refused_naming_the_weight(gen):
    """A Megatron-FSDP parameter fetches its main_grad in the backward (``get_main_grad``): a
    fused call refuses it by name rather than add into a buffer read in the forward."""
    leaves, idx = _cpu_problem(gen)
    _give_main_grads(leaves)
    leaves[3].__fsdp_param__ = True
    leaves[3].get_main_grad = lambda: torch.zeros(leaves[3].shape)
    with pytest.raises(ValueError, match=r"w_up: a Megatron-FSDP parameter \(__fsdp_param__\)"):
        _call(leaves, idx, FUSED)
    # without the flag: its gradient arrives as .grad, main_grad untouched
    before = leaves[3].main_grad.clone()
    _, grads = _step(leaves, idx, torch.randn(24, 32, generator=gen).to(torch.bfloat16),
                     MoKConfig())
    assert grads[3] is not None and grads[3].abs().sum() > 0
    assert torch.equal(leaves[3].main_grad, before)


def test_virtual_main_grad_has_the_stacked_shape(gen):
    leaves, idx = _cpu_problem(gen, R=2)
    _give_main_grads(leaves)
    leaves[2].main_grad = torch.zeros(leaves[2].shape[1:])  # one rank's shape
    with pytest.raises(ValueError, match=r"w_gate\.main_grad: expected .* of shape \[2, 2, 16, 32\]"):
        _call(leaves, idx, FUSED, virtual=True)


def test_frozen_weights_and_calls_without_grad_read_nothing(gen):
    leaves, idx = _cpu_problem(gen)
    d_out = torch.randn(24, 32, generator=gen).to(torch.bfloat16)
    # no main_grad anywhere: fine without grad, or with the flag off
    with torch.no_grad():
        _call(leaves, idx, FUSED)
    _step(leaves, idx, d_out, MoKConfig())
    frozen = [t.detach() for t in leaves]  # nothing requires grad: the call does not train
    _call(frozen, idx, FUSED)
    # a frozen weight's main_grad is not required; the others accumulate
    _give_main_grads(leaves)
    for i in (3, 6):  # w_up, ws_up
        leaves[i].requires_grad_(False)
        del leaves[i].main_grad
    _, grads = _step(leaves, idx, d_out, FUSED)
    assert all(g is None for g in grads[2:])
    assert leaves[2].main_grad.abs().sum() > 0 and leaves[7].main_grad.abs().sum() > 0


# ---------------------------------------------------------------------- the reference (CPU)
@pytest.mark.parametrize("virtual", [False, True])
def test_reference_adds_its_fp32_gradient_into_main_grad(virtual, gen):
    """On the PyTorch reference (no GPU here): the same output and d_x, d_topk_weights bits
    as the unfused call; main_grad from zeros is the fp32 gradient whose bf16 rounding is the
    unfused gradient, bit for bit where the reference uses each weight once (one rank; the
    virtual ranks' shared experts). Virtual ranks' routed experts serve every rank's tokens:
    the unfused reference rounds each rank's share to bf16 before summing them, main_grad holds
    the fp32 sum, so there they agree to bf16 rounding. From a random start, start + it; a
    second backward adds it again; the weights' .grad stays None."""
    leaves, idx = _cpu_problem(gen, R=2 if virtual else None)
    d_out = torch.randn(*leaves[0].shape, generator=gen).to(torch.bfloat16)
    out, want = _step(leaves, idx, d_out, MoKConfig(), virtual)

    _give_main_grads(leaves)
    got_out, got = _step(leaves, idx, d_out, FUSED, virtual)
    assert torch.equal(got_out, out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(g is None for g in got[2:])
    acc = [t.main_grad.clone() for t in leaves[2:]]
    for i, (name, a, t, g) in enumerate(zip(NAMES, acc, leaves[2:], want[2:])):
        assert a.dtype == torch.float32 and a.shape == t.shape, name
        if virtual and i < 3:
            bound = 2.0 ** -7 * g.float().abs().max().item()
            assert (a - g.float()).abs().max().item() <= bound, name
            assert not torch.equal(a.to(torch.bfloat16), g), name  # else the test is moot
        else:
            assert torch.equal(a.to(torch.bfloat16), g), name

    starts = _give_main_grads(leaves, gen=gen)
    _step(leaves, idx, d_out, FUSED, virtual)
    _step(leaves, idx, d_out, FUSED, virtual)
    for name, s, a, t in zip(NAMES, starts, acc, leaves[2:]):
        assert torch.equal(t.main_grad, s + a + a), name


def test_reference_accumulates_over_calls_in_flight(gen):
    """Two calls' graphs alive at once (pipeline micro-batches, a layer called twice), then
    their backwards in any order: each adds its gradient (the buffer is not a saved tensor, so
    no version-counter error)."""
    leaves, idx = _cpu_problem(gen)
    d_out = torch.randn(24, 32, generator=gen).to(torch.bfloat16)
    _give_main_grads(leaves)
    _step(leaves, idx, d_out, FUSED)
    once = [t.main_grad.clone() for t in leaves[2:]]
    _give_main_grads(leaves)
    a, b = _call(leaves, idx, FUSED), _call(leaves, idx, FUSED)
    b.backward(d_out)
    a.backward(d_out)
    for name, o, t in zip(NAMES, once, leaves[2:]):
        assert torch.equal(t.main_grad, o + o), name


def test_megatron_dummy_gradient_convention(gen):
    """A weight with ``grad_added_to_main_grad`` (Megatron's DDP sets it False each step): the
    call sets it True and the weight gets a dummy gradient of its shape and dtype, so that its
    DDP hook fires (zeros with ``zero_out_wgrad``); a weight without it gets None."""
    leaves, idx = _cpu_problem(gen)
    d_out = torch.randn(24, 32, generator=gen).to(torch.bfloat16)
    _give_main_grads(leaves)
    for t in leaves[2:6]:
        t.grad_added_to_main_grad = False
    leaves[3].zero_out_wgrad = True
    _, grads = _step(leaves, idx, d_out, FUSED)
    for i, t in enumerate(leaves[2:], start=2):
        if i < 6:
            assert t.grad_added_to_main_grad is True
            assert grads[i].shape == t.shape and grads[i].dtype == t.dtype
        else:
            assert not hasattr(t, "grad_added_to_main_grad") and grads[i] is None
    assert torch.equal(grads[3], torch.zeros_like(grads[3]))


def test_layer_with_fused_accumulation(gen):
    """MoELayer passes the config through: its expert parameters' main_grad accumulate, the
    router's gradient is autograd's."""
    layer = mok.MoELayer(32, 16, 4, 2, shared_intermediate=8, config=FUSED)
    params = [layer.w_gate, layer.w_up, layer.w_down, layer.ws_gate, layer.ws_up, layer.ws_down]
    for p in params:
        p.main_grad = torch.zeros(p.shape)
    x = torch.randn(2, 12, 32, generator=gen).to(torch.bfloat16)
    layer(x).float().square().mean().backward()
    assert layer.router.weight.grad is not None
    assert all(p.grad is None and p.main_grad.abs().sum() > 0 for p in params)


def _check_group_reference(rank, world):
    """One rank of a gloo group on the reference (all_to_all): the fused call's output, d_x and
    d_topk_weights bits are the unfused call's, its weights' .grad None, main_grad the fp32
    gradient (its experts serve every rank's rows: the unfused reference rounds each peer's
    share to bf16 before summing, so they agree to bf16 rounding; the shared expert serves
    this rank only: bitwise). Then a rank without a main_grad: it raises its ValueError, its
    peers the agreement's error naming it, before any exchange."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1234 + rank)
    leaves, idx = _cpu_problem(gen, T=16 + 4 * rank, E=2 * world, Is=8)
    group = dist.group.WORLD
    d_out = torch.randn(*leaves[0].shape, generator=gen).to(torch.bfloat16)

    def step(config):
        for t in leaves:
            t.grad = None
        x, w, wg, wu, wd, *sh = leaves
        out = mok.moe_forward(x, idx, w, wg, wu, wd, shared=tuple(sh), group=group, config=config)
        out.backward(d_out)
        return out.detach(), [None if t.grad is None else t.grad.clone() for t in leaves]

    out, want = step(MoKConfig())
    _give_main_grads(leaves)
    got_out, got = step(FUSED)
    assert torch.equal(got_out, out) and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1]) and all(g is None for g in got[2:])
    for i, (name, t, g) in enumerate(zip(NAMES, leaves[2:], want[2:])):
        if i < 3:
            bound = 2.0 ** -7 * g.float().abs().max().item()
            assert (t.main_grad - g.float()).abs().max().item() <= bound, (rank, name)
        else:
            assert torch.equal(t.main_grad.to(torch.bfloat16), g), (rank, name)
    if rank == 1:
        del leaves[2].main_grad
        with pytest.raises(ValueError, match=r"w_gate\.main_grad: .*got no main_grad attribute"):
            step(FUSED)
    else:
        with pytest.raises(RuntimeError, match=r"rank 1 rejected the call .*w_gate\.main_grad"):
            step(FUSED)


def test_group_reference_accumulates_and_agrees_on_bad_main_grads(tmp_path):
    import torch.distributed as dist

    import gloo_group

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is needed")
    gloo_group.spawn(_check_group_reference, 2, tmp_path)


# ---------------------------------------------------------------------- the custom ops (CPU)
def _fp32_grads(leaves, idx, d_out, virtual=False):
    """Autograd on the reference over fp32 copies of the weights: (d_x, d_topk_weights, the six
    weight gradients in fp32, None without a shared expert). Computed outside the custom ops
    (their bodies run below autograd)."""
    x, w, *weights = (t.detach().requires_grad_() for t in leaves)
    w32 = [t.float().detach().requires_grad_() for t in weights]
    shared = tuple(w32[3:]) or None
    forward = reference._forward_virtual if virtual else reference._forward
    out = forward(x, idx, w, *w32[:3], shared, *(() if virtual else (None,)))
    grads = torch.autograd.grad(out, [x, w, *w32], d_out)
    return list(grads) + [None] * (8 - len(grads))


def _emulated_grads(state, d_out, x, w, weights, needs, main_grads):
    """What the backward kernels return, from ``state["grads"]`` (``_fp32_grads`` of this
    d_out): the weight gradients are fp32 sums rounded once to bf16, or, with a main_grad,
    added into it unrounded (None returned), as the kernels do."""
    assert torch.equal(d_out, state["d_out"])
    d_x, d_w, *d_weights = state["grads"]
    wanted = [needs[2], needs[2], needs[3], needs[4], needs[4], needs[5]]
    mgs = main_grads if main_grads is not None else (None,) * 6
    result = []
    for g, t, want, mg in zip(d_weights, weights, wanted, mgs):
        if t is None or not want:
            result.append(None)
        elif mg is not None:
            mg.add_(g)
            result.append(None)
        else:
            result.append(g.to(t.dtype))
    return (d_x.to(x.dtype) if needs[0] else None, d_w.to(w.dtype) if needs[1] else None,
            *result)


@pytest.fixture
def emulated_kernels(monkeypatch):
    """``mok_cute.moe_forward`` / ``moe_forward_virtual`` take their training paths (the custom
    ops) on the CPU: the path check says yes, the kernels inside the ops are torch emulations
    (forward: the reference's output, zeros for the saved tensors; backward:
    ``_emulated_grads``). Returns the dict the emulated backward reads: "d_out" and "grads"
    (``_fp32_grads``), set by the test."""
    from mok_cute import expert_backward, expert_path, megakernel, virtual_backward
    from mok_cute.schedule import saved_preact_rows, schedule_capacity
    from mok_cute.virtual_backward import VirtualSaved

    state = {}
    monkeypatch.setattr(api, "_kernel_status", lambda device: (True, "emulated kernels"))
    monkeypatch.setattr(expert_path, "unsupported_shape_reason", lambda *a, **k: None)
    i32 = dict(dtype=torch.int32)

    def forward_kernel(x, idx, w, wg, wu, wd, shared, config, save=False):
        out = reference._forward(x, idx, w, wg, wu, wd, shared, None)
        (T, K), (E, I) = idx.shape, wg.shape[:2]
        cap = schedule_capacity(1, T, K, E, 128)
        if not save:  # an inference call (torch.no_grad: reentrant checkpointing's first run)
            return out
        sp = (torch.zeros(T, 2 * shared[0].shape[0], dtype=torch.bfloat16) if shared
              else torch.zeros(0, 0, dtype=torch.bfloat16))
        return out, expert_path.SavedForBackward(
            torch.zeros(T * K, 2 * I, dtype=torch.bfloat16), sp, torch.zeros(cap, **i32),
            torch.zeros(T * K, **i32), torch.zeros(cap // 128, **i32), torch.zeros(1, **i32),
            torch.zeros(E + 1, **i32))

    def backward(d_out, x, idx, w, wg, wu, wd, shared, saved, needs, options, precision,
                 dgrads="kernels", main_grads=None, timeline=None):
        state["backward_timeline"] = timeline
        return _emulated_grads(state, d_out, x, w, [wg, wu, wd, *(shared or (None,) * 3)],
                               needs, main_grads)

    def forward_virtual(xs, idx, w, wg, wu, wd, shared, config, save=False):
        out = reference._forward_virtual(xs, idx, w, wg, wu, wd, shared)
        (R, T, K), (E, I) = idx.shape, wg.shape[1:3]
        cap = schedule_capacity(R, T, K, E, 128)
        if not save:
            return out
        sp = (torch.zeros(R, T, 2 * shared[0].shape[1], dtype=torch.bfloat16) if shared
              else torch.zeros(0, dtype=torch.bfloat16))
        return out, VirtualSaved(
            torch.zeros(saved_preact_rows(R, R, T, K, E, 128), 2 * I, dtype=torch.bfloat16), sp,
            *(torch.zeros(R, cap, **i32) for _ in range(4)), torch.zeros(R, cap // 128, **i32),
            torch.zeros(R, **i32), torch.zeros(R, E + 1, **i32))

    def backward_virtual(d_out, xs, w, wg, wu, wd, shared, saved, needs, options, precision,
                         main_grads=None, timeline=None):
        state["backward_timeline"] = timeline
        return _emulated_grads(state, d_out, xs, w, [wg, wu, wd, *(shared or (None,) * 3)],
                               needs, main_grads)

    monkeypatch.setattr(expert_path, "moe_forward_kernel", forward_kernel)
    monkeypatch.setattr(expert_backward, "moe_backward", backward)
    monkeypatch.setattr(megakernel, "moe_forward_virtual", forward_virtual)
    monkeypatch.setattr(VirtualSaved, "from_forward", classmethod(lambda cls, saved: saved))
    monkeypatch.setattr(virtual_backward, "moe_backward_virtual", backward_virtual)
    return state


@pytest.mark.parametrize("virtual,params", [(False, True), (True, True), (False, False)])
def test_custom_ops_accumulate_eager_and_compiled(virtual, params, gen, emulated_kernels):
    """Through ``mok_cute.moe_forward(_virtual)``'s custom ops, kernels emulated: the fused
    call returns the unfused call's output, d_x and d_topk_weights bits, None for the weights
    (Megatron's dummy where asked) and main_grad from zeros whose bf16 rounding is the
    unfused weight gradient; torch.compile(fullgraph=True, backend="aot_eager") traces the
    parameters' (or plain leaf tensors') main_grad reads and the backward op's mutation of
    them: the same bits."""
    R = 2 if virtual else None
    leaves, idx = _cpu_problem(gen, R=R, params=params)
    d_out = torch.randn(*leaves[0].shape, generator=gen).to(torch.bfloat16)
    emulated_kernels.update(d_out=d_out, grads=_fp32_grads(leaves, idx, d_out, virtual))
    config = dataclasses.replace(FUSED, check_ids=False)
    unfused = MoKConfig(check_ids=False)
    probe = _call(leaves, idx, unfused, virtual)
    assert "train" in probe.grad_fn.name(), probe.grad_fn.name()  # the custom op's node
    out, want = _step(leaves, idx, d_out, unfused, virtual)

    leaves[4].grad_added_to_main_grad = False  # w_down: Megatron's dummy
    runs = {}
    for name, fn in (("eager", None), ("compiled", "aot_eager")):
        _give_main_grads(leaves)
        def step(*ts):
            return _call(list(ts), idx, config, virtual)
        if fn is not None:
            step = torch.compile(step, fullgraph=True, backend=fn)
        for t in leaves:
            t.grad = None
        got_out = step(*leaves)
        got_out.backward(d_out)
        runs[name] = (got_out.detach(), [None if t.grad is None else t.grad for t in leaves],
                      [t.main_grad.clone() for t in leaves[2:]])
        assert torch.equal(runs[name][0], out), name
        grads = runs[name][1]
        assert torch.equal(grads[0], want[0]) and torch.equal(grads[1], want[1]), name
        for i in range(2, len(leaves)):
            if i == 4:
                assert grads[i].shape == leaves[i].shape and leaves[i].grad_added_to_main_grad
            else:
                assert grads[i] is None, (name, NAMES[i - 2])
        for n, mg, g in zip(NAMES, runs[name][2], want[2:]):
            assert torch.equal(mg.to(torch.bfloat16), g), (name, n)
    for a, b in zip(runs["eager"][2], runs["compiled"][2]):
        assert torch.equal(a, b)

    # two calls in flight: eager adds both (the buffers are context attributes, not saved
    # tensors); AOT autograd saves them with a version check, so compiled the earlier call's
    # backward raises torch's in-place error instead of adding (documented in autograd.py)
    del leaves[4].grad_added_to_main_grad
    compiled = torch.compile(lambda *ts: _call(list(ts), idx, config, virtual), fullgraph=True,
                             backend="aot_eager")
    for name, fn in (("eager", lambda *ts: _call(list(ts), idx, config, virtual)),
                     ("compiled", compiled)):
        _give_main_grads(leaves)
        first, second = fn(*leaves), fn(*leaves)
        second.backward(d_out)
        if name == "compiled":
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                first.backward(d_out)
            continue
        first.backward(d_out)
        for n, mg, t in zip(NAMES, runs["eager"][2], leaves[2:]):
            assert torch.equal(t.main_grad, mg + mg), n


def test_group_function_hands_the_backward_main_grads_with_the_rank_dim(gen, monkeypatch):
    """``autograd.moe_forward_group`` (a torch.autograd.Function; its launches emulated): the
    group backward gets each main_grad as a [1, ...] view of the buffer (its weights are
    [1, ...] too), whatever it adds lands in the buffer, the weights get None or the dummy."""
    from mok_cute import autograd as ag, group_backward, megakernel

    leaves, idx = _cpu_problem(gen)
    d_out = torch.randn(24, 32, generator=gen).to(torch.bfloat16)
    grads32 = _fp32_grads(leaves, idx, d_out)
    seen = {}

    def forward(x, ids, w, wg, wu, wd, shared, config, group=None, save=False):
        return reference._forward(x, ids, w, wg, wu, wd, shared, None), megakernel.SavedPreact(
            torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32), None)

    def backward_group(d_out1, x1, ids1, w1, wg1, wu1, wd1, shared1, saved, needs, options,
                       tokens_per_rank=None, comm_sms=None, main_grads=None, timeline=None,
                       group_timeout_s=None):
        assert timeline is None  # MoKConfig.timeline is off
        assert group_timeout_s == MoKConfig().group_timeout_s  # the config's, handed on
        seen["main_grads"] = main_grads
        weights = [wg1, wu1, wd1, *shared1]
        out = [grads32[0].to(torch.bfloat16)[None], grads32[1][None]]
        for w1_, g, mg in zip(weights, grads32[2:], main_grads):
            if mg is None:
                out.append(g.to(torch.bfloat16)[None])
            else:
                assert mg.shape == w1_.shape and mg.dtype == torch.float32
                mg.add_(g[None])
                out.append(None)
        return tuple(out)

    monkeypatch.setattr(megakernel, "moe_forward", forward)
    monkeypatch.setattr(group_backward, "moe_backward_group", backward_group)
    x, w, wg, wu, wd, *sh = leaves
    _give_main_grads(leaves)
    leaves[3].requires_grad_(False)  # w_up frozen: no buffer, no gradient
    wd.grad_added_to_main_grad = False
    targets = api._main_grad_targets(FUSED, True, wg, wu, wd, tuple(sh))
    assert targets.main_grads[1] is None and targets.dummies == (0, 0, 1, 0, 0, 0)
    out = ag.moe_forward_group(x, idx.to(torch.int32), w, wg, wu, wd, tuple(sh), MoKConfig(),
                               object(), None, targets)
    out.backward(d_out)
    assert seen["main_grads"].w_up is None
    for name, t, g in zip(NAMES, leaves[2:], grads32[2:]):
        if name == "w_up":
            assert t.grad is None
            continue
        assert torch.equal(t.main_grad, g), name
        assert (t.grad is not None) == (name == "w_down"), name
    assert wd.grad_added_to_main_grad is True
    assert torch.equal(x.grad, grads32[0].to(torch.bfloat16))


def test_custom_op_schemas_fakes_and_opcheck(gen, emulated_kernels):
    """The backward ops declare the six buffers mutated and return fixed 8-tuples (a custom
    op mutating an Optional[Tensor] and returning list[Tensor] fails functionalization); their
    fakes give an empty tensor for a fused weight; opcheck's schema and fake tests pass with
    the buffers given (kernels emulated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mok_cute.autograd as ag

    for op in (torch.ops.mok_cute.moe_backward, torch.ops.mok_cute.moe_backward_virtual):
        schema = op.default._schema
        mutated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert mutated == list(ag._MAIN_GRAD_ARGS)
        assert len(schema.returns) == 8
    for op in (torch.ops.mok_cute.moe_forward_train, torch.ops.mok_cute.moe_forward_virtual_train):
        names = [a.name for a in op.default._schema.arguments]
        assert names[-7:] == [*ag._MAIN_GRAD_ARGS, "dummy_grads"]

    leaves, idx = _cpu_problem(gen)
    x, w, wg, wu, wd, sg, su, sd = (t.detach() for t in leaves)
    mgs = [torch.zeros(t.shape) for t in (wg, wu, wd, sg, su, sd)]
    mgs[1] = None  # w_up returned as usual
    args = (x, idx, w, wg, wu, wd, sg, su, sd, False, 8192, 8, 8, "bf16", "kernel", 0)
    outs = torch.ops.mok_cute.moe_forward_train(*args, *mgs, [0] * 6)
    d_out = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
    emulated_kernels.update(d_out=d_out, grads=_fp32_grads(leaves, idx, d_out))
    back = (d_out, x, idx, w, wg, wu, wd, sg, su, sd, list(outs[1:]), [True] * 6, 8192, 8, 8,
            "bf16", "kernel", 0, *mgs)
    torch.library.opcheck(torch.ops.mok_cute.moe_forward_train, (*args, *mgs, [0] * 6),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mok_cute.moe_backward, back,
                          test_utils=("test_schema", "test_faketensor"))
    grads = torch.ops.mok_cute.moe_backward(*back)
    assert isinstance(grads, tuple)
    assert [tuple(g.shape) for g in grads[2:]] == [(0,), tuple(wu.shape), (0,), (0,), (0,), (0,)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.mok_cute.moe_backward(*back)
    assert [tuple(g.shape) for g in fake] == [tuple(g.shape) for g in grads]


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("virtual", [False, True])
def test_activation_checkpointing_recomputes_through_the_custom_ops(virtual, reentrant, gen,
                                                                    emulated_kernels):
    """``torch.utils.checkpoint`` (both forms) around the layer call (the activations as its
    arguments, the weights as a module's), kernels emulated: the forward runs again in the
    backward (reentrant: first under no_grad, the inference path) and the gradients, the
    fused main_grads' sums included, are those of the plain call, each added once."""
    from torch.utils.checkpoint import checkpoint

    R = 2 if virtual else None
    leaves, idx = _cpu_problem(gen, R=R)
    d_out = torch.randn(*leaves[0].shape, generator=gen).to(torch.bfloat16)
    emulated_kernels.update(d_out=d_out, grads=_fp32_grads(leaves, idx, d_out, virtual))
    for config in (MoKConfig(check_ids=False), dataclasses.replace(FUSED, check_ids=False)):
        fused = config.fuse_wgrad_accumulation
        runs = []
        for wrap in (False, True):
            _give_main_grads(leaves)
            for t in leaves:
                t.grad = None
            if wrap:  # the activations as arguments, the weights as a module holds them
                out = checkpoint(lambda x, w: _call([x, w, *leaves[2:]], idx, config, virtual),
                                 *leaves[:2], use_reentrant=reentrant)
            else:
                out = _call(leaves, idx, config, virtual)
            out.backward(d_out)
            runs.append([t.main_grad.clone() if fused and i >= 2 else t.grad
                         for i, t in enumerate(leaves)])
        for name, a, b in zip(["x", "topk_weights", *NAMES], *runs):
            assert a is not None and torch.equal(a, b), (name, fused)


@pytest.mark.parametrize("virtual", [False, True])
def test_config_timeline_records_the_training_launches_through_the_custom_ops(
        virtual, gen, emulated_kernels, monkeypatch):
    """``MoKConfig(timeline=True)`` under autograd, kernels emulated: the one-GPU forward gets
    the recorder's config (megakernel and expert path; virtual: the launch fields), the
    backward megakernel's launch a
    ``TimelineBuffer`` of at least ``BACKWARD_CAPACITY`` records which ``timeline.last()``
    then holds; with a weight frozen (the backward is launches) or the recorder off, no
    buffer and ``last()`` unchanged."""
    from mok_cute import expert_path, megakernel, timeline

    R = 2 if virtual else None
    leaves, idx = _cpu_problem(gen, R=R)
    d_out = torch.randn(*leaves[0].shape, generator=gen).to(torch.bfloat16)
    emulated_kernels.update(d_out=d_out, grads=_fp32_grads(leaves, idx, d_out, virtual))
    forward_configs = []
    emulated_forward = expert_path.moe_forward_kernel

    def forward_kernel(x, idx, w, wg, wu, wd, shared, config, save=False):
        forward_configs.append(config)
        return emulated_forward(x, idx, w, wg, wu, wd, shared, config, save=save)

    def training_forward(x, idx, w, wg, wu, wd, shared, config):
        return forward_kernel(x, idx, w, wg, wu, wd, shared, config, save=True)

    monkeypatch.setattr(expert_path, "moe_forward_kernel", forward_kernel)
    monkeypatch.setattr(megakernel, "training_forward", training_forward)
    capacity = timeline.BACKWARD_CAPACITY + 3
    config = MoKConfig(check_ids=False, backend="megakernel", timeline=True,
                       timeline_capacity=capacity)
    timeline.set_last(None)
    _step(leaves, idx, d_out, config, virtual)
    recorder = emulated_kernels["backward_timeline"]
    assert isinstance(recorder, timeline.TimelineBuffer) and timeline.last() is recorder
    assert recorder.capacity == capacity
    if not virtual:
        assert [(c.timeline, c.timeline_capacity) for c in forward_configs] == [(True, capacity)]

    small = dataclasses.replace(config, timeline_capacity=5)  # the backward's floor
    _step(leaves, idx, d_out, small, virtual)
    assert emulated_kernels["backward_timeline"].capacity == timeline.BACKWARD_CAPACITY

    recorded = timeline.last()
    leaves[4].requires_grad_(False)  # w_down frozen: the dgrads and gate / up are launches
    _step(leaves, idx, d_out, config, virtual)
    assert emulated_kernels["backward_timeline"] is None and timeline.last() is recorded
    leaves[4].requires_grad_(True)
    _step(leaves, idx, d_out, dataclasses.replace(config, timeline=False), virtual)
    assert emulated_kernels["backward_timeline"] is None and timeline.last() is recorded
    if not virtual:
        assert [c.timeline for c in forward_configs[-2:]] == [True, False]
        # the expert path: its training forward records as an inference call does, its
        # backward is launches (nothing recorded)
        _step(leaves, idx, d_out, dataclasses.replace(config, backend="kernel"), virtual)
        assert (forward_configs[-1].backend, forward_configs[-1].timeline) == ("kernel", True)
        assert emulated_kernels["backward_timeline"] is None and timeline.last() is recorded


# ---------------------------------------------------------------------- numerics (GPU)
GPU_CASES = [("kernel", "bf16"), ("kernel", "fp8"), ("megakernel", "bf16"),
             ("megakernel", "fp8")]


def _gpu_config(backend, precision, fused):
    return MoKConfig(backend=backend, precision=precision, check_ids=False,
                     fuse_wgrad_accumulation=fused)


def _gpu_leaves(T=256, H=512, I=256, E=8, K=4, Is=128, seed=5):
    from test_backward import _problem

    leaves, idx = _problem(T, H, I, E, K, Is, seed=seed)
    return leaves, idx


def _gpu_main_grads(leaves, start: str):
    """main_grad on every weight: zeros or random fp32 (returned, cloned)."""
    g = torch.Generator(device="cuda").manual_seed(17)
    out = []
    for t in leaves[2:]:
        t.main_grad = (torch.zeros(t.shape, device="cuda") if start == "zeros"
                       else torch.randn(t.shape, device="cuda", generator=g))
        out.append(t.main_grad.clone())
    return out


def _gpu_step(leaves, idx, d_out, config, virtual=False):
    from test_backward import _forward as forward_one
    from test_virtual_training import _forward as forward_virtual

    for t in leaves:
        t.grad = None
    out = (forward_virtual if virtual else forward_one)("kernel", leaves, idx, config)
    assert "train" in out.grad_fn.name(), out.grad_fn.name()  # the custom op, not a fallback
    out.backward(d_out)
    return out.detach(), [None if t.grad is None else t.grad.clone() for t in leaves]


def _assert_added(name, main_grad, start, grad):
    """main_grad == fp32(start + acc) where grad == bf16(acc): within a bf16 half-ulp of the
    gradient (2^-8 relative bounds it) plus the fp32 add's rounding (2^-24 relative)."""
    diff = (main_grad.double() - start.double() - grad.double()).abs()
    tol = grad.double().abs() * 2.0 ** -8 + main_grad.double().abs() * 2.0 ** -23 + 1e-30
    worst = (diff - tol).max().item()
    assert worst <= 0, f"{name}: main_grad - start off the gradient by {worst:.3e} past the bound"


@pytest.mark.gpu
@pytest.mark.parametrize("backend,precision", GPU_CASES)
def test_main_grad_from_zeros_is_the_unfused_gradient_bitwise(backend, precision):
    """fp32 0 + acc = acc exactly, and the unfused kernels store bf16(acc) rounded to nearest:
    main_grad.to(bf16) equals the unfused weight gradient bit for bit; the output, d_x and
    d_topk_weights equal the unfused run's; the weights' .grad is None; a repeat gives the
    same bits; a second backward doubles it exactly."""
    leaves, idx = _gpu_leaves()
    d_out = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    out, want = _gpu_step(leaves, idx, d_out, _gpu_config(backend, precision, False))
    fused = _gpu_config(backend, precision, True)
    _gpu_main_grads(leaves, "zeros")
    got_out, got = _gpu_step(leaves, idx, d_out, fused)
    assert torch.equal(got_out, out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(g is None for g in got[2:])
    once = [t.main_grad.clone() for t in leaves[2:]]
    for name, mg, g in zip(NAMES, once, want[2:]):
        assert torch.isfinite(mg).all(), name
        assert torch.equal(mg.to(torch.bfloat16), g), f"{backend} {precision}: {name}"
    poison_free_memory()
    _gpu_main_grads(leaves, "zeros")
    _gpu_step(leaves, idx, d_out, fused)
    for name, mg, t in zip(NAMES, once, leaves[2:]):
        assert torch.equal(t.main_grad, mg), f"{name}: not bitwise reproducible"
    _gpu_step(leaves, idx, d_out, fused)
    for name, mg, t in zip(NAMES, once, leaves[2:]):
        assert torch.equal(t.main_grad, mg + mg), f"{name}: second backward"


@pytest.mark.gpu
@pytest.mark.parametrize("backend,precision", GPU_CASES)
def test_main_grad_from_a_random_start_adds_the_gradient(backend, precision):
    leaves, idx = _gpu_leaves(seed=8)
    d_out = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    _, want = _gpu_step(leaves, idx, d_out, _gpu_config(backend, precision, False))
    starts = _gpu_main_grads(leaves, "random")
    _gpu_step(leaves, idx, d_out, _gpu_config(backend, precision, True))
    for name, s, t, g in zip(NAMES, starts, leaves[2:], want[2:]):
        _assert_added(name, t.main_grad, s, g)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,precision",
                         [("kernel", "bf16"), ("kernel", "fp8"), ("megakernel", "bf16")])
def test_main_grad_by_load_and_by_reduce_add_give_the_same_bits(backend, precision, monkeypatch):
    """The bf16 weight gradients' two ways of adding into main_grad (``gemm_wgrad``'s
    ``main_grad_add``, picked by rows an expert; in the backward megakernel the shared
    expert's tiles too) leave the same bits from a random start."""
    from mok_cute.kernels import gemm_wgrad

    leaves, idx = _gpu_leaves(seed=9)
    d_out = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    got = {}
    for mode, max_rows in (("reduce", 0), ("load", 1 << 30)):
        monkeypatch.setattr(gemm_wgrad, "MAIN_GRAD_LOAD_MAX_ROWS", max_rows)
        starts = _gpu_main_grads(leaves, "random")  # the same start: a fixed seed
        _gpu_step(leaves, idx, d_out, _gpu_config(backend, precision, True))
        got[mode] = [t.main_grad.clone() for t in leaves[2:]]
        assert not all(torch.equal(g, s) for g, s in zip(got[mode], starts))  # it added
    for name, a, b in zip(NAMES, got["reduce"], got["load"]):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kernel", "megakernel"])
@pytest.mark.parametrize("name", ["T1", "T77_shared", "empty_experts", "K10_zero_weights"])
def test_main_grad_on_odd_shapes(backend, name):
    """The public call with fused accumulation on the backward tests' odd shapes (T = 1, T not
    a multiple of the tile with a shared expert, empty experts, K = 10 with zero weights):
    from zeros, bitwise the unfused gradients; from a random start, an expert no token chose
    keeps its start exactly and the others add their gradient."""
    from test_backward import CASES, _problem

    T, H, I, E, K, Is, routing, zero_w = CASES[name]
    leaves, idx = _problem(T, H, I, E, K, Is, seed=T + 3, routing=routing, zero_weights=zero_w)
    d_out = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    _, want = _gpu_step(leaves, idx, d_out, _gpu_config(backend, "bf16", False))
    fused = _gpu_config(backend, "bf16", True)
    _gpu_main_grads(leaves, "zeros")
    _gpu_step(leaves, idx, d_out, fused)
    for label, t, g in zip(NAMES, leaves[2:], want[2:], strict=True):
        assert torch.equal(t.main_grad.to(torch.bfloat16), g), f"{name} {backend}: {label}"
    starts = _gpu_main_grads(leaves, "random")
    _gpu_step(leaves, idx, d_out, fused)
    chosen = torch.zeros(E, dtype=torch.bool, device="cuda")
    chosen[idx.reshape(-1).long()] = True
    for label, s, t, g in zip(NAMES[:3], starts[:3], leaves[2:5], want[2:5], strict=True):
        assert torch.equal(t.main_grad[~chosen], s[~chosen]), f"{label}: an unchosen expert moved"
        _assert_added(label, t.main_grad, s, g)


@pytest.mark.gpu
def test_fp8_weight_gradients_accumulate_on_the_fp8_wgrad_kernel():
    """Sizes where the FP8 layer's weight gradients run on gemm_wgrad_fp8 (H, I multiples of
    128, I >= 1024, T * K / E >= 1024 rows an expert): from zeros, bitwise the unfused."""
    from mok_cute import expert_backward as eb

    T, H, I, E, K = 2048, 1024, 1024, 8, 4
    assert eb.fp8_weight_grads(H, I, T * K / E)
    leaves, idx = _gpu_leaves(T, H, I, E, K, Is=0, seed=3)
    d_out = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    _, want = _gpu_step(leaves, idx, d_out, _gpu_config("kernel", "fp8", False))
    _gpu_main_grads(leaves, "zeros")
    _gpu_step(leaves, idx, d_out, _gpu_config("kernel", "fp8", True))
    for name, t, g in zip(NAMES, leaves[2:], want[2:]):
        assert torch.equal(t.main_grad.to(torch.bfloat16), g), name


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compiled_fused_call_equals_eager_bitwise(precision):
    """torch.compile(fullgraph=True): main_grad read from the weights and added into by the
    backward op, the same bits as eager; Megatron's dummy on one weight."""
    leaves, idx = _gpu_leaves(T=200, H=512, I=320, seed=5)
    d_out = torch.randn(200, 512, device="cuda").to(torch.bfloat16)
    config = _gpu_config("kernel", precision, True)
    from test_backward import _forward

    def step(*ts):
        return _forward("kernel", list(ts), idx, config)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        _gpu_main_grads(leaves, "zeros")
        leaves[4].grad_added_to_main_grad = False  # as Megatron's DDP before each step
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        out.backward(d_out)
        results.append((out.detach(), [t.grad for t in leaves[:2]],
                        [t.main_grad.clone() for t in leaves[2:]]))
        assert leaves[4].grad_added_to_main_grad and leaves[4].grad is not None
        assert all(t.grad is None for i, t in enumerate(leaves) if i >= 2 and i != 4)
    (o1, g1, m1), (o2, g2, m2) = results
    assert torch.equal(o1, o2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    for name, a, b in zip(NAMES, m1, m2):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("R,Is", [(2, 0), (4, 64)])
def test_virtual_ranks_accumulate_into_stacked_main_grads(R, Is):
    """moe_forward_virtual with [R, E_loc, I, H] (etc.) buffers: from zeros, bitwise the
    unfused gradient; from a random start, start + it."""
    from test_virtual_training import _problem

    leaves, idx = _problem(R, 96, 256, 128, 4, 4, Is, seed=R)
    d_out = torch.randn(R, 96, 256, device="cuda").to(torch.bfloat16)
    config = MoKConfig(timeout_ms=5000.0, check_ids=False)
    _, want = _gpu_step(leaves, idx, d_out, config, virtual=True)
    fused = dataclasses.replace(config, fuse_wgrad_accumulation=True)
    _gpu_main_grads(leaves, "zeros")
    _, got = _gpu_step(leaves, idx, d_out, fused, virtual=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(g is None for g in got[2:])
    for name, t, g in zip(NAMES, leaves[2:], want[2:]):
        assert t.main_grad.shape == t.shape
        assert torch.equal(t.main_grad.to(torch.bfloat16), g), name
    starts = _gpu_main_grads(leaves, "random")
    _gpu_step(leaves, idx, d_out, fused, virtual=True)
    for name, s, t, g in zip(NAMES, starts, leaves[2:], want[2:]):
        _assert_added(name, t.main_grad, s, g)
