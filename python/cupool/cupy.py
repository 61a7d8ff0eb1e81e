"""CuPy on cupool: ``cupool.cupy.enable()``.

Installs an allocator with ``cupy.cuda.set_allocator`` that takes every device allocation
from cupool, stream-ordered on CuPy's current stream and device; the memory goes back to
the pool, on the same stream, when CuPy drops its last reference. CuPy's pinned host
memory pool is left alone.

Three allocators, the first that works:
- **direct** (``cupool_cupy_alloc``, a CPython builtin function CuPy calls as its
  allocator): it builds CuPy's ``MemoryPointer`` and ``CFunctionAllocatorMemory`` itself,
  the way CuPy's own pool builds its objects, without a Python-level constructor (Note
  [CuPy's objects built in place] in ``src/ffi/cupy_objects.rs``). Where the objects'
  layout cannot be checked (see ``_objects_layout``), the next one.
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


def _address(fn: Any) -> int:
    """The address of a ctypes function (a C function of a library, or a callback)."""
    return ctypes.cast(fn, ctypes.c_void_p).value


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
# Every direct allocator ever installed, with its method definition and the structures the
# library reads: a builtin function object points into its method definition for as long as
# it lives (CuPy, or the program, may still hold one after a later enable()).
_direct_states: list = []


class AllocationError(RuntimeError):
    """A cupool allocation for CuPy failed for a reason other than out of memory."""


class _CheckError(RuntimeError):
    """Raised through the compiled allocator once, by ``enable()``'s check."""


def _capsule_pointer(capsule: Any, signature: bytes = _STREAM_FN_SIGNATURE) -> int | None:
    """The C function in one of a Cython module's ``__pyx_capi__`` capsules, if it has
    ``signature``."""
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    try:
        name = api.PyCapsule_GetName(capsule)
        if name != signature:
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
    set_error = _address(ctypes.pythonapi.PyErr_SetString)

    class OutOfMemoryError(memory.OutOfMemoryError):
        """CuPy's out-of-memory error, with cupool's message."""

        def __init__(self, message: str):
            MemoryError.__init__(self, message)

    # The check: a hooks struct without a stream source fails every allocation; CuPy must
    # raise the error the library sets, not hand out the pointer it returns then.
    check = _Hooks(None, set_error, id(_CheckError), id(_CheckError))
    probe = factory(ctypes.addressof(check), _address(malloc), _address(free), check)
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
    allocator = factory(ctypes.addressof(hooks), _address(malloc), _address(free), owner)
    return allocator, owner


class _Objects(ctypes.Structure):
    """``cupool_cupy_objects`` (include/cupool.h)."""

    _fields_ = [
        ("hooks", ctypes.c_void_p),
        ("device_id", ctypes.c_void_p),
        ("as_size", ctypes.c_void_p),
        ("error_occurred", ctypes.c_void_p),
        ("dec_ref", ctypes.c_void_p),
        ("no_args", ctypes.c_void_p),
        ("memory_type", ctypes.c_void_p),
        ("memory_new", ctypes.c_void_p),
        ("memory_ptr", ctypes.c_size_t),
        ("memory_size", ctypes.c_size_t),
        ("memory_device", ctypes.c_size_t),
        ("memory_param", ctypes.c_size_t),
        ("memory_free", ctypes.c_size_t),
        ("pointer_type", ctypes.c_void_p),
        ("pointer_new", ctypes.c_void_p),
        ("pointer_ptr", ctypes.c_size_t),
        ("pointer_device", ctypes.c_size_t),
        ("pointer_mem", ctypes.c_size_t),
    ]


