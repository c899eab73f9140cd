"""BLAS thread limits for replicas on virtual CPU devices.

parallel_apply (csrc/dp/parallel_apply.c) calls :func:`limit` before it
starts two or more replicas on virtual CPU devices and, once they have all
finished, sets back the counts limit() returned itself, in C (blas_restore), so
that a Ctrl-C cannot stop that half-way. NumPy's BLAS (OpenBLAS, MKL, BLIS) and OpenMP runtimes start one
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

Not handled here: after a call on several threads, OpenBLAS's idle helper
threads spin for 2**28 clock ticks (~0.1 s) before they sleep, and OpenBLAS
has no usable call that ends that (blas_thread_shutdown_ stops them, but the
openblas_set_num_threads of limit() starts them again); replicas started in
that window share a core with the spinner (docs/cpu.md, "Switching between NumPy's
own products and DataParallel"; OPENBLAS_THREAD_TIMEOUT shortens it).

An OpenBLAS with its own threads (NumPy's wheels) is read and set through its
``openblas_get_num_threads`` / ``openblas_set_num_threads`` directly (found
once, through threadpoolctl), not through threadpoolctl's methods at every
call: those cost about 4 us a call each, several times the rest of a small
DataParallel call. Unlike threadpoolctl's methods, this does not defer to
another Python thread that first changed OpenBLAS through threadpoolctl
(threadpoolctl then ignores a second thread's changes): the limit applies
whichever thread calls DataParallel.
"""
import os

_state = {"controller": None, "missing": False, "cores": 1, "pools": (), "cores_read": None}


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
        ctrl = threadpoolctl.ThreadpoolController()
        _state["pools"] = tuple((lib, _direct(lib)) for lib in ctrl.lib_controllers
                                if lib.user_api == "blas")
        _state["controller"] = ctrl
        _state["cores"] = _cores()   # a system call: taken once, with the pools
    return _state["controller"]


def _direct(lib):
    """(get, set): the C functions of an OpenBLAS pool with its own threads,
    or None (another library, an OpenMP build, a threadpoolctl without them):
    that pool is then read and set through threadpoolctl's methods."""
    if getattr(lib, "internal_api", None) != "openblas" or \
            getattr(lib, "threading_layer", None) == "openmp":
        return None
    try:
        get = lib._get_symbol("openblas_get_num_threads")
        put = lib._get_symbol("openblas_set_num_threads")
    except Exception:   # a threadpoolctl without _get_symbol: its public methods
        return None
    return (get, put) if get is not None and put is not None else None


def threads_per_replica(replicas):
    """The thread count each of `replicas` replicas running at once on virtual
    CPU devices may use: max(1, cores // replicas), cores being the CPUs this
    process may run on (sched_getaffinity). None when nothing is to be limited:
    fewer than 2 replicas, or DPMINI_BLAS_LIMIT=0 in the environment (read at
    every call). The rule of :func:`limit`, also used for torch's intra-op
    threads (dpmini/_torch.py, which sets them per replica thread)."""
    if replicas < 2 or os.environ.get("DPMINI_BLAS_LIMIT", "1").strip() == "0":
        return None
    cores = _state.get("cores_read")
    if cores is None:
        cores = _state["cores_read"] = _cores()   # a system call: taken once
    return max(1, cores // int(replicas))


def limit(replicas):
    """Cut every BLAS pool to max(1, cores // replicas) threads.

    replicas: the number of replicas about to run on virtual CPU devices (>= 2).
    Returns a list of (the pool's set_num_threads, previous thread count),
    which parallel_apply's blas_restore calls in C once the replicas are done,
    or None when nothing was changed (limit off, threadpoolctl missing, pools
    already small enough). An exception half-way (a Ctrl-C) sets back what was
    cut before it propagates.
    """
    if os.environ.get("DPMINI_BLAS_LIMIT", "1").strip() == "0":
        return None
    ctrl = _controller()
    if ctrl is None:
        return None
    per = max(1, _state["cores"] // int(replicas))
    changed = []
    try:
        for lib, direct in _state["pools"]:
            get, put = direct if direct is not None else (None, lib.set_num_threads)
            n = get() if get is not None else lib.num_threads
            if n > per:
                # recorded before it is set: a Ctrl-C between the two still undoes it
                changed.append((put, n))
                put(per)
    except BaseException:
        # a Ctrl-C (or a failing pool) half-way: set back what was cut, then raise
        for put, n in changed:
            try:
                put(n)
            except Exception:
                pass
        raise
    return changed or None
