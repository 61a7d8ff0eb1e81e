// Pinned host memory: what an alloc+free pair costs through cupool's pinned pool against
// the CUDA runtime's own cudaHostAlloc/cudaMallocHost + cudaFreeHost, whether memory from
// the pool copies as fast as fresh pinned memory, and whether a freed buffer that an async
// copy still reads is kept from its next owner.
//
// Built with the static CUDA runtime and nothing of cupool (the C API is found with dlsym,
// so one binary serves every run):
//   nvcc -O2 -std=c++17 -arch=sm_90 -I gpu gpu/pinned_bench.cu -o pinned_bench -ldl
// and run three ways (scripts/gpu-suite, group pinned):
//   pinned_bench native                                    the runtime's own calls only
//   LD_PRELOAD=libcupool.so pinned_bench api               + cupool_host_alloc/_free(_async)
//   LD_PRELOAD=libcupool_preload.so pinned_bench preload   cudaHostAlloc, cudaMallocHost and
//                                                          cudaFreeHost reach the pool too
// Output:
//   BENCH pinned_pair <label>/<allocator> <order>/<size|mixed> median_ns=.. p99_ns=.. batch=.. repeats=..
//   BENCH pinned_h2d <label> <buffer> median_gbps=.. min_gbps=.. max_gbps=.. bytes=67108864
//   PASS|FAIL <check>[: detail]      INFO ...
// PINNED_BENCH_CHECKS=name,... runs only those allocators' reuse checks before the timings
// ("none": none; stream_reuse names the same-stream check). PINNED_BENCH_ONLY=name,... times
// only those allocators. With a cupool library in the process, each pair line also gives the
// pinned pool's context fences, fence queries and driver allocations per timed pair.
// Orders: "asc" times 4 KiB, 1 MiB, 64 MiB one after the other, "desc" the other way
// round (what ran before changes what the pool holds), "mixed" cycles through the three
// sizes inside each timed batch (reported per pair).
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "common.cuh"

typedef int (*host_alloc_fn)(void **, size_t);
typedef int (*host_free_fn)(void *);
typedef int (*host_alloc_async_fn)(void **, size_t, cudaStream_t);
typedef int (*host_free_async_fn)(void *, cudaStream_t);
typedef int (*host_stats_json_fn)(char *, size_t, size_t *);
typedef int (*interposition_fn)(void);

// cupool's C API if a cupool library is in the process (linked or preloaded), else NULL.
static host_alloc_fn cp_alloc;
static host_free_fn cp_free;
static host_alloc_async_fn cp_alloc_async;
static host_free_async_fn cp_free_async;
static host_stats_json_fn cp_stats_json;
static cudaStream_t g_stream;

static void find_cupool() {
  cp_alloc = (host_alloc_fn)dlsym(RTLD_DEFAULT, "cupool_host_alloc");
  cp_free = (host_free_fn)dlsym(RTLD_DEFAULT, "cupool_host_free");
  cp_alloc_async = (host_alloc_async_fn)dlsym(RTLD_DEFAULT, "cupool_host_alloc_async");
  cp_free_async = (host_free_async_fn)dlsym(RTLD_DEFAULT, "cupool_host_free_async");
  cp_stats_json = (host_stats_json_fn)dlsym(RTLD_DEFAULT, "cupool_host_stats_json");
}

// One way to get and give back pinned memory.
struct Allocator {
  const char *name;
  bool (*alloc)(void **p, size_t n);
  void (*release)(void *p);
};

static bool a_cupool(void **p, size_t n) { return cp_alloc(p, n) == 0; }
static void r_cupool(void *p) { cp_free(p); }
static bool a_cupool_async(void **p, size_t n) { return cp_alloc_async(p, n, g_stream) == 0; }
static void r_cupool_async(void *p) { cp_free_async(p, g_stream); }
static bool a_host_alloc(void **p, size_t n) {
  return cudaHostAlloc(p, n, cudaHostAllocDefault) == cudaSuccess;
}
static bool a_malloc_host(void **p, size_t n) { return cudaMallocHost(p, n) == cudaSuccess; }
static void r_free_host(void *p) { CK(cudaFreeHost(p)); }
[[noreturn]] static void die_free(const char *who);
// The driver's entry points as the program reaches them (the interposer's hooks under the
// preload): what the pool costs behind the hook without the CUDA runtime's own work.
typedef int (*cu_host_alloc_fn)(void **, size_t, unsigned);
typedef int (*cu_free_host_fn)(void *);
static cu_host_alloc_fn cu_host_alloc;
static cu_free_host_fn cu_free_host;
static bool a_cu_host_alloc(void **p, size_t n) { return cu_host_alloc(p, n, 0) == 0; }
static void r_cu_free_host(void *p) {
  if (cu_free_host(p) != 0) die_free("cuMemFreeHost");
}

