// Compiles the suite's use of the C API against include/cupool.h: every function and
// stats field the suite touches, and the stats structs' C layout (cupool_stats version 4,
// cupool_host_stats version 2), and the IPC calls with their handle type.
// With -DHEADER_CHECK_MAIN it is also a program, linked against libcupool.a by the suite
// to show that the static library links and answers.
#include <stddef.h>
#include <stdio.h>

#include "cupool_api.h"

static_assert(sizeof(cupool_stats) == 8 + 5 * 16 + 18 * 8, "cupool_stats v5 is 232 bytes");
static_assert(offsetof(cupool_stats, allocated_bytes) == 8, "allocated_bytes after the header");
static_assert(offsetof(cupool_stats, num_allocs) == 72, "counts after the four levels");
static_assert(offsetof(cupool_stats, cross_stream_frees) == 144, "cross_stream_frees last of v1");
static_assert(offsetof(cupool_stats, inactive_split_bytes) == 152, "v2 fields after v1's");
static_assert(offsetof(cupool_stats, mapped_bytes) == 168, "mapped_bytes after the gauges");
static_assert(offsetof(cupool_stats, granules) == 192, "granules last of v2");
static_assert(offsetof(cupool_stats, grow_wait_us) == 208, "grow_wait_us last of v3");
static_assert(offsetof(cupool_stats, fence_queries) == 216, "fence_queries last of v4");
static_assert(offsetof(cupool_stats, fence_device_waits) == 224, "fence_device_waits last (v5)");
static_assert(CUPOOL_STATS_VERSION == 5u, "stats struct version 5");
static_assert(sizeof(cupool_host_stats) == 8 + 4 * 16 + 11 * 8, "cupool_host_stats v2 is 160 bytes");
static_assert(offsetof(cupool_host_stats, chunks) == 56, "chunks the last level");
static_assert(offsetof(cupool_host_stats, pending_fence_bytes) == 144, "pending_fence_bytes last of v1");
static_assert(offsetof(cupool_host_stats, fence_queries) == 152, "fence_queries last (v2)");
static_assert(CUPOOL_HOST_STATS_VERSION == 2u, "host stats struct version 2");
static_assert(sizeof(cupool_ipc_handle) == 64, "an IPC handle is a cudaIpcMemHandle_t's 64 bytes");
// The suite asks for version 1 (the fields it reads); the library answers every version
// up to its own.
static_assert(CUP_STATS_VERSION <= CUPOOL_STATS_VERSION, "a version the library knows");
static_assert((int)CUPOOL_OK == CUP_OK && (int)CUPOOL_ERROR_INVALID_VALUE == CUP_INVALID_VALUE &&
                  (int)CUPOOL_ERROR_OUT_OF_MEMORY == CUP_OUT_OF_MEMORY &&
                  (int)CUPOOL_ERROR_BACKEND_UNAVAILABLE == CUP_BACKEND_UNAVAILABLE &&
                  (int)CUPOOL_ERROR_INVALID_POINTER == CUP_INVALID_POINTER &&
                  (int)CUPOOL_ERROR_DOUBLE_FREE == CUP_DOUBLE_FREE,
              "status values of the C contract");

int use_every_call() {
  void *p = nullptr;
  cupool_stats s;
  s.size = sizeof s;
  s.version = CUP_STATS_VERSION;
  size_t n = 0;
  char buf[16];
  int r = 0;
  r |= (int)cupool_alloc(&p, 1);
  r |= (int)cupool_alloc_async(&p, 1, (struct CUstream_st *)0);
  r |= (int)cupool_free(p);
  r |= (int)cupool_free_async(p, (struct CUstream_st *)0);
  r |= (int)cupool_get_stats(0, &s);
  r |= (int)cupool_stats_json(0, buf, sizeof buf, &n);
  r |= (int)cupool_reset_peak_stats(-1);
  r |= (int)cupool_empty_cache(&n);
  r |= (int)cupool_set_memory_limit(0, 0);
  r |= (int)cupool_config_set("verbose", "0");
  r |= cupool_interposition_active();
  cupool_host_stats hs;
  hs.size = sizeof hs;
  hs.version = CUPOOL_HOST_STATS_VERSION;
  r |= (int)cupool_host_alloc(&p, 1);
  r |= (int)cupool_host_free(p);
  r |= (int)cupool_host_alloc_async(&p, 1, (struct CUstream_st *)0);
  r |= (int)cupool_host_free_async(p, (struct CUstream_st *)0);
  r |= (int)cupool_host_get_stats(&hs);
  r |= (int)cupool_host_stats_json(buf, sizeof buf, &n);
  r |= (int)cupool_host_reset_peak_stats();
  r |= (int)cupool_host_empty_cache(&n);
  r |= (int)(hs.allocated_bytes.current + hs.reserved_bytes.peak + hs.chunks.current + hs.cache_hits +
             hs.driver_allocs + hs.pending_fence_bytes + hs.fence_queries);
  cupool_ipc_handle h;
  r |= (int)cupool_ipc_get_handle(&h, p);
  r |= (int)cupool_ipc_open_handle(&p, &h, 1u);
  r |= (int)cupool_ipc_close_handle(p);
  const char *text = cupool_status_string((cupool_status)0);
  return r + (int)(s.allocated_bytes.current + s.reserved_bytes.peak + s.requested_bytes.current +
                   s.cached_bytes.current + s.num_allocs + s.num_frees + s.cache_hits + s.cache_misses +
                   s.device_allocs + s.device_frees + s.alloc_retries + s.num_ooms + s.fences_recorded +
                   s.cross_stream_frees + s.fence_queries) +
         (text ? 0 : 1);
}

#ifdef HEADER_CHECK_MAIN
int main() {
  // Linked statically: the library must answer (a status string, stats) without crashing.
  const char *text = cupool_status_string((cupool_status)2);
  cupool_stats s;
  s.size = sizeof s;
  s.version = CUP_STATS_VERSION;
  int st = (int)cupool_get_stats(-1, &s);
  printf("static link: status_string(2)='%s', get_stats -> %d\n", text ? text : "(null)", st);
  void *p = nullptr;
  st = (int)cupool_alloc(&p, 4096);
  printf("static link: alloc -> %d\n", st);
  if (st == 0) st = (int)cupool_free(p);
  return (text && st == 0) ? 0 : 1;
}
#endif
