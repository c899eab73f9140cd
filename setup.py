"""Build script for dpmini's C extension.

The C core (csrc/<layer>/*.c, docs/architecture.md) is always built. CUDA sources (cuda/*.cu) join the
build only when nvcc is found at build time; nothing is looked up when this
file is merely imported.

Environment switches (read when building):
  DPMINI_CUDA=0          CPU-only build even when nvcc is present.
  DPMINI_CUDA_EMULATE=1  no nvcc: the CPU emulation of the CUDA layer
                         (csrc/backend/cuda_emulate.c), for testing GPU code paths.
  DPMINI_CUDA_ARCHS      semicolon list of SM versions, default "75;80;90" (SASS for
                         each, PTX for the lowest and the highest)
                         (sm_80, sm_90, plus PTX of the last for newer GPUs).
  CUDA_HOME / CUDA_PATH  where the toolkit is (else nvcc on PATH, else
                         /usr/local/cuda).
  DPMINI_MPI=0           skip the optional MPI extension dpmini._dist.
  DPMINI_TESTING=1       also build dpmini._testing (csrc/testing/), the test-only
                         extension of hooks into _dpmini that the tests import; the
                         Makefile's builds set it, a wheel leaves it out.
  MPICC                  the MPI compiler wrapper to ask for flags (else mpicc).

The optional extension dpmini._dist (csrc/dist/*.c plus csrc/core/plan.c, the
engine of dpmini.distributed) is built when an MPI compiler wrapper (mpicc)
or pkg-config names mpi.h and mpi4py's headers are importable; otherwise it
is skipped with a message saying what is missing, and dpmini works without it.
The CUDA runtime is linked statically (cudart_static), so the module imports
on machines with no GPU, no driver and no CUDA libraries.

Every extension exports only its PyInit_* function: the C files are compiled
with -fvisibility=hidden (nvcc's host code too) and, on Linux, linked with a
version script that makes every other symbol local, those of the static CUDA
runtime included (tests/test_exports.py checks it with nm -D).
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def find_nvcc():
    """Path of nvcc, or None (called at build time only)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def gencode_flags():
    """SASS for every SM in the list, and PTX for the lowest and the highest:
    a GPU runs SASS of its major version (sm_80 code on sm_86/sm_89), else the
    driver JIT-compiles the highest PTX it can run, so the lowest arch's PTX
    keeps older GPUs (Turing, sm_75, the oldest CUDA 13 supports) working and
    the highest keeps newer ones working."""
    archs = [a.strip() for a in os.environ.get("DPMINI_CUDA_ARCHS", "75;80;90").split(";")
             if a.strip()]
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    ptx = sorted({archs[0], archs[-1]}, key=lambda a: int("".join(c for c in a if c.isdigit()) or 0))
    for a in ptx:
        flags += ["-gencode", f"arch=compute_{a},code=compute_{a}"]
    return flags


class BuildExt(build_ext):
    """build_ext that adds the NumPy include path and, when nvcc is found,
    compiles cuda/*.cu and links the static CUDA runtime (at build time only)."""

    def finalize_options(self):
        super().finalize_options()
        import numpy

        for ext in self.extensions:
            ext.include_dirs.append(numpy.get_include())

    def build_extensions(self):
        dist = [e for e in self.extensions if e.name == "dpmini._dist"]
        for ext in dist:
            why = self._add_mpi(ext)
            if why:
                print(f"dpmini: skipping the optional MPI extension dpmini._dist: {why}")
                self.extensions.remove(ext)
        emulate = os.environ.get("DPMINI_CUDA_EMULATE") == "1"
        nvcc = None if (emulate or os.environ.get("DPMINI_CUDA") == "0") else find_nvcc()
        for ext in self.extensions:
            if ext.name != "dpmini._dpmini":
                continue
            if emulate:
                ext.define_macros.append(("DPMINI_CUDA_EMULATE", "1"))
            elif nvcc:
                self._add_cuda(ext, nvcc)
        super().build_extensions()

    def build_extension(self, ext):
        if sys.platform.startswith("linux"):
            ext.extra_link_args.append("-Wl,--version-script=" + self._export_map(ext))
        super().build_extension(ext)

    def _export_map(self, ext):
        """A linker version script that keeps only ext's PyInit_* global."""
        os.makedirs(self.build_temp, exist_ok=True)
        init = "PyInit_" + ext.name.rsplit(".", 1)[-1]
        path = os.path.join(self.build_temp, init + ".map")
        with open(path, "w") as f:
            f.write("{ global: %s; local: *; };\n" % init)
        return path

    def _add_mpi(self, ext):
        """Add MPI's and mpi4py's flags to ext; returns why not, or None."""
        if os.environ.get("DPMINI_MPI") == "0":
            return "DPMINI_MPI=0"
        flags = mpi_flags()
        if flags is None:
            return ("no MPI found (no mpicc, no pkg-config ompi-c/mpich); install one, e.g. "
                    "apt-get install openmpi-bin libopenmpi-dev, to get dpmini.distributed")
        try:
            import mpi4py
        except ImportError:
            return 'mpi4py is not installed (pip install "dpmini[mpi]")'
        for flag in flags:
            if flag.startswith("-I"):
                ext.include_dirs.append(flag[2:])
            elif flag.startswith("-L"):
                ext.library_dirs.append(flag[2:])
                ext.runtime_library_dirs.append(flag[2:])
            elif flag.startswith("-l"):
                ext.libraries.append(flag[2:])
            else:
                ext.extra_link_args.append(flag)
        ext.include_dirs.append(mpi4py.get_include())
        return None

    def _add_cuda(self, ext, nvcc):
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        os.makedirs(self.build_temp, exist_ok=True)
        for src in sorted(glob.glob(os.path.join("cuda", "*.cu"))):
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            deps = [src] + glob.glob(os.path.join("cuda", "*.h")) + ["csrc/backend/cuda_api.h"]
            if self.force or not os.path.exists(obj) or any(
                os.path.getmtime(d) > os.path.getmtime(obj) for d in deps
            ):
                cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                       "-Xcompiler", "-fvisibility=hidden",
                       "--cudart", "static", "-Icsrc/backend"] + gencode_flags()
                print(" ".join(cmd))
                subprocess.check_call(cmd)
            ext.extra_objects.append(obj)
        ext.define_macros.append(("DPMINI_HAVE_CUDA", "1"))
        for lib in ("lib64", os.path.join("targets", "x86_64-linux", "lib"), "lib"):
            if os.path.exists(os.path.join(home, lib, "libcudart_static.a")):
                ext.library_dirs.append(os.path.join(home, lib))
                break
        ext.libraries += ["cudart_static", "stdc++"]
        ext.extra_link_args += ["-ldl", "-lrt", "-lpthread"]


