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
//! With `thread_cache_streamless`, small blocks freed without a stream are kept too
//! (Note [thread fences] in `thread_cache/kept.rs`).
//!
//! Another thread cannot take blocks out of a live thread's cache (that would need a lock on
//! every fast-path operation). Instead `empty_cache` and the OOM path bump [`FLUSH_EPOCH`]:
//! every thread flushes its whole cache into the shared pool at its next allocator call,
//! and the calling thread flushes its own at once. A thread's cache is flushed when the
//! thread exits.

use super::block::{BlockIdx, Place, NIL};
use super::counters::{Count, Level, ThreadCounters, COUNTS, LEVELS};
use super::size_class::{class_of, ALIGNMENT};
mod kept;

use super::{pool_by_index, StreamRef, BLOCKS, MAX_POOLS};
use kept::{Kept, Ready, KEPT_BATCHES};
pub use kept::{KEPT_BATCH, KEPT_CLOSABLE_BYTES};

/// Bumped to ask every thread to flush its cache at its next call.
pub static FLUSH_EPOCH: AtomicU64 = AtomicU64::new(0);
use crate::backend::StreamHandle;
use core::cell::{Cell, UnsafeCell};
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};

pub const SLOTS: usize = 4;
pub const BIN_CAP: usize = 8;
/// Largest block any thread cache keeps.
pub const MAX_CACHED_BLOCK: u64 = 64 << 20;
const CLASSES: usize = class_of(MAX_CACHED_BLOCK) + 1;

/// A block in a bin, with what a search and a hit need of its record: Note [bins carry
/// sizes].
#[derive(Copy, Clone)]
pub struct Cached {
    pub idx: BlockIdx,
    /// Its size in units of [`ALIGNMENT`] (at most [`MAX_CACHED_BLOCK`] / 512: fits).
    units: u32,
    pub ptr: u64,
}

impl Cached {
    const NONE: Cached = Cached {
        idx: NIL,
        units: 0,
        ptr: 0,
    };

    fn new(idx: BlockIdx, size: u64, ptr: u64) -> Cached {
        debug_assert!(size <= MAX_CACHED_BLOCK && size % ALIGNMENT == 0);
        Cached {
            idx,
            units: (size / ALIGNMENT) as u32,
            ptr,
        }
    }

    #[inline]
    pub fn size(&self) -> u64 {
        self.units as u64 * ALIGNMENT
    }
}

/// Note [bins carry sizes]: a bin holds blocks of one size class, whose sizes differ by up
/// to an eighth of the class's lower bound, so its newest block is smaller than a request
/// of that class about half the time. Looking at each block's record to find one that fits
/// would cost a cache miss per block once many blocks are live (10^5 blocks' records span
/// 12.8 MB), and so would the hit's read of the block's address. So each entry carries the
/// block's size and address (which do not change while the block is cached): the search
/// takes the newest block that fits, and a hit only writes the record. The price is host
/// memory: a bin of 8 entries is 136 bytes instead of 36, and each thread's cache record
/// 99 KB instead of 44 KB.
#[derive(Copy, Clone)]
struct Bin {
    len: u32,
    items: [Cached; BIN_CAP],
}

impl Bin {
    /// The blocks' indexes, for the pool (`free_to_stream`).
    fn indexes(&self, range: core::ops::Range<usize>) -> ([BlockIdx; BIN_CAP], usize) {
        let mut out = [NIL; BIN_CAP];
        for (o, item) in out.iter_mut().zip(&self.items[range.clone()]) {
            *o = item.idx;
        }
        (out, range.len())
    }

    /// The position of the newest block of at least `size` bytes. The newest first: a
    /// loop that frees and allocates one size takes it.
    #[inline]
    fn newest_fit(&self, size: u64) -> Option<usize> {
        let top = (self.len as usize).checked_sub(1)?;
        match self.items[top].size() >= size {
            true => Some(top),
            false => (0..top).rev().find(|&i| self.items[i].size() >= size),
        }
    }

    fn bytes(&self, range: core::ops::Range<usize>) -> u64 {
        self.items[range].iter().map(Cached::size).sum()
    }
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
    /// The stream the slot's blocks were freed on.
    fn stream_ref(&self) -> StreamRef {
        StreamRef {
            id: self.stream,
            handle: self.handle,
        }
    }

