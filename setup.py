"""Builds jpaged's native CPU kernels (optional: see jpaged/device/attention/native.py): paged attention and
the few-row weight matmuls, int8 and 16-bit (jpaged/device/quant.py).

The C++ sources are compiled once per instruction set, each into its own shared library beside
native.py, which picks at run time the best one the CPU runs. No -march=native: what is built runs
on any CPU of the architecture. A machine without a C++ compiler, or where a build fails, installs
jpaged without the variant (one line says so) and runs attention on the XLA path.
"""

import copy
import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = [f"jpaged/device/attention/csrc/{name}.cc" for name in ("paged_attention", "int8_matmul")]
HEADERS = "jpaged/device/attention/csrc/third_party"
COMMON = ["-O3", "-std=c++17", "-fPIC", "-fopenmp-simd", "-fno-math-errno", "-Wno-psabi"]
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
VARIANTS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-mprefer-vector-width=512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}


class OptionalBuildExt(build_ext):
    """Builds each variant it can; a failed or impossible build is one line, not a failed install."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = True  # the variants compile side by side, one per core

    def build_extensions(self):
        if self.compiler.compiler_type == "msvc":
            print("jpaged: the native CPU attention kernels need gcc or clang; attention will run on the XLA path",
                  file=sys.stderr)
            return
        super().build_extensions()

    def build_extension(self, ext):
        # each variant compiles the same sources with its own flags: into its own folder, or the variants
        # built side by side would overwrite each other's object files
        own = copy.copy(self)
        own.build_temp = os.path.join(self.build_temp, ext.name.rsplit(".", 1)[-1])
        try:
            super(OptionalBuildExt, own).build_extension(ext)
        except Exception as error:  # noqa: BLE001 - any failure leaves the XLA path, said in one line
            print(f"jpaged: could not build {ext.name} ({type(error).__name__}: {error}); attention will use "
                  "another native variant or the XLA path", file=sys.stderr)

    def get_export_symbols(self, ext):
        return []  # plain shared libraries loaded by ctypes, not Python modules


def variant(name, flags):
    return Extension(f"jpaged.device.attention._native_{name}", sources=SOURCES, language="c++",
                     extra_compile_args=COMMON + ["-isystem", HEADERS, f'-DJPAGED_VARIANT="{name}"'] + flags,
                     depends=[f"{HEADERS}/xla/ffi/api/{h}" for h in ("api.h", "c_api.h", "ffi.h")]
                     + [f"jpaged/device/attention/csrc/{h}" for h in ("lanes.h", "work_list.h")])


setup(ext_modules=[variant(name, flags) for name, flags in VARIANTS.items() if X86 or not flags],
      cmdclass={"build_ext": OptionalBuildExt})
