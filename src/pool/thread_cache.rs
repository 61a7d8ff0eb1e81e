//! Per-thread state: the thread cache and the thread's statistics counters.
//!
//! The cache keeps, per (pool, stream), a few recently freed blocks of each size class. A
//! block freed on stream S may be reused by S at once (stream order makes it safe), so an
//! `alloc_async`/`free_async` pair on one stream is a pop and a push on a thread-owned
//! array: no lock, no atomic read-modify-write, no CUDA call.
//!
//! Bounds: [`SLOTS`] streams per thread (the least recently used slot is flushed when a new
//! stream comes), [`BIN_CAP`] blocks per class, `thread_cache_bytes` in all, blocks up to
//! `thread_cache_max_block` (at most 64 MiB). Blocks in a thread cache count as cached.
//!
//! Note [thread fences]: with `thread_cache_streamless`, small blocks freed without a
//! stream are kept too, in batches per pool. A batch closes after `fence_batch` frees (or, on a miss, after a quarter of that),
//! and this thread records one context fence for it: the frees came before the record in
//! this thread's program order, so the fence covers the work that used the blocks. Once
//! that fence has completed (one query), the batch's blocks move to per-class ready bins,
//! where this thread's streamless allocations take them: no pool lock and no shared state
//! on the way, one fence per batch. Before the pool grows, and on `empty_cache` or OOM, the
//! batches go back to the pool (to its fence queue unless their fence has completed).
//!
//! Another thread cannot take blocks out of a live thread's cache (that would need a lock on
//! every fast-path operation). Instead `empty_cache` and the OOM path bump [`FLUSH_EPOCH`]:
//! every thread flushes its whole cache into the shared pool at its next allocator call,
//! and the calling thread flushes its own at once. A thread's cache is flushed when the
//! thread exits.

use super::block::{BlockIdx, Place, BLOCK_NIL_ARRAY};
use super::counters::{Count, Level, ThreadCounters, COUNTS, LEVELS};
use super::size_class::class_of;
use super::{pool_by_index, DevicePool, StreamRef, BLOCKS, MAX_POOLS, STREAMLESS};
use crate::backend::{EventHandle, StreamHandle};
use core::cell::{Cell, UnsafeCell};
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};

pub const SLOTS: usize = 4;
pub const BIN_CAP: usize = 8;
/// Largest block any thread cache keeps.
pub const MAX_CACHED_BLOCK: u64 = 64 << 20;
const CLASSES: usize = class_of(MAX_CACHED_BLOCK) + 1;

/// Most streamless frees a kept batch holds; it closes after `fence_batch` of them (one
/// context fence, and one pool lock, per batch).
pub const KEPT_BATCH: usize = 64;
/// Most bytes a thread keeps in batches and ready bins: a small segment's worth, so that
/// the blocks it holds back from merging never cost the pool a segment (measured in
/// `docs/BENCHMARKS.md`: more let the replays' footprint grow).
const KEPT_MAX_BYTES: u64 = 2 << 20;
/// Batches a thread keeps at once (open or closed, any pools).
const KEPT_BATCHES: usize = 4;
/// Size classes of the blocks a thread keeps (small blocks only).
const READY_CLASSES: usize = class_of(super::SMALL_MAX) + 1;
/// Blocks per class ready for reuse.
const READY_CAP: usize = KEPT_BATCH;

/// Kept blocks whose fence is known complete, by size class, for one pool: what the
/// thread's streamless allocations take without a lock.
struct Ready {
    pool: u16,
    bytes: u64,
    len: [u8; READY_CLASSES],
    items: [[BlockIdx; READY_CAP]; READY_CLASSES],
}

/// Streamless frees of one pool kept by their thread until a fence covers them.
#[derive(Copy, Clone)]
struct Kept {
    live: bool,
    /// Closed: full, its fence asked for; no more blocks join it.
    closed: bool,
    pool: u16,
    /// Its context fence once closed ([`DevicePool::record_thread_fence`]); 0 for none.
    fence: u64,
    /// When it was opened (this cache's tick): the oldest goes back first.
    opened: u64,
    len: u32,
    bytes: u64,
    items: [BlockIdx; KEPT_BATCH],
}

impl Kept {
    const EMPTY: Kept = Kept {
        live: false,
        closed: false,
        pool: 0,
        fence: 0,
        opened: 0,
        len: 0,
        bytes: 0,
        items: [super::block::NIL; KEPT_BATCH],
    };
}

/// Bumped to ask every thread to flush its cache at its next call.
pub static FLUSH_EPOCH: AtomicU64 = AtomicU64::new(0);

#[derive(Copy, Clone)]
struct Bin {
    len: u32,
    items: [BlockIdx; BIN_CAP],
}

