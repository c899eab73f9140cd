"""Run dpmini.distributed's abort paths many times and count launcher hangs.

    python tools/abort_runs.py [--runs 100] [--np 4] [--limit 60] [--cases raise,skip_init,...]

Each run is `timeout -k 5 LIMIT mpirun -np NP python tests/distributed/worker.py CASE`
in its own process group. A case ends the job through a failure on one rank:

  raise           rank 1 raises while the others wait in a collective (timeout 120 s)
  skip_init       the last rank raises before init(); the others' init times out (3 s)
  caught_timeout  the last rank returns early; the others catch the TimeoutError (2 s)
  skip            the last rank runs one collective fewer and exits (timeout 3 s)
  finish_then_raise  rank 0 finishes, then rank 1 raises (jobs_worker.py)
  exit_before_init   the last rank returns without init(); the others' init
                     times out (3 s), caught, and they exit (jobs_worker.py)

Counted per case: hangs (the outer timeout had to end mpirun: exit 124/137, or
the run took past LIMIT), segfaults (exit 139 or "Segmentation fault" in the
output), wrong exit codes (0, which a failed job must never give), and the
durations (median, max). The job must end within the collective timeout plus a
few seconds. Prints one line per run and a table at the end; exit status 1 when
any run hung or segfaulted.
"""
import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "worker.py"
JOBS_WORKER = ROOT / "tests" / "distributed" / "jobs_worker.py"
# The collective timeout each case waits before the job must end (seconds).
CASE_TIMEOUT = {"raise": 0.0, "skip_init": 3.0, "caught_timeout": 2.0, "skip": 3.0,
                "finish_then_raise": 0.0, "exit_before_init": 3.0}
CASE_ENV = {"skip_init": {"DIST_TEST_TIMEOUT": "3"}}


def run_once(case, np_, limit, mpirun_args):
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    env.update(CASE_ENV.get(case, {}))
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    worker = JOBS_WORKER if case in ("finish_then_raise", "exit_before_init") else WORKER
    cmd = ["timeout", "-k", "5", str(limit), mpirun, *mpirun_args, "-np", str(np_),
           sys.executable, str(worker), case]
    with tempfile.TemporaryDirectory() as tmp:
        env["DIST_TEST_OUT"] = tmp
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=ROOT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=limit + 20)
        except subprocess.TimeoutExpired:   # even timeout -k could not end it
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        took = time.monotonic() - start
    # Whatever the launcher left behind in its group is ended here, so that one
    # hung run does not slow down the next ones.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    rc = proc.returncode
    hung = rc in (124, 137, -9) or took >= limit
    segv = rc in (139, -11) or "Segmentation fault" in out or "signal 11" in out
    return {"case": case, "rc": rc, "took": took, "hung": hung, "segv": segv,
            "zero": rc == 0, "out": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100, help="runs in all, cycling over the cases")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--limit", type=float, default=60.0, help="outer timeout per run (s)")
    ap.add_argument("--cases", default="raise,skip_init,caught_timeout,skip")
    ap.add_argument("--show", action="store_true", help="print the output of failed runs")
    ap.add_argument("mpirun_args", nargs="*", help="extra mpirun arguments (after --)")
    a = ap.parse_args()
    cases = a.cases.split(",")
    results = []
    for i in range(a.runs):
        case = cases[i % len(cases)]
        r = run_once(case, a.np, a.limit, a.mpirun_args)
        results.append(r)
        flag = "HANG" if r["hung"] else "SEGV" if r["segv"] else "EXIT0" if r["zero"] else "ok"
        print(f"{i:4d} {case:15s} rc={r['rc']:4d} {r['took']:6.2f}s {flag}", flush=True)
        if a.show and flag != "ok":
            print(r["out"][-3000:], flush=True)
    print()
    print(f"{'case':15s} {'runs':>5s} {'hangs':>6s} {'segv':>5s} {'exit0':>6s} "
          f"{'median s':>9s} {'max s':>7s} {'timeout s':>10s}")
    bad = 0
    for case in cases:
        rs = [r for r in results if r["case"] == case]
        if not rs:
            continue
        took = [r["took"] for r in rs]
        h, s, z = (sum(r[k] for r in rs) for k in ("hung", "segv", "zero"))
        bad += h + s + z
        print(f"{case:15s} {len(rs):5d} {h:6d} {s:5d} {z:6d} {statistics.median(took):9.2f} "
              f"{max(took):7.2f} {CASE_TIMEOUT.get(case, 0):10.1f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
