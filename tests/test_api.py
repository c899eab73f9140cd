"""The public names and keyword names of the design's API section, and the
module layout (dpmini.comm mirrors torch.cuda.comm)."""
import numpy as np

import dpmini
from dpmini import comm

X = np.arange(12.0).reshape(4, 3)
D = ["cpu:0", "cpu:1"]


def test_public_names():
    for name in ["DataParallel", "data_parallel", "scatter", "scatter_kwargs", "gather", "replicate",
                 "parallel_apply", "explain", "Plan", "comm", "Device", "device_count", "cpu_device_count",
                 "device_of", "asarray", "memory_allocated", "memory_reserved", "empty_cache", "DPError",
                 "CudaError", "NcclError", "SplitWarning", "ZeroDimError"]:
        assert hasattr(dpmini, name), name
    for name in ["scatter", "gather", "broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced"]:
        assert callable(getattr(comm, name)), name


def test_keyword_names_of_the_design():
    assert comm.scatter(array=X, devices=D, chunk_sizes=None, dim=0)[0].shape == (2, 3)
    assert comm.gather(arrays=[X], dim=0, destination=None).shape == (4, 3)
    assert comm.gather([X], out=np.empty((4, 3))).shape == (4, 3)
    assert len(comm.broadcast(array=X, devices=D)) == 2
    assert len(comm.broadcast_coalesced(arrays=[X], devices=D, buffer_size=10485760)) == 2
    assert comm.reduce_add(arrays=[X, X], destination=None).shape == (4, 3)
    assert len(comm.reduce_add_coalesced(per_device=[[X], [X]], destination=None, buffer_size=10485760)) == 1
    assert dpmini.scatter(inputs=X, target_devices=D, dim=0, strict=False)[0].shape == (2, 3)
    ins, kws = dpmini.scatter_kwargs(inputs=(X,), kwargs={}, target_devices=D, dim=0, strict=False)
    assert len(ins) == len(kws) == 2
    assert dpmini.gather(outputs=[X], target_device="cpu", dim=0).shape == (4, 3)
    assert len(dpmini.replicate(module=lambda x: x, devices=D)) == 2
    assert dpmini.parallel_apply(modules=[lambda x: x], inputs=[(1,)], kwargs_tup=None, devices=None) == [1]
    out = dpmini.data_parallel(module=lambda x: x, inputs=X, device_ids=D, output_device=None, dim=0,
                               module_kwargs=None)
    assert out.shape == (4, 3)
    dp = dpmini.DataParallel(module=lambda x: x, device_ids=D, output_device=None, dim=0, strict=False)
    assert dp.dim == 0
    assert isinstance(dpmini.explain(inputs=(X,), device_ids=D, dim=0, kwargs=None), dpmini.Plan)
    assert dpmini.asarray(obj=X, device="cpu:1").shape == (4, 3)
    assert str(dpmini.Device(spec="cpu:1")) == "cpu:1"


def test_comm_scatter_defaults_match_design():
    # chunk_sizes=None, dim=0 by default
    chunks = comm.scatter(X, ["cpu:0", "cpu:1", "cpu:2"])
    assert [c.shape for c in chunks] == [(2, 3), (2, 3)]


def test_dataparallel_is_subclassable_c_type():
    class Sub(dpmini.DataParallel):
        pass

    s = Sub(lambda x: x, device_ids=D)
    assert isinstance(s, dpmini.DataParallel)
    np.testing.assert_array_equal(s(X), X)
