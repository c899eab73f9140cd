"""Run dpmini.distributed's abort paths many times and count launcher hangs.

    python tools/abort_runs.py [--runs 100] [--np 4] [--limit 60] [--cases raise,skip_init,...]
                               [--loadavg] [--show]

Each run is `timeout -k 5 LIMIT mpirun -np NP python -c PRELUDE tests/distributed/worker.py
CASE` (the prelude, below, stamps times and runs the worker as __main__) in its own process
group. A case ends the job through a failure on one rank:

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

Where the seconds go: each rank runs the worker through a short prelude that
stamps the wall clock into a file when Python is up, when `import
dpmini.distributed` (which starts MPI) is done, and when a line on its stderr
says how the job ends; a thread here notes when the last rank process is gone
(polled every 10 ms, so `kill` can read -0.01).
So a run splits into
  start-up   launch -> every rank has imported dpmini.distributed (of which
             `python`: launch -> every rank's interpreter is up)
  case       -> the first rank decides how the job ends (its "aborting the
                job" or "through MPI_Finalize" line): the case's own waits,
                the collective timeout included
  kill       -> the last rank process is gone (MPI_Abort reaching the
                launcher and its signals, or MPI_Finalize)
  launcher   -> mpirun has exited (its own clean-up after the ranks)
printed per run and as medians and maxima per case. `waits` is how long the
case waits by design once its ranks run (the collective timeout where a rank
waits it out); `over` is the whole run less start-up and that wait: what a
user waits beyond the timeout once the ranks are running.
"""
import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "worker.py"
JOBS_WORKER = ROOT / "tests" / "distributed" / "jobs_worker.py"
CASE_ENV = {"skip_init": {"DIST_TEST_TIMEOUT": "3"}}
# How long each case waits by design once its ranks run, before the job may end:
# the collective timeout where a rank waits it out, the worker's own sleeps; 0 where
# a rank fails at once (its abort ends the others' waits).
CASE_WAIT = {"raise": 0.0, "skip_init": 0.0, "caught_timeout": 2.0, "skip": 3.0,
             "finish_then_raise": 0.5, "exit_before_init": 3.0}
# Each rank runs the worker through this prelude: it stamps (wall clock, shared by
# the ranks of one machine) into $DIST_TEST_OUT/trace<rank>.txt when Python is up,
# when dpmini.distributed (and with it MPI) is imported, and when a line on stderr
# says how the job ends (ENDING), then runs the worker as its own __main__. Stamps
# go to files, not to the output: mpirun forwards the ranks' output late under
# load, and drops what it has not read when a job is aborted.
RANK_PRELUDE = """
import os, runpy, sys, time
ENDING = %r
def stamp(what):
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
    with open(os.path.join(os.environ["DIST_TEST_OUT"], "trace" + rank + ".txt"), "a") as f:
        f.write("%%.6f %%s\\n" %% (time.time(), what))
stamp("python")
import dpmini.distributed
stamp("imported")
class Stamped:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        if any(w in text for w in ENDING):
            stamp("ending")
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
sys.stderr = Stamped(sys.stderr)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# The lines saying how the job ends: dpmini.distributed's abort hook, the exit
# agreement, or a rank whose init timed out going to MPI_Finalize.
ENDING = ("aborting the job", "through MPI_Finalize")


def read_all(pipe, chunks):
    """The whole output of the launcher, read while it runs."""
    chunks.append(pipe.read())


def rank_pids(root):
    """The live (not zombie) python processes below `root`: the ranks."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            try:
                with open(f"/proc/{kid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
            if name.startswith("python") and state != "Z":
                found.append(kid)
            todo.append(kid)
    return found


def watch_ranks(root, seen, stop):
    """seen[0]: the last wall-clock time a rank process was alive (polled every 10 ms)."""
    while not stop.is_set():
        if rank_pids(root):
            seen[0] = time.time()
        time.sleep(0.01)


def phases(tmp, launched, exited, ranks_gone, np_):
    """Seconds of one run from the ranks' stamps (None where one is missing): Python up
    (the last rank's), start-up (the last rank's import of dpmini.distributed), case (to
    the first ending line), kill (to the last rank process gone), launcher (to mpirun's
    exit), all from the launch."""
    stamps = {}
    for path in Path(tmp).glob("trace*.txt"):
        for line in path.read_text().splitlines():
            t, what = line.split(" ", 1)
            stamps.setdefault(what, []).append(float(t) - launched)
    python = max(stamps["python"]) if len(stamps.get("python", [])) == np_ else None
    up = max(stamps["imported"]) if len(stamps.get("imported", [])) == np_ else None
    end = min(stamps["ending"]) if stamps.get("ending") else None
    gone = ranks_gone - launched if ranks_gone else None
    return {"python": python, "up": up,
            "case_s": end - up if end is not None and up is not None else None,
            "kill": gone - end if gone is not None and end is not None else None,
            "launcher": exited - launched - gone if gone is not None else None}


def run_once(case, np_, limit, mpirun_args):
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    env.update(CASE_ENV.get(case, {}))
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    worker = JOBS_WORKER if case in ("finish_then_raise", "exit_before_init") else WORKER
    cmd = ["timeout", "-k", "5", str(limit), mpirun, *mpirun_args, "-np", str(np_),
           sys.executable, "-c", RANK_PRELUDE % (ENDING,), str(worker), case]
    chunks, seen, stop = [], [None], threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        env["DIST_TEST_OUT"] = tmp
        launched, start = time.time(), time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=ROOT, start_new_session=True)
        reader = threading.Thread(target=read_all, args=(proc.stdout, chunks))
        watcher = threading.Thread(target=watch_ranks, args=(proc.pid, seen, stop))
        reader.start()
        watcher.start()
        try:
            proc.wait(timeout=limit + 20)
        except subprocess.TimeoutExpired:   # even timeout -k could not end it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        took, exited = time.monotonic() - start, time.time()
        stop.set()
        watcher.join()
        reader.join(timeout=10)
        times = phases(tmp, launched, exited, seen[0], np_)
    out = "".join(chunks)
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
            "zero": rc == 0, "out": out, **times}


