//! The pinned pool: a cache of page-locked host memory (`cudaHostAlloc` memory) for the
//! whole process. No CUDA calls of its own: chunks come from [`Backend::host_alloc`], and
//! the ordering of reuse from the device pools' context fences.
//!
//! Layout ([`blocks`]): requests are rounded to whole pages; those up to 1 MiB are carved
//! from 2 MiB chunks, larger ones get a chunk of their own (rounded to 2 MiB) that later
//! large requests may split; free neighbours merge at once, and a chunk that is one free
//! block again goes back to the driver on `empty_cache` (or before an out-of-memory error).
//! Best fit, over two ordered sets (small and large blocks).
//!
//! Note [pinned reuse]: a copy enqueued with `cudaMemcpyAsync` may still read (or write) a
//! pinned buffer after the program freed it: natively `cudaFreeHost` synchronises the
//! device first, cupool's free does not wait. So a freed block waits, as a device block
//! freed without a stream does, for a context fence recorded after its free to complete
//! ([`fences`]). Pinned memory belongs to no context: the fence is one context fence per
//! device pool of the process (every context cupool has seen, the one current at each
//! pinned call included), and the block is reused once all of them completed. A block
//! freed on a stream (`cupool_host_free_async`) may be taken at once by an allocation on
//! that same stream, whose work runs after the free in stream order; the host must then
//! not touch it before that stream's earlier work is done (as with memory from
//! `cudaMallocAsync`). Other streams, and streamless allocations, wait for the fence.
//!
//! Note [pinned locks]: `state` (a blocking mutex) guards the map, clocks and counters and
//! is never held across a backend call; `fences` serialises recording and polling (so an
//! event is never recycled while another thread queries it) and is held across those
//! calls. Order: `fences` before `state`. A same-stream pair takes `state` twice and
//! nothing else; a streamless pair also takes `fences` twice (the fence recorded at the
//! free, Note [pinned fences at free], and the poll of an allocation that finds the block
//! still waiting), each time with a short `state` section before and after.

mod blocks;
mod fences;

use super::capture::this_thread_captures;
use super::{DevicePool, BACKEND_OFF};
use crate::backend::{Backend, HostPtr};
use crate::stats::{CupoolHostStats, CupoolStat};
use crate::status::{CupoolStatus, Result};
use blocks::{Blocks, State as BlockState, LARGE_ROUND, PAGE, SMALL_CHUNK, SMALL_MAX};
use core::sync::atomic::Ordering;
use fences::{Advance, Fences};
use std::sync::{Mutex, MutexGuard};

/// The stream of a streamless allocation or free.
pub use super::STREAMLESS;

/// Which chunks a block comes from: small requests never split a large block.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Small,
    Large,
}

/// Requests above this (256 TiB, more than any machine's memory) are out of memory at
/// once, as `cudaHostAlloc` reports them, before any rounding could overflow.
const MAX_REQUEST: u64 = 1 << 48;

/// A live pinned block, for the interposer's queries.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PinnedBlock {
    pub ptr: HostPtr,
    /// Size after rounding to pages.
    pub size: u64,
    /// What the program asked for.
    pub requested: u64,
}

#[derive(Default)]
struct Counts {
    allocs: u64,
    frees: u64,
    hits: u64,
    misses: u64,
    driver_allocs: u64,
    driver_frees: u64,
    fences: u64,
    fence_queries: u64,
    retries: u64,
    ooms: u64,
}

/// Highest values since the last peak reset: allocated, reserved, requested, chunks.
#[derive(Default)]
struct Peaks([u64; 4]);

struct State {
    map: Blocks,
    /// Stamp of the next free (Note [pinned reuse]); a fence sealed at `e` covers every
    /// block freed at `e` or before.
    clock: u64,
    /// Newest epoch a fence was recorded for, and newest one known complete.
    sealed: u64,
    done: u64,
    counts: Counts,
    peaks: Peaks,
}

impl State {
    fn levels(&self) -> [u64; 4] {
        let m = &self.map;
        [m.allocated, m.reserved, m.requested, m.chunk_count()]
    }

