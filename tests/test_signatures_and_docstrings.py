"""Every public function has a signature and a docstring that says its errors;
dpmini.comm names its functions; README's API table uses the real parameter
names."""
import copy
import pickle

import pytest

import dpmini


# --- signatures and the dpmini.comm submodule ---------------------------

COMM_NAMES = ["scatter", "gather", "broadcast", "broadcast_coalesced", "reduce_add",
              "reduce_add_coalesced"]


@pytest.mark.parametrize("name", COMM_NAMES)
def test_comm_functions_have_signatures_and_names(name):
    import inspect
    import pickle
    fn = getattr(dpmini.comm, name)
    assert fn is getattr(dpmini._dpmini.comm, name)
    assert fn.__name__ == name and fn.__module__ == "dpmini.comm"
    sig = inspect.signature(fn)
    assert list(sig.parameters)[0] in ("array", "arrays", "per_device")
    assert "--" not in fn.__doc__.splitlines()[:2]
    assert "Raises" in fn.__doc__
    assert pickle.loads(pickle.dumps(fn)) is fn


def test_every_public_function_has_a_signature():
    import inspect
    for name in dpmini.__all__:
        obj = getattr(dpmini, name)
        if callable(obj) and not isinstance(obj, type):
            inspect.signature(obj)
    for meth in ["forward", "scatter", "replicate", "parallel_apply", "gather"]:
        inspect.signature(getattr(dpmini.DataParallel, meth))
    assert list(inspect.signature(dpmini.asarray).parameters) == ["obj", "device", "pin_memory"]
    assert "Rule source" in dpmini.asarray.__doc__
    assert "Rule source" in dpmini.device_of.__doc__
    assert "Errors" in dpmini.DataParallel.replicate.__doc__
    assert "Errors" in dpmini.DataParallel.parallel_apply.__doc__
    assert "TypeError when module is not callable" in dpmini.data_parallel.__doc__


# --- README's API table uses the real parameter names --------------------

def test_readme_api_table_matches_the_signatures():
    import inspect
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    checked = 0
    for name in ["DataParallel", "data_parallel", "scatter", "scatter_kwargs", "gather",
                 "replicate", "parallel_apply", "explain"]:
        for m in re.finditer(r"`%s\(([^`]*)\)`" % name, readme):
            assert m.group(1) == str(inspect.signature(getattr(dpmini, name)))[1:-1], m.group(0)
            checked += 1
    assert checked >= 8


# --- docstrings and docs --------------------------------------------------

def test_docstrings():
    for fn in (dpmini.memory_allocated, dpmini.memory_reserved, dpmini.empty_cache):
        assert "Errors" in fn.__doc__ or "Raises" in fn.__doc__, fn
    assert ".status" in dpmini.DPError.__doc__
    assert "copy" in dpmini.Device.__reduce__.__doc__
    assert "dpmini.Array" in dpmini.device_of.__doc__
    doc = dpmini.DataParallel.__doc__
    assert "dtype" in doc and "object" in doc and "Shapes" in doc
    assert "tuple of ints" in dpmini.empty.__doc__
