"""GPU collectives of dpmini.distributed on the emulated build (mpirun, NCCL
emulated over MPI): which physical GPU each rank uses (compared by PCI bus
id, not by ordinal), and 2D copy pitch limits refused on every rank before
anything is sent."""
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_distributed import EMU_ROOT, MPIRUN, _env, _have_emulated_dist

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "gpu_device_worker.py"

needs_emulated = pytest.mark.skipif(not _have_emulated_dist(), reason="needs mpirun and an "
                                    "up-to-date emulated build with dpmini._dist")


def run(case, np_=4, limit=90, **env):
    """(exit code, {rank: [lines]}, output) of the worker on the emulated build."""
    cmd = ["timeout", "-k", "10", str(limit), MPIRUN, "-np", str(np_), sys.executable,
           str(WORKER), case]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                              timeout=limit + 30,
                              env=_env(PYTHONPATH=str(EMU_ROOT), DPMINI_EMULATE_GPUS="4",
                                       DIST_TEST_OUT=tmp, **env))
        lines = {int(re.match(r"rank(\d+)", p.name).group(1)): p.read_text().splitlines()
                 for p in Path(tmp).glob("rank*.txt")}
    return proc.returncode, lines, proc.stdout + proc.stderr


@needs_emulated
def test_ranks_that_each_see_their_gpu_as_cuda0_are_one_gpu_per_rank():
    rc, lines, out = run("visible_devices")
    assert rc == 0, out
    assert all(lines[r] == ["OK visible_devices"] for r in range(4)), out


@needs_emulated
def test_two_ranks_on_one_physical_gpu_are_refused_on_every_rank():
    rc, lines, out = run("shared_visible_device")
    assert rc == 0, out
    for r in range(4):
        assert lines[r][0].startswith("ERR shared ValueError: dpmini.distributed: ranks 0 and 1 "
                                      "both use GPU cuda:0 of host"), out
        assert "PCI bus id 00000000:10:00.0" in lines[r][0], out


@needs_emulated
def test_restage_pitch_over_the_limit_is_the_same_error_on_every_rank():
    rc, lines, out = run("pitch", DPMINI_EMULATE_MAX_PITCH="64")
    assert rc == 0, out
    for r in range(4):
        got = lines[r]
        assert got[-1] == "OK pitch", out
        for what in ("scatter", "gather", "all_gather"):
            line = next(x for x in got if x.startswith((f"ERR {what} ", f"OK {what} ")))
            assert line.startswith(f"ERR {what} ValueError: dpmini.distributed.{what}: GPU "
                                   "arrays along dim 1 move as 2D copies whose rows are 160 "
                                   "bytes (40 rows of 4 bytes), more than the largest 2D copy "
                                   "pitch of the ranks' GPUs, 64 bytes"), (r, line)


@needs_emulated
def test_communicator_setup_that_never_connects_times_out_on_every_rank():
    rc, lines, out = run("init_hang", DIST_TEST_TIMEOUT="3", limit=60)
    assert rc == 0, out
    for r in range(4):
        got = lines[r]
        assert got[0].startswith("ERR init TimeoutError: dpmini.distributed: ncclCommInitRank on "
                                 f"rank {r} (cuda:{r}) did not complete within the timeout of 3 s"), out
        assert 2.5 < float(got[1].split()[1]) < 20, got
        assert got[2].startswith("ERR after RuntimeError: "), got
        assert got[-1] == "OK init_hang", got
