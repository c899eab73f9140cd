#!/usr/bin/env python3
"""Check that csrc/'s #include graph points one way: down the layers.

csrc/ has one folder a layer (docs/architecture.md). A C file or header may
include headers of its own layer and of the layers below it, never of a layer
above: LAYERS below is the order, lowest first. csrc/dist/ is the separate
MPI extension dpmini._dist and may use the pure-C core only.

    python tools/check_layers.py           # exit 1 and list the upward includes
    python tools/check_layers.py --graph   # also print every edge and the counts

Only quoted includes ("x.h") are read; system headers (<...>) are not layers.
A header is found by its file name in any layer folder (setup.py puts every
layer folder on the include path), or by a relative path ("../cuda/x.h").
KNOWN lists the upward edges that are still there, each with why and the
issue that removes it; an edge in KNOWN that has gone is reported too, so the
list cannot go stale. tests/test_layers.py runs this check in `make test`.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

# Lowest first. A file may include headers of its own layer and lower ones.
LAYERS = [
    ("core", "pure C: chunk plan, strided copies, worker pool, allocator, env parsing; no Python.h"),
    ("backend", "the one door to CUDA and NCCL: cuda_api.h and its real/emulated/stub sides"),
    ("py", "module state, Device, dpmini.Array, argument conversion, DLPack/CAI leaves"),
    ("engine", "copy jobs between devices, comm (scatter/gather/broadcast), reduce"),
    ("tree", "walkers over nested structures: scatter, gather, explain"),
    ("dp", "replicate, parallel_apply, DataParallel"),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
# csrc/dist/ (dpmini._dist) stands beside the layers and may include core only.
DIST_MAY_INCLUDE = {"core", "dist"}

# Upward edges still present: (including file, included header) -> why.
# TODO(issue 10): gpu.c, nccl.c and their helpers (nccl_wait.c, gpu_driver.c,
# gpu_debug.c) raise Python exceptions and hold module state, so they include
# dpmini.h; moving that glue into csrc/py/ (leaving the backend files plain C
# over cuda_api.h) removes these edges. Left for a later change: the GPU
# layer's review fixes (issue 13) landed in these files at the same time.
KNOWN = {
    ("backend/gpu.c", "py/dpmini.h"): "GPU device model uses module state and raises Python errors",
    ("backend/nccl.c", "py/dpmini.h"): "NCCL collectives raise Python errors and read module state",
    ("backend/nccl_wait.c", "py/dpmini.h"): "a collective's wait checks signals with the GIL",
    ("backend/gpu_driver.c", "py/dpmini.h"): "driver-version problems are reported as Python errors",
    ("backend/gpu_debug.c", "py/dpmini.h"): "private Python test hooks into the CUDA emulator",
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(path):
    """The layer folder name of a file under csrc/, or None outside csrc/."""
    try:
        rel = path.resolve().relative_to(CSRC)
    except ValueError:
        return None
    return rel.parts[0] if len(rel.parts) > 1 else None


def sources():
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".c", ".h"))


def resolve(src, name, headers):
    """The file an include of `name` in `src` names, or None (not in the tree)."""
    near = (src.parent / name)
    if near.exists():
        return near.resolve()
    if "/" not in name and name in headers:
        return headers[name]
    fallback = (CSRC / name)
    return fallback.resolve() if fallback.exists() else None


def edges():
    """Every (including file, included file) pair inside the repository."""
    headers = {}
    for p in sources():
        if p.suffix == ".h":
            if p.name in headers:
                raise SystemExit(f"two headers named {p.name}: {headers[p.name]} and {p}")
            headers[p.name] = p.resolve()
    out = []
    for src in sources():
        for name in INCLUDE.findall(src.read_text()):
            dst = resolve(src, name, headers)
            if dst is None:
                raise SystemExit(f"{src.relative_to(ROOT)}: #include \"{name}\" names no file")
            out.append((src.resolve(), dst))
    return out


def rel(p):
    try:
        return p.relative_to(CSRC).as_posix()
    except ValueError:
        return "../" + p.relative_to(ROOT).as_posix()


def check():
    """(list of upward edges not in KNOWN, list of KNOWN edges no longer present, all edges)."""
    found = edges()
    bad, seen = [], set()
    for src, dst in found:
        a, b = layer_of(src), layer_of(dst)
        if a is None or b is None:
            continue              # outside csrc/ (cuda/strided.h): not a layer
        if a == "dist":
            ok = b in DIST_MAY_INCLUDE
        elif a not in RANK or b not in RANK:
            ok = False            # a folder that LAYERS does not name
        else:
            ok = RANK[b] <= RANK[a]
        if ok:
            continue
        key = (rel(src), rel(dst))
        if key in KNOWN:
            seen.add(key)
        else:
            bad.append(key)
    stale = sorted(set(KNOWN) - seen)
    return bad, stale, found


def main(argv):
    bad, stale, found = check()
    if "--graph" in argv:
        for src, dst in found:
            print(f"{rel(src)} -> {rel(dst)}")
        files = {s for s, _ in found} | {d for _, d in found}
        print(f"{len(found)} include edges between {len(files)} files; "
              f"{len(KNOWN) - len(stale)} known upward edges")
    for src, dst in bad:
        print(f"upward include: {src} includes {dst} "
              f"({layer_of(CSRC / src)} may not depend on {layer_of(CSRC / dst)})")
    for src, dst in stale:
        print(f"stale exception: {src} no longer includes {dst}; remove it from KNOWN")
    if bad or stale:
        print("layer order, lowest first: " + " < ".join(n for n, _ in LAYERS))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
