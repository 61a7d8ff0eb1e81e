"""Build of the `cupool` Python package: setuptools-rust compiles libcupool from the
repository's crate (../Cargo.toml) in release mode and places it in the package, where
cupool/_lib.py loads it with ctypes. The library has no Python binding, so one build serves
every Python 3 (the wheel is tagged abi3)."""

from setuptools import setup
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


setup(
    cmdclass={"bdist_wheel": PlatformWheel},
    rust_extensions=[
        RustExtension(
            "cupool.libcupool",
            path="../Cargo.toml",
            binding=Binding.NoBinding,
            py_limited_api=True,
        )
    ],
)
