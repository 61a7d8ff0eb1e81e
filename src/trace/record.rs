//! Recording: `CUPOOL_TRACE=path` (read when the pool starts) or `cupool_trace_start(path)`
//! writes every allocation and free of the process, and the pool's own segment events, as
//! RMM's log CSV ([`super::rmm_csv`]), zstd-compressed when the path ends in `.zst`.
//! Here: the calls that record and the per-thread buffers; `writer`: formatting and writing
//! batches; `session`: start, stop, exit and fork; `rows`: the rows; `clock`: the ticks.
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
//! Order: each thread's rows are in the order that thread made its calls; full buffers reach
//! the file one buffer at a time, in the order they were handed over, so rows of different
//! threads interleave by buffer. `Nanos` (time since the recording started, one clock for
//! all threads) gives the program's order: a stable sort on it. The final flush (stop,
//! exit) writes what was handed over and then merges what is left in every buffer in time
//! order.
//!
//! Note [recording cost]: when no trace is running, a call costs one relaxed load of
//! `SESSION`. When one is, a call appends a 64-byte `Record` (raw clock ticks, no
//! formatting) to its thread's buffer: no lock, no syscall. Once per [`BUFFER_RECORDS`]
//! records the owner hands its full buffer over: under `STATE`'s mutex, held for a pointer
//! swap (the slots go to the queue, a spare or new block of slots takes their place) and a
//! condvar notification. Rows are made by one writer thread per trace, started by
//! [`start`]: it takes the oldest batch from the queue, formats it, compresses it and
//! writes it under `WRITER`'s mutex, with one `write` per file (one complete zstd frame per
//! batch for `.zst`, so everything written survives a crash: a file of several frames is a
//! valid zstd file). The allocating threads never format, compress or write, except: when
//! more than [`MAX_QUEUED`] batches wait (the program makes events faster than the writer
//! writes them), the thread that hands over one more writes the oldest itself, so the
//! queue's memory stays bounded and the program runs at the writer's pace; and when there
//! is no writer thread (it could not be started), every hand-over is written by the thread
//! that makes it, as before. [`time_spent_writing`] sums the CPU time of all writing.
//!
//! Note [buffer hand-over]: a buffer has one owner thread, which appends without a lock:
//! it writes slot `len` and then publishes `len + 1` with a Release store. A flusher
//! (`cupool_trace_stop` or the exit handler, for every buffer) holds the mutex, reads
//! `len` with Acquire and copies out `[written, len)`, then sets `written = len`. The two
//! never touch the same slot: the owner writes only at index `len`, which is past
//! everything published, and a flusher reads only below the `len` it loaded. Only the
//! owner moves `len` back to 0 and replaces its slots (when its buffer is full, when it
//! exits, or at a stop it makes itself), and only while it holds the mutex (no flusher is
//! reading then): a full buffer's slots `[written, len)` move to the queue as one batch,
//! which from then on belongs to whoever pops it; a flusher never resets another thread's
//! `len` (an owner appending at that moment would publish slots the flusher has already
//! written, or lose one). Records carry the session they were made in, so one that an
//! owner appends after a stop is dropped, not written into the next trace.
//!
//! Locks: `WRITER` (the files) is always taken before `STATE` (buffers and queue), and
//! `STATE` is only ever held for short bookkeeping, never while writing. Whoever writes a
//! batch pops it while holding `WRITER`, so a batch is never in flight outside it: a stop
//! that holds `WRITER` sees every handed-over batch either written or in the queue.
//!
//! Time: raw ticks per event (`rdtsc` on x86-64, `CLOCK_MONOTONIC` elsewhere), turned into
//! nanoseconds when written, at the tick rate measured between the start and that flush
//! against `CLOCK_MONOTONIC` (a rate measured against `CLOCK_REALTIME` would follow clock
//! steps); the time of day comes from `CLOCK_REALTIME` at the start, in local time as RMM
//! writes it.
//!
//! Lifecycle: [`stop`] and the exit handler write everything synchronously on the calling
//! thread: under `WRITER` (so after the batch the writer thread may be writing at that
//! moment), the queue in order, then every buffer's rest merged by time; then the files are
//! closed and the writer thread, finding its trace gone, ends. The exit handler waits for
//! `WRITER` at most [`EXIT_WAIT`] (a writer thread stuck in `write` must not hang the exit)
//! and makes no CUDA call. A thread hands its buffer over when it exits. A fork child never
//! writes and never takes either lock (the writer thread does not exist in it, and a lock
//! held at the fork stays held there): its copy of the buffers is dropped. An I/O error
//! prints one line and stops the trace; recording never fails a call.

mod clock;
mod rows;
mod session;
mod writer;

pub use rows::{driver_path, result_word, NO_DEVICE, NO_STREAM_ID};
pub use session::{start, start_from_env, stop};
pub use writer::write_pending;
use writer::write_queued;

