"""dpmini/_dpmini.pyi against the built extension.

The stub is parsed with ast (nothing is imported from it). For every public
callable of dpmini._dpmini and of its C submodule comm (typed in the stub as the
protocol class _Comm), the stub's parameter names, kinds and defaults must equal
inspect.signature of the runtime object; every name the stub declares must exist
at run time, except the stub-only type names listed in STUB_ONLY.

The callables without a text signature (NO_TEXT_SIGNATURE) are not skipped:
their docstrings start with "name(params) -> ..." and that line is the
reference instead. Dunders are checked only where listed (constructors,
__call__, the DLPack/CUDA-array-interface protocol).

test_mypy_consumes_the_stub runs only where mypy is installed (it is not a test
dependency): it type-checks a small good and a small bad snippet.
"""
import ast
import inspect
import sys
import types
from pathlib import Path

import pytest

from dpmini import _dpmini

# The source of truth (what the wheel ships), also when the extension under test
# was built out of tree (make test-asan / test-valgrind).
STUB = Path(__file__).resolve().parents[1] / "dpmini" / "_dpmini.pyi"

# Declared in the stub for typing only; absent from the runtime module.
STUB_ONLY = {"DeviceLike", "_TorchDeviceLike", "_AnyArray", "_ArrayIn", "_Comm"}
# Private runtime names the stub declares on purpose (used by dpmini's own code).
PRIVATE_TYPED = {"_plan", "_Buffer", "_profile_start", "_profile_stop", "_profile_counts",
                 "_profile_events", "_profile_record", "_profile_begin", "_profile_end",
                 "_profile_now", "_profile_recording", "_copy_limit_seconds"}
# Runtime callables with no __text_signature__: checked against their docstring.
NO_TEXT_SIGNATURE = set()   # every callable has a text signature now
# Types that refuse construction ("cannot create ... instances"): the stub
# declares no __init__/__new__ for them.
NOT_CONSTRUCTIBLE = {"Array", "_Buffer"}
# Dunders compared besides constructors (the rest are object's or slot wrappers).
CHECKED_DUNDERS = {"__call__", "__dlpack__", "__dlpack_device__", "__cuda_array_interface__"}
# Runtime dunders deliberately left out of the stub: Array.__array__ always
# raises TypeError; declaring it would make an Array pass for numpy ArrayLike.
OMITTED = {"Array.__array__"}

_KINDS = inspect.Parameter


def _tree():
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _defs(body):
    """name -> the last def/class/annotated assignment of that name in body."""
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            if isinstance(node, ast.FunctionDef) and _is_setter(node):
                continue
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return out


def _is_setter(fn):
    return any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter")
               for d in fn.decorator_list)


def _is_property(fn):
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def _params(args, drop_first):
    """[(name, kind, default or _KINDS.empty)] of an ast.arguments."""
    pos = [(a.arg, _KINDS.POSITIONAL_ONLY) for a in args.posonlyargs] + \
          [(a.arg, _KINDS.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults = [_KINDS.empty] * (len(pos) - len(args.defaults)) + \
               [ast.literal_eval(d) for d in args.defaults]
    out = [(n, k, d) for (n, k), d in zip(pos, defaults)]
    if args.vararg:
        out.append((args.vararg.arg, _KINDS.VAR_POSITIONAL, _KINDS.empty))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, _KINDS.KEYWORD_ONLY, _KINDS.empty if d is None else ast.literal_eval(d)))
    if args.kwarg:
        out.append((args.kwarg.arg, _KINDS.VAR_KEYWORD, _KINDS.empty))
    return out[1:] if drop_first else out


def _runtime_params(obj, qualname):
    """Parameters of the runtime object, from its text signature or, for the
    objects in NO_TEXT_SIGNATURE, from its docstring's first line."""
    if qualname in NO_TEXT_SIGNATURE:
        with pytest.raises(ValueError):
            inspect.signature(obj)  # if this starts passing, drop it from the list
        first = obj.__doc__.splitlines()[0]
        name, _, rest = first.partition("(")
        assert name.strip() == qualname.rsplit(".", 1)[-1], first
        params = rest.rsplit(")", 1)[0]
        head = ("self, " if "." in qualname else "") + params
        fn = ast.parse(f"def f({head.rstrip(', ')}): pass").body[0]
        return _params(fn.args, drop_first="." in qualname)
    params = list(inspect.signature(obj).parameters.values())
    if isinstance(obj, types.WrapperDescriptorType):  # slot wrappers keep (self, /, ...)
        params = params[1:]
    elif isinstance(obj, types.MethodDescriptorType):
        # a C method's text signature starts with $self, so that inspect (and stubtest) see
        # the unbound method's self
        assert params and params[0].name == "self" and params[0].kind is _KINDS.POSITIONAL_ONLY, \
            f"{qualname}: its text signature lacks $self"
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


