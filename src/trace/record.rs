//! Recording: `CUPOOL_TRACE=path` (read when the pool starts) or `cupool_trace_start(path)`
//! writes every allocation and free of the process, and the pool's own segment events, as
//! RMM's log CSV ([`super::rmm_csv`]), zstd-compressed when the path ends in `.zst`.
//!
//! Files:
//! - `PATH`: the program's events (`allocate`, `free`, `allocate failure`, each with
//!   cupool's columns), failures included (`Result` says why: `out_of_memory`,
//!   `invalid_pointer`, `double_free`, ...). RMM's replay reads it as it is.
//! - the driver file, beside it: `x.csv` → `x.driver.csv`, `x.csv.zst` →
//!   `x.driver.csv.zst`, any other name → `PATH.driver.csv` (+ `.zst` when PATH ends in
//!   `.zst`): `segment_alloc` / `segment_free` rows ([`rmm_csv::DRIVER_HEADER`]), kept apart
//!   because RMM's replay rejects actions it does not know.
//!
//! `%p` in the path becomes the process id (so programs that start other CUDA programs
//! with the same environment get one trace each instead of overwriting one file).
//!
//! Order: each thread's rows are in the order that thread made its calls; threads'
//! buffers reach the file one buffer at a time, so rows of different threads interleave
//! by buffer. `Nanos` (time since the recording started, one clock for all threads) gives
//! the program's order: a stable sort on it. The final flush (stop, exit) merges what is
//! left in every buffer in time order.
//!
//! Note [recording cost]: when no trace is running, a call costs one relaxed load of
//! `SESSION`. When one is, a call appends a 64-byte `Record` (raw clock ticks, no
//! formatting) to its thread's buffer: no lock, no syscall. Rows are made only when a
//! buffer is written out ([`BUFFER_RECORDS`] records, or stop, exit, thread exit): by the
//! thread whose buffer is full, under `STATE`'s mutex, with one `write` per file (one
//! complete zstd frame per write for `.zst`, so everything written survives a crash: a
//! file of several frames is a valid zstd file).
//!
//! Note [buffer hand-over]: a buffer has one owner thread, which appends without a lock:
//! it writes slot `len` and then publishes `len + 1` with a Release store. A flusher (the
//! owner when the buffer is full or the thread exits; `cupool_trace_stop` or the exit
//! handler for every buffer) holds the mutex, reads `len` with Acquire and writes out
//! `[written, len)`, then sets `written = len`. The two never touch the same slot: the
//! owner writes only at index `len`, which is past everything published, and a flusher
//! reads only below the `len` it loaded. Only the owner moves `len` back to 0 (when its
//! buffer is full, when it exits, or at a stop it makes itself), and only while it holds
//! the mutex (no flusher is reading then); a flusher never resets another thread's `len`
//! (an owner appending at that moment would publish slots the flusher has already
//! written, or lose one). Records carry the session they were made in, so one that an
//! owner appends after a stop is dropped, not written into the next trace.
//!
//! Time: raw ticks per event (`rdtsc` on x86-64, `CLOCK_MONOTONIC` elsewhere), turned into
//! nanoseconds when written, at the tick rate measured between the start and that flush
//! against `CLOCK_MONOTONIC` (a rate measured against `CLOCK_REALTIME` would follow clock
//! steps); the time of day comes from `CLOCK_REALTIME` at the start, in local time as RMM
//! writes it.
//!
//! Lifecycle: an exit handler writes what is left (no CUDA call); a thread writes its
//! buffer when it exits; a fork child never writes (its copy of the buffers is dropped).
//! An I/O error prints one line and stops the trace; recording never fails a call.

mod clock;
mod rows;

pub use rows::{driver_path, result_word, NO_DEVICE, NO_STREAM_ID};

use super::rmm_csv;
use super::DriverAction;
use crate::status::{CupoolStatus, Result};
use clock::{clock_ns, ticks, Clock};
use core::cell::{Cell, UnsafeCell};
use core::mem::MaybeUninit;
use core::panic::AssertUnwindSafe;
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use rows::{driver_kind, format_record, Record, Sink};
use rows::{KIND_ALLOCATE, KIND_ALLOCATE_FAILURE, KIND_FREE};
use std::sync::{Mutex, MutexGuard, Once};

/// Records one thread buffers before its owner writes them out (64 bytes each).
pub const BUFFER_RECORDS: usize = 2048;

