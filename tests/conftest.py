"""Shared fixtures for dpmini's Python tests.

Device lists are always explicit (the default device count depends on the
machine). The chunk rule used as the oracle is torch.chunk's (docs/spec.md 0.1-0.2):
split = ceil(n / k), pieces of `split` rows with a shorter last one, so the
piece count is max(ceil(n / split), 1); n == 0 gives k empty pieces.
"""
import numpy as np
import pytest


def cpu_devices(k):
    """['cpu:0', ..., 'cpu:k-1']"""
    return [f"cpu:{i}" for i in range(k)]


def torch_chunk_sizes(n, k):
    """Per-device sizes of torch.chunk(k) on a dimension of length n."""
    if n == 0:
        return [0] * k
    split = -(-n // k)
    count = -(-n // split)
    return [split] * (count - 1) + [n - split * (count - 1)]


@pytest.fixture
def dev2():
    return cpu_devices(2)


@pytest.fixture
def dev3():
    return cpu_devices(3)


@pytest.fixture
def dev4():
    return cpu_devices(4)


@pytest.fixture
def dev8():
    return cpu_devices(8)


@pytest.fixture(scope="session")
def chunk_rule():
    """The torch.chunk oracle as a callable: chunk_rule(n, k) -> list of sizes."""
    return torch_chunk_sizes


@pytest.fixture(scope="session")
def devices_of():
    """A callable giving str(dpmini.device_of(a)) for each array of a sequence."""
    import dpmini

    return lambda arrays: [str(dpmini.device_of(a)) for a in arrays]


@pytest.fixture(scope="session")
def no_cuda():
    """Skip the test where a CUDA device exists (the test checks the no-GPU errors)."""
    import dpmini

    if dpmini.device_count() > 0:
        pytest.skip("a CUDA device is present; this test checks the no-GPU errors")


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
