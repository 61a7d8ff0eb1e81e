//! Note [thread fences]: with `thread_cache_streamless`, small blocks freed without a
//! stream are kept by the freeing thread, in batches per pool. A batch closes after
//! `fence_batch` frees (or, on a miss, after a quarter of that), and this thread records
//! one context fence for it: the frees came before the record in this thread's program
//! order, so the fence covers the work that used the blocks. Once that fence has completed
//! (one query), the batch's blocks move to per-class ready bins, where this thread's
//! streamless allocations take them: no pool lock and no shared state on the way, one
//! fence per batch. Before the pool grows, and on `empty_cache` or OOM, the batches go back
//! to the pool (to its fence queue unless their fence has completed).

use super::super::block::{BlockIdx, Place, NIL};
use super::super::size_class::class_of;
use super::super::{pool_by_index, DevicePool, BLOCKS, SMALL_MAX, STREAMLESS};
use super::{Limits, ThreadCache};
use crate::backend::EventHandle;

/// Most streamless frees a kept batch holds; it closes after `fence_batch` of them (one
/// context fence, and one pool lock, per batch).
pub const KEPT_BATCH: usize = 64;
/// Most bytes a thread keeps in batches and ready bins: a small segment's worth, so that
/// the blocks it holds back from merging never cost the pool a segment (measured in
/// `docs/BENCHMARKS.md`: more let the replays' footprint grow).
const KEPT_MAX_BYTES: u64 = 2 << 20;
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
    /// Closed: full, its fence asked for; no more blocks join it.
    pub(super) closed: bool,
    pub(super) pool: u16,
    /// Its context fence once closed ([`DevicePool::record_thread_fence`]); 0 for none.
    pub(super) fence: u64,
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
        fence: 0,
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
    /// it to the pool's fence queue.
    #[inline]
    pub fn put_streamless(&mut self, pool: &DevicePool, idx: BlockIdx, size: u64) -> bool {
        if self.limits.generation != crate::config::generation() {
            self.limits = Limits::read();
        }
        // Small blocks only: a large block freed and allocated again in a loop is the case
        // Note [lone fences] in the pool module handles (a second copy instead of a fence
        // per reuse), and large programs' buffers are few.
        let on = self.limits.enabled && self.limits.streamless;
        if size > SMALL_MAX.min(self.limits.max_block) || !on {
            return false;
        }
        self.check_flush_request();
        if self.bytes + size > self.limits.max_bytes || self.kept_bytes() + size > KEPT_MAX_BYTES {
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
        if b.len as usize >= self.limits.batch {
            self.close_kept(k, pool);
        }
        true
    }

    /// A block for a streamless allocation of at least `size` bytes from `pool`: from the
    /// blocks this thread kept whose fence is known complete (Note [thread fences]).
    #[inline]
    pub fn take_streamless(&mut self, pool: &DevicePool, size: u64) -> Option<BlockIdx> {
        let holds = self.ready.bytes > 0 || self.kept.iter().any(|b| b.live);
        if size > SMALL_MAX || !holds {
            return None;
        }
        self.check_flush_request();
        let class = class_of(size);
        if let Some(idx) = self.pop_ready(pool.index, class, size) {
            return Some(idx);
        }
        // Closed batches of this pool: their blocks become ready once their fence has
        // completed (one query each).
        let mut moved = false;
        for k in 0..KEPT_BATCHES {
            let b = self.kept[k];
            let mine = b.live && b.closed && b.pool == pool.index && b.fence != 0;
            if mine && pool.thread_fence_done(EventHandle(b.fence)) {
                self.kept[k].fence = 0;
                self.make_ready(k, pool);
                moved = true;
            }
        }
        if !moved {
            // A miss with a quarter batch kept: the batch closes now, so that the pool does
            // not grow (or take the blocks back before growing) while this thread holds
            // enough to serve itself once one fence completes.
            let open = (0..KEPT_BATCHES).find(|&k| {
                let b = &self.kept[k];
                b.live && !b.closed && b.pool == pool.index
            });
            let quarter = self.limits.batch.div_ceil(4);
            if let Some(k) = open.filter(|&k| self.kept[k].len as usize >= quarter) {
                self.close_kept(k, pool);
                let fence = self.kept[k].fence;
                if fence != 0 && pool.thread_fence_done(EventHandle(fence)) {
                    self.kept[k].fence = 0;
                    self.make_ready(k, pool);
                    moved = true;
                }
            }
        }
        if moved {
            self.pop_ready(pool.index, class, size)
        } else {
            None
        }
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

    /// Closes the open batch `k`: no more blocks join it, and a context fence recorded now
    /// covers its frees.
    fn close_kept(&mut self, k: usize, pool: &DevicePool) {
        self.kept[k].closed = true;
        self.kept[k].fence = pool.record_thread_fence().map_or(0, |ev| ev.0);
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
        self.bytes -= r.bytes;
        r.bytes = 0;
    }

    /// Gives the kept batch `k` back to its pool.
    pub(super) fn flush_kept(&mut self, k: usize) {
        let b = self.kept[k];
        if !b.live {
            return;
        }
        self.kept[k] = Kept::EMPTY;
        self.bytes -= b.bytes;
        if let Some(p) = pool_by_index(b.pool) {
            let covered = b.fence != 0 && p.thread_fence_done(EventHandle(b.fence));
            if b.fence != 0 && !covered {
                p.drop_thread_fence(EventHandle(b.fence));
            }
            // SAFETY: the blocks leave this thread's cache for the pool.
            unsafe { p.take_kept(&b.items[..b.len as usize], covered) };
        }
    }
}
