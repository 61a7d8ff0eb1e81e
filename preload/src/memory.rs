//! Device-memory hooks: `cuMemAlloc_v2` and `cuMemFree_v2` go through the pool; the
//! queries whose answer sub-allocation would change (`cuMemGetInfo_v2`,
//! `cuMemGetAddressRange_v2`, `cuPointerGetAttribute(s)`; IPC is in `ipc.rs`) are answered
//! as `docs/semantics.md` decides; `cuMemFreeAsync` routes pool blocks back to the pool.
//!
//! Ownership rule: a pointer the pool did not hand out goes to the real function unchanged
//! and the driver's own result comes back (managed, pitch, VMM, graph-owned, external,
//! NULL, and pointers allocated before the pool started).

use crate::cuda::*;
use crate::guard::{cuda_call, enter_pool};
use crate::lifecycle;
use crate::real;
use crate::slots::{sig, MemFreeAsyncFn, RealFn};
use core::ffi::{c_int, c_uint, c_void};
use cupool::backend::ContextId;
use cupool::runtime::{BlockInfo, Runtime};
use cupool::CupoolStatus;

/// Result for a driver entry point libcuda does not have (or no libcuda at all).
const NO_DRIVER: CuResult = CUDA_ERROR_NOT_INITIALIZED;

/// The pool block containing `ptr`, if the pool is running and owns it.
pub(crate) fn pool_block_containing(ptr: CuDevicePtr) -> Option<BlockInfo> {
    if ptr == 0 {
        return None;
    }
    lifecycle::runtime_if_started()?.lookup_containing(ptr)
}

// ---- cuMemAlloc_v2 -------------------------------------------------------------------

/// `cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CuDevicePtr, bytesize: usize) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuMemAlloc_v2", || unsafe { mem_alloc(dptr, bytesize) })
}

unsafe fn mem_alloc(dptr: *mut CuDevicePtr, bytesize: usize) -> CuResult {
    // SAFETY: the slot's exported function has this signature.
    let Some(real) = real::get::<sig::MemAlloc>() else {
        return NO_DRIVER;
    };
    // NULL out-pointer and size 0 are the driver's to reject; after exit started the
    // program's own calls go to the driver as they would without cupool.
    if dptr.is_null() || bytesize == 0 || lifecycle::exiting() {
        // SAFETY: forwarded unchanged.
        return unsafe { real(dptr, bytesize) };
    }
    let Some(rt) = lifecycle::runtime() else {
        // SAFETY: forwarded unchanged.
        return unsafe { real(dptr, bytesize) };
    };
    // No current context (or driver not initialised): `Ok(None)`, and the driver answers;
    // the pool never makes a context current on the program's behalf.
    match enter_pool(|| rt.alloc_if_context_current(bytesize)) {
        Some(Ok(Some(ptr))) => {
            // SAFETY: non-NULL out-pointer supplied by the caller.
            unsafe { *dptr = ptr };
            CUDA_SUCCESS
        }
        // The pool already waited for pending frees, released idle memory and retried.
        Some(Err(CupoolStatus::CupoolErrorOutOfMemory)) => CUDA_ERROR_OUT_OF_MEMORY,
        // A miss during a capture, any other pool failure, or re-entry: the driver's own
        // call, so its own result (900 under a global-mode capture, ...) reaches the program.
        // SAFETY: forwarded unchanged.
        _ => unsafe { real(dptr, bytesize) },
    }
}

// ---- cuMemFree_v2 --------------------------------------------------------------------

/// `cuMemFree_v2(CUdeviceptr dptr)`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CuDevicePtr) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuMemFree_v2", || unsafe { mem_free(dptr) })
}

unsafe fn mem_free(dptr: CuDevicePtr) -> CuResult {
    // SAFETY: the slot's exported function has this signature.
    let Some(real) = real::get::<sig::MemFree>() else {
        return NO_DRIVER;
    };
    // `cudaFree(0)` arrives as `cuMemFree_v2(0)`: the driver's to answer.
    let rt = match (dptr, lifecycle::runtime_if_started()) {
        (0, _) | (_, None) => return unsafe { real(dptr) },
        (_, Some(rt)) => rt,
    };
    match enter_pool(|| rt.free(dptr)) {
        Some(Ok(())) => CUDA_SUCCESS,
        Some(Err(status)) => free_failed(rt, dptr, status, || {
            // SAFETY: forwarded unchanged.
            unsafe { real(dptr) }
        }),
        // SAFETY: re-entry from inside the pool: forwarded unchanged.
        None => unsafe { real(dptr) },
    }
}

