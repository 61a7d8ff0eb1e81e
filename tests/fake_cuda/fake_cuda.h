/*
 * Control and observation API of the fake libcuda test double (fake_libcuda.c).
 *
 * TEST DOUBLE: the library built from fake_libcuda.c is NOT CUDA. It mimics a small part
 * of the CUDA driver API over host memory so cupool's backend and LD_PRELOAD interposer can
 * be tested on machines with no GPU. The functions below exist only in the fake.
 */
#ifndef FAKE_CUDA_H
#define FAKE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Counts since load (or the last fake_cuda_reset_counters), except live_bytes which is
 * the current total of live device allocations (cuMemAlloc_v2, cuMemAllocAsync*,
 * cuMemAllocManaged) over all fake devices. Fields are only ever appended. */
struct fake_cuda_counters {
    uint64_t mem_alloc;        /* successful device allocations (sync, async, managed) */
    uint64_t mem_free;         /* successful frees of a non-NULL pointer (sync, async) */
    uint64_t mem_free_errors;  /* frees that failed (unknown or interior pointer, capture) */
    uint64_t event_record;     /* successful cuEventRecord */
    uint64_t ctx_record_event; /* successful cuCtxRecordEvent */
    uint64_t event_query;      /* cuEventQuery calls, whatever their result */
    uint64_t event_sync;       /* cuEventSynchronize calls */
    uint64_t gpa_queries;      /* cuGetProcAddress and cuGetProcAddress_v2 calls */
    uint64_t live_bytes;       /* bytes of live device allocations (not reset) */
    uint64_t mem_alloc_errors; /* device allocations that failed (OOM, injected, capture) */
    uint64_t ctx_record_event_errors; /* cuCtxRecordEvent refused (capture) */
    uint64_t stream_sync;      /* cuStreamSynchronize calls */
    uint64_t ctx_sync;         /* cuCtxSynchronize calls */
    /* Virtual memory management (cuMemAddressReserve, cuMemCreate, cuMemMap, ...). The
     * first three are what is alive now (not reset); the rest count calls. */
    uint64_t vmm_reservations; /* address ranges reserved and not freed */
    uint64_t vmm_handles;      /* physical allocations created and not released */
    uint64_t vmm_mappings;     /* mappings made and not unmapped */
    uint64_t vmm_creates;      /* successful cuMemCreate */
    uint64_t vmm_releases;     /* successful cuMemRelease */
    uint64_t vmm_maps;         /* successful cuMemMap */
    uint64_t vmm_unmaps;       /* successful cuMemUnmap */
    uint64_t vmm_set_access;   /* successful cuMemSetAccess */
    uint64_t vmm_errors;       /* VMM calls that failed (checks or injected) */
    uint64_t vmm_exports;      /* successful cuMemExportToShareableHandle */
    uint64_t vmm_imports;      /* successful cuMemImportFromShareableHandle */
    /* Page-locked host memory. host_live_bytes is what is alive now (not reset). */
    uint64_t host_alloc;       /* successful cuMemHostAlloc / cuMemAllocHost(_v2) */
    uint64_t host_free;        /* successful cuMemFreeHost */
    uint64_t host_free_errors; /* cuMemFreeHost refused (not the base of a host allocation) */
    uint64_t host_live_bytes;  /* bytes of live host allocations */
    uint64_t host_register;    /* successful cuMemHostRegister_v2 */
    uint64_t host_unregister;  /* successful cuMemHostUnregister */
    /* Stream waits for events. */
    uint64_t stream_wait_event;        /* successful cuStreamWaitEvent */
    uint64_t stream_wait_event_legacy; /* of them, on CU_STREAM_LEGACY */
};

/* Copies the counters to *out (out may not be NULL). */
void fake_cuda_counters(struct fake_cuda_counters *out);
/* Zeroes every counter except live_bytes. */
void fake_cuda_reset_counters(void);
/* Sets the per-device memory budget (FAKE_CUDA_TOTAL_BYTES at load; default 1 GiB). */
void fake_cuda_set_total_bytes(size_t total);
/* Sets how many cuEventQuery calls report CUDA_ERROR_NOT_READY for each event recorded
 * from now on (FAKE_CUDA_EVENT_LATENCY at load; default 0). */
void fake_cuda_set_event_latency(int queries);
/* Makes the next device allocation fail with `code` (a CUresult) without allocating;
 * 0 cancels a pending injection. */
void fake_cuda_fail_next_alloc(int code);

/* Makes the next cuMemHostAlloc / cuMemAllocHost fail with `code` without allocating; 0
 * cancels a pending injection. */
void fake_cuda_fail_next_host_alloc(int code);
/* The cuMemHostAlloc flags of the host allocation containing `ptr`, or -1 when none does
 * (memory of the fake's own, not registered memory). */
int fake_cuda_host_flags(const void *ptr);
/* Whether `ptr` lies in memory registered with cuMemHostRegister. */
int fake_cuda_host_registered(const void *ptr);

/* VMM functions for fault injection (fake_cuda_fail_vmm). */
enum fake_cuda_vmm_fn {
    FAKE_VMM_GRANULARITY = 0, /* cuMemGetAllocationGranularity */
    FAKE_VMM_RESERVE = 1,     /* cuMemAddressReserve */
    FAKE_VMM_ADDRESS_FREE = 2, /* cuMemAddressFree */
    FAKE_VMM_CREATE = 3,      /* cuMemCreate */
    FAKE_VMM_RELEASE = 4,     /* cuMemRelease */
    FAKE_VMM_MAP = 5,         /* cuMemMap */
    FAKE_VMM_SET_ACCESS = 6,  /* cuMemSetAccess */
    FAKE_VMM_UNMAP = 7,       /* cuMemUnmap */
    FAKE_VMM_FUNCTIONS = 8
};
/* Makes calls of `fn` fail with `code` (a CUresult), doing nothing: the `nth` call from
 * now (1: the next) and the `count - 1` calls after it. count 0 cancels. */
void fake_cuda_fail_vmm(int fn, int nth, int count, int code);
/* 0: devices report CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0 and every
 * VMM call fails with CUDA_ERROR_NOT_SUPPORTED; 1 (default; FAKE_CUDA_VMM at load). */
void fake_cuda_set_vmm_supported(int supported);
/* The CUmemAccess_flags that `device` has on the mapping containing `ptr` (0 none, 1 read,
 * 3 read/write), or -1 when no mapping contains `ptr`. */
int fake_cuda_vmm_access(unsigned long long ptr, int device);
/* Whether `from`'s primary context has peer access to `to`'s (cuCtxEnablePeerAccess). */
int fake_cuda_peer_access(int from, int to);

#ifdef __cplusplus
}
#endif

#endif /* FAKE_CUDA_H */
