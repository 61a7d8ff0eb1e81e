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
//!
//! Note [fence recorder role]: the driver's fence calls cost much more when consecutive
//! ones come from different threads. With 16 threads taking turns on the try-lock, as every
//! thread whose batch closed did, a record took 1.16 µs and a query 0.57 µs in the pool
//! against 0.40 and 0.32 µs on one thread, and with the calls made one at a time they bound
//! the path (the same pool with its fences taken out ran 4× the pairs). The probe
//! `gpu/tools/fence_threads.cu` shows why: the same calls made by one thread while 15
//! others run cost what they cost alone (record 0.24-0.35 µs, query 0.25-0.51 µs), made in
//! turns 0.56-0.77 and 0.71-0.79 µs. So while [`MANY_CLOSERS`] or more threads close
//! batches, one thread at a time holds the recorder role. A batch that closes elsewhere
//! only asks (`asked`, [`Urge::Ask`]) and returns without touching the lock; the holder's
//! next call records one fence that covers every ticket asked for. A thread that needs its
//! kept blocks now ([`Urge::Try`]: its ready bins are empty) or must be answered
//! ([`Urge::Wait`]) acts whatever the role: with the role gating those calls too, a holder
//! busy with its own pairs left the others' batches uncovered, and 512 B pairs at 16
//! threads fell from 65-81 to 37-44 M/s. The role passes on when its holder has not come
//! back for [`ROLE_IDLE_NS`] (it stopped allocating, or sleeps), and after
//! [`ROLE_TENURE_NS`] even if it has, so that no one thread does every fence call of a busy
//! process. H200, 16 threads of 64 KiB streamless pairs, the role alone: 19.5-29.3 →
//! 33.8-37.4 M pairs/s, fences 166 000-209 000 → 110 000-123 000 a process; 512 B level
//! (docs/BENCHMARKS.md, seventeenth session).
//!
//! Why only with many threads: PyTorch under the preload frees from two threads (the
//! program's and autograd's), whose fence calls rarely meet. With the role for any number
//! of threads the GPT loop's steady step went from 0.99-1.11× native's to 1.05-1.27× in
//! five rounds (noisy, but never better); with fewer than [`MANY_CLOSERS`] threads closing
//! batches in the last ms or two, every thread records for itself as before. Six, not
//! four: with four threads the role cost 64 KiB pairs 12-15% (12.5-15.7 against 14.9-17.9
//! M/s), with six it gained 30% (21.3-24.4 against 16.0-20.2), and from eight on it
//! doubled them (docs/BENCHMARKS.md, seventeenth session). Asking rather than
//! recording is always safe: a batch not yet covered waits, or goes back to the pool (Note
//! [thread fences]). Under the model checker every caller holds the role (no time there);
//! the clock's numbering, which the model checks, does not depend on who records.

use crate::sync::{AtomicU64, LineApart, Lock};
use core::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};

/// A recorded fence, as the backend names it (its `EventHandle`'s value; the clock is
/// model-checked without a backend).
pub type Fence = u64;

/// Fences recorded and not known complete, at most (Note [shared thread fences]).
pub const MAX_IN_FLIGHT: usize = 4;

/// How long the recorder role waits for its holder's next call before another thread may
/// take it (Note [fence recorder role]): a thread that closes a batch every few hundred ns
/// comes back well within it; a thread that stopped allocating leaves the others' batches
/// waiting this long at most, about what one thread's kept blocks last at 16 threads.
pub const ROLE_IDLE_NS: u64 = 20_000;
/// How long one thread keeps the recorder role while it keeps coming back.
pub const ROLE_TENURE_NS: u64 = 200_000;

/// How hard a caller of [`FenceClock::advance`] presses (Note [fence recorder role]).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Urge {
    /// A batch just closed: record only as the recorder role's holder (or taking a role
    /// nobody holds), else leave the ticket for the holder and return.
    Ask,
    /// The caller needs its blocks now: record unless another thread is in the clock.
    Try,
    /// The caller must be answered: wait for the clock.
    Wait,
}

/// Threads whose batches closed lately, for [`FenceClock::many_closers`]: a bit per thread
/// (its number modulo 64), in windows of [`CLOSERS_WINDOW_NS`].
struct Closers {
    now: AtomicU64,
    previous: AtomicU64,
    /// When the current window began (monotonic ns).
    since: AtomicU64,
    window_ns: AtomicU64,
}

/// How many threads must have closed batches in the current or the previous window for
/// the recorder role to apply (Note [fence recorder role]).
pub const MANY_CLOSERS: u32 = 6;
/// The length of a window of [`Closers`].
pub const CLOSERS_WINDOW_NS: u64 = 1_000_000;

