// Allocation benchmarks of cupool (stream-ordered and streamless), cudaMallocAsync from a
// warm pool, and cudaMalloc, on the same GPU and the same loops (bench_common.h).
// Usage: bench_alloc [allocator...]   (cupool_async cupool_sync cudaMallocAsync cudaMalloc)
#include <cuda_runtime.h>
#include <string.h>

#include <string>

#include "bench_common.h"
#ifndef BENCH_WITHOUT_CUPOOL
#include "cupool_api.h"

struct CupoolAsync {
  static const char *name() { return "cupool_async"; }
  static bool alloc(void **p, size_t n, cudaStream_t s) { return (int)cupool_alloc_async(p, n, s) == CUP_OK; }
  static void release(void *p, cudaStream_t s) { cupool_free_async(p, s); }
  static bench::Costs costs() { return bench::fast_costs(); }
};

struct CupoolSync {
  static const char *name() { return "cupool_sync"; }
  static bool alloc(void **p, size_t n, cudaStream_t) { return (int)cupool_alloc(p, n) == CUP_OK; }
  static void release(void *p, cudaStream_t) { cupool_free(p); }
  static bench::Costs costs() { return bench::fast_costs(); }
};

#endif

struct MallocAsync {
  static const char *name() { return "cudaMallocAsync"; }
  static bool alloc(void **p, size_t n, cudaStream_t s) { return cudaMallocAsync(p, n, s) == cudaSuccess; }
  static void release(void *p, cudaStream_t s) { cudaFreeAsync(p, s); }
  static bench::Costs costs() { return bench::fast_costs(); }
};

struct Malloc {
  static const char *name() { return "cudaMalloc"; }
  static bool alloc(void **p, size_t n, cudaStream_t) { return cudaMalloc(p, n) == cudaSuccess; }
  static void release(void *p, cudaStream_t) { cudaFree(p); }
  static bench::Costs costs() { return bench::slow_costs(); }
};

int main(int argc, char **argv) {
  if (cudaFree(0) != cudaSuccess) {
    printf("BENCH_ERROR no CUDA device\n");
    return 1;
  }
  // A warm stream-ordered pool keeps what is freed: the fair comparison for a cache.
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, 0) == cudaSuccess) {
    uint64_t keep_all = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
  }
  std::vector<int> threads = {1, 4, 16};
  auto wanted = [&](const char *name) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; i++)
      if (strcmp(argv[i], name) == 0) return true;
    return false;
  };
#ifndef BENCH_WITHOUT_CUPOOL
  if (wanted("cupool_async")) bench::run_all<CupoolAsync>(threads);
  if (wanted("cupool_sync")) bench::run_all<CupoolSync>(threads);
#else
  printf("BENCH_UNAVAILABLE cupool (built without libcupool.so)\n");
#endif
  if (wanted("cudaMallocAsync")) bench::run_all<MallocAsync>(threads);
  if (wanted("cudaMalloc")) bench::run_all<Malloc>(threads);
  return 0;
}
