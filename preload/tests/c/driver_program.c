/*
 * A CUDA driver client for the preload tests, run against the fake libcuda (TEST DOUBLE).
 * It reaches the driver the way real programs do, chosen at build time (reach.h).
 * argv[1] names a scenario; results are printed as "key=value" lines, which the Rust test
 * compares between runs with and without the preload library, and checks against the
 * fake's counters and cupool's statistics.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cupool.h"
#include "fake_cuda.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUhandle;
typedef struct {
    char reserved[64];
} CUipcMemHandle;

#define CU_STREAM_CAPTURE_MODE_GLOBAL 0
#define CU_STREAM_CAPTURE_MODE_RELAXED 2
#define CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define CU_POINTER_ATTRIBUTE_RANGE_SIZE 12
#define MIB ((size_t)1 << 20)

typedef CUresult (*gpa_v1_fn)(const char *, void **, int, unsigned long long);

#define DRIVER_FUNCS(X)                                                                   \
    X(cuInit, "cuInit", 2000, CUresult, (unsigned))                                        \
    X(cuDriverGetVersion, "cuDriverGetVersion", 2020, CUresult, (int *))                   \
    X(cuDeviceGet, "cuDeviceGet", 2000, CUresult, (int *, int))                            \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000, CUresult, (CUhandle *, int)) \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", 4000, CUresult, (CUhandle))                      \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020, CUresult, (CUdeviceptr *, size_t))                \
    X(cuMemFree_v2, "cuMemFree", 3020, CUresult, (CUdeviceptr))                            \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 3020, CUresult, (size_t *, size_t *))               \
    X(cuMemGetAddressRange_v2, "cuMemGetAddressRange", 3020, CUresult,                     \
      (CUdeviceptr *, size_t *, CUdeviceptr))                                               \
    X(cuMemAllocManaged, "cuMemAllocManaged", 6000, CUresult, (CUdeviceptr *, size_t, unsigned)) \
    X(cuIpcGetMemHandle, "cuIpcGetMemHandle", 4010, CUresult, (void *, CUdeviceptr))       \
    X(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle", 11000, CUresult,                        \
      (CUdeviceptr *, CUipcMemHandle, unsigned))                                            \
    X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", 4010, CUresult, (CUdeviceptr))           \
    X(cuPointerGetAttribute, "cuPointerGetAttribute", 4000, CUresult, (void *, int, CUdeviceptr)) \
    X(cuStreamCreate, "cuStreamCreate", 2000, CUresult, (CUhandle *, unsigned))            \
    X(cuStreamDestroy_v2, "cuStreamDestroy", 4000, CUresult, (CUhandle))                  \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, CUresult, (CUhandle, int))   \
    X(cuStreamEndCapture, "cuStreamEndCapture", 10000, CUresult, (CUhandle, CUhandle *))   \
    X(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", 4000, CUresult, (CUhandle, unsigned))

#include "reach.h"

static void load_driver(void) { load_driver_table(); }

#if defined(REACH_GPA)
/* Prints who answers each (name, version, flags) query, and the status. */
static void scenario_queries(void)
{
    static const struct {
        const char *base;
        int version;
        unsigned long long flags;
    } queries[] = {
        {"cuMemAlloc", 2000, 0},        {"cuMemAlloc", 3020, 0},
        {"cuMemAlloc", 13000, 0},       {"cuMemFree", 2000, 0},
        {"cuMemFree", 3020, 0},         {"cuMemGetInfo", 3020, 0},
        {"cuMemGetAddressRange", 3020, 0}, {"cuIpcGetMemHandle", 4010, 0},
        {"cuPointerGetAttribute", 4000, 0}, {"cuMemAllocAsync", 11020, 0},
        {"cuMemAllocAsync", 11020, 2},  {"cuMemFreeAsync", 11020, 0},
        {"cuMemFreeAsync", 11020, 2},   {"cuStreamBeginCapture", 10000, 0},
        {"cuStreamBeginCapture", 10010, 0}, {"cuStreamBeginCapture", 10010, 2},
        {"cuStreamEndCapture", 10000, 0}, {"cuGetProcAddress", 11030, 0},
        {"cuGetProcAddress", 12000, 0}, {"cuInit", 2000, 0},
        {"cuNoSuchFunction", 12000, 0}, {"cuMemAlloc", 1000, 0},
    };
    for (size_t i = 0; i < sizeof queries / sizeof queries[0]; i++) {
        void *fn = (void *)0x1;
        int status = -1;
        CUresult rc = gpa(queries[i].base, &fn, queries[i].version, queries[i].flags, &status);
        char label[128];
        snprintf(label, sizeof label, "query.%s@%d/%llu", queries[i].base, queries[i].version,
                 queries[i].flags);
        printf("%s.rc=%d\n%s.status=%d\n", label, rc, label, status);
        print_owner(label, fn);
    }
    /* A query above the driver's version fails and leaves the driver's answer. */
    void *fn = NULL;
    printf("query.too_new.rc=%d\n", gpa("cuMemAlloc", &fn, 99000, 0, NULL));

    /* The 4-argument form, as the runtime fetches it, answers like the driver too. */
    void *v1 = NULL;
    CHECK(gpa("cuGetProcAddress", &v1, 11030, 0, NULL));
    gpa_v1_fn gpa4 = (gpa_v1_fn)v1;
    void *alloc = NULL;
    printf("query4.cuMemAlloc@3020.rc=%d\n", gpa4("cuMemAlloc", &alloc, 3020, 0));
    print_owner("query4.cuMemAlloc@3020", alloc);
    /* ... and so does the 5-argument form fetched through itself. */
    void *v2 = NULL;
    CHECK(gpa("cuGetProcAddress", &v2, 12000, 0, NULL));
    alloc = NULL;
    printf("query5.cuMemAlloc@3020.rc=%d\n", ((gpa_v2_fn)v2)("cuMemAlloc", &alloc, 3020, 0, NULL));
    print_owner("query5.cuMemAlloc@3020", alloc);

    /* dlsym: hooked names from libcuda's handle, others untouched. */
    print_owner("dlsym.libcuda.cuMemAlloc_v2", dlsym(libcuda, "cuMemAlloc_v2"));
    print_owner("dlsym.libcuda.cuMemAlloc", dlsym(libcuda, "cuMemAlloc"));
    print_owner("dlsym.libcuda.cuGetProcAddress_v2", dlsym(libcuda, "cuGetProcAddress_v2"));
    print_owner("dlsym.libcuda.cuInit", dlsym(libcuda, "cuInit"));
    print_owner("dlsym.libcuda.cuMemAlloc_v2x", dlsym(libcuda, "cuMemAlloc_v2x"));
}
#endif

