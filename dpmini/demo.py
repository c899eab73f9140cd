"""dpmini's demo: data-parallel training of a small MLP on real handwritten digits.

Run as `python -m dpmini.demo` (`make demo`). The model is written once against
the Python array API standard (`xp = array_namespace(x)`), so the same code
trains with NumPy on the virtual CPU devices (the default, `--library numpy`),
and with CuPy on the GPUs (`--library cupy`, needs a GPU and CuPy). It trains a
64 -> 64 (tanh) -> 10
(softmax) network, float64, on scikit-learn's bundled digits data (1,797 real
8x8 images shipped inside the package, no download) with mini-batch SGD, the
gradient of every batch computed by a dpmini.DataParallel whose replicas each
return the summed loss and gradients of their shard, with
out_dims={'loss_sum': 'sum', 'grads': 'sum'} so that the gather adds them up
(what PyTorch's Broadcast backward does, docs/spec.md 7.3). With `--library torch` the
same network is a torch.nn.Module trained as PyTorch users train: the loss of
dpmini.DataParallel(net)(x), loss.backward() (torch's autograd through the
scatter, replicate and gather) and a torch.optim.SGD step. Either way it
then trains the same network from the same seed on one device, with plain
calls on the whole batch, and compares the parameters. The output ends with

    accuracy <test accuracy of the data-parallel model>
    max_abs_diff_vs_single_device <largest |parameter difference|>

and main() returns 1 unless accuracy >= 0.95 and the difference <= 1e-6, for
every library.
"""
import argparse
import sys
import time

import numpy as np

import dpmini

PARAM_NAMES = ("W1", "b1", "W2", "b2")
MIN_ACCURACY = 0.95
MAX_PARAM_DIFF = 1e-6


LIBRARIES = ("numpy", "torch", "cupy")


def array_namespace(*arrays):
    """The array-API namespace of the arrays: array_api_compat's when it is
    installed (NumPy, PyTorch, CuPy, JAX), else the arrays' own
    __array_namespace__ (NumPy >= 2.0 has one)."""
    try:
        from array_api_compat import array_namespace as find
    except ImportError:
        return arrays[0].__array_namespace__()
    return find(*arrays)


def library_module(name):
    """The array library by name ('numpy', 'torch', 'cupy'), imported."""
    if name == "numpy":
        return np
    import importlib
    return importlib.import_module(name)


def to_library(a, library):
    """A NumPy array a as an array of library (float64 / int64 kept)."""
    if library == "numpy":
        return a
    if library == "torch":
        import torch
        return torch.from_numpy(np.ascontiguousarray(a))
    return library_module(library).asarray(a)


class MLP:
    """A 64 -> hidden (tanh) -> 10 (softmax) classifier with hand-written backprop.

    Written once against the array API: the parameters (W1, b1, W2, b2) are
    arrays of one library (NumPy by default, torch or CuPy with library=), and
    every computation goes through xp = array_namespace(x), so DataParallel's
    replicate copies them to every device as arrays of that same library.
    Calling the model on a batch returns the SUMMED cross-entropy loss and its
    gradients (not means), so per-shard results add up to the whole batch's.
    """

    def __init__(self, n_in=64, n_hidden=64, n_out=10, seed=0, library="numpy"):
        rng = np.random.default_rng(seed)
        init = {"W1": rng.normal(0.0, 1.0 / np.sqrt(n_in), (n_in, n_hidden)),
                "b1": np.zeros(n_hidden),
                "W2": rng.normal(0.0, 1.0 / np.sqrt(n_hidden), (n_hidden, n_out)),
                "b2": np.zeros(n_out)}
        for name, value in init.items():
            setattr(self, name, to_library(value, library))

    def parameters(self):
        """The parameters by name (the arrays themselves, not copies)."""
        return {name: getattr(self, name) for name in PARAM_NAMES}

    def logits(self, x):
        """x: (B, 64) float64 -> (hidden activations (B, H), logits (B, 10))."""
        xp = array_namespace(x)
        h = xp.tanh(x @ self.W1 + self.b1)
        return h, h @ self.W2 + self.b2

    def predict(self, x):
        """x: (B, 64) -> predicted class per row, (B,) int."""
        xp = array_namespace(x)
        return xp.argmax(self.logits(x)[1], axis=1)

    def __call__(self, x, y):
        """Loss and gradients of one batch (or one shard of it).

        x: (B, 64) float64 features; y: (B,) int labels in 0..9.
        Returns {'loss_sum': float, the summed cross-entropy over the B rows,
        'grads': {name: array shaped like the parameter}, gradients of that sum}.
        """
        xp = array_namespace(x, y)
        h, z = self.logits(x)
        z = z - xp.max(z, axis=1, keepdims=True)
        log_p = z - xp.log(xp.sum(xp.exp(z), axis=1, keepdims=True))
        # one-hot labels: the array API has no assignment by index arrays
        onehot = xp.astype(y[:, None] == xp.arange(z.shape[1], device=xp_device(xp, y))[None, :],
                           z.dtype)
        loss_sum = -xp.sum(log_p * onehot)
        dz = xp.exp(log_p) - onehot
        dh = (dz @ self.W2.T) * (1.0 - h * h)
        grads = {"W1": x.T @ dh, "b1": xp.sum(dh, axis=0),
                 "W2": h.T @ dz, "b2": xp.sum(dz, axis=0)}
        return {"loss_sum": float(loss_sum), "grads": grads}


