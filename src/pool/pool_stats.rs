//! The pool's statistics: levels and counters, and the fragmentation figures derived from
//! its lists (Note [fragmentation stats]).

use super::block::{BlockIdx, NIL};
use super::counters::{self, Level};
use super::{thread_cache, DevicePool, Shared, BLOCKS};
use crate::stats::{CupoolStat, CupoolStats};
use core::sync::atomic::Ordering;
use std::collections::HashMap;

impl DevicePool {
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

    /// This pool's statistics.
    pub fn stats(&self) -> CupoolStats {
        // Parked blocks are free blocks of the pool: counted in its lists, as before they
        // were parked (Note [parked arena blocks]).
        self.file_all_parked();
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
        let (thread_fences, thread_queries) = self.fence_side.thread_clock.recorded_and_queries();
        s.fences_recorded = slow.fences + thread_fences;
        s.cross_stream_frees = slow.cross_stream;
        s.inactive_split_bytes = frag.inactive_split;
        // Blocks threads keep after streamless frees wait for a fence too (Note [thread
        // fences]).
        s.pending_fence_bytes = frag.pending_fence + sums.kept_unfenced;
        s.mapped_bytes = frag.mapped;
        s.segments = frag.segments;
        s.granules = frag.granules;
        s.grow_waits = slow.grow_waits;
        s.grow_wait_us = slow.grow_wait_ns / 1000;
        s.fence_queries = slow.fence_queries + thread_queries;
        s.fence_device_waits = slow.device_waits;
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
        // SAFETY: pool lock held.
        let mut tally = unsafe { FreeTally::of_shared_index(sh) };
        let fifos = sh.streams.iter().map(|st| &st.age).chain([&sh.fence_queue]);
        for fifo in fifos.clone() {
            let mut idx = fifo.front().unwrap_or(NIL);
            while idx != NIL {
                // SAFETY: pool lock held; the fifo's blocks are the pool's.
                unsafe {
                    tally.add(sh, idx, false);
                    idx = BLOCKS.links(idx).fifo_next;
                }
            }
        }
        // SAFETY: pool lock held.
        let inactive_split = unsafe { tally.segments(sh) }.partly_free + tally.arena_mapped;
        let (mapped_now, arena_peak, granules) = sh.arena.as_ref().map_or((0, 0, 0), |a| {
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
        sh.footprint_at_peak = None;
        sh.mapped_peak = 0;
        if let Some(a) = sh.arena.as_mut() {
            a.mapped_peak = a.mapped;
        }
    }
}

/// Free blocks of the pool's lists, tallied by where their bytes are (Note [fragmentation
/// stats], Note [footprint parts]).
#[derive(Default)]
pub(super) struct FreeTally {
    /// Free bytes per segment (blocks outside the VMM arena), by segment base.
    pub(super) of_segment: HashMap<u64, u64>,
    /// In the VMM arena, free bytes that keep granules mapped: the pinned end granules of
    /// a free shared block, all of a block outside the shared index.
    pub(super) arena_mapped: u64,
}

impl FreeTally {
    /// The tally of the shared index's blocks.
    ///
    /// # Safety
    /// Pool lock held (`sh` is the locked state).
    pub(super) unsafe fn of_shared_index(sh: &Shared) -> FreeTally {
        let mut tally = FreeTally::default();
        // SAFETY: the caller's contract; the indexes' blocks are the pool's.
        unsafe {
            for idx in sh
                .small
                .collect(&BLOCKS)
                .into_iter()
                .chain(sh.large.collect(&BLOCKS))
            {
                tally.add(sh, idx, true);
            }
        }
        tally
    }

    /// Counts the free block `idx`, in the shared index (`shared`) or in a fifo.
    ///
    /// # Safety
    /// Pool lock held (`sh` is the locked state); `idx` is one of its free blocks.
    pub(super) unsafe fn add(&mut self, sh: &Shared, idx: BlockIdx, shared: bool) {
        // SAFETY: the caller's contract.
        let d = unsafe { BLOCKS.get(idx).data() };
        match sh.arena.as_ref().filter(|a| a.contains(d.ptr)) {
            // Blocks outside the shared index pin (and keep mapped) all their granules.
            Some(a) => {
                self.arena_mapped += if shared {
                    a.pinned_bytes(d.ptr, d.size)
                } else {
                    d.size
                }
            }
            None => {
                if let Some((&base, _)) = sh.segments.range(..=d.ptr).next_back() {
                    *self.of_segment.entry(base).or_insert(0) += d.size;
                }
            }
        }
    }
}

/// Free bytes of segments, split by whether the segment also holds blocks not free.
#[derive(Default)]
pub(super) struct SegmentsFree {
    /// In segments that also hold blocks not free (only a merge makes them releasable).
    pub(super) partly_free: u64,
    /// In segments that are one free block, and how many those are.
    pub(super) wholly_free: u64,
    pub(super) wholly_free_count: u64,
}

impl FreeTally {
    /// The tallied segments' free bytes, split by [`SegmentsFree`].
    ///
    /// # Safety
    /// Pool lock held (`sh` is the locked state the tally was made under).
    pub(super) unsafe fn segments(&self, sh: &Shared) -> SegmentsFree {
        let mut split = SegmentsFree::default();
        for (&base, &free) in &self.of_segment {
            // SAFETY: the caller's contract; `base` is a segment of this pool.
            if free >= unsafe { segment_size(sh, base) } {
                split.wholly_free += free;
                split.wholly_free_count += 1;
            } else {
                split.partly_free += free;
            }
        }
        split
    }
}

/// The size of the segment at `base`.
///
/// # Safety
/// Pool lock held; `base` is one of its segments (whose head record is read only for this
/// field, which no other thread writes while the segment exists).
unsafe fn segment_size(sh: &Shared, base: u64) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { BLOCKS.links(sh.segments[&base]).segment_size }
}

/// The statistics [`DevicePool::fragmentation`] derives from the pool's lists.
struct Fragmentation {
    inactive_split: u64,
    pending_fence: u64,
    mapped: CupoolStat,
    segments: u64,
    granules: u64,
}
