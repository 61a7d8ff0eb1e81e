//! The C boundary: every function of `include/cupool.h`.
//!
//! Each export is a plain `extern "C"` fn with the same three steps:
//! 1. if another copy of this library owns the process's pool, forward the call to it
//!    ([`process_api`]; one atomic load when it does not);
//! 2. otherwise run the body inside [`guard`], which turns a panic into
//!    `CUPOOL_ERROR_INTERNAL` so no unwind crosses into C;
//! 3. the body checks its arguments (NULL, 0, negative device), calls [`crate::runtime`] or
//!    [`crate::config`], and writes out-parameters only once everything has succeeded.
//!
//! The doc comments on the exports become the comments of the generated header, so they
//! state ownership and NULL rules for the C reader.

mod boundary;
pub mod capture;
pub mod cupy;
pub mod cupy_objects;
pub mod device;
pub mod ipc;
pub mod pinned;
pub mod process_api;
pub mod torch;

use crate::backend::DevicePtr;
use crate::runtime::{runtime, runtime_if_started};
use crate::stats::{CupoolStats, CUPOOL_STATS_VERSION};
use crate::status::CupoolStatus;
use core::ffi::{c_char, c_int, c_void, CStr};
use core::sync::atomic::{AtomicBool, Ordering};

use boundary::{
    c_text, copy_text_out, device_ordinal, device_selection, guard, required, stream_handle,
    text_export, to_c_pointer, write_optional, write_range_of,
};
use CupoolStatus::*;

/// A CUDA stream, as `cuda.h` declares it (`typedef struct CUstream_st *CUstream`). Only its
/// address is used; cupool never includes a CUDA header, so a CUDA program passes its
/// `CUstream`/`cudaStream_t` without a cast.
#[allow(non_camel_case_types)]
pub struct CUstream_st {
    _opaque: [u8; 0],
}

/// A status as an integer, for `cupool_status_string`, which must accept values that are
/// no `CupoolStatus` variant (an out-of-range Rust enum value would be undefined behaviour).
/// The header shows it as `cupool_status`.
pub type CupoolStatusCode = c_int;

/// Allocates `size` bytes of device memory on the calling thread's current device
/// (context). The block is safe to use from any stream at once: no work is pending on it.
///
/// On success `*ptr_out` receives the block; free it once, with `cupool_free` or
/// `cupool_free_async`. `ptr_out` must not be NULL. On failure `*ptr_out` is not written.
///
/// A `size` of 0 returns `CUPOOL_ERROR_INVALID_VALUE` (unlike `malloc(0)`, no unique pointer
/// is handed out). Other errors: `CUPOOL_ERROR_OUT_OF_MEMORY` (also for a size no device
/// can hold, as `cudaMalloc` reports it), `CUPOOL_ERROR_BACKEND_UNAVAILABLE` (no CUDA driver
/// or device).
///
/// # Safety
/// `ptr_out` is NULL or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn cupool_alloc(ptr_out: *mut *mut c_void, size: usize) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.alloc)(ptr_out, size);
    }
    guard(|| {
        let out = required(ptr_out)?;
        if size == 0 {
            return Err(CupoolErrorInvalidValue);
        }
        let block = to_c_pointer(runtime()?.alloc(size)?)?;
        out.write(block);
        Ok(())
    })
}

/// Allocates `size` bytes in stream order on `stream`: the block may be used by work
/// submitted to `stream` from now on; other streams must order themselves after `stream`
/// (as with `cudaMallocAsync`). `stream` NULL is the legacy default stream. `stream` must
/// belong to the calling thread's current context.
///
/// `ptr_out` must not be NULL and is written only on success. `size` 0 returns
/// `CUPOOL_ERROR_INVALID_VALUE`. Free the block once, preferably with
/// `cupool_free_async` on the stream that last used it.
///
/// # Safety
/// `ptr_out` is NULL or valid for writing one pointer; `stream` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn cupool_alloc_async(
    ptr_out: *mut *mut c_void,
    size: usize,
    stream: *mut CUstream_st,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.alloc_async)(ptr_out, size, stream);
    }
    guard(|| {
        let out = required(ptr_out)?;
        if size == 0 {
            return Err(CupoolErrorInvalidValue);
        }
        let block = to_c_pointer(runtime()?.alloc_async(size, stream_handle(stream))?)?;
        out.write(block);
        Ok(())
    })
}

