"""DataParallel on CUDA devices (docs/spec.md 2-5 with GPU device ids): shards are
dpmini.Array on the right device, several replicas on one GPU, outputs as
dpmini.Array or foreign GPU arrays gathered on a GPU or the host."""
import threading

import numpy as np
import pytest

import dpmini
from gpu_helpers import (DEVICE_LISTS, NGPU, chunk_sizes, cuda_debug, gpu, need_cupy,
                         need_torch_cuda, real_gpu, sample)

pytestmark = gpu


@pytest.mark.parametrize("devs", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("output_device", ["cpu", 0])
def test_identity(devs, dim, output_device):
    x = sample((7, 6), "float32")
    seen = []
    lock = threading.Lock()

    def module(t, scale=1):
        with lock:
            seen.append((type(t), str(t.device), t.shape, scale))
        return t

    dp = dpmini.DataParallel(module, device_ids=devs, output_device=output_device, dim=dim)
    y = dp(x, scale=3)
    k = len(chunk_sizes(x.shape[dim], len(devs)))
    assert len(seen) == k
    assert all(s[0] is dpmini.Array and s[3] == 3 for s in seen)
    assert sorted(s[1] for s in seen) == sorted(f"cuda:{d}" for d in devs[:k])
    if output_device == "cpu":
        assert type(y) is np.ndarray
        np.testing.assert_array_equal(y, x)
    else:
        assert isinstance(y, dpmini.Array) and y.device == "cuda:0"
        np.testing.assert_array_equal(y.numpy(), x)


def test_replicas_see_their_chunks_and_structures():
    x = sample((9, 2), "int64")
    dp = dpmini.DataParallel(lambda d: {"sum": dpmini.asarray(d["x"].numpy().sum(0, keepdims=True), d["x"].device),
                                        "n": 1},
                             device_ids=[0, 0, 0, 0], output_device="cpu")
    out = dp({"x": x})
    assert out["n"] == 1
    # 9 rows on 4 devices: [3, 3, 3], only 3 replicas (docs/spec.md 0.x)
    np.testing.assert_array_equal(out["sum"], np.stack([x[0:3].sum(0), x[3:6].sum(0), x[6:9].sum(0)]))


class FakeForeign:
    """A module output from another GPU library: only the CUDA Array Interface."""

    def __init__(self, arr):
        self._arr = arr

    @property
    def __cuda_array_interface__(self):
        return self._arr.__cuda_array_interface__


def test_foreign_gpu_outputs_are_gathered():
    x = sample((6, 3), "float64")
    dp = dpmini.DataParallel(lambda t: FakeForeign(t), device_ids=[0, 0], output_device="cpu")
    np.testing.assert_array_equal(dp(x), x)


def test_module_arrays_are_broadcast_to_gpus():
    class Linear:
        def __init__(self):
            self.w = np.arange(6.0).reshape(3, 2)

        def __call__(self, t):
            assert isinstance(self.w, dpmini.Array) and self.w.device == t.device
            return dpmini.asarray(t.numpy() @ self.w.numpy(), t.device)

    x = sample((5, 3), "float64")
    m = Linear()
    y = dpmini.DataParallel(m, device_ids=[0, 0], output_device="cpu")(x)
    np.testing.assert_allclose(y, x @ m.w)
    assert type(m.w) is np.ndarray  # the original stays on the host


def test_scalar_losses_give_a_vector():
    x = sample((4, 2), "float32")
    dp = dpmini.DataParallel(lambda t: dpmini.asarray(np.float32(t.numpy().sum()).reshape(()), t.device),
                             device_ids=[0, 0], output_device="cpu")
    with pytest.warns(UserWarning, match="scalars"):
        y = dp(x)
    np.testing.assert_allclose(y, [x[:2].sum(), x[2:].sum()])


def test_gradient_reduce_on_gpu():
    grads = [dpmini.asarray(np.full(4, float(i + 1), "float32"), 0) for i in range(3)]
    total = dpmini.comm.reduce_add(grads, destination=0)
    np.testing.assert_array_equal(total.numpy(), np.full(4, 6.0, "float32"))


def test_replica_error_names_the_gpu():
    def bad(t):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="cuda:0"):
        dpmini.DataParallel(bad, device_ids=[0, 0])(np.ones((2, 2)))


def test_scatter_gather_structures():
    x = sample((4, 3), "float32")
    parts = dpmini.scatter((x, "tag", [x]), [0, 0])
    assert len(parts) == 2 and parts[0][1] == "tag"
    assert isinstance(parts[1][2][0], dpmini.Array)
    back = dpmini.gather([p[0] for p in parts], "cpu")
    np.testing.assert_array_equal(back, x)


@real_gpu
def test_cupy_inside_replicas():
    cp = need_cupy()
    x = sample((8, 4), "float32")

    def module(t):
        c = cp.asarray(t)
        assert c.device.id == t.device.index  # the replica's GPU is current
        return c * 2

    y = dpmini.DataParallel(module, device_ids=list(range(NGPU)) * 2, output_device="cpu")(x)
    np.testing.assert_array_equal(y, x * 2)


@real_gpu
def test_torch_inside_replicas():
    torch = need_torch_cuda()
    x = sample((8, 4), "float32")

    def module(t):
        u = torch.from_dlpack(t)
        assert u.device.index == torch.cuda.current_device() == t.device.index
        return u + 1

    y = dpmini.DataParallel(module, device_ids=[0, 0], output_device="cpu")(x)
    np.testing.assert_array_equal(y, x + 1)


@real_gpu
def test_torch_replica_outputs_wait_for_torch_work():
    """A replica returns a tensor whose kernel is still queued behind a
    torch.cuda._sleep on torch's stream: gathering must wait for it."""
    torch = need_torch_cuda()
    x = sample((8, 1 << 16), "float32")

    def module(t):
        u = torch.from_dlpack(t)
        torch.cuda._sleep(100_000_000)
        return u + 1

    for out in ("cpu", 0):
        y = dpmini.DataParallel(module, device_ids=[0, 0], output_device=out)(x)
        np.testing.assert_array_equal(y if out == "cpu" else y.numpy(), x + 1)


def test_replica_workers_keep_the_callers_device():
    before = cuda_debug()["current_device"]
    seen = []

    def module(t):
        seen.append(cuda_debug()["current_device"])
        return t

    dpmini.DataParallel(module, device_ids=[0, 0], output_device="cpu")(
        sample((4, 2), "float32"))
    assert seen == [0, 0] and cuda_debug()["current_device"] == before