/// Who records the shared fences now (Note [fence recorder role]).
struct Role {
    /// The holder's thread token; 0 when nobody holds it.
    holder: AtomicU64,
    /// Until when (monotonic ns) the holder keeps it without coming back.
    until: AtomicU64,
    /// [`ROLE_IDLE_NS`] and [`ROLE_TENURE_NS`] (tests lengthen them).
    idle_ns: AtomicU64,
    tenure_ns: AtomicU64,
}

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
    /// The newest ticket asked for by a thread that did not record.
    asked: LineApart<AtomicU64>,
    closers: LineApart<Closers>,
    role: LineApart<Role>,
    in_flight: Lock<InFlight>,
}

/// Fences recorded and not known complete, oldest first.
struct InFlight {
    fences: [(u64, Fence); MAX_IN_FLIGHT],
    head: usize,
    len: usize,
    /// The number of the newest fence recorded (a record that failed leaves it).
    newest: u64,
    /// When the recorder role's holder took it (monotonic ns; Note [fence recorder role]).
    role_taken: u64,
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
            asked: LineApart(AtomicU64::new(0)),
            closers: LineApart(Closers {
                now: AtomicU64::new(0),
                previous: AtomicU64::new(0),
                since: AtomicU64::new(0),
                window_ns: AtomicU64::new(CLOSERS_WINDOW_NS),
            }),
            role: LineApart(Role {
                holder: AtomicU64::new(0),
                until: AtomicU64::new(0),
                idle_ns: AtomicU64::new(ROLE_IDLE_NS),
                tenure_ns: AtomicU64::new(ROLE_TENURE_NS),
            }),
            in_flight: Lock::new(InFlight {
                fences: [(0, 0); MAX_IN_FLIGHT],
                head: 0,
                len: 0,
                newest: 0,
                role_taken: 0,
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
    /// when no fence recorded yet covers `need` (or a ticket another thread asked for) and
    /// fewer than [`MAX_IN_FLIGHT`] are outstanding, records one (and asks once whether it
    /// completed already). `urge` says when the caller gives up instead (Note [fence
    /// recorder role]). Returns whether `need` is covered now.
    ///
    /// Note [one retire a call]: a call that records retires after the record only, since
    /// a retire before it would ask about the same oldest fence a moment earlier (while
    /// the device is behind, twice the queries for nothing); before the record only when
    /// [`MAX_IN_FLIGHT`] fences leave no room. The retire after the record asks about the
    /// oldest fence, or the new one when it is the only one. On the traces at 1-5 ms of
    /// lag this and Note [galloping fence search] halve the queries (docs/BENCHMARKS.md,
    /// eighteenth session).
    pub fn advance(&self, need: u64, urge: Urge, device: &impl FenceRecorder) -> bool {
        if self.covers(need) {
            return true;
        }
        // Among many closing threads, the caller and the time now (the role goes by them);
        // else None.
        let crowded = match urge {
            Urge::Ask => {
                let me = role::token();
                self.note_closer(me).map(|now| (me, now))
            }
            Urge::Try | Urge::Wait => None,
        };
        if let Some((me, now)) = crowded {
            if !self.may_record(me, now) {
                self.ask(need);
                return false;
            }
        }
        let mut f = if urge == Urge::Wait {
            self.in_flight.lock()
        } else {
            match self.in_flight.try_lock() {
                Some(f) => f,
                None => {
                    self.ask(need);
                    return false;
                }
            }
        };
        if let Some((me, now)) = crowded {
            self.hold_role(&mut f, me, now);
        }
        let target = need.max(self.asked.load(Acquire));
        // One round of queries a call (Note [one retire a call]): before the record only
        // when it needs the room.
        if f.newest >= target || f.len == MAX_IN_FLIGHT {
            self.retire(&mut f, device);
        }
        if f.newest < target && f.len < MAX_IN_FLIGHT {
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

    /// Sets how long the recorder role lasts without its holder and in all, and the
    /// window in which closing threads are counted (tests: times that outlast a thread's
    /// start, so that what one thread did still counts when the next one comes).
    pub fn set_role_times(&self, idle_ns: u64, tenure_ns: u64, window_ns: u64) {
        self.role.idle_ns.store(idle_ns, Relaxed);
        self.role.tenure_ns.store(tenure_ns, Relaxed);
        self.closers.window_ns.store(window_ns, Relaxed);
    }

    /// Leaves ticket `need` for whoever records next.
    ///
    /// Note [asks read first]: among many threads most asks name the ticket another thread
    /// asked for already (a ticket is the newest fence begun, the same for every batch
    /// closed since). A `fetch_max` writes the line even then, so every ask took it from
    /// the other threads' caches: 38% of the clock's samples at 16 threads on the host
    /// backend (docs/BENCHMARKS.md, nineteenth session). A load that finds `need` asked for
    /// leaves the line shared; the caller's ticket already ordered its frees before any
    /// fence that covers it (Note [shared thread fences]), so nothing is lost by not
    /// writing.
    fn ask(&self, need: u64) {
        if self.asked.load(Acquire) < need {
            self.asked.fetch_max(need, AcqRel);
        }
    }

    /// Counts the calling thread (`me`) among those whose batches closed lately; returns
    /// the time now when they are [`MANY_CLOSERS`] or more (Note [fence recorder role]),
    /// else None. A thread already counted among fewer reads two words and no clock: the
    /// path of a program with one such thread. The first call of a window starts the next.
    fn note_closer(&self, me: u64) -> Option<u64> {
        let c = &self.closers;
        let bit = 1u64 << (me % 64);
        let seen = c.now.load(Relaxed);
        if seen & bit != 0 && (seen | c.previous.load(Relaxed)).count_ones() < MANY_CLOSERS {
            return None;
        }
        let now = role::now_ns();
        let since = c.since.load(Relaxed);
        if now.saturating_sub(since) >= c.window_ns.load(Relaxed)
            && c.since
                .compare_exchange(since, now, Relaxed, Relaxed)
                .is_ok()
        {
            c.previous.store(c.now.swap(0, Relaxed), Relaxed);
        }
        let mut seen = c.now.load(Relaxed);
        if seen & bit == 0 {
            seen = c.now.fetch_or(bit, Relaxed) | bit;
        }
        ((seen | c.previous.load(Relaxed)).count_ones() >= MANY_CLOSERS).then_some(now)
    }

    /// Whether [`MANY_CLOSERS`] or more threads closed batches on this clock in the
    /// current or the previous window (as of the last close): their batches wait on fences
    /// one thread records (Note [kept bytes under contention] in `thread_cache/kept.rs`).
    pub fn many_closers(&self) -> bool {
        let c = &self.closers;
        (c.now.load(Relaxed) | c.previous.load(Relaxed)).count_ones() >= MANY_CLOSERS
            && role::now_ns().saturating_sub(c.since.load(Relaxed)) < 2 * c.window_ns.load(Relaxed)
    }

    /// Whether the calling thread (`me`) may record now: it holds the recorder role, or
    /// nobody does, or the holder's time is up (Note [fence recorder role]).
    #[inline]
    fn may_record(&self, me: u64, now: u64) -> bool {
        let holder = self.role.holder.load(Relaxed);
        holder == me || holder == 0 || now >= self.role.until.load(Relaxed)
    }

    /// Takes the recorder role for `me` (or keeps it), under the lock, among many closing
    /// threads (fewer have no role: each records for itself): it stays `me`'s
    /// until [`ROLE_IDLE_NS`] from now, and at most [`ROLE_TENURE_NS`] from when `me` took it
    /// (or the clock's own times).
    fn hold_role(&self, f: &mut InFlight, me: u64, now: u64) {
        if self.role.holder.load(Relaxed) != me {
            self.role.holder.store(me, Relaxed);
            f.role_taken = now;
        }
        let idle = self.role.idle_ns.load(Relaxed);
        let until = (now + idle).min(f.role_taken + self.role.tenure_ns.load(Relaxed));
        // Note [role renewed in steps]: every other closing thread reads `until`; written
        // on each of the holder's calls (every few hundred ns), the line left their caches
        // each time. Renewed once a quarter of the idle time has passed (or cut short at
        // the tenure's end), the holder keeps the role while it comes back within 3/4 of
        // [`ROLE_IDLE_NS`] at least.
        let current = self.role.until.load(Relaxed);
        if until < current || until - current >= idle / 4 {
            self.role.until.store(until, Relaxed);
        }
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

/// The thread token and the time the recorder role goes by (Note [fence recorder role]).
#[cfg(not(loom))]
mod role {
    /// The calling thread's number (up to 64 threads alive together get distinct bits in
    /// [`super::Closers`]).
    #[inline]
    pub(super) fn token() -> u64 {
        crate::thread_number::thread_number()
    }

    /// Monotonic ns (the vDSO: no system call).
    #[inline]
    pub(super) fn now_ns() -> u64 {
        crate::os_time::clock_ns(libc::CLOCK_MONOTONIC)
    }
}

/// Under the model checker every caller holds the role: one token, time standing still.
#[cfg(loom)]
mod role {
    pub(super) fn token() -> u64 {
        1
    }

    pub(super) fn now_ns() -> u64 {
        0
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
