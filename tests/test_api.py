"""Public API: MoKConfig, argument checks (DESIGN §2 "Bad input"), path selection, MoELayer."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

import mok_cute as mok
from mok_cute import api, reference as ref
from mok_cute.config import MoKConfig, check_tensor
from per_token import assert_tokens_close, naive_moe_forward, naive_moe_forward_virtual


def make_inputs(seed=0, T=12, H=32, I=16, E=4, K=2, Is=0, R=None):
    gen = torch.Generator().manual_seed(seed)
    lead = () if R is None else (R,)
    E_loc = E if R is None else E // R
    bf = lambda *s: (torch.randn(*s, generator=gen) * 0.2).bfloat16()  # noqa: E731
    x = bf(*lead, T, H)
    idx = torch.rand(*lead, T, E, generator=gen).topk(K, dim=-1).indices
    w = torch.rand(*lead, T, K, generator=gen) + 0.05
    args = [x, idx, w, bf(*lead, E_loc, I, H), bf(*lead, E_loc, I, H), bf(*lead, E_loc, H, I)]
    shared = (bf(*lead, Is, H), bf(*lead, Is, H), bf(*lead, H, Is)) if Is else None
    return args, shared


# ------------------------------------------------------------------------------------------------
# Package surface
# ------------------------------------------------------------------------------------------------


def test_package_exports():
    assert mok.__version__ == "0.1.0"
    for name in ("MoKConfig", "moe_forward", "moe_forward_virtual", "MoELayer", "forward_path"):
        assert callable(getattr(mok, name)), name
    assert mok.reference.moe_forward is ref.moe_forward
    assert callable(mok.schedule.build_receive_schedule)


def test_import_does_not_load_the_dsl():
    import subprocess

    code = "import sys, mok_cute; print('cutlass' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------------
# MoKConfig
# ------------------------------------------------------------------------------------------------


def test_config_defaults_and_frozen():
    cfg = MoKConfig()
    assert (cfg.tile_m, cfg.num_comm_sms, cfg.minibatch_tokens, cfg.ring_tokens) == (128, None, None, None)
    assert (cfg.timeline, cfg.timeline_capacity, cfg.timeout_ms, cfg.backend) == (False, 1 << 16, 10_000.0, "auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tile_m = 64  # type: ignore[misc]
    assert MoKConfig(tile_m=64, num_comm_sms=8, backend="reference").tile_m == 64


@pytest.mark.parametrize(
    "field,value,exc,pattern",
    [
        ("tile_m", 0, ValueError, r"MoKConfig.tile_m: expected an int >= 1, got 0"),
        ("tile_m", 64.0, TypeError, r"MoKConfig.tile_m: expected an int, got float"),
        ("tile_m", True, TypeError, r"MoKConfig.tile_m: expected an int, got bool"),
        ("num_comm_sms", -1, ValueError, r"MoKConfig.num_comm_sms: expected an int >= 0, got -1"),
        ("num_comm_sms", "8", TypeError, r"MoKConfig.num_comm_sms: expected an int or None, got str"),
        ("minibatch_tokens", -4, ValueError, r"MoKConfig.minibatch_tokens: expected an int >= 1, got -4"),
        ("ring_tokens", 0, ValueError, r"MoKConfig.ring_tokens: expected an int >= 1, got 0"),
        ("minibatch_tokens", 3, ValueError, r"MoKConfig.minibatch_tokens: expected a multiple of tile_m=128, got 3"),
        ("ring_tokens", 200, ValueError, r"MoKConfig.ring_tokens: expected a multiple of tile_m=128, got 200"),
        ("timeline", 1, TypeError, r"MoKConfig.timeline: expected a bool, got int"),
        ("timeline_capacity", 0, ValueError, r"MoKConfig.timeline_capacity: expected an int >= 1, got 0"),
        ("timeout_ms", 0.0, ValueError, r"MoKConfig.timeout_ms: expected a finite number > 0, got 0.0"),
        ("timeout_ms", float("inf"), ValueError, r"MoKConfig.timeout_ms: expected a finite number > 0, got inf"),
        ("timeout_ms", "10", TypeError, r"MoKConfig.timeout_ms: expected a float"),
        ("backend", "cuda", ValueError, r"MoKConfig.backend: expected one of \('auto', 'kernel', 'megakernel', 'reference'\), got 'cuda'"),
        ("backend", None, TypeError, r"MoKConfig.backend: expected one of"),
        ("saved_rows_factor", 0.0, ValueError, r"MoKConfig.saved_rows_factor: expected a finite number > 0, got 0.0"),
        ("saved_rows_factor", float("nan"), ValueError, r"MoKConfig.saved_rows_factor: expected a finite number > 0, got nan"),
        ("saved_rows_factor", True, TypeError, r"MoKConfig.saved_rows_factor: expected None or a float, got bool"),
        ("saved_rows_factor", "2", TypeError, r"MoKConfig.saved_rows_factor: expected None or a float, got str"),
    ],
)
def test_config_rejects_bad_fields(field, value, exc, pattern):
    with pytest.raises(exc, match=pattern):
        MoKConfig(**{field: value})


def test_check_tensor_helper():
    t = torch.randn(3, 4)
    assert check_tensor("a", t, shape=("T", 4), dtype=torch.float32, device="cpu") is t
    with pytest.raises(ValueError, match=r"a: expected shape \[T, 5\], got \[3, 4\]"):
        check_tensor("a", t, shape=("T", 5))
    with pytest.raises(TypeError, match=r"a: expected dtype torch.bfloat16 or torch.float16, got torch.float32"):
        check_tensor("a", t, dtype=(torch.bfloat16, torch.float16))
    with pytest.raises(ValueError, match=r"a: expected a tensor on device meta, got one on cpu"):
        check_tensor("a", t, device="meta")
    with pytest.raises(ValueError, match=r"a: expected a contiguous tensor"):
        check_tensor("a", t.t())
    assert check_tensor("a", t.t(), contiguous=False) is not None
    with pytest.raises(TypeError, match=r"a: expected a torch.Tensor, got list"):
        check_tensor("a", [1, 2])
    with pytest.raises(ValueError, match=r"a: expected a dense \(strided\) tensor, got layout torch.sparse_coo"):
        check_tensor("a", t.to_sparse(), contiguous=False)


# ------------------------------------------------------------------------------------------------
# moe_forward: results and bad input
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Is", [0, 8])
def test_moe_forward_on_the_cpu_against_a_per_token_loop(Is):
    """On the CPU moe_forward runs the reference; checked against the per-token loop written
    apart from it (this test compared it with mok_cute.reference itself: the same function)."""
    args, shared = make_inputs(1, Is=Is)
    out = mok.moe_forward(*args, shared=shared)
    assert out.dtype == torch.bfloat16 and out.shape == (12, 32)
    assert_tokens_close(out, naive_moe_forward(*args, shared), what="moe_forward")
    # int32 ids, bf16 routing weights and a list for `shared` are accepted too
    args32 = [args[0], args[1].to(torch.int32), args[2].bfloat16(), *args[3:]]
    out32 = mok.moe_forward(*args32, shared=None if shared is None else list(shared))
    assert_tokens_close(out32, naive_moe_forward(*args32, shared), what="int32 ids, bf16 weights")
    # auto on the CPU is the reference path: the same bits as asking for it
    assert torch.equal(mok.moe_forward(*args, shared=shared, config=MoKConfig(backend="reference")), out)


def test_every_argument_may_be_given_by_name():
    """The entry points' device guard finds x (xs) whether given by position or by name."""
    args, shared = make_inputs(5, Is=8)
    names = ("x", "topk_idx", "topk_weights", "w_gate", "w_up", "w_down")
    want = mok.moe_forward(*args, shared=shared)
    assert torch.equal(mok.moe_forward(**dict(zip(names, args)), shared=shared), want)
    xs_args, _ = make_inputs(5, R=2)
    want = mok.moe_forward_virtual(*xs_args)
    assert torch.equal(mok.moe_forward_virtual(**dict(zip(("xs", *names[1:]), xs_args))), want)


