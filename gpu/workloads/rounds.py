"""Step time and device peak of the corpus workloads, allocators taking turns (stdlib only).

    python3 gpu/workloads/rounds.py OUTDIR [--rounds 3] [--workloads gpt_train ...]
        [--steps gpt_train=90 ...] [--preload LABEL=LIBRARY[@CUPOOL_CONF] ...]
        [--cupool LABEL=LIBRARY[@CUPOOL_CONF] ...] [--async] [--no-expandable]
        [--deadline-s 540]

One process on this machine differs from the next by up to ±25% in step time, so a single
run per allocator says little. Here every round runs each workload once per allocator, in
turn (PyTorch native, PyTorch `expandable_segments:True`, with `--async` PyTorch's
`backend:cudaMallocAsync`, then each `--cupool` library through `cupool.torch.enable()` and
each `--preload` library with `PYTORCH_NO_CUDA_MEMORY_CACHING=1`), each a fresh process; the table gives each round's
median step, the median over rounds, its ratio to native's, the device peak (NVML, above the
value once the context existed) and whether the losses are bit-identical to native's.

Writes OUTDIR/LABEL.WORKLOAD.rROUND.json (each run's result JSON), OUTDIR/logs/, and
OUTDIR/rounds.json; prints the table (also OUTDIR/table.txt). Exit status 0 when every run
succeeded. No run starts after --deadline-s.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = float(1 << 30)
DEFAULT_STEPS = {"gpt_train": 60, "conv_train": 40, "llm_generate": 5}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", nargs="+", default=list(DEFAULT_STEPS))
    p.add_argument("--steps", action="append", default=[], metavar="WORKLOAD=N")
    p.add_argument("--preload", action="append", default=[],
                   metavar="LABEL=LIBRARY[@CUPOOL_CONF]",
                   help="a cupool preload library to run under (repeatable)")
    p.add_argument("--cupool", action="append", default=[],
                   metavar="LABEL=LIBRARY[@CUPOOL_CONF]",
                   help="libcupool.so to put PyTorch on through cupool.torch.enable() "
                        "(the package from python/; repeatable)")
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="also PyTorch's backend:cudaMallocAsync")
    p.add_argument("--no-expandable", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workload-dir", default=HERE,
                   help="where WORKLOAD.py lives (default: this folder)")
    p.add_argument("--deadline-s", type=float, default=540.0)
    p.add_argument("--proc-timeout-s", type=float, default=150.0)
    args = p.parse_args(argv)
    steps = dict(DEFAULT_STEPS)
    for item in args.steps:
        name, _, n = item.partition("=")
        if not n.isdigit():
            p.error(f"--steps wants WORKLOAD=N, got {item!r}")
        steps[name] = int(n)
    modes = [("native", "native", {}, {})]
    if not args.no_expandable:
        modes.append(("expandable", "expandable",
                      {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, {}))
    if args.use_async:
        modes.append(("async", "async",
                      {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, {}))
    python_dir = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")
    for option, kind in (("--cupool", "cupool"), ("--preload", "preload")):
        for item in getattr(args, option[2:]):
            label, _, rest = item.partition("=")
            lib, _, conf = rest.partition("@")
            if not label or not lib:
                p.error(f"{option} wants LABEL=LIBRARY[@CUPOOL_CONF], got {item!r}")
            if not os.path.exists(lib):
                p.error(f"{option} {label}: no such library: {lib}")
            if kind == "preload":
                env = {"LD_PRELOAD": os.path.abspath(lib), "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
            else:
                env = {"WORKLOAD_ALLOCATOR": "cupool", "CUPOOL_LIBRARY": os.path.abspath(lib),
                       "PYTHONPATH": python_dir + os.pathsep + os.environ.get("PYTHONPATH", "")}
            if conf:
                env["CUPOOL_CONF"] = conf
            modes.append((label, kind, env, {}))
    if len({m[0] for m in modes}) != len(modes):
        p.error("every mode needs its own label")
    return args, steps, modes


def run(args, steps, modes):
    os.makedirs(os.path.join(args.outdir, "logs"), exist_ok=True)
    base_env = {k: v for k, v in os.environ.items() if k not in (
        "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
        "LD_PRELOAD", "CUPOOL_CONF", "CUPOOL_TRACE", "WORKLOAD_ALLOCATOR", "CUPOOL_LIBRARY")}
    base_env["PYTHONUNBUFFERED"] = "1"
    started = time.monotonic()
    results = []
    for rnd in range(1, args.rounds + 1):
        for name in args.workloads:
            for label, kind, env, _ in modes:
                left = args.deadline_s - (time.monotonic() - started)
                tag = f"{label}.{name}.r{rnd}"
                if left < 20:
                    results.append({"label": label, "workload": name, "round": rnd,
                                    "status": "skipped (deadline)"})
                    continue
                out_json = os.path.join(args.outdir, tag + ".json")
                cmd = [sys.executable, os.path.join(args.workload_dir, name + ".py"),
                       "--seed", str(args.seed), "--mode", kind, "--out-json", out_json]
                if name in steps:
                    cmd += ["--steps", str(steps[name])]
                log = os.path.join(args.outdir, "logs", tag)
                t0 = time.monotonic()
                with open(log + ".out", "w") as o, open(log + ".err", "w") as e:
                    try:
                        rc = subprocess.run(cmd, env={**base_env, **env}, stdout=o, stderr=e,
                                            timeout=min(left, args.proc_timeout_s)).returncode
                    except subprocess.TimeoutExpired:
                        rc = "timeout"
                rec = {"label": label, "workload": name, "round": rnd, "rc": rc,
                       "seconds": round(time.monotonic() - t0, 1)}
                try:
                    with open(out_json) as f:
                        res = json.load(f)
                    rec.update(status=res.get("status"), step_ms=res.get("step_ms_median"),
                               peak=res.get("device_peak_bytes"),
                               checksum=res.get("loss_checksum"),
                               cupool=res.get("cupool"))
                except (OSError, ValueError) as err:
                    rec["status"] = f"no result ({err.__class__.__name__})"
                results.append(rec)
                print(f"== {tag}: {rec.get('status')} rc {rc} "
                      f"step {rec.get('step_ms')} ms, peak {fmt_gib(rec.get('peak'))} GiB",
                      flush=True)
    return results


def fmt_gib(v):
    return "-" if v is None else f"{v / GIB:.2f}"


def table(results, args, modes):
    lines = []
    for name in args.workloads:
        mine = [r for r in results if r["workload"] == name]
        native = [r for r in mine if r["label"] == "native" and r.get("status") == "ok"]
        native_sums = {r.get("checksum") for r in native}
        native_med = statistics.median(r["step_ms"] for r in native) if native else None
        lines.append(f"{name}: step ms per round | median | vs native | device peak GiB "
                     f"(max) | losses as native")
        for label, *_ in modes:
            runs = [r for r in mine if r["label"] == label]
            ok = [r for r in runs if r.get("status") == "ok" and r.get("step_ms") is not None]
            per_round = " / ".join(f"{r['step_ms']:.1f}" if r in ok else str(r.get("status"))
                                   for r in runs)
            med = statistics.median(r["step_ms"] for r in ok) if ok else None
            ratio = f"{med / native_med:.2f}x" if med and native_med else "-"
            peak = max((r["peak"] for r in ok if r.get("peak") is not None), default=None)
            same = ("-" if not ok or not native_sums else
                    "yes" if all(r.get("checksum") in native_sums for r in ok) else "NO")
            med_text = "-" if med is None else f"{med:.1f}"
            lines.append(f"  {label:<12} {per_round} | {med_text} | {ratio} | "
                         f"{fmt_gib(peak)} | {same}")
    return "\n".join(lines)


def main(argv):
    args, steps, modes = parse_args(argv)
    results = run(args, steps, modes)
    text = table(results, args, modes)
    print(text)
    with open(os.path.join(args.outdir, "table.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.outdir, "rounds.json"), "w") as f:
        json.dump({"steps": steps, "rounds": args.rounds, "results": results}, f, indent=1)
    return 0 if all(r.get("status") == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
