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
#include "common.cuh"
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

// What the driver calls on cupool's paths cost by themselves, measured in the same run:
// cuCtxGetCurrent (once per allocation), cuStreamGetId (once per stream-ordered call), and
// what a context fence costs (record, first and later queries), which bounds the streamless
// path whenever a freed block must be fenced before its reuse.
typedef CUresult (*get_current_fn)(CUcontext *);
typedef CUresult (*stream_id_fn)(CUstream, unsigned long long *);
typedef CUresult (*is_capturing_fn)(CUstream, CUstreamCaptureStatus *);
typedef CUresult (*ctx_record_fn)(CUcontext, CUevent);
typedef CUresult (*event_record_fn)(CUevent, CUstream);
typedef CUresult (*event_query_fn)(CUevent);
typedef CUresult (*event_create_fn)(CUevent *, unsigned);
typedef CUresult (*no_arg_fn)(void);
typedef CUresult (*stream_fn)(CUstream);

static void *driver_entry(const char *name, int version) {
  void *fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &q) != cudaSuccess) return nullptr;
  return q == cudaDriverEntryPointSuccess ? fn : nullptr;
}

// Median ns of one call, timed in 200 batches of 1000.
template <class F>
static double batched_call_ns(F call) {
  std::vector<double> t;
  for (int r = 0; r < 200; r++) {
    double t0 = bench::now_ns();
    for (int i = 0; i < 1000; i++) call();
    t.push_back((bench::now_ns() - t0) / 1000);
  }
  return bench::summarize(t).median;
}

// Record-then-query cycles, each step timed alone (a record cannot be batched without
// changing what the query sees): median ns of the record, the first query and a second one.
template <class Record>
static void fence_cycle_costs(const char *label, Record record, event_query_fn query, CUevent ev) {
  std::vector<double> rec, q1, q2;
  for (int i = 0; i < 3000; i++) {
    double a = bench::now_ns();
    if (record(ev) != CUDA_SUCCESS) return;
    double b = bench::now_ns();
    query(ev);
    double c = bench::now_ns();
    query(ev);
    double d = bench::now_ns();
    rec.push_back(b - a);
    q1.push_back(c - b);
    q2.push_back(d - c);
  }
  printf("BENCH driver_call %s_record median_ns=%.1f\n", label, bench::summarize(rec).median);
  printf("BENCH driver_call %s_first_query median_ns=%.1f\n", label, bench::summarize(q1).median);
  printf("BENCH driver_call %s_second_query median_ns=%.1f\n", label, bench::summarize(q2).median);
}