struct Slot {
    live: bool,
    pool: u16,
    stream: u64,
    handle: StreamHandle,
    last_use: u64,
    bins: [Bin; CLASSES],
}

impl Slot {
    const EMPTY: Slot = Slot {
        live: false,
        pool: 0,
        stream: 0,
        handle: 0,
        last_use: 0,
        bins: [Bin {
            len: 0,
            items: BLOCK_NIL_ARRAY,
        }; CLASSES],
    };
}

/// The options the cache obeys, read once per configuration change.
struct Limits {
    generation: u64,
    enabled: bool,
    max_block: u64,
    max_bytes: u64,
    /// Frees per kept batch (`fence_batch`, at most [`KEPT_BATCH`]).
    batch: usize,
    /// Whether streamless frees are kept (`thread_cache_streamless`).
    streamless: bool,
}

impl Limits {
    fn read() -> Self {
        use crate::config::{get, get_bool, Key};
        Limits {
            generation: crate::config::generation(),
            enabled: get_bool(Key::ThreadCache),
            max_block: get(Key::ThreadCacheMaxBlock).min(MAX_CACHED_BLOCK),
            max_bytes: get(Key::ThreadCacheBytes),
            batch: (get(Key::FenceBatch) as usize).clamp(1, KEPT_BATCH),
            streamless: crate::config::get_bool(Key::ThreadCacheStreamless),
        }
    }
}

pub struct ThreadCache {
    slots: [Slot; SLOTS],
    kept: [Kept; KEPT_BATCHES],
    ready: Ready,
    bytes: u64,
    flush_epoch: u64,
    tick: u64,
    limits: Limits,
}

impl ThreadCache {
    fn new() -> Self {
        ThreadCache {
            slots: [Slot::EMPTY; SLOTS],
            kept: [Kept::EMPTY; KEPT_BATCHES],
            ready: Ready {
                pool: 0,
                bytes: 0,
                len: [0; READY_CLASSES],
                items: [[super::block::NIL; READY_CAP]; READY_CLASSES],
            },
            bytes: 0,
            flush_epoch: FLUSH_EPOCH.load(Relaxed),
            tick: 0,
            limits: Limits {
                generation: 0,
                enabled: false,
                max_block: 0,
                max_bytes: 0,
                batch: 1,
                streamless: false,
            },
        }
    }

    /// A cached block of class `class(size)` for (pool, stream) that is at least `size`
    /// bytes, taken out of the cache.
    #[inline]
    pub fn take(&mut self, pool: u16, stream: u64, size: u64) -> Option<BlockIdx> {
        if size > MAX_CACHED_BLOCK {
            return None;
        }
        self.check_flush_request();
        let class = class_of(size);
        let slot = self
            .slots
            .iter_mut()
            .find(|s| s.live && s.stream == stream && s.pool == pool)?;
        let bin = &mut slot.bins[class];
        if bin.len == 0 {
            return None;
        }
        let idx = bin.items[bin.len as usize - 1];
        // SAFETY: blocks in this thread's cache are owned by this thread.
        let d = unsafe { BLOCKS.get(idx).data() };
        if d.size < size {
            return None;
        }
        if d.size - size >= super::LARGE_SPLIT_MIN {
            // Same class is not close enough (Note [excess] in the pool module): the block
            // goes to its stream's index in the pool, where the slow path that follows
            // this miss splits it down to the request instead of growing.
            bin.len -= 1;
            self.bytes -= d.size;
            let stream = StreamRef {
                id: slot.stream,
                handle: slot.handle,
            };
            if let Some(p) = pool_by_index(pool) {
                // SAFETY: the block was in this thread's cache, so this thread owns it.
                unsafe { give_to_pool(p, stream, &[idx]) };
            }
            return None;
        }
        bin.len -= 1;
        self.bytes -= d.size;
        Some(idx)
    }

