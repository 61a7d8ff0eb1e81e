// Two GPUs under the preload (issue "Two GPUs on real hardware"): device switching, peer
// copies, peer access to pool blocks (small, large, and mapped after peer access was
// enabled), per-device limits and empty_cache, and allocation throughput with one host
// thread per device. Run by scripts/two-gpus under LD_PRELOAD=libcupool_preload.so; the
// program is linked against the API library too (its exports forward to the preload's
// pool). Prints PASS/FAIL lines (counted by the script) and BENCH lines.
//
//   two_gpus            every check
//   two_gpus --pairs N  pairs per thread in the throughput part (default 200000)
//   two_gpus --bench-only   the throughput part only (also without the preload, to compare)
#include <dlfcn.h>
#include <string.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "common.cuh"
#include "cupool_api.h"

static const size_t MiB = 1 << 20;

__global__ void fill_bytes(uint8_t *p, size_t n, uint8_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (uint8_t)(i * 7 + seed);
}

__global__ void add_bytes(uint8_t *p, size_t n, uint8_t add) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (uint8_t)(p[i] + add);
}

// Bytes of `p` (n bytes, any device) that differ from fill_bytes(seed) + add.
static size_t mismatches(const void *p, size_t n, uint8_t seed, uint8_t add) {
  std::vector<uint8_t> host(n);
  CK(cudaMemcpy(host.data(), p, n, cudaMemcpyDefault));
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += host[i] != (uint8_t)(i * 7 + seed + add);
  return bad;
}

static void *alloc_on(int device, size_t n, uint8_t seed) {
  CK(cudaSetDevice(device));
  void *p = nullptr;
  CK(cudaMalloc(&p, n));
  fill_bytes<<<256, 256>>>((uint8_t *)p, n, seed);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return p;
}

static int pointer_device(const void *p) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) return -1;
  return a.device;
}

static uint64_t reserved_on(int device) {
  cupool_stats s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  s.version = CUP_STATS_VERSION;
  if ((int)cupool_get_stats(device, &s) != CUP_OK) return UINT64_MAX;
  return s.reserved_bytes.current;
}

// One 64 KiB alloc + free: through the CUDA runtime (what the preload intercepts) or
// through cupool's C API directly; streamless or on the thread's stream.
enum PairKind { RUNTIME_STREAMLESS, RUNTIME_ORDERED, API_STREAMLESS, API_ORDERED };
static const char *const PAIR_NAMES[] = {"cudaMalloc+cudaFree", "cudaMallocAsync+cudaFreeAsync",
                                         "cupool_alloc+cupool_free",
                                         "cupool_alloc_async+cupool_free_async"};

static void one_pair(PairKind kind, cudaStream_t s) {
  void *p = nullptr;
  switch (kind) {
    case RUNTIME_STREAMLESS:
      CK(cudaMalloc(&p, 64 * 1024));
      CK(cudaFree(p));
      break;
    case RUNTIME_ORDERED:
      CK(cudaMallocAsync(&p, 64 * 1024, s));
      CK(cudaFreeAsync(p, s));
      break;
    case API_STREAMLESS:
      if ((int)cupool_alloc(&p, 64 * 1024) != CUP_OK || (int)cupool_free(p) != CUP_OK) exit(3);
      break;
    case API_ORDERED:
      if ((int)cupool_alloc_async(&p, 64 * 1024, s) != CUP_OK || (int)cupool_free_async(p, s) != CUP_OK)
        exit(3);
      break;
  }
}

// Pairs per second from one host thread per entry of `devices` (thread t on device
// devices[t], on a stream of its own).
static double pair_rate(const std::vector<int> &devices, long pairs, PairKind kind) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int d : devices) {
    threads.emplace_back([&, d] {
      CK(cudaSetDevice(d));
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      for (int i = 0; i < 1000; i++) one_pair(kind, s);  // warm the pool and the thread's cache
      ready++;
      while (!go.load()) {
      }
      for (long i = 0; i < pairs; i++) one_pair(kind, s);
      CK(cudaStreamSynchronize(s));
      CK(cudaStreamDestroy(s));
    });
  }
  while (ready.load() < (int)devices.size()) {
  }
  auto t0 = std::chrono::steady_clock::now();
  go = true;
  for (auto &t : threads) t.join();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return (double)pairs * devices.size() / secs;
}

// Throughput: one host thread on GPU 0, then one host thread per GPU. `runtime_pairs` for
// the CUDA runtime's calls (slow without the preload), `pairs` for the rest.
static void bench(long pairs, long runtime_pairs) {
  for (int k = RUNTIME_STREAMLESS; k <= API_ORDERED; k++) {
    PairKind kind = (PairKind)k;
    long n = k <= RUNTIME_ORDERED ? runtime_pairs : pairs;
    double one = pair_rate({0}, n, kind);
    double two = pair_rate({0, 1}, n, kind);
    printf("BENCH %s, 64 KiB, pairs/s: 1 thread on GPU 0 %.3f M, 1 thread per GPU on 2 GPUs "
           "%.3f M (%.2fx)\n",
           PAIR_NAMES[k], one / 1e6, two / 1e6, two / one);
    fflush(stdout);
  }
}

