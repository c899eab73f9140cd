"""Build script for dpmini's C extension.

The C core (csrc/*.c) is always built; today that is the whole build. When
the CUDA backend is present (cuda/*.cu), its sources are to join the build
only when nvcc is found at build time; nothing is looked up when this file is
merely imported.
"""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """build_ext that adds the NumPy include path when building (not at import)."""

    def finalize_options(self):
        super().finalize_options()
        import numpy

        for ext in self.extensions:
            ext.include_dirs.append(numpy.get_include())


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
