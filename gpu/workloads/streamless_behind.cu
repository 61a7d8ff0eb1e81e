// streamless_behind: cudaMalloc/cudaFree (no stream) of many sizes while the GPU is behind.
//
// The pattern of issue 10's first cause: a program frees blocks with plain cudaFree while
// kernels that use them are still queued. Natively cudaFree waits for the device; cupool's
// preload does not wait, and must not hand the memory out again before that work is done.
//
// Every round, on a non-blocking stream S:
//   fill(victim, tag)          writes tag + i into every 32-bit word of a fresh block
//   spin(spin_us)              keeps S busy, so the GPU falls further behind every round
//   sum(victim) -> sums[round] reads the block back after the spin
// and on the host, right after queueing those: cudaFree(victim), then a burst of cudaMalloc
// and cudaFree of log-uniform sizes (512 B to 64 MiB) around a live set. Each burst block is
// written with cudaMemsetAsync on the legacy stream when allocated and checked on that
// stream before it is freed; the legacy stream does not wait for S. An allocator that reuses
// a victim's memory before S is done with it corrupts either the victim's sum or a burst
// block's bytes, and the checks at the end say so.
//
// Prints one JSON line (counts, errors, device peak above start from NVML, wall time, and
// cupool's stats when preloaded) and exits 0 when every check passed, 1 otherwise.
//
//   nvcc -O2 -o streamless_behind streamless_behind.cu
//   ./streamless_behind [--seed N] [--rounds N] [--burst N] [--spin-us N] [--live-max N]
//                       [--live-bytes-max BYTES] [--mode LABEL] [--out-json PATH]
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CK(call)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "streamless_behind: %s:%d %s -> %s\n", __FILE__, __LINE__, #call, \
              cudaGetErrorName(e_));                                                     \
      exit(2);                                                                           \
    }                                                                                    \
  } while (0)

// ---------------------------------------------------------------------------------------
// Deterministic randomness (splitmix64): the same seed gives the same sizes everywhere.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double unit() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
  uint64_t below(uint64_t n) { return next() % n; }
  // Log-uniform in [lo, hi], a multiple of 4 (32-bit words).
  size_t size(size_t lo, size_t hi) {
    double v = std::exp(std::log((double)lo) + unit() * (std::log((double)hi) - std::log((double)lo)));
    size_t n = (size_t)v & ~(size_t)3;
    return std::min(hi, std::max(lo, n));
  }
};

// ---------------------------------------------------------------------------------------
// Kernels

__global__ void fill_words(uint32_t *p, size_t n, uint32_t tag) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = tag + (uint32_t)i;
}

__global__ void spin_ns(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

__global__ void sum_words(const uint32_t *p, size_t n, unsigned long long *out) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    local += p[i];
  if (local) atomicAdd(out, local);
}

__global__ void count_bytes_not(const uint8_t *p, size_t n, uint8_t value, unsigned long long *bad) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    local += p[i] != value;
  if (local) atomicAdd(bad, local);
}

static unsigned grid_for(size_t n) { return (unsigned)std::min<size_t>(1024, (n + 255) / 256 + 1); }

// The sum of the words tag + i (each wrapped to 32 bits) over i < n, as sum_words adds them:
// the plain sum, less 2^32 for every word that wrapped (n < 2^32, so the words wrap at most
// once, from i = 2^32 - tag on).
static unsigned long long expected_sum(size_t n, uint32_t tag) {
  unsigned long long nn = n;
  unsigned long long plain = nn * tag + nn * (nn - 1) / 2;
  unsigned long long first_wrap = (1ull << 32) - tag;
  unsigned long long wrapped = nn > first_wrap ? nn - first_wrap : 0;
  return plain - (wrapped << 32);
}

// ---------------------------------------------------------------------------------------
// Device peak from NVML, loaded at run time (no link dependency; cudaMemGetInfo would count
// memory cupool caches as free).
struct NvmlMemory {
  unsigned long long total, free, used;
};
typedef int (*nvml_init_t)(void);
typedef int (*nvml_by_pci_t)(const char *, void **);
typedef int (*nvml_mem_t)(void *, NvmlMemory *);

struct PeakMonitor {
  nvml_mem_t mem = nullptr;
  void *dev = nullptr;
  std::atomic<bool> stop{false};
  std::atomic<unsigned long long> peak{0};
  unsigned long long start_used = 0, samples = 0;
  std::thread thread;
  std::string source = "none";

