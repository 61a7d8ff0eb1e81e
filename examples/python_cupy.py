#!/usr/bin/env python3
"""CuPy on cupool: arrays of changing sizes, with a checksum to compare against CuPy's pool.

Usage: pip install ./python && python3 examples/python_cupy.py [--cupy-pool]
Needs CuPy and a GPU; without them it says SKIPPED and exits 0. --cupy-pool runs the same
work on CuPy's own memory pool, for comparison (the checksums must agree).
"""

import sys

try:
    import cupy
except ImportError:
    print("SKIPPED: CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)")
    sys.exit(0)

import cupool
import cupool.cupy

try:
    devices = cupy.cuda.runtime.getDeviceCount()
except cupy.cuda.runtime.CUDARuntimeError:
    devices = 0
if devices == 0:
    print("SKIPPED: CuPy sees no CUDA device")
    sys.exit(0)

if "--cupy-pool" not in sys.argv:
    cupool.cupy.enable()

checksum = 0.0
rng = cupy.random.default_rng(0)
for step in range(200):
    n = 1000 + (step * 7919) % 500_000
    a = rng.standard_normal(n, dtype=cupy.float32)
    b = cupy.sqrt(cupy.abs(a)) * 2.0
    checksum += float(b.sum())
    del a, b
cupy.cuda.Device().synchronize()
print(f"checksum {checksum:.6e}")
if cupool.cupy.enabled():
    s = cupool.stats(cupy.cuda.Device().id)
    print(
        f"cupool: {s['cupool.num_allocs']} allocations, {s['cupool.cache_hits']} cache hits, "
        f"reserved peak {s['reserved_bytes.all.peak']} bytes"
    )
