"""Statistics under PyTorch's ``memory_stats`` names, and ``memory_summary`` in its layout.

PyTorch's names are used only where cupool measures the same thing; cupool's own figures
follow under ``cupool.<field>`` (the fields of ``cupool_stats``, levels as
``.current``/``.peak``). What is left out, and why:

- ``large_pool`` / ``small_pool`` splits, and ``*.allocated`` / ``*.freed`` byte totals:
  the pool keeps no such counters;
- ``oversize_*`` and ``max_split_size``: cupool has no ``max_split_size`` knob;
- ``num_sync_all_streams``: cupool never synchronises every stream (it waits for context
  fences).

``active_bytes`` equals ``allocated_bytes``: PyTorch counts a block freed while
``record_stream`` work is pending as active; cupool hands such a block back at once and
counts it in ``cupool.pending_fence_bytes`` until its fence completes.
"""

from __future__ import annotations

import json
from typing import Any

from . import _lib


def raw_stats(device: int | None) -> dict[str, Any]:
    """``cupool_stats_json`` of ``device`` (``None``: all devices), as a dict."""
    dev = -1 if device is None else int(device)
    return json.loads(_lib.text_out(_lib.lib().cupool_stats_json, dev, what="cupool_stats_json"))


def footprint(device: int | None = None) -> list[dict[str, Any]]:
    """Where the reserved bytes of ``device``'s pool (``None``: every device's) are now and
    where they were at their peak: one dict per device, ``{"device", "now", "at_peak",
    "vmm", "fences"}``, each footprint a dict of bytes by place (``in_use_bytes``,
    ``awaiting_fence_bytes``, ``arena_hole_ends_bytes``, ..., adding up to
    ``reserved_bytes``); ``at_peak`` is None until the pool grows after a peak reset. The
    keys of ``cupool replay``'s ``at_peak``. ``vmm`` counts the VMM arena's work so far
    (``maps``, ``map_calls``, ``unmap_calls``, ``map_ns``, ...); ``fences`` estimates the
    time in the driver calls that order reuse after frees (``record_ns``, ``query_ns``,
    ``device_wait_ns``, from one call in eight timed)."""
    dev = -1 if device is None else int(device)
    text = _lib.text_out(_lib.lib().cupool_footprint_json, dev, what="cupool_footprint_json")
    return json.loads(text)["devices"]


def stats(device: int | None = None) -> dict[str, int]:
    """The pool's statistics for ``device`` (``None``: all devices summed), as a flat dict
    with PyTorch's ``memory_stats`` key names where the meaning is the same, plus
    ``cupool.<field>`` for every field of cupool's own statistics."""
    raw = raw_stats(device)
    out: dict[str, int] = {}
    for name in ("allocated_bytes", "reserved_bytes", "requested_bytes"):
        out[f"{name}.all.current"] = raw[name]["current"]
        out[f"{name}.all.peak"] = raw[name]["peak"]
    out["active_bytes.all.current"] = raw["allocated_bytes"]["current"]
    out["active_bytes.all.peak"] = raw["allocated_bytes"]["peak"]
    out["inactive_split_bytes.all.current"] = raw["inactive_split_bytes"]
    live = raw["num_allocs"] - raw["num_frees"]
    for name in ("allocation", "active"):
        out[f"{name}.all.current"] = live
        out[f"{name}.all.allocated"] = raw["num_allocs"]
        out[f"{name}.all.freed"] = raw["num_frees"]
    out["segment.all.current"] = raw["segments"]
    out["segment.all.allocated"] = raw["device_allocs"]
    out["segment.all.freed"] = raw["device_frees"]
    out["num_alloc_retries"] = raw["alloc_retries"]
    out["num_ooms"] = raw["num_ooms"]
    out["num_device_alloc"] = raw["device_allocs"]
    out["num_device_free"] = raw["device_frees"]
    for key, value in raw.items():
        if key in ("size", "version"):
            continue
        if isinstance(value, dict):
            for sub, v in value.items():
                out[f"cupool.{key}.{sub}"] = v
        else:
            out[f"cupool.{key}"] = value
    return dict(sorted(out.items()))


