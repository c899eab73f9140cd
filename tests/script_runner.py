"""Run a Python script in a fresh interpreter with a timeout, for the checks
that could crash or hang the process (a segfault or a deadlock then fails
the test instead of killing or stalling the suite)."""
import os
import subprocess
import sys
import textwrap

import pytest

TIMEOUT = 60
# Under ASan or valgrind (make test-asan, test-valgrind) a script runs several
# times slower; a hang still ends the test, only later.
SLOWDOWN = 4 if os.environ.get("DPMINI_SANITIZER") else 1


def run_script(body, *flags, env=None, timeout=TIMEOUT, cwd=None):
    """Run the dedented `body` with `python *flags -c` (in `cwd`, e.g. a
    tmp_path, so that a dpmini folder in the current directory is not
    imported instead of the one on PYTHONPATH); fail unless it exits 0 and
    its output ends with OK. Returns the CompletedProcess."""
    code = textwrap.dedent(body)
    timeout *= SLOWDOWN
    try:
        res = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True,
                             text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock or hang: the script did not finish in {timeout}s")
    assert res.returncode == 0, f"rc {res.returncode}\n" + res.stdout + res.stderr
    assert res.stdout.strip().endswith("OK"), res.stdout + res.stderr
    return res