/// Frees a block from `cupool_alloc` or `cupool_alloc_async` without naming a stream.
/// Unlike `cudaFree` this does not wait for the device: the block is reused only after a
/// context fence shows that all work submitted before this call has completed.
///
/// `ptr` NULL returns `CUPOOL_OK` and does nothing (like `free` and `cudaFree`). A pointer
/// cupool did not hand out (or an interior pointer) returns
/// `CUPOOL_ERROR_INVALID_POINTER`; a block already freed returns
/// `CUPOOL_ERROR_DOUBLE_FREE`. After a successful call the block belongs to cupool again.
///
/// # Safety
/// Any pointer value may be passed; it is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cupool_free(ptr: *mut c_void) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.free)(ptr);
    }
    guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        // A pool that never started handed nothing out: no need to start it for a free.
        let rt = runtime_if_started().ok_or(CupoolErrorInvalidPointer)?;
        rt.free(ptr as usize as DevicePtr)
    })
}

/// Frees a block in stream order on `stream` (NULL: the legacy default stream): the block
/// may be reused by `stream` at once and by other streams once the work submitted to
/// `stream` before this call has completed (as with `cudaFreeAsync`). Freeing on another
/// stream than the allocation's is allowed.
///
/// `ptr` NULL returns `CUPOOL_OK`. Foreign or interior pointers return
/// `CUPOOL_ERROR_INVALID_POINTER`, a block already freed `CUPOOL_ERROR_DOUBLE_FREE`.
///
/// # Safety
/// Any pointer value may be passed for `ptr`; `stream` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn cupool_free_async(
    ptr: *mut c_void,
    stream: *mut CUstream_st,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.free_async)(ptr, stream);
    }
    guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        let rt = runtime_if_started().ok_or(CupoolErrorInvalidPointer)?;
        rt.free_async(ptr as usize as DevicePtr, stream_handle(stream))
    })
}

/// Frees a block in the order it was allocated in: in stream order on the stream it was
/// allocated on (as `cupool_free_async` with that stream), or as `cupool_free` when it was
/// allocated without a stream. For callers that do not keep each block's stream (CuPy's
/// C-function allocator frees with the pointer only).
///
/// `ptr` NULL returns `CUPOOL_OK`. Foreign or interior pointers return
/// `CUPOOL_ERROR_INVALID_POINTER`, a block already freed `CUPOOL_ERROR_DOUBLE_FREE`.
///
/// # Safety
/// Any pointer value may be passed for `ptr`; the allocation's stream, if any, is live.
#[no_mangle]
pub unsafe extern "C" fn cupool_free_in_allocation_order(ptr: *mut c_void) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        // A field past an older copy's `size` is not there to read.
        let entry = (api.size >= process_api::SIZE_WITH_FREE_IN_ORDER)
            .then_some(api.free_in_allocation_order)
            .flatten();
        return match entry {
            Some(f) => f(ptr),
            // An older copy owns the pool: without its stream, a free every copy can make.
            None => (api.free)(ptr),
        };
    }
    guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        let rt = runtime_if_started().ok_or(CupoolErrorInvalidPointer)?;
        rt.free_in_allocation_order(ptr as usize as DevicePtr)
    })
}

/// Fills `*stats` with the statistics of `device`, or of all devices summed when `device`
/// is -1.
///
/// The caller owns `stats` and sets `stats->size = sizeof(cupool_stats)` and
/// `stats->version = CUPOOL_STATS_VERSION` first. `size` below 8, `version` 0 or newer than
/// this library's return `CUPOOL_ERROR_VERSION_MISMATCH`. At most `size` bytes are written;
/// on success `size` and `version` are set to what this library wrote. `stats` must not be
/// NULL. Negative devices other than -1 return `CUPOOL_ERROR_INVALID_DEVICE`.
///
/// # Safety
/// `stats` is NULL or points to at least `stats->size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cupool_get_stats(device: c_int, stats: *mut CupoolStats) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.get_stats)(device, stats);
    }
    guard(|| {
        let out = required(stats)?;
        let header = out.cast::<u32>();
        let caller_size = header.read();
        if caller_size < 8 {
            return Err(CupoolErrorVersionMismatch);
        }
        let caller_version = header.add(1).read();
        if caller_version == 0 || caller_version > CUPOOL_STATS_VERSION {
            return Err(CupoolErrorVersionMismatch);
        }
        let mut figures = runtime()?.stats(device_selection(device)?)?;
        let written = (caller_size as usize).min(core::mem::size_of::<CupoolStats>());
        // `written` fits in u32: it is at most `caller_size`.
        figures.size = written as u32;
        figures.version = caller_version;
        core::ptr::copy_nonoverlapping(
            (&figures as *const CupoolStats).cast::<u8>(),
            out.as_ptr().cast::<u8>(),
            written,
        );
        Ok(())
    })
}

