"""Programs nobody edits: ``CUPOOL_TORCH=1`` (what ``cupool run --torch`` sets) puts
PyTorch on cupool right after the program's own ``import torch``, through the start-up file
``cupool-autoenable.pth`` that the package installs into site-packages. Run against the
PyTorch stand-in (``fake_torch/``) in subprocesses; the file is read from the source tree
with ``site.addsitedir``, which runs ``.pth`` lines as start-up does."""

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

FAKE = pathlib.Path(__file__).resolve().parent / "fake_torch"
AUTOLOAD = pathlib.Path(__file__).resolve().parents[1] / "autoload"
PTH = "cupool-autoenable.pth"


def run(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(FAKE), **env)
    prelude = f"import site; site.addsitedir({str(AUTOLOAD)!r})\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_variable_enables_cupool_right_after_import_torch():
    done = run(
        """
        import sys
        assert "cupool" in sys.modules, "the start-up line imported the hook"
        assert "torch" not in sys.modules
        import torch
        import cupool.torch
        assert cupool.torch.enabled(), "enabled by the start-up hook"
        assert not torch.cuda.is_initialized(), "before any CUDA work of the program"
        print("ok")
        """,
        CUPOOL_TORCH="1",
        # The stand-in cannot build the C++ shim (test_torch.py covers that fallback).
        CUPOOL_TORCH_SHIM="0",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert done.stderr == ""


def test_without_the_variable_nothing_is_imported_or_enabled():
    done = run(
        """
        import sys
        assert "cupool" not in sys.modules, "the start-up line costs nothing"
        import torch
        import cupool.torch
        assert not cupool.torch.enabled()
        print("ok")
        """,
        CUPOOL_TORCH="0",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_failure_is_one_line_and_the_program_goes_on():
    # CUDA already started when torch finishes importing: enable() must refuse, and the
    # program still runs on PyTorch's own allocator.
    done = run(
        """
        import torch
        import cupool.torch
        assert not cupool.torch.enabled()
        print("still running")
        """,
        CUPOOL_TORCH="1",
        FAKE_TORCH_CUDA_INITIALIZED_AT_IMPORT="1",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "still running"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cupool: could not enable cupool.torch"), lines


def test_the_installed_package_carries_the_start_up_file():
    try:
        files = importlib.metadata.files("cupool") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the cupool package is not installed (pip install ./python)")
    assert any(f.name == PTH for f in files), [str(f) for f in files]
