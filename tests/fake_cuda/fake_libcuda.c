/*
 * fake libcuda.so.1 -- a TEST DOUBLE of the CUDA driver API. It is not CUDA.
 *
 * It mimics, over host memory, the part of the driver that cupool's backend and its
 * LD_PRELOAD interposer use, so both can be tested on machines with no GPU and no CUDA
 * toolkit. Names and ABI are the real driver's (types are declared locally: no CUDA
 * header is needed); behaviour follows the real driver where it matters to cupool:
 *
 * - cuInit must be called first; other calls return CUDA_ERROR_NOT_INITIALIZED (3).
 *   FAKE_CUDA_DEVICES=N sets the device count (default 1; 0 makes cuInit fail with
 *   CUDA_ERROR_NO_DEVICE).
 * - Contexts: one primary context per device (a stable handle); a per-thread context
 *   stack (cuCtxSetCurrent replaces its top, Push/Pop as in the driver). Calls that need a
 *   context return CUDA_ERROR_INVALID_CONTEXT (201) when none is current.
 * - cuGetProcAddress / cuGetProcAddress_v2 resolve (base name, cudaVersion, flags) to the
 *   variant the real driver returns (cuMemAlloc@3020 -> cuMemAlloc_v2, flags 2 -> _ptsz
 *   where a _ptsz variant exists, ...). Unknown name: CUDA_SUCCESS, *pfn = NULL, status
 *   SYMBOL_NOT_FOUND (1); known name asked below its first version: CUDA_SUCCESS,
 *   *pfn = NULL, status VERSION_NOT_SUFFICIENT (2); cudaVersion above the driver's
 *   version: INVALID_VALUE. FAKE_CUDA_DRIVER_VERSION=N (default 13000) makes it an older
 *   driver: cuDriverGetVersion says N, and functions introduced after N are unknown.
 * - Device memory is host memory (aligned_alloc: 512-byte alignment, 2 MiB for requests of
 *   2 MiB or more). Each device has a budget (FAKE_CUDA_TOTAL_BYTES, default 1 GiB):
 *   an allocation that would pass it fails with CUDA_ERROR_OUT_OF_MEMORY (2).
 *   cuMemFree_v2 of a pointer that is not the base of a live device/managed allocation
 *   (interior pointers included) fails with CUDA_ERROR_INVALID_VALUE (1); of NULL succeeds
 *   (like every memory call, once cuInit ran and with a context current).
 * - Events complete when queried FAKE_CUDA_EVENT_LATENCY+1 times (default 0: at once) or
 *   when synchronized (cuEventSynchronize, cuStreamSynchronize of their stream,
 *   cuCtxSynchronize).
 * - Stream capture (measured on the real driver): while any stream of a context is
 *   capturing, cuCtxRecordEvent on that context fails with
 *   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900) and invalidates the capture, so
 *   cuStreamEndCapture then fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901).
 *   "Unsafe" calls (cuMemAlloc_v2, cuMemFree_v2, cuCtxSynchronize) do the same while a
 *   capture in GLOBAL mode, or in THREAD_LOCAL mode begun by the calling thread, is active;
 *   cuStreamSynchronize of a capturing stream too. cuStreamIsCapturing on the legacy stream
 *   answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (906) while a blocking stream of the current
 *   context is capturing, as the driver documents.
 *
 * - Page-locked host memory: cuMemHostAlloc (flags PORTABLE, DEVICEMAP, WRITECOMBINED;
 *   others: INVALID_VALUE), cuMemAllocHost_v2 (flags 0), cuMemFreeHost of the base of such
 *   an allocation (anything else: INVALID_VALUE), cuMemHostRegister_v2 /
 *   cuMemHostUnregister of caller memory (kept apart: cuMemFreeHost refuses it). All need
 *   a current context. Host memory is not counted against the device budget.
 *
 * Control and observation: fake_cuda.h (counters, fault injection). FAKE_CUDA_LOG=path
 * appends one line per call to that file. One mutex guards all state: thread-safe.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fake_cuda.h"

/* ---- the driver's types and constants, written locally ------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;    /* CUdeviceptr_v2 */
typedef unsigned int CUdeviceptr_v1;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef uint64_t cuuint64_t;
typedef int CUdriverProcAddressQueryResult;
typedef int CUstreamCaptureMode;
typedef int CUstreamCaptureStatus;
typedef int CUpointer_attribute;
typedef struct CUipcMemHandle_st {
    char reserved[64];
} CUipcMemHandle;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901
#define CUDA_ERROR_STREAM_CAPTURE_IMPLICIT 906
#define CUDA_ERROR_UNKNOWN 999

#define CU_GET_PROC_ADDRESS_SUCCESS 0
#define CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND 1
#define CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT 2
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2ull

#define CU_STREAM_CAPTURE_MODE_GLOBAL 0
#define CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define CU_STREAM_CAPTURE_MODE_RELAXED 2
#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define CU_STREAM_CAPTURE_STATUS_INVALIDATED 2

#define CU_POINTER_ATTRIBUTE_CONTEXT 1
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_POINTER 3
#define CU_POINTER_ATTRIBUTE_BUFFER_ID 7
#define CU_POINTER_ATTRIBUTE_IS_MANAGED 8
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define CU_POINTER_ATTRIBUTE_RANGE_SIZE 12
#define CU_MEMORYTYPE_HOST 1
#define CU_MEMORYTYPE_DEVICE 2

#define CU_STREAM_LEGACY ((uintptr_t)0x1)
#define CU_STREAM_PER_THREAD ((uintptr_t)0x2)
#define CU_STREAM_NON_BLOCKING 0x1u

#define FAKE_DRIVER_VERSION 13000
#define FAKE_MAX_DEVICES 16
#define FAKE_CTX_STACK_DEPTH 32
#define FAKE_LEGACY_STREAM_ID 1ull
#define FAKE_PER_THREAD_STREAM_ID 2ull
#define FAKE_FIRST_STREAM_ID 16ull

#define EXPORT __attribute__((visibility("default")))

/* ---- state -------------------------------------------------------------------------- */

struct fake_ctx {
    int device;
    int retain_count;
};

enum alloc_kind { ALLOC_DEVICE, ALLOC_MANAGED, ALLOC_HOST };

struct fake_alloc {
    uintptr_t base;
    size_t size;
    enum alloc_kind kind;
    int device;
    unsigned long long buffer_id;
    unsigned int host_flags; /* cuMemHostAlloc flags of an ALLOC_HOST allocation */
};

/* Caller memory registered with cuMemHostRegister. */
struct fake_registration {
    uintptr_t base;
    size_t size;
};

struct fake_stream {
    struct fake_stream *next;
    struct fake_ctx *ctx;
    unsigned long long id;
    unsigned int flags;
    int capture_status; /* CU_STREAM_CAPTURE_STATUS_* */
    CUstreamCaptureMode capture_mode;
    pthread_t capture_thread;
};

