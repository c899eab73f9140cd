"""python -m dpmini profile: the per-call table, the copy limit line, the trace, bad arguments."""
import io
import json
import subprocess
import sys

import pytest

from dpmini.__main__ import main


def run(*argv):
    out = io.StringIO()
    rc = main(list(argv), out=out)
    return rc, out.getvalue()


def test_profile_prints_one_table_per_call_with_each_device():
    rc, text = run("profile", "--shape", "512,256", "--dim", "1", "--devices", "2",
                   "--repeat", "2")
    assert rc == 0
    assert "call 1 (dpmini.DataParallel)" in text and "call 2 (dpmini.DataParallel)" in text
    assert "call 3" not in text
    assert "scatter copy" in text and "gather copy" in text and "strided" in text
    assert text.count("cpu:0 ") == 2 and text.count("cpu:1 ") == 2
    assert "dpmini's own overhead" in text
    assert "copy limit of one thread" in text and "the faster of memcpy" in text


def test_profile_names_the_idle_device_of_a_short_batch():
    rc, text = run("profile", "--shape", "2,3", "--devices", "3", "--repeat", "1")
    assert rc == 0
    assert "idle devices: cpu:2" in text


def test_profile_trace_file_is_trace_event_json(tmp_path):
    path = tmp_path / "t.json"
    rc, text = run("profile", "--shape", "64,8", "--shape", "64", "--devices", "cpu:0,cpu:1",
                   "--repeat", "1", "--trace", str(path))
    assert rc == 0 and f"wrote the trace to {path}" in text
    doc = json.loads(path.read_text())
    assert any(ev["ph"] == "X" and ev["cat"] == "copy" for ev in doc["traceEvents"])


def test_profile_from_the_shell():
    proc = subprocess.run([sys.executable, "-m", "dpmini", "profile", "--shape", "16,4",
                           "--devices", "2", "--repeat", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "call 1 (dpmini.DataParallel)" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--devices", "2"], "give at least one --shape"),
    (["--shape", "4,4", "--repeat", "0"], "expected 1..1000"),
    (["--shape", "4,4", "--dtype", "complex64"], "--dtype: 'complex64': expected a bool"),
    (["--shape", "4,4", "--dtype", "nope"], "--dtype:"),
    (["--shape", "4,4", "--devices", "cpu:0,cpu:999"], "device_ids"),
    (["--shape", "4,4", "--dim", "5", "--devices", "2"], "dim"),
    (["--shape", "4,4", "--trace", "/nonexistent-folder/t.json"], "--trace:"),
])
def test_profile_bad_arguments_exit_2_naming_the_option(argv, message, capsys):
    try:
        rc, _ = run("profile", *argv)
    except SystemExit as exc:    # argparse's own usage errors
        rc = exc.code
    assert rc == 2
    assert message in capsys.readouterr().err