    fn note_peaks(&mut self) {
        let levels = self.levels();
        for (peak, now) in self.peaks.0.iter_mut().zip(levels) {
            *peak = (*peak).max(now);
        }
    }
}

/// The process's pinned host memory pool.
pub struct PinnedPool {
    backend: &'static dyn Backend,
    state: Mutex<State>,
    fences: Mutex<Fences>,
}

/// Rounded size and kind of a request.
fn sizing(requested: u64) -> Result<(u64, Kind)> {
    if requested == 0 {
        return Err(CupoolStatus::CupoolErrorInvalidValue);
    }
    if requested > MAX_REQUEST {
        return Err(CupoolStatus::CupoolErrorOutOfMemory);
    }
    let need = requested.next_multiple_of(PAGE);
    Ok((
        need,
        if need <= SMALL_MAX {
            Kind::Small
        } else {
            Kind::Large
        },
    ))
}

impl PinnedPool {
    pub fn new(backend: &'static dyn Backend) -> Self {
        PinnedPool {
            backend,
            state: Mutex::new(State {
                map: Blocks::default(),
                clock: 1,
                sealed: 0,
                done: 0,
                counts: Counts::default(),
                peaks: Peaks::default(),
            }),
            fences: Mutex::new(Fences::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding it; should one, the map is still consistent at
        // every point a panic could come from (each update completes under the lock).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocates `requested` bytes: streamless (`stream` None: no work may use the block,
    /// the host may write it at once) or stream-ordered on the stream with that id. A new
    /// chunk, when needed, is made in `home`'s context, the calling thread's current one.
    pub fn alloc(&self, home: &DevicePool, requested: u64, stream: Option<u64>) -> Result<HostPtr> {
        let (need, kind) = sizing(requested)?;
        let stream = stream.unwrap_or(STREAMLESS);
        if let Some(p) = self.fit(need, kind, requested, stream) {
            return Ok(p);
        }
        // A miss of what is reusable now: make reusable what completed fences allow.
        if self.advance(Advance::Poll) > 0 {
            if let Some(p) = self.fit(need, kind, requested, stream) {
                return Ok(p);
            }
        }
        match self.grow(home, need, kind, requested, stream) {
            Err(CupoolStatus::CupoolErrorOutOfMemory) => {}
            other => return other,
        }
        // Out of memory: wait for every pending free, give idle chunks back, try again.
        self.lock().counts.retries += 1;
        self.advance(Advance::Wait);
        self.release_idle();
        if let Some(p) = self.fit(need, kind, requested, stream) {
            return Ok(p);
        }
        let again = self.grow(home, need, kind, requested, stream);
        if again == Err(CupoolStatus::CupoolErrorOutOfMemory) {
            self.lock().counts.ooms += 1;
        }
        again
    }

    /// A cached block for the request, if one may be taken now.
    fn fit(&self, need: u64, kind: Kind, requested: u64, stream: u64) -> Option<HostPtr> {
        let mut st = self.lock();
        let own = (stream != STREAMLESS)
            .then(|| st.map.fit_on_stream(stream, kind, need))
            .flatten();
        // The better fit of the stream's own blocks and everyone's (a stream's large
        // block is not split for a request that a free block fits exactly).
        let (_, p) = match (own, st.map.fit_free(kind, need)) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        st.map.take(p, need, requested, stream);
        st.counts.allocs += 1;
        st.counts.hits += 1;
        st.note_peaks();
        Some(p)
    }

    /// A new chunk from the driver, in `home`'s context, and the block from it.
    fn grow(
        &self,
        home: &DevicePool,
        need: u64,
        kind: Kind,
        requested: u64,
        stream: u64,
    ) -> Result<HostPtr> {
        // As for device segments (Note [growth during another thread's capture]): only the
        // capturing thread itself would break its capture with a driver allocation.
        if home.capturing() && this_thread_captures() {
            return Err(CupoolStatus::CupoolErrorStreamCapture);
        }
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return Err(CupoolStatus::CupoolErrorBackendUnavailable);
        }
        let bytes = match kind {
            Kind::Small => SMALL_CHUNK,
            Kind::Large => need.next_multiple_of(LARGE_ROUND),
        };
        let base = self
            .backend
            .host_alloc(home.ctx.id, bytes)
            .map_err(CupoolStatus::from)?;
        let mut st = self.lock();
        st.map.add_chunk(base, bytes, home.ctx.id, kind);
        st.map.take(base, need, requested, stream);
        st.counts.driver_allocs += 1;
        st.counts.allocs += 1;
        st.counts.misses += 1;
        st.note_peaks();
        Ok(base)
    }

    /// Gives a block back: streamless (`stream` None) or stream-ordered on the stream with
    /// that id (Note [pinned reuse]). A pointer the pool did not hand out (or an interior
    /// one) is `CupoolErrorInvalidPointer`, a block freed already `CupoolErrorDoubleFree`;
    /// neither changes anything.
    pub fn free(&self, ptr: HostPtr, stream: Option<u64>) -> Result<()> {
        let for_everyone = {
            let mut st = self.lock();
            let epoch = st.clock;
            let stream = st.map.give_back(ptr, epoch, stream.unwrap_or(STREAMLESS))?;
            st.counts.frees += 1;
            stream == STREAMLESS
        };
        // Note [pinned fences at free]: a fence recorded now covers exactly the work that
        // may still use the block. Recorded at the next miss instead, it would also cover
        // everything submitted since, and on a busy device the block would wait for that
        // too (and the pool grow meanwhile). A stream's own frees are reusable by it at
        // once and wait for the next fence for everyone else.
        if for_everyone {
            self.seal_now();
        }
        Ok(())
    }

    /// The live block that contains `ptr` (interior addresses included).
    pub fn live_block_containing(&self, ptr: HostPtr) -> Option<PinnedBlock> {
        let (start, b) = self.lock().map.block_containing(ptr)?;
        match b.state {
            BlockState::Live { requested, .. } => Some(PinnedBlock {
                ptr: start,
                size: b.size,
                requested,
            }),
            _ => None,
        }
    }

    /// Whether `ptr` lies in memory of the pool (a chunk it holds), whatever its block's
    /// state: such a pointer must never reach the driver's `cuMemFreeHost`.
    pub fn holds(&self, ptr: HostPtr) -> bool {
        self.lock().map.block_containing(ptr).is_some()
    }

    /// Waits for every pending free, then gives every idle chunk back to the driver;
    /// returns the bytes released. Chunks of a context with a capture open stay, and so
    /// do blocks whose fence could not be recorded or waited for during one.
    pub fn empty_cache(&self) -> u64 {
        self.advance(Advance::Wait);
        self.release_idle()
    }

    pub fn stats(&self) -> CupoolHostStats {
        let st = self.lock();
        let [allocated, reserved, requested, chunks] = st.levels();
        let level = |current, i: usize| CupoolStat {
            current,
            peak: st.peaks.0[i].max(current),
        };
        let c = &st.counts;
        CupoolHostStats {
            allocated_bytes: level(allocated, 0),
            reserved_bytes: level(reserved, 1),
            requested_bytes: level(requested, 2),
            chunks: level(chunks, 3),
            num_allocs: c.allocs,
            num_frees: c.frees,
            cache_hits: c.hits,
            cache_misses: c.misses,
            driver_allocs: c.driver_allocs,
            driver_frees: c.driver_frees,
            fences_recorded: c.fences,
            fence_queries: c.fence_queries,
            alloc_retries: c.retries,
            num_ooms: c.ooms,
            pending_fence_bytes: st.map.waiting_bytes,
            ..CupoolHostStats::new()
        }
    }

    /// Every peak := its current value.
    pub fn reset_peaks(&self) {
        let mut st = self.lock();
        st.peaks.0 = st.levels();
    }

    /// Checks the map's invariants (tests): `Err` says what is wrong.
    pub fn check(&self) -> core::result::Result<(), String> {
        self.lock().map.check()
    }
}
