"""PyTorch's caching allocator through the suite's benchmark loops (bench_common.h).

  torch_alloc_bench.py BUILD_DIR --build-only   compile the extension (ninja, once)
  torch_alloc_bench.py BUILD_DIR                 run it: BENCH lines on stdout
"""
import os
import sys
import time

import torch
from torch.utils.cpp_extension import load

HERE = os.path.dirname(os.path.abspath(__file__))


def build(build_dir):
    os.makedirs(build_dir, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", "16")
    return load(
        name="cupool_torch_alloc_bench",
        sources=[os.path.join(HERE, "torch_alloc_ext.cpp")],
        extra_include_paths=[HERE],
        extra_cflags=["-O2"],
        build_directory=build_dir,
        with_cuda=True,
        verbose=False,
    )


def main():
    build_dir = sys.argv[1]
    ext = build(build_dir)
    if "--build-only" in sys.argv:
        print("torch extension built")
        return
    torch.cuda.init()
    torch.empty(1, device="cuda")
    ext.run_benchmarks([1, 4, 16])
    # The Python-level cost, for reference.
    for _ in range(1000):
        y = torch.empty(1024, device="cuda")
        del y
    samples = []
    for _ in range(50):
        t0 = time.perf_counter()
        for _ in range(200):
            y = torch.empty(1024, device="cuda")
            del y
        samples.append((time.perf_counter() - t0) / 200 * 1e9)
    samples.sort()
    print(f"BENCH python_empty torch_caching 4096 median_ns={samples[len(samples) // 2]:.1f} "
          f"p99_ns={samples[-1]:.1f}", flush=True)


if __name__ == "__main__":
    main()
