"""dpmini.distributed under mpirun: values, the guard, timeouts, aborts, DDP.

Each test launches `mpirun -np N python tests/distributed/worker.py CASE` inside
an outer `timeout` and asserts on every rank's output lines and the exit code
(the worker asserts values itself; a failed assert ends the job non-zero).
Skipped when mpirun or the optional extension dpmini._dist is missing (then
`make test-distributed` installs Open MPI and mpi4py and rebuilds). The tests
that need no MPI (the ImportError text, import dpmini without mpi4py) always run.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import dpmini

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "worker.py"
# The dpmini under test (the in-place build, or build/asan under make test-asan).
PKG_ROOT = Path(dpmini.__file__).resolve().parents[1]
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")


def _have_dist():
    if MPIRUN is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import dpmini._dist"], capture_output=True,
                           timeout=60, env=_env())
    return probe.returncode == 0


def _env(**extra):
    env = dict(os.environ)
    # Open MPI as root on few cores; ignored by MPICH.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(PKG_ROOT), env.get("PYTHONPATH")] if p)
    env.update(extra)
    return env


needs_mpi = pytest.mark.skipif(not _have_dist(), reason="needs mpirun and dpmini._dist "
                               "(make test-distributed installs and builds them)")


# No retries: a job that fails on one rank must end by itself, and the
# launcher with it (dpmini/_dist_exit.py: no rank enters MPI_Finalize while
# another may still abort; tools/abort_runs.py measures it over many runs).
JOBS_WORKER = ROOT / "tests" / "distributed" / "jobs_worker.py"


def mpirun(case, np=4, limit=120, worker=WORKER, launcher=None, **env):
    """Run the worker; returns (exit code, {rank: [lines]}, all output, seconds).
    launcher: the mpirun to use (tools/multihost.py's, across hosts), default mpirun."""
    cmd = ["timeout", "-k", "10", str(limit), launcher or MPIRUN, "-np", str(np),
           sys.executable, str(worker), case]
    for _ in range(1):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            # Own process group: if even `timeout -k` cannot end mpirun, every
            # rank is killed with it here, so no orphan keeps the pipes (or the CPU).
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=_env(DIST_TEST_OUT=tmp, **env), cwd=ROOT,
                                    start_new_session=True)
            try:
                stdout, stderr = proc.communicate(timeout=limit + 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                pytest.fail(f"mpirun {case} did not end within {limit + 30} s:\n{stdout}{stderr}")
            took = time.monotonic() - start
            lines = {}
            for path in Path(tmp).glob("rank*.txt"):
                for line in path.read_text().splitlines():
                    m = re.match(r"^(\d+) (.*)$", line)
                    if m:
                        lines.setdefault(int(m.group(1)), []).append(m.group(2))
        out = stdout + stderr
    assert proc.returncode not in (124, 137), f"mpirun hit the outer timeout:\n{out}"
    return proc.returncode, lines, out, took


def errors(lines, case):
    """{rank: 'Type: message'} of the ERR lines for one case."""
    got = {}
    for r, ls in lines.items():
        for line in ls:
            if line.startswith(f"ERR {case} "):
                got[r] = line[len(f"ERR {case} "):]
    return got


@needs_mpi
@pytest.mark.parametrize("np_", [4, 1])
def test_scatter_gather_reduce_broadcast_values(np_):
    rc, lines, out, _ = mpirun("values", np=np_)
    assert rc == 0, out
    for r in range(np_):
        assert lines[r] == ["OK roundtrip", "OK sizes", "OK reduce", "OK broadcast"], out


@needs_mpi
def test_uneven_batch_gradient_equals_single_process():
    rc, lines, out, _ = mpirun("ddp")
    assert rc == 0, out
    assert all(lines[r] == ["OK ddp"] for r in range(4)), out


@needs_mpi
def test_uneven_batch_gradient_one_rank():
    rc, lines, out, _ = mpirun("ddp", np=1)
    assert rc == 0 and lines[0] == ["OK ddp"], out


@pytest.fixture(scope="module")
def mismatch_run():
    if not _have_dist():
        pytest.skip("needs mpirun and dpmini._dist")
    return mpirun("mismatch")


@pytest.mark.parametrize("case,words", [
    ("shape", ["disagree on shape", "rank 0-2: all_reduce", "shape (4,)", "rank 3:", "shape (5,)"]),
    ("dtype", ["disagree on dtype", "rank 1: all_reduce", "float32", "rank 0,2,3:", "float64"]),
    ("op", ["disagree on op", "rank 2: all_reduce", "op=max", "op=sum"]),
    ("gather_shape", ["disagree on shape", "rank 0: gather", "shape (1, 2)", "shape (2, 3)"]),
    ("root", ["disagree on root", "rank 0: reduce call", "root=1", "rank 1-3:"]),
    ("kind", ["disagree on the collective", "all_gather", "all_reduce"]),
    ("split", ["disagree on chunk_sizes/weights", "chunk_sizes=[5, 1, 1, 1]"]),
    ("fields", ["disagree on dtype", "rank 1: gather", "dtype |V12 fields#", "rank 0,2,3:"]),
    ("byteorder", ["disagree on dtype", "rank 2: gather", "dtype float64 (", "rank 0,1,3:"]),
    ("fields_void", ["disagree on dtype", "rank 3: gather", "fields#"]),
])
def test_disagreement_is_the_same_value_error_on_every_rank(mismatch_run, case, words):
    rc, lines, out, _ = mismatch_run
    assert rc == 0, out
    got = errors(lines, case)
    assert sorted(got) == [0, 1, 2, 3], out
    assert len(set(got.values())) == 1, got          # word for word the same
    msg = got[0]
    assert msg.startswith("ValueError: dpmini.distributed."), msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("case,bad_rank,own", [
    ("bad_dim", 2, "IndexError: dim: 7 is out of range"),
    ("bad_sizes", 0, "ValueError: chunk_sizes: the sizes must add up to the 8 rows"),
    ("unpicklable", 0, "TypeError: x: cannot pickle function"),
    ("root_none", 0, "TypeError: x: rank 0 is scatter's root (root=0) and passed None; root "
                     "passes the array to split"),
    ("type_op", 0, "TypeError: op: expected 'sum', 'mean', 'max' or 'min', got NoneType"),
    ("type_root", 1, "TypeError: root: expected an int, got float"),
    ("type_dim", 3, "TypeError: dim: expected an int, got str"),
    ("huge_root", 2, "ValueError: root: 1180591620717411303424 is out of range"),
    ("masked", 1, "TypeError: x: numpy.ma.MaskedArray is not supported by dpmini.distributed"),
    ("array_root", 1, "TypeError: root: expected an int, got numpy.ndarray"),
])
def test_bad_argument_on_one_rank_raises_on_every_rank(mismatch_run, case, bad_rank, own):
    rc, lines, out, _ = mismatch_run
    got = errors(lines, case)
    assert sorted(got) == [0, 1, 2, 3], out
    assert got[bad_rank].startswith(own), got
    for r in range(4):
        if r != bad_rank:
            assert got[r].startswith("ValueError: dpmini.distributed."), got
            assert f"rank {bad_rank} rejected its arguments: {own}" in got[r], got


def test_communicator_stays_usable_after_each_disagreement(mismatch_run):
    rc, lines, out, _ = mismatch_run
    assert rc == 0 and all("OK mismatch" in lines[r] for r in range(4)), out
    assert not any("NOERR" in line for ls in lines.values() for line in ls), out
    assert sorted(errors(lines, "bad_op")) == [0, 1, 2, 3]


@needs_mpi
def test_rank_that_skips_a_call_gives_timeout_error_naming_it():
    # case_skip sets the 3 s timeout itself, after an init with the default
    rc, lines, out, took = mpirun("skip", limit=90)
    assert rc != 0, out                                # uncaught TimeoutError -> MPI_Abort
    assert lines[3] == ["finished loop"], out
    named = re.findall(r"TimeoutError: dpmini.distributed.all_reduce \(call 3 on rank (\d)\): "
                       r"rank 3 did not arrive within the timeout of 3 s", out)
    assert set(named) <= {"0", "1", "2"} and named, out
    assert took < 60, took


@needs_mpi
def test_caught_timeout_still_ends_the_job_instead_of_hanging_in_finalize():
    rc, lines, out, took = mpirun("caught_timeout", limit=60)
    assert rc != 0, out
    # The first rank to abort ends the others, so some may not have written yet.
    caught = errors(lines, "caught_timeout")
    assert caught and set(caught) <= {0, 1, 2}, out
    for r, msg in caught.items():
        assert msg.startswith(f"TimeoutError: dpmini.distributed.barrier (call 1 on rank {r}): "
                              "rank 3 did not arrive"), msg
    after = errors(lines, "after_timeout")
    assert after and set(after) <= {0, 1, 2}, out
    assert all("cannot be used after a TimeoutError in barrier call 1" in m
               for m in after.values()), out
    assert "aborting the job (MPI_Abort, exit code 1) rather than waiting" in out
    assert took < 60, took


@needs_mpi
def test_ddp_mismatch_reduce_gradients_errors_explain():
    rc, lines, out, _ = mpirun("misc")
    assert rc == 0, out
    assert all("OK misc" in lines[r] for r in range(4)), out
    ddp = errors(lines, "ddp_mismatch")
    assert sorted(ddp) == [0, 1, 2, 3] and len(set(ddp.values())) == 1, ddp
    assert "on rank(s) [3] differ from rank 0's" in ddp[0], ddp
    assert errors(lines, "rows_missing")[0].startswith("ValueError: rows: weights='rows' needs")
    assert errors(lines, "int_grads")[0].startswith("TypeError: grads['w']: expected a floating")
    assert errors(lines, "bad_weights")[0].startswith("ValueError: weights: expected 'rows'")
    assert errors(lines, "bad_timeout")[0].startswith("ValueError: timeout: expected seconds > 0")
    assert errors(lines, "bad_comm")[0].startswith("TypeError: comm: expected an mpi4py")


@needs_mpi
def test_exception_on_one_rank_ends_the_job_in_seconds():
    rc, lines, out, took = mpirun("raise", limit=60)
    assert rc != 0, out
    assert "RuntimeError: boom on rank 1" in out
    assert "rank 1 of 4 ended with RuntimeError; aborting the job" in out
    assert "NOT REACHED" not in out
    assert took < 60, took     # the others wait with timeout=120: the abort ended them


@needs_mpi
def test_collective_before_init_is_a_runtime_error():
    rc, lines, out, _ = mpirun("uninitialized", np=1)
    assert rc == 0, out
    assert errors(lines, "uninitialized")[0].startswith(
        "RuntimeError: dpmini.distributed is not initialized"), out


@needs_mpi
def test_abi_guard_refuses_another_mpi_family():
    # the guard that runs at import, reached through the test-only extension
    code = (
        "import dpmini._dist as d\n"
        "from dpmini import _testing\n"
        "from mpi4py import MPI\n"
        "_testing.dist_check_abi(MPI.Get_library_version())\n"
        "fam = d.BUILD_FAMILY\n"
        "other = 'MPICH Version: 4.1.2' if fam == 'Open MPI' else 'Open MPI v4.1.4'\n"
        "for s in (other, fam + ' but another build'):\n"
        "    try:\n"
        "        _testing.dist_check_abi(s)\n"
        "    except ImportError as e:\n"
        "        print('REFUSED', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=_env())
    assert proc.returncode == 0, proc.stderr
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2, proc.stdout
    assert "built against" in refused[0] and "handles differ" in refused[0]
    assert "two MPI libraries in one process" in refused[1]


def _without_mpi4py(code):
    blocker = (
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mpi4py' or name.startswith('mpi4py.'):\n"
        "            raise ImportError('No module named mpi4py (blocked)')\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True,
                          text=True, timeout=60, env=_env())


def test_import_dpmini_works_without_mpi():
    proc = _without_mpi4py("import dpmini; print(dpmini.DataParallel.__name__)")
    assert proc.returncode == 0 and "DataParallel" in proc.stdout, proc.stderr


def test_import_distributed_without_mpi_says_how_to_install():
    proc = _without_mpi4py(
        "try:\n"
        "    import dpmini.distributed\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR', e)\n")
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTERROR dpmini.distributed needs MPI" in proc.stdout
    assert 'pip install "dpmini[mpi]"' in proc.stdout
    assert "openmpi-bin libopenmpi-dev" in proc.stdout


@needs_mpi
def test_ddp_in_dims_broadcast_table_first_counts_the_batch_rows():
    rc, lines, out, _ = mpirun("ddp_indims")
    assert rc == 0 and all(lines[r] == ["OK ddp_indims"] for r in range(4)), out


@pytest.fixture(scope="module")
def dict_keys_run():
    if not _have_dist():
        pytest.skip("needs mpirun and dpmini._dist")
    return mpirun("dict_keys")


def test_reduce_gradients_pairs_dict_entries_by_key(dict_keys_run):
    rc, lines, out, _ = dict_keys_run
    assert rc == 0 and all("OK dict_keys" in lines[r] for r in range(4)), out
    got = errors(lines, "dict_keys")
    assert sorted(got) == [0, 1, 2, 3] and len(set(got.values())) == 1, got
    assert "'c' missing on rank(s) [0, 1, 2]" in got[0], got


@needs_mpi
@pytest.mark.parametrize("case,words", [
    ("shape_differs", ["grads['w'] has shape (3,) dtype float64 on rank(s) [0], shape (2,) "
                       "dtype float64 on rank(s) [1, 2, 3]"]),
    ("dtype_differs", ["grads[1] has shape (2,) dtype float64 on rank(s) [0, 2, 3], shape (2,) "
                       "dtype float32 on rank(s) [1]"]),
    ("count_differs", ["different numbers of gradients: 1 on rank(s) [0, 1, 3], 2 on rank(s) "
                       "[2]"]),
])
def test_reduce_gradients_names_the_entry_whose_shape_differs(dict_keys_run, case, words):
    rc, lines, out, _ = dict_keys_run
    got = errors(lines, case)
    assert sorted(got) == [0, 1, 2, 3] and len(set(got.values())) == 1, got
    assert got[0].startswith("ValueError: reduce_gradients: "), got
    assert "all_reduce" not in got[0] and "(9,)" not in got[0], got   # not the packed buffer
    for w in words:
        assert w in got[0], (w, got[0])


@needs_mpi
def test_all_reduce_past_the_int_count_raises_before_copying_a_view():
    rc, lines, out, _ = mpirun("big_reduce", np=2)
    assert rc == 0, out
    got = errors(lines, "big_reduce")
    assert sorted(got) == [0, 1], out
    for m in got.values():
        assert m.startswith("OverflowError: x: 2147483653 elements do not fit MPI's int count"), m
    for r in range(2):
        peak = [int(x.split()[1]) for x in lines[r] if x.startswith("peak ")]
        assert peak and peak[0] < 2**26, (peak, out)   # no 2 GiB contiguous copy
        assert lines[r][-1] == "OK big_reduce", out


@needs_mpi
def test_rank_failing_before_init_aborts_the_job_at_once():
    # The hook installed at import aborts: the others, waiting in init with a
    # timeout of 30 s, are ended long before it (so none reports a TimeoutError).
    rc, lines, out, took = mpirun("skip_init", limit=90, DIST_TEST_TIMEOUT="30")
    assert rc != 0, out
    assert "RuntimeError: rank 3 failed before init" in out
    assert "rank 3 of 4 ended with RuntimeError; aborting the job (MPI_Abort" in out
    assert not errors(lines, "init"), out
    assert took < 60, took


@needs_mpi
def test_rank_leaving_before_init_ends_the_job_through_finalize():
    rc, lines, out, took = mpirun("exit_before_init", limit=60, worker=JOBS_WORKER)
    assert rc != 0, out
    assert lines[3] == ["left before init"], out
    got = errors(lines, "init")
    assert set(got) == {0, 1, 2}, out    # nobody aborted: every rank said its error
    for r, m in got.items():
        assert m.startswith(f"TimeoutError: dpmini.distributed.init (rank {r} of 4): not every "
                            "rank reached init() within the timeout of 3 s"), m
    assert "exiting (code 1) through MPI_Finalize, not MPI_Abort" in out
    assert "MPI_ABORT was invoked" not in out
    assert took < 60, took


@needs_mpi
def test_ranks_finishing_at_different_times_all_finalize_normally():
    rc, lines, out, _ = mpirun("staggered_finish", worker=JOBS_WORKER)
    assert rc == 0, out
    assert all(lines[r] == ["finished"] for r in range(4)), out
    assert "MPI_ABORT" not in out and "aborting" not in out, out


@needs_mpi
def test_exit_agreement_keeps_a_ranks_own_exit_code():
    rc, lines, out, _ = mpirun("exit_code_kept", worker=JOBS_WORKER)
    assert rc == 3, out
    assert all(lines[r] == ["finished"] for r in range(4)), out
    assert "MPI_ABORT" not in out, out


@needs_mpi
def test_rank_raising_after_another_finished_aborts_the_job():
    rc, lines, out, took = mpirun("finish_then_raise", limit=60, worker=JOBS_WORKER)
    assert rc != 0, out
    assert "rank 1 of 4 ended with RuntimeError; aborting the job" in out
    assert 1 not in lines, out
    assert took < 60, took


@needs_mpi
def test_rank_finishing_first_waits_at_exit_for_ranks_working_past_the_timeout():
    rc, lines, out, took = mpirun("finish_while_others_work", limit=60, worker=JOBS_WORKER)
    assert rc == 0, out
    assert all(lines[r] == ["finished"] for r in range(4)), out
    assert "MPI_ABORT" not in out, out


@needs_mpi
def test_rank_late_to_init_within_the_timeout_still_works():
    rc, lines, out, _ = mpirun("late_init", DIST_TEST_TIMEOUT="20")
    assert rc == 0, out
    assert all(lines[r] == ["OK late_init"] for r in range(4)), out


@needs_mpi
def test_torch_module_broadcast_and_collectives_return_torch():
    pytest.importorskip("torch")
    rc, lines, out, _ = mpirun("torch", limit=240)
    assert rc == 0 and all(lines[r][-1].startswith("OK torch") for r in range(4)), out


# ------------------------------------------------------------------ GPU arrays
# On the emulated build (make build-emulated: "cuda:N" dpmini arrays, NCCL
# emulated over MPI by csrc/dist/dist_nccl_emu.c); make test-distributed builds it.
# $DPMINI_DIST_EMU_ROOT names another emulated build (e.g. one built with ASan).
EMU_ROOT = Path(os.environ.get("DPMINI_DIST_EMU_ROOT") or ROOT / "build" / "emulated")


def _have_emulated_dist():
    pkg = EMU_ROOT / "dpmini"
    if not _have_dist() or not list(pkg.glob("_dist*.so")):
        return False
    # a stale copy of the wrappers would test old code: make build-emulated refreshes it
    return all((pkg / f).read_bytes() == (ROOT / "dpmini" / f).read_bytes()
               for f in ("distributed.py", "_ddp.py"))


needs_emulated = pytest.mark.skipif(not _have_emulated_dist(), reason="needs mpirun and an "
                                    "up-to-date emulated build with dpmini._dist "
                                    "(make build-emulated; make test-distributed builds it)")


def mpirun_gpu(case, np=4, **env):
    return mpirun(case, np=np, PYTHONPATH=str(EMU_ROOT), DPMINI_EMULATE_GPUS="4", **env)


@needs_emulated
@pytest.mark.parametrize("np_", [4, 1])
def test_gpu_collectives_through_emulated_nccl_equal_the_host_path(np_):
    rc, lines, out, _ = mpirun_gpu("gpu", np=np_)
    assert rc == 0, out
    for r in range(np_):
        assert [x for x in lines[r] if x.startswith("OK")] == [
            "OK gpu reduce", "OK gpu broadcast", "OK gpu scatter gather", "OK gpu"], out
    int16 = errors(lines, "int16")
    assert sorted(int16) == list(range(np_)), out
    assert all(m.startswith("TypeError: x: dtype int16 of a GPU array has no NCCL reduction")
               for m in int16.values()), int16
    other = errors(lines, "other_device")
    assert sorted(other) == list(range(np_)), out
    for r, m in other.items():
        assert m.startswith(f"ValueError: x: a GPU array on cuda:{(r + 1) % 4}, but this "
                            f"rank's NCCL communicator is on cuda:{r}"), m


@needs_emulated
def test_gpu_check_case_of_tools_gpu_check_runs_on_emulated_nccl():
    # tools/gpu_check.sh runs this case with -np 1 on a lent GPU (the real NCCL)
    rc, lines, out, _ = mpirun_gpu("gpu_real", np=1)
    assert rc == 0 and lines[0][0] == "OK gpu_real dpmini", out
    assert lines[0][1].startswith("INFO emulated NCCL over MPI"), out


@pytest.fixture(scope="module")
def gpu_errors_run():
    if not _have_emulated_dist():
        pytest.skip("needs mpirun and an up-to-date emulated build")
    return mpirun_gpu("gpu_errors", limit=90)


@pytest.mark.parametrize("case,words", [
    ("same_gpu", ["ValueError: dpmini.distributed: ranks 0 and 2 both use GPU cuda:0 of host",
                  "NCCL needs one GPU per rank"]),
    ("host_vs_gpu", ["ValueError: dpmini.distributed.all_reduce: the ranks disagree on the "
                     "device kind", "rank 0,1,3: all_reduce call 2 op=sum shape (4,) dtype "
                     "float64 (GPU array)", "rank 2: all_reduce call 2 op=sum shape (4,) dtype "
                     "float64"]),
    ("gather_host_vs_gpu", ["ValueError: dpmini.distributed.gather: the ranks disagree on the "
                            "device kind", "rank 1: gather call 3"]),
    ("fail_after", ["RuntimeError: dpmini.distributed.all_reduce (call 6): GPU collectives are "
                    "off: rank 0's NCCL communicator was aborted"]),
    ("error_after", ["RuntimeError: dpmini.distributed.all_reduce (call 2): GPU collectives "
                     "are off"]),
])
def test_gpu_disagreement_is_the_same_error_on_every_rank(gpu_errors_run, case, words):
    rc, lines, out, _ = gpu_errors_run
    got = errors(lines, case)
    assert sorted(got) == [0, 1, 2, 3], out
    assert len(set(got.values())) == 1, got
    for w in words:
        assert w in got[0], (w, got[0])


@pytest.mark.parametrize("case,pattern", [
    ("fail", r"RuntimeError: dpmini.distributed.all_reduce \(call 5 on rank {r}\): NCCL error 2: "
             r"unhandled system error"),
    ("error", r"RuntimeError: dpmini.distributed.all_reduce \(call 1 on rank {r}\): NCCL error 6: "
              r"remote process exited or there was a network error; its NCCL communicator was "
              r"aborted"),
    ("hang", r"TimeoutError: dpmini.distributed.all_reduce \(call 1 on rank {r}\): the NCCL "
             r"collective did not complete within the timeout of 2 s"),
])
def test_nccl_error_or_stall_is_a_clear_error_on_every_rank(gpu_errors_run, case, pattern):
    rc, lines, out, _ = gpu_errors_run
    assert rc == 0, out            # MPI itself stays usable: the job ends normally
    got = errors(lines, case)
    assert sorted(got) == [0, 1, 2, 3], out
    for r, m in got.items():
        assert re.match(pattern.format(r=r), m), m
    for r in range(4):
        assert lines[r][-1] == "OK gpu_errors", out
        took = [float(x.split()[1]) for x in lines[r] if x.startswith("took ")]
        assert took and 2.0 <= took[0] < 10, took


def test_interrupt_during_an_nccl_wait_aborts_it(gpu_errors_run):
    rc, lines, out, _ = gpu_errors_run
    for r in range(4):
        got = [x for x in lines[r] if x.startswith("interrupted after ")]
        assert got, out
        secs, why = got[0][len("interrupted after "):].split(" s: ")
        assert float(secs) < 30, got     # the timeout is 60 s: the timer's 0.5 s ended it
        assert why == "an interrupt in all_reduce call 1", got


@needs_mpi
def test_real_nccl_without_a_gpu_is_the_same_runtime_error_on_every_rank():
    # The in-place build is not emulated: the real libcudart / libnccl are looked
    # for (dlopen) at the first GPU collective, and this machine has no GPU.
    rc, lines, out, _ = mpirun("gpu_no_device", np=2)
    assert rc == 0, out
    if lines[0] == ["SKIP a GPU is present"]:
        pytest.skip("a GPU is present (tools/gpu_check.sh runs the real NCCL case)")
    got = errors(lines, "no_device")
    assert sorted(got) == [0, 1] and len(set(got.values())) == 1, out
    assert got[0].startswith("RuntimeError: dpmini.distributed: rank 0 could not start NCCL "
                             "for GPU arrays (every rank raises this): "), got
    assert all(lines[r][-1] == "OK gpu_no_device" for r in range(2)), out


@needs_mpi
def test_env_switch_emulates_nccl_on_a_build_without_gpus():
    rc, lines, out, _ = mpirun("env_emulate", np=2, DPMINI_DIST_NCCL="emulate")
    assert rc == 0, out
    for r in range(2):
        assert lines[r] == ["INFO emulated NCCL over MPI on host memory "
                            "(csrc/dist/dist_nccl_emu.c)", "OK env_emulate"], out


@needs_mpi
def test_test_hook_chooses_the_emulated_nccl_and_refuses_a_switch_once_in_use():
    rc, lines, out, _ = mpirun("hook_emulate", np=2)
    assert rc == 0, out
    for r in range(2):
        assert lines[r] == ["INFO emulated NCCL over MPI on host memory "
                            "(csrc/dist/dist_nccl_emu.c)",
                            "ERR switch RuntimeError: dpmini.distributed: the emulated NCCL is "
                            "already in use in this process", "OK hook_emulate"], out


@needs_mpi
def test_torch_ddp_hooks_give_the_single_process_gradient_even_when_uneven():
    pytest.importorskip("torch")
    rc, lines, out, _ = mpirun("torch_ddp", limit=300, worker=JOBS_WORKER)
    assert rc == 0, out
    assert all(lines[r] == ["OK torch_ddp"] for r in range(4)), out


@needs_mpi
def test_torch_ddp_no_sync_accumulates_and_the_synchronized_step_weights_summed_rows():
    pytest.importorskip("torch")
    rc, lines, out, _ = mpirun("torch_ddp_no_sync", limit=300, worker=JOBS_WORKER)
    assert rc == 0, out
    assert all(lines[r] == ["OK torch_ddp_no_sync"] for r in range(4)), out


@needs_mpi
def test_torch_ddp_hooks_equal_torch_ddp_on_gloo_where_the_batch_divides():
    pytest.importorskip("torch")
    port = str(29500 + os.getpid() % 400)
    rc, lines, out, _ = mpirun("torch_ddp_vs_gloo", limit=300, worker=JOBS_WORKER,
                               DIST_TEST_PORT=port)
    assert rc == 0, out
    assert all(lines[r] == ["OK torch_ddp_vs_gloo"] for r in range(4)), out


@needs_mpi
@pytest.mark.skipif(bool(os.environ.get("DPMINI_SANITIZER")),
                    reason="the error leaves a gradient hook through torch's C++ (a C++ throw), "
                           "which aborts under the preloaded ASan runtime")
def test_torch_ddp_rank_skipping_a_backward_is_an_error_on_every_rank_naming_the_steps():
    pytest.importorskip("torch")
    probe = subprocess.run([sys.executable, "-c", "import inspect, dpmini.distributed as d; "
                            "print('tag' in inspect.signature(d.all_reduce).parameters)"],
                           capture_output=True, text=True, env=_env(), timeout=120)
    if probe.stdout.strip() != "True":
        pytest.skip("needs the collectives' tag= keyword")
    rc, lines, out, _ = mpirun("torch_ddp_skipped_backward", limit=200, worker=JOBS_WORKER)
    assert rc == 0, out
    got = errors(lines, "skipped")
    assert sorted(got) == [0, 1, 2, 3] and len(set(got.values())) == 1, out
    assert got[0].startswith("ValueError:") and "ddp step 1 bucket 0" in got[0] \
        and "ddp step 2 bucket 0" in got[0], got[0]
    assert all(lines[r][-1] == "OK usable" for r in range(4)), out
