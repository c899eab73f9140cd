"""What scatter_kwargs takes as `inputs`, matched to PyTorch.

torch's scatter_kwargs scatters `inputs` as a structure: a list [x] gives
[x_i] per replica, which parallel_apply unpacks (module(x_i)); a tuple gives
(x_i,); a bare array gives x_i, which parallel_apply wraps as (x_i,) (docs/spec.md 3.1, 3.3, 6.3). dpmini keeps the container (a list per replica for a list)
and gives a bare array as (x_i,) (PyTorch's own scatter_kwargs fails on it:
'if inputs' is ambiguous). (The functional data_parallel differs on purpose,
as PyTorch's does: a non-tuple `inputs` there, a list included, is one
argument, docs/spec.md 2.9.)
"""
import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


def _check(ins, expected, container=tuple):
    assert len(ins) == len(expected)
    for got, want in zip(ins, expected):
        assert type(got) is container and len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_list_inputs_are_the_positional_arguments():
    x = np.arange(4.0)
    ins, kws = dpmini.scatter_kwargs([x], None, D2)
    _check(ins, [(x[:2],), (x[2:],)], list)
    assert kws == ({}, {})


def test_list_of_two_inputs():
    x, y = np.arange(4.0), np.arange(8.0).reshape(4, 2)
    ins, _ = dpmini.scatter_kwargs([x, y], {"k": 1}, D2)
    _check(ins, [(x[:2], y[:2]), (x[2:], y[2:])], list)


def test_list_and_tuple_split_alike_each_in_its_container():
    x = np.arange(6.0)
    a, _ = dpmini.scatter_kwargs([x, "s"], None, D2)
    b, _ = dpmini.scatter_kwargs((x, "s"), None, D2)
    assert [type(r) for r in a] == [list, list] and [type(r) for r in b] == [tuple, tuple]
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
    _check(ins, [(np.arange(2.0),), (np.arange(2.0, 4.0),)], list)
    ins, _ = dp.scatter((np.arange(4.0),), None)
    _check(ins, [(np.arange(2.0),), (np.arange(2.0, 4.0),)])


def test_an_empty_list_with_kwargs_gives_empty_tuples_as_pytorch():
    ins, kws = dpmini.scatter_kwargs([], {"k": np.arange(4.0)}, D2)
    assert ins == ((), ())
    assert [k["k"].tolist() for k in kws] == [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.parametrize("inputs", [None, ()])
def test_none_and_empty_tuple(inputs):
    assert dpmini.scatter_kwargs(inputs, None, D2) == ((), ())
