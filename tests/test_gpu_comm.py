"""dpmini.comm on CUDA devices: the CPU semantics tests again with
device_ids [0, 0], [0, 0, 0] (and distinct GPUs where present), host->GPU,
GPU->host, GPU->GPU, dims 0, 1, -1, non-contiguous inputs, all dtypes, the
copy paths (direct, 2D, host pack through staging, pack/unpack kernels) and
the NCCL / fallback collectives, each against a NumPy reference."""
import numpy as np
import pytest

import dpmini
from dpmini import _testing
from gpu_helpers import (DEVICE_LISTS, DTYPES, EMULATED, NGPU, chunk_sizes, cuda_debug, gpu,
                         host, need_torch_cuda, real_gpu, sample, two_gpus)

pytestmark = gpu


def np_chunks(x, k, dim):
    sizes = chunk_sizes(x.shape[dim], k)
    return np.split(x, np.cumsum(sizes)[:-1], axis=dim)


@pytest.mark.parametrize("devs", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("shape", [(7, 5), (10, 4, 3), (0, 3), (3, 0)])
def test_scatter_from_host_gather_to_host(devs, dim, shape):
    x = sample(shape, "float32")
    if dim == 1 and len(shape) < 2:
        pytest.skip("1-D")
    chunks = dpmini.comm.scatter(x, devs, dim=dim)
    want = np_chunks(x, len(devs), dim)
    assert len(chunks) == len(want)
    for c, w, d in zip(chunks, want, devs):
        assert isinstance(c, dpmini.Array) and c.device == f"cuda:{d}"
        np.testing.assert_array_equal(c.numpy(), w)
    g = dpmini.comm.gather(chunks, dim=dim)  # destination None: the host
    assert type(g) is np.ndarray
    np.testing.assert_array_equal(g, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1])
def test_all_dtypes_round_trip(dtype, dim):
    x = sample((9, 6), dtype)
    chunks = dpmini.comm.scatter(x, [0, 0, 0], dim=dim)
    for c, w in zip(chunks, np_chunks(x, 3, dim)):
        np.testing.assert_array_equal(c.numpy(), w)
    g = dpmini.comm.gather(chunks, dim=dim, destination=0)
    assert isinstance(g, dpmini.Array) and g.dtype == x.dtype
    np.testing.assert_array_equal(g.numpy(), x)


