"""The package's API over the C library, on the host backend: figures are read before and
after each step and compared, never against fixed values."""

import csv
import ctypes

import pytest

import cupool
from cupool import _lib

STREAM = 0x5000  # any integer is a stream on the host backend


def test_the_package_loads_its_own_library():
    path = cupool.library_path()
    assert "libcupool" in path
    assert cupool.version().count(".") == 2
    assert cupool.config_get("backend") == "host"
    assert cupool.device_count() >= 1
    assert cupool.interposition_active() is False


def test_stats_follow_allocations_and_frees():
    before = cupool.stats(0)
    ptr = cupool.alloc(1000, stream=STREAM)
    during = cupool.stats(0)
    assert during["allocated_bytes.all.current"] - before["allocated_bytes.all.current"] >= 1000
    assert during["requested_bytes.all.current"] - before["requested_bytes.all.current"] == 1000
    assert during["allocation.all.current"] == before["allocation.all.current"] + 1
    assert during["allocation.all.allocated"] == before["allocation.all.allocated"] + 1
    assert during["cupool.num_allocs"] == before["cupool.num_allocs"] + 1
    assert during["allocated_bytes.all.peak"] >= during["allocated_bytes.all.current"]
    assert during["reserved_bytes.all.current"] >= during["allocated_bytes.all.current"]
    assert during["active_bytes.all.current"] == during["allocated_bytes.all.current"]
    cupool.free(ptr, stream=STREAM)
    after = cupool.stats(0)
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["requested_bytes.all.current"] == before["requested_bytes.all.current"]
    assert after["allocation.all.freed"] == before["allocation.all.freed"] + 1
    # Every field of cupool's statistics is there under its own name.
    raw = cupool._stats.raw_stats(0)
    for field, value in raw.items():
        if isinstance(value, dict):
            assert after[f"cupool.{field}.current"] == value["current"], field
        elif field not in ("size", "version"):
            assert after[f"cupool.{field}"] == value, field
    total = cupool.stats()
    assert total["cupool.num_allocs"] >= after["cupool.num_allocs"]


def test_a_device_can_be_named():
    if cupool.device_count() < 2:
        pytest.skip("one device")
    before = cupool.stats(1)["allocated_bytes.all.current"]
    ptr = cupool.alloc(4096, stream=STREAM, device=1)
    assert cupool.stats(1)["allocated_bytes.all.current"] == before + 4096
    cupool.free(ptr, stream=STREAM)
    assert cupool.stats(1)["allocated_bytes.all.current"] == before


def test_peaks_reset_to_current():
    ptr = cupool.alloc(8 << 20, stream=STREAM)
    cupool.free(ptr, stream=STREAM)
    s = cupool.stats(0)
    assert s["allocated_bytes.all.peak"] > s["allocated_bytes.all.current"]
    cupool.reset_peak_stats(0)
    s = cupool.stats(0)
    assert s["allocated_bytes.all.peak"] == s["allocated_bytes.all.current"]


def test_footprint_says_where_the_peak_was():
    cupool.reset_peak_stats(0)
    ptr = cupool.alloc(40 << 20, stream=STREAM)
    [dev] = cupool.footprint(0)
    assert dev["device"] == 0
    peak = dev["at_peak"]
    assert peak is not None, "the pool grew after the reset"
    assert peak["in_use_bytes"] >= 40 << 20
    places = [k for k in peak if k.endswith("_bytes") and k != "reserved_bytes"]
    assert sum(peak[k] for k in places) == peak["reserved_bytes"]
    assert peak["reserved_bytes"] == cupool.stats(0)["reserved_bytes.all.peak"]
    cupool.free(ptr, stream=STREAM)
    [dev] = cupool.footprint(0)
    assert dev["now"]["in_use_bytes"] == peak["in_use_bytes"] - (40 << 20)
    assert dev["at_peak"] == peak, "the free leaves the peak's footprint as it was"
    # The fence calls' estimated time (Note [fence call times]): each kind timed and counted.
    for kind in ("record", "query", "device_wait"):
        assert isinstance(dev["fences"][f"{kind}_ns"], int)
        assert isinstance(dev["fences"][f"{kind}_sampled"], int)
    assert [d["device"] for d in cupool.footprint()] == list(range(len(cupool.footprint())))


def test_empty_cache_gives_idle_segments_back():
    ptr = cupool.alloc(30 << 20, stream=STREAM)
    cupool.free(ptr, stream=STREAM)
    reserved = cupool.stats()["reserved_bytes.all.current"]  # every device: empty_cache's
    released = cupool.empty_cache()
    assert released >= 30 << 20
    assert cupool.stats()["reserved_bytes.all.current"] == reserved - released
    assert cupool.stats(0)["num_device_free"] >= 1
    # One device at a time: nothing idle is left on device 0 now.
    assert cupool.empty_cache(0) == 0


def test_memory_limit_gives_out_of_memory():
    cupool.empty_cache()
    before = cupool.stats(0)
    cupool.set_memory_limit(4 << 20, device=0)
    try:
        assert cupool.get_memory_limit(0) == 4 << 20
        with pytest.raises(cupool.OutOfMemoryError) as e:
            cupool.alloc(64 << 20, stream=STREAM)
        assert isinstance(e.value, MemoryError)
        assert "out of memory" in str(e.value)
    finally:
        cupool.set_memory_limit(0, device=0)
    after = cupool.stats(0)
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert after["num_alloc_retries"] >= before["num_alloc_retries"] + 1
    ptr = cupool.alloc(64 << 20, stream=STREAM)
    cupool.free(ptr, stream=STREAM)


