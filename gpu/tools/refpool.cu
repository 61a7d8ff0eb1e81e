// A reference implementation of the cupool C API over cudaMallocAsync, for checking the GPU
// suite itself on a GPU before (or beside) the real library: the suite's tests must pass on a
// correct allocator and its benchmarks must run. It is slow where cupool must be fast
// (a streamless free synchronises the device) and it hooks nothing, so the suite's
// "free_does_not_wait_for_device" and preload checks are expected to fail on it.
// Never used by the suite unless CUPOOL_LIB_DIR points at it:
//   nvcc -O2 -std=c++17 -arch=sm_90 -Xcompiler -fPIC -shared -I include -I gpu gpu/tools/refpool.cu -o DIR/libcupool.so
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include <mutex>
#include <unordered_map>

#include "cupool_api.h"

namespace {
struct Block {
  size_t requested;
  cudaStream_t stream;
};
std::mutex g_lock;
std::unordered_map<void *, Block> g_live;
cupool_stats g_stats;
size_t g_limit = 0;

cudaMemPool_t pool() {
  static cudaMemPool_t p = [] {
    cudaMemPool_t mp = nullptr;
    cudaDeviceGetDefaultMemPool(&mp, 0);
    uint64_t keep = UINT64_MAX;
    cudaMemPoolSetAttribute(mp, cudaMemPoolAttrReleaseThreshold, &keep);
    return mp;
  }();
  return p;
}

uint64_t reserved_now() {
  uint64_t v = 0;
  cudaMemPoolGetAttribute(pool(), cudaMemPoolAttrReservedMemCurrent, &v);
  return v;
}

void level_add(cupool_stat &s, int64_t d) {
  s.current += d;
  if (s.current > s.peak) s.peak = s.current;
}

cupool_status do_alloc(void **out, size_t size, cudaStream_t stream, bool streamless) {
  if (!out) return CUPOOL_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(g_lock);
  size_t rounded = (size + 511) / 512 * 512;
  if (g_limit && g_stats.allocated_bytes.current + rounded > g_limit) {
    g_stats.num_ooms++;
    return CUPOOL_ERROR_OUT_OF_MEMORY;
  }
  uint64_t before = reserved_now();
  void *p = nullptr;
  cudaError_t e = cudaMallocAsync(&p, size ? size : 1, stream);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    g_stats.alloc_retries++;
    cudaDeviceSynchronize();
    cudaMemPoolTrimTo(pool(), 0);
    g_stats.device_frees++;
    e = cudaMallocAsync(&p, size ? size : 1, stream);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (e == cudaErrorMemoryAllocation) g_stats.num_ooms++;
    return e == cudaErrorMemoryAllocation ? CUPOOL_ERROR_OUT_OF_MEMORY : CUPOOL_ERROR_CUDA;
  }
  if (streamless) cudaStreamSynchronize(stream);
  uint64_t after = reserved_now();
  if (after > before) {
    g_stats.cache_misses++;
    g_stats.device_allocs++;
  } else {
    g_stats.cache_hits++;
  }
  g_live[p] = Block{size, stream};
  g_stats.num_allocs++;
  level_add(g_stats.allocated_bytes, (int64_t)rounded);
  level_add(g_stats.requested_bytes, (int64_t)size);
  *out = p;
  return CUPOOL_OK;
}

cupool_status do_free(void *p, cudaStream_t stream, bool streamless) {
  if (!p) return CUPOOL_OK;
  std::lock_guard<std::mutex> g(g_lock);
  auto it = g_live.find(p);
  if (it == g_live.end()) return CUPOOL_ERROR_INVALID_POINTER;
  Block b = it->second;
  g_live.erase(it);
  if (streamless) {
    cudaDeviceSynchronize();  // the slow, safe way: everything before the free is done
    stream = b.stream;
  }
  if (stream != b.stream) g_stats.cross_stream_frees++;
  if (cudaFreeAsync(p, stream) != cudaSuccess) return CUPOOL_ERROR_CUDA;
  g_stats.num_frees++;
  level_add(g_stats.allocated_bytes, -(int64_t)((b.requested + 511) / 512 * 512));
  level_add(g_stats.requested_bytes, -(int64_t)b.requested);
  return CUPOOL_OK;
}

cupool_stats snapshot() {
  cupool_stats s = g_stats;
  uint64_t r = reserved_now(), rp = 0;
  cudaMemPoolGetAttribute(pool(), cudaMemPoolAttrReservedMemHigh, &rp);
  s.reserved_bytes.current = r;
  s.reserved_bytes.peak = rp;
  s.cached_bytes.current = r > s.allocated_bytes.current ? r - s.allocated_bytes.current : 0;
  s.cached_bytes.peak = rp;
  s.size = sizeof s;
  s.version = CUP_STATS_VERSION;
  return s;
}
}  // namespace