  bool read(unsigned long long *used) {
    NvmlMemory m;
    if (!mem || mem(dev, &m) != 0) return false;
    *used = m.used;
    return true;
  }
  void sample() {
    unsigned long long u;
    if (!read(&u)) return;
    samples++;
    unsigned long long p = peak.load();
    while (u > p && !peak.compare_exchange_weak(p, u)) {
    }
  }
  void begin(int cuda_device) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    char bus[64] = {0};
    if (lib && cudaDeviceGetPCIBusId(bus, sizeof bus, cuda_device) == cudaSuccess) {
      auto init = (nvml_init_t)dlsym(lib, "nvmlInit_v2");
      auto by_pci = (nvml_by_pci_t)dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2");
      mem = (nvml_mem_t)dlsym(lib, "nvmlDeviceGetMemoryInfo");
      if (!init || !by_pci || !mem || init() != 0 || by_pci(bus, &dev) != 0) mem = nullptr;
    }
    if (!mem || !read(&start_used)) {
      source = "unavailable (no libnvidia-ml.so.1)";
      mem = nullptr;
      return;
    }
    source = std::string("nvml (") + bus + ")";
    peak = start_used;
    thread = std::thread([this] {
      while (!stop.load()) {
        sample();
        std::this_thread::sleep_for(std::chrono::microseconds(1000));
      }
    });
  }
  long long end() {
    stop = true;
    if (thread.joinable()) thread.join();
    sample();
    return mem ? (long long)(peak.load() - start_used) : -1;
  }
};

// ---------------------------------------------------------------------------------------

struct Block {
  uint8_t *ptr;
  size_t bytes;
  uint8_t value;
};

static std::string cupool_stats_json() {
  typedef int (*stats_fn)(int, char *, size_t, size_t *);
  auto fn = (stats_fn)dlsym(RTLD_DEFAULT, "cupool_stats_json");
  if (!fn) return "null";
  size_t needed = 0;
  fn(-1, nullptr, 0, &needed);
  std::vector<char> buf(needed + 256);
  if (fn(-1, buf.data(), buf.size(), &needed) != 0) return "null";
  return std::string(buf.data());
}

static bool preload_active() {
  typedef int (*active_fn)(void);
  auto fn = (active_fn)dlsym(RTLD_DEFAULT, "cupool_interposition_active");
  return fn && fn() == 1;
}

