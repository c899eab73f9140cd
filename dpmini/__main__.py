"""dpmini's command line: `python -m dpmini explain|profile|info ...`.

    python -m dpmini explain --shape 5,3 --dim 0 --devices 4
        prints the plan table DataParallel would follow for arrays of these
        shapes (one --shape per positional argument; nothing is allocated);
        --plot FILE also saves Plan.plot() (needs matplotlib).
    python -m dpmini profile --shape 8192,4096 --dim 1 --devices 2
        runs DataParallel over an identity model on random arrays of these
        shapes under dpmini.profile() and prints the per-call table (phase x
        device times and GB/s, idle devices, dpmini's own overhead) and the
        copy limit measured in the same run (the faster of memcpy and
        streaming stores); --repeat N calls (default 3, after one warm-up
        call), --trace FILE writes the Chrome/Perfetto trace.
    python -m dpmini info
        lists the devices, the backends built in, and the CUDA and NCCL
        versions ("not built" when dpmini was built without CUDA).

    python -m dpmini --version
        prints "dpmini X.Y.Z".

`python -m dpmini` with no command prints this help on stderr and exits 2,
as argparse does for any missing required argument (a usage error, so a
script that forgot the command does not succeed silently); `-h` prints it on
stdout and exits 0.

Option values that start with a minus (`--chunk-sizes -1,6`, `--in-dims
-1,0`, `--weights -1,2`) are read as values, as `--chunk-sizes=-1,6` is:
argparse alone would take "-1,6" for an option and report "expected one
argument". Such values reach dpmini, whose own message says what is wrong
(a negative chunk size, a weight <= 0).

Exit status: 0, or 2 for a bad argument: a usage error (argparse), a value
out of range (a shape too large for NumPy, a dim outside the int32 range,
a chunk size outside int64), a --dtype NumPy does not know, a --plot file
that cannot be written, or arguments DataParallel would reject (a bad
device, chunk_sizes of the wrong length, ...); the message is argparse's
("usage: ..." then "python -m dpmini explain: error: ..."), never a
traceback. A plan whose call would raise (e.g. strict=True with different
chunk counts, a dim out of range for an array's rank) is printed with its
error and exits 1.
"""
import argparse
import os
import platform
import re
import sys
import warnings

import numpy as np

from . import _dpmini
from ._plan import explain

__all__ = ["main"]


def _shape(text):
    """'5,3' -> (5, 3); '7' -> (7,); '' or '()' -> () (a 0-dim array)."""
    text = text.strip().strip("()")
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) > 1 and parts[-1].strip() == "":
        parts.pop()   # one trailing comma, as in Python's (5,)
    if any(part.strip() == "" for part in parts):
        raise argparse.ArgumentTypeError(f"empty size in {text!r} (expected a shape like 5,3)")
    try:
        shape = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 5,3, got {text!r}") from None
    if any(n < 0 for n in shape):
        raise argparse.ArgumentTypeError(f"sizes must be >= 0, got {text!r}")
    return shape


def _kw_shape(text):
    """'mask=5,3' -> ('mask', (5, 3))."""
    name, sep, shape = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=SHAPE like mask=5,3, got {text!r}")
    return name, _shape(shape)


_INT32 = (-2**31, 2**31 - 1)
_INT64_MAX = 2**63 - 1


def _devices(text):
    """'4' -> cpu:0..cpu:3 (a bare number is a COUNT of virtual CPU devices,
    N >= 1); 'cpu:0,cpu:2', '0,1' (CUDA ids) or '0,' (CUDA device 0 alone: a
    comma makes a list) -> that list."""
    text = text.strip()
    if text.isdigit():
        n = int(text)
        if not 1 <= n <= 256:
            raise argparse.ArgumentTypeError(
                f"a bare number is a count of virtual CPU devices, 1..256, got {n} "
                "(write a list such as 0, or cuda:0 to name one device)")
        return [f"cpu:{i}" for i in range(n)]
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected a device count or a list like cpu:0,cpu:1")
    return [int(p) if p.lstrip("-").isdigit() else p for p in parts]


