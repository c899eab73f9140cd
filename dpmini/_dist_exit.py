"""How a dpmini.distributed job ends: every rank agrees before MPI_Finalize.

The rule: no rank enters ``MPI_Finalize`` while another rank may still call
``MPI_Abort``. Open MPI 4.1's launcher can hang for good (or segfault in
``PMIx_server_finalize``) when one rank aborts the job while another is
already in ``MPI_Finalize`` or has exited (measured by tools/abort_runs.py); a
job where every rank is still running when one aborts ends cleanly.

So at exit each initialized rank takes part in an **exit agreement** on a
communicator of its own (made at init, used for nothing else, so that no
message of an unfinished collective can be paired with it): a non-blocking
all_gather of one flag per rank ("my dpmini communicator is broken"), polled
with the GIL released between tests.

* Every rank arrives and no flag is set: every rank goes on to
  ``MPI_Finalize`` normally (a rank's own exit code is kept).
* Every rank arrives and some rank's communicator is broken (a TimeoutError
  left messages in flight, which ``MPI_Finalize`` could wait on forever):
  every rank knows it, and the job is ended with ``MPI_Abort`` while no rank is
  in ``MPI_Finalize``.

It waits for every rank without a deadline, as ``MPI_Finalize`` itself would:
a rank still working (rank 0 writing a checkpoint) is waited for; a rank
that fails aborts the job itself (the hook of dpmini.distributed) while this
one is still in the agreement; a rank whose collective times out either
aborts (the error uncaught) or arrives with its flag set. Ctrl-C while
waiting aborts: this rank must not reach ``MPI_Finalize`` unagreed.
"""
import sys
import time

import numpy as np


def make_exit_comm(parent, timeout):
    """A duplicate of `parent` for the exit agreement (collective, non-blocking
    MPI_Comm_idup polled against `timeout` seconds). Returns the communicator,
    or None when not every rank completed the duplication in time (the caller
    then ends the job with MPI_Abort at exit, as for an unfinished init)."""
    comm, req = parent.Idup()
    if wait(req, timeout):
        return comm
    return None


def wait(req, timeout=None):
    """Poll an mpi4py request until it completes (True) or `timeout` seconds
    pass (False; None: no deadline). Sleeps grow from 50 us to 2 ms so a prompt
    peer costs little."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 50e-6
    while not req.Test():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    return True


def agree_to_end(exit_comm, broken):
    """The exit agreement (collective on exit_comm). broken: this rank's dpmini
    communicator cannot be finalized safely. Returns None when none is broken
    (finalize normally); otherwise a sentence saying which ranks are broken."""
    mine = np.array([1 if broken else 0], dtype=np.int32)
    every = np.zeros(exit_comm.Get_size(), dtype=np.int32)
    wait(exit_comm.Iallgather(mine, every))
    bad = [int(r) for r in np.flatnonzero(every)]
    if bad:
        return (f"the dpmini communicator of rank(s) {bad} is broken by a TimeoutError "
                "(MPI_Finalize could wait forever on its messages in flight)")
    return None


def end(exit_comm, broken):
    """At exit: run the agreement; MPI_Abort (exit code 1) unless it says that
    every rank may finalize. An interrupt while waiting also aborts: this rank
    must not reach MPI_Finalize without the agreement."""
    try:
        why = agree_to_end(exit_comm, broken)
    except BaseException as exc:   # Ctrl-C, an MPI error: never finalize unagreed
        why = f"the exit agreement was interrupted ({type(exc).__name__})"
    if why is None:
        return
    rank, size = exit_comm.Get_rank(), exit_comm.Get_size()
    sys.stderr.write(f"dpmini.distributed: rank {rank} of {size} at exit: {why}; aborting "
                     "the job (MPI_Abort, exit code 1) rather than waiting in MPI_Finalize\n")
    sys.stderr.flush()
    exit_comm.Abort(1)