struct fake_event {
    struct fake_event *next;
    unsigned int flags;
    int recorded;
    int queries_left; /* NOT_READY answers still to give */
    uintptr_t stream; /* raw handle it was recorded on; 0 for a context fence */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_env_once = PTHREAD_ONCE_INIT;

static int g_initialized;
static int g_device_count = 1;
static size_t g_total_bytes = (size_t)1 << 30;
static int g_event_latency;
static int g_driver_version = FAKE_DRIVER_VERSION;
static int g_fail_next_alloc;
static int g_fail_next_host_alloc;
static uint64_t g_host_live_bytes;
static struct fake_registration *g_regs;
static size_t g_reg_count, g_reg_cap;
static int g_log_fd = -1;
static int g_vmm_supported;

static struct fake_ctx g_ctx[FAKE_MAX_DEVICES];
static uint64_t g_live_bytes[FAKE_MAX_DEVICES];

static struct fake_alloc *g_allocs;
static size_t g_alloc_count, g_alloc_cap;
static unsigned long long g_next_buffer_id = 1;

static struct fake_stream *g_streams;
static unsigned long long g_next_stream_id = FAKE_FIRST_STREAM_ID;
static struct fake_event *g_events;

static struct fake_cuda_counters g_counters;

static __thread CUcontext t_ctx_stack[FAKE_CTX_STACK_DEPTH];
static __thread int t_ctx_depth;

/* A distinct non-NULL handle returned as the "graph" of a successful capture. */
static char g_graph_token;

static void read_env(void)
{
    g_vmm_supported = 1;
    const char *s = getenv("FAKE_CUDA_DEVICES");
    if (s && *s) {
        long n = strtol(s, NULL, 10);
        if (n < 0)
            n = 0;
        if (n > FAKE_MAX_DEVICES)
            n = FAKE_MAX_DEVICES;
        g_device_count = (int)n;
    }
    s = getenv("FAKE_CUDA_TOTAL_BYTES");
    if (s && *s)
        g_total_bytes = (size_t)strtoull(s, NULL, 10);
    s = getenv("FAKE_CUDA_EVENT_LATENCY");
    if (s && *s) {
        long n = strtol(s, NULL, 10);
        g_event_latency = n < 0 ? 0 : (int)n;
    }
    s = getenv("FAKE_CUDA_DRIVER_VERSION");
    if (s && *s) {
        long n = strtol(s, NULL, 10);
        if (n > 0 && n <= FAKE_DRIVER_VERSION)
            g_driver_version = (int)n;
    }
    s = getenv("FAKE_CUDA_VMM");
    if (s && *s)
        g_vmm_supported = strtol(s, NULL, 10) != 0;
    s = getenv("FAKE_CUDA_LOG");
    if (s && *s)
        g_log_fd = open(s, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    for (int i = 0; i < FAKE_MAX_DEVICES; i++)
        g_ctx[i].device = i;
}

static void lock(void)
{
    pthread_once(&g_env_once, read_env);
    pthread_mutex_lock(&g_lock);
}

static void unlock(void)
{
    pthread_mutex_unlock(&g_lock);
}

__attribute__((format(printf, 1, 2))) static void trace(const char *fmt, ...)
{
    if (g_log_fd < 0)
        return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof line - 2)
        n = (int)(sizeof line - 2);
    line[n] = '\n';
    ssize_t w = write(g_log_fd, line, (size_t)n + 1);
    (void)w;
}

/* ---- helpers (called with g_lock held) ---------------------------------------------- */

/* VMM mappings (defined with the VMM functions below). */
static int vmm_range_ok(uintptr_t p, size_t n);
static int vmm_lookup(uintptr_t p, struct fake_alloc *out);

static CUcontext current_ctx(void)
{
    return t_ctx_depth > 0 ? t_ctx_stack[t_ctx_depth - 1] : NULL;
}

static struct fake_ctx *valid_ctx(CUcontext c)
{
    struct fake_ctx *p = (struct fake_ctx *)c;
    for (int i = 0; i < g_device_count; i++)
        if (p == &g_ctx[i])
            return p;
    return NULL;
}

static struct fake_alloc *find_alloc_base(uintptr_t base, size_t *index)
{
    for (size_t i = 0; i < g_alloc_count; i++)
        if (g_allocs[i].base == base) {
            if (index)
                *index = i;
            return &g_allocs[i];
        }
    return NULL;
}

static struct fake_alloc *find_alloc_containing(uintptr_t p)
{
    for (size_t i = 0; i < g_alloc_count; i++)
        if (p >= g_allocs[i].base && p - g_allocs[i].base < g_allocs[i].size)
            return &g_allocs[i];
    return NULL;
}

static struct fake_stream *find_stream(uintptr_t h)
{
    for (struct fake_stream *s = g_streams; s; s = s->next)
        if ((uintptr_t)s == h)
            return s;
    return NULL;
}

static int is_special_stream(uintptr_t h)
{
    return h == 0 || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD;
}

static struct fake_event *find_event(CUevent e)
{
    for (struct fake_event *ev = g_events; ev; ev = ev->next)
        if (ev == (struct fake_event *)e)
            return ev;
    return NULL;
}

/* Whether an unsafe call from this thread in `ctx` is prohibited by an active capture;
 * if so, invalidates the captures that prohibit it. */
static int unsafe_call_during_capture(struct fake_ctx *ctx)
{
    int prohibited = 0;
    for (struct fake_stream *s = g_streams; s; s = s->next) {
        if (s->ctx != ctx || s->capture_status != CU_STREAM_CAPTURE_STATUS_ACTIVE)
            continue;
        if (s->capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL ||
            (s->capture_mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
             pthread_equal(s->capture_thread, pthread_self()))) {
            s->capture_status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
            prohibited = 1;
        }
    }
    return prohibited;
}

static void complete_events(uintptr_t stream, int all)
{
    for (struct fake_event *ev = g_events; ev; ev = ev->next)
        if (all || ev->stream == stream)
            ev->queries_left = 0;
}

static uint64_t sum_live_bytes(void)
{
    uint64_t sum = 0;
    for (int i = 0; i < FAKE_MAX_DEVICES; i++)
        sum += g_live_bytes[i];
    return sum;
}

static CUresult add_alloc(uintptr_t base, size_t size, enum alloc_kind kind, int device)
{
    if (g_alloc_count == g_alloc_cap) {
        size_t cap = g_alloc_cap ? g_alloc_cap * 2 : 64;
        struct fake_alloc *a = realloc(g_allocs, cap * sizeof *a);
        if (!a)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g_allocs = a;
        g_alloc_cap = cap;
    }
    struct fake_alloc *a = &g_allocs[g_alloc_count++];
    a->base = base;
    a->size = size;
    a->kind = kind;
    a->device = device;
    a->buffer_id = g_next_buffer_id++;
    a->host_flags = 0;
    return CUDA_SUCCESS;
}

static void remove_alloc(size_t index)
{
    g_allocs[index] = g_allocs[--g_alloc_count];
}

static void *host_aligned(size_t size)
{
    size_t align = size >= ((size_t)2 << 20) ? ((size_t)2 << 20) : 512;
    size_t rounded = (size + align - 1) / align * align;
    if (rounded < size)
        return NULL;
    return aligned_alloc(align, rounded);
}

/* Allocates device (or managed) memory on the current context's device. */
static CUresult device_alloc(CUdeviceptr *dptr, size_t size, enum alloc_kind kind,
                             int check_capture)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    if (g_fail_next_alloc) {
        rc = g_fail_next_alloc;
        g_fail_next_alloc = 0;
    } else if (check_capture && unsafe_call_during_capture(ctx)) {
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else if (size > g_total_bytes || g_live_bytes[ctx->device] > g_total_bytes - size) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS) {
        void *p = host_aligned(size);
        if (!p) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if ((rc = add_alloc((uintptr_t)p, size, kind, ctx->device)) != CUDA_SUCCESS) {
            free(p);
        } else {
            g_live_bytes[ctx->device] += size;
            g_counters.mem_alloc++;
            *dptr = (CUdeviceptr)(uintptr_t)p;
            return CUDA_SUCCESS;
        }
    }
    g_counters.mem_alloc_errors++;
    return rc;
}

static CUresult device_free(CUdeviceptr dptr, int check_capture)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (dptr == 0)
        return CUDA_SUCCESS;
    if (check_capture && unsafe_call_during_capture(ctx)) {
        g_counters.mem_free_errors++;
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    size_t index;
    struct fake_alloc *a = find_alloc_base((uintptr_t)dptr, &index);
    if (!a || a->kind == ALLOC_HOST) {
        g_counters.mem_free_errors++;
        return CUDA_ERROR_INVALID_VALUE;
    }
    g_live_bytes[a->device] -= a->size;
    g_counters.mem_free++;
    free((void *)a->base);
    remove_alloc(index);
    return CUDA_SUCCESS;
}

#define REQUIRE_INIT()                                                                   \
    do {                                                                                 \
        if (!g_initialized) {                                                            \
            unlock();                                                                    \
            return CUDA_ERROR_NOT_INITIALIZED;                                           \
        }                                                                                \
    } while (0)

/* ---- initialisation, devices, contexts ---------------------------------------------- */

static CUresult fk_cuInit(unsigned int flags)
{
    lock();
    CUresult rc;
    if (flags != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (g_device_count == 0)
        rc = CUDA_ERROR_NO_DEVICE;
    else {
        g_initialized = 1;
        rc = CUDA_SUCCESS;
    }
    trace("cuInit(%u) -> %d", flags, rc);
    unlock();
    return rc;
}

static CUresult fk_cuDriverGetVersion(int *version)
{
    lock();
    trace("cuDriverGetVersion -> %d", version ? 0 : 1);
    unlock();
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = g_driver_version;
    return CUDA_SUCCESS;
}

static CUresult fk_cuDeviceGetCount(int *count)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (count)
        *count = g_device_count;
    trace("cuDeviceGetCount -> %d (%d)", rc, g_device_count);
    unlock();
    return rc;
}

static CUresult fk_cuDeviceGet(CUdevice *device, int ordinal)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!device)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (ordinal < 0 || ordinal >= g_device_count)
        rc = CUDA_ERROR_INVALID_DEVICE;
    else
        *device = ordinal;
    trace("cuDeviceGet(%d) -> %d", ordinal, rc);
    unlock();
    return rc;
}

static CUresult fk_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!pctx)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (dev < 0 || dev >= g_device_count)
        rc = CUDA_ERROR_INVALID_DEVICE;
    else {
        g_ctx[dev].retain_count++;
        *pctx = (CUcontext)&g_ctx[dev];
    }
    trace("cuDevicePrimaryCtxRetain(%d) -> %d", dev, rc);
    unlock();
    return rc;
}

static CUresult primary_ctx_release(CUdevice dev, const char *name)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (dev < 0 || dev >= g_device_count)
        rc = CUDA_ERROR_INVALID_DEVICE;
    else if (g_ctx[dev].retain_count <= 0)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else
        g_ctx[dev].retain_count--;
    trace("%s(%d) -> %d", name, dev, rc);
    unlock();
    return rc;
}

static CUresult fk_cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    return primary_ctx_release(dev, "cuDevicePrimaryCtxRelease_v2");
}

/* The pre-11.0 variant; same behaviour here. */
static CUresult fk_cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return primary_ctx_release(dev, "cuDevicePrimaryCtxRelease");
}

static CUresult fk_cuCtxGetCurrent(CUcontext *pctx)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = pctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (pctx)
        *pctx = current_ctx();
    trace("cuCtxGetCurrent -> %d (%p)", rc, (void *)current_ctx());
    unlock();
    return rc;
}

static CUresult fk_cuCtxSetCurrent(CUcontext ctx)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (ctx && !valid_ctx(ctx))
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!ctx) {
        if (t_ctx_depth > 0)
            t_ctx_depth--;
    } else if (t_ctx_depth == 0) {
        t_ctx_stack[t_ctx_depth++] = ctx;
    } else {
        t_ctx_stack[t_ctx_depth - 1] = ctx;
    }
    trace("cuCtxSetCurrent(%p) -> %d", (void *)ctx, rc);
    unlock();
    return rc;
}

static CUresult fk_cuCtxPushCurrent_v2(CUcontext ctx)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!valid_ctx(ctx))
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (t_ctx_depth == FAKE_CTX_STACK_DEPTH)
        rc = CUDA_ERROR_INVALID_VALUE;
    else
        t_ctx_stack[t_ctx_depth++] = ctx;
    trace("cuCtxPushCurrent_v2(%p) -> %d", (void *)ctx, rc);
    unlock();
    return rc;
}

static CUresult fk_cuCtxPopCurrent_v2(CUcontext *pctx)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (t_ctx_depth == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else {
        CUcontext top = t_ctx_stack[--t_ctx_depth];
        if (pctx)
            *pctx = top;
    }
    trace("cuCtxPopCurrent_v2 -> %d", rc);
    unlock();
    return rc;
}

static CUresult fk_cuCtxGetDevice(CUdevice *device)
{
    lock();
    REQUIRE_INIT();
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    CUresult rc = CUDA_SUCCESS;
    if (!ctx)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!device)
        rc = CUDA_ERROR_INVALID_VALUE;
    else
        *device = ctx->device;
    trace("cuCtxGetDevice -> %d", rc);
    unlock();
    return rc;
}