def fmt(x):
    return "    -" if x is None else f"{x:5.2f}"


def med_max(xs):
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):5.2f} / {max(xs):5.2f}" if xs else "    -"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100, help="runs in all, cycling over the cases")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--limit", type=float, default=60.0, help="outer timeout per run (s)")
    ap.add_argument("--cases", default=",".join(CASE_WAIT))
    ap.add_argument("--show", action="store_true", help="print the output of failed runs")
    ap.add_argument("--loadavg", action="store_true",
                    help="print the 1-minute load average with each run (/proc/loadavg)")
    ap.add_argument("mpirun_args", nargs="*", help="extra mpirun arguments (after --)")
    a = ap.parse_args()
    cases = a.cases.split(",")
    results = []
    for i in range(a.runs):
        case = cases[i % len(cases)]
        r = run_once(case, a.np, a.limit, a.mpirun_args)
        results.append(r)
        flag = "HANG" if r["hung"] else "SEGV" if r["segv"] else "EXIT0" if r["zero"] else "ok"
        load = f" load {open('/proc/loadavg').read().split()[0]}" if a.loadavg else ""
        print(f"{i:4d} {case:17s} rc={r['rc']:4d} {r['took']:6.2f}s  python {fmt(r['python'])} "
              f"start-up {fmt(r['up'])} case {fmt(r['case_s'])} kill {fmt(r['kill'])} "
              f"launcher {fmt(r['launcher'])}  {flag}{load}", flush=True)
        if a.show and flag != "ok":
            print(r["out"][-3000:], flush=True)
    print()
    print(f"{'case':17s} {'runs':>4s} {'hangs':>5s} {'segv':>4s} {'exit0':>5s} "
          f"{'whole s: med / max':>19s} {'start-up':>13s} {'case':>13s} {'kill':>13s} "
          f"{'launcher':>13s} {'over':>13s} {'waits':>6s}")
    bad = 0
    for case in cases:
        rs = [r for r in results if r["case"] == case]
        if not rs:
            continue
        h, s, z = (sum(r[k] for r in rs) for k in ("hung", "segv", "zero"))
        bad += h + s + z
        wait = CASE_WAIT.get(case, 0.0)
        over = [r["took"] - r["up"] - wait if r["up"] is not None else None for r in rs]
        print(f"{case:17s} {len(rs):4d} {h:5d} {s:4d} {z:5d} "
              f"{med_max([r['took'] for r in rs]):>19s} {med_max([r['up'] for r in rs]):>13s} "
              f"{med_max([r['case_s'] for r in rs]):>13s} {med_max([r['kill'] for r in rs]):>13s} "
              f"{med_max([r['launcher'] for r in rs]):>13s} {med_max(over):>13s} {wait:6.1f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