static const size_t KIB = 1024, MIB = 1024 * 1024;
static const size_t SIZES[3] = {4 * KIB, MIB, 64 * MIB};

// One counter of the pinned pool's statistics JSON (-1 without a cupool library).
static double host_counter(const char *key) {
  static char buf[4096];
  if (!cp_stats_json || cp_stats_json(buf, sizeof buf, nullptr) != 0) return -1;
  char pattern[64];
  snprintf(pattern, sizeof pattern, "\"%s\":", key);
  const char *at = strstr(buf, pattern);
  return at ? strtod(at + strlen(pattern), nullptr) : -1;
}

[[noreturn]] static void die(const char *who, size_t n) {
  printf("BENCH_ERROR pinned %s alloc failed (size %zu)\n", who, n);
  fflush(stdout);
  exit(3);
}

[[noreturn]] static void die_free(const char *who) {
  printf("BENCH_ERROR pinned %s free failed\n", who);
  fflush(stdout);
  exit(3);
}

// `pairs` alloc+free pairs of the sizes `sizes[0..count)`, taken in turn; ns per pair.
static double time_pairs(const Allocator &a, const size_t *sizes, int count, int pairs) {
  double t0 = now_ns();
  for (int i = 0; i < pairs; i++) {
    void *p = nullptr;
    size_t n = sizes[i % count];
    if (!a.alloc(&p, n)) die(a.name, n);
    ((volatile char *)p)[0] = 1;  // the host touches what it got, as a program would
    a.release(p);
  }
  return (now_ns() - t0) / pairs;
}

// Median and p99 of batches of pairs; batch and repeat counts from a first estimate so a
// cached pair (~0.1-1 us) is timed in batches of 1000 and a driver pair (~10 us - 30 ms,
// pinning pages) one at a time, about one second per case.
static void bench_case(const char *label, const Allocator &a, const char *order,
                       const size_t *sizes, int count, const char *size_name) {
  for (int pass = 0; pass < 2; pass++) time_pairs(a, sizes, count, 3 * count);  // warm
  double estimate = time_pairs(a, sizes, count, 3 * count);
  int batch = estimate < 5000.0 ? 1000 : count;
  double per_batch = estimate * batch;
  int repeats = (int)std::min(200.0, std::max(15.0, 1e9 / per_batch));
  const char *keys[3] = {"fences_recorded", "fence_queries", "driver_allocs"};
  double before[3];
  for (int k = 0; k < 3; k++) before[k] = host_counter(keys[k]);
  std::vector<double> per_pair;
  for (int r = 0; r < repeats; r++) per_pair.push_back(time_pairs(a, sizes, count, batch));
  std::sort(per_pair.begin(), per_pair.end());
  char counts[160] = "";
  if (before[0] >= 0) {
    double pairs = (double)repeats * batch, d[3];
    for (int k = 0; k < 3; k++) d[k] = (host_counter(keys[k]) - before[k]) / pairs;
    snprintf(counts, sizeof counts, " fences_per_pair=%.3f queries_per_pair=%.3f driver_allocs_per_pair=%.4f",
             d[0], d[1], d[2]);
  }
  printf("BENCH pinned_pair %s/%s %s/%s median_ns=%.1f p99_ns=%.1f batch=%d repeats=%d%s\n", label,
         a.name, order, size_name, per_pair[per_pair.size() / 2],
         per_pair[(size_t)(0.99 * (per_pair.size() - 1))], batch, repeats, counts);
  fflush(stdout);
}

