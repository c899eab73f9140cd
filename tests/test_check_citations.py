"""tools/check_citations.py finds comments and docstrings that cite material outside the
repository and, with --fix, rewrites "spec X.Y" to "docs/spec.md X.Y" (same numbers), leaving
the ones that need a human (case numbers, issues, findings, outside paths) listed."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import check_citations  # noqa: E402

SAMPLE = '''/* gather (spec 4.5, R20): scalars; spec §1, §2, §9; spec section 8.
 * Already fine: docs/spec.md 6.5; inspect 3 and dp_device_spec, are not citations.
 * issue 13, finding 15; issue [2]; see ../shared/spec/torch-dataparallel.md
 * A public upstream issue is fine: pytorch issue 46381, issues #31460. */
'''


def test_every_kind_of_outside_citation_is_found():
    kinds = [(n, k, w) for n, k, w in check_citations.scan(SAMPLE)]
    assert kinds == [
        (1, "spec", "spec 4.5"), (1, "spec", "spec §1, §2, §9"), (1, "spec", "spec section 8"),
        (1, "case", "R20"),
        (3, "issue", "issue 13"), (3, "issue", "issue [2]"), (3, "finding", "finding 15"),
        (3, "outside", "../shared/"), (3, "outside", "torch-dataparallel.md"),
    ]


def test_fix_rewrites_spec_citations_only_and_keeps_their_numbers():
    new, n = check_citations.fix(SAMPLE)
    assert n == 3
    assert "(docs/spec.md 4.5, R20)" in new
    assert "docs/spec.md 1, 2, 9; docs/spec.md 8." in new
    assert "docs/spec.md 6.5; inspect 3" in new          # untouched
    assert check_citations.fix(new) == (new, 0)            # idempotent
    assert [k for _, k, _ in check_citations.scan(new)].count("spec") == 0


def test_every_cited_spec_section_exists_in_docs_spec():
    # the rewrite is only safe if each number the code cites is a section of docs/spec.md
    spec = (ROOT / "docs" / "spec.md").read_text()
    sections = set()
    for line in spec.splitlines():
        words = line.split()
        if line.startswith("## ") and len(words) > 1:
            sections.add(words[1].rstrip("."))
        elif words and words[0][:1].isdigit() and "." in words[0]:
            sections.add(words[0])
    missing = set()
    for f in check_citations.files(check_citations.SCANNED):
        if check_citations.rel(f) in check_citations.EXEMPT:
            continue
        for _, kind, what in check_citations.scan(f.read_text(errors="replace")):
            if kind == "spec":
                nums = check_citations.SPEC.match(what).group("nums").replace("§", "")
                for num in (x.strip() for x in nums.replace("-", ",").replace("–", ",")
                            .replace("/", ",").replace("and", ",").split(",")):
                    if num and num not in sections:
                        missing.add((check_citations.rel(f), num))
    assert missing == set()


def test_the_script_lists_exits_one_and_fixes_a_copy(tmp_path):
    f = tmp_path / "x.c"
    f.write_text(SAMPLE)
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "check_citations.py"), str(f)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert f"{f.as_posix()}:1: spec: spec 4.5" in res.stdout
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "check_citations.py"), "--fix",
                          str(f)], capture_output=True, text=True, timeout=60)
    assert "rewrote 3 spec citations" in res.stderr
    assert "docs/spec.md 4.5" in f.read_text()
    assert ": spec:" not in res.stdout and ": case: R20" in res.stdout
