"""The main job (make demo) as a test: its last two lines and its expectations."""
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("tqdm")


@pytest.mark.parametrize("devices", [None, "3"])
def test_demo_reaches_targets_and_ends_with_two_lines(devices):
    argv = [sys.executable, "-m", "dpmini.demo"] + ([] if devices is None else ["--devices", devices])
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.strip().splitlines()[-2:]
    assert last[0].startswith("accuracy ") and last[1].startswith("max_abs_diff_vs_single_device ")
    assert float(last[0].split()[1]) >= 0.95
    assert float(last[1].split()[1]) <= 1e-6
    assert "DataParallel plan:" in run.stdout  # the explain table of the first batch


def test_demo_fails_loudly_when_undertrained():
    run = subprocess.run([sys.executable, "-m", "dpmini.demo", "--epochs", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stdout.strip().splitlines()[-2].startswith("accuracy ")
