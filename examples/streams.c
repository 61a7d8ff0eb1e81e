/* cupool example: stream-ordered allocations on several streams.
 *
 * Runs on the GPU when libcuda.so.1 and a device are there, and on cupool's host backend
 * otherwise (host memory, simulated streams), so it works on any machine. It needs no CUDA
 * header to build: the few driver functions it uses are loaded at run time.
 *
 * Build and run: scripts/example
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cupool.h"

enum { NUM_STREAMS = 4, ROUNDS = 2000, BLOCKS_PER_ROUND = 8 };

/* Driver API entry points, loaded from libcuda.so.1 (signatures from cuda.h, with opaque
 * handles as void pointers and CUresult as int). */
typedef int (*cu_init_fn)(unsigned int flags);
typedef int (*cu_device_get_fn)(int *device, int ordinal);
typedef int (*cu_primary_ctx_retain_fn)(void **ctx, int device);
typedef int (*cu_ctx_set_current_fn)(void *ctx);
typedef int (*cu_stream_create_fn)(struct CUstream_st **stream, unsigned int flags);
typedef int (*cu_stream_destroy_fn)(struct CUstream_st *stream);
typedef int (*cu_ctx_synchronize_fn)(void);

struct gpu {
    void *libcuda;
    cu_stream_destroy_fn stream_destroy;
    cu_ctx_synchronize_fn ctx_synchronize;
};

/* Opens the driver and makes device 0's primary context current; 0 when there is no GPU. */
static int open_gpu(struct gpu *gpu) {
    gpu->libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!gpu->libcuda) return 0;
    cu_init_fn init = (cu_init_fn)dlsym(gpu->libcuda, "cuInit");
    cu_device_get_fn device_get = (cu_device_get_fn)dlsym(gpu->libcuda, "cuDeviceGet");
    cu_primary_ctx_retain_fn retain =
        (cu_primary_ctx_retain_fn)dlsym(gpu->libcuda, "cuDevicePrimaryCtxRetain");
    cu_ctx_set_current_fn set_current = (cu_ctx_set_current_fn)dlsym(gpu->libcuda, "cuCtxSetCurrent");
    gpu->stream_destroy = (cu_stream_destroy_fn)dlsym(gpu->libcuda, "cuStreamDestroy_v2");
    gpu->ctx_synchronize = (cu_ctx_synchronize_fn)dlsym(gpu->libcuda, "cuCtxSynchronize");
    int device = 0;
    void *ctx = NULL;
    if (!init || !device_get || !retain || !set_current || !gpu->stream_destroy ||
        !gpu->ctx_synchronize || init(0) != 0 || device_get(&device, 0) != 0 ||
        retain(&ctx, device) != 0 || set_current(ctx) != 0) {
        dlclose(gpu->libcuda);
        gpu->libcuda = NULL;
        return 0;
    }
    return 1;
}