static CUresult fk_cuCtxSynchronize(void)
{
    lock();
    REQUIRE_INIT();
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    CUresult rc = CUDA_SUCCESS;
    g_counters.ctx_sync++;
    if (!ctx)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (unsafe_call_during_capture(ctx))
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    else
        complete_events(0, 1);
    trace("cuCtxSynchronize -> %d", rc);
    unlock();
    return rc;
}

/* ---- memory ------------------------------------------------------------------------- */

static CUresult fk_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    lock();
    CUresult rc = device_alloc(dptr, bytesize, ALLOC_DEVICE, 1);
    trace("cuMemAlloc_v2(%zu) -> %d (%#llx)", bytesize, rc, rc == 0 ? *dptr : 0ull);
    unlock();
    return rc;
}

/* The pre-3.2 variant took 32-bit device pointers, which host memory cannot honour: it
 * exists so cuGetProcAddress can return it, and always fails with NOT_SUPPORTED. */
static CUresult fk_cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    (void)dptr;
    lock();
    trace("cuMemAlloc(%u) -> %d (v1, unsupported)", bytesize, CUDA_ERROR_NOT_SUPPORTED);
    unlock();
    return CUDA_ERROR_NOT_SUPPORTED;
}

static CUresult fk_cuMemFree_v2(CUdeviceptr dptr)
{
    lock();
    CUresult rc = device_free(dptr, 1);
    trace("cuMemFree_v2(%#llx) -> %d", dptr, rc);
    unlock();
    return rc;
}

/* Pre-3.2 variant: 32-bit pointers never name a fake allocation (see cuMemAlloc). */
static CUresult fk_cuMemFree(CUdeviceptr_v1 dptr)
{
    lock();
    CUresult rc = device_free((CUdeviceptr)dptr, 1);
    trace("cuMemFree(%#x) -> %d (v1)", dptr, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    lock();
    CUresult rc = device_alloc(dptr, bytesize, ALLOC_MANAGED, 0);
    trace("cuMemAllocManaged(%zu, %u) -> %d", bytesize, flags, rc);
    unlock();
    return rc;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream stream,
                            const char *name)
{
    lock();
    CUresult rc;
    if (g_initialized && !is_special_stream((uintptr_t)stream) &&
        !find_stream((uintptr_t)stream))
        rc = CUDA_ERROR_INVALID_HANDLE;
    else
        rc = device_alloc(dptr, bytesize, ALLOC_DEVICE, 0);
    trace("%s(%zu, %p) -> %d", name, bytesize, (void *)stream, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    return alloc_async(dptr, bytesize, stream, "cuMemAllocAsync");
}

static CUresult fk_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    return alloc_async(dptr, bytesize, stream, "cuMemAllocAsync_ptsz");
}

static CUresult free_async(CUdeviceptr dptr, CUstream stream, const char *name)
{
    lock();
    CUresult rc;
    if (g_initialized && !is_special_stream((uintptr_t)stream) &&
        !find_stream((uintptr_t)stream))
        rc = CUDA_ERROR_INVALID_HANDLE;
    else
        rc = device_free(dptr, 0);
    trace("%s(%#llx, %p) -> %d", name, dptr, (void *)stream, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    return free_async(dptr, stream, "cuMemFreeAsync");
}

static CUresult fk_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    return free_async(dptr, stream, "cuMemFreeAsync_ptsz");
}

#define CU_MEMHOSTALLOC_PORTABLE 0x01u
#define CU_MEMHOSTALLOC_DEVICEMAP 0x02u
#define CU_MEMHOSTALLOC_WRITECOMBINED 0x04u
#define CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712
#define CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED 713

static CUresult host_alloc(void **pp, size_t bytesize, unsigned int flags, const char *name)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    unsigned int known =
        CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
    if (!ctx)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!pp || bytesize == 0 || (flags & ~known))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (g_fail_next_host_alloc) {
        rc = g_fail_next_host_alloc;
        g_fail_next_host_alloc = 0;
    } else {
        void *p = host_aligned(bytesize);
        if (!p)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        else if ((rc = add_alloc((uintptr_t)p, bytesize, ALLOC_HOST, ctx->device)) != 0)
            free(p);
        else {
            g_allocs[g_alloc_count - 1].host_flags = flags;
            g_host_live_bytes += bytesize;
            g_counters.host_alloc++;
            *pp = p;
        }
    }
    trace("%s(%zu, %u) -> %d", name, bytesize, flags, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags)
{
    return host_alloc(pp, bytesize, flags, "cuMemHostAlloc");
}

static CUresult fk_cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return host_alloc(pp, bytesize, 0, "cuMemAllocHost_v2");
}

/* The pre-3.2 variant took a 32-bit size. */
static CUresult fk_cuMemAllocHost(void **pp, unsigned int bytesize)
{
    return host_alloc(pp, bytesize, 0, "cuMemAllocHost");
}

static CUresult fk_cuMemFreeHost(void *p)
{
    lock();
    REQUIRE_INIT();
    size_t index;
    struct fake_alloc *a = find_alloc_base((uintptr_t)p, &index);
    CUresult rc = CUDA_SUCCESS;
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!a || a->kind != ALLOC_HOST) {
        rc = CUDA_ERROR_INVALID_VALUE;
        g_counters.host_free_errors++;
    } else {
        g_host_live_bytes -= a->size;
        g_counters.host_free++;
        free(p);
        remove_alloc(index);
    }
    trace("cuMemFreeHost(%p) -> %d", p, rc);
    unlock();
    return rc;
}

static struct fake_registration *find_registration(uintptr_t p, size_t n, size_t *index)
{
    for (size_t i = 0; i < g_reg_count; i++)
        if (p < g_regs[i].base + g_regs[i].size && g_regs[i].base < p + n) {
            if (index)
                *index = i;
            return &g_regs[i];
        }
    return NULL;
}

static CUresult fk_cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int flags)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!p || bytesize == 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (find_registration((uintptr_t)p, bytesize, NULL))
        rc = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    else if (g_reg_count == g_reg_cap) {
        size_t cap = g_reg_cap ? g_reg_cap * 2 : 16;
        struct fake_registration *r = realloc(g_regs, cap * sizeof *r);
        if (!r)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            g_regs = r;
            g_reg_cap = cap;
        }
    }
    if (rc == CUDA_SUCCESS) {
        g_regs[g_reg_count].base = (uintptr_t)p;
        g_regs[g_reg_count].size = bytesize;
        g_reg_count++;
        g_counters.host_register++;
    }
    trace("cuMemHostRegister_v2(%p, %zu, %u) -> %d", p, bytesize, flags, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemHostUnregister(void *p)
{
    lock();
    REQUIRE_INIT();
    size_t index = 0;
    struct fake_registration *r = find_registration((uintptr_t)p, 1, &index);
    CUresult rc = CUDA_SUCCESS;
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!r || r->base != (uintptr_t)p)
        rc = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    else {
        g_regs[index] = g_regs[--g_reg_count];
        g_counters.host_unregister++;
    }
    trace("cuMemHostUnregister(%p) -> %d", p, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    lock();
    REQUIRE_INIT();
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    CUresult rc = CUDA_SUCCESS;
    if (!ctx)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!free_bytes || !total_bytes)
        rc = CUDA_ERROR_INVALID_VALUE;
    else {
        uint64_t live = g_live_bytes[ctx->device];
        *total_bytes = g_total_bytes;
        *free_bytes = live >= g_total_bytes ? 0 : g_total_bytes - (size_t)live;
    }
    trace("cuMemGetInfo_v2 -> %d", rc);
    unlock();
    return rc;
}

/* Pre-3.2 variant with 32-bit sizes, saturated. */
static CUresult fk_cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
    size_t f = 0, t = 0;
    CUresult rc = fk_cuMemGetInfo_v2(&f, &t);
    if (rc == CUDA_SUCCESS) {
        if (!free_bytes || !total_bytes)
            return CUDA_ERROR_INVALID_VALUE;
        *free_bytes = f > 0xffffffffu ? 0xffffffffu : (unsigned int)f;
        *total_bytes = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    }
    return rc;
}

static CUresult fk_cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_alloc mapped;
    struct fake_alloc *a = find_alloc_containing((uintptr_t)dptr);
    if (!a && vmm_lookup((uintptr_t)dptr, &mapped))
        a = &mapped; /* a VMM mapping: its own range */
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!a || a->kind == ALLOC_HOST)
        rc = CUDA_ERROR_NOT_FOUND;
    else {
        if (pbase)
            *pbase = (CUdeviceptr)a->base;
        if (psize)
            *psize = a->size;
    }
    trace("cuMemGetAddressRange_v2(%#llx) -> %d", dptr, rc);
    unlock();
    return rc;
}

/* Pre-3.2 variant: 32-bit pointers never name a fake allocation. */
static CUresult fk_cuMemGetAddressRange(CUdeviceptr_v1 *pbase, unsigned int *psize,
                                     CUdeviceptr_v1 dptr)
{
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult rc = fk_cuMemGetAddressRange_v2(&base, &size, (CUdeviceptr)dptr);
    if (rc == CUDA_SUCCESS) {
        if (pbase)
            *pbase = (CUdeviceptr_v1)base;
        if (psize)
            *psize = (unsigned int)size;
    }
    return rc;
}

/* Checks that [p, p+n) lies inside one device or managed allocation. */
static int device_range_ok(CUdeviceptr p, size_t n)
{
    struct fake_alloc *a = find_alloc_containing((uintptr_t)p);
    return (a && a->kind != ALLOC_HOST && (uintptr_t)p - a->base <= a->size - n &&
            n <= a->size) ||
           vmm_range_ok((uintptr_t)p, n);
}

