//! Exports that name a device or look at the pool's layout: what the PyTorch hooks
//! ([`super::torch`]) and the Python package build on. Same three steps as every export
//! (see [`super`]): forward to the copy that owns the pool, run inside `guard`, check the
//! arguments and write out-parameters only on success.

use super::{
    device_ordinal, device_selection, guard, process_api, required, stream_handle, text_export,
    to_c_pointer, write_optional, write_range_of, CUstream_st,
};
use crate::runtime::{runtime, Runtime};
use crate::status::CupoolStatus::{self, *};
use core::ffi::{c_char, c_int, c_void};

/// Allocates `size` bytes in stream order on `stream` for device `device` (an ordinal, not
/// -1), as `cupool_alloc_async` does for the current device. When the calling thread's
/// current context is on `device` (the usual case: the CUDA runtime made it current) the
/// block comes from that context; otherwise from `device`'s primary context, and then a
/// default-stream handle (NULL, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`), which would
/// name a stream of another context, gives a block with no pending work that any stream
/// of `device` may use at once.
///
/// `ptr_out` must not be NULL and is written only on success. `size` 0:
/// `CUPOOL_ERROR_INVALID_VALUE`; a negative or too large `device`:
/// `CUPOOL_ERROR_INVALID_DEVICE`; no room after releasing idle cached memory:
/// `CUPOOL_ERROR_OUT_OF_MEMORY`. Free the block once, with `cupool_free_async` (on the
/// stream that last used it) or `cupool_free`.
///
/// # Safety
/// `ptr_out` is NULL or valid for writing one pointer; `stream` is NULL, a special handle
/// or a live stream of `device`.
#[no_mangle]
pub unsafe extern "C" fn cupool_alloc_async_device(
    ptr_out: *mut *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut CUstream_st,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.alloc_async_device)(ptr_out, size, device, stream);
    }
    guard(|| {
        let out = required(ptr_out)?;
        if size == 0 {
            return Err(CupoolErrorInvalidValue);
        }
        let block = runtime()?.alloc_async_on_device(
            size,
            device_ordinal(device)?,
            stream_handle(stream),
        )?;
        out.write(to_c_pointer(block)?);
        Ok(())
    })
}

/// Writes the free and total bytes of `device` (an ordinal), as the driver reports them
/// (`cuMemGetInfo` in `device`'s primary context; the host backend's simulated capacity),
/// to `*free_out` and `*total_out`. Either may be NULL. Memory cupool caches counts as
/// used here.
///
/// # Safety
/// `free_out` and `total_out` are NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_mem_get_info(
    device: c_int,
    free_out: *mut usize,
    total_out: *mut usize,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.mem_get_info)(device, free_out, total_out);
    }
    guard(|| {
        let (free, total) = runtime()?.memory_info(device_ordinal(device)?)?;
        write_optional(free_out, usize::try_from(free).unwrap_or(usize::MAX));
        write_optional(total_out, usize::try_from(total).unwrap_or(usize::MAX));
        Ok(())
    })
}

/// Writes the start and size of the segment (the driver allocation the pool carved it
/// from) that holds the live block containing `ptr` (interior pointers included) to
/// `*base_out` and `*size_out`; either may be NULL. A pointer in no live cupool block:
/// `CUPOOL_ERROR_INVALID_POINTER`.
///
/// # Safety
/// Any `ptr` value may be passed (it is looked up, never dereferenced); `base_out` and
/// `size_out` are NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_segment_of(
    ptr: *const c_void,
    base_out: *mut *mut c_void,
    size_out: *mut usize,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.segment_of)(ptr, base_out, size_out);
    }
    write_range_of(ptr, base_out, size_out, Runtime::segment_of)
}

