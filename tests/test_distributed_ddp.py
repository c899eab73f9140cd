"""DistributedDataParallel around torch modules under mpirun: what every shape
of module array, each gradient dtype, hooks, re-wrapping, forwards without a
backward, buffers and the nn.Module face give.

Launches tests/distributed/ddp_worker.py through tests/test_distributed.py's
`mpirun` helper (2 ranks) and asserts on every rank's lines."""
from pathlib import Path

import pytest

from test_distributed import errors, mpirun, needs_mpi

pytest.importorskip("torch")

WORKER = Path(__file__).resolve().parent / "distributed" / "ddp_worker.py"


def run(case, np=2, **env):
    return mpirun(case, np=np, limit=200, worker=WORKER, **env)


@needs_mpi
def test_zero_dim_parameters_and_buffers_are_broadcast_with_their_shape():
    rc, lines, out, _ = run("zero_dim_arrays")
    assert rc == 0, out
    assert all(lines[r] == ["OK zero_dim_arrays"] for r in range(2)), out


@needs_mpi
def test_only_the_backward_of_a_forward_through_the_wrapper_is_reduced():
    rc, lines, out, _ = run("hooks_only_after_wrapper_forward", DIST_TEST_TIMEOUT="10")
    assert rc == 0, out
    assert all(lines[r] == ["OK hooks_only_after_wrapper_forward"] for r in range(2)), out