static void driver_call_costs() {
  auto get_current = (get_current_fn)driver_entry("cuCtxGetCurrent", 4000);
  auto stream_id = (stream_id_fn)driver_entry("cuStreamGetId", 12000);
  auto is_capturing = (is_capturing_fn)driver_entry("cuStreamIsCapturing", 10000);
  auto ctx_record = (ctx_record_fn)driver_entry("cuCtxRecordEvent", 12050);
  auto event_record = (event_record_fn)driver_entry("cuEventRecord", 2000);
  auto event_query = (event_query_fn)driver_entry("cuEventQuery", 2000);
  auto event_create = (event_create_fn)driver_entry("cuEventCreate", 2000);
  auto event_sync = (event_query_fn)driver_entry("cuEventSynchronize", 2000);
  auto ctx_sync = (no_arg_fn)driver_entry("cuCtxSynchronize", 2000);
  auto stream_query = (stream_fn)driver_entry("cuStreamQuery", 2000);
  if (!get_current || !stream_id) return;
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return;
  CUcontext ctx = nullptr;
  get_current(&ctx);
  printf("BENCH driver_call cuCtxGetCurrent median_ns=%.1f\n", batched_call_ns([&] {
           CUcontext c;
           get_current(&c);
         }));
  printf("BENCH driver_call cuStreamGetId median_ns=%.1f\n", batched_call_ns([&] {
           unsigned long long id;
           stream_id((CUstream)s, &id);
         }));
  if (is_capturing)
    printf("BENCH driver_call cuStreamIsCapturing_legacy median_ns=%.1f\n", batched_call_ns([&] {
             CUstreamCaptureStatus st;
             is_capturing(CU_STREAM_LEGACY, &st);
           }));
  CUevent ev;
  if (event_create && event_query && event_create(&ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS) {
    if (ctx_record) fence_cycle_costs("ctx_fence", [&](CUevent e) { return ctx_record(ctx, e); }, event_query, ev);
    if (event_record)
      fence_cycle_costs("legacy_event", [&](CUevent e) { return event_record(e, CU_STREAM_LEGACY); }, event_query, ev);
    // Other ways to learn that an idle device has nothing in flight.
    if (ctx_record && event_sync) {
      ctx_record(ctx, ev);
      event_sync(ev);
      printf("BENCH driver_call cuEventSynchronize_completed median_ns=%.1f\n",
             batched_call_ns([&] { event_sync(ev); }));
    }
  }
  if (ctx_sync)
    printf("BENCH driver_call cuCtxSynchronize_idle median_ns=%.1f\n", batched_call_ns([&] { ctx_sync(); }));
  if (stream_query)
    printf("BENCH driver_call cuStreamQuery_legacy_idle median_ns=%.1f\n",
           batched_call_ns([&] { stream_query(CU_STREAM_LEGACY); }));
  cudaStreamDestroy(s);
}

// The positive numbers of a list such as "1 8 16" (an environment knob), up to the first
// word that is not a number.
static std::vector<long> positive_numbers(const char *list) {
  std::vector<long> out;
  for (char *end; *list; list = end) {
    long n = strtol(list, &end, 10);
    if (end == list) break;
    if (n > 0) out.push_back(n);
  }
  return out;
}

#ifndef BENCH_WITHOUT_CUPOOL
// BENCH_THREADS_ONLY with cupool: the pool's counters and estimated fence-call time after
// each thread count's runs (cumulative; `gpu/report.py` ignores these lines), so that a
// scaling shortfall can be told apart: fences and queries per pair, misses that took the
// pool's lock, time in the driver's fence calls.
static void pool_counts_line(const char *who, int threads) {
  static char places[16384];
  places[0] = 0;
  cupool_footprint_json(-1, places, sizeof places, nullptr);
  const char *fences = strstr(places, "\"fences\":");
  if (fences) {
    char *end = strchr((char *)fences, '}');
    if (end) end[1] = 0;
  }
  printf("POOLCOUNTS %s %d num_allocs=%lld cache_misses=%lld fences_recorded=%lld "
         "fence_queries=%lld grow_waits=%lld %s\n",
         who, threads, pool_counter("num_allocs"), pool_counter("cache_misses"),
         pool_counter("fences_recorded"),
         pool_counter("fence_queries"), pool_counter("grow_waits"), fences ? fences : "");
  fflush(stdout);
}

template <class A>
static void threads_only(const std::vector<int> &threads) {
  // BENCH_THREAD_WARM_LIVE="N ...": first run the suite's live-blocks test with N blocks
  // live (as the full run does before its thread test), so the thread test starts on a pool
  // that test grew and filled, as in the suite, rather than on one only the test's own
  // warm-up loops made. Diagnostic: the two states gave the streamless path different
  // shares of its cores (docs/BENCHMARKS.md, nineteenth and twentieth sessions).
  if (const char *list = getenv("BENCH_THREAD_WARM_LIVE")) {
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return;
    for (long n : positive_numbers(list)) bench::live_blocks<A>((size_t)n, s);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    pool_counts_line(A::name(), 0);
  }
  for (int t : threads) {
    bench::throughput<A>(t);
    pool_counts_line(A::name(), t);
  }
  const int most = threads.empty() ? 0 : *std::max_element(threads.begin(), threads.end());
  if (most > 1) bench::per_cpu_rates<A>(most);
}
#endif

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
  if (const char *list = getenv("BENCH_THREAD_COUNTS")) {  // e.g. "1 8 15 16"
    threads.clear();
    for (long n : positive_numbers(list)) threads.push_back((int)n);
  }
  auto wanted = [&](const char *name) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; i++)
      if (strcmp(argv[i], name) == 0) return true;
    return false;
  };
#ifndef BENCH_WITHOUT_CUPOOL
  const bool threads_only_mode = getenv("BENCH_THREADS_ONLY") != nullptr;
  if (wanted("cupool_async")) {
    if (threads_only_mode) threads_only<CupoolAsync>(threads);
    else bench::run_all<CupoolAsync>(threads);
  }
  if (wanted("cupool_sync")) {
    if (threads_only_mode) threads_only<CupoolSync>(threads);
    else bench::run_all<CupoolSync>(threads);
  }
#else
  printf("BENCH_UNAVAILABLE cupool (built without libcupool.so)\n");
#endif
  if (wanted("cudaMallocAsync")) bench::run_all<MallocAsync>(threads);
  if (wanted("cudaMalloc")) bench::run_all<Malloc>(threads);
  return 0;
}