@pytest.mark.parametrize("view", ["T", "step", "neg", "fortran"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_non_contiguous_host_inputs(view, dim):
    x = sample((12, 10), "float64")
    v = {"T": x.T, "step": x[::2, ::3], "neg": x[::-1, ::-1], "fortran": np.asfortranarray(x)}[view]
    chunks = dpmini.comm.scatter(v, [0, 0], dim=dim)
    for c, w in zip(chunks, np_chunks(v, 2, dim)):
        np.testing.assert_array_equal(c.numpy(), w)
    np.testing.assert_array_equal(dpmini.comm.gather(chunks, dim=dim), v)


def test_fortran_chunk_keeps_its_layout():
    x = np.asfortranarray(sample((6, 4), "int32"))
    c = dpmini.comm.scatter(x, [0, 0], dim=1)[1]
    assert c.strides == (4, 24)  # dense view: PyTorch's memory_format=preserve
    np.testing.assert_array_equal(c.numpy(), x[:, 2:])


@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_from_gpu_views_and_copies(dim):
    x = sample((8, 6), "float32")
    a = dpmini.asarray(x, 0)
    devs = [0, 1] if NGPU >= 2 else [0, 0]
    chunks = dpmini.comm.scatter(a, devs, dim=dim)
    assert chunks[0].data_ptr == a.data_ptr  # docs/spec.md 3.4: own device -> a view
    for c, w in zip(chunks, np_chunks(x, 2, dim)):
        np.testing.assert_array_equal(c.numpy(), w)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gpu_to_gpu_gather(dim):
    x = sample((6, 8), "int64")
    chunks = dpmini.comm.scatter(x, [0, 0, 0], dim=dim)
    dest = 1 if NGPU >= 2 else 0
    g = dpmini.comm.gather(chunks, dim=dim, destination=dest)
    assert isinstance(g, dpmini.Array) and g.device == f"cuda:{dest}"
    np.testing.assert_array_equal(g.numpy(), x)


def test_gather_into_strided_host_out():
    x = sample((4, 6), "float32")
    chunks = dpmini.comm.scatter(x, [0, 0], dim=1)
    big = np.zeros((4, 12), "float32")
    out = big[:, ::2]  # a strided destination, written in place
    r = dpmini.comm.gather(chunks, dim=1, out=out)
    assert r is out
    np.testing.assert_array_equal(big[:, ::2], x)
    assert not big[:, 1::2].any()


def test_gather_into_device_out():
    x = sample((5, 3), "uint8")
    chunks = dpmini.comm.scatter(x, [0, 0], dim=0)
    out = dpmini.empty((5, 3), "uint8", device=0)
    assert dpmini.comm.gather(chunks, out=out) is out
    np.testing.assert_array_equal(out.numpy(), x)


def test_gather_casts_like_pytorch():
    a = dpmini.asarray(np.arange(3, dtype="float32"), 0)
    b = dpmini.asarray(np.arange(3, 6, dtype="int64"), 0)
    g = dpmini.comm.gather([a, b], destination=0)
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g.numpy(), np.arange(6, dtype="float32"))


@pytest.mark.parametrize("shape,dim", [((64, 7), 1), ((5, 33, 3), 1), ((8, 4, 6), -1)])
def test_strided_kernels_against_numpy(shape, dim):
    """Device-side pack/unpack: gathering strided views of one GPU array onto
    the same GPU runs the strided-copy kernel (short runs, < the 2D limit)."""
    x = sample(shape, "float32", seed=3)
    a = dpmini.asarray(x, 0)
    views = dpmini.comm.scatter(a, [0, 0, 0], dim=dim)  # all views of a
    assert all(v.data_ptr >= a.data_ptr for v in views)
    g = dpmini.comm.gather(views, dim=dim, destination=0)
    np.testing.assert_array_equal(g.numpy(), x)
    for v, w in zip(views, np_chunks(x, 3, dim)):  # D2H of a strided source
        np.testing.assert_array_equal(v.numpy(), w)


def test_2d_copy_path_from_pinned_memory():
    x = dpmini.asarray(sample((16, 2048), "float32"), pin_memory=True)
    chunks = dpmini.comm.scatter(x, [0, 0, 0, 0], dim=1)  # rows of 2 KiB: cudaMemcpy2DAsync
    for c, w in zip(chunks, np_chunks(x, 4, 1)):
        np.testing.assert_array_equal(c.numpy(), w)
    out = dpmini.empty((16, 2048), "float32", pin_memory=True)
    dpmini.comm.gather(chunks, dim=1, out=out)
    np.testing.assert_array_equal(out, x)


def test_staging_in_several_pieces():
    """More than one 16 MiB staging half, pageable memory, strided: host pack
    and host unpack through pinned staging."""
    x = np.arange(5 * 1024 * 1024 * 2, dtype="float32").reshape(1024 * 5, 2048)
    chunks = dpmini.comm.scatter(x, [0, 0], dim=1)
    for c, w in zip(chunks, np_chunks(x, 2, 1)):
        assert c.numpy()[::97, ::31].tolist() == w[::97, ::31].tolist()
    np.testing.assert_array_equal(dpmini.comm.gather(chunks, dim=1), x)


def test_scatter_chunk_sizes_and_out():
    x = sample((10, 2), "int32")
    chunks = dpmini.comm.scatter(x, [0, 0, 0], chunk_sizes=[1, 0, 9])
    assert [c.shape[0] for c in chunks] == [1, 0, 9]
    outs = [dpmini.empty((4, 2), "int32", device=0), dpmini.empty((6, 2), "int32", device=0)]
    r = dpmini.comm.scatter(x, out=outs)
    assert r[0] is outs[0]
    np.testing.assert_array_equal(outs[1].numpy(), x[4:])


@pytest.mark.parametrize("devs", DEVICE_LISTS, ids=str)
def test_broadcast(devs):
    x = sample((3, 4), "float64")
    a = dpmini.asarray(x, devs[0])
    out = dpmini.comm.broadcast(a, devs)
    assert len(out) == len(devs)
    assert out[0].data_ptr == a.data_ptr  # its own device: the array itself
    for o, d in zip(out, devs):
        assert o.device == f"cuda:{d}"
        np.testing.assert_array_equal(o.numpy(), x)
    from_host = dpmini.comm.broadcast(x, devs)
    for o in from_host:
        np.testing.assert_array_equal(o.numpy(), x)


def test_broadcast_coalesced_mixed():
    arrays = [sample((3,), "float32"), sample((2, 2), "int64"), sample((5,), "float16")]
    devs = [0, 1] if NGPU >= 2 else [0, 0]
    gpu_arrays = [dpmini.asarray(a, devs[0]) for a in arrays]
    rows = dpmini.comm.broadcast_coalesced(gpu_arrays, devs, buffer_size=8)
    assert len(rows) == 2
    for row, d in zip(rows, devs):
        for o, a in zip(row, arrays):
            assert o.device == f"cuda:{d}"
            np.testing.assert_array_equal(o.numpy(), a)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "uint8",
                                   "complex64", "float16", "bool"])
