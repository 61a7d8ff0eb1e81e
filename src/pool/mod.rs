//! The caching pool: device-agnostic, no CUDA calls of its own (it talks to a
//! [`Backend`]).
//!
//! Glossary
//! - **segment**: one allocation obtained from the backend (`cuMemAlloc`). Small segments
//!   (`small_segment`, 2 MiB) are carved into blocks of up to 1 MiB; large segments hold
//!   larger blocks. A segment goes back to the driver only when it is one free block again.
//! - **block**: a contiguous part of a segment, free or handed out ([`block::Block`]).
//!   Blocks are 512-byte multiples; adjacent free blocks of a segment merge.
//! - **size class**: blocks are indexed by class ([`size_class`]), eight per power of two.
//! - **shared index**: free blocks any stream may take ([`free_index::FreeIndex`]).
//! - **stream state**: per stream, the blocks freed on it that only it may take until a
//!   context fence recorded after their free completes, in free order (its age list).
//! - **fence queue**: blocks freed without a stream (or on a foreign stream): nobody may
//!   take them until a context fence recorded after their free completes.
//! - **clock / epoch**: a counter of the pool; a freed block is stamped with the clock, and
//!   an event or fence recorded when the clock read `e` covers every block stamped `<= e`.
//! - **thread cache**: per thread and stream, recently freed blocks reused with no lock
//!   ([`thread_cache`]).
//!
//! Note [pool locks]: `shared` (a spin lock) guards the indexes and lists and is held only for
//! short metadata work, never across a backend call. `events` (a blocking mutex, not a spin
//! lock) serialises recording and polling of context fences (so an event is never
//! recycled while another thread queries it); it is taken only when a request missed the
//! cache, on OOM, and by `empty_cache`, and it is the only lock held across backend calls. Order: `events` before
//! `shared`.
//!
//! Where things are: this module holds the registry of pools and the [`DevicePool`] type;
//! `size_policy` (segment sizes, when to split: Note [reuse excess]), `alloc` (the slow path),
//! `segments` (growing, splitting, merging, lookup by address), `frees`, `fences` (context
//! fences, Note [wait before growing], Note [lone fences]), `release`, `pool_stats` (Note
//! [fragmentation stats]), `footprint` (where the reserved bytes are, Note [footprint parts]),
//! `invariants`, and [`vmm`] (the VMM arena) each add their part of `DevicePool`'s methods;
//! [`handover`] hands blocks to the program and takes them back outside the pool lock
//! (thread-cache hits and frees), so the runtime writes no record.
//! [`pinned`] is the process's pool of page-locked host memory, ordered by these pools'
//! context fences.

pub mod address_map;
mod alloc;
pub mod arena;
pub mod block;
pub mod capture;
pub mod counters;
pub mod device_waits;
pub mod export;
pub mod fence_clock;
pub mod fence_times;
mod fences;
pub mod fifo;
mod footprint;
pub mod free_index;
mod frees;
pub mod handover;
mod invariants;
pub(crate) mod meta_memory;
pub mod parked;
pub mod pinned;
mod pool_stats;
mod release;
mod reserve;
mod segments;
pub mod size_class;
mod size_policy;
mod stream_ids;
pub mod thread_cache;
pub mod vmm;

pub use footprint::{Footprint, Place as FootprintPlace};
pub use invariants::InvariantReport;
pub use segments::Containing;
pub use size_policy::{LARGE_SPLIT_MIN, SMALL_MAX};

use crate::backend::{Backend, ContextInfo, EventHandle, StreamHandle};
use crate::config::{self, Key};
use crate::status::{CupoolStatus, Result};
use crate::sync::LineApart;
use address_map::AddressMap;
use block::{BlockIdx, BlockTable, SegmentKind};
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use counters::{Level, ThreadCounters};
use fifo::Fifo;
use free_index::FreeIndex;
use std::collections::{BTreeMap, VecDeque};

/// Every block record of the process.
pub static BLOCKS: BlockTable = BlockTable::new();
/// Block start address → record, for every pool of the process (device addresses are
/// unique across contexts under unified addressing).
pub static ADDRESSES: AddressMap = AddressMap::new();

/// Most device pools (contexts) one process can have.
pub const MAX_POOLS: usize = 64;
static POOLS: [AtomicPtr<DevicePool>; MAX_POOLS] =
    [const { AtomicPtr::new(core::ptr::null_mut()) }; MAX_POOLS];
