"""out= arrays that overlap a source, or themselves (zero strides), are refused
by scatter, gather and broadcast; sliced and transposed out= arrays stay
accepted."""

import numpy as np
import pytest

import dpmini


# --- out= that overlaps a source, or itself ------------------------

def test_gather_out_overlapping_an_input_is_refused():
    buf = np.arange(10.0)
    with pytest.raises(ValueError, match=r"^out: .*arrays\[1\]"):
        dpmini.comm.gather([np.arange(2.0), buf[4:8]], out=buf[2:8])
    assert np.array_equal(buf, np.arange(10.0))          # nothing written
    # disjoint memory of the same buffer is fine
    parts = [buf[0:2], buf[2:4]]
    got = dpmini.comm.gather(parts, out=buf[6:10])
    assert np.array_equal(got, [0, 1, 2, 3]) and got.base is buf


def test_scatter_out_overlapping_the_source_is_refused():
    a = np.arange(8.0)
    with pytest.raises(ValueError, match=r"^out\[0\]: .*memory of array"):
        dpmini.comm.scatter(a, out=[a[4:], a[:4]])
    b = np.zeros(8)
    with pytest.raises(ValueError, match=r"^out\[1\]: .*memory of out\[0\]"):
        dpmini.comm.scatter(a, out=[b[:4], b[2:6]])
    r = dpmini.comm.scatter(a, out=[b[:4], b[4:]])
    assert np.array_equal(b, a) and r[0].base is b


def test_broadcast_out_overlapping_the_source_is_refused():
    a = np.arange(12.0)
    with pytest.raises(ValueError, match=r"^out\[0\]: .*memory of array"):
        dpmini.comm.broadcast(a[0:6], out=[a[1:12:2]])


@pytest.mark.parametrize("fn", ["gather", "scatter", "broadcast"])
def test_zero_stride_or_self_overlapping_out_is_refused(fn):
    z = np.lib.stride_tricks.as_strided(np.zeros(1), shape=(4,), strides=(0,))
    rows = np.lib.stride_tricks.as_strided(np.zeros(8), shape=(3, 4), strides=(16, 8))
    for bad, src in [(z, np.arange(4.0)), (rows, np.ones((3, 4)))]:
        with pytest.raises(ValueError, match=r"more than one element of the written-to"):
            if fn == "gather":
                dpmini.comm.gather([src], out=bad)
            elif fn == "scatter":
                dpmini.comm.scatter(src, out=[bad])
            else:
                dpmini.comm.broadcast(src, out=[bad])


def test_sliced_and_transposed_out_still_accepted():
    x = np.arange(24.0).reshape(4, 6)
    big = np.zeros((12, 8))
    out = big[::3, ::-1][:, 1:7]                  # strided, negative, a view
    dpmini.comm.broadcast(x, out=[out])
    assert np.array_equal(out, x)
    outT = np.zeros((6, 4)).T
    assert np.array_equal(dpmini.comm.gather([x[:2], x[2:]], out=outT), x)


@pytest.mark.parametrize("shape,sizes", [((3, 0), (2, 1)), ((0, 4), (0, 0)), ((4, 0, 2), (3, 1))])
def test_zero_size_out_arrays_are_accepted(shape, sizes):
    """Outputs without elements cannot overlap, whatever their strides (np.empty((2, 0))
    has strides (0, 0)): comm.scatter writes nothing and returns them."""
    a = np.zeros(shape)
    outs = [np.empty((n,) + shape[1:]) for n in sizes]
    got = dpmini.comm.scatter(a, out=outs)
    assert [g.shape for g in got] == [o.shape for o in outs]