static void (*fake_counters)(struct fake_cuda_counters *);
static void (*fake_set_total_bytes)(size_t);

static void start(void)
{
    load_driver();
    fake_counters = need(dlsym(libcuda, "fake_cuda_counters"), "fake_cuda_counters");
    *(void **)&fake_set_total_bytes =
        need(dlsym(libcuda, "fake_cuda_set_total_bytes"), "fake_cuda_set_total_bytes");
    int dev = -1;
    CUhandle ctx = NULL;
    CHECK(drv.cuInit(0));
    CHECK(drv.cuDeviceGet(&dev, 0));
    CHECK(drv.cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(drv.cuCtxSetCurrent(ctx));
}

static uint64_t driver_allocs(void)
{
    struct fake_cuda_counters c;
    fake_counters(&c);
    return c.mem_alloc;
}

/* cupool's statistics when a cupool library is in the process (NULL function otherwise). */
static int pool_stats(cupool_stats *out)
{
    cupool_status (*get)(int, cupool_stats *) =
        (cupool_status(*)(int, cupool_stats *))dlsym(RTLD_DEFAULT, "cupool_get_stats");
    if (!get)
        return 0;
    memset(out, 0, sizeof *out);
    out->size = sizeof *out;
    out->version = CUPOOL_STATS_VERSION;
    return get(-1, out) == CUPOOL_OK;
}

static void print_pool_stats(void)
{
    cupool_stats s;
    if (!pool_stats(&s)) {
        printf("pool.available=0\n");
        return;
    }
    printf("pool.available=1\npool.num_allocs=%llu\npool.num_frees=%llu\npool.cache_hits=%llu\n"
           "pool.num_ooms=%llu\npool.device_allocs=%llu\n",
           (unsigned long long)s.num_allocs, (unsigned long long)s.num_frees,
           (unsigned long long)s.cache_hits, (unsigned long long)s.num_ooms,
           (unsigned long long)s.device_allocs);
}

/* Many allocations and frees of a few sizes: a pool serves most from its cache. */
static void scenario_loop(void)
{
    enum { ROUNDS = 200, LIVE = 8 };
    static const size_t sizes[] = {256, 4096, 100000, MIB, 3 * MIB};
    uint64_t before = driver_allocs();
    unsigned program_allocs = 0;
    for (int round = 0; round < ROUNDS; round++) {
        CUdeviceptr live[LIVE];
        for (int i = 0; i < LIVE; i++) {
            CHECK(drv.cuMemAlloc_v2(&live[i], sizes[(round + i) % 5]));
            program_allocs++;
        }
        for (int i = 0; i < LIVE; i++)
            CHECK(drv.cuMemFree_v2(live[i]));
    }
    printf("program_allocs=%u\ndriver_allocs=%llu\n", program_allocs,
           (unsigned long long)(driver_allocs() - before));
    print_pool_stats();
}

/* `pairs` allocations of `bytes` each freed at once; how many got the first one's block. */
static int same_block_pairs(int pairs, size_t bytes)
{
    CUdeviceptr p = 0, first = 0;
    int same = 0;
    for (int i = 0; i < pairs; i++) {
        CHECK(drv.cuMemAlloc_v2(&p, bytes));
        if (i == 0)
            first = p;
        same += p == first;
        CHECK(drv.cuMemFree_v2(p));
    }
    return same;
}

/*
 * Legacy order (Note [legacy order]): while no stream exists, a free is reused at once with
 * no context fence; the first stream created ends that with one wait for queued work, and
 * frees are fenced again. Prints the fences and waits each phase made.
 */
static void scenario_legacy_order(void)
{
    enum { PAIRS = 200 };
    struct fake_cuda_counters c0, c1, c2;
    CUdeviceptr p = 0;
    fake_counters(&c0);
    int same = same_block_pairs(PAIRS, 3 * MIB);
    fake_counters(&c1);
    CUhandle stream = NULL;
    CHECK(drv.cuStreamCreate(&stream, 0));
    fake_counters(&c2);
    printf("before.same_block=%d\nbefore.fences=%llu\n", same,
           (unsigned long long)(c1.ctx_record_event - c0.ctx_record_event));
    printf("at_stream.fences=%llu\nat_stream.waits=%llu\n",
           (unsigned long long)(c2.ctx_record_event - c1.ctx_record_event),
           (unsigned long long)(c2.event_sync - c1.event_sync));
    for (int i = 0; i < PAIRS; i++) {
        CHECK(drv.cuMemAlloc_v2(&p, 3 * MIB));
        CHECK(drv.cuMemFree_v2(p));
    }
    struct fake_cuda_counters c3;
    fake_counters(&c3);
    printf("after.fences=%llu\n", (unsigned long long)(c3.ctx_record_event - c2.ctx_record_event));
}

/*
 * Device waits (Note [device waits]): with every fence held in flight
 * (FAKE_CUDA_EVENT_LATENCY), a 64 MiB block freed and allocated again comes back at once
 * behind a wait of the legacy stream; a blocking stream leaves that as it is; a
 * non-blocking stream waits once when created (no wait of the program) and then at every
 * device wait, until it is destroyed; past 64 live non-blocking streams the mode ends with
 * one wait for queued work, and no device wait follows.
 */
static unsigned long long other_waits(const struct fake_cuda_counters *a,
                                      const struct fake_cuda_counters *b)
{
    return (b->stream_wait_event - b->stream_wait_event_legacy) -
           (a->stream_wait_event - a->stream_wait_event_legacy);
}

/* One phase of device waits: blocks that came back at once, and legacy and other waits. */
static void print_waits(const char *phase, int same_block, const struct fake_cuda_counters *a,
                        const struct fake_cuda_counters *b)
{
    printf("%s.same_block=%d\n%s.legacy_waits=%llu\n%s.other_waits=%llu\n", phase, same_block,
           phase, (unsigned long long)(b->stream_wait_event_legacy - a->stream_wait_event_legacy),
           phase, other_waits(a, b));
}

static void scenario_device_waits(void)
{
    enum { MANY = 65 };
    struct fake_cuda_counters c0, c1, c2, c3, c4, c5, c6, c7;
    fake_counters(&c0);
    int before = same_block_pairs(50, 64 * MIB);
    fake_counters(&c1);
    CUhandle blocking = NULL, non_blocking = NULL, many[MANY];
    CHECK(drv.cuStreamCreate(&blocking, 0));
    int blocking_same = same_block_pairs(50, 64 * MIB);
    fake_counters(&c2);
    CHECK(drv.cuStreamCreate(&non_blocking, 1 /* CU_STREAM_NON_BLOCKING */));
    fake_counters(&c3);
    int listed_same = same_block_pairs(20, 64 * MIB);
    fake_counters(&c4);
    CHECK(drv.cuStreamDestroy_v2(non_blocking));
    int destroyed_same = same_block_pairs(20, 64 * MIB);
    fake_counters(&c5);
    for (int i = 0; i < MANY; i++)
        CHECK(drv.cuStreamCreate(&many[i], 1 /* CU_STREAM_NON_BLOCKING */));
    fake_counters(&c6);
    same_block_pairs(5, 64 * MIB);
    fake_counters(&c7);
    for (int i = 0; i < MANY; i++)
        CHECK(drv.cuStreamDestroy_v2(many[i]));
    print_waits("before", before, &c0, &c1);
    print_waits("blocking", blocking_same, &c1, &c2);
    printf("at_non_blocking.other_waits=%llu\nat_non_blocking.host_waits=%llu\n",
           other_waits(&c2, &c3), (unsigned long long)(c3.event_sync - c2.event_sync));
    print_waits("listed", listed_same, &c3, &c4);
    print_waits("destroyed", destroyed_same, &c4, &c5);
    printf("many.other_waits=%llu\nmany.host_waits=%llu\n", other_waits(&c5, &c6),
           (unsigned long long)(c6.event_sync - c5.event_sync));
    printf("after.legacy_waits=%llu\nafter.other_waits=%llu\nafter.fences=%llu\n",
           (unsigned long long)(c7.stream_wait_event_legacy - c6.stream_wait_event_legacy),
           other_waits(&c6, &c7), (unsigned long long)(c7.ctx_record_event - c6.ctx_record_event));
}

/*
 * Stream-ordered pairs through cupool's C API (the preload's own exports: the interposer
 * serves cuMemAlloc, not cuMemAllocAsync) on stream A, then on a stream B created after,
 * then on A again. Note [stream id cache]: the pool asks the driver for a stream's id once
 * and again only after a stream was created (which may have reused a handle): A, B, and A
 * once more, whatever the number of pairs. The Rust test counts the cuStreamGetId calls
 * in the fake's log.
 */
static void scenario_stream_ids(void)
{
    typedef int (*alloc_async_fn)(void **, size_t, CUhandle);
    typedef int (*free_async_fn)(void *, CUhandle);
    alloc_async_fn alloc_async = (alloc_async_fn)dlsym(RTLD_DEFAULT, "cupool_alloc_async");
    free_async_fn free_async = (free_async_fn)dlsym(RTLD_DEFAULT, "cupool_free_async");
    if (!alloc_async || !free_async) {
        printf("api=0\n");
        return;
    }
    enum { PAIRS = 100 };
    CUhandle a = NULL, b = NULL;
    CHECK(drv.cuStreamCreate(&a, 0));
    unsigned same = 0, failures = 0;
    for (int phase = 0; phase < 3; phase++) {
        if (phase == 1)
            CHECK(drv.cuStreamCreate(&b, 0));
        CUhandle s = phase == 1 ? b : a;
        void *p = NULL, *first = NULL;
        for (int i = 0; i < PAIRS; i++) {
            failures += alloc_async(&p, 4096, s) != 0;
            if (i == 0)
                first = p;
            same += p == first;
            failures += free_async(p, s) != 0;
        }
    }
    CHECK(drv.cuStreamDestroy_v2(b));
    CHECK(drv.cuStreamDestroy_v2(a));
    printf("api=1\npairs=%d\nfailures=%u\nsame_block=%u\n", 3 * PAIRS, failures, same);
}

/* Frees the driver rejects must be rejected the same way; foreign frees still work. */
static void scenario_errors(void)
{
    CUdeviceptr p = 0, managed = 0;
    CHECK(drv.cuMemAlloc_v2(&p, MIB));
    printf("free_null=%d\n", drv.cuMemFree_v2(0));
    printf("free_interior=%d\n", drv.cuMemFree_v2(p + 256));
    printf("free_unknown=%d\n", drv.cuMemFree_v2((CUdeviceptr)0x10));
    printf("alloc_null_out=%d\n", drv.cuMemAlloc_v2(NULL, 16));
    CUdeviceptr zero = 0;
    printf("alloc_zero=%d\n", drv.cuMemAlloc_v2(&zero, 0));
    CHECK(drv.cuMemAllocManaged(&managed, MIB, 1));
    printf("free_managed=%d\n", drv.cuMemFree_v2(managed));
    printf("free_managed_twice=%d\n", drv.cuMemFree_v2(managed));
    printf("free_block=%d\n", drv.cuMemFree_v2(p));
    printf("free_block_twice=%d\n", drv.cuMemFree_v2(p));
}

/* Out of memory: the driver's code, counted by the pool, then recovery. */
static void scenario_oom(void)
{
    size_t free_bytes = 0, total = 0;
    CHECK(drv.cuMemGetInfo_v2(&free_bytes, &total));
    CUdeviceptr small = 0, huge = 0;
    CHECK(drv.cuMemAlloc_v2(&small, MIB));
    CHECK(drv.cuMemFree_v2(small));
    fake_set_total_bytes(64 * MIB);
    printf("oom=%d\n", drv.cuMemAlloc_v2(&huge, 256 * MIB));
    printf("oom_out_untouched=%d\n", huge == 0);
    fake_set_total_bytes(total);
    printf("after_oom=%d\n", drv.cuMemAlloc_v2(&huge, 256 * MIB));
    CHECK(drv.cuMemFree_v2(huge));
    print_pool_stats();
}

/* Allocations and frees inside a relaxed-mode capture must not invalidate it. On a
 * non-blocking stream the capture is invisible from the legacy stream, so only the
 * interposer's capture tracking keeps the pool from fencing. */
#define CU_STREAM_NON_BLOCKING 1
static void scenario_capture(unsigned stream_flags)
{
    enum { PAIRS = 300 };
    CUhandle stream = NULL, graph = NULL;
    CHECK(drv.cuStreamCreate(&stream, stream_flags));
    /* Warm the cache so allocations during the capture can be hits. */
    CUdeviceptr warm[4];
    for (int i = 0; i < 4; i++)
        CHECK(drv.cuMemAlloc_v2(&warm[i], MIB));
    for (int i = 0; i < 4; i++)
        CHECK(drv.cuMemFree_v2(warm[i]));
    CHECK(drv.cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_RELAXED));
    int failures = 0;
    for (int i = 0; i < PAIRS; i++) {
        CUdeviceptr p = 0;
        if (drv.cuMemAlloc_v2(&p, MIB) != 0 || drv.cuMemFree_v2(p) != 0)
            failures++;
    }
    /* A size never seen before: a pool miss during capture goes to the driver. */
    CUdeviceptr odd = 0;
    printf("capture_miss_alloc=%d\n", drv.cuMemAlloc_v2(&odd, 7 * MIB + 12345));
    printf("capture_miss_free=%d\n", drv.cuMemFree_v2(odd));
    printf("capture_failures=%d\n", failures);
    printf("end_capture=%d\n", drv.cuStreamEndCapture(stream, &graph));
    struct fake_cuda_counters c;
    fake_counters(&c);
    printf("fence_refusals=%llu\n", (unsigned long long)c.ctx_record_event_errors);
    /* After the capture, frees are fenced again and everything still works. */
    CUdeviceptr p = 0;
    CHECK(drv.cuMemAlloc_v2(&p, MIB));
    CHECK(drv.cuMemFree_v2(p));
    printf("after_capture=ok\n");
}

