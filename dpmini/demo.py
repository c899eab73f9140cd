"""dpmini's demo: data-parallel training of a small NumPy MLP on real handwritten digits.

Run as `python -m dpmini.demo` (`make demo`). It trains a 64 -> 64 (tanh) -> 10
(softmax) network, float64, on scikit-learn's bundled digits data (1,797 real
8x8 images shipped inside the package, no download) with mini-batch SGD, the
gradient of every batch computed by a dpmini.DataParallel whose replicas each
return the summed loss and gradients of their shard, with
out_dims={'loss_sum': 'sum', 'grads': 'sum'} so that the gather adds them up
(what PyTorch's Broadcast backward does, spec 7.3). It
then trains the same network from the same seed on one device, with plain
calls on the whole batch, and compares the parameters. The output ends with

    accuracy <test accuracy of the data-parallel model>
    max_abs_diff_vs_single_device <largest |parameter difference|>

and main() returns 1 unless accuracy >= 0.95 and the difference <= 1e-6.
"""
import argparse
import sys
import time

import numpy as np

import dpmini

PARAM_NAMES = ("W1", "b1", "W2", "b2")
MIN_ACCURACY = 0.95
MAX_PARAM_DIFF = 1e-6


class MLP:
    """A 64 -> hidden (tanh) -> 10 (softmax) classifier with hand-written backprop.

    The parameters are plain ndarray attributes (W1, b1, W2, b2), so
    DataParallel's replicate broadcasts them to every device on each call.
    Calling the model on a batch returns the SUMMED cross-entropy loss and its
    gradients (not means), so per-shard results add up to the whole batch's.
    """

    def __init__(self, n_in=64, n_hidden=64, n_out=10, seed=0):
        rng = np.random.default_rng(seed)
        self.W1 = rng.normal(0.0, 1.0 / np.sqrt(n_in), (n_in, n_hidden))
        self.b1 = np.zeros(n_hidden)
        self.W2 = rng.normal(0.0, 1.0 / np.sqrt(n_hidden), (n_hidden, n_out))
        self.b2 = np.zeros(n_out)

    def parameters(self):
        """The parameters by name (the arrays themselves, not copies)."""
        return {name: getattr(self, name) for name in PARAM_NAMES}

    def logits(self, x):
        """x: (B, 64) float64 -> (hidden activations (B, H), logits (B, 10))."""
        h = np.tanh(x @ self.W1 + self.b1)
        return h, h @ self.W2 + self.b2

    def predict(self, x):
        """x: (B, 64) -> predicted class per row, (B,) int."""
        return np.argmax(self.logits(x)[1], axis=1)

    def __call__(self, x, y):
        """Loss and gradients of one batch (or one shard of it).

        x: (B, 64) float64 features; y: (B,) int labels in 0..9.
        Returns {'loss_sum': float, the summed cross-entropy over the B rows,
        'grads': {name: array shaped like the parameter}, gradients of that sum}.
        """
        h, z = self.logits(x)
        z = z - z.max(axis=1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        rows = np.arange(len(y))
        loss_sum = -log_p[rows, y].sum()
        dz = np.exp(log_p)
        dz[rows, y] -= 1.0
        dh = (dz @ self.W2.T) * (1.0 - h * h)
        grads = {"W1": x.T @ dh, "b1": dh.sum(axis=0),
                 "W2": h.T @ dz, "b2": dz.sum(axis=0)}
        return {"loss_sum": float(loss_sum), "grads": grads}


# How DataParallel combines the replicas' results: out_dims mirrors what the
# model returns. "sum" adds the per-shard summed losses (numbers) and reduces the
# per-shard gradients with comm.reduce_add onto output_device, which is what
# PyTorch's Broadcast backward does to per-replica parameter gradients (spec 7.3).
OUT_DIMS = {"loss_sum": "sum", "grads": "sum"}


def load_digits_split(seed=0):
    """The digits data, standardised with the training set's statistics.

    Returns x_train (1347, 64), x_test (450, 64) float64 and y_train, y_test int.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data.astype(np.float64), data.target, test_size=0.25, random_state=seed)
    scaler = StandardScaler().fit(x_train)
    return scaler.transform(x_train), scaler.transform(x_test), y_train, y_test


def batches(n, batch_size, epoch, seed):
    """Index arrays of the mini-batches of one epoch (a shuffle fixed by seed and epoch)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def sgd_step(model, step, x, y, lr):
    """One SGD step on a batch: step(x, y) gives summed loss and gradients.

    The summed gradients are divided once by the batch size (mean loss).
    Returns the batch's summed loss.
    """
    out = step(x, y)
    params = model.parameters()
    for name, grad in out["grads"].items():
        params[name] -= (lr / len(x)) * grad
    return out["loss_sum"]


def train(model, step, x, y, args, desc, bar_per_epoch):
    """Train model in place for args.epochs epochs.

    bar_per_epoch: one tqdm bar per epoch (ticking per batch, showing the
    running mean loss), else a single bar ticking once per epoch.
    """
    from tqdm import tqdm

    epochs = range(args.epochs)
    outer = None if bar_per_epoch else tqdm(epochs, desc=desc, unit="epoch")
    for epoch in (epochs if outer is None else outer):
        parts = batches(len(x), args.batch_size, epoch, args.seed)
        inner = (tqdm(parts, desc=f"{desc} epoch {epoch + 1}/{args.epochs}", unit="batch")
                 if bar_per_epoch else parts)
        total = seen = 0
        for idx in inner:
            total += sgd_step(model, step, x[idx], y[idx], args.lr)
            seen += len(idx)
            if bar_per_epoch:
                inner.set_postfix(loss=f"{total / seen:.4f}", refresh=False)
        if bar_per_epoch:
            inner.close()
        else:
            outer.set_postfix(loss=f"{total / len(x):.4f}", refresh=False)
    if outer is not None:
        outer.close()


def choose_devices(n_devices):
    """The device list for DataParallel, and a line saying why.

    n_devices: use cpu:0 .. cpu:(n-1); None: the default, all virtual CPU
    devices. The demo's model is NumPy code that reads its shards directly, which
    device memory does not allow (shards on GPUs are dpmini.Array), so GPUs are
    named and skipped; a CuPy replica is not written yet.
    """
    if n_devices is not None:
        return [f"cpu:{i}" for i in range(n_devices)], "devices given with --devices"
    n_cuda = dpmini.device_count()
    if n_cuda > 0:
        devices = [f"cpu:{i}" for i in range(dpmini.cpu_device_count())]
        return devices, (f"{n_cuda} CUDA device(s) found, but the demo stays on the virtual "
                         "CPU devices: its replicas are NumPy code, and GPU shards "
                         "(dpmini.Array) need CuPy or PyTorch inside the replica")
    return None, "no CUDA device, so DataParallel's default: the virtual CPU devices"


def max_param_diff(a, b):
    """Largest |a.p - b.p| over every parameter of two models (float)."""
    return max(float(np.max(np.abs(pa - pb)))
               for pa, pb in zip(a.parameters().values(), b.parameters().values()))


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m dpmini.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30, help="training epochs (default 30)")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="use virtual CPU devices cpu:0..cpu:N-1 (default: all)")
    parser.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default 64)")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (default 0.2)")
    parser.add_argument("--seed", type=int, default=0, help="weights and shuffling seed (default 0)")
    args = parser.parse_args(argv)
    if args.devices is not None and args.devices < 1:
        parser.error("--devices must be at least 1")
    return args