def xp_device(xp, a):
    """a's device as its namespace names it (array_api_compat's device(), else a.device)."""
    try:
        from array_api_compat import device
    except ImportError:
        return a.device
    return device(a)


# How DataParallel combines the replicas' results: out_dims mirrors what the
# model returns. "sum" adds the per-shard summed losses (numbers) and reduces the
# per-shard gradients with comm.reduce_add onto output_device, which is what
# PyTorch's Broadcast backward does to per-replica parameter gradients (docs/spec.md 7.3).
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


def take_rows(a, idx):
    """Rows idx (a NumPy int array) of a, in a's library."""
    if isinstance(a, np.ndarray):
        return a[idx]
    xp = array_namespace(a)
    return xp.take(a, xp.asarray(idx, device=xp_device(xp, a)), axis=0)


def batch_step_numpy(model, step, lr):
    """The training step of one batch for train(): an SGD step of model with the
    summed loss and gradients that step(x, y) gives (DataParallel or the model)."""
    return lambda x, y: sgd_step(model, step, x, y, lr)


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


def train(batch_step, x, y, args, desc, bar_per_epoch):
    """Train for args.epochs epochs; batch_step(x, y) trains on one batch and
    returns its summed loss.

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
            total += batch_step(take_rows(x, idx), take_rows(y, idx))
            seen += len(idx)
            if bar_per_epoch:
                inner.set_postfix(loss=f"{total / seen:.4f}", refresh=False)
        if bar_per_epoch:
            inner.close()
        else:
            outer.set_postfix(loss=f"{total / len(x):.4f}", refresh=False)
    if outer is not None:
        outer.close()


def choose_devices(n_devices, library="numpy"):
    """The device list for DataParallel, and a line saying why.

    library 'cupy': the GPUs (cuda:0 .. cuda:(n-1); SystemExit without one).
    Otherwise n_devices: use cpu:0 .. cpu:(n-1); None: the default, all virtual
    CPU devices. NumPy and torch CPU replicas stay on the virtual CPU devices
    even when GPUs exist (run --library cupy for the GPUs).
    """
    n_cuda = dpmini.device_count()
    if library == "cupy":
        if n_cuda == 0:
            raise SystemExit("--library cupy needs a CUDA device, and dpmini sees none")
        n = n_cuda if n_devices is None else min(n_devices, n_cuda)
        return [f"cuda:{i}" for i in range(n)], f"--library cupy: {n} CUDA device(s)"
    if n_devices is not None:
        return [f"cpu:{i}" for i in range(n_devices)], "devices given with --devices"
    if n_cuda > 0:
        devices = [f"cpu:{i}" for i in range(dpmini.cpu_device_count())]
        return devices, (f"{n_cuda} CUDA device(s) found, but --library {library} stays on "
                         "the virtual CPU devices (--library cupy trains on the GPUs)")
    return None, "no CUDA device, so DataParallel's default: the virtual CPU devices"


def torch_mlp(seed):
    """MLP as a torch.nn.Module (float64): Linear(64, 64), Tanh, Linear(64, 10), with
    the same initial weights as MLP(seed=seed)."""
    import torch

    init = MLP(seed=seed).parameters()
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                              torch.nn.Linear(64, 10)).double()
    with torch.no_grad():
        for layer, w, b in ((net[0], "W1", "b1"), (net[2], "W2", "b2")):
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(init[w].T)))
            layer.bias.copy_(torch.from_numpy(init[b]))
    return net


def batch_step_torch(model, optimizer):
    """The training step of one batch for train(), as PyTorch users write it: the
    mean cross-entropy of model(x) (a DataParallel or the module), backward, an
    optimizer step. Returns the batch's summed loss (float)."""
    import torch

    def step(x, y):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return float(loss) * len(x)
    return step