def test_reserve_is_taken_now_and_kept_by_empty_cache():
    cupool.empty_cache()
    assert cupool.reserve(16 << 20, device=0) == 16 << 20
    cupool.empty_cache()
    assert cupool.stats(0)["reserved_bytes.all.current"] == 16 << 20
    cupool.set_memory_limit(8 << 20, device=0)
    try:
        with pytest.raises(cupool.OutOfMemoryError):
            cupool.reserve(32 << 20, device=0)
    finally:
        cupool.set_memory_limit(0, device=0)
    with pytest.raises(ValueError):
        cupool.reserve(-1)
    assert cupool.reserve(0, device=0) == 0
    cupool.empty_cache()
    assert cupool.stats(0)["reserved_bytes.all.current"] == 0


def test_memory_summary_shows_the_numbers():
    cupool.empty_cache()
    ptr = cupool.alloc(3 << 20, stream=STREAM)
    s = cupool.stats(0)
    text = cupool.memory_summary(0)
    lines = text.splitlines()
    assert all(len(line) == 77 for line in lines), "PyTorch's 75-column box"
    assert "device ID 0" in lines[1]
    assert f"CUDA OOMs: {s['num_ooms']}" in text
    allocated = next(line for line in lines if line.startswith("| Allocated memory"))
    assert f"{s['allocated_bytes.all.current'] // 1024} KiB" in allocated
    reserved = next(line for line in lines if line.startswith("| GPU reserved memory"))
    assert f"{s['reserved_bytes.all.current'] // 1024} KiB" in reserved
    allocs = next(line for line in lines if line.startswith("| Allocations"))
    assert str(s["allocation.all.allocated"]) in allocs
    # Where the reserved bytes are, now and at the peak (cupool.footprint).
    [dev] = cupool.footprint(0)
    in_use = next(line for line in lines if line.startswith("| In use"))
    cells = [c.strip() for c in in_use.split("|")]
    assert cells[2] == f"{dev['now']['in_use_bytes'] // 1024} KiB"
    assert cells[3] == f"{dev['at_peak']['in_use_bytes'] // 1024} KiB"
    cupool.free(ptr, stream=STREAM)


def test_config_round_trip_and_errors():
    old = cupool.config_get("fence_batch")
    cupool.config_set("fence_batch", 17)
    assert cupool.config_get("fence_batch") == "17"
    cupool.config_set("fence_batch", old)
    cupool.config_set("thread_cache", False)
    assert cupool.config_get("thread_cache") == "false"
    cupool.config_set("thread_cache", True)
    with pytest.raises(cupool.CupoolError) as e:
        cupool.config_set("no_such_key", 1)
    assert e.value.status == 7
    with pytest.raises(cupool.CupoolError):
        cupool.config_set("fence_batch", "lots")
    with pytest.raises(cupool.CupoolError):
        cupool.free(0x1234, stream=STREAM)


def test_trace_records_the_calls(tmp_path):
    path = tmp_path / "trace.csv"
    cupool.trace_start(str(path))
    ptr = cupool.alloc(7000, stream=STREAM)
    cupool.free(ptr, stream=STREAM)
    cupool.trace_stop()
    rows = list(csv.DictReader(path.open()))
    mine = [r for r in rows if int(r["Pointer"], 16) == ptr]
    assert [r["Action"] for r in mine] == ["allocate", "free"]
    assert mine[0]["Size"] == "7000"
    assert int(mine[0]["Stream"], 16) == STREAM


# PyTorch calls the hooks through these C types (torch/csrc/cuda/CUDAPluggableAllocator.h).
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
RECORD_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
BASE_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))
FRACTION_FN = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)


def hook(fn_type, name):
    return fn_type(_lib.function_address(name))


def test_torch_hooks_called_through_their_addresses():
    alloc = hook(ALLOC_FN, "cupool_torch_alloc")
    free = hook(FREE_FN, "cupool_torch_free")
    before = cupool.stats(0)
    ptr = alloc(5000, 0, STREAM)
    assert ptr
    assert cupool.stats(0)["requested_bytes.all.current"] == before["requested_bytes.all.current"] + 5000
    size = ctypes.c_size_t(0)
    base = hook(BASE_FN, "cupool_torch_base_allocation")(ptr, ctypes.byref(size))
    assert base <= ptr < base + size.value
    seg = next(s for s in cupool.snapshot(0)["segments"] if s["address"] == base)
    assert seg["total_size"] == size.value
    hook(RECORD_FN, "cupool_torch_record_stream")(ptr, STREAM + 1)
    free(ptr, 5000, 0, STREAM)
    assert cupool.stats(0)["requested_bytes.all.current"] == before["requested_bytes.all.current"]
    assert alloc(0, 0, STREAM) is None, "empty tensors get NULL"

    _, total = cupool.mem_get_info(0)
    fraction = hook(FRACTION_FN, "cupool_torch_set_memory_fraction")
    try:
        fraction(0.25, 0)
        assert cupool.get_memory_limit(0) == int(total * 0.25)
        fraction(0.0, 0)
        assert alloc(64 << 20, 0, STREAM) is None, "out of memory is NULL"
    finally:
        cupool.set_memory_limit(0, device=0)
