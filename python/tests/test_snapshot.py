"""Snapshots: the pickle loads, has the segments and blocks the pool has (checked against
the pool's statistics and the blocks the test holds), and carries the allocation history
while it is recorded. Where PyTorch is installed, its memory_viz reads the file too."""

import importlib.util
import pickle

import pytest

import cupool

STREAM = 0x6000
SIZES = [1000, 5000, 300_000, 3 << 20, 12 << 20]


@pytest.fixture
def blocks():
    cupool.empty_cache()
    ptrs = [cupool.alloc(size, stream=STREAM) for size in SIZES]
    yield list(zip(ptrs, SIZES))
    for ptr in ptrs:
        try:
            cupool.free(ptr, stream=STREAM)
        except cupool.CupoolError:
            pass  # freed by the test


def all_blocks(snap):
    return {b["address"]: (seg, b) for seg in snap["segments"] for b in seg["blocks"]}


def test_snapshot_has_the_pools_segments_and_blocks(blocks, tmp_path):
    path = tmp_path / "snap.pickle"
    cupool.dump_snapshot(path)
    snap = pickle.loads(path.read_bytes())
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    assert len(snap["device_traces"]) == cupool.device_count()

    s = cupool.stats()
    # The VMM arena (`vmm:on`, the default) counts as one segment in the statistics and
    # shows as its mapped runs, whole granules each (`is_expandable`); idle physical memory
    # it holds has no address and does not show.
    plain = [seg for seg in snap["segments"] if not seg["is_expandable"]]
    runs = [seg for seg in snap["segments"] if seg["is_expandable"]]
    assert runs, "the 3 MiB and 12 MiB blocks come from the arena"
    assert len(plain) + 1 == s["segment.all.current"]
    assert sum(seg["total_size"] for seg in runs) == s["cupool.mapped_bytes.current"]
    shown = sum(seg["total_size"] for seg in snap["segments"])
    assert shown <= s["reserved_bytes.all.current"] < shown + (64 << 20)
    assert (
        sum(seg["allocated_size"] for seg in snap["segments"]) == s["allocated_bytes.all.current"]
    )
    for seg in snap["segments"]:
        # Blocks tile their segment, in address order, as memory_viz assumes.
        at = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == at
            assert b["state"] in ("active_allocated", "inactive")
            assert "frames" in b and "requested_size" in b
            at += b["size"]
        assert at == seg["address"] + seg["total_size"]
        active = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        assert seg["allocated_size"] == active
        assert seg["segment_type"] in ("small", "large")

    found = all_blocks(snap)
    for ptr, size in blocks:
        seg, b = found[ptr]
        assert b["state"] == "active_allocated"
        assert b["requested_size"] == size
        assert b["size"] >= size
        assert b["stream"] == STREAM
        assert seg["device"] == 0
    small_seg, _ = found[blocks[0][0]]
    assert small_seg["segment_type"] == "small"
    assert small_seg["total_size"] == int(cupool.config_get("small_segment"))


def test_a_freed_block_is_inactive(blocks):
    ptr, _ = blocks[2]
    cupool.free(ptr, stream=STREAM)
    _, b = all_blocks(cupool.snapshot())[ptr]
    assert b["state"] == "inactive"
    assert b["requested_size"] == 0


def test_history_is_recorded_into_device_traces(blocks):
    cupool.record_memory_history(True)
    try:
        ptr = cupool.alloc(40 << 20, stream=STREAM)  # a segment of its own
        cupool.free(ptr, stream=STREAM)
        cupool.empty_cache()
        trace = cupool.snapshot()["device_traces"][0]
    finally:
        cupool.record_memory_history(None)
    mine = [e for e in trace if e.get("addr") == ptr]
    actions = [e["action"] for e in mine]
    assert "alloc" in actions and "free_requested" in actions and "free_completed" in actions
    # The block's memory came from the driver, and went back at empty_cache: in the VMM
    # arena as mappings of the chunks under it (a segment of its own with `vmm:off`).
    def covering(kinds):
        end = ptr + (40 << 20)
        return [
            e for e in trace
            if e["action"] in kinds and e["addr"] < end and ptr < e["addr"] + e["size"]
        ]
    got = covering(("segment_alloc", "segment_map"))
    gone = covering(("segment_free", "segment_unmap"))
    assert got and gone, [e["action"] for e in trace]
    assert got[0]["time_us"] <= mine[0]["time_us"] and gone[-1]["time_us"] >= mine[-1]["time_us"]
    alloc = next(e for e in mine if e["action"] == "alloc")
    assert alloc["size"] >= 40 << 20 and alloc["stream"] == STREAM
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)
    # A second snapshot keeps what the first one read, and adds what came since.
    cupool.record_memory_history(True)
    try:
        first = len(cupool.snapshot()["device_traces"][0])
        p2 = cupool.alloc(1 << 20, stream=STREAM)
        cupool.free(p2, stream=STREAM)
        second = cupool.snapshot()["device_traces"][0]
    finally:
        cupool.record_memory_history(None)
    assert len(second) >= first + 2


def test_out_of_memory_is_in_the_history():
    cupool.empty_cache()
    cupool.record_memory_history(True)
    cupool.set_memory_limit(1, device=0)
    try:
        with pytest.raises(cupool.OutOfMemoryError):
            cupool.alloc(100 << 20, stream=STREAM)
        trace = cupool.snapshot()["device_traces"][0]
    finally:
        cupool.set_memory_limit(0, device=0)
        cupool.record_memory_history(None)
    ooms = [e for e in trace if e["action"] == "oom"]
    assert ooms and ooms[-1]["size"] == 100 << 20 and "device_free" in ooms[-1]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch not installed")
def test_memory_viz_reads_the_snapshot(blocks):
    from torch.cuda import _memory_viz

    cupool.record_memory_history(True)
    ptr = cupool.alloc(2 << 20, stream=STREAM)
    cupool.free(ptr, stream=STREAM)
    snap = cupool.snapshot()
    cupool.record_memory_history(None)
    summary = _memory_viz.segsum(snap)
    assert f"segments: {len(snap['segments'])}" in summary
    assert "Device 0" in _memory_viz.trace(snap)
    assert "<html>" in _memory_viz.trace_plot(snap).lower()
