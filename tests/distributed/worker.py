"""Worker for tests/test_distributed.py: run under mpirun, one case per launch.

    mpirun -np 4 python tests/distributed/worker.py CASE

Each rank writes lines "<rank> OK <what>" or "<rank> ERR <case> <Type>: <message>"
(one line, newlines escaped as |) to $DIST_TEST_OUT/rank<r>.txt, and the pytest side asserts on them and on
the exit code. Values are checked here with asserts (an AssertionError ends the
job non-zero through dpmini's abort hook).
"""
import os
import sys
import time

import numpy as np

import dpmini
import dpmini.distributed as dist

CASE = sys.argv[1]


def say(msg):
    """One line to this rank's file in $DIST_TEST_OUT (stdout lines of ranks interleave)."""
    line = f"{RANK} {msg}".replace("\n", "|")
    print(line, flush=True)
    out = os.environ.get("DIST_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{RANK}.txt"), "a") as f:
            f.write(line + "\n")


def err(case, exc):
    say(f"ERR {case} {type(exc).__name__}: {exc}")


# ------------------------------------------------------------------ values
DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
          np.uint64, np.float16, np.float32, np.float64, np.longdouble, np.complex64,
          np.complex128, ">f8", "<U3", "S2", "M8[s]", "m8[ms]", [("a", "<i4"), ("b", "<f8")]]


def make(shape, dtype, seed=0):
    raw = np.random.default_rng(seed).integers(0, 100, size=shape)
    dt = np.dtype(dtype)
    if dt.fields:
        out = np.zeros(shape, dt)
        out["a"], out["b"] = raw, raw / 7
        return out
    if dt.kind in "US":
        return raw.astype(str).astype(dt)
    return raw.astype(dt)


def same(a, b):
    """Equal values (not bytes: longdouble carries padding bytes)."""
    if a.shape != b.shape:
        return False
    if b.dtype.fields and not a.dtype.fields:   # documented: raw void off root
        assert a.dtype.itemsize == b.dtype.itemsize
        a = a.view(b.dtype)
    if a.dtype.fields:
        return all(np.array_equal(a[f], b[f]) for f in a.dtype.fields)
    return np.array_equal(a, b)


def pieces_of(n, P, **kw):
    sizes = dist.split_sizes(n, P, **kw)
    return sizes, np.concatenate([[0], np.cumsum(sizes)]).astype(int)


def case_values():
    P = dist.size()
    assert dist.is_initialized()
    for n in (0, 1, P - 1 if P > 1 else 1, 9, 10, 2 * P + 1):
        for dim in (0, 1, -1):
            for dtype in DTYPES:
                shape = [2, 3, 4]
                shape[dim] = n
                x = make(tuple(shape), dtype, seed=n)
                sizes, off = pieces_of(n, P)
                piece = dist.scatter(x if RANK == 0 else None, dim=dim)
                want = np.take(x, np.arange(off[RANK], off[RANK + 1]), axis=dim)
                assert piece.shape == want.shape, (n, dim, dtype, piece.shape, want.shape)
                assert piece.dtype.itemsize == x.dtype.itemsize
                assert same(piece, want), (n, dim, dtype)
                back = dist.gather(piece, dim=dim)
                if RANK == 0:
                    assert same(back, x), (n, dim, dtype)
                    if not x.dtype.fields:
                        assert back.dtype == x.dtype
                else:
                    assert back is None
                every = dist.all_gather(piece, dim=dim)
                assert same(every, x), (n, dim, dtype)
    say("OK roundtrip")
    # explicit sizes and weights, root != 0, non-contiguous input
    x = make((11, 5), np.float64)
    cs = [11 - 3 * (P - 1)] + [3] * (P - 1) if P > 1 else [11]
    for kw in ({"chunk_sizes": cs}, {"weights": [1.0 + r for r in range(P)]}):
        sizes, off = pieces_of(11, P, **kw)
        piece = dist.scatter(x if RANK == P - 1 else None, root=P - 1, **kw)
        assert np.array_equal(piece, x[off[RANK]:off[RANK + 1]]), kw
        back = dist.gather(piece, root=P - 1)
        assert (RANK != P - 1 and back is None) or np.array_equal(back, x)
    strided = make((6, 8), np.int32)[:, ::2]
    piece = dist.scatter(strided if RANK == 0 else None, dim=1)
    sizes, off = pieces_of(4, P)
    assert np.array_equal(piece, strided[:, off[RANK]:off[RANK + 1]])
    say("OK sizes")
    # reductions
    v = np.arange(6, dtype=np.int64).reshape(2, 3) + RANK
    ranks = np.arange(P)
    assert np.array_equal(dist.all_reduce(v), np.arange(6).reshape(2, 3) * P + ranks.sum())
    assert np.array_equal(dist.all_reduce(v, "max"), np.arange(6).reshape(2, 3) + P - 1)
    assert np.array_equal(dist.all_reduce(v, "min"), np.arange(6).reshape(2, 3))
    m = dist.all_reduce(v.astype(np.float32), "mean")
    assert m.dtype == np.float32 and np.allclose(m, np.arange(6).reshape(2, 3) + ranks.mean())
    assert dist.all_reduce(np.float64(RANK)).shape == ()
    assert float(dist.all_reduce(np.float64(RANK))) == ranks.sum()
    b = dist.all_reduce(np.array([RANK == 0, True]), "min")
    assert b.tolist() == [P == 1, True]
    c = dist.all_reduce(np.array([1 + 1j * RANK], np.complex128))
    assert c[0] == P + 1j * ranks.sum()
    assert dist.all_reduce(np.zeros((0, 3))).shape == (0, 3)
    r = dist.reduce(v, root=P - 1)
    assert (RANK == P - 1 and np.array_equal(r, np.arange(6).reshape(2, 3) * P + ranks.sum())) \
        or (RANK != P - 1 and r is None)
    # either byte order on any rank: summed as the numbers they are, returned native
    swapped = np.arange(3.0).astype(">f8" if RANK % 2 == 0 else "<f8")
    s = dist.all_reduce(swapped)
    assert s.dtype == np.float64 and s.dtype.isnative and s.tolist() == [0.0, P, 2.0 * P]
    # 8- and 16-bit integer sums wrap as NumPy's do (Open MPI 4.1's AVX sum saturates
    # from 16 elements up), in the input's dtype
    for dt in (np.int8, np.uint8, np.int16, np.uint16):
        top = np.full(64, np.iinfo(dt).max - RANK, dt)
        want = np.sum(np.stack([np.full(64, np.iinfo(dt).max - k, dt) for k in range(P)]),
                      axis=0, dtype=dt)
        got = dist.all_reduce(top)
        assert got.dtype == dt and np.array_equal(got, want), (dt, got[:3], want[:3])
        red = dist.reduce(top, root=0)
        assert (RANK == 0 and np.array_equal(red, want)) or (RANK != 0 and red is None)
    say("OK reduce")
    # broadcast arrays and objects
    a = dist.broadcast(make((3, 4), ">f8") if RANK == P - 1 else None, root=P - 1)
    assert a.dtype == np.dtype(">f8") and np.array_equal(a, make((3, 4), ">f8"))
    o = dist.broadcast({"k": [1, 2.5, "x"], "rank": RANK} if RANK == 0 else None)
    assert o == {"k": [1, 2.5, "x"], "rank": 0}
    assert dist.broadcast(np.float32(2.5) if RANK == 0 else None).tolist() == 2.5
    dist.barrier()
    assert 0 <= dist.local_rank() < dist.local_size() <= P
    say("OK broadcast")


