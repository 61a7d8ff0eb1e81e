/*
 * Pinned host memory under the preload, against the fake libcuda (TEST DOUBLE). Reaches
 * the driver the three ways driver_program.c does (-DREACH_GPA, -DREACH_DLSYM,
 * -DREACH_LINKED) and prints "key=value" lines that preload/tests/pinned.rs compares
 * between runs with and without the preload library:
 *   cuMemHostAlloc / cuMemAllocHost_v2 / cuMemFreeHost pairs in a loop, flags 0,
 *   PORTABLE, DEVICEMAP and both (the pool's) and WRITECOMBINED (the driver's),
 *   a cuMemHostRegister'ed buffer (never the pool's), and frees the pool does not own.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cupool.h"
#include "fake_cuda.h"

typedef int CUresult;
typedef void *CUhandle;

#define CU_MEMHOSTALLOC_PORTABLE 0x01u
#define CU_MEMHOSTALLOC_DEVICEMAP 0x02u
#define CU_MEMHOSTALLOC_WRITECOMBINED 0x04u
#define CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define CU_POINTER_ATTRIBUTE_RANGE_SIZE 12
#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)

#define DRIVER_FUNCS(X)                                                                   \
    X(cuInit, "cuInit", 2000, CUresult, (unsigned))                                        \
    X(cuDeviceGet, "cuDeviceGet", 2000, CUresult, (int *, int))                            \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000, CUresult, (CUhandle *, int)) \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", 4000, CUresult, (CUhandle))                      \
    X(cuMemHostAlloc, "cuMemHostAlloc", 2020, CUresult, (void **, size_t, unsigned))       \
    X(cuMemAllocHost_v2, "cuMemAllocHost", 3020, CUresult, (void **, size_t))              \
    X(cuMemFreeHost, "cuMemFreeHost", 2000, CUresult, (void *))                            \
    X(cuMemHostRegister_v2, "cuMemHostRegister", 6050, CUresult, (void *, size_t, unsigned)) \
    X(cuMemHostUnregister, "cuMemHostUnregister", 4000, CUresult, (void *))                \
    X(cuPointerGetAttribute, "cuPointerGetAttribute", 4000, CUresult,                      \
      (void *, int, unsigned long long))

#include "reach.h"

static void load_driver(void)
{
    load_driver_table();
#if defined(REACH_GPA)
    /* The 32-bit-size v1 of cuMemAllocHost stays the driver's. */
    print_owner("query.cuMemAllocHost@2000", query("cuMemAllocHost", 2000, 0));
    print_owner("query.cuMemAllocHost@3020", (void *)drv.cuMemAllocHost_v2);
    print_owner("query.cuMemHostAlloc@2020", (void *)drv.cuMemHostAlloc);
    print_owner("query.cuMemFreeHost@2000", (void *)drv.cuMemFreeHost);
    print_owner("query.cuMemHostRegister@6050", (void *)drv.cuMemHostRegister_v2);
#endif
}

static struct fake_cuda_counters counters(void)
{
    void (*get)(struct fake_cuda_counters *) =
        need(dlsym(libcuda, "fake_cuda_counters"), "fake_cuda_counters");
    struct fake_cuda_counters c;
    get(&c);
    return c;
}

static int host_flags(const void *p)
{
    int (*get)(const void *) = need(dlsym(libcuda, "fake_cuda_host_flags"), "fake_cuda_host_flags");
    return get(p);
}

/* The pinned pool's statistics through the API the preload exports; 0 without it. */
static int host_stats(cupool_host_stats *s)
{
    cupool_status (*get)(cupool_host_stats *) =
        (cupool_status(*)(cupool_host_stats *))dlsym(RTLD_DEFAULT, "cupool_host_get_stats");
    memset(s, 0, sizeof *s);
    s->size = sizeof *s;
    s->version = CUPOOL_HOST_STATS_VERSION;
    return get && get(s) == CUPOOL_OK;
}