/* Queries whose answer sub-allocation could change. */
static void scenario_queries_on_blocks(void)
{
    CUdeviceptr a = 0, b = 0, base = 0;
    size_t size = 0;
    CHECK(drv.cuMemAlloc_v2(&a, 1000));
    CHECK(drv.cuMemAlloc_v2(&b, 1000));
    CHECK(drv.cuMemGetAddressRange_v2(&base, &size, a + 10));
    printf("range_a.base_is_a=%d\nrange_a.size=%zu\n", base == a, size);
    CHECK(drv.cuMemGetAddressRange_v2(&base, &size, b));
    printf("range_b.base_is_b=%d\nrange_b.size=%zu\n", base == b, size);
    printf("range_null_outs=%d\n", drv.cuMemGetAddressRange_v2(NULL, NULL, a));
    printf("range_unknown=%d\n", drv.cuMemGetAddressRange_v2(&base, &size, (CUdeviceptr)0x10));
    CUdeviceptr start = 0;
    size_t attr_size = 0;
    CHECK(drv.cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, b + 1));
    CHECK(drv.cuPointerGetAttribute(&attr_size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, b + 1));
    printf("attr_b.start_is_b=%d\nattr_b.size=%zu\n", start == b, attr_size);
    /* IPC: a block sharing its driver allocation with others exports a handle of its own
     * (under the preload), which opens at the block; the fake driver opens in the same
     * process, at the allocation's base. A block that is a whole allocation exports the
     * driver's handle. */
    CUipcMemHandle handle;
    printf("ipc_small=%d\n", drv.cuIpcGetMemHandle(&handle, a));
    CUdeviceptr opened = 0, opened_again = 0;
    printf("ipc_small_open=%d\n", drv.cuIpcOpenMemHandle_v2(&opened, handle, 1));
    printf("ipc_small_open_is_a=%d\n", opened == a);
    printf("ipc_small_open_again=%d\n", drv.cuIpcOpenMemHandle_v2(&opened_again, handle, 1));
    printf("ipc_small_close=%d\n", drv.cuIpcCloseMemHandle(opened));
    printf("ipc_small_close_again=%d\n", drv.cuIpcCloseMemHandle(opened_again));
    CUdeviceptr whole = 0;
    CHECK(drv.cuMemAlloc_v2(&whole, 64 * MIB));
    printf("ipc_whole=%d\n", drv.cuIpcGetMemHandle(&handle, whole));
    printf("ipc_whole_open=%d\n", drv.cuIpcOpenMemHandle_v2(&opened, handle, 1));
    printf("ipc_whole_open_is_whole=%d\n", opened == whole);
    printf("ipc_whole_close=%d\n", drv.cuIpcCloseMemHandle(opened));
    CHECK(drv.cuMemFree_v2(whole));
    size_t free_bytes = 0, total = 0;
    printf("info_null_free=%d\n", drv.cuMemGetInfo_v2(NULL, &total));
    CHECK(drv.cuMemGetInfo_v2(&free_bytes, &total));
    printf("info_free_le_total=%d\n", free_bytes <= total);
    /* Memory the program freed counts as free again, even if a pool keeps it cached. */
    size_t free_before = 0, free_after = 0;
    CUdeviceptr big = 0;
    CHECK(drv.cuMemGetInfo_v2(&free_before, &total));
    CHECK(drv.cuMemAlloc_v2(&big, 96 * MIB));
    CHECK(drv.cuMemFree_v2(big));
    CHECK(drv.cuMemGetInfo_v2(&free_after, &total));
    printf("info_free_recovered=%d\n", free_after >= free_before);
    CHECK(drv.cuMemFree_v2(a));
    CHECK(drv.cuMemFree_v2(b));
}