class _MethodDef(ctypes.Structure):
    """CPython's ``PyMethodDef``."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("meth", ctypes.c_void_p),
        ("flags", ctypes.c_int),
        ("doc", ctypes.c_char_p),
    ]


_PY_TP_NEW = 65  # Py_tp_new (CPython's typeslots.h)
_METH_O = 0x0008
_DEVICE_FN_SIGNATURE = b"int (int __pyx_skip_dispatch)"
_NO_ARGS = ()
# Marker values written by the ordinary constructors, then looked for in the objects.
_PTR_MARK, _SIZE_MARK, _PARAM_MARK, _DEVICE_MARK = (
    0x5EED_C0DE_0001_2340, 0x1234_5678_9ABC, 0x7A7A_1234_5678, 0x3A5)


def _field_offsets(obj: Any, bare: Any, marks: dict[str, tuple[int, int]]) -> dict | None:
    """The byte offset of each mark (name -> (value, width)) in ``obj``: each found exactly
    once, past CPython's object header, whose type word must be ``obj``'s type; and ``obj``
    must not differ from ``bare`` (the type's ``tp_new`` alone) anywhere else."""
    size = type(obj).__basicsize__
    raw, plain = ctypes.string_at(id(obj), size), ctypes.string_at(id(bare), size)
    if raw[8:16] != id(type(obj)).to_bytes(8, "little"):
        return None
    found: dict[str, int] = {}
    written: set[int] = set()
    for name, (value, width) in marks.items():
        pattern = value.to_bytes(width, "little")
        hits = [o for o in range(16, size - width + 1, width) if raw[o:o + width] == pattern]
        if len(hits) != 1:
            return None
        found[name] = hits[0]
        written.update(range(hits[0], hits[0] + width))
    if any(raw[o] != plain[o] for o in range(16, size) if o not in written):
        return None
    return found


def _objects_layout(memory: Any) -> dict | None:
    """Where ``CFunctionAllocatorMemory`` and ``MemoryPointer`` keep the fields the direct
    allocator writes, found by building one of each the ordinary way with marker values
    (Note [CuPy's objects built in place]); None where that cannot be told safely: not
    CPython with the GIL and the usual object header, or any mark not found exactly once."""
    import sys  # noqa: PLC0415

    if sys.implementation.name != "cpython" or hasattr(sys, "gettotalrefcount"):
        return None
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None
    memory_cls = getattr(memory, "CFunctionAllocatorMemory", None)
    pointer_cls = getattr(memory, "MemoryPointer", None)
    if memory_cls is None or pointer_cls is None:
        return None
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(
        lambda param, size, device: _PTR_MARK)
    freed = []
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(
        lambda param, ptr, device: freed.append(ptr))
    try:
        mem = memory_cls(_SIZE_MARK, _PARAM_MARK, _address(malloc), _address(free), _DEVICE_MARK)
        pointer = pointer_cls(mem, 0)
        layout_mem = _field_offsets(mem, memory_cls.__new__(memory_cls), {
            "ptr": (_PTR_MARK, 8), "size": (_SIZE_MARK, 8), "device": (_DEVICE_MARK, 4),
            "param": (_PARAM_MARK, 8), "free": (_address(free), 8)})
        layout_pointer = _field_offsets(pointer, pointer_cls.__new__(pointer_cls), {
            "ptr": (_PTR_MARK, 8), "device": (_DEVICE_MARK, 4), "mem": (id(mem), 8)})
        del pointer, mem
    except Exception:  # noqa: BLE001 - any surprise: not this allocator
        return None
    if layout_mem is None or layout_pointer is None or freed != [_PTR_MARK]:
        return None
    return {"memory": layout_mem, "pointer": layout_pointer}


def _type_new(cls: Any) -> int | None:
    """The type's ``tp_new`` (``PyType_GetSlot``; CPython 3.10 and later for static types)."""
    get_slot = ctypes.pythonapi.PyType_GetSlot
    get_slot.restype = ctypes.c_void_p
    get_slot.argtypes = [ctypes.py_object, ctypes.c_int]
    try:
        return get_slot(cls, _PY_TP_NEW) or None
    except (SystemError, TypeError):
        return None


def _direct_allocator(memory: Any, hooks: "_Hooks", device_fn: int) -> Any:
    """``cupool_cupy_alloc`` as a builtin function over CuPy's own objects, with what it
    refers to, or None where the layout is not as checked or the round trip fails.
    ``device_fn``: the address of an ``int (int)`` giving CuPy's current device."""
    lib = _lib.lib()
    alloc = getattr(lib, "cupool_cupy_alloc", None)
    install = getattr(lib, "cupool_cupy_objects_install", None)
    layout = _objects_layout(memory)
    memory_new = _type_new(getattr(memory, "CFunctionAllocatorMemory", None))
    pointer_new = _type_new(getattr(memory, "MemoryPointer", None))
    if alloc is None or install is None or layout is None or not memory_new or not pointer_new:
        return None
    api = ctypes.pythonapi
    m, p = layout["memory"], layout["pointer"]
    objects = _Objects(
        ctypes.addressof(hooks), device_fn, _address(api.PyLong_AsSize_t),
        _address(api.PyErr_Occurred), _address(api.Py_DecRef), id(_NO_ARGS),
        id(memory.CFunctionAllocatorMemory), memory_new,
        m["ptr"], m["size"], m["device"], m["param"], m["free"],
        id(memory.MemoryPointer), pointer_new, p["ptr"], p["device"], p["mem"])
    install.restype = ctypes.c_int
    install.argtypes = [ctypes.c_void_p]
    method = _MethodDef(b"cupool_cupy_alloc", _address(alloc), _METH_O, None)
    new_function = api.PyCFunction_NewEx
    new_function.restype = ctypes.py_object
    new_function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    if install(ctypes.byref(objects)) != _lib.OK:
        return None
    function = new_function(ctypes.addressof(method), None, None)
    if not _round_trip(memory, function):
        install(None)
        return None
    return function, (objects, method, hooks)


def _round_trip(memory: Any, function: Any) -> bool:
    """One allocation of 4 KiB and one of 0 bytes through the direct allocator: CuPy's own
    types with the fields as asked, and the block back in the pool once dropped."""
    import gc  # noqa: PLC0415

    try:
        used = _requested_bytes()
        mp = function(4096)
        ok = (type(mp) is memory.MemoryPointer
              and type(mp.mem) is memory.CFunctionAllocatorMemory
              and mp.ptr != 0 and mp.mem.ptr == mp.ptr and mp.mem.size == 4096
              and mp.device_id == mp.mem.device_id)
        del mp
        empty = function(0)
        ok = ok and empty.ptr == 0 and empty.mem.size == 0
        del empty
        gc.collect()
        return ok and _requested_bytes() == used
    except Exception:  # noqa: BLE001 - any surprise: not this allocator
        return False


def _requested_bytes() -> int:
    """Bytes the program holds from the pool on every device (cupool's statistics)."""
    from . import stats  # noqa: PLC0415

    return stats()["requested_bytes.all.current"]


def enable() -> None:
    """Makes cupool CuPy's device allocator (``cupy.cuda.set_allocator``): the direct one
    where this CuPy and CPython allow it, else the compiled one, else the Python one
    (``mode()`` says which)."""
    global _installed, _mode, _compiled_state
    import cupy  # noqa: PLC0415

    compiled = _compiled_allocator()
    direct = None
    if compiled is not None:
        hooks = compiled[1][0]
        device_capsule = (getattr(getattr(cupy.cuda, "device", None), "__pyx_capi__", None)
                          or {}).get("get_device_id")
        device_fn = (_capsule_pointer(device_capsule, _DEVICE_FN_SIGNATURE)
                     if device_capsule is not None else None)
        if device_fn:
            direct = _direct_allocator(cupy.cuda.memory, hooks, device_fn)
    if direct is not None:
        function, state = direct
        _direct_states.append((function, state))
        _compiled_state = (function, state, compiled)
        cupy.cuda.set_allocator(function)
        _mode = "direct"
    elif compiled is not None:
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
    """``"direct"``, ``"compiled"`` or ``"python"``: which allocator ``enable()`` installed
    (None before)."""
    return _mode