def test_zero_tokens_returns_empty_bf16():
    args, shared = make_inputs(2, T=0, Is=8)
    out = mok.moe_forward(*args, shared=shared)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    xs_args, _ = make_inputs(2, T=0, R=2)
    outs = mok.moe_forward_virtual(*xs_args)
    assert outs.shape == (2, 0, 32) and outs.dtype == torch.bfloat16


@pytest.mark.parametrize("virtual", [False, True])
def test_zero_tokens_train_like_any_call(virtual):
    """T = 0 with inputs that require grad: the empty output is part of the graph, so a
    training step over an empty batch runs its backward (zero weight gradients, empty d_x),
    main_grad untouched (nothing to add); its main_grads are checked and an FP8 training call is
    refused as one with tokens is (no FP8 kernels here)."""
    args, shared = make_inputs(3, T=0, Is=8, R=2 if virtual else None)
    leaves = [t.requires_grad_() for t in [*args[:1], *args[2:], *shared]]
    call = mok.moe_forward_virtual if virtual else mok.moe_forward
    out = call(*args, shared=shared)
    assert out.requires_grad and out.shape[-2:] == (0, 32)
    out.float().sum().backward()
    assert args[0].grad.shape == args[0].shape
    for t in leaves[2:]:
        assert t.grad is not None and not t.grad.any()
    fused = MoKConfig(fuse_wgrad_accumulation=True)
    with pytest.raises(ValueError, match=r"w_gate\.main_grad: .*got no main_grad attribute"):
        call(*args, shared=shared, config=fused)
    for t in leaves[2:]:
        t.main_grad = torch.ones(t.shape)
    call(*args, shared=shared, config=fused).float().sum().backward()
    assert all(torch.equal(t.main_grad, torch.ones(t.shape)) for t in leaves[2:])
    fp8_args, _ = make_inputs(3, T=0, H=64, I=64, R=2 if virtual else None)  # FP8's sizes
    fp8_args[0].requires_grad_()
    with pytest.raises(ValueError, match=r"config.precision='fp8': training runs on the FP8 kernels"):
        call(*fp8_args, config=MoKConfig(precision="fp8"))


def _replace(args, i, value):
    args = list(args)
    args[i] = value
    return args


