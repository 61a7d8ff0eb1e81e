//! No panic crosses the C boundary: every hook body runs inside [`cuda_call`]. And no
//! hook re-enters the pool from inside it: [`enter_pool`].

use crate::cuda::{CuResult, CUDA_ERROR_UNKNOWN};
use core::cell::Cell;
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

thread_local! {
    /// Set while this thread is inside the pool on behalf of a hook: a driver call the pool
    /// makes must never land in our own hook again (Note [never our own hook] in real.rs);
    /// if one does, it goes straight to the driver.
    static IN_POOL: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the re-entry flag raised; `None` when this thread is already inside.
pub(crate) fn enter_pool<T>(f: impl FnOnce() -> T) -> Option<T> {
    let entered = IN_POOL
        .try_with(|flag| !flag.replace(true))
        .unwrap_or(false);
    if !entered {
        return None;
    }
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            let _ = IN_POOL.try_with(|flag| flag.set(false));
        }
    }
    let _leave = Leave;
    Some(f())
}