static void print_pool_stats(void)
{
    cupool_host_stats s;
    if (!host_stats(&s)) {
        printf("pool.available=0\n");
        return;
    }
    printf("pool.available=1\npool.num_allocs=%llu\npool.num_frees=%llu\npool.cache_hits=%llu\n"
           "pool.driver_allocs=%llu\npool.allocated=%llu\n",
           (unsigned long long)s.num_allocs, (unsigned long long)s.num_frees,
           (unsigned long long)s.cache_hits, (unsigned long long)s.driver_allocs,
           (unsigned long long)s.allocated_bytes.current);
}

/* Allocations and frees of a few sizes and flags, the memory written and read back. */
static void pairs(void)
{
    static const size_t sizes[] = {64, 4 * KIB, 100 * KIB, MIB, 3 * MIB};
    static const unsigned flags[] = {0, CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_DEVICEMAP,
                                     CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP};
    uint64_t before = counters().host_alloc;
    unsigned program = 0, bad_bytes = 0, pooled_flags = 0;
    for (int round = 0; round < 100; round++) {
        void *live[8];
        for (int i = 0; i < 8; i++) {
            size_t n = sizes[(round + i) % 5];
            if (i % 3 == 2)
                CHECK(drv.cuMemAllocHost_v2(&live[i], n));
            else
                CHECK(drv.cuMemHostAlloc(&live[i], n, flags[(round + i) % 4]));
            program++;
            /* The pool's memory is PORTABLE | DEVICEMAP, whatever was asked. */
            pooled_flags += host_flags(live[i]) == (int)(CU_MEMHOSTALLOC_PORTABLE |
                                                         CU_MEMHOSTALLOC_DEVICEMAP);
            memset(live[i], i + 1, n);
        }
        for (int i = 0; i < 8; i++) {
            size_t n = sizes[(round + i) % 5];
            const unsigned char *b = live[i];
            bad_bytes += b[0] != i + 1 || b[n - 1] != i + 1;
            CHECK(drv.cuMemFreeHost(live[i]));
        }
    }
    printf("program_allocs=%u\ndriver_allocs=%llu\nbad_bytes=%u\nNODIFF pooled_flags=%u\n",
           program, (unsigned long long)(counters().host_alloc - before), bad_bytes,
           pooled_flags);
}

/* What the driver keeps: write-combined memory and memory the program registers. */
static void driver_memory(void)
{
    void *wc = NULL;
    printf("wc.alloc=%d\n", drv.cuMemHostAlloc(&wc, 64 * KIB, CU_MEMHOSTALLOC_WRITECOMBINED));
    printf("wc.flags=%d\n", host_flags(wc));
    printf("wc.free=%d\n", drv.cuMemFreeHost(wc));

    size_t n = 256 * KIB;
    void *mine = aligned_alloc(4096, n);
    printf("reg.register=%d\n", drv.cuMemHostRegister_v2(mine, n, 0));
    /* cuMemFreeHost of registered memory: the driver's error, the memory untouched. */
    memset(mine, 0x5a, n);
    printf("reg.free_host=%d\n", drv.cuMemFreeHost(mine));
    printf("reg.intact=%d\n", ((unsigned char *)mine)[n - 1] == 0x5a);
    printf("reg.unregister=%d\n", drv.cuMemHostUnregister(mine));
    free(mine);
    struct fake_cuda_counters c = counters();
    printf("reg.driver_registers=%llu\nreg.driver_unregisters=%llu\n",
           (unsigned long long)c.host_register, (unsigned long long)c.host_unregister);
}

/* A block's range attributes are its own, as for a driver allocation of that size. */
static void range_attributes(void)
{
    void *p = NULL, *q = NULL;
    CHECK(drv.cuMemHostAlloc(&p, 10000, 0));
    CHECK(drv.cuMemHostAlloc(&q, 10000, 0)); /* under the preload: part of a 2 MiB chunk */
    unsigned long long start = 0;
    size_t size = 0;
    unsigned long long inside = (unsigned long long)(uintptr_t)q + 100;
    printf("attr.start=%d\n", drv.cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, inside));
    printf("attr.start_is_block=%d\n", start == (unsigned long long)(uintptr_t)q);
    printf("attr.size=%d\n", drv.cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, inside));
    printf("attr.size_value=%zu\n", size);
    CHECK(drv.cuMemFreeHost(p));
    CHECK(drv.cuMemFreeHost(q));
}