def main(argv=None):
    """Run the demo; returns 0 when both expectations hold, else 1."""
    args = parse_args(argv)
    x_train, x_test, y_train, y_test = load_digits_split()

    device_ids, why = choose_devices(args.devices)
    model = MLP(seed=args.seed)
    parallel = dpmini.DataParallel(model, device_ids=device_ids, out_dims=OUT_DIMS)
    print(f"devices: {', '.join(str(d) for d in parallel.device_ids)} ({why})")
    first = batches(len(x_train), args.batch_size, 0, args.seed)[0]
    print(dpmini.explain((x_train[first], y_train[first]), parallel.device_ids))
    print()

    start = time.perf_counter()
    train(model, parallel, x_train, y_train, args, "data-parallel", bar_per_epoch=True)
    parallel_s = time.perf_counter() - start
    accuracy = float(np.mean(model.predict(x_test) == y_test))

    start = time.perf_counter()
    single = MLP(seed=args.seed)
    train(single, single, x_train, y_train, args, "single device", bar_per_epoch=False)
    single_s = time.perf_counter() - start
    diff = max_param_diff(model, single)

    print(f"trained {args.epochs} epochs: data-parallel {parallel_s:.2f} s, "
          f"single device {single_s:.2f} s (a tiny model: DataParallel's per-call "
          "scatter/replicate/gather dominates; the point here is exactness)")
    print(f"accuracy {accuracy:.4f}")
    print(f"max_abs_diff_vs_single_device {diff:.3g}")
    return 0 if accuracy >= MIN_ACCURACY and diff <= MAX_PARAM_DIFF else 1


if __name__ == "__main__":
    sys.exit(main())
