"""Every code block in README.md, docs/*.md and benchmarks/README.md works as
pasted.

- ```python blocks: each runs on its own in a fresh interpreter (a temporary
  folder as the working directory, so files a block writes go there and the
  source folder dpmini/ is not on sys.path through the cwd). A block preceded
  by `<!-- requires: NAME -->` (gpu, torch, matplotlib, mpi, ...) is skipped,
  with the reason, when NAME is missing.
- ```console blocks: every `$ python -m dpmini ...` line runs (exit status 0),
  and the output printed under it in the README is what the command prints.
- ```sh blocks: they name make targets; each target must exist in the
  Makefile (running them here would be `make test` inside `make test`).
"""
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# The documents whose blocks run: the README and the pages it sends readers to.
DOCUMENTS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
             "benchmarks/README.md"]

BLOCK = re.compile(r"(?:<!--\s*requires:\s*(?P<req>[^>]*?)\s*-->\s*\n)?"
                   r"^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.M | re.S)


def blocks(lang, documents=DOCUMENTS):
    """pytest params (body, requirements) of every `lang` block, named FILE:lineN."""
    out = []
    for name in documents:
        text = (ROOT / name).read_text()
        for m in BLOCK.finditer(text):
            if m.group("lang") == lang:
                line = text.count("\n", 0, m.start("body")) + 1
                reqs = [r.strip() for r in (m.group("req") or "").split(",") if r.strip()]
                out.append(pytest.param(m.group("body"), reqs, id=f"{name}:line{line}"))
    return out


def missing(req):
    """Why requirement `req` is not met here, or None when it is."""
    if req == "gpu":
        import dpmini
        return None if dpmini.device_count() > 0 else "no CUDA device"
    if req == "mpi":
        return None if importlib.util.find_spec("mpi4py") else "mpi4py is not installed"
    if "libasan" in os.environ.get("LD_PRELOAD", "") and req in ("matplotlib", "jax"):
        return f"{req} cannot be imported under LD_PRELOAD ASan"
    return None if importlib.util.find_spec(req) else f"{req} is not installed"


def test_the_readme_has_blocks_of_each_kind():
    readme = ["README.md"]
    assert len(blocks("python", readme)) >= 4 and blocks("console", readme) and blocks("sh", readme)


def test_the_moved_pages_blocks_are_collected():
    ids = {p.id.split(":")[0] for p in blocks("python")}
    assert {"docs/libraries.md", "docs/distributed.md"} <= ids


@pytest.mark.parametrize("body,reqs", blocks("python"))
def test_python_block_runs_as_pasted(body, reqs, tmp_path):
    for req in reqs:
        why = missing(req)
        if why:
            pytest.skip(f"block requires {req}: {why}")
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"block failed:\n{body}\n--- stderr ---\n{proc.stderr}"


def console_commands(body):
    """[(argv, expected output lines)] for each `$ python -m dpmini` line."""
    cmds = []
    for line in body.splitlines():
        if line.startswith("$ "):
            cmd = line[2:].split("#", 1)[0].strip()
            cmds.append((shlex.split(cmd), []))
        elif cmds:
            cmds[-1][1].append(line)
    return cmds


@pytest.mark.parametrize("body,reqs", blocks("console"))
def test_console_block_commands_run_and_print_what_is_shown(body, reqs, tmp_path):
    cmds = console_commands(body)
    assert cmds
    for argv, shown in cmds:
        assert argv[:3] == ["python", "-m", "dpmini"], argv
        if "--plot" in argv and missing("matplotlib"):
            continue
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, MPLBACKEND="Agg"))
        assert proc.returncode == 0, f"{argv}: {proc.stderr}"
        if shown:
            assert proc.stdout.splitlines()[:len(shown)] == shown, (argv, proc.stdout)


def make_targets():
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


@pytest.mark.parametrize("body,reqs", blocks("sh"))
def test_sh_block_names_existing_make_targets(body, reqs):
    targets = make_targets()
    named = []
    for line in body.splitlines():
        cmd = line.split("#", 1)[0].split()
        if cmd and cmd[0] == "make":
            named += [w for w in cmd[1:] if "=" not in w and not w.startswith("-")]
        else:
            assert not cmd, f"a sh block line that is not a make command: {line!r}"
    assert named
    for t in named:
        assert t in targets, f"the docs name `make {t}`, which the Makefile lacks"


@pytest.mark.parametrize("name", DOCUMENTS)
def test_files_the_docs_name_exist(name):
    text = (ROOT / name).read_text()
    for path in sorted(set(re.findall(r"`((?:csrc|dpmini|tests|docs|tools|benchmarks|notebooks|"
                                      r"cuda)/[\w./-]+)`", text))):
        assert (ROOT / path).exists(), f"{name} names {path}, which does not exist"


LINK = re.compile(r"\]\(((?!https?:)[^)#\s]+)(?:#([\w-]+))?\)")


def anchors(text):
    """GitHub's anchors of a Markdown text's headings."""
    out = set()
    for title in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("name", DOCUMENTS)
def test_links_between_the_docs_reach_a_file_and_heading(name):
    text = (ROOT / name).read_text()
    for target, anchor in LINK.findall(text):
        path = (ROOT / name).parent / target
        assert path.exists(), f"{name} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path.read_text()), f"{name} links to {target}#{anchor}: no such heading"
