// Where a streamless pair's time goes, size by size: the pair's median beside the fences,
// queries and device waits the pool made per pair.
//   api: cupool_alloc + cupool_free (run with LD_PRELOAD=libcupool.so, or the preload);
//   rt:  cudaMalloc + cudaFree (run under LD_PRELOAD=libcupool_preload.so).
// PAIR_DIRTY=1 first runs a kernel on a non-blocking stream and synchronises only that
// stream, the state every PyTorch process is in, where a fence query costs ~1.5 us on an
// H200 host (docs/BENCHMARKS.md, the sixteenth session); PAIR_ORDER=desc runs the sizes
// from large to small.
//   nvcc -O2 -std=c++17 -arch=native -I include -I gpu gpu/tools/pair_fences.cu -o /tmp/pf -ldl
//   LD_PRELOAD=.../libcupool_preload.so /tmp/pf rt
// Lines: PAIR <mode> <state> <size> median_ns=.. fences=.. queries=.. device_waits=.. (per pair)
// misses=.. (per pair) grow_waits=.. device_allocs=.. (in the timed pairs) segments=..
#include <algorithm>
#include <vector>

#include "common.cuh"

__global__ void touch(int *p) { p[threadIdx.x] += 1; }

typedef int (*alloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);

int main(int argc, char **argv) {
  const bool api = argc > 1 && strcmp(argv[1], "api") == 0;
  const bool dirty = getenv("PAIR_DIRTY") && strcmp(getenv("PAIR_DIRTY"), "1") == 0;
  alloc_fn pool_alloc = (alloc_fn)dlsym(RTLD_DEFAULT, "cupool_alloc");
  free_fn pool_free = (free_fn)dlsym(RTLD_DEFAULT, "cupool_free");
  if (api && (!pool_alloc || !pool_free)) {
    printf("FAIL pair_fences: no cupool_alloc/cupool_free in the process (LD_PRELOAD?)\n");
    return 2;
  }
  CK(cudaFree(0));
  if (dirty) {
    cudaStream_t s;
    int *buf;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const long long allocs_before = pool_counter("num_allocs");
    CK(cudaMalloc(&buf, 1024));
    const bool pooled = pool_counter("num_allocs") > allocs_before;  // under the preload
    touch<<<1, 32, 0, s>>>(buf);
    CK(cudaStreamSynchronize(s));
    // Under the preload the buffer is a pool block: freed, so that it holds no place in the
    // small segment (a 1 MiB block would find one place there instead of two, and fence
    // every pair). Without it, `cudaFree` would synchronise the device, which ends the
    // state this mode is for: the driver's buffer is kept.
    if (pooled) CK(cudaFree(buf));
  }
  std::vector<size_t> sizes = {512, 1u << 20, 64u << 20};
  const char *order = getenv("PAIR_ORDER");
  if (order && strcmp(order, "desc") == 0) std::reverse(sizes.begin(), sizes.end());
  auto pair = [&](size_t n) {
    void *p = nullptr;
    if (api) {
      if (pool_alloc(&p, n) != 0 || pool_free(p) != 0) {
        printf("FAIL pair_fences: cupool pair of %zu\n", n);
        exit(2);
      }
    } else {
      CK(cudaMalloc(&p, n));
      CK(cudaFree(p));
    }
  };
  for (size_t n : sizes) {
    for (int i = 0; i < 2000; i++) pair(n);
    long long f0 = pool_counter("fences_recorded"), q0 = pool_counter("fence_queries");
    long long w0 = pool_counter("fence_device_waits"), g0 = pool_counter("device_allocs");
    long long m0 = pool_counter("cache_misses"), gw0 = pool_counter("grow_waits");
    const int batch = 1000, repeats = 200;
    std::vector<double> per_pair;
    for (int r = 0; r < repeats; r++) {
      double t0 = now_ns();
      for (int i = 0; i < batch; i++) pair(n);
      per_pair.push_back((now_ns() - t0) / batch);
    }
    std::sort(per_pair.begin(), per_pair.end());
    const double pairs = (double)batch * repeats;
    printf("PAIR %s %s %zu median_ns=%.1f fences=%.3f queries=%.3f device_waits=%.3f misses=%.3f "
           "grow_waits=%lld device_allocs=%lld segments=%lld\n",
           api ? "api" : "rt", dirty ? "dirty" : "fresh", n, per_pair[per_pair.size() / 2],
           (pool_counter("fences_recorded") - f0) / pairs, (pool_counter("fence_queries") - q0) / pairs,
           (pool_counter("fence_device_waits") - w0) / pairs, (pool_counter("cache_misses") - m0) / pairs,
           pool_counter("grow_waits") - gw0, pool_counter("device_allocs") - g0, pool_counter("segments"));
  }
  return 0;
}
