"""The main job with PyTorch tensors (python -m dpmini.demo --library torch):
the same two closing lines and thresholds as the NumPy run (make demo)."""
import subprocess
import sys

import pytest


def test_demo_with_torch_reaches_the_targets(torch):
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    run = subprocess.run([sys.executable, "-m", "dpmini.demo", "--library", "torch"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.strip().splitlines()[-2:]
    assert last[0].startswith("accuracy ") and float(last[0].split()[1]) >= 0.95
    assert last[1].startswith("max_abs_diff_vs_single_device ")
    assert float(last[1].split()[1]) <= 1e-6
    assert "[torch.Tensor cpu]" in run.stdout   # the explain table names the library


def test_demo_cupy_without_a_gpu_says_so():
    import dpmini
    if dpmini.device_count() > 0:
        pytest.skip("a GPU is present: --library cupy would train")
    run = subprocess.run([sys.executable, "-m", "dpmini.demo", "--library", "cupy"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "needs a CUDA device" in run.stderr