# ------------------------------------------------------------------ disagreement
def case_mismatch():
    P = dist.size()
    calls = [
        ("shape", lambda: dist.all_reduce(np.zeros(5 if RANK == P - 1 else 4))),
        ("dtype", lambda: dist.all_reduce(np.zeros(4, np.float32 if RANK == 1 else np.float64))),
        ("op", lambda: dist.all_reduce(np.zeros(4), "max" if RANK == 2 else "sum")),
        ("gather_shape", lambda: dist.gather(np.zeros((RANK + 1, 3 if RANK else 2)))),
        ("root", lambda: dist.reduce(np.zeros(2), root=1 if RANK == 0 else 0)),
        ("kind", lambda: dist.all_gather(np.zeros(2)) if RANK == 3 else dist.all_reduce(np.zeros(2))),
        ("split", lambda: dist.scatter(np.zeros(8) if RANK == 0 else None,
                                       chunk_sizes=[2, 2, 2, 2] if RANK else [5, 1, 1, 1])),
        ("bad_dim", lambda: dist.gather(np.zeros((2, 2)), dim=7 if RANK == 2 else 0)),
        ("bad_sizes", lambda: dist.scatter(np.zeros(8) if RANK == 0 else None,
                                           chunk_sizes=[1, 1, 1, 1])),
        ("bad_op", lambda: dist.all_reduce(np.zeros(2, np.int64), "mean")),
        ("unpicklable", lambda: dist.broadcast((lambda: 0) if RANK == 0 else None)),
        ("root_none", lambda: dist.scatter(None)),
        # arguments of the wrong type or size on one rank go through the guard too
        ("type_op", lambda: dist.all_reduce(np.zeros(2), None if RANK == 0 else "sum")),
        ("type_root", lambda: dist.scatter(np.zeros(8) if RANK == 0 else None,
                                           root=0.0 if RANK == 1 else 0)),
        ("type_dim", lambda: dist.gather(np.zeros((2, 2)), dim="0" if RANK == 3 else 0)),
        ("huge_root", lambda: dist.broadcast(np.zeros(2), root=2**70 if RANK == 2 else 0)),
        ("masked", lambda: dist.all_reduce(np.ma.masked_array(np.zeros(2), [0, 1])
                                           if RANK == 1 else np.zeros(2))),
        ("fields", lambda: dist.gather(np.zeros(1, "f4,i8" if RANK == 1 else "i4,f8"))),
        ("byteorder", lambda: dist.gather(np.zeros(2, (">f8" if np.little_endian else "<f8")
                                                    if RANK == 2 else "=f8"))),
        # raw void (what scatter hands a non-root rank) on rank 0: the fields of the
        # ranks that have them are still compared with each other
        ("fields_void", lambda: dist.gather(np.zeros(1, "V12" if RANK == 0 else
                                                     "f4,i8" if RANK == 3 else "i4,f8"))),
        ("array_root", lambda: dist.scatter(np.zeros(8) if RANK == 0 else None,
                                            root=np.array([0, 0]) if RANK == 1 else 0)),
    ]
    for name, call in calls:
        try:
            call()
            say(f"NOERR {name}")
        except Exception as exc:  # every rank must raise, and go on
            err(name, exc)
        # the communicator stays usable after every one of them
        assert float(dist.all_reduce(np.float64(1.0))) == P
    say("OK mismatch")


def case_skip():
    """Rank P-1 runs one step fewer and exits; the others must get TimeoutError."""
    dist.set_timeout(3.0)
    steps = 2 if RANK == dist.size() - 1 else 3
    for _ in range(steps):
        dist.all_reduce(np.ones(4))
    say("finished loop")


def case_raise():
    """Rank 1 raises; the others wait in a collective with a long timeout."""
    dist.set_timeout(120.0)
    if RANK == 1:
        raise RuntimeError("boom on rank 1")
    dist.all_reduce(np.ones(4))
    say("NOT REACHED")


def case_ddp():
    """reduce_gradients over an uneven split equals the single-process gradient."""
    P = dist.size()

    class Linear:
        def __init__(self, seed):
            rng = np.random.default_rng(seed)
            self.W = rng.normal(size=(5, 3))
            self.b = rng.normal(size=3)

        def __call__(self, x, y):   # summed squared error and its gradients
            err_ = x @ self.W + self.b - y
            return {"loss": float((err_ ** 2).sum()),
                    "grads": {"W": 2 * x.T @ err_, "b": 2 * err_.sum(axis=0)}}

    model = Linear(seed=100 + RANK)
    ddp = dist.DistributedDataParallel(model, device_ids=["cpu:0", "cpu:1"],
                                       out_dims={"loss": "sum", "grads": "sum"})
    ref = Linear(seed=100)
    assert np.array_equal(model.W, ref.W) and np.array_equal(model.b, ref.b)
    rng = np.random.default_rng(7)
    X, Y = rng.normal(size=(11, 5)), rng.normal(size=(11, 3))
    full = ref(X, Y)["grads"]
    want = {k: g / len(X) for k, g in full.items()}
    for kw in ({}, {"chunk_sizes": [5, 0, 4, 2][:P] if P == 4 else None}):
        kw = {k: v for k, v in kw.items() if v is not None}
        xs = dist.scatter(X if RANK == 0 else None, **kw)
        ys = dist.scatter(Y if RANK == 0 else None, **kw)
        out = ddp(xs, ys)
        rows = len(xs)
        means = {k: (g / rows if rows else np.full_like(g, np.nan)) for k, g in out["grads"].items()}
        got = ddp.reduce_gradients(means)
        for k in want:
            assert np.max(np.abs(got[k] - want[k])) <= 1e-12, (k, kw)
        summed = dist.DistributedDataParallel.reduce_gradients(ddp, out["grads"], weights="sum")
        for k in want:
            assert np.max(np.abs(summed[k] - full[k])) <= 1e-12
    plan = ddp.explain(X)
    assert [b - a for a, b in plan.ranks] == dist.split_sizes(11)
    say("OK ddp")