/// The running trace's number; 0 when none runs. The one load a call makes when off.
static SESSION: AtomicU32 = AtomicU32::new(0);
static NEXT_SESSION: AtomicU32 = AtomicU32::new(1);
/// Set in a fork child of a process that traced: it never writes and never locks.
static FORKED: AtomicBool = AtomicBool::new(false);
static HANDLERS: Once = Once::new();
/// Nanoseconds spent making rows and writing them, all threads (for the benchmark).
static WRITING_NS: AtomicU64 = AtomicU64::new(0);

/// Time spent so far turning records into rows and writing them (formatting, compression,
/// `write`), summed over all threads: the part of the recording cost that is not the
/// per-call append.
pub fn time_spent_writing() -> core::time::Duration {
    core::time::Duration::from_nanos(WRITING_NS.load(Ordering::Relaxed))
}

/// One thread's buffer (Note [buffer hand-over]). Leaked; reused by a later thread once
/// its owner has exited.
struct ThreadBuffer {
    /// The owner's `gettid`; set under the mutex when a thread takes the buffer.
    tid: AtomicU64,
    /// Slots `[0, len)` are written and published (Release by the owner).
    len: AtomicUsize,
    /// Slots `[0, written)` are in the file (changed under the mutex only).
    written: AtomicUsize,
    slots: Box<[UnsafeCell<MaybeUninit<Record>>]>,
}

// SAFETY: slots are shared by the protocol of Note [buffer hand-over]; the rest is atomic.
unsafe impl Sync for ThreadBuffer {}

impl ThreadBuffer {
    fn new() -> Self {
        ThreadBuffer {
            tid: AtomicU64::new(0),
            len: AtomicUsize::new(0),
            written: AtomicUsize::new(0),
            slots: (0..BUFFER_RECORDS)
                .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
                .collect(),
        }
    }

    /// The published records not yet written, marked written. Mutex held.
    fn take_unwritten(&self, _state: &State, out: &mut Vec<(u64, Record)>) {
        let len = self.len.load(Ordering::Acquire);
        let from = self.written.load(Ordering::Relaxed).min(len);
        let tid = self.tid.load(Ordering::Relaxed);
        for slot in &self.slots[from..len] {
            // SAFETY: below the published length: written by the owner, who does not
            // touch it again until it resets under the mutex we hold.
            out.push((tid, unsafe { (*slot.get()).assume_init() }));
        }
        self.written.store(len, Ordering::Relaxed);
    }
}

fn gettid() -> u64 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as u64 }
}

/// The running trace.
struct Session {
    id: u32,
    pid: u32,
    main: Sink,
    driver: Sink,
    clock: Clock,
}

struct State {
    session: Option<Session>,
    buffers: Vec<&'static ThreadBuffer>,
    idle: Vec<&'static ThreadBuffer>,
    /// Events of threads whose thread-local storage is gone (exit handlers).
    orphans: Vec<(u64, Record)>,
}

static STATE: Mutex<State> = Mutex::new(State {
    session: None,
    buffers: Vec::new(),
    idle: Vec::new(),
    orphans: Vec::new(),
});

fn state() -> MutexGuard<'static, State> {
    // A panic while holding it cannot leave it inconsistent in a way that matters here.
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    static CURRENT: Cell<*const ThreadBuffer> = const { Cell::new(core::ptr::null()) };
    static EXIT_FLUSH: ExitFlush = const { ExitFlush };
}

/// Dropped when its thread exits: the thread's buffer is written and handed back.
struct ExitFlush;

impl Drop for ExitFlush {
    fn drop(&mut self) {
        let buf = CURRENT
            .try_with(|c| c.replace(core::ptr::null()))
            .unwrap_or(core::ptr::null());
        if buf.is_null() || is_forked() {
            return;
        }
        // SAFETY: buffers are leaked.
        let buf: &'static ThreadBuffer = unsafe { &*buf };
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut st = state();
            flush_owned(&mut st, buf);
            st.idle.push(buf);
        }));
    }
}

fn is_forked() -> bool {
    FORKED.load(Ordering::Relaxed) || crate::runtime::is_fork_child()
}

/// Whether a trace is running: one relaxed load (Note [recording cost]).
#[inline(always)]
pub fn active() -> bool {
    SESSION.load(Ordering::Relaxed) != 0
}