static CUresult fk_cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (n && !device_range_ok(dst, n))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (n)
        memset((void *)(uintptr_t)dst, value, n);
    trace("cuMemsetD8_v2(%#llx, %u, %zu) -> %d", dst, value, n, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (n && (!src || !device_range_ok(dst, n)))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (n)
        memcpy((void *)(uintptr_t)dst, src, n);
    trace("cuMemcpyHtoD_v2(%#llx, %zu) -> %d", dst, n, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (n && (!dst || !device_range_ok(src, n)))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (n)
        memcpy(dst, (const void *)(uintptr_t)src, n);
    trace("cuMemcpyDtoH_v2(%#llx, %zu) -> %d", src, n, rc);
    unlock();
    return rc;
}

static CUresult fk_cuPointerGetAttribute(void *data, CUpointer_attribute attribute,
                                      CUdeviceptr ptr)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_alloc mapped;
    struct fake_alloc *a = find_alloc_containing((uintptr_t)ptr);
    if (!a && vmm_lookup((uintptr_t)ptr, &mapped))
        a = &mapped;
    if (!data || !a) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        switch (attribute) {
        case CU_POINTER_ATTRIBUTE_CONTEXT:
            *(CUcontext *)data = (CUcontext)&g_ctx[a->device];
            break;
        case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
            *(unsigned int *)data =
                a->kind == ALLOC_HOST ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
            break;
        case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
            *(CUdeviceptr *)data = ptr;
            break;
        case CU_POINTER_ATTRIBUTE_BUFFER_ID:
            *(unsigned long long *)data = a->buffer_id;
            break;
        case CU_POINTER_ATTRIBUTE_IS_MANAGED:
            *(int *)data = a->kind == ALLOC_MANAGED;
            break;
        case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
            *(int *)data = a->device;
            break;
        case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
            *(CUdeviceptr *)data = (CUdeviceptr)a->base;
            break;
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
            *(size_t *)data = a->size;
            break;
        default:
            rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    trace("cuPointerGetAttribute(%d, %#llx) -> %d", attribute, ptr, rc);
    unlock();
    return rc;
}

/* The handle's first 8 bytes hold the allocation base, the next 8 its size. */
static CUresult fk_cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_alloc *a = find_alloc_containing((uintptr_t)dptr);
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!handle || !a || a->kind != ALLOC_DEVICE)
        rc = CUDA_ERROR_INVALID_VALUE;
    else {
        uint64_t base = (uint64_t)a->base, size = (uint64_t)a->size;
        memset(handle, 0, sizeof *handle);
        memcpy(handle->reserved, &base, sizeof base);
        memcpy(handle->reserved + 8, &size, sizeof size);
    }
    trace("cuIpcGetMemHandle(%#llx) -> %d", dptr, rc);
    unlock();
    return rc;
}

/* Opening maps nothing (one process, host memory): a handle of a live device allocation
 * opens at that allocation's base, any other handle (a cupool-tagged one included) is
 * CUDA_ERROR_INVALID_VALUE, as the real driver answers a handle it did not make. */
static int g_ipc_open;
static CUresult fk_cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    (void)flags;
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    uint64_t base = 0, size = 0;
    memcpy(&base, handle.reserved, sizeof base);
    memcpy(&size, handle.reserved + 8, sizeof size);
    int rest_zero = 1;
    for (size_t i = 16; i < sizeof handle.reserved; i++)
        rest_zero &= handle.reserved[i] == 0;
    struct fake_alloc *a = find_alloc_containing((uintptr_t)base);
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!pdptr || !rest_zero || !a || a->kind != ALLOC_DEVICE ||
             (uint64_t)a->base != base || (uint64_t)a->size != size)
        rc = CUDA_ERROR_INVALID_VALUE;
    else {
        *pdptr = (CUdeviceptr)base;
        g_ipc_open++;
    }
    trace("cuIpcOpenMemHandle(%#llx) -> %d", (unsigned long long)base, rc);
    unlock();
    return rc;
}

static CUresult fk_cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_alloc *a = find_alloc_containing((uintptr_t)dptr);
    if (!a || (CUdeviceptr)a->base != dptr || g_ipc_open == 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else
        g_ipc_open--;
    trace("cuIpcCloseMemHandle(%#llx) -> %d", (unsigned long long)dptr, rc);
    unlock();
    return rc;
}

/* ---- virtual memory management ------------------------------------------------------
 *
 * Reservations are PROT_NONE, MAP_NORESERVE anonymous mappings of host address space;
 * cuMemCreate makes a handle (counted against the device's budget, so cuMemGetInfo sees
 * it) with no memory of its own; cuMemMap binds a handle to a granule-aligned range inside
 * one reservation, still inaccessible; cuMemSetAccess records each device's access flags
 * and makes the range readable/writable (mprotect); cuMemUnmap drops the pages
 * (madvise DONTNEED) and makes the range inaccessible again. The contents of a handle do
 * not follow it to another address (cupool never relies on that).
 *
 * Checks, like the real driver's (CUDA_ERROR_INVALID_VALUE): mapping over a mapped range
 * or outside a reservation, unmapping a range that is not a set of whole mappings, setting
 * access on a range not wholly mapped, freeing a reservation that still has mappings.
 * A handle may be mapped at several places at once, as the driver allows (cupool leaves a
 * moved chunk's old place mapped for a while: Note [unmaps off the launching thread]).
 * Stricter than the driver, to catch allocator bugs: releasing a handle mapped anywhere
 * fails (the driver defers the release). */

#define FAKE_VMM_GRANULE ((size_t)2 << 20)
#define CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED 704
#define CUDA_ERROR_PEER_ACCESS_NOT_ENABLED 705

typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    int type;
    int id;
} CUmemLocation;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

struct fake_reservation {
    uintptr_t base;
    size_t size;
};

struct fake_handle {
    CUmemGenericAllocationHandle id;
    size_t size;
    int device;
    int mapped; /* places it is mapped at */
    int exportable; /* created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested */
    int imported;   /* from cuMemImportFromShareableHandle: not counted in live bytes */
    int fd;         /* memfd holding its bytes once exported or imported, -1 before */
};

struct fake_mapping {
    uintptr_t va;
    size_t size;
    CUmemGenericAllocationHandle handle;
    int device;
    unsigned char access[FAKE_MAX_DEVICES];
};

static struct fake_reservation *g_res;
static size_t g_res_count, g_res_cap;
static struct fake_handle *g_handles;
static size_t g_handle_count, g_handle_cap;
static struct fake_mapping *g_maps;
static size_t g_map_count, g_map_cap;
static CUmemGenericAllocationHandle g_next_handle = 0x1000;
static unsigned int g_peer[FAKE_MAX_DEVICES]; /* bit d: access to device d's context */

static struct {
    int nth;
    int count;
    int code;
} g_vmm_fail[FAKE_VMM_FUNCTIONS];

/* Grows a dynamic array to hold one more element; 0 on allocation failure. */
static int grow(void **array, size_t *cap, size_t count, size_t elem)
{
    if (count < *cap)
        return 1;
    size_t n = *cap ? *cap * 2 : 64;
    void *p = realloc(*array, n * elem);
    if (!p)
        return 0;
    *array = p;
    *cap = n;
    return 1;
}

/* The injected result for a call of `fn`, or CUDA_SUCCESS. */
static CUresult vmm_injected(int fn)
{
    if (fn < 0 || fn >= FAKE_VMM_FUNCTIONS || g_vmm_fail[fn].count <= 0)
        return CUDA_SUCCESS;
    if (g_vmm_fail[fn].nth > 1) {
        g_vmm_fail[fn].nth--;
        return CUDA_SUCCESS;
    }
    g_vmm_fail[fn].count--;
    return g_vmm_fail[fn].code;
}

/* Common entry checks of every VMM call; CUDA_SUCCESS to go on. */
static CUresult vmm_enter(int fn)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!g_vmm_supported)
        return CUDA_ERROR_NOT_SUPPORTED;
    return vmm_injected(fn);
}

static CUresult vmm_result(CUresult rc)
{
    if (rc != CUDA_SUCCESS)
        g_counters.vmm_errors++;
    return rc;
}

static struct fake_reservation *find_reservation(uintptr_t p, size_t n)
{
    for (size_t i = 0; i < g_res_count; i++)
        if (p >= g_res[i].base && p - g_res[i].base < g_res[i].size &&
            n <= g_res[i].size - (p - g_res[i].base))
            return &g_res[i];
    return NULL;
}

static struct fake_handle *find_handle(CUmemGenericAllocationHandle h, size_t *index)
{
    for (size_t i = 0; i < g_handle_count; i++)
        if (g_handles[i].id == h) {
            if (index)
                *index = i;
            return &g_handles[i];
        }
    return NULL;
}

static struct fake_mapping *find_mapping_containing(uintptr_t p)
{
    for (size_t i = 0; i < g_map_count; i++)
        if (p >= g_maps[i].va && p - g_maps[i].va < g_maps[i].size)
            return &g_maps[i];
    return NULL;
}

static int overlaps_mapping(uintptr_t p, size_t n)
{
    for (size_t i = 0; i < g_map_count; i++)
        if (p < g_maps[i].va + g_maps[i].size && g_maps[i].va < p + n)
            return 1;
    return 0;
}

/* Whether [p, p+n) is covered by mappings with no gap. */
static int wholly_mapped(uintptr_t p, size_t n)
{
    while (n > 0) {
        struct fake_mapping *m = find_mapping_containing(p);
        if (!m)
            return 0;
        size_t step = m->va + m->size - p;
        if (step >= n)
            return 1;
        p += step;
        n -= step;
    }
    return 1;
}

/* Whether [p, p+n) is mapped and readable and writable by the current device. */
static int vmm_range_ok(uintptr_t p, size_t n)
{
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    if (!ctx || n == 0)
        return 0;
    while (n > 0) {
        struct fake_mapping *m = find_mapping_containing(p);
        if (!m || m->access[ctx->device] != 3)
            return 0;
        size_t step = m->va + m->size - p;
        if (step >= n)
            return 1;
        p += step;
        n -= step;
    }
    return 1;
}

/* Describes the mapping containing p as a device allocation (range = the mapping,
 * buffer id = the handle); 0 when none does. */
static int vmm_lookup(uintptr_t p, struct fake_alloc *out)
{
    struct fake_mapping *m = find_mapping_containing(p);
    if (!m)
        return 0;
    out->base = m->va;
    out->size = m->size;
    out->kind = ALLOC_DEVICE;
    out->device = m->device;
    out->buffer_id = m->handle;
    return 1;
}

