"""Loading ``libcupool.so`` and calling its C API through ctypes.

Every C function returns a ``cupool_status``; :func:`check` turns a status other than
``CUPOOL_OK`` into a :class:`CupoolError` (an :class:`OutOfMemoryError` for
``CUPOOL_ERROR_OUT_OF_MEMORY``), with the library's own text. The library is found, in
order, at ``$CUPOOL_LIBRARY`` (a path, for working against a build tree) and beside this
file (where the wheel puts it).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading

# cupool_status values that the package handles by name (include/cupool.h).
OK = 0
ERROR_INVALID_VALUE = 1
ERROR_OUT_OF_MEMORY = 2
ERROR_BACKEND_UNAVAILABLE = 3
ERROR_INVALID_POINTER = 4
ERROR_DOUBLE_FREE = 5
ERROR_INVALID_DEVICE = 6
ERROR_BUFFER_TOO_SMALL = 11


class CupoolError(RuntimeError):
    """A cupool call failed; ``status`` is the ``cupool_status`` value."""

    def __init__(self, status: int, what: str):
        self.status = status
        super().__init__(f"{what}: {status_string(status)}")


class OutOfMemoryError(CupoolError, MemoryError):
    """The pool could not provide the memory, after releasing idle cache and retrying."""


_VOIDP = ctypes.c_void_p
_SIZE = ctypes.c_size_t
_INT = ctypes.c_int
_CHARP = ctypes.c_char_p
_STATUS = ctypes.c_int

# name: (restype, argtypes). Streams are passed as integers (c_void_p), as CUDA libraries
# in Python hand them out (`torch.cuda.Stream.cuda_stream`, `cupy.cuda.Stream.ptr`).
_PROTOTYPES = {
    "cupool_alloc": (_STATUS, [ctypes.POINTER(_VOIDP), _SIZE]),
    "cupool_alloc_async": (_STATUS, [ctypes.POINTER(_VOIDP), _SIZE, _VOIDP]),
    "cupool_alloc_async_device": (_STATUS, [ctypes.POINTER(_VOIDP), _SIZE, _INT, _VOIDP]),
    "cupool_free": (_STATUS, [_VOIDP]),
    "cupool_free_async": (_STATUS, [_VOIDP, _VOIDP]),
    "cupool_stats_json": (_STATUS, [_INT, _CHARP, _SIZE, ctypes.POINTER(_SIZE)]),
    "cupool_segments_json": (_STATUS, [_INT, _CHARP, _SIZE, ctypes.POINTER(_SIZE)]),
    "cupool_footprint_json": (_STATUS, [_INT, _CHARP, _SIZE, ctypes.POINTER(_SIZE)]),
    "cupool_reset_peak_stats": (_STATUS, [_INT]),
    "cupool_empty_cache": (_STATUS, [ctypes.POINTER(_SIZE)]),
    "cupool_empty_cache_device": (_STATUS, [_INT, ctypes.POINTER(_SIZE)]),
    "cupool_set_memory_limit": (_STATUS, [_INT, _SIZE]),
    "cupool_get_memory_limit": (_STATUS, [_INT, ctypes.POINTER(_SIZE)]),
    "cupool_reserve": (_STATUS, [_INT, _SIZE, ctypes.POINTER(_SIZE)]),
    "cupool_mem_get_info": (_STATUS, [_INT, ctypes.POINTER(_SIZE), ctypes.POINTER(_SIZE)]),
    "cupool_segment_of": (_STATUS, [_VOIDP, ctypes.POINTER(_VOIDP), ctypes.POINTER(_SIZE)]),
    "cupool_config_set": (_STATUS, [_CHARP, _CHARP]),
    "cupool_config_get": (_STATUS, [_CHARP, _CHARP, _SIZE, ctypes.POINTER(_SIZE)]),
    "cupool_trace_start": (_STATUS, [_CHARP]),
    "cupool_trace_stop": (_STATUS, []),
    "cupool_status_string": (_CHARP, [_INT]),
    "cupool_version": (_CHARP, []),
    "cupool_interposition_active": (_INT, []),
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_path: str | None = None


def library_path() -> str:
    """The path of the ``libcupool`` shared library this package uses."""
    explicit = os.environ.get("CUPOOL_LIBRARY")
    if explicit:
        if not os.path.isfile(explicit):
            raise OSError(f"CUPOOL_LIBRARY={explicit} is not a file")
        return explicit
    here = pathlib.Path(__file__).resolve().parent
    # setuptools-rust names the bundled library libcupool.abi3.so (or with the
    # interpreter's extension suffix); any libcupool*.so beside this file will do.
    candidates = sorted(here.glob("libcupool*.so")) + sorted(here.glob("libcupool*.dylib"))
    if not candidates:
        raise OSError(
            f"no libcupool shared library in {here}: install the package with "
            "`pip install ./python` (it builds the library with cargo), or set "
            "CUPOOL_LIBRARY to the path of a libcupool.so"
        )
    return str(candidates[0])


def lib() -> ctypes.CDLL:
    """The loaded library, with prototypes set (loaded once per process)."""
    global _library, _path
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            path = library_path()
            loaded = ctypes.CDLL(path)
            for name, (restype, argtypes) in _PROTOTYPES.items():
                fn = getattr(loaded, name)
                fn.restype = restype
                fn.argtypes = argtypes
            _path = path
            _library = loaded
    return _library


def loaded_path() -> str:
    """The path the library was loaded from (loads it if needed)."""
    lib()
    assert _path is not None
    return _path


def status_string(status: int) -> str:
    return lib().cupool_status_string(status).decode()


def check(status: int, what: str) -> None:
    """Raises for a status other than ``CUPOOL_OK``."""
    if status == OK:
        return
    if status == ERROR_OUT_OF_MEMORY:
        raise OutOfMemoryError(status, what)
    raise CupoolError(status, what)


def text_out(fn, *args, what: str) -> str:
    """Calls a ``(..., buf, buf_len, &needed)`` function and returns its text, growing the
    buffer while the library says it is too small (the text can grow between calls)."""
    needed = _SIZE(0)
    status = fn(*args, None, 0, ctypes.byref(needed))
    if status not in (OK, ERROR_BUFFER_TOO_SMALL):
        check(status, what)
    size = max(needed.value, 64)
    for _ in range(8):
        buf = ctypes.create_string_buffer(size)
        status = fn(*args, buf, size, ctypes.byref(needed))
        if status == OK:
            return buf.value.decode()
        if status != ERROR_BUFFER_TOO_SMALL:
            check(status, what)
        size = max(needed.value, size) * 2
    raise CupoolError(ERROR_BUFFER_TOO_SMALL, what)


def function_address(name: str) -> int:
    """The address of an exported C function, as PyTorch's allocator setters take it."""
    return ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value