/* Run with CUPOOL_CONF=vmm:on and FAKE_CUDA_DEVICES=2: blocks above 1 MiB come from the
 * VMM arena. Queries answer for the block; peer access reaches blocks mapped before and
 * after it is enabled. */
static void scenario_vmm(void)
{
    int (*access)(unsigned long long, int) =
        (int (*)(unsigned long long, int))need(dlsym(libcuda, "fake_cuda_vmm_access"),
                                               "fake_cuda_vmm_access");
    CUhandle ctx0 = NULL, ctx1 = NULL;
    int dev1 = -1;
    CHECK(drv.cuDeviceGet(&dev1, 1));
    CHECK(drv.cuDevicePrimaryCtxRetain(&ctx1, dev1));
    CHECK(drv.cuDevicePrimaryCtxRetain(&ctx0, 0));
    CHECK(drv.cuCtxSetCurrent(ctx1));
    CUdeviceptr a = 0, base = 0;
    size_t size = 0;
    CHECK(drv.cuMemAlloc_v2(&a, 5 * MIB + 3));
    printf("a.mapped=%d\n", access(a, 1) == 3);
    CHECK(drv.cuMemGetAddressRange_v2(&base, &size, a + 4 * MIB));
    printf("range_a.base_is_a=%d\nrange_a.size=%zu\n", base == a, size);
    CUdeviceptr start = 0;
    size_t attr_size = 0;
    CHECK(drv.cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, a + 1));
    CHECK(drv.cuPointerGetAttribute(&attr_size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, a + 1));
    printf("attr_a.start_is_a=%d\nattr_a.size=%zu\n", start == a, attr_size);
    char handle[64];
    printf("ipc_a=%d\n", drv.cuIpcGetMemHandle(handle, a));
    printf("a.peer_before=%d\n", access(a, 0));
    /* Device 0 gets access to device 1's memory. */
    CHECK(drv.cuCtxSetCurrent(ctx0));
    printf("enable_peer=%d\n", drv.cuCtxEnablePeerAccess(ctx1, 0));
    printf("a.peer_after=%d\n", access(a, 0) == 3 && access(a + 4 * MIB, 0) == 3);
    CHECK(drv.cuCtxSetCurrent(ctx1));
    CUdeviceptr b = 0;
    CHECK(drv.cuMemAlloc_v2(&b, 24 * MIB));
    int all = 1;
    for (size_t off = 0; off < 24 * MIB; off += 2 * MIB)
        all &= access(b + off, 0) == 3;
    printf("b.peer=%d\n", all);
    /* Freed arena memory stays mapped, and counts as free. */
    size_t free_before = 0, free_after = 0, total = 0;
    CHECK(drv.cuMemGetInfo_v2(&free_before, &total));
    CHECK(drv.cuMemFree_v2(b));
    CHECK(drv.cuMemGetInfo_v2(&free_after, &total));
    printf("info_free_recovered=%d\n", free_after >= free_before + 24 * MIB);
    CHECK(drv.cuMemFree_v2(a));
}