def case_caught_timeout():
    """The ranks catch the TimeoutError and return normally: the job must still
    end (non-zero) instead of waiting in MPI_Finalize on messages in flight."""
    dist.set_timeout(2.0)
    if RANK == dist.size() - 1:
        say("left early")
        return
    try:
        dist.barrier()
    except TimeoutError as exc:
        err("caught_timeout", exc)
    try:
        dist.all_reduce(np.ones(2))
    except RuntimeError as exc:
        err("after_timeout", exc)


def case_misc():
    """DDP parameter mismatch, reduce_gradients and init argument errors, explain."""
    P = dist.size()

    class M:
        def __init__(self):
            self.W = np.zeros((3, 2) if RANK != P - 1 else (2, 3))

        def __call__(self, x):
            return x

    try:
        dist.DistributedDataParallel(M(), device_ids=["cpu:0"])
    except ValueError as exc:
        err("ddp_mismatch", exc)
    for name, call in [
        ("rows_missing", lambda: dist.reduce_gradients({"w": np.ones(2)})),
        ("int_grads", lambda: dist.reduce_gradients({"w": np.ones(2, np.int64)}, weights="sum")),
        ("bad_weights", lambda: dist.reduce_gradients([np.ones(2)], weights="median")),
        ("bad_timeout", lambda: dist.init(timeout=-1.0)),
        ("bad_comm", lambda: dist.init(comm=object())),
    ]:
        try:
            call()
            say(f"NOERR {name}")
        except (TypeError, ValueError) as exc:
            err(name, exc)
    got = dist.reduce_gradients((np.full(2, float(RANK)),), weights="mean")
    assert isinstance(got, tuple) and np.allclose(got[0], (P - 1) / 2)
    got = dist.reduce_gradients({"g": np.full(2, float(RANK))}, weights=float(RANK))
    assert np.allclose(got["g"], sum(r * r for r in range(P)) / max(sum(range(P)), 1)) or P == 1
    plan = dist.explain(9, ["cpu:0", "cpu:1"], size=4)
    assert plan.ranks == [(0, 3), (3, 6), (6, 9), (9, 9)], plan.ranks
    assert plan.devices[3] == [("cpu:0", 9, 9), ("cpu:1", 9, 9)], plan.devices
    assert "rank 3: rows 9:9 (0)" in str(plan)
    assert dist.split_sizes(10, 4) == [3, 3, 3, 1]
    assert dist.split_sizes(10, 2, weights=[1, 3]) == [3, 7]
    dist.init(timeout=5.0)              # again: replaces the communicator
    assert dist.all_reduce(np.ones(1))[0] == P
    say("OK misc")


def case_ddp_indims():
    """in_dims=(None, 0, 0): last_rows counts the split batch, not the broadcast table."""
    class M:
        def __init__(self):
            self.W = np.ones((3, 1))

        def __call__(self, table, x, y):
            return {"gsum": x.T @ (x @ self.W - y)}

    rng = np.random.default_rng(0)
    X, Y = rng.normal(size=(11, 3)), rng.normal(size=(11, 1))
    ddp = dist.DistributedDataParallel(M(), device_ids=["cpu:0", "cpu:1"], in_dims=(None, 0, 0),
                                       out_dims={"gsum": "sum"})
    x, y = dist.scatter(X if RANK == 0 else None), dist.scatter(Y if RANK == 0 else None)
    out = ddp(np.zeros((50, 4)), x, y)
    assert ddp.last_rows == len(x), (ddp.last_rows, len(x))
    g = ddp.reduce_gradients({"W": out["gsum"] / max(len(x), 1)})["W"]
    ref = X.T @ (X @ np.ones((3, 1)) - Y) / 11
    assert np.max(np.abs(g - ref)) <= 1e-12
    ddp2 = dist.DistributedDataParallel(M(), device_ids=["cpu:0", "cpu:1"], in_dims=(None, 0, 0),
                                        chunk_sizes=[len(x), 0], out_dims={"gsum": "sum"})
    ddp2(np.zeros((50, 4)), x, y)
    assert ddp2.last_rows == len(x), (ddp2.last_rows, len(x))
    say("OK ddp_indims")


def case_dict_keys():
    """reduce_gradients pairs dict entries by key; different key sets raise everywhere."""
    a, b = np.full(2, 1.0), np.full(2, 2.0)
    d = {"a": a, "b": b} if RANK % 2 == 0 else {"b": b, "a": a}
    got = dist.reduce_gradients(d, weights="mean")
    assert list(got) == list(d)
    assert np.array_equal(got["a"], a) and np.array_equal(got["b"], b), got
    for name, g in [
        ("shape_differs", {"w": np.ones(3 if RANK == 0 else 2), "b": np.ones(5)}),
        ("dtype_differs", [np.ones(2), np.ones(2, np.float32 if RANK == 1 else np.float64)]),
        ("count_differs", [np.ones(2)] * (2 if RANK == 2 else 1)),
    ]:
        try:
            dist.reduce_gradients(g, weights="sum")
            say(f"NOERR {name}")
        except ValueError as exc:
            err(name, exc)
        assert dist.all_reduce(np.ones(1))[0] == dist.size()   # still usable
    bad = dict(d)
    if RANK == dist.size() - 1:
        bad["c"] = np.ones(2)
    try:
        dist.reduce_gradients(bad, weights="mean")
        say("NOERR dict_keys")
    except ValueError as exc:
        err("dict_keys", exc)
    assert dist.all_reduce(np.ones(1))[0] == dist.size()   # still usable
    say("OK dict_keys")


