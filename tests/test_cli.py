"""python -m dpmini explain / info: output and exit status."""
import io
import os
import subprocess
import sys

import pytest

import dpmini
from dpmini.__main__ import main


def run(*argv):
    out = io.StringIO()
    rc = main(list(argv), out=out)
    return rc, out.getvalue()


def test_explain_prints_the_plan_table():
    rc, text = run("explain", "--shape", "5,3", "--dim", "0", "--devices", "4")
    assert rc == 0
    assert "3 replicas on 4 devices" in text
    assert "args[0]: shape (5, 3) float32, split along dim 0" in text
    for line in ("cpu:0   [0:2)        (2, 3)       24 B",
                 "cpu:2   [4:5)        (1, 3)       12 B",
                 "cpu:3   -            -            (no replica)"):
        assert line in text


def test_explain_several_shapes_dim1_and_device_list():
    rc, text = run("explain", "--shape", "4,6", "--shape", "2,6", "--dim", "1",
                   "--devices", "cpu:0,cpu:2", "--dtype", "float64")
    assert rc == 0
    assert "args[1]: shape (2, 6) float64, split along dim 1" in text
    assert "cpu:2   [3:6)        (4, 3)" in text


def test_explain_kw_in_dims_weights_chunk_sizes():
    rc, text = run("explain", "--shape", "10,3", "--shape", "7", "--in-dims", "0,None",
                   "--kw", "mask=10", "--devices", "2", "--weights", "1,4")
    assert rc == 0
    assert "weights=[1.0, 4.0]" in text and "broadcast whole" in text
    assert "kwargs['mask']" in text and "[2:10)" in text
    rc, text = run("explain", "--shape", "6", "--devices", "3", "--chunk-sizes", "1,2,3")
    assert rc == 0 and "[3:6)" in text


def test_explain_warning_and_error_exit_status():
    rc, text = run("explain", "--shape", "5", "--shape", "1", "--devices", "2")
    assert rc == 0 and "warning:" in text
    rc, text = run("explain", "--shape", "5", "--shape", "1", "--devices", "2", "--strict")
    assert rc == 1 and "error:" in text


def test_explain_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "--devices", "2"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["explain", "--shape", "5,x"])
    with pytest.raises(SystemExit):
        main(["explain", "--shape", "5", "--devices", "0"])
    with pytest.raises(SystemExit):
        main([])
    rc = main(["explain", "--shape", "5", "--devices", "3", "--chunk-sizes", "1,2"])
    assert rc == 2 and "chunk_sizes: expected 3 entries" in capsys.readouterr().err


def test_explain_plot_saves_a_file(tmp_path):
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("matplotlib cannot be imported under LD_PRELOAD ASan")
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    rc, text = run("explain", "--shape", "5,3", "--devices", "4", "--plot", str(path))
    assert rc == 0 and path.exists() and path.stat().st_size > 1000
    assert str(path) in text


def test_info_lists_devices_backends_and_versions():
    rc, text = run("info")
    assert rc == 0
    assert f"virtual CPU devices: {dpmini.cpu_device_count()}" in text
    assert f"CUDA devices: {dpmini.device_count()}" in text
    assert "CPU: built" in text
    if not getattr(dpmini._dpmini, "has_cuda", 0):
        assert "CUDA: not built" in text
        assert "NCCL: not built" in text


def test_info_respects_cpu_device_env():
    env = dict(os.environ, DPMINI_CPU_DEVICES="5")
    proc = subprocess.run([sys.executable, "-m", "dpmini", "info"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "virtual CPU devices: 5" in proc.stdout and "DPMINI_CPU_DEVICES=5" in proc.stdout


def test_module_entry_point_explain():
    proc = subprocess.run([sys.executable, "-m", "dpmini", "explain", "--shape", "5,3",
                           "--dim", "0", "--devices", "4"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "3 replicas on 4 devices" in proc.stdout