def _assert_same(stub_fn, obj, qualname, drop_first):
    got = _params(stub_fn.args, drop_first)
    want = _runtime_params(obj, qualname)
    assert got == want, f"{qualname}: stub {got} != runtime {want}"


def _public(obj):
    return sorted(n for n in vars(obj) if not n.startswith("_"))


def _runtime_classes():
    return {n: v for n, v in vars(_dpmini).items() if isinstance(v, type)
            and (not n.startswith("_") or n in PRIVATE_TYPED)}


# ------------------------------------------------------------------ module level

def test_every_public_runtime_name_is_in_the_stub():
    stub = _defs(_tree().body)
    missing = [n for n in _public(_dpmini) if n not in stub] + \
              [n for n in PRIVATE_TYPED if n not in stub]
    assert not missing, f"not in {STUB.name}: {missing}"


def test_every_stub_name_exists_at_runtime():
    stub = _defs(_tree().body)
    extra = [n for n in stub if n not in STUB_ONLY and not hasattr(_dpmini, n)]
    assert not extra, f"in {STUB.name} but not in dpmini._dpmini: {extra}"
    for n in STUB_ONLY:
        assert n in stub and not hasattr(_dpmini, n), n


def test_functions_match_inspect_signature():
    stub = _defs(_tree().body)
    names = [n for n in _public(_dpmini) if callable(getattr(_dpmini, n))
             and not isinstance(getattr(_dpmini, n), type)] + \
        sorted(n for n in PRIVATE_TYPED if not isinstance(getattr(_dpmini, n), type))
    assert len(names) > 15
    for n in names:
        assert isinstance(stub[n], ast.FunctionDef), n
        _assert_same(stub[n], getattr(_dpmini, n), n, drop_first=False)


def test_constants():
    stub = _defs(_tree().body)
    for n in ["MAX_DEVICES", "has_cuda", "cuda_backend"]:
        assert isinstance(stub[n], ast.AnnAssign), n
    assert isinstance(_dpmini.MAX_DEVICES, int) and isinstance(_dpmini.has_cuda, int)
    # cuda_backend: Final[Literal[...]] lists every value the build can report.
    literal = stub["cuda_backend"].annotation.slice
    assert _dpmini.cuda_backend in ast.literal_eval(literal.slice)


# ----------------------------------------------------------------------- classes

def test_classes_and_bases():
    stub = _defs(_tree().body)
    for n, cls in _runtime_classes().items():
        assert isinstance(stub.get(n), ast.ClassDef), n
        bases = [ast.unparse(b) for b in stub[n].bases]
        want = [b.__name__ for b in cls.__bases__ if b is not object]
        assert bases == want, (n, bases, want)
        final = any(ast.unparse(d) == "final" for d in stub[n].decorator_list)
        subclassable = bool(cls.__flags__ & (1 << 10))  # Py_TPFLAGS_BASETYPE
        if issubclass(cls, BaseException):
            continue
        assert final == (not subclassable), f"{n}: @final must match Py_TPFLAGS_BASETYPE"


def test_class_members_match():
    stub = _defs(_tree().body)
    for n, cls in _runtime_classes().items():
        members = _defs(stub[n].body)
        inherited = {m for b in stub[n].bases if ast.unparse(b) in stub
                     for m in _defs(stub[ast.unparse(b)].body)}
        runtime = [m for m in vars(cls) if not m.startswith("_") or m in CHECKED_DUNDERS]
        runtime = [m for m in runtime if f"{n}.{m}" not in OMITTED]
        missing = [m for m in runtime if m not in members and m not in inherited]
        assert not missing, f"{n}: not in the stub: {missing}"
        for m, node in members.items():
            qual = f"{n}.{m}"
            if m in ("__init__", "__new__", "__eq__", "__ne__", "__hash__"):
                assert hasattr(cls, m), qual
                continue
            assert m in vars(cls), f"{qual} is in the stub but not at runtime"
            attr = vars(cls)[m]
            descriptor = inspect.isgetsetdescriptor(attr) or inspect.ismemberdescriptor(attr)
            if isinstance(node, ast.FunctionDef) and _is_property(node):
                assert descriptor, qual
            elif isinstance(node, ast.FunctionDef):
                assert callable(attr) and not descriptor, qual
                _assert_same(node, getattr(cls, m), qual, drop_first=True)
            else:  # an annotated attribute (exception .status)
                assert not callable(attr), qual