/* Note [ipc of arena blocks]: with CUPOOL_CONF=vmm:on, an arena block exported here opens
 * in another process (this program again, through exec) under cupool, which sees and
 * changes its bytes; a process without cupool gets the driver's error. */
static void run_open_child(const char *hex, int with_cupool)
{
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        if (!with_cupool)
            unsetenv("LD_PRELOAD");
        execl("/proc/self/exe", "driver_program", "vmm-ipc-open", hex,
              with_cupool ? "child" : "plain", (char *)NULL);
        _exit(127);
    }
    int status = 0;
    waitpid(child, &status, 0);
    printf("%s.exit=%d\n", with_cupool ? "child" : "plain",
           WIFEXITED(status) ? WEXITSTATUS(status) : 128);
}

static void scenario_vmm_ipc(void)
{
    CUdeviceptr a = 0;
    size_t n = 5 * MIB + 3;
    CHECK(drv.cuMemAlloc_v2(&a, n));
    memset((void *)(uintptr_t)a, 0x5a, n);
    unsigned char handle[64];
    printf("ipc_a=%d\n", drv.cuIpcGetMemHandle(handle, a));
    char hex[129];
    for (int i = 0; i < 64; i++)
        sprintf(hex + 2 * i, "%02x", handle[i]);
    run_open_child(hex, 1);
    const unsigned char *p = (const unsigned char *)(uintptr_t)a;
    int changed = 1;
    for (size_t i = 0; i < 4096; i++)
        changed &= p[i] == 0xb7;
    printf("a.sees_child_write=%d\na.rest_unchanged=%d\n", changed,
           p[4096] == 0x5a && p[n - 1] == 0x5a);
    run_open_child(hex, 0);
    CHECK(drv.cuMemFree_v2(a));
}

