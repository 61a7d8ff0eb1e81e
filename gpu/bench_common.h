// Allocation benchmarks shared by bench_alloc.cu (cupool, cudaMallocAsync, cudaMalloc) and
// torch_alloc_ext.cpp (PyTorch's caching allocator), so every allocator runs the very same
// loops. Host code only: compiles with nvcc and with the C++ compiler of a torch extension.
//
// An allocator is a type with
//   static const char *name();
//   static bool alloc(void **p, size_t n, cudaStream_t s);   // true on success
//   static void release(void *p, cudaStream_t s);
//   static Costs costs();                                    // repetition counts
// Results are printed as lines "BENCH section allocator case key=value ..." that the
// suite's report reads.
#pragma once
#include <cuda_runtime_api.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace bench {

inline double now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

// How many pairs one timed batch holds and how many batches are timed. A single cache-hit
// pair (~10-1000 ns) is too short for the clock, so fast allocators time batches of 1000
// and report statistics of the per-pair averages; cudaMalloc (~60 us) is timed per pair.
struct Costs {
  int batch;           // pairs per timed batch
  int repeats;         // timed batches
  int thread_pairs;    // pairs per thread in the throughput test
  size_t max_live;     // largest live-block count this allocator is run with
};

inline Costs fast_costs() { return Costs{1000, 200, 20000, 100000}; }
inline Costs slow_costs() { return Costs{1, 100, 150, 1000}; }

struct Summary {
  double median, p99, min;
};

inline Summary summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t p99 = (size_t)((double)(v.size() - 1) * 0.99 + 0.5);
  return Summary{v[v.size() / 2], v[std::min(p99, v.size() - 1)], v[0]};
}

// Fixed pseudo-random sequence, the same for every allocator.
struct Lcg {
  uint64_t state;
  explicit Lcg(uint64_t seed) : state(seed) {}
  uint32_t next() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(state >> 33);
  }
  // Log-uniform size in [lo, hi].
  size_t size_between(size_t lo, size_t hi) {
    int lo_bits = 63 - __builtin_clzll(lo), hi_bits = 63 - __builtin_clzll(hi);
    int bits = lo_bits + (int)(next() % (uint32_t)(hi_bits - lo_bits + 1));
    size_t base = (size_t)1 << bits;
    size_t n = base + next() % base;
    return std::min(std::max(n, lo), hi);
  }
};

[[noreturn]] inline void die(const char *who, const char *what, size_t n) {
  printf("BENCH_ERROR %s %s failed (size %zu)\n", who, what, n);
  fflush(stdout);
  exit(3);
}

// Can this allocator allocate at all? (cupool's stub cannot yet.)
template <class A>
bool available(cudaStream_t s) {
  void *p = nullptr;
  if (!A::alloc(&p, 4096, s)) {
    printf("BENCH_UNAVAILABLE %s\n", A::name());
    fflush(stdout);
    return false;
  }
  A::release(p, s);
  return true;
}

// (a) One size, allocated and freed again and again: the cache-hit path. `label` names the
// row (the same loop on a default stream is reported as its own row).
template <class A>
void latency_same(size_t size, cudaStream_t s, const char *label = "latency_same") {
  Costs c = A::costs();
  int batch = c.batch, repeats = c.repeats;
  if (size >= (64u << 20) && batch == 1) repeats = 50;
  for (int i = 0; i < 100; i++) {  // warm: first segment, thread caches
    void *p;
    if (!A::alloc(&p, size, s)) die(A::name(), "alloc", size);
    A::release(p, s);
  }
  std::vector<double> per_pair;
  per_pair.reserve(repeats);
  for (int r = 0; r < repeats; r++) {
    double t0 = now_ns();
    for (int i = 0; i < batch; i++) {
      void *p;
      if (!A::alloc(&p, size, s)) die(A::name(), "alloc", size);
      A::release(p, s);
    }
    per_pair.push_back((now_ns() - t0) / batch);
  }
  Summary m = summarize(per_pair);
  printf("BENCH %s %s %zu median_ns=%.1f p99_ns=%.1f min_ns=%.1f batch=%d repeats=%d\n",
         label, A::name(), size, m.median, m.p99, m.min, batch, repeats);
  fflush(stdout);
}

