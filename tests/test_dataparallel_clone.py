"""DataParallel copies, deep-copies and pickles, keeping its arguments, the
extension options (in_dims, out_dims, chunk_sizes, weights) and subclass
attributes; SplitWarning's wording."""
import copy
import pickle

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


# --- DataParallel copies and pickles; SplitWarning wording ---------------

class _Scale:
    def __init__(self, s):
        self.s = np.full(1, s)

    def __call__(self, x):
        return x * self.s[0]


class _TaggedDP(dpmini.DataParallel):
    pass


def test_dataparallel_pickles_and_copies():
    import copy
    import pickle
    dp = _TaggedDP(_Scale(3.0), ["cpu:2", "cpu:1"], output_device="cpu", dim=-1, strict=True)
    dp.tag = "hello"
    for clone in [pickle.loads(pickle.dumps(dp)), copy.copy(dp), copy.deepcopy(dp)]:
        assert type(clone) is _TaggedDP and clone is not dp
        assert [str(d) for d in clone.device_ids] == ["cpu:2", "cpu:1"]
        assert str(clone.output_device) == "cpu"
        assert clone.dim == -1 and clone.strict is True and clone.tag == "hello"
        assert np.array_equal(clone(np.ones((2, 4))), np.full((2, 4), 3.0))
    assert copy.copy(dp).module is dp.module
    assert copy.deepcopy(dp).module is not dp.module
    plain = dpmini.DataParallel(abs, D2)
    back = pickle.loads(pickle.dumps(plain))
    assert back.module is abs and str(back.output_device) == "cpu:0"
    with pytest.raises(RuntimeError, match="__init__"):
        _TaggedDP.__new__(_TaggedDP).__reduce__()


def test_split_warning_says_rows_only_along_dim_0():
    dp = dpmini.DataParallel(lambda a, b: a, ["cpu:0", "cpu:1", "cpu:2"], dim=1)
    with pytest.warns(dpmini.SplitWarning) as rec:
        dp(np.ones((2, 3)), np.ones((2, 2)))
    msg = str(rec[0].message)
    assert "index 2 of 3 along dim 1 is dropped" in msg and "row" not in msg, msg
    dp0 = dpmini.DataParallel(lambda a, b: a, ["cpu:0", "cpu:1", "cpu:2"])
    with pytest.warns(dpmini.SplitWarning) as rec:
        dp0(np.ones((5, 1)), np.ones((2, 1)))
    assert "row 4 of 5 along dim 0 is dropped" in str(rec[0].message)


# --- copy / deepcopy / pickle keep in_dims, out_dims, chunk_sizes, weights ---

def _scaled_by_table(x, w):        # w is broadcast whole (in_dims None)
    return x * w.sum()


def _sum_model(x):
    return {"y": x, "n": x.shape[0]}


class Sub(dpmini.DataParallel):     # a subclass with the five PyTorch arguments
    def __init__(self, module, device_ids=None, output_device=None, dim=0, strict=False):
        super().__init__(module, device_ids, output_device, dim, strict)


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy,
                                   lambda dp: pickle.loads(pickle.dumps(dp))],
                         ids=["copy", "deepcopy", "pickle"])
def test_clones_keep_the_extension_options(clone):
    x, w = np.ones(4), np.arange(4.0)
    dp = dpmini.DataParallel(_scaled_by_table, D2, in_dims=(0, None), out_dims=0,
                             weights=[1, 3])
    dp.note = "kept"
    c = clone(dp)
    assert (c.in_dims, c.out_dims, c.chunk_sizes, c.weights) == \
        (dp.in_dims, dp.out_dims, dp.chunk_sizes, dp.weights) == ((0, None), 0, None, (1, 3))
    assert c.note == "kept"
    np.testing.assert_array_equal(c(x, w), dp(x, w))          # [6, 6, 6, 6]
    np.testing.assert_array_equal(c(x, w), np.full(4, 6.0))

    dp = dpmini.DataParallel(_sum_model, D2, out_dims={"n": "sum"}, chunk_sizes=[1, 3])
    c = clone(dp)
    assert c.chunk_sizes == (1, 3) and c.out_dims == {"n": "sum"} and c.weights is None
    assert c(np.ones((4, 2)))["n"] == 4


def test_reduce_form_and_plain_objects():
    dp = dpmini.DataParallel(_sum_model, D2)
    assert dp.__reduce__()[2] is None                          # nothing to restore
    dp = dpmini.DataParallel(_sum_model, D2, in_dims={0: 1})
    state, slots = dp.__reduce__()[2]
    assert state is None and slots == {"in_dims": {0: 1}}
    s = Sub(_sum_model, D2)
    s.in_dims = (1,)
    c = copy.deepcopy(s)
    assert type(c) is Sub and c.in_dims == (1,)


class _OwnInitDP(dpmini.DataParallel):
    """A subclass whose __init__ takes other arguments and counts its calls."""
    inits = 0

    def __init__(self, module, tag):
        type(self).inits += 1
        super().__init__(module, device_ids=["cpu:0", "cpu:1"], dim=1, out_dims={"y": "sum"})
        self.tag = tag


def _rows_dict(x):
    return {"y": x}


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))],
                         ids=["copy", "deepcopy", "pickle"])
def test_subclass_with_own_init_clones_without_calling_it(clone):
    dp = _OwnInitDP(_rows_dict, "a")
    before = _OwnInitDP.inits
    c = clone(dp)
    assert _OwnInitDP.inits == before                      # __init__ not run again
    assert type(c) is _OwnInitDP and c.tag == "a" and c.dim == 1
    assert [str(d) for d in c.device_ids] == ["cpu:0", "cpu:1"]
    x = np.arange(8.0).reshape(2, 4)
    np.testing.assert_array_equal(c(x)["y"], dp(x)["y"])
    np.testing.assert_array_equal(c(x)["y"], x[:, :2] + x[:, 2:])


def test_rebuild_refuses_a_class_that_is_not_a_subclass():
    with pytest.raises(TypeError, match="subclass of"):
        dpmini.DataParallel._rebuild(dict, (abs,))
