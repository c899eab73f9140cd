"""Each extension exports only its PyInit_* function (setup.py: -fvisibility=hidden and, on
Linux, a linker version script), and the test hooks live in the test-only extension
dpmini._testing, not in the shipped dpmini._dpmini (csrc/py/test_api.h) or dpmini._dist
(csrc/dist/dist_test_api.h).

The oracle for the exports is `nm -D --defined-only`, the dynamic symbol table the loader
resolves against: any name there besides PyInit_<module> is an internal symbol that another
library in the process could bind to (or collide with)."""
import importlib
import shutil
import subprocess
import sys

import pytest

import dpmini
from dpmini import _dpmini

EXTENSIONS = ["dpmini._dpmini", "dpmini._dist", "dpmini._testing"]

TEST_HOOKS = ["cache_stats", "cuda_debug", "emu_busy", "emu_contexts", "emu_destroy_stream",
              "emu_fail_stream_get", "emu_free", "emu_nccl_hang", "emu_nopeer_alloc", "emu_queue",
              "emu_stats", "emulate_fault", "emulated_nccl", "fail_alloc_after", "nccl_dtypes"]
# dpmini._testing's hooks into dpmini._dist: dist_<name> there, once _<name> in _dist.
DIST_TEST_HOOKS = ["check_abi", "nccl_emulate"]


def _dynamic_symbols(path):
    res = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                         check=True, timeout=60)
    return sorted(line.split()[-1] for line in res.stdout.splitlines() if line.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None,
                    reason="reads ELF dynamic symbols with binutils' nm")
@pytest.mark.parametrize("name", EXTENSIONS)
def test_each_extension_exports_only_its_init_function(name):
    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        pytest.skip(f"{name} is not built here ({e})")
    init = "PyInit_" + name.rsplit(".", 1)[-1]
    assert _dynamic_symbols(mod.__file__) == [init]


def test_the_shipped_module_has_no_test_hooks():
    names = set(vars(_dpmini))
    leaked = [h for h in TEST_HOOKS if h in names or "_" + h in names]
    assert leaked == []


def test_the_shipped_dist_module_has_no_test_hooks():
    try:
        from dpmini import _dist
    except ImportError as e:
        pytest.skip(f"dpmini._dist is not built here ({e})")
    names = set(vars(_dist))
    leaked = [h for h in DIST_TEST_HOOKS if h in names or "_" + h in names]
    assert leaked == []
    assert type(_dist._test_api).__name__ == "PyCapsule"


def test_the_testing_extension_has_every_hook_and_dpmini_does_not_import_it():
    # dpmini never needs it: a fresh interpreter importing dpmini leaves it unloaded
    res = subprocess.run([sys.executable, "-c",
                          "import sys, dpmini, dpmini.comm; "
                          "print('dpmini._testing' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False"]
    from dpmini import _testing
    assert sorted(n for n in vars(_testing) if not n.startswith("_")) == sorted(
        TEST_HOOKS + ["dist_" + h for h in DIST_TEST_HOOKS])


def test_an_emulator_hook_outside_the_emulated_build_names_the_build():
    from dpmini import _testing
    if _dpmini.cuda_backend == "emulated":
        pytest.skip("the emulated build has the emulator")
    for call in (_testing.emu_stats, _testing.emu_contexts, lambda: _testing.emulated_nccl(1),
                 lambda: _testing.emulate_fault(1), lambda: _testing.emu_busy(0, 8)):
        with pytest.raises(RuntimeError, match="not an emulated build"):
            call()


def test_the_test_api_capsule_is_the_only_way_in():
    from dpmini import _testing
    assert type(_dpmini._test_api).__name__ == "PyCapsule"
    # the hooks act on the module's own allocator: a virtual device's counters move
    before = _testing.cache_stats("cpu:3")
    import numpy as np
    kept = dpmini.comm.broadcast(np.ones(4096), ["cpu:3"])
    after = _testing.cache_stats("cpu:3")
    assert after["allocated"] > before["allocated"]
    del kept


def test_a_dist_hook_where_dpmini_dist_cannot_load_is_an_import_error():
    # _testing itself loads without _dist (it is built without MPI); its dist_* hooks
    # import _dist at their first call
    code = ("import sys\n"
            "sys.modules['dpmini._dist'] = None\n"
            "from dpmini import _testing\n"
            "for hook in (lambda: _testing.dist_nccl_emulate(True),\n"
            "             lambda: _testing.dist_check_abi('Open MPI v4.1.4')):\n"
            "    try:\n"
            "        hook()\n"
            "    except ImportError as e:\n"
            "        print('IMPORTERROR', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert [line.split()[0] for line in res.stdout.splitlines()] == ["IMPORTERROR"] * 2
