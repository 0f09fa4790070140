"""Shared fixtures: the device (CPU emulation unless a GPU is there), and the
GPU / PyTorch / CuPy gates (skip with a reason; fail under REQUIRE_GPU=1)."""
import os

import pytest

import gpufeed

REQUIRE_GPU = os.environ.get("REQUIRE_GPU") == "1"


def need(condition, reason):
    """Skip (printing why) unless `condition`; under REQUIRE_GPU=1, fail instead."""
    if condition:
        return
    if REQUIRE_GPU:
        pytest.fail(f"REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


def torch_or_skip():
    """PyTorch (CPU is enough), or a skip; a failure under TEST_TORCH=1."""
    try:
        import torch
    except ImportError:
        # run-tests.sh installs torch and says so (TEST_TORCH=1): then these
        # tests must run, never skip.
        if os.environ.get("TEST_TORCH") == "1":
            pytest.fail("TEST_TORCH=1 (run-tests.sh installed PyTorch) but torch does not import")
        pytest.skip("PyTorch is not installed (python/run-tests.sh installs it; TEST_TORCH=0 left it out)")
    return torch


@pytest.fixture(scope="module")
def device():
    return gpufeed.default_device()


@pytest.fixture(scope="module")
def cuda_device(device):
    need(device.kind == "cuda", f"no CUDA device (running on {device.kind})")
    return device


@pytest.fixture(scope="module")
def torch_cuda(cuda_device):
    try:
        import torch
    except ImportError:
        need(False, "PyTorch is not installed")
    need(torch.cuda.is_available(), "PyTorch sees no CUDA device")
    return torch


@pytest.fixture(scope="module")
def cupy_mod(cuda_device):
    try:
        import cupy
    except ImportError:
        need(False, "CuPy is not installed")
    return cupy


@pytest.fixture()
def alloc(device):
    return gpufeed.PinnedAllocator(device)
