//! A recording's life: starting one (files, writer thread, exit and fork handlers),
//! stopping it (everything written synchronously), and what happens at exit and in a fork
//! child (Lifecycle in the parent module).

use super::clock::Clock;
use super::rows::{driver_path, Sink};
use super::writer::{write_batch, write_records, writer_thread};
use super::{
    active, files, is_forked, rmm_csv, state, Files, Session, CURRENT, EXIT_WAIT, FORKED, HANDLERS,
    NEXT_SESSION, SESSION, WORK, WRITER,
};
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;
use core::time::Duration;
use std::sync::TryLockError;

/// Starts recording to `path` (`%p`: the process id). A trace already running is stopped
/// (written out and closed) first. Errors: an empty path `CupoolErrorInvalidValue`; a file
/// that cannot be created `CupoolErrorIo` (one line on stderr says why); in a fork child
/// of a traced process or of a live pool, `CupoolErrorBackendUnavailable`.
pub fn start(path: &str) -> Result<()> {
    if path.is_empty() {
        return Err(CupoolStatus::CupoolErrorInvalidValue);
    }
    if is_forked() {
        return Err(CupoolStatus::CupoolErrorBackendUnavailable);
    }
    register_handlers();
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    let path = path.replace("%p", &pid.to_string());
    let mut w = files();
    stop_locked(&mut w);
    let driver_path = driver_path(&path);
    let sinks = Sink::create(&path)
        .map_err(|e| (path.clone(), e))
        .and_then(|main| {
            Sink::create(&driver_path)
                .map(|driver| (main, driver))
                .map_err(|e| (driver_path.clone(), e))
        })
        .and_then(|(mut main, mut driver)| {
            main.write_chunk(&format!("{}\n", rmm_csv::header()))
                .map_err(|e| (path.clone(), e))?;
            driver
                .write_chunk(&format!("{}\n", rmm_csv::DRIVER_HEADER))
                .map_err(|e| (driver_path.clone(), e))?;
            Ok((main, driver))
        });
    let (main, driver) = match sinks {
        Ok(s) => s,
        Err((p, e)) => {
            crate::log::error(&format!("cupool: cannot create the trace {p}: {e}"));
            return Err(CupoolStatus::CupoolErrorIo);
        }
    };
    let mut id = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
    if id == 0 {
        id = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
    }
    w.session = Some(Session {
        id,
        pid,
        main,
        driver,
        clock: Clock::start(),
    });
    // The writer thread runs while `writer` names its session: set before it starts.
    state().writer = id;
    let spawned = std::thread::Builder::new()
        .name("cupool-trace".into())
        .spawn(move || writer_thread(id));
    if spawned.is_err() {
        // No writer thread: the program's threads write what they hand over.
        state().writer = 0;
    }
    SESSION.store(id, Ordering::Relaxed);
    crate::log::info(&format!("cupool: recording allocations to {path}"));
    Ok(())
}

/// `CUPOOL_TRACE`, when set and no trace runs yet (the runtime calls this when it starts;
/// a trace started through the API before that is kept). A failure is reported on stderr.
pub fn start_from_env() {
    match std::env::var("CUPOOL_TRACE") {
        Ok(path) if !path.trim().is_empty() && !active() => {
            let _ = start(path.trim());
        }
        _ => {}
    }
}

/// Stops recording: everything recorded is written, on the calling thread, and the files
/// are closed. Without a running trace it does nothing.
pub fn stop() {
    if is_forked() {
        return;
    }
    stop_locked(&mut files());
}

/// Stops the running trace (`WRITER` held: `w`; Note [recording cost]).
pub(super) fn stop_locked(w: &mut Files) {
    if w.session.is_none() {
        return;
    }
    SESSION.store(0, Ordering::Relaxed);
    let (queued, mut rest) = {
        let mut st = state();
        st.writer = 0; // the writer thread ends
        let queued = core::mem::take(&mut st.queue);
        let mut rest = core::mem::take(&mut st.orphans);
        for buf in &st.buffers {
            buf.take_unwritten(&st, &mut rest);
        }
        // The calling thread owns its buffer and holds the mutex: it may start it again,
        // so its next trace begins with a whole buffer.
        let own = CURRENT.try_with(|c| c.get()).unwrap_or(core::ptr::null());
        // SAFETY: buffers are leaked.
        if let Some(own) = unsafe { own.as_ref() } {
            own.written.store(0, Ordering::Relaxed);
            own.len.store(0, Ordering::Relaxed);
        }
        (queued, rest)
    };
    WORK.notify_all();
    // What was handed over first (each thread's earlier records), then the threads' last
    // records merged in time order (a stable sort keeps each thread's).
    for batch in queued {
        write_batch(w, batch);
    }
    rest.sort_by_key(|&(_, r)| r.ticks);
    write_records(w, rest.into_iter());
    w.session = None;
}

pub(super) fn register_handlers() {
    HANDLERS.call_once(|| {
        // SAFETY: plain extern "C" functions that never unwind.
        unsafe {
            libc::atexit(on_exit);
            libc::pthread_atfork(None, None, Some(on_fork_child));
        }
    });
}

/// Exit: write what is left, close the files, on the exiting thread. No CUDA call; only
/// host memory and files. Waits for a writer thread that is writing at most [`EXIT_WAIT`].
extern "C" fn on_exit() {
    let _ = std::panic::catch_unwind(|| {
        if is_forked() {
            return;
        }
        let waited = std::time::Instant::now();
        let mut w = loop {
            match WRITER.try_lock() {
                Ok(w) => break w,
                Err(TryLockError::Poisoned(e)) => break e.into_inner(),
                Err(TryLockError::WouldBlock) if waited.elapsed() < EXIT_WAIT => {
                    std::thread::sleep(Duration::from_micros(100));
                }
                Err(TryLockError::WouldBlock) => {
                    crate::log::error(
                        "cupool: the trace writer did not finish writing at exit; the trace \
                         misses its last events",
                    );
                    return;
                }
            }
        };
        stop_locked(&mut w);
    });
}

/// Fork child: atomics only. The child's copy of the buffers is never written, and it
/// never takes `WRITER` or `STATE` (either may have been held by another thread at the
/// fork).
extern "C" fn on_fork_child() {
    FORKED.store(true, Ordering::Relaxed);
    SESSION.store(0, Ordering::Relaxed);
}
