#!/usr/bin/env python3
"""List comments and docstrings that cite material outside the repository.

A reader of dpmini has the repository, not the documents it was written from. Rules are cited
as `docs/spec.md N.M` (whose numbers follow those the code has always used) or said in words;
history belongs in git log. This script finds the citations that point elsewhere:

  spec      "spec 6.5", "spec §4", "spec section 8" without docs/spec.md: --fix rewrites them
            to "docs/spec.md 6.5" (the same numbers, so the meaning does not change)
  case      "R22": a case number of a field-report log outside the repository (docs/spec.md's
            appendix says which rule each one is now)
  issue     "issue 13", "issue [2]", "issues 8": an entry of the project's tracker (numbers of
            four digits or more are public upstream issues, "pytorch issue 46381": not listed)
  finding   "finding 15": an item of a review
  outside   a path outside the repository: "shared/spec", "../shared/", "field-reports.md",
            "torch-dataparallel.md"

    python tools/check_citations.py            # list them (exit 1 when any is found)
    python tools/check_citations.py --fix      # rewrite the spec ones, list the rest
    python tools/check_citations.py --counts   # one line per kind and folder
    python tools/check_citations.py PATH...    # only these files or folders

Only "spec" citations are rewritten: the others need a human, who replaces them with the
docs/spec.md section or with the rule in words.
"""
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["csrc", "cuda", "dpmini", "tests", "docs", "benchmarks", "tools", "fuzz", "notebooks",
           "README.md", "Makefile", "setup.py", "pyproject.toml"]
SUFFIXES = {".c", ".h", ".cu", ".py", ".pyi", ".md", ".ipynb", ".toml", ".sh", ""}
# Files whose job is to name these citations: the spec itself, this script and its test.
EXEMPT = {"docs/spec.md", "tools/check_citations.py", "tests/test_check_citations.py"}

_NUM = r"\d+(?:\.\d+)*"
# "spec 6.5", "spec §4.5-4.8", "spec §1, §2, §9", "spec section 8": the citation and its list.
SPEC = re.compile(r"(?<![\w/.])spec(?: section|\s*§|)\s*(?P<nums>" + _NUM +
                  r"(?:\s*(?:-|–|,|/|and)\s*§?" + _NUM + r")*)", re.I)
KINDS = [
    ("case", re.compile(r"\bR\d{2}\b(?: ?[a-d](?:/[a-d])*\b)?")),
    ("issue", re.compile(r"\b[Ii]ssues? ?(?:\[\d+\]|#?\d{1,3}\b)")),
    ("finding", re.compile(r"\b[Ff]indings? ?\d+")),
    ("outside", re.compile(r"shared/spec|shared/cases|\.\./shared/|field-reports\.md|"
                           r"torch-dataparallel\.md")),
]


def files(paths):
    for p in paths:
        p = (ROOT / p) if not Path(p).is_absolute() else Path(p)
        if p.is_file():
            yield p
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if (f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts
                        and not any(part.startswith(".") for part in f.relative_to(ROOT).parts)):
                    yield f


def rel(path):
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def spec_fix(match):
    """'spec §1, §2' -> 'docs/spec.md 1, 2'."""
    return "docs/spec.md " + match.group("nums").replace("§", "")


def scan(text):
    """[(line number, kind, matched text)] of one file's text."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in SPEC.finditer(line):
            out.append((n, "spec", m.group(0)))
        for kind, rx in KINDS:
            for m in rx.finditer(line):
                out.append((n, kind, m.group(0)))
    return out


def fix(text):
    """text with every spec citation rewritten to docs/spec.md; (new text, count)."""
    return SPEC.subn(spec_fix, text)


def main(argv):
    do_fix = "--fix" in argv
    counts_only = "--counts" in argv
    paths = [a for a in argv if not a.startswith("--")] or SCANNED
    found, fixed = [], 0
    for f in files(paths):
        name = rel(f)
        if name in EXEMPT:
            continue
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if do_fix:
            new, n = fix(text)
            if n:
                f.write_text(new)
                fixed += n
                text = new
        found += [(name, n, kind, what) for n, kind, what in scan(text)]
    if counts_only:
        tally = Counter((kind, name.split("/")[0]) for name, _, kind, _ in found)
        for (kind, top), c in sorted(tally.items()):
            print(f"{kind:8} {top:12} {c}")
    else:
        for name, n, kind, what in found:
            print(f"{name}:{n}: {kind}: {what}")
    if do_fix:
        print(f"rewrote {fixed} spec citations to docs/spec.md", file=sys.stderr)
    print(f"{len(found)} citations of material outside the repository", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