@pytest.mark.parametrize("devs", DEVICE_LISTS, ids=str)
def test_reduce_add(dtype, devs):
    xs = [sample((4, 5), dtype, seed=i) for i in range(len(devs))]
    arrays = [dpmini.asarray(x, d) for x, d in zip(xs, devs)]
    want = xs[0].copy()
    for x in xs[1:]:
        want += x
    r = dpmini.comm.reduce_add(arrays, destination=devs[0])
    assert isinstance(r, dpmini.Array) and r.device == f"cuda:{devs[0]}"
    np.testing.assert_array_equal(r.numpy(), want)
    h = dpmini.comm.reduce_add(arrays, destination="cpu")
    np.testing.assert_array_equal(h, want)


def test_reduce_add_strided_and_host_inputs():
    x = sample((6, 4), "float32")
    a = dpmini.comm.scatter(dpmini.asarray(x, 0), [0, 0], dim=1)  # strided views
    r = dpmini.comm.reduce_add([a[0], a[1], x[:, :2]], destination=0)
    np.testing.assert_array_equal(r.numpy(), x[:, :2] + x[:, 2:] + x[:, :2])


def test_reduce_add_coalesced():
    per = [[sample((3,), "float32", i), sample((2, 2), "int64", i)] for i in range(3)]
    gper = [[dpmini.asarray(t, 0) for t in row] for row in per]
    sums = dpmini.comm.reduce_add_coalesced(gper, destination=0)
    np.testing.assert_array_equal(sums[0].numpy(), sum(r[0] for r in per))
    np.testing.assert_array_equal(sums[1].numpy(), sum(r[1] for r in per))


@real_gpu
@two_gpus
def test_nccl_paths_on_distinct_gpus():
    """Distinct GPUs use NCCL when it loads; the results equal the fallback's."""
    x = sample((1024,), "float32")
    devs = list(range(NGPU))
    out = dpmini.comm.broadcast(dpmini.asarray(x, 0), devs)
    for o in out:
        np.testing.assert_array_equal(o.numpy(), x)
    r = dpmini.comm.reduce_add(out, destination=0)
    np.testing.assert_array_equal(r.numpy(), x * len(devs))
    print("nccl:", dpmini._dpmini.cuda_build_info()["nccl"])


@real_gpu
def test_torch_comm_parity():
    torch = need_torch_cuda()
    x = sample((10, 6), "float32")
    for dim in (0, 1, -1):
        ours = [c.numpy() for c in dpmini.comm.scatter(x, [0, 0, 0], dim=dim)]
        theirs = [t.cpu().numpy() for t in
                  torch.cuda.comm.scatter(torch.from_numpy(x), [0, 0, 0], dim=dim)]
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(a, b)


# ---- NCCL: dtypes, the emulated stand-in, communicator lifetime ----

def test_nccl_dtype_mapping():
    """NCCL has no 16-bit integers: reduce_add must not hand it int16/uint16."""
    m = _testing.nccl_dtypes()
    assert m == {"int8": True, "uint8": True, "int16": False, "uint16": False,
                 "int32": True, "uint32": True, "int64": True, "uint64": True,
                 "float32": True, "float64": True, "float16": True}


@pytest.fixture
def emulated_nccl():
    if not EMULATED:
        pytest.skip("the NCCL stand-in exists in emulated builds only")
    was = _testing.emulated_nccl(1)
    yield
    _testing.emulated_nccl(1 if was else 0)