def case_torch():
    """torch modules are broadcast at construction; collectives return torch tensors."""
    import torch

    torch.manual_seed(RANK)
    lin = torch.nn.Linear(3, 2)
    lin.register_buffer("count", torch.full((1,), float(RANK)))
    dist.DistributedDataParallel(lin, device_ids=["cpu:0"])
    w = dist.all_gather(lin.weight.detach()[None])
    assert isinstance(w, torch.Tensor) and all(torch.equal(w[0], w[i]) for i in range(len(w)))
    assert lin.count.item() == 0.0 and lin.weight.requires_grad

    t = torch.full((2,), float(RANK), requires_grad=True)
    g = dist.reduce_gradients({"w": t, "n": np.ones(1)}, weights="mean")
    assert isinstance(g["w"], torch.Tensor) and isinstance(g["n"], np.ndarray)
    P = dist.size()
    assert torch.allclose(g["w"], torch.full((2,), (P - 1) / 2, dtype=torch.float32))
    s = dist.all_reduce(torch.ones(3, dtype=torch.int64))
    assert isinstance(s, torch.Tensor) and s.dtype == torch.int64 and s.tolist() == [P] * 3
    r = dist.reduce(torch.ones(2))
    assert (r is None) == (RANK != 0) and (r is None or isinstance(r, torch.Tensor))
    piece = dist.scatter(torch.arange(8.0) if RANK == 0 else None)
    assert isinstance(piece, torch.Tensor) == (RANK == 0)
    back = dist.gather(torch.as_tensor(piece))
    assert (back is None) == (RANK != 0)
    assert back is None or (isinstance(back, torch.Tensor) and back.tolist() == list(range(8)))
    b = dist.broadcast(torch.arange(3) if RANK == 0 else None)
    assert isinstance(b, torch.Tensor) and b.tolist() == [0, 1, 2]
    if os.environ.get("DPMINI_SANITIZER"):     # jaxlib aborts under LD_PRELOADed ASan
        say("OK torch (no jax)")
        return
    try:
        import jax.numpy as jnp
    except ImportError:
        say("OK torch (no jax)")
        return

    class J:
        def __init__(self):
            self.W = jnp.full((2, 2), float(RANK))

        def __call__(self, x):
            return x

    m = J()
    dist.DistributedDataParallel(m, device_ids=["cpu:0"])
    assert type(m.W).__module__.split(".")[0] in ("jax", "jaxlib") and float(m.W[0, 0]) == 0.0
    say("OK torch")


# ------------------------------------------------------------------ GPU arrays (emulated build)
# Run with PYTHONPATH=build/emulated and DPMINI_EMULATE_GPUS >= ranks: "cuda:N"
# arrays are dpmini.Array, NCCL is emulated over MPI (csrc/dist/dist_nccl_emu.c).
NCCL_DTYPES = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16,
               np.float32, np.float64]


def on_gpu(a, dev=None):
    return dpmini.asarray(np.ascontiguousarray(a), f"cuda:{RANK if dev is None else dev}")


def host_reduce(base, P, op, dtype):
    """What every rank's base + rank combines to (float16 has no MPI type)."""
    stack = np.stack([(base + r).astype(dtype) for r in range(P)]).astype(np.float64)
    out = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0),
           "mean": stack.mean(0)}[op]
    return out.astype(dtype)


def case_gpu():
    P = dist.size()
    dist.all_reduce(np.ones(2))   # host collectives load no NCCL
    assert dist.nccl_info() == "not loaded", dist.nccl_info()
    base = np.arange(12).reshape(3, 4) % 5
    for dt in NCCL_DTYPES:
        v = (base + RANK).astype(dt)
        for op in ("sum", "max", "min") + (("mean",) if np.dtype(dt).kind == "f" else ()):
            got = dist.all_reduce(on_gpu(v), op)
            assert isinstance(got, dpmini.Array) and str(got.device) == f"cuda:{RANK}", got
            want = host_reduce(base, P, op, dt)
            if dt != np.float16:   # the host path, where MPI has the dtype
                host = dist.all_reduce(v, op)
                assert host.dtype == want.dtype and np.array_equal(host, want), (dt, op)
            assert got.numpy().dtype == want.dtype and np.array_equal(got.numpy(), want), (dt, op)
    assert dist._state.comm.nccl_device == RANK
    assert "emulated" in dist.nccl_info()
    v = (base + RANK).astype(np.float64)
    r = dist.reduce(on_gpu(v), root=P - 1, op="max")
    h = dist.reduce(v, root=P - 1, op="max")
    assert (r is None) == (h is None) == (RANK != P - 1)
    assert r is None or (isinstance(r, dpmini.Array) and np.array_equal(r.numpy(), h))
    z = dist.all_reduce(on_gpu(np.zeros((0, 3), np.float32)))
    assert z.shape == (0, 3)
    say("OK gpu reduce")
    x = make((5, 3), np.int64, seed=3)
    b = dist.broadcast(on_gpu(x) if RANK == 0 else None)
    assert isinstance(b, dpmini.Array) and str(b.device) == f"cuda:{RANK}"
    assert np.array_equal(b.numpy(), dist.broadcast(x if RANK == 0 else None))
    c16 = dist.broadcast(on_gpu(x.astype(np.complex128)) if RANK == 0 else None)
    assert np.array_equal(c16.numpy(), x.astype(np.complex128))   # bytes: any dtype
    hint = on_gpu(np.zeros(1, np.float32))   # off root: names the device only
    b = dist.broadcast(on_gpu(x.astype(np.float32)) if RANK == P - 1 else hint, root=P - 1)
    assert np.array_equal(b.numpy(), x.astype(np.float32)) and b.shape == (5, 3)
    say("OK gpu broadcast")
    for dim in (0, 1, -1):
        for dt, n in ((np.float32, 2 * P + 1), (np.int8, P - 1), (np.float16, 0),
                      (np.complex64, P + 2), (np.int16, 3)):   # bytes: any dtype
            shape = [2, 3, 4]
            shape[dim] = n
            x = make(tuple(shape), dt, seed=dim + 5)
            piece = dist.scatter(on_gpu(x) if RANK == 0 else None, dim=dim)
            hpiece = dist.scatter(x if RANK == 0 else None, dim=dim)
            assert isinstance(piece, dpmini.Array) and str(piece.device) == f"cuda:{RANK}"
            assert piece.dtype == x.dtype and np.array_equal(piece.numpy(), hpiece), (dim, dt)
            back = dist.gather(piece, dim=dim)
            assert (back is None) == (RANK != 0)
            assert back is None or (isinstance(back, dpmini.Array) and
                                    np.array_equal(back.numpy(), x)), (dim, dt)
            every = dist.all_gather(piece, dim=dim)
            assert isinstance(every, dpmini.Array) and str(every.device) == f"cuda:{RANK}"
            assert np.array_equal(every.numpy(), x), (dim, dt)
    x = make((11, 5), np.float64)
    hint = on_gpu(np.zeros(1))   # off root: names the device only
    piece = dist.scatter(on_gpu(x) if RANK == P - 1 else hint, root=P - 1, dim=0,
                         weights=[1.0 + r for r in range(P)])
    want = dist.scatter(x if RANK == P - 1 else None, root=P - 1, weights=[1.0 + r for r in range(P)])
    assert np.array_equal(piece.numpy(), want)
    back = dist.gather(piece, root=P - 1)
    assert (RANK != P - 1 and back is None) or np.array_equal(back.numpy(), x)
    say("OK gpu scatter gather")
    try:
        dist.all_reduce(on_gpu(np.zeros(3, np.int16)))
    except TypeError as exc:
        err("int16", exc)
    try:   # the communicator is on cuda:RANK
        dist.all_reduce(on_gpu(np.zeros(3), dev=(RANK + 1) % 4))
    except ValueError as exc:
        err("other_device", exc)
    # No device memory kept by a collective: results freed, everything freed.
    import gc
    gc.collect()
    before = dpmini.memory_allocated(f"cuda:{RANK}")
    x = on_gpu(make((2 * P + 1, 3), np.float32))
    for _ in range(20):
        dist.all_reduce(x)
        dist.reduce(x, root=0)
        dist.broadcast(x if RANK == 0 else None)
        dist.gather(dist.scatter(x if RANK == 0 else None, dim=1), dim=1)
        dist.all_gather(x, dim=1)
    del x
    gc.collect()
    assert dpmini.memory_allocated(f"cuda:{RANK}") == before, \
        (before, dpmini.memory_allocated(f"cuda:{RANK}"))
    dist.barrier()
    say("OK gpu")