int main(int argc, char **argv) {
  long pairs = 200000;
  bool bench_only = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--pairs") && i + 1 < argc) pairs = atol(argv[i + 1]);
    if (!strcmp(argv[i], "--bench-only")) bench_only = true;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    printf("SKIPPED: %d GPU(s); this program needs two\n", count);
    return 0;
  }
  // The API library exports it too (answering 0): only the preload's copy answers 1.
  typedef int (*active_fn)(void);
  active_fn active = (active_fn)dlsym(RTLD_DEFAULT, "cupool_interposition_active");
  bool preloaded = active != nullptr && active() == 1;
  if (bench_only) {
    info("throughput only, %s", preloaded ? "under the preload" : "CUDA's own allocators");
    bench(pairs, preloaded ? pairs : pairs / 10);
    return 0;
  }
  check("preloaded", preloaded, "run it under LD_PRELOAD=libcupool_preload.so");
  char vmm[16] = "?";
  size_t len = 0;
  cupool_config_get("vmm", vmm, sizeof vmm, &len);
  info("devices %d, vmm %s", count, vmm);

  // Device switching and peer copies.
  void *small0 = alloc_on(0, 4096, 1);
  void *large0 = alloc_on(0, 64 * MiB, 2);
  void *large1 = alloc_on(1, 64 * MiB, 3);
  check("pointer_devices", pointer_device(small0) == 0 && pointer_device(large0) == 0 &&
                               pointer_device(large1) == 1,
        "small0 on %d, large0 on %d, large1 on %d", pointer_device(small0), pointer_device(large0),
        pointer_device(large1));
  CK(cudaMemcpyPeer(large1, 1, large0, 0, 64 * MiB));
  CK(cudaSetDevice(1));
  CK(cudaDeviceSynchronize());
  check("memcpy_peer", mismatches(large1, 64 * MiB, 2, 0) == 0);

  // Peer access: GPU 1 reads and writes blocks of GPU 0, one of them allocated (and, with
  // vmm:on, mapped) after peer access was enabled.
  int can = 0;
  CK(cudaDeviceCanAccessPeer(&can, 1, 0));
  if (!check("peer_access_possible", can == 1, "cudaDeviceCanAccessPeer(1, 0) = %d", can)) return 1;
  CK(cudaSetDevice(1));
  CK(cudaDeviceEnablePeerAccess(0, 0));
  const size_t odd = 150 * MiB + 12345;
  void *after0 = alloc_on(0, odd, 4);
  struct Case {
    const char *name;
    void *p;
    size_t n;
    uint8_t seed;
  } cases[] = {{"peer_kernel_small_block", small0, 4096, 1},
               {"peer_kernel_large_block", large0, 64 * MiB, 2},
               {"peer_kernel_block_mapped_after_enable", after0, odd, 4}};
  CK(cudaSetDevice(1));
  for (auto &c : cases) add_bytes<<<256, 256>>>((uint8_t *)c.p, c.n, 5);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  for (auto &c : cases) {
    size_t bad = mismatches(c.p, c.n, c.seed, 5);
    check(c.name, bad == 0, "%zu of %zu bytes wrong", bad, c.n);
  }

  // Per-device limits and empty_cache.
  uint64_t r0 = reserved_on(0);
  check("limit_set_on_gpu0", (int)cupool_set_memory_limit(0, r0 + 128 * MiB) == CUP_OK);
  CK(cudaSetDevice(0));
  void *over = nullptr;
  cudaError_t e0 = cudaMalloc(&over, 512 * MiB);
  check("limit_refuses_on_gpu0", e0 == cudaErrorMemoryAllocation, "-> %s", cudaGetErrorName(e0));
  (void)cudaGetLastError();
  CK(cudaSetDevice(1));
  void *fine = nullptr;
  cudaError_t e1 = cudaMalloc(&fine, 512 * MiB);
  check("limit_leaves_gpu1_alone", e1 == cudaSuccess && pointer_device(fine) == 1, "-> %s",
        cudaGetErrorName(e1));
  check("limit_cleared", (int)cupool_set_memory_limit(0, 0) == CUP_OK);
  CK(cudaSetDevice(0));
  CK(cudaFree(small0));
  CK(cudaFree(large0));
  CK(cudaFree(after0));
  CK(cudaDeviceSynchronize());
  CK(cudaSetDevice(1));
  CK(cudaFree(large1));
  CK(cudaDeviceSynchronize());
  uint64_t r1_before = reserved_on(1);
  size_t released = 0;
  check("empty_cache_device_0", (int)cupool_empty_cache_device(0, &released) == CUP_OK);
  uint64_t r0_after = reserved_on(0), r1_after = reserved_on(1);
  check("empty_cache_gpu0_released", r0_after == 0 && released > 0,
        "gpu0 reserved %llu bytes after, %zu released", (unsigned long long)r0_after, released);
  check("empty_cache_gpu1_untouched", r1_after == r1_before && r1_after > 0,
        "gpu1 reserved %llu -> %llu", (unsigned long long)r1_before, (unsigned long long)r1_after);
  CK(cudaFree(fine));

  bench(pairs, pairs);
  printf("RESULT %d failures\n", g_failures);
  return g_failures ? 1 : 0;
}
