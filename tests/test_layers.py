"""csrc/'s layers (docs/architecture.md) depend one way: tools/check_layers.py
reads the #include graph and fails on an include of a higher layer's header,
on a folder its table does not name, and on a listed exception that has gone."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import check_layers  # noqa: E402


def test_no_include_points_up_a_layer():
    bad, stale, _ = check_layers.check()
    assert bad == [], f"upward includes: {bad}"
    assert stale == [], f"exceptions listed in KNOWN that are gone: {stale}"


def test_every_c_file_is_in_a_layer_folder():
    loose = [p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".c", ".h")]
    assert loose == [], f"C files directly in csrc/, outside any layer folder: {loose}"
    folders = {p.name for p in (ROOT / "csrc").iterdir() if p.is_dir()}
    assert folders == {name for name, _ in check_layers.LAYERS} | {"dist"}


def test_core_has_no_python():
    for p in sorted((ROOT / "csrc" / "core").iterdir()):
        assert "#include <Python.h>" not in p.read_text(), f"{p.name} in csrc/core/ includes Python.h"


def test_the_checker_finds_an_upward_include(tmp_path, monkeypatch):
    # a copy of csrc/ where a core file includes a tree header must fail
    fake = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", fake)
    shutil.copytree(ROOT / "cuda", tmp_path / "cuda")
    plan = fake / "core" / "plan.c"
    plan.write_text('#include "tree.h"\n' + plan.read_text())
    monkeypatch.setattr(check_layers, "CSRC", fake)
    monkeypatch.setattr(check_layers, "ROOT", tmp_path)
    bad, _, _ = check_layers.check()
    assert ("core/plan.c", "tree/tree.h") in bad


def test_the_script_exits_zero_and_prints_the_graph():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "check_layers.py"), "--graph"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "include edges between" in res.stdout
