"""A call works on what it was given at its start: the module, the device list
and the in_dims/out_dims/chunk_sizes entries are read once, so reassigning or
mutating them from another thread or from inside the call changes only the
next call (matches torch.nn.DataParallel, which reads self.module and
device_ids once per forward). Thread checks run in a subprocess with a
timeout."""
import warnings

import numpy as np
import pytest

import dpmini
from script_runner import run_script

D2 = ["cpu:0", "cpu:1"]


# --- a call keeps its own module reference and device list ----------

def test_module_reassigned_during_call_keeps_the_old_module():
    run_script("""
        import numpy as np, dpmini
        class Mod:
            def __init__(s): s.w = np.full(3, 2.0)
            def __call__(s, d): return d["x"] * s.w[0]
        dp = dpmini.DataParallel(Mod(), ["cpu:0", "cpu:1"])
        class Sneaky(dict):
            def items(self):
                dp.module = abs                  # drops the last ref to Mod()
                junk = [bytearray(b"\\xff" * 48) for _ in range(1000)]
                return super().items()
        y = dp(Sneaky(x=np.ones((4, 3))))
        assert np.array_equal(y, np.full((4, 3), 2.0)), y
        assert dp.module is abs
        print("OK")
    """)


def test_device_ids_reassigned_during_call_uses_the_old_devices():
    run_script("""
        import numpy as np, dpmini
        seen = []
        class Mod:
            def __init__(s): s.w = np.full(3, 2.0)
            def __call__(s, d):
                seen.append(str(dpmini.device_of(d["x"])))
                return d["x"] * s.w[0]
        dp = dpmini.DataParallel(Mod(), ["cpu:0", "cpu:1"])
        class Sneaky(dict):
            def items(self):
                dp.device_ids = ["cpu:7"]
                junk = [Mod() for _ in range(100)]
                return super().items()
        y = dp(Sneaky(x=np.ones((4, 3))))
        assert np.array_equal(y, np.full((4, 3), 2.0)), y
        assert sorted(seen) == ["cpu:0", "cpu:1"], seen
        assert [str(d) for d in dp.device_ids] == ["cpu:7"]
        print("OK")
    """)


def test_subclass_forward_replicates_the_module_of_call_start():
    run_script("""
        import numpy as np, dpmini
        class DP(dpmini.DataParallel):
            def scatter(self, inputs, kwargs, device_ids):
                self.module = abs                # reassign between the steps
                return super().scatter(inputs, kwargs, device_ids)
            def replicate(self, module, device_ids):
                assert module is not abs
                assert [str(d) for d in device_ids] == ["cpu:0", "cpu:1"], device_ids
                return super().replicate(module, device_ids)
        dp = DP(lambda x: x + 1, ["cpu:0", "cpu:1"])
        assert np.array_equal(dp(np.zeros(4)), np.ones(4))
        print("OK")
    """)


def test_module_hot_swapped_from_another_thread():
    run_script("""
        import numpy as np, dpmini, threading, time
        class Mod:
            def __init__(s, v): s.w = np.full(3, v); s.junk = [np.ones(2) for _ in range(3)]
            def __call__(s, x): return x * s.w[0]
        dp = dpmini.DataParallel(Mod(1.0), ["cpu:0", "cpu:1"])
        x = np.ones((100000, 3))            # > 256 KiB: copies release the GIL
        stop = False
        def caller():
            while not stop:
                dp(x)
        def swapper():
            i = 0
            while not stop:
                i += 1
                dp.module = Mod(float(i))
                dp.device_ids = ["cpu:%d" % (i % 3), "cpu:3"]
        ts = [threading.Thread(target=caller), threading.Thread(target=swapper)]
        [t.start() for t in ts]; time.sleep(1.5); stop = True; [t.join() for t in ts]
        print("OK")
    """)


# --- in_dims / out_dims entries replaced during a call ---------------------

def test_out_dims_mutated_during_gather():
    run_script("""
        import numpy as np, dpmini, warnings
        warnings.simplefilter("ignore")
        class Spec(dict): pass
        class Evil:
            def __eq__(self, other):
                dp.out_dims["a"] = Spec(y=None, z=0)   # replaces the entry being walked
                return True
            __hash__ = object.__hash__
        dp = dpmini.DataParallel(lambda x: {"a": {"y": Evil(), "z": x}}, ["cpu:0", "cpu:1"],
                                 out_dims={"a": Spec(y=None, z=0)})
        for _ in range(20):
            out = dp(np.ones((4, 3)))
            assert out["a"]["z"].shape == (4, 3)
        print("OK")
    """, "-X", "dev")


def test_in_dims_mutated_during_scatter():
    run_script("""
        import numpy as np, dpmini, warnings
        warnings.simplefilter("ignore")
        class Spec(dict): pass
        class Batch(dict):
            def items(self):
                dp.in_dims[0] = Spec(x=0, y=None)
                return super().items()
            def keys(self):
                dp.in_dims[0] = Spec(x=0, y=None)
                return super().keys()
        dp = dpmini.DataParallel(lambda b: b["x"], ["cpu:0", "cpu:1"], in_dims=[Spec(x=0, y=None)])
        for _ in range(20):
            assert dp(Batch(x=np.ones((4, 3)), y=np.ones(2))).shape == (4, 3)
        for _ in range(20):   # the functional forms too
            dpmini.scatter(Batch(x=np.ones((4, 3)), y=np.ones(2)), ["cpu:0", "cpu:1"],
                           in_dims=dp.in_dims[0])
            dpmini.explain((Batch(x=np.ones((4, 3)), y=np.ones(2)),), ["cpu:0", "cpu:1"],
                           in_dims=dp.in_dims)
        print("OK")
    """, "-X", "dev")


def test_a_change_during_a_call_applies_from_the_next_call():
    spec = [0]
    seen = []

    class Batch(dict):
        def items(self):
            spec[0] = None                    # broadcast from now on
            return super().items()

    def model(b):
        seen.append(b["x"].shape)
        return b["x"]

    dp = dpmini.DataParallel(model, D2, out_dims=0)
    dp.in_dims = spec
    dp(Batch(x=np.ones((4, 3))))              # this call still splits on dim 0
    assert sorted(seen) == [(2, 3), (2, 3)]
    assert dp.in_dims == [None]


def test_chunk_sizes_list_mutated_by_index():
    class Sneaky:
        def __init__(self, v): self.v = v
        def __index__(self):
            sizes.clear()                     # the caller's list shrinks mid-parse
            return self.v
    sizes = [Sneaky(2), Sneaky(2)]
    out = dpmini.scatter(np.zeros((4, 2)), D2, chunk_sizes=sizes)
    assert [o.shape for o in out] == [(2, 2), (2, 2)]


def test_self_referencing_in_dims_is_an_error_not_a_crash():
    spec = []
    spec.append(spec)
    with pytest.raises(RecursionError):
        dpmini.scatter((np.zeros(4),), D2, in_dims=spec)
