"""Build of the `cupool` Python package: setuptools-rust compiles libcupool from the
repository's crate (../Cargo.toml) in release mode and places it in the package, where
cupool/_lib.py loads it with ctypes. The library has no Python binding, so one build serves
every Python 3 (the wheel is tagged abi3)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools_rust import Binding, RustExtension

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70.1
    from wheel.bdist_wheel import bdist_wheel


class PlatformWheel(bdist_wheel):
    """Tags the wheel py3-none-<platform>: it holds a native library but no Python
    extension, so any Python 3 on the platform can load it."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


HERE = os.path.dirname(os.path.abspath(__file__))
PTH = "cupool-autoenable.pth"


class BuildPyWithPth(build_py):
    """Also puts cupool-autoenable.pth at the top of the wheel (site-packages once
    installed), where Python runs its one line at start-up: it enables cupool for PyTorch or
    CuPy when CUPOOL_TORCH / CUPOOL_CUPY is set (cupool/_autoenable.py)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, "autoload", PTH), os.path.join(self.build_lib, PTH))


setup(
    cmdclass={"bdist_wheel": PlatformWheel, "build_py": BuildPyWithPth},
    rust_extensions=[
        RustExtension(
            "cupool.libcupool",
            path="../Cargo.toml",
            binding=Binding.NoBinding,
            py_limited_api=True,
        )
    ],
)
