//! Pool statistics: the C struct, how counters are kept cheaply, and one printer for text
//! and JSON.
//!
//! Levels (bytes in use, reserved, ...) are `{current, peak}`; flows (allocations, hits,
//! ...) are monotonic counts; gauges (fragmentation figures, segment counts) are a current
//! value only, computed when the statistics are read (Note [fragmentation stats] in the
//! pool module), so no allocation or free pays for them. The field list is declared once, in `for_each_stat_field!`,
//! and both printers walk it, so text, JSON and the C struct cannot disagree.
//!
//! Note [cheap counters]: the allocation fast path must not touch a shared cache line, so
//! the counters it bumps (allocated/requested bytes, alloc/free counts, hits) live in a
//! per-thread [`ThreadCounters`](crate::pool::counters::ThreadCounters) record that only its thread writes (relaxed load + store,
//! no locked instruction) and that a stats reader sums. The slow path's counters (reserved
//! bytes, device calls, fences, OOMs) change under the device pool lock and live in
//! the pool's `SlowCounts`. Peaks of the summed levels are updated whenever a thread's own
//! contribution reaches a new high (see `ThreadCounters::raise_peak`): exact when one thread
//! allocates, and a lower bound within one thread's swing under concurrency.

pub mod pinned;
pub(crate) mod print;
pub use pinned::{CupoolHostStats, CUPOOL_HOST_STATS_VERSION};

/// Version of [`CupoolStats`] this library writes. Bumped when fields are added at the end.
pub const CUPOOL_STATS_VERSION: u32 = 5;

/// A level: the value now and the highest it has been since the last peak reset.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CupoolStat {
    pub current: u64,
    pub peak: u64,
}

/// Statistics of one device, or of all devices summed (`device = -1`).
///
/// The caller sets `size = sizeof(cupool_stats)` and `version = CUPOOL_STATS_VERSION`
/// before the call; the library writes at most `size` bytes, so a program built against an
/// older, shorter struct keeps working.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CupoolStats {
    /// `sizeof(cupool_stats)` as the caller compiled it.
    pub size: u32,
    /// `CUPOOL_STATS_VERSION` as the caller compiled it.
    pub version: u32,
    /// Bytes of blocks handed to the program and not yet freed, after size rounding.
    pub allocated_bytes: CupoolStat,
    /// Bytes obtained from the driver and not yet given back (the pool's footprint).
    pub reserved_bytes: CupoolStat,
    /// Bytes the program asked for, before rounding, of blocks not yet freed.
    pub requested_bytes: CupoolStat,
    /// Bytes reserved but not handed out: free blocks in the pool, in thread caches, and
    /// freed blocks waiting for their fence.
    pub cached_bytes: CupoolStat,
    /// Successful allocations.
    pub num_allocs: u64,
    /// Successful frees.
    pub num_frees: u64,
    /// Allocations served from cached memory without a driver call.
    pub cache_hits: u64,
    /// Allocations that needed a new segment from the driver.
    pub cache_misses: u64,
    /// Segments obtained from the driver (`cuMemAlloc`).
    pub device_allocs: u64,
    /// Segments given back to the driver (`cuMemFree`).
    pub device_frees: u64,
    /// Allocations that failed at first and were retried after waiting for fences and
    /// releasing idle cached memory.
    pub alloc_retries: u64,
    /// Allocations that failed with out-of-memory after the retry.
    pub num_ooms: u64,
    /// Context fences recorded to order reuse after frees.
    pub fences_recorded: u64,
    /// Frees whose stream differed from the allocation's stream (made safe by a fence).
    pub cross_stream_frees: u64,
    // ---- version 2
    /// Bytes of free blocks held by the pool in segments that cannot go back to the driver
    /// because they also hold blocks in use (allocated or in a thread cache): free but not
    /// releasable. In the VMM arena: free bytes of mapped granules that a block not free
    /// in the shared index also touches. Current value only.
    pub inactive_split_bytes: u64,
    /// Bytes freed and waiting for a context fence the pool has not yet seen complete:
    /// blocks freed without a stream or on a foreign stream (nobody may take them yet) and
    /// blocks freed on a stream (only that stream may take them yet). Blocks a thread keeps
    /// after freeing them without a stream count until their fence completes (Note [thread
    /// fences]); blocks in the threads' stream-ordered caches do not. Current value only.
    pub pending_fence_bytes: u64,
    /// Bytes of the VMM arena mapped to physical memory (0 with `vmm:off`).
    pub mapped_bytes: CupoolStat,
    /// Segments held now (driver allocations; the VMM arena counts as one).
    pub segments: u64,
    /// Granules of the VMM arena mapped now.
    pub granules: u64,
    // ---- version 3
    /// Misses that waited for the device to finish work on freed blocks instead of taking
    /// more memory from the driver (`grow_wait_us`, Note [wait before growing]).
    pub grow_waits: u64,
    /// Microseconds the program spent in those waits, in all.
    pub grow_wait_us: u64,
    /// Queries of context fences (`cuEventQuery`): with `fences_recorded`, the driver calls
    /// that ordering reuse after frees cost.
    pub fence_queries: u64,
    // ---- version 5
    /// Fence passes that made the legacy stream wait for a fence not yet complete, so that
    /// the blocks it covers were reused at once (`fence_waits`, Note [device waits]).
    pub fence_device_waits: u64,
}