static CUresult fk_cuDeviceGetAttribute(int *value, int attribute, CUdevice dev)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!value)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (dev < 0 || dev >= g_device_count)
        rc = CUDA_ERROR_INVALID_DEVICE;
    else if (attribute == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ||
             attribute == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
        *value = g_vmm_supported;
    else
        rc = CUDA_ERROR_INVALID_VALUE; /* the fake knows no other attribute */
    trace("cuDeviceGetAttribute(%d, %d) -> %d", attribute, dev, rc);
    unlock();
    return rc;
}

static int valid_prop(const CUmemAllocationProp *prop)
{
    return prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
           prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->location.id >= 0 &&
           prop->location.id < g_device_count &&
           (prop->requestedHandleTypes == 0 ||
            prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

static CUresult fk_cuMemGetAllocationGranularity(size_t *granularity,
                                                 const CUmemAllocationProp *prop, int option)
{
    lock();
    CUresult rc = vmm_enter(FAKE_VMM_GRANULARITY);
    if (rc == CUDA_SUCCESS) {
        if (!granularity || !valid_prop(prop) || (option != 0 && option != 1))
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            *granularity = FAKE_VMM_GRANULE;
    }
    trace("cuMemGetAllocationGranularity(%d) -> %d", option, rc);
    rc = vmm_result(rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                       CUdeviceptr addr, unsigned long long flags)
{
    lock();
    CUresult rc = vmm_enter(FAKE_VMM_RESERVE);
    if (rc == CUDA_SUCCESS) {
        size_t align = alignment ? alignment : FAKE_VMM_GRANULE;
        if (!ptr || size == 0 || size % FAKE_VMM_GRANULE || align % FAKE_VMM_GRANULE ||
            (align & (align - 1)) || flags != 0 ||
            !grow((void **)&g_res, &g_res_cap, g_res_count, sizeof *g_res)) {
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            (void)addr; /* a hint only */
            size_t len = size + align;
            void *p = len < size ? MAP_FAILED
                                 : mmap(NULL, len, PROT_NONE,
                                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) {
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            } else {
                uintptr_t raw = (uintptr_t)p;
                uintptr_t base = (raw + align - 1) / align * align;
                if (base > raw)
                    munmap(p, base - raw);
                if (raw + len > base + size)
                    munmap((void *)(base + size), raw + len - (base + size));
                g_res[g_res_count].base = base;
                g_res[g_res_count].size = size;
                g_res_count++;
                *ptr = (CUdeviceptr)base;
            }
        }
    }
    trace("cuMemAddressReserve(%zu) -> %d (%#llx)", size, rc, rc == 0 ? *ptr : 0ull);
    rc = vmm_result(rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    lock();
    CUresult rc = vmm_enter(FAKE_VMM_ADDRESS_FREE);
    if (rc == CUDA_SUCCESS) {
        size_t i = 0;
        while (i < g_res_count && g_res[i].base != (uintptr_t)ptr)
            i++;
        if (i == g_res_count || g_res[i].size != size || overlaps_mapping(ptr, size)) {
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            munmap((void *)(uintptr_t)ptr, size);
            g_res[i] = g_res[--g_res_count];
        }
    }
    trace("cuMemAddressFree(%#llx, %zu) -> %d", ptr, size, rc);
    rc = vmm_result(rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags)
{
    lock();
    CUresult rc = vmm_enter(FAKE_VMM_CREATE);
    if (rc == CUDA_SUCCESS) {
        if (!handle || size == 0 || size % FAKE_VMM_GRANULE || flags != 0 || !valid_prop(prop) ||
            !grow((void **)&g_handles, &g_handle_cap, g_handle_count, sizeof *g_handles)) {
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            int dev = prop->location.id;
            if (size > g_total_bytes || g_live_bytes[dev] > g_total_bytes - size) {
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            } else {
                struct fake_handle *h = &g_handles[g_handle_count++];
                h->id = g_next_handle++;
                h->size = size;
                h->device = dev;
                h->mapped = 0;
                h->exportable =
                    prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
                h->imported = 0;
                h->fd = -1;
                g_live_bytes[dev] += size;
                g_counters.vmm_creates++;
                *handle = h->id;
            }
        }
    }
    trace("cuMemCreate(%zu) -> %d (%#llx)", size, rc, rc == 0 ? *handle : 0ull);
    rc = vmm_result(rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemRelease(CUmemGenericAllocationHandle handle)
{
    lock();
    CUresult rc = vmm_enter(FAKE_VMM_RELEASE);
    if (rc == CUDA_SUCCESS) {
        size_t i;
        struct fake_handle *h = find_handle(handle, &i);
        if (!h || h->mapped) {
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            if (h->fd >= 0)
                close(h->fd);
            if (!h->imported) {
                g_live_bytes[h->device] -= h->size;
                g_counters.vmm_releases++;
            }
            g_handles[i] = g_handles[--g_handle_count];
        }
    }
    trace("cuMemRelease(%#llx) -> %d", handle, rc);
    rc = vmm_result(rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                            CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    lock();
    CUresult rc = vmm_enter(FAKE_VMM_MAP);
    if (rc == CUDA_SUCCESS) {
        struct fake_handle *h = find_handle(handle, NULL);
        if (!h || offset != 0 || size != h->size || flags != 0 ||
            ptr % FAKE_VMM_GRANULE || !find_reservation(ptr, size) ||
            overlaps_mapping(ptr, size) ||
            !grow((void **)&g_maps, &g_map_cap, g_map_count, sizeof *g_maps)) {
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            if (h->fd >= 0) /* its bytes live in its memfd: they follow it */
                mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0);
            struct fake_mapping *m = &g_maps[g_map_count++];
            memset(m, 0, sizeof *m);
            m->va = (uintptr_t)ptr;
            m->size = size;
            m->handle = handle;
            m->device = h->device;
            h->mapped++;
            g_counters.vmm_maps++;
        }
    }
    trace("cuMemMap(%#llx, %zu, %#llx) -> %d", ptr, size, handle, rc);
    rc = vmm_result(rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                  size_t count)
{
    lock();
    CUresult rc = vmm_enter(FAKE_VMM_SET_ACCESS);
    if (rc == CUDA_SUCCESS) {
        if (!desc || count == 0 || size == 0 || !wholly_mapped(ptr, size))
            rc = CUDA_ERROR_INVALID_VALUE;
        for (size_t i = 0; rc == CUDA_SUCCESS && i < count; i++) {
            int f = desc[i].flags;
            if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
                rc = CUDA_ERROR_INVALID_VALUE;
            else if (desc[i].location.id < 0 || desc[i].location.id >= g_device_count)
                rc = CUDA_ERROR_INVALID_DEVICE;
            else if (f != 0 && f != 1 && f != 3)
                rc = CUDA_ERROR_INVALID_VALUE;
        }
        if (rc == CUDA_SUCCESS) {
            for (size_t i = 0; i < g_map_count; i++) {
                struct fake_mapping *m = &g_maps[i];
                if (!(m->va < ptr + size && ptr < m->va + m->size))
                    continue;
                int prot = PROT_NONE;
                for (size_t k = 0; k < count; k++)
                    m->access[desc[k].location.id] = (unsigned char)desc[k].flags;
                for (int d = 0; d < FAKE_MAX_DEVICES; d++) {
                    if (m->access[d] == 3)
                        prot = PROT_READ | PROT_WRITE;
                    else if (m->access[d] == 1 && prot == PROT_NONE)
                        prot = PROT_READ;
                }
                mprotect((void *)m->va, m->size, prot);
            }
            g_counters.vmm_set_access++;
        }
    }
    trace("cuMemSetAccess(%#llx, %zu, %zu) -> %d", ptr, size, count, rc);
    rc = vmm_result(rc);
    unlock();
    return rc;
}

/* Exporting gives the handle a memfd holding its bytes (copied from where it is mapped,
 * which is then remapped from the memfd), and the caller a duplicate of it, named after the
 * device; importing such a descriptor, in this process or another one, makes a handle of
 * the same memfd. So an importer sees the exporter's bytes, as with the real driver. */
static struct fake_mapping *mapping_of(CUmemGenericAllocationHandle handle)
{
    for (size_t i = 0; i < g_map_count; i++)
        if (g_maps[i].handle == handle)
            return &g_maps[i];
    return NULL;
}

static int mapping_prot(const struct fake_mapping *m)
{
    int prot = PROT_NONE;
    for (int d = 0; d < FAKE_MAX_DEVICES; d++) {
        if (m->access[d] == 3)
            prot = PROT_READ | PROT_WRITE;
        else if (m->access[d] == 1 && prot == PROT_NONE)
            prot = PROT_READ;
    }
    return prot;
}

static int give_memfd(struct fake_handle *h)
{
    char name[32];
    snprintf(name, sizeof name, "fake-cuda-dev%d", h->device);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)h->size) != 0) {
        if (fd >= 0)
            close(fd);
        return 0;
    }
    struct fake_mapping *m = mapping_of(h->id);
    if (m) {
        mprotect((void *)m->va, m->size, PROT_READ);
        if (pwrite(fd, (void *)m->va, m->size, 0) != (ssize_t)m->size) {
            close(fd);
            mprotect((void *)m->va, m->size, mapping_prot(m));
            return 0;
        }
        mmap((void *)m->va, m->size, mapping_prot(m), MAP_SHARED | MAP_FIXED, fd, 0);
    }
    h->fd = fd;
    return 1;
}

static CUresult fk_cuMemExportToShareableHandle(void *shareable,
                                                CUmemGenericAllocationHandle handle,
                                                int type, unsigned long long flags)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_handle *h = find_handle(handle, NULL);
    if (!shareable || !h || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || flags != 0 ||
        !h->exportable)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (h->fd < 0 && !give_memfd(h))
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else {
        int fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0);
        if (fd < 0)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            *(int *)shareable = fd;
            g_counters.vmm_exports++;
        }
    }
    trace("cuMemExportToShareableHandle(%#llx) -> %d", handle, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                  void *os_handle, int type)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    int fd = (int)(intptr_t)os_handle, device = -1;
    char link[64], target[128] = {0};
    struct stat st;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    if (!handle || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || fstat(fd, &st) != 0 ||
        readlink(link, target, sizeof target - 1) < 0 ||
        sscanf(target, "/memfd:fake-cuda-dev%d", &device) != 1 || device < 0 ||
        device >= g_device_count || st.st_size <= 0 || st.st_size % FAKE_VMM_GRANULE ||
        !grow((void **)&g_handles, &g_handle_cap, g_handle_count, sizeof *g_handles))
        rc = CUDA_ERROR_INVALID_VALUE;
    else {
        struct fake_handle *h = &g_handles[g_handle_count++];
        h->id = g_next_handle++;
        h->size = (size_t)st.st_size;
        h->device = device;
        h->mapped = 0;
        h->exportable = 1;
        h->imported = 1;
        h->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        g_counters.vmm_imports++;
        *handle = h->id;
    }
    trace("cuMemImportFromShareableHandle(%d) -> %d", fd, rc);
    unlock();
    return rc;
}

static CUresult fk_cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    lock();
    CUresult rc = vmm_enter(FAKE_VMM_UNMAP);
    if (rc == CUDA_SUCCESS) {
        /* Every mapping the range touches must lie wholly inside it, and it must touch one. */
        size_t touched = 0;
        for (size_t i = 0; i < g_map_count; i++) {
            struct fake_mapping *m = &g_maps[i];
            if (!(m->va < ptr + size && ptr < m->va + m->size))
                continue;
            touched++;
            if (m->va < ptr || m->va + m->size > ptr + size)
                rc = CUDA_ERROR_INVALID_VALUE;
        }
        if (size == 0 || touched == 0)
            rc = CUDA_ERROR_INVALID_VALUE;
        for (size_t i = 0; rc == CUDA_SUCCESS && i < g_map_count;) {
            struct fake_mapping *m = &g_maps[i];
            if (!(m->va < ptr + size && ptr < m->va + m->size)) {
                i++;
                continue;
            }
            /* A fresh inaccessible anonymous mapping: the bytes stay with a memfd. */
            mmap((void *)m->va, m->size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            struct fake_handle *h = find_handle(m->handle, NULL);
            if (h && h->mapped > 0)
                h->mapped--;
            g_maps[i] = g_maps[--g_map_count];
            g_counters.vmm_unmaps++;
        }
    }
    trace("cuMemUnmap(%#llx, %zu) -> %d", ptr, size, rc);
    rc = vmm_result(rc);
    unlock();
    return rc;
}

static CUresult fk_cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags)
{
    lock();
    REQUIRE_INIT();
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    struct fake_ctx *p = valid_ctx(peer);
    CUresult rc = CUDA_SUCCESS;
    if (!ctx || !p)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (flags != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (p == ctx)
        rc = CUDA_ERROR_INVALID_DEVICE;
    else if (g_peer[ctx->device] & (1u << p->device))
        rc = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    else
        g_peer[ctx->device] |= 1u << p->device;
    trace("cuCtxEnablePeerAccess(%p) -> %d", (void *)peer, rc);
    unlock();
    return rc;
}

static CUresult fk_cuCtxDisablePeerAccess(CUcontext peer)
{
    lock();
    REQUIRE_INIT();
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    struct fake_ctx *p = valid_ctx(peer);
    CUresult rc = CUDA_SUCCESS;
    if (!ctx || !p)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!(g_peer[ctx->device] & (1u << p->device)))
        rc = CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
    else
        g_peer[ctx->device] &= ~(1u << p->device);
    trace("cuCtxDisablePeerAccess(%p) -> %d", (void *)peer, rc);
    unlock();
    return rc;
}

/* ---- streams ------------------------------------------------------------------------ */

static CUresult fk_cuStreamCreate(CUstream *pstream, unsigned int flags)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
    if (!ctx)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!pstream)
        rc = CUDA_ERROR_INVALID_VALUE;
    else {
        struct fake_stream *s = calloc(1, sizeof *s);
        if (!s)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            s->ctx = ctx;
            s->flags = flags;
            s->id = g_next_stream_id++;
            s->next = g_streams;
            g_streams = s;
            *pstream = (CUstream)s;
        }
    }
    trace("cuStreamCreate(%u) -> %d", flags, rc);
    unlock();
    return rc;
}

