//! Exports of the pinned host memory pool (`cupool_host_*`): page-locked memory from a
//! cache, for staging copies. Same three steps as every export (see [`super`]): forward to
//! the copy that owns the pool, run inside `guard`, check the arguments and write
//! out-parameters only on success.

use super::{
    guard, process_api, required, stream_handle, text_export, to_c_pointer, write_optional,
    CUstream_st,
};
use crate::backend::HostPtr;
use crate::runtime::{runtime, runtime_if_started};
use crate::stats::{CupoolHostStats, CUPOOL_HOST_STATS_VERSION};
use crate::status::CupoolStatus::{self, *};
use core::ffi::{c_char, c_void};

/// Allocates `size` bytes of page-locked (pinned) host memory from cupool's cache: memory
/// `cudaMemcpyAsync` copies from and to without staging, as from `cudaHostAlloc` with
/// `cudaHostAllocPortable | cudaHostAllocMapped`. It is usable from every device and
/// context, and page aligned. Nothing is pending on it: the host may write it at once.
///
/// Freed blocks are reused only once the work submitted before their free has completed
/// (a context fence in every context cupool knows), so an async copy still reading a freed
/// buffer is never overwritten by its next owner. A miss takes a chunk from the driver
/// (`cuMemHostAlloc`, 2 MiB, or the request rounded to 2 MiB above 1 MiB) in the calling
/// thread's current context (device 0's primary context when none is current).
///
/// `ptr_out` must not be NULL and is written only on success. `size` 0:
/// `CUPOOL_ERROR_INVALID_VALUE`; no page-locked memory left after waiting for pending
/// frees and releasing idle chunks: `CUPOOL_ERROR_OUT_OF_MEMORY`. Free the block once,
/// with `cupool_host_free` or `cupool_host_free_async` (not `cudaFreeHost`, except under
/// `libcupool_preload.so`, where `cudaFreeHost` reaches the same pool).
///
/// # Safety
/// `ptr_out` is NULL or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn cupool_host_alloc(ptr_out: *mut *mut c_void, size: usize) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.host_alloc)(ptr_out, size);
    }
    guard(|| {
        let out = required(ptr_out)?;
        if size == 0 {
            return Err(CupoolErrorInvalidValue);
        }
        let block = to_c_pointer(runtime()?.host_alloc(size)?)?;
        out.write(block);
        Ok(())
    })
}

/// Allocates `size` bytes of pinned host memory in stream order on `stream` (NULL: the
/// legacy default stream; it must belong to the calling thread's current context). The
/// block may be one freed with `cupool_host_free_async` on the same stream whose earlier
/// work (a copy still reading it) has not run yet: work submitted to `stream` from now on
/// may use it at once, but the host must not read or write it before that earlier work is
/// done (`cudaStreamSynchronize`, an event, or a host function enqueued on `stream`). Use
/// `cupool_host_alloc` for a buffer the host fills at once.
///
/// `ptr_out` must not be NULL and is written only on success; `size` 0:
/// `CUPOOL_ERROR_INVALID_VALUE`. Free the block once, with `cupool_host_free_async` or
/// `cupool_host_free`.
///
/// # Safety
/// `ptr_out` is NULL or valid for writing one pointer; `stream` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn cupool_host_alloc_async(
    ptr_out: *mut *mut c_void,
    size: usize,
    stream: *mut CUstream_st,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.host_alloc_async)(ptr_out, size, stream);
    }
    guard(|| {
        let out = required(ptr_out)?;
        if size == 0 {
            return Err(CupoolErrorInvalidValue);
        }
        let block = runtime()?.host_alloc_async(size, stream_handle(stream))?;
        out.write(to_c_pointer(block)?);
        Ok(())
    })
}

/// Frees a block from `cupool_host_alloc` or `cupool_host_alloc_async` without naming a
/// stream. Unlike `cudaFreeHost` this does not wait for the device: the block is reused
/// only once a fence recorded after this call has completed in every context, so copies
/// already enqueued from or to it finish first. The program must not touch the block
/// after this call.
///
/// `ptr` NULL returns `CUPOOL_OK` and does nothing. A pointer the pinned pool did not hand
/// out (an interior pointer, memory from `cudaHostAlloc` or `cudaHostRegister` outside the
/// preload, a device block) returns `CUPOOL_ERROR_INVALID_POINTER`, a block already freed
/// `CUPOOL_ERROR_DOUBLE_FREE`; either way nothing changes.
///
/// # Safety
/// Any pointer value may be passed; it is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cupool_host_free(ptr: *mut c_void) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.host_free)(ptr);
    }
    guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        let rt = runtime_if_started().ok_or(CupoolErrorInvalidPointer)?;
        rt.host_free(ptr as usize as HostPtr)
    })
}