def _repeat(text):
    """A call count in 1..1000."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if not 1 <= n <= 1000:
        raise argparse.ArgumentTypeError(f"expected 1..1000, got {n}")
    return n


def _dim(text):
    """An int dim in the int32 range (the C core's dim type)."""
    try:
        d = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if not _INT32[0] <= d <= _INT32[1]:
        raise argparse.ArgumentTypeError(
            f"{d} is out of range (a dim is an int from {_INT32[0]} to {_INT32[1]})")
    return d


def _ints(text):
    """'3,2,2' -> [3, 2, 2]. Negative sizes are left to dpmini, whose message
    names the entry (chunk_sizes[0]: must be >= 0)."""
    try:
        sizes = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ints like 3,2,2, got {text!r}") from None
    for n in sizes:
        if not -_INT64_MAX - 1 <= n <= _INT64_MAX:
            raise argparse.ArgumentTypeError(
                f"{n} is out of range (rows per device: 0 to {_INT64_MAX})")
    return sizes


def _floats(text):
    try:
        return [float(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2.5, got {text!r}") from None


def _in_dims(text):
    """'0,None,1' -> (0, None, 1): one entry per positional argument."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part.lower() == "none":
            out.append(None)
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected ints or None like 0,None, got {text!r}") from None
    return tuple(out)


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m dpmini",
        description="See how dpmini.DataParallel splits a batch, and what this build supports.")
    parser.add_argument("--version", action="version", version=f"dpmini {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{explain,profile,info}")

    ex = sub.add_parser(
        "explain", help="print the split plan for arrays of given shapes",
        description="Print the plan DataParallel would follow for arrays of these shapes "
                    "(dpmini.explain). Nothing is allocated or copied.")
    ex.add_argument("--shape", type=_shape, action="append", default=[], metavar="N,M,...",
                    help="shape of one positional array argument (repeat for several)")
    ex.add_argument("--kw", type=_kw_shape, action="append", default=[], metavar="NAME=N,M",
                    help="a keyword array argument (repeatable)")
    ex.add_argument("--dim", type=_dim, default=0, help="the split dim (default 0)")
    ex.add_argument("--devices", type=_devices, default=None, metavar="N|LIST",
                    help="a bare number N (1..256) is a COUNT: N virtual CPU devices "
                         "cpu:0..cpu:N-1; anything with a comma or a name is a LIST of "
                         "devices: cpu:0,cpu:2 or 0,1 (CUDA ids); one device: cpu:0 or 0, "
                         "(default: DataParallel's default devices)")
    ex.add_argument("--dtype", default="float32", help="array dtype (default float32)")
    ex.add_argument("--in-dims", type=_in_dims, default=None, metavar="D,...",
                    help="in_dims for the positional arguments, e.g. 0,None,1")
    ex.add_argument("--chunk-sizes", type=_ints, default=None, metavar="A,B,...",
                    help="explicit rows per device")
    ex.add_argument("--weights", type=_floats, default=None, metavar="W,...",
                    help="rows per device proportional to these weights")
    ex.add_argument("--strict", action="store_true", help="different chunk counts are an error")
    ex.add_argument("--plot", metavar="FILE", default=None,
                    help="also save the plan's picture (PNG, SVG, PDF; needs matplotlib); "
                         "the extension picks the format")
    ex.set_defaults(subparser=ex)

    pr = sub.add_parser(
        "profile", help="time a DataParallel round trip per phase and device",
        description="Run DataParallel over an identity model on random arrays of these "
                    "shapes under dpmini.profile() and print where the time goes.")
    pr.add_argument("--shape", type=_shape, action="append", default=[], metavar="N,M,...",
                    help="shape of one positional array argument (repeat for several)")
    pr.add_argument("--dim", type=_dim, default=0, help="the split dim (default 0)")
    pr.add_argument("--devices", type=_devices, default=None, metavar="N|LIST",
                    help="a COUNT of virtual CPU devices or a LIST, as for explain "
                         "(default: DataParallel's default devices)")
    pr.add_argument("--dtype", default="float32", help="array dtype (default float32)")
    pr.add_argument("--repeat", type=_repeat, default=3, metavar="N",
                    help="profiled calls after one warm-up call (1..1000, default 3)")
    pr.add_argument("--trace", metavar="FILE", default=None,
                    help="also write the Chrome/Perfetto trace (JSON) there")
    pr.set_defaults(subparser=pr)

    sub.add_parser("info", help="list devices, backends and CUDA/NCCL versions",
                   description="List the devices dpmini sees, the backends built in, and "
                               "the CUDA and NCCL versions.")
    return parser


def _version():
    from . import __version__
    return __version__


# explain's options that take a value (argparse also accepts a unique prefix)
_VALUE_OPTIONS = ("--shape", "--kw", "--dim", "--devices", "--dtype", "--in-dims",
                  "--chunk-sizes", "--weights", "--plot")
_NEGATIVE_VALUE = re.compile(r"^-[0-9.]")


def _join_negative_values(argv):
    """['--chunk-sizes', '-1,6'] -> ['--chunk-sizes=-1,6']: a value that starts
    with a minus and a digit after an option that takes one is that option's
    value (no dpmini option starts with a digit)."""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        takes_value = (tok.startswith("--") and "=" not in tok and len(tok) > 2 and
                       any(opt.startswith(tok) for opt in _VALUE_OPTIONS))
        if takes_value and i + 1 < len(argv) and _NEGATIVE_VALUE.match(argv[i + 1]):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def _plot_file(path):
    """The file Figure.savefig(path) writes: path itself when it has an
    extension, else path + '.' + matplotlib's savefig.format ('myplan' ->
    'myplan.png')."""
    if os.path.splitext(path)[1]:
        return path
    try:
        import matplotlib
        fmt = matplotlib.rcParams.get("savefig.format", "png")
    except ImportError:
        fmt = "png"
    return f"{path}.{fmt}"


def _placeholder(shape, dtype):
    """A read-only array of this shape that owns no memory (a broadcast view)."""
    return np.broadcast_to(np.zeros((), dtype=dtype), shape)


def _fail(sub, message):
    """An argparse-style error for `sub` (usage, then 'prog: error: ...') without
    exiting: returns 2, the exit status of a bad argument."""
    sub.print_usage(sys.stderr)
    print(f"{sub.prog}: error: {message}", file=sys.stderr)
    return 2


def _check_plot_path(path):
    """None when matplotlib can write `path`, else what is wrong with it
    (checked before the table is printed)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return 'needs matplotlib: pip install "dpmini[plot]" (or pip install matplotlib)'
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in formats:
        return (f"{path!r}: unknown picture format {ext!r} (the extension picks it: "
                f"{', '.join(sorted(formats))})")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{path!r}: the folder {folder!r} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.isdir(path)):
        return f"{path!r}: cannot write there"
    return None


def cmd_explain(args, parser, out):
    sub = getattr(args, "subparser", parser)
    if not args.shape and not args.kw:
        sub.error("give at least one --shape (or --kw NAME=SHAPE)")   # exits 2
    names = [name for name, _ in args.kw]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return _fail(sub, f"--kw: {', '.join(repeated)} given more than once (one "
                          "--kw NAME=SHAPE per keyword argument)")
    if args.plot is not None and not args.plot.strip():
        return _fail(sub, "--plot: expected a file name, got ''")
    try:
        dtype = np.dtype(args.dtype)
    except (TypeError, ValueError) as exc:
        return _fail(sub, f"--dtype: {exc}")
    if dtype.subdtype is not None:   # '(2,3)f8' would add dims to every array
        return _fail(sub, f"--dtype: {args.dtype!r} is a subarray dtype (shape "
                          f"{dtype.shape}); give a plain dtype and put the extra "
                          "dimensions in --shape")
    try:
        inputs = tuple(_placeholder(s, dtype) for s in args.shape)
        kwargs = {name: _placeholder(s, dtype) for name, s in args.kw}
    except (ValueError, MemoryError) as exc:  # NumPy: too many elements for this dtype
        return _fail(sub, f"--shape/--kw: {exc} (a shape NumPy cannot describe)")
    if args.plot:
        args.plot = _plot_file(args.plot)
        problem = _check_plot_path(args.plot)
        if problem:
            return _fail(sub, f"--plot: {problem}")
    try:
        plan = explain(inputs, args.devices, dim=args.dim, kwargs=kwargs, strict=args.strict,
                       in_dims=args.in_dims, chunk_sizes=args.chunk_sizes,
                       weights=args.weights)
    except (ValueError, TypeError, IndexError, OverflowError) as exc:
        return _fail(sub, str(exc))
    print(plan, file=out)
    if args.plot:
        try:
            fig = plan.plot()
            fig.savefig(args.plot, dpi=100, bbox_inches="tight")
        except (ImportError, OSError, ValueError) as exc:
            return _fail(sub, f"--plot: {exc}")
        print(f"\nsaved the picture to {args.plot}", file=out)
    return 1 if plan.error else 0


def _random_array(rng, shape, dtype):
    """A random array of shape and dtype (values in [0, 1) cast to dtype)."""
    return rng.random(shape).astype(dtype, copy=False)


def _identity(*arrays):
    return arrays[0] if len(arrays) == 1 else arrays


def cmd_profile(args, parser, out):
    from ._dpmini import DataParallel
    from ._profile import copy_limit, profile

    sub = getattr(args, "subparser", parser)
    if not args.shape:
        sub.error("give at least one --shape")   # exits 2
    try:
        dtype = np.dtype(args.dtype)
    except (TypeError, ValueError) as exc:
        return _fail(sub, f"--dtype: {exc}")
    if dtype.subdtype is not None or dtype.fields is not None or dtype.kind not in "biuf":
        return _fail(sub, f"--dtype: {args.dtype!r}: expected a bool, integer or floating "
                          "dtype (the arrays are random numbers)")
    if args.trace is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.trace))):
        return _fail(sub, f"--trace: {args.trace!r}: the folder does not exist")
    try:
        rng = np.random.default_rng(0)
        inputs = tuple(_random_array(rng, s, dtype) for s in args.shape)
    except (ValueError, MemoryError) as exc:
        return _fail(sub, f"--shape: {exc} (cannot allocate these arrays)")
    try:
        dp = DataParallel(_identity, device_ids=args.devices, dim=args.dim)
        dp(*inputs)   # warm-up: worker threads started, allocator caches filled
        with profile() as prof:
            for _ in range(args.repeat):
                dp(*inputs)
    except (ValueError, TypeError, IndexError, OverflowError) as exc:
        return _fail(sub, str(exc))
    print(prof.table(), file=out)
    copies = [e for e in prof.events if e["kind"] == "copy" and e["duration_ns"] > 0]
    if copies:
        print("", file=out)
        print(_limit_text(copies, copy_limit), file=out)
    if args.trace:
        try:
            prof.export_chrome_trace(args.trace)
        except OSError as exc:
            return _fail(sub, f"--trace: {exc}")
        print(f"\nwrote the trace to {args.trace} (open it in https://ui.perfetto.dev or "
              "chrome://tracing)", file=out)
    return 0