static CUresult fk_cuStreamDestroy_v2(CUstream stream)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    for (struct fake_stream **pp = &g_streams; *pp; pp = &(*pp)->next) {
        if (*pp == (struct fake_stream *)stream) {
            struct fake_stream *s = *pp;
            *pp = s->next;
            complete_events((uintptr_t)s, 0);
            free(s);
            rc = CUDA_SUCCESS;
            break;
        }
    }
    trace("cuStreamDestroy_v2(%p) -> %d", (void *)stream, rc);
    unlock();
    return rc;
}

static CUresult fk_cuStreamGetId(CUstream stream, unsigned long long *id)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    uintptr_t h = (uintptr_t)stream;
    struct fake_stream *s = NULL;
    if (!id)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (h == 0 || h == CU_STREAM_LEGACY)
        *id = FAKE_LEGACY_STREAM_ID;
    else if (h == CU_STREAM_PER_THREAD)
        *id = FAKE_PER_THREAD_STREAM_ID;
    else if ((s = find_stream(h)) != NULL)
        *id = s->id;
    else
        rc = CUDA_ERROR_INVALID_HANDLE;
    trace("cuStreamGetId(%p) -> %d", (void *)stream, rc);
    unlock();
    return rc;
}

static CUresult fk_cuStreamSynchronize(CUstream stream)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    uintptr_t h = (uintptr_t)stream;
    struct fake_stream *s = find_stream(h);
    g_counters.stream_sync++;
    if (!s && !is_special_stream(h))
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (s && s->capture_status != CU_STREAM_CAPTURE_STATUS_NONE) {
        s->capture_status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else
        complete_events(h, 0);
    trace("cuStreamSynchronize(%p) -> %d", (void *)stream, rc);
    unlock();
    return rc;
}

static CUresult begin_capture(CUstream stream, CUstreamCaptureMode mode, const char *name)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_stream *s = find_stream((uintptr_t)stream);
    if (!s)
        /* The legacy stream cannot be captured; unknown handles are invalid. */
        rc = is_special_stream((uintptr_t)stream) ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
                                                  : CUDA_ERROR_INVALID_HANDLE;
    else if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (s->capture_status != CU_STREAM_CAPTURE_STATUS_NONE)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    else {
        s->capture_status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
        s->capture_mode = mode;
        s->capture_thread = pthread_self();
    }
    trace("%s(%p, %d) -> %d", name, (void *)stream, mode, rc);
    unlock();
    return rc;
}

static CUresult fk_cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode)
{
    return begin_capture(stream, mode, "cuStreamBeginCapture_v2");
}

/* The 10.0 variant had no mode argument: global mode. */
static CUresult fk_cuStreamBeginCapture(CUstream stream)
{
    return begin_capture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL, "cuStreamBeginCapture");
}

static CUresult fk_cuStreamEndCapture(CUstream stream, CUgraph *graph)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_stream *s = find_stream((uintptr_t)stream);
    if (!s)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (!graph)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (s->capture_status == CU_STREAM_CAPTURE_STATUS_NONE)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    else {
        rc = s->capture_status == CU_STREAM_CAPTURE_STATUS_INVALIDATED
                 ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                 : CUDA_SUCCESS;
        *graph = rc == CUDA_SUCCESS ? (CUgraph)(void *)&g_graph_token : NULL;
        s->capture_status = CU_STREAM_CAPTURE_STATUS_NONE;
    }
    trace("cuStreamEndCapture(%p) -> %d", (void *)stream, rc);
    unlock();
    return rc;
}

static CUresult fk_cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    uintptr_t h = (uintptr_t)stream;
    struct fake_stream *s = find_stream(h);
    if (!status)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (s)
        *status = s->capture_status;
    else if (h == 0 || h == CU_STREAM_LEGACY) {
        /* As documented for the real driver: asking about the legacy stream while a
         * blocking stream of the current context is capturing answers
         * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (and invalidates nothing). */
        *status = CU_STREAM_CAPTURE_STATUS_NONE;
        struct fake_ctx *ctx = (struct fake_ctx *)current_ctx();
        for (s = g_streams; s; s = s->next)
            if (s->ctx == ctx && !(s->flags & CU_STREAM_NON_BLOCKING) &&
                s->capture_status != CU_STREAM_CAPTURE_STATUS_NONE)
                rc = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    } else if (h == CU_STREAM_PER_THREAD)
        *status = CU_STREAM_CAPTURE_STATUS_NONE;
    else
        rc = CUDA_ERROR_INVALID_HANDLE;
    trace("cuStreamIsCapturing(%p) -> %d", (void *)stream, rc);
    unlock();
    return rc;
}

/* ---- events ------------------------------------------------------------------------- */

static CUresult fk_cuEventCreate(CUevent *pevent, unsigned int flags)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!current_ctx())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!pevent)
        rc = CUDA_ERROR_INVALID_VALUE;
    else {
        struct fake_event *ev = calloc(1, sizeof *ev);
        if (!ev)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            ev->flags = flags;
            ev->next = g_events;
            g_events = ev;
            *pevent = (CUevent)ev;
        }
    }
    trace("cuEventCreate(%u) -> %d", flags, rc);
    unlock();
    return rc;
}

static CUresult event_destroy(CUevent event, const char *name)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    for (struct fake_event **pp = &g_events; *pp; pp = &(*pp)->next) {
        if (*pp == (struct fake_event *)event) {
            struct fake_event *ev = *pp;
            *pp = ev->next;
            free(ev);
            rc = CUDA_SUCCESS;
            break;
        }
    }
    trace("%s(%p) -> %d", name, (void *)event, rc);
    unlock();
    return rc;
}

static CUresult fk_cuEventDestroy_v2(CUevent event)
{
    return event_destroy(event, "cuEventDestroy_v2");
}

static CUresult fk_cuEventDestroy(CUevent event)
{
    return event_destroy(event, "cuEventDestroy");
}

static CUresult fk_cuEventRecord(CUevent event, CUstream stream)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    uintptr_t h = (uintptr_t)stream;
    struct fake_event *ev = find_event(event);
    if (!ev || (!is_special_stream(h) && !find_stream(h)))
        rc = CUDA_ERROR_INVALID_HANDLE;
    else {
        ev->recorded = 1;
        ev->queries_left = g_event_latency;
        ev->stream = h;
        g_counters.event_record++;
    }
    trace("cuEventRecord(%p, %p) -> %d", (void *)event, (void *)stream, rc);
    unlock();
    return rc;
}

