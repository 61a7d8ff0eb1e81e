// What a context fence costs the host: cuCtxRecordEvent, then cuEventQuery of the fence
// recorded one iteration earlier (what a pool's free-then-allocate loop does), timed call by
// call, medians of 200 000 iterations; then how soon a fence completes. Nothing of cupool is
// called, so running it with and without LD_PRELOAD of a cupool library shows whether the
// library's presence changes what the driver's calls cost:
//   nvcc -O2 -std=c++17 -arch=native -Igpu gpu/tools/fence_cost.cu -o fence_cost -ldl
//   ./fence_cost plain; LD_PRELOAD=libcupool.so ./fence_cost api
//   LD_PRELOAD=libcupool_preload.so ./fence_cost preload
// What ran before the loop (docs/BENCHMARKS.md, "Session of 2026-11-27 (second)"):
//   FENCE_STREAMS=N      N idle non-blocking streams (FENCE_WORK=1: each ran a memset)
//   FENCE_ALLOC=BYTES    one cudaMalloc written and freed
//   FENCE_KERNEL=1 / FENCE_STEPS=mask   a kernel on a non-blocking stream, in parts (below)
//   FENCE_PROBE=1        cuStreamIsCapturing(legacy) before each record, as the C API's pool
// Prints: FENCE <label> record_ns=.. query_prev_ns=.. query_new_ns=.. prev_done=..% new_done=..%
//         LATENCY <label> delay_ns=.. complete_at_first_query=..% median_ns_to_complete=..
// and, where a cupool library is preloaded, the same loop through its pinned pool:
//   POOL <label> pinned_pair_ns=..  (cupool_host_alloc + cupool_host_free of 1 MiB)
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include "common.cuh"

typedef CUresult (*record_fn)(CUcontext, CUevent);
typedef CUresult (*query_fn)(CUevent);
typedef CUresult (*create_fn)(CUevent *, unsigned);
typedef CUresult (*ctx_fn)(CUcontext *);
typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

