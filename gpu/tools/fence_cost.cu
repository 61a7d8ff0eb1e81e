// What a context fence costs the host: cuCtxRecordEvent, then cuEventQuery of the fence
// recorded one iteration earlier (what a pool's free-then-allocate loop does), timed call by
// call, medians of 200 000 iterations; then how soon a fence completes. Nothing of cupool is
// called, so running it with and without LD_PRELOAD of a cupool library shows whether the
// library's presence changes what the driver's calls cost:
//   nvcc -O2 -std=c++17 -arch=native -Igpu gpu/tools/fence_cost.cu -o fence_cost -ldl -lcuda
//   ./fence_cost plain; LD_PRELOAD=libcupool.so ./fence_cost api
//   LD_PRELOAD=libcupool_preload.so ./fence_cost preload
// What ran before the loop (docs/BENCHMARKS.md, "Session of 2026-11-27 (second)"):
//   FENCE_STREAMS=N      N idle non-blocking streams (FENCE_WORK=1: each ran a memset)
//   FENCE_ALLOC=BYTES    one cudaMalloc written and freed
//   FENCE_KERNEL=1 / FENCE_STEPS=mask   a kernel on a non-blocking stream, in parts (below)
//   FENCE_PROBE=1        cuStreamIsCapturing(legacy) before each record, as the C API's pool
//   FENCE_RESET=k        after FENCE_STEPS, one call that might end the slow query (below)
// Other ways to learn that a fence completed ("Session of 2026-11-27 (third)"), each a loop
// of its own before the plain one: after the context fence a private non-blocking stream
// waits on it (cuStreamWaitEvent), then
//   FENCE_HOSTWORD=1     writes the fence's number into a mapped host word
//                        (cuStreamWriteValue64): completion is a load;
//   FENCE_HOSTWORD=2     nothing more (does the wait change what the query costs?);
//   FENCE_HOSTWORD=3     records an event of its own, which is queried instead;
//   FENCE_HOSTWORD=4     nothing more, and the check is cuStreamQuery of the private stream
//                        (idle once every fence it waited on completed).
//   HOSTWORD <label> record_ns=.. (all calls) load_ns=.. (the check) prev_done=..% new_done=..%
//   SPLIT <label> record_ns=.. wait_ns=.. write_ns=..   (the calls apart)
//   HYBRID <label> query_ns=.. (mode 1: a load, then cuEventQuery when the word has not landed)
//   HOSTLAT <label> delay_ns=.. complete_at_first_load=..% median_ns_to_complete=..
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
typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t,
                           CUdriverProcAddressQueryResult *);

__device__ uint8_t g_scratch[1 << 20];
static cudaStream_t g_work_stream = 0;  // the stream FENCE_STEPS ran its kernel on

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A driver function by name and version through cuGetProcAddress; nullptr when missing.
template <typename F>
static F resolve(gpa_fn gpa, const char *name, int version) {
  void *p = nullptr;
  CUdriverProcAddressQueryResult q;
  return gpa(name, &p, version, 0, &q) == CUDA_SUCCESS ? (F)p : nullptr;
}

typedef CUresult (*wait_fn)(CUstream, CUevent, unsigned);
typedef CUresult (*write64_fn)(CUstream, CUdeviceptr, cuuint64_t, unsigned);