static CUresult fk_cuCtxRecordEvent(CUcontext hctx, CUevent event)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_ctx *ctx = hctx ? valid_ctx(hctx) : (struct fake_ctx *)current_ctx();
    struct fake_event *ev = find_event(event);
    if (!ctx)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!ev)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else {
        /* Measured on the real driver: any capture in the context is invalidated. */
        for (struct fake_stream *s = g_streams; s; s = s->next) {
            if (s->ctx == ctx && s->capture_status != CU_STREAM_CAPTURE_STATUS_NONE) {
                s->capture_status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
                rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
            }
        }
        if (rc == CUDA_SUCCESS) {
            ev->recorded = 1;
            ev->queries_left = g_event_latency;
            ev->stream = 0;
            g_counters.ctx_record_event++;
        } else {
            g_counters.ctx_record_event_errors++;
        }
    }
    trace("cuCtxRecordEvent(%p, %p) -> %d", (void *)hctx, (void *)event, rc);
    unlock();
    return rc;
}

static CUresult fk_cuEventQuery(CUevent event)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_event *ev = find_event(event);
    g_counters.event_query++;
    if (!ev)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (ev->recorded && ev->queries_left > 0) {
        ev->queries_left--;
        rc = CUDA_ERROR_NOT_READY;
    }
    trace("cuEventQuery(%p) -> %d", (void *)event, rc);
    unlock();
    return rc;
}

static CUresult fk_cuEventSynchronize(CUevent event)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    struct fake_event *ev = find_event(event);
    g_counters.event_sync++;
    if (!ev)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else
        ev->queries_left = 0;
    trace("cuEventSynchronize(%p) -> %d", (void *)event, rc);
    unlock();
    return rc;
}

/* Every stream may wait for any recorded event: the fake runs no work, so the wait only
 * checks the handle and is counted (on CU_STREAM_LEGACY apart). */
static CUresult fk_cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags)
{
    lock();
    REQUIRE_INIT();
    CUresult rc = CUDA_SUCCESS;
    if (!find_event(event) || flags != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else {
        g_counters.stream_wait_event++;
        g_counters.stream_wait_event_legacy += stream == (CUstream)0x1;
    }
    trace("cuStreamWaitEvent(%p, %p, %u) -> %d", (void *)stream, (void *)event, flags, rc);
    unlock();
    return rc;
}

/* ---- errors ------------------------------------------------------------------------- */

static const char *error_name(CUresult e)
{
    switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case 4: return "CUDA_ERROR_DEINITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_ILLEGAL_STATE: return "CUDA_ERROR_ILLEGAL_STATE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: return "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return NULL;
    }
}

static CUresult fk_cuGetErrorName(CUresult error, const char **pstr)
{
    if (!pstr)
        return CUDA_ERROR_INVALID_VALUE;
    const char *name = error_name(error);
    *pstr = name;
    return name ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult fk_cuGetErrorString(CUresult error, const char **pstr)
{
    return fk_cuGetErrorName(error, pstr);
}

/* ---- cuGetProcAddress --------------------------------------------------------------- */

static CUresult fk_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                 cuuint64_t flags);
static CUresult fk_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus);