/// Writes the pool's segments on `device` (-1: all devices) and the blocks that tile each
/// of them, as one JSON object and a NUL, into `buf`, which the caller owns:
/// `{"segments": [{"device", "address", "total_size", "allocated_size", "requested_size",
/// "stream", "segment_type" ("small"/"large"), "is_expandable", "blocks": [{"address",
/// "size", "requested_size", "state", "stream"}]}]}`, in address order, with the names of
/// PyTorch's memory snapshots. `state` is `"active_allocated"` for a block the program
/// holds and `"inactive"` for a free one (also one that waits for its fence); addresses
/// and streams are numbers. Each block is read consistently, the whole layout is not
/// (other threads keep allocating while it is read).
///
/// Buffer rules as for `cupool_stats_json`; since the layout can grow between two calls,
/// ask for the size, then pass a larger buffer and retry on
/// `CUPOOL_ERROR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `buf` is NULL or valid for `buf_len` bytes; `needed_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_segments_json(
    device: c_int,
    buf: *mut c_char,
    buf_len: usize,
    needed_out: *mut usize,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.segments_json)(device, buf, buf_len, needed_out);
    }
    text_export(buf, buf_len, needed_out, || {
        let segments = runtime()?.segments(device_selection(device)?)?;
        Ok(crate::runtime::segments_json(&segments))
    })
}

/// Writes where the reserved bytes of `device`'s pool (-1: every device's) are now and
/// where they were when they were highest since the last peak reset, as one JSON object and
/// a NUL, into `buf`, which the caller owns:
/// `{"devices": [{"device", "now": {..}, "at_peak": {..} or null, "vmm": {..}, "fences":
/// {..}}]}`. Each
/// footprint has `reserved_bytes`, the bytes of each place they can be (`in_use_bytes`,
/// `awaiting_fence_bytes`, `stream_only_bytes`, `arena_hole_ends_bytes`,
/// `arena_in_busy_chunks_bytes`, `arena_stealable_bytes`, `arena_idle_bytes`,
/// `segments_partly_free_bytes`, `segments_free_bytes`, `other_bytes`: in threads'
/// caches), which add up to `reserved_bytes`, and `segments_free` (a count). `at_peak` is
/// taken when a growth leaves the reserved bytes more than 1/64 above the last one taken
/// (so within 1.6% of the peak; its `reserved_bytes` says where), and is null until the
/// pool grows. The keys are those of `cupool replay`'s `at_peak`. `vmm` counts the VMM
/// arena's work so far (granules mapped and unmapped, the driver calls that took and the
/// time in them, `create_ns`, `map_ns`, `unmap_ns`, `release_ns`; all zero without an
/// arena), so the mapping work of a stretch of a run is the difference of two readings.
/// `fences` estimates the time in the driver calls that order reuse after frees
/// (`record_ns`, `query_ns`, `device_wait_ns`, from one call in eight of each kind timed
/// per thread, whose counts are `record_sampled`, `query_sampled`, `device_wait_sampled`).
///
/// Buffer rules as for `cupool_stats_json`.
///
/// # Safety
/// `buf` is NULL or valid for `buf_len` bytes; `needed_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_footprint_json(
    device: c_int,
    buf: *mut c_char,
    buf_len: usize,
    needed_out: *mut usize,
) -> CupoolStatus {
    if let Some(f) = process_api::other_copy().and_then(|api| api.footprint_json) {
        return f(device, buf, buf_len, needed_out);
    }
    text_export(buf, buf_len, needed_out, || {
        let all = runtime()?.footprints(device_selection(device)?)?;
        Ok(crate::runtime::footprints_json(&all))
    })
}

/// Makes the pool of `device` (an ordinal; -1: the calling thread's current context) take
/// from the driver now whatever it lacks to hold `bytes`, and keep that much from then on:
/// `cupool_empty_cache` and the other releases never go below it (the `reserve` option
/// does the same when a pool starts). `bytes` 0 ends the reserve (the next
/// `cupool_empty_cache` gives it back). Writes the bytes taken now to `*taken_out` (may be
/// NULL). Over the memory limit, or when the driver has not that much free:
/// `CUPOOL_ERROR_OUT_OF_MEMORY`, and the reserve stays what it was; during a stream
/// capture: `CUPOOL_ERROR_STREAM_CAPTURE`.
///
/// # Safety
/// `taken_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_reserve(
    device: c_int,
    bytes: usize,
    taken_out: *mut usize,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.reserve)(device, bytes, taken_out);
    }
    guard(|| {
        let device = device_selection(device)?;
        let taken = runtime()?.reserve(device, bytes as u64)?;
        write_optional(taken_out, usize::try_from(taken).unwrap_or(usize::MAX));
        Ok(())
    })
}
