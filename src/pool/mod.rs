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
//! Note [locks]: `shared` (a spin lock) guards the indexes and lists and is held only for
//! short metadata work, never across a backend call. `events` (a blocking mutex, not a spin
//! lock) serialises recording and polling of context fences (so an event is never
//! recycled while another thread queries it); it is taken only when a request missed the
//! cache, on OOM, and by `empty_cache`, and it is the only lock held across backend calls. Order: `events` before
//! `shared`.

pub mod address_map;
pub mod block;
pub mod counters;
pub mod fifo;
pub mod free_index;
pub mod size_class;
pub mod thread_cache;
pub mod vmm;

use crate::backend::{Backend, BackendError, ContextInfo, EventHandle, StreamHandle};
use crate::config::{self, Key};
use crate::stats::{CupoolStat, CupoolStats};
use crate::status::{CupoolStatus, Result};
use address_map::AddressMap;
use block::{BlockData, BlockIdx, BlockTable, Place, SegmentKind, NIL};
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use counters::{Level, ThreadCounters};
use fifo::Fifo;
use free_index::FreeIndex;
use size_class::ALIGNMENT;
use std::collections::{BTreeMap, HashMap, VecDeque};

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

/// Largest block carved from small segments.
pub const SMALL_MAX: u64 = 1 << 20;
/// A large block is split only when the remainder is at least this big (smaller remainders
/// stay with the block: splitting them off would only make fragments). It is also the most
/// a block handed out may exceed its rounded request by, on every path (Note [excess]).
///
/// Note [excess]: the shared index splits a larger free block down to the request unless
/// the remainder is under this bound, and a segment of a block's own is rounded to 2 MiB
/// with the same rule; the thread cache, which never splits, hands out a cached block only
/// when it is less than this bound larger than the request. Before that rule a thread-cache
/// hit could hand out a block of the same size class whole, up to 1/8 larger than asked
/// (4 MiB on a 34 MiB request): memory the program could not use and the pool could not
/// lend. `tests/pool_host.rs` checks the bound on every allocation.
pub const LARGE_SPLIT_MIN: u64 = 1 << 20;
/// Fitting free blocks of the arena compared for the fewest unmapped granules.
const VMM_FIT_PROBES: usize = 16;
/// Smallest remainder split off a block of the VMM arena.
const VMM_SPLIT_MIN: u64 = ALIGNMENT;
/// Granularity of large segments (the driver's own).
const SEGMENT_GRANULE: u64 = 2 << 20;
/// Context fences outstanding at most before a poll stops recording new ones (each costs
/// an event and ~0.2-0.7 µs to record; while the device is this far behind, a new one
/// would not complete before the outstanding ones).
const MAX_OUTSTANDING_FENCES: usize = 64;
/// Fenced reuses of a lone block in a row after which the pool grows a second copy of it
/// (Note [lone fences]). A ski-rental bound: 256 fences (a record and a query, ~0.37 µs
/// on an H100) cost about what allocating a 64 MiB segment costs (~85 µs), so a loop never
/// pays much more than twice what the better of "fence every reuse" and "hold a second
/// copy" would have cost it.
const SPARE_AFTER_LONE_FENCES: u32 = 256;

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
pub fn pool_for(
    ctx: ContextInfo,
    backend: &'static dyn Backend,
    limit: impl FnOnce() -> u64,
) -> Result<&'static DevicePool> {
    if let Some(p) = all_pools().find(|p| p.ctx.id == ctx.id) {
        return Ok(p);
    }
    let _g = POOL_CREATE.lock();
    if let Some(p) = all_pools().find(|p| p.ctx.id == ctx.id) {
        return Ok(p);
    }
    let n = POOL_COUNT.load(Ordering::Acquire) as usize;
    if n == MAX_POOLS {
        crate::log::error("cupool: too many CUDA contexts in one process (limit 64)");
        return Err(CupoolStatus::CupoolErrorInternal);
    }
    let pool = Box::leak(Box::new(DevicePool::new(n as u16, ctx, backend)));
    pool.set_limit(limit());
    POOLS[n].store(pool, Ordering::Release);
    POOL_COUNT.store(n as u32 + 1, Ordering::Release);
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
    cross_stream: u64,
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
    stream_pos: HashMap<u64, usize>,
    /// Blocks awaiting a context fence, in free order.
    fence_queue: Fifo,
    fences: VecDeque<(EventHandle, u64)>,
    /// Blocks pushed to the fence queue since the last fence.
    unsealed_fence_blocks: u64,
    fence_sealed: u64,
    fence_done: u64,
    clock: u64,
    reserved: u64,
    reserved_peak: u64,
    /// Segment base → its head block.
    segments: BTreeMap<u64, BlockIdx>,
    slow: SlowCounts,
    /// The VMM arena, while one is reserved (Note [vmm arena]).
    arena: Option<vmm::Arena>,
    /// Most bytes the arenas released since the last peak reset had mapped at once (the
    /// live arena keeps its own peak).
    mapped_peak: u64,
}

impl Shared {
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

/// An event or fence and the clock value it covers.
type Recorded = (EventHandle, u64);

/// The context fences outstanding after a seal.
struct Outstanding {
    count: usize,
    newest: Option<Recorded>,
}

impl Outstanding {
    fn of(sh: &Shared) -> Self {
        Outstanding {
            count: sh.fences.len(),
            newest: sh.fences.back().copied(),
        }
    }
}

/// Which work a fence-advance pass may do. Each first seals: records one fence for the
/// frees no fence covers yet (not past [`MAX_OUTSTANDING_FENCES`] unless it waits for all).
#[derive(Copy, Clone, PartialEq, Eq)]
enum Advance {
    /// Record events/fences for unsealed frees and poll the outstanding ones.
    Poll,
    /// Record, then wait for every outstanding event and fence (OOM path, empty_cache).
    Wait,
    /// Record, then wait at most this long for the newest fence (before growing: Note
    /// [wait before growing]); what completed meanwhile drains either way.
    WaitUpTo(core::time::Duration),
}

/// One context's pool.
pub struct DevicePool {
    pub index: u16,
    pub ctx: ContextInfo,
    backend: &'static dyn Backend,
    shared: spin::Mutex<Shared>,
    /// A blocking mutex, not a spin lock: it is held across backend calls (Note [locks]).
    events: std::sync::Mutex<()>,
    /// Cap on reserved bytes set for this device through the API, 0 = none,
    /// [`LIMIT_FROM_CONFIG`] = the `memory_limit` option (read when growing, so a change of
    /// the option takes effect at once).
    limit: AtomicU64,
    capture_depth: AtomicU32,
    /// Misses in a row served by a fence pass that made exactly one large block reusable
    /// (Note [lone fences]). A heuristic's count: outside the pool lock, and a lost update
    /// between racing threads only moves the second copy a little.
    lone_fence_streak: AtomicU32,
    peak_epoch: AtomicU64,
    peaks: [AtomicU64; counters::LEVELS],
    /// Whether large blocks come from a VMM arena (`vmm:on` when the pool was created, and
    /// the backend could reserve one).
    vmm: AtomicBool,
}

impl DevicePool {
    fn new(index: u16, ctx: ContextInfo, backend: &'static dyn Backend) -> Self {
        DevicePool {
            index,
            ctx,
            backend,
            shared: spin::Mutex::new(Shared {
                small: FreeIndex::new(),
                large: FreeIndex::new(),
                streams: Vec::new(),
                stream_pos: HashMap::new(),
                fence_queue: Fifo::new(),
                fences: VecDeque::new(),
                unsealed_fence_blocks: 0,
                fence_sealed: 0,
                fence_done: 0,
                clock: 1,
                reserved: 0,
                reserved_peak: 0,
                segments: BTreeMap::new(),
                slow: SlowCounts::default(),
                arena: None,
                mapped_peak: 0,
            }),
            events: std::sync::Mutex::new(()),
            limit: AtomicU64::new(LIMIT_FROM_CONFIG),
            capture_depth: AtomicU32::new(0),
            lone_fence_streak: AtomicU32::new(0),
            peak_epoch: AtomicU64::new(0),
            peaks: core::array::from_fn(|_| AtomicU64::new(0)),
            vmm: AtomicBool::new(config::get(Key::Vmm) == 1),
        }
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

    pub fn capture_begin(&self) {
        self.capture_depth.fetch_add(1, Ordering::AcqRel);
    }

    pub fn capture_end(&self) {
        let _ = self
            .capture_depth
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| d.checked_sub(1));
    }

