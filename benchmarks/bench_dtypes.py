"""bfloat16 through dpmini against float32 of the same shape, measured in the
same run: what dpmini's own DLPack import/export (NumPy's refuses bfloat16) and
the float32-accumulated sums cost.

Run: python benchmarks/bench_dtypes.py [--rounds 9]. Needs torch and ml_dtypes;
prints figures, not a test; always exits 0. Each figure is the median of
interleaved rounds (every route once per round), so a slow spell hits all
routes alike.

1. DataParallel(identity) of a torch tensor, 2 virtual devices: small (8, 4)
   (per-call cost) and large (4096, 1024) (copy speed), bfloat16 vs float32.
   The bfloat16 input costs two more __dlpack__ calls (NumPy's refusal, then
   dpmini's peek and import), the result one _HostDLPack export.
2. out_dims="sum" of (4096, 1024) over 2 replicas: bfloat16 (cast to float32,
   add, round once) vs float32 (added in place).
"""
import argparse
import statistics
import time

import dpmini

DEVS = ["cpu:0", "cpu:1"]


def timed(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def compare(name, routes, rounds, calls):
    for fn in routes.values():
        fn()   # warm-up
    samples = {k: [] for k in routes}
    for _ in range(rounds):
        for k, fn in routes.items():
            samples[k].append(timed(fn, calls))
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["float32"]
    for k, v in med.items():
        print(f"  {name:<28} {k:<9} {v * 1e6:10.1f} us   {v / base:5.2f}x float32")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    try:
        import ml_dtypes  # noqa: F401
        import torch
    except ImportError as e:
        print(f"skipped: {e}")
        return
    torch.set_num_threads(1)
    dp = dpmini.DataParallel(lambda t: t, DEVS)
    dps = dpmini.DataParallel(lambda t: t, DEVS, out_dims="sum")
    with torch.no_grad():
        for shape, calls in [((8, 4), 2000), ((4096, 1024), 10)]:
            xs = {"float32": torch.randn(*shape)}
            xs["bfloat16"] = xs["float32"].bfloat16()
            compare(f"identity {shape}", {k: (lambda x=x: dp(x)) for k, x in xs.items()},
                    args.rounds, calls)
        xs = {"float32": torch.randn(2, 4096, 1024)}
        xs["bfloat16"] = xs["float32"].bfloat16()
        compare("out_dims='sum' (4096, 1024)",
                {k: (lambda x=x: dps(x)) for k, x in xs.items()}, args.rounds, 5)


if __name__ == "__main__":
    main()