# (description, how to corrupt the arguments, exception, regex the message must match)
BAD_CASES = [
    ("x 1-D", lambda a, s: (_replace(a, 0, a[0][0]), s), ValueError, r"x: expected a 2-D tensor \[T, H\], got shape \[32\]"),
    ("x fp32", lambda a, s: (_replace(a, 0, a[0].float()), s), TypeError, r"x: expected dtype torch.bfloat16, got torch.float32"),
    ("x not a tensor", lambda a, s: (_replace(a, 0, a[0].tolist()), s), TypeError, r"x: expected a torch.Tensor, got list"),
    ("x non-contiguous", lambda a, s: (_replace(a, 0, a[0].t().contiguous().t()), s), ValueError, r"x: expected a contiguous tensor"),
    ("x sparse", lambda a, s: (_replace(a, 0, a[0].to_sparse()), s), ValueError, r"x: expected a dense \(strided\) tensor, got layout torch.sparse_coo"),
    ("topk_weights sparse csr", lambda a, s: (_replace(a, 2, a[2].to_sparse_csr()), s), ValueError, r"topk_weights: expected a dense \(strided\) tensor, got layout torch.sparse_csr"),
    ("topk_idx float", lambda a, s: (_replace(a, 1, a[1].float()), s), TypeError, r"topk_idx: expected dtype torch.int32 or torch.int64, got torch.float32"),
    ("topk_idx wrong T", lambda a, s: (_replace(a, 1, a[1][:5]), s), ValueError, r"topk_idx: expected shape \[12, K\]"),
    ("topk_idx on meta", lambda a, s: (_replace(a, 1, a[1].to("meta")), s), ValueError, r"topk_idx: expected a tensor on device cpu, got one on meta"),
    ("topk_idx non-contiguous", lambda a, s: (_replace(a, 1, a[1].t().contiguous().t()), s), ValueError, r"topk_idx: expected a contiguous tensor"),
    ("expert id too large", lambda a, s: (_replace(a, 1, torch.where(a[1] == 0, 4, a[1])), s), ValueError, r"topk_idx: expected global expert ids in \[0, 4\), got id 4"),
    ("expert id negative", lambda a, s: (_replace(a, 1, torch.where(a[1] == 0, -1, a[1])), s), ValueError, r"topk_idx: expected global expert ids in \[0, 4\), got id -1"),
    ("K > E", lambda a, s: (_replace(_replace(a, 1, a[1].repeat(1, 3)), 2, a[2].repeat(1, 3)), s), ValueError, r"topk_idx: expected top-k K <= number of experts E = 4 .*got K = 6"),
    ("K == 0", lambda a, s: (_replace(_replace(a, 1, a[1][:, :0]), 2, a[2][:, :0]), s), ValueError, r"topk_idx: expected top-k K >= 1"),
    ("topk_weights shape", lambda a, s: (_replace(a, 2, a[2][:, :1].contiguous()), s), ValueError, r"topk_weights: expected shape \[12, 2\], got \[12, 1\]"),
    ("topk_weights fp16", lambda a, s: (_replace(a, 2, a[2].half()), s), TypeError, r"topk_weights: expected dtype torch.float32 or torch.bfloat16, got torch.float16"),
    ("topk_weights int", lambda a, s: (_replace(a, 2, a[1]), s), TypeError, r"topk_weights: expected dtype torch.float32 or torch.bfloat16, got torch.int64"),
    ("w_gate wrong H", lambda a, s: (_replace(a, 3, a[3][..., :16].contiguous()), s), ValueError, r"w_gate: expected shape \[E_loc, I, 32\], got \[4, 16, 16\]"),
    ("w_gate 2-D", lambda a, s: (_replace(a, 3, a[3][0]), s), ValueError, r"w_gate: expected shape \[E_loc, I, 32\]"),
    ("w_gate fp32", lambda a, s: (_replace(a, 3, a[3].float()), s), TypeError, r"w_gate: expected dtype torch.bfloat16, got torch.float32"),
    ("w_up wrong E", lambda a, s: (_replace(a, 4, a[4][:3]), s), ValueError, r"w_up: expected shape \[4, 16, 32\], got \[3, 16, 32\]"),
    ("w_up on meta", lambda a, s: (_replace(a, 4, a[4].to("meta")), s), ValueError, r"w_up: expected a tensor on device cpu"),
    ("w_down transposed", lambda a, s: (_replace(a, 5, a[5].transpose(1, 2)), s), ValueError, r"w_down: expected shape \[4, 32, 16\], got \[4, 16, 32\]"),
    ("w_down non-contiguous", lambda a, s: (_replace(a, 5, a[5].transpose(1, 2).contiguous().transpose(1, 2)), s), ValueError, r"w_down: expected a contiguous tensor"),
    ("w_down fp16", lambda a, s: (_replace(a, 5, a[5].half()), s), TypeError, r"w_down: expected dtype torch.bfloat16, got torch.float16"),
    ("shared not a tuple", lambda a, s: (a, s[0]), TypeError, r"shared: expected None or a 3-tuple \(ws_gate, ws_up, ws_down\), got Tensor"),
    ("shared 2 items", lambda a, s: (a, s[:2]), TypeError,
     r"shared: expected None or a 3-tuple \(ws_gate, ws_up, ws_down\), got tuple of 2 "
     r"\(Tensor\(shape=\(8, 32\)"),
    ("shared gate wrong H", lambda a, s: (a, (s[0][:, :8].contiguous(), s[1], s[2])), ValueError, r"shared\[0\] \(ws_gate\): expected shape \[Is, 32\], got \[8, 8\]"),
    ("shared up wrong Is", lambda a, s: (a, (s[0], s[1][:4], s[2])), ValueError, r"shared\[1\] \(ws_up\): expected shape \[8, 32\], got \[4, 32\]"),
    ("shared down transposed", lambda a, s: (a, (s[0], s[1], s[2].t().contiguous())), ValueError, r"shared\[2\] \(ws_down\): expected shape \[32, 8\], got \[8, 32\]"),
    ("shared fp32", lambda a, s: (a, (s[0], s[1].float(), s[2])), TypeError, r"shared\[1\] \(ws_up\): expected dtype torch.bfloat16, got torch.float32"),
    ("shared on meta", lambda a, s: (a, (s[0], s[1], s[2].to("meta"))), ValueError, r"shared\[2\] \(ws_down\): expected a tensor on device cpu"),
]


