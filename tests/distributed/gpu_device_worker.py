"""Worker for tests/test_distributed_gpu_devices.py, run under mpirun on the
emulated build: which GPU each rank uses and what its 2D copies accept.

    mpirun -np 4 python tests/distributed/gpu_device_worker.py CASE

Each rank writes "OK <what>" or "ERR <what> <Type>: <message>" lines to
$DIST_TEST_OUT/rank<r>.txt (the ranks' stdout lines interleave).
"""
import os
import sys
import time

import numpy as np

import dpmini
import dpmini.distributed as dist


def say(msg):
    path = os.path.join(os.environ["DIST_TEST_OUT"], f"rank{dist.rank()}.txt")
    with open(path, "a") as f:
        f.write(msg.replace("\n", "|") + "\n")


def on_gpu(a, dev):
    return dpmini.asarray(np.ascontiguousarray(a), f"cuda:{dev}")


def case_visible_devices():
    """Every rank sees its own GPU as cuda:0 (a per-rank CUDA_VISIBLE_DEVICES,
    as SLURM and torchrun set it): one GPU per rank, no 'same GPU' error."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(dist.rank())
    P = dist.size()
    got = dist.all_reduce(on_gpu(np.full(3, dist.rank() + 1.0), 0))
    assert np.array_equal(got.numpy(), np.full(3, P * (P + 1) / 2)), got.numpy()
    say("OK visible_devices")


def case_shared_visible_device():
    """Two ranks whose CUDA_VISIBLE_DEVICES name one GPU: refused everywhere."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(dist.rank() // 2)
    try:
        dist.all_reduce(on_gpu(np.ones(3), 0))
    except ValueError as exc:
        say(f"ERR shared {type(exc).__name__}: {exc}")


def case_pitch():
    """$DPMINI_EMULATE_MAX_PITCH is 64 bytes: rows of 40 float32 (160 bytes)
    along dim 1 cannot be one 2D copy on any rank."""
    P, me = dist.size(), dist.rank()
    dev = me
    x = np.arange(2 * 40, dtype=np.float32).reshape(2, 40)
    for what, call in (
            ("scatter", lambda: dist.scatter(on_gpu(x, dev) if me == 0 else on_gpu(x[:1], dev),
                                             dim=1)),
            ("gather", lambda: dist.gather(on_gpu(np.ones((2, 10), np.float32), dev), dim=1)),
            ("all_gather", lambda: dist.all_gather(on_gpu(np.ones((2, 10), np.float32), dev),
                                                   dim=1))):
        try:
            call()
            say(f"OK {what} passed")
        except (ValueError, RuntimeError, TimeoutError) as exc:
            say(f"ERR {what} {type(exc).__name__}: {exc}")
    # the communicator still works, and narrow rows still move along dim 1
    piece = dist.scatter(on_gpu(x[:, :4 * P], dev) if me == 0 else on_gpu(x[:1], dev), dim=1)
    assert np.array_equal(piece.numpy(), x[:, 4 * me:4 * me + 4]), piece.numpy()
    back = dist.all_gather(piece, dim=1)
    assert np.array_equal(back.numpy(), x[:, :4 * P])
    say("OK pitch")


def case_init_hang():
    """ncclCommInitRank never returns (a peer that never connects): a
    TimeoutError within the timeout, GPU collectives off, host ones still on."""
    os.environ["DPMINI_DIST_NCCL_FAULT"] = "init_hang"
    start = time.monotonic()
    try:
        dist.all_reduce(on_gpu(np.ones(3), dist.rank()))
    except TimeoutError as exc:
        say(f"ERR init {type(exc).__name__}: {exc}")
    say(f"waited {time.monotonic() - start:.1f}")
    del os.environ["DPMINI_DIST_NCCL_FAULT"]
    try:
        dist.all_reduce(on_gpu(np.ones(3), dist.rank()))
    except RuntimeError as exc:
        say(f"ERR after {type(exc).__name__}: {exc}")
    assert dist.all_reduce(np.ones(2)).tolist() == [dist.size()] * 2
    say("OK init_hang")


if __name__ == "__main__":
    dist.init(timeout=float(os.environ.get("DIST_TEST_TIMEOUT", "20")))
    globals()["case_" + sys.argv[1]]()
