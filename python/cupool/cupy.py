"""CuPy on cupool: ``cupool.cupy.enable()``.

Installs an allocator with ``cupy.cuda.set_allocator`` that takes every device allocation
from cupool, stream-ordered on CuPy's current stream and device; the memory goes back to
the pool, on the same stream, when CuPy drops its last reference. CuPy's pinned host
memory pool is left alone.

Two allocators, the first that works:
- **compiled** (CuPy's ``CFunctionAllocator`` over ``cupool_cupy_malloc`` /
  ``cupool_cupy_free``): CuPy calls the library from its compiled code, which takes its
  current stream from CuPy's own C function (``cupy.cuda.stream.__pyx_capi__``) and raises
  CuPy's out-of-memory error itself (Note [CuPy's C-function allocator] in
  ``src/ffi/cupy.rs``). No Python frame and no ctypes call per allocation.
- **Python** (``allocate`` below), where CuPy lacks what the first needs, or does not raise
  an error the library sets (checked once, at ``enable()``).

``mode()`` says which one is installed.
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


class _Hooks(ctypes.Structure):
    """``cupool_cupy_hooks`` (include/cupool.h)."""

    _fields_ = [
        ("current_stream", ctypes.c_void_p),
        ("set_error", ctypes.c_void_p),
        ("out_of_memory_type", ctypes.c_void_p),
        ("error_type", ctypes.c_void_p),
    ]


# The C signature of CuPy's ``get_current_stream_ptr`` as its Cython module exports it.
_STREAM_FN_SIGNATURE = b"intptr_t (void)"
_mode = None
# What the compiled allocator refers to by address: kept alive while it is installed.
_compiled_state: Any = None


class AllocationError(RuntimeError):
    """A cupool allocation for CuPy failed for a reason other than out of memory."""


class _CheckError(RuntimeError):
    """Raised through the compiled allocator once, by ``enable()``'s check."""


def _capsule_pointer(capsule: Any) -> int | None:
    """The C function in one of a Cython module's ``__pyx_capi__`` capsules, if it has
    the signature ``intptr_t (void)``."""
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    try:
        name = api.PyCapsule_GetName(capsule)
        if name != _STREAM_FN_SIGNATURE:
            return None
        return api.PyCapsule_GetPointer(capsule, name)
    except (TypeError, ValueError):
        return None


def _compiled_allocator() -> Any:
    """CuPy's ``CFunctionAllocator`` over the library's CuPy hooks, with what it refers to,
    or ``None`` where this CuPy cannot run it safely."""
    import cupy  # noqa: PLC0415

    memory = cupy.cuda.memory
    factory = getattr(memory, "CFunctionAllocator", None)
    capi = getattr(getattr(cupy.cuda, "stream", None), "__pyx_capi__", None) or {}
    stream_fn = _capsule_pointer(capi["get_current_stream_ptr"]) if (
        "get_current_stream_ptr" in capi) else None
    lib = _lib.lib()
    malloc = getattr(lib, "cupool_cupy_malloc", None)
    free = getattr(lib, "cupool_cupy_free", None)
    if factory is None or not stream_fn or malloc is None or free is None:
        return None
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
    set_error = address(ctypes.pythonapi.PyErr_SetString)

    class OutOfMemoryError(memory.OutOfMemoryError):
        """CuPy's out-of-memory error, with cupool's message."""

        def __init__(self, message: str):
            MemoryError.__init__(self, message)

    # The check: a hooks struct without a stream source fails every allocation; CuPy must
    # raise the error the library sets, not hand out the pointer it returns then.
    check = _Hooks(None, set_error, id(_CheckError), id(_CheckError))
    probe = factory(ctypes.addressof(check), address(malloc), address(free), check)
    try:
        probe.malloc(1)
    except _CheckError:
        pass
    except BaseException:  # noqa: BLE001 - any other outcome: not safe to use
        return None
    else:
        return None
    hooks = _Hooks(stream_fn, set_error, id(OutOfMemoryError), id(AllocationError))
    owner = (hooks, OutOfMemoryError)
    allocator = factory(ctypes.addressof(hooks), address(malloc), address(free), owner)
    return allocator, owner


def enable() -> None:
    """Makes cupool CuPy's device allocator (``cupy.cuda.set_allocator``): the compiled
    one where this CuPy supports it, else the Python one (``mode()`` says which)."""
    global _installed, _mode, _compiled_state
    import cupy  # noqa: PLC0415

    compiled = _compiled_allocator()
    if compiled is not None:
        allocator, owner = compiled
        _compiled_state = (allocator, owner)
        cupy.cuda.set_allocator(allocator.malloc)
        _mode = "compiled"
    else:
        _bind()
        cupy.cuda.set_allocator(allocate)
        _mode = "python"
    _installed = True


def enabled() -> bool:
    return _installed


def mode() -> str | None:
    """``"compiled"`` or ``"python"``: which allocator ``enable()`` installed (None before)."""
    return _mode
