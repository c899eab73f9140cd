#!/usr/bin/env python3
"""Check that csrc/'s include and call graphs point one way: down the layers.

csrc/ has one folder a layer (docs/architecture.md). A C file or header may
include headers of its own layer and of the layers below it, never of a layer
above: LAYERS below is the order, lowest first. csrc/dist/ is the separate
MPI extension dpmini._dist and may use the pure-C core only; csrc/testing/ is
the test-only extension dpmini._testing, which includes the capsule headers
py/test_api.h (and what it names: core/, backend/ types) and
dist/dist_test_api.h, and nothing above.

    python tools/check_layers.py           # exit 1 and list the upward edges
    python tools/check_layers.py --graph   # also print every edge and the counts
    python tools/check_layers.py --objects DIR   # the call check on DIR's .o files

Includes: only quoted includes ("x.h") are read; system headers (<...>) are
not layers.
A header is found by its file name in any layer folder (setup.py puts every
layer folder on the include path), or by a relative path ("../cuda/x.h").

Calls: a header that declares another layer's functions would hide an upward
call from the include check, so the object files are read too (`nm`): a
file's undefined symbol that another csrc/ file defines is a call edge (a
function call or a use of its data, such as a method table) from the first
file to the second, and it must not point up a layer either. The objects are
compiled ($CC or Python's compiler; binutils' nm reads them) into a
temporary folder (-O0, a few seconds) in the emulated-GPU
configuration, which compiles the most code (the real-CUDA and CPU-only
builds leave parts out, none in); --objects DIR reads a build's instead.
csrc/dist/ and csrc/testing/ are separate extensions and not part of the
call check (they cannot link to _dpmini's symbols: it exports none).

And the two graphs agree: a header declares only what files of its own
layer define (foreign_declarations), and a file that calls into another
layer includes a header of that layer itself (unseen_calls), so the include
graph shows every dependency.

KNOWN and KNOWN_CALLS list the upward edges that are still there, each with
why and the issue that removes it; an edge listed there that has gone is
reported too, so the lists cannot go stale. tests/test_layers.py runs both
checks in `make test`.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
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
    ("module", "the module's init: exec slot, types, the method tables of every layer"),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
# csrc/dist/ (dpmini._dist) stands beside the layers and may include core only.
DIST_MAY_INCLUDE = {"core", "dist"}
# csrc/testing/ (dpmini._testing, the test-only extension) stands beside them too:
# it includes py/test_api.h (the capsule's table) and the core/backend types that
# table names, and dist/dist_test_api.h (_dist's table, plain C), and calls into
# _dpmini and _dist only through their capsules, never by symbol.
TESTING_MAY_INCLUDE = {"core", "backend", "py", "dist", "testing"}

# Upward edges still present: (including file, included header) -> why.
# None: keep it so (a new entry needs its reason and the issue that removes it).
KNOWN = {}

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
        elif a == "testing":
            ok = b in TESTING_MAY_INCLUDE
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


# Upward call edges still present: (calling file, defining file) -> why.
# None: keep it so (a new entry needs its reason and the issue that removes it).
KNOWN_CALLS = {}

# nm -P symbol types: U is undefined (w, v weak undefined); upper-case
# letters other than U are global definitions.
DEFINED = set("TDBRCGSVWI")


def _c_of(obj, base):
    """csrc/<layer>/x.c for base/.../csrc/<layer>/x.o, or None."""
    parts = obj.relative_to(base).parts
    if "csrc" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("csrc")
    src = CSRC.joinpath(*parts[i + 1:]).with_suffix(".c")
    return src if src.exists() else None


def layer_sources():
    """The .c files of the _dpmini extension: every layer folder (not dist/)."""
    return sorted(p for p in CSRC.rglob("*.c") if layer_of(p) in RANK)


def compile_objects(outdir):
    """Compile every layer source into outdir (-O0), as outdir/csrc/<layer>/x.o so that
    --objects outdir reads them again; {source: object}."""
    import numpy

    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    flags = ["-c", "-O0", "-std=c11", "-fPIC", "-w", "-DDPMINI_CUDA_EMULATE=1",
             "-I" + sysconfig.get_paths()["include"], "-I" + numpy.get_include(),
             "-I" + str(CSRC)] + ["-I" + str(CSRC / name) for name, _ in LAYERS]

    def one(src):
        obj = (Path(outdir) / "csrc" / rel(src.resolve())).with_suffix(".o")
        obj.parent.mkdir(parents=True, exist_ok=True)
        res = subprocess.run([cc, *flags, str(src), "-o", str(obj)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"compiling {rel(src.resolve())} failed:\n{res.stderr}")
        return src.resolve(), obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(pool.map(one, layer_sources()))


def symbols(obj):
    """(set of global symbols obj defines, set it leaves undefined)."""
    res = subprocess.run(["nm", "-P", str(obj)], capture_output=True, text=True, check=True)
    defined, undefined = set(), set()
    for line in res.stdout.splitlines():
        f = line.split()
        if len(f) < 2:
            continue
        if f[1] in ("U", "w", "v"):
            undefined.add(f[0])
        elif f[1] in DEFINED:
            defined.add(f[0])
    return defined, undefined


def link_graph(objects=None):
    """(call edges, definitions) of {source: object file}, else of freshly
    compiled objects (compile_objects). Call edges: {(calling file, defining
    file): sorted symbols}, every symbol one file uses and another defines;
    definitions: {symbol: defining file}."""
    tmp = None
    if objects is None:
        tmp = tempfile.mkdtemp(prefix="check_layers_")
        objects = compile_objects(tmp)
    try:
        table, wanted = {}, {}
        for src, obj in objects.items():
            defined, undefined = symbols(obj)
            for name in defined:
                table[name] = src
            wanted[src] = undefined
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out = {}
    for src, names in wanted.items():
        for name in names:
            dst = table.get(name)
            if dst is not None and dst != src:
                out.setdefault((src, dst), []).append(name)
    return {k: sorted(v) for k, v in out.items()}, table


def check_calls(objects=None, graph=None):
    """(upward call edges not in KNOWN_CALLS as (caller, callee, symbols),
    KNOWN_CALLS edges no longer present, all call edges). graph: a
    link_graph() result, else link_graph(objects)."""
    found, _ = graph if graph is not None else link_graph(objects)
    bad, seen = [], set()
    for (src, dst), names in sorted(found.items()):
        a, b = layer_of(src), layer_of(dst)
        if a in RANK and b in RANK and RANK[b] <= RANK[a]:
            continue
        key = (rel(src), rel(dst))
        if key in KNOWN_CALLS:
            seen.add(key)
        else:
            bad.append((key[0], key[1], names))
    stale = sorted(set(KNOWN_CALLS) - seen)
    return bad, stale, found


# A name followed by "(" (a prototype, or a call in a static inline body), or
# the name an extern data declaration ends with; comments are removed first.
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_CALLED = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_EXTERN = re.compile(r"\bextern\b[^;(){}]*?\b(\w+)\s*(?:\[[^\]]*\])?\s*;")


def foreign_declarations(definitions):
    """Headers that name a function or datum defined in another layer's
    file: each layer declares its own, in a header of its folder, so that
    including it is the dependency. [(header, symbol, defining file)]."""
    out = []
    for h in sorted(CSRC.rglob("*.h")):
        layer = layer_of(h)
        if layer not in RANK:
            continue
        text = _COMMENT.sub(" ", h.read_text())
        names = set(_CALLED.findall(text)) | set(_EXTERN.findall(text))
        for name in sorted(names):
            src = definitions.get(name)
            if src is not None and layer_of(src) != layer:
                out.append((rel(h.resolve()), name, rel(src)))
    return out


def unseen_calls(calls, includes):
    """Call edges between layers that the include graph does not show: the
    calling file includes no header of the called file's layer itself (a
    declaration written into the .c file, or one reached only through another
    layer's header). [(caller, callee, symbols)]."""
    direct = {}
    for src, dst in includes:
        direct.setdefault(src, set()).add(layer_of(dst))
    out = []
    for (src, dst), names in sorted(calls.items()):
        if layer_of(src) != layer_of(dst) and layer_of(dst) not in direct.get(src, set()):
            out.append((rel(src), rel(dst), names))
    return out


