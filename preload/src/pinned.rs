//! Pinned host memory hooks: `cuMemHostAlloc` and `cuMemAllocHost_v2` (what `cudaHostAlloc`
//! and `cudaMallocHost` become) are served from cupool's pinned pool, `cuMemFreeHost`
//! (`cudaFreeHost`) gives its blocks back; everything else is the driver's.
//!
//! Decided here:
//! - Flags: the pool's chunks are `PORTABLE | DEVICEMAP`, which gives every request made
//!   with flags 0, `PORTABLE`, `DEVICEMAP` or both what it asked for (or more). Any other
//!   flag (`WRITECOMBINED`: uncached memory that the host reads very slowly, a different
//!   kind of memory, and flags the driver may add later) goes to the driver unchanged, and
//!   so does its `cuMemFreeHost`: the pool does not own that pointer.
//! - Memory the program pins itself (`cuMemHostRegister`, `cudaHostRegister`) is never
//!   seen: those calls are not hooked.
//! - Ownership rule, as for device memory (`memory.rs`): a pointer the pool did not hand
//!   out goes to the real `cuMemFreeHost` and the driver's answer comes back; a second
//!   free, or an interior pointer, of pool memory gets the driver's answer for such a
//!   pointer (`CUDA_ERROR_INVALID_VALUE`) without reaching the driver, which would see the
//!   pool's chunk.
//! - No current context, a NULL out-pointer, size 0, the process exiting, or any pool
//!   failure but out-of-memory: the real call, so the driver's own result.

use crate::cuda::*;
use crate::guard::{cuda_call, enter_pool};
use crate::lifecycle;
use crate::real;
use crate::slots::sig;
use core::ffi::{c_uint, c_void};
use cupool::CupoolStatus;

/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`: the flags the pool's memory
/// has; a request with no other flag is the pool's.
const POOLED_FLAGS: c_uint = 0x01 | 0x02;

/// Result for a driver entry point libcuda does not have (or no libcuda at all).
const NO_DRIVER: CuResult = CUDA_ERROR_NOT_INITIALIZED;

/// `cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)`.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytesize: usize,
    flags: c_uint,
) -> CuResult {
    cuda_call("cuMemHostAlloc", || {
        let Some(real) = real::get::<sig::MemHostAlloc>() else {
            return NO_DRIVER;
        };
        // SAFETY: arguments forwarded as received.
        unsafe { host_alloc(pp, bytesize, flags, || real(pp, bytesize, flags)) }
    })
}

/// `cuMemAllocHost_v2(void **pp, size_t bytesize)`: `cuMemHostAlloc` with flags 0.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) -> CuResult {
    cuda_call("cuMemAllocHost_v2", || {
        let Some(real) = real::get::<sig::MemAllocHost>() else {
            return NO_DRIVER;
        };
        // SAFETY: arguments forwarded as received.
        unsafe { host_alloc(pp, bytesize, 0, || real(pp, bytesize)) }
    })
}

/// A block of the pinned pool for the request when the pool may serve it, else
/// `driver()`'s answer.
///
/// # Safety
/// `pp` is what the program passed: NULL or valid for a write.
unsafe fn host_alloc(
    pp: *mut *mut c_void,
    bytesize: usize,
    flags: c_uint,
    driver: impl FnOnce() -> CuResult,
) -> CuResult {
    if pp.is_null() || bytesize == 0 || flags & !POOLED_FLAGS != 0 || lifecycle::exiting() {
        return driver();
    }
    let Some(rt) = lifecycle::runtime() else {
        return driver();
    };
    match enter_pool(|| rt.host_alloc_if_context_current(bytesize)) {
        Some(Ok(Some(p))) => {
            // SAFETY: non-NULL out-pointer supplied by the caller.
            unsafe { *pp = p as usize as *mut c_void };
            CUDA_SUCCESS
        }
        // The pool already waited for pending frees, released idle chunks and retried.
        Some(Err(CupoolStatus::CupoolErrorOutOfMemory)) => CUDA_ERROR_OUT_OF_MEMORY,
        _ => driver(),
    }
}

/// `cuMemFreeHost(void *p)`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CuResult {
    cuda_call("cuMemFreeHost", || {
        let Some(real) = real::get::<sig::MemFreeHost>() else {
            return NO_DRIVER;
        };
        let ptr = p as usize as u64;
        let rt = match (ptr, lifecycle::runtime_if_started()) {
            // SAFETY: forwarded unchanged.
            (0, _) | (_, None) => return unsafe { real(p) },
            (_, Some(rt)) => rt,
        };
        match enter_pool(|| rt.host_free(ptr)) {
            Some(Ok(())) => CUDA_SUCCESS,
            // Pool memory, but no block start in use: what the driver answers a second
            // free or an interior pointer, without handing it our chunk.
            Some(Err(_)) if rt.host_memory_holds(ptr) => CUDA_ERROR_INVALID_VALUE,
            // Not ours (or re-entry from inside the pool): the driver's own answer.
            // SAFETY: forwarded unchanged.
            _ => unsafe { real(p) },
        }
    })
}

/// The range of the live pinned block containing `ptr` as the pointer range attributes
/// report it (the size asked for, or the rounded size in the rounding tail), if the pool
/// holds one.
pub(crate) fn pinned_block_range(ptr: u64) -> Option<(u64, u64)> {
    let block = lifecycle::runtime_if_started()?.host_block_containing(ptr)?;
    let requested_end = block.ptr.saturating_add(block.requested);
    Some(if ptr < requested_end {
        (block.ptr, block.requested)
    } else {
        (block.ptr, block.size)
    })
}
