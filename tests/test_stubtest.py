"""mypy.stubtest checks the hand-written stubs against the built extensions: dpmini/_dpmini.pyi
(and dpmini/_dist.pyi when that file exists and dpmini._dist is built). Names, kinds,
defaults, positional-only markers, @final/disjoint bases and every runtime name missing from
the stub are its findings; tests/stubtest_allowlist.txt lists the deliberate differences, each
with its reason. tests/test_stubs.py adds what stubtest does not see (docstrings, setters,
that every C method's text signature parses and starts with $self: stubtest silently skips a
signature inspect cannot parse)."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dpmini

pytest.importorskip("mypy.stubtest", reason="mypy is in the test extras (pip install -e '.[test]')")

ALLOWLIST = Path(__file__).resolve().parent / "stubtest_allowlist.txt"
PACKAGE_ROOT = Path(dpmini.__file__).resolve().parent.parent  # the dpmini under test


def _checked_modules():
    mods = ["dpmini._dpmini"]
    if (PACKAGE_ROOT / "dpmini" / "_dist.pyi").exists():
        try:
            importlib.import_module("dpmini._dist")
            mods.append("dpmini._dist")
        except ImportError:
            pass
    return mods


def test_stubtest_finds_no_difference_between_the_stubs_and_the_extensions(tmp_path):
    env = dict(os.environ, MYPYPATH=str(PACKAGE_ROOT), PYTHONPATH=str(PACKAGE_ROOT),
               MYPY_CACHE_DIR=str(tmp_path / "mypy_cache"))
    res = subprocess.run([sys.executable, "-m", "mypy.stubtest", *_checked_modules(),
                          "--allowlist", str(ALLOWLIST), "--concise"],
                         capture_output=True, text=True, timeout=300, cwd=PACKAGE_ROOT, env=env)
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