static void scenario_vmm_ipc_open(const char *hex, const char *who)
{
    CUipcMemHandle handle;
    for (int i = 0; i < 64; i++) {
        unsigned v = 0;
        sscanf(hex + 2 * i, "%2x", &v);
        handle.reserved[i] = (char)v;
    }
    CUdeviceptr q = 0, q2 = 0;
    CUresult rc = drv.cuIpcOpenMemHandle_v2(&q, handle, 1);
    printf("%s.open=%d\n", who, rc);
    if (rc != 0)
        return;
    size_t n = 5 * MIB + 3;
    const unsigned char *p = (const unsigned char *)(uintptr_t)q;
    int same = 1;
    for (size_t i = 0; i < n; i++)
        same &= p[i] == 0x5a;
    printf("%s.sees_pattern=%d\n", who, same);
    memset((void *)(uintptr_t)q, 0xb7, 4096);
    printf("%s.open_again=%d\n", who, drv.cuIpcOpenMemHandle_v2(&q2, handle, 1));
    printf("%s.same_pointer=%d\n", who, q2 == q);
    printf("%s.close=%d\n", who, drv.cuIpcCloseMemHandle(q));
    printf("%s.close_again=%d\n", who, drv.cuIpcCloseMemHandle(q2));
    struct fake_cuda_counters c;
    fake_counters(&c);
    printf("%s.imports=%llu\n%s.mappings_left=%llu\n", who, (unsigned long long)c.vmm_imports,
           who, (unsigned long long)c.vmm_mappings);
}