def mpi_flags():
    """Compile and link flags of the MPI on this machine, or None (build time only)."""
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if mpicc:
        try:
            cflags = subprocess.check_output([mpicc, "--showme:compile"], text=True,
                                             stderr=subprocess.DEVNULL).split()
            lflags = subprocess.check_output([mpicc, "--showme:link"], text=True,
                                             stderr=subprocess.DEVNULL).split()
            return cflags + lflags
        except (OSError, subprocess.CalledProcessError):
            pass
        try:   # MPICH: "mpicc -show" prints the whole compiler line
            words = subprocess.check_output([mpicc, "-show"], text=True,
                                            stderr=subprocess.DEVNULL).split()
            return [w for w in words[1:] if w[:2] in ("-I", "-L", "-l") or w.startswith("-Wl")]
        except (OSError, subprocess.CalledProcessError):
            pass
    for pkg in ("ompi-c", "mpich"):
        try:
            return subprocess.check_output(["pkg-config", "--cflags", "--libs", pkg], text=True,
                                           stderr=subprocess.DEVNULL).split()
        except (OSError, subprocess.CalledProcessError):
            continue
    return None


# csrc/ is one folder a layer (docs/architecture.md); dist/ is the separate
# MPI extension. Every layer folder is on the include path, so a C file names
# a header by its file name alone ("plan.h"); "csrc" itself stays on the path
# for csrc/backend/cuda_emulate.c's "../cuda/strided.h".
LAYERS = ["core", "backend", "py", "engine", "tree", "dp", "module"]
INCLUDE_DIRS = ["csrc"] + [os.path.join("csrc", layer) for layer in LAYERS]


def c_sources():
    return sorted(src for layer in LAYERS
                  for src in glob.glob(os.path.join("csrc", layer, "*.c")))


extra_compile_args = ["-std=c11", "-O3", "-fvisibility=hidden", "-Wall", "-Wextra",
                      "-Wno-unused-parameter",
                      "-Wno-missing-field-initializers", "-Wno-cast-function-type"]
if os.environ.get("DPMINI_WERROR") == "1":
    extra_compile_args.append("-Werror")
extra_compile_args += os.environ.get("DPMINI_CFLAGS", "").split()


def testing_extensions():
    """dpmini._testing when DPMINI_TESTING=1, else none: the test hooks
    (csrc/testing/testing.c) reach _dpmini through its capsule _test_api
    (csrc/py/test_api.h) and _dist through its own (csrc/dist/dist_test_api.h,
    plain C: no MPI flags needed, and _testing builds without _dist), so they
    are never part of the shipped modules."""
    if os.environ.get("DPMINI_TESTING") != "1":
        return []
    return [Extension(
        "dpmini._testing",
        sources=sorted(glob.glob(os.path.join("csrc", "testing", "*.c"))),
        include_dirs=["csrc/core", "csrc/backend", "csrc/py", "csrc/dist", "csrc/testing"],
        extra_compile_args=extra_compile_args,
        extra_link_args=os.environ.get("DPMINI_LDFLAGS", "").split(),
    )]


setup(
    ext_modules=[
        Extension(
            "dpmini._dpmini",
            sources=c_sources(),
            include_dirs=list(INCLUDE_DIRS),
            extra_compile_args=extra_compile_args,
            extra_link_args=["-pthread"] + os.environ.get("DPMINI_LDFLAGS", "").split(),
        ),
        # Optional: dropped in BuildExt.build_extensions when MPI or mpi4py is missing.
        Extension(
            "dpmini._dist",
            sources=sorted(glob.glob(os.path.join("csrc", "dist", "*.c"))) + ["csrc/core/plan.c"],
            include_dirs=["csrc/core", "csrc/dist"],
            extra_compile_args=extra_compile_args,
            extra_link_args=os.environ.get("DPMINI_LDFLAGS", "").split(),
        ),
    ] + testing_extensions(),
    cmdclass={"build_ext": BuildExt},
)
