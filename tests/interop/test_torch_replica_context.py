"""torch's per-thread state in the replica threads (dpmini/_torch.py's replica
context, docs/spec.md 6.2): grad mode, inference mode, CPU and CUDA autocast (flag and
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


# --- reproducible random numbers (docs/libraries.md: the rule) ---------------

def dropout_model(torch):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.ReLU(),
                            torch.nn.Linear(32, 8), torch.nn.AlphaDropout(0.2),
                            torch.nn.Dropout1d(0.3))
    return m.train()


def seeded_runs(torch, fn, seed, repeats=6):
    outs = []
    for _ in range(repeats):
        torch.manual_seed(seed)
        with torch.no_grad():
            outs.append(fn())
    return outs


@pytest.mark.parametrize("n", [2, 3, 4])
def test_same_seed_same_dropout_masks_over_repeats(torch, n):
    m = dropout_model(torch)
    x = torch.randn(24, 8)
    devs = [f"cpu:{i}" for i in range(n)]

    def call():
        return dpmini.DataParallel(m, devs)(x)
    outs = seeded_runs(torch, call, 7)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    other = seeded_runs(torch, call, 8, repeats=1)[0]
    assert not torch.equal(other, outs[0])


def test_random_functions_in_replicas_are_reproducible_whichever_thread_runs_first(torch):
    import time

    def replica(x, delay):
        time.sleep(delay)   # changes which thread draws first
        return torch.cat([torch.rand(3), torch.randn(3), torch.empty(3).uniform_(),
                          torch.randint(0, 100, (3,)).float(),
                          torch.nn.functional.dropout(torch.ones(3), 0.5),
                          torch.nn.functional.rrelu(-torch.ones(3), training=True),
                          torch.nn.functional.gumbel_softmax(torch.zeros(3)),
                          torch.nn.functional.dropout1d(torch.ones(1, 3, 1), 0.5)[0, :, 0]])

    def call(delays):
        return dpmini.parallel_apply([replica] * 3, [(i, d) for i, d in enumerate(delays)],
                                     devices=["cpu:0", "cpu:1", "cpu:2"])
    a = seeded_runs(torch, lambda: call([0.0, 0.02, 0.04]), 5, repeats=1)[0]
    b = seeded_runs(torch, lambda: call([0.04, 0.02, 0.0]), 5, repeats=1)[0]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # each replica draws its own numbers
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "complex128"])
def test_replica_dropout_equals_torchs_own_with_the_replicas_generator_state(torch, dtype):
    # F.dropout in a replica is computed as torch computes it: the same mask
    # torch's dropout draws from a default generator in the replica's state
    # (a real mask for complex inputs)
    x = torch.randn(5, 7, dtype=getattr(torch, dtype))
    seen = {}

    def replica(i):
        seen[i] = torch.nn.functional.dropout(x, 0.3)
        return i
    torch.manual_seed(11)
    dpmini.parallel_apply([replica, replica], [(0,), (1,)], devices=DEVS)
    torch.manual_seed(11)
    s = int(torch.randint(0, 2**32, (), dtype=torch.int64))
    for i in (0, 1):
        g = torch.Generator().manual_seed((s + i) % 2**32)
        own = torch.default_generator.get_state()
        torch.default_generator.set_state(g.get_state())
        try:
            want = torch.nn.functional.dropout(x, 0.3)
        finally:
            torch.default_generator.set_state(own)
        assert torch.equal(seen[i], want)


def test_get_rng_state_in_a_replica_is_its_generators_state(torch):
    # torch.get_rng_state() in replica i: the state of its generator, seeded
    # (s + i) mod 2**32 from the call's one draw s; outside: the default's
    seen = {}

    def replica(i):
        seen[i] = torch.get_rng_state()
        return i
    torch.manual_seed(11)
    dpmini.parallel_apply([replica, replica], [(0,), (1,)], devices=DEVS)
    torch.manual_seed(11)
    s = int(torch.randint(0, 2**32, (), dtype=torch.int64))
    for i in (0, 1):
        want = torch.Generator().manual_seed((s + i) % 2**32).get_state()
        assert torch.equal(seen[i], want)
    assert torch.equal(torch.get_rng_state(), torch.default_generator.get_state())


def test_set_rng_state_in_a_replica_replays_its_draws(torch):
    def replica(i):
        state = torch.get_rng_state()
        first = torch.rand(4)
        torch.set_rng_state(state)
        return first, torch.rand(4)
    torch.manual_seed(4)
    outs = dpmini.parallel_apply([replica, replica], [(0,), (1,)], devices=DEVS)
    for first, again in outs:
        assert torch.equal(first, again)
    assert not torch.equal(outs[0][0], outs[1][0])
    # the caller's generator moved by the call's one draw only
    after_call = torch.default_generator.get_state()
    torch.manual_seed(4)
    torch.randint(0, 2**32, (1,), dtype=torch.int64)
    assert torch.equal(torch.default_generator.get_state(), after_call)


def test_one_replica_draws_as_the_caller_would(torch):
    m = dropout_model(torch)
    x = torch.randn(6, 8)
    torch.manual_seed(3)
    with torch.no_grad():
        got = dpmini.DataParallel(m, ["cpu:1"])(x)
    torch.manual_seed(3)
    with torch.no_grad():
        want = m(x)
    assert torch.equal(got, want)


def test_rng_rule_off_leaves_replicas_on_the_default_generator(torch, monkeypatch):
    monkeypatch.setenv("DPMINI_TORCH_RNG", "0")
    state = torch.default_generator.get_state()
    dpmini.parallel_apply([lambda _: 0] * 2, [(0,), (1,)], devices=DEVS)
    # no draw for the call: the caller's generator did not move
    assert torch.equal(torch.default_generator.get_state(), state)


def test_a_call_advances_the_callers_generator_once_if_its_replicas_draw(torch):
    # one torch.randint draw when a replica runs a random function, none else
    torch.manual_seed(9)
    dpmini.parallel_apply([lambda _: torch.rand(2)] * 2, [(0,), (1,)], devices=DEVS)
    after_draws = torch.default_generator.get_state()
    torch.manual_seed(9)
    torch.randint(0, 2**32, (1,), dtype=torch.int64)
    assert torch.equal(after_draws, torch.default_generator.get_state())
    state = torch.default_generator.get_state()
    dpmini.parallel_apply([lambda _: torch.ones(2)] * 2, [(0,), (1,)], devices=DEVS)
    assert torch.equal(torch.default_generator.get_state(), state)


def test_attention_dropout_without_a_generator_argument_is_reproducible(torch):
    # scaled_dot_product_attention and nn.MultiheadAttention take no
    # generator: they run with the default generator in the replica's state
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True).train()
    q = torch.randn(4, 5, 8)

    def replica(x):
        sdpa = torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.5)
        return sdpa, mha(x, x, x, need_weights=False)[0]

    def call():
        return dpmini.parallel_apply([replica] * 2, [(q[:2],), (q[2:],)], devices=DEVS)
    outs = seeded_runs(torch, call, 21, repeats=4)
    for o in outs[1:]:
        assert all(torch.equal(a, b) for r, s in zip(o, outs[0]) for a, b in zip(r, s))
    other = seeded_runs(torch, call, 22, repeats=1)[0]
    assert not torch.equal(other[0][0], outs[0][0][0])


def test_calls_that_draw_nothing_leave_the_callers_generator_as_it_was(torch):
    # dropout in eval, dropout p=0 in train, attention without dropout: no draw
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    cases = {
        "dropout eval": (dropout_model(torch).eval(), (x,)),
        "dropout p=0": (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.0),
                                            torch.nn.Dropout1d(0.0)).train(), (x,)),
        "attention eval": (mha.eval(), (x.view(6, 1, 8),) * 3),
        "attention p=0": (torch.nn.MultiheadAttention(8, 2, batch_first=True).train(),
                          (x.view(6, 1, 8),) * 3),
    }
    cases["rrelu not training"] = (lambda a: torch.rrelu(a) + torch.rrelu_(a.clone()), (x,))
    for name, (m, args) in cases.items():
        torch.manual_seed(5)
        state = torch.default_generator.get_state()
        with torch.no_grad():
            if isinstance(m, torch.nn.Module):
                dpmini.DataParallel(m, DEVS)(*args)
            else:
                dpmini.parallel_apply([m, m], [(args[0][:3],), (args[0][3:],)], devices=DEVS)
        assert torch.equal(torch.default_generator.get_state(), state), name


def test_attention_that_draws_nothing_does_not_wait_for_the_swap_lock(torch):
    # a random function without a generator argument takes the process-wide
    # swap lock only when it draws: with dropout_p=0 replicas do not queue
    import threading
    import time
    from dpmini import _torch as adapter
    q = torch.randn(2, 4, 8)

    def replica(x, p):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=p)
    adapter._swap_lock.acquire()
    # the lock is held for 20 s unless the call ends first (then the timer is
    # cancelled): a call that waited for it would take the whole 20 s
    timer = threading.Timer(20.0, adapter._swap_lock.release)
    timer.start()
    t0 = time.monotonic()
    dpmini.parallel_apply([replica] * 2, [(q[:1], 0.0), (q[1:], 0.0)], devices=DEVS)
    waited = time.monotonic() - t0
    if timer.is_alive():
        timer.cancel()
        adapter._swap_lock.release()
    assert waited < 15
    # with dropout it does take the lock (the call waits for the timer)
    adapter._swap_lock.acquire()
    timer = threading.Timer(1.0, adapter._swap_lock.release)
    t0 = time.monotonic()
    timer.start()
    dpmini.parallel_apply([replica] * 2, [(q[:1], 0.5), (q[1:], 0.5)], devices=DEVS)
    timer.join()
    assert time.monotonic() - t0 >= 0.9


@pytest.mark.parametrize("make_p", [float, lambda p: __import__("numpy").float64(p),
                                    lambda p: __import__("numpy").float32(p)])
def test_dropout_with_a_numpy_probability_is_reproducible(torch, make_p):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(make_p(0.5))).train()
    x = torch.randn(16, 8)
    outs = seeded_runs(torch, lambda: dpmini.DataParallel(m, DEVS)(x), 3, repeats=8)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def _padded_encoder(torch):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    x = torch.randn(4, 6, 16)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 4:] = True
    return enc, x, mask


def _per_shard(torch, fn, x, mask):
    """fn on each of the two devices' shards, concatenated."""
    return torch.cat([fn(x[:2], mask[:2]), fn(x[2:], mask[2:])])


