//! Note [thread fences]: with `thread_cache_streamless`, small blocks freed without a
//! stream are kept by the freeing thread, in batches per pool. A batch closes after
//! `fence_batch` frees or 1 MiB, half of what a thread alone may keep (after a quarter of
//! `fence_batch` or of that when no other batch waits for its fence, or on a miss) and takes a
//! ticket of the pool's shared thread fences: the frees came before the ticket
//! in this thread's program order, so any fence numbered at or above it covers the work
//! that used the blocks (Note [shared thread fences] in `pool/fence_clock.rs`). Once such a
//! fence has completed (an atomic load), the batch's blocks move to per-class ready bins,
//! where this thread's streamless allocations take them: no pool lock and no shared state
//! on the way. Before the pool grows, and on `empty_cache` or OOM, the batches go back to
//! the pool (to its fence queue unless a fence covers them).
//!
//! Note [stale kept blocks]: a thread that stops allocating the sizes it kept (a loop of
//! 512 B pairs, then one of 1 MiB pairs) would hold those blocks until the pool grows, and
//! they split the segments they lie in: the 1 MiB loop then found one 1 MiB place in its
//! 2 MiB segment instead of two, and needed a fence for every pair instead of every second
//! (the preload's 1 MiB pair after 512 B ones: 1.30-1.46 µs against 0.86-0.95 µs on an H100,
//! docs/BENCHMARKS.md). After [`STALE_AFTER_MISSES`] streamless allocations in a row that
//! they did not serve, the kept blocks go back to the pool, where they merge. 16 rather
//! than 64: with 64, a kept block of `streamless_behind` made the pool grow one more small
//! segment (host replay 95.14% → 94.77%); with 16 every corpus trace stays at ≥ 95% at lag
//! 0, and PyTorch's steps under the preload took the same time (docs/BENCHMARKS.md).

use super::super::block::{BlockIdx, Place, NIL};
use super::super::counters::ThreadCounters;
use super::super::fence_clock::Urge;
use super::super::size_class::class_of;
use super::super::{pool_by_index, DevicePool, BLOCKS, SMALL_MAX, STREAMLESS};
use super::thread_counters;
use super::{Limits, ThreadCache};

/// Most streamless frees a kept batch holds; it closes after `fence_batch` of them (one
/// context fence, and one pool lock, per batch).
pub const KEPT_BATCH: usize = 64;
/// Largest block a thread keeps. A batch must hold several blocks to share a fence: a
/// larger block fills half of what a batch holds alone, so its batch would close at once,
/// one fence per free, which the pool's own path does better (Note [lone fences]): the
/// preload's 1 MiB pair took 576-579 ns kept against 447-453 ns through the pool on an H100
/// (docs/BENCHMARKS.md).
const KEPT_MAX_BLOCK: u64 = KEPT_MAX_BYTES / 8;
// A kept block is a small one (Note [room beside stranded blocks] grows a small segment).
const _: () = assert!(KEPT_MAX_BLOCK <= SMALL_MAX);
/// Streamless allocations in a row that the kept blocks did not serve, after which the
/// thread gives them back (Note [stale kept blocks]).
const STALE_AFTER_MISSES: u32 = 16;
/// Most bytes a thread keeps in batches and ready bins: a small segment's worth, so that
/// the blocks it holds back from merging never cost the pool a segment (measured in
/// `docs/BENCHMARKS.md`: more let the replays' footprint grow: 4 MiB took the `streamless`
/// trace from 95.81% to 94.70-95.07%). A batch closes at half of it, so that a batch of
/// large blocks closes (and can become ready) before the thread runs out of room and its
/// frees go to the pool (with a count alone, 14% of a loop's allocations missed).
pub(super) const KEPT_MAX_BYTES: u64 = 2 << 20;
/// Note [kept bytes under contention]: what a thread may keep while many threads' batches
/// wait on the same shared fences ([`DevicePool::thread_fences_crowded`]). Their fences
/// are then recorded one at a time for everyone (Note [fence recorder role]), so a batch
/// waits longer to be covered, and a thread with 2 MiB kept ran dry meanwhile and took
/// its blocks from the pool under its lock, with the other threads. 16 threads of 64 KiB
/// streamless pairs on an H200 with the recorder role: 33.8-37.4 M pairs/s with 2 MiB,
/// 54.2-67.7 M with 4 MiB, 42.8-45.3 M with 8 MiB (docs/BENCHMARKS.md, seventeenth
/// session). A program with fewer such threads keeps 2 MiB, so the replays (one thread)
/// do not change; one with N keeps at most N × 2 MiB more. The batches keep the size they
/// have at 2 MiB (closed at 1 MiB, early at 512 KiB): the room goes to more batches in
/// flight, not larger ones. Batches of half the 4 MiB (32 blocks of 64 KiB) left 1.8% of
/// 16 threads' allocations to the pool under its lock; closing at 1 MiB left less than
/// half as many, and 16 threads' 64 KiB pairs went from 41.2-43.9 to 47.0-53.8 M/s in one
/// call and from 33.7-39.1 to 37.0-61.4 in another, 512 B level (docs/BENCHMARKS.md,
/// eighteenth session).
pub(super) const KEPT_MAX_BYTES_SHARED: u64 = 4 << 20;
/// What an open batch holds when it may close before it is full (with a quarter of
/// `fence_batch` frees, whichever comes first): a quarter of what a thread alone keeps.
pub const KEPT_CLOSABLE_BYTES: u64 = KEPT_MAX_BYTES / 4;
/// Batches a thread keeps at once (open or closed, any pools).
pub(super) const KEPT_BATCHES: usize = 4;
/// Size classes of the blocks a thread keeps (small blocks only).
const READY_CLASSES: usize = class_of(SMALL_MAX) + 1;
/// Blocks per class ready for reuse.
const READY_CAP: usize = KEPT_BATCH;