static POOL_COUNT: AtomicU32 = AtomicU32::new(0);
static POOL_CREATE: spin::Mutex<()> = spin::Mutex::new(());

/// Set when the process is exiting or is a fork child: no backend call may be made.
pub static BACKEND_OFF: AtomicBool = AtomicBool::new(false);

/// A pool's limit value meaning "use the `memory_limit` option".
pub const LIMIT_FROM_CONFIG: u64 = u64::MAX;

/// The stream a block was allocated for, `STREAMLESS` for `cupool_alloc`.
pub const STREAMLESS: u64 = u64::MAX;

/// A stream as the pool sees it: its unique id and the handle last used with it.
#[derive(Copy, Clone, Debug)]
pub struct StreamRef {
    pub id: u64,
    pub handle: StreamHandle,
}

/// One allocation as the slow path sees it.
#[derive(Copy, Clone, Debug)]
struct Request {
    /// Rounded size.
    size: u64,
    /// What the program asked for.
    requested: u64,
    kind: SegmentKind,
    /// The stream for stream-ordered allocations, `None` for streamless ones.
    stream: Option<StreamRef>,
}

/// The pool with index `i`, if created.
#[inline]
pub fn pool_by_index(i: u16) -> Option<&'static DevicePool> {
    let p = POOLS.get(i as usize)?.load(Ordering::Acquire);
    // SAFETY: pools are leaked on creation and never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// Every pool created so far.
pub fn all_pools() -> impl Iterator<Item = &'static DevicePool> {
    let n = POOL_COUNT.load(Ordering::Acquire) as u16;
    (0..n).filter_map(pool_by_index)
}

/// The pool of `ctx`, created on first use.
/// `limit` gives the device's memory limit for a pool created now.
#[inline]
pub fn pool_for(
    ctx: ContextInfo,
    backend: &'static dyn Backend,
    limit: impl FnOnce() -> u64,
) -> Result<&'static DevicePool> {
    if let Some(p) = all_pools().find(|p| p.ctx.id == ctx.id) {
        return Ok(p);
    }
    create_pool(ctx, backend, limit)
}

/// The creation half of [`pool_for`], kept out of line: it builds a `DevicePool` on the
/// stack (2 KiB), which made every call's frame that large when inlined.
#[cold]
#[inline(never)]
fn create_pool(
    ctx: ContextInfo,
    backend: &'static dyn Backend,
    limit: impl FnOnce() -> u64,
) -> Result<&'static DevicePool> {
    let _g = POOL_CREATE.lock();
    if let Some(p) = all_pools().find(|p| p.ctx.id == ctx.id) {
        return Ok(p);
    }
    let n = POOL_COUNT.load(Ordering::Acquire) as usize;
    if n == MAX_POOLS {
        crate::log::error("cupool: too many CUDA contexts in one process (limit 64)");
        return Err(CupoolStatus::CupoolErrorInternal);
    }
    if n > 0 {
        // Note [device waits]: another context's work is not ordered by this one's legacy
        // stream.
        device_waits::end("a second context has a pool");
    }
    let pool = Box::leak(Box::new(DevicePool::new(n as u16, ctx, backend)));
    pool.set_limit(limit());
    POOLS[n].store(pool, Ordering::Release);
    POOL_COUNT.store(n as u32 + 1, Ordering::Release);
    pool.reserve_from_config();
    Ok(pool)
}

#[derive(Default, Copy, Clone)]
struct SlowCounts {
    misses: u64,
    device_allocs: u64,
    device_frees: u64,
    retries: u64,
    ooms: u64,
    fences: u64,
    /// Queries of context fences (`cuEventQuery`) by fence passes.
    fence_queries: u64,
    cross_stream: u64,
    grow_waits: u64,
    grow_wait_ns: u64,
    /// Legacy-stream waits that stood in for fences (Note [device waits]).
    device_waits: u64,
}

struct StreamState {
    small: FreeIndex,
    large: FreeIndex,
    /// Every block of `small` and `large`, in free order.
    age: Fifo,
}

impl StreamState {
    fn new() -> Self {
        StreamState {
            small: FreeIndex::new(),
            large: FreeIndex::new(),
            age: Fifo::new(),
        }
    }

    fn index(&mut self, kind: SegmentKind) -> &mut FreeIndex {
        match kind {
            SegmentKind::Small => &mut self.small,
            SegmentKind::Large => &mut self.large,
        }
    }
}

