// PyTorch's caching allocator driven from C++ (no Python in the timed loops) through the
// same benchmark loops as bench_alloc.cu. Built once by torch_alloc_bench.py.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "bench_common.h"

struct TorchCaching {
  static const char *name() { return "torch_caching"; }
  static bool alloc(void **p, size_t n, cudaStream_t s) {
    try {
      *p = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(n, s);
      return *p != nullptr;
    } catch (...) {
      return false;
    }
  }
  static void release(void *p, cudaStream_t) { c10::cuda::CUDACachingAllocator::raw_delete(p); }
  static bench::Costs costs() { return bench::fast_costs(); }
};

void run_benchmarks(std::vector<int64_t> thread_counts) {
  c10::cuda::CUDAGuard guard(0);
  std::vector<int> threads(thread_counts.begin(), thread_counts.end());
  bench::run_all<TorchCaching>(threads);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run_benchmarks", &run_benchmarks, "run the allocation benchmarks on PyTorch's allocator");
}