@pytest.mark.parametrize("name,corrupt,exc,pattern", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_moe_forward_bad_input(name, corrupt, exc, pattern):
    args, shared = make_inputs(3, Is=8)
    bad_args, bad_shared = corrupt(args, shared)
    with pytest.raises(exc, match=pattern):
        mok.moe_forward(*bad_args, shared=bad_shared)


def test_moe_forward_bad_config():
    args, _ = make_inputs(4)
    with pytest.raises(TypeError, match=r"config: expected a mok_cute.MoKConfig or None, got dict"):
        mok.moe_forward(*args, config={"backend": "reference"})


def test_backend_kernel_without_kernel_path_raises():
    args, _ = make_inputs(5)
    with pytest.raises(RuntimeError, match=r"config.backend is 'kernel' but the kernel path cannot run on cpu"):
        mok.moe_forward(*args, config=MoKConfig(backend="kernel"))


def test_moe_forward_is_differentiable():
    args, shared = make_inputs(6, Is=8)
    leaves = [t.clone().requires_grad_() for t in (args[0], args[2], *args[3:], *shared)]
    out = mok.moe_forward(leaves[0], args[1], *leaves[1:5], shared=tuple(leaves[5:]))
    gen = torch.Generator().manual_seed(0)
    (out.float() * torch.randn(out.shape, generator=gen)).sum().backward()
    for leaf in leaves:
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape and torch.isfinite(leaf.grad.float()).all()
        assert (leaf.grad != 0).any()


# ------------------------------------------------------------------------------------------------
# moe_forward_virtual
# ------------------------------------------------------------------------------------------------


def test_virtual_on_the_cpu_against_a_per_token_loop():
    args, shared = make_inputs(7, R=3, E=6, K=3, Is=8)
    outs = mok.moe_forward_virtual(*args, shared=shared)
    assert outs.shape == (3, 12, 32) and outs.dtype == torch.bfloat16
    assert_tokens_close(outs, naive_moe_forward_virtual(*args, shared), what="moe_forward_virtual")


VIRTUAL_BAD = [
    ("xs 2-D", lambda a, s: (_replace(a, 0, a[0][0]), s), ValueError, r"xs: expected a 3-D tensor \[R, T, H\], got shape \[12, 32\]"),
    ("xs fp32", lambda a, s: (_replace(a, 0, a[0].float()), s), TypeError, r"xs: expected dtype torch.bfloat16"),
    ("topk_idx wrong R", lambda a, s: (_replace(a, 1, a[1][:1]), s), ValueError, r"topk_idx: expected shape \[2, 12, K\]"),
    ("topk_weights wrong R", lambda a, s: (_replace(a, 2, a[2][:1]), s), ValueError, r"topk_weights: expected shape \[2, 12, 2\], got \[1, 12, 2\]"),
    ("w_gate no leading R", lambda a, s: (_replace(a, 3, a[3][0]), s), ValueError, r"w_gate: expected shape \[2, E_loc, I, 32\]"),
    ("w_gate wrong R", lambda a, s: (_replace(a, 3, torch.cat([a[3], a[3]])), s), ValueError, r"w_gate: expected shape \[2, E_loc, I, 32\], got \[4, 2, 16, 32\]"),
    ("w_down wrong I", lambda a, s: (_replace(a, 5, a[5][..., :8].contiguous()), s), ValueError, r"w_down: expected shape \[2, 2, 32, 16\]"),
    ("id >= R*E_loc", lambda a, s: (_replace(a, 1, a[1] + 1), s), ValueError, r"topk_idx: expected global expert ids in \[0, 4\), got id 4"),
    ("K > E", lambda a, s: (_replace(_replace(a, 1, a[1].repeat(1, 1, 3)), 2, a[2].repeat(1, 1, 3)), s), ValueError, r"topk_idx: expected top-k K <= number of experts E = 4"),
    ("shared no leading R", lambda a, s: (a, (s[0][0], s[1], s[2])), ValueError, r"shared\[0\] \(ws_gate\): expected shape \[2, Is, 32\]"),
    ("shared down wrong", lambda a, s: (a, (s[0], s[1], s[2][:, :, :4].contiguous())), ValueError, r"shared\[2\] \(ws_down\): expected shape \[2, 32, 8\]"),
]


@pytest.mark.parametrize("name,corrupt,exc,pattern", VIRTUAL_BAD, ids=[c[0] for c in VIRTUAL_BAD])
def test_virtual_bad_input(name, corrupt, exc, pattern):
    args, shared = make_inputs(8, R=2, E=4, Is=8)
    bad_args, bad_shared = corrupt(args, shared)
    with pytest.raises(exc, match=pattern):
        mok.moe_forward_virtual(*bad_args, shared=bad_shared)


def test_virtual_backend_kernel_without_a_gpu_raises():
    args, _ = make_inputs(9, R=2, E=4)
    for backend in ("kernel", "megakernel"):
        with pytest.raises(RuntimeError, match=f"config.backend is '{backend}' but the kernel path cannot run on cpu"):
            mok.moe_forward_virtual(*args, config=MoKConfig(backend=backend))


def test_distributed_backend_choices():
    with pytest.raises(ValueError, match=r"config.backend: expected 'auto', 'megakernel' or 'reference' for moe_forward with group="):
        mok.api.choose_path("cpu", MoKConfig(backend="kernel"), distributed=True)
    with pytest.raises(RuntimeError, match=r"config.backend is 'megakernel' but it cannot run on cpu"):
        mok.api.choose_path("cpu", MoKConfig(backend="megakernel"), distributed=True)
    assert mok.api.choose_path("cpu", MoKConfig(), distributed=True).path == "reference"


# ------------------------------------------------------------------------------------------------
# Path selection
# ------------------------------------------------------------------------------------------------


def test_forward_path_on_this_machine():
    text = mok.forward_path("cpu")
    assert text.startswith("reference: device cpu is not a CUDA device")
    assert "moe_forward_virtual: reference" in text
    assert mok.forward_path(config=MoKConfig(backend="reference")).startswith("reference: config.backend is 'reference'")
    assert mok.forward_path("cpu", MoKConfig(backend="kernel")).startswith("error: config.backend is 'kernel'")
    with pytest.raises(TypeError, match="device: expected a torch.device, str, int or None, got float"):
        mok.forward_path(1.5)
    with pytest.raises(ValueError, match=r"device: not a device: 'foo'"):
        mok.forward_path("foo")
    with pytest.raises(ValueError, match=r"device: expected a CUDA device index >= 0, got -1"):
        mok.forward_path(-1)


def _fake_expert_path(ok, why, calls):
    fake = types.ModuleType("mok_cute.expert_path")
    fake.kernel_path_status = lambda device: (ok, why)

    def moe_forward_kernel(*args):
        calls.append(args)
        return "kernel result"

    fake.moe_forward_kernel = moe_forward_kernel
    return fake


@pytest.fixture
def cuda_visible(monkeypatch):
    """Pretend a CUDA device exists (path selection only; nothing is allocated on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_choose_path_uses_the_kernel_path_status(monkeypatch, cuda_visible):
    import mok_cute

    calls = []
    monkeypatch.setitem(sys.modules, "mok_cute.expert_path", _fake_expert_path(True, "sm_90a kernels ready", calls))
    monkeypatch.setattr(mok_cute, "expert_path", sys.modules["mok_cute.expert_path"], raising=False)
    dev = torch.device("cuda", 0)
    assert api.choose_path(dev) == api.PathChoice("kernel", "sm_90a kernels ready")
    assert mok.forward_path(dev).startswith("kernel: sm_90a kernels ready; training")
    assert mok.forward_path().startswith("kernel: ")  # default device = current CUDA device
    assert api.choose_path(dev, MoKConfig(backend="reference")).path == "reference"
    ep = api.choose_path(dev, distributed=True)
    assert ep.path == "reference" and "IPC launch" in ep.reason
    assert api.choose_path(dev, MoKConfig(backend="megakernel"), distributed=True).path == "megakernel"
    assert api.choose_path(dev, virtual=True).path == "megakernel"
    assert api.choose_path(dev, MoKConfig(backend="megakernel")).path == "megakernel"
    assert "moe_forward_virtual: megakernel" in mok.forward_path(dev)
    assert api.choose_path(torch.device("cpu")).path == "reference"  # CPU tensors never take the kernel
    # Training: the expert path's backward kernels, or the megakernel's at one rank; virtual
    # ranks train on the megakernel and the backward megakernel (mok_cute.virtual_backward)
    assert api.choose_path(dev, needs_grad=True).path == "kernel"
    assert "training (inputs that require grad): the backward kernels" in mok.forward_path(dev)
    assert api.choose_path(dev, virtual=True, needs_grad=True).path == "megakernel"
    assert "moe_forward_virtual_train" in mok.forward_path(dev)
    assert api.choose_path(dev, MoKConfig(backend="megakernel"), needs_grad=True).path == "megakernel"

    monkeypatch.setitem(sys.modules, "mok_cute.expert_path", _fake_expert_path(False, "compute capability 8.0 < 9.0", calls))
    monkeypatch.setattr(mok_cute, "expert_path", sys.modules["mok_cute.expert_path"], raising=False)
    assert api.choose_path(dev) == api.PathChoice("reference", "compute capability 8.0 < 9.0")
    with pytest.raises(RuntimeError, match="compute capability 8.0 < 9.0"):
        api.choose_path(dev, MoKConfig(backend="kernel"))
    assert calls == []


def test_choose_path_when_the_kernel_path_fails_to_import(monkeypatch, cuda_visible):
    import mok_cute

    monkeypatch.delattr(mok_cute, "expert_path", raising=False)
    monkeypatch.setitem(sys.modules, "mok_cute.expert_path", None)  # makes `from . import expert_path` raise ImportError
    choice = api.choose_path(torch.device("cuda", 0))
    assert choice.path == "reference"
    assert choice.reason.startswith("mok_cute.expert_path failed to import (ModuleNotFoundError")
    assert mok.forward_path("cuda:0").startswith("reference: mok_cute.expert_path failed to import")


# ------------------------------------------------------------------------------------------------
# MoELayer
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
def test_layer_forward_is_the_layer_on_its_routing(renormalize):
    torch.manual_seed(0)
    layer = mok.MoELayer(32, 16, 8, 3, shared_intermediate=12, renormalize=renormalize)
    assert layer.w_gate.shape == (8, 16, 32) and layer.w_down.shape == (8, 32, 16)
    assert layer.ws_gate.shape == (12, 32) and layer.ws_down.shape == (32, 12)
    assert layer.router.weight.dtype == torch.float32 and layer.w_up.dtype == torch.bfloat16
    x = torch.randn(2, 7, 32).bfloat16()
    out = layer(x)
    assert out.shape == (2, 7, 32) and out.dtype == torch.bfloat16

    x2d = x.reshape(14, 32)
    idx, w = layer.route(x2d)
    probs = torch.softmax(x2d.float() @ layer.router.weight.t(), dim=-1)
    assert torch.equal(idx, probs.topk(3, dim=-1).indices)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(14))
    else:
        torch.testing.assert_close(w, probs.gather(1, idx))
    with torch.no_grad():
        want = naive_moe_forward(x2d, idx, w, layer.w_gate, layer.w_up, layer.w_down, layer.shared)
    assert_tokens_close(out.reshape(14, 32), want, what="MoELayer")


def test_layer_backward_reaches_every_parameter():
    torch.manual_seed(1)
    layer = mok.MoELayer(16, 8, 4, 2, shared_intermediate=8)
    x = torch.randn(20, 16).bfloat16().requires_grad_()
    out = layer(x)
    (out.float() * torch.randn(out.shape)).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad.float()).all(), name
        assert (p.grad != 0).any(), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_layer_in_a_bf16_autocast_region_takes_fp32_activations(device):
    """Inside ``torch.autocast(dtype=torch.bfloat16)`` the layer takes an fp32 x as bf16 (its
    gradient flows back in fp32) and computes as outside the region (the fp32 router, the
    reference's fp32 sums, the kernels): the output and the gradients are those of the call on
    x.bfloat16() outside it; outside autocast an fp32 x is refused by name as before."""
    torch.manual_seed(0)
    layer = mok.MoELayer(256, 128, 8, 2, shared_intermediate=128, device=device,
                         config=MoKConfig(check_ids=False))
    x = torch.randn(2, 5, 256, device=device).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        out = layer(x, return_aux_loss=True)
    (out[0].float().sum() + out[1]).backward()
    got = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
    layer.zero_grad()
    xb = x.detach().bfloat16().requires_grad_()
    want_out = layer(xb, return_aux_loss=True)
    (want_out[0].float().sum() + want_out[1]).backward()
    assert torch.equal(out[0], want_out[0]) and torch.equal(out[1], want_out[1])
    assert got[0].dtype == torch.float32 and torch.equal(got[0], xb.grad.float())
    for g, p in zip(got[1:], layer.parameters()):
        assert torch.equal(g, p.grad)
    with pytest.raises(TypeError, match=r"x: expected dtype torch.bfloat16, got torch.float32"):
        layer(x)


def test_bad_devices_and_flags_are_refused_by_name():
    """A device torch cannot parse, or one that neither the kernels nor the reference run on
    (meta), and a non-bool ``return_aux_loss``, are errors naming the argument, not torch's
    unnamed parse error or a failure deep inside."""
    with pytest.raises(ValueError, match=r"^device: not a device: 'foo'"):
        mok.MoELayer(16, 8, 4, 2, device="foo")
    args, _ = make_inputs(4)
    with pytest.raises(ValueError, match=r"^x: expected a CUDA or CPU tensor .*got one on meta"):
        mok.moe_forward(*(t.to("meta") for t in args))
    layer = mok.MoELayer(16, 8, 4, 2)
    with pytest.raises(TypeError, match=r"^return_aux_loss: expected a bool, got str"):
        layer(torch.zeros(3, 16).bfloat16(), return_aux_loss="no")


def test_layer_without_shared_expert_and_repr():
    layer = mok.MoELayer(16, 8, 4, 1)
    assert layer.shared is None and len(list(layer.parameters())) == 4
    assert "num_experts=4" in repr(layer) and "top_k=1" in repr(layer)


def test_layer_in_bf16_and_after_to_bfloat16():
    """MoELayer(dtype=torch.bfloat16) and layer.to(torch.bfloat16): the router is stored in bf16
    and computed in fp32, the output is the reference's on that routing."""
    torch.manual_seed(2)
    x = torch.randn(30, 16).bfloat16()
    for layer in (mok.MoELayer(16, 8, 4, 2, shared_intermediate=8, dtype=torch.bfloat16),
                  mok.MoELayer(16, 8, 4, 2, shared_intermediate=8).to(torch.bfloat16)):
        assert {p.dtype for p in layer.parameters()} == {torch.bfloat16}
        idx, w = layer.route(x)
        probs = torch.softmax(x.float() @ layer.router.weight.float().t(), dim=-1)
        assert torch.equal(idx, probs.topk(2, dim=-1).indices) and w.dtype == torch.float32
        with torch.no_grad():
            want = naive_moe_forward(x, idx, w, layer.w_gate, layer.w_up, layer.w_down, layer.shared)
        assert_tokens_close(layer(x), want, what="MoELayer in bf16")
    with pytest.raises(ValueError, match=r"dtype: expected torch.bfloat16 .* got torch.float32"):
        mok.MoELayer(16, 8, 4, 2, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"w_gate: expected dtype torch.bfloat16"):
        mok.MoELayer(16, 8, 4, 2).to(torch.float32)(x)


def test_layer_load_balancing_loss():
    """E * sum_e f_e * P_e by hand; 1.0 for perfectly balanced routing; gradient to the router
    only through P; zero, not NaN, for T = 0."""
    torch.manual_seed(3)
    layer = mok.MoELayer(16, 8, 4, 2)
    x = torch.randn(40, 16).bfloat16()
    out, aux = layer(x, return_aux_loss=True)
    assert torch.equal(out, layer(x))
    idx, _ = layer.route(x)
    probs = torch.softmax(x.float() @ layer.router.weight.t(), dim=-1)
    f = torch.bincount(idx.reshape(-1), minlength=4).float() / idx.numel()
    torch.testing.assert_close(aux, 4 * (f * probs.mean(0)).sum())
    aux.backward()
    assert layer.router.weight.grad is not None and layer.w_gate.grad is None
    balanced = layer.load_balancing_loss(torch.tensor([[0, 1], [2, 3]]), torch.full((2, 4), 0.25))
    torch.testing.assert_close(balanced, torch.tensor(1.0))
    _, empty = layer(torch.zeros(0, 16).bfloat16(), return_aux_loss=True)
    assert empty.item() == 0.0


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(hidden=0), ValueError, r"hidden: expected an int >= 1, got 0"),
        (dict(intermediate=2.5), TypeError, r"intermediate: expected an int, got float"),
        (dict(num_experts=0), ValueError, r"num_experts: expected an int >= 1, got 0"),
        (dict(top_k=5), ValueError, r"top_k: expected an int <= 4, got 5"),
        (dict(top_k=0), ValueError, r"top_k: expected an int >= 1, got 0"),
        (dict(shared_intermediate=-1), ValueError, r"shared_intermediate: expected an int >= 0, got -1"),
        (dict(renormalize="yes"), TypeError, r"renormalize: expected a bool, got str"),
        (dict(config="fast"), TypeError, r"config: expected a mok_cute.MoKConfig or None, got str"),
    ],
)
def test_layer_bad_arguments(kwargs, exc, pattern):
    base = dict(hidden=16, intermediate=8, num_experts=4, top_k=2)
    base.update(kwargs)
    with pytest.raises(exc, match=pattern):
        mok.MoELayer(**base)


