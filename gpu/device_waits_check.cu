// device_waits_check: `fence_waits` (default `auto`: device waits under the preload) while
// the GPU is behind (Note [device waits] in src/pool/device_waits.rs). Run as
//   LD_PRELOAD=libcupool_preload.so ./device_waits_check
// (the suite's group `preload`); without the preload the checks on data still pass and the
// ones on the pool's counters say what they saw.
//
// Each round: a late writer (a kernel that waits, then writes pattern A) is queued on a
// 64 MiB block, the block is freed at once (no stream), the same size is allocated again
// and pattern B is written by the new owner; the device is synchronised, then the block is
// checked. A block handed back before the late writer ran, with nothing ordering the new
// owner's work after it, ends with A's bytes.
// Phase 1: the late writer on one blocking stream, the new owner on another.
// Phase 2: the late writer on one thread's per-thread default stream, the new owner on
// another thread's.
// Phase 3: a non-blocking stream is created while a late writer is queued (device waits
// end there, after a wait for the device); the new owner writes on that stream. Then the
// phase-1 round again: the pool must not wait on the device any more.
#include <thread>

#include "common.cuh"

static const size_t kBytes = 64u << 20;
static const uint64_t kLateNs = 2ull * 1000 * 1000;
static const int kRounds = 40;

struct Outcome {
  int reused = 0;
  unsigned long long bad = 0;
};

// One round: late writer on `late`, free, allocate, pattern on `owner`, synchronise, check.
static void round_on(cudaStream_t late, cudaStream_t owner, uint32_t seed, Outcome &out) {
  const unsigned grid = grid_for(kBytes);
  uint8_t *a = nullptr, *b = nullptr;
  CK(cudaMalloc(&a, kBytes));
  spin_then_fill<<<grid, 256, 0, late>>>(a, kBytes, seed, kLateNs);
  CK(cudaGetLastError());
  CK(cudaFree(a));
  CK(cudaMalloc(&b, kBytes));
  out.reused += a == b;
  fill_pattern<<<grid, 256, 0, owner>>>(b, kBytes, seed + 1);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());  // the late writer has run, whenever it ran
  out.bad += device_mismatches(b, kBytes, seed + 1, owner);
  CK(cudaFree(b));
}

int main() {
  CK(cudaFree(0));
  const bool preloaded = pool_counter("fence_device_waits") >= 0;

  // Phase 1: two blocking streams.
  cudaStream_t s1, s2;
  CK(cudaStreamCreate(&s1));
  CK(cudaStreamCreate(&s2));
  long long waits0 = pool_counter("fence_device_waits");
  long long grows0 = pool_counter("device_allocs");
  Outcome p1;
  for (int r = 0; r < kRounds; r++) round_on(s1, s2, 100 + 2 * r, p1);
  long long waits1 = pool_counter("fence_device_waits");
  check("device_waits.blocking_streams_keep_order", p1.bad == 0, "%llu bytes wrong", p1.bad);
  if (preloaded) {
    check("device_waits.reused_behind_a_device_wait", p1.reused >= kRounds - 1 && waits1 > waits0,
          "%d of %d reused, device waits %lld -> %lld", p1.reused, kRounds, waits0, waits1);
  }
  info("blocking streams: %d of %d reallocations got the block back; device waits %lld -> %lld, "
       "driver allocations %lld -> %lld",
       p1.reused, kRounds, waits0, waits1, grows0, pool_counter("device_allocs"));

  // Phase 2: per-thread default streams of two threads, the free on the first thread.
  Outcome p2;
  for (int r = 0; r < kRounds; r++) {
    const unsigned grid = grid_for(kBytes);
    uint8_t *a = nullptr, *b = nullptr;
    std::thread late([&] {
      CK(cudaMalloc(&a, kBytes));
      spin_then_fill<<<grid, 256, 0, cudaStreamPerThread>>>(a, kBytes, 500 + 2 * r, kLateNs);
      CK(cudaGetLastError());
      CK(cudaFree(a));
    });
    late.join();
    std::thread owner([&] {
      CK(cudaMalloc(&b, kBytes));
      fill_pattern<<<grid, 256, 0, cudaStreamPerThread>>>(b, kBytes, 501 + 2 * r);
      CK(cudaGetLastError());
    });
    owner.join();
    p2.reused += a == b;
    CK(cudaDeviceSynchronize());
    p2.bad += device_mismatches(b, kBytes, 501 + 2 * r, 0);
    CK(cudaFree(b));
  }
  check("device_waits.per_thread_streams_keep_order", p2.bad == 0, "%llu bytes wrong", p2.bad);
  info("per-thread default streams: %d of %d reallocations got the block back", p2.reused, kRounds);

  // Phase 3: a non-blocking stream created while a late writer is queued.
  uint8_t *z = nullptr, *w = nullptr;
  const unsigned grid = grid_for(kBytes);
  CK(cudaMalloc(&z, kBytes));
  spin_then_fill<<<grid, 256, 0, s1>>>(z, kBytes, 900, 10 * kLateNs);
  CK(cudaGetLastError());
  CK(cudaFree(z));
  // The first reallocation drains `z` behind a device wait (it is not complete yet).
  CK(cudaMalloc(&w, kBytes));
  CK(cudaFree(w));
  double t0 = now_ns();
  cudaStream_t nb;
  CK(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking));
  double create_ms = (now_ns() - t0) / 1e6;
  CK(cudaMalloc(&w, kBytes));
  fill_pattern<<<grid, 256, 0, nb>>>(w, kBytes, 901);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  unsigned long long bad3 = device_mismatches(w, kBytes, 901, nb);
  check("device_waits.non_blocking_stream_created_while_behind", bad3 == 0,
        "%llu bytes wrong (same block: %d)", bad3, (int)(w == z));
  CK(cudaFree(w));
  long long waits2 = pool_counter("fence_device_waits");
  Outcome p3;
  for (int r = 0; r < kRounds / 4; r++) round_on(s1, nb, 1000 + 2 * r, p3);
  long long waits3 = pool_counter("fence_device_waits");
  check("device_waits.order_kept_after_the_end", p3.bad == 0, "%llu bytes wrong", p3.bad);
  if (preloaded) {
    check("device_waits.none_after_a_non_blocking_stream", waits3 == waits2,
          "device waits %lld -> %lld", waits2, waits3);
  }
  info("non-blocking stream created in %.2f ms with a late writer queued; after it %d of %d "
       "reallocations got the block back, device waits %lld -> %lld",
       create_ms, p3.reused, kRounds / 4, waits2, waits3);
  CK(cudaStreamDestroy(nb));
  CK(cudaStreamDestroy(s1));
  CK(cudaStreamDestroy(s2));
  return g_failures ? 1 : 0;
}