@two_gpus
@pytest.mark.parametrize("nccl", ["absent", "present"])
@pytest.mark.parametrize("dtype", ["int16", "uint16", "float32", "int64", "float16"])
def test_reduce_add_on_distinct_gpus_with_and_without_nccl(nccl, dtype, request):
    if nccl == "present":
        request.getfixturevalue("emulated_nccl")
    x = sample((33, 5), dtype)
    parts = [dpmini.asarray(x, 0), dpmini.asarray(x + 1, 1)]
    calls = cuda_debug()["nccl_calls"]
    r = dpmini.comm.reduce_add(parts, destination=0)
    assert r.device == "cuda:0" and r.dtype == x.dtype
    np.testing.assert_array_equal(r.numpy(), (x + x + 1).astype(dtype))
    used_nccl = cuda_debug()["nccl_calls"] - calls
    assert used_nccl == (nccl == "present" and dtype not in ("int16", "uint16"))
    b = dpmini.comm.broadcast(dpmini.asarray(x, 1), [0, 1])
    for o in b:
        np.testing.assert_array_equal(o.numpy(), x)


@pytest.mark.skipif(not EMULATED, reason="the NCCL stand-in exists in emulated builds only")
def test_nccl_communicator_cache_destroy_and_abort(tmp_path):
    """Runs with 4 emulated GPUs in a subprocess: 12 device lists overflow the
    8-entry cache (the rest are destroyed after use); a failed collective
    aborts and evicts its communicators; threads share an entry safely."""
    import os
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import itertools, threading
        import numpy as np
        import dpmini
        from dpmini import _testing
        dbg = _testing.cuda_debug
        _testing.emulated_nccl(1)
        x = np.arange(100, dtype="float32")
        lists = list(itertools.permutations(range(4), 2))
        for devs in lists:
            out = dpmini.comm.broadcast(dpmini.asarray(x, devs[0]), list(devs))
            assert all((o.numpy() == x).all() for o in out)
        d = dbg()
        assert d["nccl_destroyed"] == len(lists) - 8, d
        assert d["nccl_live_comms"] == 16, d  # 8 cached lists of 2
        _testing.emulated_nccl(-1, 3)  # the next group fails (ncclInternalError)
        try:
            dpmini.comm.broadcast(dpmini.asarray(x, 0), [0, 1])
        except dpmini.NcclError as e:
            assert "ncclGroupEnd" in str(e), e
        else:
            raise AssertionError("no NcclError")
        d = dbg()
        assert d["nccl_aborted"] == 1 and d["nccl_live_comms"] == 14, d
        out = dpmini.comm.broadcast(dpmini.asarray(x, 0), [0, 1])  # a fresh set
        assert (out[1].numpy() == x).all()
        errs = []
        def work():
            try:
                for _ in range(20):
                    r = dpmini.comm.reduce_add(
                        [dpmini.asarray(x, 2), dpmini.asarray(x, 3)], destination=2)
                    assert (r.numpy() == 2 * x).all()
            except Exception as e:
                errs.append(e)
        ts = [threading.Thread(target=work) for _ in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert not errs, errs
        print("ok", dbg())
    """)
    here = os.path.dirname(os.path.dirname(os.path.abspath(dpmini.__file__)))
    env = dict(os.environ, DPMINI_EMULATE_GPUS="4", PYTHONPATH=here)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


# ---- 2D copies with pitches cudaMemcpy2D refuses take the pack path ----

class RawCAI:
    def __init__(self, ptr, shape, strides, typestr="|u1", owner=None):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": shape, "strides": strides, "typestr": typestr, "data": (ptr, False),
            "version": 3, "stream": None}


def test_2d_copy_with_pitch_over_int_max_falls_back():
    pitch, width = (1 << 31) + 512, 2048
    big = dpmini.empty((pitch + width,), "uint8", device=0)  # ~2 GiB, never touched
    try:
        rows = RawCAI(big.data_ptr, (2, width), (pitch, 1), owner=big)
        x = sample((2, width), "uint8")
        for i in range(2):  # write each row through a contiguous 1-row view
            row = RawCAI(big.data_ptr + i * pitch, (1, width), None, owner=big)
            dpmini.comm.gather([dpmini.asarray(x[i:i + 1], 0)], out=row)
        got = dpmini.comm.gather([rows], destination=0)  # device -> same device
        np.testing.assert_array_equal(got.numpy(), x)
        host_out = dpmini.comm.gather([rows], destination="cpu")
        np.testing.assert_array_equal(host_out, x)
    finally:
        del big
        dpmini.empty_cache()