def case_gpu_errors():
    P = dist.size()
    # Two ranks on one GPU (every rank on cuda:RANK % 2), before any communicator.
    try:
        dist.all_reduce(on_gpu(np.ones(2), dev=RANK % 2))
    except ValueError as exc:
        err("same_gpu", exc)
    # Host on one rank, GPU on the others.
    v = np.ones(4) * RANK
    try:
        dist.all_reduce(v if RANK == 2 else on_gpu(v))
    except ValueError as exc:
        err("host_vs_gpu", exc)
    try:
        dist.gather(v if RANK == 1 else on_gpu(v))
    except ValueError as exc:
        err("gather_host_vs_gpu", exc)
    ok = dist.all_reduce(on_gpu(v))   # still usable: the right devices now
    assert np.array_equal(ok.numpy(), np.ones(4) * sum(range(P)))
    say("OK gpu agreement")
    for fault in ("fail", "error"):
        os.environ["DPMINI_DIST_NCCL_FAULT"] = fault
        start = time.monotonic()
        try:
            dist.all_reduce(on_gpu(v))
        except RuntimeError as exc:
            err(fault, exc)
        del os.environ["DPMINI_DIST_NCCL_FAULT"]
        assert time.monotonic() - start < 10
        try:   # GPU collectives are off now, on every rank; host ones work
            dist.all_reduce(on_gpu(v))
        except RuntimeError as exc:
            err(fault + "_after", exc)
        assert np.array_equal(dist.all_reduce(v), np.ones(4) * sum(range(P)))
        dist.init(timeout=2.0)   # a new communicator, a new NCCL communicator
    os.environ["DPMINI_DIST_NCCL_FAULT"] = "hang"
    start = time.monotonic()
    try:
        dist.all_reduce(on_gpu(v))
    except TimeoutError as exc:
        err("hang", exc)
        say(f"took {time.monotonic() - start:.1f}")
    # Ctrl-C (here a timer's handler) while waiting for a stalled NCCL call
    dist.init(timeout=60.0)
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt("timer")
    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    start = time.monotonic()
    try:
        dist.all_reduce(on_gpu(v))
    except KeyboardInterrupt:
        say(f"interrupted after {time.monotonic() - start:.1f} s: {dist._state.comm.nccl_broken}")
    del os.environ["DPMINI_DIST_NCCL_FAULT"]
    dist.barrier()
    say("OK gpu_errors")


class HostClaimingCuda:
    """Host memory that says it is on cuda:0 (DLPack and the CUDA Array Interface)."""

    def __init__(self, a, dev=0):
        self.a, self.dev = a, dev

    def __dlpack_device__(self):
        return (2, self.dev)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "version": 3,
                "data": (self.a.ctypes.data, False), "strides": None}


def case_gpu_no_device():
    """The real NCCL path (dlopen of libcudart and libnccl) on a machine without a GPU."""
    if dpmini._dpmini.cuda_build_info()["device_count"] > 0:
        say("SKIP a GPU is present")
        return
    dist._gpu_alloc = lambda lib, shape, typestr, dev: HostClaimingCuda(np.empty(shape, typestr))
    try:
        dist.all_reduce(HostClaimingCuda(np.ones(3)))
    except RuntimeError as exc:
        err("no_device", exc)
    say(f"INFO {dist.nccl_info()}")
    assert np.array_equal(dist.all_reduce(np.ones(3)), np.ones(3) * dist.size())
    say("OK gpu_no_device")


