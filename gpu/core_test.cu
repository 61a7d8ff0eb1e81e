// Core tests of the cupool C API on a real GPU (issue "core pool").
// Usage: core_test SUBTEST   (roundtrip | api | ordering | oom | empty_cache | threads | stats)
// Each subtest runs in its own process (the suite starts one per subtest) so that one crash
// or one leaked cache cannot change another's result. Output: PASS/FAIL/INFO lines.
#include "common.cuh"
#include "cupool_api.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <math.h>
#include <string.h>
#include <string>
#include <thread>
#include <vector>

static const size_t MiB = (size_t)1 << 20;

static cupool_stats read_stats(int device = 0) {
  cupool_stats s;
  memset(&s, 0, sizeof s);
  s.size = (uint32_t)sizeof s;
  s.version = CUP_STATS_VERSION;
  int st = (int)cupool_get_stats(device, &s);
  if (st != CUP_OK) info("cupool_get_stats(%d) -> %d %s", device, st, cupool_status_string((cupool_status)st));
  return s;
}

static void print_stats_json(const char *label) {
  char buf[8192];
  size_t needed = 0;
  int st = (int)cupool_stats_json(0, buf, sizeof buf, &needed);
  if (st == CUP_OK)
    printf("STATS %s %s\n", label, buf);
  else
    printf("STATS %s unavailable: %d %s\n", label, st, cupool_status_string((cupool_status)st));
  fflush(stdout);
}

// The pool must work at all; otherwise every later check would only repeat this failure.
static bool pool_available() {
  void *p = nullptr;
  int st = (int)cupool_alloc(&p, 4096);
  if (!check("pool_available", st == CUP_OK && p != nullptr, "cupool_alloc(4096) -> %d %s", st,
             cupool_status_string((cupool_status)st)))
    return false;
  st = (int)cupool_free(p);
  return check("pool_free_works", st == CUP_OK, "cupool_free -> %d %s", st,
               cupool_status_string((cupool_status)st));
}

// ---------------------------------------------------------------------------------------
// roundtrip: data through pool blocks of many sizes, all live at once (overlap shows up as
// another block's pattern), through both the streamless and the stream-ordered calls.
static const size_t kRoundTripSizes[] = {1,           2,          3,           7,
                                         255,         256,        257,         511,
                                         4095,        4097,       65535,       65537,
                                         MiB - 1,     MiB + 13,   3 * MiB + 5, 16 * MiB + 1,
                                         64 * MiB - 3, 100 * MiB + 77, 255 * MiB + 7, 256 * MiB};

static void roundtrip_round(bool stream_ordered, cudaStream_t stream, int round) {
  const char *api = stream_ordered ? "async" : "sync";
  const size_t count = sizeof kRoundTripSizes / sizeof kRoundTripSizes[0];
  std::vector<void *> blocks(count, nullptr);
  int alloc_failures = 0, misaligned = 0;
  for (size_t k = 0; k < count; k++) {
    int st = stream_ordered ? (int)cupool_alloc_async(&blocks[k], kRoundTripSizes[k], stream)
                            : (int)cupool_alloc(&blocks[k], kRoundTripSizes[k]);
    if (st != CUP_OK || !blocks[k]) {
      alloc_failures++;
      printf("INFO alloc %zu -> %d\n", kRoundTripSizes[k], st);
      blocks[k] = nullptr;
    } else if ((uintptr_t)blocks[k] % 256 != 0) {
      misaligned++;
    }
  }
  char name[128];
  snprintf(name, sizeof name, "roundtrip_%s_r%d_alloc_all_sizes", api, round);
  check(name, alloc_failures == 0, "%d of %zu allocations failed", alloc_failures, count);
  snprintf(name, sizeof name, "roundtrip_%s_r%d_alignment_256", api, round);
  check(name, misaligned == 0, "%d blocks not 256-byte aligned", misaligned);

  // Copy a pattern in, transform on the device, copy out: all blocks live together.
  size_t max_size = kRoundTripSizes[count - 1];
  std::vector<uint8_t> host(max_size), back(max_size);
  for (size_t k = 0; k < count; k++) {
    if (!blocks[k]) continue;
    size_t n = kRoundTripSizes[k];
    for (size_t i = 0; i < n; i++) host[i] = pattern_byte(i, (uint32_t)(k * 31 + round));
    CK(cudaMemcpyAsync(blocks[k], host.data(), n, cudaMemcpyHostToDevice, stream));
    transform_bytes<<<grid_for(n), 256, 0, stream>>>((uint8_t *)blocks[k], n);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(stream));  // host buffer is reused by the next block
  }
  size_t bad_blocks = 0, first_bad = 0;
  for (size_t k = 0; k < count; k++) {
    if (!blocks[k]) continue;
    size_t n = kRoundTripSizes[k];
    CK(cudaMemcpyAsync(back.data(), blocks[k], n, cudaMemcpyDeviceToHost, stream));
    CK(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < n; i++) {
      uint8_t want = (uint8_t)((pattern_byte(i, (uint32_t)(k * 31 + round)) ^ 0xA5) + (i & 7));
      if (back[i] != want) {
        if (!bad_blocks) first_bad = n;
        bad_blocks++;
        break;
      }
    }
  }
  snprintf(name, sizeof name, "roundtrip_%s_r%d_data", api, round);
  check(name, bad_blocks == 0, "%zu blocks wrong (first: size %zu)", bad_blocks, first_bad);

  int free_failures = 0;
  for (size_t k = 0; k < count; k++) {
    if (!blocks[k]) continue;
    int st = stream_ordered ? (int)cupool_free_async(blocks[k], stream) : (int)cupool_free(blocks[k]);
    free_failures += st != CUP_OK;
  }
  snprintf(name, sizeof name, "roundtrip_%s_r%d_free", api, round);
  check(name, free_failures == 0, "%d frees failed", free_failures);
}

