"""dpmini's distributed demo: the digits MLP of dpmini.demo over MPI ranks x devices.

Run under MPI: ``mpirun -np 4 python -m dpmini.demo_distributed`` (``make
demo-distributed``). Every rank builds the model of dpmini.demo (imported from
it, not copied) from a different seed; DistributedDataParallel broadcasts rank
0's parameters, so they start equal. Each step, rank 0 holds the global batch
(66 rows by default: 4 ranks do not divide it, so the ranks get 17, 17, 17, 15
rows, and the epoch's last batch 27 rows: 7, 7, 7, 6); dpmini.distributed.scatter
splits it across the ranks by torch.chunk's rule, each rank's
DistributedDataParallel splits its rows across its 2 virtual CPU devices,
reduce_gradients(weights="rows") combines the per-rank MEAN gradients weighted
by rows, and every rank takes the same SGD step. Rank 0 then trains the same
network on one device with dpmini.demo's own loop and compares. The output
ends with the two lines of ``make demo``:

    accuracy <test accuracy of the distributed model>
    max_abs_diff_vs_single_device <largest |parameter difference|>

and every rank exits 1 unless accuracy >= 0.95 and the difference <= 1e-6.
"""
import argparse
import contextlib
import sys
import time

import numpy as np

from . import demo
from . import distributed as dist


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mpirun -np N python -m dpmini.demo_distributed",
                                description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=30, help="training epochs (default 30)")
    p.add_argument("--devices", type=int, default=2, metavar="N",
                   help="virtual CPU devices per rank (default 2)")
    p.add_argument("--batch-size", type=int, default=66,
                   help="GLOBAL mini-batch size (default 66: not a multiple of 4 ranks)")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="weights and shuffling seed (default 0)")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, s")
    args = p.parse_args(argv)
    if args.devices < 1 or args.batch_size < 1 or args.epochs < 0:
        p.error("--devices and --batch-size must be at least 1, --epochs at least 0")
    return args


def train_distributed(model, ddp, x, y, args, log):
    """SGD over the global batches of demo.batches; rank 0's x/y are the data."""
    for epoch in range(args.epochs):
        total = 0.0
        for idx in demo.batches(len(y), args.batch_size, epoch, args.seed):
            is_root = dist.rank() == 0
            xs = dist.scatter(x[idx] if is_root else None)
            ys = dist.scatter(y[idx] if is_root else None)
            out = ddp(xs, ys)                 # summed loss and gradients of this rank's rows
            rows = len(ys)
            means = {k: g / rows if rows else g for k, g in out["grads"].items()}
            grads = ddp.reduce_gradients(means, weights="rows")
            for name, g in grads.items():
                model.parameters()[name] -= args.lr * g
            total += float(dist.all_reduce(np.array(out["loss_sum"]), "sum"))
        if epoch % 10 == 9 or epoch == args.epochs - 1:
            log(f"epoch {epoch + 1}/{args.epochs}: mean loss {total / len(y):.4f}")


def main(argv=None):
    """Run the demo (collective); returns 0 when both expectations hold, else 1."""
    args = parse_args(argv)
    dist.init(timeout=args.timeout)
    rank, size = dist.rank(), dist.size()

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    x_train, x_test, y_train, y_test = demo.load_digits_split()
    model = demo.MLP(seed=args.seed + rank)          # different on purpose: DDP broadcasts
    devices = [f"cpu:{i}" for i in range(args.devices)]
    ddp = dist.DistributedDataParallel(model, device_ids=devices, out_dims=demo.OUT_DIMS)
    log(f"{size} ranks x {len(devices)} devices ({', '.join(devices)}) per rank, "
        f"global batch {args.batch_size}")
    first = demo.batches(len(y_train), args.batch_size, 0, args.seed)[0]
    log(str(ddp.explain(x_train[first])))
    last = demo.batches(len(y_train), args.batch_size, 0, args.seed)[-1]
    log(f"last batch of an epoch: {len(last)} rows -> ranks get "
        f"{dist.split_sizes(len(last))}")

    start = time.perf_counter()
    train_distributed(model, ddp, x_train, y_train, args, log)
    dist_s = time.perf_counter() - start
    params = np.concatenate([p.ravel() for p in model.parameters().values()])
    spread = dist.all_reduce(params, "max") - dist.all_reduce(params, "min")
    log(f"parameters equal on every rank: max spread {float(np.max(spread)):.3g}")

    ok = 0
    if rank == 0:
        accuracy = float(np.mean(model.predict(x_test) == y_test))
        start = time.perf_counter()
        single = demo.MLP(seed=args.seed)
        # the progress bar on stdout: mpirun forwards stdout and stderr apart,
        # and the two result lines must come last
        with contextlib.redirect_stderr(sys.stdout):
            demo.train(demo.batch_step_numpy(single, single, args.lr), x_train, y_train, args,
                       "single device", bar_per_epoch=False)
        single_s = time.perf_counter() - start
        diff = demo.max_param_diff(model, single)
        print(f"trained {args.epochs} epochs: {size} ranks x {len(devices)} devices "
              f"{dist_s:.2f} s, one process on one device {single_s:.2f} s (a tiny model: "
              "per-step communication dominates; the point here is exactness)")
        print(f"accuracy {accuracy:.4f}")
        print(f"max_abs_diff_vs_single_device {diff:.3g}", flush=True)
        ok = int(accuracy >= demo.MIN_ACCURACY and diff <= demo.MAX_PARAM_DIFF)
    ok = dist.broadcast(ok, root=0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
