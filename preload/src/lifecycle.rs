//! Process lifecycle of the interposer: lazy start, exit, fork.
//!
//! - Nothing happens at load time but resolving the real `dlsym` (a libc call) and raising
//!   the "interposition active" flag (an atomic): a process that never calls a CUDA entry
//!   point runs untouched.
//! - The pool starts on the first allocation hook that needs it. At that moment the exit
//!   handler is registered. Registering at the first allocation (not at the
//!   first `cuGetProcAddress`) matters for exit order: the CUDA runtime registers its own
//!   teardown during its initialisation, before it allocates, so our exit handler, which
//!   `atexit` runs in reverse order, runs first and marks the process as exiting before
//!   the runtime or the driver tears anything down.
//! - Exit: [`cupool::runtime::mark_exiting`] (no CUDA call from the pool from then on),
//!   then the optional `CUPOOL_STATS_AT_EXIT` summary ([`cupool::runtime::write_stats_at_exit`],
//!   the variable parsed by [`cupool::runtime::stats_at_exit_requested`]), one `write(2)`.
//! - `CUPOOL_TRACE`: the pool starts recording when it starts (the runtime reads it), and
//!   the recorder's own exit handler writes what is left.
//! - Fork: the pool registers its own fork handler when it starts
//!   ([`cupool::runtime::mark_fork_child`]); in the child, every hook passes straight
//!   through to the driver (which refuses a forked child anyway) and the C API reports the
//!   pool unavailable.

use core::sync::atomic::{
    AtomicBool, AtomicU8, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use cupool::runtime::Runtime;

/// Set by the exit handler.
static EXITING: AtomicBool = AtomicBool::new(false);
/// Set once our code has seen the pool running.
static POOL_STARTED: AtomicBool = AtomicBool::new(false);
/// `CUPOOL_STATS_AT_EXIT` as read when the handlers were registered.
static STATS_AT_EXIT: AtomicBool = AtomicBool::new(false);

const HANDLERS_NONE: u8 = 0;
const HANDLERS_REGISTERING: u8 = 1;
const HANDLERS_DONE: u8 = 2;
static HANDLERS: AtomicU8 = AtomicU8::new(HANDLERS_NONE);

/// Whether hooks must forward everything to the driver untouched: in a fork child, and
/// when another copy of cupool owns the process's pool (an executable that exports the
/// cupool API itself): the hooks serve only this copy's pool, and one pool per process
/// wins over interposition.
#[inline]
pub fn pass_through() -> bool {
    cupool::runtime::is_fork_child() || cupool::ffi::process_api::forwards_to_other_copy()
}

/// Whether the process has started exiting (our exit handler ran).
#[inline]
pub fn exiting() -> bool {
    EXITING.load(Relaxed)
}

/// The pool for a hook that may start it. `None`: pass the call through (fork child, or
/// the pool cannot start: no device, backend refused, ...).
pub fn runtime() -> Option<&'static Runtime> {
    if pass_through() {
        return None;
    }
    register_handlers_once();
    let rt = match cupool::runtime::runtime_if_started() {
        Some(rt) => rt,
        None => cupool::runtime::runtime().ok()?,
    };
    note_pool_started(rt);
    Some(rt)
}

/// First sight of the running pool from the hooks: it is told that the capture hooks
/// (capture.rs) see every capture begin and end.
#[inline]
fn note_pool_started(rt: &Runtime) {
    if !POOL_STARTED.load(Relaxed) {
        rt.captures_reported_by_caller();
        POOL_STARTED.store(true, Relaxed);
    }
}

/// The pool if it is running; never starts it (frees, queries: a pool that never started
/// owns no pointer).
pub fn runtime_if_started() -> Option<&'static Runtime> {
    if pass_through() {
        return None;
    }
    let rt = cupool::runtime::runtime_if_started()?;
    register_handlers_once();
    note_pool_started(rt);
    Some(rt)
}

fn register_handlers_once() {
    if HANDLERS.load(Acquire) == HANDLERS_DONE {
        return;
    }
    if HANDLERS
        .compare_exchange(HANDLERS_NONE, HANDLERS_REGISTERING, Acquire, Relaxed)
        .is_err()
    {
        return; // another thread is registering, or has
    }
    STATS_AT_EXIT.store(cupool::runtime::stats_at_exit_requested(), Relaxed);
    // SAFETY: plain libc registrations of `extern "C"` functions that never unwind.
    unsafe {
        libc::atexit(on_exit);
    }
    cupool::log::debug("cupool: preload hooks live; exit handler registered");
    HANDLERS.store(HANDLERS_DONE, Release);
}

/// Cleanups other hook modules ask for at exit (files to remove): function pointers in
/// atomics, so that registering one and running them at exit take no lock and allocate
/// nothing, and this module imports none of those modules.
static EXIT_CLEANUPS: [AtomicUsize; 2] = [const { AtomicUsize::new(0) }; 2];

/// Runs `cleanup` at exit (no CUDA call may be made there), once however often it is asked
/// for. Fails only past the fixed number of slots, which would be a bug: a debug assertion.
pub fn at_exit(cleanup: fn()) {
    let f = cleanup as usize;
    for slot in &EXIT_CLEANUPS {
        match slot.compare_exchange(0, f, Relaxed, Relaxed) {
            Ok(_) => return,
            Err(cur) if cur == f => return,
            Err(_) => continue,
        }
    }
    debug_assert!(false, "lifecycle::EXIT_CLEANUPS is full");
}

fn run_exit_cleanups() {
    for slot in &EXIT_CLEANUPS {
        let f = slot.load(Relaxed);
        if f != 0 {
            // SAFETY: only `at_exit` stores here, and only `fn()` pointers.
            let cleanup: fn() = unsafe { core::mem::transmute::<usize, fn()>(f) };
            cleanup();
        }
    }
}

extern "C" fn on_exit() {
    EXITING.store(true, Relaxed);
    let _ = std::panic::catch_unwind(|| {
        cupool::runtime::mark_exiting();
        run_exit_cleanups();
        if STATS_AT_EXIT.load(Relaxed) {
            cupool::runtime::write_stats_at_exit();
        }
    });
}

/// Called from the library constructor: atomics only.
pub fn on_load() {
    // The real dlsym is resolved before any other code can call our `dlsym`.
    crate::real::resolve_real_dlsym();
    // This library prints the exit summary itself (see `on_exit`), once.
    cupool::runtime::claim_stats_at_exit();
    if !cupool::ffi::process_api::forwards_to_other_copy() {
        cupool::ffi::set_interposition_active(true);
        // Note [captures seen by hooks].
        cupool::runtime::Runtime::interposer_reports_captures();
        // Note [stream id cache]: streams.rs reports every stream creation.
        cupool::runtime::stream_ids::creations_seen_by_caller();
    }
}
