//! What a replay reports: the report, its sampled series and the times per operation.

use super::FootprintAtPeak;
use crate::trace::Reference;

/// One point of the sampled series: the highest value of each level since the previous
/// point (so a spike between two points still shows), after event `op`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ReplaySample {
    /// Events replayed so far (an index into the trace's events).
    pub op: usize,
    pub requested_bytes: u64,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
}

/// Median and mean of per-operation times, in nanoseconds of the calling thread's CPU
/// time (what the call cost the program; the host backend has no device time).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct OpTimes {
    pub median_ns: u64,
    pub mean_ns: f64,
}

/// What a replay found.
#[derive(Clone, Debug)]
pub struct ReplayReport {
    /// The backend the replay ran on ("host", "cuda").
    pub backend: &'static str,
    /// Events in the trace.
    pub trace_events: usize,
    /// Events looked at (fewer than `trace_events` when `max_events` cut the trace).
    pub events: usize,
    /// Calls made on the pool for events: `allocs + frees`.
    pub ops: u64,
    pub allocs: u64,
    pub frees: u64,
    /// Blocks of the trace's prelude allocated before the first event.
    pub prelude_allocs: u64,
    /// Calls that failed in the traced program (not replayed).
    pub trace_failures: u64,
    /// Allocations that ran out of memory in the replay (their frees are skipped).
    pub ooms: u64,
    /// Frees skipped because their allocation ran out of memory in the replay.
    pub skipped_frees: u64,
    /// Events of no consequence: allocations of 0 bytes and frees of NULL.
    pub skipped_empty: u64,
    /// Streams the replay created for the trace's streams.
    pub streams: usize,
    pub peak_requested_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Peak allocated / peak reserved; `None` when nothing was reserved.
    pub utilization: Option<f64>,
    /// Peak requested / peak reserved; `None` when nothing was reserved.
    pub requested_utilization: Option<f64>,
    /// Segments obtained from the driver during the trace.
    pub device_allocs: u64,
    /// Segments given back to the driver during the trace (the cleanup not counted).
    pub device_frees: u64,
    pub fences: u64,
    /// Queries of those fences (`cuEventQuery`), and fence passes that made the legacy
    /// stream wait for a fence instead (`fence_waits:device`, Note [device waits]).
    pub fence_queries: u64,
    pub fence_device_waits: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub cross_stream_frees: u64,
    pub alloc_retries: u64,
    pub alloc_time: OpTimes,
    pub free_time: OpTimes,
    /// Seconds the events took to replay, prelude and cleanup not counted.
    pub wall_seconds: f64,
    /// VMM granules (2 MiB) mapped and unmapped during the trace (`vmm:on`).
    pub granule_maps: u64,
    pub granule_unmaps: u64,
    /// Driver calls those took (map with its access grant; unmap): each costs tens of µs
    /// on a GPU, whatever its size (Note [arena chunks] in `src/pool/arena/mod.rs`).
    pub map_calls: u64,
    pub unmap_calls: u64,
    /// The driver work of the trace's second half (its events from the middle one on), when
    /// it has two events or more: a training loop's steady state, without the growth of
    /// its first steps, for comparing how much memory a policy moves once warm.
    pub second_half: Option<DriverWork>,
    /// With a simulated GPU lag: microseconds of trace time the program would have spent
    /// waiting for fences (the pool's waits before growing, out-of-memory retries).
    pub simulated_wait_us: u64,
    /// What the traced program's own allocator reserved, when the trace tells.
    pub reference: Option<Reference>,
    pub series: Vec<ReplaySample>,
    /// Where the reserved bytes were after the event that left them highest (`None` when
    /// nothing was reserved).
    pub at_peak: Option<FootprintAtPeak>,
    /// Blocks still live at the end of the trace, freed by the replay.
    pub live_at_end: u64,
    /// Bytes `empty_cache` gave back after those frees.
    pub released_at_end_bytes: u64,
    /// Reserved bytes after that: 0 unless the pool leaks.
    pub reserved_after_empty_cache: u64,
}

/// Driver calls that move device memory, counted over a stretch of a replay.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverWork {
    /// Memory created (`cuMemCreate` with `vmm:on`, `cuMemAlloc` otherwise) and released.
    pub device_allocs: u64,
    pub device_frees: u64,
    /// VMM map (with its access grant) and unmap calls, and the granules they moved.
    pub map_calls: u64,
    pub unmap_calls: u64,
    pub granule_maps: u64,
    pub granule_unmaps: u64,
    /// Of the unmap calls, those the pool's worker thread made (Note [unmaps off the
    /// launching thread]): the rest were the allocating threads'.
    pub worker_unmap_calls: u64,
}

impl DriverWork {
    /// The counts of a pool's statistics and VMM figures read at one moment.
    pub fn of(vmm: &crate::pool::vmm::VmmStats, stats: &crate::stats::CupoolStats) -> Self {
        DriverWork {
            device_allocs: stats.device_allocs,
            device_frees: stats.device_frees,
            map_calls: vmm.map_calls,
            unmap_calls: vmm.unmap_calls,
            granule_maps: vmm.maps,
            granule_unmaps: vmm.unmaps,
            worker_unmap_calls: vmm.deferred_unmap_calls,
        }
    }

    /// The work done between `earlier` and this reading.
    pub fn since(&self, earlier: &DriverWork) -> DriverWork {
        DriverWork {
            device_allocs: self.device_allocs.saturating_sub(earlier.device_allocs),
            device_frees: self.device_frees.saturating_sub(earlier.device_frees),
            map_calls: self.map_calls.saturating_sub(earlier.map_calls),
            unmap_calls: self.unmap_calls.saturating_sub(earlier.unmap_calls),
            granule_maps: self.granule_maps.saturating_sub(earlier.granule_maps),
            granule_unmaps: self.granule_unmaps.saturating_sub(earlier.granule_unmaps),
            worker_unmap_calls: self
                .worker_unmap_calls
                .saturating_sub(earlier.worker_unmap_calls),
        }
    }

    /// Driver calls in all: creations, releases, maps and unmaps.
    pub fn calls(&self) -> u64 {
        self.device_allocs + self.device_frees + self.map_calls + self.unmap_calls
    }
}
