"""dpmini's command line: `python -m dpmini explain ...` and `python -m dpmini info`.

    python -m dpmini explain --shape 5,3 --dim 0 --devices 4
        prints the plan table DataParallel would follow for arrays of these
        shapes (one --shape per positional argument; nothing is allocated);
        --plot FILE also saves Plan.plot() (needs matplotlib).
    python -m dpmini info
        lists the devices, the backends built in, and the CUDA and NCCL
        versions ("not built" when dpmini was built without CUDA).

Exit status: 0, or 2 for a usage error (argparse) or arguments DataParallel
would reject (a bad device, chunk_sizes of the wrong length, ...). A plan
whose call would raise (e.g. strict=True with different chunk counts) is
printed with its error and exits 1.
"""
import argparse
import os
import platform
import sys

import numpy as np

from . import _dpmini
from ._plan import explain

__all__ = ["main"]


def _shape(text):
    """'5,3' -> (5, 3); '7' -> (7,); '' or '()' -> () (a 0-dim array)."""
    text = text.strip().strip("()")
    if not text:
        return ()
    try:
        shape = tuple(int(part) for part in text.split(",") if part.strip() != "")
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


def _devices(text):
    """'4' -> cpu:0..cpu:3; 'cpu:0,cpu:2' or '0,1' (CUDA ids) -> that list."""
    text = text.strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError("--devices N needs N >= 1")
        return [f"cpu:{i}" for i in range(n)]
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected a device count or a list like cpu:0,cpu:1")
    return [int(p) if p.lstrip("-").isdigit() else p for p in parts]


def _ints(text):
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ints like 3,2,2, got {text!r}") from None


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
    sub = parser.add_subparsers(dest="command", required=True, metavar="{explain,info}")

    ex = sub.add_parser(
        "explain", help="print the split plan for arrays of given shapes",
        description="Print the plan DataParallel would follow for arrays of these shapes "
                    "(dpmini.explain). Nothing is allocated or copied.")
    ex.add_argument("--shape", type=_shape, action="append", default=[], metavar="N,M,...",
                    help="shape of one positional array argument (repeat for several)")
    ex.add_argument("--kw", type=_kw_shape, action="append", default=[], metavar="NAME=N,M",
                    help="a keyword array argument (repeatable)")
    ex.add_argument("--dim", type=int, default=0, help="the split dim (default 0)")
    ex.add_argument("--devices", type=_devices, default=None, metavar="N|LIST",
                    help="N virtual CPU devices, or a list like cpu:0,cpu:2 "
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
                    help="also save the plan's picture (PNG, SVG, PDF; needs matplotlib)")

    sub.add_parser("info", help="list devices, backends and CUDA/NCCL versions",
                   description="List the devices dpmini sees, the backends built in, and "
                               "the CUDA and NCCL versions.")
    return parser


def _placeholder(shape, dtype):
    """A read-only array of this shape that owns no memory (a broadcast view)."""
    return np.broadcast_to(np.zeros((), dtype=dtype), shape)


def cmd_explain(args, parser, out):
    if not args.shape and not args.kw:
        parser.error("explain: give at least one --shape (or --kw NAME=SHAPE)")
    try:
        dtype = np.dtype(args.dtype)
    except TypeError as exc:
        parser.error(f"--dtype: {exc}")
    inputs = tuple(_placeholder(s, dtype) for s in args.shape)
    kwargs = {name: _placeholder(s, dtype) for name, s in args.kw}
    try:
        plan = explain(inputs, args.devices, dim=args.dim, kwargs=kwargs, strict=args.strict,
                       in_dims=args.in_dims, chunk_sizes=args.chunk_sizes,
                       weights=args.weights)
    except (ValueError, TypeError, IndexError) as exc:
        print(f"python -m dpmini explain: error: {exc}", file=sys.stderr)
        return 2
    print(plan, file=out)
    if args.plot:
        try:
            fig = plan.plot()
        except ImportError as exc:
            print(f"python -m dpmini explain: error: {exc}", file=sys.stderr)
            return 2
        fig.savefig(args.plot, dpi=100, bbox_inches="tight")
        print(f"\nsaved the picture to {args.plot}", file=out)
    return 1 if plan.error else 0


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
    return info.get("backend", "unknown"), cuda, str(info.get("nccl", "not loaded"))


def cmd_info(out):
    from . import __version__, cpu_device_count, device_count

    has_cuda = bool(getattr(_dpmini, "has_cuda", 0))
    backend, cuda_text, nccl_text = _cuda_versions()
    n_cpu = cpu_device_count()
    try:
        n_cuda = device_count()
    except Exception as exc:
        n_cuda, cuda_note = 0, f" ({type(exc).__name__}: {exc})"
    else:
        cuda_note = ""
    env = os.environ.get("DPMINI_CPU_DEVICES")
    lines = [
        f"dpmini {__version__} (Python {platform.python_version()}, NumPy {np.__version__}, "
        f"{platform.system()} {platform.machine()})",
        "",
        "devices",
        f"  virtual CPU devices: {n_cpu} (cpu:0..cpu:{n_cpu - 1}; dpmini.cpu_device_count(), "
        + (f"$DPMINI_CPU_DEVICES={env})" if env else "$DPMINI_CPU_DEVICES unset: usable cores, "
           "at least 2)"),
        f"  CUDA devices: {n_cuda} (dpmini.device_count()){cuda_note}",
        f"  default device_ids: {'cuda:0..cuda:%d' % (n_cuda - 1) if n_cuda else 'the virtual CPU devices'}",
        "",
        "backends",
        "  CPU: built (virtual devices, one worker thread each)",
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
    args = parser.parse_args(argv)
    if args.command == "explain":
        return cmd_explain(args, parser, out)
    return cmd_info(out)


if __name__ == "__main__":
    sys.exit(main())
