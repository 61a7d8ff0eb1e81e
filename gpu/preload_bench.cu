// cudaMalloc + cudaFree pair cost through the runtime, with or without LD_PRELOAD of the
// pool (the program cannot tell which, except through the exported query). Lines:
//   BENCH preload_pair <label> <size> median_ns=.. p99_ns=..
// Usage: preload_bench LABEL   (PRELOAD_BENCH_ORDER=desc: 64 MiB, 1 MiB, then 512 B, since
// what ran before changes what the pool holds)
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "common.cuh"

// The current value of one level of the preloaded pool's statistics, -1 without the preload.
static long long pool_level_now(const char *key) {
  char counter[64];
  snprintf(counter, sizeof counter, "%s\":{\"current", key);
  return pool_counter(counter);
}

int main(int argc, char **argv) {
  const char *label = argc > 1 ? argv[1] : "run";
  CK(cudaFree(0));
  std::vector<size_t> sizes = {512, 1u << 20, 64u << 20};
  const char *order = getenv("PRELOAD_BENCH_ORDER");
  if (order != nullptr && strcmp(order, "desc") == 0) std::reverse(sizes.begin(), sizes.end());
  for (size_t n : sizes) {
    // Two warm-up passes: the first includes the pool's start and its first segment, so
    // only the second tells a pooled pair from a driver pair.
    double t0 = 0;
    for (int pass = 0; pass < 2; pass++) {
      t0 = now_ns();
      for (int i = 0; i < 20; i++) {
        void *p;
        CK(cudaMalloc(&p, n));
        CK(cudaFree(p));
      }
    }
    // A pooled pair is ~0.1-1 us: time batches of 1000; a driver pair is ~60 us: batches of 5.
    bool slow = (now_ns() - t0) / 20 > 5000.0;
    const int batch = slow ? 5 : 1000, repeats = slow ? 60 : 200;
    std::vector<double> per_pair;
    long long fences0 = pool_counter("fences_recorded"), grows0 = pool_counter("device_allocs");
    long long queries0 = pool_counter("fence_queries");
    for (int r = 0; r < repeats; r++) {
      double t0 = now_ns();
      for (int i = 0; i < batch; i++) {
        void *p;
        CK(cudaMalloc(&p, n));
        CK(cudaFree(p));
      }
      per_pair.push_back((now_ns() - t0) / batch);
    }
    std::sort(per_pair.begin(), per_pair.end());
    printf("BENCH preload_pair %s %zu median_ns=%.1f p99_ns=%.1f batch=%d repeats=%d\n", label, n,
           per_pair[per_pair.size() / 2], per_pair[(size_t)(0.99 * (per_pair.size() - 1))], batch, repeats);
    // Why a pooled pair costs what it does: context fences and segment allocations per pair,
    // and what the pool holds for it (a second copy of a lone block, Note [lone fences]).
    if (fences0 >= 0)
      printf("INFO preload_pair %s %zu fences_per_pair=%.3f queries_per_pair=%.3f device_allocs=%lld "
             "reserved_mib=%.0f\n",
             label, n, (double)(pool_counter("fences_recorded") - fences0) / (batch * repeats),
             queries0 < 0 ? -1.0 : (double)(pool_counter("fence_queries") - queries0) / (batch * repeats),
             pool_counter("device_allocs") - grows0, pool_level_now("reserved_bytes") / 1048576.0);
  }
  return 0;
}
