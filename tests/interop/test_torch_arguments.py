"""Torch-shaped arguments: torch.device objects wherever dpmini takes a
device, torch tensors as comm's out= and in device_of, and scatter_kwargs'
inputs container compared with PyTorch's own scatter_kwargs."""
import numpy as np
import pytest

import dpmini

from .conftest import DEVS


def test_torch_devices_name_the_same_devices_as_their_strings(torch):
    D = torch.device
    assert dpmini.Device(D("cpu")) == dpmini.Device("cpu")
    assert dpmini.Device(D("cpu", 1)) == dpmini.Device("cpu:1")
    assert dpmini.Device(D("cuda", 1)) == dpmini.Device("cuda:1")   # may be absent, as strings
    assert dpmini.Device(D("cuda")) == dpmini.Device("cuda:0")


def test_dataparallel_takes_torch_devices_and_cpu_output_means_the_host(torch):
    D = torch.device
    dp = dpmini.DataParallel(lambda t: t * 2, [D("cpu", 0), D("cpu", 1)],
                             output_device=D("cpu"))
    assert dp.device_ids == [dpmini.Device(d) for d in DEVS]
    assert dp.output_device == dpmini.Device("cpu")
    x = torch.arange(4.0)
    out = dp(x)
    assert torch.equal(out, x * 2) and dpmini.device_of(out) == dpmini.Device("cpu")
    out1 = dpmini.DataParallel(lambda t: t, DEVS, output_device=D("cpu", 1))(x)
    assert dpmini.device_of(out1) == dpmini.Device("cpu:1")


def test_comm_functions_take_torch_devices(torch):
    D = torch.device
    x = torch.arange(6.0)
    parts = dpmini.comm.scatter(x, [D("cpu", 0), D("cpu", 1)])
    assert [dpmini.device_of(p) for p in parts] == [dpmini.Device(d) for d in DEVS]
    back = dpmini.comm.gather(parts, destination=D("cpu"))
    assert torch.equal(back, x) and dpmini.device_of(back) == dpmini.Device("cpu")
    copies = dpmini.comm.broadcast(x, [D("cpu", 0), D("cpu", 1)])
    assert [dpmini.device_of(c) for c in copies] == [dpmini.Device(d) for d in DEVS]
    s = dpmini.comm.reduce_add([x, x], D("cpu", 1))
    assert torch.equal(s, 2 * x) and dpmini.device_of(s) == dpmini.Device("cpu:1")
    a = dpmini.asarray(np.ones(3), D("cpu", 1))
    assert dpmini.device_of(a) == dpmini.Device("cpu:1")


def test_a_torch_device_of_another_type_is_refused_naming_the_argument(torch):
    with pytest.raises(ValueError, match=r"^output_device: unsupported torch.device "
                                         r"device\(type='meta'\)"):
        dpmini.DataParallel(lambda t: t, DEVS, output_device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"^device_ids\[0\]: expected a non-host device"):
        dpmini.DataParallel(lambda t: t, [torch.device("cpu")])
    with pytest.raises(TypeError, match=r"^device_ids: expected a list of devices, got a "
                                        r"single torch.device"):
        dpmini.DataParallel(lambda t: t, torch.device("cpu", 0))


def test_comm_scatter_and_gather_write_into_torch_out_tensors(torch):
    x = torch.arange(6.0).reshape(3, 2)
    outs = [torch.empty(2, 2), torch.empty(1, 2)]
    res = dpmini.comm.scatter(x, out=outs)
    assert res[0] is outs[0] and res[1] is outs[1]
    assert torch.equal(torch.cat(outs), x)
    out = torch.empty(3, 2)
    assert dpmini.comm.gather([x[:2], x[2:]], out=out) is out
    assert torch.equal(out, x)
    bf = torch.empty(3, 2, dtype=torch.bfloat16)
    assert dpmini.comm.gather([x[:2].bfloat16(), x[2:].bfloat16()], out=bf) is bf
    assert torch.equal(bf, x.bfloat16())


def test_comm_out_refusals_name_the_type_by_module(torch):
    with pytest.raises(TypeError, match=r"^out: expected a sequence of arrays, got torch.Tensor"):
        dpmini.comm.scatter(np.ones(4), out=torch.empty(4))
    with pytest.raises(ValueError, match=r"^out: Expected out array to have shape \[3, 2\]"):
        dpmini.comm.gather([torch.ones(3, 2)], out=torch.empty(3, 3))


