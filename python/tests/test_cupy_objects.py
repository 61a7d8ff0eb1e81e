"""The direct CuPy allocator (Note [CuPy's objects built in place] in
``src/ffi/cupy_objects.rs``) against CuPy's real compiled types, on the host backend: CuPy
imports without a GPU, and these tests call the allocator themselves instead of
``cupy.empty`` (which needs a device). Skipped where CuPy is not installed; ``.ci/run``
installs it."""

import ctypes
import gc
import sys

import pytest

import cupool

memory = pytest.importorskip("cupy.cuda.memory", reason="needs CuPy (pip install cupy-cuda13x)")

import cupool.cupy as cc  # noqa: E402

STREAM = 0x8000
_STREAM_FN = ctypes.PYFUNCTYPE(ctypes.c_ssize_t)(lambda: STREAM)
_DEVICE_FN = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda skip_dispatch: 0)


class OutOfMemory(memory.OutOfMemoryError):
    def __init__(self, message):
        MemoryError.__init__(self, message)


def address(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


# Every direct allocator made here, with what it refers to, kept for the whole process: a
# builtin function object points into its method definition for as long as it lives.
_KEEP = []


@pytest.fixture
def direct():
    """The direct allocator over the host backend, CuPy's current stream and device stood
    in for by two functions; uninstalled afterwards."""
    set_error = address(ctypes.pythonapi.PyErr_SetString)
    hooks = cc._Hooks(address(_STREAM_FN), set_error, id(OutOfMemory), id(cc.AllocationError))
    made = cc._direct_allocator(memory, hooks, address(_DEVICE_FN))
    assert made is not None, "the layout check or the round trip failed"
    _KEEP.append(made)
    yield made[0]
    cupool._lib.lib().cupool_cupy_objects_install(None)


def test_layout_is_found_in_cupys_own_objects():
    layout = cc._objects_layout(memory)
    assert layout is not None
    assert set(layout["memory"]) == {"ptr", "size", "device", "param", "free"}
    assert set(layout["pointer"]) == {"ptr", "device", "mem"}
    offsets = list(layout["memory"].values())
    assert len(set(offsets)) == len(offsets) and min(offsets) >= 16


def test_direct_allocator_builds_cupys_objects_and_frees_into_the_pool(direct):
    before = cupool.stats(0)
    mp = direct(10_000)
    assert type(mp) is memory.MemoryPointer
    assert type(mp.mem) is memory.CFunctionAllocatorMemory
    assert mp.ptr != 0 and mp.mem.ptr == mp.ptr
    assert mp.mem.size == 10_000 and mp.device_id == 0 and mp.mem.device_id == 0
    ordinary = memory.MemoryPointer(memory.CFunctionAllocatorMemory(0, 0, 0, 0, 0), 0)
    assert sys.getrefcount(mp.mem) == sys.getrefcount(ordinary.mem), "held once, by the pointer"
    block = next(b for s in cupool.snapshot(0)["segments"] for b in s["blocks"]
                 if b["address"] == mp.ptr)
    assert block["stream"] == STREAM and block["state"] == "active_allocated"
    first = mp.ptr
    held = cupool.stats(0)["requested_bytes.all.current"]
    assert held == before["requested_bytes.all.current"] + 10_000
    del mp
    gc.collect()
    after = cupool.stats(0)
    assert after["requested_bytes.all.current"] == before["requested_bytes.all.current"]
    assert after["cupool.num_frees"] == before["cupool.num_frees"] + 1
    # Freed on its stream: that stream's next request takes it back at once.
    again = direct(10_000)
    assert again.ptr == first
    del again


def test_direct_allocator_of_zero_bytes_allocates_nothing(direct):
    before = cupool.stats(0)["cupool.num_allocs"]
    empty = direct(0)
    assert empty.ptr == 0 and empty.mem.size == 0
    del empty
    assert cupool.stats(0)["cupool.num_allocs"] == before


def test_direct_allocator_raises_cupys_out_of_memory_and_goes_on(direct):
    cupool.empty_cache()
    cupool.set_memory_limit(1, device=0)
    try:
        with pytest.raises(memory.OutOfMemoryError) as e:
            direct(200 << 20)
        assert "209715200 bytes" in str(e.value) and "cupool" in str(e.value)
    finally:
        cupool.set_memory_limit(0, device=0)
    assert direct(1 << 20).ptr != 0, "usable after the error"


@pytest.mark.parametrize("bad, error", [(-1, OverflowError), ("4096", TypeError)])
def test_direct_allocator_rejects_what_is_not_a_size(direct, bad, error):
    with pytest.raises(error):
        direct(bad)


def test_no_direct_allocator_where_the_layout_cannot_be_checked(monkeypatch):
    monkeypatch.setattr(cc, "_field_offsets", lambda *args: None)
    set_error = address(ctypes.pythonapi.PyErr_SetString)
    hooks = cc._Hooks(address(_STREAM_FN), set_error, id(OutOfMemory), id(cc.AllocationError))
    assert cc._direct_allocator(memory, hooks, address(_DEVICE_FN)) is None


def test_install_refuses_an_incomplete_description():
    lib = cupool._lib.lib()
    lib.cupool_cupy_objects_install.argtypes = [ctypes.c_void_p]
    empty = cc._Objects()
    assert lib.cupool_cupy_objects_install(ctypes.addressof(empty)) == cupool._lib.ERROR_INVALID_VALUE