def test_eval_fast_paths_run_in_replicas_as_on_one_device(torch):
    # TransformerEncoder in eval with a padding mask takes torch's nested-tensor
    # fast path (padded positions come out 0) only when no TorchFunctionMode is
    # active: eval-mode replicas of the fast-path modules run outside the
    # random-number mode, also when the encoder is all eval but its dropouts
    # train (Monte Carlo dropout: the fast path skips them, as on one device)
    enc, x, mask = _padded_encoder(torch)
    for mc_dropout in (False, True):
        enc.eval()
        if mc_dropout:
            for m in enc.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.train()
        with torch.no_grad():
            want = _per_shard(torch, lambda a, k: enc(a, src_key_padding_mask=k), x, mask)
            got = dpmini.DataParallel(enc, DEVS)(x, src_key_padding_mask=mask)
        assert torch.equal(got[:, 4:], torch.zeros_like(got[:, 4:])), mc_dropout
        assert torch.allclose(got, want, atol=1e-6), mc_dropout


def test_a_frozen_eval_encoder_under_a_training_head_matches_one_device(torch):
    enc, x, mask = _padded_encoder(torch)
    enc.requires_grad_(False)
    head = torch.nn.Linear(16, 3)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = enc, head

        def forward(self, a, k):
            return self.head(self.enc(a, src_key_padding_mask=k))
    model = Model().train()
    enc.eval()   # a frozen encoder under a head that trains
    with torch.no_grad():
        want = _per_shard(torch, model, x, mask)
    got = dpmini.DataParallel(model, DEVS)(x, mask)
    assert torch.allclose(got, want, atol=1e-6)
    got.sum().backward()
    dp_grad = head.weight.grad.clone()
    head.zero_grad()
    _per_shard(torch, model, x, mask).sum().backward()
    assert torch.allclose(dp_grad, head.weight.grad, atol=1e-5)


