// Allocation benchmarks of cupool (stream-ordered and streamless), cudaMallocAsync from a
// warm pool, and cudaMalloc, on the same GPU and the same loops (bench_common.h).
// Usage: bench_alloc [allocator...]   (cupool_async cupool_sync cudaMallocAsync cudaMalloc)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <vector>
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

// What the driver calls on cupool's hot path cost by themselves (cupool calls
// cuCtxGetCurrent once per allocation and cuStreamGetId once per stream-ordered call).
static void driver_call_costs() {
  typedef CUresult (*get_current_fn)(CUcontext *);
  typedef CUresult (*stream_id_fn)(CUstream, unsigned long long *);
  void *a = nullptr, *b = nullptr;
  cudaDriverEntryPointQueryResult qa, qb;
  if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &a, 4000, cudaEnableDefault, &qa) != cudaSuccess ||
      cudaGetDriverEntryPointByVersion("cuStreamGetId", &b, 12000, cudaEnableDefault, &qb) != cudaSuccess || !a || !b)
    return;
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return;
  std::vector<double> t1, t2;
  for (int r = 0; r < 200; r++) {
    CUcontext c;
    unsigned long long id;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 1000; i++) ((get_current_fn)a)(&c);
    auto t1_ = std::chrono::steady_clock::now();
    for (int i = 0; i < 1000; i++) ((stream_id_fn)b)((CUstream)s, &id);
    auto t2_ = std::chrono::steady_clock::now();
    t1.push_back(std::chrono::duration<double, std::nano>(t1_ - t0).count() / 1000);
    t2.push_back(std::chrono::duration<double, std::nano>(t2_ - t1_).count() / 1000);
  }
  std::sort(t1.begin(), t1.end());
  std::sort(t2.begin(), t2.end());
  printf("BENCH driver_call cuCtxGetCurrent median_ns=%.1f\n", t1[t1.size() / 2]);
  printf("BENCH driver_call cuStreamGetId median_ns=%.1f\n", t2[t2.size() / 2]);
  cudaStreamDestroy(s);
}

int main(int argc, char **argv) {
  if (cudaFree(0) != cudaSuccess) {
    printf("BENCH_ERROR no CUDA device\n");
    return 1;
  }
  driver_call_costs();
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
