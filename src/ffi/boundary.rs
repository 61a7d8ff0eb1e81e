//! What every export of the C boundary shares: the panic guard, the checks of its
//! arguments and the writes of its out-parameters.

use super::CUstream_st;
use crate::backend::{DevicePtr, StreamHandle};
use crate::runtime::{runtime_if_started, Runtime};
use crate::status::{CupoolStatus, Result};
use core::ffi::{c_char, c_int, c_void, CStr};
use core::ptr::NonNull;
use std::panic::{catch_unwind, AssertUnwindSafe};

use CupoolStatus::*;

/// Runs one export's body: `Ok` becomes `CUPOOL_OK`, an error its status, and a panic
/// `CUPOOL_ERROR_INTERNAL` after one line on stderr. The only place a panic is caught.
pub(super) fn guard(body: impl FnOnce() -> Result<()>) -> CupoolStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CupoolOk,
        Ok(Err(status)) => status,
        Err(_) => {
            crate::log::always(
                "cupool: internal error: a panic was caught at the C boundary; returning CUPOOL_ERROR_INTERNAL",
            );
            CupoolErrorInternal
        }
    }
}

/// An out-pointer the caller must supply.
pub(super) fn required<T>(out: *mut T) -> Result<NonNull<T>> {
    NonNull::new(out).ok_or(CupoolErrorInvalidValue)
}

/// Writes an optional out-parameter (NULL: the caller does not want it).
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(super) unsafe fn write_optional<T>(out: *mut T, value: T) {
    if let Some(out) = NonNull::new(out) {
        out.write(value);
    }
}

/// `-1` selects all devices; any other negative ordinal is refused here, too-large ones by
/// the runtime.
pub(super) fn device_selection(device: c_int) -> Result<Option<i32>> {
    match device {
        -1 => Ok(None),
        d if d < 0 => Err(CupoolErrorInvalidDevice),
        d => Ok(Some(d)),
    }
}

pub(super) fn device_ordinal(device: c_int) -> Result<i32> {
    if device < 0 {
        Err(CupoolErrorInvalidDevice)
    } else {
        Ok(device)
    }
}

pub(super) fn stream_handle(stream: *mut CUstream_st) -> StreamHandle {
    stream as StreamHandle
}

pub(super) fn to_c_pointer(ptr: DevicePtr) -> Result<*mut c_void> {
    let address = usize::try_from(ptr).map_err(|_| CupoolErrorInternal)?;
    Ok(address as *mut c_void)
}

/// The body of an export that names an address range by a pointer into a live block:
/// `lookup` finds the range (None: `ptr` is in no live block it knows, or no pool has
/// started, `CUPOOL_ERROR_INVALID_POINTER`), whose start and size go to the optional
/// out-parameters (a size too large for `size_t` as `SIZE_MAX`).
///
/// # Safety
/// `base_out` and `size_out` are NULL or valid for a write.
pub(super) unsafe fn write_range_of(
    ptr: *const c_void,
    base_out: *mut *mut c_void,
    size_out: *mut usize,
    lookup: impl FnOnce(&Runtime, DevicePtr) -> Option<(DevicePtr, u64)>,
) -> CupoolStatus {
    guard(|| {
        let rt = runtime_if_started().ok_or(CupoolErrorInvalidPointer)?;
        let (base, size) =
            lookup(rt, ptr as usize as DevicePtr).ok_or(CupoolErrorInvalidPointer)?;
        let base = to_c_pointer(base)?;
        write_optional(base_out, base);
        write_optional(size_out, usize::try_from(size).unwrap_or(usize::MAX));
        Ok(())
    })
}

/// Copies `text` and a NUL into `buf`; `*needed_out` (when not NULL) receives
/// `strlen(text) + 1` on success and on `CUPOOL_ERROR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `buf` is NULL or valid for `buf_len` bytes; `needed_out` is NULL or valid for a write.
pub(super) unsafe fn copy_text_out(
    text: &str,
    buf: *mut c_char,
    buf_len: usize,
    needed_out: *mut usize,
) -> Result<()> {
    if buf.is_null() && buf_len != 0 {
        return Err(CupoolErrorInvalidValue);
    }
    let needed = text.len() + 1;
    if buf_len < needed {
        write_optional(needed_out, needed);
        return Err(CupoolErrorBufferTooSmall);
    }
    let dst = buf.cast::<u8>();
    core::ptr::copy_nonoverlapping(text.as_ptr(), dst, text.len());
    dst.add(text.len()).write(0);
    write_optional(needed_out, needed);
    Ok(())
}

/// [`copy_text_out`] of a text made only once the buffer arguments are known good (so a
/// bad call costs nothing), under [`guard`].
///
/// # Safety
/// As for [`copy_text_out`].
pub(super) unsafe fn text_export(
    buf: *mut c_char,
    buf_len: usize,
    needed_out: *mut usize,
    make: impl FnOnce() -> Result<String>,
) -> CupoolStatus {
    guard(|| {
        if buf.is_null() && buf_len != 0 {
            return Err(CupoolErrorInvalidValue);
        }
        copy_text_out(&make()?, buf, buf_len, needed_out)
    })
}

/// A C string argument as UTF-8; NULL is `CUPOOL_ERROR_INVALID_VALUE`, bad UTF-8 `not_utf8`.
///
/// # Safety
/// `s` is NULL or a NUL-terminated string that lives for the call.
pub(super) unsafe fn c_text<'a>(s: *const c_char, not_utf8: CupoolStatus) -> Result<&'a str> {
    if s.is_null() {
        return Err(CupoolErrorInvalidValue);
    }
    CStr::from_ptr(s).to_str().map_err(|_| not_utf8)
}
