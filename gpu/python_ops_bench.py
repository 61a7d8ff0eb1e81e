"""Per-operation cost from Python: `torch.empty` + `del` and `cupy.empty` + `del`, under each
allocator, each in a fresh process, side by side in one run (issue 11's benchmark).

  python3 gpu/python_ops_bench.py [--out-json FILE] [--reps N] [--rounds R]
                                 [--processes K] [--cpu N] [--only LIB]

Allocators (one process each; those that cannot start are reported, not fatal):
  torch: native (PyTorch's caching allocator), expandable (expandable_segments:True),
         async (backend:cudaMallocAsync), rmm (RMM's pool resource through
         rmm.allocators.torch), cupool (cupool.torch.enable(): its C++ shim),
         cupool_plain (cupool.torch.enable(shim=False): PyTorch's pluggable allocator)
  cupy:  cupy (CuPy's default memory pool), cupool (cupool.cupy.enable())

The cupool package comes from python/ beside this folder (or PYTHONPATH), its library from
CUPOOL_LIBRARY; RMM from RMM_PYTHONPATH when set (e.g. a `pip install --target` folder), else the
environment. Each process warms its allocator with every size first, then times pairs in
three loop shapes, R rounds each, medians of the per-round ns per pair:
  each    one size at a time (all pairs of 512 B, then all of 1 MiB, then 64 MiB);
  cycle   the sizes in turn (512 B, 1 MiB, 64 MiB, 512 B, ...);
  shuffle the same pairs in a fixed random order.
Python's own cost is in every figure (about the same for every allocator of one library):
compare within a library and a shape. PyTorch processes also time `raw`: the same sizes in
turn through `torch.cuda.caching_allocator_alloc` / `caching_allocator_delete` (the active
allocator with no tensor around it).

One process per allocator is not enough on machines whose processes differ by up to 2× in
speed: `--processes K` starts K processes per allocator, taking turns (each pass in a
rotated order), and reports per allocator the median over its processes of each figure,
with its ratio to the first allocator of the library (PyTorch native, CuPy's pool).
`--cpu N` pins every process to CPU N, so they all run on the same core.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (512, 1 << 20, 64 << 20)
TORCH_MODES = ("native", "expandable", "async", "rmm", "cupool", "cupool_plain")
CUPY_MODES = ("cupy", "cupool")


def env_for(lib, mode):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
              "LD_PRELOAD"):
        env.pop(k, None)
    if lib == "torch" and mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if lib == "torch" and mode == "async":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    if mode == "rmm" and env.get("RMM_PYTHONPATH"):
        env["PYTHONPATH"] = env["RMM_PYTHONPATH"] + (os.pathsep + env["PYTHONPATH"]
                                                     if env.get("PYTHONPATH") else "")
    if mode.startswith("cupool"):
        python_dir = os.path.join(os.path.dirname(HERE), "python")
        env["PYTHONPATH"] = python_dir + (os.pathsep + env["PYTHONPATH"]
                                          if env.get("PYTHONPATH") else "")
    return env


def order(shape, reps, seed):
    if shape == "each":
        return [s for s in SIZES for _ in range(reps)]
    if shape == "cycle":
        return [s for _ in range(reps) for s in SIZES]
    seq = [s for s in SIZES for _ in range(reps)]
    random.Random(seed).shuffle(seq)
    return seq


def child(lib, mode, reps, rounds, shapes):
    """Runs in the child process: switch the allocator, warm up, time, print JSON."""
    if lib == "torch":
        import torch
        if mode.startswith("cupool"):
            import cupool.torch
            cupool.torch.enable(shim=mode == "cupool")
        elif mode == "rmm":
            import rmm
            from rmm.allocators.torch import rmm_torch_allocator
            rmm.reinitialize(pool_allocator=True)
            torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        dev = torch.device("cuda")
        torch.cuda.init()

        def pair(n):
            x = torch.empty(n, dtype=torch.uint8, device=dev)
            del x

        sync = torch.cuda.synchronize
        stream = torch.cuda.current_stream().cuda_stream
        raw_alloc = torch.cuda.caching_allocator_alloc
        raw_free = torch.cuda.caching_allocator_delete

        def raw_pair(n):
            raw_free(raw_alloc(n, 0, stream))
    else:
        raw_pair = None
        import cupy
        if mode == "cupool":
            import cupool.cupy
            cupool.cupy.enable()

        def pair(n):
            x = cupy.empty(n, dtype=cupy.uint8)
            del x

        def sync():
            cupy.cuda.runtime.deviceSynchronize()

    for n in SIZES:  # warm: every size once in the cache
        for _ in range(8):
            pair(n)
    sync()
    out = {}
    shapes = [x for x in shapes if x != "raw" or raw_pair]
    for shape in shapes:
        run_one = raw_pair if shape == "raw" else pair
        per_size = {n: [] for n in SIZES}
        per_pair = []
        for r in range(rounds):
            seq = order("cycle" if shape == "raw" else shape, reps, seed=r)
            times = {n: 0 for n in SIZES}
            t_all = time.perf_counter_ns()
            for n in seq:
                t = time.perf_counter_ns()
                run_one(n)
                times[n] += time.perf_counter_ns() - t
            per_pair.append((time.perf_counter_ns() - t_all) / len(seq))
            for n in SIZES:
                per_size[n].append(times[n] / reps)
        sync()
        out[shape] = {
            "ns_per_pair_median": statistics.median(per_pair),
            "ns_by_size_median": {str(n): statistics.median(v) for n, v in per_size.items()},
        }
    print(json.dumps({"lib": lib, "mode": mode, "status": "ok", "reps": reps,
                      "rounds": rounds, "shapes": out}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-json")
    p.add_argument("--reps", type=int, default=2000, help="pairs per size per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--child", nargs=2, metavar=("LIB", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--processes", type=int, default=1,
                   help="processes per allocator, taking turns (medians over them)")
    p.add_argument("--cpu", type=int, help="pin every process to this CPU")
    p.add_argument("--only", choices=("torch", "cupy"), help="one library's allocators")
    p.add_argument("--shapes", default="each,cycle,shuffle,raw",
                   help="loop shapes, in the order each process runs them")
    p.add_argument("--modes", help="comma-separated allocators of that library (default all)")
    args = p.parse_args()
    if args.child:
        if args.cpu is not None:
            os.sched_setaffinity(0, {args.cpu})
        child(args.child[0], args.child[1], args.reps, args.rounds, args.shapes.split(","))
        return
    results = []
    runs = [("torch", m) for m in TORCH_MODES] + [("cupy", m) for m in CUPY_MODES]
    if args.only:
        runs = [r for r in runs if r[0] == args.only]
    if args.modes:
        wanted = args.modes.split(",")
        runs = [r for r in runs if r[1] in wanted]
    passes = max(1, args.processes)
    for k in range(passes):
        turn = runs[k % len(runs):] + runs[:k % len(runs)]
        for lib, mode in turn:
            res = run_child(args, lib, mode)
            res["pass"] = k
            results.append(res)
            print(table_row(res), flush=True)
    if passes > 1:
        print(f"medians over {passes} processes each (ratio to the library's first allocator):")
        for line in summary(results, runs):
            print(line, flush=True)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(results, f, indent=1)


def run_child(args, lib, mode):
    """One child process; its JSON result, or a failure record."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", lib, mode,
           "--reps", str(args.reps), "--rounds", str(args.rounds), "--shapes", args.shapes]
    if args.cpu is not None:
        cmd += ["--cpu", str(args.cpu)]
    try:
        r = subprocess.run(cmd, env=env_for(lib, mode), capture_output=True, text=True,
                           timeout=args.timeout)
        line = (r.stdout.strip().splitlines() or [""])[-1]
        res = json.loads(line) if r.returncode == 0 and line.startswith("{") else {
            "lib": lib, "mode": mode, "status": "failed",
            "error": (r.stderr.strip().splitlines() or ["(no output)"])[-1][:300]}
    except subprocess.TimeoutExpired:
        res = {"lib": lib, "mode": mode, "status": "timeout"}
    return res