def case_gpu_real():
    """On a real GPU (tools/gpu_check.sh, mpirun -np 1): all_reduce, reduce and
    broadcast of torch and dpmini GPU arrays through the real NCCL."""
    libs = []
    try:
        import torch
        if torch.cuda.is_available():
            libs.append("torch")
    except ImportError:
        torch = None
    if dpmini._dpmini.cuda_build_info()["device_count"] > 0:
        libs.append("dpmini")
    if not libs:
        say("SKIP no GPU")
        return
    P = dist.size()
    for lib in libs:
        dtypes = NCCL_DTYPES if lib == "dpmini" else [np.int8, np.uint8, np.int32, np.int64,
                                                      np.float16, np.float32, np.float64]
        for dt in dtypes:
            base = np.arange(24).reshape(4, 6) % 7

            def dev(a):
                a = np.ascontiguousarray(a)
                return torch.from_numpy(a).to(f"cuda:{RANK}") if lib == "torch" \
                    else dpmini.asarray(a, f"cuda:{RANK}")

            def host(a):
                return a.cpu().numpy() if lib == "torch" else a.numpy()
            x = dev((base + RANK).astype(dt))
            for op in ("sum", "max", "min") + (("mean",) if np.dtype(dt).kind == "f" else ()):
                got = dist.all_reduce(x, op)
                assert type(got) is type(x) and str(got.device) == str(x.device), (lib, got)
                assert np.array_equal(host(got), host_reduce(base, P, op, dt)), (lib, dt, op)
            r = dist.reduce(x, root=0, op="sum")
            assert (r is None) == (RANK != 0)
            assert r is None or np.array_equal(host(r), host_reduce(base, P, "sum", dt))
            b = dist.broadcast(x if RANK == 0 else None)
            assert np.array_equal(host(b), base.astype(dt)), (lib, dt)
        say(f"OK gpu_real {lib}")
    say(f"INFO {dist.nccl_info()}")


def case_env_emulate():
    """DPMINI_DIST_NCCL=emulate on a build without GPUs: host memory claiming to be
    cuda:RANK goes through the emulated NCCL."""
    dist._gpu_alloc = lambda lib, shape, typestr, dev: HostClaimingCuda(np.empty(shape, typestr), dev)
    v = np.arange(6, dtype=np.int64).reshape(2, 3) + RANK
    got = dist.all_reduce(HostClaimingCuda(v, RANK))
    assert isinstance(got, HostClaimingCuda) and got.dev == RANK
    assert np.array_equal(got.a, dist.all_reduce(v))
    b = dist.broadcast(HostClaimingCuda(v, RANK) if RANK == 0 else None)
    assert np.array_equal(b.a, np.arange(6).reshape(2, 3))
    say(f"INFO {dist.nccl_info()}")
    say("OK env_emulate")


def case_hook_emulate():
    """dpmini._testing.dist_nccl_emulate(True) on a build without GPUs, instead of
    DPMINI_DIST_NCCL: the emulated NCCL moves host memory claiming to be cuda:RANK;
    switching to the real one afterwards is refused."""
    from dpmini import _testing
    _testing.dist_nccl_emulate(True)
    dist._gpu_alloc = lambda lib, shape, typestr, dev: HostClaimingCuda(np.empty(shape, typestr), dev)
    v = np.arange(6, dtype=np.int64).reshape(2, 3) + RANK
    got = dist.all_reduce(HostClaimingCuda(v, RANK))
    assert isinstance(got, HostClaimingCuda) and got.dev == RANK
    assert np.array_equal(got.a, dist.all_reduce(v))
    say(f"INFO {dist.nccl_info()}")
    try:
        _testing.dist_nccl_emulate(False)
    except RuntimeError as exc:
        err("switch", exc)
    _testing.dist_nccl_emulate(True)   # the one in use: accepted
    say("OK hook_emulate")


def case_big_reduce():
    """all_reduce of more than 2**31 elements through a broadcast_to view: the
    OverflowError comes before any copy of the view (2 GiB here)."""
    import tracemalloc
    tracemalloc.start()
    try:
        dist.all_reduce(np.broadcast_to(np.ones(1, np.int8), (2**31 + 5,)))
        say("NOERR big_reduce")
    except OverflowError as exc:
        err("big_reduce", exc)
    say(f"peak {tracemalloc.get_traced_memory()[1]}")
    tracemalloc.stop()
    assert dist.all_reduce(np.ones(2)).tolist() == [dist.size()] * 2   # still usable
    say("OK big_reduce")


def case_silent_steps():
    """Each way one rank's step could silently mix with the others' (a caught
    local error, a None gradient, another weights mode, a skipped call) is the
    same call's error on every rank, and the steps after it are right."""
    P = dist.size()
    dist.set_timeout(20.0)

    def grads(step):   # every rank's gradient of a step: the step's own value
        return {"w": np.full(3, float(step + RANK))}

    def want(step):    # the rows-weighted mean: rows = RANK + 1
        rows = np.arange(1, P + 1)
        return float((rows * (step + np.arange(P))).sum() / rows.sum())

    # 1. rows=-1 on rank 1 at step 1, caught: every rank raises at step 1 and
    #    steps 0, 2, 3 are each their own step's mean.
    for step in range(4):
        rows = -1 if (step == 1 and RANK == min(1, P - 1)) else RANK + 1
        try:
            got = dist.reduce_gradients(grads(step), rows=rows, tag=step)
            assert np.allclose(got["w"], want(step)), (step, got, want(step))
            say(f"OK rows_negative step {step}")
        except ValueError as exc:
            err(f"rows_negative_{step}", exc)
    # 2. A None gradient on the last rank: its TypeError, the others' ValueError,
    #    at once (not after the timeout).
    start = time.monotonic()
    try:
        dist.reduce_gradients([None if RANK == P - 1 else np.ones(2)], weights="mean")
        say("NOERR none_grad")
    except (TypeError, ValueError) as exc:
        err("none_grad", exc)
    say(f"none_grad took {time.monotonic() - start:.2f}")
    # 3. weights="mean" on rank 0, "rows" elsewhere: a ValueError naming both.
    try:
        dist.reduce_gradients(grads(0), weights="mean" if RANK == 0 else "rows", rows=1)
        say("NOERR weights_mode")
    except ValueError as exc:
        err("weights_mode", exc)
    # 4. The last rank skips the call tagged 1: a ValueError naming the tags on
    #    every rank; it then retries its call tagged 2, which pairs with the
    #    others' call tagged 2 and is right.
    skipper = RANK == P - 1
    for step in ([2, 2] if skipper else [1, 2]):
        try:
            got = dist.all_reduce(np.full(2, float(step)), tag=step)
            assert got.tolist() == [float(P * step)] * 2, (step, got)
            say(f"OK tagged step {step}")
        except ValueError as exc:
            err("skipped_tag", exc)
    # 5. An option error in a collective's own arguments on one rank (a
    #    bad tag type): every rank raises at that call.
    try:
        dist.all_reduce(np.ones(2), tag=1.5 if RANK == 0 else 1)
        say("NOERR bad_tag")
    except (TypeError, ValueError) as exc:
        err("bad_tag", exc)
    assert dist.all_reduce(np.ones(2)).tolist() == [float(P)] * 2   # still in step
    say("OK silent_steps")


