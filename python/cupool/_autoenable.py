"""Puts PyTorch (and CuPy) on cupool in programs nobody edits: ``cupool run --torch -- python
train.py``, or ``CUPOOL_TORCH=1`` / ``CUPOOL_CUPY=1`` in the environment.

The package installs ``cupool-autoenable.pth`` into site-packages; Python runs its one line
at start-up, which imports this module only when one of the variables is set (so other
programs pay nothing). It then waits for the program's own ``import torch`` (or ``import
cupy``) and calls ``cupool.torch.enable()`` right after it, before the program can allocate
anything on the GPU. A failure is printed as one line on stderr and the program goes on with
the framework's own allocator: a start-up hook must never stop a program.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

#: Environment variable → (module to wait for, function that enables cupool for it).
_TARGETS = {
    "CUPOOL_TORCH": ("torch", "cupool.torch"),
    "CUPOOL_CUPY": ("cupy", "cupool.cupy"),
}

_TRUE = {"1", "true", "yes", "on"}


def wanted() -> dict:
    """Module name → cupool module to enable, for every variable set to a true value."""
    return {
        module: enabler
        for var, (module, enabler) in _TARGETS.items()
        if os.environ.get(var, "").strip().lower() in _TRUE
    }


def _enable(enabler: str) -> None:
    try:
        __import__(enabler)
        sys.modules[enabler].enable()
    except Exception as e:  # noqa: BLE001 - any failure must leave the program running
        print(f"cupool: could not enable {enabler}: {e}", file=sys.stderr)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the watched modules with the other finders and enables cupool once the
    module's own code has run."""

    def __init__(self, targets: dict):
        self.targets = dict(targets)

    def find_spec(self, name, path=None, target=None):
        enabler = self.targets.get(name)
        if enabler is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        del self.targets[name]
        loader = spec.loader
        run_module = loader.exec_module

        def exec_module(module):
            run_module(module)
            _enable(enabler)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Called by the ``.pth`` line at start-up."""
    targets = wanted()
    if not targets:
        return
    for module, enabler in list(targets.items()):
        if module in sys.modules:  # already imported (by another start-up hook)
            _enable(enabler)
            del targets[module]
    if targets:
        sys.meta_path.insert(0, _AfterImport(targets))
