"""Summary of a corpus recording (run by scripts/record-corpus; stdlib only).

    python3 gpu/workloads/summarize.py OUTDIR

Reads OUTDIR/runs.tsv (one line per run: workload, mode, status, rc, seconds, result JSON,
note) and the result JSON of every run, and writes:

- OUTDIR/summary.json: one record per workload and mode (device peak, PyTorch's reserved
  and allocated peaks, cupool's, step time, loss checksum, whether the losses are
  identical to the native run's, trace and snapshot files with their sizes);
- OUTDIR/NAME.peaks.json: per workload, what each allocator held at peak, to keep beside
  the workload's traces in tests/traces/gpu/;

and prints a table. Exit status 0 when every run that was attempted succeeded.
"""
import glob
import json
import os
import sys

GIB = float(1 << 30)
MODES_ORDER = ("native", "expandable", "async", "rmm", "cupool", "preload")


def read_runs(outdir):
    runs = []
    path = os.path.join(outdir, "runs.tsv")
    if not os.path.exists(path):
        return runs
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 7:
                continue
            name, mode, status, rc, secs, result, note = parts[:7]
            runs.append({"workload": name, "mode": mode, "status": status,
                         "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                         "process_s": float(secs) if secs else None,
                         "result_path": result, "note": note})
    return runs


def load_result(path):
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except (ValueError, IndexError, OSError) as e:
        return {"error": f"unreadable result {path}: {e}"}


def level(stats, key, field="peak"):
    v = (stats or {}).get(key)
    return v.get(field) if isinstance(v, dict) else None


def files_of(outdir, workload, mode):
    """The trace files a run left: cupool's (preload) or PyTorch's snapshot (native)."""
    pattern = {"preload": f"{workload}.cupool*", "native": f"{workload}.torch.pickle*"}.get(mode)
    if not pattern:
        return {}
    return {os.path.basename(p): os.path.getsize(p)
            for p in sorted(glob.glob(os.path.join(outdir, pattern)))}


def record_for(outdir, run, native_result):
    res = load_result(run["result_path"]) or {}
    torch_stats = res.get("torch") or {}
    cupool = res.get("cupool") if isinstance(res.get("cupool"), dict) else None
    rec = {
        "workload": run["workload"],
        "mode": run["mode"],
        "status": run["status"] if run["status"] != "ok" else res.get("status", "ok"),
        "rc": run["rc"],
        "process_s": run["process_s"],
        "note": run["note"] or None,
        "error": res.get("error"),
        "steps": res.get("steps"),
        "step_ms_median": res.get("step_ms_median"),
        "device_peak_bytes": res.get("device_peak_bytes"),
        "device_peak_source": res.get("device_peak_source"),
        "torch_reserved_peak_bytes": torch_stats.get("max_memory_reserved"),
        "torch_allocated_peak_bytes": torch_stats.get("max_memory_allocated"),
        "torch_requested_peak_bytes": torch_stats.get("requested_bytes.all.peak"),
        "torch_num_device_alloc": torch_stats.get("num_device_alloc"),
        "torch_num_device_free": torch_stats.get("num_device_free"),
        "expandable_segments_seen": torch_stats.get("expandable_segments_seen"),
        "cupool_reserved_peak_bytes": level(cupool, "reserved_bytes"),
        "cupool_allocated_peak_bytes": level(cupool, "allocated_bytes"),
        "cupool_requested_peak_bytes": level(cupool, "requested_bytes"),
        "cupool_device_allocs": (cupool or {}).get("device_allocs"),
        "cupool_device_frees": (cupool or {}).get("device_frees"),
        "cupool_num_allocs": (cupool or {}).get("num_allocs"),
        "loss_checksum": res.get("loss_checksum"),
        "files": files_of(outdir, run["workload"], run["mode"]),
        "snapshot": {k: v for k, v in (res.get("snapshot") or {}).items() if k != "path"} or None,
    }
    for k in ("bad_victim_sums", "bad_block_bytes", "allocs", "frees", "peak_live_bytes",
              "wall_ms", "host_ms", "token_checksum", "tokens_generated", "params"):
        if k in res:
            rec[k] = res[k]
    # Same computation under every allocator: the losses must agree to the bit.
    if native_result and res and run["mode"] != "native" and rec["status"] == "ok":
        a, b = native_result.get("losses"), res.get("losses")
        if a is not None and b is not None:
            rec["losses_identical_to_native"] = a == b
            if len(a) == len(b) and a:
                rec["max_abs_loss_diff_vs_native"] = max(abs(x - y) for x, y in zip(a, b))
        else:
            rec["losses_identical_to_native"] = (
                native_result.get("loss_checksum") == res.get("loss_checksum"))
        if "token_checksum" in res and "token_checksum" in native_result:
            rec["losses_identical_to_native"] = bool(
                rec.get("losses_identical_to_native", True)
                and res["token_checksum"] == native_result["token_checksum"])
    return rec