def main_torch(args, device_ids, why, data):
    """--library torch: train torch_mlp through DataParallel with autograd and
    torch.optim.SGD, then on one device; returns (accuracy, max parameter
    difference, data-parallel seconds, single-device seconds)."""
    import torch

    x_train, x_test, y_train, y_test = data
    net = torch_mlp(args.seed)
    parallel = dpmini.DataParallel(net, device_ids=device_ids)
    print_setup(parallel, why, x_train, y_train, args)
    start = time.perf_counter()
    train(batch_step_torch(parallel, torch.optim.SGD(parallel.parameters(), lr=args.lr)),
          x_train, y_train, args, "data-parallel", bar_per_epoch=True)
    parallel_s = time.perf_counter() - start
    with torch.no_grad():
        accuracy = float((net(x_test).argmax(1) == y_test).double().mean())
    single = torch_mlp(args.seed)
    start = time.perf_counter()
    train(batch_step_torch(single, torch.optim.SGD(single.parameters(), lr=args.lr)),
          x_train, y_train, args, "single device", bar_per_epoch=False)
    single_s = time.perf_counter() - start
    diff = max(float((a - b).abs().max()) for a, b in zip(net.parameters(), single.parameters()))
    return accuracy, diff, parallel_s, single_s


def max_param_diff(a, b):
    """Largest |a.p - b.p| over every parameter of two models (float)."""
    diffs = []
    for pa, pb in zip(a.parameters().values(), b.parameters().values()):
        xp = array_namespace(pa, pb)
        diffs.append(float(xp.max(xp.abs(pa - pb))))
    return max(diffs)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m dpmini.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30, help="training epochs (default 30)")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="use virtual CPU devices cpu:0..cpu:N-1 (default: all)")
    parser.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default 64)")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (default 0.2)")
    parser.add_argument("--seed", type=int, default=0, help="weights and shuffling seed (default 0)")
    parser.add_argument("--library", choices=LIBRARIES, default="numpy",
                        help="array library of the model and the data: numpy (default), torch "
                             "(CPU tensors on the virtual CPU devices) or cupy (the GPUs)")
    args = parser.parse_args(argv)
    if args.devices is not None and args.devices < 1:
        parser.error("--devices must be at least 1")
    return args


def print_setup(parallel, why, x, y, args):
    """The devices used and why, and how the first batch is split."""
    print(f"devices: {', '.join(str(d) for d in parallel.device_ids)} ({why})")
    first = batches(len(x), args.batch_size, 0, args.seed)[0]
    print(dpmini.explain((take_rows(x, first), take_rows(y, first)), parallel.device_ids))
    print()


def main_numpy(args, device_ids, why, data):
    """Train MLP (hand-written gradients) through DataParallel with out_dims sums,
    then on one device; returns (accuracy, max parameter difference, data-parallel
    seconds, single-device seconds)."""
    x_train, x_test, y_train, y_test = data
    model = MLP(seed=args.seed, library=args.library)
    parallel = dpmini.DataParallel(model, device_ids=device_ids, out_dims=OUT_DIMS)
    print_setup(parallel, why, x_train, y_train, args)

    start = time.perf_counter()
    train(batch_step_numpy(model, parallel, args.lr), x_train, y_train, args, "data-parallel",
          bar_per_epoch=True)
    parallel_s = time.perf_counter() - start
    xp = array_namespace(x_test)
    accuracy = float(xp.mean(xp.astype(model.predict(x_test) == y_test, xp.float64)))

    start = time.perf_counter()
    single = MLP(seed=args.seed, library=args.library)
    train(batch_step_numpy(single, single, args.lr), x_train, y_train, args, "single device",
          bar_per_epoch=False)
    single_s = time.perf_counter() - start
    diff = max_param_diff(model, single)

    return accuracy, diff, parallel_s, single_s


def main(argv=None):
    """Run the demo; returns 0 when both expectations hold, else 1."""
    args = parse_args(argv)
    device_ids, why = choose_devices(args.devices, args.library)
    try:
        library_module(args.library)
    except ImportError as e:
        raise SystemExit(f"--library {args.library}: {e}") from None
    x_train, x_test, y_train, y_test = (to_library(a, args.library)
                                        for a in load_digits_split())
    if args.library == "torch":
        accuracy, diff, parallel_s, single_s = main_torch(
            args, device_ids, why, (x_train, x_test, y_train, y_test))
    else:
        accuracy, diff, parallel_s, single_s = main_numpy(
            args, device_ids, why, (x_train, x_test, y_train, y_test))
    print(f"trained {args.epochs} epochs: data-parallel {parallel_s:.2f} s, "
          f"single device {single_s:.2f} s (a tiny model: DataParallel's per-call "
          "scatter/replicate/gather dominates; the point here is exactness)")
    print(f"accuracy {accuracy:.4f}")
    print(f"max_abs_diff_vs_single_device {diff:.3g}")
    return 0 if accuracy >= MIN_ACCURACY and diff <= MAX_PARAM_DIFF else 1


if __name__ == "__main__":
    sys.exit(main())