struct Shared {
    small: FreeIndex,
    large: FreeIndex,
    streams: Vec<StreamState>,
    stream_pos: stream_ids::StreamPositions,
    /// Blocks awaiting a context fence, in free order.
    fence_queue: Fifo,
    fences: VecDeque<(EventHandle, u64)>,
    /// Blocks pushed to the fence queue since the last fence.
    unsealed_fence_blocks: u64,
    fence_sealed: u64,
    /// Newest fence epoch seen complete on the host.
    fence_done: u64,
    /// Newest fence epoch the legacy stream was made to wait for (Note [device waits]):
    /// blocks freed up to it are reusable, though the host has not seen them idle.
    device_drained: u64,
    /// Arena ranges of blocks drained by a device wait, pinned until their fence epoch
    /// (the third member) is seen complete: (address, bytes, epoch).
    device_pins: Vec<(u64, u64, u64)>,
    clock: u64,
    reserved: u64,
    reserved_peak: u64,
    /// Where the reserved bytes were when they were highest (Note [footprint at peak]).
    footprint_at_peak: Option<Footprint>,
    /// Segment base → its head block.
    segments: BTreeMap<u64, BlockIdx>,
    slow: SlowCounts,
    /// The VMM arena, while one is reserved (Note [vmm arena]).
    arena: Option<arena::Arena>,
    /// Most bytes the arenas released since the last peak reset had mapped at once (the
    /// live arena keeps its own peak).
    mapped_peak: u64,
    /// Empty block records kept for this pool's splits and merges (Note [record stash]).
    records: Vec<BlockIdx>,
    /// Bases of segments a block of which was exported through CUDA IPC: never given back
    /// to the driver (Note [exported segments] in `release.rs`).
    exported: std::collections::BTreeSet<u64>,
}

/// Note [record stash]: every split takes a block record and every merge gives one back.
/// Taken one at a time from the process-wide table, each was a trip through the table's
/// lock, which every pool shares: with one thread per device, streamless pairs went from
/// 9.1 M/s on one device to 3.5 M/s on two (`examples/devices_scaling.rs`, host backend;
/// on two H200s 0.50–0.63×). Each pool now keeps a stash under its own lock and trades
/// with the table in batches of `RECORD_BATCH`: 12.2 M/s on one device, 21.2 M/s on two
/// (host), 1.54–1.94× on the two H200s.
const RECORD_BATCH: usize = 64;

impl Shared {
    /// An empty block record, from the stash (Note [record stash]); `None` when the
    /// process-wide table is full.
    fn new_record(&mut self) -> Option<BlockIdx> {
        if self.records.is_empty() {
            BLOCKS.allocate_into(&mut self.records, RECORD_BATCH);
        }
        self.records.pop()
    }

    /// Gives back a record that no index or map refers to any more.
    fn drop_record(&mut self, idx: BlockIdx) {
        BLOCKS.clear(idx);
        self.records.push(idx);
        if self.records.len() >= 2 * RECORD_BATCH {
            BLOCKS.release_cleared(&self.records[RECORD_BATCH..]);
            self.records.truncate(RECORD_BATCH);
        }
    }

    /// Whether `idx` (owned by the caller) lies in the VMM arena.
    ///
    /// # Safety
    /// Pool lock held.
    unsafe fn in_arena(&self, idx: BlockIdx) -> bool {
        self.arena
            .as_ref()
            .is_some_and(|a| a.contains(BLOCKS.get(idx).data().ptr))
    }

    fn index(&mut self, kind: SegmentKind) -> &mut FreeIndex {
        match kind {
            SegmentKind::Small => &mut self.small,
            SegmentKind::Large => &mut self.large,
        }
    }

    fn stream(&mut self, s: StreamRef) -> &mut StreamState {
        let pos = match self.stream_pos.get(&s.id) {
            Some(&p) => p,
            None => {
                self.streams.push(StreamState::new());
                let p = self.streams.len() - 1;
                self.stream_pos.insert(s.id, p);
                p
            }
        };
        &mut self.streams[pos]
    }
}