    pub fn capturing(&self) -> bool {
        self.capture_depth.load(Ordering::Acquire) != 0
    }

    #[inline]
    pub fn peak_epoch(&self) -> u64 {
        self.peak_epoch.load(Ordering::Relaxed)
    }

    /// Whether large blocks come from the VMM arena now.
    fn arena_active(&self) -> bool {
        self.vmm.load(Ordering::Relaxed) && self.shared.lock().arena.is_some()
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

    fn kind_for(size: u64) -> SegmentKind {
        if size <= SMALL_MAX {
            SegmentKind::Small
        } else {
            SegmentKind::Large
        }
    }

    fn segment_size_for(&self, size: u64, kind: SegmentKind) -> u64 {
        match kind {
            SegmentKind::Small => config::get(Key::SmallSegment).max(SMALL_MAX),
            SegmentKind::Large => {
                let large = config::get(Key::LargeSegment).max(2 * SMALL_MAX);
                if size <= large / 2 {
                    large
                } else {
                    size.div_ceil(SEGMENT_GRANULE) * SEGMENT_GRANULE
                }
            }
        }
    }

    // ---------------------------------------------------------------- allocation

    /// Allocates a block that missed the thread cache. `flush_own_cache` gives the calling
    /// thread's cached blocks of this pool back; it is called before the pool grows and
    /// before the out-of-memory retry, so blocks the thread holds are not left out.
    pub fn alloc_slow(
        &self,
        c: &ThreadCounters,
        size: u64,
        requested: u64,
        stream: Option<StreamRef>,
        flush_own_cache: &mut dyn FnMut(),
    ) -> Result<u64> {
        let req = Request {
            size,
            requested,
            kind: Self::kind_for(size),
            stream,
        };
        if req.kind == SegmentKind::Large && self.vmm.load(Ordering::Relaxed) {
            self.ensure_arena();
        }
        // Note [remap last]: in the VMM arena a large request always "fits" its unmapped
        // tail, so a first fit that needs granules mapped would remap (tens of µs per
        // granule on a GPU) while frees waiting for a fence could serve it as they are.
        // Fits that need no mapping come first: before and after a fence pass, after this
        // thread's cache is flushed and after waiting for fences; mapping comes last.
        if let Some(ptr) = self.try_fit(c, req, false) {
            return Ok(ptr);
        }
        if self.may_order() {
            if self.spare_due(req) {
                // On failure (limit, driver OOM) the fence below serves the request, and
                // the streak starts again: no release-and-retry for a copy nobody needs.
                if let Ok(ptr) = self.grow_and_carve(c, req) {
                    self.shared.lock().slow.misses += 1;
                    return Ok(ptr);
                }
            }
            let moved = self.advance(Advance::Poll);
            let fitted = if moved > 0 {
                self.try_fit(c, req, false)
            } else {
                None
            };
            self.note_fence_pass(req, moved, fitted.is_some());
            if let Some(ptr) = fitted {
                return Ok(ptr);
            }
        }
        // Blocks this thread's cache holds are invisible to the search above (the cache
        // is searched by the request's class only): give them back before growing.
        flush_own_cache();
        if req.kind == SegmentKind::Large && self.arena_active() && self.may_order() {
            // Note [vmm arena]: the flushed blocks' granules can be stolen once fenced.
            self.advance(Advance::Poll);
        }
        if let Some(ptr) = self.try_fit(c, req, false) {
            return Ok(ptr);
        }
        if let Some(ptr) = self.wait_before_growing(c, req) {
            return Ok(ptr);
        }
        if let Some(ptr) = self.try_fit(c, req, true) {
            return Ok(ptr);
        }
        self.shared.lock().slow.misses += 1;
        match self.grow_and_carve(c, req) {
            Ok(ptr) => return Ok(ptr),
            Err(CupoolStatus::CupoolErrorOutOfMemory) => {}
            Err(e) => return Err(e),
        }
        // Out of memory: give back what the pool can, then try once more.
        self.shared.lock().slow.retries += 1;
        crate::log::info(&format!(
            "cupool: device {} out of memory for {size} bytes; waiting for pending frees and releasing cached memory",
            self.ctx.device
        ));
        flush_own_cache();
        // Other threads give theirs back at their next call.
        thread_cache::request_flush_all();
        if self.may_order() {
            self.advance(Advance::Wait);
            if let Some(ptr) = self.try_fit(c, req, true) {
                return Ok(ptr);
            }
            self.release_idle_segments(c);
        }
        let result = self.grow_and_carve(c, req);
        if result == Err(CupoolStatus::CupoolErrorOutOfMemory) {
            self.shared.lock().slow.ooms += 1;
            crate::log::info(&format!(
                "cupool: device {} out of memory: {size} bytes requested",
                self.ctx.device
            ));
        }
        result
    }

    /// Note [wait before growing]: blocks freed while the device is behind wait for their
    /// fence, and a miss that cannot use them would take more memory from the driver. When
    /// the bytes waiting would cover the request, the miss waits (at most `grow_wait_us`)
    /// for the newest fence instead, which is what `cudaFree` would have waited for on
    /// every free; then it fits the request from what drained. The stall is bounded and
    /// taken only on a miss, where a driver allocation (tens of µs) was the alternative.
    /// A spare copy (Note [lone fences]) is not subject to this: it exists to save fences.
    fn wait_before_growing(&self, c: &ThreadCounters, req: Request) -> Option<u64> {
        let bound = config::get(Key::GrowWaitUs);
        if bound == 0 || !self.may_order() {
            return None;
        }
        let waiting = {
            let sh = self.shared.lock();
            sh.fence_queue.bytes + sh.streams.iter().map(|st| st.age.bytes).sum::<u64>()
        };
        if waiting < req.size {
            return None;
        }
        let bound = core::time::Duration::from_micros(bound);
        let moved = self.advance(Advance::WaitUpTo(bound));
        if moved == 0 {
            return None;
        }
        self.try_fit(c, req, false)
    }

    /// Whether this miss should grow a second copy of a large block instead of fencing the
    /// freed one again; if so, the streak starts again.
    ///
    /// Note [lone fences]: a block with a segment of its own that a loop frees without a
    /// stream and allocates again needs, for every reuse, a context fence recorded after
    /// its free and seen complete (~0.37 µs of driver calls on an H100, most of such a
    /// pair's cost). With two copies, one fence covers both frees: half the fences. When
    /// [`SPARE_AFTER_LONE_FENCES`] misses in a row were each served by a fence pass that
    /// made exactly one block reusable, the next miss of a large block up to
    /// `fence_spare_max` grows instead. With GPU work in flight the pool grows the second
    /// copy anyway (the fence is not complete yet), so this only gives an idle loop a busy
    /// loop's footprint. The copy is ordinary idle cache: released by `empty_cache` and
    /// before an out-of-memory error, reported free by the interposer's `cuMemGetInfo`.
    fn spare_due(&self, req: Request) -> bool {
        if req.kind != SegmentKind::Large || req.size > config::get(Key::FenceSpareMax) {
            return false;
        }
        let streak = self.lone_fence_streak.load(Ordering::Relaxed);
        // Of racing misses, the one that resets the streak grows the copy.
        streak >= SPARE_AFTER_LONE_FENCES
            && self
                .lone_fence_streak
                .compare_exchange(streak, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Counts a miss's fence pass for Note [lone fences]: it made `moved` blocks reusable,
    /// and the request was `served` from them.
    fn note_fence_pass(&self, req: Request, moved: usize, served: bool) {
        let lone = moved == 1 && served && req.kind == SegmentKind::Large;
        let streak = self.lone_fence_streak.load(Ordering::Relaxed);
        let next = if lone { streak.saturating_add(1) } else { 0 };
        if next != streak {
            self.lone_fence_streak.store(next, Ordering::Relaxed);
        }
    }

    /// Takes a fitting free block the caller may use, from its stream's own frees first,
    /// then from the shared index. With `remap` false, a block of the VMM arena that is not
    /// wholly mapped is left where it is (Note [remap last]).
    fn try_fit(&self, c: &ThreadCounters, req: Request, remap: bool) -> Option<u64> {
        let Request { size, kind, .. } = req;
        let mut sh = self.shared.lock();
        // SAFETY: pool lock held for every record touched below.
        unsafe {
            if let Some(s) = req.stream {
                if let Some(&pos) = sh.stream_pos.get(&s.id) {
                    // The stream's own block unless the shared index has a smaller fit.
                    let own = sh.streams[pos].index(kind).find(&BLOCKS, size);
                    let shared = sh.index(kind).find(&BLOCKS, size);
                    let size_of = |i: BlockIdx| BLOCKS.get(i).data().size;
                    let use_own = match (own, shared) {
                        (Some(o), Some(g)) => size_of(o) <= size_of(g),
                        (Some(_), None) => true,
                        _ => false,
                    };
                    if let (true, Some(idx)) = (use_own, own) {
                        let st = &mut sh.streams[pos];
                        st.index(kind).remove(&BLOCKS, idx);
                        BLOCKS.get(idx).data().place = Place::Allocated;
                        match self.split(&mut sh, idx, size, kind, Place::FreeOnStream, true) {
                            Some(rest) => {
                                let st = &mut sh.streams[pos];
                                st.age.replace(&BLOCKS, idx, rest);
                                st.index(kind).insert(&BLOCKS, rest);
                            }
                            None => sh.streams[pos].age.remove(&BLOCKS, idx),
                        }
                        drop(sh);
                        return Some(self.hand_out(c, idx, req));
                    }
                }
            }
            let (idx, mapped) = self.take_shared(&mut sh, req)?;
            if !mapped && !remap {
                self.insert_shared(&mut sh, idx);
                return None;
            }
            drop(sh);
            if !mapped {
                return self.map_or_put_back(c, idx, req, false).ok();
            }
            Some(self.hand_out(c, idx, req))
        }
    }

    /// Takes a free block of at least `req.size` from the shared index and splits it to
    /// size; returns it and whether every granule under it is mapped (always, outside the
    /// VMM arena).
    ///
    /// # Safety
    /// Pool lock held.
    unsafe fn take_shared(&self, sh: &mut Shared, req: Request) -> Option<(BlockIdx, bool)> {
        let Request { size, kind, .. } = req;
        let idx = match sh.arena.as_ref() {
            // Note [vmm arena]: among a few fitting blocks, the one needing the fewest
            // granules mapped (a remap costs tens of µs on a GPU).
            Some(a) if kind == SegmentKind::Large => {
                sh.large.find_cheapest(&BLOCKS, size, VMM_FIT_PROBES, |i| {
                    let p = BLOCKS.get(i).data().ptr;
                    if a.contains(p) {
                        a.unmapped_count(p, size)
                    } else {
                        0
                    }
                })?
            }
            _ => sh.index(kind).find(&BLOCKS, size)?,
        };
        sh.index(kind).remove(&BLOCKS, idx);
        // Taken: a remainder split off below must not merge back into it.
        let d = BLOCKS.get(idx).data();
        d.place = Place::Allocated;
        let in_arena = sh.in_arena(idx);
        if in_arena {
            // Note [vmm arena]: only the part handed out is pinned (a free block may be the
            // arena's whole tail); the remainder goes back unpinned. In the arena a block
            // is split unless it fits exactly.
            sh.arena.as_mut().unwrap().pin(d.ptr, size);
            if let Some(rest) = self.split(sh, idx, size, kind, Place::FreeShared, false) {
                self.insert_shared_as(sh, rest, false);
            }
        } else if let Some(rest) = self.split(sh, idx, size, kind, Place::FreeShared, true) {
            self.insert_shared(sh, rest);
        }
        let mapped = !in_arena || sh.arena.as_ref().unwrap().all_mapped(d.ptr, d.size);
        Some((idx, mapped))
    }

    /// Maps the granules under the arena block `idx` (taken and pinned by the caller) and
    /// hands it out; when that fails, puts the block back in the shared index.
    fn map_or_put_back(
        &self,
        c: &ThreadCounters,
        idx: BlockIdx,
        req: Request,
        may_create: bool,
    ) -> Result<u64> {
        match self.map_arena_block(c, idx, may_create) {
            Ok(()) => Ok(self.hand_out(c, idx, req)),
            Err(e) => {
                let mut sh = self.shared.lock();
                // SAFETY: pool lock held; the block is ours, in no index.
                unsafe { self.insert_shared(&mut sh, idx) };
                Err(e)
            }
        }
    }

    /// Splits `idx` so that it is `size` bytes long, when the remainder is worth keeping;
    /// returns the remainder's record (same stream and stamp as `idx`, in `rest_place`; the
    /// caller puts it in the matching index).
    ///
    /// # Safety
    /// Pool lock held; `idx` is owned by the caller (in no index).
    unsafe fn split(
        &self,
        sh: &mut Shared,
        idx: BlockIdx,
        size: u64,
        kind: SegmentKind,
        rest_place: Place,
        pinned_whole: bool,
    ) -> Option<BlockIdx> {
        let d = BLOCKS.get(idx).data();
        let rest_size = d.size - size;
        let in_arena = sh.in_arena(idx);
        let min = match kind {
            SegmentKind::Small => ALIGNMENT,
            // A remainder in the arena costs no segment of its own: split exactly.
            SegmentKind::Large if in_arena => VMM_SPLIT_MIN,
            SegmentKind::Large => LARGE_SPLIT_MIN,
        };
        if rest_size < min {
            return None;
        }
        if in_arena && pinned_whole {
            // The block is pinned (outside the shared index): the granule at the cut now
            // overlaps two such blocks (Note [vmm arena]).
            sh.arena.as_mut().unwrap().split_at(d.ptr + size);
        }
        let rest = BLOCKS.allocate()?;
        let r = BLOCKS.get(rest).data();
        *r = *d;
        r.ptr = d.ptr + size;
        r.size = rest_size;
        r.requested = 0;
        r.place = rest_place;
        r.segment_head = false;
        r.segment_size = 0;
        r.seg_prev = idx;
        r.seg_next = d.seg_next;
        r.list_prev = NIL;
        r.list_next = NIL;
        r.fifo_prev = NIL;
        r.fifo_next = NIL;
        if d.seg_next != NIL {
            BLOCKS.get(d.seg_next).data().seg_prev = rest;
        }
        d.seg_next = rest;
        d.size = size;
        BLOCKS.get(rest).publish_free(r.ptr);
        ADDRESSES.set(r.ptr, rest);
        Some(rest)
    }

    /// Marks `idx` as handed to the program and does its bookkeeping.
    fn hand_out(&self, c: &ThreadCounters, idx: BlockIdx, req: Request) -> u64 {
        let b = BLOCKS.get(idx);
        // SAFETY: the caller took `idx` out of every list; nobody else refers to it.
        let d = unsafe { b.data() };
        d.place = Place::Allocated;
        d.requested = req.requested;
        d.stream = req.stream.map_or(STREAMLESS, |s| s.id);
        d.handle = req.stream.map_or(0, |s| s.handle as u64);
        let (ptr, size) = (d.ptr, d.size);
        self.note_allocated(c, size, req.requested);
        b.publish_allocated(ptr);
        ptr
    }

    /// Puts a free block in the shared index, merging it with free neighbours.
    ///
    /// # Safety
    /// Pool lock held; `idx` is owned by the caller (in no index or FIFO).
    unsafe fn insert_shared(&self, sh: &mut Shared, idx: BlockIdx) {
        self.insert_shared_as(sh, idx, true)
    }

    /// [`DevicePool::insert_shared`]; `pinned` says whether the block's granules are
    /// pinned (an arena block coming from outside the shared index), so that it unpins
    /// them.
    ///
    /// # Safety
    /// As for [`DevicePool::insert_shared`].
    unsafe fn insert_shared_as(&self, sh: &mut Shared, idx: BlockIdx, pinned: bool) {
        let mut idx = idx;
        let d = BLOCKS.get(idx).data();
        if let Some(a) = sh.arena.as_mut().filter(|a| pinned && a.contains(d.ptr)) {
            a.unpin(d.ptr, d.size);
        }
        let kind = d.kind;
        let prev = d.seg_prev;
        if prev != NIL && BLOCKS.get(prev).data().place == Place::FreeShared {
            sh.index(kind).remove(&BLOCKS, prev);
            Self::absorb_next(prev);
            idx = prev;
        }
        let next = BLOCKS.get(idx).data().seg_next;
        if next != NIL && BLOCKS.get(next).data().place == Place::FreeShared {
            sh.index(kind).remove(&BLOCKS, next);
            Self::absorb_next(idx);
        }
        let d = BLOCKS.get(idx).data();
        d.place = Place::FreeShared;
        d.stream = 0;
        d.requested = 0;
        sh.index(kind).insert(&BLOCKS, idx);
    }

    /// Merges `idx`'s next neighbour into `idx` and frees the neighbour's record.
    ///
    /// # Safety
    /// Pool lock held; both blocks are owned by the caller.
    unsafe fn absorb_next(idx: BlockIdx) {
        let d = BLOCKS.get(idx).data();
        let next = d.seg_next;
        let n = *BLOCKS.get(next).data();
        d.size += n.size;
        d.seg_next = n.seg_next;
        if n.seg_next != NIL {
            BLOCKS.get(n.seg_next).data().seg_prev = idx;
        }
        ADDRESSES.clear(n.ptr);
        BLOCKS.release(next);
    }

    /// Gets a new segment from the backend (no lock held during the call) and carves the
    /// block from it.
    fn grow_and_carve(&self, c: &ThreadCounters, req: Request) -> Result<u64> {
        if self.capturing() {
            // A fence, sync or driver allocation now could invalidate the capture; the
            // interposer hands the request to the driver unchanged.
            return Err(CupoolStatus::CupoolErrorStreamCapture);
        }
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return Err(CupoolStatus::CupoolErrorBackendUnavailable);
        }
        if req.kind == SegmentKind::Large && self.shared.lock().arena.is_some() {
            return self.carve_arena(c, req);
        }
        // The usual segment first; for a large block that does not fit (memory limit or
        // driver OOM), a segment of just the block's size.
        let standard = self.segment_size_for(req.size, req.kind);
        let minimal = match req.kind {
            SegmentKind::Small => standard,
            SegmentKind::Large => req.size.div_ceil(SEGMENT_GRANULE) * SEGMENT_GRANULE,
        };
        let candidates: &[u64] = if minimal < standard {
            &[standard, minimal]
        } else {
            &[standard]
        };
        for &seg_size in candidates {
            let limit = self.limit();
            if limit != 0 && self.reserved() + seg_size > limit {
                continue;
            }
            match self.backend.allocate(self.ctx.id, seg_size) {
                Ok(ptr) => return self.adopt_segment(c, ptr, seg_size, req),
                Err(BackendError::OutOfMemory) => {}
                Err(e) => {
                    crate::log::info(&format!("cupool: segment allocation failed: {e:?}"));
                    return Err(e.into());
                }
            }
        }
        Err(CupoolStatus::CupoolErrorOutOfMemory)
    }

    fn adopt_segment(
        &self,
        c: &ThreadCounters,
        ptr: u64,
        seg_size: u64,
        req: Request,
    ) -> Result<u64> {
        let Request { size, kind, .. } = req;
        if ptr % ALIGNMENT != 0 || ptr >= address_map::ADDRESS_LIMIT {
            // Never seen from CUDA; refuse rather than hand out memory we cannot track.
            let _ = self.backend.release(self.ctx.id, ptr, seg_size);
            crate::log::error("cupool: backend returned an address the pool cannot track");
            return Err(CupoolStatus::CupoolErrorInternal);
        }
        let Some(idx) = BLOCKS.allocate() else {
            let _ = self.backend.release(self.ctx.id, ptr, seg_size);
            return Err(CupoolStatus::CupoolErrorOutOfMemory);
        };
        let mut sh = self.shared.lock();
        // SAFETY: the record is new and ours; pool lock held.
        unsafe {
            // About to be handed out: a remainder split off below must not merge into it.
            *BLOCKS.get(idx).data() =
                BlockData::segment_head(ptr, seg_size, self.index, kind, Place::Allocated);
            BLOCKS.get(idx).publish_free(ptr);
            ADDRESSES.set(ptr, idx);
            sh.segments.insert(ptr, idx);
            sh.reserved += seg_size;
            sh.reserved_peak = sh.reserved_peak.max(sh.reserved);
            sh.slow.device_allocs += 1;
            if c.raise(Level::Cached, seg_size, self.peak_epoch()).0 {
                drop(sh);
                self.update_peak(Level::Cached);
                sh = self.shared.lock();
            }
            if let Some(rest) = self.split(&mut sh, idx, size, kind, Place::FreeShared, true) {
                self.insert_shared(&mut sh, rest);
            }
        }
        drop(sh);
        crate::trace::record::segment_alloc(ptr, seg_size, self.ctx.device);
        Ok(self.hand_out(c, idx, req))
    }

    // ---------------------------------------------------------------- frees

    /// A block freed on stream `s` (directly or flushed from a thread cache): `s` may take
    /// it at once, other streams once a context fence recorded after now completes.
    ///
    /// # Safety
    /// The caller owns every block in `blocks` (taken back from the program or from its
    /// thread cache), all of this pool.
    pub unsafe fn free_to_stream(&self, s: StreamRef, blocks: &[BlockIdx]) {
        let mut sh = self.shared.lock();
        let clock = sh.clock;
        for &idx in blocks {
            let d = BLOCKS.get(idx).data();
            d.place = Place::FreeOnStream;
            d.stream = s.id;
            d.requested = 0;
            d.free_epoch = clock;
            let idx = self.merge_on_stream(&mut sh, s, idx);
            let kind = BLOCKS.get(idx).data().kind;
            let st = sh.stream(s);
            st.index(kind).insert(&BLOCKS, idx);
            st.age.push_back(&BLOCKS, idx);
        }
    }

    /// Merges a block just freed on stream `s` (in no list yet) with its free neighbours
    /// that `s` may use: blocks freed on `s` itself and shared ones. The result belongs to
    /// `s` until a fence covers it (its stamp is the newest), like any block freed on `s`.
    ///
    /// Note [merge on free]: without it, a segment freed piece by piece on a stream stays
    /// in pieces until the next fence drains them into the shared index, and a request
    /// as large as the segment misses and grows the pool while the memory sits there.
    ///
    /// # Safety
    /// Pool lock held; `idx` is owned by the caller (in no index or FIFO).
    unsafe fn merge_on_stream(&self, sh: &mut Shared, s: StreamRef, idx: BlockIdx) -> BlockIdx {
        let mut idx = idx;
        let kind = BLOCKS.get(idx).data().kind;
        // A shared free block of the VMM arena may lie over unmapped granules, which a
        // block outside the shared index must never do (Note [vmm arena]): only the
        // stream's own pieces merge there.
        let arena = sh.arena.as_ref().map(|a| (a.base, a.size));
        let in_arena = |p: u64| arena.is_some_and(|(base, size)| p >= base && p - base < size);
        let mergeable = |n: BlockIdx| {
            n != NIL && {
                let nd = BLOCKS.get(n).data();
                (nd.place == Place::FreeShared && !in_arena(nd.ptr))
                    || (nd.place == Place::FreeOnStream && nd.stream == s.id)
            }
        };
        // Takes neighbour `n` out of its list before it merges into a block outside the
        // shared index that it meets at `junction`; in the VMM arena a shared neighbour's
        // granules become pinned, and the junction granule is counted once (Note [vmm
        // arena]).
        let take = |sh: &mut Shared, n: BlockIdx, junction: u64| {
            let nd = BLOCKS.get(n).data();
            let shared = nd.place == Place::FreeShared;
            if shared {
                sh.index(kind).remove(&BLOCKS, n);
            } else {
                let st = sh.stream(s);
                st.index(kind).remove(&BLOCKS, n);
                st.age.remove(&BLOCKS, n);
            }
            if let Some(a) = sh.arena.as_mut().filter(|a| a.contains(nd.ptr)) {
                if shared {
                    a.pin(nd.ptr, nd.size);
                }
                a.merge_at(junction);
            }
        };
        let prev = BLOCKS.get(idx).data().seg_prev;
        if mergeable(prev) {
            take(sh, prev, BLOCKS.get(idx).data().ptr);
            let epoch = BLOCKS.get(idx).data().free_epoch;
            Self::absorb_next(prev);
            let d = BLOCKS.get(prev).data();
            d.place = Place::FreeOnStream;
            d.stream = s.id;
            d.free_epoch = epoch;
            idx = prev;
        }
        let next = BLOCKS.get(idx).data().seg_next;
        if mergeable(next) {
            take(sh, next, BLOCKS.get(next).data().ptr);
            Self::absorb_next(idx);
        }
        idx
    }

    /// A block freed without a stream, or on a stream other than its own: reused only
    /// after a context fence recorded after now has completed.
    ///
    /// # Safety
    /// The caller owns `idx` (taken back from the program).
    pub unsafe fn free_to_fence(&self, idx: BlockIdx, cross_stream: bool) {
        let seal = {
            let mut sh = self.shared.lock();
            let d = BLOCKS.get(idx).data();
            d.place = Place::AwaitingFence;
            d.requested = 0;
            d.free_epoch = sh.clock;
            sh.fence_queue.push_back(&BLOCKS, idx);
            sh.unsealed_fence_blocks += 1;
            if cross_stream {
                sh.slow.cross_stream += 1;
            }
            sh.unsealed_fence_blocks >= config::get(Key::FenceBatch).max(1)
        };
        if seal && self.may_order() {
            // Batch full: record one fence for all of them now, so they are reusable by the
            // time the next miss looks (recording costs ~0.2 µs; no wait).
            if let Ok(_ev) = self.events.try_lock() {
                self.reporting_stalls("sealing a batch of frees", || self.seal(Advance::Poll));
            }
        }
    }

    // ---------------------------------------------------------------- fences

    /// Records one context fence covering every block freed so far that no fence covers
    /// yet (in the fence queue and in every stream's age list).
    ///
    /// Note [no stored stream handles]: a stream's frees are made shareable by a context
    /// fence, never by an event recorded on the stream's handle: the pool only remembers
    /// handles from earlier calls, and the program may have destroyed that stream since
    /// (the driver does not validate handles: recording on a dead one is a use after
    /// free). A context fence needs no handle and covers all streams at once. Caller holds
    /// `self.events`.
    fn seal(&self, mode: Advance) -> Outstanding {
        let epoch = {
            let mut sh = self.shared.lock();
            let outstanding = Outstanding::of(&sh);
            if mode != Advance::Wait && sh.fences.len() >= MAX_OUTSTANDING_FENCES {
                // The device is far behind: one more fence would not complete sooner than
                // the outstanding ones, and the blocks simply wait for a later one.
                return outstanding;
            }
            let covered = sh.fence_sealed;
            // SAFETY (closure): pool lock held; stamps grow along each FIFO, so its newest
            // block tells whether anything in it is unsealed.
            let newest = |f: &Fifo| {
                f.back()
                    .map_or(0, |t| unsafe { BLOCKS.get(t).data().free_epoch })
            };
            let unsealed = newest(&sh.fence_queue) > covered
                || sh.streams.iter().any(|st| newest(&st.age) > covered);
            if !unsealed {
                return outstanding;
            }
            let epoch = sh.clock;
            sh.clock += 1;
            epoch
        };
        let recorded = self.backend.record_context_fence(self.ctx.id);
        let mut sh = self.shared.lock();
        match recorded {
            Ok(ev) => {
                sh.fences.push_back((ev, epoch));
                sh.fence_sealed = epoch;
                sh.unsealed_fence_blocks = 0;
                sh.slow.fences += 1;
            }
            Err(e) => crate::log::debug(&format!("cupool: context fence failed: {e:?}")),
        }
        Outstanding::of(&sh)
    }

    /// Seals unsealed frees, polls (or waits for) outstanding context fences, and moves
    /// the blocks they cover to the shared index. Returns how many blocks moved.
    ///
    /// This is the streamless path's cost whenever a freed block must be fenced before its
    /// reuse, so it takes the pool lock as few times as it can: once before and once after
    /// recording, once to retire fences and drain; more only in a binary search.
    fn advance(&self, mode: Advance) -> usize {
        self.reporting_stalls("a fence pass", || self.advance_now(mode))
    }

    /// Runs `fence_work`; with `CUPOOL_LOG=debug`, reports it when it stalled the caller for
    /// over 50 µs (a driver call that blocked, or a wait for another thread's pass).
    fn reporting_stalls<T>(&self, what: &str, fence_work: impl FnOnce() -> T) -> T {
        if crate::log::level() < crate::log::Level::Debug {
            return fence_work();
        }
        let started = std::time::Instant::now();
        let result = fence_work();
        let spent = started.elapsed();
        if spent > std::time::Duration::from_micros(50) {
            crate::log::debug(&format!(
                "cupool: device {}: {what} took {} us",
                self.ctx.device,
                spent.as_micros()
            ));
        }
        result
    }

    fn advance_now(&self, mode: Advance) -> usize {
        // A panic elsewhere cannot leave the guarded data (there is none) inconsistent.
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let Outstanding { count, newest } = self.seal(mode);
        let done = match (mode, newest) {
            (_, None) => 0,
            // Waiting on the newest covers every older one; if that fails (driver error),
            // no older one is tried.
            (Advance::Wait, Some((ev, e))) => {
                if self.backend.wait_event(self.ctx.id, ev).is_ok() {
                    e
                } else {
                    0
                }
            }
            (Advance::WaitUpTo(bound), Some(newest)) => {
                match self.backend.wait_event_for(self.ctx.id, newest.0, bound) {
                    Ok(true) => newest.1,
                    _ => self.newest_completed(count, newest).map_or(0, |(_, e)| e),
                }
            }
            (Advance::Poll, Some(newest)) => {
                self.newest_completed(count, newest).map_or(0, |(_, e)| e)
            }
        };
        // Retire the fences that completed and drain what they cover; the events go back
        // to the backend with no pool lock held (Note [locks]).
        let mut moved = 0;
        loop {
            let mut retired = [EventHandle(0); 16];
            let mut n = 0;
            {
                let mut sh = self.shared.lock();
                sh.fence_done = sh.fence_done.max(done);
                while n < retired.len() {
                    match sh.fences.front() {
                        Some(&(ev, e)) if e <= sh.fence_done => {
                            sh.fences.pop_front();
                            retired[n] = ev;
                            n += 1;
                        }
                        _ => break,
                    }
                }
                if n < retired.len() {
                    // SAFETY: pool lock held.
                    moved += unsafe { self.drain(&mut sh) };
                }
            }
            for &ev in &retired[..n] {
                self.backend.recycle_event(self.ctx.id, ev);
            }
            if n < retired.len() {
                return moved;
            }
        }
    }

    /// The newest of the `count` outstanding fences (`newest` is the last) known complete,
    /// if any. Caller holds `self.events`, so the list does not change meanwhile.
    ///
    /// A fence covers all the work its older ones cover, so the completed fences are (up
    /// to the instant of each query) a prefix of the list. The newest is asked first, since
    /// on an idle device it has completed and one query settles everything; otherwise a
    /// binary search finds the end of the prefix in about log2(count) queries instead of
    /// one query per fence. Whatever a query error or a race does to that ordering, the
    /// answer is a fence that did complete, which is all correctness needs.
    fn newest_completed(&self, count: usize, newest: Recorded) -> Option<Recorded> {
        let complete = |f: Recorded| {
            self.backend
                .event_completed(self.ctx.id, f.0)
                .unwrap_or(false)
        };
        if complete(newest) {
            return Some(newest);
        }
        let fence_at = |i: usize| -> Recorded { self.shared.lock().fences[i] };
        // Invariant: every fence at or after `hi` is incomplete (as last seen); `found` is
        // the newest fence seen complete.
        let (mut lo, mut hi, mut found) = (0, count - 1, None);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let f = fence_at(mid);
            if complete(f) {
                found = Some(f);
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        found
    }

    /// Moves every block whose event or fence has completed to the shared index; returns
    /// how many.
    ///
    /// # Safety
    /// Pool lock held.
    unsafe fn drain(&self, sh: &mut Shared) -> usize {
        let mut moved = 0;
        let fence_done = sh.fence_done;
        while let Some(idx) = sh.fence_queue.front() {
            if BLOCKS.get(idx).data().free_epoch > fence_done {
                break;
            }
            sh.fence_queue.remove(&BLOCKS, idx);
            self.insert_shared(sh, idx);
            moved += 1;
        }
        for pos in 0..sh.streams.len() {
            loop {
                let st = &mut sh.streams[pos];
                let Some(idx) = st.age.front() else { break };
                let d = BLOCKS.get(idx).data();
                if d.free_epoch > fence_done {
                    break;
                }
                let kind = d.kind;
                st.age.remove(&BLOCKS, idx);
                st.index(kind).remove(&BLOCKS, idx);
                self.insert_shared(sh, idx);
                moved += 1;
            }
        }
        moved
    }

    // ---------------------------------------------------------------- release

    /// Gives every segment that is one free shared block back to the backend; returns the
    /// bytes released.
    pub fn release_idle_segments(&self, c: &ThreadCounters) -> u64 {
        if !self.may_order() {
            return 0;
        }
        let victims: Vec<(u64, u64)> = {
            let mut sh = self.shared.lock();
            let mut v = Vec::new();
            let heads: Vec<(u64, BlockIdx)> = sh.segments.iter().map(|(&b, &i)| (b, i)).collect();
            let arena_base = sh.arena.as_ref().map(|a| a.base);
            for (base, idx) in heads {
                if Some(base) == arena_base {
                    continue;
                }
                // SAFETY: pool lock held.
                unsafe {
                    let d = BLOCKS.get(idx).data();
                    if d.place == Place::FreeShared && d.seg_next == NIL && d.size == d.segment_size
                    {
                        let kind = d.kind;
                        sh.index(kind).remove(&BLOCKS, idx);
                        ADDRESSES.clear(base);
                        v.push((base, d.segment_size));
                        BLOCKS.release(idx);
                        sh.segments.remove(&base);
                    }
                }
            }
            let total: u64 = v.iter().map(|&(_, s)| s).sum();
            sh.reserved -= total;
            sh.slow.device_frees += v.len() as u64;
            v
        };
        let mut released = 0;
        for (ptr, size) in victims {
            crate::trace::record::segment_free(ptr, size, self.ctx.device);
            c.lower(Level::Cached, size);
            match self.backend.release(self.ctx.id, ptr, size) {
                Ok(()) => released += size,
                Err(e) => {
                    // The driver refused (shutting down, or a driver bug): the memory is
                    // gone from the pool either way; report it once.
                    crate::log::warn(&format!("cupool: releasing a segment failed: {e:?}"));
                    released += size;
                }
            }
        }
        released + self.release_arena(c)
    }

    /// Waits for pending frees, then releases every idle segment (`empty_cache`).
    pub fn empty_cache(&self, c: &ThreadCounters) -> Result<u64> {
        if self.capturing() {
            return Err(CupoolStatus::CupoolErrorStreamCapture);
        }
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return Ok(0);
        }
        self.advance(Advance::Wait);
        Ok(self.release_idle_segments(c))
    }

    // ---------------------------------------------------------------- queries

    /// Reserved bytes now.
    pub fn reserved(&self) -> u64 {
        self.shared.lock().reserved
    }

    /// Bytes cached but not usable by the program right now without a driver call:
    /// reserved minus what the program holds.
    pub fn idle_bytes(&self) -> u64 {
        let allocated = thread_cache::sum_level(self.index, Level::Allocated).max(0) as u64;
        self.reserved().saturating_sub(allocated)
    }

    /// The block of this pool that contains `ptr`, and its segment.
    pub fn find_containing(&self, ptr: u64) -> Option<Containing> {
        let sh = self.shared.lock();
        let (&base, &head) = sh.segments.range(..=ptr).next_back()?;
        // SAFETY: pool lock held; records of this pool are only changed under it (an
        // allocated block's fields are read-only while allocated).
        unsafe {
            let seg_size = BLOCKS.get(head).data().segment_size;
            if ptr >= base + seg_size {
                return None;
            }
            let mut idx = head;
            while idx != NIL {
                let d = BLOCKS.get(idx).data();
                if ptr >= d.ptr && ptr < d.ptr + d.size {
                    return Some(Containing {
                        idx,
                        block_ptr: d.ptr,
                        segment_base: base,
                        segment_size: seg_size,
                    });
                }
                idx = d.seg_next;
            }
        }
        None
    }

    /// This pool's statistics.
    pub fn stats(&self) -> CupoolStats {
        let (reserved, reserved_peak, slow, frag) = {
            let sh = self.shared.lock();
            // SAFETY: pool lock held.
            let frag = unsafe { Self::fragmentation(&sh) };
            (sh.reserved, sh.reserved_peak, sh.slow, frag)
        };
        let sums = thread_cache::sum_pool(self.index);
        let level = |l: Level| -> CupoolStat {
            let cur = sums.levels[l as usize].max(0) as u64;
            CupoolStat {
                current: cur,
                peak: self.peaks[l as usize].load(Ordering::Relaxed).max(cur),
            }
        };
        let mut s = CupoolStats::new();
        s.allocated_bytes = level(Level::Allocated);
        s.requested_bytes = level(Level::Requested);
        s.cached_bytes = level(Level::Cached);
        s.reserved_bytes = CupoolStat {
            current: reserved,
            peak: reserved_peak,
        };
        s.num_allocs = sums.counts[counters::Count::Allocs as usize];
        s.num_frees = sums.counts[counters::Count::Frees as usize];
        s.cache_hits = s.num_allocs.saturating_sub(slow.misses);
        s.cache_misses = slow.misses;
        s.device_allocs = slow.device_allocs;
        s.device_frees = slow.device_frees;
        s.alloc_retries = slow.retries;
        s.num_ooms = slow.ooms;
        s.fences_recorded = slow.fences;
        s.cross_stream_frees = slow.cross_stream;
        s.inactive_split_bytes = frag.inactive_split;
        s.pending_fence_bytes = frag.pending_fence;
        s.mapped_bytes = frag.mapped;
        s.segments = frag.segments;
        s.granules = frag.granules;
        s
    }

    /// The figures [`DevicePool::stats`] computes under the pool lock.
    ///
    /// Note [fragmentation stats]: `inactive_split_bytes`, `pending_fence_bytes`,
    /// `segments`, `granules` and the mapped bytes are derived from the pool's lists when
    /// the statistics are read, not kept as counters, so allocations and frees pay nothing
    /// for them; the price is a walk of the free blocks the pool holds (not of the blocks
    /// in use) under the pool lock, in every stats call. Only the pool's own free blocks are
    /// read: a block in use or in a thread cache belongs to another thread (Note in
    /// `block.rs`), so a segment's free bytes are summed from the indexes and lists, and a
    /// segment whose free bytes fall short of its size holds blocks in use. Peaks are kept
    /// only for the mapped bytes (mapping is a slow path); the other two would need a
    /// check on every free.
    ///
    /// # Safety
    /// Pool lock held (`sh` is the locked state).
    unsafe fn fragmentation(sh: &Shared) -> Fragmentation {
        let mut free_of_segment: HashMap<u64, u64> = HashMap::new();
        let mut arena_inactive = 0u64;
        let arena = sh.arena.as_ref();
        let mut count = |idx: BlockIdx, shared: bool| {
            let d = BLOCKS.get(idx).data();
            match arena.filter(|a| a.contains(d.ptr)) {
                // Blocks outside the shared index pin (and keep mapped) all their granules.
                Some(a) => {
                    arena_inactive += if shared {
                        a.pinned_ends(d.ptr, d.size)
                    } else {
                        d.size
                    }
                }
                None => {
                    if let Some((&base, _)) = sh.segments.range(..=d.ptr).next_back() {
                        *free_of_segment.entry(base).or_insert(0) += d.size;
                    }
                }
            }
        };
        for idx in sh
            .small
            .collect(&BLOCKS)
            .into_iter()
            .chain(sh.large.collect(&BLOCKS))
        {
            count(idx, true);
        }
        let fifos = sh.streams.iter().map(|st| &st.age).chain([&sh.fence_queue]);
        for fifo in fifos.clone() {
            let mut idx = fifo.front().unwrap_or(NIL);
            while idx != NIL {
                count(idx, false);
                idx = BLOCKS.get(idx).data().fifo_next;
            }
        }
        let inactive_split = free_of_segment
            .iter()
            .filter(|&(base, &free)| {
                let head = sh.segments[base];
                free < BLOCKS.get(head).data().segment_size
            })
            .map(|(_, &free)| free)
            .sum::<u64>()
            + arena_inactive;
        let (mapped_now, arena_peak, granules) = arena.map_or((0, 0, 0), |a| {
            (a.mapped * a.granule, a.mapped_peak * a.granule, a.mapped)
        });
        Fragmentation {
            inactive_split,
            pending_fence: fifos.map(|f| f.bytes).sum(),
            mapped: CupoolStat {
                current: mapped_now,
                peak: sh.mapped_peak.max(arena_peak).max(mapped_now),
            },
            segments: sh.segments.len() as u64,
            granules,
        }
    }

    /// Restarts every peak from the current value.
    pub fn reset_peaks(&self) {
        let sums = thread_cache::sum_pool(self.index);
        for (i, p) in self.peaks.iter().enumerate() {
            p.store(sums.levels[i].max(0) as u64, Ordering::Relaxed);
        }
        self.peak_epoch.fetch_add(1, Ordering::Relaxed);
        let mut sh = self.shared.lock();
        sh.reserved_peak = sh.reserved;
        sh.mapped_peak = 0;
        if let Some(a) = sh.arena.as_mut() {
            a.mapped_peak = a.mapped;
        }
    }

    /// Checks the pool's internal invariants (tests): every segment's blocks tile it
    /// exactly, adjacent shared-free blocks are merged, index totals match, and the map
    /// points at every block. Returns the bytes held by free blocks of each place.
    pub fn check_invariants(&self) -> core::result::Result<InvariantReport, String> {
        let sh = self.shared.lock();
        let mut report = InvariantReport::default();
        // SAFETY: pool lock held; allocated blocks' fields are stable while allocated.
        unsafe {
            for (&base, &head) in sh.segments.iter() {
                let hd = BLOCKS.get(head).data();
                if !hd.segment_head || hd.ptr != base {
                    return Err(format!("segment {base:#x}: bad head"));
                }
                let mut expect = base;
                let mut idx = head;
                let mut prev = NIL;
                let mut prev_shared = false;
                while idx != NIL {
                    let d = BLOCKS.get(idx).data();
                    if d.ptr != expect || d.seg_prev != prev || d.pool != self.index {
                        return Err(format!(
                            "segment {base:#x}: block {:#x} out of place",
                            d.ptr
                        ));
                    }
                    if ADDRESSES.get(d.ptr) != Some(idx) {
                        return Err(format!("block {:#x} missing from the address map", d.ptr));
                    }
                    let shared = d.place == Place::FreeShared;
                    if shared && prev_shared {
                        return Err(format!("block {:#x}: free neighbours not merged", d.ptr));
                    }
                    match d.place {
                        Place::Allocated => report.allocated += d.size,
                        Place::FreeShared => report.shared += d.size,
                        Place::FreeOnStream => report.on_stream += d.size,
                        Place::AwaitingFence => report.awaiting_fence += d.size,
                        Place::ThreadCache => report.thread_cache += d.size,
                        Place::Unused => {
                            return Err(format!("block {:#x} unused but linked", d.ptr))
                        }
                    }
                    prev_shared = shared;
                    expect = d.ptr + d.size;
                    prev = idx;
                    idx = d.seg_next;
                }
                if expect != base + hd.segment_size {
                    return Err(format!("segment {base:#x}: blocks do not tile it"));
                }
                match sh.arena.as_ref().filter(|a| a.base == base) {
                    Some(a) => {
                        report.reserved += a.held() * a.granule;
                        let mut expected = vec![0u32; a.granule_count()];
                        let mut idx = head;
                        while idx != NIL {
                            let d = BLOCKS.get(idx).data();
                            if d.place != Place::FreeShared {
                                for g in a.granules(d.ptr, d.size) {
                                    expected[g] += 1;
                                }
                            }
                            idx = d.seg_next;
                        }
                        a.check(&expected)?;
                    }
                    None => report.reserved += hd.segment_size,
                }
            }
        }
        if report.reserved != sh.reserved {
            return Err(format!(
                "reserved {} != segments {}",
                sh.reserved, report.reserved
            ));
        }
        if sh.small.bytes + sh.large.bytes != report.shared {
            return Err("shared index bytes disagree with the blocks".into());
        }
        let on_stream: u64 = sh
            .streams
            .iter()
            .map(|s| s.small.bytes + s.large.bytes)
            .sum();
        let aged: u64 = sh.streams.iter().map(|s| s.age.bytes).sum();
        if on_stream != report.on_stream || aged != report.on_stream {
            return Err("stream indexes disagree with the blocks".into());
        }
        if sh.fence_queue.bytes != report.awaiting_fence {
            return Err("fence queue disagrees with the blocks".into());
        }
        Ok(report)
    }
}

/// A block found by address, with the segment it belongs to
/// ([`DevicePool::find_containing`]).
#[derive(Copy, Clone, Debug)]
pub struct Containing {
    pub idx: BlockIdx,
    /// Start of the block (read under the pool lock).
    pub block_ptr: u64,
    pub segment_base: u64,
    pub segment_size: u64,
}

/// The statistics [`DevicePool::fragmentation`] derives from the pool's lists.
struct Fragmentation {
    inactive_split: u64,
    pending_fence: u64,
    mapped: CupoolStat,
    segments: u64,
    granules: u64,
}

/// Bytes by place, from [`DevicePool::check_invariants`].
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvariantReport {
    pub reserved: u64,
    pub allocated: u64,
    pub shared: u64,
    pub on_stream: u64,
    pub awaiting_fence: u64,
    pub thread_cache: u64,
}
