// Does a context fence cost more when many threads take turns recording it? The fast-path
// issue's streamless path at 16 threads spends most of its time in shared context fences,
// and each record took 1.3 µs there against 0.45 µs on one thread (docs/BENCHMARKS.md,
// sixteenth session). This probe separates the causes. T threads each loop over a stand-in
// for a pair (FT_WORK_NS of spinning, plus one cuCtxGetCurrent as the pool's path makes),
// and every FT_EVERY iterations a thread wants a fence:
//   mode rotate  the thread that wants it records one under a try-lock, as the pool's
//                shared thread fences do (the oldest in flight queried first, at most 4);
//   mode owner   only thread 0 records and queries; the others never call the driver for
//                fences (a dedicated fence thread, or an owner that keeps the role);
//   mode alone   thread 0 alone, the others not started (the one-thread cost);
// Prints, per mode and thread count:
//   FT <mode> threads=T record_ns=.. query_ns=.. fences=.. iters_per_s=.. (all threads)
//      slowest_ms=.. fastest_ms=..
//   nvcc -O2 -std=c++17 -arch=native gpu/tools/fence_threads.cu -o fence_threads -lcuda -lpthread
//   ./fence_threads 1 4 16
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

static double now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

static void check(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) {
    const char *s = "?";
    cuGetErrorString(r, &s);
    fprintf(stderr, "fence_threads: %s failed: %s\n", what, s);
    exit(1);
  }
}

struct Clock {
  std::mutex lock;
  CUevent ring[4];
  int head = 0, len = 0;
  std::vector<CUevent> spare;
  // Timed under the lock, so plain counters.
  double record_ns = 0, query_ns = 0;
  long records = 0, queries = 0;

  void advance(CUcontext ctx) {
    while (len > 0) {
      double t0 = now_ns();
      CUresult r = cuEventQuery(ring[head]);
      query_ns += now_ns() - t0;
      queries++;
      if (r != CUDA_SUCCESS) break;
      spare.push_back(ring[head]);
      head = (head + 1) % 4;
      len--;
    }
    if (len < 4) {
      CUevent ev = spare.back();
      spare.pop_back();
      double t0 = now_ns();
      check(cuCtxRecordEvent(ctx, ev), "cuCtxRecordEvent");
      record_ns += now_ns() - t0;
      records++;
      ring[(head + len) % 4] = ev;
      len++;
    }
  }
};

static void spin_ns(double ns) {
  double end = now_ns() + ns;
  while (now_ns() < end) {
  }
}

int main(int argc, char **argv) {
  check(cuInit(0), "cuInit");
  CUdevice dev;
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  CUcontext ctx;
  check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  double work = getenv("FT_WORK_NS") ? atof(getenv("FT_WORK_NS")) : 150;
  int every = getenv("FT_EVERY") ? atoi(getenv("FT_EVERY")) : 8;
  long iters = getenv("FT_ITERS") ? atol(getenv("FT_ITERS")) : 100000;
  std::vector<int> counts;
  for (int i = 1; i < argc; i++) counts.push_back(atoi(argv[i]));
  if (counts.empty()) counts = {1, 4, 16};
  for (const char *mode : {"alone", "rotate", "owner"}) {
    for (int threads : counts) {
      if (std::string(mode) == "alone" && threads != 1) continue;
      Clock clock;
      for (int i = 0; i < 64; i++) {
        CUevent ev;
        check(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
        clock.spare.push_back(ev);
      }
      std::atomic<int> ready{0};
      std::vector<double> took(threads);
      auto body = [&](int me) {
        check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        ready.fetch_add(1);
        while (ready.load() < threads) {
        }
        double t0 = now_ns();
        for (long i = 0; i < iters; i++) {
          CUcontext cur;
          cuCtxGetCurrent(&cur);
          spin_ns(work);
          if (i % every != every - 1) continue;
          bool mine = std::string(mode) != "owner" || me == 0;
          if (!mine) continue;
          if (std::string(mode) == "owner") {
            std::lock_guard<std::mutex> g(clock.lock);
            clock.advance(ctx);
          } else if (clock.lock.try_lock()) {
            clock.advance(ctx);
            clock.lock.unlock();
          }
        }
        took[me] = now_ns() - t0;
      };
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; t++) pool.emplace_back(body, t);
      for (auto &t : pool) t.join();
      double slow = *std::max_element(took.begin(), took.end());
      double fast = *std::min_element(took.begin(), took.end());
      printf("FT %s threads=%d record_ns=%.0f query_ns=%.0f fences=%ld queries=%ld "
             "iters_per_s=%.2fM slowest_ms=%.1f fastest_ms=%.1f\n",
             mode, threads, clock.records ? clock.record_ns / clock.records : 0.0,
             clock.queries ? clock.query_ns / clock.queries : 0.0, clock.records,
             clock.queries, threads * iters / slow * 1e3, slow / 1e6, fast / 1e6);
      fflush(stdout);
      check(cuCtxSynchronize(), "cuCtxSynchronize");
      for (int i = 0; i < clock.len; i++) clock.spare.push_back(clock.ring[(clock.head + i) % 4]);
      for (CUevent ev : clock.spare) cuEventDestroy(ev);
    }
  }
  return 0;
}
