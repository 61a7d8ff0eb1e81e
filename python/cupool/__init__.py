"""cupool: a CUDA device-memory caching allocator, from Python.

Pure Python over cupool's C API (``libcupool.so``, loaded with ctypes), so one wheel
serves every Python 3. ``cupool.torch.enable()`` puts PyTorch on the pool,
``cupool.cupy.enable()`` CuPy; neither framework is imported until then.

Devices: a ``device`` of ``None`` means all devices (summed) where a call can cover
several, as in :func:`stats`; PyTorch's functions, once patched by
``cupool.torch.enable()``, keep PyTorch's meaning (the current device).
"""

from __future__ import annotations

import ctypes
from typing import Any

from . import _lib
from ._lib import CupoolError, OutOfMemoryError
from ._snapshot import (
    device_count,
    dump_snapshot,
    record_memory_history,
    snapshot,
)
from ._stats import footprint, memory_summary, stats

__all__ = [
    "CupoolError",
    "OutOfMemoryError",
    "alloc",
    "free",
    "stats",
    "footprint",
    "memory_summary",
    "empty_cache",
    "set_memory_limit",
    "get_memory_limit",
    "reserve",
    "reset_peak_stats",
    "config_get",
    "config_set",
    "trace_start",
    "trace_stop",
    "snapshot",
    "dump_snapshot",
    "record_memory_history",
    "device_count",
    "mem_get_info",
    "library_path",
    "version",
    "interposition_active",
]


def version() -> str:
    """The library's version, e.g. ``"0.1.0"``."""
    return _lib.lib().cupool_version().decode()


def library_path() -> str:
    """The path of the ``libcupool`` shared library in use."""
    return _lib.loaded_path()


def interposition_active() -> bool:
    """Whether ``libcupool_preload.so`` interposes CUDA in this process."""
    return bool(_lib.lib().cupool_interposition_active())


def alloc(size: int, stream: int = 0, device: int | None = None) -> int:
    """Allocates ``size`` bytes of device memory in stream order on ``stream`` (a
    ``cudaStream_t`` as an integer; 0 is the legacy default stream) and returns its
    address. ``device`` ``None``: the calling thread's current device. Free it once with
    :func:`free`. Raises :class:`OutOfMemoryError` when the pool cannot provide it."""
    ptr = ctypes.c_void_p()
    if device is None:
        status = _lib.lib().cupool_alloc_async(ctypes.byref(ptr), size, stream)
    else:
        status = _lib.lib().cupool_alloc_async_device(ctypes.byref(ptr), size, device, stream)
    _lib.check(status, f"cupool: allocating {size} bytes")
    return int(ptr.value)


def free(ptr: int, stream: int | None = 0) -> None:
    """Frees a block from :func:`alloc` in stream order on ``stream`` (``None``: without a
    stream, reused only after a context fence)."""
    if stream is None:
        status = _lib.lib().cupool_free(ptr)
    else:
        status = _lib.lib().cupool_free_async(ptr, stream)
    _lib.check(status, f"cupool: freeing {ptr:#x}")


def _devices(device: int | None):
    return range(device_count()) if device is None else [int(device)]


def empty_cache(device: int | None = None) -> int:
    """Gives idle cached memory of ``device`` (``None``: every device) back to the driver;
    returns the bytes released."""
    released = ctypes.c_size_t(0)
    if device is None:
        status = _lib.lib().cupool_empty_cache(ctypes.byref(released))
    else:
        status = _lib.lib().cupool_empty_cache_device(int(device), ctypes.byref(released))
    _lib.check(status, "cupool: empty_cache")
    return released.value


def set_memory_limit(limit: int, device: int | None = None) -> None:
    """Caps the bytes the pool may reserve on ``device`` (``None``: on every device) at
    ``limit``; 0 removes the cap. An allocation past it fails with out of memory after
    idle cached memory was released."""
    if limit < 0:
        raise ValueError("the limit is a number of bytes, 0 for none")
    for d in _devices(device):
        _lib.check(_lib.lib().cupool_set_memory_limit(d, int(limit)), "cupool: set_memory_limit")


def reserve(nbytes: int, device: int | None = None) -> int:
    """Makes the pool of ``device`` (``None``: the current device) take from the driver
    now what it lacks to hold ``nbytes``, and keep that much through ``empty_cache`` (no
    warm-up; the memory is claimed before other processes take it). 0 ends the reserve.
    Returns the bytes taken now; raises :class:`OutOfMemoryError` past the memory limit or
    what the device has free."""
    if nbytes < 0:
        raise ValueError("the reserve is a number of bytes, 0 for none")
    taken = ctypes.c_size_t(0)
    _lib.check(
        _lib.lib().cupool_reserve(-1 if device is None else int(device), int(nbytes),
                                  ctypes.byref(taken)),
        "cupool: reserve",
    )
    return taken.value


def get_memory_limit(device: int = 0) -> int:
    """The cap on reserved bytes of ``device`` (0: none)."""
    out = ctypes.c_size_t(0)
    _lib.check(
        _lib.lib().cupool_get_memory_limit(int(device), ctypes.byref(out)),
        "cupool: get_memory_limit",
    )
    return out.value


def mem_get_info(device: int = 0) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device`` as the driver reports them (cached memory
    counts as used)."""
    free_b, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _lib.check(
        _lib.lib().cupool_mem_get_info(int(device), ctypes.byref(free_b), ctypes.byref(total)),
        "cupool: mem_get_info",
    )
    return free_b.value, total.value


def reset_peak_stats(device: int | None = None) -> None:
    """Sets every peak of ``device`` (``None``: all devices) to its current value."""
    dev = -1 if device is None else int(device)
    _lib.check(_lib.lib().cupool_reset_peak_stats(dev), "cupool: reset_peak_stats")


def _config_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def config_set(key: str, value: Any) -> None:
    """Sets option ``key`` (see the README's table) to ``value`` (text, a number or a
    bool). Raises :class:`CupoolError` for an unknown key or a value it cannot take."""
    status = _lib.lib().cupool_config_set(key.encode(), _config_text(value).encode())
    _lib.check(status, f"cupool: config {key}={_config_text(value)}")


def config_get(key: str) -> str:
    """The current value of option ``key``, as text."""
    return _lib.text_out(_lib.lib().cupool_config_get, key.encode(), what=f"cupool: config {key}")


def trace_start(path: str) -> None:
    """Records every allocation and free of the process to ``path`` (RMM's log CSV, zstd
    when it ends in ``.zst``); see the README's "Traces and replay"."""
    _lib.check(_lib.lib().cupool_trace_start(str(path).encode()), f"cupool: trace {path}")


def trace_stop() -> None:
    """Stops recording and writes everything recorded."""
    _lib.check(_lib.lib().cupool_trace_stop(), "cupool: trace_stop")
