//! glibc's own `dlsym`, the one lookup every part of cupool uses (the driver loader, the
//! process-API lookup, and the preload library's `dlsym` hook and driver-function table).
//!
//! Note [real dlsym]: inside `libcupool_preload.so` the public `dlsym` is our own hook, and a
//! call to `dlsym` from code linked into that library binds to it (self-interposition). So
//! the real one is fetched with `dlvsym(handle, "dlsym", "GLIBC_x")`:
//! - `dlvsym` itself is not hooked;
//! - a versioned lookup never matches the hook, which is unversioned: glibc rejects an
//!   unversioned definition when a (hidden) version is asked for;
//! - `RTLD_NEXT` first: searched from the object that contains this code (the preload
//!   library, `libcupool.so`, or the executable linking `libcupool.a`), it skips that
//!   object; `RTLD_DEFAULT` (the whole global scope) only if that finds nothing.
//!
//! The versions are the ones glibc has given `dlsym`: 2.34 moved it into libc proper;
//! 2.2.5 (x86-64) and 2.17 (aarch64) are the original ones. The address is cached in an
//! atomic: after the first lookup, no lock and no allocation (the preload's `dlsym` hook
//! runs this for every `dlsym` of the process, malloc implementations included).

use core::ffi::{c_char, c_void, CStr};
use core::ptr::null_mut;
use core::sync::atomic::{AtomicPtr, Ordering::Acquire, Ordering::Release};

/// glibc's `dlsym` signature.
pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// `RTLD_NEXT` (glibc): search the objects after the caller's.
pub const RTLD_NEXT: *mut c_void = -1isize as *mut c_void;
/// `RTLD_DEFAULT` (glibc): the global scope.
pub const RTLD_DEFAULT: *mut c_void = null_mut();

/// The symbol versions glibc has given `dlsym`, newest first.
const DLSYM_VERSIONS: [&CStr; 3] = [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"];

static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// glibc's `dlsym`, or `None` when it cannot be found (never on glibc ≥ 2.2.5).
#[inline]
pub fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Acquire);
    if p.is_null() {
        p = resolve_real_dlsym();
    }
    if p.is_null() {
        None
    } else {
        // SAFETY: `p` is the address of glibc's `dlsym`, which has this signature.
        Some(unsafe { core::mem::transmute::<*mut c_void, DlsymFn>(p) })
    }
}

/// Looks the real `dlsym` up (Note [real dlsym]) and caches it; null when not found. Safe
/// to race: every thread finds the same address. Only libc calls and atomics, so a library
/// constructor may call it.
#[cfg(all(target_os = "linux", target_env = "gnu", not(miri)))]
pub fn resolve_real_dlsym() -> *mut c_void {
    for scope in [RTLD_NEXT, RTLD_DEFAULT] {
        for version in DLSYM_VERSIONS {
            // SAFETY: NUL-terminated literals and a glibc pseudo-handle.
            let p = unsafe { libc::dlvsym(scope, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                REAL_DLSYM.store(p, Release);
                return p;
            }
        }
    }
    null_mut()
}

/// Without glibc symbol versions there is no way around an interposed `dlsym`: nothing is
/// found (each copy of cupool then keeps its own pool, and the driver cannot be loaded).
/// Under Miri too, which cannot call `dlvsym` (FFI): the unit tests that reach a lookup
/// (the process-API owner, through every C entry point) then see a lone copy.
#[cfg(any(miri, not(all(target_os = "linux", target_env = "gnu"))))]
pub fn resolve_real_dlsym() -> *mut c_void {
    let _ = (&REAL_DLSYM, DLSYM_VERSIONS, Release);
    null_mut()
}

/// `dlsym(handle, name)` through glibc's real `dlsym`, never an interposed one; null when
/// not found.
///
/// # Safety
/// `handle` is `RTLD_DEFAULT`, `RTLD_NEXT` or a live `dlopen` handle; `name` is NULL or a
/// NUL-terminated string.
pub unsafe fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    match real_dlsym() {
        // SAFETY: the caller's guarantees; `f` is glibc's dlsym.
        Some(f) => unsafe { f(handle, name) },
        None => null_mut(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore)] // calls glibc's dlvsym/dlsym (FFI): Miri cannot
    fn finds_libc_functions_and_not_missing_ones() {
        assert!(real_dlsym().is_some());
        // SAFETY: lookups in the global scope with NUL-terminated names.
        unsafe {
            assert!(!dlsym(RTLD_DEFAULT, c"malloc".as_ptr()).is_null());
            assert!(dlsym(RTLD_DEFAULT, c"cupool_no_such_symbol_anywhere".as_ptr()).is_null());
        }
    }

    #[test]
    #[cfg_attr(miri, ignore)] // calls glibc's dlvsym/dlsym (FFI): Miri cannot
    fn the_cached_address_is_glibcs_dlsym() {
        let f = real_dlsym().expect("glibc's dlsym") as *mut c_void;
        // SAFETY: as above; `dlsym` here is the test binary's libc binding (no hook here).
        let public = unsafe { libc::dlsym(RTLD_DEFAULT, c"dlsym".as_ptr()) };
        assert_eq!(f, public);
    }
}
