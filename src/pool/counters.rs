//! Statistics counters that the fast path can afford (see Note [cheap counters] in
//! `stats.rs`).
//!
//! Each thread has a [`ThreadCounters`] record per device pool that only that thread
//! writes, with relaxed load + store (no locked instruction, no shared cache line). A
//! stats reader sums all records. Levels are signed deltas: a thread that frees blocks
//! another thread allocated goes negative, and the sum is still exact.

use crate::sync::AtomicU64;
use core::sync::atomic::Ordering::Relaxed;

/// The levels kept per thread (reserved bytes are kept exactly under the pool lock).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Level {
    Allocated = 0,
    Requested = 1,
    Cached = 2,
}
pub const LEVELS: usize = 3;

/// The counts kept per thread.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Count {
    Allocs = 0,
    Frees = 1,
}
pub const COUNTS: usize = 2;

/// One thread's counters for one device pool.
pub struct ThreadCounters {
    /// Signed deltas stored as u64 (two's complement).
    levels: [AtomicU64; LEVELS],
    /// Highest value of each delta since this thread last saw a peak reset (owner only).
    high_water: [AtomicU64; LEVELS],
    /// The pool's peak epoch this thread's high-water marks belong to (owner only).
    peak_epoch: AtomicU64,
    counts: [AtomicU64; COUNTS],
    /// Bytes this thread keeps after freeing them without a stream that no completed fence
    /// covers yet (Note [thread fences]): part of the pool's `pending_fence_bytes`. A
    /// signed delta like the levels (a thread's exit handler lowers it on the orphan
    /// record).
    kept_unfenced: AtomicU64,
    /// Bytes this thread holds in its kept batches and ready bins, fenced or not (Note
    /// [thread fences]): memory no other thread can take (Note [room beside stranded
    /// blocks] in `pool/alloc.rs`). A signed delta like the levels.
    kept_held: AtomicU64,
    /// Streamless allocations the pool served by fencing this thread's own kept blocks
    /// since its kept blocks last served it (Note [room beside stranded blocks] in
    /// `pool/alloc.rs`). Owner only; 0 on a record another thread adopts.
    own_fence_streak: AtomicU64,
    /// True for a record that several threads may use at once (the fallback record for
    /// threads whose thread-local storage is gone): then updates use locked RMWs.
    shared: bool,
}

/// Result of raising a level: whether the thread's own delta reached a new high, in which
/// case the caller must recompute the pool-wide peak.
#[must_use]
pub struct Raised(pub bool);

impl ThreadCounters {
    pub fn new(shared: bool) -> Self {
        ThreadCounters {
            levels: core::array::from_fn(|_| AtomicU64::new(0)),
            high_water: core::array::from_fn(|_| AtomicU64::new(0)),
            peak_epoch: AtomicU64::new(0),
            counts: core::array::from_fn(|_| AtomicU64::new(0)),
            kept_unfenced: AtomicU64::new(0),
            kept_held: AtomicU64::new(0),
            own_fence_streak: AtomicU64::new(0),
            shared,
        }
    }

    #[inline]
    fn add(&self, a: &AtomicU64, delta: u64) -> u64 {
        if self.shared {
            a.fetch_add(delta, Relaxed).wrapping_add(delta)
        } else {
            let v = a.load(Relaxed).wrapping_add(delta);
            a.store(v, Relaxed);
            v
        }
    }

    #[inline]
    pub fn count(&self, c: Count) {
        self.add(&self.counts[c as usize], 1);
    }

    /// Raises `level` by `bytes`; returns whether the pool-wide peak must be recomputed.
    #[inline]
    pub fn raise(&self, level: Level, bytes: u64, pool_peak_epoch: u64) -> Raised {
        let v = self.add(&self.levels[level as usize], bytes) as i64;
        let hw = &self.high_water[level as usize];
        if self.peak_epoch.load(Relaxed) != pool_peak_epoch {
            self.peak_epoch.store(pool_peak_epoch, Relaxed);
            for (h, l) in self.high_water.iter().zip(self.levels.iter()) {
                h.store(l.load(Relaxed), Relaxed);
            }
            return Raised(true);
        }
        if v > hw.load(Relaxed) as i64 {
            hw.store(v as u64, Relaxed);
            return Raised(true);
        }
        Raised(false)
    }

    #[inline]
    pub fn lower(&self, level: Level, bytes: u64) {
        self.add(&self.levels[level as usize], bytes.wrapping_neg());
    }

    pub fn level(&self, level: Level) -> i64 {
        self.levels[level as usize].load(Relaxed) as i64
    }

    /// Moves the bytes this thread keeps unfenced up (`bytes` > 0) or down.
    #[inline]
    pub fn keep_unfenced(&self, bytes: i64) {
        self.add(&self.kept_unfenced, bytes as u64);
    }

    /// This record's share of the kept bytes no fence covers yet (a signed delta).
    pub fn kept_unfenced(&self) -> i64 {
        self.kept_unfenced.load(Relaxed) as i64
    }

    /// Moves the bytes this thread holds in kept batches and ready bins up or down.
    #[inline]
    pub fn hold_kept(&self, bytes: i64) {
        self.add(&self.kept_held, bytes as u64);
    }

    /// This record's share of the bytes threads hold in kept batches and ready bins (a
    /// signed delta).
    pub fn kept_held(&self) -> i64 {
        self.kept_held.load(Relaxed) as i64
    }

    /// The streak of Note [room beside stranded blocks].
    #[inline]
    pub fn own_fence_streak(&self) -> u64 {
        self.own_fence_streak.load(Relaxed)
    }

    /// Sets that streak (its owner only).
    #[inline]
    pub fn set_own_fence_streak(&self, n: u64) {
        self.own_fence_streak.store(n, Relaxed);
    }

    pub fn get_count(&self, c: Count) -> u64 {
        self.counts[c as usize].load(Relaxed)
    }

    /// Called when a new thread adopts a record a finished thread left: its high-water
    /// marks restart from the current deltas.
    pub fn adopt(&self) {
        for (h, l) in self.high_water.iter().zip(self.levels.iter()) {
            h.store(l.load(Relaxed), Relaxed);
        }
        self.own_fence_streak.store(0, Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn deltas_go_negative_and_sum_back() {
        let a = ThreadCounters::new(false);
        let b = ThreadCounters::new(false);
        let _ = a.raise(Level::Allocated, 1024, 0);
        b.lower(Level::Allocated, 1024);
        assert_eq!(a.level(Level::Allocated) + b.level(Level::Allocated), 0);
        assert_eq!(b.level(Level::Allocated), -1024);
    }

    #[test]
    fn raise_reports_new_highs_only() {
        let a = ThreadCounters::new(false);
        assert!(a.raise(Level::Allocated, 10, 0).0);
        a.lower(Level::Allocated, 10);
        assert!(
            !a.raise(Level::Allocated, 10, 0).0,
            "back to the old high: no new peak"
        );
        assert!(a.raise(Level::Allocated, 1, 0).0);
        assert!(
            a.raise(Level::Allocated, 0, 1).0,
            "a peak reset re-arms the check"
        );
    }
}