use super::rmm_csv;
use super::DriverAction;
use crate::status::Result;
use clock::{ticks, Clock};
use core::cell::Cell;
use core::mem::MaybeUninit;
use core::panic::AssertUnwindSafe;
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use core::time::Duration;
use rows::{driver_kind, Record, Sink};
use rows::{KIND_ALLOCATE, KIND_ALLOCATE_FAILURE, KIND_FREE};
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, Once};

/// Records one thread buffers before it hands them to the writer (64 bytes each).
pub const BUFFER_RECORDS: usize = 2048;
/// Full buffers that may wait for the writer thread (16 MiB of records) before the threads
/// that hand over more write the oldest themselves (Note [recording cost]).
pub const MAX_QUEUED: usize = 128;
/// Written blocks of slots kept for later hand-overs: as many as may be queued, so that
/// once a burst has filled the queue, later ones append to memory already paged in (a
/// fresh block costs the appending thread 32 page faults). At most 16 MiB, kept for the
/// process once a burst has needed them.
const MAX_SPARES: usize = MAX_QUEUED;
/// How long the exit handler waits for a writer thread that is writing.
pub const EXIT_WAIT: Duration = Duration::from_secs(10);

/// The running trace's number; 0 when none runs. The one load a call makes when off.
static SESSION: AtomicU32 = AtomicU32::new(0);
static NEXT_SESSION: AtomicU32 = AtomicU32::new(1);
/// Set in a fork child of a process that traced: it never writes and never locks.
static FORKED: AtomicBool = AtomicBool::new(false);
static HANDLERS: Once = Once::new();
/// CPU nanoseconds spent making rows and writing them, all threads (for the benchmark).
static WRITING_NS: AtomicU64 = AtomicU64::new(0);

/// CPU time spent so far turning records into rows and writing them (formatting,
/// compression, `write`), summed over the threads that did it (the writer thread, and the
/// program's threads when they had to write: Note [recording cost]): the part of the
/// recording cost that is not the per-call append.
pub fn time_spent_writing() -> Duration {
    Duration::from_nanos(WRITING_NS.load(Ordering::Relaxed))
}

/// `BUFFER_RECORDS` record slots on the heap.
type Slots = Box<[MaybeUninit<Record>]>;

fn new_slots() -> Slots {
    Box::new_uninit_slice(BUFFER_RECORDS)
}

fn slots_into_raw(slots: Slots) -> *mut MaybeUninit<Record> {
    debug_assert_eq!(slots.len(), BUFFER_RECORDS);
    Box::into_raw(slots).cast()
}

/// # Safety
/// `ptr` comes from [`slots_into_raw`] and is not used again.
unsafe fn slots_from_raw(ptr: *mut MaybeUninit<Record>) -> Slots {
    // SAFETY: by the caller; the length is the one every block has.
    unsafe { Box::from_raw(core::ptr::slice_from_raw_parts_mut(ptr, BUFFER_RECORDS)) }
}

/// One thread's buffer (Note [buffer hand-over]). Leaked; reused by a later thread once
/// its owner has exited.
struct ThreadBuffer {
    /// The owner's `gettid`; set under the mutex when a thread takes the buffer.
    tid: AtomicU64,
    /// Slots `[0, len)` are written and published (Release by the owner).
    len: AtomicUsize,
    /// Slots `[0, written)` are written out or handed over (changed under the mutex only).
    written: AtomicUsize,
    /// The block the owner appends to (from [`slots_into_raw`]); replaced by the owner,
    /// under the mutex, when it hands its records over.
    slots: AtomicPtr<MaybeUninit<Record>>,
}

impl ThreadBuffer {
    fn new() -> Self {
        ThreadBuffer {
            tid: AtomicU64::new(0),
            len: AtomicUsize::new(0),
            written: AtomicUsize::new(0),
            slots: AtomicPtr::new(slots_into_raw(new_slots())),
        }
    }

    /// Copies the published records not yet written out, and marks them written. Mutex
    /// held (any thread: the owner keeps appending past them).
    fn take_unwritten(&self, _state: &State, out: &mut Vec<(u64, Record)>) {
        let len = self.len.load(Ordering::Acquire);
        let from = self.written.load(Ordering::Relaxed).min(len);
        let tid = self.tid.load(Ordering::Relaxed);
        let slots = self.slots.load(Ordering::Relaxed);
        for i in from..len {
            // SAFETY: below the published length: written by the owner, who does not
            // touch it again until it resets under the mutex we hold.
            out.push((tid, unsafe { (*slots.add(i)).assume_init() }));
        }
        self.written.store(len, Ordering::Relaxed);
    }

    /// Moves the records not yet written out to the queue, as one batch, and empties the
    /// buffer: its block of slots goes with the batch and a spare takes its place. Called
    /// by the owner only, with the mutex held (the one place `len` goes back to 0).
    fn hand_over(&self, st: &mut State) {
        let len = self.len.load(Ordering::Relaxed);
        let from = self.written.load(Ordering::Relaxed).min(len);
        if from < len {
            let spare = st.spares.pop().unwrap_or_else(new_slots);
            let full = self.slots.swap(slots_into_raw(spare), Ordering::Relaxed);
            // SAFETY: the block was installed by `slots_into_raw` and is no longer
            // reachable from the buffer; only the mutex holder reads it (we hold it).
            let slots = unsafe { slots_from_raw(full) };
            st.queue.push_back(Batch::Buffer {
                tid: self.tid.load(Ordering::Relaxed),
                slots,
                from,
                to: len,
            });
        }
        self.written.store(0, Ordering::Relaxed);
        self.len.store(0, Ordering::Relaxed);
    }
}

