"""PyTorch tensors through DataParallel, scatter, gather, replicate, explain
and comm on the virtual CPU devices: split with PyTorch's chunk rule, handed
to the replicas as torch tensors (zero-copy on dpmini's device memory),
gathered back into one torch tensor."""
import collections
import warnings

import numpy as np
import pytest

import dpmini

DEVS = ["cpu:0", "cpu:1"]


def record(seen):
    def replica(*args, **kwargs):
        seen.append((args, kwargs))
        return args[0] if args else next(iter(kwargs.values()))
    return replica


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_split_along_dim_gives_torch_shards_and_one_torch_result(torch, dim):
    x = torch.arange(24.0, dtype=torch.float64).reshape(4, 6)
    seen = []
    out = dpmini.DataParallel(record(seen), DEVS, dim=dim)(x)
    assert type(out) is torch.Tensor and out.shape == x.shape
    assert torch.equal(out, x)
    shards = sorted((a[0] for a, _ in seen), key=lambda t: float(t.flatten()[0]))
    assert all(type(s) is torch.Tensor and s.device.type == "cpu" for s in shards)
    want = torch.chunk(x, 2, dim=dim)
    assert [tuple(s.shape) for s in shards] == [tuple(w.shape) for w in want]
    for s, w in zip(shards, want):
        assert torch.equal(s, w)


def test_the_issue_case_splits_the_batch(torch):
    """np.asarray(x) * 1 on each shard: 4 rows back, not 8."""
    x = torch.arange(8.0).reshape(4, 2)
    out = dpmini.DataParallel(lambda s: np.asarray(s) * 1, DEVS)(x)
    assert type(out) is np.ndarray and out.shape == (4, 2)
    np.testing.assert_array_equal(out, x.numpy())


def test_shards_live_in_dpmini_device_memory_without_another_copy(torch):
    x = torch.arange(16.0, dtype=torch.float64)
    before = dpmini.memory_allocated("cpu:1")
    parts = dpmini.scatter(x, DEVS)
    assert [type(p) for p in parts] == [torch.Tensor, torch.Tensor]
    assert dpmini.memory_allocated("cpu:1") >= before + 8 * 8
    # the tensor is a view of that memory: writes through NumPy's view of the
    # same DLPack export show in the tensor (one buffer, by data pointer)
    view = np.from_dlpack(parts[1])
    assert view.ctypes.data == parts[1].data_ptr()
    assert parts[1].data_ptr() % 64 == 0   # dpmini's block alignment
    view[0] = -1.0
    assert parts[1][0].item() == -1.0 and x[8].item() == 8.0
    del parts, view
    assert dpmini.memory_allocated("cpu:1") == before


def test_input_is_imported_without_a_copy(torch):
    """in_dims None on the host keeps every replica reading a copy on its own
    device; the import itself shares the tensor's memory (dpmini.asarray)."""
    x = torch.arange(6.0)
    a = dpmini.asarray(x)
    assert a.ctypes.data == x.data_ptr()


def test_nested_structures_and_kwargs(torch):
    Pair = collections.namedtuple("Pair", "a b")
    x = torch.arange(8.0).reshape(4, 2)
    seen = []

    def replica(d, t, p, mask=None):
        seen.append((type(d["x"]), type(t[0]), type(p.a), type(mask)))
        return {"x": d["x"] + 1, "b": p.b}

    out = dpmini.DataParallel(replica, DEVS)(
        {"x": x}, (x.clone(),), Pair(x.clone(), x.clone() * 2), mask=x > 3)
    assert seen == [(torch.Tensor,) * 4] * 2
    assert type(out) is dict and type(out["x"]) is torch.Tensor
    assert torch.equal(out["x"], x + 1) and torch.equal(out["b"], x * 2)


def test_mixed_numpy_torch_and_jax_arguments(torch, jnp):
    seen = []

    def replica(a, b, c):
        seen.append((type(a), type(b), type(c).__name__, a.shape[0], b.shape[0], c.shape[0]))
        return a

    dpmini.DataParallel(replica, DEVS)(np.ones(4), torch.ones(4), jnp.ones(4))
    assert seen == [(np.ndarray, torch.Tensor, "ArrayImpl", 2, 2, 2)] * 2


