"""``cupool.cupy.enable()`` against a stand-in for the few CuPy names it uses
(``cuda.set_allocator``, ``cuda.get_current_stream``, ``cuda.Device``,
``cuda.memory.UnownedMemory/MemoryPointer/OutOfMemoryError``): allocations come from the
pool on CuPy's current stream and device, and go back when CuPy drops the memory."""

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
