//! Note [unmaps off the launching thread]: a move (Note [arena chunks]) unmaps an idle
//! chunk where it was and maps it under a new block, both on the thread that allocates, which
//! is the thread that launches the program's work. On an H200 the GPT loop through
//! `cupool.torch.enable()` paid such calls 1:1 in step time when that thread made them, and
//! nothing when another thread made the same calls (`gpu/workloads/vmm_cycles.py`,
//! docs/BENCHMARKS.md, fourteenth session). The map cannot leave the allocating thread: the
//! driver checks a copy's or memset's addresses when it is queued, and one queued on memory
//! not mapped yet fails at once (`gpu/tools/async_map.cu api`). The unmap can: CUDA lets a
//! handle be mapped at several places, and a map of a handle still mapped elsewhere costs
//! what a plain map costs (`async_map alias`: 24-28 µs at 8 MiB either way). So, with
//! `vmm_deferred_unmap`:
//! - A moved chunk is mapped at its new place at once and its old place is left mapped: a
//!   **stale alias**, in the arena's books unmapped (free address space like any other),
//!   in the driver still mapped. The pool's worker thread unmaps stale aliases one at a time,
//!   oldest first, each under `events`, so its calls never run beside the allocating
//!   thread's (concurrent unmaps made that thread's maps wait: `vmm_cycles.py unmap-bg`).
//! - Every call that needs the address space or the handle first unmaps the stale aliases in
//!   its way on its own thread: a map over part of one (the driver refuses a mapping over
//!   another), a release of a handle that has one, and a release of the arena. Every such
//!   call holds `events`, so the set cannot change under it. A chunk moved back to exactly
//!   its old place takes its alias back, with no call at all.
//! - No memory is held for it: an alias is the same physical memory. Nothing may touch a
//!   stale alias (it is free memory to the program), and nothing does: every block handed out
//!   over those granules maps them first.
//! - Captures: the worker makes its calls under an ordering guard (Note [capture
//!   exclusion]), so none during a capture; the aliases wait for it to end.
//! - The worker is started at the first alias, and again in a process that has none (after
//!   `fork`, where the pool refuses every call anyway). At exit, once no call may start, the
//!   pool waits up to 100 ms for an unmap the worker has in flight, so that none runs while
//!   the driver is torn down; the aliases stay (the address space goes with the process).
//! - More than [`MOST_STALE`] aliases outstanding (the worker falling behind): the oldest is
//!   unmapped by the thread that adds one.
//!
//! Note [simulated unmapper]: a replay on the host backend must give the same figures on
//! every run, and a worker thread's timing would not (which aliases are revived, which are
//! unmapped in the way: a few calls either way from run to run). So a replay puts its pool's
//! unmapper on trace time: no thread is started, and before each event the replaying thread
//! makes the unmaps the worker would have finished by then, one per [`SIMULATED_UNMAP_US`]
//! of trace time, each no earlier than its alias appeared.

use super::super::{pool_by_index, DevicePool, BACKEND_OFF};
use crate::config::{self, Key};
use crate::trace::record::segment as trace_driver;
use crate::trace::DriverAction;
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Stale aliases outstanding at most; past it the thread that adds one unmaps the oldest.
const MOST_STALE: usize = 256;

/// Trace time one unmap of the worker takes in a replay (Note [simulated unmapper]): an
/// old place of 2-8 MiB took 13.6-17.6 µs to unmap on an H200 (`gpu/tools/async_map.cu
/// alias`, docs/BENCHMARKS.md).
pub const SIMULATED_UNMAP_US: u64 = 16;

/// The old place of a moved chunk, still mapped (Note [unmaps off the launching thread]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(in crate::pool) struct Stale {
    pub at: u64,
    pub bytes: u64,
    pub handle: u64,
    /// Trace time it appeared at, in a replay (Note [simulated unmapper]); 0 otherwise.
    pub added_us: u64,
}

impl Stale {
    /// The old place of a moved chunk: `bytes` of `handle` mapped at `at`.
    pub fn new(at: u64, bytes: u64, handle: u64) -> Self {
        Stale {
            at,
            bytes,
            handle,
            added_us: 0,
        }
    }
}

/// A pool's stale aliases and the worker that unmaps them.
#[derive(Default)]
pub(in crate::pool) struct Unmapper {
    /// Oldest first. Changed only with the pool's `events` held (and this lock, for the
    /// worker's wait).
    stale: Mutex<VecDeque<Stale>>,
    added: Condvar,
    /// Process id the worker was started in (0: none).
    worker_pid: AtomicU32,
    /// Unmaps of stale aliases made, by the worker and by other threads, their bytes and
    /// time; and the calls that failed.
    worker_calls: AtomicU64,
    inline_calls: AtomicU64,
    bytes: AtomicU64,
    worker_ns: AtomicU64,
    inline_ns: AtomicU64,
    failures: AtomicU64,
    /// Stale aliases taken back into use instead of a map.
    revived: AtomicU64,
    /// Note [simulated unmapper]: on trace time instead of a thread; the trace time now,
    /// and when the simulated worker is free again.
    simulated: AtomicBool,
    simulated_now_us: AtomicU64,
    simulated_free_at_us: AtomicU64,
}

