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


# --- --version, no command, --plot's real file name, negative option values ---

def test_version_prints_the_version():
    proc = subprocess.run([sys.executable, "-m", "dpmini", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"dpmini {dpmini.__version__}"


def test_no_command_prints_the_help_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "dpmini"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "usage: python -m dpmini" in proc.stderr
    assert "explain" in proc.stderr and "info" in proc.stderr and "--version" in proc.stderr
    assert "error: choose a command: explain, profile or info" in proc.stderr
    help_proc = subprocess.run([sys.executable, "-m", "dpmini", "-h"], capture_output=True,
                               text=True, timeout=60)
    assert help_proc.returncode == 0 and "usage: python -m dpmini" in help_proc.stdout


def test_plot_without_extension_names_the_file_written(tmp_path):
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("matplotlib cannot be imported under LD_PRELOAD ASan")
    matplotlib = pytest.importorskip("matplotlib")
    base = tmp_path / "myplan"
    rc, text = run("explain", "--shape", "5,3", "--devices", "2", "--plot", str(base))
    written = f"{base}.{matplotlib.rcParams['savefig.format']}"
    assert rc == 0 and os.path.exists(written) and not base.exists()
    assert f"saved the picture to {written}" in text


@pytest.mark.parametrize("argv", [["--chunk-sizes", "-1,6"], ["--chunk-sizes=-1,6"],
                                  ["--chunk", "-1,6"]])
def test_negative_chunk_sizes_get_dpminis_message(argv, capsys):
    rc = main(["explain", "--shape", "5", "--devices", "2", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert "chunk_sizes[0]: must be >= 0" in err and "got -1" in err
    assert "expected one argument" not in err


def test_negative_values_for_other_options(capsys):
    rc = main(["explain", "--shape", "5", "--devices", "2", "--weights", "-1,2"])
    assert rc == 2 and "weights[0]: must be a finite number > 0" in capsys.readouterr().err
    rc, text = run("explain", "--shape", "5,3", "--devices", "2", "--in-dims", "-1")
    assert rc == 0 and "split along dim 1" in text
    rc, text = run("explain", "--shape", "5,3", "--devices", "2", "--dim", "-1")
    assert rc == 0 and "split along dim 1" in text


def test_negative_chunk_sizes_from_the_shell():
    for argv in (["--chunk-sizes", "-1,6"], ["--chunk-sizes=-1,6"]):
        proc = subprocess.run([sys.executable, "-m", "dpmini", "explain", "--shape", "5",
                               "--devices", "2", *argv], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2
        assert "chunk_sizes[0]: must be >= 0" in proc.stderr, proc.stderr


def test_subarray_dtype_is_blamed_on_dtype(capsys):
    rc = main(["explain", "--shape", "4", "--devices", "2", "--dtype", "(2,3)f8"])
    err = capsys.readouterr().err
    assert rc == 2 and "--dtype: '(2,3)f8' is a subarray dtype" in err
    assert "--shape/--kw" not in err


def test_empty_plot_file_name_is_an_error(capsys):
    rc = main(["explain", "--shape", "4", "--devices", "2", "--plot", ""])
    assert rc == 2 and "--plot: expected a file name" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["5,,3", ",5", "5,3,,"])
def test_shape_with_an_empty_size_is_refused(text, capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "--shape", text, "--devices", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--shape" in err and "empty size" in err


def test_shape_with_one_trailing_comma_is_a_tuple():
    rc, text = run("explain", "--shape", "5,", "--devices", "2")
    assert rc == 0 and "(5,)" in text


def test_closed_pipe_ends_quietly_with_status_1():
    # The reader closes the pipe before dpmini writes: no BrokenPipeError traceback.
    code = ("import os, subprocess, sys\n"
            "r, w = os.pipe()\n"
            "os.close(r)\n"
            "p = subprocess.run([sys.executable, '-m', 'dpmini', 'explain', '--shape', '5,3',"
            " '--devices', '2'], stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)\n"
            "print(p.returncode)\n"
            "print(p.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    lines = proc.stdout.splitlines()
    assert lines[0] == "1", proc.stdout
    assert "Traceback" not in proc.stdout and "BrokenPipeError" not in proc.stdout
