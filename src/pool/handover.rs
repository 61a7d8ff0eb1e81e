//! Handing blocks to the program and taking them back outside the pool lock: a thread-cache
//! hit, a free, and the lookups of a live block. These are the only writes and reads of
//! block records that the runtime makes, and they happen here, so that the runtime holds
//! no `unsafe`.
//!
//! Who owns a record when (Note in `block.rs`): the thread whose cache holds the block,
//! then the program from [`Block::publish_allocated`](super::block::Block::publish_allocated)
//! on, then the thread whose free won the tag's compare-and-swap ([`take_back`]).

use super::block::{BlockData, BlockIdx, Place, TakeBack};
use super::counters::ThreadCounters;
use super::thread_cache::ThreadCache;
use super::{pool_by_index, Containing, DevicePool, StreamRef, ADDRESSES, BLOCKS};
use crate::status::{CupoolStatus, Result};

impl DevicePool {
    /// A thread-cache hit: takes a block of at least `size` bytes cached for `stream` out of
    /// the calling thread's `cache` and hands it to the program, which asked for
    /// `requested` bytes. Returns the block's address and its size in the pool; `None` on a
    /// miss. No lock and no atomic beyond the block's tag: the thread owns what its cache
    /// holds.
    #[inline(always)]
    pub fn alloc_cached(
        &self,
        cache: &mut ThreadCache,
        c: &ThreadCounters,
        size: u64,
        requested: u64,
        stream: StreamRef,
    ) -> Option<(u64, u64)> {
        let hit = cache.take(self.index, stream.id, size)?;
        let (ptr, block_size) = (hit.ptr, hit.size());
        let b = BLOCKS.get(hit.idx);
        // SAFETY: the block came out of this thread's cache: this thread owns it. Only
        // written: the cache gave its address and size (Note [bins carry sizes]).
        b.set_place(Place::Allocated);
        let d = unsafe { b.data() };
        debug_assert_eq!((d.ptr, d.size), (ptr, block_size));
        d.requested = requested;
        d.stream = stream.id;
        d.handle = stream.handle as u64;
        self.note_allocated(c, block_size, requested);
        b.publish_allocated(ptr);
        Some((ptr, block_size))
    }
}

impl DevicePool {
    /// A large request on `stream` served by the block parked for it (Note [parked arena
    /// blocks]) when that block is exactly `size` bytes, as [`DevicePool::alloc_cached`].
    /// A parked block that does not fit is filed in the pool; `None` then, and when
    /// nothing is parked.
    #[inline]
    pub fn alloc_parked(
        &self,
        c: &ThreadCounters,
        size: u64,
        requested: u64,
        stream: StreamRef,
    ) -> Option<(u64, u64)> {
        let idx = self.parked.take(stream.id)?;
        let b = BLOCKS.get(idx);
        // SAFETY (both): swapped out of its slot: this thread owns the block. Copied out:
        // the check below takes the record again, which a reference held over it would
        // not survive (Miri, Stacked Borrows).
        let (its_stream, its_size) = {
            let d = unsafe { b.data() };
            (d.stream, d.size)
        };
        if its_stream != stream.id
            || its_size != size
            || !self.slow_path_hands_out(idx, stream.id, size)
        {
            // SAFETY: owned, in no list.
            unsafe { self.file_parked(idx) };
            return None;
        }
        b.set_place(Place::Allocated);
        let d = unsafe { b.data() };
        d.requested = requested;
        d.handle = stream.handle as u64;
        let ptr = d.ptr;
        self.note_allocated(c, size, requested);
        b.publish_allocated(ptr);
        Some((ptr, size))
    }

    /// A streamless allocation served from the blocks the calling thread freed without a
    /// stream and kept, once their fence is known complete (Note [thread fences]). As
    /// [`DevicePool::alloc_cached`]; `None` on a miss.
    #[inline]
    pub fn alloc_kept(
        &self,
        cache: &mut ThreadCache,
        c: &ThreadCounters,
        size: u64,
        requested: u64,
    ) -> Option<u64> {
        let idx = cache.take_streamless(self, size)?;
        let b = BLOCKS.get(idx);
        // SAFETY: the block came out of this thread's cache: this thread owns it.
        b.set_place(Place::Allocated);
        let d = unsafe { b.data() };
        d.requested = requested;
        d.stream = super::STREAMLESS;
        d.handle = 0;
        let ptr = d.ptr;
        c.hold_kept(-(d.size as i64));
        if c.own_fence_streak() != 0 {
            // Note [room beside stranded blocks]: served by its own kept blocks again.
            c.set_own_fence_streak(0);
        }
        self.note_allocated(c, d.size, requested);
        b.publish_allocated(ptr);
        Some(ptr)
    }
}

/// A block the program gave back ([`take_back`]), owned by the calling thread until it is
/// filed ([`Taken::to_fence`], [`Taken::to_stream`]) or left with the program
/// ([`Taken::keep`]). Dropping it instead would leave the block in no list and never
/// reused.
#[must_use = "a block taken back must be filed (to_fence, to_stream) or kept"]
pub struct Taken {
    idx: BlockIdx,
    ptr: u64,
    pool: &'static DevicePool,
    size: u64,
    requested: u64,
    stream: u64,
    handle: u64,
}