def test_constructors_match():
    stub = _defs(_tree().body)
    for n, cls in _runtime_classes().items():
        if issubclass(cls, BaseException):
            continue
        members = _defs(stub[n].body)
        ctors = [members[c] for c in ("__init__", "__new__") if c in members]
        if n in NOT_CONSTRUCTIBLE:
            assert not ctors, f"{n} cannot be created; its stub must not declare a constructor"
            with pytest.raises(TypeError, match="cannot create"):
                cls()
            continue
        assert len(ctors) == 1, n
        _assert_same(ctors[0], cls, n, drop_first=True)


def test_data_parallel_setters():
    """Every settable DataParallel attribute has a @x.setter in the stub."""
    cls = _defs(_tree().body)["DataParallel"]
    setters = {d.value.id for fn in cls.body if isinstance(fn, ast.FunctionDef)
               for d in fn.decorator_list if isinstance(d, ast.Attribute) and d.attr == "setter"}
    dp = _dpmini.DataParallel(lambda *args: args, device_ids=["cpu:0", "cpu:1"])
    for m in _public(_dpmini.DataParallel):
        if inspect.isgetsetdescriptor(vars(_dpmini.DataParallel)[m]):
            assert m in setters, m
            setattr(dp, m, getattr(dp, m))  # writable at runtime too


# ---------------------------------------------------------------------- comm

def test_comm_matches_protocol():
    stub = _defs(_tree().body)
    assert ast.unparse(stub["comm"].annotation) == "_Comm"
    proto = _defs(stub["_Comm"].body)
    runtime = _public(_dpmini.comm)
    assert sorted(proto) == runtime
    for n in runtime:
        _assert_same(proto[n], getattr(_dpmini.comm, n), f"comm.{n}", drop_first=True)


# ------------------------------------------------------------- the checker itself

def test_a_broken_stub_fails():
    """The comparison notices a renamed parameter, a changed default and a
    keyword-only parameter made positional."""
    fn = ast.parse("def scatter(inputs, target_devices, dim=1, strict=False, in_dims=None,"
                   " chunk_sizes=None, weights=None): ...").body[0]
    with pytest.raises(AssertionError, match="scatter"):
        _assert_same(fn, _dpmini.scatter, "scatter", drop_first=False)
    fn = ast.parse("def data_parallel(module, inputs, device_ids=None, output_device=None, dim=0,"
                   " module_kwargs=None, in_dims=None, out_dims=None, chunk_sizes=None,"
                   " weights=None): ...").body[0]
    with pytest.raises(AssertionError):
        _assert_same(fn, _dpmini.data_parallel, "data_parallel", drop_first=False)
    fn = ast.parse("def reduce_add(self, array, destination=None): ...").body[0]
    with pytest.raises(AssertionError):
        _assert_same(fn, _dpmini.comm.reduce_add, "comm.reduce_add", drop_first=True)


# ------------------------------------------------- mypy (only where it is installed)

_MYPY_OK = """
from typing import TYPE_CHECKING
import numpy as np
import dpmini
from dpmini import comm
if TYPE_CHECKING:
    from dpmini._dpmini import DeviceLike
devs: "list[DeviceLike]" = ["cpu:0", dpmini.Device("cpu:1")]
dp = dpmini.DataParallel(lambda x: x, device_ids=devs, chunk_sizes=[3, 1])
ids: list[dpmini.Device] = dp.device_ids
dp.output_device = "cpu"
n: int = dpmini.device_count() + dpmini.memory_allocated("cpu:0")
parts = comm.scatter(np.zeros(4), devices=devs, dim=0)
total = comm.reduce_add(list(parts), destination="cpu")
"""
_MYPY_BAD = """
import numpy as np
import dpmini
from dpmini import comm
dpmini.scatter(np.zeros(3), ["cpu:0"], dimm=0)
dpmini.Device(1.5)
comm.reduce_add([np.zeros(3)], buffer_size=3)
s: str = dpmini.device_count()
"""


def test_mypy_consumes_the_stub(tmp_path, monkeypatch):
    """mypy resolves dpmini._dpmini to the stub: good code passes, each bad line fails."""
    api = pytest.importorskip("mypy.api")
    (tmp_path / "ok.py").write_text(_MYPY_OK)
    (tmp_path / "bad.py").write_text(_MYPY_BAD)
    # MYPYPATH: the source tree (mypy cannot see through the editable install).
    monkeypatch.setenv("MYPYPATH", str(STUB.parents[1]))
    args = ["--no-incremental", "--follow-imports=silent", "--python-executable", sys.executable]
    out, err, rc = api.run(args + [str(tmp_path / "ok.py")])
    assert rc == 0, out + err
    out, err, rc = api.run(args + [str(tmp_path / "bad.py")])
    assert rc == 1, out + err
    flagged = sorted({int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line})
    assert flagged == [5, 6, 7, 8], out