    /// Keeps a block freed on `stream`; returns false (and keeps nothing) when the cache
    /// is off for this block or full: then the caller gives it to the pool.
    #[inline]
    pub fn put(&mut self, pool: u16, stream: StreamRef, idx: BlockIdx, size: u64) -> bool {
        if self.limits.generation != crate::config::generation() {
            self.limits = Limits::read();
        }
        if size > self.limits.max_block || !self.limits.enabled {
            return false;
        }
        self.check_flush_request();
        if self.bytes + size > self.limits.max_bytes {
            return false;
        }
        self.tick += 1;
        let tick = self.tick;
        let pos = match self
            .slots
            .iter()
            .position(|s| s.live && s.stream == stream.id && s.pool == pool)
        {
            Some(p) => p,
            None => {
                let victim = self.least_recently_used_slot();
                self.flush_slot(victim);
                let s = &mut self.slots[victim];
                s.live = true;
                s.pool = pool;
                s.stream = stream.id;
                victim
            }
        };
        let class = class_of(size);
        let slot = &mut self.slots[pos];
        slot.handle = stream.handle;
        slot.last_use = tick;
        if slot.bins[class].len as usize == BIN_CAP {
            // Full: the older half goes to the pool, in one lock.
            let bin = &mut slot.bins[class];
            let half = BIN_CAP / 2;
            let older: [BlockIdx; BIN_CAP / 2] = core::array::from_fn(|i| bin.items[i]);
            bin.items.copy_within(half.., 0);
            bin.len -= half as u32;
            let moved: u64 = older
                .iter()
                // SAFETY: owned by this thread's cache.
                .map(|&i| unsafe { BLOCKS.get(i).data().size })
                .sum();
            self.bytes -= moved;
            if let Some(p) = pool_by_index(pool) {
                // SAFETY: the blocks leave this thread's cache for the pool.
                unsafe { give_to_pool(p, stream, &older) };
            }
        }
        let slot = &mut self.slots[pos];
        let bin = &mut slot.bins[class];
        // SAFETY: the caller owns the block and hands it to this thread's cache.
        let d = unsafe { BLOCKS.get(idx).data() };
        d.place = Place::ThreadCache;
        d.stream = stream.id;
        bin.items[bin.len as usize] = idx;
        bin.len += 1;
        self.bytes += size;
        true
    }

