"""CuPy allocations through the preload: arrays made and freed, a checksum printed.

CuPy carries its own static CUDA runtime, so a cudaMalloc symbol hook never sees it; the
preload's driver-level hooks must. Runs CuPy's default memory pool and then no pool
(every array a driver allocation). Stdout is compared with and without the preload; the
pool's stats go to stderr.
"""
import os
import sys

import cupy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pool_stats import pool_stats_to_stderr  # noqa: E402


def workload(tag):
    total = 0
    for i in range(200):
        n = 1000 + (i * 7919) % 300000
        a = cupy.arange(n, dtype=cupy.int64)
        b = (a * (i + 3)) % 1000003
        c = cupy.cumsum(b) % 998244353
        total = (total * 31 + int(c[-1]) + int(b.sum())) % (1 << 61)
        del a, b, c
    big = cupy.ones((64 << 20) // 8, dtype=cupy.float64)
    total = (total + int(big.sum())) % (1 << 61)
    del big
    cupy.cuda.Device().synchronize()
    print(f"{tag} checksum {total}")


workload("cupy_default_pool")
cupy.get_default_memory_pool().free_all_blocks()
cupy.cuda.set_allocator(None)  # every array now a runtime/driver allocation
workload("cupy_no_pool")
pool_stats_to_stderr("cupy")