/* Frees nobody may make: the driver's answers, whoever owns the memory. */
static void bad_frees(void)
{
    void *p = NULL;
    CHECK(drv.cuMemHostAlloc(&p, 10 * KIB, 0));
    printf("bad.interior=%d\n", drv.cuMemFreeHost((char *)p + 4096));
    int on_stack = 0;
    printf("bad.stack=%d\n", drv.cuMemFreeHost(&on_stack));
    printf("bad.free=%d\n", drv.cuMemFreeHost(p));
    printf("bad.twice=%d\n", drv.cuMemFreeHost(p));
    void *none = (void *)0x1;
    printf("bad.null_out=%d\n", drv.cuMemHostAlloc(NULL, 4096, 0));
    printf("bad.size0=%d\n", drv.cuMemHostAlloc(&none, 0, 0));
    printf("bad.size0_out_untouched=%d\n", none == (void *)0x1);
    printf("bad.unknown_flag=%d\n", drv.cuMemHostAlloc(&none, 4096, 0x80));
}

/* Pinned blocks freed from an exit handler that runs after the preload's: cupool must
 * make no driver call for them (the driver may be gone by then). */
static void *exit_blocks[2];
static void free_during_exit(void)
{
    for (int i = 0; i < 2; i++)
        printf("atexit_free=%d\n", drv.cuMemFreeHost(exit_blocks[i]));
    fflush(stdout);
}

/* A fork child never touches the parent's pool: its pinned allocations go to the driver,
 * and the C API reports the pool unavailable there; the parent's pool goes on. */
static void scenario_fork(void)
{
    void *p = NULL;
    CHECK(drv.cuMemHostAlloc(&p, 64 * KIB, 0)); /* the pool is live in the parent */
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        uint64_t before = counters().host_alloc;
        void *c = NULL;
        int rc = drv.cuMemHostAlloc(&c, 64 * KIB, 0);
        int freed = rc == 0 ? drv.cuMemFreeHost(c) : -1;
        cupool_host_stats s;
        printf("child.alloc=%d\nchild.free=%d\nchild.driver_allocs=%llu\nchild.pool_stats_ok=%d\n",
               rc, freed, (unsigned long long)(counters().host_alloc - before),
               host_stats(&s));
        fflush(stdout);
        _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    printf("child.exit=%d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    printf("parent.free=%d\n", drv.cuMemFreeHost(p));
    void *again = NULL;
    printf("parent.alloc_after=%d\n", drv.cuMemHostAlloc(&again, 64 * KIB, 0));
    printf("parent.free_after=%d\n", drv.cuMemFreeHost(again));
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    int free_late = argc > 1 && !strcmp(argv[1], "exit-free-late");
    if (free_late)
        atexit(free_during_exit); /* registered before any allocation: runs late */
    load_driver();
    int dev = -1;
    CUhandle ctx = NULL;
    CHECK(drv.cuInit(0));
    CHECK(drv.cuDeviceGet(&dev, 0));
    CHECK(drv.cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(drv.cuCtxSetCurrent(ctx));
    if (argc > 1 && !strcmp(argv[1], "fork")) {
        scenario_fork();
        return 0;
    }
    if (free_late) {
        CHECK(drv.cuMemHostAlloc(&exit_blocks[0], 100 * KIB, 0));
        CHECK(drv.cuMemAllocHost_v2(&exit_blocks[1], 3 * MIB));
        /* Marker in the driver log: everything after it happens during exit. */
        CHECK(drv.cuDeviceGet(&dev, 0));
        printf("exiting=1\n");
        return 0;
    }

    pairs();
    driver_memory();
    range_attributes();
    bad_frees();
    print_pool_stats();
    /* Everything freed and the cache emptied: the driver holds no host memory. */
    cupool_status (*empty)(size_t *) =
        (cupool_status(*)(size_t *))dlsym(RTLD_DEFAULT, "cupool_host_empty_cache");
    if (empty && empty(NULL) != CUPOOL_OK)
        printf("empty_cache_failed=1\n");
    printf("driver_host_live_bytes=%llu\n", (unsigned long long)counters().host_live_bytes);
    return 0;
}
