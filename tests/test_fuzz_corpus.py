"""Replay the fuzz corpus (fuzz/corpus: the seeds and every input that ever
crashed the fuzzer) through fuzz/fuzz_core.c without libFuzzer, so `make
test` re-checks each finding with any C compiler. `make fuzz` does the
fuzzing itself (clang + libFuzzer); see docs/reliability.md."""
import shutil
import subprocess

import pytest

from test_c_units import CFLAGS, ROOT, _show

CORPUS = sorted((ROOT / "fuzz" / "corpus").iterdir())


def test_fuzz_corpus_replays_clean(tmp_path):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler: `cc` is not on PATH")
    assert len(CORPUS) >= 20, "the seed corpus is missing"
    exe = tmp_path / "replay"
    build = subprocess.run(
        [cc, *CFLAGS, "fuzz/fuzz_core.c", "fuzz/replay.c", "csrc/core/plan.c", "csrc/core/copy.c", "csrc/core/alloc.c",
         "-o", str(exe)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, "compiling the fuzz harness failed: " + _show(build)
    run = subprocess.run([str(exe), *map(str, CORPUS)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, "a corpus input broke an invariant: " + _show(run)
    assert f"replayed {len(CORPUS)} inputs" in run.stdout
