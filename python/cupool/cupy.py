"""CuPy on cupool: ``cupool.cupy.enable()``.

Installs an allocator with ``cupy.cuda.set_allocator`` that takes every device allocation
from cupool, stream-ordered on CuPy's current stream and device; the memory goes back to
the pool, on the same stream, when CuPy drops its last reference. CuPy's pinned host
memory pool is left alone.
"""

from __future__ import annotations

import ctypes
from typing import Any

from . import _lib

_installed = False


class _Block:
    """Owns one pool block for CuPy's ``UnownedMemory``; frees it when collected."""

    __slots__ = ("ptr", "stream")

    def __init__(self, ptr: int, stream: int):
        self.ptr = ptr
        self.stream = stream

    def __del__(self) -> None:
        try:
            lib = _lib.lib()
        except Exception:  # interpreter shutdown: nothing left to free into
            return
        status = lib.cupool_free_async(self.ptr, self.stream)
        if status != _lib.OK:
            # Should CuPy's stream be gone, the block goes back without a stream.
            lib.cupool_free(self.ptr)


def allocate(size: int) -> Any:
    """CuPy allocator: a ``MemoryPointer`` to ``size`` bytes of pool memory on CuPy's
    current device, in stream order on its current stream."""
    import cupy  # noqa: PLC0415 - optional dependency

    memory = cupy.cuda.memory
    device = cupy.cuda.Device().id
    if size == 0:
        return memory.MemoryPointer(memory.UnownedMemory(0, 0, None, device), 0)
    stream = int(cupy.cuda.get_current_stream().ptr)
    ptr = ctypes.c_void_p()
    status = _lib.lib().cupool_alloc_async_device(ctypes.byref(ptr), size, device, stream)
    if status == _lib.ERROR_OUT_OF_MEMORY:
        total = 0
        free_b, total_b = ctypes.c_size_t(0), ctypes.c_size_t(0)
        if _lib.lib().cupool_mem_get_info(device, ctypes.byref(free_b), ctypes.byref(total_b)) == 0:
            total = total_b.value
        raise memory.OutOfMemoryError(size, total)
    _lib.check(status, f"cupool: allocating {size} bytes for CuPy")
    owner = _Block(int(ptr.value), stream)
    return memory.MemoryPointer(memory.UnownedMemory(owner.ptr, size, owner, device), 0)


def enable() -> None:
    """Makes cupool CuPy's device allocator (``cupy.cuda.set_allocator``)."""
    global _installed
    import cupy  # noqa: PLC0415

    cupy.cuda.set_allocator(allocate)
    _installed = True


def enabled() -> bool:
    return _installed