static void bench_pairs(const char *label, const std::vector<Allocator> &allocators) {
  char name[32];
  for (const Allocator &a : allocators) {
    for (int i = 0; i < 3; i++) {
      snprintf(name, sizeof name, "%zu", SIZES[i]);
      bench_case(label, a, "asc", &SIZES[i], 1, name);
    }
    for (int i = 2; i >= 0; i--) {
      snprintf(name, sizeof name, "%zu", SIZES[i]);
      bench_case(label, a, "desc", &SIZES[i], 1, name);
    }
    bench_case(label, a, "mixed", SIZES, 3, "mixed");
  }
}

// GB/s of one 64 MiB host-to-device copy from `h` (median of `reps` on g_stream).
static void time_h2d(const char *label, const char *buffer, void *h, void *d, size_t n) {
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  memset(h, 0x11, n);
  CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, g_stream));  // warm
  std::vector<double> gbps;
  for (int r = 0; r < 20; r++) {
    CK(cudaEventRecord(start, g_stream));
    CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, g_stream));
    CK(cudaEventRecord(stop, g_stream));
    CK(cudaEventSynchronize(stop));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, start, stop));
    gbps.push_back((double)n / (ms * 1e6));
  }
  std::sort(gbps.begin(), gbps.end());
  printf("BENCH pinned_h2d %s %s median_gbps=%.2f min_gbps=%.2f max_gbps=%.2f bytes=%zu\n", label,
         buffer, gbps[gbps.size() / 2], gbps.front(), gbps.back(), n);
  fflush(stdout);
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
}

// Copy bandwidth from pageable memory, from pinned memory allocated fresh (the runtime's
// cudaHostAlloc: pooled under the preload, the driver's otherwise), and from a block the
// pool handed out again (after a free and an alloc of the same size: a cache hit).
static void bench_h2d(const char *label, const Allocator *pooled) {
  const size_t n = 64 * MIB;
  void *d = nullptr;
  CK(cudaMalloc(&d, n));
  void *pageable = malloc(n);
  time_h2d(label, "pageable", pageable, d, n);
  free(pageable);
  void *fresh = nullptr;
  CK(cudaHostAlloc(&fresh, n, cudaHostAllocDefault));
  time_h2d(label, "cudaHostAlloc", fresh, d, n);
  CK(cudaFreeHost(fresh));
  if (pooled) {
    void *p = nullptr;
    if (!pooled->alloc(&p, n)) die(pooled->name, n);
    pooled->release(p);
    CK(cudaDeviceSynchronize());  // the freed block's fence completes: the next is a hit
    void *again = nullptr;
    if (!pooled->alloc(&again, n)) die(pooled->name, n);
    char buffer[64];
    snprintf(buffer, sizeof buffer, "%s_cached%s", pooled->name, again == p ? "" : "_new");
    time_h2d(label, buffer, again, d, n);
    pooled->release(again);
  }
  CK(cudaFree(d));
}

__global__ void spin_ns(uint64_t delay_ns) {
  uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < delay_ns) {
  }
}

// A buffer freed while a copy queued behind 200 ms of device work still has to read it:
// the next allocation of that size must not hand it out before the copy ran, so what the
// new owner writes never reaches the device.
static void check_reuse_after_free(const Allocator &a) {
  const size_t n = 8 * MIB;
  void *d = nullptr;
  CK(cudaMalloc(&d, n));
  void *h = nullptr;
  if (!a.alloc(&h, n)) die(a.name, n);
  memset(h, 0x5a, n);
  spin_ns<<<1, 1, 0, g_stream>>>(200ull * 1000 * 1000);
  CK(cudaGetLastError());
  CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, g_stream));
  a.release(h);
  void *next = nullptr;
  if (!a.alloc(&next, n)) die(a.name, n);
  bool reused = next == h;
  memset(next, 0xff, n);  // the new owner writes at once
  CK(cudaStreamSynchronize(g_stream));
  std::vector<unsigned char> back(n);
  CK(cudaMemcpy(back.data(), d, n, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += back[i] != 0x5a;
  char name[96];
  snprintf(name, sizeof name, "freed_buffer_kept_from_next_owner.%s", a.name);
  check(name, bad == 0, "%zu bytes changed under the copy, reused=%d", bad, (int)reused);
  a.release(next);
  CK(cudaFree(d));
}

// Same-stream reuse: a block freed on the stream may come back at once for work on that
// stream; a device-side write then a copy back shows the data still lands right.
static void check_stream_reuse() {
  const size_t n = MIB;
  void *h = nullptr, *d = nullptr;
  CK(cudaMalloc(&d, n));
  if (cp_alloc_async(&h, n, g_stream) != 0) die("cupool_host_async", n);
  memset(h, 0x33, n);
  CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, g_stream));
  cp_free_async(h, g_stream);
  void *again = nullptr;
  if (cp_alloc_async(&again, n, g_stream) != 0) die("cupool_host_async", n);
  CK(cudaMemcpyAsync(again, d, n, cudaMemcpyDeviceToHost, g_stream));
  CK(cudaStreamSynchronize(g_stream));
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += ((unsigned char *)again)[i] != 0x33;
  check("same_stream_reuse_in_order", bad == 0, "reused=%d bad=%zu", (int)(again == h),
        bad);
  cp_free_async(again, g_stream);
  CK(cudaStreamSynchronize(g_stream));
  CK(cudaFree(d));
}