/// One context's pool.
pub struct DevicePool {
    pub index: u16,
    pub ctx: ContextInfo,
    backend: &'static dyn Backend,
    /// On lines of its own: the lock's word is written by every thread that takes it,
    /// while the fields beside it (index, context, backend) are read on every allocation
    /// and free; sharing a line made the lines bounce between cores (perf: the loads of
    /// `index` and `ctx.device` in `free`).
    shared: LineApart<spin::Mutex<Shared>>,
    /// A blocking mutex, not a spin lock: it is held across backend calls (Note [pool locks]).
    events: std::sync::Mutex<()>,
    /// Cap on reserved bytes set for this device through the API, 0 = none,
    /// [`LIMIT_FROM_CONFIG`] = the `memory_limit` option (read when growing, so a change of
    /// the option takes effect at once).
    limit: AtomicU64,
    /// Written at every fence a thread records: on lines of their own, away from the
    /// read-mostly fields every call reads (Note [fence counters apart]).
    fence_side: LineApart<FenceSide>,
    /// The device's total memory, once asked (Note [release bound]).
    device_total: AtomicU64,
    /// Misses in a row served by a fence pass that made exactly one large block reusable
    /// (Note [lone fences]). A heuristic's count: outside the pool lock, and a lost update
    /// between racing threads only moves the second copy a little.
    lone_fence_streak: AtomicU32,
    peak_epoch: AtomicU64,
    peaks: [AtomicU64; counters::LEVELS],
    /// Whether large blocks come from a VMM arena (`vmm:on` when the pool was created, and
    /// the backend could reserve one).
    vmm: AtomicBool,
    /// Bytes the pool keeps through releases (Note [reserve at start]).
    reserve_floor: AtomicU64,
    /// Large blocks freed on their stream, kept for its next request (Note [parked arena
    /// blocks]).
    parked: parked::ParkSlots,
    /// Old places of moved arena memory and the thread that unmaps them (Note [unmaps off
    /// the launching thread]).
    unmapper: vmm::unmapper::Unmapper,
}

/// Note [fence counters apart]: every context fence a thread records enters and leaves the
/// capture exclusion and counts itself. Those counters shared a cache line with the pool's
/// backend, context and index, which every call reads, and the capture side's `depth`
/// shared one with `ordering_calls`, which every fence writes: each fence of one thread
/// made the next calls and fences of every other thread miss. perf, host backend, two
/// threads, `thread_cache_streamless:true`: the load of `depth` took 64% of the samples of
/// `record_thread_fence` (a thread fence's record then; `ThreadFences::record` in
/// `frees.rs` now), 17% of all. With the counters on lines of their own (and
/// `depth` read by a load: Note [capture exclusion]) that function fell to 4%, and the
/// pairs went from 14.6–16.1 to 15.5–18.2 M/s on two threads (23.3–24.3 to 24.4–25.0 on
/// one; 3 interleaved runs each, docs/BENCHMARKS.md).
struct FenceSide {
    /// Captures open in this pool's context, and the driver calls they exclude (Note
    /// [capture exclusion] in `capture.rs`).
    captures: capture::CaptureExclusion,
    /// The context fences that cover the streamless frees threads keep (Note [thread
    /// fences]), shared by every thread's kept batches (Note [shared thread fences]).
    thread_clock: fence_clock::FenceClock,
    /// The pool clock (`Shared::clock`), stored after each increment, before the fence it
    /// numbers is recorded: what a parked block is stamped with (Note [parked arena
    /// blocks]).
    clock: AtomicU64,
    /// Time in the fence calls (Note [fence call times]).
    times: fence_times::FenceTimes,
}

impl DevicePool {
    fn new(index: u16, ctx: ContextInfo, backend: &'static dyn Backend) -> Self {
        DevicePool {
            index,
            ctx,
            backend,
            shared: LineApart(spin::Mutex::new(Shared {
                small: FreeIndex::new(),
                large: FreeIndex::new(),
                streams: Vec::new(),
                stream_pos: stream_ids::StreamPositions::default(),
                fence_queue: Fifo::new(),
                fences: VecDeque::new(),
                unsealed_fence_blocks: 0,
                fence_sealed: 0,
                fence_done: 0,
                device_drained: 0,
                device_pins: Vec::new(),
                clock: 1,
                reserved: 0,
                reserved_peak: 0,
                footprint_at_peak: None,
                segments: BTreeMap::new(),
                slow: SlowCounts::default(),
                arena: None,
                mapped_peak: 0,
                records: Vec::with_capacity(2 * RECORD_BATCH),
                exported: std::collections::BTreeSet::new(),
            })),
            events: std::sync::Mutex::new(()),
            limit: AtomicU64::new(LIMIT_FROM_CONFIG),
            fence_side: LineApart(FenceSide {
                captures: capture::CaptureExclusion::new(),
                thread_clock: fence_clock::FenceClock::new(),
                clock: AtomicU64::new(1),
                times: fence_times::FenceTimes::new(),
            }),
            device_total: AtomicU64::new(0),
            lone_fence_streak: AtomicU32::new(0),
            peak_epoch: AtomicU64::new(0),
            peaks: core::array::from_fn(|_| AtomicU64::new(0)),
            vmm: AtomicBool::new(config::get(Key::Vmm) == 1),
            reserve_floor: AtomicU64::new(0),
            parked: parked::ParkSlots::new(),
            unmapper: vmm::unmapper::Unmapper::default(),
        }
    }