/// Frees a pinned block in stream order on `stream` (NULL: the legacy default stream; it
/// must belong to the calling thread's current context): work submitted to `stream`
/// before this call may still use it. The block may be reused at once by
/// `cupool_host_alloc_async` on the same stream, and by other streams and
/// `cupool_host_alloc` once that work has completed. A block allocated on another stream
/// is treated as freed without a stream. NULL and bad pointers as for `cupool_host_free`.
///
/// # Safety
/// Any pointer value may be passed for `ptr`; `stream` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn cupool_host_free_async(
    ptr: *mut c_void,
    stream: *mut CUstream_st,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.host_free_async)(ptr, stream);
    }
    guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        let rt = runtime_if_started().ok_or(CupoolErrorInvalidPointer)?;
        rt.host_free_async(ptr as usize as HostPtr, stream_handle(stream))
    })
}

/// Fills `*stats` with the statistics of the pinned host memory pool (all zero before its
/// first allocation).
///
/// The caller owns `stats` and sets `stats->size = sizeof(cupool_host_stats)` and
/// `stats->version = CUPOOL_HOST_STATS_VERSION` first. `size` below 8, `version` 0 or newer
/// than this library's return `CUPOOL_ERROR_VERSION_MISMATCH`. At most `size` bytes are
/// written; on success `size` and `version` are set to what this library wrote. `stats`
/// must not be NULL.
///
/// # Safety
/// `stats` is NULL or points to at least `stats->size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cupool_host_get_stats(stats: *mut CupoolHostStats) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.host_get_stats)(stats);
    }
    guard(|| {
        let out = required(stats)?;
        let header = out.cast::<u32>();
        let caller_size = header.read();
        let caller_version = header.add(1).read();
        if caller_size < 8 || caller_version == 0 || caller_version > CUPOOL_HOST_STATS_VERSION {
            return Err(CupoolErrorVersionMismatch);
        }
        let mut figures = runtime()?.host_stats();
        let written = (caller_size as usize).min(core::mem::size_of::<CupoolHostStats>());
        // `written` fits in u32: it is at most `caller_size`.
        figures.size = written as u32;
        figures.version = caller_version;
        core::ptr::copy_nonoverlapping(
            (&figures as *const CupoolHostStats).cast::<u8>(),
            out.as_ptr().cast::<u8>(),
            written,
        );
        Ok(())
    })
}

/// Writes the pinned pool's statistics as one JSON object and a NUL into `buf` (one key
/// per field of `cupool_host_stats`). Buffer rules as for `cupool_stats_json`:
/// `CUPOOL_ERROR_BUFFER_TOO_SMALL` with the needed size in `*needed_out`; `buf` NULL with
/// `buf_len` 0 asks for the size; `needed_out` may be NULL.
///
/// # Safety
/// `buf` is NULL or valid for `buf_len` bytes; `needed_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_host_stats_json(
    buf: *mut c_char,
    buf_len: usize,
    needed_out: *mut usize,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.host_stats_json)(buf, buf_len, needed_out);
    }
    text_export(buf, buf_len, needed_out, || {
        Ok(runtime()?.host_stats().to_json())
    })
}

/// Sets every peak of the pinned pool's statistics to its current value.
#[no_mangle]
pub extern "C" fn cupool_host_reset_peak_stats() -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        // SAFETY: the table holds this same function of the copy that owns the pool.
        return unsafe { (api.host_reset_peak_stats)() };
    }
    guard(|| {
        runtime()?.host_reset_peak_stats();
        Ok(())
    })
}

/// Gives the pinned pool's idle chunks back to the driver (`cuMemFreeHost`), after waiting
/// for the fences of blocks freed moments ago. Blocks in use keep their chunk. Device
/// memory is not touched (that is `cupool_empty_cache`), nor is pinned memory by
/// `cupool_empty_cache`.
///
/// `*released_out` receives the bytes released; `released_out` may be NULL.
///
/// # Safety
/// `released_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_host_empty_cache(released_out: *mut usize) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.host_empty_cache)(released_out);
    }
    guard(|| {
        let released = runtime()?.host_empty_cache()?;
        write_optional(
            released_out,
            usize::try_from(released).unwrap_or(usize::MAX),
        );
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_arguments_are_refused_before_any_work() {
        unsafe {
            assert_eq!(
                cupool_host_alloc(core::ptr::null_mut(), 16),
                CupoolErrorInvalidValue
            );
            assert_eq!(
                cupool_host_alloc_async(core::ptr::null_mut(), 16, core::ptr::null_mut()),
                CupoolErrorInvalidValue
            );
            let mut p = core::ptr::null_mut();
            assert_eq!(cupool_host_alloc(&mut p, 0), CupoolErrorInvalidValue);
            assert!(p.is_null(), "out-pointer written on failure");
            assert_eq!(cupool_host_free(core::ptr::null_mut()), CupoolOk);
            assert_eq!(
                cupool_host_free_async(core::ptr::null_mut(), core::ptr::null_mut()),
                CupoolOk
            );
            assert_eq!(
                cupool_host_get_stats(core::ptr::null_mut()),
                CupoolErrorInvalidValue
            );
            let mut s = CupoolHostStats::new();
            s.version = CUPOOL_HOST_STATS_VERSION + 1;
            assert_eq!(cupool_host_get_stats(&mut s), CupoolErrorVersionMismatch);
            s.version = CUPOOL_HOST_STATS_VERSION;
            s.size = 4;
            assert_eq!(cupool_host_get_stats(&mut s), CupoolErrorVersionMismatch);
        }
    }
}