def test_layer_bad_input():
    layer = mok.MoELayer(16, 8, 4, 2)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 16\], got \[3, 8\]"):
        layer(torch.randn(3, 8).bfloat16())
    with pytest.raises(TypeError, match=r"x: expected dtype torch.bfloat16, got torch.float32"):
        layer(torch.randn(3, 16))
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor"):
        layer([[0.0] * 16])
    with pytest.raises(ValueError, match=r"x: expected a dense \(strided\) tensor"):
        layer(torch.randn(3, 16).bfloat16().to_sparse())
    # route and load_balancing_loss are public too
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 16\], got \[3, 17\]"):
        layer.route(torch.randn(3, 17))
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor"):
        layer.route([[0.0] * 16])
    probs = torch.full((2, 4), 0.25)
    with pytest.raises(TypeError, match=r"topk_idx: expected dtype torch.int32 or torch.int64, got torch.float32"):
        layer.load_balancing_loss(torch.tensor([[0.0, 1.0], [2.0, 3.0]]), probs)
    with pytest.raises(ValueError, match=r"topk_idx: expected shape \[2, K\], got \[3, 2\]"):
        layer.load_balancing_loss(torch.tensor([[0, 1], [2, 3], [1, 2]]), probs)
    with pytest.raises(ValueError, match=r"probs: expected shape \[T, 4\], got \[2, 5\]"):
        layer.load_balancing_loss(torch.tensor([[0, 1], [2, 3]]), torch.full((2, 5), 0.2))


