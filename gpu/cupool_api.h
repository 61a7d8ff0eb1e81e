/* The cupool C API as the GPU suite uses it.
 *
 * By default this includes the generated header include/cupool.h (the suite passes
 * -I include). Until that header exists, or when the suite finds that it does not
 * compile against the names below (it then builds with -DCUPOOL_GPU_OWN_DECLS and
 * records a failing "header_contract" test), the declarations below are used: they
 * mirror the fixed C contract of include/cupool.h (stats struct version 1). Keep them
 * in step with it; the ABI, not the spelling, is what the tests exercise. */
#ifndef CUPOOL_GPU_API_H
#define CUPOOL_GPU_API_H

#include <stddef.h>
#include <stdint.h>

#if !defined(CUPOOL_GPU_OWN_DECLS) && defined(__has_include)
#if __has_include(<cupool.h>)
#include <cupool.h>
#define CUPOOL_GPU_REAL_HEADER 1
#endif
#endif

#ifndef CUPOOL_GPU_REAL_HEADER
#ifdef __cplusplus
extern "C" {
#endif
struct CUstream_st;
typedef int cupool_status;
typedef struct {
  uint64_t current, peak;
} cupool_stat;
typedef struct {
  uint32_t size, version;
  cupool_stat allocated_bytes, reserved_bytes, requested_bytes, cached_bytes;
  uint64_t num_allocs, num_frees, cache_hits, cache_misses, device_allocs, device_frees,
      alloc_retries, num_ooms, fences_recorded, cross_stream_frees;
} cupool_stats;
cupool_status cupool_alloc(void **ptr_out, size_t size);
cupool_status cupool_alloc_async(void **ptr_out, size_t size, struct CUstream_st *stream);
cupool_status cupool_free(void *ptr);
cupool_status cupool_free_async(void *ptr, struct CUstream_st *stream);
cupool_status cupool_get_stats(int device, cupool_stats *stats);
cupool_status cupool_stats_json(int device, char *buf, size_t buf_len, size_t *needed_out);
cupool_status cupool_reset_peak_stats(int device);
cupool_status cupool_empty_cache(size_t *released_out);
cupool_status cupool_set_memory_limit(int device, size_t bytes);
cupool_status cupool_config_set(const char *key, const char *value);
const char *cupool_status_string(cupool_status s);
int cupool_interposition_active(void);
#ifdef __cplusplus
}
#endif
#endif

/* Status values of the contract, under our own names so that they never clash with the
 * generated header's spelling. Compare with (int)status. */
enum {
  CUP_OK = 0,
  CUP_INVALID_VALUE = 1,
  CUP_OUT_OF_MEMORY = 2,
  CUP_BACKEND_UNAVAILABLE = 3,
  CUP_INVALID_POINTER = 4,
  CUP_DOUBLE_FREE = 5,
};
#define CUP_STATS_VERSION 1u

#endif