def main(argv):
    bad, stale, found = check()
    objects = None
    if "--objects" in argv:
        base = Path(argv[argv.index("--objects") + 1]).resolve()
        objects = {}
        for obj in base.rglob("*.o"):
            src = _c_of(obj, base)
            if src is not None and layer_of(src) in RANK:
                objects[src.resolve()] = obj
    graph = link_graph(objects)
    cbad, cstale, calls = check_calls(graph=graph)
    if "--graph" in argv:
        for src, dst in found:
            print(f"{rel(src)} -> {rel(dst)}")
        files = {s for s, _ in found} | {d for _, d in found}
        print(f"{len(found)} include edges between {len(files)} files; "
              f"{len(KNOWN) - len(stale)} known upward edges")
        for (src, dst), names in sorted(calls.items()):
            print(f"{rel(src)} calls {rel(dst)}: {' '.join(names)}")
        files = {s for s, _ in calls} | {d for _, d in calls}
        print(f"{len(calls)} call edges between {len(files)} files; "
              f"{len(KNOWN_CALLS) - len(cstale)} known upward call edges")
    for src, dst in bad:
        print(f"upward include: {src} includes {dst} "
              f"({layer_of(CSRC / src)} may not depend on {layer_of(CSRC / dst)})")
    for src, dst in stale:
        print(f"stale exception: {src} no longer includes {dst}; remove it from KNOWN")
    for src, dst, names in cbad:
        print(f"upward call: {src} uses {', '.join(names)} of {dst} "
              f"({layer_of(CSRC / src)} may not depend on {layer_of(CSRC / dst)})")
    for src, dst in cstale:
        print(f"stale exception: {src} no longer calls {dst}; remove it from KNOWN_CALLS")
    unseen = unseen_calls(calls, found)
    for src, dst, names in unseen:
        print(f"call not in the include graph: {src} uses {', '.join(names)} of {dst} "
              f"but includes no header of {layer_of(CSRC / dst)}/")
    foreign = foreign_declarations(graph[1])
    for header, name, src in foreign:
        print(f"declared outside its layer: {header} declares {name}, defined in {src}")
    if bad or stale or cbad or cstale or unseen or foreign:
        print("layer order, lowest first: " + " < ".join(n for n, _ in LAYERS))
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