def test_group_without_init_process_group():
    args, _ = make_inputs(10)
    with pytest.raises(ValueError, match=r"group: expected a torch.distributed ProcessGroup"):
        mok.moe_forward(*args, group=object())
    with pytest.raises(ValueError, match=r"group: expected a torch.distributed ProcessGroup"):
        mok.MoELayer(16, 8, 4, 2, group=object())


# ------------------------------------------------------------------------------------------------
# GPU (run on the H200: pytest -m gpu)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_matches_reference_on_cpu():
    print(mok.forward_path("cuda"))
    args, shared = make_inputs(11, T=300, H=256, I=128, E=8, K=2, Is=64)
    out = mok.moe_forward(*(a.cuda() for a in args), shared=tuple(s.cuda() for s in shared))
    want = ref.moe_forward(*args, shared=shared)
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    assert_tokens_close(out.cpu(), want, what=f"{mok.forward_path('cuda')} against the CPU reference")
    ref_cuda = mok.moe_forward(*(a.cuda() for a in args), shared=tuple(s.cuda() for s in shared), config=MoKConfig(backend="reference"))
    assert_tokens_close(ref_cuda.cpu(), want, what="the reference on CUDA against the CPU reference")
    again = mok.moe_forward(*(a.cuda() for a in args), shared=tuple(s.cuda() for s in shared))
    assert torch.equal(out, again)  # bitwise reproducible run to run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bad_device_mix():
    args, _ = make_inputs(12)
    cuda_args = [a.cuda() for a in args]
    with pytest.raises(ValueError, match=r"w_gate: expected a tensor on device cuda:0, got one on cpu"):
        mok.moe_forward(*_replace(cuda_args, 3, args[3]))