/* One row per (base name, variant): the variant is returned for versions >= since. */
struct proc_entry {
    const char *base;
    int since;
    int per_thread; /* 1: only for CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
    void *fn;
};

#define PROC(base, since, fn) {base, since, 0, (void *)(fn)}
#define PROC_PTSZ(base, since, fn) {base, since, 1, (void *)(fn)}

static const struct proc_entry g_procs[] = {
    PROC("cuInit", 2000, fk_cuInit),
    PROC("cuDriverGetVersion", 2020, fk_cuDriverGetVersion),
    PROC("cuDeviceGet", 2000, fk_cuDeviceGet),
    PROC("cuDeviceGetCount", 2000, fk_cuDeviceGetCount),
    PROC("cuDevicePrimaryCtxRetain", 7000, fk_cuDevicePrimaryCtxRetain),
    PROC("cuDevicePrimaryCtxRelease", 7000, fk_cuDevicePrimaryCtxRelease),
    PROC("cuDevicePrimaryCtxRelease", 11000, fk_cuDevicePrimaryCtxRelease_v2),
    PROC("cuCtxGetCurrent", 4000, fk_cuCtxGetCurrent),
    PROC("cuCtxSetCurrent", 4000, fk_cuCtxSetCurrent),
    PROC("cuCtxPushCurrent", 4000, fk_cuCtxPushCurrent_v2),
    PROC("cuCtxPopCurrent", 4000, fk_cuCtxPopCurrent_v2),
    PROC("cuCtxGetDevice", 2000, fk_cuCtxGetDevice),
    PROC("cuCtxSynchronize", 2000, fk_cuCtxSynchronize),
    PROC("cuCtxRecordEvent", 12050, fk_cuCtxRecordEvent),
    PROC("cuGetProcAddress", 11030, fk_cuGetProcAddress),
    PROC("cuGetProcAddress", 12000, fk_cuGetProcAddress_v2),
    PROC("cuGetErrorName", 6000, fk_cuGetErrorName),
    PROC("cuGetErrorString", 6000, fk_cuGetErrorString),
    PROC("cuMemAlloc", 2000, fk_cuMemAlloc),
    PROC("cuMemAlloc", 3020, fk_cuMemAlloc_v2),
    PROC("cuMemFree", 2000, fk_cuMemFree),
    PROC("cuMemFree", 3020, fk_cuMemFree_v2),
    PROC("cuMemGetInfo", 2000, fk_cuMemGetInfo),
    PROC("cuMemGetInfo", 3020, fk_cuMemGetInfo_v2),
    PROC("cuMemGetAddressRange", 2000, fk_cuMemGetAddressRange),
    PROC("cuMemGetAddressRange", 3020, fk_cuMemGetAddressRange_v2),
    PROC("cuMemAllocManaged", 6000, fk_cuMemAllocManaged),
    PROC("cuMemHostAlloc", 2020, fk_cuMemHostAlloc),
    PROC("cuMemAllocHost", 2000, fk_cuMemAllocHost),
    PROC("cuMemAllocHost", 3020, fk_cuMemAllocHost_v2),
    PROC("cuMemFreeHost", 2000, fk_cuMemFreeHost),
    PROC("cuMemHostRegister", 6050, fk_cuMemHostRegister_v2),
    PROC("cuMemHostUnregister", 4000, fk_cuMemHostUnregister),
    PROC("cuMemAllocAsync", 11020, fk_cuMemAllocAsync),
    PROC_PTSZ("cuMemAllocAsync", 11020, fk_cuMemAllocAsync_ptsz),
    PROC("cuMemFreeAsync", 11020, fk_cuMemFreeAsync),
    PROC_PTSZ("cuMemFreeAsync", 11020, fk_cuMemFreeAsync_ptsz),
    PROC("cuMemsetD8", 3020, fk_cuMemsetD8_v2),
    PROC("cuMemcpyHtoD", 3020, fk_cuMemcpyHtoD_v2),
    PROC("cuMemcpyDtoH", 3020, fk_cuMemcpyDtoH_v2),
    PROC("cuPointerGetAttribute", 4000, fk_cuPointerGetAttribute),
    PROC("cuIpcGetMemHandle", 4010, fk_cuIpcGetMemHandle),
    PROC("cuIpcOpenMemHandle", 4010, fk_cuIpcOpenMemHandle),
    PROC("cuIpcOpenMemHandle", 11000, fk_cuIpcOpenMemHandle),
    PROC("cuIpcCloseMemHandle", 4010, fk_cuIpcCloseMemHandle),
    PROC("cuStreamCreate", 2000, fk_cuStreamCreate),
    PROC("cuStreamDestroy", 4000, fk_cuStreamDestroy_v2),
    PROC("cuStreamGetId", 12000, fk_cuStreamGetId),
    PROC("cuStreamSynchronize", 2000, fk_cuStreamSynchronize),
    PROC("cuStreamBeginCapture", 10000, fk_cuStreamBeginCapture),
    PROC("cuStreamBeginCapture", 10010, fk_cuStreamBeginCapture_v2),
    PROC("cuStreamEndCapture", 10000, fk_cuStreamEndCapture),
    PROC("cuStreamIsCapturing", 10000, fk_cuStreamIsCapturing),
    PROC("cuDeviceGetAttribute", 2000, fk_cuDeviceGetAttribute),
    PROC("cuCtxEnablePeerAccess", 4000, fk_cuCtxEnablePeerAccess),
    PROC("cuCtxDisablePeerAccess", 4000, fk_cuCtxDisablePeerAccess),
    PROC("cuMemGetAllocationGranularity", 10020, fk_cuMemGetAllocationGranularity),
    PROC("cuMemAddressReserve", 10020, fk_cuMemAddressReserve),
    PROC("cuMemAddressFree", 10020, fk_cuMemAddressFree),
    PROC("cuMemCreate", 10020, fk_cuMemCreate),
    PROC("cuMemRelease", 10020, fk_cuMemRelease),
    PROC("cuMemMap", 10020, fk_cuMemMap),
    PROC("cuMemUnmap", 10020, fk_cuMemUnmap),
    PROC("cuMemSetAccess", 10020, fk_cuMemSetAccess),
    PROC("cuMemExportToShareableHandle", 10020, fk_cuMemExportToShareableHandle),
    PROC("cuMemImportFromShareableHandle", 10020, fk_cuMemImportFromShareableHandle),
    PROC("cuEventCreate", 2000, fk_cuEventCreate),
    PROC("cuEventRecord", 2000, fk_cuEventRecord),
    PROC("cuEventQuery", 2000, fk_cuEventQuery),
    PROC("cuEventSynchronize", 2000, fk_cuEventSynchronize),
    PROC("cuStreamWaitEvent", 3020, fk_cuStreamWaitEvent),
    PROC("cuEventDestroy", 2000, fk_cuEventDestroy),
    PROC("cuEventDestroy", 4000, fk_cuEventDestroy_v2),
};

static CUresult resolve_proc(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus)
{
    if (!symbol || !pfn || cudaVersion > g_driver_version) {
        if (pfn)
            *pfn = NULL;
        if (symbolStatus)
            *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_INVALID_VALUE;
    }
    int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct proc_entry *best = NULL, *best_ptsz = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
        const struct proc_entry *e = &g_procs[i];
        if (strcmp(e->base, symbol) != 0 || e->since > g_driver_version)
            continue;
        known = 1;
        if (e->since > cudaVersion)
            continue;
        const struct proc_entry **slot = e->per_thread ? &best_ptsz : &best;
        if (!*slot || (*slot)->since < e->since)
            *slot = e;
    }
    if (per_thread && best_ptsz)
        best = best_ptsz;
    *pfn = best ? best->fn : NULL;
    if (symbolStatus)
        *symbolStatus = best    ? CU_GET_PROC_ADDRESS_SUCCESS
                        : known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                                : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_SUCCESS;
}

static CUresult fk_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus)
{
    lock();
    g_counters.gpa_queries++;
    CUresult rc = resolve_proc(symbol, pfn, cudaVersion, flags, symbolStatus);
    trace("cuGetProcAddress_v2(%s, %d, %llu) -> %d (%p)", symbol ? symbol : "(null)",
          cudaVersion, (unsigned long long)flags, rc, pfn ? *pfn : NULL);
    unlock();
    return rc;
}

static CUresult fk_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                 cuuint64_t flags)
{
    lock();
    g_counters.gpa_queries++;
    CUresult rc = resolve_proc(symbol, pfn, cudaVersion, flags, NULL);
    trace("cuGetProcAddress(%s, %d, %llu) -> %d (%p)", symbol ? symbol : "(null)",
          cudaVersion, (unsigned long long)flags, rc, pfn ? *pfn : NULL);
    unlock();
    return rc;
}

/* ---- control and observation (fake_cuda.h) ------------------------------------------ */

EXPORT void fake_cuda_counters(struct fake_cuda_counters *out)
{
    lock();
    g_counters.live_bytes = sum_live_bytes();
    g_counters.host_live_bytes = g_host_live_bytes;
    g_counters.vmm_reservations = g_res_count;
    g_counters.vmm_handles = g_handle_count;
    g_counters.vmm_mappings = g_map_count;
    if (out)
        *out = g_counters;
    unlock();
}

EXPORT void fake_cuda_reset_counters(void)
{
    lock();
    memset(&g_counters, 0, sizeof g_counters);
    g_counters.live_bytes = sum_live_bytes();
    g_counters.host_live_bytes = g_host_live_bytes;
    g_counters.vmm_reservations = g_res_count;
    g_counters.vmm_handles = g_handle_count;
    g_counters.vmm_mappings = g_map_count;
    unlock();
}

EXPORT void fake_cuda_set_total_bytes(size_t total)
{
    lock();
    g_total_bytes = total;
    unlock();
}

EXPORT void fake_cuda_set_event_latency(int queries)
{
    lock();
    g_event_latency = queries < 0 ? 0 : queries;
    unlock();
}

EXPORT void fake_cuda_fail_next_alloc(int code)
{
    lock();
    g_fail_next_alloc = code;
    unlock();
}

EXPORT void fake_cuda_fail_next_host_alloc(int code)
{
    lock();
    g_fail_next_host_alloc = code;
    unlock();
}

EXPORT int fake_cuda_host_flags(const void *ptr)
{
    lock();
    struct fake_alloc *a = find_alloc_containing((uintptr_t)ptr);
    int flags = a && a->kind == ALLOC_HOST ? (int)a->host_flags : -1;
    unlock();
    return flags;
}

EXPORT int fake_cuda_host_registered(const void *ptr)
{
    lock();
    int found = find_registration((uintptr_t)ptr, 1, NULL) != NULL;
    unlock();
    return found;
}

EXPORT void fake_cuda_fail_vmm(int fn, int nth, int count, int code)
{
    lock();
    if (fn >= 0 && fn < FAKE_VMM_FUNCTIONS) {
        g_vmm_fail[fn].nth = nth < 1 ? 1 : nth;
        g_vmm_fail[fn].count = count < 0 ? 0 : count;
        g_vmm_fail[fn].code = code;
    }
    unlock();
}

EXPORT void fake_cuda_set_vmm_supported(int supported)
{
    lock();
    g_vmm_supported = supported != 0;
    unlock();
}

EXPORT int fake_cuda_vmm_access(unsigned long long ptr, int device)
{
    lock();
    struct fake_mapping *m = find_mapping_containing((uintptr_t)ptr);
    int flags = !m ? -1 : (device < 0 || device >= FAKE_MAX_DEVICES) ? 0 : m->access[device];
    unlock();
    return flags;
}

EXPORT int fake_cuda_peer_access(int from, int to)
{
    lock();
    int on = from >= 0 && from < FAKE_MAX_DEVICES && to >= 0 && to < FAKE_MAX_DEVICES &&
             (g_peer[from] & (1u << to)) != 0;
    unlock();
    return on;
}

/* ---- exported names ------------------------------------------------------------------
 *
 * The implementations above are static and the exported names are aliases of them, so
 * calls inside this library and the addresses cuGetProcAddress returns always reach the
 * fake's own code, never a same-named symbol interposed by an LD_PRELOAD library (as
 * with the real driver, whose internal entry points cannot be interposed). */
#define EXPORT_ALIAS(name) EXPORT __typeof__(fk_##name) name __attribute__((alias("fk_" #name)))
EXPORT_ALIAS(cuInit);
EXPORT_ALIAS(cuDriverGetVersion);
EXPORT_ALIAS(cuDeviceGetCount);
EXPORT_ALIAS(cuDeviceGet);
EXPORT_ALIAS(cuDevicePrimaryCtxRetain);
EXPORT_ALIAS(cuDevicePrimaryCtxRelease_v2);
EXPORT_ALIAS(cuDevicePrimaryCtxRelease);
EXPORT_ALIAS(cuCtxGetCurrent);
EXPORT_ALIAS(cuCtxSetCurrent);
EXPORT_ALIAS(cuCtxPushCurrent_v2);
EXPORT_ALIAS(cuCtxPopCurrent_v2);
EXPORT_ALIAS(cuCtxGetDevice);
EXPORT_ALIAS(cuCtxSynchronize);
EXPORT_ALIAS(cuMemAlloc_v2);
EXPORT_ALIAS(cuMemAlloc);
EXPORT_ALIAS(cuMemFree_v2);
EXPORT_ALIAS(cuMemFree);
EXPORT_ALIAS(cuMemAllocManaged);
EXPORT_ALIAS(cuMemAllocAsync);
EXPORT_ALIAS(cuMemAllocAsync_ptsz);
EXPORT_ALIAS(cuMemFreeAsync);
EXPORT_ALIAS(cuMemFreeAsync_ptsz);
EXPORT_ALIAS(cuMemHostAlloc);
EXPORT_ALIAS(cuMemAllocHost_v2);
EXPORT_ALIAS(cuMemAllocHost);
EXPORT_ALIAS(cuMemFreeHost);
EXPORT_ALIAS(cuMemHostRegister_v2);
EXPORT_ALIAS(cuMemHostUnregister);
EXPORT_ALIAS(cuMemGetInfo_v2);
EXPORT_ALIAS(cuMemGetInfo);
EXPORT_ALIAS(cuMemGetAddressRange_v2);
EXPORT_ALIAS(cuMemGetAddressRange);
EXPORT_ALIAS(cuMemsetD8_v2);
EXPORT_ALIAS(cuMemcpyHtoD_v2);
EXPORT_ALIAS(cuMemcpyDtoH_v2);
EXPORT_ALIAS(cuPointerGetAttribute);
EXPORT_ALIAS(cuIpcGetMemHandle);
EXPORT_ALIAS(cuIpcOpenMemHandle);
EXPORT __typeof__(fk_cuIpcOpenMemHandle) cuIpcOpenMemHandle_v2 __attribute__((alias("fk_cuIpcOpenMemHandle")));
EXPORT_ALIAS(cuIpcCloseMemHandle);
EXPORT_ALIAS(cuStreamCreate);
EXPORT_ALIAS(cuStreamDestroy_v2);
EXPORT_ALIAS(cuStreamGetId);
EXPORT_ALIAS(cuStreamSynchronize);
EXPORT_ALIAS(cuStreamBeginCapture_v2);
EXPORT_ALIAS(cuStreamBeginCapture);
EXPORT_ALIAS(cuStreamEndCapture);
EXPORT_ALIAS(cuStreamIsCapturing);
EXPORT_ALIAS(cuEventCreate);
EXPORT_ALIAS(cuEventDestroy_v2);
EXPORT_ALIAS(cuEventDestroy);
EXPORT_ALIAS(cuEventRecord);
EXPORT_ALIAS(cuCtxRecordEvent);
EXPORT_ALIAS(cuEventQuery);
EXPORT_ALIAS(cuEventSynchronize);
EXPORT_ALIAS(cuStreamWaitEvent);
EXPORT_ALIAS(cuGetErrorName);
EXPORT_ALIAS(cuGetErrorString);
EXPORT_ALIAS(cuGetProcAddress);
EXPORT_ALIAS(cuGetProcAddress_v2);
EXPORT_ALIAS(cuDeviceGetAttribute);
EXPORT_ALIAS(cuCtxEnablePeerAccess);
EXPORT_ALIAS(cuCtxDisablePeerAccess);
EXPORT_ALIAS(cuMemGetAllocationGranularity);
EXPORT_ALIAS(cuMemAddressReserve);
EXPORT_ALIAS(cuMemAddressFree);
EXPORT_ALIAS(cuMemCreate);
EXPORT_ALIAS(cuMemRelease);
EXPORT_ALIAS(cuMemMap);
EXPORT_ALIAS(cuMemUnmap);
EXPORT_ALIAS(cuMemSetAccess);
EXPORT_ALIAS(cuMemExportToShareableHandle);
EXPORT_ALIAS(cuMemImportFromShareableHandle);