/// Writes the statistics of `device` (-1: all devices) as one JSON object and a NUL into
/// `buf`, which the caller owns.
///
/// When `buf_len` is too small nothing is written to `buf`, `*needed_out` receives the size
/// needed (NUL included) and `CUPOOL_ERROR_BUFFER_TOO_SMALL` is returned; pass `buf` NULL and
/// `buf_len` 0 to ask for the size. On success `*needed_out` receives the bytes written, NUL
/// included. `needed_out` may be NULL. `buf` NULL with `buf_len` > 0 is
/// `CUPOOL_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `buf` is NULL or valid for `buf_len` bytes; `needed_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_stats_json(
    device: c_int,
    buf: *mut c_char,
    buf_len: usize,
    needed_out: *mut usize,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.stats_json)(device, buf, buf_len, needed_out);
    }
    text_export(buf, buf_len, needed_out, || {
        Ok(runtime()?.stats(device_selection(device)?)?.to_json())
    })
}

/// Sets every peak of `device` (-1: all devices) to its current value.
#[no_mangle]
pub extern "C" fn cupool_reset_peak_stats(device: c_int) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        // SAFETY: the table holds this same function of the copy that owns the pool.
        return unsafe { (api.reset_peak_stats)(device) };
    }
    guard(|| runtime()?.reset_peak_stats(device_selection(device)?))
}

/// Gives the idle cached memory of every device back to the driver. Blocks still in use,
/// and freed blocks whose fence has not completed, stay.
///
/// `*released_out` receives the bytes released; `released_out` may be NULL.
///
/// # Safety
/// `released_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_empty_cache(released_out: *mut usize) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.empty_cache)(released_out);
    }
    guard(|| {
        let released = runtime()?.empty_cache(None)?;
        write_optional(
            released_out,
            usize::try_from(released).unwrap_or(usize::MAX),
        );
        Ok(())
    })
}

/// `cupool_empty_cache` for one device (-1: all devices). `released_out` may be NULL.
///
/// # Safety
/// `released_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_empty_cache_device(
    device: c_int,
    released_out: *mut usize,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.empty_cache_device)(device, released_out);
    }
    guard(|| {
        let released = runtime()?.empty_cache(device_selection(device)?)?;
        write_optional(
            released_out,
            usize::try_from(released).unwrap_or(usize::MAX),
        );
        Ok(())
    })
}

/// Caps the bytes the pool may reserve on `device` (an ordinal, not -1); 0 removes the
/// cap. An allocation that would pass it fails with `CUPOOL_ERROR_OUT_OF_MEMORY` after idle
/// cached memory has been released. Memory already reserved is not given back by this call.
#[no_mangle]
pub extern "C" fn cupool_set_memory_limit(device: c_int, bytes: usize) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        // SAFETY: the table holds this same function of the copy that owns the pool.
        return unsafe { (api.set_memory_limit)(device, bytes) };
    }
    guard(|| runtime()?.set_memory_limit(device_ordinal(device)?, bytes as u64))
}

/// Writes the cap set for `device` (0: none) to `*bytes_out`, which must not be NULL.
///
/// # Safety
/// `bytes_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_get_memory_limit(
    device: c_int,
    bytes_out: *mut usize,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.get_memory_limit)(device, bytes_out);
    }
    guard(|| {
        let out = required(bytes_out)?;
        let limit = runtime()?.memory_limit(device_ordinal(device)?)?;
        out.write(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(())
    })
}