def test_the_fast_path_is_decided_when_the_module_is_called(torch):
    # a teacher put in eval inside forward, and an encoder in train mode whose
    # layers are in eval (torch decides on its first layer): both take torch's
    # fast path as on one device
    enc, x, mask = _padded_encoder(torch)

    class Distill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.teacher, self.student = enc, torch.nn.Linear(16, 16)

        def forward(self, a, k):
            self.teacher.eval()
            with torch.no_grad():
                t = self.teacher(a, src_key_padding_mask=k)
            return self.student(a), t
    model = Distill().train()
    want = _per_shard(torch, lambda a, k: model(a, k)[1], x, mask)
    model.train()
    got = dpmini.DataParallel(model, DEVS)(x, mask)[1]
    assert torch.equal(got[:, 4:], torch.zeros_like(got[:, 4:]))
    assert torch.allclose(got, want, atol=1e-6)
    enc.train()
    enc.layers.eval()
    with torch.no_grad():
        want = _per_shard(torch, lambda a, k: enc(a, src_key_padding_mask=k), x, mask)
        got = dpmini.DataParallel(enc, DEVS)(x, src_key_padding_mask=mask)
    assert torch.allclose(got, want, atol=1e-6)


def test_eval_layers_whose_dropouts_draw_keep_the_rule_where_no_fast_path_can_run(torch):
    # Monte Carlo dropout in an eval TransformerEncoderLayer fed by a trainable
    # layer: with grad on torch takes its other path, the dropouts draw, and the
    # call is repeatable; so is a module switched to train inside forward
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self, switch):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)
            self.enc = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.5, batch_first=True)
            self.switch = switch

        def forward(self, a):
            if self.switch:
                self.enc.train()
            return self.enc(self.proj(a))
    x = torch.randn(8, 6, 16)
    for switch in (False, True):
        m = Model(switch)
        m.enc.eval()
        for sub in m.enc.modules():
            if isinstance(sub, torch.nn.Dropout):
                sub.train()
        outs = []
        for _ in range(6):
            torch.manual_seed(1)
            outs.append(dpmini.DataParallel(m, DEVS)(x).detach())
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), switch