/// Kept blocks whose fence is known complete, by size class, for one pool: what the
/// thread's streamless allocations take without a lock.
pub(super) struct Ready {
    pub(super) pool: u16,
    pub(super) bytes: u64,
    pub(super) len: [u8; READY_CLASSES],
    pub(super) items: [[BlockIdx; READY_CAP]; READY_CLASSES],
}

/// Streamless frees of one pool kept by their thread until a fence covers them.
#[derive(Copy, Clone)]
pub(super) struct Kept {
    pub(super) live: bool,
    /// Closed: full, its ticket taken; no more blocks join it.
    pub(super) closed: bool,
    pub(super) pool: u16,
    /// Once closed, the shared thread fence that covers it
    /// ([`DevicePool::thread_fence_ticket`]).
    pub(super) need: u64,
    /// When it was opened (this cache's tick): the oldest goes back first.
    pub(super) opened: u64,
    pub(super) len: u32,
    pub(super) bytes: u64,
    pub(super) items: [BlockIdx; KEPT_BATCH],
}

impl Kept {
    pub(super) const EMPTY: Kept = Kept {
        live: false,
        closed: false,
        pool: 0,
        need: 0,
        opened: 0,
        len: 0,
        bytes: 0,
        items: [NIL; KEPT_BATCH],
    };
}

impl Ready {
    pub(super) fn new() -> Self {
        Ready {
            pool: 0,
            bytes: 0,
            len: [0; READY_CLASSES],
            items: [[NIL; READY_CAP]; READY_CLASSES],
        }
    }
}

impl ThreadCache {
    /// Keeps a block freed without a stream (Note [thread fences]); returns false (and
    /// keeps nothing) when the cache is off for this block or full: then the caller gives
    /// it to the pool's fence queue. `c` is the calling thread's counters for `pool` (the
    /// caller has them at hand: no second thread-local lookup on the free path).
    #[inline]
    pub fn put_streamless(
        &mut self,
        pool: &DevicePool,
        c: &ThreadCounters,
        idx: BlockIdx,
        size: u64,
    ) -> bool {
        if !self.keeps_streamless(size) {
            return false;
        }
        self.check_flush_request();
        if self.bytes + size > self.limits.max_bytes || self.kept_bytes() + size > self.kept_cap {
            return false;
        }
        let k = match self
            .kept
            .iter()
            .position(|b| b.live && !b.closed && b.pool == pool.index)
        {
            Some(k) => k,
            None => {
                // A free batch, else the oldest goes back to its pool.
                let k = match self.kept.iter().position(|b| !b.live) {
                    Some(k) => k,
                    None => {
                        let oldest = (0..KEPT_BATCHES)
                            .min_by_key(|&k| self.kept[k].opened)
                            .unwrap_or(0);
                        self.flush_kept(oldest);
                        oldest
                    }
                };
                self.tick += 1;
                self.kept[k] = Kept {
                    live: true,
                    pool: pool.index,
                    opened: self.tick,
                    ..Kept::EMPTY
                };
                k
            }
        };
        // SAFETY: the caller owns the block and hands it to this thread's cache.
        BLOCKS.get(idx).set_place(Place::ThreadCache);
        let d = unsafe { BLOCKS.get(idx).data() };
        d.stream = STREAMLESS;
        let b = &mut self.kept[k];
        b.items[b.len as usize] = idx;
        b.len += 1;
        b.bytes += size;
        self.bytes += size;
        c.keep_unfenced(size as i64);
        c.hold_kept(size as i64);
        // Note [kept bytes under contention]: the batch size of the 2 MiB a thread keeps
        // alone, whatever it may keep.
        let full = b.len as usize >= self.limits.batch || b.bytes >= KEPT_MAX_BYTES / 2;
        // Early, while no batch of this pool waits for its fence: so that the fence runs
        // while the thread still has ready blocks, rather than from its next miss on.
        if full || (self.closable(k) && !self.awaiting_fence(pool.index)) {
            self.close_kept(k, pool);
        }
        true
    }

