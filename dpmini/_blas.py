"""BLAS thread limits for replicas on virtual CPU devices.

parallel_apply (csrc/parallel_apply.c) calls :func:`limit` before it starts
two or more replicas on virtual CPU devices and :func:`restore` once they have
all finished. NumPy's BLAS (OpenBLAS, MKL, BLIS) and OpenMP runtimes start one
thread per core by default; two replicas running matrix products at once would
then run 2 x cores threads on cores cores and slow each other down (measured:
an MLP step on 2 virtual devices at 0.85x plain NumPy). During the call every
such pool is cut to ``cores // replicas`` threads (at least 1), so replicas x
BLAS threads <= cores, and set back afterwards.

The pools are found and set with threadpoolctl (imported on first use; without
it nothing is limited). Only BLAS pools (threadpoolctl's user_api "blas":
OpenBLAS, MKL, BLIS), whose thread count is process-wide: an OpenMP runtime's
count (omp_set_num_threads) belongs to the thread that sets it, so setting it
here would not reach the replicas' worker threads. ``DPMINI_BLAS_LIMIT=0`` in the environment (read at
every call) turns the limit off. The setting is process-wide: threads outside
the parallel section that call BLAS meanwhile see the limit too.
"""
import os

_state = {"controller": None, "missing": False, "cores": 1}


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _controller():
    """threadpoolctl's controller, built (with the usable core count) on the first
    call, or None without threadpoolctl. Built once: rebuilding it allocates, and
    a BLAS library loaded by an import after that first call is not limited."""
    if _state["missing"]:
        return None
    if _state["controller"] is None:
        try:
            import threadpoolctl
        except ImportError:
            _state["missing"] = True
            return None
        _state["controller"] = threadpoolctl.ThreadpoolController()
        _state["cores"] = _cores()   # a system call: taken once, with the pools
    return _state["controller"]


def limit(replicas):
    """Cut every BLAS pool to max(1, cores // replicas) threads.

    replicas: the number of replicas about to run on virtual CPU devices (>= 2).
    Returns a list of (pool, previous thread count) to hand to :func:`restore`,
    or None when nothing was changed (limit off, threadpoolctl missing, pools
    already small enough).
    """
    if os.environ.get("DPMINI_BLAS_LIMIT", "1").strip() == "0":
        return None
    ctrl = _controller()
    if ctrl is None:
        return None
    per = max(1, _state["cores"] // int(replicas))
    changed = []
    for lib in ctrl.lib_controllers:
        if lib.user_api != "blas":
            continue
        n = lib.num_threads
        if n > per:
            lib.set_num_threads(per)
            changed.append((lib, n))
    return changed or None


def restore(changed):
    """Set the pools :func:`limit` changed back to their previous thread counts.
    parallel_apply reports an error raised here through sys.unraisablehook
    (the replicas' results stand)."""
    for lib, n in changed:
        lib.set_num_threads(n)