def _limit_text(copies, copy_limit):
    """The copy limit of one thread measured now, and the copies' best rate against it."""
    nbytes = min(max(max(e["bytes"] for e in copies), 1 << 20), 256 << 20)
    lim = copy_limit(nbytes, threads=1, repeat=7)
    best = max(e["bytes"] / e["duration_ns"] for e in copies)
    return (f"copy limit of one thread, measured now on {nbytes / 2**20:.0f} MiB: "
            f"{lim['gbps']:.1f} GB/s (the faster of memcpy {lim['memcpy_gbps']:.1f} and "
            f"streaming stores {lim['stream_gbps']:.1f}); the fastest copy span above: "
            f"{best:.1f} GB/s = {best / lim['gbps']:.2f}x the limit")


def _cuda_versions():
    """(backend, CUDA text, NCCL text) from the extension's cuda_build_info()."""
    info_fn = getattr(_dpmini, "cuda_build_info", None)
    if info_fn is None:
        return "none", "not built", "not built"
    try:
        info = info_fn()
    except Exception as exc:  # a backend that fails to answer is reported, not fatal
        note = f"unavailable ({type(exc).__name__}: {exc})"
        return "unknown", note, note

    def cuda_text(v):  # CUDA encodes 13.0 as 13000
        return f"{v // 1000}.{v % 1000 // 10}" if v else "none"

    cuda = (f"runtime {cuda_text(info.get('runtime_version', 0))}, "
            f"driver {cuda_text(info.get('driver_version', 0))}")
    if info.get("cuda_unusable"):
        cuda += f"; CUDA UNUSABLE: {info['cuda_unusable']}"
    return info.get("backend", "unknown"), cuda, str(info.get("nccl", "not loaded"))