__device__ uint8_t g_scratch[1 << 20];

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char **argv) {
  const char *label = argc > 1 ? argv[1] : "run";
  CK(cudaFree(0));
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!cuda) cuda = dlopen("libcuda.so.1", RTLD_NOW);
  gpa_fn gpa = (gpa_fn)dlsym(cuda, "cuGetProcAddress_v2");
  void *p = nullptr;
  CUdriverProcAddressQueryResult q;
  gpa("cuCtxRecordEvent", &p, 12050, 0, &q);
  record_fn record = (record_fn)p;
  gpa("cuEventQuery", &p, 2000, 0, &q);
  query_fn query = (query_fn)p;
  gpa("cuEventCreate", &p, 2000, 0, &q);
  create_fn create = (create_fn)p;
  gpa("cuCtxGetCurrent", &p, 4000, 0, &q);
  ctx_fn current = (ctx_fn)p;
  CUcontext ctx;
  if (!record || !query || !create || !current || current(&ctx) != CUDA_SUCCESS) {
    printf("FENCE %s unavailable\n", label);
    return 1;
  }
  // FENCE_STREAMS=N: N more streams in the context (idle), as a program with a stream pool.
  int extra = getenv("FENCE_STREAMS") ? atoi(getenv("FENCE_STREAMS")) : 0;
  std::vector<cudaStream_t> streams(extra);
  for (auto &st : streams) CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  // FENCE_WORK=1: each of those streams ran a copy once (streams that have done work).
  if (getenv("FENCE_WORK") && extra > 0) {
    void *d;
    CK(cudaMalloc(&d, 4096));
    for (auto &st : streams) CK(cudaMemsetAsync(d, 0, 4096, st));
    CK(cudaDeviceSynchronize());
  }
  // FENCE_ALLOC=BYTES: one cudaMalloc of that size, written and freed before the loop (under
  // the preload: a block of cupool's VMM arena with vmm:on).
  if (getenv("FENCE_ALLOC")) {
    size_t bytes = strtoull(getenv("FENCE_ALLOC"), nullptr, 10);
    void *d;
    CK(cudaMalloc(&d, bytes));
    CK(cudaMemset(d, 0, bytes));
    CK(cudaDeviceSynchronize());
    CK(cudaFree(d));
  }
  // FENCE_KERNEL=1: a kernel ran on a non-blocking stream first (what a program does);
  // FENCE_STEPS=mask runs parts of that: 1 creates the stream, 2 allocates and frees the
  // buffer (cudaMalloc), 4 launches the kernel (into a __device__ array unless 2), 8 runs
  // a memset on the buffer instead, 16 synchronises the stream instead of the device, 32
  // keeps the buffer.
  int steps = getenv("FENCE_KERNEL") ? 1 | 2 | 4 | 16 : 0;
  if (getenv("FENCE_STEPS")) steps = atoi(getenv("FENCE_STEPS"));
  if (steps) {
    cudaStream_t st = 0;
    if (steps & 1) CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    uint8_t *d = nullptr;
    if (steps & 2) CK(cudaMalloc(&d, 1 << 20));
    if (steps & 4) {
      uint8_t *target = d;
      if (!target) CK(cudaGetSymbolAddress((void **)&target, g_scratch));
      fill_pattern<<<grid_for(1 << 20), 256, 0, st>>>(target, 1 << 20, 1);
      CK(cudaGetLastError());
    }
    if ((steps & 8) && d) CK(cudaMemsetAsync(d, 0, 1 << 20, st));
    if (steps & 16) CK(cudaStreamSynchronize(st));  // 16: the stream, not the device
    else CK(cudaDeviceSynchronize());
    if (d && !(steps & 32)) CK(cudaFree(d));  // 32: the buffer stays allocated
  }
  // FENCE_PROBE=1: ask cuStreamIsCapturing on the legacy stream before each record, as
  // cupool's pool does through its C API (the interposer does not).
  typedef CUresult (*capturing_fn)(CUstream, CUstreamCaptureStatus *);
  gpa("cuStreamIsCapturing", &p, 10000, 0, &q);
  capturing_fn capturing = getenv("FENCE_PROBE") ? (capturing_fn)p : nullptr;
  const int n = 200000, ring = 8;
  CUevent ev[ring];
  for (int i = 0; i < ring; i++) create(&ev[i], CU_EVENT_DISABLE_TIMING);
  std::vector<double> rec, qprev, qnew;
  rec.reserve(n);
  qprev.reserve(n);
  qnew.reserve(n);
  long prev_done = 0, new_done = 0;
  record(ctx, ev[0]);
  for (int i = 1; i < n; i++) {
    double t0 = now_ns();
    if (capturing) {
      CUstreamCaptureStatus cs;
      capturing(CU_STREAM_LEGACY, &cs);
    }
    record(ctx, ev[i % ring]);
    double t1 = now_ns();
    CUresult r = query(ev[(i - 1) % ring]);
    double t2 = now_ns();
    prev_done += r == CUDA_SUCCESS;
    if (i % 2 == 0) {  // every other iteration, also ask the fence just recorded
      new_done += query(ev[i % ring]) == CUDA_SUCCESS;
      qnew.push_back(now_ns() - t2);
    }
    rec.push_back(t1 - t0);
    qprev.push_back(t2 - t1);
  }
  typedef int (*host_alloc_fn)(void **, size_t);
  typedef int (*host_free_fn)(void *);
  host_alloc_fn halloc = (host_alloc_fn)dlsym(RTLD_DEFAULT, "cupool_host_alloc");
  host_free_fn hfree = (host_free_fn)dlsym(RTLD_DEFAULT, "cupool_host_free");
  if (halloc && hfree) {
    std::vector<double> pairs;
    for (int r = 0; r < 200; r++) {
      double t0 = now_ns();
      for (int i = 0; i < 1000; i++) {
        void *b = nullptr;
        if (halloc(&b, 1 << 20) != 0 || hfree(b) != 0) return 1;
      }
      pairs.push_back((now_ns() - t0) / 1000);
    }
    printf("POOL %s pinned_pair_ns=%.1f\n", label, median(pairs));
  }
  printf("STREAMS %s extra=%d\n", label, extra);
  printf("FENCE %s record_ns=%.1f query_prev_ns=%.1f query_new_ns=%.1f prev_done=%.1f%% "
         "new_done=%.1f%%\n",
         label, median(rec), median(qprev), median(qnew), 100.0 * prev_done / (n - 1),
         100.0 * new_done / qnew.size());
  // How soon a fence completes: record, then spin on queries, by delay before the first.
  for (int delay_ns : {0, 500, 1000, 2000, 5000}) {
    std::vector<double> lat;
    long first_done = 0;
    for (int i = 0; i < 2000; i++) {
      record(ctx, ev[0]);
      double t0 = now_ns();
      while (now_ns() - t0 < delay_ns) {
      }
      bool first = true;
      while (query(ev[0]) != CUDA_SUCCESS) first = false;
      first_done += first;
      lat.push_back(now_ns() - t0);
    }
    printf("LATENCY %s delay_ns=%d complete_at_first_query=%.1f%% median_ns_to_complete=%.0f\n", label,
           delay_ns, 100.0 * first_done / 2000, median(lat));
  }
  return 0;
}