def test_replicas_of_fast_path_modules_copy_and_pickle_as_their_class(torch):
    import copy
    import gc
    import io
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(4, 5, 8)
    with torch.no_grad():
        reps = dpmini.replicate(mha, DEVS)
        c = copy.deepcopy(reps[1])
        buf = io.BytesIO()
        torch.save(reps[1], buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        del reps
        gc.collect()
        for other in (c, loaded):
            assert type(other) is torch.nn.MultiheadAttention
            assert torch.allclose(other(x, x, x)[0], mha(x, x, x)[0], atol=1e-6)
        c.out_proj.weight.zero_()
        c.out_proj.bias.zero_()
        assert bool((c(x, x, x)[0] == 0).all())   # the copy's own weights


def test_random_functions_in_eval_mode_replicas_are_reproducible(torch):
    # sampling in eval (F.dropout(training=True), randn_like) keeps the rule,
    # whichever replica draws first
    import time

    class Sampler(torch.nn.Module):
        def forward(self, a, delay):
            time.sleep(delay)
            return torch.nn.functional.dropout(a, 0.5, training=True) + torch.randn_like(a)
    m = Sampler().eval()
    x = torch.ones(8, 4)

    def call(delays):
        return dpmini.parallel_apply([m, m], [(x[:4], delays[0]), (x[4:], delays[1])],
                                     devices=DEVS)
    a = seeded_runs(torch, lambda: call([0.0, 0.03]), 3, repeats=1)[0]
    b = seeded_runs(torch, lambda: call([0.03, 0.0]), 3, repeats=1)[0]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], a[1])