    /// Whether this thread keeps a block of `size` bytes when it is freed without a stream.
    /// Small blocks only: a large block freed and allocated again in a loop is the case
    /// Note [lone fences] in the pool module handles (a second copy instead of a fence per
    /// reuse), and large programs' buffers are few.
    #[inline]
    pub fn keeps_streamless(&mut self, size: u64) -> bool {
        if self.limits.generation != crate::config::generation() {
            self.limits = Limits::read();
        }
        self.limits.enabled
            && self.limits.streamless
            && size <= KEPT_MAX_BLOCK.min(self.limits.max_block)
    }

    /// Whether the open batch `k` holds enough to close before it is full: a quarter of
    /// `fence_batch` frees or of what a thread alone may keep.
    fn closable(&self, k: usize) -> bool {
        let b = &self.kept[k];
        b.len as usize >= self.limits.batch.div_ceil(4) || b.bytes >= KEPT_CLOSABLE_BYTES
    }

    /// Whether a closed batch of `pool` has not been made ready yet.
    fn awaiting_fence(&self, pool: u16) -> bool {
        self.kept
            .iter()
            .any(|b| b.live && b.closed && b.pool == pool)
    }

    /// A block for a streamless allocation of at least `size` bytes from `pool`: from the
    /// blocks this thread kept whose fence is known complete (Note [thread fences]).
    #[inline]
    pub fn take_streamless(&mut self, pool: &DevicePool, size: u64) -> Option<BlockIdx> {
        let holds = self.ready.bytes > 0 || self.kept.iter().any(|b| b.live);
        if !holds {
            return None;
        }
        let found = self.take_kept(pool, size);
        if found.is_some() {
            self.kept_misses = 0;
        } else {
            self.kept_misses += 1;
            if self.kept_misses >= STALE_AFTER_MISSES {
                // Note [stale kept blocks].
                self.kept_misses = 0;
                self.flush_streamless(pool.index);
            }
        }
        found
    }

    /// Gives the blocks this thread keeps for `pool` back to it; returns whether some went
    /// to its fence queue.
    pub(super) fn flush_streamless(&mut self, pool: u16) -> bool {
        let mut to_fence = false;
        for k in 0..KEPT_BATCHES {
            if self.kept[k].pool == pool {
                to_fence |= self.flush_kept(k);
            }
        }
        if self.ready.pool == pool {
            self.flush_ready();
        }
        to_fence
    }

    #[inline]
    fn take_kept(&mut self, pool: &DevicePool, size: u64) -> Option<BlockIdx> {
        if size > KEPT_MAX_BLOCK {
            return None;
        }
        self.check_flush_request();
        let class = class_of(size);
        if let Some(idx) = self.pop_ready(pool.index, class, size) {
            return Some(idx);
        }
        // Closed batches of this pool: their blocks become ready once a shared fence
        // covers them.
        if !self.ready_covered(pool) {
            // A miss with a quarter batch kept: the batch closes now, so that the pool does
            // not grow (or take the blocks back before growing) while this thread holds
            // enough to serve itself once one fence completes.
            let open = (0..KEPT_BATCHES).find(|&k| {
                let b = &self.kept[k];
                b.live && !b.closed && b.pool == pool.index
            });
            if let Some(k) = open.filter(|&k| self.closable(k)) {
                self.close_kept(k, pool);
            }
            if !self.ready_covered(pool) {
                return None;
            }
        }
        self.pop_ready(pool.index, class, size)
    }

    /// Moves this pool's closed batches that a completed shared fence covers to the ready
    /// bins, first bringing the fences forward for the oldest (unless another thread is).
    /// Returns whether any moved.
    fn ready_covered(&mut self, pool: &DevicePool) -> bool {
        let closed = |b: &Kept| b.live && b.closed && b.pool == pool.index;
        let Some(oldest) = self.kept.iter().filter(|b| closed(b)).map(|b| b.need).min() else {
            return false;
        };
        if !pool.thread_fence_covers(oldest) && !pool.advance_thread_fences(oldest, Urge::Try) {
            return false;
        }
        let mut moved = false;
        for k in 0..KEPT_BATCHES {
            let b = &self.kept[k];
            if closed(b) && pool.thread_fence_covers(b.need) {
                self.make_ready(k, pool);
                moved = true;
            }
        }
        moved
    }