def test_device_of_a_torch_shard_is_the_device_dpmini_put_it_on(torch):
    parts = dpmini.scatter(torch.ones(8, 2), DEVS)
    assert [dpmini.device_of(p) for p in parts] == [dpmini.Device(d) for d in DEVS]
    assert dpmini.device_of(parts[1][1:]) == dpmini.Device("cpu:1")   # a view of it
    assert dpmini.device_of(torch.ones(2)) == dpmini.Device("cpu")
    assert dpmini.device_of(torch.ones(2, requires_grad=True)) == dpmini.Device("cpu")


def test_scatter_kwargs_keeps_the_inputs_container_as_pytorch(torch):
    from torch.nn.parallel.scatter_gather import scatter_kwargs as torch_scatter_kwargs
    # non-tensor values: PyTorch's scatter runs on the CPU and copies them per replica
    for inputs, kwargs in [([5, "s"], None), ((5, "s"), None), ([], {"k": 5}), ((), {"k": 5})]:
        want = torch_scatter_kwargs(inputs, kwargs, [0, 1])
        got = dpmini.scatter_kwargs(inputs, kwargs, DEVS)
        assert [type(r) for r in got[0]] == [type(r) for r in want[0]], inputs
        assert got == want
    x = torch.arange(4.0)
    ins, _ = dpmini.scatter_kwargs([x], None, DEVS)
    assert [type(r) for r in ins] == [list, list]
    assert [r[0].tolist() for r in ins] == [[0.0, 1.0], [2.0, 3.0]]


def test_a_packed_sequence_is_refused_naming_its_path(torch):
    # its fields share no batch dimension: pieces made field by field do not fit
    # together (docs/spec.md 3.1)
    from torch.nn.utils.rnn import pack_padded_sequence
    x = torch.randn(4, 3, 2)
    packed = pack_padded_sequence(x, [3, 3, 2, 1], batch_first=True)
    lstm = torch.nn.LSTM(2, 4, batch_first=True)
    match = "PackedSequence cannot be scattered: its data has sum"
    with pytest.raises(TypeError, match=r"^args\[0\]\['seq'\]: a torch.nn.utils.rnn." + match):
        dpmini.scatter_kwargs(({"seq": packed},), None, DEVS)
    with pytest.raises(TypeError, match=r"^kwargs\['h'\]: .*" + match):
        dpmini.scatter_kwargs((x,), {"h": packed}, DEVS)
    with pytest.raises(TypeError, match=r"^args\[0\]: .*" + match):
        dpmini.DataParallel(lstm, DEVS)(packed)
    # given as the argument tuple itself, it would be unpacked field by field
    for call in (lambda: dpmini.data_parallel(lstm, packed, DEVS),
                 lambda: dpmini.data_parallel(lambda *a: a[0], packed, DEVS),
                 lambda: dpmini.scatter_kwargs(packed, None, DEVS),
                 lambda: dpmini.explain(packed, DEVS)):
        with pytest.raises(TypeError, match=r"^inputs: .*" + match):
            call()
    with torch.no_grad(), pytest.raises(TypeError, match=r"^args\[0\]: .*" + match):
        dpmini.DataParallel(lstm, DEVS)(packed)
    assert dpmini.explain((packed,), DEVS).error.startswith("args[0]: a torch.nn.utils.rnn.")

    class Subclass(torch.nn.utils.rnn.PackedSequence):
        pass
    with pytest.raises(TypeError, match=match):
        dpmini.scatter(Subclass(*packed), DEVS)
    import collections
    SameName = collections.namedtuple("PackedSequence", "a b")   # another module's: split
    assert [p.a.shape[0] for p in dpmini.scatter(SameName(x, 3), DEVS)] == [2, 2]

    class PacksInside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = lstm

        def forward(self, x):
            n, t = x.shape[:2]
            return self.lstm(pack_padded_sequence(x, [t] * n, batch_first=True))[0]
    with pytest.raises(TypeError, match="PackedSequence cannot be gathered: its data has sum"):
        dpmini.DataParallel(PacksInside(), DEVS)(x)