/// Records an allocation through the runtime: its result, the bytes asked for, the
/// block's size in the pool (0: unknown), the device ([`NO_DEVICE`]: unknown) and, for a
/// stream-ordered call, the stream handle and its id ([`NO_STREAM_ID`]: unknown).
#[inline]
pub fn allocation(
    result: Result<u64>,
    requested: u64,
    rounded: u64,
    device: i32,
    stream: Option<(u64, u64)>,
) {
    let (kind, ptr, status) = match result {
        Ok(p) => (KIND_ALLOCATE, p, 0),
        Err(e) => (KIND_ALLOCATE_FAILURE, 0, e as u8),
    };
    call(kind, ptr, requested, rounded, device, stream, status);
}

/// Records a free through the runtime, failed ones included (`status` then says why).
#[inline]
pub fn free(
    result: Result<()>,
    ptr: u64,
    requested: u64,
    rounded: u64,
    device: i32,
    stream: Option<(u64, u64)>,
) {
    let status = result.err().map_or(0, |e| e as u8);
    call(KIND_FREE, ptr, requested, rounded, device, stream, status);
}

#[inline(always)]
fn call(
    kind: u8,
    ptr: u64,
    size: u64,
    rounded: u64,
    device: i32,
    stream: Option<(u64, u64)>,
    status: u8,
) {
    let session = SESSION.load(Ordering::Relaxed);
    if session == 0 {
        return;
    }
    let (stream, stream_id, streamless) = match stream {
        Some((handle, id)) => (handle, id, false),
        None => (0, NO_STREAM_ID, true),
    };
    push(Record {
        ticks: ticks(),
        ptr,
        size,
        rounded,
        stream,
        stream_id,
        device,
        session,
        kind,
        status,
        streamless,
    });
}

/// Records a segment the pool got from the driver (the driver file).
#[inline]
pub fn segment_alloc(ptr: u64, size: u64, device: i32) {
    segment(DriverAction::SegmentAlloc, ptr, size, device);
}

/// Records a segment the pool gave back to the driver (the driver file).
#[inline]
pub fn segment_free(ptr: u64, size: u64, device: i32) {
    segment(DriverAction::SegmentFree, ptr, size, device);
}

/// Records a driver event of the pool (the driver file): a segment obtained or given
/// back, or a mapping made or removed.
pub fn segment(action: DriverAction, ptr: u64, size: u64, device: i32) {
    let session = SESSION.load(Ordering::Relaxed);
    if session == 0 {
        return;
    }
    let kind = driver_kind(action);
    push(Record {
        ticks: ticks(),
        ptr,
        size,
        rounded: size,
        stream: 0,
        stream_id: NO_STREAM_ID,
        device,
        session,
        kind,
        status: 0,
        streamless: true,
    });
}

/// Appends to this thread's buffer (Note [buffer hand-over]).
#[inline(always)]
fn push(record: Record) {
    let buf = CURRENT.try_with(|c| c.get()).unwrap_or(core::ptr::null());
    let buf: &ThreadBuffer = if buf.is_null() {
        match attach() {
            Some(b) => b,
            None => return push_orphan(record),
        }
    } else {
        // SAFETY: buffers are leaked.
        unsafe { &*buf }
    };
    let mut n = buf.len.load(Ordering::Relaxed);
    if n == BUFFER_RECORDS {
        flush_full(buf);
        n = buf.len.load(Ordering::Relaxed);
    }
    // SAFETY: only the owner (this thread) writes slots, and only at the published
    // length; no flusher reads at or past it (Note [buffer hand-over]).
    unsafe { (*buf.slots[n].get()).write(record) };
    buf.len.store(n + 1, Ordering::Release);
}

#[cold]
fn attach() -> Option<&'static ThreadBuffer> {
    // Registering the exit flush fails once the thread's TLS is being torn down.
    EXIT_FLUSH.try_with(|_| ()).ok()?;
    if is_forked() {
        return None;
    }
    let buf = std::panic::catch_unwind(|| {
        let mut st = state();
        let buf = st.idle.pop().unwrap_or_else(|| {
            let b: &'static ThreadBuffer = Box::leak(Box::new(ThreadBuffer::new()));
            st.buffers.push(b);
            b
        });
        buf.tid.store(gettid(), Ordering::Relaxed);
        buf
    })
    .ok()?;
    CURRENT.try_with(|c| c.set(buf)).ok()?;
    Some(buf)
}

#[cold]
fn push_orphan(record: Record) {
    if is_forked() {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        let mut st = state();
        st.orphans.push((gettid(), record));
        if st.orphans.len() >= BUFFER_RECORDS {
            let mut records = core::mem::take(&mut st.orphans);
            write_records(&mut st, &mut records);
        }
    });
}