/// Sets configuration option `key` to `value` (both NUL-terminated; the README lists the
/// keys). Takes effect from the next operation that reads it; `backend` can only be set
/// before the first allocation.
///
/// NULL `key` or `value`: `CUPOOL_ERROR_INVALID_VALUE`. Unknown key:
/// `CUPOOL_ERROR_UNKNOWN_CONFIG_KEY`. A value the key cannot take (or a change that is no
/// longer allowed): `CUPOOL_ERROR_INVALID_CONFIG_VALUE`, and the old value stays.
///
/// # Safety
/// `key` and `value` are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn cupool_config_set(
    key: *const c_char,
    value: *const c_char,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.config_set)(key, value);
    }
    guard(|| {
        let key = c_text(key, CupoolErrorUnknownConfigKey)?;
        let value = c_text(value, CupoolErrorInvalidConfigValue)?;
        crate::config::set(key, value)
    })
}

/// Writes the current value of option `key` as text and a NUL into `buf`, which the caller
/// owns. Buffer rules as for `cupool_stats_json`: `CUPOOL_ERROR_BUFFER_TOO_SMALL` with the
/// needed size in `*needed_out`; `buf` NULL with `buf_len` 0 asks for the size;
/// `needed_out` may be NULL. `key` NULL: `CUPOOL_ERROR_INVALID_VALUE`; unknown:
/// `CUPOOL_ERROR_UNKNOWN_CONFIG_KEY`.
///
/// # Safety
/// `key` is NULL or a NUL-terminated string; `buf` is NULL or valid for `buf_len` bytes;
/// `needed_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_config_get(
    key: *const c_char,
    buf: *mut c_char,
    buf_len: usize,
    needed_out: *mut usize,
) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.config_get)(key, buf, buf_len, needed_out);
    }
    guard(|| {
        let key = c_text(key, CupoolErrorUnknownConfigKey)?;
        if buf.is_null() && buf_len != 0 {
            return Err(CupoolErrorInvalidValue);
        }
        let value = crate::config::get_text(key)?;
        copy_text_out(&value, buf, buf_len, needed_out)
    })
}

/// Starts recording every allocation and free of the process (all threads, all devices,
/// failures included) to the file `path`, as RMM's log CSV (header
/// `Thread,Time,Action,Pointer,Size,Stream`, then cupool's columns), zstd-compressed when
/// `path` ends in `.zst`. The pool's own segment allocations and releases go to a second
/// file beside it: `x.csv` becomes `x.driver.csv`, `x.csv.zst` `x.driver.csv.zst`, any
/// other name gets `.driver.csv` appended (and `.zst` when it ends in `.zst`). `%p` in
/// `path` is replaced by the process id. The environment variable `CUPOOL_TRACE=path` does
/// the same when the pool starts.
///
/// May be called before the first allocation. A trace already running is stopped (written
/// out and closed) first. Events are buffered per thread and written when a buffer fills,
/// when the thread exits, at `cupool_trace_stop` and at process exit; what was written
/// survives a crash of the program. A write error stops the trace with one line on stderr;
/// allocations never fail because of recording.
///
/// `path` NULL, empty or not UTF-8: `CUPOOL_ERROR_INVALID_VALUE`. A file that cannot be
/// created: `CUPOOL_ERROR_IO` (one line on stderr says why); no trace runs then.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cupool_trace_start(path: *const c_char) -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        return (api.trace_start)(path);
    }
    guard(|| {
        let path = c_text(path, CupoolErrorInvalidValue)?;
        if path.is_empty() {
            return Err(CupoolErrorInvalidValue);
        }
        crate::trace::record::start(path)
    })
}

/// Stops recording: writes everything recorded so far and closes the trace files.
/// `CUPOOL_OK` also when no trace is running.
#[no_mangle]
pub extern "C" fn cupool_trace_stop() -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        // SAFETY: the table holds this same function of the copy that owns the pool.
        return unsafe { (api.trace_stop)() };
    }
    guard(|| {
        crate::trace::record::stop();
        Ok(())
    })
}

/// Every status, indexed by its value.
const ALL_STATUSES: [CupoolStatus; 15] = [
    CupoolOk,
    CupoolErrorInvalidValue,
    CupoolErrorOutOfMemory,
    CupoolErrorBackendUnavailable,
    CupoolErrorInvalidPointer,
    CupoolErrorDoubleFree,
    CupoolErrorInvalidDevice,
    CupoolErrorUnknownConfigKey,
    CupoolErrorInvalidConfigValue,
    CupoolErrorCuda,
    CupoolErrorStreamCapture,
    CupoolErrorBufferTooSmall,
    CupoolErrorVersionMismatch,
    CupoolErrorInternal,
    CupoolErrorIo,
];

