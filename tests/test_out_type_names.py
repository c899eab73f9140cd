"""An out= object that is not NumPy's ndarray is named by its module and
qualified name, so a buffer-protocol type that happens to be called `ndarray`
does not read as NumPy's."""
import numpy as np
import pytest

import dpmini


class ndarray(bytearray):   # a buffer-protocol type named like NumPy's
    pass


ndarray.__module__ = "otherlib"


def test_gather_out_of_another_ndarray_type_names_its_module():
    with pytest.raises(TypeError, match=r"^out: expected a numpy.ndarray or a GPU array, got "
                                        r"otherlib\.ndarray \(an array-like"):
        dpmini.comm.gather([np.ones(4, np.uint8)] * 2, out=ndarray(8))


def test_scatter_out_entry_of_another_ndarray_type_names_its_module():
    with pytest.raises(TypeError, match=r"^out\[0\]: expected a numpy.ndarray or a GPU "
                                        r"array, got otherlib\.ndarray"):
        dpmini.comm.scatter(np.ones(4, np.uint8), out=[ndarray(2), ndarray(2)])


def test_scatter_out_that_is_one_array_names_numpy():
    with pytest.raises(TypeError, match=r"^out: expected a sequence of arrays, got "
                                        r"numpy\.ndarray$"):
        dpmini.comm.scatter(np.ones(4), out=np.ones(4))


def test_device_of_names_what_it_got():
    with pytest.raises(TypeError, match=r"^array: expected a numpy.ndarray, a GPU array or an "
                                        r"array of another library \(torch, JAX\), got "
                                        r"otherlib\.ndarray$"):
        dpmini.device_of(ndarray(2))