    /// Estimated time in the driver calls that order reuse after frees (Note [fence call
    /// times]).
    pub fn fence_time_stats(&self) -> fence_times::FenceTimeStats {
        self.fence_side.times.stats()
    }

    /// Runs the fence call `f` of kind `call`, timed now and then (Note [fence call times]).
    #[inline]
    pub(crate) fn fence_call<T>(&self, call: fence_times::FenceCall, f: impl FnOnce() -> T) -> T {
        self.fence_side.times.time(call, f)
    }

    pub fn set_limit(&self, bytes: u64) {
        self.limit.store(bytes, Ordering::Relaxed);
    }

    /// The cap in force on reserved bytes (0 = none).
    pub fn limit(&self) -> u64 {
        match self.limit.load(Ordering::Relaxed) {
            LIMIT_FROM_CONFIG => config::get(Key::MemoryLimit),
            l => l,
        }
    }

    #[inline]
    pub fn peak_epoch(&self) -> u64 {
        self.peak_epoch.load(Ordering::Relaxed)
    }

    /// Whether a block of `size` comes from (and goes back to) this pool's VMM arena.
    ///
    /// Note [arena blocks bypass thread caches]: a large block parked in a thread cache is
    /// pinned in the arena (its granules cannot be stolen) and cannot merge with its free
    /// neighbours, and a request of another size class misses it: the arena then maps or
    /// moves memory instead. Given straight to its stream's free list it merges at once
    /// and is still reused by its stream without a fence. Host replays, `vmm:on`
    /// (docs/BENCHMARKS.md): `conv_train.torch` 1133 + 797 map + unmap calls at 96.0% to
    /// 387 + 67 at 97.7%, `gpt_train.torch` 1653 + 963 at 96.3% to 1242 + 552 at 96.6%.
    /// Their stream's next request of the same size is served without the lists by
    /// parking instead (Note [parked arena blocks] in `parked.rs`), which every pass that
    /// needs the block merged undoes first.
    #[inline]
    pub(crate) fn vmm_large(&self, size: u64) -> bool {
        size > size_policy::SMALL_MAX && self.vmm.load(Ordering::Relaxed)
    }

    /// Whether large blocks come from the VMM arena now.
    fn arena_active(&self) -> bool {
        self.arena_active_in(&self.shared.lock())
    }

    /// [`DevicePool::arena_active`] for a caller that holds the pool lock (`sh`).
    fn arena_active_in(&self, sh: &Shared) -> bool {
        self.vmm.load(Ordering::Relaxed) && sh.arena.is_some()
    }

    /// Whether fences, syncs and releases may be issued now.
    fn may_order(&self) -> bool {
        !self.capturing() && !BACKEND_OFF.load(Ordering::Relaxed)
    }

    /// Recomputes the pool-wide peak of `level` after a thread reached a new high.
    #[cold]
    pub fn update_peak(&self, level: Level) {
        let total = thread_cache::sum_level(self.index, level).max(0) as u64;
        self.peaks[level as usize].fetch_max(total, Ordering::Relaxed);
    }

    /// Bookkeeping for a block handed to the program (any path).
    #[inline]
    pub fn note_allocated(&self, c: &ThreadCounters, size: u64, requested: u64) {
        let epoch = self.peak_epoch();
        c.count(counters::Count::Allocs);
        if c.raise(Level::Allocated, size, epoch).0 {
            self.update_peak(Level::Allocated);
        }
        if c.raise(Level::Requested, requested, epoch).0 {
            self.update_peak(Level::Requested);
        }
        c.lower(Level::Cached, size);
    }

    /// Bookkeeping for a block the program gave back (any path).
    #[inline]
    pub fn note_freed(&self, c: &ThreadCounters, size: u64, requested: u64) {
        c.count(counters::Count::Frees);
        c.lower(Level::Allocated, size);
        c.lower(Level::Requested, requested);
        if c.raise(Level::Cached, size, self.peak_epoch()).0 {
            self.update_peak(Level::Cached);
        }
    }
}
