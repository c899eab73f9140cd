"""dpmini.distributed across two hosts that share no network or hostname.

The hosts are network namespaces on this machine joined by a bridge, each
with its own hostname (tools/multihost.py says which settings are needed): Open MPI sees two nodes and moves data between
them over TCP. `make test-distributed` makes them once for the run
(DPMINI_MULTIHOST_MPIRUN); run alone, this module makes and tears them down
itself. Where namespaces cannot be made (not root, no `ip`, a sandbox without
network namespaces) every test here is skipped, saying why.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_distributed import JOBS_WORKER, _have_dist, errors, mpirun

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "multihost.py"


@pytest.fixture(scope="module")
def hosts():
    if not _have_dist():
        pytest.skip("needs mpirun and dpmini._dist (make test-distributed installs and builds them)")
    given = os.environ.get("DPMINI_MULTIHOST_MPIRUN")
    if given:
        yield given
        return
    d = tempfile.mkdtemp(prefix="dpmini-hosts-")
    got = subprocess.run([sys.executable, str(TOOL), "up", d], capture_output=True, text=True,
                         timeout=120)
    if got.returncode != 0:
        pytest.skip(f"two hosts as network namespaces cannot be made here: {got.stderr.strip()}")
    try:
        yield os.path.join(d, "mpirun")
    finally:
        subprocess.run([sys.executable, str(TOOL), "down", d], timeout=120)


def test_two_hosts_have_their_own_names_and_local_ranks_and_move_data(hosts):
    rc, lines, out, _ = mpirun("hosts", launcher=hosts, limit=300, worker=JOBS_WORKER)
    assert rc == 0, out
    names = {r: lines[r][0].split()[-1] for r in range(4)}
    assert all(lines[r][0].startswith("OK hosts") for r in range(4)), out
    assert names[0] == names[1] != names[2] == names[3], names


def test_values_across_hosts(hosts):
    rc, lines, out, _ = mpirun("values", launcher=hosts, limit=300)
    assert rc == 0, out
    for r in range(4):
        assert lines[r] == ["OK roundtrip", "OK sizes", "OK reduce", "OK broadcast"], out


def test_uneven_ddp_gradient_across_hosts(hosts):
    rc, lines, out, _ = mpirun("ddp", launcher=hosts, limit=300)
    assert rc == 0, out
    assert all(lines[r] == ["OK ddp"] for r in range(4)), out


def test_torch_ddp_hooks_across_hosts(hosts):
    pytest.importorskip("torch")
    rc, lines, out, _ = mpirun("torch_ddp", launcher=hosts, limit=300, worker=JOBS_WORKER)
    assert rc == 0, out
    assert all(lines[r] == ["OK torch_ddp"] for r in range(4)), out


def test_disagreement_across_hosts_is_the_same_error_on_every_rank(hosts):
    rc, lines, out, _ = mpirun("mismatch", launcher=hosts, limit=300)
    assert rc == 0, out
    got = errors(lines, "shape")
    assert sorted(got) == [0, 1, 2, 3] and len(set(got.values())) == 1, out
    assert all(lines[r][-1] == "OK mismatch" for r in range(4)), out


def test_exception_on_one_host_ends_the_job_on_both(hosts):
    rc, lines, out, took = mpirun("raise", launcher=hosts, limit=120)
    assert rc != 0, out
    assert "rank 1 of 4 ended with RuntimeError; aborting the job" in out
    assert "NOT REACHED" not in out
    assert took < 100, took       # the others wait with timeout=120: the abort ended them


def test_rank_skipping_a_call_on_the_other_host_gives_timeout_error(hosts):
    rc, lines, out, took = mpirun("skip", launcher=hosts, limit=120)
    assert rc != 0, out
    assert "rank 3 did not arrive within the timeout of 3 s" in out
    assert took < 100, took


def test_demo_across_hosts_matches_one_process(hosts):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")]
                                          if p))
    got = subprocess.run(["timeout", "-k", "10", "400", hosts, "-np", "4", sys.executable, "-m",
                          "dpmini.demo_distributed"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=450)
    out = got.stdout + got.stderr
    assert got.returncode == 0, out
    assert "parameters equal on every rank: max spread 0" in out, out
    diff = float(out.split("max_abs_diff_vs_single_device")[1].split()[0])
    assert diff <= 1e-12, out
