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
        s.fences_recorded = slow.fences + self.fence_side.thread_fences.load(Ordering::Relaxed);
        s.cross_stream_frees = slow.cross_stream;
        s.inactive_split_bytes = frag.inactive_split;
        s.pending_fence_bytes = frag.pending_fence;
        s.mapped_bytes = frag.mapped;
        s.segments = frag.segments;
        s.granules = frag.granules;
        s.grow_waits = slow.grow_waits;
        s.grow_wait_us = slow.grow_wait_ns / 1000;
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
}

/// The statistics [`DevicePool::fragmentation`] derives from the pool's lists.
struct Fragmentation {
    inactive_split: u64,
    pending_fence: u64,
    mapped: CupoolStat,
    segments: u64,
    granules: u64,
}
