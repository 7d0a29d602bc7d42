"""Shared test setup: GPU gating, the offline compile target, a seeded generator.

CUTE_DSL_ARCH is read once when `cutlass` is first imported, and without a GPU the DSL would
target sm_100a. This file is imported before any test module, so setting it here (only when
unset and without CUDA) makes every compile-only test target Hopper sm_90a.
"""

import os
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


# the gradient checks against autograd on the fp32 reference at the reduced named shapes hold
# 10-50 GB each (gptoss_reduced ~50): `gpu_check.sh alltests` runs them one at a time in a shard
# of their own beside the others; two at once ran an 80 GB card out of memory (2026-12-06)
BIGMEM_TESTS = ("test_gradients_match_autograd_on_the_reference",
                "test_fp8_gradients_within_the_issue_bound_of_bf16",
                "test_fp8_weight_gradients_hold_the_bound_below_the_size_thresholds_too")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(item, "originalname", None) in BIGMEM_TESTS and "_reduced]" in item.nodeid:
            item.add_marker(pytest.mark.bigmem)
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A fresh CPU generator seeded from the test's id: different for every test, the same
    on every run. Draw on the CPU and move to the device, so data is identical everywhere."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def launches(monkeypatch) -> list:
    """The keyword arguments of every kernel launch traced while the test runs (grid, block,
    cluster, cooperative, ...), one dict per ``.launch(...)``: launch attributes are host
    code, invisible in the PTX and SASS that the other compile-only checks read."""
    from cutlass.cutlass_dsl.cutlass import KernelLauncher

    seen = []
    launch = KernelLauncher.launch

    def recording_launch(self, *args, **kwargs):
        seen.append(dict(kwargs))
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(KernelLauncher, "launch", recording_launch)
    return seen


@pytest.fixture(autouse=True)
def _return_cached_gpu_memory(request):
    """After each GPU test, hand the caching allocator's free blocks back to the driver:
    `gpu_check.sh alltests` runs 12 pytest processes on one GPU, and blocks cached by one
    test's large problem (up to 33 GiB a process) starved the others into OOM (2026-12-01)."""
    yield
    if HAS_CUDA and "gpu" in request.keywords:
        torch.cuda.empty_cache()