def case_big_views():
    """Zero-stride views past MPI's int counts, or whose copy needs more memory
    than the machine has: the error comes before any copy (tracemalloc's peak
    stays small), on every rank, and the communicator stays usable."""
    import tracemalloc
    huge = np.broadcast_to(np.ones(1, np.int8), (2**31 + 5,))            # 2 GiB as a copy
    wide = np.broadcast_to(np.zeros(1, "V4096"), (2**24,))                # 64 GiB as a copy
    calls = [
        ("scatter_view", lambda: dist.scatter(huge if RANK == 0 else None)),
        ("gather_view", lambda: dist.gather(huge)),
        ("all_gather_view", lambda: dist.all_gather(huge[None], dim=1)),
        ("broadcast_view", lambda: dist.broadcast(huge if RANK == 0 else None)),
        ("all_reduce_view", lambda: dist.all_reduce(np.broadcast_to(np.ones(1), (2**31 + 5,)))),
        ("broadcast_memory", lambda: dist.broadcast(wide if RANK == 0 else None)),
    ]
    for name, call in calls:
        tracemalloc.start()
        try:
            call()
            say(f"NOERR {name}")
        except (OverflowError, MemoryError, ValueError) as exc:
            err(name, exc)
        say(f"peak {name} {tracemalloc.get_traced_memory()[1]}")
        tracemalloc.stop()
        assert dist.all_reduce(np.ones(2)).tolist() == [dist.size()] * 2   # still usable
    say("OK big_views")


def case_nan():
    """max/min propagate NaN as np.maximum/np.minimum whichever rank holds it,
    NaN beats inf and -inf, integers are exact; all_reduce and reduce."""
    P = dist.size()

    def of(rank, holder, dtype, n):
        a = np.arange(n, dtype=np.float64) + rank + 1
        if rank == holder:
            a[0] = np.nan
            a[1] = np.nan
        if rank == (holder + 1) % P:
            a[1], a[2] = np.inf, -np.inf
        return a.astype(dtype)

    for dtype in (np.float32, np.float64, np.longdouble):
        for n in (3, 100):
            for holder in range(P):
                every = [of(r, holder, dtype, n) for r in range(P)]
                for op, ref in (("max", np.maximum), ("min", np.minimum)):
                    want = ref.reduce(np.stack(every))
                    got = dist.all_reduce(every[RANK], op)
                    assert np.array_equal(got, want, equal_nan=True), (dtype, n, holder, op, got)
                    assert np.isnan(got[0]) and np.isnan(got[1]), got
                    r = dist.reduce(every[RANK], root=P - 1, op=op)
                    assert r is None or np.array_equal(r, want, equal_nan=True), (op, r)
    ints = np.array([RANK, -RANK, 7], np.int64)
    assert dist.all_reduce(ints, "max").tolist() == [P - 1, 0, 7]
    assert dist.all_reduce(ints, "min").tolist() == [0, -(P - 1), 7]
    say("OK nan")


def case_threads():
    """A collective called while another thread of the same rank is inside one
    is refused there (a communicator serves one thread at a time); the
    thread's own call completes and the communicator stays usable."""
    import threading
    P = dist.size()
    if RANK == 0:
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("a", dist.all_reduce(np.ones(2))))
        t.start()
        time.sleep(2.0)   # the thread is inside by now; the others arrive after 5 s
        try:
            dist.all_reduce(np.ones(2))
            say("NOERR threads")
        except RuntimeError as exc:
            err("threads", exc)
        t.join()
        assert got["a"].tolist() == [float(P)] * 2, got
    else:
        time.sleep(5.0)
        dist.all_reduce(np.ones(2))
    assert dist.all_reduce(np.ones(2)).tolist() == [float(P)] * 2   # still in step
    say("OK threads")


def case_torch_users():
    """torch users: a tensor that requires grad is refused on every rank (naming
    .detach()); out= writes in place (all_reduce(t, out=t) is torch's in-place
    all_reduce); a wrong out of all_reduce is an error on every rank."""
    import torch
    P = dist.size()
    t = torch.ones(3, requires_grad=RANK == 2)
    try:
        dist.all_reduce(t)
        say("NOERR requires_grad")
    except (TypeError, ValueError) as exc:
        err("requires_grad", exc)
    with torch.no_grad():   # no graph to cut: read detached, as DataParallel does
        assert dist.all_reduce(t).tolist() == [float(P)] * 3
    t = torch.full((3,), float(RANK))
    got = dist.all_reduce(t, out=t)
    assert got is t and t.tolist() == [float(sum(range(P)))] * 3, t
    m = np.full(2, float(RANK))
    assert dist.all_reduce(m, op="max", out=m) is m and m.tolist() == [float(P - 1)] * 2
    b = torch.full((2,), float(RANK + 5))
    assert dist.broadcast(b, root=1, out=b) is b and b.tolist() == [6.0, 6.0], b
    o = np.empty(2)
    assert dist.reduce(np.ones(2), root=0, out=o if RANK == 0 else None) is (o if RANK == 0
                                                                           else None)
    assert RANK != 0 or o.tolist() == [float(P)] * 2
    g = torch.empty(P)
    assert dist.all_gather(torch.tensor([float(RANK)]), out=g) is g and g.tolist() == \
        [float(r) for r in range(P)]
    piece = np.empty(2)
    assert dist.scatter(np.arange(2.0 * P) if RANK == 0 else None, out=piece) is piece
    assert piece.tolist() == [2.0 * RANK, 2.0 * RANK + 1], piece
    for name, out in (("out_shape", np.empty(3 if RANK == 1 else 2)),
                      ("out_dtype", np.empty(2, np.float32 if RANK == 3 else np.float64))):
        try:
            dist.all_reduce(np.ones(2), out=out)
            say(f"NOERR {name}")
        except (TypeError, ValueError) as exc:
            err(name, exc)
    assert dist.all_reduce(np.ones(2)).tolist() == [float(P)] * 2   # still in step
    say("OK torch_users")


