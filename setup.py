"""Build of the optional CPU replay kernel ``gockpt._gockpt_native`` (csrc/).

Package metadata lives in pyproject.toml; this file only declares the extension. The
extension is optional: without a working C++ compiler (or without pybind11 headers) the
install still succeeds and replay uses the torch backend (gockpt._native logs it once).
The build needs no torch. No -march=native: the AVX2 and AVX-512 kernels are compiled through
target regions in csrc/module.cpp and chosen at run time, so a wheel built on one x86-64
machine runs on any other.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

PTH = "gockpt-accelerate.pth"


class BuildPyWithPth(build_py):
    """Also put ``gockpt-accelerate.pth`` at the root of the build, i.e. into site-packages.

    Its one line imports ``_gockpt_autoattach`` at interpreter start-up only when
    ``GOCKPT_ENABLED`` is true (GoCkpt attached to every Accelerator with no change to the
    script). Editable installs do not carry it.
    """

    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


def _native_extensions() -> list[Extension]:
    try:
        import pybind11
    except ImportError:
        print(
            "gockpt: pybind11 not found; skipping the optional native replay kernel",
            file=sys.stderr,
        )
        return []
    if sys.platform == "win32":
        compile_args = ["/O2", "/std:c++17", "/fp:precise"]
        link_args: list[str] = []
    else:
        compile_args = [
            "-O3",
            "-g0",
            "-std=c++17",
            # Rounding is decided in the source (explicit FMA intrinsics where torch's kernels
            # fuse, separate operations where they do not): never let the compiler contract.
            "-ffp-contract=off",
            "-fno-math-errno",
            "-fvisibility=hidden",
            "-pthread",
        ]
        link_args = ["-pthread"]
    return [
        Extension(
            "gockpt._gockpt_native",
            sources=["csrc/module.cpp"],
            depends=["csrc/kernel_args.h", "csrc/lanes.h", "csrc/optim_kernels.inc"],
            include_dirs=[pybind11.get_include(), "csrc"],
            language="c++",
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=True,
        )
    ]


setup(ext_modules=_native_extensions(), cmdclass={"build_py": BuildPyWithPth})