extern "C" {
cupool_status cupool_alloc(void **p, size_t n) { return do_alloc(p, n, 0, true); }
cupool_status cupool_alloc_async(void **p, size_t n, struct CUstream_st *s) { return do_alloc(p, n, s, false); }
cupool_status cupool_free(void *p) { return do_free(p, 0, true); }
cupool_status cupool_free_async(void *p, struct CUstream_st *s) { return do_free(p, s, false); }
cupool_status cupool_get_stats(int, cupool_stats *out) {
  if (!out || out->size < sizeof(cupool_stats)) return CUPOOL_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(g_lock);
  *out = snapshot();
  return CUPOOL_OK;
}
cupool_status cupool_stats_json(int, char *buf, size_t len, size_t *needed) {
  cupool_stats s;
  {
    std::lock_guard<std::mutex> g(g_lock);
    s = snapshot();
  }
  char tmp[2048];
  int n = snprintf(tmp, sizeof tmp,
                   "{\"allocated_bytes\":{\"current\":%llu,\"peak\":%llu},\"reserved_bytes\":{\"current\":%llu,"
                   "\"peak\":%llu},\"requested_bytes\":{\"current\":%llu,\"peak\":%llu},\"cached_bytes\":{"
                   "\"current\":%llu,\"peak\":%llu},\"num_allocs\":%llu,\"num_frees\":%llu,\"cache_hits\":%llu,"
                   "\"cache_misses\":%llu,\"device_allocs\":%llu,\"device_frees\":%llu,\"alloc_retries\":%llu,"
                   "\"num_ooms\":%llu,\"fences_recorded\":%llu,\"cross_stream_frees\":%llu}",
                   (unsigned long long)s.allocated_bytes.current, (unsigned long long)s.allocated_bytes.peak,
                   (unsigned long long)s.reserved_bytes.current, (unsigned long long)s.reserved_bytes.peak,
                   (unsigned long long)s.requested_bytes.current, (unsigned long long)s.requested_bytes.peak,
                   (unsigned long long)s.cached_bytes.current, (unsigned long long)s.cached_bytes.peak,
                   (unsigned long long)s.num_allocs, (unsigned long long)s.num_frees,
                   (unsigned long long)s.cache_hits, (unsigned long long)s.cache_misses,
                   (unsigned long long)s.device_allocs, (unsigned long long)s.device_frees,
                   (unsigned long long)s.alloc_retries, (unsigned long long)s.num_ooms,
                   (unsigned long long)s.fences_recorded, (unsigned long long)s.cross_stream_frees);
  if (needed) *needed = (size_t)n + 1;
  if (!buf || len < (size_t)n + 1) return CUPOOL_ERROR_BUFFER_TOO_SMALL;
  memcpy(buf, tmp, (size_t)n + 1);
  return CUPOOL_OK;
}
cupool_status cupool_reset_peak_stats(int) {
  std::lock_guard<std::mutex> g(g_lock);
  g_stats.allocated_bytes.peak = g_stats.allocated_bytes.current;
  g_stats.requested_bytes.peak = g_stats.requested_bytes.current;
  uint64_t zero = 0;
  cudaMemPoolSetAttribute(pool(), cudaMemPoolAttrReservedMemHigh, &zero);
  return CUPOOL_OK;
}
cupool_status cupool_empty_cache(size_t *released) {
  std::lock_guard<std::mutex> g(g_lock);
  cudaDeviceSynchronize();
  uint64_t before = reserved_now();
  cudaMemPoolTrimTo(pool(), 0);
  uint64_t after = reserved_now();
  if (after < before) g_stats.device_frees++;
  if (released) *released = (size_t)(before - after);
  return CUPOOL_OK;
}
cupool_status cupool_set_memory_limit(int, size_t bytes) {
  std::lock_guard<std::mutex> g(g_lock);
  g_limit = bytes;
  return CUPOOL_OK;
}
cupool_status cupool_config_set(const char *key, const char *) {
  return key && strcmp(key, "verbose") == 0 ? CUPOOL_OK : CUPOOL_ERROR_UNKNOWN_CONFIG_KEY;
}
const char *cupool_status_string(cupool_status s) {
  static const char *names[] = {"success", "invalid value", "out of memory", "backend unavailable",
                                "pointer not allocated by cupool", "pointer already freed"};
  return (int)s >= 0 && (int)s < 6 ? names[(int)s] : "other error";
}
int cupool_interposition_active(void) { return 0; }
}
