"""The extension options (in_dims, out_dims, weights, chunk_sizes) with GPU
device ids, on two GPUs and on one GPU twice, gathered on a GPU and on the
host: out_dims "sum" on dpmini.Array and CUDA-array-interface outputs, and
out_dims None comparing GPU arrays by value (not by identity) and returning
the array on the output device."""
import numpy as np
import pytest

import dpmini
from gpu_helpers import NGPU, gpu, host

pytestmark = gpu

DEVS = [[0, 0]] + ([[0, 1]] if NGPU >= 2 else [])
OUTS = [0, "cpu"]


def on(y, output_device):
    """y is where output_device says, as the type that device gives."""
    if output_device == "cpu":
        assert type(y) is np.ndarray
    else:
        assert isinstance(y, dpmini.Array) and y.device == f"cuda:{output_device}"
    return host(y)


class FakeForeign:
    """A replica output from another GPU library: only the CUDA Array Interface."""

    def __init__(self, arr):
        self._arr = arr

    @property
    def __cuda_array_interface__(self):
        return self._arr.__cuda_array_interface__


@pytest.mark.parametrize("devs", DEVS, ids=str)
@pytest.mark.parametrize("output_device", OUTS, ids=str)
@pytest.mark.parametrize("wrap", [lambda a: a, FakeForeign], ids=["dpmini", "cai"])
def test_out_dims_sum_on_gpu_outputs(devs, output_device, wrap):
    x = np.arange(12.0).reshape(4, 3)
    dp = dpmini.DataParallel(lambda v: {"g": wrap(v), "n": v.shape[0]}, devs,
                             output_device=output_device, out_dims={"g": "sum", "n": "sum"})
    out = dp(x)
    np.testing.assert_array_equal(on(out["g"], output_device), x[:2] + x[2:])
    assert out["n"] == 4


@pytest.mark.parametrize("devs", DEVS, ids=str)
@pytest.mark.parametrize("output_device", OUTS, ids=str)
@pytest.mark.parametrize("wrap", [lambda a: a, FakeForeign], ids=["dpmini", "cai"])
def test_out_dims_none_on_gpu_outputs(devs, output_device, wrap):
    table = np.array([0.0, 1.0, np.nan, 3.0])          # NaN counts as equal
    dp = dpmini.DataParallel(lambda v, w: (v, wrap(w)), devs, output_device=output_device,
                             in_dims=(0, None), out_dims=(0, None))
    y, w = dp(np.ones((4, 3)), table)
    np.testing.assert_array_equal(on(y, output_device), np.ones((4, 3)))
    np.testing.assert_array_equal(on(w, output_device), table)


@pytest.mark.parametrize("devs", DEVS, ids=str)
def test_out_dims_none_detects_different_gpu_arrays(devs):
    def model(v):
        return (v, dpmini.asarray(v.numpy()[:1], v.device))   # differs per replica

    dp = dpmini.DataParallel(model, devs, output_device="cpu", out_dims=(0, None))
    with pytest.raises(TypeError, match=r"out\[1\]: .*replica 1 returned an array that "
                                        r"differs from replica 0's"):
        dp(np.arange(8.0).reshape(4, 2))


@pytest.mark.parametrize("devs", DEVS, ids=str)
@pytest.mark.parametrize("output_device", OUTS, ids=str)
def test_in_dims_weights_chunk_sizes_on_gpus(devs, output_device):
    seen = []

    def model(x, tokens, table):
        seen.append((x.shape, tokens.shape, table.shape, str(table.device)))
        return {"x": x, "tokens": tokens}

    x = np.arange(30.0).reshape(10, 3)
    tokens = np.arange(20).reshape(2, 10)
    table = np.ones((5, 4), np.float32)
    for opts, rows in [({"weights": [1, 4]}, [2, 8]), ({"chunk_sizes": [7, 3]}, [7, 3])]:
        seen.clear()
        dp = dpmini.DataParallel(model, devs, output_device=output_device,
                                 in_dims=(0, 1, None), out_dims={"tokens": 1}, **opts)
        out = dp(x, tokens, table)
        np.testing.assert_array_equal(on(out["x"], output_device), x)
        np.testing.assert_array_equal(on(out["tokens"], output_device), tokens)
        assert sorted(s[0][0] for s in seen) == sorted(rows)
        assert sorted(s[1][1] for s in seen) == sorted(rows)
        assert all(s[2] == (5, 4) for s in seen)
        assert sorted(s[3] for s in seen) == sorted(f"cuda:{d}" for d in devs)