static int test_roundtrip() {
  if (!pool_available()) return 1;
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Round 2 runs on cached blocks: it checks that reuse hands out correct, separate memory.
  for (int round = 1; round <= 2; round++) {
    roundtrip_round(false, stream, round);
    roundtrip_round(true, stream, round);
  }
  CK(cudaStreamSynchronize(stream));
  cupool_stats s = read_stats();
  check("roundtrip_cache_hits_on_reuse", s.cache_hits > 0, "cache_hits=%llu",
        (unsigned long long)s.cache_hits);
  print_stats_json("roundtrip");
  CK(cudaStreamDestroy(stream));
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------
// api: argument errors return the documented statuses and leave out-params alone.
static int test_api() {
  if (!pool_available()) return 1;
  int st = (int)cupool_alloc(nullptr, 64);
  check("api_alloc_null_out", st == CUP_INVALID_VALUE, "-> %d %s", st, cupool_status_string((cupool_status)st));
  int host_var = 0;
  st = (int)cupool_free(&host_var);
  check("api_free_foreign_pointer", st == CUP_INVALID_POINTER, "-> %d %s", st,
        cupool_status_string((cupool_status)st));
  st = (int)cupool_free(nullptr);
  info("cupool_free(NULL) -> %d %s", st, cupool_status_string((cupool_status)st));
  void *p = nullptr;
  st = (int)cupool_alloc(&p, 1 << 16);
  check("api_alloc_64k", st == CUP_OK && p, "-> %d", st);
  st = (int)cupool_free((char *)p + 256);
  check("api_free_interior_pointer", st != CUP_OK, "-> %d %s", st, cupool_status_string((cupool_status)st));
  st = (int)cupool_free(p);
  check("api_free_64k", st == CUP_OK, "-> %d", st);
  st = (int)cupool_free(p);
  check("api_double_free_detected", st == CUP_DOUBLE_FREE || st == CUP_INVALID_POINTER,
        "-> %d %s", st, cupool_status_string((cupool_status)st));
  void *sentinel = (void *)0x1234;
  void *out = sentinel;
  st = (int)cupool_alloc(&out, (size_t)1 << 62);
  check("api_huge_alloc_fails_oom", st == CUP_OUT_OF_MEMORY || st == CUP_INVALID_VALUE, "-> %d %s",
        st, cupool_status_string((cupool_status)st));
  check("api_out_param_untouched_on_failure", out == sentinel, "out=%p", out);
  st = (int)cupool_config_set("no_such_key_xyz", "1");
  check("api_config_unknown_key_rejected", st != CUP_OK, "-> %d %s", st, cupool_status_string((cupool_status)st));
  const char *text = cupool_status_string((cupool_status)CUP_OUT_OF_MEMORY);
  check("api_status_string", text && text[0], "'%s'", text ? text : "(null)");
  info("cupool_interposition_active() = %d (expected 0 without the preload)",
       cupool_interposition_active());
  check("api_interposition_inactive_without_preload", cupool_interposition_active() == 0, "");
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------
// ordering: a block freed behind a slow kernel must not be rewritten by later work on
// another stream before that kernel has finished with it.
static const uint64_t kSpinNs = 80ull * 1000 * 1000;

static void ordering_case(bool stream_ordered, size_t size) {
  const char *api = stream_ordered ? "async" : "streamless";
  cudaStream_t a, b;
  CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  void *first = nullptr, *second = nullptr;
  char name[128];
  int st = stream_ordered ? (int)cupool_alloc_async(&first, size, a) : (int)cupool_alloc(&first, size);
  snprintf(name, sizeof name, "ordering_%s_%zu_alloc", api, size);
  if (!check(name, st == CUP_OK, "-> %d", st)) return;
  // Late writer: pattern 1 lands ~80 ms after launch.
  spin_then_fill<<<grid_for(size), 256, 0, a>>>((uint8_t *)first, size, 1, kSpinNs);
  CK(cudaGetLastError());
  double t0 = now_ns();
  st = stream_ordered ? (int)cupool_free_async(first, a) : (int)cupool_free(first);
  double free_us = (now_ns() - t0) / 1e3;
  snprintf(name, sizeof name, "ordering_%s_%zu_free", api, size);
  check(name, st == CUP_OK, "-> %d", st);
  st = stream_ordered ? (int)cupool_alloc_async(&second, size, b) : (int)cupool_alloc(&second, size);
  snprintf(name, sizeof name, "ordering_%s_%zu_realloc", api, size);
  if (!check(name, st == CUP_OK, "-> %d", st)) return;
  fill_pattern<<<grid_for(size), 256, 0, b>>>((uint8_t *)second, size, 2);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  unsigned long long bad = device_mismatches(second, size, 2, b);
  info("ordering_%s_%zu: same block reused across streams: %s; free call took %.1f us "
       "(a free that waits for the device takes ~%llu ms)",
       api, size, first == second ? "yes" : "no", free_us, (unsigned long long)(kSpinNs / 1000000));
  snprintf(name, sizeof name, "ordering_%s_%zu_no_clobber", api, size);
  check(name, bad == 0, "%llu bytes of the new block overwritten by the old kernel", bad);
  snprintf(name, sizeof name, "ordering_%s_%zu_free_does_not_wait_for_device", api, size);
  // Not a timing target: a free that synchronises would take the whole 80 ms.
  check(name, free_us < 40000.0, "%.1f us", free_us);
  st = stream_ordered ? (int)cupool_free_async(second, b) : (int)cupool_free(second);
  snprintf(name, sizeof name, "ordering_%s_%zu_free_second", api, size);
  check(name, st == CUP_OK, "-> %d", st);
  CK(cudaDeviceSynchronize());
  CK(cudaStreamDestroy(a));
  CK(cudaStreamDestroy(b));
}

// Same stream: a block freed on A may be reused at once on A; stream order keeps it safe.
static void ordering_same_stream(size_t size) {
  cudaStream_t a;
  CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  void *first = nullptr, *second = nullptr;
  if (!check("ordering_same_stream_alloc", (int)cupool_alloc_async(&first, size, a) == CUP_OK)) return;
  spin_then_fill<<<grid_for(size), 256, 0, a>>>((uint8_t *)first, size, 1, kSpinNs / 4);
  CK(cudaGetLastError());
  check("ordering_same_stream_free", (int)cupool_free_async(first, a) == CUP_OK);
  check("ordering_same_stream_realloc", (int)cupool_alloc_async(&second, size, a) == CUP_OK);
  fill_pattern<<<grid_for(size), 256, 0, a>>>((uint8_t *)second, size, 2);
  CK(cudaGetLastError());
  unsigned long long bad = device_mismatches(second, size, 2, a);
  info("ordering_same_stream: same block reused on the same stream: %s (expected yes)",
       first == second ? "yes" : "no");
  check("ordering_same_stream_data", bad == 0, "%llu bytes wrong", bad);
  check("ordering_same_stream_free_second", (int)cupool_free_async(second, a) == CUP_OK);
  CK(cudaStreamSynchronize(a));
  CK(cudaStreamDestroy(a));
}

static int test_ordering() {
  if (!pool_available()) return 1;
  const size_t sizes[] = {4096, 4 * MiB, 64 * MiB};
  for (size_t size : sizes) {
    ordering_case(true, size);
    ordering_case(false, size);
  }
  ordering_same_stream(4 * MiB);
  print_stats_json("ordering");
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------
// oom: a request larger than the device fails cleanly and the pool keeps working; a large
// request that fits only once the cache is released succeeds.
static int test_oom() {
  if (!pool_available()) return 1;
  size_t free0 = 0, total = 0;
  CK(cudaMemGetInfo(&free0, &total));
  cupool_stats before = read_stats();
  void *p = (void *)0x1234;
  int st = (int)cupool_alloc(&p, total + total / 2);
  check("oom_over_device_size", st == CUP_OUT_OF_MEMORY, "-> %d %s", st, cupool_status_string((cupool_status)st));
  check("oom_out_param_untouched", p == (void *)0x1234, "out=%p", p);
  cupool_stats after = read_stats();
  check("oom_counted", after.num_ooms > before.num_ooms, "num_ooms %llu -> %llu",
        (unsigned long long)before.num_ooms, (unsigned long long)after.num_ooms);
  cudaError_t sticky = cudaGetLastError();
  check("oom_leaves_no_cuda_error", sticky == cudaSuccess, "cudaGetLastError -> %s",
        cudaGetErrorName(sticky));

  // Still usable afterwards.
  void *q = nullptr;
  st = (int)cupool_alloc(&q, 8 * MiB);
  check("oom_recovery_alloc", st == CUP_OK, "-> %d", st);
  if (st == CUP_OK) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    fill_pattern<<<grid_for(8 * MiB), 256, 0, s>>>((uint8_t *)q, 8 * MiB, 9);
    CK(cudaGetLastError());
    check("oom_recovery_data", device_mismatches(q, 8 * MiB, 9, s) == 0);
    check("oom_recovery_free", (int)cupool_free(q) == CUP_OK);
    CK(cudaStreamDestroy(s));
  }
  CK(cudaDeviceSynchronize());

  // Fill ~85% of free memory with blocks of one size, free them (they stay cached), then
  // ask for one block of ~60%: it fits only if the pool gives cached memory back.
  size_t released = 0;
  check("oom_empty_cache_before_fill", (int)cupool_empty_cache(&released) == CUP_OK);
  CK(cudaMemGetInfo(&free0, &total));
  if (!check("oom_device_mostly_free_before_fill", free0 >= total / 2,
             "cudaMemGetInfo free %zu MiB of %zu MiB after the OOM and empty_cache (needs half)",
             free0 / MiB, total / MiB))
    return 1;
  const size_t chunk = 512 * MiB;
  size_t count = (size_t)(free0 * 0.85) / chunk;
  std::vector<void *> chunks;
  for (size_t i = 0; i < count; i++) {
    void *c = nullptr;
    if ((int)cupool_alloc(&c, chunk) != CUP_OK) break;
    chunks.push_back(c);
  }
  check("oom_fill_device", chunks.size() == count, "%zu of %zu chunks of 512 MiB", chunks.size(), count);
  for (void *c : chunks) cupool_free(c);
  CK(cudaDeviceSynchronize());
  size_t free_cached = 0;
  CK(cudaMemGetInfo(&free_cached, &total));
  size_t big = (size_t)(free0 * 0.60) / MiB * MiB;
  info("oom_release: driver free %zu MiB before fill, %zu MiB with %zu MiB cached; asking %zu MiB",
       free0 / MiB, free_cached / MiB, chunks.size() * chunk / MiB, big / MiB);
  if (free_cached > big)
    info("oom_release: the pool gave memory back before the big request; the test still checks "
         "that the request succeeds");
  before = read_stats();
  void *large = nullptr;
  st = (int)cupool_alloc(&large, big);
  after = read_stats();
  check("oom_release_cache_then_alloc", st == CUP_OK, "-> %d %s", st, cupool_status_string((cupool_status)st));
  // Segments: the request fits only once cached segments went back (a retry, or frees).
  // The VMM arena (vmm:on) instead moves the cached granules under the new block
  // (stitching): no retry, and the memory held does not grow.
  bool stitched = after.granules > 0 && after.reserved_bytes.current <= before.reserved_bytes.current;
  check("oom_release_counted",
        after.alloc_retries > before.alloc_retries || after.device_frees > before.device_frees ||
            free_cached > big || stitched,
        "alloc_retries %llu -> %llu, device_frees %llu -> %llu, reserved %llu -> %llu MiB",
        (unsigned long long)before.alloc_retries, (unsigned long long)after.alloc_retries,
        (unsigned long long)before.device_frees, (unsigned long long)after.device_frees,
        (unsigned long long)(before.reserved_bytes.current / MiB),
        (unsigned long long)(after.reserved_bytes.current / MiB));
  if (st == CUP_OK) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    fill_pattern<<<1024, 256, 0, s>>>((uint8_t *)large, big, 4);
    CK(cudaGetLastError());
    check("oom_release_large_block_data", device_mismatches(large, big, 4, s) == 0);
    CK(cudaStreamDestroy(s));
    check("oom_release_free", (int)cupool_free(large) == CUP_OK);
  }
  print_stats_json("oom");
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------
// empty_cache: cached memory goes back to the driver, visible in cudaMemGetInfo.
static int test_empty_cache() {
  if (!pool_available()) return 1;
  std::vector<void *> blocks;
  const size_t sizes[] = {64 * MiB, 2 * MiB, 512 * 1024, 4096, 300 * MiB + 11};
  for (int r = 0; r < 4; r++)
    for (size_t s : sizes) {
      void *p = nullptr;
      if ((int)cupool_alloc(&p, s) == CUP_OK) blocks.push_back(p);
    }
  check("empty_cache_allocs", blocks.size() == 4 * (sizeof sizes / sizeof sizes[0]), "%zu blocks",
        blocks.size());
  for (void *p : blocks) cupool_free(p);
  CK(cudaDeviceSynchronize());
  cupool_stats s0 = read_stats();
  size_t free_before = 0, free_after = 0, total = 0;
  CK(cudaMemGetInfo(&free_before, &total));
  size_t released = 0;
  int st = (int)cupool_empty_cache(&released);
  CK(cudaMemGetInfo(&free_after, &total));
  cupool_stats s1 = read_stats();
  check("empty_cache_status", st == CUP_OK, "-> %d %s", st, cupool_status_string((cupool_status)st));
  check("empty_cache_released_something", released > 0, "released %zu bytes (reserved was %llu)",
        released, (unsigned long long)s0.reserved_bytes.current);
  double gained = (double)free_after - (double)free_before;
  double tolerance = 8.0 * MiB + 0.02 * (double)released;
  check("empty_cache_driver_free_rises_by_released", fabs(gained - (double)released) <= tolerance,
        "cudaMemGetInfo free rose by %.1f MiB, released %.1f MiB", gained / MiB, (double)released / MiB);
  check("empty_cache_reserved_zero", s1.reserved_bytes.current == 0, "reserved_bytes.current=%llu",
        (unsigned long long)s1.reserved_bytes.current);
  check("empty_cache_cached_zero", s1.cached_bytes.current == 0, "cached_bytes.current=%llu",
        (unsigned long long)s1.cached_bytes.current);
  check("empty_cache_allocated_zero", s1.allocated_bytes.current == 0, "allocated_bytes.current=%llu",
        (unsigned long long)s1.allocated_bytes.current);
  // Allocating again after emptying works.
  void *p = nullptr;
  check("empty_cache_alloc_after", (int)cupool_alloc(&p, 64 * MiB) == CUP_OK && p);
  if (p) cupool_free(p);
  print_stats_json("empty_cache");
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------
// threads: several host threads, each with its own stream, allocate, write, check and free;
// a producer/consumer pair also frees on another thread and stream than it allocated on.
struct ThreadResult {
  unsigned long long mismatches = 0;
  int api_errors = 0;
};

static uint32_t lcg(uint32_t &state) {
  state = state * 1664525u + 1013904223u;
  return state >> 8;
}

static void worker(int id, bool stream_ordered, int iterations, ThreadResult *out) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long *counter;
  CK(cudaMallocHost(&counter, sizeof *counter));
  *counter = 0;
  uint32_t rng = 12345u + (uint32_t)id;
  struct Live { void *p; size_t n; uint32_t seed; };
  std::vector<Live> live;
  for (int it = 0; it < iterations; it++) {
    size_t n = 256 + lcg(rng) % (1u << 20);
    void *p = nullptr;
    int st = stream_ordered ? (int)cupool_alloc_async(&p, n, s) : (int)cupool_alloc(&p, n);
    if (st != CUP_OK) { out->api_errors++; continue; }
    uint32_t seed = (uint32_t)(id * 100000 + it);
    fill_pattern<<<grid_for(n), 256, 0, s>>>((uint8_t *)p, n, seed);
    live.push_back({p, n, seed});
    if (live.size() > 8) {
      size_t k = lcg(rng) % live.size();
      Live v = live[k];
      live[k] = live.back();
      live.pop_back();
      count_mismatches<<<grid_for(v.n), 256, 0, s>>>((uint8_t *)v.p, v.n, v.seed, counter);
      st = stream_ordered ? (int)cupool_free_async(v.p, s) : (int)cupool_free(v.p);
      if (st != CUP_OK) out->api_errors++;
    }
  }
  for (Live &v : live) {
    count_mismatches<<<grid_for(v.n), 256, 0, s>>>((uint8_t *)v.p, v.n, v.seed, counter);
    int st = stream_ordered ? (int)cupool_free_async(v.p, s) : (int)cupool_free(v.p);
    if (st != CUP_OK) out->api_errors++;
  }
  if (cudaGetLastError() != cudaSuccess) out->api_errors++;
  CK(cudaStreamSynchronize(s));
  out->mismatches = *counter;
  CK(cudaFreeHost(counter));
  CK(cudaStreamDestroy(s));
}

// Producer allocates on its stream and fills; consumer waits for the producer's event,
// checks on its own stream, then frees on its own stream (a cross-stream free).
static void producer_consumer(int blocks, ThreadResult *out) {
  struct Item { void *p; size_t n; uint32_t seed; cudaEvent_t ready; };
  std::mutex m;
  std::condition_variable cv;
  std::deque<Item> queue;
  bool done = false;
  std::thread producer([&] {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    uint32_t rng = 777;
    for (int i = 0; i < blocks; i++) {
      Item item;
      item.n = 512 + lcg(rng) % (2u << 20);
      item.seed = 5000000u + (uint32_t)i;
      if ((int)cupool_alloc_async(&item.p, item.n, s) != CUP_OK) { out->api_errors++; continue; }
      fill_pattern<<<grid_for(item.n), 256, 0, s>>>((uint8_t *)item.p, item.n, item.seed);
      CK(cudaEventCreateWithFlags(&item.ready, cudaEventDisableTiming));
      CK(cudaEventRecord(item.ready, s));
      std::lock_guard<std::mutex> g(m);
      queue.push_back(item);
      cv.notify_one();
    }
    { std::lock_guard<std::mutex> g(m); done = true; cv.notify_one(); }
    CK(cudaStreamSynchronize(s));
    CK(cudaStreamDestroy(s));
  });
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long *counter;
  CK(cudaMallocHost(&counter, sizeof *counter));
  *counter = 0;
  for (;;) {
    std::unique_lock<std::mutex> g(m);
    cv.wait(g, [&] { return done || !queue.empty(); });
    if (queue.empty() && done) break;
    Item item = queue.front();
    queue.pop_front();
    g.unlock();
    CK(cudaStreamWaitEvent(s, item.ready, 0));
    count_mismatches<<<grid_for(item.n), 256, 0, s>>>((uint8_t *)item.p, item.n, item.seed, counter);
    if ((int)cupool_free_async(item.p, s) != CUP_OK) out->api_errors++;
    CK(cudaEventDestroy(item.ready));
  }
  producer.join();
  CK(cudaStreamSynchronize(s));
  out->mismatches += *counter;
  CK(cudaFreeHost(counter));
  CK(cudaStreamDestroy(s));
}

static int test_threads() {
  if (!pool_available()) return 1;
  const int kThreads = 8, kIterations = 1500;
  std::vector<ThreadResult> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++)
    threads.emplace_back(worker, t, t % 2 == 0, kIterations, &results[t]);
  for (auto &t : threads) t.join();
  unsigned long long bad = 0;
  int errors = 0;
  for (auto &r : results) { bad += r.mismatches; errors += r.api_errors; }
  check("threads_8_mixed_api_errors", errors == 0, "%d failed calls", errors);
  check("threads_8_mixed_data", bad == 0, "%llu bytes wrong", bad);
  cupool_stats before = read_stats();
  ThreadResult pc;
  producer_consumer(2000, &pc);
  cupool_stats after = read_stats();
  check("threads_cross_stream_free_errors", pc.api_errors == 0, "%d failed calls", pc.api_errors);
  check("threads_cross_stream_free_data", pc.mismatches == 0, "%llu bytes wrong", pc.mismatches);
  info("cross_stream_frees %llu -> %llu", (unsigned long long)before.cross_stream_frees,
       (unsigned long long)after.cross_stream_frees);
  check("threads_cross_stream_frees_counted", after.cross_stream_frees >= before.cross_stream_frees + 2000,
        "%llu new", (unsigned long long)(after.cross_stream_frees - before.cross_stream_frees));
  CK(cudaDeviceSynchronize());
  cupool_stats s = read_stats();
  check("threads_all_freed", s.allocated_bytes.current == 0, "allocated_bytes.current=%llu",
        (unsigned long long)s.allocated_bytes.current);
  print_stats_json("threads");
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------
// stats: counters agree with what this program did.
static int test_stats() {
  if (!pool_available()) return 1;
  cupool_reset_peak_stats(0);
  cupool_stats s0 = read_stats();
  const int n = 100;
  const size_t size = 3 * MiB + 17;
  std::vector<void *> blocks;
  for (int i = 0; i < n; i++) {
    void *p = nullptr;
    if ((int)cupool_alloc(&p, size) == CUP_OK) blocks.push_back(p);
  }
  cupool_stats s1 = read_stats();
  check("stats_header", s1.size == sizeof(cupool_stats) && s1.version == CUP_STATS_VERSION,
        "size %u version %u", s1.size, s1.version);
  check("stats_num_allocs", s1.num_allocs - s0.num_allocs == blocks.size(), "%llu new for %zu",
        (unsigned long long)(s1.num_allocs - s0.num_allocs), blocks.size());
  check("stats_requested_bytes", s1.requested_bytes.current - s0.requested_bytes.current == n * size,
        "requested grew by %llu, asked %zu",
        (unsigned long long)(s1.requested_bytes.current - s0.requested_bytes.current), n * size);
  check("stats_allocated_ge_requested", s1.allocated_bytes.current >= s1.requested_bytes.current,
        "allocated %llu requested %llu", (unsigned long long)s1.allocated_bytes.current,
        (unsigned long long)s1.requested_bytes.current);
  check("stats_reserved_ge_allocated", s1.reserved_bytes.current >= s1.allocated_bytes.current,
        "reserved %llu allocated %llu", (unsigned long long)s1.reserved_bytes.current,
        (unsigned long long)s1.allocated_bytes.current);
  for (void *p : blocks) cupool_free(p);
  CK(cudaDeviceSynchronize());
  cupool_stats s2 = read_stats();
  check("stats_num_frees", s2.num_frees - s1.num_frees == blocks.size(), "%llu new",
        (unsigned long long)(s2.num_frees - s1.num_frees));
  check("stats_allocated_zero_after_frees", s2.allocated_bytes.current == 0 && s2.requested_bytes.current == 0,
        "allocated %llu requested %llu", (unsigned long long)s2.allocated_bytes.current,
        (unsigned long long)s2.requested_bytes.current);
  check("stats_peak_kept", s2.requested_bytes.peak >= n * size && s2.allocated_bytes.peak >= n * size,
        "requested.peak %llu allocated.peak %llu", (unsigned long long)s2.requested_bytes.peak,
        (unsigned long long)s2.allocated_bytes.peak);
  check("stats_cached_equals_reserved_when_idle", s2.cached_bytes.current == s2.reserved_bytes.current,
        "cached %llu reserved %llu", (unsigned long long)s2.cached_bytes.current,
        (unsigned long long)s2.reserved_bytes.current);
  check("stats_allocs_equal_frees", s2.num_allocs == s2.num_frees, "allocs %llu frees %llu",
        (unsigned long long)s2.num_allocs, (unsigned long long)s2.num_frees);
  info("hits %llu + misses %llu vs allocs %llu", (unsigned long long)s2.cache_hits,
       (unsigned long long)s2.cache_misses, (unsigned long long)s2.num_allocs);
  // Reuse: the same sizes again must be served from the cache.
  for (int i = 0; i < n; i++) {
    void *p = nullptr;
    if ((int)cupool_alloc(&p, size) == CUP_OK) blocks[i] = p;
  }
  for (void *p : blocks) cupool_free(p);
  cupool_stats s3 = read_stats();
  check("stats_hits_on_reuse", s3.cache_hits - s2.cache_hits >= (uint64_t)n, "%llu new hits for %d",
        (unsigned long long)(s3.cache_hits - s2.cache_hits), n);
  check("stats_no_device_alloc_on_reuse", s3.device_allocs == s2.device_allocs,
        "device_allocs %llu -> %llu", (unsigned long long)s2.device_allocs,
        (unsigned long long)s3.device_allocs);
  cupool_reset_peak_stats(0);
  cupool_stats s4 = read_stats();
  check("stats_reset_peak", s4.allocated_bytes.peak == s4.allocated_bytes.current,
        "peak %llu current %llu", (unsigned long long)s4.allocated_bytes.peak,
        (unsigned long long)s4.allocated_bytes.current);
  cupool_stats all = read_stats(-1);
  check("stats_all_devices_sum", all.num_allocs >= s4.num_allocs, "all %llu dev0 %llu",
        (unsigned long long)all.num_allocs, (unsigned long long)s4.num_allocs);
  // JSON: a short buffer reports the size it needs; a large one gets the document.
  char small[8];
  size_t needed = 0;
  int st = (int)cupool_stats_json(0, small, sizeof small, &needed);
  check("stats_json_short_buffer", st != CUP_OK && needed > sizeof small, "-> %d needed %zu", st, needed);
  std::vector<char> buf(needed + 1);
  st = (int)cupool_stats_json(0, buf.data(), buf.size(), &needed);
  check("stats_json_full", st == CUP_OK && strstr(buf.data(), "\"cache_hits\"") != nullptr, "-> %d", st);
  // Memory limit: a request over the limit fails, under it succeeds; 0 lifts it.
  check("stats_limit_set", (int)cupool_set_memory_limit(0, 256 * MiB) == CUP_OK);
  size_t released = 0;
  cupool_empty_cache(&released);
  void *p = nullptr;
  st = (int)cupool_alloc(&p, 512 * MiB);
  check("limit_over_fails", st == CUP_OUT_OF_MEMORY, "-> %d %s", st, cupool_status_string((cupool_status)st));
  if (st == CUP_OK) cupool_free(p);
  st = (int)cupool_alloc(&p, 64 * MiB);
  check("limit_under_succeeds", st == CUP_OK, "-> %d", st);
  if (st == CUP_OK) cupool_free(p);
  check("limit_lifted", (int)cupool_set_memory_limit(0, 0) == CUP_OK);
  st = (int)cupool_alloc(&p, 512 * MiB);
  check("limit_lifted_alloc", st == CUP_OK, "-> %d", st);
  if (st == CUP_OK) cupool_free(p);
  print_stats_json("stats");
  return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s roundtrip|api|ordering|oom|empty_cache|threads|stats\n", argv[0]);
    return 2;
  }
  CK(cudaFree(0));
  std::string t = argv[1];
  if (t == "roundtrip") return test_roundtrip();
  if (t == "api") return test_api();
  if (t == "ordering") return test_ordering();
  if (t == "oom") return test_oom();
  if (t == "empty_cache") return test_empty_cache();
  if (t == "threads") return test_threads();
  if (t == "stats") return test_stats();
  fprintf(stderr, "unknown subtest %s\n", argv[1]);
  return 2;
}