// The host-word fence (FENCE_HOSTWORD=1): see the header comment.
static void host_word_loop(const char *label, CUcontext ctx, record_fn record, query_fn query,
                           gpa_fn gpa) {
  wait_fn wait = resolve<wait_fn>(gpa, "cuStreamWaitEvent", 3020);
  write64_fn write64 = resolve<write64_fn>(gpa, "cuStreamWriteValue64", 12000);
  int dev = 0, ops = 0;
  CK(cudaGetDevice(&dev));
  cuDeviceGetAttribute(&ops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev);
  if (!wait || !write64) {
    printf("HOSTWORD %s unavailable (no cuStreamWriteValue64)\n", label);
    return;
  }
  printf("HOSTWORD %s mem_ops_64=%d\n", label, ops);
  volatile uint64_t *word = nullptr;
  CK(cudaHostAlloc((void **)&word, 64, cudaHostAllocMapped));
  *word = 0;
  CUdeviceptr dword;
  if (cuMemHostGetDevicePointer(&dword, (void *)word, 0) != CUDA_SUCCESS) {
    printf("HOSTWORD %s unavailable (no device pointer)\n", label);
    return;
  }
  CUstream priv;
  CK(cudaStreamCreateWithFlags((cudaStream_t *)&priv, cudaStreamNonBlocking));
  const int n = 200000, ring = 8;
  CUevent ev[ring];
  for (int i = 0; i < ring; i++) cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING);
  uint64_t seq = 0;
  // FENCE_HOSTWORD=2: the wait only, no write (does a wait on the fence change what its
  // driver query costs?); the three calls are timed apart in SPLIT.
  bool wait_only = atoi(getenv("FENCE_HOSTWORD")) == 2;
  // FENCE_HOSTWORD=3: instead of the write, an event recorded on the private stream after
  // its wait (a stream event standing for the context fence); queried instead of the word.
  bool relay = atoi(getenv("FENCE_HOSTWORD")) == 3;
  // FENCE_HOSTWORD=4: the wait only, and the private stream queried (cuStreamQuery).
  bool stream_query = atoi(getenv("FENCE_HOSTWORD")) == 4;
  CUevent relay_ev[8];
  for (auto &e : relay_ev) cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
  std::vector<double> t_rec, t_wait, t_write;
  auto fence = [&](CUevent e) -> uint64_t {
    double a = now_ns();
    record(ctx, e);
    double b = now_ns();
    wait(priv, e, 0);
    double c = now_ns();
    ++seq;
    if (relay) {
      cuEventRecord(relay_ev[seq % 8], priv);
    } else if (!wait_only && !stream_query) {
      CUresult r = write64(priv, dword, seq, 0);
      if (r != CUDA_SUCCESS) {
        printf("HOSTWORD %s write failed %d\n", label, (int)r);
        exit(1);
      }
    }
    double d = now_ns();
    t_rec.push_back(b - a);
    t_wait.push_back(c - b);
    t_write.push_back(d - c);
    return seq;
  };
  // Whether fence `k` is known complete, the way this mode learns it.
  auto done_of = [&](uint64_t k) -> bool {
    if (relay) return query(relay_ev[k % 8]) == CUDA_SUCCESS;
    if (stream_query) return cuStreamQuery(priv) == CUDA_SUCCESS;
    return *word >= k;
  };
  std::vector<double> rec, lprev, lnew, hyb;
  long prev_done = 0, new_done = 0, hyb_queries = 0;
  uint64_t last = fence(ev[0]);
  for (int i = 1; i < n; i++) {
    double t0 = now_ns();
    uint64_t mine = fence(ev[i % ring]);
    double t1 = now_ns();
    bool done = done_of(last);
    double t2 = now_ns();
    prev_done += done;
    // HYBRID: what a poll costs that falls back to the driver when the word has not landed.
    if ((!done && !relay && !stream_query) || wait_only) {
      hyb_queries++;
      query(ev[(i - 1) % ring]);
    }
    hyb.push_back(now_ns() - t1);
    if (i % 2 == 0) {
      double t3 = now_ns();
      new_done += done_of(mine);
      lnew.push_back(now_ns() - t3);
    }
    rec.push_back(t1 - t0);
    lprev.push_back(t2 - t1);
    last = mine;
  }
  CK(cudaStreamSynchronize((cudaStream_t)priv));
  printf("HOSTWORD %s record_ns=%.1f load_ns=%.1f prev_done=%.1f%% new_done=%.1f%% final_ok=%d\n",
         label, median(rec), median(lprev), 100.0 * prev_done / (n - 1),
         100.0 * new_done / lnew.size(), relay || stream_query || *word == seq);
  printf("SPLIT %s record_ns=%.1f wait_ns=%.1f write_ns=%.1f\n", label, median(t_rec),
         median(t_wait), median(t_write));
  printf("HYBRID %s query_ns=%.1f driver_queries=%.1f%%\n", label, median(hyb),
         100.0 * hyb_queries / (n - 1));
  if (wait_only) return;
  for (int delay_ns : {0, 500, 1000, 2000, 5000}) {
    std::vector<double> lat;
    long first_done = 0;
    for (int i = 0; i < 2000; i++) {
      uint64_t mine = fence(ev[0]);
      double t0 = now_ns();
      while (now_ns() - t0 < delay_ns) {
      }
      bool first = true;
      while (!done_of(mine)) first = false;
      first_done += first;
      lat.push_back(now_ns() - t0);
    }
    printf("HOSTLAT %s delay_ns=%d complete_at_first_load=%.1f%% median_ns_to_complete=%.0f\n",
           label, delay_ns, 100.0 * first_done / 2000, median(lat));
  }
}

