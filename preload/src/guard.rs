//! No panic crosses the C boundary: every hook body runs inside [`cuda_call`].

use crate::cuda::{CuResult, CUDA_ERROR_UNKNOWN};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs a hook body; a panic becomes one stderr line and `CUDA_ERROR_UNKNOWN`.
#[inline]
pub fn cuda_call(hook: &'static str, body: impl FnOnce() -> CuResult) -> CuResult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(rc) => rc,
        Err(_) => {
            report_panic(hook);
            CUDA_ERROR_UNKNOWN
        }
    }
}

/// Runs `body`; on a panic, reports it and returns `fallback()` instead.
#[inline]
pub fn or_else<T>(hook: &'static str, body: impl FnOnce() -> T, fallback: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(_) => {
            report_panic(hook);
            fallback()
        }
    }
}

#[cold]
fn report_panic(hook: &'static str) {
    cupool::log::always(&format!(
        "cupool: internal error (panic) in the {hook} hook; the call was not completed (please report)"
    ));
}
