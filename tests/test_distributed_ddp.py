"""DistributedDataParallel around torch modules under mpirun: what every shape
of module array, each gradient dtype, hooks, re-wrapping, forwards without a
backward, buffers and the nn.Module face give.

Launches tests/distributed/ddp_worker.py through tests/test_distributed.py's
`mpirun` helper (2 ranks) and asserts on every rank's lines."""
import os
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


@needs_mpi
def test_a_forward_without_backward_on_one_rank_leaves_the_steps_paired_and_exact():
    rc, lines, out, _ = run("forward_without_backward", DIST_TEST_TIMEOUT="10")
    assert rc == 0, out
    assert all(lines[r] == ["OK forward_without_backward"] for r in range(2)), out


@needs_mpi
def test_no_sync_after_a_forward_without_backward_on_one_rank_stays_local():
    rc, lines, out, _ = run("no_sync_after_forward_without_backward", DIST_TEST_TIMEOUT="10")
    assert rc == 0, out
    assert all(lines[r] == ["OK no_sync_after_forward_without_backward"] for r in range(2)), out


@needs_mpi
@pytest.mark.skipif(bool(os.environ.get("DPMINI_SANITIZER")),
                    reason="the error leaves a gradient hook through torch's C++ (a C++ throw), "
                           "which aborts under the preloaded ASan runtime")
def test_a_backward_skipped_on_one_rank_is_an_error_on_every_rank_saying_what_to_do():
    rc, lines, out, _ = run("skipped_backward", DIST_TEST_TIMEOUT="10")
    assert rc == 0, out
    got = errors(lines, "skipped")
    assert sorted(got) == [0, 1] and len(set(got.values())) == 1, out
    assert got[0].startswith("ValueError:") and "ddp step 1 bucket 0" in got[0] \
        and "ddp step 2 bucket 0" in got[0], got[0]
    assert "Every rank must skip a step together" in got[0], got[0]
    assert all(lines[r][-1] == "OK usable" for r in range(2)), out


@needs_mpi
def test_a_new_wrapper_of_the_same_model_takes_the_hooks_over():
    rc, lines, out, _ = run("rewrap_each_epoch", DIST_TEST_TIMEOUT="10")
    assert rc == 0, out
    got = errors(lines, "old_wrapper")
    assert sorted(got) == [0, 1], out
    assert got[0].startswith("RuntimeError: DistributedDataParallel: this wrapper's gradient "
                             "hooks were removed"), got[0]
    assert all(lines[r][-1] == "OK rewrap_each_epoch" for r in range(2)), out


@needs_mpi
def test_float16_and_bfloat16_gradients_are_reduced_in_float32_and_rounded_once():
    rc, lines, out, _ = run("half_gradients")
    assert rc == 0, out
    assert all(lines[r] == ["OK half_gradients"] for r in range(2)), out


@needs_mpi
def test_sparse_embedding_gradients_come_back_sparse_with_the_mean():
    rc, lines, out, _ = run("sparse_gradients")
    assert rc == 0, out
    assert all(lines[r] == ["OK sparse_gradients"] for r in range(2)), out


@needs_mpi
def test_all_reduce_takes_float16_and_bfloat16_summing_in_float32():
    rc, lines, out, _ = run("half_all_reduce")
    assert rc == 0, out
    got = errors(lines, "mixed")
    assert sorted(got) == [0, 1] and len(set(got.values())) == 1, out
    assert "float16 summed in float32" in got[0], got[0]
    assert all(lines[r][-1] == "OK half_all_reduce" for r in range(2)), out


@needs_mpi
def test_broadcast_buffers_copies_rank_0s_buffers_before_each_training_forward():
    rc, lines, out, _ = run("broadcast_buffers", DIST_TEST_TIMEOUT="10")
    assert rc == 0, out
    assert all(lines[r] == ["OK broadcast_buffers"] for r in range(2)), out


@needs_mpi
def test_the_wrapper_of_a_torch_module_is_an_nn_module_whose_child_is_module():
    rc, lines, out, _ = run("module_face")
    assert rc == 0, out
    assert all(lines[r] == ["OK module_face"] for r in range(2)), out


@needs_mpi
def test_different_models_on_the_ranks_name_what_each_rank_has():
    rc, lines, out, _ = run("layout_mismatch")
    assert rc == 0, out
    got = errors(lines, "layout")
    assert sorted(got) == [0, 1] and len(set(got.values())) == 1, out
    msg = got[0]
    assert "on rank(s) [1] differ from rank 0's" in msg, msg
    assert "'0.weight' is shape (3, 2) dtype torch.float32 (torch) on rank(s) [0], " \
           "shape (4, 2) dtype torch.float32 (torch) on rank(s) [1]" in msg, msg
    assert "'0.bias' is shape (3,)" in msg and "shape (4,)" in msg, msg
    assert "'extra' is missing on rank(s) [0], shape (2,) dtype torch.float32 (torch) on rank(s) [1]" \
        in msg, msg
