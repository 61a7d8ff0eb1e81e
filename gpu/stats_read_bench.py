"""What a program's memory monitoring costs per read: `torch.cuda.memory_allocated()`,
`torch.cuda.max_memory_reserved()` and `torch.cuda.memory_stats()` under PyTorch's own
allocator and under `cupool.torch.enable()` (which answers them from cupool's statistics),
and cupool's own `cupool.stats()` / `cupool.footprint()`. Training loops read these every
step to log them.

  python3 gpu/stats_read_bench.py [--reads N] [--label NAME] [--native]

The pool is first shaped like a training loop's: 96 tensors of 3-98 MiB and 512 small ones,
every other one freed, so the pool has free blocks in and past the mapped part of its VMM
arena. Each figure is the median of N reads, in µs; one JSON line on stdout. The cupool
package comes from python/ beside this folder (or PYTHONPATH), its library from
CUPOOL_LIBRARY.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def median_us(fn, reads):
    times = []
    for _ in range(reads):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reads", type=int, default=201)
    p.add_argument("--label", default=None, help="name for the JSON line (default: mode)")
    p.add_argument("--native", action="store_true",
                   help="PyTorch's own allocator (default: cupool.torch.enable())")
    args = p.parse_args(argv)
    if not args.native:
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
        import cupool
        import cupool.torch
        cupool.torch.enable()
    import torch

    mib = 1 << 20
    live = [torch.empty((3 + i) * mib + 4096 * i, dtype=torch.uint8, device="cuda")
            for i in range(96)]
    live += [torch.empty(512 + 64 * i, dtype=torch.uint8, device="cuda") for i in range(512)]
    del live[::2]
    torch.cuda.synchronize()
    out = {"label": args.label or ("native" if args.native else "cupool"),
           "reads": args.reads,
           "memory_allocated_us": median_us(torch.cuda.memory_allocated, args.reads),
           "max_memory_reserved_us": median_us(torch.cuda.max_memory_reserved, args.reads),
           "memory_stats_us": median_us(torch.cuda.memory_stats, args.reads)}
    if not args.native:
        out["cupool_stats_us"] = median_us(cupool.stats, args.reads)
        out["cupool_footprint_us"] = median_us(cupool.footprint, args.reads)
    out["allocated_bytes"] = torch.cuda.memory_allocated()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
