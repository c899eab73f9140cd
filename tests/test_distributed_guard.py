"""dpmini.distributed's guard round 2 under mpirun: one rank's mistake is the
same call's error on every rank (never a silently mixed step), tags, out=,
NaN in max/min, torch tensors that require grad, sizes checked before copies.

Launches tests/distributed/worker.py through tests/test_distributed.py's
`mpirun` helper and asserts on every rank's lines."""
import re

import pytest

from test_distributed import _have_dist, errors, mpirun, needs_mpi


@pytest.fixture(scope="module")
def silent_steps_run():
    if not _have_dist():
        pytest.skip("needs mpirun and dpmini._dist")
    return mpirun("silent_steps")


@needs_mpi
def test_caught_local_rows_error_is_raised_on_every_rank_and_later_steps_are_right(
        silent_steps_run):
    rc, lines, out, _ = silent_steps_run
    assert rc == 0, out
    got = errors(lines, "rows_negative_1")
    assert sorted(got) == [0, 1, 2, 3], out
    assert got[1].startswith("ValueError: rows: expected an int >= 0, got -1"), got
    for r in (0, 2, 3):
        assert "rank 1 rejected its arguments: ValueError: rows: expected an int >= 0" \
            in got[r], got
    for r in range(4):
        for step in (0, 2, 3):
            assert f"OK rows_negative step {step}" in lines[r], out
        assert not errors(lines, "rows_negative_0") and not errors(lines, "rows_negative_2")


@needs_mpi
def test_none_gradient_on_one_rank_is_a_prompt_error_on_every_rank(silent_steps_run):
    rc, lines, out, _ = silent_steps_run
    got = errors(lines, "none_grad")
    assert sorted(got) == [0, 1, 2, 3], out
    assert got[3].startswith("TypeError: grads[0]: expected a floating or complex array, "
                             "got None"), got
    for r in range(3):
        assert got[r].startswith("ValueError: dpmini.distributed.all_gather"), got
        assert "rank 3 rejected its arguments: TypeError: grads[0]" in got[r], got
        took = [float(line.split()[-1]) for line in lines[r] if line.startswith("none_grad took")]
        assert took and took[0] < 10, (took, out)   # the timeout is 20 s


@needs_mpi
def test_weights_mode_that_differs_on_one_rank_is_a_value_error_on_every_rank(silent_steps_run):
    rc, lines, out, _ = silent_steps_run
    got = errors(lines, "weights_mode")
    assert sorted(got) == [0, 1, 2, 3] and len(set(got.values())) == 1, got
    msg = got[0]
    assert "disagree on the options" in msg, msg
    assert "rank 0: all_gather call" in msg and "weights='mean'" in msg, msg
    assert "rank 1-3: all_gather call" in msg and "weights='rows'" in msg, msg


@needs_mpi
def test_skipped_tagged_call_is_a_value_error_naming_the_tags(silent_steps_run):
    rc, lines, out, _ = silent_steps_run
    got = errors(lines, "skipped_tag")
    assert sorted(got) == [0, 1, 2, 3] and len(set(got.values())) == 1, got
    msg = got[0]
    assert "disagree on tag" in msg, msg
    assert re.search(r"rank 0-2: all_reduce call \d+ tag=1 ", msg), msg
    assert re.search(r"rank 3: all_reduce call \d+ tag=2 ", msg), msg
    for r in range(4):   # the retried call tagged 2 pairs and is right
        assert "OK tagged step 2" in lines[r] and "OK tagged step 1" not in lines[r], out


@needs_mpi
def test_bad_tag_on_one_rank_raises_on_every_rank(silent_steps_run):
    rc, lines, out, _ = silent_steps_run
    got = errors(lines, "bad_tag")
    assert sorted(got) == [0, 1, 2, 3], out
    assert got[0].startswith("TypeError: tag: expected an int, a str or None, got float"), got
    for r in (1, 2, 3):
        assert "rank 0 rejected its arguments: TypeError: tag:" in got[r], got
    assert all("OK silent_steps" in lines[r] for r in range(4)), out


@needs_mpi
def test_views_past_mpi_counts_or_memory_raise_before_any_copy_on_every_rank():
    rc, lines, out, _ = mpirun("big_views", np=2)
    assert rc == 0, out
    own = {
        "scatter_view": ([0], "OverflowError: x: 1 blocks of 2147483653 rows of 1 bytes along "
                              "dim 0 do not fit MPI's int counts"),
        "gather_view": ([0, 1], "OverflowError: x: 1 blocks of 2147483653 rows"),
        "all_gather_view": ([0, 1], "OverflowError: x: 1 blocks of 2147483653 rows"),
        "broadcast_view": ([0], "OverflowError: x: 2147483653 elements do not fit MPI's int count"),
        "all_reduce_view": ([0, 1], "OverflowError: x: 2147483653 elements do not fit"),
        "broadcast_memory": ([0], "MemoryError: x: this view would be copied to be sent (it is "
                                  "not C-contiguous), which needs 64.00 GiB"),
    }
    for case, (ranks, text) in own.items():
        got = errors(lines, case)
        assert sorted(got) == [0, 1], (case, out)
        for r in (0, 1):
            if r in ranks:
                assert got[r].startswith(text), (case, got)
            else:
                assert got[r].startswith("ValueError: dpmini.distributed.") and \
                    f"rank {ranks[0]} rejected its arguments: {text}" in got[r], (case, got)
        for r in (0, 1):
            peak = [int(line.split()[-1]) for line in lines[r] if line.startswith(f"peak {case} ")]
            assert peak and peak[0] < 64 << 20, (case, peak)   # no copy of the view
    assert all("OK big_views" in lines[r] for r in range(2)), out


