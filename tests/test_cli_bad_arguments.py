"""The command line (`python -m dpmini`) exits 2 with an argparse message naming
the option, never a traceback; --devices takes a count or a list; --plot is
written only after the checks pass."""
import io
import os
import subprocess
import sys

import pytest

import dpmini
from dpmini.__main__ import main

TIMEOUT = 60


# --- the command line exits 2 with an argparse message, never a traceback --

BAD_CLI = [
    (["--shape", "100000000000,100000000000"], "--shape"),
    (["--shape", "5,3", "--dim", "99999999999"], "--dim"),
    (["--shape", "5,3", "--devices", "2", "--chunk-sizes", "99999999999999999999,1"],
     "--chunk-sizes"),
    (["--shape", "5,3", "--devices", "2", "--chunk-sizes", "-1,6"], "--chunk-sizes"),
    (["--shape", "5,3", "--devices", "3", "--chunk-sizes", "1,4"], "chunk_sizes"),
    (["--shape", "5,3", "--plot", "/nonexistent/dir/x.png"], "--plot"),
    (["--shape", "5,3", "--plot", "x.unknownext"], "--plot"),
    (["--shape", "5,3", "--dtype", "nosuchtype"], "--dtype"),
    (["--kw", "a=3", "--kw", "a=4"], "--kw"),
    (["--shape", "5", "--devices", "0"], "--devices"),
    (["--shape", "5", "--devices", "300"], "--devices"),
    ([], "--shape"),
]


@pytest.mark.parametrize("argv,option", BAD_CLI, ids=[" ".join(a) or "none" for a, _ in BAD_CLI])
def test_cli_bad_arguments_exit_2(argv, option, capsys, tmp_path, monkeypatch):
    if "--plot" in argv and "libasan" in os.environ.get("LD_PRELOAD", ""):
        # checking a --plot path imports matplotlib, which aborts under ASan
        pytest.skip("matplotlib cannot be imported under LD_PRELOAD ASan")
    monkeypatch.chdir(tmp_path)
    try:
        rc = main(["explain", *argv], out=io.StringIO())
    except SystemExit as exc:             # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "usage: python -m dpmini explain" in err, err
    assert "python -m dpmini explain: error:" in err and option in err, err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir())   # nothing printed or written before the check


def test_cli_subprocess_has_no_traceback():
    p = subprocess.run([sys.executable, "-m", "dpmini", "explain", "--shape",
                        "100000000000,100000000000"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "error: --shape" in p.stderr


def test_cli_devices_count_and_list_documented():
    p = subprocess.run([sys.executable, "-m", "dpmini", "explain", "--help"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    text = " ".join(p.stdout.split())
    assert "COUNT" in text and "LIST" in text and "0," in text
    rc = main(["explain", "--shape", "4", "--devices", "cpu:1"], out=io.StringIO())
    assert rc == 0                        # one named device is a list


def test_cli_plot_written_after_checks(tmp_path):
    pytest.importorskip("matplotlib")
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("matplotlib cannot be imported under LD_PRELOAD ASan")
    out = io.StringIO()
    rc = main(["explain", "--shape", "5,3", "--plot", str(tmp_path / "p.svg")], out=out)
    assert rc == 0 and (tmp_path / "p.svg").stat().st_size > 1000
