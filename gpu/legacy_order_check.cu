// legacy_order_check: `legacy_order:on` under the preload while the GPU is behind (Note
// [legacy order] in src/runtime/legacy_order.rs). Run as
//   CUPOOL_CONF=legacy_order:on LD_PRELOAD=libcupool_preload.so ./legacy_order_check
// (the suite's group `preload`); without the preload, or with the mode off, the checks on
// data still pass and the ones on the pool's counters say what they saw.
//
// Phase 1, no stream yet: a late writer (a kernel that waits 20 ms, then writes pattern A)
// is queued on a 64 MiB block, the block is freed at once, the same size is allocated
// again and pattern B is written on the legacy stream. Legacy order may hand back the same
// block with no fence; the legacy stream runs the late writer first, so the block ends
// with B. 50 such rounds, then the pool's fence count.
// Phase 2, the transition: the same late writer on a block freed at once, then a
// non-blocking stream is created (the mode ends there, after one wait for the device), the
// same size allocated and pattern C written on the new stream. If the end did not wait,
// the late writer, still running on the legacy stream, would overwrite C with A.
#include "common.cuh"

static const size_t kBytes = 64u << 20;
static const uint64_t kLateNs = 20ull * 1000 * 1000;

int main() {
  CK(cudaFree(0));
  const unsigned grid = grid_for(kBytes);
  // Phase 1.
  long long fences_before = pool_counter("fences_recorded");
  int reused = 0;
  unsigned long long bad = 0;
  for (int round = 0; round < 50; round++) {
    uint8_t *a = nullptr, *b = nullptr;
    CK(cudaMalloc(&a, kBytes));
    spin_then_fill<<<grid, 256>>>(a, kBytes, 1000 + round, kLateNs / 10);
    CK(cudaGetLastError());
    CK(cudaFree(a));
    CK(cudaMalloc(&b, kBytes));
    reused += a == b;
    fill_pattern<<<grid, 256>>>(b, kBytes, 2000 + round);
    CK(cudaGetLastError());
    bad += device_mismatches(b, kBytes, 2000 + round, 0);
    CK(cudaFree(b));
  }
  long long fences_after = pool_counter("fences_recorded");
  check("legacy_order.reuse_while_behind_keeps_order", bad == 0, "%llu bytes wrong", bad);
  // Run as the suite runs it (the preload and legacy_order:on), the mode must have served
  // these rounds: every reallocation the same block, and no fence. Elsewhere this says
  // nothing, so that the data checks above can run natively too.
  const char *conf = getenv("CUPOOL_CONF");
  if (fences_before >= 0 && conf && strstr(conf, "legacy_order:on")) {
    check("legacy_order.reused_at_once_without_fences",
          reused == 50 && fences_after == fences_before, "%d of 50 reused, fences %lld -> %lld",
          reused, fences_before, fences_after);
  }
  info("legacy order: %d of 50 reallocations got the block back at once; pool fences %lld -> %lld",
       reused, fences_before, fences_after);

  // Phase 2.
  uint8_t *z = nullptr, *w = nullptr;
  CK(cudaMalloc(&z, kBytes));
  spin_then_fill<<<grid, 256>>>(z, kBytes, 3000, kLateNs);
  CK(cudaGetLastError());
  CK(cudaFree(z));
  double t0 = now_ns();
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double create_ms = (now_ns() - t0) / 1e6;
  CK(cudaMalloc(&w, kBytes));
  fill_pattern<<<grid, 256, 0, s>>>(w, kBytes, 4000);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  unsigned long long bad2 = device_mismatches(w, kBytes, 4000, s);
  check("legacy_order.stream_created_while_behind", bad2 == 0,
        "%llu bytes wrong (same block: %d)", bad2, (int)(w == z));
  info("legacy order: cudaStreamCreate took %.2f ms with the late writer queued; same block: %d",
       create_ms, (int)(w == z));
  CK(cudaFree(w));
  CK(cudaStreamDestroy(s));
  return g_failures ? 1 : 0;
}
