"""dpmini.DataParallel over torch.nn.Modules on virtual CPU devices, against plain
torch on the same cores.

Run: python benchmarks/bench_torch.py [--rounds 7]
A script that prints figures, not a test; it always exits 0. Every figure is printed
with its target and "met" or "MISSED".

Timing: the routes of one figure run interleaved (each round runs every route in
turn, after a warm-up round) and each figure is the MEDIAN over the rounds, so a slow
spell hits all routes alike. The load average is printed before and after, and on Linux
the share of CPU time the host stole from this virtual machine during the run (on a noisy
host the figures move by far more than on a quiet one: see benchmarks/README.md).

1. Training step of an MLP (4096 x 784 -> 512 -> 10, float32; forward, cross-entropy,
   backward, SGD step): DataParallel on 2 virtual devices against the same step on the
   module itself. Target: >= 0.95x plain torch (plain time / DataParallel time).
   Backward runs on the caller's thread in torch's engine; the parallel part is the
   forward. Printed three times: as the environment has it; (1b, a child process)
   with OMP_WAIT_POLICY=PASSIVE; (1c, a child process) with DPMINI_PARK_OPENMP=0.
   With libgomp's default policy the OpenMP threads of the caller's backward keep
   spinning for milliseconds after it ends; dpmini parks them while the next
   forward's replicas run (docs/libraries.md), and 1c shows the step without that.
   1d is a baseline without dpmini: the same step split by hand over two Python threads.
2. A conv net of about 5 M parameters in eval mode under torch.no_grad() (batch 128 of
   3 x 32 x 32): DataParallel on 2 virtual devices against the module itself.
   Target: >= 1.0x plain torch.
3. Per-call overhead of a tiny nn.Linear(8, 8) on an (8, 8) input over 2 virtual
   devices, minus the direct call, under torch.no_grad() and with grad mode on
   (forward only). Target: < 0.2 ms.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

import dpmini

DEVS = ["cpu:0", "cpu:1"]


def _median_ms(routes, rounds, calls):
    """Median per-call time (ms) of each route, routes interleaved round by round."""
    times = {name: [] for name in routes}
    for r in range(rounds + 1):
        for name, fn in routes.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            if r > 0:                      # round 0 warms up
                times[name].append((time.perf_counter() - t) / calls * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def _verdict(ok):
    return "met" if ok else "MISSED"


def bench_mlp_training(rounds):
    torch.manual_seed(0)
    x = torch.randn(4096, 784)
    y = torch.randint(0, 10, (4096,))
    models = {}
    for name in ("plain", "dpmini"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
        models[name] = (m if name == "plain" else dpmini.DataParallel(m, DEVS),
                        torch.optim.SGD(m.parameters(), lr=0.01))

    def step(name):
        model, opt = models[name]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    t = _median_ms({n: (lambda n=n: step(n)) for n in models}, rounds, 3)
    ratio = t["plain"] / t["dpmini"]
    print(f"1. MLP training step, 2 devices: plain torch {t['plain']:.2f} ms, DataParallel "
          f"{t['dpmini']:.2f} ms: {ratio:.2f}x plain torch (target >= 0.95x: "
          f"{_verdict(ratio >= 0.95)})")
    return ratio


def bench_mlp_hand_split(rounds):
    """Figure 1d: the step of figure 1 split by hand, without dpmini: two Python threads
    (a ThreadPoolExecutor whose threads run one torch thread each) run the module on one half
    of the batch each, torch.cat joins the outputs, the backward runs on the caller."""
    from concurrent.futures import ThreadPoolExecutor
    torch.manual_seed(0)
    x = torch.randn(4096, 784)
    y = torch.randint(0, 10, (4096,))
    halves = x.chunk(2)
    models = {}
    for name in ("plain", "split"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
        models[name] = (m, torch.optim.SGD(m.parameters(), lr=0.01))
    with ThreadPoolExecutor(2, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        def step(name):
            model, opt = models[name]
            opt.zero_grad()
            out = model(x) if name == "plain" else torch.cat(list(pool.map(model, halves)))
            nn.functional.cross_entropy(out, y).backward()
            opt.step()
        t = _median_ms({n: (lambda n=n: step(n)) for n in models}, rounds, 3)
    print(f"1d. the same step split by hand (two Python threads, no dpmini): plain torch "
          f"{t['plain']:.2f} ms, split {t['split']:.2f} ms: {t['plain'] / t['split']:.2f}x "
          f"plain torch (a baseline, no target)")


def _convnet():
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(256 * 4 * 4, 1024), nn.ReLU(), nn.Linear(1024, 10))


def bench_convnet_eval(rounds):
    torch.manual_seed(0)
    model = _convnet().eval()
    nparams = sum(p.numel() for p in model.parameters())
    dp = dpmini.DataParallel(model, DEVS)
    x = torch.randn(128, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(dp(x), model(x), atol=1e-4)
        t = _median_ms({"plain": lambda: model(x), "dpmini": lambda: dp(x)}, rounds, 2)
    ratio = t["plain"] / t["dpmini"]
    print(f"2. conv net ({nparams / 1e6:.1f} M parameters) eval, batch 128, 2 devices: "
          f"plain torch {t['plain']:.2f} ms, DataParallel {t['dpmini']:.2f} ms: "
          f"{ratio:.2f}x plain torch (target >= 1.0x: {_verdict(ratio >= 1.0)})")
    return ratio


def bench_tiny_overhead(rounds):
    model = nn.Linear(8, 8)
    dp = dpmini.DataParallel(model, DEVS)
    x = torch.randn(8, 8)
    out = {}
    for mode, grad in (("no_grad", False), ("grad", True)):
        with torch.set_grad_enabled(grad):
            t = _median_ms({"plain": lambda: model(x), "dpmini": lambda: dp(x)}, rounds, 300)
        over = t["dpmini"] - t["plain"]
        out[mode] = over
        print(f"3. per-call overhead, nn.Linear(8, 8), 2 devices, {mode}: "
              f"{over * 1e3:.0f} us (DataParallel {t['dpmini'] * 1e3:.0f} us, direct "
              f"{t['plain'] * 1e3:.0f} us; target < 200 us: {_verdict(over < 0.2)})")
    return out


def mlp_training_child(rounds, label, **env_vars):
    """Figure 1 again in a child process with env_vars in its environment
    (OMP_WAIT_POLICY is read by libgomp when torch loads it, DPMINI_PARK_OPENMP
    when torch is first used through dpmini)."""
    env = dict(os.environ, **env_vars)
    out = subprocess.run([sys.executable, __file__, "--rounds", str(rounds), "--mlp-only"],
                         env=env, capture_output=True, text=True, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("1.")), None)
    print(f"{label}:", line.split(":", 1)[1].strip() if line else f"failed: {out.stderr[-300:]}")


def _cpu_times():
    """(steal, total) jiffies of all CPUs from /proc/stat, or None where there is none.
    Steal is the time a virtual machine's vCPUs wanted to run and the host ran something
    else: a run with much of it was not on a quiet machine, whatever the load says."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def _steal_note(start):
    end = _cpu_times()
    if start is None or end is None or end[1] <= start[1]:
        return ""
    return f", host steal {100 * (end[0] - start[0]) / (end[1] - start[1]):.1f}% of CPU time"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mlp-only", action="store_true", help="figure 1 alone")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, torch threads "
          f"{torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')!r}, "
          f"DPMINI_PARK_OPENMP={os.environ.get('DPMINI_PARK_OPENMP', '')!r}, "
          f"load {os.getloadavg()[0]:.2f}")
    start = _cpu_times()
    bench_mlp_training(args.rounds)
    if args.mlp_only:
        print(f"load after: {os.getloadavg()[0]:.2f}{_steal_note(start)}")
        return 0
    if "OMP_WAIT_POLICY" not in os.environ:
        mlp_training_child(args.rounds, "1b. the same, OMP_WAIT_POLICY=PASSIVE",
                           OMP_WAIT_POLICY="PASSIVE")
    if "DPMINI_PARK_OPENMP" not in os.environ:
        mlp_training_child(args.rounds, "1c. the same, DPMINI_PARK_OPENMP=0 (OpenMP team "
                           "not parked)", DPMINI_PARK_OPENMP="0")
    bench_mlp_hand_split(args.rounds)
    bench_convnet_eval(args.rounds)
    bench_tiny_overhead(args.rounds)
    print(f"load after: {os.getloadavg()[0]:.2f}{_steal_note(start)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
