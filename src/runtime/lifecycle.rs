//! The process's lifecycle as the runtime sees it: exit (no CUDA call from then on), fork
//! (a child never touches the parent's pool), and the `CUPOOL_STATS_AT_EXIT` summary.

use super::{runtime_if_started, Runtime, FORK_CHILD, RUNTIME};
use crate::config;
use crate::pool::BACKEND_OFF;
use core::sync::atomic::{AtomicBool, Ordering};

pub(super) extern "C" fn on_exit() {
    mark_exiting();
}

/// Runs in the child right after `fork`: atomics only (async-signal-safe).
pub(super) extern "C" fn on_fork_child() {
    mark_fork_child();
}

/// The exit summary's handler when no other library prints it ([`claim_stats_at_exit`]).
pub(super) extern "C" fn print_stats_at_exit() {
    let _ = std::panic::catch_unwind(write_stats_at_exit);
}

/// The `CUPOOL_STATS_AT_EXIT` summary: one screen of counters on stderr, one `write(2)`.
/// Counters only: no CUDA call (the driver may already be gone). The one place it is made
/// (the preload library's exit handler calls it too).
pub fn write_stats_at_exit() {
    let pid = std::process::id();
    let mut text = match RUNTIME.get() {
        Some(Ok(rt)) => format!(
            "cupool: statistics at exit (pid {pid}, backend {}, all devices)\n",
            rt.backend.name()
        ),
        _ => format!("cupool: statistics at exit (pid {pid})\n"),
    };
    match runtime_if_started().map(|rt| rt.stats(None)) {
        Some(Ok(stats)) => {
            text.push_str(&stats.to_text());
            for pool in Runtime::pools_of(None) {
                let v = pool.vmm_stats();
                if v.range_bytes > 0 {
                    text.push_str(&v.to_line());
                }
                if let Some(line) = pool.fence_time_stats().to_line(pool.ctx.device) {
                    text.push_str(&line);
                }
            }
            for pool in Runtime::pools_of(None) {
                if let Some(f) = pool.footprint_at_peak() {
                    text.push_str(&format!(
                        "device {}: at the peak, {} bytes reserved:\n",
                        pool.ctx.device, f.reserved
                    ));
                    f.text_lines(&mut text, "  ", &|n| n.to_string());
                }
            }
            if let Some(rt) = runtime_if_started().filter(|rt| rt.host_pool_started()) {
                text.push_str("pinned host memory:\n");
                text.push_str(&rt.host_stats().to_text());
            }
        }
        Some(Err(status)) => {
            text.push_str(&format!("  statistics unavailable: {}\n", status.as_str()));
        }
        None => text.push_str("  the pool never started: no allocation went through cupool\n"),
    }
    crate::log::write_stderr(text.as_bytes());
}

/// Set by a library that prints the exit summary itself (the preload library prints it
/// from its own exit handler, which also covers processes whose pool never started).
pub(super) static STATS_AT_EXIT_CLAIMED: AtomicBool = AtomicBool::new(false);

/// Tells the runtime not to register its own exit summary. Atomics only: callable from a
/// library constructor.
pub fn claim_stats_at_exit() {
    STATS_AT_EXIT_CLAIMED.store(true, Ordering::Relaxed);
}

/// Whether `CUPOOL_STATS_AT_EXIT` asks for the exit summary: a boolean as options take it
/// ([`config::parse_bool`]); unset or empty is off, and a value that is no boolean is off
/// with one line on stderr. The one parser of the variable (the preload library uses it).
pub fn stats_at_exit_requested() -> bool {
    let Ok(value) = std::env::var("CUPOOL_STATS_AT_EXIT") else {
        return false;
    };
    if value.trim().is_empty() {
        return false;
    }
    config::parse_bool(&value).unwrap_or_else(|| {
        crate::log::error(&format!(
            "cupool: CUPOOL_STATS_AT_EXIT='{}' is not a boolean (1/0, true/false, yes/no, on/off); no summary at exit",
            value.trim()
        ));
        false
    })
}

/// Marks the process as a fork child of a process whose pool was live: every later call
/// is refused (the child must never touch the parent's pool or its device memory).
pub fn mark_fork_child() {
    FORK_CHILD.store(true, Ordering::Relaxed);
    BACKEND_OFF.store(true, Ordering::Relaxed);
}

/// Whether this process is such a fork child (the interposer's hooks then pass every call
/// through).
#[inline]
pub fn is_fork_child() -> bool {
    FORK_CHILD.load(Ordering::Relaxed)
}

/// Marks the process as exiting: from now on no CUDA call is made (frees of pool blocks
/// only update metadata; nothing is given back to the driver).
pub fn mark_exiting() {
    BACKEND_OFF.store(true, Ordering::Relaxed);
    // A worker's unmap in flight ends before the driver may go (Note [unmaps off the
    // launching thread]). A fork child has no worker (and may have copied its lock held).
    if !is_fork_child() {
        for pool in crate::pool::all_pools() {
            pool.quiesce_unmapper(std::time::Duration::from_millis(100));
        }
    }
}