// Frees a random live block and allocates a new one of a random size in its slot.
template <class A>
inline void churn_one(std::vector<void *> &live, Lcg &rng, size_t lo, size_t hi, cudaStream_t s) {
  size_t k = rng.next() % live.size();
  A::release(live[k], s);
  size_t n = rng.size_between(lo, hi);
  if (!A::alloc(&live[k], n, s)) die(A::name(), "alloc", n);
}

template <class A>
Summary churn(size_t live_count, size_t lo, size_t hi, cudaStream_t s, int batch, int repeats) {
  Lcg rng(42);
  std::vector<void *> live(live_count);
  for (size_t i = 0; i < live_count; i++) {
    size_t n = rng.size_between(lo, hi);
    if (!A::alloc(&live[i], n, s)) die(A::name(), "prefill alloc", n);
  }
  for (int i = 0; i < std::max(batch, 64); i++) churn_one<A>(live, rng, lo, hi, s);  // warm
  std::vector<double> per_pair;
  for (int r = 0; r < repeats; r++) {
    double t0 = now_ns();
    for (int i = 0; i < batch; i++) churn_one<A>(live, rng, lo, hi, s);
    per_pair.push_back((now_ns() - t0) / batch);
  }
  for (void *p : live) A::release(p, s);
  cudaStreamSynchronize(s);
  return summarize(per_pair);
}

// (b) Mixed sizes 512 B - 4 MiB with 64 blocks live.
template <class A>
void latency_mixed(cudaStream_t s) {
  Costs c = A::costs();
  Summary m = churn<A>(64, 512, 4u << 20, s, c.batch, c.repeats);
  printf("BENCH latency_mixed %s 64live median_ns=%.1f p99_ns=%.1f min_ns=%.1f\n", A::name(), m.median,
         m.p99, m.min);
  fflush(stdout);
}

// Cost per pair with N live blocks of mixed small sizes (256 B - 64 KiB).
template <class A>
void live_blocks(size_t n, cudaStream_t s) {
  Costs c = A::costs();
  if (n > c.max_live) {
    printf("BENCH live %s %zu skipped=1\n", A::name(), n);
    return;
  }
  Summary m = churn<A>(n, 256, 64u << 10, s, c.batch, std::max(20, c.repeats / 2));
  printf("BENCH live %s %zu median_ns=%.1f p99_ns=%.1f\n", A::name(), n, m.median, m.p99);
  fflush(stdout);
}

// The CPUs this process may run on, ascending.
inline std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