/// `text` followed by a NUL, built at compile time.
const fn nul_terminated<const N: usize>(text: &str) -> [u8; N] {
    let bytes = text.as_bytes();
    let mut out = [0u8; N];
    let mut i = 0;
    while i < bytes.len() {
        out[i] = bytes[i];
        i += 1;
    }
    out
}

/// The NUL-terminated text of `CupoolStatus::as_str`, as a `&'static CStr`, at compile time
/// (an interior NUL would fail the build).
macro_rules! status_text {
    ($status:expr) => {{
        const TEXT: &str = $status.as_str();
        const BYTES: [u8; TEXT.len() + 1] = nul_terminated(TEXT);
        const C_TEXT: &CStr = match CStr::from_bytes_with_nul(&BYTES) {
            Ok(c) => c,
            Err(_) => panic!("status text contains a NUL"),
        };
        C_TEXT
    }};
}

static STATUS_TEXTS: [&CStr; 15] = [
    status_text!(ALL_STATUSES[0]),
    status_text!(ALL_STATUSES[1]),
    status_text!(ALL_STATUSES[2]),
    status_text!(ALL_STATUSES[3]),
    status_text!(ALL_STATUSES[4]),
    status_text!(ALL_STATUSES[5]),
    status_text!(ALL_STATUSES[6]),
    status_text!(ALL_STATUSES[7]),
    status_text!(ALL_STATUSES[8]),
    status_text!(ALL_STATUSES[9]),
    status_text!(ALL_STATUSES[10]),
    status_text!(ALL_STATUSES[11]),
    status_text!(ALL_STATUSES[12]),
    status_text!(ALL_STATUSES[13]),
    status_text!(ALL_STATUSES[14]),
];

const UNKNOWN_STATUS_TEXT: &CStr = c"unknown cupool status";

/// A static, NUL-terminated English description of `status`. Never NULL: a value that is no
/// status gets "unknown cupool status". The caller must not free it.
#[no_mangle]
pub extern "C" fn cupool_status_string(status: CupoolStatusCode) -> *const c_char {
    usize::try_from(status)
        .ok()
        .and_then(|i| STATUS_TEXTS.get(i))
        .copied()
        .unwrap_or(UNKNOWN_STATUS_TEXT)
        .as_ptr()
}

const VERSION_TEXT: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(c) => c,
        Err(_) => panic!("package version contains a NUL"),
    };

/// This library's version, e.g. "0.1.0": static, NUL-terminated, never NULL; do not free.
#[no_mangle]
pub extern "C" fn cupool_version() -> *const c_char {
    VERSION_TEXT.as_ptr()
}

static INTERPOSITION_ACTIVE: AtomicBool = AtomicBool::new(false);

/// Records whether `libcupool_preload.so` interposes CUDA in this process (called by the
/// preload crate once its hooks are installed). Also tells the copy of cupool that owns the
/// process's pool, so `cupool_interposition_active` answers the same through every copy.
pub fn set_interposition_active(active: bool) {
    INTERPOSITION_ACTIVE.store(active, Ordering::Release);
    if let Some(api) = process_api::other_copy() {
        // SAFETY: the table holds this same function of the copy that owns the pool.
        unsafe { (api.set_interposition_active)(c_int::from(active)) };
    }
}

/// 1 when `libcupool_preload.so` interposes CUDA calls in this process (so `cudaMalloc`,
/// `cuMemAlloc` and friends also go through cupool), 0 otherwise.
#[no_mangle]
pub extern "C" fn cupool_interposition_active() -> c_int {
    if let Some(api) = process_api::other_copy() {
        // SAFETY: the table holds this same function of the copy that owns the pool.
        return unsafe { (api.interposition_active)() };
    }
    c_int::from(INTERPOSITION_ACTIVE.load(Ordering::Acquire))
}

/// Table entry behind [`set_interposition_active`]; not part of the header.
extern "C" fn set_interposition_active_entry(active: c_int) {
    INTERPOSITION_ACTIVE.store(active != 0, Ordering::Release);
}

#[cfg(test)]
mod tests;