int main(int argc, char **argv) {
  const char *label = argc > 1 ? argv[1] : "run";
  CK(cudaFree(0));
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!cuda) cuda = dlopen("libcuda.so.1", RTLD_NOW);
  gpa_fn gpa = (gpa_fn)dlsym(cuda, "cuGetProcAddress_v2");
  record_fn record = resolve<record_fn>(gpa, "cuCtxRecordEvent", 12050);
  query_fn query = resolve<query_fn>(gpa, "cuEventQuery", 2000);
  create_fn create = resolve<create_fn>(gpa, "cuEventCreate", 2000);
  ctx_fn current = resolve<ctx_fn>(gpa, "cuCtxGetCurrent", 4000);
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
    cudaStream_t &st = g_work_stream;
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
  // FENCE_RESET=k, after FENCE_STEPS: what, short of synchronising the device, ends the slow
  // query. 1: cuEventSynchronize of a completed context fence; 2: cuStreamQuery of the
  // stream that ran the kernel; 3: cuStreamSynchronize of that stream again; 4: a fresh
  // non-blocking stream synchronised; 5: cuCtxSynchronize (the known way).
  if (getenv("FENCE_RESET")) {
    int how = atoi(getenv("FENCE_RESET"));
    CUevent e;
    create(&e, CU_EVENT_DISABLE_TIMING);
    record(ctx, e);
    while (query(e) != CUDA_SUCCESS) {
    }
    if (how == 1) CK((cudaError_t)cuEventSynchronize(e));
    if (how == 2) printf("RESET stream query %d\n", (int)cuStreamQuery((CUstream)g_work_stream));
    if (how == 3) CK(cudaStreamSynchronize(g_work_stream));
    if (how == 4) {
      cudaStream_t fresh;
      CK(cudaStreamCreateWithFlags(&fresh, cudaStreamNonBlocking));
      CK(cudaStreamSynchronize(fresh));
    }
    if (how == 5) CK((cudaError_t)cuCtxSynchronize());
  }
  // FENCE_PROBE=1: ask cuStreamIsCapturing on the legacy stream before each record, as
  // cupool's pool does through its C API (the interposer does not).
  typedef CUresult (*capturing_fn)(CUstream, CUstreamCaptureStatus *);
  capturing_fn capturing =
      getenv("FENCE_PROBE") ? resolve<capturing_fn>(gpa, "cuStreamIsCapturing", 10000) : nullptr;
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
  if (getenv("FENCE_HOSTWORD")) host_word_loop(label, ctx, record, query, gpa);
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
    printf("LATENCY %s delay_ns=%d complete_at_first_query=%.1f%% median_ns_to_complete=%.0f\n",
           label, delay_ns, 100.0 * first_done / 2000, median(lat));
  }
  return 0;
}