def _at_offset(t: torch.Tensor, elems: int) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data starts ``elems`` elements into its storage."""
    flat = torch.empty(t.numel() + elems, dtype=t.dtype, device=t.device)
    view = flat[elems:].view(t.shape)
    view.copy_(t)
    return view


def test_alignment_is_checked_by_name_and_only_for_the_kernels():
    """``check_aligned``: a view 8 bytes past a 16-byte boundary is refused naming it, an
    aligned or empty tensor passes. On the CPU (the reference, no TMA) the call takes it and
    gives the aligned call's bits."""
    from mok_cute.config import check_aligned

    w = torch.randn(4, 16).to(torch.bfloat16)
    assert check_aligned("w", w) is w
    assert check_aligned("empty", torch.empty(0)).numel() == 0
    with pytest.raises(ValueError, match=r"w_down: expected its data 16-byte aligned on cpu .* "
                                         r"8 bytes past a boundary .*\.clone\(\)"):
        check_aligned("w_down", _at_offset(w, 4))
    args, shared = make_inputs(5, Is=16)
    moved = [*args[:5], _at_offset(args[5], 4)]
    want = mok.moe_forward(*args, shared=shared)
    assert torch.equal(mok.moe_forward(*moved, shared=shared), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_views_off_a_16_byte_boundary_are_refused_by_name():
    """On CUDA, x, a weight, a shared weight or a main_grad whose data is not 16-byte aligned
    (the kernels' TMA and vector reads) is refused by name before anything runs: a main_grad
    at forward time, so no other main_grad has been added into."""
    args, shared = make_inputs(13, T=40, H=128, I=128, E=4, K=2, Is=128)
    args = [a.cuda() for a in args]
    shared = tuple(s.cuda() for s in shared)
    for i, name in ((0, "x"), (3, "w_gate"), (5, "w_down")):
        moved = list(args)
        moved[i] = _at_offset(args[i], 4)
        with pytest.raises(ValueError, match=f"{name}: expected its data 16-byte aligned"):
            mok.moe_forward(*moved, shared=shared)
    with pytest.raises(ValueError, match=r"shared\[1\] \(ws_up\): expected its data 16-byte"):
        mok.moe_forward(*args, shared=(shared[0], _at_offset(shared[1], 4), shared[2]))
    leaves = [t.detach().clone().requires_grad_() for t in args[3:]]
    starts = []
    for t, elems in zip(leaves, (0, 0, 2)):  # w_down's main_grad 8 bytes off
        t.main_grad = _at_offset(torch.randn(t.shape, device="cuda"), elems)
        starts.append(t.main_grad.clone())
    with pytest.raises(ValueError, match=r"w_down\.main_grad: expected its data 16-byte aligned"):
        mok.moe_forward(*args[:3], *leaves, config=MoKConfig(fuse_wgrad_accumulation=True))
    for t, s0 in zip(leaves, starts):
        assert torch.equal(t.main_grad, s0)


def test_megakernel_sizes_it_cannot_take_fall_back_or_raise():
    from mok_cute.config import MoEDims

    ok = MoEDims(num_ranks=2, tokens=8, hidden=512, top_k=4, local_experts=4, intermediate=256,
                 shared_intermediate=0)
    assert api._megakernel_fallback(ok, MoKConfig()) is False
    odd = ok._replace(hidden=100)
    with pytest.warns(UserWarning, match="x: hidden size must be a multiple of 64"):
        assert api._megakernel_fallback(odd, MoKConfig()) is True
    for backend in ("kernel", "megakernel"):
        with pytest.raises(ValueError, match=f"config.backend='{backend}': x: hidden size"):
            api._megakernel_fallback(odd, MoKConfig(backend=backend))
    with pytest.raises(ValueError, match="shared: intermediate size"):
        api._megakernel_fallback(ok._replace(shared_intermediate=100), MoKConfig(backend="megakernel"))


def test_the_kernel_paths_fallback_is_the_unchecked_reference(monkeypatch):
    """A size the expert path cannot take (H = 32, not a multiple of 64) without grad: a
    warning, then the reference's bits, without a second pass of the input checks (api.py
    checked them and waits for its id check)."""
    from mok_cute import expert_path

    args, shared = make_inputs(3, Is=16)
    want = ref.moe_forward(*args, shared=shared)
    monkeypatch.setattr(ref, "check_moe_inputs", lambda *a, **k: pytest.fail("checked twice"))
    with pytest.warns(UserWarning, match="running the PyTorch reference because x: hidden size"):
        got = expert_path.moe_forward_kernel(*args, shared, MoKConfig(backend="auto"))
    assert torch.equal(got, want)


def test_options_objects_are_checked_and_part_of_the_config():
    from mok_cute.config import ExpertPathOptions, MegakernelOptions

    cfg = MoKConfig(megakernel=MegakernelOptions(tickets="static"),
                    expert_path=ExpertPathOptions(fc2_pingpong_max_k=0))
    assert cfg.megakernel.tickets == "static" and not cfg.expert_path.fc2_pingpong(768)
    assert MoKConfig() == MoKConfig(megakernel=MegakernelOptions(), expert_path=ExpertPathOptions())
    with pytest.raises(TypeError, match="MoKConfig.megakernel: expected a mok_cute.MegakernelOptions"):
        MoKConfig(megakernel={"tickets": "static"})
    with pytest.raises(TypeError, match="MoKConfig.expert_path"):
        MoKConfig(expert_path=None)
    with pytest.raises(TypeError, match="MegakernelOptions.rows_in_place"):
        MegakernelOptions(rows_in_place=1)
    for bad in (0, 65, 2.0):
        with pytest.raises((TypeError, ValueError), match="MegakernelOptions.backward_comm_sms"):
            MegakernelOptions(backward_comm_sms=bad)


def _trainable(seed=3, T=24, H=32, I=16, E=4, K=2, Is=16):
    args, shared = make_inputs(seed, T=T, H=H, I=I, E=E, K=K, Is=Is)
    leaves = [args[0], args[2], *args[3:], *(shared or ())]
    return [t.detach().clone().requires_grad_(True) for t in leaves], args[1]


def _reference_step(fn, leaves, idx, d_out, config=None):
    for t in leaves:
        t.grad = None
    out = fn(leaves[0], idx, leaves[1], *leaves[2:5], shared=tuple(leaves[5:]) or None,
             config=config)
    out.backward(d_out)
    return out.detach(), [t.grad for t in leaves]


def test_compiled_call_on_the_reference_keeps_its_bits_and_names_its_break():
    """No kernel here: under torch.compile the reference runs eagerly (Inductor fusing its ops
    changed its bf16 rounding), so output and gradients are eager's bitwise; fullgraph=True
    refuses the graph break with the reason."""
    leaves, idx = _trainable()
    d_out = torch.randn(24, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = _reference_step(mok.moe_forward, leaves, idx, d_out)
    torch._dynamo.reset()
    got = _reference_step(torch.compile(mok.moe_forward), leaves, idx, d_out)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="PyTorch reference"):
        _reference_step(torch.compile(mok.moe_forward, fullgraph=True), leaves, idx, d_out)


def test_a_direct_call_in_an_autocast_region_keeps_the_reference_bits():
    """``moe_forward`` itself (not only MoELayer) turns autocast off: its bf16 contract, the
    same output and gradients as outside the region."""
    leaves, idx = _trainable(seed=5)
    d_out = torch.randn(24, 32, generator=torch.Generator().manual_seed(6)).bfloat16()
    want = _reference_step(mok.moe_forward, leaves, idx, d_out)

    def in_autocast(*args, **kwargs):  # the forward in the region, the backward after it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mok.moe_forward(*args, **kwargs)
    got = _reference_step(in_autocast, leaves, idx, d_out)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))


