"""What a reserve saves (Note [reserve at start]): the first allocations of a fresh process, with and
without `reserve`, each in its own process, several processes each, taking turns.

  CUPOOL_LIBRARY=.../libcupool.so PYTHONPATH=python python3 gpu/reserve_bench.py [ROUNDS]

Per process: start the pool (one 4 KiB allocation, so the CUDA context is not counted), then
with a reserve call `cupool.reserve(RESERVE)` and time it, then time the first N
allocations (sizes log-uniform from 64 KiB to 64 MiB, fixed seed, on the NULL stream, none
freed), one by one. Prints the medians over processes.
"""
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

RESERVE = 8 << 30
N = 200


def child(with_reserve):
    import cupool

    p = cupool.alloc(4096, stream=0)  # the context and the pool start here
    cupool.free(p, stream=0)
    t = time.perf_counter_ns()
    if with_reserve:
        cupool.reserve(RESERVE)
    reserve_ns = time.perf_counter_ns() - t
    rng = random.Random(7)
    sizes = [int(math.exp(rng.uniform(math.log(64 << 10), math.log(64 << 20)))) for _ in range(N)]
    times, live = [], []
    for n in sizes:
        t = time.perf_counter_ns()
        live.append(cupool.alloc(n, stream=0))
        times.append(time.perf_counter_ns() - t)
    s = cupool.stats(0)
    print(json.dumps({
        "reserve_ms": reserve_ns / 1e6,
        "first_allocs_total_ms": sum(times) / 1e6,
        "first_alloc_median_us": statistics.median(times) / 1e3,
        "first_alloc_max_us": max(times) / 1e3,
        "device_allocs": s["num_device_alloc"],
        "bytes": sum(sizes),
    }))


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("--child-on", "--child-off"):
        child(sys.argv[1] == "--child-on")
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    res = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, f"--child-{mode}"],
                                 capture_output=True, text=True, timeout=120)
            line = (out.stdout.strip().splitlines() or [""])[-1]
            if out.returncode != 0 or not line.startswith("{"):
                print(mode, "failed:", (out.stderr.strip().splitlines() or [""])[-1])
                continue
            res[mode].append(json.loads(line))
    for mode, runs in res.items():
        if not runs:
            continue
        keys = runs[0].keys()
        med = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
        print(f"reserve {mode:3} ({len(runs)} processes, medians): {json.dumps(med)}")


if __name__ == "__main__":
    main()
