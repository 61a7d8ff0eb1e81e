//! Where a pool's reserved bytes are at one moment: what `cupool replay` reports at the
//! peak, so that a footprint above the live bytes can be traced to its cause.
//!
//! Note [footprint]: the reserved bytes split without overlap into
//! - bytes of blocks the program holds (the `allocated` level);
//! - freed bytes nobody else may take yet: blocks waiting for a context fence, and blocks
//!   freed on a stream, which that stream reuses at once and others after a fence;
//! - in the VMM arena (Note [vmm arena]), free bytes in mapped memory: in granules a block
//!   in use also touches (the ends of holes between blocks: no granule can be split), in
//!   free granules of chunks another granule of which is in use (a chunk maps and unmaps
//!   whole, Note [chunks]), and in chunks wholly free (they move where they are needed);
//!   then physical memory mapped nowhere (idle);
//! - in segments, free bytes of segments that also hold blocks in use, and wholly free
//!   segments (which only a release gives back);
//! - the rest: blocks in threads' caches, which only their threads may read.
//!
//! The pool sees every free block it holds, so all but the first and the last come from its
//! lists, under its lock, as [`DevicePool::stats`] does (Note [fragmentation stats]);
//! blocks in use and in thread caches belong to other threads and are not read. A free
//! shared block of the arena lies over mapped granules only at its ends (pinned by a
//! neighbour) or in granules no block in use touches; the second kind are exactly the
//! unpinned granules of mapped chunks, counted per chunk.

use super::counters::Level;
use super::pool_stats::FreeTally;
use super::{thread_cache, DevicePool};

/// Where the reserved bytes of one pool are (Note [footprint]); every field is bytes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    pub reserved: u64,
    /// Blocks the program holds, after the pool's rounding.
    pub in_use: u64,
    /// Freed without a stream (or on another stream than the block's), waiting for a fence.
    pub awaiting_fence: u64,
    /// Freed on a stream: that stream reuses them at once, the others after a fence.
    pub stream_only: u64,
    /// VMM arena: free bytes in granules that blocks not free also touch (hole ends).
    pub arena_hole_ends: u64,
    /// VMM arena: free granules of chunks partly in use.
    pub arena_in_busy_chunks: u64,
    /// VMM arena: granules of mapped chunks wholly free (stealable).
    pub arena_stealable: u64,
    /// VMM arena: physical memory held and mapped nowhere.
    pub arena_idle: u64,
    /// Free bytes of segments that also hold blocks not free.
    pub segments_partly_free: u64,
    /// Segments that are one free block.
    pub segments_free: u64,
    /// How many segments those are.
    pub segments_free_count: u64,
    /// The rest: blocks in threads' caches.
    pub other: u64,
}

impl Footprint {
    /// The bytes the pool found in its lists and levels: all but [`Footprint::other`].
    pub fn accounted(&self) -> u64 {
        self.in_use
            + self.awaiting_fence
            + self.stream_only
            + self.arena_hole_ends
            + self.arena_in_busy_chunks
            + self.arena_stealable
            + self.arena_idle
            + self.segments_partly_free
            + self.segments_free
    }
}

impl DevicePool {
    /// Where this pool's reserved bytes are now (Note [footprint]).
    pub fn footprint(&self) -> Footprint {
        let in_use = thread_cache::sum_level(self.index, Level::Allocated).max(0) as u64;
        let sh = self.shared.lock();
        let mut f = Footprint {
            reserved: sh.reserved,
            in_use,
            awaiting_fence: sh.fence_queue.bytes,
            stream_only: sh.streams.iter().map(|st| st.age.bytes).sum(),
            ..Footprint::default()
        };
        if let Some(a) = sh.arena.as_ref() {
            f.arena_in_busy_chunks = a.granules_free_in_busy_chunks() * a.granule;
            f.arena_stealable = a.stealable_granules() * a.granule;
            f.arena_idle = a.idle_granules() * a.granule;
        }
        // SAFETY: pool lock held.
        let tally = unsafe { FreeTally::of_shared_index(&sh) };
        f.arena_hole_ends = tally.arena_mapped;
        // SAFETY: pool lock held, the tally made under it.
        let segments = unsafe { tally.segments(&sh) };
        f.segments_partly_free = segments.partly_free;
        f.segments_free = segments.wholly_free;
        f.segments_free_count = segments.wholly_free_count;
        f.other = f.reserved.saturating_sub(f.accounted());
        f
    }
}