def peaks_file(outdir, workload, recs, results):
    """NAME.peaks.json: what each allocator held at peak for the workload's run."""
    any_res = next((r for r in results.values() if r), {})
    out = {"workload": workload, "seed": any_res.get("seed"), "steps": any_res.get("steps"),
           "config": any_res.get("config"), "device": any_res.get("device_name"),
           "torch_version": any_res.get("torch_version"), "modes": {}}
    keys = ("status", "device_peak_bytes", "torch_reserved_peak_bytes",
            "torch_allocated_peak_bytes", "torch_requested_peak_bytes",
            "cupool_reserved_peak_bytes", "cupool_allocated_peak_bytes",
            "cupool_requested_peak_bytes", "cupool_device_allocs", "cupool_device_frees",
            "step_ms_median", "losses_identical_to_native", "files")
    for rec in recs:
        out["modes"][rec["mode"]] = {k: rec.get(k) for k in keys if rec.get(k) is not None}
    path = os.path.join(outdir, f"{workload}.peaks.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")


def gib(v):
    return f"{v / GIB:.2f}" if isinstance(v, (int, float)) else "-"


def table(records):
    head = ("workload", "mode", "status", "steps", "step ms", "dev peak", "torch res",
            "torch alloc", "cupool res", "cupool alloc", "util", "same", "files MB")
    rows = []
    for r in records:
        res_peak = r.get("torch_reserved_peak_bytes") or r.get("cupool_reserved_peak_bytes")
        alloc_peak = r.get("torch_allocated_peak_bytes") or r.get("cupool_allocated_peak_bytes")
        util = f"{alloc_peak / res_peak:.1%}" if res_peak and alloc_peak else "-"
        same = r.get("losses_identical_to_native")
        rows.append((
            r["workload"], r["mode"], r["status"], str(r.get("steps") or "-"),
            f"{r['step_ms_median']:.1f}" if r.get("step_ms_median") else "-",
            gib(r.get("device_peak_bytes")), gib(r.get("torch_reserved_peak_bytes")),
            gib(r.get("torch_allocated_peak_bytes")), gib(r.get("cupool_reserved_peak_bytes")),
            gib(r.get("cupool_allocated_peak_bytes")), util,
            "-" if same is None else ("yes" if same else "NO"),
            f"{sum(r['files'].values()) / 1e6:.2f}" if r.get("files") else "-",
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: summarize.py OUTDIR")
    outdir = sys.argv[1]
    runs = read_runs(outdir)
    by_workload = {}
    for run in runs:
        by_workload.setdefault(run["workload"], []).append(run)
    records = []
    for workload, wruns in by_workload.items():
        wruns.sort(key=lambda r: MODES_ORDER.index(r["mode"]) if r["mode"] in MODES_ORDER else 9)
        results = {r["mode"]: load_result(r["result_path"]) for r in wruns}
        native = results.get("native")
        if (native or {}).get("status") != "ok":
            native = None
        recs = [record_for(outdir, r, native) for r in wruns]
        records += recs
        peaks_file(outdir, workload, recs, results)
    total_files = sum(sum(r["files"].values()) for r in records if r.get("files"))
    summary = {"outdir": os.path.abspath(outdir), "records": records,
               "trace_bytes_total": total_files,
               "all_ok": all(r["status"] == "ok" for r in records if r["status"] != "skipped")}
    with open(os.path.join(outdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")
    print(table(records))
    print("(GiB; dev peak: NVML, above the value once the CUDA context existed; util: allocated "
          "peak / reserved peak of the allocator in use; same: losses bit-identical to native)")
    print(f"trace and snapshot files: {total_files / 1e6:.2f} MB")
    bad = [r for r in records if r["status"] not in ("ok", "skipped")]
    for r in bad:
        print(f"FAILED {r['workload']} {r['mode']}: {r['status']} rc={r['rc']} "
              f"{(r.get('error') or r.get('note') or '')[:300]}")
    for r in records:
        if r["status"] == "ok" and r.get("note"):
            print(f"NOTE {r['workload']} {r['mode']}: {r['note'][:300]}")
    diff = [r for r in records if r.get("losses_identical_to_native") is False]
    for r in diff:
        print(f"DIFFERENT {r['workload']} {r['mode']}: results differ from native "
              f"(max loss difference {r.get('max_abs_loss_diff_vs_native')})")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