// Whether `name` is one of the comma-separated names in `list`.
static bool listed(const char *list, const char *name) {
  size_t n = strlen(name);
  for (const char *at = list; (at = strstr(at, name)) != nullptr; at += n)
    if ((at == list || at[-1] == ',') && (at[n] == ',' || at[n] == '\0')) return true;
  return false;
}

int main(int argc, char **argv) {
  const char *label = argc > 1 ? argv[1] : "run";
  CK(cudaFree(0));
  CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  find_cupool();
  interposition_fn interposed = (interposition_fn)dlsym(RTLD_DEFAULT, "cupool_interposition_active");
  info("pinned_bench %s: cupool C API %s, interposition %s", label, cp_alloc ? "found" : "absent",
       interposed && interposed() ? "active" : "off");

  std::vector<Allocator> allocators;
  if (cp_alloc && cp_free) allocators.push_back({"cupool_host", a_cupool, r_cupool});
  if (cp_alloc_async && cp_free_async)
    allocators.push_back({"cupool_host_async", a_cupool_async, r_cupool_async});
  allocators.push_back({"cudaHostAlloc", a_host_alloc, r_free_host});
  allocators.push_back({"cudaMallocHost", a_malloc_host, r_free_host});
  if (interposed && interposed()) {
    // The program's own `cuMemHostAlloc` resolves to the interposer's hook.
    cu_host_alloc = (cu_host_alloc_fn)dlsym(RTLD_DEFAULT, "cuMemHostAlloc");
    cu_free_host = (cu_free_host_fn)dlsym(RTLD_DEFAULT, "cuMemFreeHost");
    if (cu_host_alloc && cu_free_host)
      allocators.push_back({"cuMemHostAlloc", a_cu_host_alloc, r_cu_free_host});
  }

  // Checks first (the timings below leave the pool warm, which would hide a bug).
  // PINNED_BENCH_CHECKS=name,...: only those allocators' reuse checks ("none": no check;
  // for finding what earlier work changes the timings after them).
  const char *only = getenv("PINNED_BENCH_CHECKS");
  auto checked = [&](const char *name) { return only == nullptr || listed(only, name); };
  for (const Allocator &a : allocators)
    if (strcmp(a.name, "cupool_host_async") != 0 && checked(a.name)) check_reuse_after_free(a);
  if (cp_alloc_async && cp_free_async && checked("stream_reuse")) check_stream_reuse();

  // PINNED_BENCH_ONLY=name,...: time only those allocators (to see what the others, timed
  // before them in the same process, change).
  const Allocator pooled = allocators[0];
  if (const char *times = getenv("PINNED_BENCH_ONLY")) {
    std::vector<Allocator> kept;
    for (const Allocator &a : allocators)
      if (listed(times, a.name)) kept.push_back(a);
    allocators = kept;
  }
  bench_pairs(label, allocators);
  bench_h2d(label, cp_alloc ? &pooled : nullptr);

  if (cp_stats_json) {
    static char buf[2048];
    if (cp_stats_json(buf, sizeof buf, nullptr) == 0) printf("CUPOOL_HOST_STATS %s %s\n", label, buf);
  }
  CK(cudaStreamDestroy(g_stream));
  return g_failures ? 1 : 0;
}