def summary(results, runs):
    """Per allocator, the median over its processes of each shape's figure per size."""
    lines = []
    base = {}
    for lib, mode in runs:
        ok = [r for r in results if r["lib"] == lib and r["mode"] == mode
              and r.get("status") == "ok"]
        if not ok:
            lines.append(f"{lib:5} {mode:10} no successful process")
            continue
        cells = []
        for shape in ok[0]["shapes"]:
            meds = [statistics.median(r["shapes"][shape]["ns_by_size_median"][str(n)]
                                      for r in ok) for n in SIZES]
            ref = base.setdefault((lib, shape), meds)
            ratios = "/".join(f"{m / b:.2f}" for m, b in zip(meds, ref))
            cells.append(f"{shape}: " + " / ".join(f"{m:6.0f}" for m in meds) + f" ({ratios}x)")
        lines.append(f"{lib:5} {mode:10} n={len(ok)} " + "; ".join(cells))
    return lines


def table_row(res):
    head = f"{res['lib']:5} {res['mode']:10}"
    if res.get("status") != "ok":
        return f"{head} {res.get('status')}: {res.get('error', '')}"
    cells = []
    for shape, v in res["shapes"].items():
        by = v["ns_by_size_median"]
        cells.append(f"{shape}: " + " / ".join(f"{by[str(n)]:7.0f}" for n in SIZES))
    return f"{head} ns per pair at 512 B / 1 MiB / 64 MiB, " + "; ".join(cells)


if __name__ == "__main__":
    main()
