// cudaMalloc + cudaFree pair cost through the runtime, with or without LD_PRELOAD of the
// pool (the program cannot tell which, except through the exported query). Lines:
//   BENCH preload_pair <label> <size> median_ns=.. p99_ns=..
// Usage: preload_bench LABEL
#include <algorithm>
#include <vector>

#include "common.cuh"

int main(int argc, char **argv) {
  const char *label = argc > 1 ? argv[1] : "run";
  CK(cudaFree(0));
  const size_t sizes[] = {512, 1u << 20, 64u << 20};
  for (size_t n : sizes) {
    double t0 = now_ns();
    for (int i = 0; i < 20; i++) {
      void *p;
      CK(cudaMalloc(&p, n));
      CK(cudaFree(p));
    }
    // A pooled pair is ~0.1-1 us: time batches of 1000; a driver pair is ~60 us: batches of 5.
    bool slow = (now_ns() - t0) / 20 > 5000.0;
    const int batch = slow ? 5 : 1000, repeats = slow ? 60 : 200;
    std::vector<double> per_pair;
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
  }
  return 0;
}