def cmd_info(out):
    from . import __version__, cpu_device_count, device_count

    has_cuda = bool(getattr(_dpmini, "has_cuda", 0))
    backend, cuda_text, nccl_text = _cuda_versions()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n_cpu = cpu_device_count()
    rejected = any(issubclass(w.category, RuntimeWarning) and "DPMINI_CPU_DEVICES" in
                   str(w.message) for w in caught)
    try:
        n_cuda = device_count()
    except Exception as exc:
        n_cuda, cuda_note = 0, f" ({type(exc).__name__}: {exc})"
    else:
        cuda_note = " (CUDA unusable: see versions)" if "UNUSABLE" in cuda_text else ""
    env = os.environ.get("DPMINI_CPU_DEVICES")
    if env and rejected:
        source = (f"$DPMINI_CPU_DEVICES={env!r} rejected (not an int in 1..256), so the "
                  "usable cores, at least 2")
    elif env:
        source = f"$DPMINI_CPU_DEVICES={env}"
    else:
        source = "$DPMINI_CPU_DEVICES unset: usable cores, at least 2"
    lines = [
        f"dpmini {__version__} (Python {platform.python_version()}, NumPy {np.__version__}, "
        f"{platform.system()} {platform.machine()})",
        "",
        "devices",
        f"  virtual CPU devices: {n_cpu} (cpu:0..cpu:{n_cpu - 1}; dpmini.cpu_device_count(), "
        f"{source})",
        f"  CUDA devices: {n_cuda} (dpmini.device_count()){cuda_note}",
        f"  default device_ids: {'cuda:0..cuda:%d' % (n_cuda - 1) if n_cuda else 'the virtual CPU devices'}",
        "",
        "backends",
        "  CPU: built (virtual devices; one worker thread per device, more while its "
        "jobs overlap, up to 1024)",
        f"  CUDA: {('built (' + backend + ')') if has_cuda else 'not built'}",
        "",
        "versions",
        f"  CUDA: {cuda_text if has_cuda else 'not built'}",
        f"  NCCL: {nccl_text if has_cuda else 'not built'} (loaded on first use)",
    ]
    print("\n".join(lines), file=out)
    return 0


def main(argv=None, out=None):
    """Run the command line; returns the exit status."""
    out = sys.stdout if out is None else out
    parser = _parser()
    args = parser.parse_args(_join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    if args.command is None:
        parser.print_help(sys.stderr)
        print(f"\n{parser.prog}: error: choose a command: explain, profile or info",
              file=sys.stderr)
        return 2
    if args.command == "explain":
        return cmd_explain(args, parser, out)
    if args.command == "profile":
        return cmd_profile(args, parser, out)
    return cmd_info(out)


def _run_from_shell():
    """main() for `python -m dpmini`: a reader that closes the pipe early
    (`... | head`) ends the run quietly with status 1, as the Python docs
    recommend for SIGPIPE (the rest of the output goes to devnull)."""
    try:
        rc = main()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(_run_from_shell())
