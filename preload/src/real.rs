//! The real functions behind the hooks: glibc's `dlsym` and libcuda's own entry points.
//!
//! Note [never our own hook]: a call to `dlsym` made from inside this library binds to our
//! exported `dlsym` (self-interposition), and `dlsym(RTLD_DEFAULT, "cuMemAlloc_v2")` finds
//! our export first. So the real `dlsym` is cupool's one lookup of it ([`cupool::dl`]:
//! `dlvsym(RTLD_NEXT, "dlsym", version)`, which skips this library, is not hooked, and never
//! matches our unversioned hook), and libcuda's functions are resolved with the real
//! `dlsym` on libcuda's own handle, which searches libcuda and its dependencies only.
//! Every address is cached in an atomic: no lock, no allocation after the first lookup.

use crate::slots::{sig, RealFn, Slot, SLOT_COUNT};
use core::ffi::c_void;
use core::ptr::null_mut;
use core::sync::atomic::{AtomicPtr, Ordering::Acquire, Ordering::Release};

pub use cupool::dl::{dlsym, real_dlsym, resolve_real_dlsym, DlsymFn};

static LIBCUDA: AtomicPtr<c_void> = AtomicPtr::new(null_mut());
const LIBCUDA_SONAME: &core::ffi::CStr = c"libcuda.so.1";

/// libcuda's handle if the process has already loaded it; never loads it. The handle keeps
/// one reference to libcuda for the life of the process (libcuda is never unloaded while
/// a CUDA program runs anyway).
pub fn loaded_libcuda() -> *mut c_void {
    let h = LIBCUDA.load(Acquire);
    if !h.is_null() {
        return h;
    }
    // SAFETY: plain dlopen of a literal name; RTLD_NOLOAD never loads anything.
    let h = unsafe { libc::dlopen(LIBCUDA_SONAME.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    publish_handle(h)
}

/// libcuda's handle, loading it if needed: only called from a CUDA entry point, i.e. when
/// the program is using CUDA (a `-lcuda` program has it loaded already).
pub fn libcuda_for_call() -> *mut c_void {
    let h = loaded_libcuda();
    if !h.is_null() {
        return h;
    }
    // SAFETY: as above.
    let h = unsafe { libc::dlopen(LIBCUDA_SONAME.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    publish_handle(h)
}

fn publish_handle(h: *mut c_void) -> *mut c_void {
    if h.is_null() {
        return h;
    }
    match LIBCUDA.compare_exchange(null_mut(), h, Release, Acquire) {
        Ok(_) => h,
        Err(existing) => {
            // Another thread won; drop our extra reference.
            // SAFETY: `h` came from a successful dlopen.
            unsafe { libc::dlclose(h) };
            existing
        }
    }
}

/// Marks a slot that was looked up and found missing (distinct from "not looked up yet").
const MISSING: *mut c_void = core::ptr::dangling_mut::<c_void>();
static SLOTS: [AtomicPtr<c_void>; SLOT_COUNT] = [const { AtomicPtr::new(null_mut()) }; SLOT_COUNT];

/// libcuda's own implementation of `slot`, loading libcuda if needed; `None` when the
/// driver does not export it (or no driver can be loaded).
pub fn function(slot: Slot) -> Option<*mut c_void> {
    let cell = SLOTS.get(slot as usize)?;
    let p = cell.load(Acquire);
    if p == MISSING {
        return None;
    }
    if !p.is_null() {
        return Some(p);
    }
    let lib = libcuda_for_call();
    if lib.is_null() {
        // Not cached: libcuda may become loadable later (e.g. LD_LIBRARY_PATH set by then
        // is not possible, but a later dlopen by the program with a full path is).
        return None;
    }
    // SAFETY: `lib` is a live handle; the name is a NUL-terminated literal.
    let found = unsafe { dlsym(lib, slot.exported_name().as_ptr().cast()) };
    cell.store(if found.is_null() { MISSING } else { found }, Release);
    (!found.is_null()).then_some(found)
}

/// libcuda's own implementation of `slot` if libcuda is loaded; never loads it.
pub fn function_if_loaded(slot: Slot) -> Option<*mut c_void> {
    if loaded_libcuda().is_null() {
        return None;
    }
    function(slot)
}

/// libcuda's own implementation of the slot `S` names, typed as `S` says (the pairing of
/// a slot with its signature is written once, in [`crate::slots`]); loads libcuda if needed.
#[inline]
pub fn get<S: RealFn>() -> Option<S::Fn> {
    const {
        assert!(core::mem::size_of::<S::Fn>() == core::mem::size_of::<*mut c_void>());
    }
    let p = function(S::SLOT)?;
    // SAFETY: `S::Fn` is the exported function's type (slots.rs); fn pointers are
    // pointer-sized (checked above).
    Some(unsafe { core::mem::transmute_copy::<*mut c_void, S::Fn>(&p) })
}

/// The calling thread's current context as the driver sees it; `None` when the driver is
/// not initialised, or no context is current (the real call would then fail on its own).
pub fn current_context() -> Option<u64> {
    let f = get::<sig::CtxGetCurrent>()?;
    let mut ctx: *mut c_void = null_mut();
    // SAFETY: `ctx` is a valid out-pointer.
    let rc = unsafe { f(&mut ctx) };
    (rc == 0 && !ctx.is_null()).then_some(ctx as u64)
}
