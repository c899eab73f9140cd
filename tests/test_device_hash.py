"""dpmini.Device hashes like its spelling, so it agrees with its string equality
in dicts and sets."""

import pytest

import dpmini


# --- Device hash agrees with its string equality ------------------------

def test_device_hash_equals_hash_of_its_spelling():
    for spec in ["cpu", "cpu:0", "cpu:1", "cpu:255"]:
        d = dpmini.Device(spec)
        assert d == spec and hash(d) == hash(spec) == hash(str(d))
    assert "cpu:1" in {dpmini.Device("cpu:1")}
    assert {"cpu:1": 1}[dpmini.Device("cpu:1")] == 1
    assert dpmini.Device(-1) == "cpu" and hash(dpmini.Device(-1)) == hash("cpu")
    assert dpmini.Device("cpu:1") != "cpu:01"       # only the canonical spelling
