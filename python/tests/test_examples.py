"""The Python examples run on the host backend: the ctypes one does its work; the PyTorch
and CuPy ones need a GPU and say SKIPPED (with exit 0) where there is none."""

import os
import subprocess
import sys

import pytest

import cupool
from conftest import REPO


def run_example(name, *args):
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *args],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_ctypes_example():
    out = run_example("python_ctypes.py", cupool.library_path())
    assert "running on the host backend" in out
    assert "600 allocations and frees on the legacy default stream" in out
    assert "empty_cache released" in out


@pytest.mark.parametrize("name", ["python_torch.py", "python_cupy.py"])
def test_framework_examples_run_or_say_why_not(name):
    out = run_example(name)
    if out.startswith("SKIPPED"):
        pytest.skip(f"{name}: {out.strip()}")
    assert "cupool" in out
