"""What the replica contexts cost (dpmini.register_replica_context; torch's in
dpmini/_torch.py): per-call overhead of the hook and of torch's context, and
the cost of the reproducible random numbers rule against no rule.

Run: python benchmarks/bench_replica_context.py [--rounds 9] [--calls 300]
A script that prints figures and ratios, not a test; it always exits 0.

The routes of one figure run interleaved (each round runs every route once,
after a warm-up round) and each figure is the median over the rounds, so a
slow spell on the shared machine hits all routes alike. Items 1 and 2 are CPU
time of the process (time.process_time: the caller and the worker threads),
which waiting for a core on a loaded machine does not inflate; item 3 is
wall-clock time.

1. Hook, no array library: DataParallel(identity) on one (8, 4) float32
   array over 2 virtual devices, with no provider registered, with a provider
   that returns None, and with one whose enter and exit do nothing (torch is
   not imported in this part: it runs in a subprocess of its own).
2. torch's context: nn.Linear(8, 8) in eval mode under torch.no_grad() through
   DataParallel on 2 virtual devices, with torch's provider registered and
   unregistered (the difference is what carrying grad mode, inference mode,
   autocast, streams and thread counts costs a call), and the direct call.
3. Random numbers: a training-mode forward (under no_grad) of models with
   dropout on 2 virtual devices, with the rule (DPMINI_TORCH_RNG unset) and
   without it (DPMINI_TORCH_RNG=0): a small MLP (64 x 32 -> 64 -> 10, two
   Dropout) where per-op costs dominate, and 4096 x 784 -> 512 -> 10 with
   Dropout, where the arithmetic does.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import dpmini


def median_per_call(routes, calls, rounds, clock=time.perf_counter):
    """Median over `rounds` interleaved rounds (after a warm-up one) of the mean
    seconds per call of each route, `calls` calls a round, on `clock`."""
    times = {name: [] for name in routes}
    for r in range(rounds + 1):
        for name, fn in routes.items():
            start = clock()
            for _ in range(calls):
                fn()
            if r > 0:
                times[name].append((clock() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_hook(calls, rounds):
    devs = ["cpu:0", "cpu:1"]
    x = np.ones((8, 4), dtype=np.float32)
    dp = dpmini.DataParallel(lambda a: a, device_ids=devs)

    def none_provider(devices):
        return None

    def noop_provider(devices):
        return noop_enter

    def noop_enter(i, device):
        return None

    def with_provider(p):
        def run():
            dpmini.register_replica_context(p)
            try:
                dp(x)
            finally:
                dpmini.unregister_replica_context(p)
        return run
    def register_only():
        dpmini.register_replica_context(none_provider)
        dpmini.unregister_replica_context(none_provider)
        dp(x)
    # registering costs too: measured alone, then subtracted
    t = median_per_call({
        "none": lambda: dp(x),
        "register only": register_only,
        "provider -> None": with_provider(none_provider),
        "provider -> enter": with_provider(noop_provider),
    }, calls, rounds, time.process_time)
    reg = t["register only"] - t["none"]
    print(f"1. DataParallel(identity), one (8, 4) leaf, 2 devices, no torch, CPU time: "
          f"{t['none'] * 1e6:.1f} us a call with no provider; a provider returning None "
          f"+{(t['provider -> None'] - t['none'] - reg) * 1e6:.1f} us; one whose enter and "
          f"exit do nothing +{(t['provider -> enter'] - t['none'] - reg) * 1e6:.1f} us "
          f"(registering and unregistering, {reg * 1e6:.1f} us, subtracted)")


def bench_torch_context(calls, rounds):
    import torch
    from dpmini import _torch
    devs = ["cpu:0", "cpu:1"]
    lin = torch.nn.Linear(8, 8).eval()
    x = torch.randn(8, 8)
    dp = dpmini.DataParallel(lin, device_ids=devs)

    def without():
        dpmini.unregister_replica_context(_torch._replica_context)
        try:
            dp(x)
        finally:
            dpmini.register_replica_context(_torch._replica_context)

    def register_only():
        dpmini.unregister_replica_context(_torch._replica_context)
        dpmini.register_replica_context(_torch._replica_context)
        dp(x)

    with torch.no_grad():
        t = median_per_call({"with": lambda: dp(x), "without": without,
                             "register only": register_only, "direct": lambda: lin(x)},
                            calls, rounds, time.process_time)
    ctx = (t["register only"] - t["without"]) * 1e6
    print(f"2. nn.Linear(8, 8) eval, no_grad, 2 devices, CPU time: {t['with'] * 1e6:.1f} us a "
          f"call (over the direct call {(t['with'] - t['direct']) * 1e6:.1f} us); "
          f"torch's replica context {ctx:.1f} us of it "
          f"({t['register only'] / t['without']:.2f}x the call without it)")


def bench_random(calls, rounds):
    import torch
    devs = ["cpu:0", "cpu:1"]
    torch.manual_seed(0)
    small = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10), torch.nn.Dropout(0.2)).train()
    big = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                              torch.nn.Linear(512, 10)).train()
    cases = [("MLP 64 x 32 -> 64 -> 10", small, torch.randn(64, 32), calls),
             ("MLP 4096 x 784 -> 512 -> 10", big, torch.randn(4096, 784), max(calls // 100, 2))]
    for name, model, x, n in cases:
        dp = dpmini.DataParallel(model, device_ids=devs)

        def rule(dp=dp, x=x):
            os.environ.pop("DPMINI_TORCH_RNG", None)
            dp(x)

        def no_rule(dp=dp, x=x):
            os.environ["DPMINI_TORCH_RNG"] = "0"
            dp(x)
        with torch.no_grad():
            t = median_per_call({"rule": rule, "no rule": no_rule}, n, rounds)
        os.environ.pop("DPMINI_TORCH_RNG", None)
        print(f"3. {name}, training-mode forward with dropout, 2 devices: "
              f"{t['rule'] * 1e3:.3f} ms with the random numbers rule, "
              f"{t['no rule'] * 1e3:.3f} ms without: {t['rule'] / t['no rule']:.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--part", choices=["hook", "torch"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part in (None, "hook"):
        if args.part is None:
            # in a fresh interpreter: torch must not be imported there
            subprocess.run([sys.executable, __file__, "--part", "hook", "--rounds",
                            str(args.rounds), "--calls", str(args.calls)], check=False)
        else:
            bench_hook(args.calls, args.rounds)
            return
    try:
        import torch  # noqa: F401
    except ImportError:
        print("2-3. skipped: torch is not installed")
        return
    bench_torch_context(args.calls, args.rounds)
    bench_random(args.calls, args.rounds)


if __name__ == "__main__":
    main()