// Pins the calling thread to `cpu` (no-op for -1).
inline void pin_to(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

// The CPU that thread `t` of `threads` is pinned to for the per-core reference below: one
// each, when the process may use that many CPUs; -1 when it may not.
inline int reference_cpu(int t, int threads) {
  static const std::vector<int> cpus = allowed_cpus();
  return threads <= (int)cpus.size() ? cpus[t] : -1;
}

// The CPU that worker `t` of the throughput test is pinned to: none (-1, the scheduler's
// choice, as the suite has always run it) unless BENCH_THREAD_PIN=1. On an H200 host the
// two gave the same share of the per-core reference, within the runs' spread
// (docs/BENCHMARKS.md, nineteenth session).
inline int cpu_for_thread(int t, int threads) {
  const char *pin = getenv("BENCH_THREAD_PIN");
  return pin != nullptr && strcmp(pin, "1") == 0 ? reference_cpu(t, threads) : -1;
}

// The thread test's pairs per thread (the allocator's default, or BENCH_THREAD_PAIRS) and
// their size (64 KiB, or BENCH_THREAD_SIZE: diagnostic), read by both of its loops.
template <class A>
void thread_test_shape(int &pairs, size_t &size) {
  pairs = A::costs().thread_pairs;
  if (const char *n = getenv("BENCH_THREAD_PAIRS")) pairs = atoi(n);
  const char *bytes = getenv("BENCH_THREAD_SIZE");
  size = bytes ? strtoull(bytes, nullptr, 10) : 64u << 10;
}

// `n` alloc+free pairs of `size` bytes on `s`; false at the first failed allocation.
template <class A>
bool pairs_on(int n, size_t size, cudaStream_t s) {
  for (int i = 0; i < n; i++) {
    void *p;
    if (!A::alloc(&p, size, s)) return false;
    A::release(p, s);
  }
  return true;
}

// Aggregate pairs per second of `threads` threads, each with its own stream, each doing the
// same number of 64 KiB pairs; all start together. Median of 3 runs. Knobs, to tell where
// the scaling goes: BENCH_THREAD_PAIRS=N pairs per thread instead of the allocator's
// default (longer runs, less start skew); BENCH_THREAD_STREAM=null has each thread use the
// NULL stream instead of a stream of its own (no stream creation, and the pool's ids of
// the default streams need no driver call). Besides the aggregate it prints the sum of the
// threads' own rates (pairs over each thread's own time), which start skew does not lower.
template <class A>
void throughput(int threads) {
  int thread_pairs;
  size_t size;
  thread_test_shape<A>(thread_pairs, size);
  const char *mode = getenv("BENCH_THREAD_STREAM");
  const bool null_stream = mode != nullptr && strcmp(mode, "null") == 0;
  std::vector<double> own_sums, skews, slowest, fastest;
  std::vector<double> rates;
  for (int run = 0; run < 3; run++) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::atomic<int> failures{0};
    // Each thread times its own pair loop; the aggregate spans first start to last end,
    // so stream creation, teardown and thread joins stay outside the measurement.
    std::vector<double> starts(threads), ends(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; t++)
      pool.emplace_back([&, t] {
        pin_to(cpu_for_thread(t, threads));
        cudaStream_t s = nullptr;
        if (!null_stream && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
          failures++;
          ready++;
          return;
        }
        if (!pairs_on<A>(50, size, s)) failures++;  // warm this thread's cache
        ready++;
        while (!go.load(std::memory_order_acquire)) {
        }
        starts[t] = now_ns();
        if (!pairs_on<A>(thread_pairs, size, s)) failures++;
        ends[t] = now_ns();
        cudaStreamSynchronize(s);
        if (!null_stream) cudaStreamDestroy(s);
      });
    // Sleeps rather than spins: with 16 workers spinning on `go` on a 16-core host, a
    // spinning main thread made 17 runnable threads, and the last worker started up to a
    // scheduler slice late. On an H200 host the start skew went from up to 7.9 ms to
    // 4-11 us (docs/BENCHMARKS.md, eighteenth session).
    while (ready.load() < threads) std::this_thread::sleep_for(std::chrono::microseconds(20));
    go.store(true, std::memory_order_release);
    for (auto &t : pool) t.join();
    double secs = (*std::max_element(ends.begin(), ends.end()) -
                   *std::min_element(starts.begin(), starts.end())) / 1e9;
    if (failures.load()) die(A::name(), "threaded alloc", size);
    rates.push_back((double)threads * thread_pairs / secs);
    double own = 0, lo = 1e300, hi = 0;
    for (int t = 0; t < threads; t++) {
      double took = ends[t] - starts[t];
      own += thread_pairs / (took / 1e9);
      lo = std::min(lo, took);
      hi = std::max(hi, took);
    }
    own_sums.push_back(own);
    skews.push_back(*std::max_element(starts.begin(), starts.end()) -
                    *std::min_element(starts.begin(), starts.end()));
    slowest.push_back(hi);
    fastest.push_back(lo);
  }
  std::sort(rates.begin(), rates.end());
  for (auto *v : {&own_sums, &skews, &slowest, &fastest}) std::sort(v->begin(), v->end());
  double rate = rates[1];
  // own_rates_sum: the threads' own rates summed (start skew and stragglers do not lower
  // it); start_skew_us: last start minus first; thread_ms_min/max: the fastest and slowest
  // thread's own loop (medians over the runs).
  printf("BENCH threads %s %d pairs_per_s=%.0f ns_per_pair_aggregate=%.1f pairs_per_thread=%d "
         "own_rates_sum=%.0f start_skew_us=%.1f thread_ms_min=%.2f thread_ms_max=%.2f "
         "stream=%s\n",
         A::name(), threads, rate, 1e9 / rate, thread_pairs, own_sums[1], skews[1] / 1e3,
         fastest[1] / 1e6, slowest[1] / 1e6, null_stream ? "null" : "own");
  fflush(stdout);
}

