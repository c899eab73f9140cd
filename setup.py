"""Build script for dpmini's C extension.

The C core (csrc/*.c) is always built. CUDA sources (cuda/*.cu) join the
build only when nvcc is found at build time; nothing is looked up when this
file is merely imported.

Environment switches (read when building):
  DPMINI_CUDA=0          CPU-only build even when nvcc is present.
  DPMINI_CUDA_EMULATE=1  no nvcc: the CPU emulation of the CUDA layer
                         (csrc/cuda_emulate.c), for testing GPU code paths.
  DPMINI_CUDA_ARCHS      semicolon list of SM versions, default "80;90"
                         (sm_80, sm_90, plus PTX of the last for newer GPUs).
  CUDA_HOME / CUDA_PATH  where the toolkit is (else nvcc on PATH, else
                         /usr/local/cuda).
The CUDA runtime is linked statically (cudart_static), so the module imports
on machines with no GPU, no driver and no CUDA libraries.
"""
import glob
import os
import shutil
import subprocess

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
    archs = [a.strip() for a in os.environ.get("DPMINI_CUDA_ARCHS", "80;90").split(";") if a.strip()]
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
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
        emulate = os.environ.get("DPMINI_CUDA_EMULATE") == "1"
        nvcc = None if (emulate or os.environ.get("DPMINI_CUDA") == "0") else find_nvcc()
        for ext in self.extensions:
            if emulate:
                ext.define_macros.append(("DPMINI_CUDA_EMULATE", "1"))
            elif nvcc:
                self._add_cuda(ext, nvcc)
        super().build_extensions()

    def _add_cuda(self, ext, nvcc):
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        os.makedirs(self.build_temp, exist_ok=True)
        for src in sorted(glob.glob(os.path.join("cuda", "*.cu"))):
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            deps = [src] + glob.glob(os.path.join("cuda", "*.h")) + ["csrc/cuda_api.h"]
            if self.force or not os.path.exists(obj) or any(
                os.path.getmtime(d) > os.path.getmtime(obj) for d in deps
            ):
                cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                       "--cudart", "static", "-Icsrc"] + gencode_flags()
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


def c_sources():
    return sorted(glob.glob(os.path.join("csrc", "*.c")))


extra_compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                      "-Wno-missing-field-initializers", "-Wno-cast-function-type"]
if os.environ.get("DPMINI_WERROR") == "1":
    extra_compile_args.append("-Werror")
extra_compile_args += os.environ.get("DPMINI_CFLAGS", "").split()

setup(
    ext_modules=[
        Extension(
            "dpmini._dpmini",
            sources=c_sources(),
            include_dirs=["csrc"],
            extra_compile_args=extra_compile_args,
            extra_link_args=["-pthread"] + os.environ.get("DPMINI_LDFLAGS", "").split(),
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
