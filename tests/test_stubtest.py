"""mypy.stubtest checks the hand-written stubs against the built extensions: dpmini/_dpmini.pyi,
and dpmini/_dist.pyi where the optional dpmini._dist is built (else that case skips, saying
why: it needs MPI and mpi4py at build time). Names, kinds,
defaults, positional-only markers, @final/disjoint bases and every runtime name missing from
the stub are its findings; tests/stubtest_allowlist.txt lists _dpmini's deliberate differences,
each with its reason (_dist's stub has none). tests/test_stubs.py adds what stubtest does not see (docstrings, setters,
that every C method's text signature parses and starts with $self: stubtest silently skips a
signature inspect cannot parse)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dpmini

pytest.importorskip("mypy.stubtest", reason="mypy is in the test extras (pip install -e '.[test]')")

ALLOWLIST = Path(__file__).resolve().parent / "stubtest_allowlist.txt"
PACKAGE_ROOT = Path(dpmini.__file__).resolve().parent.parent  # the dpmini under test


def _stubtest(module, tmp_path):
    # the allowlist's entries are _dpmini's (stubtest also fails on an unused entry);
    # dpmini/_dist.pyi has no deliberate difference
    allow = ["--allowlist", str(ALLOWLIST)] if module == "dpmini._dpmini" else []
    env = dict(os.environ, MYPYPATH=str(PACKAGE_ROOT), PYTHONPATH=str(PACKAGE_ROOT),
               MYPY_CACHE_DIR=str(tmp_path / "mypy_cache"))
    return subprocess.run([sys.executable, "-m", "mypy.stubtest", module, *allow, "--concise"],
                          capture_output=True, text=True, timeout=300, cwd=PACKAGE_ROOT, env=env)


@pytest.mark.parametrize("module", ["dpmini._dpmini", "dpmini._dist"])
def test_stubtest_finds_no_difference_between_the_stubs_and_the_extensions(module, tmp_path):
    # probed in a child: importing _dist here would start MPI in the test process
    probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                           text=True, timeout=120, cwd=PACKAGE_ROOT,
                           env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    if probe.returncode != 0:   # only the optional _dist can be missing
        why = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"{module} is not built here (it needs MPI and mpi4py at build time): {why}")
    res = _stubtest(module, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_stubtest_reports_a_stub_that_disagrees(tmp_path):
    # a copy of the stub with one default changed must fail: the check can fail
    pkg = tmp_path / "dpmini"
    pkg.mkdir()
    stub = (PACKAGE_ROOT / "dpmini" / "_dpmini.pyi").read_text()
    assert "def device_count() -> int: ..." in stub
    (pkg / "_dpmini.pyi").write_text(stub.replace("def device_count() -> int: ...",
                                                  "def device_count(x: int = 0) -> int: ..."))
    (pkg / "__init__.pyi").write_text("")
    env = dict(os.environ, MYPYPATH=str(tmp_path), PYTHONPATH=str(PACKAGE_ROOT),
               MYPY_CACHE_DIR=str(tmp_path / "mypy_cache"))
    res = subprocess.run([sys.executable, "-m", "mypy.stubtest", "dpmini._dpmini",
                          "--allowlist", str(ALLOWLIST), "--concise"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert res.returncode != 0
    assert "dpmini._dpmini.device_count" in res.stdout, res.stdout + res.stderr
