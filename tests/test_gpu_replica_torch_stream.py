"""GPU replicas run on the caller's current torch stream of their device and
under its CUDA autocast (docs/spec.md 6.2: torch's parallel_apply enters
torch.cuda.stream(caller's stream) and autocast in each worker), and the
worker's own stream is set back after. CPU torch has no CUDA streams, so
torch.cuda's stream functions are stand-ins here that record, per thread,
what was set; the replicas run on the emulated GPUs."""
import threading

import pytest

import dpmini
from gpu_helpers import NGPU, gpu

pytestmark = gpu


class FakeStream:
    def __init__(self, name, device):
        self.name, self.device_index = name, device

    def __repr__(self):
        return f"FakeStream({self.name!r}, {self.device_index})"


@pytest.fixture
def torch_streams(monkeypatch):
    """torch.cuda with per-thread current streams (as c10's are): the caller's
    thread starts on side streams, every other thread on default ones."""
    torch = pytest.importorskip("torch")
    tl = threading.local()
    caller = threading.get_ident()

    def current(device=None):
        cur = getattr(tl, "streams", None)
        if cur is None:
            kind = "side" if threading.get_ident() == caller else "default"
            cur = tl.streams = {d: FakeStream(kind, d) for d in range(NGPU)}
        return cur[device]

    def set_stream(stream):
        current(stream.device_index)
        tl.streams[stream.device_index] = stream
        torch.cuda.set_log.append((threading.get_ident(), repr(stream)))

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", current)
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "set_log", [], raising=False)
    return torch


def test_gpu_replicas_run_on_the_callers_stream_of_their_device(torch_streams):
    torch = torch_streams
    devs = [0, 1] if NGPU >= 2 else [0, 0]

    def replica(i):
        # what the replica's own torch code would launch on
        return threading.get_ident(), repr(torch.cuda.current_stream(devs[i]))
    got = dpmini.parallel_apply([replica, replica], [(0,), (1,)],
                                devices=[f"cuda:{d}" for d in devs])
    assert [s for _, s in got] == [f"FakeStream('side', {d})" for d in devs]
    # each worker thread is back on its own stream once its replica returned
    for (thread, _), d in zip(got, devs):
        sets = [s for t, s in torch.cuda.set_log if t == thread]
        assert sets == [f"FakeStream('side', {d})", f"FakeStream('default', {d})"], sets


def test_gpu_replicas_run_under_the_callers_cuda_autocast(torch_streams):
    torch = torch_streams
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        got = dpmini.parallel_apply(
            [lambda _: (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))] * 2,
            [(0,), (1,)], devices=["cuda:0", f"cuda:{NGPU - 1}"])
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", torch.float16)
    assert got == [(True, torch.bfloat16)] * 2
