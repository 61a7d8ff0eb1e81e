"""`cupy.empty` + `del` per pair under CuPy's own memory pool and under cupool's three CuPy
allocators (direct: the library builds CuPy's objects itself; compiled: CuPy's
CFunctionAllocator over the library; python: the fallback),
switched round by round inside ONE process, so that the process-to-process spread of the
Python interpreter (±50% between fresh processes on the H100 hosts, docs/BENCHMARKS.md)
does not decide the comparison.

  CUPOOL_LIBRARY=.../libcupool.so PYTHONPATH=python python3 gpu/cupy_ops_ab.py [--rounds R]

Each round times 2000 pairs per size in two loop shapes (each size alone; the sizes
shuffled), for every allocator in turn (each round starting with the next one), through `cupy.empty` and through the allocator
alone (`alloc` rows: `allocator(size)` + `del`); the report gives medians over rounds (ns
per pair) and each cupool allocator's ratio to CuPy's pool.
"""
import argparse
import random
import statistics
import time

import cupy

import cupool.cupy as cc

SIZES = (512, 1 << 20, 64 << 20)
PAIRS = 2000


def loops(seed):
    each = [[s] * PAIRS for s in SIZES]
    mixed = [s for s in SIZES for _ in range(PAIRS)]
    random.Random(seed).shuffle(mixed)
    return {"each": each, "shuffled": [mixed]}


def time_loop(order):
    start = time.perf_counter_ns()
    for s in order:
        x = cupy.empty(s, dtype=cupy.uint8)
        del x
    return (time.perf_counter_ns() - start) / len(order)


def time_alloc(fn, order):
    start = time.perf_counter_ns()
    for s in order:
        x = fn(s)
        del x
    return (time.perf_counter_ns() - start) / len(order)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    pool = cupy.cuda.MemoryPool()
    cc.enable()
    assert cc.mode() == "direct", cc.mode()
    direct = cupy.cuda.get_allocator()
    compiled = cc._compiled_state[2][0].malloc
    allocators = {"cupy pool": pool.malloc, "cupool direct": direct,
                  "cupool compiled": compiled, "cupool python": cc.allocate}
    results = {}
    names = list(allocators)
    for r in range(args.rounds):
        # Each round starts with another allocator, so none always runs right after another.
        turn = names[r % len(names):] + names[:r % len(names)]
        for name in turn:
            fn = allocators[name]
            cupy.cuda.set_allocator(fn)
            for s in SIZES:  # warm: every size once
                cupy.empty(s, dtype=cupy.uint8)
            for shape, orders in loops(r).items():
                for order in orders:
                    key = (name, shape, order[0] if shape == "each" else "mixed")
                    results.setdefault(key, []).append(time_loop(order))
                    key = (name, "alloc " + shape, key[2])
                    results.setdefault(key, []).append(time_alloc(fn, order))
    cupy.cuda.runtime.deviceSynchronize()
    print(f"{'allocator':16s} {'shape':9s} {'size':>9s} {'ns/pair':>8s} {'vs pool':>8s}")
    for (name, shape, size), v in sorted(results.items(), key=lambda kv: (kv[0][1], str(kv[0][2]), kv[0][0])):
        med = statistics.median(v)
        base = statistics.median(results[("cupy pool", shape, size)])
        print(f"{name:16s} {shape:9s} {str(size):>9s} {med:8.0f} {med / base:7.2f}x")


if __name__ == "__main__":
    main()
