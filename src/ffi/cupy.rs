//! CuPy's C-function allocator (`cupy.cuda.memory.CFunctionAllocator(param, malloc, free,
//! owner)`) over the pool, for `cupool.cupy.enable()`: CuPy calls
//! `void *malloc(void *param, size_t size, int device)` and
//! `void free(void *param, void *ptr, int device)` from compiled code, so an allocation
//! costs no Python frame and no ctypes call (docs/BENCHMARKS.md).
//!
//! Note [CuPy's C-function allocator]: CuPy passes no stream and does not check the pointer
//! it gets. So `param` is a [`CupoolCupyHooks`] that the Python side fills with
//! - CuPy's own `get_current_stream_ptr` (the C function of its Cython module, taken from
//!   `cupy.cuda.stream.__pyx_capi__`), called for the stream of every allocation;
//! - `PyErr_SetString` and the exception types to raise: on failure the allocation sets a
//!   Python exception and returns `(void *)-1`, which CuPy's compiled `_call_malloc` turns
//!   into that exception (CuPy 14 checks for an error on -1; `cupool.cupy.enable()` makes
//!   sure it does before it installs this allocator, and falls back to its Python one).
//!
//! CuPy calls both with the GIL held, as the two Python calls need. A block is freed in the
//! order it was allocated in (`cupool_free_in_allocation_order`): CuPy's own pool gives a
//! freed block back to the stream it was allocated on, and so does this.

use super::device::{cupool_alloc_async_device, cupool_mem_get_info};
use super::{cupool_free_in_allocation_order, CUstream_st};
use crate::status::CupoolStatus::*;
use core::ffi::{c_char, c_int, c_void};
use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What CuPy's allocation returns on failure, with a Python exception set.
pub(super) const FAILED: *mut c_void = usize::MAX as *mut c_void;

/// The `param` of `cupool_cupy_malloc` and `cupool_cupy_free` (CuPy passes it as
/// `void *`); the caller keeps it alive as long as the allocator.
#[repr(C)]
pub struct CupoolCupyHooks {
    /// The caller's current stream (`cudaStream_t` as an integer): CuPy's
    /// `get_current_stream_ptr`. NULL: every allocation fails (how `enable()` checks that
    /// CuPy raises what is set).
    pub current_stream: Option<unsafe extern "C" fn() -> isize>,
    /// `PyErr_SetString`, to report a failure.
    pub set_error: Option<unsafe extern "C" fn(*mut c_void, *const c_char)>,
    /// The exception type raised when the pool is out of memory (a subclass of CuPy's
    /// `OutOfMemoryError` taking a message).
    pub out_of_memory_type: *mut c_void,
    /// The exception type raised for any other failure.
    pub error_type: *mut c_void,
}

/// Sets the Python exception `kind` with `message` (a NUL in it would cut it short).
///
/// # Safety
/// The GIL is held; `kind` is one of `hooks`' exception types.
unsafe fn raise(hooks: &CupoolCupyHooks, kind: *mut c_void, message: &str) {
    let Some(set_error) = hooks.set_error else {
        crate::log::error(message);
        return;
    };
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: the caller's contract.
    unsafe { set_error(kind, text.as_ptr()) };
}

/// CuPy's allocation hook: `size` bytes on `device` in stream order on CuPy's current
/// stream. On failure sets a Python exception (out of memory: `hooks->out_of_memory_type`,
/// after idle cached memory was released and the allocation retried) and returns
/// `(void *)-1`, never NULL.
///
/// # Safety
/// `param` points to a live `CupoolCupyHooks`; called with the GIL held (as CuPy does).
#[no_mangle]
pub unsafe extern "C" fn cupool_cupy_malloc(
    param: *mut c_void,
    size: usize,
    device: c_int,
) -> *mut c_void {
    if param.is_null() {
        crate::log::error("cupool: CuPy allocation without its hooks");
        return FAILED;
    }
    // SAFETY: the caller's contract.
    let hooks = unsafe { &*(param as *const CupoolCupyHooks) };
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: GIL held (the caller's contract).
        unsafe { allocate_for_cupy(hooks, size, device) }
    }))
    .unwrap_or_else(|_| {
        crate::log::always("cupool: internal error: a panic was caught in CuPy's allocation");
        FAILED
    })
}

/// `size` bytes on `device` in stream order on CuPy's current stream, or [`FAILED`] with a
/// Python exception set (out of memory: `hooks.out_of_memory_type`, after idle cached
/// memory was released and the allocation retried).
///
/// # Safety
/// GIL held; `hooks`' functions are CPython's and CuPy's.
pub(super) unsafe fn allocate_for_cupy(
    hooks: &CupoolCupyHooks,
    size: usize,
    device: c_int,
) -> *mut c_void {
    let Some(current_stream) = hooks.current_stream else {
        let message = "cupool: no current-stream source for CuPy";
        // SAFETY: GIL held (the caller's contract).
        unsafe { raise(hooks, hooks.error_type, message) };
        return FAILED;
    };
    // SAFETY: CuPy's own function, called with the GIL held.
    let stream = unsafe { current_stream() } as usize as *mut CUstream_st;
    let mut ptr = core::ptr::null_mut();
    // SAFETY: a valid out-pointer; the stream is CuPy's current one.
    let status = unsafe { cupool_alloc_async_device(&mut ptr, size, device, stream) };
    match status {
        CupoolOk => ptr,
        CupoolErrorOutOfMemory => {
            let (mut free, mut total, mut limit) = (0usize, 0usize, 0usize);
            // SAFETY: valid out-pointers.
            let _ = unsafe { cupool_mem_get_info(device, &mut free, &mut total) };
            // SAFETY: a valid out-pointer.
            let _ = unsafe { super::cupool_get_memory_limit(device, &mut limit) };
            let limit = match limit {
                0 => String::new(),
                l => format!(", memory_limit {l} bytes"),
            };
            let message = format!(
                "Out of memory allocating {size} bytes on device {device} (cupool: \
                 {free} bytes free of {total}{limit}; after releasing its idle cache and \
                 retrying)"
            );
            // SAFETY: GIL held.
            unsafe { raise(hooks, hooks.out_of_memory_type, &message) };
            FAILED
        }
        other => {
            let message = format!(
                "cupool: allocating {size} bytes on device {device} for CuPy: {}",
                other.as_str()
            );
            // SAFETY: GIL held.
            unsafe { raise(hooks, hooks.error_type, &message) };
            FAILED
        }
    }
}

/// CuPy's free hook: frees a block `cupool_cupy_malloc` returned, in stream order on the
/// stream it was allocated on. A pointer cupool did not hand out, or one freed twice, is
/// reported on stderr and otherwise ignored (CuPy's free cannot fail).
///
/// # Safety
/// Any `ptr` value may be passed (it is looked up, never dereferenced).
#[no_mangle]
pub unsafe extern "C" fn cupool_cupy_free(param: *mut c_void, ptr: *mut c_void, device: c_int) {
    let _ = param; // CuPy passes it; the block knows its stream
                   // SAFETY: the caller's contract. The export catches its own panics.
    let freed = unsafe { cupool_free_in_allocation_order(ptr) };
    if freed != CupoolOk {
        crate::log::error(&format!(
            "cupool: CuPy freed {ptr:p} (device {device}): {}",
            freed.as_str()
        ));
    }
}