def test_a_replica_error_in_a_random_function_is_its_error(torch):
    def replica(_):
        return torch.nn.functional.dropout(torch.ones(3), p=1.5)
    with pytest.raises(ValueError, match="(?s)Caught ValueError in replica 0.*dropout probability has to be"):
        dpmini.parallel_apply([replica] * 2, [(0,), (1,)], devices=DEVS)


def test_replica_dropout_keeps_torchs_defaults(torch):
    # F.alpha_dropout's training defaults to False, F.dropout's to True
    def replica(_):
        x = torch.ones(50)
        return (torch.equal(torch.nn.functional.alpha_dropout(x, 0.5), x),
                torch.equal(torch.nn.functional.dropout(x, 0.5), x))
    got = dpmini.parallel_apply([replica] * 2, [(0,), (1,)], devices=DEVS)
    assert got == [(True, False)] * 2


def test_a_failing_step_of_the_context_undoes_the_steps_before_it(torch, monkeypatch):
    # the stream step fails after grad mode was set: grad mode is set back
    from dpmini import _torch

    def failing(self, index, device, undo):
        torch._C._set_grad_enabled(False)
        undo.append(lambda: torch._C._set_grad_enabled(True))
        raise RuntimeError("no stream")
    monkeypatch.setattr(_torch._ReplicaCall, "_set", failing)
    with pytest.raises(RuntimeError, match="Caught RuntimeError in replica 0"):
        dpmini.parallel_apply([lambda _: 0] * 2, [(0,), (1,)], devices=DEVS)
    monkeypatch.undo()
    # what the worker threads were left with, seen without torch's provider
    dpmini.unregister_replica_context(_torch._replica_context)
    try:
        probe = dpmini.parallel_apply([lambda _: torch.is_grad_enabled()] * 2, [(0,), (1,)],
                                      devices=DEVS)
    finally:
        dpmini.register_replica_context(_torch._replica_context)
    assert probe == [True, True]


# The caller's OpenMP team (docs/spec.md 6.3). With OMP_WAIT_POLICY=ACTIVE, read
# by libgomp when torch loads it, the team's idle threads spin for good after a
# parallel region, so a team left spinning while the replicas sleep shows as
# about a core's worth of CPU time. The replicas sleep 0.3 s; the process's CPU
# time over the call is printed (spinning: about 0.3 s; parked: a few ms).
_TEAM_SCRIPT = """
import os, time, torch, dpmini
from torch import nn

class Sleep(nn.Module):
    def forward(self, x):
        time.sleep(0.3)
        return x * 1

torch.set_num_threads(2)
dp = dpmini.DataParallel(Sleep(), ["cpu:0", "cpu:1"])
x = torch.ones(4, 3)
dp(x)                                          # workers started
big = torch.ones(4_000_000)
assert float((big + 1).sum()) == 8_000_000.0   # a region of the caller's team
c0 = time.process_time()
out = dp(x)
print("cpu", time.process_time() - c0)
assert torch.equal(out, x)
assert torch.get_num_threads() == 2
print("OK")
"""


def _call_cpu_seconds(park):
    from script_runner import run_script
    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE", DPMINI_PARK_OPENMP=park)
    res = run_script(_TEAM_SCRIPT, env=env)
    return float(res.stdout.split("cpu", 1)[1].split()[0])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a team of two threads")
