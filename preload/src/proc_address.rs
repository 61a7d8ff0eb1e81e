//! `cuGetProcAddress` / `cuGetProcAddress_v2` wrappers: how every CUDA runtime, static or
//! shared, reaches the driver (`dlsym(libcuda, "cuGetProcAddress_v2")`, then one query per
//! entry point).
//!
//! The real function is always asked first, so its error codes, its `symbolStatus` and its
//! choice of variant stand. We then substitute only when the real answer is a non-NULL
//! function and our table has a hook with the same signature for exactly that (base name,
//! `cudaVersion`, flags): `cuMemAlloc`@3020 gets our `cuMemAlloc_v2`, `cuMemAlloc`@2000
//! keeps the driver's 32-bit v1, a `flags=2` query for a stream function gets our `_ptsz`
//! hook (which forwards to the driver's `_ptsz` function), and the self-queries get the
//! wrapper of matching arity (`cuGetProcAddress`@11030: 4 arguments, @12000: 5).

use crate::cuda::*;
use crate::guard::cuda_call;
use crate::lifecycle;
use crate::real;
use crate::slots::sig;
// The one import of the hook table by a hook: see the table's module note.
use crate::table;
use core::ffi::{c_char, c_int, c_void};
use core::ptr::null_mut;

/// `cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)`
/// (the 4-argument form of CUDA 11.3).
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CuResult {
    cuda_call("cuGetProcAddress", || {
        // SAFETY: arguments forwarded as received.
        let rc = unsafe {
            match real::get::<sig::GetProcAddress>() {
                Some(real) => real(symbol, pfn, cuda_version, flags),
                // A driver with only the 5-argument form: the status is optional there.
                None => match real::get::<sig::GetProcAddressV2>() {
                    Some(real) => real(symbol, pfn, cuda_version, flags, null_mut()),
                    None => return CUDA_ERROR_NOT_INITIALIZED,
                },
            }
        };
        // SAFETY: the driver accepted `pfn` and `symbol`.
        unsafe { substitute(rc, symbol, pfn, cuda_version, flags) };
        rc
    })
}

/// `cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
/// CUdriverProcAddressQueryResult *symbolStatus)` (CUDA 12.0).
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut c_int,
) -> CuResult {
    cuda_call("cuGetProcAddress_v2", || {
        // SAFETY: the slot's exported function has this signature.
        let Some(real) = real::get::<sig::GetProcAddressV2>() else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: arguments forwarded as received.
        let rc = unsafe { real(symbol, pfn, cuda_version, flags, symbol_status) };
        // SAFETY: the driver accepted `pfn` and `symbol`.
        unsafe { substitute(rc, symbol, pfn, cuda_version, flags) };
        rc
    })
}

/// Replaces the driver's answer with our hook where the table says so. The driver's
/// `symbolStatus` (SUCCESS whenever it returned a function) stays as it wrote it.
///
/// # Safety
/// After a successful real call, `pfn` is a valid pointer the driver wrote and `symbol` a
/// NUL-terminated string.
unsafe fn substitute(
    rc: CuResult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) {
    if rc != CUDA_SUCCESS || pfn.is_null() || lifecycle::pass_through() {
        return;
    }
    // SAFETY: the driver wrote `*pfn`.
    if unsafe { (*pfn).is_null() } {
        return; // not found or version not sufficient: the driver's answer stands
    }
    // SAFETY: `symbol` is NUL-terminated (the driver read it).
    let Some(hook) = (unsafe { table::hook_for_query(symbol, cuda_version, flags) }) else {
        return;
    };
    // Our hook forwards to the driver's export of the same variant; without it there is
    // nothing to forward to, so the driver's pointer stays.
    if crate::real::function(hook.slot).is_none() {
        return;
    }
    // SAFETY: checked non-NULL above.
    unsafe { *pfn = (hook.replacement)() };
}
