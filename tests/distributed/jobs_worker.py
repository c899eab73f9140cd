"""Worker for the job-ending and torch DDP cases of tests/test_distributed.py.

    mpirun -np 4 python tests/distributed/jobs_worker.py CASE

Lines "<rank> OK <what>" / "<rank> ERR <case> <Type>: <message>" go to
$DIST_TEST_OUT/rank<r>.txt as in worker.py; values are asserted here.
"""
import os
import sys
import time

import numpy as np

import dpmini.distributed as dist
from mpi4py import MPI

CASE = sys.argv[1]
RANK = MPI.COMM_WORLD.Get_rank()


def say(msg):
    line = f"{RANK} {msg}".replace("\n", "|")
    print(line, flush=True)
    out = os.environ.get("DIST_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{RANK}.txt"), "a") as f:
            f.write(line + "\n")


def case_exit_before_init():
    """The last rank returns normally without calling init(); the others'
    init times out and they exit with code 1 through MPI_Finalize."""
    if RANK == MPI.COMM_WORLD.Get_size() - 1:
        say("left before init")
        return
    try:
        dist.init(timeout=3.0)
    except TimeoutError as exc:   # uncaught, as in a script: the rank ends with code 1
        say(f"ERR init {type(exc).__name__}: {exc}")
        raise


def case_staggered_finish():
    """Every rank finishes, rank r after r * 0.4 s: the early ones wait in the
    exit agreement and every rank finalizes normally (exit code 0)."""
    dist.init(timeout=10.0)
    assert dist.all_reduce(np.ones(2)).tolist() == [dist.size()] * 2
    time.sleep(0.4 * RANK)
    say("finished")


def case_exit_code_kept():
    """The last rank ends with sys.exit(3) after the last collective; the
    agreement passes and the job's exit code is that rank's."""
    dist.init(timeout=10.0)
    dist.barrier()
    say("finished")
    if RANK == dist.size() - 1:
        sys.exit(3)


def case_finish_then_raise():
    """Rank 0 finishes at once; rank 1 raises a moment later (the job is aborted
    while rank 0 waits in the exit agreement, not in MPI_Finalize)."""
    dist.init(timeout=30.0)
    dist.barrier()
    if RANK == 1:
        time.sleep(0.5)
        raise RuntimeError("boom on rank 1 after rank 0 finished")
    if RANK > 1:
        time.sleep(1.0)
    say("finished")


def case_leave_early():
    """The last rank finishes while the others keep working past the timeout
    without a collective: its exit agreement gives up after the timeout."""
    dist.init(timeout=2.0)
    dist.barrier()
    if RANK != dist.size() - 1:
        time.sleep(8.0)
    say("finished")


if __name__ == "__main__":
    globals()["case_" + CASE]()
