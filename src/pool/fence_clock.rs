//! Context fences shared by every thread's kept streamless frees.
//!
//! Note [shared thread fences]: a thread that keeps the blocks it frees without a stream
//! (Note [thread fences] in `thread_cache/kept.rs`) needs, for each batch of them, *a*
//! context fence recorded after the batch's last free; it does not need one of its own.
//! The clock numbers fences in the order their records begin (`started`). A batch that
//! closes takes a ticket, the number of the newest fence begun so far, and is covered by
//! any later fence, once one has completed (`done` ≥ ticket + 1). So one fence covers
//! every batch of every thread closed before it, and the number of fences follows the
//! device's progress rather than the number of threads: at most [`MAX_IN_FLIGHT`] are
//! outstanding, since while the device is behind, another would only complete after them.
//! With one fence per batch and per thread, 16 threads on an H100 got 2.1× one thread's
//! pairs: every fence took the driver's lock, the backend's event list and the capture
//! exclusion (docs/BENCHMARKS.md).
//!
//! Why the ticket is a read-modify-write (`fetch_add(0)`) rather than a load: the batch's
//! frees (and the program's launches before them) must happen before the record of any
//! fence numbered above the ticket. The recorder numbers its fence with a read-modify-write
//! of the same counter before it records; two read-modify-writes of one atomic are ordered,
//! and the later one (acquire) synchronizes with the earlier (release), so either the
//! recorder's comes first (the ticket is at least its number, and only a later fence
//! covers the batch) or the ticket's does (the recorder sees everything the closing thread
//! did before). With a plain load on the ticket's side there is no such edge: the model
//! check in `tests/loom_lockfree.rs` finds a fence that misses the batch.
//!
//! Completion: a context fence covers every stream's work queued before it, so a later
//! fence completing means every earlier one's work is done. Fences are retired oldest first
//! and `done` only grows.

use crate::sync::{AtomicU64, LineApart, Lock};
use core::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};

/// A recorded fence, as the backend names it (its `EventHandle`'s value; the clock is
/// model-checked without a backend).
pub type Fence = u64;

/// Fences recorded and not known complete, at most (Note [shared thread fences]).
pub const MAX_IN_FLIGHT: usize = 4;

/// What the clock needs from a backend: record a context fence now, ask whether one has
/// completed, give a completed one back.
pub trait FenceRecorder {
    /// A context fence covering every stream's work queued so far; `None` when none can be
    /// recorded now (a capture is open, the driver refused).
    fn record(&self) -> Option<Fence>;
    /// Whether the fence has completed (an error counts as not yet).
    fn completed(&self, fence: Fence) -> bool;
    /// Gives a completed fence back.
    fn recycle(&self, fence: Fence);
}

/// The shared fences of one pool's kept batches (Note [shared thread fences]).
pub struct FenceClock {
    /// The number of the newest fence whose record has begun. Every batch close reads it
    /// with a read-modify-write, so it has lines of its own.
    started: LineApart<AtomicU64>,
    /// The number of the newest fence known complete: read by every check, written once a
    /// poll retires fences.
    done: LineApart<AtomicU64>,
    in_flight: Lock<InFlight>,
}

/// Fences recorded and not known complete, oldest first.
struct InFlight {
    fences: [(u64, Fence); MAX_IN_FLIGHT],
    head: usize,
    len: usize,
    /// The number of the newest fence recorded (a record that failed leaves it).
    newest: u64,
    /// Fences recorded and queries made so far (the `fences_recorded` and `fence_queries`
    /// statistics), counted under the lock so the threads' path has no counter to share.
    recorded: u64,
    queries: u64,
}

impl InFlight {
    fn oldest(&self) -> Option<(u64, Fence)> {
        (self.len > 0).then(|| self.fences[self.head])
    }

    fn pop_oldest(&mut self) {
        self.head = (self.head + 1) % MAX_IN_FLIGHT;
        self.len -= 1;
    }

    fn push(&mut self, seq: u64, fence: Fence) {
        self.fences[(self.head + self.len) % MAX_IN_FLIGHT] = (seq, fence);
        self.len += 1;
        self.newest = seq;
    }
}

impl Default for FenceClock {
    fn default() -> Self {
        Self::new()
    }
}

impl FenceClock {
    pub fn new() -> Self {
        FenceClock {
            started: LineApart(AtomicU64::new(0)),
            done: LineApart(AtomicU64::new(0)),
            in_flight: Lock::new(InFlight {
                fences: [(0, 0); MAX_IN_FLIGHT],
                head: 0,
                len: 0,
                newest: 0,
                recorded: 0,
                queries: 0,
            }),
        }
    }

    /// The number a fence must reach to cover everything the caller did before this call
    /// (a batch's frees): one more than the newest fence begun.
    #[inline]
    pub fn ticket(&self) -> u64 {
        self.started.fetch_add(0, AcqRel) + 1
    }

    /// Whether a completed fence covers ticket `need`, without asking the device.
    #[inline]
    pub fn covers(&self, need: u64) -> bool {
        self.done.load(Acquire) >= need
    }

    /// Brings the clock forward for ticket `need`: retires the fences that completed and,
    /// when no fence recorded yet covers `need` and fewer than [`MAX_IN_FLIGHT`] are
    /// outstanding, records one (and asks once whether it completed already). With
    /// `wait_for_lock` false it gives up at once while another thread does this. Returns
    /// whether `need` is covered now.
    pub fn advance(&self, need: u64, wait_for_lock: bool, device: &impl FenceRecorder) -> bool {
        if self.covers(need) {
            return true;
        }
        let mut f = if wait_for_lock {
            self.in_flight.lock()
        } else {
            match self.in_flight.try_lock() {
                Some(f) => f,
                None => return false,
            }
        };
        self.retire(&mut f, device);
        if f.newest < need && f.len < MAX_IN_FLIGHT {
            // Numbered before it is recorded (Note [shared thread fences]).
            let seq = self.started.fetch_add(1, AcqRel) + 1;
            if let Some(fence) = device.record() {
                f.recorded += 1;
                f.push(seq, fence);
                self.retire(&mut f, device);
            }
        }
        drop(f);
        self.covers(need)
    }

    /// Retires completed fences, oldest first, up to the first that has not completed.
    fn retire(&self, f: &mut InFlight, device: &impl FenceRecorder) {
        while let Some((seq, fence)) = f.oldest() {
            f.queries += 1;
            if !device.completed(fence) {
                break;
            }
            f.pop_oldest();
            device.recycle(fence);
            // Fences are numbered in record order under this lock, so `done` only grows.
            self.done.store(seq, Release);
        }
    }

    /// Fences recorded and queries made so far (statistics; takes the lock).
    pub fn recorded_and_queries(&self) -> (u64, u64) {
        let f = self.in_flight.lock();
        (f.recorded, f.queries)
    }

    /// The number of the newest fence begun (the model check's device reads it).
    pub fn started(&self) -> u64 {
        self.started.load(Relaxed)
    }
}