/// What a failed pool free returns. Only a pointer outside every pool block may reach the
/// driver: handing it a pool address could free a whole segment under live blocks.
fn free_failed(
    rt: &Runtime,
    dptr: CuDevicePtr,
    status: CupoolStatus,
    driver: impl FnOnce() -> CuResult,
) -> CuResult {
    match status {
        // Freed twice: the driver answers a second free of its own allocation this way.
        CupoolStatus::CupoolErrorDoubleFree => CUDA_ERROR_INVALID_VALUE,
        // Inside a live pool block but not its start: the driver's answer for an interior
        // pointer, without involving the driver (it would see our segment).
        _ if rt.lookup_containing(dptr).is_some() => {
            if status != CupoolStatus::CupoolErrorInvalidPointer {
                cupool::log::warn(&format!(
                    "cupool: free of pool block {dptr:#x} failed: {}",
                    status.as_str()
                ));
            }
            CUDA_ERROR_INVALID_VALUE
        }
        // Not ours: the driver's own answer.
        _ => driver(),
    }
}

// ---- cuMemFreeAsync ------------------------------------------------------------------

/// `cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CuDevicePtr, stream: CuHandle) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuMemFreeAsync", || unsafe {
        mem_free_async::<sig::MemFreeAsync>(dptr, stream, stream as usize)
    })
}

/// `cuMemFreeAsync_ptsz`: stream 0 is the calling thread's per-thread default stream.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: CuDevicePtr, stream: CuHandle) -> CuResult {
    let pool_stream = if stream.is_null() {
        CU_STREAM_PER_THREAD
    } else {
        stream as usize
    };
    // SAFETY: arguments forwarded as received.
    cuda_call("cuMemFreeAsync_ptsz", || unsafe {
        mem_free_async::<sig::MemFreeAsyncPtsz>(dptr, stream, pool_stream)
    })
}

/// A pool block freed stream-ordered goes back to the pool on that stream (reusable there
/// at once, elsewhere after the stream's work); anything else is the driver's.
unsafe fn mem_free_async<S: RealFn<Fn = MemFreeAsyncFn>>(
    dptr: CuDevicePtr,
    stream: CuHandle,
    pool_stream: usize,
) -> CuResult {
    let Some(real) = real::get::<S>() else {
        return NO_DRIVER;
    };
    let Some(rt) = lifecycle::runtime_if_started() else {
        // SAFETY: forwarded unchanged.
        return unsafe { real(dptr, stream) };
    };
    if dptr == 0 || rt.lookup_containing(dptr).is_none() {
        // SAFETY: forwarded unchanged.
        return unsafe { real(dptr, stream) };
    }
    match enter_pool(|| rt.free_async(dptr, pool_stream)) {
        Some(Ok(())) => CUDA_SUCCESS,
        Some(Err(status)) => free_failed(rt, dptr, status, || unsafe { real(dptr, stream) }),
        // SAFETY: re-entry: forwarded unchanged.
        None => unsafe { real(dptr, stream) },
    }
}

// ---- cuMemGetInfo_v2 -----------------------------------------------------------------

/// `cuMemGetInfo_v2(size_t *free, size_t *total)`: the driver's figures, with memory the
/// pool caches but no block uses counted as free (docs/semantics.md).
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuMemGetInfo_v2", || unsafe { mem_get_info(free, total) })
}

unsafe fn mem_get_info(free: *mut usize, total: *mut usize) -> CuResult {
    // SAFETY: the slot's exported function has this signature.
    let Some(real) = real::get::<sig::MemGetInfo>() else {
        return NO_DRIVER;
    };
    // The driver validates both pointers (NULL included) and writes them on success.
    // SAFETY: forwarded unchanged.
    let rc = unsafe { real(free, total) };
    if rc != CUDA_SUCCESS || free.is_null() {
        return rc;
    }
    let (Some(rt), Some(ctx)) = (lifecycle::runtime_if_started(), real::current_context()) else {
        return rc;
    };
    let idle = rt.idle_cached_bytes(ContextId(ctx));
    // SAFETY: the driver just wrote both non-NULL pointers.
    unsafe {
        let mut reported = (*free as u64).saturating_add(idle);
        if !total.is_null() {
            reported = reported.min(*total as u64);
        }
        *free = usize::try_from(reported).unwrap_or(usize::MAX);
    }
    rc
}

// ---- cuMemGetAddressRange_v2 ---------------------------------------------------------

