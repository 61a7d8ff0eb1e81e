//! Statistics of the pinned (page-locked host memory) pool: the C struct and its printers.
//! A struct of its own, not fields appended to [`super::CupoolStats`]: that one is per
//! device, and pinned memory belongs to no device.

use super::{print, CupoolStat};

/// Version of [`CupoolHostStats`] this library writes. Bumped when fields are added at the
/// end.
pub const CUPOOL_HOST_STATS_VERSION: u32 = 2;

/// Statistics of the pinned host memory pool (`cupool_host_alloc`, and `cudaHostAlloc` /
/// `cudaMallocHost` under the preload).
///
/// The caller sets `size = sizeof(cupool_host_stats)` and
/// `version = CUPOOL_HOST_STATS_VERSION` before the call; the library writes at most `size`
/// bytes.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CupoolHostStats {
    /// `sizeof(cupool_host_stats)` as the caller compiled it.
    pub size: u32,
    /// `CUPOOL_HOST_STATS_VERSION` as the caller compiled it.
    pub version: u32,
    /// Bytes of pinned blocks handed to the program and not yet freed, after rounding to
    /// whole pages.
    pub allocated_bytes: CupoolStat,
    /// Bytes of page-locked memory obtained from the driver and not yet given back.
    pub reserved_bytes: CupoolStat,
    /// Bytes the program asked for, before rounding, of blocks not yet freed.
    pub requested_bytes: CupoolStat,
    /// Chunks (driver allocations) held.
    pub chunks: CupoolStat,
    /// Successful allocations.
    pub num_allocs: u64,
    /// Successful frees.
    pub num_frees: u64,
    /// Allocations served from cached memory without a driver call.
    pub cache_hits: u64,
    /// Allocations that needed a new chunk from the driver.
    pub cache_misses: u64,
    /// Chunks obtained from the driver (`cuMemHostAlloc`).
    pub driver_allocs: u64,
    /// Chunks given back to the driver (`cuMemFreeHost`).
    pub driver_frees: u64,
    /// Context fences recorded to order the reuse of freed blocks (one per context).
    pub fences_recorded: u64,
    /// Allocations that failed at first and were retried after waiting for pending frees
    /// and releasing idle chunks.
    pub alloc_retries: u64,
    /// Allocations that failed with out-of-memory after the retry.
    pub num_ooms: u64,
    /// Bytes freed and waiting for a fence that the pool has not yet seen complete.
    /// Current value only.
    pub pending_fence_bytes: u64,
    /// Queries of those fences (`cuEventQuery`, one per device pool and fence asked).
    pub fence_queries: u64,
}

/// Calls `$m!(name, Kind)` for every field after the header, in struct order (`level`,
/// `count` or `gauge`, as in [`crate::for_each_stat_field!`]).
macro_rules! for_each_host_stat_field {
    ($m:ident) => {
        $m!(allocated_bytes, level);
        $m!(reserved_bytes, level);
        $m!(requested_bytes, level);
        $m!(chunks, level);
        $m!(num_allocs, count);
        $m!(num_frees, count);
        $m!(cache_hits, count);
        $m!(cache_misses, count);
        $m!(driver_allocs, count);
        $m!(driver_frees, count);
        $m!(fences_recorded, count);
        $m!(alloc_retries, count);
        $m!(num_ooms, count);
        $m!(pending_fence_bytes, gauge);
        $m!(fence_queries, count);
    };
}

impl CupoolHostStats {
    /// A struct with the header filled for this library's version.
    pub fn new() -> Self {
        CupoolHostStats {
            size: core::mem::size_of::<CupoolHostStats>() as u32,
            version: CUPOOL_HOST_STATS_VERSION,
            ..Default::default()
        }
    }

    /// JSON object with one key per field; levels are `{"current":..,"peak":..}`.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(512);
        out.push('{');
        macro_rules! field {
            ($f:ident, level) => {
                print::json_level(&mut out, stringify!($f), self.$f);
            };
            ($f:ident, $kind:ident) => {
                print::json_value(&mut out, stringify!($f), self.$f);
            };
        }
        for_each_host_stat_field!(field);
        out.push('}');
        out
    }

    /// Human-readable table, one field per line, in the layout of
    /// [`super::CupoolStats::to_text`].
    pub fn to_text(&self) -> String {
        let mut out = String::with_capacity(1024);
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
        for_each_host_stat_field!(field);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_every_field_once() {
        let mut s = CupoolHostStats::new();
        s.chunks = CupoolStat {
            current: 2,
            peak: 3,
        };
        s.pending_fence_bytes = 4096;
        let json = s.to_json();
        assert!(
            json.contains("\"chunks\":{\"current\":2,\"peak\":3}"),
            "{json}"
        );
        assert!(json.contains("\"pending_fence_bytes\":4096"), "{json}");
        assert_eq!(json.matches("\":").count(), 15 + 4 * 2, "{json}");
        assert_eq!(s.to_text().lines().count(), 15);
    }
}
