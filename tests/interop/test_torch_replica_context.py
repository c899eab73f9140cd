"""torch's per-thread state in the replica threads (dpmini/_torch.py's replica
context, spec 6.2): grad mode, inference mode, CPU and CUDA autocast (flag and
dtype), the intra-op thread count (cut to cores // replicas on virtual CPU
devices), set in each persistent worker on every call and set back after."""
import os

import pytest

import dpmini

DEVS = ["cpu:0", "cpu:1"]


def state(torch):
    """What a replica sees of its thread's torch state."""
    return {
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "cpu": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "cuda": (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")),
        "threads": torch.get_num_threads(),
    }


def replica_states(torch, devs=DEVS):
    return dpmini.parallel_apply([lambda _: state(torch)] * len(devs),
                                 [(i,) for i in range(len(devs))], devices=devs)


def per_replica(torch, n):
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)) // n))


def test_grad_and_inference_mode_are_carried_both_ways(torch):
    with torch.no_grad():
        assert [s["grad"] for s in replica_states(torch)] == [False, False]
    # after a no_grad call the persistent workers run with grad again
    assert [s["grad"] for s in replica_states(torch)] == [True, True]
    with torch.inference_mode():
        got = replica_states(torch)
    assert [(s["inference"], s["grad"]) for s in got] == [(True, False)] * 2
    assert [(s["inference"], s["grad"]) for s in replica_states(torch)] == [(False, True)] * 2


def test_cpu_autocast_carries_its_dtype(torch):
    # torch's parallel_apply copies only the flag: dpmini carries the dtype too
    with torch.autocast("cpu", dtype=torch.float16):
        got = replica_states(torch)
    assert [s["cpu"] for s in got] == [(True, torch.float16)] * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = replica_states(torch)
    assert [s["cpu"] for s in got] == [(True, torch.bfloat16)] * 2
    after = replica_states(torch)
    assert [s["cpu"][0] for s in after] == [False, False]


def test_cuda_autocast_flag_and_dtype_are_carried(torch):
    # CPU torch cannot enter torch.autocast("cuda"), but its per-thread state
    # can be set: what a replica sees of it is what a GPU replica would use
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        got = replica_states(torch)
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", torch.float16)
    assert [s["cuda"] for s in got] == [(True, torch.bfloat16)] * 2
    assert [s["cuda"] for s in replica_states(torch)] == [(False, torch.float16)] * 2


def test_state_a_replica_leaves_behind_does_not_reach_the_next_call(torch):
    def leaky(_):
        torch.set_grad_enabled(False)
        torch.set_autocast_enabled("cpu", True)
        torch.set_num_threads(1)
        return 0
    dpmini.parallel_apply([leaky, leaky], [(0,), (1,)], devices=DEVS)
    got = replica_states(torch)
    assert [(s["grad"], s["cpu"][0]) for s in got] == [(True, False)] * 2
    assert [s["threads"] for s in got] == [per_replica(torch, 2)] * 2


def test_state_is_set_back_after_a_replica_raises(torch):
    def fails(_):
        raise RuntimeError("boom")
    with torch.no_grad(), torch.autocast("cpu"):
        with pytest.raises(RuntimeError, match="Caught RuntimeError in replica 0"):
            dpmini.parallel_apply([fails, fails], [(0,), (1,)], devices=DEVS)
    got = replica_states(torch)
    assert [(s["grad"], s["cpu"][0]) for s in got] == [(True, False)] * 2


def test_intra_op_threads_are_cut_to_cores_per_replica(torch):
    caller = torch.get_num_threads()
    got = replica_states(torch)
    assert [s["threads"] for s in got] == [per_replica(torch, 2)] * 2
    assert torch.get_num_threads() == caller
    # a caller's smaller count is kept, and reaches the persistent workers
    torch.set_num_threads(1)
    try:
        assert [s["threads"] for s in replica_states(torch)] == [1, 1]
    finally:
        torch.set_num_threads(caller)
    assert torch.get_num_threads() == caller


def test_thread_limit_off_gives_replicas_the_callers_count(torch, monkeypatch):
    monkeypatch.setenv("DPMINI_BLAS_LIMIT", "0")
    caller = torch.get_num_threads()
    assert [s["threads"] for s in replica_states(torch)] == [caller, caller]


def test_autocast_cache_is_cleared_when_the_replica_leaves(torch):
    # torch.autocast clears its per-thread cache of cast weights when left: a
    # replica's cast copies must not outlive the call (stale weights after an
    # in-place update of the parameters, as an optimizer step makes)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(4, 4)

    def run():
        return dpmini.parallel_apply([lin, lin], [(x,), (x,)], devices=DEVS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        before = run()
        lin.weight.mul_(2)
        after = run()
        want = lin(x)
    assert want.dtype == torch.float16
    assert all(torch.equal(a, want) for a in after)
    assert not torch.equal(after[0], before[0])
