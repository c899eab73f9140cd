"""csrc/'s layers (docs/architecture.md) depend one way: tools/check_layers.py
reads the #include graph and fails on an include of a higher layer's header,
on a folder its table does not name, and on a listed exception that has gone;
it reads the object files' symbols (nm) and fails on a call up a layer, even
one whose declaration sits in a header of the caller's own layer, on a call
into another layer that the caller's includes do not show, and on a header
that declares another layer's functions."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import check_layers  # noqa: E402


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """csrc/ compiled once for the whole module (check_layers.compile_objects; the script
    test reads the same objects with --objects, so nothing is compiled twice)."""
    outdir = tmp_path_factory.mktemp("check_layers_objects")
    return outdir, check_layers.compile_objects(outdir)


@pytest.fixture(scope="module")
def real_graph(objects):
    """link_graph() of this checkout."""
    return check_layers.link_graph(objects[1])


def test_no_include_points_up_a_layer():
    bad, stale, _ = check_layers.check()
    assert bad == [], f"upward includes: {bad}"
    assert stale == [], f"exceptions listed in KNOWN that are gone: {stale}"


def test_every_c_file_is_in_a_layer_folder():
    loose = [p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".c", ".h")]
    assert loose == [], f"C files directly in csrc/, outside any layer folder: {loose}"
    folders = {p.name for p in (ROOT / "csrc").iterdir() if p.is_dir()}
    assert folders == {name for name, _ in check_layers.LAYERS} | {"dist", "testing"}


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


def test_no_call_points_up_a_layer(real_graph):
    bad, stale, found = check_layers.check_calls(graph=real_graph)
    assert bad == [], f"upward calls: {bad}"
    assert stale == [], f"exceptions listed in KNOWN_CALLS that are gone: {stale}"
    # the graph is real: a few edges that must be there
    pairs = {(check_layers.rel(a), check_layers.rel(b)) for a, b in found}
    assert ("engine/copy_engine.c", "core/copy.c") in pairs
    assert ("tree/scatter.c", "core/plan.c") in pairs


def _fake_tree(tmp_path, files):
    """A csrc/ of the given {relative path: text} files; returns its path."""
    fake = tmp_path / "csrc"
    for name, text in files.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    return fake


def _compile(fake, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    objects = {}
    folders = [f"-I{d}" for d in sorted(fake.iterdir()) if d.is_dir()]
    for src in sorted(fake.rglob("*.c")):
        obj = tmp_path / (src.stem + ".o")
        subprocess.run([cc, "-c", "-O0", *folders, str(src), "-o", str(obj)],
                       check=True, timeout=60)
        objects[src.resolve()] = obj
    return objects


def test_the_checker_finds_an_upward_call_through_a_header(tmp_path, monkeypatch):
    # core/low.c calls a function that tree/high.c defines, declared in a core
    # header: the include graph sees nothing wrong, the call check does.
    fake = _fake_tree(tmp_path, {
        "core/low.h": "int dp_high_thing(void);\n",
        "core/low.c": '#include "low.h"\nint dp_low(void) { return dp_high_thing() + 1; }\n',
        "tree/high.c": "int dp_high_thing(void) { return 41; }\n",
    })
    monkeypatch.setattr(check_layers, "CSRC", fake)
    monkeypatch.setattr(check_layers, "ROOT", tmp_path)
    monkeypatch.setattr(check_layers, "KNOWN", {})
    monkeypatch.setattr(check_layers, "KNOWN_CALLS", {})
    bad_includes, _, _ = check_layers.check()
    assert bad_includes == []
    bad, stale, found = check_layers.check_calls(_compile(fake, tmp_path))
    assert bad == [("core/low.c", "tree/high.c", ["dp_high_thing"])]
    assert stale == []
    # a downward call of the same kind is not reported
    fake2 = _fake_tree(tmp_path / "down", {
        "tree/high.c": "int dp_low(void);\nint dp_high(void) { return dp_low(); }\n",
        "core/low.c": "int dp_low(void) { return 1; }\n",
    })
    monkeypatch.setattr(check_layers, "CSRC", fake2)
    bad, _, found = check_layers.check_calls(_compile(fake2, tmp_path / "down"))
    assert bad == []
    assert [(check_layers.rel(a), check_layers.rel(b)) for a, b in found] == [
        ("tree/high.c", "core/low.c")]


def test_every_call_between_layers_is_in_the_include_graph(real_graph):
    _, _, includes = check_layers.check()
    calls, _ = real_graph
    assert check_layers.unseen_calls(calls, includes) == []


def test_every_header_declares_only_its_own_layers_symbols(real_graph):
    _, definitions = real_graph
    assert check_layers.foreign_declarations(definitions) == []


def test_a_header_declaring_another_layers_function_is_reported(tmp_path, monkeypatch):
    # py/all.h declaring tree's function: tree's callers would include a py
    # header for it, and the include graph would show py, not tree
    fake = _fake_tree(tmp_path, {
        "py/all.h": "/* walk() in a comment is not a declaration */\n"
                    "int dp_walk(int x);\nextern int dp_walk_table[];\nint dp_py(void);\n",
        "py/py.c": '#include "all.h"\nint dp_py(void) { return 0; }\n',
        "tree/walk.c": "int dp_walk_table[2];\nint dp_walk(int x) { return x; }\n"
                       "int walk(void) { return 0; }\n",
    })
    monkeypatch.setattr(check_layers, "CSRC", fake)
    monkeypatch.setattr(check_layers, "ROOT", tmp_path)
    _, definitions = check_layers.link_graph(_compile(fake, tmp_path))
    assert check_layers.foreign_declarations(definitions) == [
        ("py/all.h", "dp_walk", "tree/walk.c"), ("py/all.h", "dp_walk_table", "tree/walk.c")]


def test_a_call_declared_in_the_c_file_itself_is_reported(tmp_path, monkeypatch):
    # tree/high.c declares core's function itself instead of including low.h:
    # a dependency the include graph would not show
    fake = _fake_tree(tmp_path, {
        "core/low.h": "int dp_low(void);\n",
        "core/low.c": '#include "low.h"\nint dp_low(void) { return 1; }\n',
        "tree/high.c": "int dp_low(void);\nint dp_high(void) { return dp_low(); }\n",
        "tree/ok.c": '#include "low.h"\nint dp_ok(void) { return dp_low(); }\n',
    })
    monkeypatch.setattr(check_layers, "CSRC", fake)
    monkeypatch.setattr(check_layers, "ROOT", tmp_path)
    _, _, includes = check_layers.check()
    _, _, calls = check_layers.check_calls(_compile(fake, tmp_path))
    assert check_layers.unseen_calls(calls, includes) == [
        ("tree/high.c", "core/low.c", ["dp_low"])]


def test_a_listed_call_exception_that_has_gone_is_reported(tmp_path, monkeypatch):
    fake = _fake_tree(tmp_path, {"core/low.c": "int dp_low(void) { return 1; }\n"})
    monkeypatch.setattr(check_layers, "CSRC", fake)
    monkeypatch.setattr(check_layers, "ROOT", tmp_path)
    monkeypatch.setattr(check_layers, "KNOWN_CALLS", {("core/low.c", "tree/high.c"): "gone"})
    bad, stale, _ = check_layers.check_calls(_compile(fake, tmp_path))
    assert bad == []
    assert stale == [("core/low.c", "tree/high.c")]


def test_the_script_exits_zero_and_prints_the_graph(objects, real_graph):
    # --objects: the module's objects, so the script only runs nm (seconds, even under load)
    outdir, compiled = objects
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "check_layers.py"), "--graph",
                          "--objects", str(outdir)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    calls, _ = real_graph
    assert f"{len(calls)} call edges between" in res.stdout  # it read every object
    assert "include edges between" in res.stdout
    assert "call edges between" in res.stdout