def test_the_callers_openmp_team_sleeps_while_replicas_run(torch):
    assert _call_cpu_seconds("1") < 0.05
    # the control: the same call with the team left as it was spins through it
    # (about 0.3 s); a loaded machine may deny the spinning thread its share
    # for a while, so one of three runs must show more than a third of that
    spun = 0.0
    for _ in range(3):
        spun = _call_cpu_seconds("0")
        if spun > 0.1:
            break
    assert spun > 0.1


_SHORT_THEN_LONG = _TEAM_SCRIPT.replace("c0 = time.process_time()", """
tiny = dpmini.DataParallel(nn.Linear(3, 3), ["cpu:0", "cpu:1"])
with torch.no_grad():
    for _ in range(2000):                      # until one took under 1 ms
        t = time.perf_counter()
        tiny(x)
        if time.perf_counter() - t < 0.001:
            break
    else:
        print("no call of nn.Linear(3, 3) took under 1 ms")
        print("OK")
        raise SystemExit(0)
c0 = time.process_time()
dp(x)
print("unparked", time.process_time() - c0)
assert float((big + 1).sum()) == 8_000_000.0
c0 = time.process_time()""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a team of two threads")
def test_a_call_after_a_short_call_leaves_the_team_as_it_was(torch):
    from script_runner import run_script
    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE", DPMINI_PARK_OPENMP="1")
    unparked = 0.0
    for _ in range(3):        # the spinning side may be denied its core now and then
        out = run_script(_SHORT_THEN_LONG, env=env).stdout
        if "took under 1 ms" in out:
            pytest.skip("the machine is too busy for a call under 1 ms")
        parked = float(out.split("cpu", 1)[1].split()[0])
        assert parked < 0.05      # after that long call: parked again
        unparked = float(out.split("unparked", 1)[1].split()[0])
        if unparked > 0.1:
            break
    assert unparked > 0.1     # after calls under 1 ms: not parked, the team spins


# A Python thread whose first torch use is inside a parked DataParallel call:
# torch sets that thread's OpenMP thread count there, inside the region, and
# the region's end must not drop it (it did: the thread's count, then the
# process-wide one through the replicas' set-back, went back to the core count).
_FRESH_THREAD_SCRIPT = """
import threading, torch, dpmini
from torch import nn

torch.set_num_threads(1)
m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
x = torch.randn(33, 64)
seen = []

def work():
    dp = dpmini.DataParallel(m, ["cpu:0", "cpu:1"])
    for _ in range(3):
        dp(x)
        seen.append(torch.get_num_threads())

t = threading.Thread(target=work)
t.start()
t.join()
print("thread", seen, "main", torch.get_num_threads())
assert seen == [1, 1, 1] and torch.get_num_threads() == 1
print("OK")
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a team of two threads")
def test_a_new_threads_first_call_keeps_torchs_thread_count(torch):
    from script_runner import run_script
    env = dict(os.environ, DPMINI_PARK_OPENMP="1")
    assert "OK" in run_script(_FRESH_THREAD_SCRIPT, env=env).stdout


# The same with no torch.set_num_threads: torch then sets a thread's count from
# MKL's when it first asks, and MKL answers 1 inside a parallel region; the
# first call of a thread asks outside the parked region (the caller went on
# single-threaded for good otherwise).
_FIRST_ASK_SCRIPT = """
import torch, dpmini
from torch import nn

m = nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 3))
dp = dpmini.DataParallel(m, ["cpu:0", "cpu:1"])
y = dp(torch.randn(8, 7))   # the first thing to ask for the thread count
y.sum().backward()
dp(torch.randn(8, 7))
print("threads", torch.get_num_threads())
assert torch.get_num_threads() == 2
print("OK")
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="expects torch's default of two threads")
def test_a_threads_first_ask_for_its_count_is_outside_the_parked_region(torch):
    from script_runner import run_script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    env["DPMINI_PARK_OPENMP"] = "1"
    assert "OK" in run_script(_FIRST_ASK_SCRIPT, env=env).stdout
