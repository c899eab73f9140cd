"""A call whose worker thread cannot start lets the pool's idle threads go
(dp_pool_trim); a call made meanwhile from another Python thread, whose
replica jobs are queued quiet (woken in a chain), must still find a thread:
it always returns. Thread starts are made to fail in one thread only by a
small LD_PRELOAD shim over pthread_create (as a thread or memory limit
would); the script reports a hang when the other thread's calls stop
progressing for 10 s. Subprocess with a timeout; needs a C compiler; not
under sanitizers (their runtime must come first in LD_PRELOAD)."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.skipif(bool(os.environ.get("DPMINI_SANITIZER")),
                       reason="the sanitizer runtime must be the first LD_PRELOAD"),
    pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                       reason="needs a C compiler for the pthread_create shim"),
]

SHIM = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <dlfcn.h>
#include <errno.h>
static __thread int fail_here;
void shim_set(int v) { fail_here = v; }
int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg)
{
    static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
    if (!real) real = (int (*)(pthread_t *, const pthread_attr_t *, void *(*)(void *),
                               void *))dlsym(RTLD_NEXT, "pthread_create");
    if (fail_here) return EAGAIN;
    return real(t, a, fn, arg);
}
"""

SCRIPT = textwrap.dedent("""
    import ctypes, os, threading, time
    import numpy as np, dpmini
    shim_set = ctypes.CDLL(None).shim_set
    X = np.zeros((2, 1))
    calls = [0]
    def other_thread():
        dp = dpmini.DataParallel(lambda x: x + 1, device_ids=["cpu:0", "cpu:1"])
        while True:
            assert (dp(X) == 1).all()
            calls[0] += 1
    threading.Thread(target=other_thread, daemon=True).start()
    start = time.time(); k = 2; last = -1; since = time.time(); failed = 0
    while time.time() - start < 12:
        time.sleep(0.001)
        shim_set(1)   # this thread's call on fresh devices cannot start a worker
        try:
            dpmini.DataParallel(lambda x: x, device_ids=[f"cpu:{k}", f"cpu:{k + 1}"])(X)
        except RuntimeError:
            failed += 1
        finally:
            shim_set(0)
        k = k + 2 if k < 250 else 2
        if calls[0] != last:
            last, since = calls[0], time.time()
        elif time.time() - since > 10:
            print("HANG after", calls[0], "calls,", failed, "failed starts", flush=True)
            os._exit(1)
    assert failed > 0 and calls[0] > 0, (failed, calls[0])
    print("OK", calls[0], failed)
""")


def test_calls_from_another_thread_return_while_failed_starts_trim_the_pool(tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    shim = tmp_path / "shim.so"
    src = tmp_path / "shim.c"
    src.write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(shim), str(src), "-ldl"],
                   check=True, capture_output=True)
    env = dict(os.environ, DPMINI_CPU_DEVICES="256", LD_PRELOAD=str(shim))
    try:
        res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                             timeout=90, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("the script itself hung (past its own 10 s hang check)")
    assert res.returncode == 0 and res.stdout.startswith("OK"), res.stdout + res.stderr