int main(int argc, char **argv) {
  uint64_t seed = 1234;
  int rounds = 300, burst = 12, live_max = 48;
  double spin_us = 1500;
  size_t live_bytes_max = (size_t)2 << 30;
  size_t size_lo = 512, size_hi = (size_t)64 << 20;
  std::string mode, out_json;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto val = [&](void) -> const char * {
      if (i + 1 >= argc) {
        fprintf(stderr, "streamless_behind: %s needs a value\n", a.c_str());
        exit(64);
      }
      return argv[++i];
    };
    if (a == "--seed") seed = strtoull(val(), nullptr, 10);
    else if (a == "--rounds") rounds = atoi(val());
    else if (a == "--burst") burst = atoi(val());
    else if (a == "--spin-us") spin_us = atof(val());
    else if (a == "--live-max") live_max = atoi(val());
    else if (a == "--live-bytes-max") live_bytes_max = strtoull(val(), nullptr, 10);
    else if (a == "--mode") mode = val();
    else if (a == "--out-json") out_json = val();
    else {
      fprintf(stderr, "streamless_behind: unknown option %s (see the header of the source)\n", a.c_str());
      return 64;
    }
  }
  int device = 0;
  CK(cudaSetDevice(device));
  CK(cudaFree(nullptr));  // the context, before the start value of the device peak
  if (mode.empty()) mode = preload_active() ? "preload" : "native";
  PeakMonitor monitor;
  monitor.begin(device);

  Rng rng{seed};
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long *sums = nullptr, *bad_bytes = nullptr;
  CK(cudaMalloc(&sums, sizeof(unsigned long long) * (size_t)rounds));
  CK(cudaMalloc(&bad_bytes, sizeof(unsigned long long)));
  CK(cudaMemset(sums, 0, sizeof(unsigned long long) * (size_t)rounds));
  CK(cudaMemset(bad_bytes, 0, sizeof(unsigned long long)));
  CK(cudaDeviceSynchronize());

  std::vector<size_t> victim_words(rounds);
  std::vector<uint32_t> victim_tag(rounds);
  std::vector<Block> live;
  size_t live_bytes = 0, peak_live_bytes = 0;
  unsigned long long allocs = 0, frees = 0, bytes_requested = 0, checks = 0;
  auto t0 = std::chrono::steady_clock::now();

  auto free_block = [&](size_t idx) {
    Block b = live[idx];
    count_bytes_not<<<grid_for(b.bytes), 256>>>(b.ptr, b.bytes, b.value, bad_bytes);
    CK(cudaGetLastError());
    checks++;
    CK(cudaFree(b.ptr));
    frees++;
    live_bytes -= b.bytes;
    live[idx] = live.back();
    live.pop_back();
  };

  for (int r = 0; r < rounds; r++) {
    size_t vbytes = rng.size(size_lo, size_hi);
    size_t words = vbytes / 4;
    uint32_t tag = (uint32_t)rng.next();
    uint32_t *victim = nullptr;
    CK(cudaMalloc(&victim, vbytes));
    allocs++;
    bytes_requested += vbytes;
    fill_words<<<grid_for(words), 256, 0, s>>>(victim, words, tag);
    spin_ns<<<1, 1, 0, s>>>((uint64_t)(spin_us * 1000.0));
    sum_words<<<grid_for(words), 256, 0, s>>>(victim, words, sums + r);
    CK(cudaGetLastError());
    CK(cudaFree(victim));  // streamless, while S has not even started on it
    frees++;
    victim_words[r] = words;
    victim_tag[r] = tag;

    for (int k = 0; k < burst; k++) {
      bool grow = live.empty() || ((int)live.size() < live_max && live_bytes < live_bytes_max &&
                                   rng.below(100) < 55);
      if (grow) {
        Block b;
        b.bytes = rng.size(size_lo, size_hi);
        b.value = (uint8_t)(1 + rng.below(255));
        CK(cudaMalloc(&b.ptr, b.bytes));
        allocs++;
        bytes_requested += b.bytes;
        CK(cudaMemsetAsync(b.ptr, b.value, b.bytes, 0));
        live.push_back(b);
        live_bytes += b.bytes;
        peak_live_bytes = std::max(peak_live_bytes, live_bytes);
      } else {
        free_block((size_t)rng.below(live.size()));
      }
    }
  }
  double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  while (!live.empty()) free_block(live.size() - 1);
  CK(cudaDeviceSynchronize());
  double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  std::vector<unsigned long long> got(rounds);
  CK(cudaMemcpy(got.data(), sums, sizeof(unsigned long long) * (size_t)rounds, cudaMemcpyDeviceToHost));
  unsigned long long bad = 0;
  CK(cudaMemcpy(&bad, bad_bytes, sizeof bad, cudaMemcpyDeviceToHost));
  int bad_sums = 0, first_bad = -1;
  unsigned long long sum_checksum = 1469598103934665603ull;  // FNV-1a over the sums
  for (int r = 0; r < rounds; r++) {
    if (got[r] != expected_sum(victim_words[r], victim_tag[r])) {
      bad_sums++;
      if (first_bad < 0) first_bad = r;
    }
    for (int b = 0; b < 8; b++) sum_checksum = (sum_checksum ^ ((got[r] >> (8 * b)) & 0xff)) * 1099511628211ull;
  }
  CK(cudaFree(sums));
  CK(cudaFree(bad_bytes));
  CK(cudaStreamDestroy(s));
  CK(cudaDeviceSynchronize());
  long long peak = monitor.end();
  bool ok = bad_sums == 0 && bad == 0;

  char head[2048];
  snprintf(head, sizeof head,
           "{\"workload\":\"streamless_behind\",\"mode\":\"%s\",\"status\":\"%s\",\"seed\":%llu,"
           "\"steps\":%d,\"rounds\":%d,\"burst\":%d,\"spin_us\":%.1f,\"allocs\":%llu,\"frees\":%llu,"
           "\"bytes_requested\":%llu,\"peak_live_bytes\":%zu,\"block_checks\":%llu,"
           "\"bad_victim_sums\":%d,\"first_bad_round\":%d,\"bad_block_bytes\":%llu,"
           "\"loss_checksum\":\"%016llx\",\"host_ms\":%.3f,\"wall_ms\":%.3f,"
           "\"step_ms_median\":null,\"device_peak_bytes\":%lld,\"device_peak_source\":\"%s\","
           "\"device_peak_samples\":%llu,\"cupool\":",
           mode.c_str(), ok ? "ok" : "failed", (unsigned long long)seed, rounds, rounds, burst, spin_us,
           allocs, frees, bytes_requested, peak_live_bytes, checks, bad_sums, first_bad, bad, sum_checksum,
           host_ms, wall_ms, peak, monitor.source.c_str(), monitor.samples);
  std::string line = std::string(head) + cupool_stats_json() + "}";
  printf("%s\n", line.c_str());
  fflush(stdout);
  if (!out_json.empty()) {
    FILE *f = fopen(out_json.c_str(), "w");
    if (f) {
      fprintf(f, "%s\n", line.c_str());
      fclose(f);
    } else {
      fprintf(stderr, "streamless_behind: cannot write %s\n", out_json.c_str());
    }
  }
  return ok ? 0 : 1;
}
