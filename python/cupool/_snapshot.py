"""Memory snapshots in the layout of ``torch.cuda.memory._snapshot()``, which
``python -m torch.cuda._memory_viz`` and the memory_viz web page read.

Segments and blocks come from ``cupool_segments_json`` (the pool's layout now). The
allocation history (``device_traces``) comes from cupool's own recording: while
:func:`record_memory_history` is on, every allocation and free of the process is written
to a trace file (``cupool_trace_start``); a snapshot stops that trace so that everything
recorded is written, reads it, and starts the next file at once. Calls made in that
moment between two files are not in the history.
"""

from __future__ import annotations

import csv
import json
import os
import pickle
import tempfile
import threading
import time
from typing import Any

from . import _lib

_state_lock = threading.Lock()
_recording: dict[str, Any] | None = None  # {dir, path, started_us, max_entries, n}
_entries: dict[int, list[dict[str, Any]]] = {}


def device_count() -> int:
    """How many devices the pool's backend sees."""
    lib = _lib.lib()
    n = 0
    while lib.cupool_mem_get_info(n, None, None) == _lib.OK:
        n += 1
    return n


def _start_file() -> None:
    assert _recording is not None
    _recording["n"] += 1
    path = os.path.join(_recording["dir"], f"history-{_recording['n']}.csv")
    _lib.check(_lib.lib().cupool_trace_start(path.encode()), "cupool_trace_start")
    _recording["path"] = path
    _recording["started_us"] = time.time_ns() // 1000


def record_memory_history(enabled: bool | str | None = True, max_entries: int = 1_000_000) -> None:
    """Starts (``enabled`` true, or PyTorch's ``"all"``/``"state"``) or stops (``None`` or
    false) recording the allocation history that snapshots carry as ``device_traces``.
    Keeps the last ``max_entries`` events per device. Uses cupool's trace recording, so it
    replaces a trace started with :func:`cupool.trace_start`."""
    global _recording
    with _state_lock:
        if enabled:
            if _recording is None:
                _recording = {
                    "dir": tempfile.mkdtemp(prefix="cupool-history-"),
                    "n": 0,
                    "max_entries": int(max_entries),
                }
                _entries.clear()
                _start_file()
            else:
                _recording["max_entries"] = int(max_entries)
        elif _recording is not None:
            _collect(restart=False)
            _recording = None


def recording() -> bool:
    return _recording is not None


def _collect(restart: bool) -> None:
    """Stops the running history file, adds its events, and starts the next one."""
    assert _recording is not None
    _lib.check(_lib.lib().cupool_trace_stop(), "cupool_trace_stop")
    path, started_us = _recording["path"], _recording["started_us"]
    if restart:
        _start_file()
    for device, entry in _read_trace(path, started_us):
        entries = _entries.setdefault(device, [])
        entries.append(entry)
    for entries in _entries.values():
        entries.sort(key=lambda e: e["time_us"])
        del entries[: max(0, len(entries) - _recording["max_entries"])]
    for p in (path, _driver_path(path)):
        try:
            os.remove(p)
        except OSError:
            pass


def _driver_path(path: str) -> str:
    # cupool's naming: x.csv -> x.driver.csv (src/trace/record/rows.rs).
    return path[: -len(".csv")] + ".driver.csv"


def _int(text: str) -> int:
    text = text.strip()
    if not text:
        return 0
    return int(text, 16) if text.lower().startswith("0x") else int(text)


def _read_trace(path: str, started_us: int):
    """Yields ``(device, entry)`` for each event of one history file and its driver file,
    as PyTorch's trace entries."""

    def entry(action, addr, size, stream, nanos):
        return {
            "action": action,
            "addr": addr,
            "size": size,
            "stream": stream,
            "time_us": started_us + nanos // 1000,
            "frames": [],
            "compile_context": "N/A",
            "user_metadata": "",
        }

    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("Device"):
                continue
            device, nanos = int(row["Device"]), _int(row["Nanos"])
            addr, stream = _int(row["Pointer"]), _int(row["Stream"])
            size = _int(row.get("Rounded") or "") or _int(row["Size"])
            action, ok = row["Action"], row["Result"] == "ok"
            if action == "allocate" and ok:
                yield device, entry("alloc", addr, size, stream, nanos)
            elif action == "free" and ok:
                yield device, entry("free_requested", addr, size, stream, nanos)
                yield device, entry("free_completed", addr, size, stream, nanos)
            elif action == "allocate failure" and row["Result"] == "out_of_memory":
                e = entry("oom", 0, _int(row["Size"]), stream, nanos)
                del e["addr"]
                e["device_free"] = 0
                yield device, e
    driver = _driver_path(path)
    if not os.path.exists(driver):
        return
    actions = {
        "segment_alloc": "segment_alloc",
        "segment_free": "segment_free",
        "map": "segment_map",
        "unmap": "segment_unmap",
    }
    with open(driver, newline="") as f:
        for row in csv.DictReader(f):
            action = actions.get(row["Action"])
            if action is None or not row.get("Device"):
                continue
            yield int(row["Device"]), entry(
                action, _int(row["Pointer"]), _int(row["Size"]), 0, _int(row["Nanos"])
            )


def segments(device: int | None = None) -> list[dict[str, Any]]:
    """The pool's segments (``None``: all devices) in PyTorch's snapshot layout."""
    dev = -1 if device is None else int(device)
    text = _lib.text_out(_lib.lib().cupool_segments_json, dev, what="cupool_segments_json")
    segs = json.loads(text)["segments"]
    for seg in segs:
        seg["active_size"] = seg["allocated_size"]
        seg["segment_pool_id"] = (0, 0)
        seg["frames"] = []
        for block in seg["blocks"]:
            block["frames"] = []
    return segs


def snapshot(device: int | None = None) -> dict[str, Any]:
    """The pool's state as ``torch.cuda.memory._snapshot()`` returns it: ``segments`` (with
    their ``blocks``), ``device_traces`` (one list per device; empty unless
    :func:`record_memory_history` is on), ``allocator_settings`` and
    ``external_annotations``."""
    with _state_lock:
        if _recording is not None:
            _collect(restart=True)
        traces = [list(_entries.get(d, [])) for d in range(max(device_count(), 1))]
    settings = {"backend": "cupool"}
    for key in ("backend", "vmm", "memory_limit", "small_segment", "large_segment"):
        try:
            from . import config_get

            settings[f"cupool.{key}"] = config_get(key)
        except _lib.CupoolError:
            pass
    return {
        "segments": segments(device),
        "device_traces": traces,
        "allocator_settings": settings,
        "external_annotations": [],
    }


def dump_snapshot(path: str | os.PathLike, device: int | None = None) -> None:
    """Writes :func:`snapshot` as a pickle, as ``torch.cuda.memory._dump_snapshot`` does."""
    data = snapshot(device)
    with open(path, "wb") as f:
        pickle.dump(data, f)