/// Takes the block the program holds at `ptr` back from it: the block, or why not.
#[inline]
pub fn take_back(ptr: u64) -> Result<Taken> {
    let idx = ADDRESSES
        .get(ptr)
        .ok_or(CupoolStatus::CupoolErrorInvalidPointer)?;
    let b = BLOCKS
        .try_get(idx)
        .ok_or(CupoolStatus::CupoolErrorInvalidPointer)?;
    match b.try_take_back(ptr) {
        TakeBack::Taken => {}
        TakeBack::AlreadyFree => return Err(CupoolStatus::CupoolErrorDoubleFree),
        TakeBack::NotThisBlock => return Err(CupoolStatus::CupoolErrorInvalidPointer),
    }
    // SAFETY: the CAS above made this thread the block's owner.
    let d = unsafe { b.data() };
    let pool = pool_by_index(d.pool).ok_or(CupoolStatus::CupoolErrorInternal)?;
    Ok(Taken {
        idx,
        ptr,
        pool,
        size: d.size,
        requested: d.requested,
        stream: d.stream,
        handle: d.handle,
    })
}

impl Taken {
    /// The pool the block belongs to.
    #[inline]
    pub fn pool(&self) -> &'static DevicePool {
        self.pool
    }

    /// The block's size in the pool.
    #[inline]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// What the program asked for.
    #[inline]
    pub fn requested(&self) -> u64 {
        self.requested
    }

    /// The stream it was allocated for ([`super::STREAMLESS`] for none), and the handle
    /// that allocation named.
    #[inline]
    pub fn stream(&self) -> (u64, u64) {
        (self.stream, self.handle)
    }

    /// The free failed after all: the program keeps the block.
    #[inline]
    pub fn keep(self) {
        BLOCKS.get(self.idx).publish_allocated(self.ptr);
    }

    /// Freed without a stream, or (`cross_stream`) on a stream other than its own: reused
    /// after a context fence ([`DevicePool::free_to_fence`]).
    #[inline]
    pub fn to_fence(self, cross_stream: bool) {
        // SAFETY: `take_back` made this thread the owner; `self` is consumed.
        unsafe { self.pool.free_to_fence(self.idx, cross_stream) };
    }

    /// Freed without a stream: kept by the calling thread's cache when it can (Note
    /// [thread fences]), otherwise to the pool's fence queue. `c` is the calling thread's
    /// counters for the block's pool.
    #[inline]
    pub fn to_fence_or_keep(self, cache: Option<&mut ThreadCache>, c: &ThreadCounters) {
        if let Some(cache) = cache {
            if cache.put_streamless(self.pool, c, self.idx, self.size) {
                return;
            }
        }
        self.to_fence(false);
    }

    /// Freed on stream `s`: a block of the VMM arena is parked for `s` (Note [parked arena
    /// blocks]) once the pool has lists for `s`; another goes into the calling thread's
    /// cache when it keeps it; otherwise to the pool ([`DevicePool::free_to_stream`]).
    #[inline]
    pub fn to_stream(self, cache: Option<&mut ThreadCache>, s: StreamRef) {
        if self.pool.vmm_large(self.size) {
            if self.pool.parked.may_park(s.id) {
                self.park(s);
                return;
            }
        } else if let Some(cache) = cache {
            if cache.put(self.pool.index, s, self.idx, self.size, self.ptr) {
                return;
            }
        }
        // SAFETY: `take_back` made this thread the owner; `self` is consumed.
        unsafe { self.pool.free_to_stream(s, &[self.idx]) };
    }

    /// Parks the block for `s` (Note [parked arena blocks]); a block parked there before,
    /// freed earlier, is filed at once.
    fn park(self, s: StreamRef) {
        let b = BLOCKS.get(self.idx);
        // SAFETY: `take_back` made this thread the owner; the slot publishes the record.
        let d = unsafe { b.data() };
        d.stream = s.id;
        d.handle = s.handle as u64;
        d.requested = 0;
        // SAFETY: as above.
        unsafe { BLOCKS.links(self.idx) }.free_epoch = self.pool.clock_for_parking();
        b.set_place(Place::Parked);
        if let Some(earlier) = self.pool.parked.park(s.id, self.idx) {
            // SAFETY: swapped out of the slot: this thread owns it now.
            unsafe { self.pool.file_parked(earlier) };
        }
    }
}

/// The size in the pool of the block the program holds at `ptr` (0 if none), for a caller
/// that has just allocated it.
pub fn allocated_size(ptr: u64) -> u64 {
    ADDRESSES
        .get(ptr)
        .and_then(|i| BLOCKS.try_get(i))
        .filter(|b| b.is_allocated_at(ptr))
        // SAFETY: an allocated block's fields do not change until the program frees it,
        // and the caller has just allocated it.
        .map_or(0, |b| unsafe { b.data() }.size)
}

/// The pool of the block the program holds, starting at `ptr`.
pub fn pool_holding(ptr: u64) -> Option<&'static DevicePool> {
    let b = BLOCKS.try_get(ADDRESSES.get(ptr)?)?;
    if !b.is_allocated_at(ptr) {
        return None;
    }
    // SAFETY: allocated: its pool index does not change until it is freed.
    pool_by_index(unsafe { b.data() }.pool)
}

/// The record of the block found by [`DevicePool::find_containing`] while the program
/// holds it, checked through its tag (a block freed meanwhile is not reported).
pub fn live_record(found: &Containing) -> Option<BlockData> {
    let b = BLOCKS.try_get(found.idx)?;
    if !b.is_allocated_at(found.block_ptr) {
        return None;
    }
    // SAFETY: an allocated block's fields do not change until it is freed; the tag is
    // checked again below.
    let d = unsafe { *b.data() };
    if !b.is_allocated_at(found.block_ptr) {
        return None;
    }
    Some(d)
}