/* The child of an initialised parent never touches the parent's pool. */
static void scenario_fork(void)
{
    CUdeviceptr p = 0;
    CHECK(drv.cuMemAlloc_v2(&p, MIB));
    CHECK(drv.cuMemFree_v2(p));
    CHECK(drv.cuMemAlloc_v2(&p, MIB));
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        enum { N = 20 };
        uint64_t before = driver_allocs();
        for (int i = 0; i < N; i++) {
            CUdeviceptr q = 0;
            if (drv.cuMemAlloc_v2(&q, MIB) != 0 || drv.cuMemFree_v2(q) != 0)
                _exit(10);
        }
        cupool_stats s;
        printf("child.driver_allocs=%llu\nchild.program_allocs=%d\nchild.pool_stats_ok=%d\n",
               (unsigned long long)(driver_allocs() - before), N, pool_stats(&s));
        fflush(stdout);
        _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    printf("child.exit=%d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    printf("parent.free=%d\n", drv.cuMemFree_v2(p));
}

/* Exit without freeing, and frees that run during exit. */
static CUdeviceptr exit_blocks[4];
static void free_during_exit(void)
{
    for (int i = 0; i < 2; i++)
        printf("atexit_free=%d\n", drv.cuMemFree_v2(exit_blocks[i]));
    fflush(stdout);
}
__attribute__((destructor)) static void free_after_main(void)
{
    if (!drv.cuMemFree_v2 || !exit_blocks[2])
        return;
    for (int i = 2; i < 4; i++)
        printf("destructor_free=%d\n", drv.cuMemFree_v2(exit_blocks[i]));
    fflush(stdout);
}

static void scenario_exit(int free_late)
{
    if (free_late)
        atexit(free_during_exit); /* registered before any allocation: runs late */
    for (int i = 0; i < 4; i++)
        CHECK(drv.cuMemAlloc_v2(&exit_blocks[i], MIB));
    if (!free_late)
        memset(exit_blocks, 0, sizeof exit_blocks);
    /* Marker in the driver log: everything after it happens during exit. */
    int version = 0;
    CHECK(drv.cuDriverGetVersion(&version));
    printf("exiting=1\n");
    fflush(stdout);
}

/* Exit while other threads are in the middle of allocating and freeing, with blocks live:
 * argv[2] is a seed that sets how long the threads run before main returns. The process
 * must end with status 0 and no crash (the pool's exit handling races the threads). */
static void *busy_thread(void *arg)
{
    uintptr_t k = (uintptr_t)arg;
    for (unsigned i = 0;; i++) {
        CUdeviceptr p = 0;
        size_t size = ((size_t)((i * 2654435761u + k * 97) % 4096) + 1) * 1024; /* 1 KiB-4 MiB */
        if (drv.cuMemAlloc_v2(&p, size) == 0)
            drv.cuMemFree_v2(p);
    }
    return NULL;
}

static void scenario_exit_busy(unsigned seed)
{
    CUdeviceptr live[8];
    for (int i = 0; i < 8; i++)
        CHECK(drv.cuMemAlloc_v2(&live[i], (size_t)(i + 1) * 300 * 1024));
    for (uintptr_t k = 0; k < 4; k++) {
        pthread_t t;
        if (pthread_create(&t, NULL, busy_thread, (void *)k) != 0)
            exit(3);
        pthread_detach(t);
    }
    usleep(200 + (seed * 7919u) % 3000);
    printf("exiting=1\n");
    fflush(stdout);
}

/* 100 children, each forked from a parent with a live pool, use CUDA themselves. */
static void scenario_forks(void)
{
    CUdeviceptr p = 0;
    CHECK(drv.cuMemAlloc_v2(&p, MIB));
    int ok = 0;
    for (int c = 0; c < 100; c++) {
        fflush(stdout);
        pid_t child = fork();
        if (child == 0) {
            for (int i = 0; i < 10; i++) {
                CUdeviceptr q = 0;
                if (drv.cuMemAlloc_v2(&q, (size_t)(i + 1) * 100 * 1024) != 0 ||
                    drv.cuMemFree_v2(q) != 0)
                    _exit(10);
            }
            _exit(0);
        }
        int status = 0;
        waitpid(child, &status, 0);
        ok += WIFEXITED(status) && WEXITSTATUS(status) == 0;
        /* The parent's pool keeps working between forks. */
        CUdeviceptr q = 0;
        if (drv.cuMemAlloc_v2(&q, 3 * MIB) != 0 || drv.cuMemFree_v2(q) != 0)
            exit(4);
    }
    printf("children_ok=%d\nparent.free=%d\n", ok, drv.cuMemFree_v2(p));
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SCENARIO\n", argv[0]);
        return 2;
    }
    const char *s = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* For tests that look at what the process leaves behind once it has exited. */
    const char *pid_file = getenv("PID_FILE");
    if (pid_file) {
        FILE *f = fopen(pid_file, "w");
        if (!f)
            return 2;
        fprintf(f, "%d\n", (int)getpid());
        fclose(f);
    }
    start();
    if (!strcmp(s, "loop"))
        scenario_loop();
    else if (!strcmp(s, "errors"))
        scenario_errors();
    else if (!strcmp(s, "legacy-order"))
        scenario_legacy_order();
    else if (!strcmp(s, "device-waits"))
        scenario_device_waits();
    else if (!strcmp(s, "stream-ids"))
        scenario_stream_ids();
    else if (!strcmp(s, "oom"))
        scenario_oom();
    else if (!strcmp(s, "capture"))
        scenario_capture(0);
    else if (!strcmp(s, "capture-nonblocking"))
        scenario_capture(CU_STREAM_NON_BLOCKING);
    else if (!strcmp(s, "block-queries"))
        scenario_queries_on_blocks();
    else if (!strcmp(s, "fork"))
        scenario_fork();
    else if (!strcmp(s, "vmm"))
        scenario_vmm();
    else if (!strcmp(s, "vmm-ipc"))
        scenario_vmm_ipc();
    else if (!strcmp(s, "vmm-ipc-open") && argc > 3)
        scenario_vmm_ipc_open(argv[2], argv[3]);
    else if (!strcmp(s, "exit-nofree"))
        scenario_exit(0);
    else if (!strcmp(s, "exit-free-late"))
        scenario_exit(1);
    else if (!strcmp(s, "exit-busy"))
        scenario_exit_busy(argc > 2 ? (unsigned)atoi(argv[2]) : 0);
    else if (!strcmp(s, "forks"))
        scenario_forks();
#if defined(REACH_GPA)
    else if (!strcmp(s, "queries"))
        scenario_queries();
#endif
    else {
        fprintf(stderr, "unknown scenario %s\n", s);
        return 2;
    }
    return 0;
}