    #[inline]
    fn pop_ready(&mut self, pool: u16, class: usize, size: u64) -> Option<BlockIdx> {
        let r = &mut self.ready;
        let n = r.len[class] as usize;
        if r.pool != pool || n == 0 {
            return None;
        }
        let idx = r.items[class][n - 1];
        // SAFETY: blocks in this thread's cache are owned by this thread.
        let block = unsafe { BLOCKS.get(idx).data() }.size;
        if block < size {
            return None;
        }
        r.len[class] -= 1;
        r.bytes -= block;
        self.bytes -= block;
        Some(idx)
    }

    /// Bytes in kept batches and ready bins.
    fn kept_bytes(&self) -> u64 {
        self.ready.bytes + self.kept.iter().map(|b| b.bytes).sum::<u64>()
    }

    /// Closes the open batch `k`: no more blocks join it, and it takes a ticket of the
    /// shared thread fences, asking for a fence to be recorded now unless another thread
    /// is doing that.
    fn close_kept(&mut self, k: usize, pool: &DevicePool) {
        let need = pool.thread_fence_ticket();
        self.kept[k].closed = true;
        self.kept[k].need = need;
        pool.advance_thread_fences(need, Urge::Ask);
        // Note [kept bytes under contention]: read once a batch, not on every free.
        self.kept_cap = if pool.thread_fences_crowded() {
            KEPT_MAX_BYTES_SHARED
        } else {
            KEPT_MAX_BYTES
        };
    }

    /// Moves the blocks of the covered batch `k` to the ready bins (first giving the bins
    /// of another pool back to it); a block whose bin is full goes to the pool.
    fn make_ready(&mut self, k: usize, pool: &DevicePool) {
        if self.ready.pool != pool.index && self.ready.bytes > 0 {
            self.flush_ready();
        }
        self.ready.pool = pool.index;
        let b = self.kept[k];
        self.kept[k] = Kept::EMPTY;
        let counters = thread_counters(pool.index);
        counters.keep_unfenced(-(b.bytes as i64));
        let mut overflow = [NIL; KEPT_BATCH];
        let mut n = 0;
        for &idx in &b.items[..b.len as usize] {
            // SAFETY: owned by this thread's cache.
            let size = unsafe { BLOCKS.get(idx).data().size };
            let class = class_of(size);
            let r = &mut self.ready;
            let len = r.len[class] as usize;
            if len == READY_CAP {
                overflow[n] = idx;
                n += 1;
                self.bytes -= size;
                counters.hold_kept(-(size as i64));
                continue;
            }
            r.items[class][len] = idx;
            r.len[class] += 1;
            r.bytes += size;
        }
        // SAFETY: the blocks leave this thread's cache; their fence completed.
        unsafe { pool.take_kept(&overflow[..n], true) };
    }

    /// Gives the ready blocks back to their pool.
    pub(super) fn flush_ready(&mut self) {
        let pool = pool_by_index(self.ready.pool);
        let r = &mut self.ready;
        for class in 0..READY_CLASSES {
            let n = r.len[class] as usize;
            if n == 0 {
                continue;
            }
            if let Some(p) = pool {
                // SAFETY: the blocks leave this thread's cache; their fence completed.
                unsafe { p.take_kept(&r.items[class][..n], true) };
            }
            r.len[class] = 0;
        }
        if r.bytes > 0 {
            thread_counters(r.pool).hold_kept(-(r.bytes as i64));
        }
        self.bytes -= r.bytes;
        r.bytes = 0;
    }

    /// Gives the kept batch `k` back to its pool; returns whether its blocks went to the
    /// fence queue (no completed fence covered them yet).
    pub(super) fn flush_kept(&mut self, k: usize) -> bool {
        let b = self.kept[k];
        if !b.live {
            return false;
        }
        self.kept[k] = Kept::EMPTY;
        self.bytes -= b.bytes;
        let counters = thread_counters(b.pool);
        counters.keep_unfenced(-(b.bytes as i64));
        counters.hold_kept(-(b.bytes as i64));
        let Some(p) = pool_by_index(b.pool) else {
            return false;
        };
        let covered = b.closed && p.thread_fence_covers(b.need);
        // SAFETY: the blocks leave this thread's cache for the pool.
        unsafe { p.take_kept(&b.items[..b.len as usize], covered) };
        !covered && b.len > 0
    }
}
