"""A replica's exception wrapped by dpmini (here a KeyError) pickles and keeps
its text."""

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


# --- a replica's KeyError pickles ---------------------------------------

def test_wrapped_keyerror_pickles_and_keeps_its_text():
    import pickle

    def f(x):
        raise KeyError("k")
    with pytest.raises(KeyError) as info:
        dpmini.DataParallel(f, D2)(np.ones(4))
    e = info.value
    assert type(e.args[0]) is dpmini._dpmini._KeyErrorMessage
    assert dpmini._dpmini._KeyErrorMessage.__module__ == "dpmini._dpmini"
    assert str(e).startswith("Caught KeyError in replica 0 on device cpu:0.\nOriginal Traceback")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is KeyError and str(back) == str(e)
