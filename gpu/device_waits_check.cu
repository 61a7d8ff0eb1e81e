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
// Phase 3: a non-blocking stream is created while a late writer is queued: device waits go
// on, the new stream waits for the device (the program does not); the new owner writes on
// that stream.
// Phase 4: the late writer and the new owner on non-blocking streams (the same one, then
// two different ones), and the late writer on a blocking stream with the new owner on a
// non-blocking one: reused behind device waits, data intact.
// Phase 5: what a device wait costs per listed non-blocking stream: pairs that each reuse a
// block behind a device wait (the device held busy by a late writer elsewhere), timed with
// 2 and with 64 listed streams (INFO only; no timing is checked).
// Phase 6: 2 more non-blocking streams (66, past the bound of live ones device waits make
// wait): device waits end, after a wait for the device; order is kept, and no device wait
// follows.
#include <algorithm>
#include <thread>
#include <vector>

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

// Median ns of a cudaMalloc+cudaFree pair of 64 MiB while a late writer keeps the device
// busy on `late`: each free's fence is incomplete at the next allocation, which takes the
// block back behind a device wait (under the preload).
static double pair_ns_behind_device_waits(cudaStream_t late) {
  uint8_t *busy = nullptr;
  CK(cudaMalloc(&busy, 2u << 20));
  spin_then_fill<<<1, 32, 0, late>>>(busy, 32, 7, 40 * kLateNs);
  CK(cudaGetLastError());
  std::vector<double> ns;
  for (int i = 0; i < 400; i++) {
    void *p = nullptr;
    const double t0 = now_ns();
    CK(cudaMalloc(&p, kBytes));
    CK(cudaFree(p));
    ns.push_back(now_ns() - t0);
  }
  CK(cudaDeviceSynchronize());
  CK(cudaFree(busy));
  std::sort(ns.begin(), ns.end());
  return ns[ns.size() / 2];
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
  cudaStream_t nb, nb2;
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
  if (preloaded) {
    check("device_waits.creation_does_not_wait_for_the_device", create_ms < 10.0,
          "cudaStreamCreateWithFlags took %.2f ms with a 20 ms late writer queued", create_ms);
  }
  info("non-blocking stream created in %.2f ms with a 20 ms late writer queued", create_ms);

  // Phase 4: non-blocking streams on either side.
  CK(cudaStreamCreateWithFlags(&nb2, cudaStreamNonBlocking));
  long long waits2 = pool_counter("fence_device_waits");
  Outcome same, across, mixed;
  for (int r = 0; r < kRounds; r++) round_on(nb, nb, 1000 + 2 * r, same);
  for (int r = 0; r < kRounds; r++) round_on(nb, nb2, 1200 + 2 * r, across);
  for (int r = 0; r < kRounds; r++) round_on(s1, nb2, 1400 + 2 * r, mixed);
  long long waits3 = pool_counter("fence_device_waits");
  check("device_waits.non_blocking_same_stream_keeps_order", same.bad == 0, "%llu bytes wrong",
        same.bad);
  check("device_waits.non_blocking_streams_keep_order", across.bad == 0, "%llu bytes wrong",
        across.bad);
  check("device_waits.blocking_to_non_blocking_keeps_order", mixed.bad == 0,
        "%llu bytes wrong", mixed.bad);
  if (preloaded) {
    check("device_waits.reused_with_non_blocking_streams",
          across.reused >= kRounds - 1 && mixed.reused >= kRounds - 1 && waits3 > waits2,
          "%d and %d of %d reused, device waits %lld -> %lld", across.reused, mixed.reused,
          kRounds, waits2, waits3);
  }
  info("non-blocking streams: %d / %d / %d of %d reallocations got the block back (same "
       "stream / two / blocking to non-blocking); device waits %lld -> %lld",
       same.reused, across.reused, mixed.reused, kRounds, waits2, waits3);

  // Phase 5: the cost of a device wait per listed stream.
  const double pair_2 = pair_ns_behind_device_waits(s1);
  std::vector<cudaStream_t> many(62);
  for (auto &s : many) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double pair_64 = pair_ns_behind_device_waits(s1);
  info("a cudaMalloc+cudaFree pair reused behind a device wait: %.0f ns with 2 listed "
       "non-blocking streams, %.0f ns with 64 (%.0f ns a stream wait)",
       pair_2, pair_64, (pair_64 - pair_2) / 62);

  // Phase 6: past the bound of live non-blocking streams, device waits end.
  for (int i = 0; i < 2; i++) {
    many.emplace_back();
    CK(cudaStreamCreateWithFlags(&many.back(), cudaStreamNonBlocking));
  }
  long long waits4 = pool_counter("fence_device_waits");
  Outcome p5;
  for (int r = 0; r < kRounds / 4; r++) round_on(s1, nb2, 1600 + 2 * r, p5);
  long long waits5 = pool_counter("fence_device_waits");
  check("device_waits.order_kept_after_the_end", p5.bad == 0, "%llu bytes wrong", p5.bad);
  if (preloaded) {
    check("device_waits.none_past_the_stream_bound", waits5 == waits4,
          "device waits %lld -> %lld", waits4, waits5);
  }
  info("after 66 non-blocking streams: %d of %d reallocations got the block back, device waits "
       "%lld -> %lld",
       p5.reused, kRounds / 4, waits4, waits5);
  for (auto &s : many) CK(cudaStreamDestroy(s));
  CK(cudaStreamDestroy(nb2));
  CK(cudaStreamDestroy(nb));
  CK(cudaStreamDestroy(s1));
  CK(cudaStreamDestroy(s2));
  return g_failures ? 1 : 0;
}