@needs_mpi
def test_max_and_min_propagate_nan_whichever_rank_holds_it():
    rc, lines, out, _ = mpirun("nan")
    assert rc == 0, out
    assert all(lines[r] == ["OK nan"] for r in range(4)), out


@needs_mpi
def test_second_thread_in_a_collective_is_refused_naming_one_thread_at_a_time():
    rc, lines, out, _ = mpirun("threads")
    assert rc == 0, out
    got = errors(lines, "threads")
    assert list(got) == [0], out
    assert got[0].startswith("RuntimeError: dpmini.distributed: a communicator serves one "
                             "thread at a time"), got
    assert all("OK threads" in lines[r] for r in range(4)), out


@pytest.fixture(scope="module")
def torch_users_run():
    pytest.importorskip("torch")
    if not _have_dist():
        pytest.skip("needs mpirun and dpmini._dist")
    return mpirun("torch_users")


@needs_mpi
def test_tensor_that_requires_grad_is_refused_on_every_rank_naming_detach(torch_users_run):
    rc, lines, out, _ = torch_users_run
    got = errors(lines, "requires_grad")
    assert sorted(got) == [0, 1, 2, 3], out
    own = "TypeError: x: a torch tensor that requires grad"
    assert got[2].startswith(own) and "pass x.detach()" in got[2], got
    for r in (0, 1, 3):
        assert f"rank 2 rejected its arguments: {own}" in got[r], got


@needs_mpi
def test_out_writes_the_result_in_place_as_torch_does(torch_users_run):
    rc, lines, out, _ = torch_users_run
    assert rc == 0, out
    assert all("OK torch_users" in lines[r] for r in range(4)), out


@needs_mpi
@pytest.mark.parametrize("case,bad_rank,own", [
    ("out_shape", 1, "ValueError: out: expected shape (2,) (the result's), got (3,)"),
    ("out_dtype", 3, "TypeError: out: expected dtype float64 (the result's), got float32"),
])
def test_wrong_out_of_all_reduce_raises_on_every_rank(torch_users_run, case, bad_rank, own):
    rc, lines, out, _ = torch_users_run
    got = errors(lines, case)
    assert sorted(got) == [0, 1, 2, 3], out
    assert got[bad_rank].startswith(own), got
    for r in set(range(4)) - {bad_rank}:
        assert f"rank {bad_rank} rejected its arguments: {own}" in got[r], got


@needs_mpi
@pytest.mark.parametrize("np_", [4, 2, 1])
def test_values_on_both_sides_of_the_fused_size(np_):
    rc, lines, out, _ = mpirun("sizes_both_paths", np=np_)
    assert rc == 0, out
    assert all(lines[r] == ["OK sizes_both_paths"] for r in range(np_)), out


MISMATCH_SIZES = {
    "b_root": "disagree on root", "b_tag": "disagree on tag", "s_root": "disagree on root",
    "s_split": "disagree on chunk_sizes/weights", "s_dim": "disagree on dim",
    "g_shape": "disagree on the number of dimensions", "g_dtype": "disagree on dtype",
    "g_tag": "disagree on tag", "ag_dtype": "disagree on dtype",
    "kind": "disagree on the collective", "kind2": "disagree on the collective",
    "ar_shape": "disagree on shape", "ar_op": "disagree on op", "r_root": "disagree on root",
    "kind3": "disagree on the collective",
}


@needs_mpi
@pytest.mark.parametrize("np_", [4, 2])
def test_mismatch_on_every_data_path_raises_everywhere_and_the_next_call_is_right(np_):
    rc, lines, out, _ = mpirun("mismatch_sizes", np=np_, limit=240)
    assert rc == 0, out
    for n in (8, 4096, 1 << 20):
        for name, words in MISMATCH_SIZES.items():
            got = errors(lines, f"{name}_{n}")
            assert sorted(got) == list(range(np_)), (name, n, out)
            assert len(set(got.values())) == 1, (name, n, got)
            assert words in got[0], (name, n, got[0])
    assert all(lines[r][-1] == "OK mismatch_sizes" for r in range(np_)), out