/// What the unmapper did, for the statistics.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct UnmapperCounts {
    pub worker_calls: u64,
    pub inline_calls: u64,
    pub bytes: u64,
    pub worker_ns: u64,
    pub inline_ns: u64,
    pub failures: u64,
    pub revived: u64,
    /// Stale aliases outstanding now, and their bytes.
    pub stale: u64,
    pub stale_bytes: u64,
}

/// Takes the entries `hit` picks out of `list`, keeping the others in order.
fn take_where(list: &mut VecDeque<Stale>, hit: impl Fn(&Stale) -> bool) -> VecDeque<Stale> {
    let (hits, rest) = list.drain(..).partition(|s| hit(s));
    *list = rest;
    hits
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding it; the list is consistent at every step anyway.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DevicePool {
    /// Whether a moved chunk's old place may be left for the worker now.
    pub(in crate::pool) fn defers_unmaps(&self) -> bool {
        config::get(Key::VmmDeferredUnmap) != 0 && !BACKEND_OFF.load(Ordering::Relaxed)
    }

    /// Leaves a moved chunk's old place mapped for the worker to unmap. The caller holds
    /// `events`.
    pub(in crate::pool) fn leave_stale(&self, s: Stale) {
        let s = Stale {
            added_us: self.unmapper.simulated_now_us.load(Ordering::Relaxed),
            ..s
        };
        let oldest = {
            let mut list = lock(&self.unmapper.stale);
            list.push_back(s);
            (list.len() > MOST_STALE)
                .then(|| list.pop_front())
                .flatten()
        };
        self.unmapper.added.notify_one();
        self.ensure_unmapper();
        if let Some(old) = oldest {
            self.unmap_stale(old, false);
        }
    }

    /// Readies `[at, at + bytes)` for a map of `handle` there. When a stale alias is that
    /// very mapping (a chunk moved back to where it was), it is taken back into use and
    /// true is returned: no map is needed. Otherwise the stale aliases overlapping the
    /// range are unmapped on this thread (the driver refuses a mapping over another), and
    /// false. The caller holds `events`.
    pub(in crate::pool) fn ready_for_map(&self, at: u64, bytes: u64, handle: u64) -> bool {
        let in_way: VecDeque<Stale> = {
            let mut list = lock(&self.unmapper.stale);
            let exact = |s: &Stale| (s.at, s.bytes, s.handle) == (at, bytes, handle);
            if let Some(i) = list.iter().position(exact) {
                list.remove(i);
                self.unmapper.revived.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            take_where(&mut list, |s| s.at < at + bytes && at < s.at + s.bytes)
        };
        for s in in_way {
            self.unmap_stale(s, false);
        }
        false
    }

    /// Unmaps, on this thread, the stale aliases of `handle` (it is about to be released).
    /// The caller holds `events`.
    pub(in crate::pool) fn clear_stale_handle(&self, handle: u64) {
        self.clear_stale_where(|s| s.handle == handle);
    }

    /// Unmaps every stale alias on this thread (the arena is being released). The caller
    /// holds `events`.
    pub(in crate::pool) fn clear_all_stale(&self) {
        self.clear_stale_where(|_| true);
    }

    fn clear_stale_where(&self, hit: impl Fn(&Stale) -> bool) {
        let taken = take_where(&mut lock(&self.unmapper.stale), hit);
        for s in taken {
            self.unmap_stale(s, false);
        }
    }

    fn unmap_stale(&self, s: Stale, by_worker: bool) {
        let u = &self.unmapper;
        let start = Instant::now();
        let r = self.backend.unmap_physical(self.ctx.id, s.at, s.bytes);
        let (calls, ns) = match by_worker {
            true => (&u.worker_calls, &u.worker_ns),
            false => (&u.inline_calls, &u.inline_ns),
        };
        ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        match r {
            Ok(()) => {
                calls.fetch_add(1, Ordering::Relaxed);
                u.bytes.fetch_add(s.bytes, Ordering::Relaxed);
                trace_driver(DriverAction::Unmap, s.at, s.bytes, self.ctx.device);
            }
            Err(e) => {
                // The driver keeps the mapping; the address space stays unusable, as a
                // failed unmap of a chunk leaves it (Note [arena chunks]).
                u.failures.fetch_add(1, Ordering::Relaxed);
                crate::log::warn(&format!(
                    "cupool: device {}: unmapping the old place of moved arena memory ({} bytes at {:#x}) failed: {e:?}",
                    self.ctx.device, s.bytes, s.at
                ));
            }
        }
    }

    fn ensure_unmapper(&self) {
        if self.unmapper.simulated.load(Ordering::Relaxed) {
            return;
        }
        let pid = std::process::id();
        if self.unmapper.worker_pid.swap(pid, Ordering::AcqRel) == pid {
            return;
        }
        // Pools are created once and never freed: the worker may keep this one.
        let Some(pool) = pool_by_index(self.index) else {
            return;
        };
        let started = std::thread::Builder::new()
            .name(format!("cupool-unmap-{}", self.ctx.device))
            .spawn(move || pool.unmapper_loop());
        if let Err(e) = started {
            // The aliases stay until a call in their way, or the list's bound, clears them.
            self.unmapper.worker_pid.store(0, Ordering::Release);
            crate::log::warn(&format!(
                "cupool: could not start the unmapping thread: {e}"
            ));
        }
    }

    fn unmapper_loop(&self) {
        loop {
            {
                let mut list = lock(&self.unmapper.stale);
                while list.is_empty() {
                    list = self
                        .unmapper
                        .added
                        .wait(list)
                        .unwrap_or_else(|p| p.into_inner());
                }
            }
            if BACKEND_OFF.load(Ordering::Relaxed)
                || self.unmapper.simulated.load(Ordering::Relaxed)
            {
                return;
            }
            // Note [capture exclusion]: no calls while a capture is open.
            let Some(_calls) = self.enter_ordering_calls() else {
                std::thread::sleep(Duration::from_micros(200));
                continue;
            };
            let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
            // Exit may have begun while this thread waited ([`DevicePool::quiesce_unmapper`]).
            if BACKEND_OFF.load(Ordering::Relaxed) {
                return;
            }
            let oldest = {
                let mut list = lock(&self.unmapper.stale);
                list.pop_front()
            };
            if let Some(s) = oldest {
                self.unmap_stale(s, true);
            }
        }
    }

    /// Puts this pool's unmapper on trace time (Note [simulated unmapper]): a replay's pool,
    /// before its first event.
    pub fn simulate_unmapper(&self) {
        self.unmapper.simulated.store(true, Ordering::Relaxed);
    }

    /// Note [simulated unmapper]: the trace time is now `now_us`; makes, on this thread, the
    /// unmaps the worker would have finished by then, oldest alias first.
    pub fn run_simulated_unmapper(&self, now_us: u64) {
        let u = &self.unmapper;
        if !u.simulated.load(Ordering::Relaxed) {
            return;
        }
        u.simulated_now_us.store(now_us, Ordering::Relaxed);
        loop {
            let Some(oldest) = lock(&u.stale).front().copied() else {
                return;
            };
            let start = u
                .simulated_free_at_us
                .load(Ordering::Relaxed)
                .max(oldest.added_us);
            if start + SIMULATED_UNMAP_US > now_us {
                return;
            }
            // As the worker: under an ordering guard and `events`.
            let Some(_calls) = self.enter_ordering_calls() else {
                return;
            };
            let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
            let taken = {
                let mut list = lock(&u.stale);
                match list.front() == Some(&oldest) {
                    true => list.pop_front(),
                    false => None,
                }
            };
            if let Some(s) = taken {
                self.unmap_stale(s, true);
                u.simulated_free_at_us
                    .store(start + SIMULATED_UNMAP_US, Ordering::Relaxed);
            }
        }
    }

    /// At exit, once no call may start (`BACKEND_OFF`): waits, at most `bound`, for an
    /// unmap the worker has in flight, so that none runs while the driver is torn down. The
    /// worker makes its calls under `events` and checks the flag once it holds it.
    pub fn quiesce_unmapper(&self, bound: Duration) {
        let start = Instant::now();
        while start.elapsed() < bound {
            match self.events.try_lock() {
                Ok(_) | Err(std::sync::TryLockError::Poisoned(_)) => return,
                Err(std::sync::TryLockError::WouldBlock) => {
                    std::thread::sleep(Duration::from_micros(100))
                }
            }
        }
    }

    /// What the unmapper did so far, and the aliases outstanding.
    pub fn unmapper_counts(&self) -> UnmapperCounts {
        let u = &self.unmapper;
        let list = lock(&u.stale);
        UnmapperCounts {
            worker_calls: u.worker_calls.load(Ordering::Relaxed),
            inline_calls: u.inline_calls.load(Ordering::Relaxed),
            bytes: u.bytes.load(Ordering::Relaxed),
            worker_ns: u.worker_ns.load(Ordering::Relaxed),
            inline_ns: u.inline_ns.load(Ordering::Relaxed),
            failures: u.failures.load(Ordering::Relaxed),
            revived: u.revived.load(Ordering::Relaxed),
            stale: list.len() as u64,
            stale_bytes: list.iter().map(|s| s.bytes).sum(),
        }
    }

    /// Waits up to `bound` for the worker to unmap every stale alias (tests).
    pub fn settle_unmaps(&self, bound: Duration) -> bool {
        let start = Instant::now();
        while !lock(&self.unmapper.stale).is_empty() {
            if start.elapsed() > bound {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        // The worker unmaps the alias it took with `events` held.
        drop(self.events.lock().unwrap_or_else(|p| p.into_inner()));
        true
    }
}