    fn least_recently_used_slot(&self) -> usize {
        if let Some(free) = self.slots.iter().position(|s| !s.live) {
            return free;
        }
        let mut best = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if s.last_use < self.slots[best].last_use {
                best = i;
            }
        }
        best
    }

    #[inline]
    fn check_flush_request(&mut self) {
        let want = FLUSH_EPOCH.load(Relaxed);
        if want != self.flush_epoch {
            self.flush_epoch = want;
            self.flush_all();
        }
    }

    fn flush_slot(&mut self, pos: usize) {
        let slot = &mut self.slots[pos];
        if !slot.live {
            return;
        }
        let stream = StreamRef {
            id: slot.stream,
            handle: slot.handle,
        };
        let pool = pool_by_index(slot.pool);
        let mut bytes = 0;
        for bin in slot.bins.iter_mut().filter(|b| b.len > 0) {
            let items = &bin.items[..bin.len as usize];
            // SAFETY: owned by this thread's cache.
            bytes += items
                .iter()
                .map(|&i| unsafe { BLOCKS.get(i).data().size })
                .sum::<u64>();
            if let Some(p) = pool {
                // SAFETY: the blocks leave this thread's cache for the pool.
                unsafe { give_to_pool(p, stream, items) };
            }
            bin.len = 0;
        }
        slot.live = false;
        self.bytes -= bytes;
    }

    /// Gives every cached block back to its pool.
    pub fn flush_all(&mut self) {
        for pos in 0..SLOTS {
            self.flush_slot(pos);
        }
        for k in 0..KEPT_BATCHES {
            self.flush_kept(k);
        }
        self.flush_ready();
    }

    /// Gives back the blocks of one pool (before that pool's OOM retry).
    pub fn flush_pool(&mut self, pool: u16) {
        for pos in 0..SLOTS {
            if self.slots[pos].pool == pool {
                self.flush_slot(pos);
            }
        }
        for k in 0..KEPT_BATCHES {
            if self.kept[k].pool == pool {
                self.flush_kept(k);
            }
        }
        if self.ready.pool == pool {
            self.flush_ready();
        }
    }

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
        if size > super::SMALL_MAX.min(self.limits.max_block) || !on {
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
        let d = unsafe { BLOCKS.get(idx).data() };
        d.place = Place::ThreadCache;
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
        if size > super::SMALL_MAX || !holds {
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
        let mut overflow = [super::block::NIL; KEPT_BATCH];
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
    fn flush_ready(&mut self) {
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
    fn flush_kept(&mut self, k: usize) {
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

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Gives blocks of a cache slot back to their pool: to their stream's index, or, for the
/// streamless slot (whose blocks are there because their fence completed, Note [thread
/// fences]), to the shared index.
///
/// # Safety
/// The caller owns the blocks (they were in its thread cache) and gives them up.
unsafe fn give_to_pool(pool: &DevicePool, stream: StreamRef, blocks: &[BlockIdx]) {
    if stream.id == STREAMLESS {
        pool.take_kept(blocks, true);
    } else {
        pool.free_to_stream(stream, blocks);
    }
}

/// Everything one thread owns. Never freed: when its thread exits, the cache is flushed
/// and the record waits for the next new thread, keeping its counters (the sums stay
/// exact).
pub struct ThreadState {
    counters: Box<[ThreadCounters]>,
    cache: UnsafeCell<ThreadCache>,
}

// SAFETY: `cache` is only touched by the thread the record is attached to (or by its exit
// handler); counters are atomics.
unsafe impl Sync for ThreadState {}

impl ThreadState {
    fn new(shared: bool) -> Self {
        ThreadState {
            counters: (0..MAX_POOLS)
                .map(|_| ThreadCounters::new(shared))
                .collect(),
            cache: UnsafeCell::new(ThreadCache::new()),
        }
    }

    #[inline]
    pub fn counters(&self, pool: u16) -> &ThreadCounters {
        &self.counters[pool as usize]
    }
}

struct Registry {
    all: Vec<&'static ThreadState>,
    idle: Vec<&'static ThreadState>,
}

static REGISTRY: spin::Mutex<Registry> = spin::Mutex::new(Registry {
    all: Vec::new(),
    idle: Vec::new(),
});
static ORPHAN: spin::Once<&'static ThreadState> = spin::Once::new();

thread_local! {
    static CURRENT: Cell<*const ThreadState> = const { Cell::new(core::ptr::null()) };
    static EXIT_FLUSH: ExitFlush = const { ExitFlush };
}

/// Its drop runs when the thread exits: flush the cache, park the record.
struct ExitFlush;

impl Drop for ExitFlush {
    fn drop(&mut self) {
        let p = CURRENT
            .try_with(|c| c.replace(core::ptr::null()))
            .unwrap_or(core::ptr::null());
        if p.is_null() {
            return;
        }
        // SAFETY: records are leaked; the exiting thread is the cache's only user.
        let ts: &'static ThreadState = unsafe { &*p };
        let _ = std::panic::catch_unwind(core::panic::AssertUnwindSafe(|| {
            // SAFETY: as above.
            unsafe { (*ts.cache.get()).flush_all() };
        }));
        REGISTRY.lock().idle.push(ts);
    }
}

/// The record for threads whose thread-local storage is gone (exit handlers): no cache,
/// counters updated with atomic RMWs.
fn orphan() -> &'static ThreadState {
    ORPHAN.call_once(|| {
        let ts: &'static ThreadState = Box::leak(Box::new(ThreadState::new(true)));
        REGISTRY.lock().all.push(ts);
        ts
    })
}

#[cold]
fn attach() -> Option<&'static ThreadState> {
    // Registering the exit handler fails once the thread's TLS is being torn down.
    EXIT_FLUSH.try_with(|_| ()).ok()?;
    let ts = {
        let mut reg = REGISTRY.lock();
        match reg.idle.pop() {
            Some(ts) => ts,
            None => {
                let ts: &'static ThreadState = Box::leak(Box::new(ThreadState::new(false)));
                reg.all.push(ts);
                ts
            }
        }
    };
    for c in ts.counters.iter() {
        c.adopt();
    }
    CURRENT.try_with(|c| c.set(ts)).ok()?;
    Some(ts)
}

/// Runs `f` with this thread's record and cache (no cache when the thread is exiting).
#[inline]
pub fn with_thread<R>(f: impl FnOnce(&'static ThreadState, Option<&mut ThreadCache>) -> R) -> R {
    let cur = CURRENT.try_with(|c| c.get()).unwrap_or(core::ptr::null());
    let ts = if cur.is_null() {
        attach()
    } else {
        // SAFETY: records are leaked.
        Some(unsafe { &*cur })
    };
    match ts {
        // SAFETY: only this thread touches its cache, and `f` is not re-entered (the
        // allocator calls nothing that calls back into it).
        Some(ts) => f(ts, Some(unsafe { &mut *ts.cache.get() })),
        None => f(orphan(), None),
    }
}

/// Sum of one level of one pool over every thread.
pub fn sum_level(pool: u16, level: Level) -> i64 {
    REGISTRY
        .lock()
        .all
        .iter()
        .map(|t| t.counters(pool).level(level))
        .sum()
}

/// Summed levels and counts of one pool.
pub struct PoolSums {
    pub levels: [i64; LEVELS],
    pub counts: [u64; COUNTS],
}

pub fn sum_pool(pool: u16) -> PoolSums {
    let mut s = PoolSums {
        levels: [0; LEVELS],
        counts: [0; COUNTS],
    };
    for t in REGISTRY.lock().all.iter() {
        let c = t.counters(pool);
        for (i, l) in [Level::Allocated, Level::Requested, Level::Cached]
            .into_iter()
            .enumerate()
        {
            s.levels[i] += c.level(l);
        }
        for (i, k) in [Count::Allocs, Count::Frees].into_iter().enumerate() {
            s.counts[i] += c.get_count(k);
        }
    }
    s
}

/// Asks every thread to flush its cache at its next call.
pub fn request_flush_all() {
    FLUSH_EPOCH.fetch_add(1, Relaxed);
}
