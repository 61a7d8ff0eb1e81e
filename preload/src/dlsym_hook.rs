//! The exported `dlsym`: how programs that resolve driver functions by name (the CUDA
//! runtime's one `dlsym(libcuda, "cuGetProcAddress_v2")`, XLA/TensorFlow stubs, cuBLASLt)
//! reach our hooks.
//!
//! Rules (research/preload-interception.md §4.15):
//! - Exact names only (the table in `table.rs`); everything else goes to glibc's `dlsym`
//!   with no allocation, lock or log: our own code (std's `thread::spawn`, ...) lands here
//!   too, and so may a malloc implementation.
//! - The caller's lookup is honoured: we first do it with the real `dlsym`, and replace the
//!   result only when it is libcuda's own definition of that name (so `dlsym(handle_of_libfoo,
//!   "cuMemAlloc_v2")` that finds libfoo's function gets libfoo's function).
//! - `RTLD_NEXT` is relative to the *caller*, which glibc finds from `dlsym`'s return
//!   address. So the pass-through is a tail jump, not a call: on x86-64 and aarch64 the
//!   exported `dlsym` is a small naked trampoline that asks [`dlsym_target`] where to go
//!   and jumps there with the caller's return address intact.

use crate::real::{self, DlsymFn};
use crate::table;
use core::ffi::{c_char, c_void};
use core::ptr::null_mut;

/// Where a `dlsym(handle, name)` call goes: glibc's `dlsym` for every name we do not
/// answer, [`answer_hooked_name`] for ours. No allocation, lock, log or panic here.
extern "C" fn dlsym_target(_handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let Some(real_dlsym) = real::real_dlsym() else {
        return dlsym_unavailable as *mut c_void;
    };
    // SAFETY: `name` is the caller's `dlsym` argument: NULL or NUL-terminated.
    if unsafe { table::hook_by_exported_name(name) }.is_none() {
        return real_dlsym as *mut c_void;
    }
    answer_hooked_name as *mut c_void
}

/// Reached when glibc's `dlsym` cannot be found at all (never on glibc ≥ 2.2.5).
extern "C" fn dlsym_unavailable(_handle: *mut c_void, _name: *const c_char) -> *mut c_void {
    null_mut()
}

/// `dlsym` for a name we hook: the caller's own lookup, with libcuda's definition replaced
/// by our hook.
unsafe extern "C" fn answer_hooked_name(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: the caller's arguments, forwarded.
    let resolved = unsafe { real::dlsym(handle, name) };
    if resolved.is_null() || crate::lifecycle::pass_through() {
        return resolved;
    }
    crate::guard::or_else(
        "dlsym",
        // SAFETY: `name` is NUL-terminated (the real dlsym just read it).
        || unsafe { replace_libcuda_definition(name, resolved) },
        || resolved,
    )
}

/// Our hook when `resolved` is libcuda's own definition of `name`, else `resolved`.
///
/// # Safety
/// `name` must be NUL-terminated.
unsafe fn replace_libcuda_definition(name: *const c_char, resolved: *mut c_void) -> *mut c_void {
    // SAFETY: per the contract.
    let Some(hook) = (unsafe { table::hook_by_exported_name(name) }) else {
        return resolved;
    };
    let replacement = (hook.replacement)();
    if resolved == replacement {
        return resolved; // the global scope found our export already
    }
    // Never loads libcuda from inside dlsym: a lookup that found libcuda's function means
    // libcuda is loaded.
    match real::function_if_loaded(hook.slot) {
        Some(libcuda_own) if libcuda_own == resolved => replacement,
        _ => resolved,
    }
}

/// The exported `dlsym` (x86-64): save the arguments, ask [`dlsym_target`], restore them
/// and jump, so the target sees the caller's return address.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // Entry: rsp ≡ 8 (mod 16). Two pushes and 8 bytes of padding make it 16-aligned
    // for the call, as the ABI requires.
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {target}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "jmp rax",
        target = sym dlsym_target,
    )
}

/// The exported `dlsym` (aarch64): as on x86-64; the link register is restored before the
/// branch, so the target returns straight to the caller.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {target}",
        "mov x16, x0",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "br x16",
        target = sym dlsym_target,
    )
}

/// The exported `dlsym` on other architectures: a plain call (an `RTLD_NEXT` lookup is
/// then relative to this library rather than to its caller).
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let target = dlsym_target(handle, name);
    // SAFETY: every target has `dlsym`'s signature.
    let f = unsafe { core::mem::transmute::<*mut c_void, DlsymFn>(target) };
    // SAFETY: the caller's arguments, forwarded.
    unsafe { f(handle, name) }
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const _: Option<DlsymFn> = None; // the type is used by the portable fallback only