// One thread's rate on each of the CPUs that `threads` threads run on (pinned there, the
// same loop as `throughput`, median of 3 runs each): what perfect scaling would give on
// these cores. Why: on a host whose cores run the same loop at two speeds about 2x apart
// (cores shared with other load), "one thread's rate" depends on where that thread ran,
// and the 16-thread ratio swung between 6x and 19x with the same library
// (docs/BENCHMARKS.md, eighteenth session). Prints the sum and the slowest and fastest
// CPU's rate; the report compares the threads' own rates summed with the sum.
template <class A>
void per_cpu_rates(int threads) {
  if (reference_cpu(0, threads) < 0) return;
  int thread_pairs;
  size_t size;
  thread_test_shape<A>(thread_pairs, size);
  double sum = 0, lo = 1e300, hi = 0;
  for (int t = 0; t < threads; t++) {
    std::vector<double> rates;
    std::thread worker([&] {
      pin_to(reference_cpu(t, threads));
      cudaStream_t s = nullptr;
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return;
      for (int run = 0; run < 3; run++) {
        if (!pairs_on<A>(50, size, s)) return;
        double t0 = now_ns();
        if (!pairs_on<A>(thread_pairs, size, s)) return;
        rates.push_back(thread_pairs / ((now_ns() - t0) / 1e9));
      }
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    });
    worker.join();
    if (rates.size() != 3) die(A::name(), "per-CPU alloc", size);
    std::sort(rates.begin(), rates.end());
    sum += rates[1];
    lo = std::min(lo, rates[1]);
    hi = std::max(hi, rates[1]);
  }
  printf("BENCH threads_per_cpu %s %d pairs_per_s_sum=%.0f slowest_cpu=%.0f fastest_cpu=%.0f\n",
         A::name(), threads, sum, lo, hi);
  fflush(stdout);
}

// Everything, for one allocator (BENCH_THREADS_ONLY=1: only the throughput test).
template <class A>
void run_all(const std::vector<int> &thread_counts) {
  const int most = thread_counts.empty() ? 0 : *std::max_element(thread_counts.begin(), thread_counts.end());
  if (getenv("BENCH_THREADS_ONLY")) {
    for (int t : thread_counts) throughput<A>(t);
    if (most > 1) per_cpu_rates<A>(most);
    return;
  }
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) die(A::name(), "stream", 0);
  if (!available<A>(s)) return;
  const size_t sizes[] = {512, 64u << 10, 1u << 20, 64u << 20};
  for (size_t n : sizes) latency_same<A>(n, s);
  // The same loop on the default streams programs use most (PyTorch's and CuPy's is NULL).
  latency_same<A>(512, (cudaStream_t)0, "latency_null");
  latency_same<A>(512, cudaStreamLegacy, "latency_legacy");
  latency_mixed<A>(s);
  const size_t lives[] = {10, 1000, 100000};
  for (size_t n : lives) live_blocks<A>(n, s);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  for (int t : thread_counts) throughput<A>(t);
  if (most > 1) per_cpu_rates<A>(most);
}

}  // namespace bench