static int check(cupool_status status, const char *what) {
    if (status != CUPOOL_OK) {
        fprintf(stderr, "%s failed: %s\n", what, cupool_status_string(status));
        return 0;
    }
    return 1;
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void print_level(const char *name, cupool_stat level) {
    printf("  %-18s current %12llu  peak %12llu\n", name, (unsigned long long)level.current,
           (unsigned long long)level.peak);
}

static void print_count(const char *name, uint64_t count) {
    printf("  %-18s %12llu\n", name, (unsigned long long)count);
}

int main(void) {
    struct gpu gpu = {0};
    struct CUstream_st *streams[NUM_STREAMS];

    char backend[16] = "";
    if (!check(cupool_config_get("backend", backend, sizeof backend, NULL), "config_get")) return 1;
    int on_gpu = strcmp(backend, "cuda") == 0 && open_gpu(&gpu);
    if (on_gpu) {
        cu_stream_create_fn stream_create =
            (cu_stream_create_fn)dlsym(gpu.libcuda, "cuStreamCreate");
        for (int s = 0; s < NUM_STREAMS; s++) {
            if (!stream_create || stream_create(&streams[s], 1 /* CU_STREAM_NON_BLOCKING */) != 0) {
                fprintf(stderr, "cuStreamCreate failed\n");
                return 1;
            }
        }
        printf("GPU found: running on the cuda backend with %d streams\n", NUM_STREAMS);
    } else {
        if (strcmp(backend, "host") != 0) {
            /* Must happen before the first allocation: the backend is fixed at first use. */
            if (!check(cupool_config_set("backend", "host"), "config_set(backend, host)")) return 1;
            printf("no GPU found: running on the host backend\n");
        } else {
            printf("running on the host backend (CUPOOL_CONF)\n");
        }
        for (int s = 0; s < NUM_STREAMS; s++)
            streams[s] = (struct CUstream_st *)(uintptr_t)(0x1000 * (s + 1)); /* simulated */
    }
    printf("cupool %s\n", cupool_version());

    /* Each round, every stream allocates a few blocks of varied sizes and frees them in
     * stream order; the pool hands the same memory back to the same stream without a
     * driver call. */
    void *blocks[NUM_STREAMS][BLOCKS_PER_ROUND];
    double start = seconds_now();
    for (int round = 0; round < ROUNDS; round++) {
        for (int s = 0; s < NUM_STREAMS; s++) {
            for (int b = 0; b < BLOCKS_PER_ROUND; b++) {
                size_t size = (size_t)512 << ((b + round) % 12); /* 512 B .. 1 MiB */
                if (!check(cupool_alloc_async(&blocks[s][b], size, streams[s]), "cupool_alloc_async"))
                    return 1;
            }
        }
        for (int s = 0; s < NUM_STREAMS; s++)
            for (int b = 0; b < BLOCKS_PER_ROUND; b++)
                if (!check(cupool_free_async(blocks[s][b], streams[s]), "cupool_free_async")) return 1;
    }
    double elapsed = seconds_now() - start;
    long pairs = (long)ROUNDS * NUM_STREAMS * BLOCKS_PER_ROUND;

    /* A streamless block, freed without naming a stream (no device-wide wait). */
    void *scratch = NULL;
    if (!check(cupool_alloc(&scratch, 8u << 20), "cupool_alloc")) return 1;
    if (!check(cupool_free(scratch), "cupool_free")) return 1;

    printf("%ld alloc+free pairs on %d streams: %.0f ns per pair\n", pairs, NUM_STREAMS,
           elapsed * 1e9 / (double)pairs);

    cupool_stats stats;
    memset(&stats, 0, sizeof stats);
    stats.size = sizeof stats;
    stats.version = CUPOOL_STATS_VERSION;
    if (!check(cupool_get_stats(-1, &stats), "cupool_get_stats")) return 1;
    printf("stats:\n");
    print_level("allocated_bytes", stats.allocated_bytes);
    print_level("reserved_bytes", stats.reserved_bytes);
    print_level("requested_bytes", stats.requested_bytes);
    print_level("cached_bytes", stats.cached_bytes);
    print_count("num_allocs", stats.num_allocs);
    print_count("num_frees", stats.num_frees);
    print_count("cache_hits", stats.cache_hits);
    print_count("cache_misses", stats.cache_misses);
    print_count("device_allocs", stats.device_allocs);
    print_count("device_frees", stats.device_frees);
    print_count("fences_recorded", stats.fences_recorded);

    if (on_gpu) {
        /* Freed blocks become releasable once the work before their free has completed. */
        if (gpu.ctx_synchronize() != 0) fprintf(stderr, "cuCtxSynchronize failed\n");
    }
    size_t released = 0;
    if (!check(cupool_empty_cache(&released), "cupool_empty_cache")) return 1;
    printf("empty_cache released %zu bytes\n", released);

    if (on_gpu)
        for (int s = 0; s < NUM_STREAMS; s++) gpu.stream_destroy(streams[s]);
    return 0;
}
