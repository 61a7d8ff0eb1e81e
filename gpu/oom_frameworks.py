"""Limits and out-of-memory across PyTorch and CuPy in one process under the preload (the
reliability issue): both frameworks allocate from the one cupool pool, under one
`memory_limit`.

Run as the suite does:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 CUPOOL_CONF=memory_limit:2G \\
        LD_PRELOAD=libcupool_preload.so python gpu/oom_frameworks.py

1. PyTorch fills the limit with 256 MiB tensors until it raises its out-of-memory error.
2. CuPy, in the same process, then fails cleanly with its own out-of-memory error (its
   memory pool gives back what it caches and retries first), and PyTorch's tensors keep
   their contents.
3. Half of PyTorch's tensors are freed: CuPy allocates, PyTorch allocates again.
4. The pool counted the failures, never held more than the limit, and after everything is
   freed and `cupool_empty_cache` is called holds nothing.

Prints PASS/FAIL lines and "RESULT ok" or "RESULT FAILED" (exit 1). Without cupool in the
process it prints "SKIPPED" and exits 2: the check means nothing without the limit.
"""
import ctypes
import json
import sys

import cupy
import torch

CHUNK = 256 << 20
failures = []
# With PYTORCH_NO_CUDA_MEMORY_CACHING=1 PyTorch calls cudaMalloc itself and reports its
# failure as a CUDA error ("CUDA error: out of memory", `torch.AcceleratorError`), not as
# `torch.cuda.OutOfMemoryError`, with or without cupool.
TORCH_OOM = tuple(
    e for e in (torch.cuda.OutOfMemoryError, getattr(torch, "AcceleratorError", None)) if e
)


def is_torch_oom(e):
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} oom_frameworks.{name}{': ' + detail if detail else ''}")
    if not ok:
        failures.append(name)


def cupool_call(name):
    try:
        return getattr(ctypes.CDLL(None), name)
    except AttributeError:
        return None


def stats():
    fn = cupool_call("cupool_stats_json")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    buf = ctypes.create_string_buffer(8192)
    needed = ctypes.c_size_t(0)
    assert fn(-1, buf, len(buf), ctypes.byref(needed)) == 0
    return json.loads(buf.value.decode())


def main():
    if cupool_call("cupool_stats_json") is None:
        print("SKIPPED: cupool is not in this process (run under LD_PRELOAD=libcupool_preload.so)")
        return 2
    limit_fn = cupool_call("cupool_get_memory_limit")
    torch.cuda.init()
    base = stats()["reserved_bytes"]["current"]

    # 1. PyTorch fills the limit.
    tensors = []
    torch_oom = None
    for i in range(1000):
        try:
            tensors.append(torch.full((CHUNK // 4,), float(i), device="cuda"))
        except TORCH_OOM as e:
            if not is_torch_oom(e):
                raise
            torch_oom = e
            break
    check("torch_hits_the_limit", torch_oom is not None and len(tensors) >= 2,
          f"{len(tensors)} tensors of 256 MiB before {type(torch_oom).__name__}")

    # 2. CuPy in the same process: a clean out-of-memory error of its own.
    cupy_oom = None
    try:
        cupy.ones(CHUNK // 8, dtype=cupy.float64)
    except cupy.cuda.memory.OutOfMemoryError as e:
        cupy_oom = e
    check("cupy_fails_cleanly", cupy_oom is not None, type(cupy_oom).__name__)
    torch.cuda.synchronize()
    # Read back with no device memory (the pool is at its limit): the ends of each tensor.
    intact = all(
        bool((t[:16].cpu() == float(i)).all() and (t[-16:].cpu() == float(i)).all())
        for i, t in enumerate(tensors)
    )
    check("torch_tensors_intact_after_both_failures", intact)

    # 3. Room again: both frameworks allocate.
    del tensors[len(tensors) // 2:]
    torch.cuda.synchronize()
    a = None
    try:
        a = cupy.ones(CHUNK // 8, dtype=cupy.float64)
        ok = float(a.sum()) == CHUNK // 8
    except cupy.cuda.memory.OutOfMemoryError:
        ok = False
    check("cupy_allocates_after_torch_frees", ok)
    try:
        t = torch.ones(CHUNK // 4, device="cuda")
        ok = float(t.sum()) == CHUNK // 4
    except TORCH_OOM:
        ok = False
    check("torch_allocates_again", ok)

    s = stats()
    check("pool_counted_the_failures", s["num_ooms"] >= 2, f"num_ooms={s['num_ooms']}")
    limit = None
    if limit_fn is not None:
        limit_fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
        v = ctypes.c_uint64(0)
        if limit_fn(0, ctypes.byref(v)) == 0 and v.value:
            limit = v.value
    if limit:
        check("reserved_never_passed_the_limit", s["reserved_bytes"]["peak"] <= limit,
              f"peak {s['reserved_bytes']['peak']} limit {limit}")

    # 4. Everything back.
    del a, t, tensors
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.synchronize()
    empty = cupool_call("cupool_empty_cache")
    empty.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
    released = ctypes.c_size_t(0)
    empty(ctypes.byref(released))
    after = stats()["reserved_bytes"]["current"]
    check("reserved_back_to_start_after_empty_cache", after <= base,
          f"reserved {after} (at start {base}), released {released.value}")
    print("RESULT " + ("ok" if not failures else "FAILED " + ",".join(failures)))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