def case_sizes_both_paths():
    """Every collective's values on both sides of the size up to which the data
    travels with the guard's record (64 KiB): small pieces fused, large ones
    by MPI's own messages; dims 0 and 1, ragged splits, the root's own piece."""
    P = dist.size()
    rng = np.random.default_rng(7)
    for rows in (5, 100, 3000):   # 5 x 40 float64 = 1.6 KB; 100 x 40 = 32 KB; 3000 x 40 = 960 KB
        full = rng.random((rows, 40))
        for dim in (0, 1):
            for root in (0, P - 1):
                n = full.shape[dim]
                sizes, off = pieces_of(n, P)
                piece = dist.scatter(full if RANK == root else None, root=root, dim=dim)
                want = np.take(full, range(off[RANK], off[RANK + 1]), axis=dim)
                assert np.array_equal(piece, want), (rows, dim, root)
                back = dist.gather(piece, root=root, dim=dim)
                assert (back is None) == (RANK != root)
                assert back is None or np.array_equal(back, full), (rows, dim, root)
                assert np.array_equal(dist.all_gather(piece, dim=dim), full), (rows, dim)
                got = dist.broadcast(full if RANK == root else None, root=root)
                assert np.array_equal(got, full) and got is not full, (rows, root)
        mine = full * (RANK + 1)
        total = full * (P * (P + 1) / 2)
        assert np.allclose(dist.all_reduce(mine), total), rows
        assert np.array_equal(dist.all_reduce(mine, "max"), full * P), rows
        r = dist.reduce(mine, root=P - 1)
        assert (r is None) == (RANK != P - 1) and (r is None or np.allclose(r, total)), rows
        ints = np.full(rows * 40, 100, np.int8)   # widened sum: wraps as NumPy's
        want = np.full(rows * 40, 100 * P, np.int64).astype(np.int8)
        assert np.array_equal(dist.all_reduce(ints), want), rows
    say("OK sizes_both_paths")


def case_mismatch_sizes():
    """Mismatches on each path a piece can take (inside the record up to 8 KiB,
    right behind it up to 4 MiB, after the verdict past that; all_reduce and
    reduce on two ranks: behind the record past 8 KiB): root, tag, shape, dtype,
    dim, split, op and the collective differ on one rank; every rank raises
    the same ValueError, and the next call (whose messages must not meet the
    failed call's data) returns the right values."""
    P = dist.size()
    last = RANK == P - 1
    for n in (8, 4096, 1 << 20):   # float64: 64 B, 32 KiB, 8 MiB
        full = np.arange(n * P, dtype=np.float64) + n
        piece = full[RANK * n:(RANK + 1) * n].copy()
        calls = [
            ("b_root", lambda: dist.broadcast(full, root=1 if last else 0)),
            ("b_tag", lambda: dist.broadcast(full if RANK == 0 else None,
                                             tag=2 if last else 1)),
            ("s_root", lambda: dist.scatter(full, root=1 if last else 0)),
            ("s_split", lambda: dist.scatter(full if RANK == 0 else None, chunk_sizes=(
                [n * P] + [0] * (P - 1)) if last else None)),
            ("s_dim", lambda: dist.scatter(full.reshape(P, n) if RANK == 0 else None,
                                           dim=1 if last else 0)),
            ("g_shape", lambda: dist.gather(piece if not last else piece[:-1].reshape(1, -1))),
            ("g_dtype", lambda: dist.gather(piece.astype(np.float32) if last else piece)),
            ("g_tag", lambda: dist.gather(piece, tag="x" if last else "y")),
            ("ag_dtype", lambda: dist.all_gather(piece.astype(np.float32) if last else piece)),
            ("kind", lambda: dist.gather(piece) if last else dist.broadcast(
                full if RANK == 0 else None)),
            ("kind2", lambda: dist.scatter(full if RANK == 0 else None) if last
             else dist.all_gather(piece)),
            ("ar_shape", lambda: dist.all_reduce(piece[:-1] if last else piece)),
            ("ar_op", lambda: dist.all_reduce(piece, "max" if last else "sum")),
            ("r_root", lambda: dist.reduce(piece, root=1 if last else 0)),
            ("kind3", lambda: dist.all_reduce(piece) if last else dist.gather(piece)),
        ]
        for name, call in calls:
            try:
                call()
                say(f"NOERR {name} {n}")
            except ValueError as exc:
                err(f"{name}_{n}", exc)
            got = dist.broadcast(full if RANK == 0 else None)
            assert np.array_equal(got, full), (name, n)
            assert np.array_equal(dist.scatter(full if RANK == P - 1 else None, root=P - 1),
                                  piece), (name, n)
            back = dist.gather(piece, root=P - 1)
            assert (back is None) != last and (back is None or np.array_equal(back, full))
            assert np.array_equal(dist.all_gather(piece), full), (name, n)
            assert np.array_equal(dist.all_reduce(piece), full.reshape(P, n).sum(0)), (name, n)
    say("OK mismatch_sizes")


def init_with_missing_rank():
    """Rank P-1 fails before init() (skip_init) or is late to it (late_init); the
    others' init must be bounded by its timeout (DIST_TEST_TIMEOUT)."""
    from mpi4py import MPI
    global RANK
    RANK = MPI.COMM_WORLD.Get_rank()
    last = RANK == MPI.COMM_WORLD.Get_size() - 1
    if last and CASE == "skip_init":
        raise RuntimeError(f"rank {RANK} failed before init")
    if last:
        time.sleep(1.5)
    start = time.monotonic()
    try:
        dist.init(timeout=float(os.environ.get("DIST_TEST_TIMEOUT", "30")))
    except TimeoutError as exc:   # caught: the job must still end, at exit
        err("init", exc)
        say(f"waited {time.monotonic() - start:.1f}")
        return
    assert dist.all_reduce(np.ones(2)).tolist() == [dist.size()] * 2
    say(f"OK {CASE}")


def case_uninitialized():
    try:
        dist.scatter(np.zeros(3))
    except RuntimeError as exc:
        err("uninitialized", exc)


if __name__ == "__main__":
    RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    if CASE == "uninitialized":
        case_uninitialized()
        sys.exit(0)
    if CASE in ("skip_init", "late_init"):
        init_with_missing_rank()
        sys.exit(0)
    dist.init(timeout=float(os.environ.get("DIST_TEST_TIMEOUT", "30")))
    RANK = dist.rank()
    globals()["case_" + CASE]()
