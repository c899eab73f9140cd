"""Probes for one real GPU, run by tools/gpu_check.sh after the tests: each
checks one finding of the GPU reviews that the test suite cannot show on the
CPU emulation. Every probe prints one line

    PROBE <finding> <name>: OK|FAIL|SKIP <detail>

and never raises (a crash of the whole script is a finding too). Run as
`python3 tools/gpu_probes.py [name ...]` with dpmini importable.
"""
import ctypes
import gc
import subprocess
import sys
import textwrap
import time
import traceback

import numpy as np

import dpmini
import dpmini._testing  # built with DPMINI_TESTING=1 (tools/gpu_check.sh does)

PROBES = []


def probe(finding):
    def register(fn):
        PROBES.append((finding, fn))
        return fn
    return register


class Skip(Exception):
    pass


def cuda_torch():
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"no torch ({exc})")
    if not torch.cuda.is_available():
        raise Skip("torch sees no GPU")
    return torch


def verdict(ok, detail):
    return ("OK " if ok else "FAIL ") + detail


@probe("C1")
def device_count_matches_cuda():
    """dpmini's count (NVML unless a GPU is in MIG mode) equals the runtime's."""
    torch = cuda_torch()
    mig = subprocess.run(["nvidia-smi", "--query-gpu=mig.mode.current", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().replace("\n", ",")
    d, t = dpmini.device_count(), torch.cuda.device_count()
    return verdict(d == t, f"dpmini {d}, torch {t}, MIG mode {mig or '?'}")


@probe("W3")
def destroyed_consumer_stream_is_not_synchronised():
    """A CuPy consumer's stream is destroyed before dpmini frees the block: the
    free must not use that handle (the block waits for a device sync)."""
    code = textwrap.dedent("""
        import gc, numpy as np, cupy, dpmini
        a = dpmini.asarray(np.arange(1 << 20, dtype=np.float32), 0)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            c = cupy.from_dlpack(a)
            c2 = c * 2
        s.synchronize()
        del c, c2, s
        gc.collect()
        for _ in range(50):   # new streams may reuse the handle
            t = cupy.cuda.Stream(non_blocking=True)
            del t
        before = dpmini._testing.cuda_debug()
        del a
        gc.collect()
        after = dpmini._testing.cuda_debug()
        print("stream_syncs", after["export_stream_syncs"] - before["export_stream_syncs"],
              "deferred", after["export_deferred"] - before["export_deferred"])
    """)
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        raise Skip(f"no CuPy ({exc})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    last = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    ok = r.returncode == 0 and last[0].startswith("stream_syncs 0 deferred 1")
    return verdict(ok, f"rc {r.returncode}: {last[0][:200]}")


@probe("W2")
def cuda_autocast_reaches_replicas():
    """Under torch.autocast('cuda'), replicas compute in the autocast dtype as
    in torch.nn.DataParallel."""
    torch = cuda_torch()
    lin = torch.nn.Linear(64, 64).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        want = torch.nn.DataParallel(lin, device_ids=[0])(x).dtype
        got = dpmini.DataParallel(lin, device_ids=[0, 0], output_device=0)(x).dtype
    return verdict(got == want, f"torch {want}, dpmini {got}")


@probe("W2")
def callers_stream_orders_replicas():
    """Under torch.cuda.stream(s), replicas see work queued on s before the call."""
    torch = cuda_torch()
    s = torch.cuda.Stream()
    wrong = 0
    with torch.no_grad():
        for _ in range(3):
            with torch.cuda.stream(s):
                base = torch.arange(1 << 22, device="cuda", dtype=torch.float32)
                torch.cuda._sleep(200_000_000)
                x = base * 2
                y = dpmini.DataParallel(lambda t: t + 1, device_ids=[0, 0], output_device=0)(x)
            torch.cuda.synchronize()
            wrong += int(not torch.equal(torch.as_tensor(y, device="cuda"), base * 2 + 1))
    return verdict(wrong == 0, f"{wrong}/3 results wrong")


@probe("torch")
def torch_module_replicates_on_the_gpu():
    torch = cuda_torch()
    lin = torch.nn.Linear(16, 4).cuda()
    x = torch.randn(6, 16, device="cuda")
    with torch.no_grad():
        want = lin(x)
        got = dpmini.DataParallel(lin, device_ids=[0, 0], output_device=0)(x)
    return verdict(torch.allclose(torch.as_tensor(got, device="cuda"), want), "values")


@probe("8")
def consumer_write_after_export():
    """Documented limit: a consumer's write after export is not waited for."""
    torch = cuda_torch()
    a = dpmini.asarray(np.ones(1 << 24, np.float32), 0)
    t = torch.from_dlpack(a)
    torch.cuda._sleep(300_000_000)
    t.mul_(2)
    r = a.numpy()
    torch.cuda.synchronize()
    seen = bool((r == 2).all())
    return "OK " + ("the write was seen" if seen else "stale read (the documented limit)")


@probe("13")
def strided_copy_over_2_pow_32_elements():
    """The kernel's 64-bit index path: a stride-2 view of 2^32 + 4099 uint8."""
    n = (1 << 32) + 4099
    block = (np.arange(1 << 20) % 251).astype(np.uint8)   # 8.6 GB of host memory, fast to make
    pattern = np.tile(block, -(-2 * n // block.size))[:2 * n]
    d = dpmini.asarray(pattern, 0)

    class Strided:
        def __init__(self, owner):
            self.owner = owner
            self.__cuda_array_interface__ = {"shape": (n,), "strides": (2,), "typestr": "|u1",
                                             "data": (owner.data_ptr, False), "version": 3,
                                             "stream": None}
    start = time.perf_counter()
    r = dpmini.comm.gather([Strided(d)], destination=0)
    took = time.perf_counter() - start
    ok = bool(np.array_equal(r.numpy(), pattern[::2]))
    del r, d
    gc.collect()
    dpmini.empty_cache()
    return verdict(ok, f"{n} elements, gather {took:.2f} s")


@probe("H3")
def max_pitch_of_this_gpu():
    """cudaDevAttrMaxPitch, the limit the restage copies are checked against."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            lib = None
    if lib is None:
        raise Skip("no libcudart on the loader's path")
    v = ctypes.c_int()
    rc = lib.cudaDeviceGetAttribute(ctypes.byref(v), 11, 0)
    return verdict(rc == 0 and v.value > 0, f"maxPitch {v.value} (rc {rc})")


def main(names):
    failed = 0
    gpus = dpmini.device_count() if dpmini._dpmini.cuda_backend == "cuda" else 0
    for finding, fn in PROBES:
        if names and fn.__name__ not in names:
            continue
        try:
            if gpus == 0:
                raise Skip(f"no CUDA device for dpmini (backend {dpmini._dpmini.cuda_backend})")
            line = fn()
        except Skip as exc:
            line = f"SKIP {exc}"
        except Exception as exc:   # a probe reports, never stops the run
            traceback.print_exc()
            line = f"FAIL {type(exc).__name__}: {exc}"
        failed += line.startswith("FAIL")
        print(f"PROBE {finding} {fn.__name__}: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