/// Calls `$m!(name, Kind)` for every field after the header, in struct order.
/// `Kind` is `level` (a [`CupoolStat`]), `count` (monotonic) or `gauge` (a current value
/// with no peak).
#[macro_export]
macro_rules! for_each_stat_field {
    ($m:ident) => {
        $m!(allocated_bytes, level);
        $m!(reserved_bytes, level);
        $m!(requested_bytes, level);
        $m!(cached_bytes, level);
        $m!(num_allocs, count);
        $m!(num_frees, count);
        $m!(cache_hits, count);
        $m!(cache_misses, count);
        $m!(device_allocs, count);
        $m!(device_frees, count);
        $m!(alloc_retries, count);
        $m!(num_ooms, count);
        $m!(fences_recorded, count);
        $m!(cross_stream_frees, count);
        $m!(inactive_split_bytes, gauge);
        $m!(pending_fence_bytes, gauge);
        $m!(mapped_bytes, level);
        $m!(segments, gauge);
        $m!(granules, gauge);
        $m!(grow_waits, count);
        $m!(grow_wait_us, count);
        $m!(fence_queries, count);
        $m!(fence_device_waits, count);
    };
}

impl CupoolStats {
    /// A struct with the header filled for this library's version.
    pub fn new() -> Self {
        CupoolStats {
            size: core::mem::size_of::<CupoolStats>() as u32,
            version: CUPOOL_STATS_VERSION,
            ..Default::default()
        }
    }

    /// Adds another device's figures (for the all-devices sum).
    pub fn accumulate(&mut self, other: &CupoolStats) {
        macro_rules! add {
            ($f:ident, level) => {
                self.$f.current += other.$f.current;
                self.$f.peak += other.$f.peak;
            };
            ($f:ident, $kind:ident) => {
                self.$f += other.$f;
            };
        }
        for_each_stat_field!(add);
    }

    /// JSON object with one key per field; levels are `{"current":..,"peak":..}`.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(896);
        out.push('{');
        macro_rules! field {
            ($f:ident, level) => {
                print::json_level(&mut out, stringify!($f), self.$f);
            };
            ($f:ident, $kind:ident) => {
                print::json_value(&mut out, stringify!($f), self.$f);
            };
        }
        for_each_stat_field!(field);
        out.push('}');
        out
    }

    /// Human-readable table, one field per line.
    pub fn to_text(&self) -> String {
        let mut out = String::with_capacity(1536);
        macro_rules! field {
            ($f:ident, level) => {
                print::text_level(&mut out, stringify!($f), self.$f);
            };
            ($f:ident, count) => {
                print::text_count(&mut out, stringify!($f), self.$f);
            };
            ($f:ident, gauge) => {
                print::text_gauge(&mut out, stringify!($f), self.$f);
            };
        }
        for_each_stat_field!(field);
        out
    }
}
