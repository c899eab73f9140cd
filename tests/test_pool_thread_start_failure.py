"""Worker threads that cannot be started, under an address-space cap
(RLIMIT_AS, as `ulimit -v`): a call on 256 virtual devices needs 256 worker
threads of 8 MiB stack each, more than the cap allows. It must end in
RuntimeError/MemoryError (never glibc's "cannot allocate memory for
thread-local data" abort, a Python fatal error or a segfault), and the next
call on two devices must work (the failed call's idle threads are let go).
Runs in a subprocess with a timeout; skipped under sanitizers, whose shadow
memory does not fit under the cap."""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(bool(os.environ.get("DPMINI_SANITIZER")),
                                reason="sanitizer shadow memory does not fit under RLIMIT_AS")

TIMEOUT = 180

SCRIPT = textwrap.dedent("""
    import resource, sys
    lim = int(float(sys.argv[1]) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    import numpy as np
    import dpmini

    devs = ["cpu:%d" % i for i in range(256)]

    def f(x):
        return x + 1

    def outcome(call, check):
        try:
            return "ok" if check(call()) else "WRONG"
        except (MemoryError, RuntimeError) as e:
            return type(e).__name__

    for _ in range(3):
        print("pa", outcome(
            lambda: dpmini.parallel_apply([f] * 256, [(np.full(3, i),) for i in range(256)],
                                          devices=devs),
            lambda out: [int(o[0]) for o in out] == [i + 1 for i in range(256)]))
        print("dp", outcome(lambda: dpmini.DataParallel(f, device_ids=devs)(np.arange(512.0)),
                            lambda out: out.tolist() == [i + 1.0 for i in range(512)]))
    out = dpmini.parallel_apply([f, f], [(np.ones(2),), (np.ones(2),)],
                                devices=["cpu:0", "cpu:1"])
    print("next", [o.tolist() for o in out] == [[2.0, 2.0], [2.0, 2.0]])
    out = dpmini.DataParallel(f, device_ids=["cpu:0", "cpu:1"])(np.arange(4.0))
    print("next", out.tolist() == [1.0, 2.0, 3.0, 4.0])
""")


@pytest.mark.parametrize("gib", ["0.8", "1.2"])
def test_calls_on_256_devices_under_an_address_space_cap_fail_cleanly(gib):
    try:
        res = subprocess.run([sys.executable, "-c", SCRIPT, gib], capture_output=True,
                             text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hang under RLIMIT_AS={gib} GiB")
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert "thread-local data" not in text and "Fatal Python error" not in text, text
    lines = [ln.split() for ln in res.stdout.splitlines()]
    firsts = [ln for ln in lines if ln[0] in ("pa", "dp")]
    assert len(firsts) == 6, text
    assert all(ln[1] in ("ok", "RuntimeError", "MemoryError") for ln in firsts), text
    # 256 threads x 8 MiB of stack is 2 GiB of address space: more than either cap,
    # so at least the first call on 256 devices takes the error path.
    assert firsts[0][1] in ("RuntimeError", "MemoryError"), text
    assert [ln for ln in lines if ln[0] == "next"] == [["next", "True"], ["next", "True"]], text
