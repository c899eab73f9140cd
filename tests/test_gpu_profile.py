"""dpmini.profile() on CUDA devices: copies to and from GPUs are copy spans of
their GPU (path "gpu", ending when the copy's streams are synced), replicas on
GPUs are replica spans of their GPU. Runs on the emulated build (make
test-emulated) and on real GPUs."""
import numpy as np

import dpmini
from gpu_helpers import gpu, host, two_gpus

pytestmark = gpu


def copies(prof, phase):
    return [e for e in prof.events if e["kind"] == "copy" and e["phase"] == phase]


@two_gpus
def test_gpu_scatter_and_gather_copies_are_spans_of_their_gpu():
    x = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)    # 4 MiB: not inline
    dpmini.comm.gather(dpmini.comm.scatter(x, [0, 1]))               # warm
    with dpmini.profile() as prof:
        chunks = dpmini.comm.scatter(x, [0, 1])
        back = dpmini.comm.gather(chunks)
    np.testing.assert_array_equal(back, x)
    for phase in ("scatter", "gather"):
        spans = copies(prof, phase)
        assert sorted(e["device"] for e in spans) == ["cuda:0", "cuda:1"], spans
        assert all(e["path"] == "gpu" for e in spans)
        assert all(e["bytes"] == x.nbytes // 2 for e in spans)
    names = [c["name"] for c in prof.calls()]
    assert names == ["comm.scatter", "comm.gather"]


@two_gpus
def test_gpu_replicas_are_spans_of_their_gpu():
    dp = dpmini.DataParallel(lambda a: a, [0, 1])   # replicas get dpmini.Array chunks
    x = np.arange(512, dtype=np.float32).reshape(64, 8)
    dp(x)
    with dpmini.profile() as prof:
        y = dp(x)
    np.testing.assert_array_equal(host(y), x)
    replicas = sorted(e["device"] for e in prof.events if e["kind"] == "replica")
    assert replicas == ["cuda:0", "cuda:1"]
    c = prof.calls()[0]
    assert set(c["devices"]) >= {"cuda:0", "cuda:1"} and c["idle_devices"] == []