/// Records waiting for the writer.
enum Batch {
    /// A thread's full (or last) buffer: slots `[from, to)` are records of thread `tid`.
    Buffer {
        tid: u64,
        slots: Slots,
        from: usize,
        to: usize,
    },
    /// Records of threads whose thread-local storage was gone (thread id, record).
    Loose(Vec<(u64, Record)>),
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

/// What writing needs: the files, and room to make rows in (kept between batches).
struct Files {
    session: Option<Session>,
    main: String,
    driver: String,
}

/// The files. Taken before `STATE`, held while writing (Note [recording cost]).
static WRITER: Mutex<Files> = Mutex::new(Files {
    session: None,
    main: String::new(),
    driver: String::new(),
});

struct State {
    buffers: Vec<&'static ThreadBuffer>,
    idle: Vec<&'static ThreadBuffer>,
    /// Events of threads whose thread-local storage is gone (exit handlers).
    orphans: Vec<(u64, Record)>,
    /// Batches handed over, oldest first.
    queue: VecDeque<Batch>,
    /// Written blocks of slots, for the next hand-over.
    spares: Vec<Slots>,
    /// The session whose writer thread runs; 0: none (hand-overs are written by the
    /// threads that make them).
    writer: u32,
}

/// Buffers and the queue; held only for bookkeeping, never while writing.
static STATE: Mutex<State> = Mutex::new(State {
    buffers: Vec::new(),
    idle: Vec::new(),
    orphans: Vec::new(),
    queue: VecDeque::new(),
    spares: Vec::new(),
    writer: 0,
});

/// Signalled when a batch is queued or the writer thread should look at its session.
static WORK: Condvar = Condvar::new();

// A panic while holding either cannot leave it inconsistent in a way that matters here.
fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

fn files() -> MutexGuard<'static, Files> {
    WRITER.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    static CURRENT: Cell<*const ThreadBuffer> = const { Cell::new(core::ptr::null()) };
    static EXIT_FLUSH: ExitFlush = const { ExitFlush };
}

/// Dropped when its thread exits: the thread's records are handed over and its buffer
/// goes back to the idle ones.
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
            buf.hand_over(&mut st);
            st.idle.push(buf);
            handed_over(st);
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
    push(|| Record {
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
    push(|| Record {
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

/// Appends to this thread's buffer (Note [buffer hand-over]). `make` runs once the slot is
/// known, so the record is written straight into it, one field at a time: a record built on
/// the stack and then copied costs a failed store-to-load forward per event (the copy
/// reads 16 bytes that two 8-byte stores have just written), about a fifth of the append.
#[inline(always)]
fn push(make: impl FnOnce() -> Record) {
    let buf = CURRENT.try_with(|c| c.get()).unwrap_or(core::ptr::null());
    let buf: &ThreadBuffer = if buf.is_null() {
        match attach() {
            Some(b) => b,
            None => return push_orphan(make()),
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
    let slots = buf.slots.load(Ordering::Relaxed);
    // SAFETY: `n < BUFFER_RECORDS`, the block's length. Only the owner (this thread)
    // writes slots, and only at the published length; no flusher reads at or past it
    // (Note [buffer hand-over]).
    unsafe { rows::write_fields(slots.add(n).cast::<Record>(), make()) };
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
            let records = core::mem::take(&mut st.orphans);
            st.queue.push_back(Batch::Loose(records));
            handed_over(st);
        }
    });
}

/// The owner's buffer is full: hand it over and start it again.
#[cold]
#[inline(never)]
fn flush_full(buf: &ThreadBuffer) {
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        if is_forked() {
            return Err(());
        }
        let mut st = state();
        buf.hand_over(&mut st);
        handed_over(st);
        Ok(())
    }));
    if !matches!(r, Ok(Ok(()))) {
        // Whatever happened, the owner must get an empty buffer to append to.
        buf.written.store(0, Ordering::Relaxed);
        buf.len.store(0, Ordering::Relaxed);
    }
}

/// After a hand-over (`st` held): wakes the writer thread. Without one, the calling thread
/// writes what is queued itself; when the writer is more than [`MAX_QUEUED`] batches
/// behind, it writes the oldest (Note [recording cost]).
fn handed_over(st: MutexGuard<'static, State>) {
    let queued = st.queue.len();
    let to_write = if st.writer == 0 {
        queued
    } else {
        queued.saturating_sub(MAX_QUEUED)
    };
    drop(st);
    WORK.notify_all();
    if to_write > 0 {
        write_queued(&mut files(), to_write);
    }
}
