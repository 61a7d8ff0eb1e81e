"""``cupool.cupy.enable()`` against a stand-in for the few CuPy names it uses
(``cuda.set_allocator``, ``cuda.get_current_stream``, ``cuda.Device``,
``cuda.memory.UnownedMemory/MemoryPointer/OutOfMemoryError``): allocations come from the
pool on CuPy's current stream and device, and go back when CuPy drops the memory."""

import ctypes
import gc
import sys
import types

import pytest

import cupool

STREAM = 0x8000


class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset


class OutOfMemoryError(MemoryError):
    def __init__(self, size, total, limit=0):
        super().__init__(f"Out of memory allocating {size:,} bytes (total {total:,} bytes)")
        self.size, self.total = size, total


class CFunctionAllocator:
    """CuPy's C-function allocator as its compiled code runs it: the C functions are called
    with the GIL held, and an exception they set is raised (CuPy 14 checks on -1)."""

    _malloc_t = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _free_t = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)

    def __init__(self, param, malloc_func, free_func, owner):
        self.param, self.owner = param, owner
        self._malloc = self._malloc_t(malloc_func)
        self._free = self._free_t(free_func)

    def malloc(self, size):
        alloc = self

        class Memory:
            def __init__(self):
                self.size, self.device_id, self.ptr = size, 0, 0
                self.ptr = alloc._malloc(alloc.param, size, 0) if size else 0

            def __del__(self):
                if self.ptr:
                    alloc._free(alloc.param, self.ptr, 0)

        return MemoryPointer(Memory(), 0)


# CuPy's Cython module exports its C functions as capsules named by their signature.
_STREAM_FN = ctypes.CFUNCTYPE(ctypes.c_ssize_t)(lambda: STREAM)
_SIGNATURE = b"intptr_t (void)"


def stream_capsule(signature=_SIGNATURE):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.cast(_STREAM_FN, ctypes.c_void_p).value, signature, None)


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    memory = types.ModuleType("cupy.cuda.memory")
    memory.UnownedMemory, memory.MemoryPointer = UnownedMemory, MemoryPointer
    memory.OutOfMemoryError = OutOfMemoryError
    cuda.memory = memory
    cuda.allocator = None
    cuda.set_allocator = lambda fn: setattr(cuda, "allocator", fn)
    cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=STREAM)
    cuda.Device = lambda: types.SimpleNamespace(id=0)
    cupy.cuda = cuda
    cuda.stream = types.ModuleType("cupy.cuda.stream")
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.memory", memory)
    return cupy


def test_cupy_allocations_come_from_the_pool(fake_cupy):
    import cupool.cupy

    cupool.cupy.enable()
    assert cupool.cupy.enabled()
    allocate = fake_cupy.cuda.allocator
    before = cupool.stats(0)
    mp = allocate(10_000)
    during = cupool.stats(0)
    assert during["requested_bytes.all.current"] == before["requested_bytes.all.current"] + 10_000
    assert mp.mem.size == 10_000 and mp.mem.device_id == 0
    seg = cupool.snapshot(0)["segments"]
    block = next(b for s in seg for b in s["blocks"] if b["address"] == mp.ptr)
    assert block["stream"] == STREAM, "stream-ordered on CuPy's current stream"
    del mp, block, seg
    gc.collect()
    after = cupool.stats(0)
    assert after["requested_bytes.all.current"] == before["requested_bytes.all.current"]
    assert after["cupool.num_frees"] == before["cupool.num_frees"] + 1

    empty = allocate(0)
    assert empty.ptr == 0 and cupool.stats(0)["cupool.num_allocs"] == after["cupool.num_allocs"]


def test_cupy_out_of_memory_is_cupys_error(fake_cupy):
    import cupool.cupy

    cupool.empty_cache()
    cupool.set_memory_limit(1, device=0)
    try:
        with pytest.raises(OutOfMemoryError) as e:
            cupool.cupy.allocate(200 << 20)
        assert e.value.size == 200 << 20 and e.value.total == cupool.mem_get_info(0)[1]
    finally:
        cupool.set_memory_limit(0, device=0)


@pytest.fixture
def compiled_cupy(fake_cupy, monkeypatch):
    """The fake CuPy with what the compiled allocator needs."""
    fake_cupy.cuda.memory.CFunctionAllocator = CFunctionAllocator
    fake_cupy.cuda.stream.__pyx_capi__ = {"get_current_stream_ptr": stream_capsule()}
    return fake_cupy


def test_compiled_allocator_takes_cupys_stream_and_frees_on_it(compiled_cupy):
    import cupool.cupy

    cupool.cupy.enable()
    assert cupool.cupy.mode() == "compiled"
    before = cupool.stats(0)
    mp = compiled_cupy.cuda.allocator(10_000)
    assert mp.ptr != 0 and mp.ptr != 2**64 - 1
    block = next(b for s in cupool.snapshot(0)["segments"] for b in s["blocks"]
                 if b["address"] == mp.ptr)
    assert block["stream"] == STREAM and block["state"] == "active_allocated"
    first = mp.ptr
    del mp
    gc.collect()
    after = cupool.stats(0)
    assert after["requested_bytes.all.current"] == before["requested_bytes.all.current"]
    assert after["cupool.num_frees"] == before["cupool.num_frees"] + 1
    # Freed on its stream: that stream's next request of the size takes it back at once
    # (a streamless free would wait for a fence first).
    again = compiled_cupy.cuda.allocator(10_000)
    assert again.ptr == first
    assert cupool.stats(0)["cupool.fences_recorded"] == after["cupool.fences_recorded"]
    del again


def test_compiled_allocator_raises_cupys_out_of_memory(compiled_cupy):
    import cupool.cupy

    cupool.cupy.enable()
    cupool.empty_cache()
    cupool.set_memory_limit(1, device=0)
    try:
        with pytest.raises(OutOfMemoryError) as e:
            compiled_cupy.cuda.allocator(200 << 20)
        assert "209715200 bytes" in str(e.value) and "cupool" in str(e.value)
    finally:
        cupool.set_memory_limit(0, device=0)
    assert compiled_cupy.cuda.allocator(1 << 20).ptr != 0, "usable after the error"


@pytest.mark.parametrize("capi", [{}, {"get_current_stream_ptr": "other"}, "signature"])
def test_python_allocator_where_cupy_lacks_what_the_compiled_one_needs(compiled_cupy, capi):
    import cupool.cupy

    if capi == "signature":
        capi = {"get_current_stream_ptr": stream_capsule(b"PyObject *(int)")}
    compiled_cupy.cuda.stream.__pyx_capi__ = capi
    cupool.cupy.enable()
    assert cupool.cupy.mode() == "python"
    assert compiled_cupy.cuda.allocator(4096).ptr != 0