def test_in_dims_out_dims_and_weights(torch):
    x = torch.arange(12.0, dtype=torch.float64).reshape(6, 2)
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    seen = []

    def replica(x, w):
        seen.append((tuple(x.shape), type(w), tuple(w.shape)))
        return x @ w, (x * 0).sum()

    dp = dpmini.DataParallel(replica, DEVS, in_dims=(0, None), out_dims=(0, "sum"),
                             weights=[1, 2])
    y, total = dp(x, w)
    assert sorted(seen) == [((2, 2), torch.Tensor, (2,)), ((4, 2), torch.Tensor, (2,))]
    assert type(y) is torch.Tensor and torch.equal(y, x @ w)
    assert type(total) is torch.Tensor and total.item() == 0.0


def test_out_dims_none_returns_one_equal_tensor(torch):
    c = torch.tensor([1.0, 2.0])
    out = dpmini.DataParallel(lambda x: (x, c), DEVS, out_dims=(0, None))(torch.ones(4))
    assert type(out[1]) is torch.Tensor and torch.equal(out[1], c)


def test_scalar_losses_become_a_vector(torch):
    x = torch.arange(8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = dpmini.DataParallel(lambda s: s.sum(), DEVS)(x)
    assert type(out) is torch.Tensor and out.tolist() == [6.0, 22.0]


def test_gather_of_torch_outputs_and_mixed_libraries(torch):
    out = dpmini.gather([{"y": torch.ones(2)}, {"y": torch.zeros(3)}], "cpu")
    assert type(out["y"]) is torch.Tensor and out["y"].tolist() == [1, 1, 0, 0, 0]
    with pytest.raises(TypeError, match=r"out\['y'\]: .*different libraries.*Tensor, ndarray"):
        dpmini.gather([{"y": torch.ones(2)}, {"y": np.ones(2)}], "cpu")


def test_comm_functions_accept_and_return_tensors(torch):
    x = torch.arange(6.0)
    parts = dpmini.comm.scatter(x, DEVS)
    assert [type(p) for p in parts] == [torch.Tensor] * 2
    assert torch.equal(dpmini.comm.gather(list(parts), destination="cpu"), x)
    b = dpmini.comm.broadcast(x, DEVS)
    assert all(type(t) is torch.Tensor and torch.equal(t, x) for t in b)
    r = dpmini.comm.reduce_add([x, x])
    assert type(r) is torch.Tensor and torch.equal(r, 2 * x)
    rows = dpmini.comm.broadcast_coalesced([x, np.ones(2)], DEVS)
    assert [type(v) for v in rows[1]] == [torch.Tensor, np.ndarray]


class Holder:
    def __init__(self, torch):
        self.w = torch.arange(3.0)
        self.layers = [{"b": torch.ones(2)}]

    def __call__(self, x):
        return x * self.w.sum() + self.layers[0]["b"].sum()


def test_replicate_copies_tensors_per_device(torch):
    m = Holder(torch)
    reps = dpmini.replicate(m, DEVS)
    assert all(type(r.w) is torch.Tensor for r in reps)
    assert reps[0].w.data_ptr() != reps[1].w.data_ptr() != m.w.data_ptr()
    assert all(torch.equal(r.layers[0]["b"], m.layers[0]["b"]) for r in reps)
    out = dpmini.DataParallel(m, DEVS)(torch.ones(4))
    assert type(out) is torch.Tensor and out.tolist() == [5.0] * 4


def test_real_nn_module_equals_the_module(torch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3)).double()
    x = torch.randn(11, 5, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
        got = dpmini.DataParallel(model, DEVS)(x)
    assert type(got) is torch.Tensor and got.shape == (11, 3)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    # replicas are PyTorch's shallow copies (docs/spec.md 5.5), never the module itself
    reps = dpmini.replicate(model, DEVS)
    assert all(r is not model and type(r) is type(model) for r in reps)


def test_requires_grad_is_refused_naming_the_argument(torch):
    x = torch.ones(4, requires_grad=True)
    with pytest.raises(TypeError, match=r"^args\[0\]: a torch.Tensor that requires grad.*"
                                        r"x\.detach\(\)"):
        dpmini.DataParallel(lambda t: t, DEVS)(x)
    with pytest.raises(TypeError, match=r"^kwargs\['mask'\]: .*requires grad"):
        dpmini.DataParallel(lambda t, mask: t, DEVS)(torch.ones(4), mask=x)
    with pytest.raises(TypeError, match=r"^module\.w: a torch.nn.parameter.Parameter that "
                                        r"requires grad"):
        class P:
            def __init__(self):
                self.w = torch.nn.Parameter(torch.ones(2))
        dpmini.replicate(P(), DEVS)
    # outside no_grad, an nn.Module's outputs record the graph (docs/spec.md 7)
    model = torch.nn.Linear(2, 2)
    assert dpmini.DataParallel(model, DEVS)(torch.ones(4, 2)).grad_fn is not None


def test_an_output_that_requires_grad_is_explained_as_the_replicas_output(torch):
    # the input does not require grad; the parameters do, with grad mode on
    model = torch.nn.Linear(2, 2)
    x = torch.ones(4, 2)
    with pytest.raises(TypeError) as e:
        dpmini.DataParallel(lambda t: {"y": model(t)}, DEVS)(x)
    msg = str(e.value)
    assert msg.startswith("out['y']: a replica returned a torch.Tensor that requires grad "
                          "(computed from parameters that require grad, with grad mode on)")
    assert "torch.no_grad()" in msg and "torch.nn.Module" in msg and "detach" not in msg
    with torch.no_grad():
        y = dpmini.DataParallel(lambda t: {"y": model(t)}, DEVS)(x)["y"]
    assert torch.allclose(y, model(x).detach())


def test_requires_grad_is_read_detached_under_no_grad(torch):
    x = torch.arange(8.0).reshape(4, 2).requires_grad_()
    with torch.no_grad():
        got = dpmini.DataParallel(lambda t: t * 2, DEVS)(x)
        assert torch.equal(got, x.detach() * 2) and not got.requires_grad

        class P:
            def __init__(self):
                self.w = torch.nn.Parameter(torch.ones(2))
        reps = dpmini.replicate(P(), DEVS)
        assert all(torch.equal(r.w, torch.ones(2)) and not r.w.requires_grad for r in reps[1:])
    with pytest.raises(TypeError, match="requires grad"):     # grad mode back on: refused
        dpmini.DataParallel(lambda t: t, DEVS)(x)


def test_explain_shows_torch_leaves(torch):
    plan = dpmini.explain((torch.ones(4, 2),), DEVS)
    assert plan.leaves[0]["library"] == "torch.Tensor cpu"
    assert "[torch.Tensor cpu]" in str(plan)


def test_data_parallel_and_scatter_kwargs_with_tensors(torch):
    x = torch.arange(8.0).reshape(4, 2)
    out = dpmini.data_parallel(lambda t, k: t + k, (x,), device_ids=DEVS,
                               module_kwargs={"k": torch.ones(4, 1)})
    assert type(out) is torch.Tensor and torch.equal(out, x + 1)
    ins, kws = dpmini.scatter_kwargs((x,), {"m": x > 2}, DEVS)
    assert [type(i[0]) for i in ins] == [torch.Tensor] * 2
    assert [type(k["m"]) for k in kws] == [torch.Tensor] * 2


def test_strided_and_non_float_tensors(torch):
    x = torch.arange(12).reshape(3, 4).T          # non-contiguous int64
    parts = dpmini.scatter(x, DEVS, dim=1)
    assert [p.dtype for p in parts] == [torch.int64] * 2
    assert torch.equal(torch.cat(parts, dim=1), x)
    b = torch.tensor([True, False, True, True])
    assert torch.equal(dpmini.gather(list(dpmini.scatter(b, DEVS)), "cpu"), b)


def test_a_dtype_numpy_cannot_hold_is_named(torch):
    # bfloat16, float8 and complex32 go through as ml_dtypes' dtypes
    # (test_ml_dtypes_interop.py); a packed float4 pair has no NumPy dtype
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    x = torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(TypeError, match=r"^args\[0\]: a torch.Tensor of dtype a vector dtype "
                                        r".*NumPy has no such dtype.*x\.float\(\)") as e:
        dpmini.DataParallel(lambda t: t, DEVS)(x)
    assert e.value.__cause__ is not None   # numpy.from_dlpack's own error


def test_a_dtype_numpy_cannot_hold_is_named_at_its_path(torch):
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")

    def packed(t):
        return torch.zeros(2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)

    with pytest.raises(TypeError, match=r"^out\['y'\]: a torch.Tensor of dtype a vector"):
        dpmini.DataParallel(lambda t: {"y": packed(t)}, DEVS)(torch.ones(4, 2))
    with pytest.raises(TypeError, match=r"^module\.w: a torch.Tensor of dtype a vector"):
        holder = Holder(torch)
        holder.w = packed(None)
        dpmini.replicate(holder, DEVS)


def test_repeated_calls_leak_neither_references_nor_device_memory(torch):
    import gc
    import sys
    x = torch.arange(64.0).reshape(16, 4)
    holder = Holder(torch)
    dp = dpmini.DataParallel(lambda t: {"y": t * 2, "s": t.sum()}, DEVS,
                             out_dims={"y": 0, "s": "sum"})
    dpr = dpmini.DataParallel(holder, DEVS)
    for _ in range(20):   # warm the caches (origins, allocator)
        dp(x), dpr(x[:, 0])
    gc.collect()   # earlier tests' garbage must not be freed inside the measured loop
    refs = sys.getrefcount(x), sys.getrefcount(holder.w)
    mem = [dpmini.memory_allocated(d) for d in DEVS]
    for _ in range(500):
        out = dp(x)
        dpr(x[:, 0])
        dpmini.gather(list(dpmini.scatter(x, DEVS)), "cpu")
    del out
    gc.collect()
    assert (sys.getrefcount(x), sys.getrefcount(holder.w)) == refs
    assert [dpmini.memory_allocated(d) for d in DEVS] == mem


def test_tensor_with_the_negative_bit_is_refused_not_read_with_the_wrong_sign(torch):
    c = torch.tensor([[1 + 2j], [3 + 4j]]).conj().imag        # values -2, -4; DLPack gives 2, 4
    assert c.is_neg()
    with pytest.raises(TypeError, match=r"args\[0\]: a tensor with the negative bit set.*resolve_neg"):
        dpmini.DataParallel(lambda a: a, DEVS)(c)
    with pytest.raises(TypeError, match="negative bit"):
        dpmini.comm.scatter(c, DEVS)
    got = dpmini.DataParallel(lambda a: a, DEVS)(c.resolve_neg())
    assert torch.equal(got, torch.tensor([[-2.0], [-4.0]], dtype=torch.float64))


def test_tensor_with_the_conjugate_bit_is_refused_naming_resolve_conj(torch):
    t = torch.tensor([[1 + 2j], [3 + 4j]], dtype=torch.complex64)
    c = t.conj()
    assert c.is_conj()
    with pytest.raises(TypeError, match=r"args\[0\]\['x'\]: a tensor with the conjugate bit set"
                                        r".*resolve_conj\(\)"):
        dpmini.DataParallel(lambda x: x, DEVS)({"x": c})
    with pytest.raises(TypeError, match="conjugate bit"):
        dpmini.comm.scatter(c, DEVS)
    got = dpmini.DataParallel(lambda a: a, DEVS)(c.resolve_conj())
    assert torch.equal(got, torch.tensor([[1 - 2j], [3 - 4j]], dtype=torch.complex64))


def test_tensor_with_a_forward_mode_tangent_is_refused_not_dropped(torch):
    import torch.autograd.forward_ad as fwAD
    m = torch.nn.Linear(4, 2).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    v = torch.randn(6, 4, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, v)
        for devs in (DEVS, ["cpu:0"]):
            with pytest.raises(TypeError, match=r"^args\[0\]: a tensor with a forward-mode AD "
                                                r"tangent.*unpack_dual\(x\)\.primal"):
                dpmini.DataParallel(m, devs)(dual)
        with pytest.raises(TypeError, match=r"^array: a tensor with a forward-mode AD tangent"):
            dpmini.comm.scatter(dual, DEVS)
        # a replica that returns one: refused at its output path
        with pytest.raises(TypeError, match=r"^out: a tensor with a forward-mode AD tangent"):
            dpmini.DataParallel(lambda a: fwAD.make_dual(a, a), DEVS)(x)
        # the primal goes through; inside the level, tensors without a tangent too
        got = dpmini.DataParallel(m, DEVS)(fwAD.unpack_dual(dual).primal)
    assert torch.allclose(got, m(x))


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                                   "float32", "float64", "complex64", "complex128", "bfloat16"])
def test_host_tensors_of_every_dtype_round_trip_with_their_values_strides_and_types(torch, dtype):
    # Tensor.numpy()/torch.from_numpy for the dtypes NumPy has, DLPack for the others:
    # the same values, dtype and type either way, strided inputs included.
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dt = getattr(torch, dtype)
    x = (torch.arange(24).reshape(4, 6) % 3).to(dt).t()   # (6, 4), not contiguous
    param = torch.nn.Parameter(x.clone(), requires_grad=False)
    for src in (x, param, x[::2]):
        pieces = dpmini.comm.scatter(src, devices=DEVS)
        assert [type(p) for p in pieces] == [torch.Tensor, torch.Tensor]
        back = dpmini.comm.gather(list(pieces), destination="cpu")
        assert type(back) is torch.Tensor and back.dtype == dt
        assert torch.equal(back, src.detach())
    out = torch.empty(x.shape, dtype=dt)
    dpmini.comm.gather(list(dpmini.comm.scatter(x, devices=DEVS)), out=out)
    assert torch.equal(out, x)