    /// Gives every block of the slot back to its pool, on its stream; returns their
    /// bytes.
    fn flush_bins(&mut self) -> u64 {
        let stream = self.stream_ref();
        let pool = pool_by_index(self.pool);
        let mut bytes = 0;
        for bin in self.bins.iter_mut().filter(|b| b.len > 0) {
            let all = 0..bin.len as usize;
            bytes += bin.bytes(all.clone());
            let (items, n) = bin.indexes(all);
            if let Some(p) = pool {
                // SAFETY: the blocks leave this thread's cache for the pool.
                unsafe { p.free_to_stream(stream, &items[..n]) };
            }
            bin.len = 0;
        }
        bytes
    }

    const EMPTY: Slot = Slot {
        live: false,
        pool: 0,
        stream: 0,
        handle: 0,
        last_use: 0,
        bins: [Bin {
            len: 0,
            items: [Cached::NONE; BIN_CAP],
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
    /// Streamless allocations in a row the kept blocks did not serve (Note [stale kept
    /// blocks]).
    kept_misses: u32,
    /// Most bytes this thread keeps now: [`kept::KEPT_MAX_BYTES`], or
    /// [`kept::KEPT_MAX_BYTES_SHARED`] while many threads' batches wait on the same fences
    /// (Note [kept bytes under contention]).
    kept_cap: u64,
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
            kept_misses: 0,
            kept_cap: kept::KEPT_MAX_BYTES,
            ready: Ready::new(),
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

    // Note [next class up]: when no block of a small request's class fits (the bin is
    // empty, or every block in it is smaller than the request), the newest block of the
    // next class is handed out instead. Every block there is larger than any size of the
    // request's class, by at most two class steps (a quarter of the request). Otherwise the
    // request goes to the pool's lock and free lists, and the frees that keep coming to the
    // cache overflow it into the pool as well. `examples/live_cost.rs` (host backend, random
    // sizes of 256 B – 64 KiB, development machine, six runs each, taking turns): with 10
    // blocks live, requests to the pool 36% → 4%, 143–206 → 93–126 ns a pair; with 10^5,
    // 27% → 12%, 634–797 → 535–695 ns. Host replays: peak reserved unchanged on every
    // corpus trace but `gpt_train.torch` at lag 0, 97.73% → 97.96% utilization, whose second
    // half then creates and releases more arena chunks (14 → 24 and 30 → 53), as the GPT loop
    // through `enable()` does on an H200 (1.8 → 2.6 and 3.1 → 5.8 a step, about 30 µs of
    // driver time; docs/BENCHMARKS.md). Small requests only (up to `SMALL_MAX`): a large
    // block lives in the VMM arena, where a quarter more is memory the arena could lend.

    /// The newest cached block of class `class(size)` for (pool, stream) that is at least
    /// `size` bytes, else the next class's newest (Note [next class up]), taken out of the
    /// cache (Note [bins carry sizes]).
    #[inline]
    pub fn take(&mut self, pool: u16, stream: u64, size: u64) -> Option<Cached> {
        if size > MAX_CACHED_BLOCK {
            return None;
        }
        self.check_flush_request();
        let class = class_of(size);
        let slot = self
            .slots
            .iter_mut()
            .find(|s| s.live && s.stream == stream && s.pool == pool)?;
        let (bin, pos) = match slot.bins[class].newest_fit(size) {
            Some(pos) => (&mut slot.bins[class], pos),
            // Note [next class up]: the next class's newest block, for a small request.
            None if size <= super::SMALL_MAX => {
                let bin = &mut slot.bins[class + 1];
                let top = (bin.len as usize).checked_sub(1)?;
                (bin, top)
            }
            None => return None,
        };
        let top = bin.len as usize - 1;
        let item = bin.items[pos];
        if pos != top {
            bin.items.copy_within(pos + 1..=top, pos);
        }
        bin.len -= 1;
        self.bytes -= item.size();
        if item.size() - size >= super::LARGE_SPLIT_MIN {
            // Same class is not close enough (Note [reuse excess] in the pool module): the
            // block goes to its stream's index in the pool, where the slow path that
            // follows this miss splits it down to the request instead of growing.
            let stream = slot.stream_ref();
            if let Some(p) = pool_by_index(pool) {
                // SAFETY: the block was in this thread's cache, so this thread owns it.
                unsafe { p.free_to_stream(stream, &[item.idx]) };
            }
            return None;
        }
        Some(item)
    }

    /// Keeps a block freed on `stream`; returns false (and keeps nothing) when the cache
    /// is off for this block or full: then the caller gives it to the pool.
    #[inline]
    pub fn put(
        &mut self,
        pool: u16,
        stream: StreamRef,
        idx: BlockIdx,
        size: u64,
        ptr: u64,
    ) -> bool {
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
            let (older, n) = bin.indexes(0..half);
            self.bytes -= bin.bytes(0..half);
            bin.items.copy_within(half.., 0);
            bin.len -= half as u32;
            if let Some(p) = pool_by_index(pool) {
                // SAFETY: the blocks leave this thread's cache for the pool.
                unsafe { p.free_to_stream(stream, &older[..n]) };
            }
        }
        let slot = &mut self.slots[pos];
        let bin = &mut slot.bins[class];
        // SAFETY: the caller owns the block and hands it to this thread's cache.
        BLOCKS.get(idx).set_place(Place::ThreadCache);
        let d = unsafe { BLOCKS.get(idx).data() };
        d.stream = stream.id;
        bin.items[bin.len as usize] = Cached::new(idx, size, ptr);
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
        let bytes = slot.flush_bins();
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

    /// Gives every block of `pool` this cache holds back to it (before that pool grows,
    /// and before its OOM retry); returns whether some went to its fence queue (kept
    /// streamless frees no completed fence covers yet).
    pub fn flush_pool(&mut self, pool: u16) -> bool {
        for pos in 0..SLOTS {
            if self.slots[pos].pool == pool {
                self.flush_slot(pos);
            }
        }
        self.flush_streamless(pool)
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
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
    for (pool, c) in ts.counters.iter().enumerate() {
        c.adopt();
        // What the record's last thread kept went back to the pool at its exit, counted on
        // the orphan record when its own was gone: the new thread holds none of it (Note
        // [room beside stranded blocks] in `alloc.rs` reads a thread's own share).
        let held = c.kept_held();
        if held != 0 {
            orphan().counters(pool as u16).hold_kept(held);
            c.hold_kept(-held);
        }
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

/// The calling thread's counters for `pool`, without touching its cache (so it may be
/// called while a caller up the stack holds the cache).
pub fn thread_counters(pool: u16) -> &'static ThreadCounters {
    let cur = CURRENT.try_with(|c| c.get()).unwrap_or(core::ptr::null());
    let ts = if cur.is_null() {
        attach()
    } else {
        // SAFETY: records are leaked.
        Some(unsafe { &*cur })
    };
    ts.unwrap_or_else(orphan).counters(pool)
}

/// Sum over every thread (and the orphan record) of one value of its counters for `pool`.
fn sum_over_threads(pool: u16, value: impl Fn(&ThreadCounters) -> i64) -> i64 {
    REGISTRY
        .lock()
        .all
        .iter()
        .map(|t| value(t.counters(pool)))
        .sum()
}

/// Sum of one level of one pool over every thread.
pub fn sum_level(pool: u16, level: Level) -> i64 {
    sum_over_threads(pool, |c| c.level(level))
}

/// The bytes every thread holds in kept batches and ready bins for `pool` (Note [room
/// beside stranded blocks] in `pool/alloc.rs`).
pub fn kept_held_sum(pool: u16) -> i64 {
    sum_over_threads(pool, ThreadCounters::kept_held)
}

/// Summed levels and counts of one pool.
pub struct PoolSums {
    pub levels: [i64; LEVELS],
    pub counts: [u64; COUNTS],
    /// Bytes threads keep after streamless frees that no fence covers yet.
    pub kept_unfenced: u64,
}

pub fn sum_pool(pool: u16) -> PoolSums {
    let mut s = PoolSums {
        levels: [0; LEVELS],
        counts: [0; COUNTS],
        kept_unfenced: 0,
    };
    let mut kept: i64 = 0;
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
        kept += c.kept_unfenced();
    }
    s.kept_unfenced = kept.max(0) as u64;
    s
}

/// Asks every thread to flush its cache at its next call.
pub fn request_flush_all() {
    FLUSH_EPOCH.fetch_add(1, Relaxed);
}
