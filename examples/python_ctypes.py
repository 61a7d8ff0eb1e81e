#!/usr/bin/env python3
"""cupool from plain Python with ctypes: no package, only libcupool.so and its C API.

Usage: python3 examples/python_ctypes.py [path/to/libcupool.so]
The library is taken from the argument, else $CUPOOL_LIBRARY, else target/release of this
repository (`cargo build --release`). Runs on the GPU when libcuda.so.1 has a device, and
on cupool's host backend (host memory, simulated streams) otherwise.
"""

import ctypes
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CUPOOL_OK = 0
CUPOOL_ERROR_BUFFER_TOO_SMALL = 11
# Two streams every CUDA context has: the legacy default stream and the per-thread one.
STREAMS = {"legacy default": 0, "per-thread default": 2}


def library_path():
    if len(sys.argv) > 1:
        return sys.argv[1]
    return os.environ.get("CUPOOL_LIBRARY") or os.path.join(
        HERE, "..", "target", "release", "libcupool.so"
    )


def gpu_present():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def main():
    lib = ctypes.CDLL(library_path())
    lib.cupool_alloc_async.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
    lib.cupool_free_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cupool_stats_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    lib.cupool_empty_cache.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
    lib.cupool_config_set.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.cupool_config_get.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    lib.cupool_status_string.restype = ctypes.c_char_p

    def check(status, what):
        if status != CUPOOL_OK:
            sys.exit(f"{what}: {lib.cupool_status_string(status).decode()}")

    backend = ctypes.create_string_buffer(16)
    check(lib.cupool_config_get(b"backend", backend, 16, None), "config_get(backend)")
    if backend.value == b"host":
        print("running on the host backend (CUPOOL_CONF)")
    elif gpu_present():
        print("GPU found: running on the cuda backend")
    else:
        check(lib.cupool_config_set(b"backend", b"host"), "config_set(backend, host)")
        print("no GPU found: running on the host backend")

    sizes = [512, 4096, 100_000, 1 << 20, 3 << 20, 12 << 20]
    for name, stream in STREAMS.items():
        for _ in range(100):
            blocks = []
            for size in sizes:
                ptr = ctypes.c_void_p()
                check(lib.cupool_alloc_async(ctypes.byref(ptr), size, stream), f"alloc {size}")
                blocks.append(ptr.value)
            for ptr in blocks:
                check(lib.cupool_free_async(ptr, stream), "free")
        print(f"{len(sizes) * 100} allocations and frees on the {name} stream")

    needed = ctypes.c_size_t(0)
    lib.cupool_stats_json(-1, None, 0, ctypes.byref(needed))
    buf = ctypes.create_string_buffer(needed.value)
    check(lib.cupool_stats_json(-1, buf, needed.value, ctypes.byref(needed)), "stats_json")
    stats = json.loads(buf.value)
    print(
        "allocations {num_allocs}, cache hits {cache_hits}, misses {cache_misses}, "
        "reserved {reserved} bytes (peak {peak})".format(
            reserved=stats["reserved_bytes"]["current"], peak=stats["reserved_bytes"]["peak"], **stats
        )
    )
    released = ctypes.c_size_t(0)
    check(lib.cupool_empty_cache(ctypes.byref(released)), "empty_cache")
    print(f"empty_cache released {released.value} bytes")


if __name__ == "__main__":
    main()
