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


# Per call, the allocator makes one C call each way and builds CuPy's two objects; the rest
# is looked up once, at enable() (a Python allocator pays for every attribute lookup: the
# first version took 9.8 µs per cupy.empty + del on an H100 host against 4.9 µs for CuPy's
# own pool, docs/BENCHMARKS.md).
_alloc_fn: Any = None  # cupool_torch_alloc(size, device, stream) -> pointer or NULL
_free_fn: Any = None  # cupool_torch_free(ptr, size, device, stream)
_device_id: Any = None
_stream_ptr: Any = None
_MemoryPointer: Any = None
_UnownedMemory: Any = None


class _Block:
    """Owns one pool block for CuPy's ``UnownedMemory``; frees it when collected, in stream
    order on the stream it was allocated on (should that stream be gone, without one)."""

    __slots__ = ("ptr", "device", "stream")

    def __init__(self, ptr: int, device: int, stream: int):
        self.ptr = ptr
        self.device = device
        self.stream = stream

    def __del__(self) -> None:
        free = _free_fn
        if free is not None:  # None only at interpreter shutdown: nothing to free into
            free(self.ptr, 0, self.device, self.stream)


def allocate(size: int) -> Any:
    """CuPy allocator: a ``MemoryPointer`` to ``size`` bytes of pool memory on CuPy's
    current device, in stream order on its current stream."""
    if _alloc_fn is None:
        _bind()
    device = _device_id()
    if size == 0:
        return _MemoryPointer(_UnownedMemory(0, 0, None, device), 0)
    stream = _stream_ptr()
    ptr = _alloc_fn(size, device, stream)
    if not ptr:
        _raise_for(size, device, stream)
    return _MemoryPointer(_UnownedMemory(ptr, size, _Block(ptr, device, stream), device), 0)


def _raise_for(size: int, device: int, stream: int) -> None:
    """The allocation failed: ask again through the call that says why, and raise CuPy's
    OutOfMemoryError (or cupool's error for anything else)."""
    import cupy  # noqa: PLC0415

    lib = _lib.lib()
    ptr = ctypes.c_void_p()
    status = lib.cupool_alloc_async_device(ctypes.byref(ptr), size, device, stream)
    if status == _lib.OK:  # memory came free meanwhile: give it back, report the failure
        lib.cupool_free_async(ptr, stream)
        status = _lib.ERROR_OUT_OF_MEMORY
    if status == _lib.ERROR_OUT_OF_MEMORY:
        free_b, total_b = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.cupool_mem_get_info(device, ctypes.byref(free_b), ctypes.byref(total_b))
        raise cupy.cuda.memory.OutOfMemoryError(size, total_b.value)
    _lib.check(status, f"cupool: allocating {size} bytes for CuPy")


def _bind() -> None:
    """Looks up once what every allocation uses."""
    global _alloc_fn, _free_fn, _device_id, _stream_ptr, _MemoryPointer, _UnownedMemory
    import cupy  # noqa: PLC0415

    lib = _lib.lib()
    alloc = lib.cupool_torch_alloc
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = lib.cupool_torch_free
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    device_mod = getattr(cupy.cuda, "device", None)
    stream_mod = getattr(cupy.cuda, "stream", None)
    _device_id = getattr(device_mod, "get_device_id", None) or (lambda: cupy.cuda.Device().id)
    _stream_ptr = getattr(stream_mod, "get_current_stream_ptr", None) or (
        lambda: int(cupy.cuda.get_current_stream().ptr)
    )
    _MemoryPointer = cupy.cuda.memory.MemoryPointer
    _UnownedMemory = cupy.cuda.memory.UnownedMemory
    _alloc_fn, _free_fn = alloc, free


def enable() -> None:
    """Makes cupool CuPy's device allocator (``cupy.cuda.set_allocator``)."""
    global _installed
    import cupy  # noqa: PLC0415

    _bind()
    cupy.cuda.set_allocator(allocate)
    _installed = True


def enabled() -> bool:
    return _installed