/// The owner's buffer is full: write it and start it again.
#[cold]
#[inline(never)]
fn flush_full(buf: &ThreadBuffer) {
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| flush_owned(&mut state(), buf)));
    if r.is_err() {
        // Whatever happened, the owner must get an empty buffer to append to.
        buf.written.store(0, Ordering::Relaxed);
        buf.len.store(0, Ordering::Relaxed);
    }
}

/// Writes the owner's unwritten records and empties its buffer. Called by the owner only,
/// with the mutex held (the one place `len` goes back to 0).
fn flush_owned(st: &mut State, buf: &ThreadBuffer) {
    let mut records = Vec::new();
    buf.take_unwritten(st, &mut records);
    buf.written.store(0, Ordering::Relaxed);
    buf.len.store(0, Ordering::Relaxed);
    write_records(st, &mut records);
}

/// Writes `records` (thread id, record) of the running session; drops the rest. An I/O
/// error ends the trace with one line on stderr.
fn write_records(st: &mut State, records: &mut [(u64, Record)]) {
    let Some(session) = st.session.as_mut() else {
        return;
    };
    // SAFETY: getpid has no preconditions.
    if session.pid != unsafe { libc::getpid() } as u32 {
        return; // a fork child that got here anyway: never write the parent's trace
    }
    let began = clock_ns(libc::CLOCK_MONOTONIC);
    session.clock.calibrate();
    let mut main = String::with_capacity(records.len() * 96);
    let mut driver = String::new();
    for &(tid, r) in records.iter() {
        if r.session == session.id {
            format_record(&session.clock, tid, &r, &mut main, &mut driver);
        }
    }
    let result = session
        .main
        .write_chunk(&main)
        .map_err(|e| (session.main.path.clone(), e))
        .and_then(|()| {
            session
                .driver
                .write_chunk(&driver)
                .map_err(|e| (session.driver.path.clone(), e))
        });
    let spent = clock_ns(libc::CLOCK_MONOTONIC).saturating_sub(began);
    WRITING_NS.fetch_add(spent, Ordering::Relaxed);
    if let Err((path, e)) = result {
        SESSION.store(0, Ordering::Relaxed);
        st.session = None;
        crate::log::error(&format!(
            "cupool: writing the trace {path} failed ({e}); tracing stopped"
        ));
    }
}

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
    let mut st = state();
    stop_locked(&mut st);
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
    st.session = Some(Session {
        id,
        pid,
        main,
        driver,
        clock: Clock::start(),
    });
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

/// Stops recording: everything buffered is written and the files are closed. Without a
/// running trace it does nothing.
pub fn stop() {
    if is_forked() {
        return;
    }
    stop_locked(&mut state());
}

fn stop_locked(st: &mut State) {
    if st.session.is_none() {
        return;
    }
    SESSION.store(0, Ordering::Relaxed);
    let mut records = core::mem::take(&mut st.orphans);
    for buf in st.buffers.clone() {
        buf.take_unwritten(st, &mut records);
    }
    // Merge the threads' last records in time order (a stable sort keeps each thread's).
    records.sort_by_key(|&(_, r)| r.ticks);
    write_records(st, &mut records);
    st.session = None;
    // The calling thread owns its buffer and holds the mutex: it may start it again, so
    // its next trace begins with a whole buffer.
    let own = CURRENT.try_with(|c| c.get()).unwrap_or(core::ptr::null());
    // SAFETY: buffers are leaked.
    if let Some(own) = unsafe { own.as_ref() } {
        own.written.store(0, Ordering::Relaxed);
        own.len.store(0, Ordering::Relaxed);
    }
}

fn register_handlers() {
    HANDLERS.call_once(|| {
        // SAFETY: plain extern "C" functions that never unwind.
        unsafe {
            libc::atexit(on_exit);
            libc::pthread_atfork(None, None, Some(on_fork_child));
        }
    });
}

/// Exit: write what is left, close the files. No CUDA call; only host memory and files.
extern "C" fn on_exit() {
    let _ = std::panic::catch_unwind(stop);
}

/// Fork child: atomics only. The child's copy of the buffers is never written.
extern "C" fn on_fork_child() {
    FORKED.store(true, Ordering::Relaxed);
    SESSION.store(0, Ordering::Relaxed);
}
