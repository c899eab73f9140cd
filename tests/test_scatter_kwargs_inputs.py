"""What scatter_kwargs takes as `inputs` (issue 8 item 11), matched to PyTorch.

torch's scatter_kwargs scatters `inputs` as a structure: a list [x] gives
[x_i] per replica, which parallel_apply unpacks (module(x_i)); a bare array
gives x_i, which parallel_apply wraps as (x_i,) (spec 3.1, 3.3, 6.3). dpmini
returns each replica's positional arguments as a tuple, so both give (x_i,).
(The functional data_parallel differs on purpose, as PyTorch's does: a
non-tuple `inputs` there, a list included, is one argument, spec 2.9.)
"""
import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


def _check(ins, expected):
    assert len(ins) == len(expected)
    for got, want in zip(ins, expected):
        assert type(got) is tuple and len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_list_inputs_are_the_positional_arguments():
    x = np.arange(4.0)
    ins, kws = dpmini.scatter_kwargs([x], None, D2)
    _check(ins, [(x[:2],), (x[2:],)])
    assert kws == ({}, {})


def test_list_of_two_inputs():
    x, y = np.arange(4.0), np.arange(8.0).reshape(4, 2)
    ins, _ = dpmini.scatter_kwargs([x, y], {"k": 1}, D2)
    _check(ins, [(x[:2], y[:2]), (x[2:], y[2:])])


def test_list_equals_tuple():
    x = np.arange(6.0)
    a, _ = dpmini.scatter_kwargs([x, "s"], None, D2)
    b, _ = dpmini.scatter_kwargs((x, "s"), None, D2)
    assert [len(r) for r in a] == [len(r) for r in b] == [2, 2]
    for ra, rb in zip(a, b):
        np.testing.assert_array_equal(ra[0], rb[0])
        assert ra[1] == rb[1] == "s"


def test_bare_array_is_one_argument():
    x = np.arange(4.0)
    ins, _ = dpmini.scatter_kwargs(x, None, D2)
    _check(ins, [(x[:2],), (x[2:],)])


def test_list_inputs_drive_parallel_apply_as_in_pytorch():
    x = np.arange(4.0)
    ins, kws = dpmini.scatter_kwargs([x], None, D2)
    outs = dpmini.parallel_apply([lambda a: a * 2] * 2, ins, kws, D2)
    np.testing.assert_array_equal(np.concatenate(outs), x * 2)


def test_empty_list_is_no_arguments():
    assert dpmini.scatter_kwargs([], None, D2) == ((), ())


def test_data_parallel_keeps_a_list_as_one_argument():
    x = np.arange(4.0)
    out = dpmini.data_parallel(lambda lst: lst[0] + 1, [x], D2)
    np.testing.assert_array_equal(out, x + 1)


def test_dataparallel_scatter_takes_a_list_as_the_arguments():
    dp = dpmini.DataParallel(lambda a: a, D2)
    ins, _ = dp.scatter([np.arange(4.0)], None)
    _check(ins, [(np.arange(2.0),), (np.arange(2.0, 4.0),)])


@pytest.mark.parametrize("inputs", [None, ()])
def test_none_and_empty_tuple(inputs):
    assert dpmini.scatter_kwargs(inputs, None, D2) == ((), ())
