"""Tests against the real PyTorch and JAX (`make test-interop` installs them
into the venv; under `make test` they skip when the library is missing).

JAX gets two host devices (XLA_FLAGS, set before JAX is imported) so that an
array sharded over several JAX devices can be made on the CPU, and float64
(jax_enable_x64) so that results compare exactly with NumPy's.
"""
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEVS = ["cpu:0", "cpu:1"]


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/interop" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.interop)


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="session")
def jax():
    if os.environ.get("DPMINI_SANITIZER"):
        # jaxlib's own code aborts under an LD_PRELOADed ASan runtime, with or
        # without dpmini; the JAX tests run in `make test-interop` instead.
        pytest.skip("JAX cannot run under the LD_PRELOADed ASan runtime (make test-asan)")
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    return jax


@pytest.fixture(scope="session")
def jnp(jax):
    import jax.numpy as jnp
    return jnp
