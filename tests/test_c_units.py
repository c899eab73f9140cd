"""Build and run the pure-C unit tests in tests/c/ (one pytest test each).

Each tests/c/test_*.c is a standalone program with a main() that prints its
failed checks and exits non-zero when any failed. It is linked against the
Python-free core (csrc/core/: plan.c, copy.c, pool.c, env.c, alloc.c, omp_team.c) with warnings as errors, so a
warning in those files or in a test fails here too. Skipped when no C
compiler named `cc` is on PATH. $DPMINI_TEST_CFLAGS adds flags (`make test-asan`
sets the sanitizer flags there, so these programs run sanitized too).
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
C_TESTS = sorted((ROOT / "tests" / "c").glob("test_*.c"))
CORE_SOURCES = ["csrc/core/plan.c", "csrc/core/copy.c", "csrc/core/pool.c", "csrc/core/env.c",
                "csrc/core/alloc.c", "csrc/core/omp_team.c"]
# Tests that need more than the core: test_omp_team runs an OpenMP team (libgomp).
EXTRA_FLAGS = {"test_omp_team": ["-fopenmp"]}
CFLAGS = ["-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread", "-Icsrc/core",
          *os.environ.get("DPMINI_TEST_CFLAGS", "").split()]


def _show(proc):
    return f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


@pytest.mark.parametrize("source", C_TESTS, ids=[p.stem for p in C_TESTS])
def test_c_unit(source, tmp_path):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler: `cc` is not on PATH")
    exe = tmp_path / source.stem
    rel = source.relative_to(ROOT).as_posix()
    build = subprocess.run(
        [cc, *CFLAGS, *EXTRA_FLAGS.get(source.stem, []), rel, *CORE_SOURCES, "-o", str(exe),
         "-ldl"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, f"compiling {rel} failed: " + _show(build)
    run = subprocess.run([str(exe)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{rel} failed: " + _show(run)
