//! The writing side of a recording: batches of records formatted into rows, compressed
//! and written (Note [recording cost], Note [buffer hand-over] in the parent module), by the
//! session's writer thread or by whoever hands a batch over when the queue is full.

use super::clock::clock_ns;
use super::rows::{format_record, Record};
use super::{files, is_forked, state, Batch, Files, MAX_SPARES, SESSION, WORK, WRITING_NS};
use core::sync::atomic::Ordering;

/// Writes up to `limit` batches from the front of the queue (`WRITER` held: `w`).
pub(super) fn write_queued(w: &mut Files, limit: usize) {
    for _ in 0..limit {
        let batch = state().queue.pop_front();
        match batch {
            Some(batch) => write_batch(w, batch),
            None => break,
        }
    }
}

/// Writes, on the calling thread and now, every batch already handed over (full buffers,
/// those of exited threads), after the one the writer thread may be writing; buffers still
/// being filled stay where they are. For tests and benchmarks: the writer thread does the
/// same on its own.
pub fn write_pending() {
    if is_forked() {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        let mut w = files();
        let queued = state().queue.len();
        write_queued(&mut w, queued);
    });
}

/// Writes one batch, then keeps its block of slots for a later hand-over.
pub(super) fn write_batch(w: &mut Files, batch: Batch) {
    match batch {
        Batch::Buffer {
            tid,
            slots,
            from,
            to,
        } => {
            write_records(
                w,
                slots[from..to].iter().map(|r| {
                    // SAFETY: `[from, to)` were published by the owner before it handed
                    // the block over.
                    (tid, unsafe { r.assume_init() })
                }),
            );
            let extra = {
                let mut st = state();
                if st.spares.len() < MAX_SPARES {
                    st.spares.push(slots);
                    None
                } else {
                    Some(slots)
                }
            };
            drop(extra);
        }
        Batch::Loose(records) => write_records(w, records.into_iter()),
    }
}

/// Writes `records` (thread id, record) of the running session, as one chunk per file;
/// drops the rest. An I/O error ends the trace with one line on stderr.
pub(super) fn write_records(w: &mut Files, records: impl Iterator<Item = (u64, Record)>) {
    let Files {
        session: slot,
        main,
        driver,
    } = w;
    let Some(session) = slot.as_mut() else {
        return;
    };
    // SAFETY: getpid has no preconditions.
    if session.pid != unsafe { libc::getpid() } as u32 {
        return; // a fork child that got here anyway: never write the parent's trace
    }
    let began = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID);
    session.clock.calibrate();
    main.clear();
    driver.clear();
    for (tid, r) in records {
        if r.session == session.id {
            format_record(&session.clock, tid, &r, main, driver);
        }
    }
    let result = session
        .main
        .write_chunk(main)
        .map_err(|e| (session.main.path.clone(), e))
        .and_then(|()| {
            session
                .driver
                .write_chunk(driver)
                .map_err(|e| (session.driver.path.clone(), e))
        });
    let spent = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID).saturating_sub(began);
    WRITING_NS.fetch_add(spent, Ordering::Relaxed);
    if let Err((path, e)) = result {
        SESSION.store(0, Ordering::Relaxed);
        *slot = None;
        // The writer thread ends; what is queued can never be written.
        let dropped = {
            let mut st = state();
            st.writer = 0;
            core::mem::take(&mut st.queue)
        };
        WORK.notify_all();
        drop(dropped);
        crate::log::error(&format!(
            "cupool: writing the trace {path} failed ({e}); tracing stopped"
        ));
    }
}

/// The writer thread of session `id`: writes the queue's batches, oldest first, until its
/// session is no longer the one running.
pub(super) fn writer_thread(id: u32) {
    loop {
        {
            let mut st = state();
            while st.writer == id && st.queue.is_empty() {
                st = WORK.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.writer != id {
                return;
            }
        }
        let _ = std::panic::catch_unwind(|| {
            let mut w = files();
            // Popped under `WRITER`: a stop, which holds it, sees every batch written or
            // queued.
            let batch = {
                let mut st = state();
                if st.writer == id {
                    st.queue.pop_front()
                } else {
                    None
                }
            };
            if let Some(batch) = batch {
                write_batch(&mut w, batch);
            }
        });
    }
}