def nested(flat: dict[str, int]) -> dict[str, Any]:
    """A flat ``a.b.c`` dict as nested dicts (``torch.cuda.memory_stats_as_nested_dict``)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return root


def _format_size(sz: int, pref_sz: float) -> str:
    # PyTorch's memory_summary units: switch past 768 of the smaller unit.
    prefixes = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if pref_sz < 768 * 1024:
            break
        prefix = new_prefix
        sz //= 1024
        pref_sz /= 1024
    return f"{sz:6d} {prefix}"


def _format_count(cnt: int, pref_cnt: float) -> str:
    prefixes = [" ", "K", "M"]
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if pref_cnt < 750 * 1000:
            break
        prefix = new_prefix
        cnt //= 1000
        pref_cnt /= 1000
    return f"{cnt:7d} {prefix} "


_UNKNOWN = f"{'-':>8}  "  # as wide as a formatted cell (10 characters)


def memory_summary(device: int | None = None, abbreviated: bool = False) -> str:
    """A printout of the pool's statistics in the layout of ``torch.cuda.memory_summary``
    (75-column box, ``Cur Usage | Peak Usage | Tot Alloc | Tot Freed``), then cupool's own
    figures. ``device`` ``None``: all devices. Cells cupool does not measure show ``-``;
    there are no large/small pool rows (``abbreviated`` is accepted for PyTorch's
    signature)."""
    del abbreviated  # the pool has no large/small split to leave out
    s = stats(device)
    raw = raw_stats(device)
    rows = [
        ("allocated_bytes", "Allocated memory", _format_size),
        ("active_bytes", "Active memory", _format_size),
        ("requested_bytes", "Requested memory", _format_size),
        ("reserved_bytes", "GPU reserved memory", _format_size),
        ("inactive_split_bytes", "Non-releasable memory", _format_size),
        ("allocation", "Allocations", _format_count),
        ("active", "Active allocs", _format_count),
        ("segment", "GPU reserved segments", _format_count),
    ]
    lines = ["=" * 75]
    where = "all devices" if device is None else f"device ID {device}"
    lines.append(f" {'':16} cupool CUDA memory summary, {where:<27}"[:75].ljust(75))
    lines.append("-" * 75)
    lines.append(
        f"  {'':9} CUDA OOMs: {s['num_ooms']:<12d} | {'':6} cudaMalloc retries: "
        f"{s['num_alloc_retries']:<8d}  "
    )
    lines.append("=" * 75)
    lines.append("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ")
    for key, name, fmt in rows:
        lines.append("-" * 75)
        cells = []
        values = [s.get(f"{key}.all.{c}") for c in ("current", "peak", "allocated", "freed")]
        for v in values:
            # PyTorch picks each cell's unit from the value itself on the "all" rows.
            cells.append(_UNKNOWN if v is None else fmt(v, v))
        lines.append(f" {name:<21} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} ")
    lines.append("=" * 75)
    extra = [
        ("Idle cached memory", _format_size, raw["cached_bytes"]["current"]),
        ("Waiting for a fence", _format_size, raw["pending_fence_bytes"]),
        ("Cache hits", _format_count, raw["cache_hits"]),
        ("Cache misses", _format_count, raw["cache_misses"]),
        ("Fences recorded", _format_count, raw["fences_recorded"]),
        ("Cross-stream frees", _format_count, raw["cross_stream_frees"]),
    ]
    for name, fmt, v in extra:
        lines.append(f" {name:<21} | {fmt(v, v)} | {'':10} | {'':10} | {'':10} ")
    lines.append("=" * 75)
    lines.extend(_footprint_rows(footprint(device)))
    return "|" + "|\n|".join(lines) + "|\n"


# The places of cupool's footprint (``cupool_footprint_json``), as memory_summary rows.
_PLACES = (
    ("in_use_bytes", "In use"),
    ("awaiting_fence_bytes", "Waiting for a fence"),
    ("stream_only_bytes", "Freed on a stream"),
    ("arena_hole_ends_bytes", "Arena: hole ends"),
    ("arena_in_busy_chunks_bytes", "Arena: in busy chunks"),
    ("arena_stealable_bytes", "Arena: free chunks"),
    ("arena_idle_bytes", "Arena: unmapped"),
    ("segments_partly_free_bytes", "Free in segments"),
    ("segments_free_bytes", "Free segments"),
    ("other_bytes", "In threads' caches"),
)


def _footprint_rows(devices: list[dict[str, Any]]) -> list[str]:
    """Where the reserved bytes are now (``Cur Usage``) and were when they were highest
    (``Peak Usage``; with several devices, the sum of each device's own peak), one row a
    place that holds any."""
    now = {k: sum(d["now"][k] for d in devices) for k, _ in _PLACES}
    peaks = [d["at_peak"] for d in devices if d["at_peak"] is not None]
    peak = {k: sum(p[k] for p in peaks) for k, _ in _PLACES} if peaks else None
    title = "Reserved, by place"
    lines = [f" {title:<21} | Cur Usage  | Peak Usage | {'':10} | {'':10} "]
    for key, name in _PLACES:
        if now[key] == 0 and (peak is None or peak[key] == 0):
            continue
        at_peak = _UNKNOWN if peak is None else _format_size(peak[key], peak[key])
        lines.append("-" * 75)
        lines.append(
            f" {name:<21} | {_format_size(now[key], now[key])} | {at_peak} | {'':10} | {'':10} "
        )
    lines.append("=" * 75)
    return lines
