"""What the allocators say about a workload run: cupool's statistics, footprint and per-step
counts (through the C API's JSON exports), PyTorch's own counters, and PyTorch's memory
history as a snapshot (part of the workload harness, `common.py`)."""
import ctypes
import gzip
import json
import os
import pickle

try:
    import torch
except ImportError:  # the count helpers still work without torch (tests)
    torch = None

# cupool's status for a buffer that is too small (include/cupool.h).
CUPOOL_ERROR_BUFFER_TOO_SMALL = 11


def torch_caching_allocator_in_use():
    return (os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1"
            and os.environ.get("WORKLOAD_ALLOCATOR") not in ("cupool", "rmm"))


def cupool_json(name):
    """The JSON a `cupool_*_json(-1, ...)` export of the cupool already loaded in this process
    writes (every device), as a dict; None when no cupool is loaded or it lacks `name`."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    fn.restype = ctypes.c_int
    needed = ctypes.c_size_t(0)
    status = fn(-1, None, 0, ctypes.byref(needed))
    if status not in (0, CUPOOL_ERROR_BUFFER_TOO_SMALL):
        return {"error": f"{name} status {status}"}
    buf = ctypes.create_string_buffer(max(int(needed.value), 1) + 256)
    status = fn(-1, buf, len(buf), ctypes.byref(needed))
    if status != 0:
        return {"error": f"{name} status {status}"}
    try:
        return json.loads(buf.value.decode())
    except ValueError as e:
        return {"error": f"{name} returned bad JSON: {e}"}


def cupool_stats():
    """cupool's stats (all devices) as a dict, or None when no cupool is loaded."""
    return cupool_json("cupool_stats_json")


# cupool's monotonic counts read at every step's end, so a stretch of steps (after the
# warm-up, say) can be told apart from the run's totals: what the pool did per step.
STEP_COUNT_KEYS = (
    "num_allocs", "cache_misses", "device_allocs", "device_frees", "alloc_retries",
    "fences_recorded", "fence_queries", "grow_waits", "grow_wait_us", "fence_device_waits",
)
# The VMM arena's counts (`cupool_footprint_json`'s `vmm`), prefixed `vmm_`.
VMM_COUNT_KEYS = ("maps", "unmaps", "map_calls", "unmap_calls", "create_ns", "map_ns",
                  "unmap_ns", "release_ns", "deferred_unmap_calls", "deferred_unmap_ns")
# The estimated time in fence calls (`cupool_footprint_json`'s `fences`), prefixed `fence_`.
FENCE_TIME_KEYS = ("record_ns", "query_ns", "device_wait_ns")


def cupool_counts(stats, devices):
    """cupool's monotonic counts as one flat dict of ints: `stats` is `cupool_stats_json`'s
    dict, `devices` `cupool_footprint_json`'s `devices` list (its `vmm` objects, summed over
    devices, and its `fences` objects as `fence_` keys; a library without them gives no such
    keys). None when either is missing."""
    if not isinstance(stats, dict) or "error" in stats or not isinstance(devices, list):
        return None
    out = {k: int(stats[k]) for k in STEP_COUNT_KEYS if k in stats}
    for d in devices:
        vmm = d.get("vmm")
        if isinstance(vmm, dict):
            for k in VMM_COUNT_KEYS:
                out["vmm_" + k] = out.get("vmm_" + k, 0) + int(vmm.get(k, 0))
        fences = d.get("fences")
        if isinstance(fences, dict):
            for k in FENCE_TIME_KEYS:
                out["fence_" + k] = out.get("fence_" + k, 0) + int(fences.get(k, 0))
    return out


def count_deltas(before, after):
    """The counts that moved from `before` to `after` (dicts of ints), as a dict."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


TORCH_STAT_KEYS = (
    "reserved_bytes.all.peak", "allocated_bytes.all.peak", "requested_bytes.all.peak",
    "active_bytes.all.peak", "inactive_split_bytes.all.peak", "segment.all.peak",
    "num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms",
    "num_sync_all_streams",
)


def torch_allocator_stats(device_index, check_expandable=False):
    """PyTorch's caching-allocator peaks and counters (None under no caching and RMM: not
    counted). Under `cupool.torch.enable()` they are cupool's, through the patched calls."""
    if not torch_caching_allocator_in_use() and os.environ.get("WORKLOAD_ALLOCATOR") != "cupool":
        return None
    out = {
        "max_memory_reserved": int(torch.cuda.max_memory_reserved(device_index)),
        "max_memory_allocated": int(torch.cuda.max_memory_allocated(device_index)),
    }
    try:
        stats = torch.cuda.memory_stats(device_index)
        for k in TORCH_STAT_KEYS:
            if k in stats:
                out[k] = int(stats[k])
    except Exception as e:
        out["memory_stats_error"] = f"{type(e).__name__}: {e}"
    if check_expandable:  # did PyTorch take the setting? (an unknown key would have failed)
        try:
            segs = torch.cuda.memory._snapshot()["segments"]
            out["expandable_segments_seen"] = any(s.get("is_expandable") for s in segs)
        except Exception as e:
            out["expandable_segments_seen"] = f"unknown ({type(e).__name__})"
    return out


# ---------------------------------------------------------------------------------------
# PyTorch memory snapshot


class SnapshotRecorder:
    """Records PyTorch's allocation history (no stack traces: they would make the pickle
    tens of times larger) and writes the snapshot at the end."""

    def __init__(self, path, max_entries):
        self.path = path
        self.max_entries = max_entries
        self.error = None
        self.active = False

    def start(self):
        rec = torch.cuda.memory._record_memory_history
        try:
            rec(enabled="all", context=None, stacks="python", max_entries=self.max_entries)
            self.active = True
        except TypeError:
            try:  # torch 2.0's signature
                rec(True, record_context=False, trace_alloc_max_entries=self.max_entries,
                    trace_alloc_record_context=False)
                self.active = True
            except Exception as e:
                self.error = f"_record_memory_history unavailable: {type(e).__name__}: {e}"
        except Exception as e:
            self.error = f"_record_memory_history failed: {type(e).__name__}: {e}"

    def finish(self):
        """Writes the snapshot; returns a dict describing it (entries, actions, truncation)."""
        info = {"path": self.path, "max_entries": self.max_entries, "error": self.error}
        if not self.active:
            return info
        try:
            snap = torch.cuda.memory._snapshot()
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:
                pass
            opener = gzip.open if self.path.endswith(".gz") else open
            with opener(self.path, "wb") as f:
                pickle.dump(snap, f, protocol=pickle.HIGHEST_PROTOCOL)
            traces = snap.get("device_traces", [])
            actions = {}
            for dev in traces:
                for entry in dev:
                    a = entry.get("action", "?")
                    actions[a] = actions.get(a, 0) + 1
            longest = max((len(t) for t in traces), default=0)
            info.update({
                "bytes": os.path.getsize(self.path),
                "entries": sum(len(t) for t in traces),
                "actions": actions,
                "segments_at_end": len(snap.get("segments", [])),
                # A full ring buffer has dropped its oldest entries.
                "truncated": longest >= self.max_entries,
            })
        except Exception as e:
            info["error"] = f"snapshot failed: {type(e).__name__}: {e}"
        return info