def test_main_grad_stays_out_of_a_create_graph_backward():
    """Fused accumulation on the reference under ``backward(create_graph=True)``: main_grad
    gets the gradient's value, not a node of the graph (it lives across steps)."""
    leaves, idx = _trainable(seed=7, Is=0)
    for w in leaves[2:]:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    out = mok.moe_forward(leaves[0], idx, leaves[1], *leaves[2:5],
                          config=MoKConfig(fuse_wgrad_accumulation=True))
    out.float().square().sum().backward(create_graph=True)
    for w in leaves[2:]:
        assert not w.main_grad.requires_grad and w.main_grad.grad_fn is None
        assert (w.main_grad != 0).any()


def test_layer_deep_copy_shares_its_group():
    """copy.deepcopy of a layer with a process group (an EMA or reference model): the copy
    shares the group (a group cannot be copied) and computes the same output."""
    import copy
    import datetime
    import os
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            layer = mok.MoELayer(32, 16, 4, 2, group=dist.group.WORLD)
            twin = copy.deepcopy(layer)
            assert twin.group is layer.group and twin.w_gate is not layer.w_gate
            x = torch.randn(6, 32).bfloat16()
            assert torch.equal(twin(x), layer(x))
        finally:
            dist.destroy_process_group()


def test_importing_the_package_registers_its_ops():
    """A fresh process that imports mok_cute finds torch.ops.mok_cute.* (an exported or
    AOT-compiled graph calls them by name)."""
    import subprocess

    code = ("import torch, mok_cute; "
            "print(all(hasattr(torch.ops.mok_cute, n) for n in "
            "('moe_forward_train', 'moe_backward', 'moe_forward_virtual_train')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip() == "True", done.stderr