/// `cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)`: for a
/// pointer inside a pool block, the block's own range (not the segment's).
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    pbase: *mut CuDevicePtr,
    psize: *mut usize,
    dptr: CuDevicePtr,
) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuMemGetAddressRange_v2", || unsafe {
        mem_get_address_range(pbase, psize, dptr)
    })
}

unsafe fn mem_get_address_range(
    pbase: *mut CuDevicePtr,
    psize: *mut usize,
    dptr: CuDevicePtr,
) -> CuResult {
    // SAFETY: the slot's exported function has this signature.
    let Some(real) = real::get::<sig::MemGetAddressRange>() else {
        return NO_DRIVER;
    };
    let Some(block) = pool_block_containing(dptr) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real(pbase, psize, dptr) };
    };
    // Ask the driver too, so its checks (context, initialisation) still apply; its answer
    // (our segment) is replaced by the block.
    let (mut base, mut size) = (0, 0);
    // SAFETY: valid local out-pointers.
    let rc = unsafe { real(&mut base, &mut size, dptr) };
    if rc != CUDA_SUCCESS {
        return rc;
    }
    let (base, size) = block_range(&block, dptr);
    // SAFETY: each out-pointer is optional, as in the driver.
    unsafe {
        if !pbase.is_null() {
            *pbase = base;
        }
        if !psize.is_null() {
            *psize = usize::try_from(size).unwrap_or(usize::MAX);
        }
    }
    CUDA_SUCCESS
}

/// The range reported for `dptr` inside `block`: the size the program asked for, as the
/// driver reports for its own allocations, unless `dptr` lies in the rounding tail, where
/// the rounded size keeps `dptr` inside the range.
pub fn block_range(block: &BlockInfo, dptr: CuDevicePtr) -> (CuDevicePtr, u64) {
    let requested_end = block.ptr.saturating_add(block.requested);
    if block.requested > 0 && dptr < requested_end {
        (block.ptr, block.requested)
    } else {
        (block.ptr, block.size)
    }
}

// ---- cuPointerGetAttribute(s) --------------------------------------------------------

/// `cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)`:
/// the driver's answer, with the range attributes of a pool block made the block's own.
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: CuDevicePtr,
) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuPointerGetAttribute", || unsafe {
        let Some(real) = real::get::<sig::PointerGetAttribute>() else {
            return NO_DRIVER;
        };
        let rc = real(data, attribute, ptr);
        if rc == CUDA_SUCCESS {
            rewrite_range_attribute(attribute, data, ptr);
        }
        rc
    })
}

/// `cuPointerGetAttributes(unsigned numAttributes, CUpointer_attribute *attributes,
/// void **data, CUdeviceptr ptr)`: as [`cuPointerGetAttribute`], for each attribute.
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttributes(
    count: c_uint,
    attributes: *mut c_int,
    data: *mut *mut c_void,
    ptr: CuDevicePtr,
) -> CuResult {
    // SAFETY: arguments forwarded as received; the arrays are read only after the driver
    // accepted them.
    cuda_call("cuPointerGetAttributes", || unsafe {
        let Some(real) = real::get::<sig::PointerGetAttributes>() else {
            return NO_DRIVER;
        };
        let rc = real(count, attributes, data, ptr);
        if rc == CUDA_SUCCESS && !attributes.is_null() && !data.is_null() {
            for i in 0..count as usize {
                rewrite_range_attribute(*attributes.add(i), *data.add(i), ptr);
            }
        }
        rc
    })
}

/// Replaces the driver's segment range with the pool block's range.
///
/// # Safety
/// `data` is NULL or the out-pointer the driver just filled for `attribute`.
unsafe fn rewrite_range_attribute(attribute: c_int, data: *mut c_void, ptr: CuDevicePtr) {
    if data.is_null()
        || (attribute != CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
            && attribute != CU_POINTER_ATTRIBUTE_RANGE_SIZE)
    {
        return;
    }
    // A device block's range, or a pinned block's (its chunk is the driver's range).
    let range = pool_block_containing(ptr)
        .map(|block| block_range(&block, ptr))
        .or_else(|| crate::pinned::pinned_block_range(ptr));
    let Some((base, size)) = range else {
        return;
    };
    // SAFETY: RANGE_START_ADDR is a CUdeviceptr and RANGE_SIZE a size_t: both 8 bytes,
    // written by the driver through this same pointer.
    unsafe {
        if attribute == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR {
            data.cast::<CuDevicePtr>().write_unaligned(base);
        } else {
            data.cast::<usize>()
                .write_unaligned(usize::try_from(size).unwrap_or(usize::MAX));
        }
    }
}
